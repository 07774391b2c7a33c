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
local lock, token, expires = KEYS[1], ARGV[1], ARGV[2]
local cur = redis.call('HMGET', lock, 'token', 'expires_at')
if cur[1] ~= token or cur[2] ~= ARGV[7] then return 0 end
redis.call('HSET', lock, 'expires_at', expires, 'ttl', ARGV[3])
redis.call('PEXPIREAT', lock, string.format('%.0f', tonumber(expires) + tonumber(ARGV[4])))
redis.call('PUBLISH', ARGV[5], ARGV[6])
return 1
