-- CLAIM: SETNX, and a waiting exclusive bid's turn in the key's queue.
--
-- In one step: a bid that holds an offer takes it (the lease is its own for its whole TTL from
-- now, with the fence the offer took); a bid that holds the live lease already, or whose request
-- id made the live lease (an offer not taken never counts), gets that lease again. Otherwise a
-- bid that does not wait is today's SETNX — checking for the key and writing it are one step, so
-- two claims cannot both see it free — except that a key with bids queued is refused (and what is
-- free is handed to the queue's head in this step). A bid that waits is granted a free key that
-- nobody queues for; it joins the queue (or keeps its place) and answers queued at once while
-- another's lease or offer is live; else it joins, the key is handed on, and if its turn came it
-- is granted now, else it answers queued.
--
-- Joined after lib/prelude.lua, lib/grant.lua, lib/keys.lua, fast/claim.lua (whose `now` and
-- epoch check it goes on from), lib/pools.lua and lib/queue.lua. Its call: `Claim` in
-- scripts/grant.rs.
-- KEYS: as lib/keys.lua's. ARGV: as `grant_context`'s (kind `x`).
-- Replies (codes named in lib/prelude.lua): {GRANTED, fence, expires_at, token, ttl, now} (and a
-- trailing 1 when the bid held that live lease already);
-- {REFUSED}; {QUEUED, retry_after_ms}; {ON_HOLD, hold_until, now, reason} a store-wide hold is
-- in force; {OTHER_EPOCH, epoch} the store is in another epoch than the broker knows: it must
-- catch up (put its leases back) before it may grant; {NEWER_LAYOUT, layout} a broker of a newer
-- layout runs on the store.
local c, bid = grant_context(now)
local cur = redis.call('HMGET', LOCK, 'token', 'fence', 'expires_at', 'ttl', 'request_id', 'offered')
local live = cur[1] and tonumber(cur[3]) > c.now_ms
if live and cur[1] == c.token then
  if cur[6] == '1' then
    local expires = c.now_ms + bid.ttl
    -- Taken: `offered` is no longer '1' (every reader asks for '1'), in the same write.
    redis.call('HSET', LOCK, 'expires_at', int(expires), 'ttl', int(bid.ttl), 'granted_at', int(c.now_ms), 'by', c.broker, 'offered', '0')
    redis.call('PEXPIRE', LOCK, int(bid.ttl + c.slack))
    keep(FENCE, bid.ttl + c.slack)
    return {GRANTED, cur[2], expires, c.token, bid.ttl, c.now_ms}
  end
  -- Held already: answered with a trailing 1, so that the broker knows a grant its own release
  -- handed this bid (`handed.rs`) has reached the bid this way.
  return {GRANTED, cur[2], cur[3], cur[1], cur[4], c.now_ms, 1}
end
if live and bid.rid ~= '' and cur[5] == bid.rid and cur[6] ~= '1' then
  return {GRANTED, cur[2], cur[3], cur[1], cur[4], c.now_ms}
end
-- Another's lease or offer is live: nothing can be handed on before it ends (ended pool holders
-- aside), so a bid that does not wait is refused, and one that waits joins the queue (or keeps
-- its place) and waits for that end — the hot key's common case, without walking the queue.
if live then
  settle_pool(c)
  if bid.wait == 0 then return {REFUSED} end
  enqueue(c, bid)
  return {QUEUED, math.max(1, tonumber(cur[3]) - c.now_ms)}
end
c.freed = not cur[1]
if bid.wait == 0 then
  if redis.call('ZCARD', QUEUE) > 0 then
    hand_on(c, nil)
    if redis.call('ZCARD', QUEUE) > 0 then return {REFUSED} end
    cur[1] = redis.call('HGET', LOCK, 'token')
  end
  if cur[1] or busy_for(c, 'x') then return {REFUSED} end
  local fence, expires = write_lease(c, c.token, c.broker, 'x', bid.ttl, bid.rid, bid.owner, false)
  return {GRANTED, fence, expires, c.token, bid.ttl, c.now_ms}
end
if redis.call('ZCARD', QUEUE) == 0 then
  settle(c)
  if not busy_for(c, 'x') then
    local fence, expires = write_lease(c, c.token, c.broker, 'x', bid.ttl, bid.rid, bid.owner, false)
    return {GRANTED, fence, expires, c.token, bid.ttl, c.now_ms}
  end
end
return wait_turn(c, bid)
