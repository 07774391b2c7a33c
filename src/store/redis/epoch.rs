//! The store's epoch: how brokers notice that Redis lost, or may have lost, writes, and put
//! their live leases back before anything is granted again.
//!
//! An epoch is a period in which the store's data is continuous. It is recorded in a marker
//! (`<prefix>epoch`, see `scripts.rs`) with the server process (`run_id`) it began on. A new
//! epoch begins when the marker is missing (a new store, or one emptied by a restart without
//! persistence or a `FLUSHALL`) or names another server process (a restart from disk that may
//! have lost its last second, a replica promoted that may have missed writes). The broker that
//! sees it first starts the new epoch with a store-wide hold of `store_settle_ms` and announces
//! it on the notice channel.
//!
//! Each broker remembers the epoch it last caught up with and passes it to every granting
//! script, which refuses to grant in another epoch. A broker that meets a new epoch — through a
//! refused grant, the announcement, its once-a-second check, or the check every new connection
//! gets before use — puts its live leases (its [`Ledger`](crate::store::ledger::Ledger)) back
//! into the store, and only then grants in the new epoch. The hold gives every running broker
//! time to do so before anyone else's grant can land on one of those keys.
//!
//! On a Redis Cluster each master has its own epoch (a master can restart, be flushed or fail
//! over alone), and a script may only touch keys of one slot: so every slot has its own marker,
//! `<prefix>epoch{<tag>}`, with a hash tag chosen to land on that slot (`slots.rs`). A master's
//! epoch is decided atomically on the marker of its first slot (the check), then copied to the
//! markers of its other slots; a slot whose marker is missing answers "held", like a store with
//! no marker. The check asks the cluster for its masters (`CLUSTER SLOTS`) and checks each one:
//! its `run_id`, read from the master itself, and its first slot's marker. New connections to
//! cluster nodes are made by the `redis` crate, out of the broker's sight; what tells the broker
//! that one reached a new server process is NOSCRIPT — Redis 7 neither replicates nor persists
//! its script cache, so a restarted server or a promoted replica has none of the broker's
//! scripts, and the broker checks the epoch before it runs one there (`RedisStore::invoke`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::StreamExt;
use redis::Value;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::RedisStore;
use super::connection::Conn;
use super::slots::{SLOTS, slot_of};
use crate::domain::{LockKey, Token, millis};
use crate::store::ledger::{Entry, Kind};
use crate::store::{EXPIRY_SLACK_MS, Hold, HoldReason, Holder, Space, StoreError, StoreResult};

/// How many leases one put-back script call carries. Bounded so that one call stays short for
/// Redis (a script blocks the server while it runs).
const PUT_BACK_BATCH: usize = 100;

/// The payload that announces a repaired slot marker, followed by the slot.
pub(super) const SLOT_NOTICE: &str = "!slot ";

/// How many marker writes or put-back calls a cluster check keeps in flight at once.
const MARK_CONCURRENCY: usize = 64;

/// How often an idle broker checks the epoch, so it notices a flush (which breaks no
/// connection) within this.
pub(super) const CHECK_EVERY: Duration = Duration::from_secs(1);

/// What a broker knows of the store's epoch.
#[derive(Default)]
pub(super) struct Epoch {
    state: Mutex<EpochState>,
    /// One check or put-back at a time: they write the same leases.
    catching_up: tokio::sync::Mutex<()>,
    /// Wakes the epoch watcher to check now (another broker announced a new epoch, or a grant
    /// was refused for a stale one).
    pub wake: Notify,
}

#[derive(Default)]
struct EpochState {
    /// The epoch this broker caught up with, by shard: the first slot of a cluster master's
    /// slots, or 0 for one server. Missing before its first check.
    known: HashMap<u16, String>,
    /// Cluster only: the epoch each slot's marker is expected in (its master's, or — for a slot
    /// that moved from another master with its marker — that master's).
    slots: Option<Arc<[Arc<str>]>>,
    /// Set while this broker puts its leases back into a new epoch: it grants nothing meanwhile.
    putting_back_to: Option<String>,
}

