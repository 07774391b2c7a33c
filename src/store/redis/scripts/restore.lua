-- RESTORE: puts back the end of an exclusive lease that a renewal moved, when the replicas did
-- not acknowledge that renewal, if it is still that token's lease as the renewal left it (a
-- later renewal, answered, is left alone). The notice wakes waiters that timed their wait for
-- the longer lease.
--
-- Its call: `Replicas::confirm_renew` in replicas.rs.
-- KEYS: lock.
-- ARGV: token, expires_at to restore, its ttl, slack_ms, notice channel, client key, the
-- renewal's expires_at.
-- Replies 1 restored, 0 nothing to do.
local cur = redis.call('HMGET', KEYS[1], 'token', 'expires_at')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[7] then return 0 end
redis.call('HSET', KEYS[1], 'expires_at', ARGV[2], 'ttl', ARGV[3])
redis.call('PEXPIREAT', KEYS[1], string.format('%.0f', tonumber(ARGV[2]) + tonumber(ARGV[4])))
redis.call('PUBLISH', ARGV[5], ARGV[6])
return 1
