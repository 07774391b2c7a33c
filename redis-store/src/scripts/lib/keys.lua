-- The KEYS of every script on a key's queue (CLAIM, TAKE_OVER, JOIN, RELEASE, RENEW, FORCE,
-- LEAVE), by name: joined after lib/prelude.lua, before the fast paths (fast/claim.lua,
-- fast/release.lua) and lib/queue.lua. Their Rust side is `write_queue_keys` in
-- scripts/grant.rs; what each key holds is in the key layout (redis-store/README.md).
--
-- The exclusive lease (for a semaphore: its pool again, where no such lease is), the fence
-- counter, the epoch marker, the pool, its ends, the queue and the bids.
local LOCK, FENCE, MARKER, POOL, ENDS, QUEUE, BIDS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
-- Present while some broker has watches on the key (see `changed` in lib/queue.lua).
local WATCHED = KEYS[8]
-- A lock key has an exclusive lease; a semaphore has none.
local EXCL = LOCK ~= POOL
