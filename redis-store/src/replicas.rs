//! Replica acknowledgements (`--redis-replica-acks N`): a grant or a renewal is answered only
//! once `N` replicas have it, as Redis's `WAIT` confirms, so a failover to one of them keeps it.
//!
//! `WAIT` counts the writes of the connection it runs on, so it follows the script on the same
//! connection: the multiplexed connection of a single server or Sentinel master, or on a cluster
//! the connection to the master of the lock's slot (see [`Conn::wait_for_replicas`]). On a
//! shared multiplexed connection it may wait for other requests' later writes too: a stricter
//! wait, never a looser one. `WAIT` blocks the connection it runs on: while a replica stalls,
//! the broker's other calls queue behind it (see docs/topologies.md).
//!
//! **Group commit.** One `WAIT` acknowledges every earlier write on its connection, so grants
//! share them: at most one `WAIT` is in flight per connection ([`Group`]), and the grants whose
//! writes complete meanwhile are all answered by the next one. One `WAIT` per grant would put
//! each grant's script behind every earlier grant's replication round trip (Redis runs a
//! connection's commands in order, and `WAIT` holds the connection until it returns). A grant
//! is only ever answered by a `WAIT` sent after its own write had completed: each `WAIT` is
//! numbered when it is sent, a grant notes the number reached once its write is done, and only
//! a `WAIT` with a higher number answers it.
//!
//! **The same connection.** `WAIT` counts only the writes of the connection it runs on: on a
//! connection made after the write (the one that carried it broke, timed out or was replaced
//! after a master switch), it has nothing to wait for and would answer at once with every
//! replica — an acknowledgement of nothing. So each write's connection generation is noted,
//! and only a `WAIT` on that same connection answers it; if the connection was replaced
//! meanwhile, the write counts as not acknowledged (released or put back, as below). On a
//! cluster, the cluster client can also remake a node's connection unseen; that case is not
//! covered (docs/topologies.md).
//!
//! When the replicas do not confirm in time, nothing is left that the client was not told:
//! - a **grant** is released (by its token, holder-checked), and the request answers
//!   `503 store_unavailable`;
//! - a **renewal** (of an exclusive lease, a shared one or a permit) puts back the end of the
//!   lease that the holder had before it (read just
//!   before renewing), and answers `503`: the lease then ends exactly when the holder was last
//!   told, neither later (the master would otherwise keep a longer lease than any answer said)
//!   nor sooner (ending it would hand the key to someone else while its holder still believes
//!   its last answer). If the lease was not this token's live lease when the renewal began,
//!   nothing was promised and it is released. (One race is not covered: the same holder
//!   renewing through another broker between that read and this renewal was told an end that
//!   the restore then moves back to the one read.)
//!
//! The clean-up is a write the stalled replicas do not have either; what counts is the master,
//! which every later request reads. Each is a DEBUG line: the request's `503` is counted into the
//! store outage in progress, and so is a clean-up that failed (see `lockbroker_core::metrics::Outage`), which
//! the logs tell once when it begins and once when it ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::Script;

use super::RedisStore;
use super::connection::Conn;
use lockbroker_core::domain::{Lease, LockKey, Space, Token, millis};
use lockbroker_core::store::{EXPIRY_SLACK_MS, Store, StoreError, StoreResult};

/// Puts back the end of an exclusive lease whose renewal the replicas did not acknowledge.
const RESTORE: &str = include_str!("scripts/restore.lua");

/// RESTORE for a shared lease or a permit.
const RESTORE_POOLED: &str = include_str!("scripts/restore_pooled.lua");

/// What the store does after each granting or renewing write.
pub(super) struct Replicas {
    /// How many replicas must have a write before it is answered; 0: no `WAIT` at all.
    acks: u32,
    /// `WAIT`'s own timeout: half the store timeout. It must be shorter than the connection's
    /// response timeout (the store timeout), or a stalled replica would look like a broken
    /// connection; and an acquire is bounded by the store timeout as a whole, so the grant's
    /// script before it and the release after it need the other half.
    wait_ms: u64,
    restore: Script,
    restore_pooled: Script,
    /// The group commit of the one connection of a single server or a Sentinel master.
    single: Group,
    /// On a cluster, one group per slot: `WAIT` goes to the slot's master (see the module's
    /// documentation).
    slots: Mutex<HashMap<u16, Arc<Group>>>,
}

