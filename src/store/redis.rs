//! The Redis store: each primitive is one Lua script, run by SHA over one multiplexed,
//! self-reconnecting connection, reading the time from Redis's own `TIME`.
//!
//! Layout of one lock's Redis keys (they share a hash tag, so every script stays valid on a
//! Redis Cluster): `<prefix>{<key>}:lock`, a hash with `token`, `fence`, `expires_at` (Unix ms on
//! Redis's clock), `ttl` and, when given, `owner`; and `<prefix>{<key>}:fence`, the key's fence
//! counter.

use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;
use std::time::Instant;

use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, PubSubSink, PubSubStream};
use redis::io::tcp::{TcpSettings, socket2};
use redis::{FromRedisValue, IntoConnectionInfo, RedisError, Script, Value};

use super::{
    Bid, Claim, EXPIRY_SLACK_MS, HeldBack, Holder, Lease, Released, Snapshot, Store, StoreError,
    TakeOver,
};
use crate::domain::{Fence, LockKey, Owner, RequestId, Token, Ttl};
use crate::waiters::Waiters;

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
"#;

/// The store's incarnation, checked before anything is granted. KEYS[3] is a hash, never
/// expired, with `id` (Redis's clock in µs when it was created) and `hold_until` (ms).
///
/// A Redis that restarts empty forgets every lease while their holders still believe they hold
/// them. The brokers notice: each remembers the id it last saw and passes it as ARGV[6]. A
/// broker that knew an id and finds the marker missing, or finds another id (a broker that knew
/// nothing re-created it first), holds every grant back until `store_loss_delay_ms` after
/// the current marker's birth, by which time every lease of the lost data has ended. Every
/// broker checks the marker as soon as its notice listener connects (creating it on a new
/// store) and again on every reconnect, so brokers that never grant know it too, and a loss is
/// usually flagged store-wide before any grant. What it cannot see: a store that lost its data
/// while no running broker had seen it (every broker restarted too) looks new, and is used at
/// once.
///
/// A broker that never saw the old store cannot tell a store that lost its data from a new
/// one, and may reach it first (started after the loss, say, while the others reconnect). So a
/// marker is born holding grants back for `store_settle_ms`: long enough for the brokers that
/// knew the old store, reconnecting with at most a second between tries, to check it and set
/// the longer hold. ARGV[7] is `<store_loss_delay_ms>,<store_settle_ms>`.
///
/// (On Redis Cluster this marker will have to be one per node; it is the one key here that
/// belongs to no lock.)
const INCARNATION: &str = r#"
local function incarnation(now)
  local delay, settle = string.match(ARGV[7], '^(%d+),(%d+)$')
  local m = redis.call('HMGET', KEYS[3], 'id', 'hold_until')
  local id, hold = m[1], tonumber(m[2] or '0')
  if not id then
    id = int(now)
    hold = math.floor(now / 1000) + tonumber(settle)
    redis.call('HSET', KEYS[3], 'id', id, 'hold_until', int(hold))
  end
  if ARGV[6] ~= '' and ARGV[6] ~= id then
    local until_ms = math.floor(tonumber(id) / 1000) + tonumber(delay)
    if until_ms > hold then
      hold = until_ms
      redis.call('HSET', KEYS[3], 'hold_until', int(hold))
    end
  end
  return id, hold
end
"#;

