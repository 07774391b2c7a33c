-- The lock cycle's common case, as functions: CLAIM's fast path (fast/claim.lua) and RELEASE's
-- (fast/release.lua) run them on their one key, BATCH (batch.lua) on many keys in one call.
-- Joined after lib/prelude.lua. Each takes the key's lease, fence counter, pool's ends, queue and
-- watch mark (lib/keys.lua's LOCK, FENCE, ENDS, QUEUE, WATCHED) and Redis's clock as `now_us`
-- answers it.
--
-- Redis's clock as text, from TIME's answer: the µs (a fence) and the ms (`granted_at`), cut from
-- the answer's two fields: formatting a number costs Redis more than the rest of a grant's Lua.
-- A BATCH makes them once for all its operations.
local function clock_text(time)
  local us = string.rep('0', 6 - #time[2]) .. time[2]
  return time[1] .. us, time[1] .. string.sub(us, 1, 3)
end
-- Whether the whole number written `a` is below the one written `b`, both decimal without
-- leading zeros (as every fence and clock the scripts write): the shorter is the smaller, and at
-- equal lengths the digits compare in order. Cheaper for Redis than reading 16-digit numbers.
local function below(a, b)
  local la, lb = #a, #b
  if la ~= lb then return la < lb end
  return a < b
end
-- A free key (no lease record: an expired one is taken over as claim.lua says) that nobody
-- queues for, watches, shares, or keeps a fence counter for, granted to the bid: its reply, or
-- nil with nothing written. Why the grant needs no counter: every fence a key ever had is in its
-- fence counter, in a live record (this lease hash, a pool's records), or below Redis's clock — a
-- script that drops a record whose fence is not below the clock raises the counter to it first
-- (`kept_fence`, lib/grant.lua). So with no counter, no pool and no lease record, Redis's clock in
-- µs is above every fence granted before (as long as it does not step back while nothing holds
-- the key). `owner`: '' or '=' and the label; `text`: `clock_text`'s answer as a pair, if the
-- caller made it already (else it is made here, once the key is found free). Granted, it answers
-- the lease's expires_at, ttl and Redis's clock in ms (its fence is `now`): numbers, no table,
-- which only a single call's reply needs.
local function fast_claim(now, time, text, lock, fence, ends, queue, watched, token, ttl, owner, rid, broker)
  if redis.call('EXISTS', lock, queue, ends, watched, fence) ~= 0 then return nil end
  local now_ms = math.floor(now / 1000)
  local ms = tonumber(ttl)
  local expires = now_ms + ms
  local us_text, ms_text
  if text then us_text, ms_text = text[1], text[2] else us_text, ms_text = clock_text(time) end
  -- Numbers as text: the clock's cut from TIME's answer (`clock_text`), the rest with `int`. A
  -- number handed to redis.call as it is gets written with `%.17g`, which costs Redis about twice
  -- as much as `int`'s `%d`.
  redis.call('HSET', lock, 'token', token, 'fence', us_text, 'expires_at', int(expires),
    'ttl', ttl, 'granted_at', ms_text, 'by', broker)
  if owner ~= '' then redis.call('HSET', lock, 'owner', string.sub(owner, 2)) end
  if rid ~= '' then redis.call('HSET', lock, 'request_id', rid) end
  redis.call('PEXPIRE', lock, int(ms + SLACK))
  return expires, ms, now_ms
end
-- The token's own live exclusive lease, remembered by this broker (`broker`) alone, on a key that
-- nobody queues for, watches or shares, with no fence counter and a fence below Redis's clock
-- (nothing then needs the fence kept), released: how long it was held (ms) and its fence (as
-- text), or nil with nothing written. Either way also the lease as read (token, expires_at,
-- offered, by, fence, granted_at), for RELEASE's slow path to go on from. `text`: `clock_text`'s
-- answer as a pair, if the caller made it already.
local function fast_release(now, text, lock, fence, ends, queue, watched, token, broker)
  local now_ms = math.floor(now / 1000)
  local v = redis.call('HMGET', lock, 'token', 'expires_at', 'offered', 'by', 'fence', 'granted_at')
  local f = v[5]
  -- The lease live and its fence below the clock: compared as text where the clock's text is
  -- made already (a BATCH), else as numbers; the fence answered as text either way (no second
  -- read of a 16-digit number).
  local live, old
  if v[1] == token and v[3] ~= '1' and v[4] == broker and v[6] and f then
    if text then
      live, old = below(text[2], v[2]), below(f, text[1])
    else
      live, old = tonumber(v[2]) > now_ms, tonumber(f) < now
    end
  end
  if live and old and redis.call('EXISTS', queue, ends, watched, fence) == 0 then
    redis.call('DEL', lock)
    return math.max(0, now_ms - tonumber(v[6])), f, v
  end
  return nil, nil, v
end
