//! The Lua scripts: each store primitive is one script, so that each step of the lock recipe
//! (SETNX to claim, GET to look, GETSET to take over an expired lease, a holder-checked DEL to
//! release) runs atomically on Redis and reads the time from Redis's own clock.
//!
//! Layout of one lock's Redis keys, which share a hash tag so every script stays on one slot of
//! a Redis Cluster: `<prefix>{<key>}:lock`, a hash with `token`, `fence`, `expires_at` (Unix ms
//! on Redis's clock), `ttl`, `granted_at` and, when given, `owner` and `request_id`, for the
//! exclusive lease; `<prefix>{<key>}:fence`, the key's fence counter; the shared leases in a
//! pool (below) at `<prefix>{<key>}:shared`; and `<prefix>{<key>}:writers`, a sorted set of the
//! intents of waiting exclusive acquires (token → end, ms), which holds new shared grants back.
//!
//! A pool — the shared leases of a lock, or the permits of a semaphore — is a hash `<pool>`
//! (each holder's token → `fence|expires_at|ttl|granted_at|request_id|owner`, with `owner` `=`
//! and the label or empty for none, and `?<request_id>` → token) and a sorted set
//! `<pool>:ends` (token → expires_at), so ended holders are found without reading every one.
//! A semaphore's pool is `<prefix>{<key>}:sem`, with its limit in the hash's `#limit` and its
//! own fence counter `<prefix>{<key>}:sem:fence`: semaphores and locks are separate spaces.
//!
//! The epoch marker `<prefix>epoch` is a hash, never expired: `id` (the epoch, Redis's clock in
//! µs when it began), `run_id` (the server process it began on), `hold_until` (ms; nothing is
//! granted before it) and `reason` (`settle` or `loss`). On a Redis Cluster there is one marker per slot,
//! `<prefix>epoch{<tag>}`, so that a script's keys stay on one slot. See `epoch.rs` for what an
//! epoch is.

use redis::{Cmd, Script, ToRedisArgs};

use crate::store::WRITER_INTENT_MS;

/// Shared head of every script.
///
/// `TIME` in a script that then writes needs effects replication: the default since Redis 5 and
/// the only mode since 7; `replicate_commands` turns it on for older servers.
///
/// Numbers are formatted with `%.0f` before they are written, because Lua hands `redis.call`
/// numbers as `%.14g`, which would round a 16-digit fence.
const PRELUDE: &str = r#"
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
"#;

/// Helpers of the scripts on pools (shared leases, semaphore permits), kept out of the exclusive
/// path's scripts: each script defines its functions again on every call.
const POOLS: &str = r#"
local function record(rec)
  local f, e, t, g, r, o = string.match(rec, '^(%d+)|(%d+)|(%d+)|(%d+)|([^|]*)|(.*)$')
  return tonumber(f), tonumber(e), tonumber(t), tonumber(g), r, o
end
local function live_count(ends, now_ms)
  return redis.call('ZCOUNT', ends, '(' .. int(now_ms), '+inf')
end
local function keep(key, ms)
  local left = redis.call('PTTL', key)
  if left >= 0 and left < ms then redis.call('PEXPIRE', key, ms) end
  if left == -1 then redis.call('PEXPIRE', key, ms) end
end
-- Drops a holder's request id from its pool, unless the id now names a later holder.
local function drop_rid(pool, rid, token)
  if rid ~= '' and redis.call('HGET', pool, '?' .. rid) == token then
    redis.call('HDEL', pool, '?' .. rid)
  end
end
-- Drops up to 100 ended holders of a pool (hash, ends) per call.
local function prune(pool, ends, now_ms)
  local gone = redis.call('ZRANGEBYSCORE', ends, '-inf', int(now_ms), 'LIMIT', 0, 100)
  for _, token in ipairs(gone) do
    local rec = redis.call('HGET', pool, token)
    if rec then
      local _, _, _, _, rid = record(rec)
      drop_rid(pool, rid, token)
      redis.call('HDEL', pool, token)
    end
    redis.call('ZREM', ends, token)
  end
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
"#;

