-- CLAIM's fast path: the lock cycle's common case — a free key that nobody queues for, watches,
-- shares, or keeps a fence counter for — granted in five calls (`fast_claim`, lib/fast.lua),
-- before the queue's helpers are even defined (defining them costs as much as a call). Anything
-- else falls through to claim.lua, which reuses `now` and the epoch check from here.
--
-- Joined after lib/prelude.lua, lib/grant.lua, lib/keys.lua (the KEYS by name) and lib/fast.lua.
-- KEYS and ARGV: CLAIM's (claim.lua); the ARGV read here by name (`grant_context` in
-- lib/queue.lua reads them for the slow path).
local TOKEN, TTL, OWNER, KNOWN, REQUEST_ID, BROKER = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local now, time = now_us()
local held = checked(now, MARKER, KNOWN)
if held then return held end
local expires, ms, now_ms = fast_claim(now, time, nil, LOCK, FENCE, ENDS, QUEUE, WATCHED, TOKEN, TTL, OWNER,
  REQUEST_ID, BROKER)
if expires then return {GRANTED, now, expires, TOKEN, ms, now_ms} end
