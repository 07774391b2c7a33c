//! The [`EpochKeeper`]'s ledger: recording a lease granted or renewed, and putting leases back
//! into a new epoch — every live lease of this broker's ledger (after a loss, `check.rs`), the
//! leases of one slot (after its marker was repaired), or one lease whose answer raced a loss;
//! and releasing (also how a lease released while it was being put back is released again).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::Instant;

use super::connection::Conn;
use super::epoch::{EpochKeeper, MARK_CONCURRENCY};
use super::keys::Site;
use super::scripts::{
    BatchOp, Caller, HolderContext, LeaseBack, Placement, PutBack, PutBackReply, Release,
    ReleaseReply,
};
use super::shard::Shard;
use crate::ledger::Entry;
use lockbroker_core::domain::{Fence, Kind, Lease, LockKey, Space, Token, millis};
use lockbroker_core::store::{AsHolder, Released, StoreError, StoreResult};

/// How many leases one put-back script call carries. Bounded so that one call stays short for
/// Redis (a script blocks the server while it runs).
pub(super) const PUT_BACK_BATCH: usize = 100;

/// How a put-back went.
#[derive(Default)]
pub(super) struct PutBackReport {
    pub written: usize,
    pub already_there: usize,
    pub double_claims: usize,
    pub counters_raised: usize,
}

impl PutBackReport {
    pub(super) fn add(&mut self, other: &PutBackReport) {
        self.written += other.written;
        self.already_there += other.already_there;
        self.double_claims += other.double_claims;
        self.counters_raised += other.counters_raised;
    }
}

impl EpochKeeper {
    /// Records a lease granted or renewed here in the ledger — unless an end of it reached the
    /// ledger first (a release or force release that Redis ran after this call; see the
    /// ledger's docs). If it was written in an epoch older than the newest one this broker has
    /// seen, its answer raced a loss and the put-back may have missed it: it is put back on its
    /// own.
    pub(super) fn remember(
        self: &Arc<Self>,
        key: &LockKey,
        kind: Kind,
        slot: Option<u16>,
        lease: &Lease,
        ends: Instant,
        epoch: &str,
    ) {
        if self.ledger.record(key, kind, lease, ends) && self.epoch.is_behind(slot, epoch) {
            self.metrics.late_put_back();
            self.put_back_late(key.clone(), kind, lease.token.clone());
        }
    }

    /// Puts every live lease of the ledger on `shard` back into epoch `epoch`. `None` if the
    /// epoch moved meanwhile. On a cluster, one script call per slot (a script's keys must
    /// share a slot), several at once.
    pub(super) async fn put_back_all(
        self: &Arc<Self>,
        conn: &Conn,
        shard: &Shard,
        epoch: &str,
    ) -> StoreResult<Option<PutBackReport>> {
        let leases = self.ledger.live(Instant::now());
        let mut by_slot: BTreeMap<Option<u16>, Vec<(LockKey, Entry)>> = BTreeMap::new();
        for (key, entry) in leases {
            let slot = self.layout.slot(&key);
            if slot.is_none_or(|slot| shard.holds(slot)) {
                by_slot.entry(slot).or_default().push((key, entry));
            }
        }
        let epoch: Arc<str> = epoch.into();
        let calls: Vec<_> = by_slot
            .into_iter()
            .flat_map(|(slot, leases)| {
                let marker =
                    slot.map_or_else(|| self.layout.marker.clone(), |s| self.layout.marker_of(s));
                leases
                    .chunks(PUT_BACK_BATCH)
                    .map(|batch| (marker.clone(), batch.to_vec()))
                    .collect::<Vec<_>>()
            })
            .map(|(marker, batch)| {
                let (mut conn, epoch) = (conn.clone(), epoch.clone());
                async move {
                    let mut report = PutBackReport::default();
                    let done = self
                        .put_batch(&mut conn, &marker, &epoch, &batch, &mut report)
                        .await?;
                    Ok::<_, StoreError>(done.then_some(report))
                }
            })
            .collect();
        let mut calls =
            futures_util::stream::iter(calls).buffer_unordered(if self.layout.cluster {
                MARK_CONCURRENCY
            } else {
                1
            });
        let mut total = PutBackReport::default();
        while let Some(batch) = calls.next().await {
            let Some(report) = batch? else {
                return Ok(None);
            };
            total.add(&report);
        }
        Ok(Some(total))
    }

