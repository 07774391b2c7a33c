-- FORCE: ends every live lease on a key without its token — offers not taken included — and
-- hands the key on to the queue's head in the same step. Each broker that remembers an ended
-- lease is told once, with the highest fence it remembered there (every lease on the key up to
-- it is over; see `ended`).
--
-- Joined after lib/prelude.lua, lib/pools.lua, lib/grant.lua, lib/keys.lua, lib/queue.lua and
-- lib/holder.lua. Its call: `Force` in scripts/holder.rs.
-- KEYS: as lib/keys.lua's. ARGV: as `holder_context`'s (no token).
-- Replies {HELD, fences...} (none: nothing was live), or {HOLD_IN_FORCE, hold_until, now, reason}
-- while a store-wide hold is in force.
local now = now_us()
local c = holder_context(now)
local id, hold, reason = epoch(MARKER)
if not id then return {HOLD_IN_FORCE, 0, c.now_ms, 'settle'} end
if c.now_ms < hold then return {HOLD_IN_FORCE, hold, c.now_ms, reason} end
local out = {HELD}
-- The highest fence ended per broker told; '' for the shared channel.
local tops = {}
local function note(by, fence)
  if (not by) or by == '*' then by = '' end
  local list = {}
  if by == '' then list = {''} else for b in string.gmatch(by, '[^,]+') do list[#list + 1] = b end end
  for _, b in ipairs(list) do
    if (tops[b] or 0) < fence then tops[b] = fence end
  end
end
if EXCL then
  local cur = redis.call('HMGET', LOCK, 'fence', 'expires_at', 'by')
  if cur[1] and tonumber(cur[2]) > c.now_ms then
    out[#out + 1] = tonumber(cur[1])
    note(cur[3], tonumber(cur[1]))
  end
  kept_fence(FENCE, cur[1], c.now)
  redis.call('DEL', LOCK)
end
local live = holders(POOL, ENDS, c.now_ms)
for i = 1, #live, 6 do
  out[#out + 1] = live[i + 1]
  note(redis.call('HGET', POOL, '@' .. live[i]), live[i + 1])
end
-- A semaphore's pool is its only key: its queue is not in it.
redis.call('DEL', POOL, ENDS)
for b, top in pairs(tops) do
  if b == '' then ended(c, nil, top, true) else ended(c, b, top, true) end
end
hand_on(c, nil)
return out
