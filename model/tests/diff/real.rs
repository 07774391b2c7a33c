//! The real side of a run: two `RedisStore`s (brokers 0 and 1) on a fresh `redis-server`, each
//! step run on both sides and the answers, fences, holders and notices compared.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lockbroker_core::domain::{LockKey, Owner, Pool, Space, Token, Ttl};
use lockbroker_core::store::{
    AsHolder, Bid, GrantAnswer, Join, Notice, Renewal, SessionEntry, SessionOp, SessionRecord,
    SessionSpec, Store, StoreError,
};
use lockbroker_redis::{RedisSettings, RedisStore, RedisTls, RedisUrl};

type StoreResult<T> = Result<T, StoreError>;
use lockbroker_model::store::{Answer, Fence};
use lockbroker_test_support::redis_server::RedisServer;
use tokio::sync::mpsc;

use super::batch::keys_of_answers;
use super::several::why;
use super::{BatchStep, KEYS, LIMIT, ModelSide, SEMAPHORE, SessStep, Step, Tally};

/// `batch.lua` as the Redis store joins it (`redis-store/src/scripts/mod.rs`): the test calls it
/// itself, to see each operation's answer (SLOW included) in one call.
const BATCH_LUA: &str = concat!(
    include_str!("../../../redis-store/src/scripts/lib/prelude.lua"),
    include_str!("../../../redis-store/src/scripts/lib/grant.lua"),
    include_str!("../../../redis-store/src/scripts/lib/fast.lua"),
    include_str!("../../../redis-store/src/scripts/batch.lua"),
);

/// A short lease, offer window and renewal, in ms: one tick of the model.
const SHORT_MS: u64 = 150;
/// A long one: it never ends in a run.
const LONG_MS: u64 = 600_000;
/// The steps between two ticks must end this long before the first short end among them.
const MARGIN_MS: u64 = 20;

pub(crate) enum Outcome {
    Agreed {
        ticks: usize,
        flushes: usize,
        /// The CLAIM_ALLs compared.
        claims: Tally,
    },
    /// The machine stalled: a short end may have passed between two ticks, at this step.
    Spoiled(usize),
    Disagreed {
        at: usize,
        what: String,
    },
}

/// An answer as both sides can say it: fences are the side's own.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Said {
    Granted(usize, Fence),
    /// CLAIM_ALL: every key granted to the token, each key's fence in the order asked.
    GrantedEach(usize, Vec<Fence>),
    /// BATCH: each operation's answer, then each SLOW one's answer alone.
    Ops(Vec<Said>),
    /// A BATCH operation that is not the common case.
    Slow,
    /// A reply code BATCH never gives.
    Code(i64),
    Queued,
    Refused,
    OnHold,
    Held(Fence),
    NotHeld,
    NotOwner,
    Forced(Vec<Fence>),
    /// SESSION: a live record's entries (key, token), or none.
    Session(Option<BTreeSet<(u8, usize)>>),
    /// KEEP: each lease's answer.
    Kept(Vec<Said>),
    Done,
}

