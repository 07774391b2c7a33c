-- PUT_BACK: puts leases back after a loss.
--
-- For each lease: the fence counter is raised to at least its fence (a store that lost or rolled
-- back counters must not hand out a fence again); then if the key is free (or its lease has
-- ended) the lease is written back with what remains of it (WRITTEN); if the key already holds
-- this token, its end is moved out to what remains if that is later (ALREADY_THERE); if it holds
-- another live lease — only possible if one lock already had two holders, say a broker that was
-- cut off during a loss — the lease with the higher fence stays, and the reply says which
-- (OTHER_KEPT: the other one stays; OTHER_REPLACED: this one replaced it), with the other's
-- fence. (The codes are named in lib/prelude.lua.) An exclusive lease and
-- live shared ones are such a conflict too; pool leases (shared leases, a semaphore's permits) do
-- not conflict with each other.
--
-- Each batch keeps the store-wide hold in force for at least PUT_BACK_HOLD_MS more: a broker with
-- many leases to put back may need longer than the settle time, and no other broker may grant
-- one of its keys before it is back.
--
-- Joined after lib/prelude.lua, lib/pools.lua and lib/grant.lua (for `kept_fence`: a lease record
-- it replaces or drops keeps its fence in the counter while Redis's clock has not passed it). Its
-- call: `PutBack` in scripts/epoch.rs.
-- KEYS: epoch marker, then for each lease four keys: for an exclusive lease its lock, fence
--       counter, shared pool and its ends; for a pool lease (shared or permit) the pool, its
--       ends, fence counter and the exclusive lock (for a permit: the pool again).
-- Each lease put back records this broker among the ones that remember it (`by`, see
-- lib/queue.lua's `ended`, and `by_with` in lib/pools.lua), so that its end is told to this broker.
--
-- ARGV: the epoch, slack_ms, this broker's id, then seven for each lease: kind (`x` exclusive, `s` shared, or the
--       semaphore's limit), token, fence, remaining_ms, ttl_ms, owner and request id (each ''
--       for none, else '=' and the value).
-- Replies {EPOCH_MOVED} if the store is no longer in that epoch (a loss during the put-back:
-- start over), else three numbers per lease: code, the other lease's fence (or 0), and 1 if the
-- counter had to be raised.

local PUT_BACK_HOLD_MS = 1000
local now = now_us()
local now_ms = math.floor(now / 1000)
local marker = KEYS[1]
local m = redis.call('HMGET', marker, 'id', 'hold_until')
if m[1] ~= ARGV[1] then return {EPOCH_MOVED} end
if tonumber(m[2] or '0') < now_ms + PUT_BACK_HOLD_MS then
  redis.call('HSET', marker, 'hold_until', int(now_ms + PUT_BACK_HOLD_MS))
end
local slack = tonumber(ARGV[2])
local broker = ARGV[3]
local out = {}
for i = 0, (#KEYS - 1) / 4 - 1 do
  local k1, k2, k3, k4 = KEYS[2 + 4 * i], KEYS[3 + 4 * i], KEYS[4 + 4 * i], KEYS[5 + 4 * i]
  local a = 4 + 7 * i
  local kind, token, fence, remaining = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local ttl, owner, rid = ARGV[a + 4], ARGV[a + 5], ARGV[a + 6]
  local counter = (kind == 'x' and k2) or k3
  local raised = 0
  if tonumber(redis.call('GET', counter) or '0') < fence then
    redis.call('SET', counter, int(fence))
    raised = 1
  end
  if redis.call('PTTL', counter) < remaining + slack then
    redis.call('PEXPIRE', counter, remaining + slack)
  end
  local code, other, write = WRITTEN, 0, true
  if kind == 'x' then
    local lock, pool, ends = k1, k3, k4
    local cur = redis.call('HMGET', lock, 'token', 'fence', 'expires_at')
    kept_fence(counter, cur[2], now)
    if cur[1] and tonumber(cur[3]) > now_ms then
      if cur[1] == token then
        code, write = ALREADY_THERE, false
        local by = redis.call('HGET', lock, 'by')
        if by and by_with(by, broker) ~= by then redis.call('HSET', lock, 'by', by_with(by, broker)) end
        if now_ms + remaining > tonumber(cur[3]) then
          redis.call('HSET', lock, 'expires_at', int(now_ms + remaining))
          redis.call('PEXPIRE', lock, remaining + slack)
        end
      elseif tonumber(cur[2]) > fence then
        code, other, write = OTHER_KEPT, tonumber(cur[2]), false
      else
        code, other = OTHER_REPLACED, tonumber(cur[2])
      end
    end
    if write then
      local live = holders(pool, ends, now_ms)
      for j = 2, #live, 6 do
        if live[j] > fence then code, other, write = OTHER_KEPT, live[j], false end
      end
      if write and #live > 0 then
        code, other = OTHER_REPLACED, live[#live - 4]
        redis.call('DEL', pool, ends)
      end
    end
    if write then
      redis.call('DEL', lock)
      redis.call('HSET', lock, 'token', token, 'fence', int(fence), 'expires_at', int(now_ms + remaining), 'ttl', ttl, 'granted_at', int(now_ms), 'by', broker)
      if owner ~= '' then redis.call('HSET', lock, 'owner', string.sub(owner, 2)) end
      if rid ~= '' then redis.call('HSET', lock, 'request_id', string.sub(rid, 2)) end
      redis.call('PEXPIRE', lock, remaining + slack)
    end
  else
    local pool, ends, lock = k1, k2, k4
    local rec = redis.call('HGET', pool, token)
    if rec then
      local f, e, t, g, r, o = record(rec)
      if e > now_ms then
        code, write = ALREADY_THERE, false
        local by = redis.call('HGET', pool, '@' .. token)
        if by and by_with(by, broker) ~= by then redis.call('HSET', pool, '@' .. token, by_with(by, broker)) end
        if now_ms + remaining > e then
          redis.call('HSET', pool, token, int(f) .. '|' .. int(now_ms + remaining) .. '|' .. int(t) .. '|' .. int(g) .. '|' .. r .. '|' .. o)
          redis.call('ZADD', ends, int(now_ms + remaining), token)
        end
      end
    end
    if write and lock ~= pool then
      local cur = redis.call('HMGET', lock, 'fence', 'expires_at')
      kept_fence(counter, cur[1], now)
      if cur[1] and tonumber(cur[2]) > now_ms and tonumber(cur[1]) > fence then
        code, other, write = OTHER_KEPT, tonumber(cur[1]), false
      elseif cur[1] then
        if tonumber(cur[2]) > now_ms then code, other = OTHER_REPLACED, tonumber(cur[1]) end
        redis.call('DEL', lock)
      end
    end
    if write and kind ~= 's' and live_count(ends, now_ms) == 0 then
      redis.call('HSET', pool, '#limit', kind)
    end
    if write then
      local r = (rid ~= '' and string.sub(rid, 2)) or ''
      redis.call('HSET', pool, token, int(fence) .. '|' .. int(now_ms + remaining) .. '|' .. ttl .. '|' .. int(now_ms) .. '|' .. r .. '|' .. owner, '@' .. token, broker)
      if r ~= '' then redis.call('HSET', pool, '?' .. r, token) end
      redis.call('ZADD', ends, int(now_ms + remaining), token)
    end
    keep(pool, remaining + slack)
    keep(ends, remaining + slack)
  end
  out[#out + 1] = code
  out[#out + 1] = other
  out[#out + 1] = raised
end
return out
