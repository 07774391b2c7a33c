-- Shared by every script that grants or hands a key on (CLAIM, TAKE_OVER, JOIN, RELEASE, RENEW,
-- FORCE, LEAVE): the epoch check and the fence every grant takes.
--
-- Checking the epoch in the granting script itself closes the gap between a loss and the moment
-- a broker notices: no broker grants into an emptied store, whatever its timing. `checked`
-- replies `{OTHER_EPOCH, epoch}` when the store is not in the epoch the broker knows — it lost
-- its data, or another broker saw a loss first; on a cluster, the key's slot may also have moved
-- from another master, with that master's epoch — `{ON_HOLD, hold_until, now, reason}` while a
-- store-wide hold is in force, and `{NEWER_LAYOUT, layout}` when a broker of a newer layout runs
-- on the store (this one does not know what it keeps there, and must not grant beside it).
--
-- The fence is taken in the same script as the write that grants, so fences are ordered like
-- grants. (Taking it with INCR before a separate SETNX is not: A INCRs 5, B INCRs 6, B wins and
-- releases, A then wins with 5.) The fence is never below Redis's clock in microseconds: a
-- counter that is missing (a new key, a counter that expired with it, a Redis that restarted
-- empty) or rolled back (a Redis restarted from an older snapshot, a failover to a lagging
-- replica) jumps to the clock, above any fence granted before, as long as the key saw fewer than
-- one grant per microsecond on average and Redis's clock did not step back.
local function checked(now, marker, known)
  local id, hold, reason, layout = epoch(marker)
  if layout > LAYOUT then return {NEWER_LAYOUT, layout} end
  if id ~= known then return {OTHER_EPOCH, id or false} end
  local now_ms = math.floor(now / 1000)
  if now_ms < hold then return {ON_HOLD, hold, now_ms, reason} end
  return nil
end
-- `last`: the fence of the key's exclusive lease record, live or not (0 for none), which the
-- counter need not hold: a grant on the fast path (fast/claim.lua) writes its fence in the lease
-- alone.
--
-- A pool's grant writes its fence in the counter: a pool's records are dropped without keeping
-- their fences (`fence_for`). An exclusive lease's grant only reads it (`exclusive_fence`): the
-- lease record holds its fence, and every script that drops the record keeps the fence in the
-- counter while Redis's clock has not passed it (`kept_fence`) — so a key the queue hands on
-- leaves no counter behind, and its next free claim takes the fast path. `exclusive_fence` also
-- answers whether the counter exists (the caller then keeps it as long as the lease).
local function fence_for(counter, now, last)
  local n = redis.call('INCR', counter)
  local fence = math.max(n, last + 1, now)
  if fence ~= n then redis.call('SET', counter, int(fence)) end
  return fence
end
local function exclusive_fence(counter, now, last)
  local n = redis.call('GET', counter)
  return math.max(tonumber(n or '0') + 1, last + 1, now), n ~= false
end
-- Before a script drops an exclusive lease record (fence `f`, a string, or nil): the fence is
-- kept in the key's `counter` if Redis's clock (`now`, µs) has not passed it (a clock stepped
-- back), since a grant on the fast path (fast/claim.lua) takes the clock as its fence when the
-- key has no counter. With the clock past it, nothing needs it: every later fence is at least
-- the clock.
local function kept_fence(counter, f, now)
  f = tonumber(f)
  if (not f) or f < now then return end
  if tonumber(redis.call('GET', counter) or '0') < f then
    redis.call('SET', counter, int(f), 'PX', int(math.ceil((f - now) / 1000) + SLACK))
  end
end
