-- LEAVE: a queued bid stops waiting. Its queue entry goes; an offer made to it and not taken
-- ends, and the key is handed on to the next in line in the same step. A lease its token holds
-- (a taken offer, a grant) is left alone. A queued bid that leaves is handed on after too: an
-- exclusive bid at the head may have been all that held the shared bids behind it back.
--
-- Joined after lib/prelude.lua, lib/pools.lua, lib/grant.lua, lib/keys.lua and lib/queue.lua.
-- Its call: `Leave` in scripts/holder.rs.
-- KEYS: as lib/keys.lua's. ARGV: as `holder_context`'s.
-- Replies 1 if an offer ended, else 0 (a boolean, not a reply code).
local token = ARGV[1]
local now = now_us()
local queued = redis.call('ZREM', QUEUE, token) == 1
if queued then redis.call('HDEL', BIDS, token) end
local offer = false
if EXCL then
  local v = redis.call('HMGET', LOCK, 'token', 'offered', 'fence')
  if v[1] == token and v[2] == '1' then
    kept_fence(FENCE, v[3], now)
    redis.call('DEL', LOCK)
    offer = true
  end
end
if (not offer) and redis.call('HEXISTS', POOL, '!' .. token) == 1 then
  drop_holder(POOL, ENDS, token)
  offer = true
end
if offer or queued then
  local c = holder_context(now)
  if offer then changed(c) end
  hand_on(c, nil)
end
if offer then return 1 end
return 0