impl EpochState {
    /// The epoch a key's marker is expected in: its slot's on a cluster, the store's otherwise.
    fn expected(&self, slot: Option<u16>) -> Option<&str> {
        match (slot, &self.slots) {
            (Some(slot), Some(slots)) => Some(&slots[usize::from(slot)]),
            (Some(_), None) => None,
            (None, _) => self.known.get(&0).map(String::as_str),
        }
    }
}

impl Epoch {
    fn state(&self) -> MutexGuard<'_, EpochState> {
        // Each write is one assignment: a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The epoch a grant on a key of `slot` (on a cluster) may be made in, or the hold while
    /// this broker is putting leases back.
    pub fn for_grant(&self, slot: Option<u16>) -> Result<String, Hold> {
        let state = self.state();
        if state.putting_back_to.is_some() {
            return Err(Hold {
                reason: HoldReason::PuttingBack,
                retry_after_ms: 1_000,
            });
        }
        Ok(state.expected(slot).unwrap_or_default().to_owned())
    }

    /// Whether `epoch` is older than the newest epoch this broker has seen for `slot` (or the
    /// one it is putting leases back into, if any).
    pub fn is_behind(&self, slot: Option<u16>, epoch: &str) -> bool {
        let state = self.state();
        if let Some(latest) = &state.putting_back_to {
            return latest != epoch;
        }
        state.expected(slot).is_some_and(|latest| latest != epoch)
    }

    /// Cluster: a slot's marker is in `epoch`, not its master's. If `epoch` is the current
    /// epoch of a master this broker has caught up with, the slot moved from that master with
    /// its data (and its marker): grants on it go on in that epoch. `false` otherwise.
    pub fn adopt(&self, slot: u16, epoch: &str) -> bool {
        let mut state = self.state();
        if !state.known.values().any(|known| known == epoch) {
            return false;
        }
        if let Some(slots) = &state.slots {
            let mut adopted = slots.to_vec();
            adopted[usize::from(slot)] = epoch.into();
            state.slots = Some(adopted.into());
        }
        true
    }

    pub fn putting_back(&self) -> bool {
        self.state().putting_back_to.is_some()
    }
}

/// While alive, this broker is putting its leases back into an epoch and grants nothing; however
/// the put-back ends (done, failed, or its task gone), dropping it lets grants through again.
struct PuttingBack<'a>(&'a Epoch);

impl<'a> PuttingBack<'a> {
    fn begin(epoch: &'a Epoch, into: &str) -> Self {
        epoch.state().putting_back_to = Some(into.to_owned());
        Self(epoch)
    }
}

impl Drop for PuttingBack<'_> {
    fn drop(&mut self) {
        self.0.state().putting_back_to = None;
    }
}

/// What the epoch check answered.
pub(super) struct Checked {
    id: String,
    run_id: String,
    hold_until_ms: u64,
    now_ms: u64,
    reason: String,
}

impl Checked {
    fn hold(&self) -> Option<Hold> {
        (self.now_ms < self.hold_until_ms).then(|| Hold {
            reason: if self.reason == "loss" {
                HoldReason::Loss
            } else {
                HoldReason::Settling
            },
            retry_after_ms: self.hold_until_ms - self.now_ms,
        })
    }
}

/// How a put-back went.
#[derive(Default)]
struct PutBack {
    written: usize,
    already_there: usize,
    double_claims: usize,
    counters_raised: usize,
}

/// One shard of the store for the epoch: a cluster master's slots, or the whole store.
pub(super) struct Shard {
    /// The shard's first slot (0 for one server): its epoch is decided on this slot's marker.
    pub first: u16,
    /// Its slot ranges, inclusive (empty for one server: every key).
    ranges: Vec<(u16, u16)>,
}

impl Shard {
    fn whole() -> Self {
        Self {
            first: 0,
            ranges: Vec::new(),
        }
    }

    fn holds(&self, slot: u16) -> bool {
        self.ranges.is_empty() || self.ranges.iter().any(|(a, b)| (*a..=*b).contains(&slot))
    }

    fn slots(&self) -> impl Iterator<Item = u16> + '_ {
        self.ranges.iter().flat_map(|(a, b)| *a..=*b)
    }
}

