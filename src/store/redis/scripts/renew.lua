-- RENEW: moves the end of the token's live lease to ttl_ms from now. A renew that makes the
-- lease end sooner publishes a notice too: waiters timed for the old expiry would oversleep.
--
-- Joined after lib/prelude.lua, lib/pools.lua and lib/holder.lua. Its call: `Renew` in
-- scripts/holder.rs.
-- KEYS: as lib/holder.lua's.
-- ARGV: token, ttl_ms, slack_ms, notice channel, notice key.
-- Replies {1, fence, expires_at, owner, epoch} for the exclusive lease, {4, fence, expires_at,
-- owner, epoch, limit} for a pool lease (the semaphore's limit, or '' for a shared lease); {0}
-- not held, {2} not the token's; or {3, hold_until, now, reason}. The epoch lets the broker tell
-- a renewal that raced a loss (see `RedisStore::remember`).
local now = math.floor(now_us() / 1000)
local h, expires, reason = holder(now)
if h == 3 then return {3, expires, now, reason} end
local ttl = tonumber(ARGV[2])
if h == 4 then
  local f, _, _, g, r, o = record(reason)
  redis.call('HSET', KEYS[3], ARGV[1], int(f) .. '|' .. int(now + ttl) .. '|' .. int(ttl) .. '|' .. int(g) .. '|' .. r .. '|' .. o)
  redis.call('ZADD', KEYS[4], int(now + ttl), ARGV[1])
  if now + ttl < expires then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
  keep(KEYS[3], ttl + tonumber(ARGV[3]))
  keep(KEYS[4], ttl + tonumber(ARGV[3]))
  return {4, f, now + ttl, (o ~= '' and string.sub(o, 2)) or false, redis.call('HGET', KEYS[2], 'id') or '', redis.call('HGET', KEYS[3], '#limit') or ''}
end
if h ~= 1 then return {h} end
redis.call('HSET', KEYS[1], 'expires_at', int(now + ttl), 'ttl', int(ttl))
if now + ttl < expires then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[3]))
local v = redis.call('HMGET', KEYS[1], 'fence', 'owner')
return {1, v[1], now + ttl, v[2] or false, redis.call('HGET', KEYS[2], 'id') or ''}