fn model_said(a: &Answer, token: usize) -> Said {
    match a {
        Answer::Granted { fence, .. } => Said::Granted(token, *fence),
        Answer::Queued { .. } => Said::Queued,
        Answer::Refused | Answer::NoRoom => Said::Refused,
        Answer::OnHold { .. } | Answer::HoldInForce | Answer::OtherEpoch => Said::OnHold,
        Answer::Held { fence } => Said::Held(*fence),
        Answer::NotHeld => Said::NotHeld,
        Answer::NotOwner => Said::NotOwner,
        Answer::Forced(f) if f.is_empty() => Said::NotHeld,
        Answer::Forced(f) => Said::Forced(f.clone()),
        Answer::Session(rec) => Said::Session(rec.as_ref().map(|r| {
            r.entries
                .iter()
                .map(|(k, t)| (*k, t.client as usize + 256 * t.attempt as usize))
                .collect()
        })),
        Answer::Kept(all) => Said::Kept(all.iter().map(|a| model_said(a, usize::MAX)).collect()),
        _ => Said::Done,
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn lock_key(k: u8) -> LockKey {
    LockKey::parse(&format!("d{k}")).unwrap()
}

fn space_of(key: u8) -> Space {
    if key == SEMAPHORE {
        Space::Semaphores
    } else {
        Space::Locks
    }
}

fn ttl(long: bool) -> Ttl {
    Ttl::from_ms(if long { LONG_MS } else { SHORT_MS })
}

/// Per key, the model's fences and the real ones: one renaming that keeps their order.
#[derive(Default)]
struct Fences(Vec<BTreeMap<Fence, Fence>>);

impl Fences {
    fn pair(&mut self, key: u8, model: Fence, real: Fence) -> Result<(), String> {
        let map = &mut self.0[key as usize];
        if let Some(r) = map.get(&model) {
            return if *r == real {
                Ok(())
            } else {
                Err(format!("model fence {model} was real {r}, now {real}"))
            };
        }
        let below = map.range(..model).next_back().map(|(_, r)| *r);
        let above = map.range(model..).next().map(|(_, r)| *r);
        if below.is_some_and(|b| b >= real) || above.is_some_and(|a| a <= real) {
            return Err(format!(
                "fence order differs: model {model} ↔ real {real} on key d{key}"
            ));
        }
        map.insert(model, real);
        Ok(())
    }

    fn same(&mut self, key: u8, model: &Said, real: &Said) -> Result<(), String> {
        let err = || Err(format!("model {model:?}, real {real:?}"));
        match (model, real) {
            (Said::GrantedEach(..), _) | (_, Said::GrantedEach(..)) => err(),
            (Said::Granted(a, f), Said::Granted(b, g)) if a == b => self.pair(key, *f, *g),
            (Said::Held(f), Said::Held(g)) => self.pair(key, *f, *g),
            (Said::Forced(f), Said::Forced(g)) if f.len() == g.len() => {
                let (mut f, mut g) = (f.clone(), g.clone());
                f.sort_unstable();
                g.sort_unstable();
                f.iter()
                    .zip(&g)
                    .try_for_each(|(f, g)| self.pair(key, *f, *g))
            }
            (a, b)
                if a == b && !matches!(a, Said::Granted(..) | Said::Held(_) | Said::Forced(_)) =>
            {
                Ok(())
            }
            _ => err(),
        }
    }
}

struct Real {
    redis: RedisServer,
    /// The test's own connection (BATCH), and each broker's id as its leases record it.
    conn: redis::aio::MultiplexedConnection,
    ids: [String; 2],
    stores: [RedisStore; 2],
    notices: [mpsc::Receiver<Notice>; 2],
    tokens: HashMap<usize, Token>,
    /// Each session number's id.
    sessions: HashMap<usize, Token>,
}

impl Real {
    async fn start() -> Self {
        let redis = RedisServer::start().await;
        let store = || {
            let s = RedisStore::connect(
                &RedisSettings {
                    url: RedisUrl::parse(&redis.url()).unwrap(),
                    key_prefix: "m:".into(),
                    timeout: Duration::from_millis(SHORT_MS),
                    store_loss_delay: Duration::ZERO,
                    store_settle: Duration::from_millis(200),
                    tls: RedisTls::default(),
                    replica_acks: 0,
                    batch_max: 64,
                },
                Arc::default(),
            )
            .unwrap();
            let (tx, rx) = mpsc::channel(4096);
            s.start(tx);
            (s, rx)
        };
        let ((a, ra), (b, rb)) = (store(), store());
        let conn = redis.connection().await;
        let mut real = Real {
            redis,
            conn,
            ids: [String::new(), String::new()],
            stores: [a, b],
            notices: [ra, rb],
            tokens: HashMap::new(),
            sessions: HashMap::new(),
        };
        real.caught_up().await;
        for b in 0..2 {
            real.ids[b] = real.broker_id(b).await;
        }
        real
    }

    /// Broker `b`'s id: what a lease it grants records as `by` (a claim of a key of its own,
    /// released after).
    async fn broker_id(&mut self, b: usize) -> String {
        let key = LockKey::parse(&format!("id{b}")).unwrap();
        let bid = Bid {
            token: Token::generate(),
            ttl: Ttl::from_ms(LONG_MS),
            owner: None,
            request_id: None,
            wait_ms: 0,
            ends: None,
        };
        let granted = self.stores[b].claim(&key, &bid).await.expect("a claim");
        assert!(matches!(granted, GrantAnswer::Granted(_)), "{granted:?}");
        let id: String = redis::cmd("HGET")
            .arg(format!("m:{{id{b}}}:lock"))
            .arg("by")
            .query_async(&mut self.conn)
            .await
            .expect("the lease's broker");
        self.stores[b]
            .release(Space::Locks, &key, &bid.token)
            .await
            .expect("a release");
        id
    }

    /// The store's epoch (the marker's id): the one both brokers know once caught up.
    async fn epoch(&mut self) -> StoreResult<String> {
        let id: Option<String> = redis::cmd("HGET")
            .arg("m:epoch")
            .arg("id")
            .query_async(&mut self.conn)
            .await
            .map_err(|e| StoreError::Failed(e.to_string()))?;
        Ok(id.unwrap_or_default())
    }

    /// BATCH through `broker` in `epoch`, then (unless `stale`) each operation it answered SLOW
    /// alone through the broker's own store, in order — as `run_batched` does.
    async fn batch(
        &mut self,
        broker: u8,
        ops: &[BatchStep],
        epoch: &str,
        stale: bool,
    ) -> StoreResult<Said> {
        let script = redis::Script::new(BATCH_LUA);
        let mut call = script.prepare_invoke();
        call.key("m:epoch")
            .arg(epoch)
            .arg(self.ids[broker as usize].as_str());
        for op in ops {
            for suffix in [":lock", ":fence", ":shared:ends", ":queue", ":watched"] {
                call.key(format!("m:{{d{}}}{suffix}", op.key()));
            }
            match *op {
                BatchStep::Claim {
                    token,
                    long,
                    session,
                    ..
                } => {
                    let owner = if session {
                        format!("={}", Owner::for_session(None, 0).as_str())
                    } else {
                        String::new()
                    };
                    let t = self.token(token);
                    // As the broker sends them (`BatchOp` in scripts/batch.rs): `c` without an
                    // owner or request id, `C` with them.
                    if owner.is_empty() {
                        call.arg("c").arg(t.as_str()).arg(ttl(long).as_ms());
                    } else {
                        call.arg("C")
                            .arg(t.as_str())
                            .arg(ttl(long).as_ms())
                            .arg(owner)
                            .arg("");
                    }
                }
                BatchStep::Release { token, .. } => {
                    let t = self.token(token);
                    call.arg("r").arg(t.as_str());
                }
            }
        }
        // One flat reply (`batch.lua`): a granted claim's fence as text, a release's held_ms and
        // fence as text, or SLOW alone.
        let reply: Vec<redis::Value> = call
            .invoke_async(&mut self.conn)
            .await
            .map_err(|e| StoreError::Failed(e.to_string()))?;
        // A number, or one given as text (a fence).
        let int = |v: Option<&redis::Value>| match v {
            Some(redis::Value::Int(n)) => *n,
            Some(redis::Value::BulkString(text)) => std::str::from_utf8(text)
                .ok()
                .and_then(|t| t.parse().ok())
                .unwrap_or(i64::MIN),
            _ => i64::MIN,
        };
        let mut values = reply.iter();
        let mut out = Vec::new();
        let mut slow = Vec::new();
        for op in ops {
            let first = values.next();
            out.push(match (first, op) {
                (Some(redis::Value::Int(-2)), _) => {
                    slow.push(op.alone(broker));
                    Said::Slow
                }
                (Some(redis::Value::BulkString(_)), BatchStep::Claim { token, .. }) => {
                    Said::Granted(*token, int(first) as Fence)
                }
                (Some(redis::Value::Int(held_ms)), BatchStep::Release { .. }) if *held_ms >= 0 => {
                    Said::Held(int(values.next()) as Fence)
                }
                (first, _) => Said::Code(int(first)),
            });
        }
        if values.next().is_some() {
            out.push(Said::Code(reply.len() as i64));
        }
        if !stale {
            for alone in slow {
                out.push(Box::pin(self.step(&alone, 0)).await?);
            }
        }
        Ok(Said::Ops(out))
    }

    /// Waits until both brokers grant (their epoch checks and put-backs done, the hold over).
    async fn caught_up(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        for store in &self.stores {
            while let Some(hold) = store.ready().await.expect("the store answers") {
                assert!(Instant::now() < deadline, "the store stayed held");
                tokio::time::sleep(Duration::from_millis(hold.retry_after_ms.clamp(5, 100))).await;
            }
        }
    }

    fn token(&mut self, t: usize) -> Token {
        self.tokens.entry(t).or_insert_with(Token::generate).clone()
    }

    fn bid(&mut self, t: usize, long: bool, wait: bool) -> Bid {
        Bid {
            token: self.token(t),
            ttl: ttl(long),
            owner: None,
            request_id: None,
            wait_ms: if wait { LONG_MS } else { 0 },
            ends: None,
        }
    }

    fn index_of(&self, token: &Token) -> usize {
        self.tokens
            .iter()
            .find(|(_, v)| *v == token)
            .map_or(usize::MAX, |(k, _)| *k)
    }

    fn granted(&self, lease: &lockbroker_core::domain::Lease) -> Said {
        Said::Granted(self.index_of(&lease.token), lease.fence)
    }

    async fn step(&mut self, step: &Step, seen: Fence) -> StoreResult<Said> {
        let space = match step {
            Step::Release { key, .. }
            | Step::Renew { key, .. }
            | Step::Leave { key, .. }
            | Step::Force { key, .. } => space_of(*key),
            _ => Space::Locks,
        };
        Ok(match *step {
            Step::Claim {
                broker,
                key,
                token,
                shared,
                long,
                wait,
                session,
            } => {
                let mut bid = self.bid(token, long, wait);
                bid.owner = session.then(|| Owner::for_session(None, 0));
                let s = &self.stores[broker as usize];
                let pool = if key == SEMAPHORE {
                    Some(Pool::Semaphore {
                        limit: LIMIT.into(),
                    })
                } else {
                    shared.then_some(Pool::Shared)
                };
                if let Some(pool) = pool {
                    match s.join(&lock_key(key), pool, &bid).await? {
                        Join::Granted(l) => self.granted(&l),
                        Join::Busy { .. } | Join::LimitMismatch { .. } => Said::Refused,
                        Join::Queued { .. } => Said::Queued,
                        Join::OnHold(_) => Said::OnHold,
                    }
                } else {
                    let a = s.claim(&lock_key(key), &bid).await?;
                    self.grant(a)
                }
            }
            Step::TakeOver {
                broker,
                key,
                token,
                long,
            } => {
                let bid = self.bid(token, long, false);
                let a = self.stores[broker as usize]
                    .take_over(&lock_key(key), seen, &bid)
                    .await?;
                self.grant(a)
            }
            Step::Release { broker, key, token } => {
                let t = self.token(token);
                match self.stores[broker as usize]
                    .release(space, &lock_key(key), &t)
                    .await?
                {
                    AsHolder::Done(_) => Said::Held(0),
                    other => holder(other),
                }
            }
            Step::Renew {
                broker,
                key,
                token,
                long,
                until,
            } => {
                let t = self.token(token);
                let renewal = if until {
                    Renewal::Until(now_ms() + ttl(long).as_ms())
                } else {
                    Renewal::For(ttl(long))
                };
                match self.stores[broker as usize]
                    .renew(space, &lock_key(key), &t, renewal)
                    .await?
                {
                    AsHolder::Done(l) => Said::Held(l.fence),
                    other => holder(other),
                }
            }
            Step::Leave { broker, key, token } => {
                let t = self.token(token);
                self.stores[broker as usize]
                    .leave(space, &lock_key(key), &t)
                    .await?;
                Said::Done
            }
            Step::Force { broker, key } => {
                match self.stores[broker as usize]
                    .force_release(space, &lock_key(key))
                    .await?
                {
                    AsHolder::Done(f) => Said::Forced(f),
                    other => holder(other),
                }
            }
            Step::Session { broker, id, ref op } => self.session(broker, id, op).await?,
            Step::Keep {
                broker,
                ref leases,
                long,
            } => {
                let entries: Vec<SessionEntry> = leases
                    .iter()
                    .map(|&(key, token)| self.entry(key, token))
                    .collect();
                let until = now_ms() + ttl(long).as_ms();
                let mut out = Vec::new();
                for kept in self.stores[broker as usize]
                    .renew_all(&entries, until)
                    .await
                {
                    out.push(match kept? {
                        AsHolder::Done(l) => Said::Held(l.fence),
                        other => holder(other),
                    });
                }
                Said::Kept(out)
            }
            Step::ClaimAll {
                broker,
                ref keys,
                token,
                long,
            } => {
                let bid = self.bid(token, long, false);
                let names: Vec<LockKey> = keys.iter().map(|&k| lock_key(k)).collect();
                match self.stores[broker as usize].claim_all(&names, &bid).await? {
                    Some(leases) => {
                        let fences = leases.iter().map(|l| l.fence).collect();
                        let to = leases
                            .first()
                            .map_or(usize::MAX, |l| self.index_of(&l.token));
                        if leases.iter().any(|l| self.index_of(&l.token) != to) {
                            Said::GrantedEach(usize::MAX, fences)
                        } else {
                            Said::GrantedEach(to, fences)
                        }
                    }
                    None => Said::Refused,
                }
            }
            Step::Batch { broker, ref ops } => {
                let epoch = self.epoch().await?;
                self.batch(broker, ops, &epoch, false).await?
            }
            Step::Tick | Step::Flush | Step::FlushClaimAll(_) | Step::FlushBatch(_) => Said::Done,
        })
    }

    fn entry(&mut self, key: u8, token: usize) -> SessionEntry {
        SessionEntry {
            space: space_of(key),
            key: lock_key(key),
            token: self.token(token),
            entered_ms: 0,
        }
    }

    async fn session(&mut self, broker: u8, id: usize, op: &SessStep) -> StoreResult<Said> {
        let sid = self
            .sessions
            .entry(id)
            .or_insert_with(Token::generate)
            .clone();
        let spec = |long| SessionSpec {
            ttl: ttl(long),
            owner: None,
            lock_delay_ms: 0,
            request_id: None,
        };
        let store = &self.stores[broker as usize];
        let rec = match *op {
            SessStep::Open { long } => store.session(&sid, SessionOp::Open(&spec(long))).await?,
            SessStep::Renew => store.session(&sid, SessionOp::Renew(None)).await?,
            SessStep::Read => store.session(&sid, SessionOp::Read).await?,
            SessStep::Close => store.session(&sid, SessionOp::Close).await?,
            SessStep::Enter { key, token } => {
                let e = self.entry(key, token);
                self.stores[broker as usize]
                    .session(&sid, SessionOp::Enter(&e))
                    .await?
            }
            SessStep::Drop { key, token } => {
                let e = self.entry(key, token);
                self.stores[broker as usize]
                    .session(&sid, SessionOp::Drop(&e))
                    .await?
            }
        };
        Ok(Said::Session(rec.map(|r| self.entries(&r))))
    }

    fn entries(&self, r: &SessionRecord) -> BTreeSet<(u8, usize)> {
        r.entries
            .iter()
            .map(|e| {
                let k = e
                    .key
                    .as_str()
                    .trim_start_matches('d')
                    .parse()
                    .unwrap_or(u8::MAX);
                (k, self.index_of(&e.token))
            })
            .collect()
    }

    fn grant(&self, a: GrantAnswer) -> Said {
        match a {
            GrantAnswer::Granted(l) => self.granted(&l),
            GrantAnswer::Refused => Said::Refused,
            GrantAnswer::OnHold(_) => Said::OnHold,
            GrantAnswer::Queued { .. } => Said::Queued,
        }
    }

    /// The key's lease record (token, fence, live) and live shared holders, as READ says (a
    /// semaphore's live permits, as PERMITS says).
    async fn holders(
        &self,
        key: u8,
    ) -> StoreResult<(Option<(usize, Fence, bool)>, BTreeSet<(usize, Fence)>)> {
        if key == SEMAPHORE {
            let permits = self.stores[0].permits(&lock_key(key)).await?;
            let held = permits
                .holders
                .iter()
                .map(|l| (self.index_of(&l.token), l.fence));
            return Ok((None, held.collect()));
        }
        let snap = self.stores[0].read(&lock_key(key)).await?;
        let lease = snap
            .lease
            .as_ref()
            .map(|l| (self.index_of(&l.token), l.fence, l.is_live_at(snap.now_ms)));
        let shared = snap
            .shared
            .iter()
            .map(|l| (self.index_of(&l.token), l.fence))
            .collect();
        Ok((lease, shared))
    }

    /// The offers, looks and requeues told to each broker since the last drain.
    fn drain(&mut self) -> BTreeSet<(u8, String)> {
        let mut out = BTreeSet::new();
        for b in 0..2 {
            while let Ok(n) = self.notices[b].try_recv() {
                match n {
                    Notice::Offered(_, k, t) => {
                        out.insert((
                            b as u8,
                            format!("offered {} to {}", k.as_str(), self.index_of(&t)),
                        ));
                    }
                    Notice::Requeue(_, k) => {
                        out.insert((b as u8, format!("requeue {}", k.as_str())));
                    }
                    Notice::Look(_, k, _) => {
                        out.insert((b as u8, format!("look {}", k.as_str())));
                    }
                    _ => {}
                }
            }
        }
        out
    }
}

fn holder<T>(h: AsHolder<T>) -> Said {
    match h {
        AsHolder::Done(_) => Said::Done,
        AsHolder::NotHeld => Said::NotHeld,
        AsHolder::NotOwner => Said::NotOwner,
        AsHolder::OnHold(_) => Said::OnHold,
    }
}

/// Runs `steps` on a fresh Redis and on the model.
pub(crate) async fn run_steps(steps: &[Step]) -> Outcome {
    let mut real = Real::start().await;
    let mut model = ModelSide::new();
    let mut fences = Fences(vec![BTreeMap::new(); KEYS as usize]);
    let (mut ticks, mut flushes) = (0, 0);
    let mut claims = Tally::default();
    // The first real step since the last tick began then (ms), and the last one ended then.
    let mut segment: Option<u64> = None;
    let mut last_end = now_ms();
    for (at, step) in steps.iter().enumerate() {
        let disagree = |what: String| Outcome::Disagreed {
            at,
            what: format!("{step:?}: {what}"),
        };
        match step {
            Step::Tick | Step::Flush | Step::FlushClaimAll(_) | Step::FlushBatch(_) => {
                // Every short end passes (and what the brokers told each other arrives).
                let until = last_end + SHORT_MS + 5;
                let wait = until.saturating_sub(now_ms());
                tokio::time::sleep(Duration::from_millis(wait)).await;
                model.step(&Step::Tick);
                ticks += 1;
                segment = None;
                let told: BTreeSet<(u8, String)> = model
                    .told
                    .drain(..)
                    .filter_map(|(b, n)| match n {
                        lockbroker_model::store::Notice::Offered(k, t) => Some((
                            b,
                            format!(
                                "offered d{k} to {}",
                                t.client as usize + 256 * t.attempt as usize
                            ),
                        )),
                        lockbroker_model::store::Notice::Requeue(k) => {
                            Some((b, format!("requeue d{k}")))
                        }
                        lockbroker_model::store::Notice::Look(k, _) => {
                            Some((b, format!("look d{k}")))
                        }
                        _ => None,
                    })
                    .collect();
                let heard = real.drain();
                if told != heard {
                    return disagree(format!(
                        "notices: model told {told:?}, brokers heard {heard:?}"
                    ));
                }
                if *step != Step::Tick {
                    let Ok(before) = real.epoch().await else {
                        return Outcome::Spoiled(at);
                    };
                    real.redis.flushall().await;
                    if let Step::FlushClaimAll(claim) = step {
                        // The broker meets another epoch, catches up (CHECK, PUT_BACK: the settle
                        // hold, 200 ms, starts) and is refused by the hold: the Store interface
                        // answers "not granted" for both. Longer than a short lease: stalled.
                        let called = now_ms();
                        let Ok(said_real) = real.step(claim, 0).await else {
                            return Outcome::Spoiled(at);
                        };
                        if now_ms() >= called + SHORT_MS {
                            return Outcome::Spoiled(at);
                        }
                        let answer = model.stale_claim_all(claim);
                        claims.count(&answer, "");
                        if answer != Answer::OtherEpoch || said_real != Said::Refused {
                            return disagree(format!(
                                "CLAIM_ALL in the epoch before a loss: model {answer:?}, real {said_real:?}"
                            ));
                        }
                        // Nothing of it written: the holders compared below are the leases put
                        // back, on both sides.
                        model.catch_up();
                    } else if let Step::FlushBatch(batch) = step {
                        // Every claim answers SLOW (another epoch); its SLOW operations are not
                        // run alone (their CLAIM would meet the epoch as CLAIM_ALL's does).
                        let Step::Batch { broker, ops } = &**batch else {
                            unreachable!("a BATCH step")
                        };
                        let Ok(said_real) = real.batch(*broker, ops, &before, true).await else {
                            return Outcome::Spoiled(at);
                        };
                        let answer = model.stale_batch(batch);
                        count_batch(&mut claims, ops, &answer, "in the epoch before a loss: ");
                        let said_model = batch_said(ops, &answer);
                        if said_model != said_real {
                            return disagree(format!(
                                "BATCH in the epoch before a loss: model {said_model:?}, real {said_real:?}"
                            ));
                        }
                        model.catch_up();
                    } else {
                        model.flush();
                    }
                    real.caught_up().await;
                    flushes += 1;
                    let _ = real.drain();
                    model.told.clear();
                    last_end = now_ms();
                }
                for k in 0..KEYS {
                    match compare_holders(&real, &model, &mut fences, k).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return disagree(e),
                        Err(_) => return Outcome::Spoiled(at),
                    }
                }
                continue;
            }
            _ => {}
        }
        let started = now_ms();
        let first = *segment.get_or_insert(started);
        let key = match *step {
            Step::Claim { key, .. } | Step::TakeOver { key, .. } | Step::Release { key, .. } => key,
            Step::Renew { key, .. } | Step::Leave { key, .. } | Step::Force { key, .. } => key,
            Step::Keep { ref leases, .. } => leases.first().map_or(0, |l| l.0),
            Step::ClaimAll { ref keys, .. } => keys[0],
            Step::Batch { ref ops, .. } => ops[0].key(),
            Step::Session { .. } => 0,
            Step::Tick | Step::Flush | Step::FlushClaimAll(_) | Step::FlushBatch(_) => {
                unreachable!()
            }
        };
        let token = match *step {
            Step::Claim { token, .. } | Step::TakeOver { token, .. } => token,
            Step::ClaimAll { token, .. } => token,
            _ => usize::MAX,
        };
        // Every key a step names (its holders are compared after it).
        let keys = match step {
            Step::ClaimAll { keys, .. } => keys.clone(),
            Step::Batch { ops, .. } => {
                let mut keys: Vec<u8> = ops.iter().map(BatchStep::key).collect();
                keys.sort_unstable();
                keys.dedup();
                keys
            }
            _ => vec![key],
        };
        let why = why(&model, &keys);
        // TAKE_OVER names the record each side sees.
        let seen = match step {
            Step::TakeOver { .. } => match real.holders(key).await {
                Ok(h) => h.0.map_or(0, |(_, f, _)| f),
                Err(_) => return Outcome::Spoiled(at),
            },
            _ => 0,
        };
        // A store call that timed out (the timeout is the short window) is a stalled machine.
        let Ok(said_real) = real.step(step, seen).await else {
            return Outcome::Spoiled(at);
        };
        let answer = model.step(step);
        if let Step::ClaimAll { .. } = step {
            claims.count(&answer, &why);
        }
        last_end = now_ms();
        if last_end + MARGIN_MS >= first + SHORT_MS {
            return Outcome::Spoiled(at);
        }
        let mut said_model = model_said(&answer, token);
        if let (Step::ClaimAll { keys, .. }, Answer::Granted { fence, .. }) = (step, &answer) {
            said_model = Said::GrantedEach(token, vec![*fence; keys.len()]);
        }
        // RELEASE answers no fence on the store interface.
        if let (Said::Held(_), Step::Release { .. }) = (&said_model, step) {
            said_model = Said::Held(0);
        }
        if let Step::Batch { ops, .. } = step {
            count_batch(&mut claims, ops, &answer, "");
            said_model = batch_said(ops, &answer);
        }
        let fenced = !matches!(step, Step::Release { .. });
        let same = if let (Step::Batch { ops, .. }, Said::Ops(m), Said::Ops(r), Answer::Batch(a)) =
            (step, &said_model, &said_real, &answer)
        {
            if m.len() == r.len() {
                keys_of_answers(ops, a)
                    .into_iter()
                    .zip(m.iter().zip(r))
                    .try_for_each(|(k, (m, r))| fences.same(k, m, r))
            } else {
                Err(format!("model {said_model:?}, real {said_real:?}"))
            }
        } else if let (
            Step::ClaimAll { keys, .. },
            Said::GrantedEach(a, f),
            Said::GrantedEach(b, g),
        ) = (step, &said_model, &said_real)
        {
            if a == b && f.len() == g.len() {
                keys.iter()
                    .zip(f.iter().zip(g))
                    .try_for_each(|(&k, (f, g))| fences.pair(k, *f, *g))
            } else {
                Err(format!("model {said_model:?}, real {said_real:?}"))
            }
        } else if let (Step::Keep { leases, .. }, Said::Kept(m), Said::Kept(r)) =
            (step, &said_model, &said_real)
        {
            if m.len() == r.len() {
                leases
                    .iter()
                    .zip(m.iter().zip(r))
                    .try_for_each(|(l, (m, r))| fences.same(l.0, m, r))
            } else {
                Err(format!("model {said_model:?}, real {said_real:?}"))
            }
        } else if fenced {
            fences.same(key, &said_model, &said_real)
        } else if said_model == said_real {
            Ok(())
        } else {
            Err(format!("model {said_model:?}, real {said_real:?}"))
        };
        if let Err(e) = same {
            return disagree(e);
        }
        for &key in &keys {
            match compare_holders(&real, &model, &mut fences, key).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return disagree(e),
                Err(_) => return Outcome::Spoiled(at),
            }
        }
    }
    claims.add(&model.direct);
    Outcome::Agreed {
        ticks,
        flushes,
        claims,
    }
}

