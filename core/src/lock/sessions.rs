//! Sessions: one keep-alive for many leases (see `store/session.rs` for how the store keeps
//! them). The service keeps a session's record and its leases in step:
//!
//! - An acquire under a session enters its lease's token in the record *before* asking for the
//!   key (so a close that comes meanwhile finds it and a keep-alive renews it), bids with the
//!   session's end as its lease's end ([`Bid::ends`](crate::store::Bid::ends)), and once granted
//!   enters it again, which also reads the session: ended → the lease is released and the
//!   acquire answers [`LockError::NoSession`]; renewed meanwhile → the lease is extended to the
//!   session's new end. A waiting acquire whose session ends while it waits stops waiting (it
//!   leaves the key's queue as a client that went away does) and answers the same.
//! - A keep-alive moves the record's end, then every entered lease's end to the session's end
//!   plus its lock delay ([`Renewal::Until`], which never shortens a lease). It answers only
//!   when every lease is extended: a store failure on any is a 503, and the client retries.
//!   A lease found gone (released by its token, force-released) leaves the record.
//! - A close ends the record, then releases every entered lease (no lock delay).
//!
//! A session that ends by expiry is not seen by anyone: its leases end by themselves at its end
//! plus the lock delay, each in its own key, and their keys pass to the heads of their queues as
//! any expired lease's do.

use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::Instant;

use super::{AcquireRequest, LockError, LockService};
use crate::domain::{LockKey, Mode, Owner, Space, Token, Ttl};
use crate::metrics::StoreOp;
use crate::store::{
    AsHolder, ENTRY_GRACE_MS, Lease, Renewal, SessionEntry, SessionOp, SessionRecord, SessionSpec,
    Store, StoreResult,
};

/// How often a waiting acquire under a session looks whether its session still lives, at most:
/// a session closed through any broker ends its waiters within this.
const SESSION_LOOK: Duration = Duration::from_secs(2);

/// A lease under a session as `GET /sessions/{S}` shows it.
#[derive(Debug, Clone)]
pub struct SessionLease {
    pub space: Space,
    pub key: LockKey,
    /// A lock's mode (`None` for a semaphore permit).
    pub mode: Option<Mode>,
    pub fence: u64,
}

impl<S: Store> LockService<S> {
    /// One call on a session's record, timed and counted.
    async fn on_session(
        &self,
        id: &Token,
        op: SessionOp<'_>,
    ) -> StoreResult<Option<SessionRecord>> {
        let answer = self
            .timed(StoreOp::session, self.store.session(id, op))
            .await;
        if answer.is_err() {
            self.metrics.session("error");
        }
        answer
    }

    /// Opens a session (or, with a request id that opened one still alive, answers that one).
    pub async fn open_session(&self, spec: SessionSpec) -> Result<SessionRecord, LockError> {
        let record = self
            .on_session(&Token::generate(), SessionOp::Open(&spec))
            .await?
            .ok_or(LockError::NotHeld)?;
        self.metrics.session("opened");
        Ok(record)
    }

    /// The keep-alive: moves the session's end to its TTL (or `ttl`) from now and every lease
    /// under it along. `NotHeld` when the session has ended.
    pub async fn keep_alive(
        &self,
        id: &Token,
        ttl: Option<Ttl>,
    ) -> Result<SessionRecord, LockError> {
        let Some(record) = self.on_session(id, SessionOp::Renew(ttl)).await? else {
            self.metrics.session("ended");
            return Err(LockError::NotHeld);
        };
        let started = Instant::now();
        let kept = self
            .store
            .renew_all(&record.entries, record.leases_end_ms())
            .await;
        let failed_any = kept.iter().any(Result::is_err);
        self.metrics
            .store_call(StoreOp::keep, started.elapsed(), failed_any);
        let mut gone = Vec::new();
        let mut failed = None;
        for (entry, outcome) in record.entries.iter().zip(kept) {
            match outcome {
                Ok(AsHolder::Done(_)) => {}
                // Gone: dropped once it has been gone longer than an acquire can be in flight
                // (an entry entered before its grant, or still waiting, must stay for a close).
                Ok(AsHolder::NotHeld | AsHolder::NotOwner)
                    if record.now_ms.saturating_sub(entry.entered_ms) > ENTRY_GRACE_MS =>
                {
                    gone.push(entry)
                }
                Ok(AsHolder::NotHeld | AsHolder::NotOwner) => {}
                Ok(AsHolder::OnHold(hold)) => failed = Some(LockError::OnHold(hold)),
                Err(e) => failed = Some(e.into()),
            }
        }
        // Entries of leases that ended (a release by token, a force release, a grant that never
        // came) leave the record, ENTRY_GRACE_MS after they were last entered.
        for entry in gone {
            let _ = self.on_session(id, SessionOp::Drop(entry)).await;
        }
        if let Some(e) = failed {
            return Err(e);
        }
        self.metrics.session("kept");
        Ok(record)
    }