impl RedisStore {
    /// Checks the epoch on the current connection (making and verifying one if needed) and
    /// catches up with a new one. Returns the store-wide hold in force, if any.
    ///
    /// Every check reads the server's `run_id` again, so a restart behind a proxy that keeps
    /// client connections open is noticed within [`CHECK_EVERY`] too.
    ///
    /// A connection that fails the check is replaced and the check made again at once (the new
    /// connection's verification is the check): after a restart, the old connection is usually
    /// the first thing that fails, and the put-back must not wait for another round.
    pub(super) async fn catch_up(&self) -> StoreResult<Option<Hold>> {
        let deadline = Instant::now() + self.timeout;
        let mut last = None;
        for _ in 0..2 {
            let link = match tokio::time::timeout_at(deadline, self.link()).await {
                Ok(link) => link?,
                Err(_) => return Err(StoreError::Timeout(millis(self.timeout))),
            };
            let mut conn = link.conn.clone();
            // Unbounded here: a new epoch puts leases back (on a cluster, marks a master's
            // thousands of slots too), which must not stop halfway. Each call in it is bounded.
            let checked = if self.cluster {
                self.check_cluster(&mut conn).await
            } else {
                self.check_on(&mut conn).await
            };
            match checked {
                Ok(hold) => return Ok(hold),
                Err(e) => {
                    self.connection.drop_link(link.generation, &e);
                    last = Some(e);
                }
            }
        }
        Err(last.expect("two failed tries"))
    }

    /// The epoch check on `conn`, and the put-back if the epoch is not the one this broker
    /// knows. Run on every new connection before it is used.
    pub(super) async fn check_on(&self, conn: &mut Conn) -> StoreResult<Option<Hold>> {
        let _one = self.epoch.catching_up.lock().await;
        let checked = self.check_shard(conn, &Shard::whole()).await?;
        Ok(checked.hold())
    }

    /// The epoch check of every master of a cluster, each caught up with as [`check_on`] does
    /// for one server. Returns a hold only if every master holds: a master that settles alone
    /// holds only its own keys (its slots' markers say so to every script), and the broker stays
    /// ready for the others.
    ///
    /// [`check_on`]: RedisStore::check_on
    pub(super) async fn check_cluster(&self, conn: &mut Conn) -> StoreResult<Option<Hold>> {
        let _one = self.epoch.catching_up.lock().await;
        let shards = self.bounded(masters(conn)).await?;
        // The hold that stops every grant: the shortest, if every master holds.
        let mut hold: Option<Hold> = None;
        let mut all_held = !shards.is_empty();
        let mut epochs = Vec::with_capacity(shards.len());
        for shard in &shards {
            let checked = self.check_shard(conn, shard).await?;
            match checked.hold() {
                Some(h)
                    if hold
                        .as_ref()
                        .is_none_or(|held| h.retry_after_ms < held.retry_after_ms) =>
                {
                    hold = Some(h);
                }
                Some(_) => {}
                None => all_held = false,
            }
            epochs.push(checked.id);
        }
        let hold = hold.filter(|_| all_held);
        // Which epoch each slot's marker is expected in: its master's, unless the slot keeps
        // another master's current epoch (it moved here with its marker).
        let mut state = self.epoch.state();
        let current: Vec<&str> = epochs.iter().map(String::as_str).collect();
        let mut table: Vec<Arc<str>> = vec![Arc::from(""); usize::from(SLOTS)];
        for (shard, epoch) in shards.iter().zip(&epochs) {
            let epoch: Arc<str> = epoch.as_str().into();
            for slot in shard.slots() {
                let kept = state
                    .slots
                    .as_ref()
                    .map(|old| &old[usize::from(slot)])
                    .filter(|old| current.contains(&&***old) && ***old != *epoch);
                table[usize::from(slot)] = kept.cloned().unwrap_or_else(|| epoch.clone());
            }
        }
        state
            .known
            .retain(|first, _| shards.iter().any(|s| s.first == *first));
        state.slots = Some(table.into());
        Ok(hold)
    }