/// A BATCH's answers as both sides say them: a grant names its own token; a release run alone
/// answers no fence on the store interface.
fn batch_said(ops: &[BatchStep], answer: &Answer) -> Said {
    let Answer::Batch(all) = answer else {
        return model_said(answer, usize::MAX);
    };
    let alone = ops
        .iter()
        .zip(all)
        .filter(|(_, a)| **a == Answer::Slow)
        .map(|(op, _)| matches!(op, BatchStep::Release { .. }));
    let released_alone = std::iter::repeat_n(false, ops.len()).chain(alone);
    Said::Ops(
        all.iter()
            .zip(released_alone)
            .map(|(a, released_alone)| match a {
                Answer::Slow => Said::Slow,
                Answer::Granted { token, .. } => {
                    model_said(a, token.client as usize + 256 * token.attempt as usize)
                }
                Answer::Held { .. } if released_alone => Said::Held(0),
                _ => model_said(a, usize::MAX),
            })
            .collect(),
    )
}

/// What a BATCH's operations met, by the model, for the run's tally.
fn count_batch(tally: &mut Tally, ops: &[BatchStep], answer: &Answer, when: &str) {
    let Answer::Batch(all) = answer else {
        return;
    };
    for (op, a) in ops.iter().zip(all) {
        let what = match (op, a) {
            (BatchStep::Claim { .. }, Answer::Slow) => "claim SLOW",
            (BatchStep::Claim { .. }, _) => "claim granted",
            (BatchStep::Release { .. }, Answer::Slow) => "release SLOW",
            (BatchStep::Release { .. }, _) => "release held",
        };
        *tally.0.entry(format!("BATCH {when}{what}")).or_default() += 1;
    }
    let mut keys: Vec<u8> = ops.iter().map(BatchStep::key).collect();
    keys.sort_unstable();
    if keys.windows(2).any(|w| w[0] == w[1]) {
        *tally
            .0
            .entry(format!("BATCH {when}with one key twice"))
            .or_default() += 1;
    }
}

