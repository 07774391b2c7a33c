-- JOIN: a shared lease or a semaphore permit joins a pool if it has room and nobody queues ahead
-- of it, and a waiting bid's turn in the key's queue (as CLAIM's, for shared bids and permits).
--
-- Joined after lib/prelude.lua, lib/pools.lua, lib/grant.lua, lib/keys.lua and lib/queue.lua.
-- Its call: `JoinPool` in scripts/grant.rs.
-- KEYS: as lib/keys.lua's. ARGV: as `grant_context`'s (kind `s`, or the semaphore's limit).
-- Replies as CLAIM's (never {REFUSED}), or {NO_ROOM, retry_after_ms} (the bid does not wait and
-- there is no room: an exclusive lease or offer is live, bids are queued, or every permit is
-- taken) or {OTHER_LIMIT, limit} (the live holders, or the queued bids, use that other limit).
local now = now_us()
local held = checked(now, MARKER, ARGV[4])
if held then return held end
local c, bid = grant_context(now)
settle(c)
if bid.kind ~= 's' then
  local used = redis.call('HGET', POOL, '#limit')
  if used and tonumber(used) ~= tonumber(bid.kind) and live_count(ENDS, c.now_ms) > 0 then
    return {OTHER_LIMIT, tonumber(used)}
  end
  local first = redis.call('ZRANGE', QUEUE, 0, 0)[1]
  local rec = first and redis.call('HGET', BIDS, first)
  local kind = rec and select(3, bid_of(rec))
  if kind and tonumber(kind) ~= tonumber(bid.kind) then return {OTHER_LIMIT, tonumber(kind)} end
end
local mine = redis.call('HGET', POOL, c.token)
if mine then
  local f, e, t, _, r, o = record(mine)
  if e > c.now_ms then
    if redis.call('HEXISTS', POOL, '!' .. c.token) == 0 then return {GRANTED, f, e, c.token, t, c.now_ms} end
    local expires = c.now_ms + bid.ttl
    redis.call('HSET', POOL, c.token, int(f) .. '|' .. int(expires) .. '|' .. int(bid.ttl) .. '|' .. int(c.now_ms) .. '|' .. r .. '|' .. o, '@' .. c.token, c.broker)
    redis.call('HDEL', POOL, '!' .. c.token)
    redis.call('ZADD', ENDS, int(expires), c.token)
    keep(POOL, bid.ttl + c.slack)
    keep(ENDS, bid.ttl + c.slack)
    keep(FENCE, bid.ttl + c.slack)
    return {GRANTED, f, expires, c.token, bid.ttl, c.now_ms}
  end
end
if bid.rid ~= '' then
  local again = redis.call('HGET', POOL, '?' .. bid.rid)
  local rec = again and redis.call('HEXISTS', POOL, '!' .. again) == 0 and redis.call('HGET', POOL, again)
  if rec then
    local f, e, t = record(rec)
    if e > c.now_ms then return {GRANTED, f, e, again, t, c.now_ms} end
  end
end
if bid.wait == 0 then
  if redis.call('ZCARD', QUEUE) > 0 then
    hand_on(c, nil)
    if redis.call('ZCARD', QUEUE) > 0 then return {NO_ROOM, busy_for(c, 'x') or c.window} end
  end
  local busy = busy_for(c, bid.kind)
  if busy then return {NO_ROOM, busy} end
  local fence, expires = write_lease(c, c.token, c.broker, bid.kind, bid.ttl, bid.rid, bid.owner, false)
  return {GRANTED, fence, expires, c.token, bid.ttl, c.now_ms}
end
if redis.call('ZCARD', QUEUE) == 0 and not busy_for(c, bid.kind) then
  local fence, expires = write_lease(c, c.token, c.broker, bid.kind, bid.ttl, bid.rid, bid.owner, false)
  return {GRANTED, fence, expires, c.token, bid.ttl, c.now_ms}
end
return wait_turn(c, bid)
