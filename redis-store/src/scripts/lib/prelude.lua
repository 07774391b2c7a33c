-- Shared head of every script but MARK and REPAIR (joined in front of it at build time, see
-- `scripts/mod.rs`), and the top of the function library: helpers, and the constants both sides
-- of the boundary agree on. Nothing here runs a command: a library's top runs once, when it is
-- loaded, where only the functions are registered.
--
-- Numbers are formatted by `int` before they are written, because Lua hands `redis.call`
-- numbers as `%.14g`, which would round a 16-digit fence: a whole number (every one the scripts
-- write: fences, ms, counts) with `%d`, a 64-bit integer's formatting; anything else rounded with
-- `%.0f`, a floating-point one that costs Redis several times as much.
--
-- LAYOUT: the version of what this broker keeps in Redis (the broker's `STORE_LAYOUT`; a unit
-- test checks that the two agree). The epoch marker's `layout` field records the newest layout a
-- broker on the store runs; a granting script refuses to grant on a marker of a newer layout.
local LAYOUT = 2
-- How long a key outlives the lease (or the wait) that last set its expiry, ms: the broker's
-- `EXPIRY_SLACK_MS` (a unit test checks that the two agree).
local SLACK = 60000
-- Reply codes: the first field of a script's reply, by name. The broker's side is in
-- scripts/codes.rs (`GrantCode`, `HolderCode`, `PutBackCode`); a unit test checks that every code
-- below is there with the same number, and every code there is here. Plain locals, not a table:
-- a table would be built anew at every call, a local is one load.
-- Reply codes begin.
-- The granting scripts (CLAIM, TAKE_OVER, JOIN; `checked` answers the three codes it checks):
local REFUSED = 0
local GRANTED = 1
local ON_HOLD = 2
local OTHER_EPOCH = 3
local NO_ROOM = 4
local OTHER_LIMIT = 5
local NEWER_LAYOUT = 6
local QUEUED = 7
-- The holder scripts (RELEASE, RENEW, FORCE; `holder` in lib/holder.lua answers the same):
-- HELD is the token's exclusive lease (FORCE: the live leases ended), HELD_POOLED its pool lease.
local NOT_HELD = 0
local HELD = 1
local NOT_OWNER = 2
local HOLD_IN_FORCE = 3
local HELD_POOLED = 4
-- PUT_BACK, one per lease, or EPOCH_MOVED alone:
local ALREADY_THERE = 0
local WRITTEN = 1
local OTHER_KEPT = 2
local OTHER_REPLACED = 3
local EPOCH_MOVED = -1
-- BATCH, for one operation: not the common case; run it alone.
local SLOW = -2
-- Reply codes end.
-- Redis's clock in µs, and as TIME answers it ({seconds, microseconds}, strings).
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2]), t
end
local function int(n)
  if n % 1 == 0 then return string.format('%d', n) end
  return string.format('%.0f', n)
end
local function epoch(marker)
  local m = redis.call('HMGET', marker, 'id', 'hold_until', 'reason', 'layout')
  return m[1], tonumber(m[2] or '0'), m[3] or '', tonumber(m[4] or '0') or 0
end
