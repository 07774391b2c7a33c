-- KEEP: a session's keep-alive for many leases in one call — RENEW's `until` form (never
-- shortens a lease) on each lease in turn, each answered as RENEW answers. On one Redis (or
-- Sentinel) a session's leases, on any keys, are kept by this one call whatever their number;
-- on a cluster a call carries the leases of one slot (a script may not touch another's).
--
-- Joined after lib/prelude.lua, lib/pools.lua, lib/grant.lua, lib/keys.lua, lib/name_keys.lua,
-- lib/queue.lua, lib/holder.lua and lib/renewal.lua; the key names of lib/keys.lua are set
-- (`name_keys`) for each lease in turn. Its call: `Keep` in scripts/holder.rs.
-- KEYS: lib/keys.lua's eight for each lease, one lease after another. ARGV: the epoch this
-- broker knows, its id, the time to move every lease's end to (store clock, ms), then for each
-- lease its token and its context string (as every holder script's last argument).
-- Replies one RENEW reply per lease, in order.
local now = now_us()
local out = {}
for i = 0, #KEYS / 8 - 1 do
  local k = 8 * i
  name_keys(k)
  local c = holder_context(now, ARGV[4 + 2 * i], ARGV[1], ARGV[2], ARGV[5 + 2 * i])
  out[i + 1] = renewal(c, 0, ARGV[3])
end
return out