/// The key's holders on both sides: a disagreement, or the real store's error.
async fn compare_holders(
    real: &Real,
    model: &ModelSide,
    fences: &mut Fences,
    key: u8,
) -> StoreResult<Result<(), String>> {
    let (lease, shared) = real.holders(key).await?;
    Ok(same_holders(model, fences, key, lease, shared))
}

fn same_holders(
    model: &ModelSide,
    fences: &mut Fences,
    key: u8,
    lease: Option<(usize, Fence, bool)>,
    shared: BTreeSet<(usize, Fence)>,
) -> Result<(), String> {
    let k = &model.store.keys[key as usize];
    let ix = |t: lockbroker_model::store::Token| t.client as usize + 256 * t.attempt as usize;
    let m_lease = k.lock.as_ref().map(|l| (ix(l.token), l.fence, l.live()));
    match (m_lease, lease) {
        (None, None) => {}
        (Some((a, f, x)), Some((b, g, y))) if a == b && x == y => fences.pair(key, f, g)?,
        (m, r) => return Err(format!("d{key}'s lease record: model {m:?}, real {r:?}")),
    }
    if k.lock.is_none() {
        let mut m: Vec<(usize, Fence)> = k
            .pool
            .iter()
            .filter(|l| l.live())
            .map(|l| (ix(l.token), l.fence))
            .collect();
        m.sort_unstable();
        if m.len() != shared.len() || m.iter().zip(&shared).any(|(a, b)| a.0 != b.0) {
            return Err(format!(
                "d{key}'s shared holders: model {m:?}, real {shared:?}"
            ));
        }
        for (a, b) in m.iter().zip(&shared) {
            fences.pair(key, a.1, b.1)?;
        }
    }
    Ok(())
}