    /// Checks one shard's epoch and catches up with it: puts this broker's leases on the shard
    /// back if the epoch is not the one it knew. Called with `catching_up` held.
    async fn check_shard(&self, conn: &mut Conn, shard: &Shard) -> StoreResult<Checked> {
        let marker = self.marker_of(shard.first);
        // A put-back that finds the epoch moved again (a second loss meanwhile) starts over; a
        // put-back that went through checks once more, for the hold as the put-back left it.
        for _ in 0..4 {
            let known = self.epoch.state().known.get(&shard.first).cloned();
            let checked = self.run_check(conn, &marker, known.as_deref()).await?;
            if known.as_deref() == Some(checked.id.as_str()) {
                return Ok(checked);
            }
            if known.is_none()
                && let Some(hold) = checked.hold()
                && hold.reason == HoldReason::Settling
            {
                tracing::info!(
                    settle_ms = hold.retry_after_ms,
                    "the lock store has no record of earlier grants (new or emptied): \
                     settling before the first grant"
                );
            }
            let putting_back = PuttingBack::begin(&self.epoch, &checked.id);
            let started = Instant::now();
            // On a cluster, the slots of this broker's leases are marked first and their leases
            // put back at once, then the master's other slots are marked: the put-back must
            // not wait for thousands of markers while the hold runs.
            let leased: BTreeSet<u16> = if self.cluster {
                self.ledger
                    .live(Instant::now())
                    .iter()
                    .filter_map(|(key, _)| self.slot(key))
                    .filter(|slot| shard.holds(*slot))
                    .collect()
            } else {
                BTreeSet::new()
            };
            if self.cluster {
                self.mark_slots(conn, shard, &checked, |slot| leased.contains(&slot))
                    .await?;
            }
            // The epoch moved during the put-back (`None`): check again.
            let put_back = self.put_back_all(conn, shard, &checked.id).await?;
            if self.cluster {
                self.mark_slots(conn, shard, &checked, |slot| !leased.contains(&slot))
                    .await?;
            }
            if let Some(report) = put_back {
                self.epoch
                    .state()
                    .known
                    .insert(shard.first, checked.id.clone());
                drop(putting_back);
                match known {
                    Some(known) => self.report_loss(&known, &checked, &report, started.elapsed()),
                    None => return Ok(checked),
                }
            }
        }
        Err(StoreError::Failed(
            "the lock store's epoch keeps changing; not granting until it settles".into(),
        ))
    }

    /// Cluster: a slot's marker is missing while its master's epoch goes on (the marker was
    /// deleted or evicted on its own, and the slot's lock keys may have gone with it). The slot
    /// gets its marker back, in its master's epoch, with a hold of `store_settle_ms`, and the
    /// repair is announced (`!slot <n>`) so that every broker puts its leases on the slot back
    /// ([`RedisStore::put_back_slot`]) before the hold ends. Logged as an error: Redis should
    /// not evict keys.
    pub(super) async fn repair_slot(&self, slot: u16) -> StoreResult<()> {
        let Ok(epoch) = self.epoch.for_grant(Some(slot)) else {
            return Ok(());
        };
        let Some(link) = self.connection.current() else {
            return Ok(());
        };
        let mut conn = link.conn.clone();
        let mut eval = redis::cmd("EVAL");
        eval.arg(self.scripts.repair)
            .arg(1)
            .arg(self.marker_of(slot))
            .arg(&epoch)
            .arg(millis(self.store_settle))
            .arg(&*self.channel)
            .arg(format!("{SLOT_NOTICE}{slot}"));
        let repaired: i64 = self.bounded(eval.query_async(&mut conn)).await?;
        if repaired == 1 {
            tracing::error!(
                slot,
                "the epoch marker of one Redis Cluster slot was missing (deleted or evicted: keep \
                 Redis from evicting keys); the slot's keys are held for the settle time while \
                 every broker puts its leases on it back"
            );
            self.metrics.store_loss(0, 0, millis(self.store_settle));
        }
        self.put_back_slot(slot).await
    }

