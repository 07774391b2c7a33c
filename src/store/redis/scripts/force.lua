-- FORCE: ends every live lease on a key without its token. Publishes the notice key, the highest
-- fence ended and `*` (every lease up to that fence is over).
--
-- Joined after lib/prelude.lua and lib/pools.lua. Its call: `Force` in scripts/holder.rs.
-- KEYS: as lib/holder.lua's. ARGV: notice channel, notice key.
-- Replies {1, fences...} (none: nothing was live), or {3, hold_until, now, reason} while a
-- store-wide hold is in force.
local now = math.floor(now_us() / 1000)
local id, hold, reason = epoch(KEYS[2])
if not id then return {3, 0, now, 'settle'} end
if now < hold then return {3, hold, now, reason} end
local out = {1}
local top = 0
if KEYS[1] ~= KEYS[3] then
  local cur = redis.call('HMGET', KEYS[1], 'fence', 'expires_at')
  if cur[1] and tonumber(cur[2]) > now then
    out[#out + 1] = tonumber(cur[1])
    top = tonumber(cur[1])
  end
  redis.call('DEL', KEYS[1])
end
local live = holders(KEYS[3], KEYS[4], now)
for i = 2, #live, 6 do
  out[#out + 1] = live[i]
  if live[i] > top then top = live[i] end
end
redis.call('DEL', KEYS[3], KEYS[4])
if top > 0 then redis.call('PUBLISH', ARGV[1], ARGV[2] .. ' ' .. int(top) .. ' *') end
return out
