-- JOIN: a shared lease or a semaphore permit joins a pool if it has room.
--
-- Joined after lib/prelude.lua, lib/pools.lua and lib/grant.lua. Its call: `Join` in
-- scripts/grant.rs.
-- KEYS: pool, its ends, fence counter, epoch marker [, for a shared lease: the exclusive lease,
--       the intents].
-- ARGV: token, ttl_ms, owner ('' or '=' and the label), slack_ms, limit ('' for a shared lease),
--       the epoch this broker knows, request_id ('' for none).
-- Replies as CLAIM's ({1, ...}, {2, ...}, {3, ...}; never {0}), or {4, retry_after_ms} (no room:
-- an exclusive lease or intent is live, or every permit is taken) or {5, limit} (the live
-- holders use that other limit).
local now = now_us()
local held = checked(now, KEYS[4])
if held then return held end
local now_ms = math.floor(now / 1000)
prune(KEYS[1], KEYS[2], now_ms)
local live = live_count(KEYS[2], now_ms)
if ARGV[5] ~= '' and live > 0 then
  local used = tonumber(redis.call('HGET', KEYS[1], '#limit') or ARGV[5])
  if used ~= tonumber(ARGV[5]) then return {5, used} end
end
if ARGV[7] ~= '' then
  local again = redis.call('HGET', KEYS[1], '?' .. ARGV[7])
  local rec = again and redis.call('HGET', KEYS[1], again)
  if rec then
    local f, e, t = record(rec)
    if e > now_ms then return {1, f, e, again, t, now_ms} end
  end
end
if ARGV[5] == '' then
  local x = redis.call('HGET', KEYS[5], 'expires_at')
  if x then
    if tonumber(x) > now_ms then return {4, tonumber(x) - now_ms} end
    redis.call('DEL', KEYS[5])
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', int(now_ms))
  local w = redis.call('ZRANGE', KEYS[6], 0, 0, 'WITHSCORES')
  if w[1] then return {4, tonumber(w[2]) - now_ms} end
else
  local limit = tonumber(ARGV[5])
  if live > 0 then
    if live >= limit then
      local first = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. int(now_ms), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      return {4, tonumber(first[2]) - now_ms}
    end
  end
  redis.call('HSET', KEYS[1], '#limit', ARGV[5])
end
local fence = fence_for(KEYS[3], now)
local ttl = tonumber(ARGV[2])
local expires = now_ms + ttl
redis.call('HSET', KEYS[1], ARGV[1], int(fence) .. '|' .. int(expires) .. '|' .. int(ttl) .. '|' .. int(now_ms) .. '|' .. ARGV[7] .. '|' .. ARGV[3])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], '?' .. ARGV[7], ARGV[1]) end
redis.call('ZADD', KEYS[2], expires, ARGV[1])
local kept = ttl + tonumber(ARGV[4])
keep(KEYS[1], kept)
keep(KEYS[2], kept)
keep(KEYS[3], kept)
return {1, fence, expires, ARGV[1], ttl, now_ms}