    /// Cluster: puts this broker's live leases on `slot` back (after a repair of its marker).
    pub(super) async fn put_back_slot(&self, slot: u16) -> StoreResult<()> {
        let _one = self.epoch.catching_up.lock().await;
        let Ok(epoch) = self.epoch.for_grant(Some(slot)) else {
            return Ok(());
        };
        let Some(link) = self.connection.current() else {
            return Ok(());
        };
        let mut conn = link.conn.clone();
        let marker = self.marker_of(slot);
        let leases: Vec<(LockKey, Entry)> = self
            .ledger
            .live(Instant::now())
            .into_iter()
            .filter(|(key, _)| self.slot(key) == Some(slot))
            .collect();
        let mut report = PutBack::default();
        for batch in leases.chunks(PUT_BACK_BATCH) {
            self.put_back(&mut conn, &marker, &epoch, batch, &mut report)
                .await?;
        }
        if report.written > 0 {
            tracing::warn!(
                slot,
                put_back = report.written,
                "put leases back on a repaired slot"
            );
            self.metrics.leases_put_back(report.written);
        }
        Ok(())
    }

    /// Cluster: copies a master's new epoch from its first slot's marker to its other slots'.
    async fn mark_slots(
        &self,
        conn: &Conn,
        shard: &Shard,
        checked: &Checked,
        which: impl Fn(u16) -> bool,
    ) -> StoreResult<()> {
        let fields: Arc<[String; 4]> = Arc::new([
            checked.id.clone(),
            checked.run_id.clone(),
            checked.hold_until_ms.to_string(),
            checked.reason.clone(),
        ]);
        let calls: Vec<_> = shard
            .slots()
            .filter(|s| *s != shard.first && which(*s))
            .map(|slot| {
                let (store, mut conn, fields) = (self.clone(), conn.clone(), fields.clone());
                async move {
                    let mut eval = redis::cmd("EVAL");
                    eval.arg(store.scripts.mark)
                        .arg(1)
                        .arg(store.marker_of(slot))
                        .arg(&fields[..]);
                    store.bounded(eval.query_async::<i64>(&mut conn)).await
                }
            })
            .collect();
        let mut marks = futures_util::stream::iter(calls).buffer_unordered(MARK_CONCURRENCY);
        while let Some(marked) = marks.next().await {
            marked?;
        }
        Ok(())
    }

    async fn run_check(
        &self,
        conn: &mut Conn,
        marker: &str,
        known: Option<&str>,
    ) -> StoreResult<Checked> {
        let mut eval = redis::cmd("EVAL");
        eval.arg(&self.scripts.check)
            .arg(1)
            .arg(marker)
            .arg(known.unwrap_or(""))
            .arg(millis(self.store_settle))
            .arg(millis(self.store_loss_delay))
            .arg(&*self.channel);
        let (id, hold_until_ms, now_ms, reason, run_id): (String, u64, u64, String, String) =
            self.bounded(eval.query_async(conn)).await?;
        Ok(Checked {
            id,
            run_id,
            hold_until_ms,
            now_ms,
            reason,
        })
    }

    /// Puts every live lease of the ledger on `shard` back into epoch `epoch`. `None` if the
    /// epoch moved meanwhile. On a cluster, one script call per slot (a script's keys must
    /// share a slot), several at once.
    async fn put_back_all(
        &self,
        conn: &Conn,
        shard: &Shard,
        epoch: &str,
    ) -> StoreResult<Option<PutBack>> {
        let leases = self.ledger.live(Instant::now());
        let mut by_slot: BTreeMap<Option<u16>, Vec<(LockKey, Entry)>> = BTreeMap::new();
        for (key, entry) in leases {
            let slot = self.cluster.then(|| slot_of(self.keys(&key)[0].as_bytes()));
            if slot.is_none_or(|slot| shard.holds(slot)) {
                by_slot.entry(slot).or_default().push((key, entry));
            }
        }
        let epoch: Arc<str> = epoch.into();
        let calls: Vec<_> = by_slot
            .into_iter()
            .flat_map(|(slot, leases)| {
                let marker = slot.map_or_else(|| self.marker.to_string(), |s| self.marker_of(s));
                leases
                    .chunks(PUT_BACK_BATCH)
                    .map(|batch| (marker.clone(), batch.to_vec()))
                    .collect::<Vec<_>>()
            })
            .map(|(marker, batch)| {
                let (store, mut conn, epoch) = (self.clone(), conn.clone(), epoch.clone());
                async move {
                    let mut report = PutBack::default();
                    let done = store
                        .put_back(&mut conn, &marker, &epoch, &batch, &mut report)
                        .await?;
                    Ok::<_, StoreError>(done.then_some(report))
                }
            })
            .collect();
        let mut calls = futures_util::stream::iter(calls).buffer_unordered(if self.cluster {
            MARK_CONCURRENCY
        } else {
            1
        });
        let mut total = PutBack::default();
        while let Some(batch) = calls.next().await {
            let Some(report) = batch? else {
                return Ok(None);
            };
            total.written += report.written;
            total.already_there += report.already_there;
            total.double_claims += report.double_claims;
            total.counters_raised += report.counters_raised;
        }
        Ok(Some(total))
    }

