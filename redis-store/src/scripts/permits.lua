-- PERMITS: a semaphore's live holders.
--
-- Joined after lib/prelude.lua and lib/pools.lua. Its call: `Permits` in scripts/reads.rs.
-- KEYS: pool, its ends.
-- Replies the clock, the limit (or false), then six fields for each holder (see `holders`).
local pool, ends = KEYS[1], KEYS[2]
local now = math.floor(now_us() / 1000)
local out = {now, redis.call('HGET', pool, '#limit') or false}
for _, x in ipairs(holders(pool, ends, now)) do out[#out + 1] = x end
return out