/// Shared by CLAIM and TAKE_OVER. KEYS: lock, fence counter, epoch marker, shared pool, its ends,
/// intents. ARGV: token, ttl_ms, has_owner ('1'/'0'), owner, slack_ms, the epoch this broker
/// knows, request_id ('' for none), waits ('1'/'0') [, the fence of the expired lease seen].
///
/// Replies: `{1, fence, expires_at, token, ttl, now}` granted; `{0}` refused; `{2, hold_until, now,
/// reason}` a store-wide hold is in force; `{3, epoch}` the store is not in the epoch the broker
/// knows (it lost its data, or another broker saw a loss first; on a cluster, the key's slot may
/// also have moved from another master, with that master's epoch): the broker must catch up —
/// put its leases back — before it may grant.
///
/// Checking the epoch in the granting script itself closes the gap between a loss and the
/// moment a broker notices: no broker grants into an emptied store, whatever its timing.
///
/// The fence is taken in the same script as the write that grants, so fences are ordered like
/// grants. (Taking it with INCR before a separate SETNX is not: A INCRs 5, B INCRs 6, B wins and
/// releases, A then wins with 5.) The fence is never below Redis's clock in microseconds: a
/// counter that is missing (a new key, a counter that expired with it, a Redis that restarted
/// empty) or rolled back (a Redis restarted from an older snapshot, a failover to a lagging
/// replica) jumps to the clock, above any fence granted before, as long as the key saw fewer
/// than one grant per microsecond on average and Redis's clock did not step back.
const GRANT: &str = r#"
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
"#;

/// SETNX. Checking for the key and writing it are one step, so two claims cannot both see it
/// free. A key that holds the live lease an earlier acquire with the same request id produced
/// answers that lease again (a client repeating an acquire whose answer it lost).
const CLAIM: &str = r#"
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
"#;

/// GETSET, made safe. The classic recipe GETSETs blindly and compares the old value afterwards,
/// so a loser has already overwritten the winner's value (the winner's token with it). Here the
/// comparison comes first, in the same step: only a contender that still sees the expired lease
/// it read (ARGV[9] is its fence) writes. A key that vanished in between (the recipe's "GETSET
/// returned nil") is free, and the contender wins it.
const TAKE_OVER: &str = r#"
local now = now_us()
local held = checked(now, KEYS[3])
if held then return held end
local cur = redis.call('HMGET', KEYS[1], 'fence', 'expires_at')
if cur[1] then
  if cur[1] ~= ARGV[9] then return {0} end
  if tonumber(cur[2]) > math.floor(now / 1000) then return {0} end
end
return grant(now)
"#;

/// A shared lease or a semaphore permit: joins a pool if it has room. KEYS: pool, its ends, fence
/// counter, epoch marker [, for a shared lease: the exclusive lease, the intents]. ARGV: token,
/// ttl_ms, owner ('' or '=' and the label), slack_ms, limit ('' for a shared lease), the epoch
/// this broker knows, request_id ('' for none).
///
/// Replies as the grant scripts (`{1, …}`, `{2, …}`, `{3, …}`), or `{4, retry_after_ms}` (no
/// room: an exclusive lease or intent is live, or every permit is taken) or `{5, limit}` (the
/// live holders use that other limit).
const JOIN: &str = r#"
local now = now_us()
local held = checked(now, KEYS[4])
if held then return held end
local now_ms = math.floor(now / 1000)
prune(KEYS[1], KEYS[2], now_ms)
local live = live_count(KEYS[2], now_ms)
if ARGV[5] ~= '' and live > 0 then
  local used = tonumber(redis.call('HGET', KEYS[1], '#limit') or ARGV[5])
  if used ~= tonumber(ARGV[5]) then return {5, used} end
end
if ARGV[7] ~= '' then
  local again = redis.call('HGET', KEYS[1], '?' .. ARGV[7])
  local rec = again and redis.call('HGET', KEYS[1], again)
  if rec then
    local f, e, t = record(rec)
    if e > now_ms then return {1, f, e, again, t, now_ms} end
  end
