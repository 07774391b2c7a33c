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
use tokio::sync::Notify;
use tokio::time::Instant;

use super::RedisStore;
use super::connection::Conn;
use super::connection::run_id;
use crate::domain::{LockKey, Token, millis};
use crate::store::ledger::Entry;
use crate::store::{EXPIRY_SLACK_MS, Hold, HoldReason, Holder, StoreError, StoreResult};

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

    /// Whether `epoch` is older than the newest epoch this broker has seen (the one it is
    /// putting leases back into, if any).
    pub fn is_behind(&self, epoch: &str) -> bool {
        let state = self.state();
        state
            .putting_back_to
            .as_deref()
            .or(state.known.as_deref())
            .is_some_and(|latest| latest != epoch)
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
            // The server process as it is now, not as it was when the connection was made: a
            // proxy between broker and Redis may keep this connection open across a restart.
            let checked = match tokio::time::timeout_at(deadline, run_id(&mut conn)).await {
                Ok(Ok(run_id)) => self.check_on(&mut conn, &run_id).await,
                Ok(Err(e)) => Err(e),
                Err(_) => Err(StoreError::Timeout(millis(self.timeout))),
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

    /// The epoch check on `conn` (reaching server `run_id`), and the put-back if the epoch is
    /// not the one this broker knows. Run on every new connection before it is used.
    pub(super) async fn check_on(
        &self,
        conn: &mut Conn,
        run_id: &str,
    ) -> StoreResult<Option<Hold>> {
        let _one = self.epoch.catching_up.lock().await;
        // A put-back that finds the epoch moved again (a second loss meanwhile) starts over; a
        // put-back that went through checks once more, for the hold as the put-back left it.
        for _ in 0..4 {
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
                    let putting_back = PuttingBack::begin(&self.epoch, &checked.id);
                    let started = Instant::now();
                    // The epoch moved during the put-back (`None`): check again.
                    if let Some(report) = self.put_back_all(conn, &checked.id).await? {
                        self.epoch.state().known = Some(checked.id.clone());
                        drop(putting_back);
                        self.report_loss(&known, &checked, &report, started.elapsed());
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
        conn: &mut Conn,
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
    async fn put_back_all(&self, conn: &mut Conn, epoch: &str) -> StoreResult<Option<PutBack>> {
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
        conn: &mut Conn,
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
                self.release_again(key.clone(), entry.token.clone(), entry.remaining(now));
            }
        }
        Ok(true)
    }

    /// Releases a lease put back after its holder had released it, retrying (the store may still
    /// be on its way back, or the hold in force) until a definite answer or the lease's end.
    fn release_again(&self, key: LockKey, token: Token, remaining: Duration) {
        let store = self.clone();
        tokio::spawn(async move {
            let give_up = Instant::now() + remaining;
            let mut pause = Duration::from_millis(50);
            loop {
                match crate::store::Store::release(&store, &key, &token).await {
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
