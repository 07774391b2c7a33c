-- CHECK: the epoch check, run on every new connection before it is used, once a second, and
-- when another broker announces a new epoch.
--
-- The server process is read here (`INFO server`'s `run_id`), in the same step as the marker and
-- so on the very server that holds it: on a cluster, a keyless `INFO` sent separately can reach
-- another node while the cluster's slots move.
--
-- A new epoch begins — with a store-wide hold of store_settle_ms, announced on the channel — when
-- the marker is missing (a new store, or one emptied by a restart without persistence or a flush)
-- or was written on another server process (a restart from disk that may have lost its last
-- writes, a replica promoted that may have missed some). A broker that knew another epoch than
-- the current one has seen a loss: the reason becomes `loss`, and the optional paranoid
-- store_loss_delay_ms stretches the hold to that long after the epoch began.
--
-- The marker's `layout` is raised to this broker's LAYOUT (never lowered): it records the newest
-- layout a broker on the store runs, and a broker of an older one that knows the field refuses
-- to grant beside it.
--
-- Joined after lib/prelude.lua. Its call: `Check` in scripts/epoch.rs.
-- KEYS: epoch marker.
-- ARGV: the epoch this broker knows ('' if none), store_settle_ms, store_loss_delay_ms, notice
--       channel.
-- Replies {id, hold_until, now, reason, run_id, layout}.
local marker, known = KEYS[1], ARGV[1]
local now = now_us()
local now_ms = math.floor(now / 1000)
local server = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
local m = redis.call('HMGET', marker, 'id', 'run_id', 'hold_until', 'reason', 'layout')
local id, run, hold, reason = m[1], m[2], tonumber(m[3] or '0'), m[4] or ''
local layout = tonumber(m[5] or '0') or 0
if (not id) or run ~= server then
  if id or known ~= '' then reason = 'loss' else reason = 'settle' end
  id = int(now)
  hold = math.max(hold, now_ms + tonumber(ARGV[2]))
  redis.call('HSET', marker, 'id', id, 'run_id', server, 'hold_until', int(hold), 'reason', reason)
  redis.call('PUBLISH', ARGV[4], '!epoch')
end
if layout < LAYOUT then
  layout = LAYOUT
  redis.call('HSET', marker, 'layout', LAYOUT)
end
if known ~= '' and known ~= id then
  hold = math.max(hold, math.floor(tonumber(id) / 1000) + tonumber(ARGV[3]))
  reason = 'loss'
  redis.call('HSET', marker, 'hold_until', int(hold), 'reason', reason)
end
return {id, hold, now_ms, reason, server, layout}