end
if ARGV[5] == '' then
  local x = redis.call('HGET', KEYS[5], 'expires_at')
  if x then
    if tonumber(x) > now_ms then return {4, tonumber(x) - now_ms} end
    redis.call('DEL', KEYS[5])
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', int(now_ms))
  local w = redis.call('ZRANGE', KEYS[6], 0, 0, 'WITHSCORES')
  if w[1] then return {4, tonumber(w[2]) - now_ms} end
else
  local limit = tonumber(ARGV[5])
  if live > 0 then
    if live >= limit then
      local first = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. int(now_ms), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      return {4, tonumber(first[2]) - now_ms}
    end
  end
  redis.call('HSET', KEYS[1], '#limit', ARGV[5])
end
local fence = fence_for(KEYS[3], now)
local ttl = tonumber(ARGV[2])
local expires = now_ms + ttl
redis.call('HSET', KEYS[1], ARGV[1], int(fence) .. '|' .. int(expires) .. '|' .. int(ttl) .. '|' .. int(now_ms) .. '|' .. ARGV[7] .. '|' .. ARGV[3])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], '?' .. ARGV[7], ARGV[1]) end
redis.call('ZADD', KEYS[2], expires, ARGV[1])
local kept = ttl + tonumber(ARGV[4])
keep(KEYS[1], kept)
keep(KEYS[2], kept)
keep(KEYS[3], kept)
return {1, fence, expires, ARGV[1], ttl, now_ms}
"#;

