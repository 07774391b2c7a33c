//! The store's primitives on Redis: each one script call (`scripts/`), and what the broker does
//! with its answer (the ledger, the replicas).

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::grant::{GrantScript, STORE_LAYOUT, newer_layout};
use super::replicas::Written;
use super::scripts::{
    Force, ForceReply, Leave, NoGrant, Read, ReadPermits, Renew, RenewReply, Renewed,
};
use super::{RedisStore, failovers, listing, notices};
use lockbroker_core::domain::{Fence, Kind, Lease, LockKey, Pool, Space, Token, millis};
use lockbroker_core::store::{
    AsHolder, Bid, GrantAnswer, Hold, HoldReason, Join, ListQuery, Notice, Page, Permits, Released,
    Renewal, SessionEntry, SessionOp, SessionRecord, Snapshot, Store, StoreError, StoreResult,
    WATCH_MARK,
};

/// The answer of CLAIM or TAKE_OVER.
fn exclusive(granted: Result<Lease, NoGrant>) -> StoreResult<GrantAnswer> {
    Ok(match granted {
        Ok(lease) => GrantAnswer::Granted(lease),
        Err(NoGrant::OnHold(hold)) => GrantAnswer::OnHold(hold),
        Err(NoGrant::Refused) => GrantAnswer::Refused,
        Err(NoGrant::Queued { retry_after_ms }) => GrantAnswer::Queued { retry_after_ms },
        Err(NoGrant::NewerLayout { layout }) => return Err(newer_layout(layout)),
        Err(NoGrant::Busy { .. } | NoGrant::LimitMismatch { .. }) => {
            return Err(StoreError::Failed(
                "Redis answered an exclusive claim as a pool's join".into(),
            ));
        }
    })
}

impl Store for RedisStore {
    async fn claim(&self, key: &LockKey, bid: &Bid) -> StoreResult<GrantAnswer> {
        exclusive(self.grant(GrantScript::Claim, key, bid).await?)
    }

    async fn claim_all(&self, keys: &[LockKey], bid: &Bid) -> StoreResult<Option<Vec<Lease>>> {
        self.grant_all(keys, bid).await
    }

    async fn read(&self, key: &LockKey) -> StoreResult<Snapshot> {
        let keys = self.layout.names(Space::Locks, key);
        self.keeper
            .run(&Read { keys: &keys })
            .await
            .map(|reply| reply.0)
    }

    async fn take_over(&self, key: &LockKey, seen: Fence, bid: &Bid) -> StoreResult<GrantAnswer> {
        exclusive(self.grant(GrantScript::TakeOver { seen }, key, bid).await?)
    }

    async fn release(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> StoreResult<AsHolder<Released>> {
        self.keeper.release(space, key, token).await
    }

    async fn renew(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
        how: Renewal,
    ) -> StoreResult<AsHolder<Lease>> {
        let told = if self.replicas.asked() {
            // Boxed: see `Replicas::asked`.
            Box::pin(self.replicas.before_renew(self, space, key, token)).await?
        } else {
            None
        };
        let site = self.layout.site(space, key);
        let (caller, known) = (self.broker.caller(), self.keeper.epoch_for(site.slot));
        let renew = Renew {
            on: self.keeper.holder_context(&site, &caller, &known),
            token,
            how,
        };
        let (reply, generation) = self
            .keeper
            .run_acked(&renew, self.replicas.link_for(self, key))
            .await?;
        let answered = Instant::now();
        let (kind, lease, epoch) = match self.renewal(space, key, token, reply)? {
            Ok(renewed) => renewed,
            Err(refused) => return Ok(refused),
        };
        if self.replicas.asked() {
            Box::pin(self.replicas.confirm_renew(
                self,
                space,
                key,
                token,
                told,
                Written {
                    lease: &lease,
                    generation,
                },
            ))
            .await?;
        }
        let ends = answered + Duration::from_millis(lease.ttl_ms);
        self.keeper
            .remember(key, kind, site.slot, &lease, ends, &epoch);
        Ok(AsHolder::Done(lease))
    }

    async fn join(&self, key: &LockKey, pool: Pool, bid: &Bid) -> StoreResult<Join> {
        Ok(match self.grant(GrantScript::Join(pool), key, bid).await? {
            Ok(lease) => Join::Granted(lease),
            Err(NoGrant::OnHold(hold)) => Join::OnHold(hold),
            Err(NoGrant::Busy { retry_after_ms }) => Join::Busy { retry_after_ms },
            Err(NoGrant::Queued { retry_after_ms }) => Join::Queued { retry_after_ms },
            Err(NoGrant::LimitMismatch { limit }) => Join::LimitMismatch { limit },
            Err(NoGrant::NewerLayout { layout }) => return Err(newer_layout(layout)),
            Err(NoGrant::Refused) => {
                return Err(StoreError::Failed("unexpected join reply".into()));
            }
        })
    }

    async fn leave(&self, space: Space, key: &LockKey, token: &Token) -> StoreResult<()> {
        // A grant a release made to the bid, which its waiter did not take: released, so that
        // the key passes on (LEAVE leaves a granted lease alone).
        if space == Space::Locks && self.keeper.handed.take(key, token).is_some() {
            return self.keeper.release(space, key, token).await.map(|_| ());
        }
        let site = self.layout.site(space, key);
        let (caller, epoch) = (self.broker.caller(), self.keeper.epoch_for(site.slot));
        let leave = Leave {
            on: self.keeper.holder_context(&site, &caller, &epoch),
            token,
        };
        self.keeper.run(&leave).await.map(|_| ())
    }

    async fn session(&self, id: &Token, op: SessionOp<'_>) -> StoreResult<Option<SessionRecord>> {
        self.session_call(id, op).await
    }

    async fn renew_all(
        &self,
        entries: &[SessionEntry],
        until_ms: u64,
    ) -> Vec<StoreResult<AsHolder<Lease>>> {
        self.keep_leases(entries, until_ms).await
    }

    async fn mark_watched(&self, space: Space, key: &LockKey) -> StoreResult<bool> {
        let watched = self.layout.names(space, key).watched;
        let mark_ms = millis(WATCH_MARK);
        self.keeper
            .with_link(async |conn| {
                redis::cmd("SET")
                    .arg(&watched)
                    .arg("1")
                    .arg("PX")
                    .arg(mark_ms)
                    .query_async::<()>(conn)
                    .await
            })
            .await?;
        Ok(true)
    }

    async fn permits(&self, key: &LockKey) -> StoreResult<Permits> {
        let keys = self.layout.names(Space::Semaphores, key);
        self.keeper
            .run(&ReadPermits { keys: &keys })
            .await
            .map(|reply| reply.0)
    }

    async fn force_release(
        &self,
        space: Space,
        key: &LockKey,
    ) -> StoreResult<AsHolder<Vec<Fence>>> {
        let site = self.layout.site(space, key);
        let (caller, epoch) = (self.broker.caller(), self.keeper.epoch_for(site.slot));
        let force = Force {
            on: self.keeper.holder_context(&site, &caller, &epoch),
        };
        let fences = match self.keeper.run(&force).await? {
            ForceReply::Ended(fences) => fences,
            ForceReply::Refused(refusal) => return Ok(refusal.answer()),
        };
        let Some(&top) = fences.iter().max() else {
            return Ok(AsHolder::NotHeld);
        };
        self.keeper
            .ledger
            .forget_ended(space, key.as_str(), top, true);
        Ok(AsHolder::Done(fences))
    }

    async fn list(&self, query: &ListQuery) -> StoreResult<Page> {
        listing::page(self, query).await
    }

    fn cursor_pattern(&self) -> Option<&'static str> {
        Some(listing::CURSOR_PATTERN)
    }

