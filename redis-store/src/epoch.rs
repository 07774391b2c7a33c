//! The store's epoch: how brokers notice that Redis lost, or may have lost, writes, and put
//! their live leases back before anything is granted again.
//!
//! An epoch is a period in which the store's data is continuous. It is recorded in a marker
//! (`<prefix>epoch`, see the key layout in `README.md`) with the server process (`run_id`) it
//! began on. A new epoch begins when the marker is missing (a new store, or one emptied by a
//! restart without persistence or a `FLUSHALL`) or names another server process (a restart from
//! disk that may have lost its last second, a replica promoted that may have missed writes). The
//! broker that sees it first starts the new epoch with a store-wide hold of `store_settle_ms` and
//! announces it on the notice channel.
//!
//! Each broker remembers the epoch it last caught up with and passes it to every granting
//! script, which refuses to grant in another epoch. A broker that meets a new epoch — through a
//! refused grant, the announcement, its once-a-second check, or the check every new connection
//! gets before use — puts its live leases (its [`Ledger`](crate::ledger::Ledger)) back
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
//! scripts, and the broker checks the epoch before it runs one there (`EpochKeeper::invoke`, `calls.rs`).
//! Hence scripts by SHA on a cluster, not the function library of one Redis and Sentinel
//! (`scripts/library.rs`): functions are replicated and persisted, and would not tell.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};

use super::Broker;
use super::batch::Batcher;
use super::connection::RedisConnection;
use super::handed::HandedGrants;
use super::keys::KeyLayout;
use super::scripts::{Epoched, GrantReply, GrantedLease, NoGrant, Scripts};
use super::shard::Shard;
use crate::ledger::Ledger;
use lockbroker_core::domain::millis;
use lockbroker_core::metrics::Metrics;
use lockbroker_core::store::{Hold, HoldReason, Notice, StoreError, StoreResult};

/// The payload that announces a repaired slot marker, followed by the slot.
pub(super) const SLOT_NOTICE: &str = "!slot ";

/// How many marker writes or put-back calls a cluster check keeps in flight at once.
pub(super) const MARK_CONCURRENCY: usize = 64;

/// How often an idle broker checks the epoch, so it notices a flush (which breaks no
/// connection) within this.
pub(super) const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Keeps this broker in the store's epoch: the one owner of the epoch check and the put-back,
/// and of what they touch — the connection (no call goes over one whose epoch was not checked),
/// the scripts run on it (`calls.rs`), what this broker knows of the epoch ([`Epoch`]) and the
/// ledger of its live leases, which it puts back into a new epoch.
///
/// The path of a grant, in this type's methods: [`EpochKeeper::grant_in_epoch`] (below) runs
/// the granting script in the epoch this broker knows; a script that finds the store in another
/// epoch answers `OtherEpoch`, and the keeper catches up — [`EpochKeeper::catch_up`] in
/// `check.rs`: the check script, which starts the new epoch and its hold (the settle time) if
/// no broker did yet; then, the epoch being new to this broker, `put_back_all` in `put_back.rs`
/// writes every live lease of the ledger back — and runs the script again in the new epoch,
/// where it answers "on hold" until the settle time ends. The granted lease goes into the ledger
/// ([`EpochKeeper::remember`], `put_back.rs`), or is put back on its own if its answer raced
/// a loss.
///
/// Catching up runs scripts, and running a script can catch up (a NOSCRIPT on a cluster node;
/// a new connection, verified by the check before use); putting a lease back can release one
/// again, which runs a script. The futures of that cycle are boxed, with their `Send` declared,
/// in this file ([`EpochKeeper::catch_up_task`], [`EpochKeeper::repair_task`]) and in
/// `check.rs` (`reconnect`): the compiler cannot see through a cycle of inferred future types.
pub(super) struct EpochKeeper {
    /// Where the broker's keys are in Redis (shared with the store).
    pub layout: Arc<KeyLayout>,
    /// `<prefix>released`, the shared channel: where the check announces a new epoch.
    pub channel: Arc<str>,
    /// This broker on the store: the leases it puts back record its id.
    pub broker: Arc<Broker>,
    /// The one verified connection, and the store's time bound (`connection.rs`).
    pub connection: RedisConnection,
    pub scripts: Scripts,
    /// What this broker knows of the store's epoch.
    pub epoch: Epoch,
    /// This broker's live leases: what it puts back after a loss.
    pub ledger: Ledger,
    /// Where the store's notices go, once started: a store loss tells every waiter to ask again
    /// (the queues went with it).
    pub notices: OnceLock<mpsc::Sender<Notice>>,
    pub metrics: Arc<Metrics>,
    /// Claims and releases gathered into one script call while another is in flight
    /// (`batch.rs`).
    pub batcher: Batcher,
    /// Grants releases made to this broker's own bids, until their waiters take them
    /// (`handed.rs`).
    pub handed: HandedGrants,
}

