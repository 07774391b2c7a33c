-- Holder check shared by RELEASE and RENEW. KEYS: as lib/keys.lua's; ARGV[1]: the token.
--
-- `holder` answers HELD the exclusive lease is ARGV[1]'s (with its expiry), HELD_POOLED a pool
-- lease is (with its expiry and record), NOT_HELD (absent or expired), NOT_OWNER held by another
-- token; HOLD_IN_FORCE — with the hold's end and reason — instead of NOT_HELD or NOT_OWNER while
-- a store-wide hold is in force or the store has no epoch at all (just emptied): leases are being
-- put back, so the key may be about to hold this token's lease again, or lose another's put back
-- by mistake, and "not held" or "not yours" would be a guess. An offer not taken is not its
-- token's lease yet (nobody outside the broker knows the token): it answers as another's live
-- lease.
--
-- The check and the write are one step: the classic GET-then-DEL lets a client whose lease
-- expired between the two delete its successor's lease.
-- `cur`: the exclusive lease's token, expires_at and offered (then anything), if the caller has
-- read them already; `token`: the token asked about, if not ARGV[1] (KEEP asks for many).
local function holder(now_ms, cur, token)
  token = token or ARGV[1]
  if not cur then
    cur = {}
    if EXCL then cur = redis.call('HMGET', LOCK, 'token', 'expires_at', 'offered') end
  end
  if cur[1] == token and tonumber(cur[2]) > now_ms and cur[3] ~= '1' then return HELD, tonumber(cur[2]) end
  local rec = redis.call('HGET', POOL, token)
  if rec and redis.call('HEXISTS', POOL, '!' .. token) == 0 then
    local _, e = record(rec)
    if e > now_ms then return HELD_POOLED, e, rec end
  end
  local id, hold, reason = epoch(MARKER)
  if not id then return HOLD_IN_FORCE, 0, 'settle' end
  if now_ms < hold then return HOLD_IN_FORCE, hold, reason end
  local exclusive = cur[1] and tonumber(cur[2]) > now_ms
  if (not exclusive) and live_count(ENDS, now_ms) == 0 then return NOT_HELD end
  return NOT_OWNER
end
