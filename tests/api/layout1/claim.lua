-- The CLAIM script of store layout 1 (the brokers before the queue per key), verbatim: lib/prelude.lua,
-- lib/grant.lua and claim.lua as they were joined. The queue tests run it beside layout 2.
-- Shared head of every script but MARK and REPAIR (joined in front of it at build time, see
-- `scripts/mod.rs`).
--
-- `TIME` in a script that then writes needs effects replication: the default since Redis 5 and
-- the only mode since 7; `replicate_commands` turns it on for older servers.
--
-- Numbers are formatted with `%.0f` before they are written, because Lua hands `redis.call`
-- numbers as `%.14g`, which would round a 16-digit fence.
if redis.replicate_commands then redis.replicate_commands() end
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function int(n) return string.format('%.0f', n) end
local function epoch(marker)
  local m = redis.call('HMGET', marker, 'id', 'hold_until', 'reason')
  return m[1], tonumber(m[2] or '0'), m[3] or ''
end
-- Shared by CLAIM, TAKE_OVER and JOIN: the epoch check and the fence every grant takes, and the
-- exclusive grant itself.
--
-- Checking the epoch in the granting script itself closes the gap between a loss and the moment
-- a broker notices: no broker grants into an emptied store, whatever its timing. `checked`
-- replies `{3, epoch}` when the store is not in the epoch the broker knows (ARGV[6]) — it lost
-- its data, or another broker saw a loss first; on a cluster, the key's slot may also have moved
-- from another master, with that master's epoch — and `{2, hold_until, now, reason}` while a
-- store-wide hold is in force.
--
-- The fence is taken in the same script as the write that grants, so fences are ordered like
-- grants. (Taking it with INCR before a separate SETNX is not: A INCRs 5, B INCRs 6, B wins and
-- releases, A then wins with 5.) The fence is never below Redis's clock in microseconds: a
-- counter that is missing (a new key, a counter that expired with it, a Redis that restarted
-- empty) or rolled back (a Redis restarted from an older snapshot, a failover to a lagging
-- replica) jumps to the clock, above any fence granted before, as long as the key saw fewer than
-- one grant per microsecond on average and Redis's clock did not step back.

-- How long a waiting exclusive bid's intent holds new shared grants back: the broker's
-- `WRITER_INTENT_MS` (a unit test checks that the two agree).
local WRITER_INTENT_MS = 2000
local function checked(now, marker)
  local id, hold, reason = epoch(marker)
  if id ~= ARGV[6] then return {3, id or false} end
  local now_ms = math.floor(now / 1000)
  if now_ms < hold then return {2, hold, now_ms, reason} end
  return nil
end
local function fence_for(counter, now)
  local fence = redis.call('INCR', counter)
  if fence < now then
    fence = now
    redis.call('SET', counter, int(fence))
  end
  return fence
end
-- The exclusive grant: refused while shared leases are live (a waiting bid, ARGV[8] = '1',
-- then records its intent); KEYS[4] shared pool, KEYS[5] its ends, KEYS[6] the intents.
local function grant(now)
  local now_ms = math.floor(now / 1000)
  if redis.call('ZCARD', KEYS[5]) > 0 then
    if redis.call('ZCOUNT', KEYS[5], '(' .. int(now_ms), '+inf') > 0 then
      if ARGV[8] == '1' then
        redis.call('ZADD', KEYS[6], int(now_ms + WRITER_INTENT_MS), ARGV[1])
        redis.call('PEXPIRE', KEYS[6], WRITER_INTENT_MS + tonumber(ARGV[5]))
      end
      return {0}
    end
    redis.call('DEL', KEYS[4], KEYS[5])
  end
  -- Only a bid that waits ever recorded an intent.
  if ARGV[8] == '1' then redis.call('ZREM', KEYS[6], ARGV[1]) end
  local fence = fence_for(KEYS[2], now)
  local ttl = tonumber(ARGV[2])
  local expires = now_ms + ttl
  local kept = ttl + tonumber(ARGV[5])
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', int(fence), 'expires_at', int(expires), 'ttl', int(ttl), 'granted_at', int(now_ms))
  if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'owner', ARGV[4]) end
  if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'request_id', ARGV[7]) end
  redis.call('PEXPIRE', KEYS[1], kept)
  redis.call('PEXPIRE', KEYS[2], kept)
  return {1, fence, expires, ARGV[1], ttl, now_ms}
end
-- CLAIM: SETNX. Checking for the key and writing it are one step, so two claims cannot both see
-- it free. A key that holds the live lease an earlier acquire with the same request id produced
-- answers that lease again (a client repeating an acquire whose answer it lost).
--
-- Joined after lib/prelude.lua and lib/grant.lua. Its call: `Claim` in scripts/grant.rs.
-- KEYS: lock, fence counter, epoch marker, shared pool, its ends, intents.
-- ARGV: token, ttl_ms, has_owner ('1'/'0'), owner, slack_ms, the epoch this broker knows,
--       request_id ('' for none), waits ('1'/'0').
-- Replies: {1, fence, expires_at, token, ttl, now} granted; {0} refused; {2, hold_until, now,
-- reason} a store-wide hold is in force; {3, epoch} the store is in another epoch than the
-- broker knows: it must catch up (put its leases back) before it may grant.
local now = now_us()
local held = checked(now, KEYS[3])
if held then return held end
local cur = redis.call('HMGET', KEYS[1], 'token', 'fence', 'expires_at', 'ttl', 'request_id')
if cur[1] then
  if ARGV[7] ~= '' and cur[5] == ARGV[7] and tonumber(cur[3]) > math.floor(now / 1000) then
    return {1, cur[2], cur[3], cur[1], cur[4], math.floor(now / 1000)}
  end
  return {0}
end
return grant(now)
