-- RENEW: moves the end of the token's live lease to ttl_ms from now — or, with `until` given,
-- to that time (store clock, ms) unless the lease ends later already (a session's keep-alive,
-- which never shortens a lease); this broker is added to the ones that answer its holder. A
-- lease held under a session (its owner label starts with the session mark, "\30") keeps its
-- end on a renewal without `until`: it ends with its session. A renew that makes the lease end
-- sooner tells the broker of the queue's first bid to look when it now ends: it timed its wait
-- for the old end.
--
-- Joined after lib/prelude.lua, lib/pools.lua, lib/grant.lua, lib/keys.lua, lib/queue.lua,
-- lib/holder.lua and lib/renewal.lua (which does the work). Its call: `Renew` in
-- scripts/holder.rs.
-- KEYS: as lib/keys.lua's. ARGV: as `holder_context`'s, then ttl_ms and until ('' for none).
-- Replies {HELD, fence, expires_at, ttl, owner, epoch} for the exclusive lease, {HELD_POOLED,
-- fence, expires_at, ttl, owner, epoch, limit} for a pool lease (the semaphore's limit, or ''
-- for a shared lease); {NOT_HELD}, {NOT_OWNER}; or {HOLD_IN_FORCE, hold_until, now, reason}.
-- The epoch lets the broker tell a renewal that raced a loss (see `EpochKeeper::remember`).
local now = now_us()
return renewal(holder_context(now), ARGV[5], ARGV[6])
