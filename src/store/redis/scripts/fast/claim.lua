-- CLAIM's fast path: the lock cycle's common case — a free key (no lease record: an expired
-- one is taken over as claim.lua says) that nobody queues for, watches, shares, or keeps a fence
-- counter for — granted in five calls, before the queue's helpers are even defined (defining
-- them costs as much as a call). Anything else falls through to claim.lua, which reuses `now` and the epoch
-- check from here.
--
-- Why the grant needs no counter here: every fence a key ever had is in its fence counter, in a
-- live record (this lease hash, a pool's records), or below Redis's clock — a script that drops
-- a record whose fence is not below the clock raises the counter to it first (`kept_fence`,
-- lib/grant.lua). So with no counter, no pool and no lease record, Redis's clock in µs is above
-- every fence granted before (as long as it does not step back while nothing holds the key).
--
-- Joined after lib/prelude.lua and lib/grant.lua. KEYS and ARGV: CLAIM's (claim.lua).
local now, time = now_us()
local held = checked(now, KEYS[3], ARGV[4])
if held then return held end
if redis.call('EXISTS', KEYS[1], KEYS[6], KEYS[5], KEYS[8], KEYS[2]) == 0 then
  local now_ms = math.floor(now / 1000)
  local ttl = tonumber(ARGV[2])
  local expires = now_ms + ttl
  -- The clock's µs and ms as text, cut from TIME's answer: formatting a number costs Redis
  -- more than the rest of the grant's Lua. (Numbers handed to redis.call as they are, as the
  -- expiry is, are written exactly: with 17 significant digits.)
  local us = string.rep('0', 6 - #time[2]) .. time[2]
  redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', time[1] .. us, 'expires_at', expires,
    'ttl', ARGV[2], 'granted_at', time[1] .. string.sub(us, 1, 3), 'by', ARGV[6])
  if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'owner', string.sub(ARGV[3], 2)) end
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'request_id', ARGV[5]) end
  redis.call('PEXPIRE', KEYS[1], ttl + SLACK)
  return {1, now, expires, ARGV[1], ttl, now_ms}
end
