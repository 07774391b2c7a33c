//! Several keys at once: every key or none, with one token, a fence per key.
//!
//! The keys are taken one after another **in one global order — sorted** — each through the
//! key's own queue, exactly as a single acquire waits: so a request never waits for a key while
//! holding a later one, and no cycle of waits can form (the classic lock ordering); each key is
//! served in its queue's order, so a stream of single-key requests cannot starve a several-keys
//! one (it waits in line like them). While it waits for a key, the keys it holds already are kept
//! renewed; they are held up for at most the request's `wait_ms` (plus the store timeout). When the
//! wait runs out on some key, every key taken is released and the answer names the busy keys; a
//! client that goes away mid-way releases what it took the same way (a guard, on drop); a broker
//! that dies mid-way leaves the keys it took to end at their TTL, as any lease of a dead broker.
//!
//! One token for all: the first key's grant decides it (with a `request_id`, an earlier attempt's
//! token), the others are asked with it, so a retry with the same `request_id` gets the same
//! leases back. Under a session, each key's lease is entered in the session as a single acquire's
//! is, and the session keeps them (no renewal here).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::Instant;

use super::pending::PendingGrant;
use super::{AcquireRequest, LockError, LockService};
use crate::domain::{Kind, LockKey, Space, Token, Ttl, WaitFor, millis};
use crate::metrics::{AcquireResult, StoreOp};
use crate::store::{Bid, Lease, Renewal, Store, StoreError};

/// The most keys one request may name.
pub const MAX_KEYS: usize = 64;

/// What a several-keys acquire got: each key's lease, in the order the keys were asked.
#[derive(Debug, Clone)]
pub struct Leases {
    pub token: Token,
    pub leases: Vec<(LockKey, Lease)>,
}

/// The keys taken so far, released on drop unless the acquire succeeded (the client went away,
/// or the acquire failed on a later key).
struct Taken<S: Store> {
    service: LockService<S>,
    kind_space: crate::domain::Space,
    keys: Arc<Mutex<Vec<(LockKey, Lease)>>>,
    kept: bool,
}

impl<S: Store> Taken<S> {
    /// Releases the keys taken so far, now (the drop would in the background; it still does if
    /// this is dropped halfway).
    async fn release(&mut self) {
        let taken = self.keys.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let releases = taken
            .iter()
            .map(|(key, lease)| self.service.release(self.kind_space, key, &lease.token));
        join_all(releases).await;
        self.keys.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

impl<S: Store> Drop for Taken<S> {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        let taken = std::mem::take(&mut *self.keys.lock().unwrap_or_else(|e| e.into_inner()));
        if taken.is_empty() {
            return;
        }
        let (service, space) = (self.service.clone(), self.kind_space);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let releases = taken
                    .iter()
                    .map(|(key, lease)| service.release(space, key, &lease.token));
                join_all(releases).await;
            });
        }
    }
}