/// Writes ARGV's bid into KEYS[1] with the next fence from KEYS[2].
///
/// ARGV: token, ttl_ms, has_owner ('1'/'0'), owner, slack_ms, known incarnation,
/// store_loss_delay_ms, request_id ('' for none)[, seen fence].
/// Replies: `{1, fence, expires_at, token, ttl, incarnation}` granted; `{0, incarnation}` taken
/// or lost; `{2, hold_until, now, incarnation}` held back after a data loss.
///
/// The fence is taken in the same script as the write that grants, so fences are ordered like
/// grants. (Taking it with INCR before a separate SETNX is not: A INCRs 5, B INCRs 6, B wins and
/// releases, A then wins with 5.) The fence is never below Redis's clock in microseconds: a
/// counter that is missing (a new key, a counter that expired with it, a Redis that restarted
/// empty) or rolled back (a Redis restarted from an older snapshot, a failover to a lagging
/// replica) jumps to the clock, above any fence granted before, as long as the key saw fewer
/// than one grant per microsecond on average and Redis's clock did not step back.
const GRANT: &str = r#"
local function grant(now, inc)
  local fence = redis.call('INCR', KEYS[2])
  if fence < now then
    fence = now
    redis.call('SET', KEYS[2], int(fence))
  end
  local ttl = tonumber(ARGV[2])
  local expires = math.floor(now / 1000) + ttl
  local keep = ttl + tonumber(ARGV[5])
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', int(fence), 'expires_at', int(expires), 'ttl', int(ttl), 'granted_at', int(math.floor(now / 1000)))
  if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'owner', ARGV[4]) end
  if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'request_id', ARGV[8]) end
  redis.call('PEXPIRE', KEYS[1], keep)
  redis.call('PEXPIRE', KEYS[2], keep)
  return {1, fence, expires, ARGV[1], ttl, inc}
end
local function checked(now)
  local inc, hold = incarnation(now)
  local now_ms = math.floor(now / 1000)
  if now_ms < hold then return inc, {2, hold, now_ms, inc} end
  return inc, nil
end
"#;

/// SETNX. Checking for the key and writing it are one step, so two claims cannot both see it
/// free. A key that holds the live lease an earlier acquire with the same request id produced
/// answers that lease again (a client repeating an acquire whose answer it lost).
const CLAIM: &str = r#"
local now = now_us()
local inc, held = checked(now)
if held then return held end
local cur = redis.call('HMGET', KEYS[1], 'token', 'fence', 'expires_at', 'ttl', 'request_id')
if cur[1] then
  if ARGV[8] ~= '' and cur[5] == ARGV[8] and tonumber(cur[3]) > math.floor(now / 1000) then
    return {1, cur[2], cur[3], cur[1], cur[4], inc}
  end
  return {0, inc}
end
return grant(now, inc)
"#;

/// The incarnation check alone, run by each broker's notice listener whenever it (re)connects:
/// a broker that knew the store notices a loss at once, and sets the hold-back in the marker
/// before an idle broker that knew nothing can grant. ARGV as for GRANT (only 6 and 7 are read).
const CHECK: &str = r#"
local id, hold = incarnation(now_us())
return id
"#;

/// GET, with Redis's clock read in the same step so the expiry is judged on the store's time.
/// Also answers the store's incarnation (KEYS[2]), so a broker that only reads learns it too.
const READ: &str = r#"
local now = math.floor(now_us() / 1000)
local v = redis.call('HMGET', KEYS[1], 'token', 'fence', 'expires_at', 'ttl', 'owner', 'request_id')
return {now, v[1], v[2], v[3], v[4], v[5], v[6], redis.call('HGET', KEYS[2], 'id')}
"#;

/// GETSET, made safe. The seeds GETSET blindly and compare the old value afterwards, so a loser
/// has already overwritten the winner's value (the winner's token with it). Here the comparison
/// comes first, in the same step: only a contender that still sees the expired lease it read
/// (ARGV[9] is its fence) writes. A key that vanished in between (the seeds' "GETSET returned
/// nil") is free, and the contender wins it.
const TAKE_OVER: &str = r#"
local now = now_us()
local inc, held = checked(now)
if held then return held end
local cur = redis.call('HMGET', KEYS[1], 'fence', 'expires_at')
if cur[1] then
  if cur[1] ~= ARGV[9] then return {0, inc} end
  if tonumber(cur[2]) > math.floor(now / 1000) then return {0, inc} end
end
return grant(now, inc)
"#;

/// Holder check shared by release and renew: 0 not held (absent or expired), 2 held by another
/// token, 1 held by ARGV[1]; and the lease's expiry. The check and the write are one step: the
/// seeds' GET-then-DEL lets a client whose lease expired between the two delete its successor's
/// lease.
const HOLDER: &str = r#"
local function holder(now_ms)
  local cur = redis.call('HMGET', KEYS[1], 'token', 'expires_at')
  if not cur[1] or tonumber(cur[2]) <= now_ms then return 0 end
  if cur[1] ~= ARGV[1] then return 2 end
  return 1, tonumber(cur[2])
