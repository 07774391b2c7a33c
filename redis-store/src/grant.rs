//! Granting: CLAIM, TAKE_OVER or JOIN run in the epoch this broker knows (caught up with first
//! when the store is in another: [`EpochKeeper::grant_in_epoch`](super::epoch::EpochKeeper::grant_in_epoch)),
//! then the wait for replicas, then the ledger.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::RedisStore;
use super::keys::Site;
use super::replicas::Written;
use super::scripts::{Claim, Epoched, GrantReply, GrantedLease, JoinPool, NoGrant, TakeOver};
use lockbroker_core::domain::{Fence, Kind, Lease, LockKey, Pool, Token};
use lockbroker_core::store::{Bid, StoreError, StoreResult};

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
    ) -> StoreResult<Result<Lease, NoGrant>> {
        // A grant a release of this broker's made to this bid, waiting for its ask.
        if matches!(script, GrantScript::Claim)
            && let Some(lease) = self.keeper.take_handed(key, &bid.token)
        {
            return Ok(Ok(lease));
        }
        let kind = script.kind();
        let site = self.layout.site(kind.space(), key);
        let at = &site;
        // The connection the granting write went over: its replicas are asked on that one.
        let carried = AtomicU64::new(0);
        let carried_by = &carried;
        let run_in = |epoch: String| async move {
            let (reply, generation) = self.run_grant_script(script, key, at, bid, &epoch).await?;
            carried_by.store(generation, Ordering::Relaxed);
            Ok(reply)
        };
        let (granted, epoch) = match self.keeper.grant_in_epoch(site.slot, run_in).await? {
            Ok(granted) => granted,
            Err(not) => return Ok(Err(not)),
        };
        let answered = Instant::now();
        // What remains on the store's clock: a lease handed back again by request id is older
        // than its TTL.
        let remaining = Duration::from_millis(granted.expires_at_ms.saturating_sub(granted.now_ms));
        let again = granted.again;
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
        self.keeper
            .remember(key, kind, site.slot, &lease, answered + remaining, &epoch);
        if again && bid.waits() && lease.token == bid.token && self.keeper.handed.enabled {
            self.keeper
                .handed
                .answered(key, &bid.token, lease.fence, answered + remaining);
        }
        Ok(Ok(lease))
    }

    /// Runs `script` on `key` (at `site`) once in `epoch`: its reply, and the generation of the
    /// connection it went over.
    async fn run_grant_script(
        &self,
        script: GrantScript,
        key: &LockKey,
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
        let keeper = &self.keeper;
        let link = self.replicas.link_for(self, key);
        match script {
            // A claim whose replicas are asked goes alone over an ack link, where its WAIT
            // follows it (see `replicas.rs`), not in a batch on the main connection.
            GrantScript::Claim if self.replicas.asked() => keeper.run_acked(&claim, link).await,
            GrantScript::Claim => {
                keeper
                    .run_batched(&claim, &keys.lock, || claim.batch_op())
                    .await
            }
            GrantScript::TakeOver { seen } => {
                keeper.run_acked(&TakeOver { claim, seen }, link).await
            }
            GrantScript::Join(pool) => keeper.run_acked(&JoinPool { claim, pool }, link).await,
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
pub(super) fn lease_of(granted: GrantedLease, bid: &Bid, kind: Kind) -> StoreResult<Lease> {
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