    async fn ready(&self) -> StoreResult<Option<Hold>> {
        if self.keeper.epoch.putting_back_everywhere() {
            return Ok(Some(Hold {
                reason: HoldReason::PuttingBack,
                retry_after_ms: 1_000,
            }));
        }
        let hold = self.keeper.catch_up_task().await?;
        let layout = self
            .keeper
            .epoch
            .store_layout
            .load(std::sync::atomic::Ordering::Relaxed);
        if layout > STORE_LAYOUT {
            return Err(newer_layout(layout));
        }
        Ok(hold)
    }

    fn ledger_len(&self) -> usize {
        self.keeper.ledger.len()
    }

    fn start(&self, notices: mpsc::Sender<Notice>) {
        let _ = self.keeper.notices.set(notices.clone());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no runtime for the store's background work; waiters will poll");
            return;
        };
        runtime.spawn(notices::watch_epoch(self.clone(), notices.clone()));
        runtime.spawn(failovers::follow_failovers(self.clone(), notices.clone()));
        runtime.spawn(notices::listen(self.clone(), notices));
    }
}

impl RedisStore {
    /// What RENEW's `reply` on `token`'s lease on `key` in `space` says: the lease renewed, its
    /// kind and the store's epoch; or the refusal to answer (a lease the store says is not held
    /// is forgotten by the ledger).
    pub(crate) fn renewal(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
        reply: RenewReply,
    ) -> StoreResult<Result<(Kind, Lease, String), AsHolder<Lease>>> {
        let (kind, renewed) = match (space, reply) {
            (_, RenewReply::Refused(refusal)) => {
                let outcome = refusal.answer();
                if !matches!(outcome, AsHolder::OnHold(_)) {
                    self.keeper.ledger.forget_any(space, key, token);
                }
                return Ok(Err(outcome));
            }
            (Space::Locks, RenewReply::Exclusive(renewed)) => (Kind::Exclusive, renewed),
            (Space::Locks, RenewReply::Pooled { renewed, .. }) => (Kind::Shared, renewed),
            (Space::Semaphores, RenewReply::Pooled { renewed, limit }) => {
                let limit = limit.ok_or_else(|| {
                    StoreError::Failed(
                        "Redis renewed a permit of a semaphore without a limit".into(),
                    )
                })?;
                (Kind::Semaphore { limit }, renewed)
            }
            (Space::Semaphores, RenewReply::Exclusive(_)) => {
                return Err(StoreError::Failed(
                    "Redis renewed an exclusive lease on a semaphore".into(),
                ));
            }
        };
        let Renewed {
            fence,
            expires_at_ms,
            ttl_ms,
            owner,
            epoch,
        } = renewed;
        let lease = Lease {
            token: token.clone(),
            fence,
            expires_at_ms,
            ttl_ms,
            owner,
            request_id: None,
            limit: match kind {
                Kind::Semaphore { limit } => Some(limit),
                Kind::Exclusive | Kind::Shared => None,
            },
        };
        Ok(Ok((kind, lease, epoch)))
    }
}
