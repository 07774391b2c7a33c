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

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use redis::Value;
use redis::aio::MultiplexedConnection;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::RedisStore;
use crate::domain::{LockKey, millis};
use crate::store::ledger::Entry;
use crate::store::{EXPIRY_SLACK_MS, Hold, HoldReason, StoreError, StoreResult};

/// How many leases one put-back script call carries. Bounded so that one call stays short for
/// Redis (a script blocks the server while it runs).
const PUT_BACK_BATCH: usize = 100;

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
    /// The epoch this broker caught up with; `None` before its first check.
    known: Option<String>,
    /// Set while this broker puts its leases back into a new epoch: it grants nothing meanwhile.
    putting_back_to: Option<String>,
}

impl Epoch {
    fn state(&self) -> MutexGuard<'_, EpochState> {
        // Each write is one assignment: a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The epoch a grant may be made in, or the hold while this broker is putting leases back.
    pub fn for_grant(&self) -> Result<String, Hold> {
        let state = self.state();
        if state.putting_back_to.is_some() {
            return Err(Hold {
                reason: HoldReason::PuttingBack,
                retry_after_ms: 1_000,
            });
        }
        Ok(state.known.clone().unwrap_or_default())
    }

    /// The newest epoch this broker has seen (the one it is putting leases back into, if any).
    pub fn latest(&self) -> Option<String> {
        let state = self.state();
        state
            .putting_back_to
            .clone()
            .or_else(|| state.known.clone())
    }

    pub fn putting_back(&self) -> bool {
        self.state().putting_back_to.is_some()
    }
}

/// What the epoch check answered.
struct Checked {
    id: String,
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

impl RedisStore {
    /// Checks the epoch on the current connection (making and verifying one if needed) and
    /// catches up with a new one. Returns the store-wide hold in force, if any.
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
            match self.check_on(&mut conn, &link.run_id).await {
                Ok(hold) => return Ok(hold),
                Err(e) => {
                    self.connection.drop_link(link.generation, &e);
                    last = Some(e);
                }
            }
        }
        Err(last.expect("two failed tries"))
    }

    /// The epoch check on `conn` (reaching server `run_id`), and the put-back if the epoch is
    /// not the one this broker knows. Run on every new connection before it is used.
    pub(super) async fn check_on(
        &self,
        conn: &mut MultiplexedConnection,
        run_id: &str,
    ) -> StoreResult<Option<Hold>> {
        let _one = self.epoch.catching_up.lock().await;
        // A put-back that finds the epoch moved again (a second loss meanwhile) starts over.
        for _ in 0..3 {
            let known = self.epoch.state().known.clone();
            let checked = self.run_check(conn, known.as_deref(), run_id).await?;
            match known {
                Some(known) if known == checked.id => return Ok(checked.hold()),
                None => {
                    if let Some(hold) = checked.hold()
                        && hold.reason == HoldReason::Settling
                    {
                        tracing::info!(
                            settle_ms = hold.retry_after_ms,
                            "the lock store has no record of earlier grants (new or emptied): \
                             settling before the first grant"
                        );
                    }
                    self.epoch.state().known = Some(checked.id.clone());
                    return Ok(checked.hold());
                }
                Some(known) => {
                    self.epoch.state().putting_back_to = Some(checked.id.clone());
                    let started = Instant::now();
                    let outcome = self.put_back_all(conn, &checked.id).await;
                    let mut state = self.epoch.state();
                    state.putting_back_to = None;
                    match outcome {
                        Ok(Some(report)) => {
                            state.known = Some(checked.id.clone());
                            drop(state);
                            self.report_loss(&known, &checked, &report, started.elapsed());
                            return Ok(checked.hold());
                        }
                        // The epoch moved during the put-back: check again.
                        Ok(None) => continue,
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        Err(StoreError::Failed(
            "the lock store's epoch keeps changing; not granting until it settles".into(),
        ))
    }

    async fn run_check(
        &self,
        conn: &mut MultiplexedConnection,
        known: Option<&str>,
        run_id: &str,
    ) -> StoreResult<Checked> {
        let mut eval = redis::cmd("EVAL");
        eval.arg(&self.scripts.check)
            .arg(1)
            .arg(&*self.marker)
            .arg(known.unwrap_or(""))
            .arg(run_id)
            .arg(millis(self.store_settle))
            .arg(millis(self.store_loss_delay))
            .arg(&*self.channel);
        let (id, hold_until_ms, now_ms, reason): (String, u64, u64, String) =
            self.bounded(eval.query_async(conn)).await?;
        Ok(Checked {
            id,
            hold_until_ms,
            now_ms,
            reason,
        })
    }

    /// Puts every live lease of the ledger back into epoch `epoch`. `None` if the epoch moved
    /// meanwhile.
    async fn put_back_all(
        &self,
        conn: &mut MultiplexedConnection,
        epoch: &str,
    ) -> StoreResult<Option<PutBack>> {
        let leases = self.ledger.live(Instant::now());
        let mut report = PutBack::default();
        for batch in leases.chunks(PUT_BACK_BATCH) {
            if !self.put_back(conn, epoch, batch, &mut report).await? {
                return Ok(None);
            }
        }
        Ok(Some(report))
    }

    /// Puts `batch` back; `false` if the store is no longer in `epoch`.
    async fn put_back(
        &self,
        conn: &mut MultiplexedConnection,
        epoch: &str,
        batch: &[(LockKey, Entry)],
        report: &mut PutBack,
    ) -> StoreResult<bool> {
        let now = Instant::now();
        let mut inv = self.scripts.put_back.key(&*self.marker);
        inv.arg(epoch).arg(EXPIRY_SLACK_MS);
        for (key, entry) in batch {
            let [lock, fence] = self.keys(key);
            inv.key(lock).key(fence);
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
        let reply: Vec<Value> = self.bounded(inv.invoke_async(conn)).await?;
        let codes: Vec<i64> = reply
            .iter()
            .map(redis::FromRedisValue::from_redis_value_ref)
            .collect::<Result<_, _>>()
            .map_err(|_| StoreError::Failed("malformed put-back reply".into()))?;
        if codes.first() == Some(&-1) {
            return Ok(false);
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
                    self.ledger.forget(key, &entry.token);
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
            if code != 2 && !self.ledger.holds(key, &entry.token) {
                // Released while the put-back ran: release it again, or it would block its key
                // until it ends.
                let store = self.clone();
                let (key, token) = (key.clone(), entry.token.clone());
                tokio::spawn(async move {
                    let _ = crate::store::Store::release(&store, &key, &token).await;
                });
            }
        }
        Ok(true)
    }

    /// A lease recorded under an epoch older than the newest one seen may have missed the
    /// put-back (its answer raced the loss): put it back on its own.
    pub(super) fn put_back_late(&self, key: LockKey) {
        let store = self.clone();
        tokio::spawn(async move {
            let Some(link) = store.connection.current() else {
                // The next connection's check puts every lease back.
                return;
            };
            let mut conn = link.conn.clone();
            let _one = store.epoch.catching_up.lock().await;
            let Some(epoch) = store.epoch.state().known.clone() else {
                return;
            };
            let Some(entry) = store.ledger.get(&key) else {
                return;
            };
            let mut report = PutBack::default();
            match store
                .put_back(&mut conn, &epoch, &[(key, entry)], &mut report)
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
