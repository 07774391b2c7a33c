//! Replica acknowledgements (`--redis-replica-acks N`): a grant or a renewal is answered only
//! once `N` replicas have it, as Redis's `WAIT` confirms, so a failover to one of them keeps it.
//!
//! `WAIT` counts the writes of the connection it runs on, so it follows the script on the same
//! connection. On a shared multiplexed connection it may wait for other requests' later writes
//! too: a stricter wait, never a looser one. And `WAIT` blocks the connection it runs on: Redis
//! runs a connection's commands in order, and holds the next ones until the `WAIT` returns.
//!
//! **Ack links.** On one server or a Sentinel master, the writes that wait for replicas do not go
//! over the broker's main connection but over a few connections beside it, [`ACK_LINKS`] of them
//! (`connection/ack_links.rs`), each write and the `WAIT` that confirms it over the same one. So
//! up to [`ACK_LINKS`] replication round trips are in flight at once, and the broker's other
//! calls (releases, reads, the epoch check, grants without acks) never queue behind a `WAIT`.
//! A write goes over the first link with no `WAIT` in flight, starting from its key's own (by
//! the key's hash), and over the key's own when every link has one ([`Replicas::link_for`]):
//! a write sent behind a `WAIT` waits in Redis for that `WAIT` to return before it even runs,
//! then for a `WAIT` of its own — about one and a half replication round trips instead of one.
//! Nothing needs one key's writes on one connection: each is answered (after its `WAIT`) before
//! its holder's next call, and the clean-ups after an unacknowledged write go over the main
//! connection anyway. On a cluster the script and its `WAIT` go to the master of the lock's
//! slot, over the cluster client's connection to that node (see [`Conn::wait_for_replicas`]):
//! one per master already.
//! Claims that wait for replicas are not batched (`batch.rs`): a batch goes over the main
//! connection, and its operations would each need a `WAIT` there.
//!
//! **Group commit.** One `WAIT` acknowledges every earlier write on its connection, so grants
//! share them: at most one `WAIT` is in flight per connection — per ack link, and on a cluster per
//! slot ([`Group`]) — and the grants whose writes complete meanwhile are all answered by the next
//! one. One `WAIT` per grant would put each grant's script behind every earlier grant's
//! replication round trip (the connection is held until each `WAIT` returns). A grant is only
//! ever answered by a `WAIT` sent after its own write had completed: each `WAIT` is numbered when
//! it is sent, a grant notes the number reached once its write is done, and only a `WAIT` with a
//! higher number answers it. Each ack link has its own group, so its numbering and its last
//! answer are its own.
//!
//! **The same connection.** `WAIT` counts only the writes of the connection it runs on: on a
//! connection made after the write (the one that carried it broke, timed out or was replaced
//! after a master switch), it has nothing to wait for and would answer at once with every
//! replica — an acknowledgement of nothing. So each write's connection generation is noted
//! (main connection and ack links draw theirs from one count: a generation names one
//! connection), and only a `WAIT` on that same connection answers it; if the connection was
//! replaced meanwhile, the write counts as not acknowledged (released or put back, as below).
//! An ack link goes with the main connection it was made beside (a master switch replaces them
//! all). On a cluster, the cluster client can also remake a node's connection unseen; that case
//! is not covered (docs/topologies.md).
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
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::Script;

use self::group::Group;
use super::RedisStore;
use super::connection::Conn;
use lockbroker_core::domain::{Lease, LockKey, Space, Token, millis};
use lockbroker_core::store::{EXPIRY_SLACK_MS, Store, StoreError, StoreResult};

mod group;

/// How many ack links a store keeps beside its main connection when replicas are asked for,
/// on one server or a Sentinel master: how many `WAIT`s can be in flight at once. Each is made
/// when a write first needs it. With the replica 1 ms away and 64 clients on a 2-core machine,
/// 16 did best (with 4 or 8 most writes still waited behind a `WAIT`; 32 did no better; see
/// docs/benchmarks.md, "Replica acknowledgements").
pub(super) const ACK_LINKS: usize = 16;

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
    /// The group commits of the ack links of a single server or a Sentinel master, one per
    /// link (`connection/ack_links.rs`).
    links: Box<[Group]>,
    /// On a cluster, one group per slot: `WAIT` goes to the slot's master (see the module's
    /// documentation).
    slots: Mutex<HashMap<u16, Arc<Group>>>,
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
    /// `links`: how many ack links the connection keeps (`connection/ack_links.rs`).
    pub(super) fn new(acks: u32, store_timeout: Duration, links: usize) -> Self {
        Self {
            acks,
            wait_ms: (millis(store_timeout) / 2).max(1),
            restore: Script::new(RESTORE),
            restore_pooled: Script::new(RESTORE_POOLED),
            links: (0..links.max(1)).map(|_| Group::default()).collect(),
            slots: Mutex::default(),
        }
    }

    /// The ack link a write on `key` that waits for replicas goes over (`None`: the main
    /// connection, on a cluster or without acks): the first with no `WAIT` in flight, starting
    /// from the key's own (by its hash), so that the write runs at once rather than behind a
    /// `WAIT`, then waits for one `WAIT` of its own; the key's own when every link has a `WAIT`
    /// in flight.
    pub(super) fn link_for(&self, store: &RedisStore, key: &LockKey) -> Option<usize> {
        let own = store.keeper.connection.ack_link_of(key)?;
        let links = store.keeper.connection.ack_links();
        let idle = (0..links)
            .map(|i| (own + i) % links)
            .find(|&i| self.links[i].idle());
        Some(idle.unwrap_or(own))
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
            None => {
                // The group of the ack link that carried the write. If it was replaced meanwhile,
                // any group will do: the WAIT, on that connection only, cannot run.
                let link = store.keeper.connection.ack_link_with(generation);
                self.links[link.unwrap_or(0)]
                    .acknowledged(limit, generation, wait)
                    .await
            }
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