    /// Puts `batch` back; `false` if the store is no longer in `epoch`.
    async fn put_back(
        &self,
        conn: &mut Conn,
        marker: &str,
        epoch: &str,
        batch: &[(LockKey, Entry)],
        report: &mut PutBack,
    ) -> StoreResult<bool> {
        let now = Instant::now();
        let mut inv = self.scripts.put_back.call();
        inv.key(marker).arg(epoch).arg(EXPIRY_SLACK_MS);
        for (key, entry) in batch {
            let names = self.names(entry.kind.space(), key);
            match entry.kind {
                Kind::Exclusive => inv
                    .key(names.lock)
                    .key(names.fence)
                    .key(names.pool)
                    .key(names.ends)
                    .arg("x"),
                Kind::Shared => inv
                    .key(names.pool)
                    .key(names.ends)
                    .key(names.fence)
                    .key(names.lock)
                    .arg("s"),
                Kind::Semaphore { limit } => inv
                    .key(names.pool)
                    .key(names.ends)
                    .key(names.fence)
                    .key(names.lock)
                    .arg(limit),
            };
            inv.arg(entry.token.as_str())
                .arg(entry.fence)
                .arg(millis(entry.remaining(now)).max(1))
                .arg(entry.ttl_ms)
                .arg(
                    entry
                        .owner
                        .as_ref()
                        .map_or(String::new(), |o| format!("={}", o.as_str())),
                )
                .arg(
                    entry
                        .request_id
                        .as_ref()
                        .map_or(String::new(), |r| format!("={}", r.as_str())),
                );
        }
        // Inside the check: a NOSCRIPT here needs no other check first.
        let reply: Vec<Value> = self.bounded(self.invoke_unchecked(conn, &inv)).await?;
        let codes: Vec<i64> = reply
            .iter()
            .map(redis::FromRedisValue::from_redis_value_ref)
            .collect::<Result<_, _>>()
            .map_err(|_| StoreError::Failed("malformed put-back reply".into()))?;
        if codes.first() == Some(&-1) {
            return Ok(false);
        }
        if codes.len() != 3 * batch.len() {
            return Err(StoreError::Failed("malformed put-back reply".into()));
        }
        for ((key, entry), outcome) in batch.iter().zip(codes.chunks(3)) {
            let [code, other, raised] = [outcome[0], outcome[1], outcome[2]];
            report.counters_raised += usize::from(raised == 1);
            match code {
                1 => report.written += 1,
                0 => report.already_there += 1,
                2 => {
                    report.double_claims += 1;
                    tracing::error!(
                        %key, kept_fence = other, dropped_fence = entry.fence,
                        "a lock had two holders after a store loss; the lease with the higher \
                         fence stays, the other holder's next renew answers not_owner"
                    );
                    self.ledger
                        .forget_any(entry.kind.space(), key, &entry.token);
                }
                3 => {
                    report.double_claims += 1;
                    report.written += 1;
                    tracing::error!(
                        %key, kept_fence = entry.fence, dropped_fence = other,
                        "a lock had two holders after a store loss; the lease with the higher \
                         fence stays, the other holder's next renew answers not_owner"
                    );
                }
                _ => return Err(StoreError::Failed("malformed put-back reply".into())),
            }
            if code != 2 && !self.ledger.holds(key, entry.kind, &entry.token) {
                // Released while the put-back ran: release it again, or it would block its key
                // until it ends.
                self.release_again(
                    entry.kind.space(),
                    key.clone(),
                    entry.token.clone(),
                    entry.remaining(now),
                );
            }
        }
        Ok(true)
    }

