-- Shared head of every script but MARK and REPAIR (joined in front of it at build time, see
-- `scripts/mod.rs`).
--
-- `TIME` in a script that then writes needs effects replication: the default since Redis 5 and
-- the only mode since 7; `replicate_commands` turns it on for older servers.
--
-- Numbers are formatted with `%.0f` before they are written, because Lua hands `redis.call`
-- numbers as `%.14g`, which would round a 16-digit fence.
if redis.replicate_commands then redis.replicate_commands() end
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function int(n) return string.format('%.0f', n) end
local function epoch(marker)
  local m = redis.call('HMGET', marker, 'id', 'hold_until', 'reason')
  return m[1], tonumber(m[2] or '0'), m[3] or ''
end
