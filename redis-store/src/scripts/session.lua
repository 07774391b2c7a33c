-- SESSION: one call on a session's record (`SessionOp` in lockbroker-core's store/session.rs):
-- open, renew (the keep-alive), read, close, enter a lease, drop an entry. The record is one hash
-- whose hash tag is the session's id, so on a cluster it lives on a slot of its own and this
-- script touches nothing else; the leases under the session are kept in step by the broker (see
-- store/session.rs), each in its own key's scripts.
--
-- The record: `ttl`, `expires_at` (Redis's clock, ms), `owner` ('' or '=' and the label),
-- `delay` (the lock delay, ms), and one field per lease entered, `e|<space>|<token>|<key>` → when it
-- was last entered (ms) and the client key, space-separated. A record whose end has passed is ended: every call but open deletes it and answers none.
-- Redis drops it by itself a slack after its end.
--
-- Joined after lib/prelude.lua. Its call: `SessionCall` in scripts/session.rs.
-- KEYS: the record. ARGV: op ('open', 'renew', 'read', 'close', 'enter', 'drop'), then for
-- open: ttl, owner, delay; renew: ttl ('' keeps the session's); enter and drop: the entry's
-- field and key.
-- Replies {0} for none, else {1, now, ttl, expires_at, owner, delay, field, key, field, key, ...}
-- with the record as the call left it (close: as it was).
local R = KEYS[1]
local now = math.floor(now_us() / 1000)
local op = ARGV[1]
local function answer()
  local out = {1, now, 0, 0, '', 0}
  local h = redis.call('HGETALL', R)
  for i = 1, #h, 2 do
    local f, v = h[i], h[i + 1]
    if f == 'ttl' then out[3] = tonumber(v)
    elseif f == 'expires_at' then out[4] = tonumber(v)
    elseif f == 'owner' then out[5] = v
    elseif f == 'delay' then out[6] = tonumber(v)
    else
      out[#out + 1] = f
      out[#out + 1] = v
    end
  end
  return out
end
if op == 'open' then
  local ttl = tonumber(ARGV[2])
  redis.call('DEL', R)
  redis.call('HSET', R, 'ttl', int(ttl), 'expires_at', int(now + ttl), 'owner', ARGV[3], 'delay', ARGV[4])
  redis.call('PEXPIRE', R, ttl + SLACK)
  return answer()
end
local ends = tonumber(redis.call('HGET', R, 'expires_at') or '0')
if ends <= now then
  redis.call('DEL', R)
  return {0}
end
if op == 'renew' then
  local ttl = tonumber(ARGV[2]) or tonumber(redis.call('HGET', R, 'ttl'))
  redis.call('HSET', R, 'ttl', int(ttl), 'expires_at', int(now + ttl))
  redis.call('PEXPIRE', R, ttl + SLACK)
elseif op == 'enter' then
  redis.call('HSET', R, ARGV[2], int(now) .. ' ' .. ARGV[3])
elseif op == 'drop' then
  redis.call('HDEL', R, ARGV[2])
elseif op == 'close' then
  local was = answer()
  redis.call('DEL', R)
  return was
end
return answer()
