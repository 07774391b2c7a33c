-- RELEASE: ends the token's live lease. Publishes the notice key and the released lease's fence
-- on the channel, so every broker's waiters for it wake at once instead of polling, and the
-- broker that granted it (which may not be this one) drops it from its ledger.
--
-- Joined after lib/prelude.lua, lib/pools.lua and lib/holder.lua. Its call: `Release` in
-- scripts/holder.rs.
-- KEYS: as lib/holder.lua's.
-- ARGV: token, notice channel, notice key (the client key; `#` and the key for a semaphore).
-- Replies {1, held_ms}; {0} not held, {2} not the token's; or {3, hold_until, now, reason}.
local now = math.floor(now_us() / 1000)
local h, hold, reason = holder(now)
if h == 3 then return {3, hold, now, reason} end
if h == 4 then
  local f, _, _, g = record(reason)
  leave_pool(reason)
  redis.call('PUBLISH', ARGV[2], ARGV[3] .. ' ' .. int(f))
  return {1, math.max(0, now - g)}
end
if h ~= 1 then return {h} end
local v = redis.call('HMGET', KEYS[1], 'granted_at', 'fence')
local granted = tonumber(v[1] or now)
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], ARGV[3] .. ' ' .. v[2])
return {1, math.max(0, now - granted)}
