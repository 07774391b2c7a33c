//! Granting: CLAIM, TAKE_OVER or JOIN run in the epoch this broker knows (caught up with first
//! when the store is in another), then the wait for replicas, then the ledger.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::RedisStore;
use super::keys::Site;
use super::replicas::Written;
use super::scripts::{Claim, Epoched, GrantReply, Granted, Join, NotGranted, TakeOver};
use lockbroker_core::domain::{Fence, Kind, Lease, LockKey, Pool, Token};
use lockbroker_core::store::{Bid, Hold, HoldReason, StoreError, StoreResult};

/// The version of what this broker keeps in Redis: 2 added the queue per key (`LAYOUT` in
/// `lib/prelude.lua`; see `README.md`, the key layout, and docs/failover.md, "Rolling upgrades").
pub(crate) const STORE_LAYOUT: u32 = 2;

/// Which granting script a bid runs.
#[derive(Debug, Clone, Copy)]
pub(super) enum GrantScript {
    Claim,
    /// Takes over the expired lease with this fence.
    TakeOver {
        seen: Fence,
    },
    Join(Pool),
}

impl GrantScript {
    /// The kind of lease it grants.
    fn kind(self) -> Kind {
        match self {
            GrantScript::Claim | GrantScript::TakeOver { .. } => Kind::Exclusive,
            GrantScript::Join(Pool::Shared) => Kind::Shared,
            GrantScript::Join(Pool::Semaphore { limit }) => Kind::Semaphore { limit },
        }
    }
}

impl RedisStore {
    /// Runs `script` for `bid` on `key`: the lease granted (confirmed by the replicas asked for,
    /// and in the ledger), or what the script answered instead.
    pub(super) async fn grant(
        &self,
        script: GrantScript,
        key: &LockKey,
        bid: &Bid,
    ) -> StoreResult<Result<Lease, NotGranted>> {
        let kind = script.kind();
        let site = self.site(kind.space(), key);
        let at = &site;
        // The connection the granting write went over: its replicas are asked on that one.
        let carried = AtomicU64::new(0);
        let carried_by = &carried;
        let attempt = |epoch: String| async move {
            let (reply, generation) = self.attempt(script, at, bid, &epoch).await?;
            carried_by.store(generation, Ordering::Relaxed);
            Ok(reply)
        };
        let (granted, epoch) = match self.in_epoch(site.slot, attempt).await? {
            Ok(granted) => granted,
            Err(not) => return Ok(Err(not)),
        };
        let answered = Instant::now();
        // What remains on the store's clock: a lease handed back again by request id is older
        // than its TTL.
        let remaining = Duration::from_millis(granted.expires_at_ms.saturating_sub(granted.now_ms));
        let lease = lease_of(granted, bid, kind)?;
        if self.replicas.asked() {
            // Boxed: see `Replicas::asked`.
            Box::pin(self.replicas.confirm_grant(
                self,
                kind.space(),
                key,
                &bid.token,
                Written {
                    lease: &lease,
                    generation: carried.load(Ordering::Relaxed),
                },
            ))
            .await?;
        }
        self.remember(key, kind, site.slot, &lease, answered + remaining, &epoch);
        Ok(Ok(lease))
    }

    /// One run of `script` in `epoch`, and the generation of the connection it went over.
    async fn attempt(
        &self,
        script: GrantScript,
        site: &Site<'_>,
        bid: &Bid,
        epoch: &str,
    ) -> StoreResult<(Epoched<GrantReply>, u64)> {
        let (keys, marker) = (&site.keys, &*site.marker);
        let caller = self.broker.caller();
        let claim = Claim {
            keys,
            marker,
            bid,
            epoch,
            caller: &caller,
        };
        match script {
            GrantScript::Claim => self.run_tracked(&claim).await,
            GrantScript::TakeOver { seen } => self.run_tracked(&TakeOver { claim, seen }).await,
            GrantScript::Join(pool) => self.run_tracked(&Join { claim, pool }).await,
        }
    }

