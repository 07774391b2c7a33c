-- REPAIR (cluster): gives back a slot its marker, lost on its own (deleted or evicted), in its
-- master's epoch with a hold, and announces it. Call: `Repair` (scripts/epoch.rs).
-- KEYS: the slot's marker. ARGV: id, hold_ms, notice channel, announcement, layout.
-- Replies 1 if it wrote the marker, 0 if one was there.
local marker = KEYS[1]
if redis.call('EXISTS', marker) == 1 then return 0 end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', marker, 'id', ARGV[1], 'run_id', '', 'hold_until', string.format('%.0f', now_ms + tonumber(ARGV[2])), 'reason', 'loss', 'layout', ARGV[5])
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
