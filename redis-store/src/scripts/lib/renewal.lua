-- RENEW's work on one lease, as a function: RENEW (renew.lua) runs it once, KEEP (keep.lua) once
-- per lease of a session. `c`: the holder context (`holder_context` in lib/queue.lua) with the
-- lease's token; `ttl_arg`: the new length in ms (a string); `until_arg`: '' or the time (store
-- clock, ms) to move the end to unless it ends later already. What it does and answers is said
-- in renew.lua.
--
-- Joined after lib/prelude.lua, lib/pools.lua, lib/grant.lua, lib/keys.lua, lib/queue.lua and
-- lib/holder.lua.
local function renewal(c, ttl_arg, until_arg)
  local now_ms = c.now_ms
  local h, expires, reason = holder(now_ms, nil, c.token)
  if h == HOLD_IN_FORCE then return {HOLD_IN_FORCE, expires, now_ms, reason} end
  local until_ms = tonumber(until_arg)
  -- The lease's new end and length; `o` its owner label (false for none).
  local function target(o)
    if until_ms then
      local ends = math.max(expires, until_ms)
      return ends, ends - now_ms
    end
    if string.sub(o or '', 1, 1) == '\30' then return expires, expires - now_ms end
    local ttl = tonumber(ttl_arg)
    return now_ms + ttl, ttl
  end
  local function sooner(ends, ttl)
    if ends >= expires then return end
    local first = redis.call('ZRANGE', QUEUE, 0, 0)[1]
    local rec = first and redis.call('HGET', BIDS, first)
    local b = rec and string.match(rec, '^([^|]*)|')
    if b then tell(c, b, 'l ' .. c.space .. ' ' .. int(ttl) .. ' ' .. c.key) end
  end
  if h == HELD_POOLED then
    local f, _, _, g, r, o = record(reason)
    local ends, ttl = target(string.sub(o, 2))
    redis.call('HSET', POOL, c.token, int(f) .. '|' .. int(ends) .. '|' .. int(ttl) .. '|' .. int(g) .. '|' .. r .. '|' .. o)
    local by = redis.call('HGET', POOL, '@' .. c.token)
    local now_by = by_with(by, c.broker)
    if now_by ~= by then redis.call('HSET', POOL, '@' .. c.token, now_by) end
    redis.call('ZADD', ENDS, int(ends), c.token)
    sooner(ends, ttl)
    keep(POOL, ttl + c.slack)
    keep(ENDS, ttl + c.slack)
    return {HELD_POOLED, f, ends, ttl, (o ~= '' and string.sub(o, 2)) or false, redis.call('HGET', MARKER, 'id') or '', redis.call('HGET', POOL, '#limit') or ''}
  end
  if h ~= HELD then return {h} end
  local v = redis.call('HMGET', LOCK, 'fence', 'owner')
  local ends, ttl = target(v[2])
  redis.call('HSET', LOCK, 'expires_at', int(ends), 'ttl', int(ttl))
  local by = redis.call('HGET', LOCK, 'by')
  local now_by = by_with(by, c.broker)
  if now_by ~= by then redis.call('HSET', LOCK, 'by', now_by) end
  sooner(ends, ttl)
  redis.call('PEXPIRE', LOCK, ttl + c.slack)
  return {HELD, v[1], ends, ttl, v[2] or false, redis.call('HGET', MARKER, 'id') or ''}
end
