-- MARK (cluster): copies a master's epoch to another slot's marker. Call: `Mark` (scripts/epoch.rs).
-- KEYS: the slot's marker. ARGV: id, run_id, hold_until, reason, layout (the master's marker's,
-- never lowered). Replies 1.
local marker, id = KEYS[1], ARGV[1]
local m = redis.call('HMGET', marker, 'id', 'layout')
local layout = math.max(tonumber(m[2] or '0') or 0, tonumber(ARGV[5]))
if m[1] ~= id then
  redis.call('HSET', marker, 'id', id, 'run_id', ARGV[2], 'hold_until', ARGV[3], 'reason', ARGV[4], 'layout', layout)
elseif layout ~= tonumber(m[2] or '0') then
  redis.call('HSET', marker, 'layout', layout)
end
return 1