    /// Puts `batch` back; `false` if the store is no longer in `epoch`.
    async fn put_batch(
        self: &Arc<Self>,
        conn: &mut Conn,
        marker: &str,
        epoch: &str,
        batch: &[(LockKey, Entry)],
        report: &mut PutBackReport,
    ) -> StoreResult<bool> {
        let now = Instant::now();
        let put_back = PutBack {
            marker,
            epoch,
            broker: &self.broker.id,
            leases: batch
                .iter()
                .map(|(key, entry)| LeaseBack {
                    keys: self.layout.names(entry.kind.space(), key),
                    entry,
                    remaining_ms: millis(entry.remaining(now)).max(1),
                })
                .collect(),
        };
        // Inside the check: a NOSCRIPT here needs no other check first.
        let placed = match self.run_unchecked(conn, &put_back).await? {
            PutBackReply::OtherEpoch => return Ok(false),
            PutBackReply::Placed(placed) if placed.len() == batch.len() => placed,
            PutBackReply::Placed(_) => {
                return Err(StoreError::Failed(
                    "Redis answered the put_back script with a reply per lease for another \
                     number of leases"
                        .into(),
                ));
            }
        };
        for ((key, entry), placed) in batch.iter().zip(placed) {
            report.counters_raised += usize::from(placed.counter_raised);
            let kept = !matches!(placed.outcome, Placement::OtherKept { .. });
            match placed.outcome {
                Placement::Written => report.written += 1,
                Placement::AlreadyThere => report.already_there += 1,
                Placement::OtherKept { fence: other } => {
                    report.double_claims += 1;
                    double_claim(key, other, entry.fence);
                    self.ledger
                        .forget_any(entry.kind.space(), key, &entry.token);
                }
                Placement::OtherReplaced { fence: other } => {
                    report.double_claims += 1;
                    report.written += 1;
                    double_claim(key, entry.fence, other);
                }
            }
            if kept && !self.ledger.holds(key, entry.kind, &entry.token) {
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

    /// Cluster: puts this broker's live leases on `slot` back (after a repair of its marker).
    pub(super) async fn put_back_slot(self: &Arc<Self>, slot: u16) -> StoreResult<()> {
        let _one = self.epoch.catching_up.lock().await;
        let Ok(epoch) = self.epoch.for_grant(Some(slot)) else {
            return Ok(());
        };
        let Some(link) = self.connection.current() else {
            return Ok(());
        };
        let mut conn = link.conn.clone();
        let marker = self.layout.marker_of(slot);
        let leases: Vec<(LockKey, Entry)> = self
            .ledger
            .live(Instant::now())
            .into_iter()
            .filter(|(key, _)| self.layout.slot(key) == Some(slot))
            .collect();
        let mut report = PutBackReport::default();
        for batch in leases.chunks(PUT_BACK_BATCH) {
            self.put_batch(&mut conn, &marker, &epoch, batch, &mut report)
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

    /// The epoch this broker knows for `slot`, as the holder scripts take it: '' while it puts
    /// leases back (the key is then not handed on).
    pub(super) fn epoch_for(&self, slot: Option<u16>) -> String {
        self.epoch.for_grant(slot).unwrap_or_default()
    }

    /// What a holder script on `site` takes.
    pub(super) fn holder_context<'a>(
        &'a self,
        site: &'a Site<'_>,
        caller: &'a Caller<'a>,
        epoch: &'a str,
    ) -> HolderContext<'a> {
        HolderContext {
            keys: &site.keys,
            marker: &site.marker,
            epoch,
            caller,
            channel: &self.channel,
        }
    }

    /// Releases `token`'s lease on `key` (the store's release; here because a put-back
    /// releases again a lease released while it ran), and drops it from the ledger.
    pub(super) async fn release(
        self: &Arc<Self>,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> StoreResult<AsHolder<Released>> {
        let site = self.layout.site(space, key);
        let (caller, epoch) = (self.broker.caller(), self.epoch_for(site.slot));
        let release = Release {
            on: self.holder_context(&site, &caller, &epoch),
            token,
            direct: self.handed.enabled && space == Space::Locks,
        };
        let answer = match space {
            // Only an exclusive lease is released in a batch.
            Space::Locks => {
                self.run_batched(&release, &site.keys.lock, || {
                    BatchOp::release(&site.keys, token.as_str())
                })
                .await
            }
            Space::Semaphores => self.run_tracked(&release).await,
        };
        let answered = Instant::now();
        let outcome = match answer?.0 {
            ReleaseReply::Released {
                held_ms,
                fence,
                handed,
            } => {
                // The end's mark keeps a renewal answered after it out of the ledger.
                self.ledger.forget_ended(space, key.as_str(), fence, false);
                if let Some(handed) = handed {
                    self.handed(key, handed, answered, &epoch);
                }
                AsHolder::Done(Released { held_ms })
            }
            ReleaseReply::Refused(refusal) => refusal.answer(),
        };
        if !matches!(outcome, AsHolder::OnHold(_)) {
            self.ledger.forget_any(space, key, token);
        }
        Ok(outcome)
    }

    /// Releases a lease put back after its holder had released it, retrying (the store may still
    /// be on its way back, or the hold in force) until a definite answer or the lease's end.
    fn release_again(
        self: &Arc<Self>,
        space: Space,
        key: LockKey,
        token: Token,
        remaining: Duration,
    ) {
        let keeper = Arc::clone(self);
        tokio::spawn(async move {
            let give_up = Instant::now() + remaining;
            let mut pause = Duration::from_millis(50);
            loop {
                match keeper.release(space, &key, &token).await {
                    Ok(AsHolder::OnHold(_)) | Err(_) if Instant::now() + pause < give_up => {
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
    fn put_back_late(self: &Arc<Self>, key: LockKey, kind: Kind, token: Token) {
        let keeper = Arc::clone(self);
        tokio::spawn(async move {
            let Some(link) = keeper.connection.current() else {
                // The next connection's check puts every lease back.
                return;
            };
            let mut conn = link.conn.clone();
            let _one = keeper.epoch.catching_up.lock().await;
            let slot = keeper.layout.slot(&key);
            let Ok(epoch) = keeper.epoch.for_grant(slot) else {
                return;
            };
            let Some(entry) = keeper.ledger.get(&key, kind, &token) else {
                return;
            };
            let mut report = PutBackReport::default();
            let marker = keeper.layout.marker_for(&key);
            match keeper
                .put_batch(&mut conn, &marker, &epoch, &[(key, entry)], &mut report)
                .await
            {
                Ok(true) => keeper.metrics.leases_put_back(report.written),
                // The epoch moved (or the call failed): a full check catches up.
                _ => keeper.epoch.wake.notify_one(),
            }
        });
    }
}

/// Logs a lock that had two holders after a store loss: the lease with the higher fence, `kept`,
/// stays.
fn double_claim(key: &LockKey, kept: Fence, dropped: Fence) {
    tracing::error!(
        %key, kept_fence = kept, dropped_fence = dropped,
        "a lock had two holders after a store loss; the lease with the higher fence stays, the \
         other holder's next renew answers not_owner"
    );
}