/// Group commit on one connection: the `WAIT`s sent on it, one at a time, and the outcome of the
/// last one, which answers every grant whose write completed before it was sent.
#[derive(Default)]
struct Group {
    /// Held while a `WAIT` is in flight: the next grants wait for it, then share one `WAIT`.
    turn: tokio::sync::Mutex<()>,
    /// How many `WAIT`s were sent on this connection; counted up just before each is sent.
    sent: AtomicU64,
    /// The last `WAIT` that returned: its number, the generation of the connection it ran on,
    /// and how many replicas acknowledged.
    last: Mutex<Option<(u64, u64, StoreResult<u64>)>>,
}

impl Group {
    /// How many replicas acknowledged a `WAIT` sent after this call began, so after the
    /// caller's write completed, on the connection `generation` that carried that write: the
    /// last one's answer if it was sent late enough on that connection, or one this call sends
    /// (`wait` runs it on that connection, or fails), after the one in flight returns. Waits
    /// at most `limit` for its turn.
    async fn acknowledged(
        &self,
        limit: Duration,
        generation: u64,
        wait: impl AsyncFnOnce() -> StoreResult<u64>,
    ) -> StoreResult<u64> {
        // Every WAIT numbered above `mark` is sent after this point.
        let mark = self.sent.load(Ordering::SeqCst);
        let answered = || {
            self.last
                .lock()
                .expect("the WAIT record is never poisoned")
                .as_ref()
                .filter(|(number, on, _)| *number > mark && *on == generation)
                .map(|(_, _, acked)| acked.clone())
        };
        let Ok(_turn) = tokio::time::timeout(limit, self.turn.lock()).await else {
            return Err(StoreError::Timeout(millis(limit)));
        };
        // A WAIT sent after `mark` returned while this call waited for its turn: it covers
        // this call's write (group commit).
        if let Some(acked) = answered() {
            return acked;
        }
        let number = self.sent.fetch_add(1, Ordering::SeqCst) + 1;
        let acked = wait().await;
        *self.last.lock().expect("the WAIT record is never poisoned") =
            Some((number, generation, acked.clone()));
        acked
    }
}

/// A lease a script wrote (granted or renewed), and the generation of the connection that
/// carried the write: its acknowledgement is asked on that connection.
pub(super) struct Written<'a> {
    pub lease: &'a Lease,
    pub generation: u64,
}

/// The lease as its holder knew it before a renewal: what a renewal that replicas did not
/// acknowledge puts back.
pub(super) struct Told {
    expires_at_ms: u64,
    ttl_ms: u64,
    /// A shared lease or a permit, not the exclusive lease.
    pooled: bool,
}

impl Replicas {
    pub(super) fn new(acks: u32, store_timeout: Duration) -> Self {
        Self {
            acks,
            wait_ms: (millis(store_timeout) / 2).max(1),
            restore: Script::new(RESTORE),
            restore_pooled: Script::new(RESTORE_POOLED),
            single: Group::default(),
            slots: Mutex::default(),
        }
    }

    /// Whether writes wait for replicas at all (`--redis-replica-acks` above 0). Callers box
    /// the waits behind this, so that a store without replica acks (the usual one) does not
    /// carry room for them in every grant's and renewal's future.
    pub(super) fn asked(&self) -> bool {
        self.acks > 0
    }

    /// After a grant, before it is answered: `Ok` once enough replicas have it. Otherwise a
    /// lease this request created is released (one handed back again by request id was
    /// granted, and answered, before), and the error is the answer.
    pub(super) async fn confirm_grant(
        &self,
        store: &RedisStore,
        space: Space,
        key: &LockKey,
        bid: &Token,
        Written { lease, generation }: Written<'_>,
    ) -> StoreResult<()> {
        let Err(error) = self.confirm(store, key, generation).await else {
            return Ok(());
        };
        if lease.token == *bid {
            match store.release(space, key, &lease.token).await {
                Ok(_) => {
                    tracing::debug!(%key, %error, "a grant was not acknowledged by the replicas in time: released it")
                }
                Err(e) => {
                    tracing::debug!(%key, %error, release_error = %e, "a grant was not acknowledged by the replicas in time, and releasing it failed: it ends at its TTL");
                    store.metrics.outage().cleanup_failed(&e);
                }
            }
        }
        Err(error)
    }

