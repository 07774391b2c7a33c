-- RELEASE: ends the token's live lease, and hands the key on to the queue's head in the same
-- step. The brokers that remember the lease in their ledgers, other than this one, are told
-- (see `ended`).
--
-- Joined after lib/prelude.lua, lib/keys.lua, fast/release.lua (whose `now` it goes on from),
-- lib/pools.lua, lib/grant.lua, lib/queue.lua and lib/holder.lua. Its call: `Release` in
-- scripts/holder.rs.
-- KEYS: as lib/keys.lua's. ARGV: as `holder_context`'s.
-- Replies (codes named in lib/prelude.lua) {HELD, held_ms, fence} — followed, when the key went
-- straight to a bid of the caller's own broker (its context's kind `g`, see `hand_on`), by that
-- grant: its token, fence, expires_at, ttl, Redis's clock, request_id ('' for none) and owner
-- ('' or '=' and the label); {NOT_HELD}, {NOT_OWNER}; or
-- {HOLD_IN_FORCE, hold_until, now, reason}.
local c = holder_context(now)
-- The reply of a release, and the grant `hand_on` made to the caller's own bid, if one.
local function released(held_ms, fence)
  local reply = {HELD, held_ms, fence}
  for _, v in ipairs(c.handed or {}) do reply[#reply + 1] = v end
  return reply
end
local h, hold, reason = holder(c.now_ms, lease)
if h == HOLD_IN_FORCE then return {HOLD_IN_FORCE, hold, c.now_ms, reason} end
if h == HELD_POOLED then
  local f, _, _, g = record(reason)
  local by = redis.call('HGET', POOL, '@' .. c.token)
  drop_holder(POOL, ENDS, c.token)
  ended(c, by, f, false)
  hand_on(c, nil)
  return released(math.max(0, c.now_ms - g), f)
end
if h ~= HELD then return {h} end
local granted_at, fence, by = lease[6], lease[5], lease[4]
kept_fence(FENCE, fence, c.now)
redis.call('DEL', LOCK)
c.freed = true
ended(c, by, tonumber(fence), false)
hand_on(c, nil)
return released(math.max(0, c.now_ms - tonumber(granted_at or c.now_ms)), tonumber(fence))
