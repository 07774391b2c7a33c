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
-- Joined after lib/prelude.lua, lib/grant.lua and lib/keys.lua (the KEYS by name). KEYS and
-- ARGV: CLAIM's (claim.lua); the ARGV read here by name (`grant_context` in lib/queue.lua reads
-- them for the slow path).
local TOKEN, TTL, OWNER, KNOWN, REQUEST_ID, BROKER = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local now, time = now_us()
local held = checked(now, MARKER, KNOWN)
if held then return held end
if redis.call('EXISTS', LOCK, QUEUE, ENDS, WATCHED, FENCE) == 0 then
  local now_ms = math.floor(now / 1000)
  local ttl = tonumber(TTL)
  local expires = now_ms + ttl
  -- The clock's µs and ms as text, cut from TIME's answer: formatting a number costs Redis
  -- more than the rest of the grant's Lua. (Numbers handed to redis.call as they are, as the
  -- expiry is, are written exactly: with 17 significant digits.)
  local us = string.rep('0', 6 - #time[2]) .. time[2]
  redis.call('HSET', LOCK, 'token', TOKEN, 'fence', time[1] .. us, 'expires_at', expires,
    'ttl', TTL, 'granted_at', time[1] .. string.sub(us, 1, 3), 'by', BROKER)
  if OWNER ~= '' then redis.call('HSET', LOCK, 'owner', string.sub(OWNER, 2)) end
  if REQUEST_ID ~= '' then redis.call('HSET', LOCK, 'request_id', REQUEST_ID) end
  redis.call('PEXPIRE', LOCK, ttl + SLACK)
  return {GRANTED, now, expires, TOKEN, ttl, now_ms}
end