    /// Ends the session and releases every lease under it. `NotHeld` when it had ended.
    pub async fn close_session(&self, id: &Token) -> Result<(), LockError> {
        let Some(record) = self.on_session(id, SessionOp::Close).await? else {
            self.metrics.session("ended");
            return Err(LockError::NotHeld);
        };
        self.metrics.session("closed");
        let releases = record
            .entries
            .iter()
            .map(|e| self.release(e.space, &e.key, &e.token));
        for released in join_all(releases).await {
            match released {
                Ok(()) | Err(LockError::NotHeld | LockError::NotOwner) => {}
                // The session has ended; a lease the store did not release ends at the
                // session's end plus its lock delay. The client hears that it failed.
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The session and the live leases under it.
    pub async fn session(
        &self,
        id: &Token,
    ) -> Result<(SessionRecord, Vec<SessionLease>), LockError> {
        let Some(record) = self.on_session(id, SessionOp::Read).await? else {
            return Err(LockError::NotHeld);
        };
        let views = record.entries.iter().map(|e| async move {
            let held = match e.space {
                Space::Locks => self.inspect(&e.key).await,
                Space::Semaphores => self.permits(&e.key).await,
            };
            match held {
                Ok(view) => {
                    Ok(view
                        .holders
                        .iter()
                        .find(|l| l.token == e.token)
                        .map(|l| SessionLease {
                            space: e.space,
                            key: e.key.clone(),
                            mode: view.mode,
                            fence: l.fence,
                        }))
                }
                Err(LockError::NotHeld) => Ok(None),
                Err(e) => Err(e),
            }
        });
        let mut leases = Vec::new();
        for view in join_all(views).await {
            leases.extend(view?);
        }
        leases.sort_by(|a, b| (a.space, &a.key).cmp(&(b.space, &b.key)));
        Ok((record, leases))
    }

    /// An acquire under the session `id` (see the module's comment).
    pub(super) async fn acquire_in_session(
        &self,
        key: &LockKey,
        mut req: AcquireRequest,
        id: Token,
        token: Token,
    ) -> Result<Lease, LockError> {
        let space = req.kind.space();
        let mut entry = SessionEntry {
            space,
            key: key.clone(),
            token,
            entered_ms: 0,
        };
        let Some(record) = self.on_session(&id, SessionOp::Enter(&entry)).await? else {
            return Err(LockError::NoSession);
        };
        let left = record.leases_end_ms().saturating_sub(record.now_ms).max(1);
        let ends = Instant::now() + Duration::from_millis(left);
        req.ttl = Ttl::from_ms(left);
        let label = req.owner.take().or(record.owner);
        req.owner = Some(Owner::for_session(label.as_ref(), record.lock_delay_ms));
        let waits = req.wait.as_duration() > Duration::ZERO;
        let acquire = self.acquire_as(key, req, entry.token.clone(), Some(ends));
        let granted = if waits {
            tokio::select! {
                granted = acquire => granted,
                () = self.session_ended(&id, &entry, record.expires_at_ms - record.now_ms) => Err(LockError::NoSession),
            }
        } else {
            acquire.await
        };
        let lease = match granted {
            Ok(lease) => lease,
            Err(e) => {
                let _ = self.on_session(&id, SessionOp::Drop(&entry)).await;
                return Err(e);
            }
        };
        // A repeated acquire (same request id) gets the earlier acquire's lease, whose token
        // that acquire entered.
        if lease.token != entry.token {
            let _ = self.on_session(&id, SessionOp::Drop(&entry)).await;
            entry.token = lease.token.clone();
        }
        self.confirm_in_session(&id, &entry, lease).await
    }

    /// The last step of an acquire under a session: enters the granted lease again, which says
    /// whether the session still lives and when it ends now, and extends the lease to that end.
    async fn confirm_in_session(
        &self,
        id: &Token,
        entry: &SessionEntry,
        mut lease: Lease,
    ) -> Result<Lease, LockError> {
        let confirmed = self.on_session(id, SessionOp::Enter(entry)).await;
        let record = match confirmed {
            Ok(Some(record)) => record,
            Ok(None) => {
                // The session ended while the lease was granted: nothing is left held.
                let _ = self.release(entry.space, &entry.key, &entry.token).await;
                return Err(LockError::NoSession);
            }
            Err(e) => {
                let _ = self.release(entry.space, &entry.key, &entry.token).await;
                return Err(e.into());
            }
        };
        if lease.expires_at_ms < record.leases_end_ms() {
            let until = Renewal::Until(record.leases_end_ms());
            let extended = self
                .timed(
                    StoreOp::renew,
                    self.store
                        .renew(entry.space, &entry.key, &entry.token, until),
                )
                .await;
            if let Err(e) = extended
                .map_err(LockError::from)
                .and_then(|a| a.into_result())
            {
                let _ = self.release(entry.space, &entry.key, &entry.token).await;
                return Err(e);
            }
        }
        lease.expires_at_ms = record.expires_at_ms;
        lease.ttl_ms = record.ttl_ms;
        Ok(lease)
    }

    /// Ends when the session `id` has ended (looked at when it would end if not kept alive,
    /// and at least every [`SESSION_LOOK`]): for a waiting acquire under it, whose `entry` each
    /// look enters again (an acquire in flight keeps its entry: see [`ENTRY_GRACE_MS`]).
    async fn session_ended(&self, id: &Token, entry: &SessionEntry, first_ms: u64) {
        let mut next = Duration::from_millis(first_ms).min(SESSION_LOOK);
        loop {
            tokio::time::sleep(next).await;
            next = match self.on_session(id, SessionOp::Enter(entry)).await {
                Ok(None) => return,
                Ok(Some(r)) => Duration::from_millis(r.expires_at_ms - r.now_ms).min(SESSION_LOOK),
                // The store did not answer: the acquire's own store calls say so.
                Err(_) => SESSION_LOOK,
            };
        }
    }
}