    /// Releases a lease put back after its holder had released it, retrying (the store may still
    /// be on its way back, or the hold in force) until a definite answer or the lease's end.
    fn release_again(&self, space: Space, key: LockKey, token: Token, remaining: Duration) {
        let store = self.clone();
        tokio::spawn(async move {
            let give_up = Instant::now() + remaining;
            let mut pause = Duration::from_millis(50);
            loop {
                match crate::store::Store::release(&store, space, &key, &token).await {
                    Ok(Holder::Held(_)) | Err(_) if Instant::now() + pause < give_up => {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(1));
                    }
                    _ => return,
                }
            }
        });
    }

    /// A lease recorded under an epoch older than the newest one seen may have missed the
    /// put-back (its answer raced the loss): put it back on its own.
    pub(super) fn put_back_late(&self, key: LockKey, kind: Kind, token: Token) {
        let store = self.clone();
        tokio::spawn(async move {
            let Some(link) = store.connection.current() else {
                // The next connection's check puts every lease back.
                return;
            };
            let mut conn = link.conn.clone();
            let _one = store.epoch.catching_up.lock().await;
            let slot = store.slot(&key);
            let Ok(epoch) = store.epoch.for_grant(slot) else {
                return;
            };
            let Some(entry) = store.ledger.get(&key, kind, &token) else {
                return;
            };
            let mut report = PutBack::default();
            let marker = store.marker_for(&key);
            match store
                .put_back(&mut conn, &marker, &epoch, &[(key, entry)], &mut report)
                .await
            {
                Ok(true) => store.metrics.leases_put_back(report.written),
                // The epoch moved (or the call failed): a full check catches up.
                _ => store.epoch.wake.notify_one(),
            }
        });
    }

    fn report_loss(&self, was: &str, checked: &Checked, report: &PutBack, took: Duration) {
        let hold_ms = checked.hold_until_ms.saturating_sub(checked.now_ms);
        tracing::warn!(
            was_epoch = %was,
            epoch = %checked.id,
            put_back = report.written,
            already_there = report.already_there,
            double_claims = report.double_claims,
            fence_counters_raised = report.counters_raised,
            hold_ms,
            put_back_ms = millis(took),
            "the lock store lost or may have lost writes (restart, flush or failover): put this \
             broker's live leases back; grants resume when the hold ends"
        );
        self.metrics
            .store_loss(report.written, report.double_claims, hold_ms);
    }
}

/// The cluster's masters and their slot ranges (`CLUSTER SLOTS`), ordered by first slot.
pub(super) async fn masters(conn: &mut Conn) -> redis::RedisResult<Vec<Shard>> {
    let ranges: Vec<Value> = redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await?;
    let mut by_master: BTreeMap<(String, u16), Vec<(u16, u16)>> = BTreeMap::new();
    for range in &ranges {
        let Value::Array(parts) = range else { continue };
        let (Some(start), Some(end), Some(Value::Array(master))) =
            (parts.first(), parts.get(1), parts.get(2))
        else {
            continue;
        };
        let (Some(host), Some(port)) = (master.first(), master.get(1)) else {
            continue;
        };
        let host: String = redis::from_redis_value_ref(host)?;
        let port: u16 = redis::from_redis_value_ref(port)?;
        by_master.entry((host, port)).or_default().push((
            redis::from_redis_value_ref(start)?,
            redis::from_redis_value_ref(end)?,
        ));
    }
    let mut shards: Vec<Shard> = by_master
        .into_values()
        .map(|mut ranges| {
            ranges.sort_unstable();
            Shard {
                first: ranges[0].0,
                ranges,
            }
        })
        .collect();
    shards.sort_by_key(|s| s.first);
    Ok(shards)
}
