-- Shared head of every script but MARK and REPAIR (joined in front of it at build time, see
-- `scripts/mod.rs`).
--
-- `TIME` in a script that then writes needs effects replication: the default since Redis 5 and
-- the only mode since 7; `replicate_commands` turns it on for older servers.
--
-- Numbers are formatted with `%.0f` before they are written, because Lua hands `redis.call`
-- numbers as `%.14g`, which would round a 16-digit fence.
--
-- LAYOUT: the version of what this broker keeps in Redis (the broker's `STORE_LAYOUT`; a unit
-- test checks that the two agree). The epoch marker's `layout` field records the newest layout a
-- broker on the store runs; a granting script refuses to grant on a marker of a newer layout.
if redis.replicate_commands then redis.replicate_commands() end
local LAYOUT = 2
-- How long a key outlives the lease (or the wait) that last set its expiry, ms: the broker's
-- `EXPIRY_SLACK_MS` (a unit test checks that the two agree).
local SLACK = 60000
-- Redis's clock in µs, and as TIME answers it ({seconds, microseconds}, strings).
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2]), t
end
local function int(n) return string.format('%.0f', n) end
local function epoch(marker)
  local m = redis.call('HMGET', marker, 'id', 'hold_until', 'reason', 'layout')
  return m[1], tonumber(m[2] or '0'), m[3] or '', tonumber(m[4] or '0') or 0
end