    /// Runs `attempt` in the epoch this broker knows for `slot`: its grant, with that epoch, or
    /// what it answered instead. A script that finds the store in another epoch than this
    /// broker knows is answered by catching up (putting this broker's leases back), then tried
    /// again; on a cluster, a slot that moved here from a master this broker has caught up with
    /// is adopted in that master's epoch, and a slot whose marker alone is missing repaired.
    async fn in_epoch<F: Future<Output = StoreResult<Epoched<GrantReply>>>>(
        &self,
        slot: Option<u16>,
        attempt: impl Fn(String) -> F,
    ) -> StoreResult<Result<(Granted, String), NotGranted>> {
        let mut tries = 0;
        loop {
            tries += 1;
            let known = match self.epoch.for_grant(slot) {
                Ok(known) => known,
                Err(hold) => return Ok(Err(NotGranted::OnHold(hold))),
            };
            let marker = match attempt(known.clone()).await? {
                Epoched::Answered(GrantReply::Granted(granted)) => return Ok(Ok((granted, known))),
                Epoched::Answered(GrantReply::NotGranted(NotGranted::NewerLayout { layout })) => {
                    return Err(newer_layout(layout));
                }
                Epoched::Answered(GrantReply::NotGranted(not)) => return Ok(Err(not)),
                Epoched::OtherEpoch(marker) => marker,
            };
            match (tries, slot, marker) {
                (1, Some(slot), Some(epoch)) if self.epoch.adopt(slot, &epoch) => {}
                // Caught up and the slot's marker is still missing: it alone lost it.
                (2, Some(slot), None) => self.clone().repair_task(slot).await?,
                (1 | 2, ..) => {
                    if let Some(hold) = self.clone().catch_up_task().await? {
                        return Ok(Err(NotGranted::OnHold(hold)));
                    }
                }
                _ => {
                    return Ok(Err(NotGranted::OnHold(Hold {
                        reason: HoldReason::PuttingBack,
                        retry_after_ms: 1_000,
                    })));
                }
            }
        }
    }

    /// Records a lease granted or renewed here in the ledger — unless an end of it reached the
    /// ledger first (a release or force release that Redis ran after this call; see the
    /// ledger's docs). If it was written in an epoch older than the newest one this broker has
    /// seen, its answer raced a loss and the put-back may have missed it: it is put back on its
    /// own.
    pub(super) fn remember(
        &self,
        key: &LockKey,
        kind: Kind,
        slot: Option<u16>,
        lease: &Lease,
        ends: Instant,
        epoch: &str,
    ) {
        if self.ledger.record(key, kind, lease, ends) && self.epoch.is_behind(slot, epoch) {
            self.put_back_late(key.clone(), kind, lease.token.clone());
        }
    }
}

/// The broker's answer when the store's marker records a newer layout than its own: it does not
/// know what brokers of that layout keep in Redis, and grants nothing beside them. Logged at
/// most once a minute (every grant meets it).
pub(super) fn newer_layout(layout: u32) -> StoreError {
    static LAST_LOGGED: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = LAST_LOGGED.load(Ordering::Relaxed);
    if now >= last + 60
        && LAST_LOGGED
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        tracing::error!(
            store_layout = layout,
            own_layout = STORE_LAYOUT,
            "a broker with a newer store layout runs on this store: this broker grants nothing \
             until it is upgraded"
        );
    }
    StoreError::Failed(format!(
        "a broker with a newer store layout ({layout}) runs on this store; upgrade this broker"
    ))
}

/// The lease `granted` is, for `bid`.
fn lease_of(granted: Granted, bid: &Bid, kind: Kind) -> StoreResult<Lease> {
    Ok(Lease {
        // The bid's own token, or the one of the earlier grant this repeats.
        token: if granted.token == bid.token.as_str() {
            bid.token.clone()
        } else {
            Token::parse(&granted.token).map_err(|_| {
                StoreError::Failed("Redis handed back a lease with a malformed token".into())
            })?
        },
        fence: granted.fence,
        expires_at_ms: granted.expires_at_ms,
        ttl_ms: granted.ttl_ms,
        owner: bid.owner.clone(),
        request_id: bid.request_id.clone(),
        limit: match kind {
            Kind::Semaphore { limit } => Some(limit),
            Kind::Exclusive | Kind::Shared => None,
        },
    })
}