end
"#;

/// ARGV: token, notice channel, client key. Publishes the key on the channel, so every broker's
/// waiters for it wake at once instead of polling. Replies `{code, held_ms}`.
const RELEASE: &str = r#"
local now = math.floor(now_us() / 1000)
local h = holder(now)
if h ~= 1 then return {h, false} end
local granted = tonumber(redis.call('HGET', KEYS[1], 'granted_at') or now)
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return {1, now - granted}
"#;

/// ARGV: token, ttl_ms, slack_ms, notice channel, client key. A renew that makes the lease end
/// sooner publishes a notice too: waiters timed for the old expiry would oversleep.
const RENEW: &str = r#"
local now = math.floor(now_us() / 1000)
local h, expires = holder(now)
if h ~= 1 then return {h, false, false, false} end
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'expires_at', int(now + ttl), 'ttl', int(ttl))
if now + ttl < expires then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[3]))
local v = redis.call('HMGET', KEYS[1], 'fence', 'owner')
return {1, v[1], now + ttl, v[2]}
"#;

/// Connection settings for [`RedisStore::connect`].
#[derive(Debug, Clone)]
pub struct RedisSettings {
    pub url: String,
    /// Prepended to every Redis key the broker writes.
    pub key_prefix: String,
    /// Bound on one store call, connecting included.
    pub timeout: Duration,
    /// After a broker notices that Redis lost its data, how long nothing is granted: at least
    /// the longest lease that may have been live.
    pub store_loss_delay: Duration,
    /// When a broker finds no incarnation marker (a new Redis, or one that lost its data), how
    /// long grants wait, so that brokers that knew the old store reach it and, if it lost its
    /// data, hold grants back before anything is granted.
    pub store_settle: Duration,
}

/// The Redis store. Cloning is cheap: the connection is multiplexed and shared.
#[derive(Clone)]
pub struct RedisStore {
    /// Kept for the notice subscriber, which needs a connection of its own (a subscribed
    /// connection can issue no other commands).
    client: redis::Client,
    /// The multiplexed connection, swapped for a fresh one when a call times out (see
    /// `replace_connection`). A std RwLock: held only to clone or swap the handle.
    conn: Arc<RwLock<ConnectionManager>>,
    manager_config: ConnectionManagerConfig,
    /// When the connection was last replaced, so a burst of timeouts replaces it once.
    replaced_at: Arc<std::sync::Mutex<Option<Instant>>>,
    prefix: String,
    /// `<prefix>released`: where releases publish the client key.
    channel: String,
    /// `<prefix>incarnation`: the marker that tells a Redis that lost its data (see INCARNATION).
    marker: String,
    /// The marker id this broker saw last; empty before the first grant attempt.
    incarnation: Arc<std::sync::Mutex<String>>,
    /// ARGV[7] of the incarnation check: `<store_loss_delay_ms>,<store_settle_ms>`.
    hold_args: String,
    timeout: Duration,
    scripts: Arc<Scripts>,
}

/// Built once: each `Script` hashes its source at construction and runs by EVALSHA afterwards,
/// loading itself on NOSCRIPT (after a Redis restart, say).
struct Scripts {
    claim: Script,
    read: Script,
    take_over: Script,
    release: Script,
    renew: Script,
    /// The incarnation check's source, run with plain EVAL (see `check_incarnation`).
    check: String,
}

impl Scripts {
    fn new() -> Self {
        Self {
            claim: Script::new(&[PRELUDE, INCARNATION, GRANT, CLAIM].concat()),
            read: Script::new(&[PRELUDE, READ].concat()),
            take_over: Script::new(&[PRELUDE, INCARNATION, GRANT, TAKE_OVER].concat()),
            release: Script::new(&[PRELUDE, HOLDER, RELEASE].concat()),
            renew: Script::new(&[PRELUDE, HOLDER, RENEW].concat()),
            check: [PRELUDE, INCARNATION, CHECK].concat(),
        }
    }
}

