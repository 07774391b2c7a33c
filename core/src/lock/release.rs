//! What a holder does with its lease — release it, renew it — and what an admin may do without
//! the token: force release, which ends every lease on a key.

use std::time::Duration;

use super::{LockError, LockService};
use crate::domain::{Fence, LockKey, Owner, Space, Token, Ttl};
use crate::metrics::{HolderResult, StoreOp};
use crate::store::{AsHolder, Lease, Renewal, Store, StoreResult};

impl<S: Store> LockService<S> {
    /// Releases `token`'s live lease on `key` in `space`: the exclusive or a shared lease of a
    /// lock, or a semaphore's permit.
    pub async fn release(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> Result<(), LockError> {
        let outcome = self
            .timed(StoreOp::release, self.store.release(space, key, token))
            .await;
        let held = match &outcome {
            Ok(AsHolder::Done(released)) => Some(Duration::from_millis(released.held_ms)),
            _ => None,
        };
        self.metrics.released(space, holder_result(&outcome), held);
        if held.is_some() {
            self.watchers.changed(space, key);
        }
        outcome?.into_result().map(drop)
    }

    /// Moves the end of `token`'s live lease on `key` in `space` to `ttl` from now. Same token,
    /// same fence. A lease held under a session keeps its end, which is its session's: the
    /// answer says when the session ends (without the lock delay the lease's end adds).
    pub async fn renew(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
        ttl: Ttl,
    ) -> Result<Lease, LockError> {
        let how = Renewal::For(ttl);
        let outcome = self
            .timed(StoreOp::renew, self.store.renew(space, key, token, how))
            .await;
        self.metrics.renewed(space, holder_result(&outcome));
        if matches!(outcome, Ok(AsHolder::Done(_))) {
            // Not a change of holders, but the lease may now end sooner than the watchers'
            // keeper expects: it reads once and times the expiry again.
            self.watchers.changed(space, key);
        }
        let mut lease = outcome?.into_result()?;
        if let Some(delay) = lease.owner.as_ref().and_then(Owner::session_delay_ms) {
            lease.expires_at_ms = lease.expires_at_ms.saturating_sub(delay);
        }
        Ok(lease)
    }

    /// Ends every live lease on `key` in `space` without their tokens; the fences it ended.
    /// Refused unless force release is allowed on this broker (see [`LockSettings`](super::LockSettings)).
    pub async fn force_release(
        &self,
        space: Space,
        key: &LockKey,
    ) -> Result<Vec<Fence>, LockError> {
        if !self.settings.allow_force_release {
            return Err(LockError::ForceReleaseOff);
        }
        let outcome = self
            .timed(StoreOp::force_release, self.store.force_release(space, key))
            .await;
        self.metrics.force_released(space, holder_result(&outcome));
        let fences = outcome?.into_result()?;
        self.watchers.changed(space, key);
        tracing::warn!(
            %key,
            ?space,
            ?fences,
            "force release ended {} lease(s) without their tokens",
            fences.len()
        );
        Ok(fences)
    }
}

/// How a holder-checked store call ended, as the metrics count it.
fn holder_result<T>(outcome: &StoreResult<AsHolder<T>>) -> HolderResult {
    match outcome {
        Ok(AsHolder::Done(_)) => HolderResult::Done,
        Ok(AsHolder::NotHeld) => HolderResult::NotHeld,
        Ok(AsHolder::NotOwner) => HolderResult::NotOwner,
        Ok(AsHolder::OnHold(_)) | Err(_) => HolderResult::Error,
    }
}
