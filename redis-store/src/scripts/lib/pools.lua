-- Helpers of the scripts on pools (shared leases, semaphore permits), and `by_with`, which the
-- scripts that record the brokers answering a lease share. A pool is a hash of records and a
-- sorted set of ends: see the key layout, redis-store/README.md.
local function record(rec)
  local f, e, t, g, r, o = string.match(rec, '^(%d+)|(%d+)|(%d+)|(%d+)|([^|]*)|(.*)$')
  return tonumber(f), tonumber(e), tonumber(t), tonumber(g), r, o
end
local function live_count(ends, now_ms)
  return redis.call('ZCOUNT', ends, '(' .. int(now_ms), '+inf')
end
local function keep(key, ms)
  local left = redis.call('PTTL', key)
  if left == -1 or (left >= 0 and left < ms) then redis.call('PEXPIRE', key, int(ms)) end
end
-- Drops a holder's request id from its pool, unless the id now names a later holder.
local function drop_rid(pool, rid, token)
  if rid ~= '' and redis.call('HGET', pool, '?' .. rid) == token then
    redis.call('HDEL', pool, '?' .. rid)
  end
end
-- Drops one holder of a pool, with its marks.
local function drop_holder(pool, ends, token)
  local rec = redis.call('HGET', pool, token)
  if rec then
    local _, _, _, _, rid = record(rec)
    drop_rid(pool, rid, token)
  end
  redis.call('HDEL', pool, token, '!' .. token, '@' .. token)
  redis.call('ZREM', ends, token)
end
-- The live holders of a pool: {token, fence, expires, ttl, owner-or-false, request-id-or-false}...
local function holders(pool, ends, now_ms)
  local out = {}
  local tokens = redis.call('ZRANGEBYSCORE', ends, '(' .. int(now_ms), '+inf')
  for _, token in ipairs(tokens) do
    local rec = redis.call('HGET', pool, token)
    if rec then
      local f, e, t, _, r, o = record(rec)
      out[#out + 1] = token
      out[#out + 1] = f
      out[#out + 1] = e
      out[#out + 1] = t
      out[#out + 1] = (o ~= '' and string.sub(o, 2)) or false
      out[#out + 1] = (r ~= '' and r) or false
    end
  end
  return out
end
-- The brokers that answer a lease's holder, with the caller added (at most four ids; beyond,
-- `*`: its end is told on the shared channel). A lease an older broker wrote has none, and keeps
-- none: that broker reads the shared channel.
local function by_with(by, broker)
  if (not by) or by == '' or by == '*' then return by end
  for b in string.gmatch(by, '[^,]+') do
    if b == broker then return by end
  end
  local _, n = string.gsub(by, ',', '')
  if n >= 3 then return '*' end
  return by .. ',' .. broker
end
