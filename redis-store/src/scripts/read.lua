-- READ: GET, with Redis's clock read in the same step so the expiry is judged on the store's time.
--
-- Joined after lib/prelude.lua and lib/pools.lua. Its call: `Read` in scripts/reads.rs.
-- KEYS: lock, shared pool, its ends.
-- Replies the clock, the exclusive lease's six fields (token, fence, expires_at, ttl, owner,
-- request_id; each false when there is none), then (when there is no exclusive lease record)
-- six for each live shared lease (see `holders`).
local now = math.floor(now_us() / 1000)
local v = redis.call('HMGET', KEYS[1], 'token', 'fence', 'expires_at', 'ttl', 'owner', 'request_id')
local out = {now, v[1] or false, v[2] or false, v[3] or false, v[4] or false, v[5] or false, v[6] or false}
-- No shared lease is live beside an exclusive lease record (a shared grant deletes an expired
-- one, an exclusive grant needs no live shared lease): the exclusive path skips the look.
if v[1] then return out end
for _, x in ipairs(holders(KEYS[2], KEYS[3], now)) do out[#out + 1] = x end
return out