/// GET, with Redis's clock read in the same step so the expiry is judged on the store's time.
/// KEYS: lock, shared pool, its ends. Replies the clock, the exclusive lease's six fields, then
/// (when there is no exclusive lease record) six for each live shared lease (see `holders`).
const READ: &str = r#"
local now = math.floor(now_us() / 1000)
local v = redis.call('HMGET', KEYS[1], 'token', 'fence', 'expires_at', 'ttl', 'owner', 'request_id')
local out = {now, v[1] or false, v[2] or false, v[3] or false, v[4] or false, v[5] or false, v[6] or false}
-- No shared lease is live beside an exclusive lease record (a shared grant deletes an expired
-- one, an exclusive grant needs no live shared lease): the exclusive path skips the look.
if v[1] then return out end
for _, x in ipairs(holders(KEYS[2], KEYS[3], now)) do out[#out + 1] = x end
return out
"#;

/// A semaphore's live holders. KEYS: pool, its ends. Replies the clock, the limit (or false),
/// then six fields for each holder.
const PERMITS: &str = r#"
local now = math.floor(now_us() / 1000)
local out = {now, redis.call('HGET', KEYS[1], '#limit') or false}
for _, x in ipairs(holders(KEYS[1], KEYS[2], now)) do out[#out + 1] = x end
return out
"#;

/// Holder check shared by release and renew. KEYS: exclusive lock (for a semaphore: its pool
/// again, where no such lease is), epoch marker, pool, its ends. Codes: 1 the exclusive lease is
/// ARGV[1]'s (with its expiry), 4 a pool lease is (with its expiry and record), 0 not held
/// (absent or expired), 2 held by another token; 3 — with the hold's end and reason — instead of
/// 0 or 2 while a store-wide hold is in force or the store has no epoch at all (just emptied):
/// leases are being put back, so the key may be about to hold this token's lease again, or lose
/// another's put back by mistake, and "not held" or "not yours" would be a guess.
///
/// The check and the write are one step: the classic GET-then-DEL lets a client whose lease
/// expired between the two delete its successor's lease.
const HOLDER: &str = r#"
local function holder(now_ms)
  local cur = redis.call('HMGET', KEYS[1], 'token', 'expires_at')
  if cur[1] == ARGV[1] and tonumber(cur[2]) > now_ms then return 1, tonumber(cur[2]) end
  local rec = redis.call('HGET', KEYS[3], ARGV[1])
  if rec then
    local _, e = record(rec)
    if e > now_ms then return 4, e, rec end
  end
  local id, hold, reason = epoch(KEYS[2])
  if not id then return 3, 0, 'settle' end
  if now_ms < hold then return 3, hold, reason end
  local exclusive = KEYS[1] ~= KEYS[3] and cur[1] and tonumber(cur[2]) > now_ms
  if (not exclusive) and live_count(KEYS[4], now_ms) == 0 then return 0 end
  return 2
end
local function leave_pool(rec)
  local _, _, _, _, rid = record(rec)
  redis.call('HDEL', KEYS[3], ARGV[1])
  drop_rid(KEYS[3], rid, ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
end
"#;

/// ARGV: token, notice channel, notice key (the client key; `#` and the key for a semaphore).
/// Publishes the notice key and the released lease's fence on the channel, so every broker's
/// waiters for it wake at once instead of polling, and the broker that granted it (which may not
/// be this one) drops it from its ledger. Replies `{code, held_ms}`, or `{3, hold_until, now,
/// reason}`.
const RELEASE: &str = r#"
local now = math.floor(now_us() / 1000)
local h, hold, reason = holder(now)
if h == 3 then return {3, hold, now, reason} end
if h == 4 then
  local f, _, _, g = record(reason)
  leave_pool(reason)
  redis.call('PUBLISH', ARGV[2], ARGV[3] .. ' ' .. int(f))
  return {1, math.max(0, now - g)}
end
if h ~= 1 then return {h} end
local v = redis.call('HMGET', KEYS[1], 'granted_at', 'fence')
local granted = tonumber(v[1] or now)
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], ARGV[3] .. ' ' .. v[2])
return {1, math.max(0, now - granted)}
"#;

/// ARGV: token, ttl_ms, slack_ms, notice channel, notice key. A renew that makes the lease end
/// sooner publishes a notice too: waiters timed for the old expiry would oversleep. Replies
/// `{1, fence, expires_at, owner, epoch}` (a pool lease: and the semaphore's limit, or ''), `{0}`,
/// `{2}` or `{3, hold_until, now, reason}`; the epoch lets the broker tell a renewal that raced
/// a loss (see `RedisStore::remember`).
const RENEW: &str = r#"
local now = math.floor(now_us() / 1000)
local h, expires, reason = holder(now)
if h == 3 then return {3, expires, now, reason} end
local ttl = tonumber(ARGV[2])
if h == 4 then
  local f, _, _, g, r, o = record(reason)
  redis.call('HSET', KEYS[3], ARGV[1], int(f) .. '|' .. int(now + ttl) .. '|' .. int(ttl) .. '|' .. int(g) .. '|' .. r .. '|' .. o)
  redis.call('ZADD', KEYS[4], int(now + ttl), ARGV[1])
  if now + ttl < expires then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
  keep(KEYS[3], ttl + tonumber(ARGV[3]))
  keep(KEYS[4], ttl + tonumber(ARGV[3]))
  return {1, f, now + ttl, (o ~= '' and string.sub(o, 2)) or false, redis.call('HGET', KEYS[2], 'id') or '', redis.call('HGET', KEYS[3], '#limit') or ''}
end
if h ~= 1 then return {h} end
redis.call('HSET', KEYS[1], 'expires_at', int(now + ttl), 'ttl', int(ttl))
if now + ttl < expires then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[3]))
local v = redis.call('HMGET', KEYS[1], 'fence', 'owner')
return {1, v[1], now + ttl, v[2] or false, redis.call('HGET', KEYS[2], 'id') or ''}
"#;

