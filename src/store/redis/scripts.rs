//! The Lua scripts: each store primitive is one script, so that each step of the lock recipe
//! (SETNX to claim, GET to look, GETSET to take over an expired lease, a holder-checked DEL to
//! release) runs atomically on Redis and reads the time from Redis's own clock.
//!
//! Layout of one lock's Redis keys, which share a hash tag so every script stays on one slot of
//! a Redis Cluster: `<prefix>{<key>}:lock`, a hash with `token`, `fence`, `expires_at` (Unix ms
//! on Redis's clock), `ttl`, `granted_at` and, when given, `owner` and `request_id`; and
//! `<prefix>{<key>}:fence`, the key's fence counter.
//!
//! The epoch marker `<prefix>epoch` is a hash, never expired: `id` (the epoch, Redis's clock in
//! µs when it began), `run_id` (the server process it began on), `hold_until` (ms; nothing is
//! granted before it) and `reason` (`settle` or `loss`). On a Redis Cluster there is one marker per slot,
//! `<prefix>epoch{<tag>}`, so that a script's keys stay on one slot. See `epoch.rs` for what an
//! epoch is.

use redis::{Cmd, Script, ToRedisArgs};

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

/// Shared by CLAIM and TAKE_OVER. KEYS: lock, fence counter, epoch marker. ARGV: token, ttl_ms,
/// has_owner ('1'/'0'), owner, slack_ms, the epoch this broker knows, request_id ('' for none)
/// [, the fence of the expired lease seen].
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
local function checked(now)
  local id, hold, reason = epoch(KEYS[3])
  if id ~= ARGV[6] then return {3, id or false} end
  local now_ms = math.floor(now / 1000)
  if now_ms < hold then return {2, hold, now_ms, reason} end
  return nil
end
local function grant(now)
  local fence = redis.call('INCR', KEYS[2])
  if fence < now then
    fence = now
    redis.call('SET', KEYS[2], int(fence))
  end
  local ttl = tonumber(ARGV[2])
  local now_ms = math.floor(now / 1000)
  local expires = now_ms + ttl
  local keep = ttl + tonumber(ARGV[5])
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', int(fence), 'expires_at', int(expires), 'ttl', int(ttl), 'granted_at', int(now_ms))
  if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'owner', ARGV[4]) end
  if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'request_id', ARGV[7]) end
  redis.call('PEXPIRE', KEYS[1], keep)
  redis.call('PEXPIRE', KEYS[2], keep)
  return {1, fence, expires, ARGV[1], ttl, now_ms}
end
"#;

/// SETNX. Checking for the key and writing it are one step, so two claims cannot both see it
/// free. A key that holds the live lease an earlier acquire with the same request id produced
/// answers that lease again (a client repeating an acquire whose answer it lost).
const CLAIM: &str = r#"
local now = now_us()
local held = checked(now)
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
/// it read (ARGV[8] is its fence) writes. A key that vanished in between (the recipe's "GETSET
/// returned nil") is free, and the contender wins it.
const TAKE_OVER: &str = r#"
local now = now_us()
local held = checked(now)
if held then return held end
local cur = redis.call('HMGET', KEYS[1], 'fence', 'expires_at')
if cur[1] then
  if cur[1] ~= ARGV[8] then return {0} end
  if tonumber(cur[2]) > math.floor(now / 1000) then return {0} end
end
return grant(now)
"#;

/// GET, with Redis's clock read in the same step so the expiry is judged on the store's time.
const READ: &str = r#"
local now = math.floor(now_us() / 1000)
local v = redis.call('HMGET', KEYS[1], 'token', 'fence', 'expires_at', 'ttl', 'owner', 'request_id')
return {now, v[1], v[2], v[3], v[4], v[5], v[6]}
"#;

/// Holder check shared by release and renew. KEYS: lock, epoch marker. Codes: 1 held by ARGV[1]
/// (with the lease's expiry), 0 not held (absent or expired), 2 held by another token; 3 — with
/// the hold's end and reason — instead of 0 or 2 while a store-wide hold is in force or the
/// store has no epoch at all (just emptied): leases are being put back, so the key may be about
/// to hold this token's lease again, or lose another's put back by mistake, and "not held" or
/// "not yours" would be a guess.
///
/// The check and the write are one step: the classic GET-then-DEL lets a client whose lease
/// expired between the two delete its successor's lease.
const HOLDER: &str = r#"
local function holder(now_ms)
  local cur = redis.call('HMGET', KEYS[1], 'token', 'expires_at')
  if cur[1] == ARGV[1] and tonumber(cur[2]) > now_ms then return 1, tonumber(cur[2]) end
  local id, hold, reason = epoch(KEYS[2])
  if not id then return 3, 0, 'settle' end
  if now_ms < hold then return 3, hold, reason end
  if not cur[1] or tonumber(cur[2]) <= now_ms then return 0 end
  return 2