impl EpochKeeper {
    /// Runs a granting script (`run`, given the epoch to run in) in the epoch this broker knows
    /// for `slot`: its grant, with that epoch, or what it answered instead. A script that finds
    /// the store in another epoch than this broker knows is answered by catching up (putting
    /// this broker's leases back), then run again; on a cluster, a slot that moved here from a
    /// master this broker has caught up with is adopted in that master's epoch, and a slot whose
    /// marker alone is missing repaired.
    pub(super) async fn grant_in_epoch<F: Future<Output = StoreResult<Epoched<GrantReply>>>>(
        self: &Arc<Self>,
        slot: Option<u16>,
        run: impl Fn(String) -> F,
    ) -> StoreResult<Result<(GrantedLease, String), NoGrant>> {
        let mut tries = 0;
        loop {
            tries += 1;
            let known = match self.epoch.for_grant(slot) {
                Ok(known) => known,
                Err(hold) => return Ok(Err(NoGrant::OnHold(hold))),
            };
            let marker = match run(known.clone()).await? {
                Epoched::Answered(GrantReply::Granted(granted)) => return Ok(Ok((granted, known))),
                Epoched::Answered(GrantReply::NoGrant(not)) => return Ok(Err(not)),
                Epoched::OtherEpoch(marker) => marker,
            };
            match (tries, slot, marker) {
                (1, Some(slot), Some(epoch)) if self.epoch.adopt(slot, &epoch) => {}
                // Caught up and the slot's marker is still missing: it alone lost it.
                (2, Some(slot), None) => self.repair_task(slot).await?,
                (1 | 2, ..) => {
                    if let Some(hold) = self.catch_up_task().await? {
                        return Ok(Err(NoGrant::OnHold(hold)));
                    }
                }
                _ => {
                    return Ok(Err(NoGrant::OnHold(Hold {
                        reason: HoldReason::PuttingBack,
                        retry_after_ms: 1_000,
                    })));
                }
            }
        }
    }

    /// [`EpochKeeper::catch_up`] in a task of its own (a put-back must not stop halfway because
    /// the request that started it gave up).
    pub(super) fn catch_up_task(
        self: &Arc<Self>,
    ) -> Pin<Box<dyn Future<Output = StoreResult<Option<Hold>>> + Send>> {
        let keeper = Arc::clone(self);
        self.spawned(async move { keeper.catch_up().await })
    }

    /// [`EpochKeeper::repair_slot`] in a task of its own, as [`EpochKeeper::catch_up_task`].
    pub(super) fn repair_task(
        self: &Arc<Self>,
        slot: u16,
    ) -> Pin<Box<dyn Future<Output = StoreResult<()>> + Send>> {
        let keeper = Arc::clone(self);
        self.spawned(async move { keeper.repair_slot(slot).await })
    }