/// Ends every live lease on a key without its token. KEYS and the first ARGV as for RELEASE
/// (no token). Publishes the notice key, the highest fence ended and `*` (every lease up to that
/// fence is over). Replies `{1, fences…}` (none: nothing was live), or `{3, hold_until, now,
/// reason}` while a store-wide hold is in force.
const FORCE: &str = r#"
local now = math.floor(now_us() / 1000)
local id, hold, reason = epoch(KEYS[2])
if not id then return {3, 0, now, 'settle'} end
if now < hold then return {3, hold, now, reason} end
local out = {1}
local top = 0
if KEYS[1] ~= KEYS[3] then
  local cur = redis.call('HMGET', KEYS[1], 'fence', 'expires_at')
  if cur[1] and tonumber(cur[2]) > now then
    out[#out + 1] = tonumber(cur[1])
    top = tonumber(cur[1])
  end
  redis.call('DEL', KEYS[1])
end
local live = holders(KEYS[3], KEYS[4], now)
for i = 2, #live, 6 do
  out[#out + 1] = live[i]
  if live[i] > top then top = live[i] end
end
redis.call('DEL', KEYS[3], KEYS[4])
if top > 0 then redis.call('PUBLISH', ARGV[1], ARGV[2] .. ' ' .. int(top) .. ' *') end
return out
"#;

/// The epoch check, run on every new connection before it is used, once a second, and when
/// another broker announces a new epoch. KEYS: epoch marker. ARGV: the epoch this broker knows
/// ('' if none), store_settle_ms, store_loss_delay_ms, notice channel.
///
/// The server process is read here (`INFO server`'s `run_id`), in the same step as the marker
/// and so on the very server that holds it: on a cluster, a keyless `INFO` sent separately can
/// reach another node while the cluster's slots move.
///
/// A new epoch begins — with a store-wide hold of `store_settle_ms`, announced on the channel —
/// when the marker is missing (a new store, or one emptied by a restart without persistence or a
/// flush) or was written on another server process (a restart from disk that may have lost its
/// last writes, a replica promoted that may have missed some). A broker that knew another epoch
/// than the current one has seen a loss: the reason becomes `loss`, and the optional paranoid
/// `store_loss_delay_ms` stretches the hold to that long after the epoch began.
///
/// Replies `{id, hold_until, now, reason, run_id}`.
const CHECK: &str = r#"
local now = now_us()
local now_ms = math.floor(now / 1000)
local server = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
local m = redis.call('HMGET', KEYS[1], 'id', 'run_id', 'hold_until', 'reason')
local id, run, hold, reason = m[1], m[2], tonumber(m[3] or '0'), m[4] or ''
if (not id) or run ~= server then
  if id or ARGV[1] ~= '' then reason = 'loss' else reason = 'settle' end
  id = int(now)
  hold = math.max(hold, now_ms + tonumber(ARGV[2]))
  redis.call('HSET', KEYS[1], 'id', id, 'run_id', server, 'hold_until', int(hold), 'reason', reason)
  redis.call('PUBLISH', ARGV[4], '!epoch')
end
if ARGV[1] ~= '' and ARGV[1] ~= id then
  hold = math.max(hold, math.floor(tonumber(id) / 1000) + tonumber(ARGV[3]))
  reason = 'loss'
  redis.call('HSET', KEYS[1], 'hold_until', int(hold), 'reason', reason)
end
return {id, hold, now_ms, reason, server}
"#;

/// Cluster only: copies a master's epoch (as CHECK left it on the master's first slot) to the
/// marker of another of its slots, unless that marker is already in that epoch. KEYS: the slot's
/// marker. ARGV: id, run_id, hold_until, reason.
const MARK: &str = r#"
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then
  redis.call('HSET', KEYS[1], 'id', ARGV[1], 'run_id', ARGV[2], 'hold_until', ARGV[3], 'reason', ARGV[4])
end
return 1
"#;

/// Cluster only: gives back a slot its marker, lost on its own (deleted or evicted), in its
/// master's epoch with a hold, and announces it. KEYS: the slot's marker. ARGV: id, hold_ms,
/// notice channel, announcement. Replies 1 if it wrote the marker, 0 if one was there.
const REPAIR: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'run_id', '', 'hold_until', string.format('%.0f', now_ms + tonumber(ARGV[2])), 'reason', 'loss')
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
"#;

/// Puts leases back after a loss. KEYS: epoch marker, then for each lease four keys: for an
/// exclusive lease its lock, fence counter, shared pool and its ends; for a pool lease (shared or
/// permit) the pool, its ends, fence counter and the exclusive lock (for a permit: the pool
/// again). ARGV: the epoch, slack_ms, then seven for each lease: kind (`x` exclusive, `s`
/// shared, or the semaphore's limit), token, fence, remaining_ms, ttl_ms, owner and request id
/// (each '' for none, else '=' and the value).
///
/// For each lease: the fence counter is raised to at least its fence (a store that lost or
/// rolled back counters must not hand out a fence again); then if the key is free (or its lease
/// has ended) the lease is written back with what remains of it (code 1); if the key already
/// holds this token, its end is moved out to what remains if that is later (code 0); if it holds
/// another live lease — only possible if one lock already had two holders, say a broker that was
/// cut off during a loss — the lease with the higher fence stays, and the reply says which
/// (code 2: the other one stays; code 3: this one replaced it), with the other's fence. An
/// exclusive lease and live shared ones are such a conflict too; pool leases (shared leases, a
/// semaphore's permits) do not conflict with each other.
///
/// Each batch keeps the store-wide hold in force for at least `PUT_BACK_HOLD_MS` more: a
/// broker with many leases to put back may need longer than the settle time, and no other
/// broker may grant one of its keys before it is back.
///
/// Replies `{-1}` if the store is no longer in that epoch (a loss during the put-back: start
/// over), else three numbers per lease: code, the other lease's fence (or 0), and 1 if the
/// counter had to be raised.
const PUT_BACK: &str = r#"
local now_ms = math.floor(now_us() / 1000)
local m = redis.call('HMGET', KEYS[1], 'id', 'hold_until')
if m[1] ~= ARGV[1] then return {-1} end
if tonumber(m[2] or '0') < now_ms + PUT_BACK_HOLD_MS then
  redis.call('HSET', KEYS[1], 'hold_until', int(now_ms + PUT_BACK_HOLD_MS))
end
local slack = tonumber(ARGV[2])
local out = {}
for i = 0, (#KEYS - 1) / 4 - 1 do
  local k1, k2, k3, k4 = KEYS[2 + 4 * i], KEYS[3 + 4 * i], KEYS[4 + 4 * i], KEYS[5 + 4 * i]
  local a = 3 + 7 * i
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
  local code, other, write = 1, 0, true
  if kind == 'x' then
    local lock, pool, ends = k1, k3, k4
    local cur = redis.call('HMGET', lock, 'token', 'fence', 'expires_at')
    if cur[1] and tonumber(cur[3]) > now_ms then
      if cur[1] == token then
        code, write = 0, false
        if now_ms + remaining > tonumber(cur[3]) then
          redis.call('HSET', lock, 'expires_at', int(now_ms + remaining))
          redis.call('PEXPIRE', lock, remaining + slack)
        end
      elseif tonumber(cur[2]) > fence then
        code, other, write = 2, tonumber(cur[2]), false
      else
        code, other = 3, tonumber(cur[2])
      end
    end
    if write then
      local live = holders(pool, ends, now_ms)
      for j = 2, #live, 6 do
        if live[j] > fence then code, other, write = 2, live[j], false end
      end
      if write and #live > 0 then
        code, other = 3, live[#live - 4]
        redis.call('DEL', pool, ends)
      end
    end
    if write then
      redis.call('DEL', lock)
      redis.call('HSET', lock, 'token', token, 'fence', int(fence), 'expires_at', int(now_ms + remaining), 'ttl', ttl, 'granted_at', int(now_ms))
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
        code, write = 0, false
        if now_ms + remaining > e then
          redis.call('HSET', pool, token, int(f) .. '|' .. int(now_ms + remaining) .. '|' .. int(t) .. '|' .. int(g) .. '|' .. r .. '|' .. o)
          redis.call('ZADD', ends, int(now_ms + remaining), token)
        end
      end
    end
    if write and lock ~= pool then
      local cur = redis.call('HMGET', lock, 'fence', 'expires_at')
      if cur[1] and tonumber(cur[2]) > now_ms and tonumber(cur[1]) > fence then
        code, other, write = 2, tonumber(cur[1]), false
      elseif cur[1] then
        if tonumber(cur[2]) > now_ms then code, other = 3, tonumber(cur[1]) end
        redis.call('DEL', lock)
      end
    end
    if write and kind ~= 's' and live_count(ends, now_ms) == 0 then
      redis.call('HSET', pool, '#limit', kind)
    end
    if write then
      local r = (rid ~= '' and string.sub(rid, 2)) or ''
      redis.call('HSET', pool, token, int(fence) .. '|' .. int(now_ms + remaining) .. '|' .. ttl .. '|' .. int(now_ms) .. '|' .. r .. '|' .. owner)
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
"#;

/// How much longer each put-back batch keeps the store-wide hold in force (see PUT_BACK).
const PUT_BACK_HOLD_MS: u64 = 1_000;

/// One script: its source, and its SHA1 (from the `redis` crate's `Script`).
pub(super) struct Lua {
    source: String,
    sha: Script,
}

impl Lua {
    fn new(source: String) -> Self {
        Self {
            sha: Script::new(&source),
            source,
        }
    }

    /// A call of this script, to fill with keys and arguments.
    pub fn call(&self) -> Call<'_> {
        Call {
            lua: self,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }
}

/// A script call: run by SHA ([`Call::by_sha`]), or with its source ([`Call::with_source`]) when
/// the server answers NOSCRIPT. What the server does on NOSCRIPT is the store's decision (see
/// `RedisStore::invoke`): the crate's own fallback would load the script on every master of a
/// cluster.
pub(super) struct Call<'a> {
    lua: &'a Lua,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call<'_> {
    pub fn key(&mut self, key: impl ToRedisArgs) -> &mut Self {
        key.write_redis_args(&mut self.keys);
        self
    }

    pub fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    /// `EVALSHA`: the server runs the script if it has it cached.
    pub fn by_sha(&self) -> Cmd {
        self.command("EVALSHA", self.lua.sha.get_hash().as_bytes())
    }

    /// `EVAL` with the source, which also caches it on that server.
    pub fn with_source(&self) -> Cmd {
        self.command("EVAL", self.lua.source.as_bytes())
    }

    fn command(&self, verb: &str, script: &[u8]) -> Cmd {
        let mut cmd = redis::cmd(verb);
        cmd.arg(script)
            .arg(self.keys.len())
            .arg(&*self.keys)
            .arg(&*self.args);
        cmd
    }
}

/// Built once: each script's SHA is computed at construction.
pub(super) struct Scripts {
    pub claim: Lua,
    pub read: Lua,
    pub take_over: Lua,
    pub release: Lua,
    pub renew: Lua,
    pub join: Lua,
    pub permits: Lua,
    pub force: Lua,
    /// The epoch check's source, run with plain EVAL: this background check, once a second,
    /// then shows apart from the lock operations in Redis's command statistics.
    pub check: String,
    /// Run with plain EVAL too, and only when a master's epoch changes.
    pub mark: &'static str,
    /// Plain EVAL, on the rare slot whose marker alone went missing.
    pub repair: &'static str,
    pub put_back: Lua,
}

impl Scripts {
    pub fn new() -> Self {
        let intent = format!("local WRITER_INTENT_MS = {WRITER_INTENT_MS}\n");
        Self {
            claim: Lua::new([PRELUDE, &intent, GRANT, CLAIM].concat()),
            read: Lua::new([PRELUDE, POOLS, READ].concat()),
            take_over: Lua::new([PRELUDE, &intent, GRANT, TAKE_OVER].concat()),
            release: Lua::new([PRELUDE, POOLS, HOLDER, RELEASE].concat()),
            renew: Lua::new([PRELUDE, POOLS, HOLDER, RENEW].concat()),
            join: Lua::new([PRELUDE, POOLS, &intent, GRANT, JOIN].concat()),
            permits: Lua::new([PRELUDE, POOLS, PERMITS].concat()),
            force: Lua::new([PRELUDE, POOLS, FORCE].concat()),
            check: [PRELUDE, CHECK].concat(),
            mark: MARK,
            repair: REPAIR,
            put_back: Lua::new(
                [
                    PRELUDE,
                    POOLS,
                    &format!("local PUT_BACK_HOLD_MS = {PUT_BACK_HOLD_MS}\n"),
                    PUT_BACK,
                ]
                .concat(),
            ),
        }
    }
}
