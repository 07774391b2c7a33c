-- RELEASE's fast path: the lock cycle's common case — the token's own live exclusive lease,
-- remembered by this broker alone, on a key that nobody queues for, watches or shares, with no
-- fence counter and a fence below Redis's clock (see fast/claim.lua: nothing then needs the
-- fence kept) — released in four calls, before the queue's helpers are defined. Anything else
-- falls through to release.lua, which reuses `now` and the lease read here.
--
-- Joined after lib/prelude.lua and lib/keys.lua (the KEYS by name). KEYS and ARGV: RELEASE's
-- (release.lua).
local now = now_us()
-- The exclusive lease as read here (token, expires_at, offered, by, fence, granted_at); nil on a
-- semaphore. Nothing writes before release.lua reads it again.
local lease = nil
if EXCL then
  local now_ms = math.floor(now / 1000)
  local v = redis.call('HMGET', LOCK, 'token', 'expires_at', 'offered', 'by', 'fence', 'granted_at')
  lease = v
  if v[1] == ARGV[1] and v[3] ~= '1' and v[4] == ARGV[3] and v[6] and tonumber(v[2]) > now_ms
      and tonumber(v[5]) < now and redis.call('EXISTS', QUEUE, ENDS, WATCHED, FENCE) == 0 then
    redis.call('DEL', LOCK)
    return {HELD, math.max(0, now_ms - tonumber(v[6])), tonumber(v[5])}
  end
end