    /// Runs `work` in a task of its own, waiting for it at most the store's time bound. Boxed,
    /// with its `Send` declared: catching up runs scripts, which can catch up.
    fn spawned<T: Send + 'static>(
        &self,
        work: impl Future<Output = StoreResult<T>> + Send + 'static,
    ) -> Pin<Box<dyn Future<Output = StoreResult<T>> + Send>> {
        let timeout = self.connection.timeout();
        Box::pin(async move {
            match tokio::time::timeout(timeout, tokio::spawn(work)).await {
                Ok(Ok(result)) => result,
                _ => Err(StoreError::Timeout(millis(timeout))),
            }
        })
    }
}

/// What a broker knows of the store's epoch, and how long a new epoch holds grants.
pub(super) struct Epoch {
    state: Mutex<EpochState>,
    /// One check or put-back at a time: they write the same leases.
    pub catching_up: tokio::sync::Mutex<()>,
    /// Wakes the epoch watcher to check now (another broker announced a new epoch, or a grant
    /// was refused for a stale one).
    pub wake: Notify,
    /// How long a new epoch holds every grant, so that every running broker that knew the store
    /// puts its live leases back first.
    pub settle: Duration,
    /// Paranoid option: after a detected loss, hold every grant until this long after the new
    /// epoch began.
    pub loss_delay: Duration,
    /// The store layout the last epoch check found on a marker (see `STORE_LAYOUT`): a newer one
    /// than this broker's makes it not ready.
    pub store_layout: std::sync::atomic::AtomicU32,
}

#[derive(Default)]
pub(super) struct EpochState {
    /// The epoch this broker caught up with, by shard: the first slot of a cluster master's
    /// slots, or 0 for one server. Missing before its first check.
    pub known: HashMap<u16, String>,
    /// Cluster only: the epoch each slot's marker is expected in (its master's, or — for a slot
    /// that moved from another master with its marker — that master's).
    pub slots: Option<Arc<[Arc<str>]>>,
    /// Set while this broker puts its leases back into a shard's new epoch: it grants nothing
    /// on that shard meanwhile (on one server, nothing at all).
    putting_back_to: Option<PutBackInto>,
}

/// What a put-back writes into: a new epoch, on one shard.
struct PutBackInto {
    epoch: String,
    shard: Shard,
}

impl PutBackInto {
    /// Whether a key of `slot` (`None`: one server) is on the shard being put back.
    fn holds(&self, slot: Option<u16>) -> bool {
        slot.is_none_or(|slot| self.shard.holds(slot))
    }
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
    pub(super) fn new(settle: Duration, loss_delay: Duration) -> Self {
        Self {
            state: Mutex::default(),
            catching_up: tokio::sync::Mutex::default(),
            wake: Notify::new(),
            settle,
            loss_delay,
            store_layout: std::sync::atomic::AtomicU32::new(0),
        }
    }

    pub(super) fn state(&self) -> MutexGuard<'_, EpochState> {
        // Each write is one assignment: a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The epoch a grant on a key of `slot` (on a cluster) may be made in, or the hold while
    /// this broker is putting leases back on the key's shard (a cluster's other masters lost
    /// nothing: their keys are granted meanwhile).
    pub(super) fn for_grant(&self, slot: Option<u16>) -> Result<String, Hold> {
        let state = self.state();
        if state
            .putting_back_to
            .as_ref()
            .is_some_and(|p| p.holds(slot))
        {
            return Err(Hold {
                reason: HoldReason::PuttingBack,
                retry_after_ms: 1_000,
            });
        }
        Ok(state.expected(slot).unwrap_or_default().to_owned())
    }

    /// Whether `epoch` is older than the newest epoch this broker has seen for `slot` (or the
    /// one it is putting leases back into on the slot's shard, if any). On a cluster, also
    /// when `epoch` is no master's current epoch: a master's put-back ends (and its epoch is
    /// known) before the check of the other masters does and the slots' table is rebuilt, and a
    /// lease answered in the old epoch meanwhile must still be put back on its own.
    pub(super) fn is_behind(&self, slot: Option<u16>, epoch: &str) -> bool {
        let state = self.state();
        if let Some(into) = state.putting_back_to.as_ref().filter(|p| p.holds(slot)) {
            return into.epoch != epoch;
        }
        state.expected(slot).is_some_and(|latest| latest != epoch)
            || (slot.is_some() && !state.known.values().any(|known| known == epoch))
    }

