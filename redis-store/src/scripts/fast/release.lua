-- RELEASE's fast path: the lock cycle's common case — the token's own live exclusive lease,
-- remembered by this broker alone, on a key that nobody queues for, watches or shares, with no
-- fence counter and a fence below Redis's clock — released in four calls (`fast_release`,
-- lib/fast.lua), before the queue's helpers are defined. Anything else falls through to
-- release.lua, which reuses `now` and the lease read here.
--
-- Joined after lib/prelude.lua, lib/keys.lua (the KEYS by name) and lib/fast.lua. KEYS and ARGV:
-- RELEASE's (release.lua).
local now = now_us()
-- The exclusive lease as read here (token, expires_at, offered, by, fence, granted_at); nil on a
-- semaphore. Nothing writes before release.lua reads it again.
local lease = nil
if EXCL then
  local held_ms, fence
  held_ms, fence, lease = fast_release(now, nil, LOCK, FENCE, ENDS, QUEUE, WATCHED, ARGV[1], ARGV[3])
  if held_ms then return {HELD, held_ms, fence} end
end