impl RedisStore {
    /// Sets up the connection without waiting for Redis: the broker starts (and says it is not
    /// ready) while Redis is down, and the connection manager reconnects by itself when it
    /// returns.
    pub fn connect(settings: &RedisSettings) -> Result<Self, StoreError> {
        let info = settings
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| StoreError::Failed(format!("invalid Redis URL: {e}")))?;
        // A response timeout alone does not make the connection manager reconnect: on a
        // connection whose far end vanished without a reset (a host gone, a black-holing
        // middlebox), every call would time out until the kernel gave up, minutes later.
        // TCP_USER_TIMEOUT bounds how long sent data may stay unacknowledged, and keepalive
        // probes an idle one, so such a connection fails and is replaced within a few seconds.
        let tcp = TcpSettings::default().set_nodelay(true).set_keepalive(
            socket2::TcpKeepalive::new()
                .with_time(Duration::from_secs(5))
                .with_interval(Duration::from_secs(1)),
        );
        #[cfg(target_os = "linux")]
        let tcp = tcp.set_user_timeout(settings.timeout.max(Duration::from_secs(1)));
        let client = redis::Client::open(info.set_tcp_settings(tcp))
            .map_err(|e| StoreError::Failed(format!("invalid Redis URL: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(settings.timeout))
            .set_response_timeout(Some(settings.timeout))
            // Reconnect quickly and keep trying: a request that finds the connection down fails
            // at once with 503, and the next one may already find it back.
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_secs(1))
            .set_number_of_retries(3);
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
            .map_err(|e| StoreError::Failed(format!("cannot set up the Redis connection: {e}")))?;
        Ok(Self {
            client,
            conn: Arc::new(RwLock::new(conn)),
            manager_config: config,
            replaced_at: Arc::default(),
            prefix: settings.key_prefix.clone(),
            channel: format!("{}released", settings.key_prefix),
            marker: format!("{}incarnation", settings.key_prefix),
            incarnation: Arc::default(),
            hold_args: format!(
                "{},{}",
                duration_ms(settings.store_loss_delay),
                duration_ms(settings.store_settle)
            ),
            timeout: settings.timeout,
            scripts: Arc::new(Scripts::new()),
        })
    }

    fn keys(&self, key: &LockKey) -> [String; 2] {
        [
            format!("{}{{{}}}:lock", self.prefix, key),
            format!("{}{{{}}}:fence", self.prefix, key),
        ]
    }

    /// Runs one call with the store's time bound. The connection has the same bound on each
    /// response; this one also covers waiting for a reconnect.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) if e.is_timeout() => Err(self.timed_out()),
            Ok(Err(e)) => Err(StoreError::Failed(e.to_string())),
            Err(_) => Err(self.timed_out()),
        }
    }

    /// A handle on the current connection (cheap: the manager is a shared, multiplexed handle).
    fn connection(&self) -> ConnectionManager {
        self.conn.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Swaps in a fresh connection after a timeout. A response timeout alone does not make the
    /// connection manager reconnect, and a connection whose far end stopped answering while
    /// something still acknowledges its packets (a black-holing proxy or middlebox) would time
    /// out every call forever. At most once per store timeout; the old connection closes when
    /// the calls still using it finish.
    fn replace_connection(&self) {
        {
            let mut replaced_at = self.replaced_at.lock().unwrap_or_else(|e| e.into_inner());
            if replaced_at.is_some_and(|at| at.elapsed() < self.timeout) {
                return;
            }
            *replaced_at = Some(Instant::now());
        }
        match ConnectionManager::new_lazy_with_config(
            self.client.clone(),
            self.manager_config.clone(),
        ) {
            Ok(fresh) => {
                tracing::warn!("a Redis call timed out: replacing the connection");
                *self.conn.write().unwrap_or_else(|e| e.into_inner()) = fresh;
            }
            Err(e) => tracing::warn!(error = %e, "cannot set up a fresh Redis connection"),
        }
    }

    fn timed_out(&self) -> StoreError {
        self.replace_connection();
        StoreError::Timeout(duration_ms(self.timeout))
    }

    /// Runs CLAIM or TAKE_OVER for `bid`.
    async fn grant_script(
        &self,
        script: &Script,
        key: &LockKey,
        bid: &Bid,
        seen: Option<Fence>,
    ) -> Result<GrantReply, StoreError> {
        let [lock, fence] = self.keys(key);
        let known = self.known_incarnation();
        let mut inv = script.key(lock);
        inv.key(fence)
            .key(&self.marker)
            .arg(bid.token.as_str())
            .arg(bid.ttl.as_ms())
            .arg(if bid.owner.is_some() { "1" } else { "0" })
            .arg(bid.owner.as_ref().map_or("", |o| o.as_str()))
            .arg(EXPIRY_SLACK_MS)
            .arg(&known)
            .arg(&self.hold_args)
            .arg(bid.request_id.as_ref().map_or("", |r| r.as_str()));
        if let Some(seen) = seen {
            inv.arg(seen);
        }
        let mut conn = self.connection();
        let reply: Vec<Value> = self.bounded(inv.invoke_async(&mut conn)).await?;
        let (outcome, incarnation) = match field::<u8>(&reply, 0)? {
            0 => (GrantReply::Refused, field::<String>(&reply, 1)?),
            1 => {
                let token: String = field(&reply, 3)?;
                let lease = Lease {
                    // The bid's own token, or the one of the earlier grant this repeats.
                    token: if token == bid.token.as_str() {
                        bid.token.clone()
                    } else {
                        Token::parse(&token).map_err(|_| corrupt("token"))?
                    },
                    fence: field(&reply, 1)?,
                    expires_at_ms: field(&reply, 2)?,
                    ttl_ms: field(&reply, 4)?,
                    owner: bid.owner.clone(),
                    request_id: bid.request_id.clone(),
                };
                (GrantReply::Granted(lease), field::<String>(&reply, 5)?)
            }
            2 => (
                GrantReply::HeldBack(HeldBack {
                    until_ms: field(&reply, 1)?,
                    now_ms: field(&reply, 2)?,
                }),
                field::<String>(&reply, 3)?,
            ),
            code => return Err(StoreError::Failed(format!("unexpected grant reply {code}"))),
        };
        self.note_incarnation(&known, incarnation);
        Ok(outcome)
    }

    /// Remembers the store's incarnation if this broker knew none yet. A broker that learns it
    /// before Redis loses its data will notice the loss at its next grant, even if it never
    /// granted anything before it (see INCARNATION). A known incarnation is only ever replaced by
    /// a grant reply, which is where a loss is detected.
    fn adopt_incarnation(&self, seen: Option<String>) {
        if let Some(seen) = seen {
            let mut known = self.incarnation.lock().unwrap_or_else(|e| e.into_inner());
            if known.is_empty() {
                *known = seen;
            }
        }
    }

    /// Checks the store's incarnation as a grant would, creating the marker if the store has
    /// none. Run when the notice listener first connects, so every running broker knows the
    /// incarnation from the start — a broker that never grants still notices a loss — and on
    /// every reconnect and health tick, so a loss is noticed, and grants held back store-wide,
    /// as soon as Redis is back.
    async fn check_incarnation(&self) -> bool {
        let known = self.known_incarnation();
        let mut conn = self.connection();
        // Plain EVAL, not EVALSHA: this background check, once a second, then shows apart from
        // the lock operations in Redis's command statistics. It is not on any request's path.
        let mut eval = redis::cmd("EVAL");
        eval.arg(&self.scripts.check)
            .arg(3)
            .arg("")
            .arg("")
            .arg(&self.marker)
            .arg("")
            .arg("")
            .arg("")
            .arg("")
            .arg("")
            .arg(&known)
            .arg(&self.hold_args);
        match self.bounded(eval.query_async::<String>(&mut conn)).await {
            Ok(seen) => {
                self.note_incarnation(&known, seen);
                true
            }
            Err(_) => false,
        }
    }

    /// Records the incarnation a script answered; a change means Redis lost its data.
    fn note_incarnation(&self, known: &str, seen: String) {
        if seen != known {
            if !known.is_empty() {
                tracing::error!(
                    was = %known, now = %seen,
                    "Redis lost its data (restarted empty?): grants are held back until every \
                     lease it may have held has ended"
                );
            }
            *self.incarnation.lock().unwrap_or_else(|e| e.into_inner()) = seen;
        }
    }

    fn known_incarnation(&self) -> String {
        self.incarnation
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// What CLAIM and TAKE_OVER answer.
enum GrantReply {
    Granted(Lease),
    Refused,
    HeldBack(HeldBack),
}

/// Element `i` of a script's array reply.
fn field<T: FromRedisValue>(reply: &[Value], i: usize) -> Result<T, StoreError> {
    reply
        .get(i)
        .ok_or_else(|| corrupt("reply"))
        .and_then(|v| T::from_redis_value_ref(v).map_err(|_| corrupt("reply")))
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Failed(format!("the lock in Redis has a malformed {what}"))
}

/// The holder script's answers other than "yours".
fn refusal<T>(code: u8) -> Result<Holder<T>, StoreError> {
    match code {
        0 => Ok(Holder::NotHeld),
        2 => Ok(Holder::NotOwner),
        _ => Err(StoreError::Failed(format!(
            "unexpected holder code {code} from Redis"
        ))),
    }
}

fn parse_owner(raw: Option<String>) -> Result<Option<Owner>, StoreError> {
    raw.map(|o| Owner::parse(&o).map_err(|_| corrupt("owner")))
        .transpose()
}

type ReadReply = (
    u64,
    Option<String>,
    Option<u64>,
    Option<u64>,
    Option<u64>,
    Option<String>,
    Option<String>,
    Option<String>,
);

impl Store for RedisStore {
    async fn claim(&self, key: &LockKey, bid: &Bid) -> Result<Claim, StoreError> {
        Ok(
            match self
                .grant_script(&self.scripts.claim, key, bid, None)
                .await?
            {
                GrantReply::Granted(lease) => Claim::Granted(lease),
                GrantReply::Refused => Claim::Taken,
                GrantReply::HeldBack(held) => Claim::HeldBack(held),
            },
        )
    }

    async fn read(&self, key: &LockKey) -> Result<Snapshot, StoreError> {
        let [lock, _] = self.keys(key);
        let mut conn = self.connection();
        let (now_ms, token, fence, expires, ttl, owner, request_id, incarnation): ReadReply = self
            .bounded(
                self.scripts
                    .read
                    .key(lock)
                    .key(&self.marker)
                    .invoke_async(&mut conn),
            )
            .await?;
        self.adopt_incarnation(incarnation);
        let lease = match (token, fence, expires, ttl) {
            (Some(token), Some(fence), Some(expires_at_ms), Some(ttl_ms)) => Some(Lease {
                token: Token::parse(&token).map_err(|_| corrupt("token"))?,
                fence,
                expires_at_ms,
                ttl_ms,
                owner: parse_owner(owner)?,
                request_id: request_id.and_then(|r| RequestId::parse(&r).ok()),
            }),
            (None, None, None, None) => None,
            _ => return Err(corrupt("record")),
        };
        Ok(Snapshot { now_ms, lease })
    }

    async fn take_over(
        &self,
        key: &LockKey,
        seen: Fence,
        bid: &Bid,
    ) -> Result<TakeOver, StoreError> {
        Ok(
            match self
                .grant_script(&self.scripts.take_over, key, bid, Some(seen))
                .await?
            {
                GrantReply::Granted(lease) => TakeOver::Granted(lease),
                GrantReply::Refused => TakeOver::Lost,
                GrantReply::HeldBack(held) => TakeOver::HeldBack(held),
            },
        )
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<Holder<Released>, StoreError> {
        let [lock, _] = self.keys(key);
        let mut conn = self.connection();
        let (code, held_ms): (u8, Option<u64>) = self
            .bounded(
                self.scripts
                    .release
                    .key(lock)
                    .arg(token.as_str())
                    .arg(&self.channel)
                    .arg(key.as_str())
                    .invoke_async(&mut conn),
            )
            .await?;
        match code {
            1 => Ok(Holder::Done(Released {
                held_ms: held_ms.unwrap_or(0),
            })),
            code => refusal(code),
        }
    }

    async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Ttl,
    ) -> Result<Holder<Lease>, StoreError> {
        let [lock, _] = self.keys(key);
        let mut conn = self.connection();
        let reply: (u8, Option<u64>, Option<u64>, Option<String>) = self
            .bounded(
                self.scripts
                    .renew
                    .key(lock)
                    .arg(token.as_str())
                    .arg(ttl.as_ms())
                    .arg(EXPIRY_SLACK_MS)
                    .arg(&self.channel)
                    .arg(key.as_str())
                    .invoke_async(&mut conn),
            )
            .await?;
        match reply {
            (1, Some(fence), Some(expires_at_ms), owner) => Ok(Holder::Done(Lease {
                token: token.clone(),
                fence,
                expires_at_ms,
                ttl_ms: ttl.as_ms(),
                owner: parse_owner(owner)?,
                request_id: None,
            })),
            (1, ..) => Err(corrupt("record")),
            (code, ..) => refusal(code),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.connection();
        let _: String = self
            .bounded(redis::cmd("PING").query_async(&mut conn))
            .await?;
        Ok(())
    }

    fn start_notices(&self, waiters: &Arc<Waiters>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no runtime to listen for release notices on; waiters will poll");
            return;
        };
        runtime.spawn(listen_for_notices(self.clone(), Arc::downgrade(waiters)));
    }
}

/// How often the notice connection is checked with a PING: a connection that silently stopped
/// delivering (a half-open TCP connection) is replaced within this, plus the store timeout.
const NOTICE_HEALTH_EVERY: Duration = Duration::from_secs(1);

/// The broker's one subscriber connection: delivers every notice on `channel` to `waiters`,
/// reconnecting with backoff for as long as the waiters exist. After each (re)connect every
/// queue's head is woken, since notices published while disconnected are lost.
///
/// It also checks the store's incarnation on every (re)connect and health tick (see
/// [`RedisStore::check_incarnation`]).
async fn listen_for_notices(store: RedisStore, waiters: Weak<Waiters>) {
    let (client, channel, timeout) = (&store.client, &store.channel, store.timeout);
    let mut backoff = Duration::from_millis(100);
    loop {
        match subscribe(client, channel, timeout).await {
            Ok((mut sink, mut stream)) => {
                tracing::debug!(%channel, "listening for release notices");
                backoff = Duration::from_millis(100);
                // Subscribed: Redis is back (or was never gone). Before anything else, see
                // whether it lost its data meanwhile. The first try may go out on the main
                // connection's dead socket (which only then starts reconnecting): try again
                // every 100 ms until one answers, well within store_settle_ms.
                for _ in 0..50 {
                    if store.check_incarnation().await {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                match waiters.upgrade() {
                    Some(waiters) => waiters.wake_all(),
                    None => return,
                }
                let mut health = tokio::time::interval(NOTICE_HEALTH_EVERY);
                health.tick().await;
                loop {
                    tokio::select! {
                        message = stream.next() => {
                            let Some(message) = message else { break };
                            let Some(waiters) = waiters.upgrade() else { return };
                            if let Ok(key) = std::str::from_utf8(message.get_payload_bytes())
                                .map_err(drop)
                                .and_then(|k| LockKey::parse(k).map_err(drop))
                            {
                                waiters.wake(&key);
                            }
                        }
                        _ = health.tick() => {
                            if waiters.strong_count() == 0 {
                                return;
                            }
                            store.check_incarnation().await;
                            let pong = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
                            if !matches!(pong, Ok(Ok(_))) {
                                break;
                            }
                        }
                    }
                }
                tracing::warn!(
                    "release notices disconnected; waiters fall back to polling until they return"
                );
            }
            Err(e) => tracing::debug!(error = %e, "cannot subscribe to release notices yet"),
        }
        if waiters.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

async fn subscribe(
    client: &redis::Client,
    channel: &str,
    timeout: Duration,
) -> Result<(PubSubSink, PubSubStream), StoreError> {
    let connect = async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(channel).await?;
        Ok::<_, RedisError>(pubsub.split())
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(split)) => Ok(split),
        Ok(Err(e)) => Err(StoreError::Failed(e.to_string())),
        Err(_) => Err(StoreError::Timeout(duration_ms(timeout))),
    }
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