    /// Cluster: a slot's marker is in `epoch`, not its master's. If `epoch` is the current
    /// epoch of a master this broker has caught up with, the slot moved from that master with
    /// its data (and its marker): grants on it go on in that epoch. `false` otherwise.
    pub(super) fn adopt(&self, slot: u16, epoch: &str) -> bool {
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

    /// Whether this broker is putting leases back on every key of the store (one server, or a
    /// cluster's only master): it would grant nothing now.
    pub(super) fn putting_back_everywhere(&self) -> bool {
        self.state()
            .putting_back_to
            .as_ref()
            .is_some_and(|p| p.shard.is_everything())
    }
}

/// While alive, this broker is putting its leases back into a shard's epoch and grants nothing
/// on that shard; however the put-back ends (done, failed, or its task gone), dropping it lets
/// grants through again.
pub(super) struct PuttingBack<'a>(&'a Epoch);

impl<'a> PuttingBack<'a> {
    pub(super) fn begin(epoch: &'a Epoch, into: &str, shard: &Shard) -> Self {
        epoch.state().putting_back_to = Some(PutBackInto {
            epoch: into.to_owned(),
            shard: shard.clone(),
        });
        Self(epoch)
    }
}

impl Drop for PuttingBack<'_> {
    fn drop(&mut self) {
        self.0.state().putting_back_to = None;
    }
}

#[cfg(test)]
mod tests {
    use super::super::slots::SLOTS;
    use super::*;

    fn held(epoch: &Epoch, slot: Option<u16>) -> bool {
        epoch.for_grant(slot).is_err()
    }

    #[test]
    fn a_put_back_holds_the_keys_of_its_shard_only() {
        let epoch = Epoch::new(Duration::ZERO, Duration::ZERO);
        epoch.state().known.insert(0, "old".into());
        let master = Shard {
            first: 0,
            ranges: vec![(0, 99), (200, 299)],
        };
        let putting_back = PuttingBack::begin(&epoch, "new", &master);
        assert!(held(&epoch, Some(0)) && held(&epoch, Some(250)));
        assert!(!held(&epoch, Some(100)) && !held(&epoch, Some(16_383)));
        assert!(!epoch.putting_back_everywhere(), "the other masters grant");
        // A lease answered in the old epoch raced the put-back only on its shard.
        assert!(epoch.is_behind(Some(5), "old") && !epoch.is_behind(Some(5), "new"));
        assert!(!epoch.is_behind(Some(150), "old"));
        // The put-back is done and "new" known for the master, but its slots still expect "old"
        // (the table is rebuilt when every master is checked): "old" is behind all the same.
        {
            let mut state = epoch.state();
            state.known.insert(0, "new".into());
            state.slots = Some(vec![Arc::from("old"); usize::from(SLOTS)].into());
        }
        drop(putting_back);
        assert!(!held(&epoch, Some(0)));
        assert!(epoch.is_behind(Some(5), "old"));
        epoch.state().slots = Some(vec![Arc::from("new"); usize::from(SLOTS)].into());
        assert!(epoch.is_behind(Some(5), "old") && !epoch.is_behind(Some(5), "new"));

        // One server, or a cluster's only master: every key is held, and the broker is not ready.
        for shard in [
            Shard::whole(),
            Shard {
                first: 0,
                ranges: vec![(0, 8_000), (8_001, SLOTS - 1)],
            },
        ] {
            let putting_back = PuttingBack::begin(&epoch, "new", &shard);
            assert!(epoch.putting_back_everywhere(), "{shard:?}");
            assert!(held(&epoch, Some(9_000)), "{shard:?}");
            drop(putting_back);
        }
        let putting_back = PuttingBack::begin(&epoch, "new", &Shard::whole());
        assert!(held(&epoch, None));
        drop(putting_back);
        assert!(!epoch.putting_back_everywhere());
    }
}