    /// [`Replicas::confirm_grant`] for one write that granted `lease` on every key of `keys`
    /// (CLAIM_ALL): one wait, and when the replicas do not acknowledge it, every key released.
    pub(super) async fn confirm_grants(
        &self,
        store: &RedisStore,
        keys: &[LockKey],
        lease: &Lease,
        generation: u64,
    ) -> StoreResult<()> {
        let Some(first) = keys.first() else {
            return Ok(());
        };
        let Err(error) = self.confirm(store, first, generation).await else {
            return Ok(());
        };
        let releases = keys
            .iter()
            .map(|key| store.release(Space::Locks, key, &lease.token));
        for (key, released) in keys
            .iter()
            .zip(futures_util::future::join_all(releases).await)
        {
            if let Err(e) = released {
                tracing::debug!(%key, %error, release_error = %e, "a grant was not acknowledged by the replicas in time, and releasing it failed: it ends at its TTL");
                store.metrics.outage().cleanup_failed(&e);
            }
        }
        Err(error)
    }

    /// Before a renewal: the lease as its holder knows it (exclusive, shared or a permit), if
    /// acknowledgements are asked for.
    pub(super) async fn before_renew(
        &self,
        store: &RedisStore,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> StoreResult<Option<Told>> {
        if self.acks == 0 {
            return Ok(None);
        }
        let (now_ms, exclusive, pooled) = match space {
            Space::Locks => {
                let snapshot = store.read(key).await?;
                (snapshot.now_ms, snapshot.lease, snapshot.shared)
            }
            Space::Semaphores => {
                let permits = store.permits(key).await?;
                (permits.now_ms, None, permits.holders)
            }
        };
        let told = |l: &Lease, pooled| Told {
            expires_at_ms: l.expires_at_ms,
            ttl_ms: l.ttl_ms,
            pooled,
        };
        Ok(exclusive
            .filter(|l| l.token == *token && l.is_live_at(now_ms))
            .map(|l| told(&l, false))
            .or_else(|| {
                pooled
                    .iter()
                    .find(|l| l.token == *token)
                    .map(|l| told(l, true))
            }))
    }

    /// After a renewal, before it is answered: `Ok` once enough replicas have it. Otherwise the
    /// lease's end before the renewal is put back (see the module's documentation) and the
    /// error is the answer.
    pub(super) async fn confirm_renew(
        &self,
        store: &RedisStore,
        space: Space,
        key: &LockKey,
        token: &Token,
        told: Option<Told>,
        Written {
            lease: renewed,
            generation,
        }: Written<'_>,
    ) -> StoreResult<()> {
        let Err(error) = self.confirm(store, key, generation).await else {
            return Ok(());
        };
        let undone = match told {
            Some(told) => {
                let names = store.layout.names(space, key);
                let mut inv = if told.pooled {
                    let mut inv = self.restore_pooled.key(names.pool);
                    inv.key(names.ends);
                    inv
                } else {
                    self.restore.key(names.lock)
                };
                inv.arg(token.as_str())
                    .arg(told.expires_at_ms)
                    .arg(told.ttl_ms)
                    .arg(EXPIRY_SLACK_MS)
                    .arg(&*store.channel)
                    .arg(&names.notice)
                    .arg(renewed.expires_at_ms);
                store
                    .keeper
                    .with_link(async |conn| inv.invoke_async::<u8>(conn).await)
                    .await
                    .map(drop)
            }
            None => store.release(space, key, token).await.map(drop),
        };
        match undone {
            Ok(()) => {
                tracing::debug!(%key, %error, "a renewal was not acknowledged by the replicas in time: the lease ends when its holder was last told")
            }
            Err(e) => {
                tracing::debug!(%key, %error, undo_error = %e, "a renewal was not acknowledged by the replicas in time, and undoing it failed: the lease ends at the renewed time");
                store.metrics.outage().cleanup_failed(&e);
            }
        }
        Err(error)
    }

    /// `WAIT`s for the replicas after a write on `key` made over connection `generation`.
    async fn confirm(&self, store: &RedisStore, key: &LockKey, generation: u64) -> StoreResult<()> {
        if self.acks == 0 {
            return Ok(());
        }
        let [lock, _] = store.layout.keys(key);
        let (acks, wait_ms) = (self.acks, self.wait_ms);
        let wait = async || {
            store
                .keeper
                .with_link_on(generation, async |conn: &mut Conn| {
                    conn.wait_for_replicas(&lock, acks, wait_ms).await
                })
                .await
        };
        // The turn waits at most as long as the WAIT it waits for: a grant waits for two WAITs
        // at most, both within the store timeout (each WAIT waits half of it).
        let limit = Duration::from_millis(wait_ms);
        let acked = match store.layout.slot(key) {
            None => self.single.acknowledged(limit, generation, wait).await,
            Some(slot) => {
                let group = self
                    .slots
                    .lock()
                    .expect("the groups are never poisoned")
                    .entry(slot)
                    .or_default()
                    .clone();
                group.acknowledged(limit, generation, wait).await
            }
        }?;
        if acked >= u64::from(acks) {
            return Ok(());
        }
        tracing::debug!(%key, acked, wanted = acks, wait_ms, "replicas did not acknowledge in time");
        Err(StoreError::Timeout(wait_ms))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use tokio::sync::oneshot;

    use super::*;

    /// Lets the spawned tasks run until `done` holds (a current-thread runtime: they run only
    /// when this task yields).
    async fn until(done: impl Fn() -> bool) {
        while !done() {
            tokio::task::yield_now().await;
        }
    }

    /// Three writes on one group: A's `WAIT` in flight, then B and C wait for their turn, C's
    /// write on connection `c_generation`. Returns how many `WAIT`s were sent in all.
    async fn waits_sent(c_generation: u64) -> usize {
        let group = Arc::new(Group::default());
        let sent = Arc::new(AtomicUsize::new(0));
        let limit = Duration::from_secs(5);
        let blocked_wait = |gate: oneshot::Receiver<()>| {
            let sent = sent.clone();
            async move || {
                sent.fetch_add(1, Ordering::SeqCst);
                gate.await.expect("the test opens the gate");
                Ok(1)
            }
        };
        let (open_a, gate_a) = oneshot::channel();
        let (open_b, gate_b) = oneshot::channel();
        let a = tokio::spawn({
            let (group, wait) = (group.clone(), blocked_wait(gate_a));
            async move { group.acknowledged(limit, 1, wait).await }
        });
        until(|| sent.load(Ordering::SeqCst) == 1).await;
        let b = tokio::spawn({
            let (group, wait) = (group.clone(), blocked_wait(gate_b));
            async move { group.acknowledged(limit, 1, wait).await }
        });
        tokio::task::yield_now().await;
        let c = tokio::spawn({
            let (group, sent) = (group.clone(), sent.clone());
            async move {
                group
                    .acknowledged(limit, c_generation, async || {
                        sent.fetch_add(1, Ordering::SeqCst);
                        Ok(1)
                    })
                    .await
            }
        });
        tokio::task::yield_now().await;
        open_a.send(()).unwrap();
        assert_eq!(a.await.unwrap().unwrap(), 1);
        // B's WAIT is sent after C's write completed.
        until(|| sent.load(Ordering::SeqCst) == 2).await;
        open_b.send(()).unwrap();
        assert_eq!(b.await.unwrap().unwrap(), 1);
        assert_eq!(c.await.unwrap().unwrap(), 1);
        sent.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn a_wait_sent_after_a_write_on_its_connection_answers_it_too() {
        assert_eq!(waits_sent(1).await, 2);
    }

    #[tokio::test]
    async fn a_wait_on_a_newer_connection_never_answers_a_write_made_on_an_older_one() {
        assert_eq!(waits_sent(2).await, 3);
    }
}
