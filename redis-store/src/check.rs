//! Checking the store's epoch (see `epoch.rs`), the [`EpochKeeper`]'s check: on every new
//! connection before it is used ([`EpochKeeper::link`]), once a second, when another broker
//! announces a new epoch and when a grant meets another epoch; and catching up with a new one,
//! which puts this broker's leases back (`put_back.rs`). On a cluster, each master's epoch is
//! checked and copied to the markers of its slots.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use std::pin::Pin;

use futures_util::StreamExt;
use tokio::time::Instant;

use super::connection::{Conn, Link};
use super::epoch::{EpochKeeper, MARK_CONCURRENCY, PuttingBack, SLOT_NOTICE};
use super::put_back::PutBackReport;
use super::scripts::{Check, Checked, Mark, Repair};
use super::shard::{Shard, masters};
use super::slots::SLOTS;
use lockbroker_core::domain::millis;
use lockbroker_core::store::{Hold, HoldReason, Notice, StoreError, StoreResult};

impl EpochKeeper {
    /// The verified connection, making one if there is none (see `connection.rs`).
    pub(super) async fn link(self: &Arc<Self>) -> StoreResult<Link> {
        self.connection
            .get(|| {
                tokio::spawn(Arc::clone(self).reconnect());
            })
            .await
    }

    /// Ack link `index` (see `connection/ack_links.rs`), making one if there is none.
    pub(super) async fn ack_link(self: &Arc<Self>, index: usize) -> StoreResult<Link> {
        self.connection
            .get_ack(index, || {
                tokio::spawn(Arc::clone(self).reconnect_ack(index));
            })
            .await
    }

