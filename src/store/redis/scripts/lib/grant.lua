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
