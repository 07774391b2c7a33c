-- RESTORE_POOLED: RESTORE (restore.lua) for a shared lease or a semaphore permit.
--
-- Its call: `Replicas::confirm_renew` in replicas.rs.
-- KEYS: pool, its ends.
-- ARGV: as restore.lua's.
-- Replies 1 restored, 0 nothing to do.
local pool, token, expires = KEYS[1], ARGV[1], ARGV[2]
local rec = redis.call('HGET', pool, token)
if not rec then return 0 end
local f, e, t, rest = string.match(rec, '^(%d+)|(%d+)|(%d+)|(.*)$')
if e ~= ARGV[7] then return 0 end
redis.call('HSET', pool, token, f .. '|' .. expires .. '|' .. ARGV[3] .. '|' .. rest)
redis.call('ZADD', KEYS[2], expires, token)
redis.call('PUBLISH', ARGV[5], ARGV[6])
return 1