    /// Makes ack link `index` beside the main connection (making that first if there is none),
    /// and verifies it as [`EpochKeeper::reconnect`] does.
    fn reconnect_ack(self: Arc<Self>, index: usize) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let timeout = self.connection.timeout();
            let verified = async {
                let main = tokio::time::timeout(timeout, self.link())
                    .await
                    .map_err(|_| StoreError::Timeout(millis(timeout)))??;
                let mut conn = self.connection.open_ack().await?;
                self.check(&mut conn).await?;
                Ok::<_, StoreError>((conn, main.generation))
            };
            match verified.await {
                Ok((conn, of)) => self.connection.ack_up(index, conn, of),
                Err(e) => {
                    tracing::debug!(error = %e, "cannot make a Redis connection for replica acknowledgements");
                    self.connection.ack_down(index, e);
                }
            }
        })
    }

    /// Makes a new connection and runs the epoch check on it (putting leases back if the store
    /// lost them) before anything else may use it.
    ///
    /// A boxed future with its `Send` declared: reconnecting can put leases back, which can
    /// release through a connection, which can reconnect — a cycle the compiler cannot see
    /// through when the future's type is inferred.
    fn reconnect(self: Arc<Self>) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let verified = async {
                let mut conn = self.connection.open().await?;
                self.check(&mut conn).await?;
                Ok::<_, StoreError>(conn)
            };
            match verified.await {
                Ok(conn) => {
                    tracing::debug!("connected to Redis");
                    self.connection.up(conn);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot connect to Redis");
                    self.connection.down(e);
                }
            }
        })
    }

    /// Checks the epoch on the current connection (making and verifying one if needed) and
    /// catches up with a new one. Returns the store-wide hold in force, if any.
    ///
    /// Every check reads the server's `run_id` again, so a restart behind a proxy that keeps
    /// client connections open is noticed within [`CHECK_EVERY`](super::epoch::CHECK_EVERY) too.
    ///
    /// A connection that fails the check is replaced and the check made again at once (the new
    /// connection's verification is the check): after a restart, the old connection is usually
    /// the first thing that fails, and the put-back must not wait for another round.
    pub(super) async fn catch_up(self: &Arc<Self>) -> StoreResult<Option<Hold>> {
        let deadline = Instant::now() + self.connection.timeout();
        let mut last = None;
        for _ in 0..2 {
            let link = match tokio::time::timeout_at(deadline, self.link()).await {
                Ok(link) => link?,
                Err(_) => return Err(StoreError::Timeout(millis(self.connection.timeout()))),
            };
            let mut conn = link.conn.clone();
            // Unbounded here: a new epoch puts leases back (on a cluster, marks a master's
            // thousands of slots too), which must not stop halfway. Each call in it is bounded.
            match self.check(&mut conn).await {
                Ok(hold) => return Ok(hold),
                Err(e) => {
                    self.connection.drop_link(link.generation, &e);
                    last = Some(e);
                }
            }
        }
        Err(last.expect("two failed tries"))
    }

    /// The epoch check on `conn` — of every master, on a cluster — and the put-back if the
    /// epoch is not the one this broker knows. Run on every new connection before it is used.
    async fn check(self: &Arc<Self>, conn: &mut Conn) -> StoreResult<Option<Hold>> {
        if self.layout.cluster {
            self.check_cluster(conn).await
        } else {
            self.check_server(conn).await
        }
    }

    /// The epoch check of one server.
    async fn check_server(self: &Arc<Self>, conn: &mut Conn) -> StoreResult<Option<Hold>> {
        let _one = self.epoch.catching_up.lock().await;
        let checked = self.check_shard(conn, &Shard::whole()).await?;
        Ok(checked.hold())
    }

    /// The epoch check of every master of a cluster, each caught up with as
    /// [`EpochKeeper::check_server`] does for one server. Returns a hold only if every master holds: a master that settles alone
    /// holds only its own keys (its slots' markers say so to every script), and the broker stays
    /// ready for the others.
    async fn check_cluster(self: &Arc<Self>, conn: &mut Conn) -> StoreResult<Option<Hold>> {
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
    async fn check_shard(self: &Arc<Self>, conn: &mut Conn, shard: &Shard) -> StoreResult<Checked> {
        let marker = self.layout.marker_of(shard.first);
        // A put-back that finds the epoch moved again (a second loss meanwhile) starts over; a
        // put-back that went through checks once more, for the hold as the put-back left it.
        for _ in 0..4 {
            let known = self.epoch.state().known.get(&shard.first).cloned();
            let checked = self.run_check(conn, &marker, known.as_deref()).await?;
            // A newer layout than this broker's: every grant is refused (and logged) by the
            // granting scripts, and the broker says it is not ready.
            self.epoch
                .store_layout
                .store(checked.layout, std::sync::atomic::Ordering::Relaxed);
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
            let putting_back = PuttingBack::begin(&self.epoch, &checked.id, shard);
            let started = Instant::now();
            // On a cluster, the slots of this broker's leases are marked first and their leases
            // put back at once, then the master's other slots are marked: the put-back must
            // not wait for thousands of markers while the hold runs.
            let leased: BTreeSet<u16> = if self.layout.cluster {
                self.ledger
                    .live(Instant::now())
                    .iter()
                    .filter_map(|(key, _)| self.layout.slot(key))
                    .filter(|slot| shard.holds(*slot))
                    .collect()
            } else {
                BTreeSet::new()
            };
            if self.layout.cluster {
                self.mark_slots(conn, shard, &checked, |slot| leased.contains(&slot))
                    .await?;
            }
            // The epoch moved during the put-back (`None`): check again.
            let put_back = self.put_back_all(conn, shard, &checked.id).await?;
            if self.layout.cluster {
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

    /// Cluster: copies a master's new epoch from its first slot's marker to its other slots'.
    async fn mark_slots(
        &self,
        conn: &Conn,
        shard: &Shard,
        checked: &Checked,
        which: impl Fn(u16) -> bool,
    ) -> StoreResult<()> {
        let checked = Arc::new(checked.clone());
        let calls: Vec<_> = shard
            .slots()
            .filter(|s| *s != shard.first && which(*s))
            .map(|slot| {
                let (mut conn, checked) = (conn.clone(), checked.clone());
                async move {
                    let marker = self.layout.marker_of(slot);
                    let mark = Mark {
                        marker: &marker,
                        checked: &checked,
                    };
                    self.eval(&mut conn, &mark).await
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
        let check = Check {
            marker,
            known,
            settle_ms: millis(self.epoch.settle),
            loss_delay_ms: millis(self.epoch.loss_delay),
            channel: &self.channel,
        };
        self.eval(conn, &check).await
    }

    /// Cluster: a slot's marker is missing while its master's epoch goes on (the marker was
    /// deleted or evicted on its own, and the slot's lock keys may have gone with it). The slot
    /// gets its marker back, in its master's epoch, with a hold of `store_settle_ms`, and the
    /// repair is announced (`!slot <n>`) so that every broker puts its leases on the slot back
    /// ([`EpochKeeper::put_back_slot`]) before the hold ends. Logged as an error: Redis should
    /// not evict keys.
    pub(super) async fn repair_slot(self: &Arc<Self>, slot: u16) -> StoreResult<()> {
        let Ok(epoch) = self.epoch.for_grant(Some(slot)) else {
            return Ok(());
        };
        let Some(link) = self.connection.current() else {
            return Ok(());
        };
        let mut conn = link.conn.clone();
        let repair = Repair {
            marker: &self.layout.marker_of(slot),
            epoch: &epoch,
            hold_ms: millis(self.epoch.settle),
            channel: &self.channel,
            announcement: &format!("{SLOT_NOTICE}{slot}"),
        };
        let repaired = self.eval(&mut conn, &repair).await?;
        if repaired {
            tracing::error!(
                slot,
                "the epoch marker of one Redis Cluster slot was missing (deleted or evicted: keep \
                 Redis from evicting keys); the slot's keys are held for the settle time while \
                 every broker puts its leases on it back"
            );
            self.metrics.store_loss(0, 0, millis(self.epoch.settle));
        }
        self.put_back_slot(slot).await
    }

    fn report_loss(&self, was: &str, checked: &Checked, report: &PutBackReport, took: Duration) {
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
        // The queues went with the loss: every waiter asks again, which queues it anew.
        if let Some(notices) = self.notices.get() {
            let _ = notices.try_send(Notice::Missed);
        }
    }
}
