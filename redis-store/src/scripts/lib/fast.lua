-- The lock cycle's common case, as functions: CLAIM's fast path (fast/claim.lua) and RELEASE's
-- (fast/release.lua) run them on their one key, BATCH (batch.lua) on many keys in one call.
-- Joined after lib/prelude.lua. Each takes the key's lease, fence counter, pool's ends, queue and
-- watch mark (lib/keys.lua's LOCK, FENCE, ENDS, QUEUE, WATCHED) and Redis's clock as `now_us`
-- answers it.
--
-- A free key (no lease record: an expired one is taken over as claim.lua says) that nobody
-- queues for, watches, shares, or keeps a fence counter for, granted to the bid: its reply, or
-- nil with nothing written. Why the grant needs no counter: every fence a key ever had is in its
-- fence counter, in a live record (this lease hash, a pool's records), or below Redis's clock — a
-- script that drops a record whose fence is not below the clock raises the counter to it first
-- (`kept_fence`, lib/grant.lua). So with no counter, no pool and no lease record, Redis's clock in
-- µs is above every fence granted before (as long as it does not step back while nothing holds
-- the key). `owner`: '' or '=' and the label.
local function fast_claim(now, time, lock, fence, ends, queue, watched, token, ttl, owner, rid, broker)
  if redis.call('EXISTS', lock, queue, ends, watched, fence) ~= 0 then return nil end
  local now_ms = math.floor(now / 1000)
  local ms = tonumber(ttl)
  local expires = now_ms + ms
  -- The clock's µs and ms as text, cut from TIME's answer: formatting a number costs Redis
  -- more than the rest of the grant's Lua. (Numbers handed to redis.call as they are, as the
  -- expiry is, are written exactly: with 17 significant digits.)
  local us = string.rep('0', 6 - #time[2]) .. time[2]
  redis.call('HSET', lock, 'token', token, 'fence', time[1] .. us, 'expires_at', expires,
    'ttl', ttl, 'granted_at', time[1] .. string.sub(us, 1, 3), 'by', broker)
  if owner ~= '' then redis.call('HSET', lock, 'owner', string.sub(owner, 2)) end
  if rid ~= '' then redis.call('HSET', lock, 'request_id', rid) end
  redis.call('PEXPIRE', lock, ms + SLACK)
  return {GRANTED, now, expires, token, ms, now_ms}
end
-- The token's own live exclusive lease, remembered by this broker (`broker`) alone, on a key that
-- nobody queues for, watches or shares, with no fence counter and a fence below Redis's clock
-- (nothing then needs the fence kept), released: its reply, or nil with nothing written. Either
-- way also the lease as read (token, expires_at, offered, by, fence, granted_at), for RELEASE's
-- slow path to go on from.
local function fast_release(now, lock, fence, ends, queue, watched, token, broker)
  local now_ms = math.floor(now / 1000)
  local v = redis.call('HMGET', lock, 'token', 'expires_at', 'offered', 'by', 'fence', 'granted_at')
  if v[1] == token and v[3] ~= '1' and v[4] == broker and v[6] and tonumber(v[2]) > now_ms
      and tonumber(v[5]) < now and redis.call('EXISTS', queue, ends, watched, fence) == 0 then
    redis.call('DEL', lock)
    return {HELD, math.max(0, now_ms - tonumber(v[6])), tonumber(v[5])}, v
  end
  return nil, v
end