impl<S: Store> LockService<S> {
    /// Acquires every key of `keys` (distinct, 1 to [`MAX_KEYS`]) or none (see the module's
    /// comment), waiting up to `req.wait` in all. `Locked` names the keys that were busy then.
    pub async fn acquire_all(
        &self,
        keys: &[LockKey],
        req: AcquireRequest,
    ) -> Result<Leases, LockError> {
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_by(|&a, &b| keys[a].cmp(&keys[b]));
        let deadline = Instant::now() + req.wait.as_duration();
        let space = req.kind.space();
        let mut taken = Taken {
            service: self.clone(),
            kind_space: space,
            keys: Arc::default(),
            kept: false,
        };
        let mut token = Token::generate();
        if keys.len() > 1 && req.session.is_none() && req.kind == Kind::Exclusive {
            match self.all_free(keys, &req, &token).await {
                Some(Ok(leases)) => return Ok(leases),
                // Taken one by one, with another token: the failed call may have granted this
                // one (its guard releases what it did).
                Some(Err(_)) => token = Token::generate(),
                None => {}
            }
        }
        let mut granted: Vec<Option<Lease>> = vec![None; keys.len()];
        for (n, &i) in order.iter().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now());
            let asked = AcquireRequest {
                wait: WaitFor::from_ms(millis(left)),
                ..req.clone()
            };
            let acquire = self.acquire_one(&keys[i], asked, token.clone());
            let answer = if n == 0 || req.session.is_some() || left.is_zero() {
                acquire.await
            } else {
                tokio::select! {
                    answer = acquire => answer,
                    () = self.keep_renewed(space, &taken.keys, req.ttl) => unreachable!("keeps renewing"),
                }
            };
            match answer {
                Ok(lease) => {
                    if n == 0 {
                        // With a request id, the first key may be an earlier attempt's lease:
                        // its token is the one for every key.
                        token = lease.token.clone();
                    }
                    taken
                        .keys
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((keys[i].clone(), lease.clone()));
                    granted[i] = Some(lease);
                }
                Err(LockError::Locked { retry_after_ms }) => {
                    // Released before the answer, so that none is held once the client has it.
                    let (busy, ()) =
                        tokio::join!(self.busy_among(keys, &order[n..]), taken.release());
                    return Err(LockError::LockedKeys {
                        keys: busy,
                        retry_after_ms,
                    });
                }
                Err(e) => {
                    taken.release().await;
                    return Err(e);
                }
            }
        }
        taken.kept = true;
        let leases = keys
            .iter()
            .cloned()
            .zip(granted.into_iter().flatten())
            .collect();
        Ok(Leases { token, leases })
    }

    /// Every key in one store call if each one is free now ([`Store::claim_all`]): the leases, in
    /// the order of `keys`; `None` when not (nothing taken); a store failure (after which the
    /// keys the call may have granted are released by `token`, unless a request id lets a retry
    /// get them back, as for one key: see `PendingGrant`).
    async fn all_free(
        &self,
        keys: &[LockKey],
        req: &AcquireRequest,
        token: &Token,
    ) -> Option<Result<Leases, StoreError>> {
        let arrived = Instant::now();
        let bid = Bid {
            token: token.clone(),
            ttl: req.ttl,
            owner: req.owner.clone(),
            request_id: req.request_id.clone(),
            wait_ms: 0,
            ends: None,
        };
        let guards: Vec<_> = keys
            .iter()
            .map(|key| PendingGrant {
                store: bid.request_id.is_none().then_some(&self.store),
                space: Space::Locks,
                key,
                token,
                ttl: bid.ttl,
                outage: self.metrics.outage(),
            })
            .collect();
        let answer = self
            .timed(StoreOp::claim_all, self.store.claim_all(keys, &bid))
            .await;
        for guard in guards {
            guard.settle(&answer);
        }
        let leases = match answer {
            Ok(Some(leases)) if leases.len() == keys.len() => leases,
            Ok(_) => return None,
            Err(e) => return Some(Err(e)),
        };
        for key in keys {
            self.metrics
                .acquired(Kind::Exclusive, AcquireResult::Granted, arrived.elapsed());
            self.watchers.changed(Space::Locks, key);
        }
        Some(Ok(Leases {
            token: token.clone(),
            leases: keys.iter().cloned().zip(leases).collect(),
        }))
    }

    /// One key of a several-keys acquire, with the request's token.
    async fn acquire_one(
        &self,
        key: &LockKey,
        mut req: AcquireRequest,
        token: Token,
    ) -> Result<Lease, LockError> {
        match req.session.take() {
            Some(session) => self.acquire_in_session(key, req, session, token).await,
            None => self.acquire_as(key, req, token, None).await,
        }
    }

    /// Keeps the keys taken so far renewed while a later one is waited for: every third of
    /// their TTL. Never ends (the caller races it against the wait).
    async fn keep_renewed(
        &self,
        space: crate::domain::Space,
        taken: &Mutex<Vec<(LockKey, Lease)>>,
        ttl: Ttl,
    ) {
        let every = Duration::from_millis((ttl.as_ms() / 3).max(1));
        loop {
            tokio::time::sleep(every).await;
            let held: Vec<_> = taken.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let renewals = held.iter().map(|(key, lease)| {
                self.store
                    .renew(space, key, &lease.token, Renewal::For(ttl))
            });
            // A renewal that fails is not fatal here: the lease still ends at its TTL, and the
            // acquire ends by its wait; a lease lost meanwhile shows when the client renews it.
            let _ = join_all(renewals).await;
        }
    }

    /// The keys among `keys[rest]` that are held now (the first always counts: its wait ran out).
    async fn busy_among(&self, keys: &[LockKey], rest: &[usize]) -> Vec<LockKey> {
        let mut busy = vec![keys[rest[0]].clone()];
        let looks = rest[1..].iter().map(|&i| async move {
            let held = self.inspect(&keys[i]).await.is_ok();
            held.then(|| keys[i].clone())
        });
        busy.extend(join_all(looks).await.into_iter().flatten());
        busy
    }
}
