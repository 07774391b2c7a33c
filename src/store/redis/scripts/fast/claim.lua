-- CLAIM's fast path: the lock cycle's common case — a free key (no lease record: an expired
-- one is taken over as claim.lua says) that nobody queues for, watches, shares, or keeps a fence
-- counter for — granted in five calls, before the queue's helpers are even defined (defining
-- them costs as much as a call). Anything else falls through to claim.lua, which reuses `now` and the epoch
-- check from here.
--
-- Why the grant needs no counter here: every fence a key ever had is in its fence counter, in a
-- live record (this lease hash, a pool's records), or below Redis's clock — a script that drops
-- a record whose fence is not below the clock raises the counter to it first (`kept_fence`,
-- lib/queue.lua). So with no counter, no pool and no lease record, Redis's clock in µs is above
-- every fence granted before (as long as it does not step back while nothing holds the key).
--
-- Joined after lib/prelude.lua and lib/grant.lua. KEYS and ARGV: CLAIM's (claim.lua).
local now = now_us()
local held = checked(now, KEYS[3], ARGV[5])
if held then return held end
if redis.call('EXISTS', KEYS[1], KEYS[6], KEYS[5], KEYS[8], KEYS[2]) == 0 then
  local now_ms = math.floor(now / 1000)
  local ttl = tonumber(ARGV[2])
  local expires = now_ms + ttl
  -- Numbers go to redis.call as they are: Redis writes them with 17 significant digits, exact
  -- for these integers (below 2^53), and cheaper than formatting them in Lua.
  redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', now, 'expires_at', expires, 'ttl', ARGV[2],
    'granted_at', now_ms, 'by', ARGV[9])
  if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'owner', string.sub(ARGV[3], 2)) end
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'request_id', ARGV[6]) end
  redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[4]))
  return {1, now, expires, ARGV[1], ttl, now_ms}
end
