-- TAKE_OVER: GETSET, made safe. The classic recipe GETSETs blindly and compares the old value
-- afterwards, so a loser has already overwritten the winner's value (the winner's token with it).
-- Here the comparison comes first, in the same step: only a contender that still sees the expired
-- lease it read (ARGV[9] is its fence) writes. A key that vanished in between (the recipe's
-- "GETSET returned nil") is free, and the contender wins it.
--
-- Joined after lib/prelude.lua and lib/grant.lua. Its call: `TakeOver` in scripts/grant.rs.
-- KEYS and ARGV[1..8] as CLAIM's; ARGV[9]: the fence of the expired lease seen.
-- Replies as CLAIM's.
local now = now_us()
local held = checked(now, KEYS[3])
if held then return held end
local cur = redis.call('HMGET', KEYS[1], 'fence', 'expires_at')
if cur[1] then
  if cur[1] ~= ARGV[9] then return {0} end
  if tonumber(cur[2]) > math.floor(now / 1000) then return {0} end
end
return grant(now)