end
"#;

/// ARGV: token, notice channel, client key. Publishes the key and the released lease's fence on
/// the channel, so every broker's waiters for it wake at once instead of polling, and the broker
/// that granted it (which may not be this one) drops it from its ledger. Replies `{code, held_ms}`, or `{3, hold_until,
/// now, reason}`.
const RELEASE: &str = r#"
local now = math.floor(now_us() / 1000)
local h, hold, reason = holder(now)
if h == 3 then return {3, hold, now, reason} end
if h ~= 1 then return {h} end
local v = redis.call('HMGET', KEYS[1], 'granted_at', 'fence')
local granted = tonumber(v[1] or now)
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], ARGV[3] .. ' ' .. v[2])
return {1, now - granted}
"#;

/// ARGV: token, ttl_ms, slack_ms, notice channel, client key. A renew that makes the lease end
/// sooner publishes a notice too: waiters timed for the old expiry would oversleep. Replies
/// `{1, fence, expires_at, owner, epoch}`, `{0}`, `{2}` or `{3, hold_until, now, reason}`; the
/// epoch lets the broker tell a renewal that raced a loss (see `RedisStore::remember`).
const RENEW: &str = r#"
local now = math.floor(now_us() / 1000)
local h, expires, reason = holder(now)
if h == 3 then return {3, expires, now, reason} end
if h ~= 1 then return {h} end
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'expires_at', int(now + ttl), 'ttl', int(ttl))
if now + ttl < expires then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[3]))
local v = redis.call('HMGET', KEYS[1], 'fence', 'owner')
return {1, v[1], now + ttl, v[2] or false, redis.call('HGET', KEYS[2], 'id') or ''}
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

/// Puts leases back after a loss. KEYS: epoch marker, then for each lease its lock and fence
/// counter. ARGV: the epoch, slack_ms, then six for each lease: token, fence, remaining_ms,
/// ttl_ms, owner and request id (each '' for none, else '=' and the value).
///
/// For each lease: the fence counter is raised to at least its fence (a store that lost or
/// rolled back counters must not hand out a fence again); then if the key is free (or its lease
/// has ended) the lease is written back with what remains of it (code 1); if the key already
/// holds this token, its end is moved out to what remains if that is later (code 0); if it holds
/// another live lease — only possible if one lock already had two holders, say a broker that was
/// cut off during a loss — the lease with the higher fence stays, and the reply says which
/// (code 2: the other one stays; code 3: this one replaced it), with the other's fence.
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
for i = 0, (#KEYS - 1) / 2 - 1 do
  local lock, counter = KEYS[2 + 2 * i], KEYS[3 + 2 * i]
  local a = 3 + 6 * i
  local token, fence, remaining = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local raised = 0
  if tonumber(redis.call('GET', counter) or '0') < fence then
    redis.call('SET', counter, int(fence))
    raised = 1
  end
  if redis.call('PTTL', counter) < remaining + slack then
    redis.call('PEXPIRE', counter, remaining + slack)
  end
  local cur = redis.call('HMGET', lock, 'token', 'fence', 'expires_at')
  local code, other, write = 1, 0, true
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
    redis.call('DEL', lock)
    redis.call('HSET', lock, 'token', token, 'fence', int(fence), 'expires_at', int(now_ms + remaining), 'ttl', ARGV[a + 3], 'granted_at', int(now_ms))
    if ARGV[a + 4] ~= '' then redis.call('HSET', lock, 'owner', string.sub(ARGV[a + 4], 2)) end
    if ARGV[a + 5] ~= '' then redis.call('HSET', lock, 'request_id', string.sub(ARGV[a + 5], 2)) end
    redis.call('PEXPIRE', lock, remaining + slack)
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
        Self {
            claim: Lua::new([PRELUDE, GRANT, CLAIM].concat()),
            read: Lua::new([PRELUDE, READ].concat()),
            take_over: Lua::new([PRELUDE, GRANT, TAKE_OVER].concat()),
            release: Lua::new([PRELUDE, HOLDER, RELEASE].concat()),
            renew: Lua::new([PRELUDE, HOLDER, RENEW].concat()),
            check: [PRELUDE, CHECK].concat(),
            mark: MARK,
            repair: REPAIR,
            put_back: Lua::new(
                [
                    PRELUDE,
                    &format!("local PUT_BACK_HOLD_MS = {PUT_BACK_HOLD_MS}\n"),
                    PUT_BACK,
                ]
                .concat(),
            ),
        }
    }
}
