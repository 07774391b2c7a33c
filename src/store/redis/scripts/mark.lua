-- MARK (cluster): copies a master's epoch to another slot's marker. Call: `Mark` (scripts/epoch.rs).
-- KEYS: the slot's marker. ARGV: id, run_id, hold_until, reason. Replies 1.
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then
  redis.call('HSET', KEYS[1], 'id', ARGV[1], 'run_id', ARGV[2], 'hold_until', ARGV[3], 'reason', ARGV[4])
end
return 1
