-- CLAIM: SETNX. Checking for the key and writing it are one step, so two claims cannot both see
-- it free. A key that holds the live lease an earlier acquire with the same request id produced
-- answers that lease again (a client repeating an acquire whose answer it lost).
--
-- Joined after lib/prelude.lua and lib/grant.lua. Its call: `Claim` in scripts/grant.rs.
-- KEYS: lock, fence counter, epoch marker, shared pool, its ends, intents.
-- ARGV: token, ttl_ms, has_owner ('1'/'0'), owner, slack_ms, the epoch this broker knows,
--       request_id ('' for none), waits ('1'/'0').
-- Replies: {1, fence, expires_at, token, ttl, now} granted; {0} refused; {2, hold_until, now,
-- reason} a store-wide hold is in force; {3, epoch} the store is in another epoch than the
-- broker knows: it must catch up (put its leases back) before it may grant.
local now = now_us()
local held = checked(now, KEYS[3])
if held then return held end
local cur = redis.call('HMGET', KEYS[1], 'token', 'fence', 'expires_at', 'ttl', 'request_id')
if cur[1] then
  if ARGV[7] ~= '' and cur[5] == ARGV[7] and tonumber(cur[3]) > math.floor(now / 1000) then
    return {1, cur[2], cur[3], cur[1], cur[4], math.floor(now / 1000)}
  end
  return {0}
end
return grant(now)
