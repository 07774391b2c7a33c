-- TAKE_OVER: GETSET, made safe. The classic recipe GETSETs blindly and compares the old value
-- afterwards, so a loser has already overwritten the winner's value (the winner's token with it).
-- Here the comparison comes first, in the same step: only a contender that still sees the expired
-- lease it read (its fence) writes. A key that vanished in between (the recipe's "GETSET
-- returned nil") is free, and the contender wins it. With bids queued, the key goes to the
-- queue's head instead (handed on in this step) and the contender is refused: a bid that does
-- not wait never goes ahead of the queue. A lapsed offer taken over is ended as the hand-on ends
-- one (its broker requeues).
--
-- Joined after lib/prelude.lua, lib/pools.lua, lib/grant.lua, lib/keys.lua and lib/queue.lua.
-- Its call: `TakeOver` in scripts/grant.rs.
-- KEYS and ARGV[1..7] as CLAIM's; ARGV[8]: the fence of the expired lease seen.
-- Replies as CLAIM's (never {QUEUED}).
local now = now_us()
local held = checked(now, MARKER, ARGV[4])
if held then return held end
local c, bid = grant_context(now)
if redis.call('ZCARD', QUEUE) > 0 then
  hand_on(c, nil)
  if redis.call('ZCARD', QUEUE) > 0 then return {REFUSED} end
end
local cur = redis.call('HMGET', LOCK, 'fence', 'expires_at', 'offered', 'by')
if cur[1] then
  if cur[1] ~= ARGV[8] then return {REFUSED} end
  if tonumber(cur[2]) > c.now_ms then return {REFUSED} end
  if cur[3] == '1' then requeue(c, cur[4]) end
end
if live_count(ENDS, c.now_ms) > 0 then return {REFUSED} end
local fence, expires = write_lease(c, c.token, c.broker, 'x', bid.ttl, bid.rid, bid.owner, false)
return {GRANTED, fence, expires, c.token, bid.ttl, c.now_ms}
