//! The lease guard: the [`Lease`] that [`Client::acquire`] and its kin return renews itself in
//! a background task, says once when it is lost, and is released by [`Lease::release`] or, on a
//! best-effort basis, when dropped.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};

use crate::client::{Client, REQUEST_TIMEOUT};
use crate::error::Error;
use crate::keep::{Plan, end_in_background, keep, lose, lost, mark_released};
use crate::several::{SeveralGrant, released_all};
use crate::types::{Claim, Grant, Resource, Token};

/// Shortest pause between two attempts while the broker does not answer: keeps a short lease
/// from turning an outage into a busy loop.
pub(crate) const MIN_RETRY: Duration = Duration::from_millis(10);

/// Longest pause between two attempts while the broker does not answer (unless the broker's
/// `Retry-After` asks for more on an acquire): a broker that comes back is noticed within a
/// second.
pub(crate) const MAX_RETRY: Duration = Duration::from_secs(1);

/// What an acquire asks for beyond the key: the lease's length, how long the broker may wait
/// for it, a label for people, and how the guard renews it.
#[derive(Clone)]
pub struct LeaseOptions {
    /// The lease's length; each renewal extends it to this much from the renewal.
    pub ttl: Duration,
    /// How long the broker waits while someone else holds the lock; `0` answers at once. 503s
    /// (429, 502, 504) and connection failures are retried within it.
    pub wait: Duration,
    /// A label shown by the broker's status and listings (at most 128 characters).
    pub owner: Option<String>,
    /// How often the guard renews; a third of `ttl` when `None`.
    pub renew_every: Option<Duration>,
    /// Called from the renewal task when a renewal fails without ending the lease (the guard
    /// keeps trying until the lease's end), and when one gets through again.
    pub on_trouble: Option<TroubleHook>,
}

impl fmt::Debug for LeaseOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseOptions")
            .field("ttl", &self.ttl)
            .field("wait", &self.wait)
            .field("owner", &self.owner)
            .field("renew_every", &self.renew_every)
            .finish_non_exhaustive()
    }
}

impl LeaseOptions {
    /// A lease of `ttl`, no wait, no owner, renewed every third of `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            wait: Duration::ZERO,
            owner: None,
            renew_every: None,
            on_trouble: None,
        }
    }

    /// Waits up to `wait` for the lease.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Labels the lease for people.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// Renews every `every` instead of every third of the ttl.
    pub fn renew_every(mut self, every: Duration) -> Self {
        self.renew_every = Some(every);
        self
    }
}

/// What [`LeaseOptions::on_trouble`] holds: called on the renewal task, so it must be quick.
pub type TroubleHook = Arc<dyn Fn(&Trouble) + Send + Sync>;

/// A renewal's trouble, for [`LeaseOptions::on_trouble`].
#[derive(Debug)]
pub enum Trouble {
    /// A renewal failed without an answer that ends the lease (no answer, a `503`, a proxy's
    /// `502`/`504`, a `429`); the guard tries again until `ends_in` has passed.
    Failing { error: Error, ends_in: Duration },
    /// A renewal got through after failing ones.
    Recovered,
}

/// Why a lease (or a session) was lost. A lease under a session is lost with it, for the
/// session's reason: a renewal is then the session's keep-alive.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Loss {
    /// A renewal was refused, and asking again would not change it: `not_held` or `not_owner`
    /// (nobody, or somebody else, holds it), `401`/`403` (the bearer token was revoked or is not
    /// allowed to renew), or any other answer that is not worth asking again: neither
    /// [`Error::is_transient`] nor a `5xx` (which is asked again until the lease's end). The
    /// error says which.
    #[error("a renewal was refused: {0}")]
    Refused(Error),
    /// No renewal was confirmed before the lease would have ended (judged from when the last
    /// confirmed renewal was sent, a tenth of the ttl early, so the signal precedes the end).
    #[error("no renewal got through before it ended{}", last.as_ref().map_or_else(String::new, |e| format!(" (last: {e})")))]
    Expired { last: Option<Error> },
}

/// What [`Lease::release`] did.
#[derive(Debug)]
pub enum Released {
    /// The broker ended the lease now.
    Now,
    /// The broker had no such lease any more (`not_held`, `not_owner`): it had ended already.
    Gone(Error),
    /// An earlier call (or a drop) released it; nothing was sent.
    Before,
}

/// Where a lease stands (and a [`Session`](crate::Session): `Held` while it is alive,
/// `Released` once closed).
#[derive(Debug, Clone)]
pub enum LeaseState {
    /// Held, as far as the last confirmed renewal (or the session's keep-alive) tells.
    Held,
    /// Released by its holder ([`Lease::release`] or a drop), or closed with its session.
    Released,
    /// Lost: the holder must stop acting on it (the fence still protects the resource).
    Lost(Loss),
}

/// A held lease: its key, fence and token, renewed in the background while it lives. A lease on
/// several keys ([`Client::acquire_all`]) holds them all with one token: [`Lease::key`] and
/// [`Lease::fence`] are the first key's, [`Lease::fences`] each key's; every key is renewed, the
/// loss of any is the loss of all (the rest are released), and a release releases all. Dropping
/// it stops the renewals and releases it on a best-effort basis (a task on the current tokio
/// runtime; if there is none, or the runtime ends first, the lease ends by its ttl). Prefer
/// [`Lease::release`], which says whether the broker confirmed. `Debug` shows no token.
pub struct Lease {
    shared: Arc<Shared>,
    renewer: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    client: Client,
    resource: Resource,
    token: Token,
    fence: u64,
    /// Every key and its fence, in the order asked (the one key's for a single lease).
    fences: Vec<(String, u64)>,
    /// Taken with [`Client::acquire_all`]: renewed key by key, released in one request.
    several: bool,
    ttl: Duration,
    /// Sent `Released` or `Lost` once; whoever changes it from `Held` first decides.
    state: watch::Sender<LeaseState>,
    /// Set by the first release (or drop): later ones send nothing.
    release_sent: AtomicBool,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("resource", &self.shared.resource)
            .field("fence", &self.shared.fence)
            .field("ttl", &self.shared.ttl)
            .field("state", &*self.shared.state.borrow())
            .finish_non_exhaustive()
    }
}

impl Lease {
    /// Takes over a lease granted by a call of the caller's own ([`Client::grant`]) and keeps
    /// it as [`Client::acquire_with`] does. `sent_at`: when the request that produced the grant
    /// was sent (the lease cannot end before `sent_at + ttl`, and is judged to end then).
    pub fn hold(
        client: Client,
        claim: &Claim,
        grant: &Grant,
        sent_at: Instant,
        options: LeaseOptions,
    ) -> Self {
        Self::renewed(Shared::new(client, claim, grant), sent_at, options)
    }

    /// [`Lease::hold`] for a grant of several keys ([`Client::grant_all`]).
    pub fn hold_all(
        client: Client,
        grant: &SeveralGrant,
        sent_at: Instant,
        options: LeaseOptions,
    ) -> Self {
        Self::renewed(Shared::several(client, grant), sent_at, options)
    }

    fn renewed(shared: Shared, sent_at: Instant, options: LeaseOptions) -> Self {
        let ttl = shared.ttl;
        let every = options
            .renew_every
            .unwrap_or(ttl / 3)
            .max(Duration::from_millis(1));
        let shared = Arc::new(shared);
        let plan = Plan {
            sent_at,
            ttl,
            every,
            on_trouble: options.on_trouble,
        };
        let kept = shared.clone();
        let renewer = tokio::spawn(async move {
            let url = || {
                let url = kept.client.resource_url(&kept.resource);
                url.map_or_else(|_| kept.client.url().to_owned(), |u| format!("{u}/renew"))
            };
            keep(&kept.state, plan, || kept.renew(), url).await;
            let expired = matches!(*kept.state.borrow(), LeaseState::Lost(Loss::Expired { .. }));
            if kept.several && expired {
                let _ = kept.release_now().await; // what the broker still holds goes now
            }
        });
        Self {
            shared,
            renewer: Mutex::new(Some(renewer)),
        }
    }

    /// A lease granted under a session: not renewed on its own (the session's keep-alive keeps
    /// it), lost when the session is lost (with the session's [`Loss`]), and released when the
    /// session is closed (the broker released it with the session).
    pub(crate) fn under_session(
        client: Client,
        claim: &Claim,
        grant: &Grant,
        session: watch::Receiver<LeaseState>,
    ) -> Self {
        Self::followed(Shared::new(client, claim, grant), session)
    }

    /// [`Lease::under_session`] for several keys.
    pub(crate) fn under_session_all(
        client: Client,
        grant: &SeveralGrant,
        session: watch::Receiver<LeaseState>,
    ) -> Self {
        Self::followed(Shared::several(client, grant), session)
    }

    fn followed(shared: Shared, session: watch::Receiver<LeaseState>) -> Self {
        let shared = Arc::new(shared);
        let follower = tokio::spawn(follow_session(shared.clone(), session));
        Self {
            shared,
            renewer: Mutex::new(Some(follower)),
        }
    }

    /// The lock's key or the semaphore's name.
    pub fn key(&self) -> &str {
        &self.shared.resource.key
    }

    /// What the lease is on.
    pub fn resource(&self) -> &Resource {
        &self.shared.resource
    }

    /// The fencing token: send it with every write to the protected resource, which refuses a
    /// fence lower than one it has seen.
    pub fn fence(&self) -> u64 {
        self.shared.fence
    }

    /// Every key the lease holds and its fence, in the order they were asked for: the one key's
    /// for a single lease, each key's for one from [`Client::acquire_all`].
    pub fn fences(&self) -> &[(String, u64)] {
        &self.shared.fences
    }

    /// The fence of `key`, if the lease holds it.
    pub fn fence_of(&self, key: &str) -> Option<u64> {
        self.shared
            .fences
            .iter()
            .find(|(k, _)| k == key)
            .map(|&(_, f)| f)
    }

    /// The lease's token, for handing the lease to another process.
    pub fn token(&self) -> &Token {
        &self.shared.token
    }

    /// The lease's length, as the broker granted it.
    pub fn ttl(&self) -> Duration {
        self.shared.ttl
    }

    /// Whether the lease is held: neither released nor lost.
    pub fn is_held(&self) -> bool {
        matches!(*self.shared.state.borrow(), LeaseState::Held)
    }

    /// Where the lease stands now.
    pub fn state(&self) -> LeaseState {
        self.shared.state.borrow().clone()
    }

    /// A receiver that sees the lease's state change (once: to released or to lost).
    pub fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.shared.state.subscribe()
    }

    /// Resolves when the lease is lost (at once if it was already); never if it is released
    /// instead. Made for `tokio::select!` next to the work the lease protects.
    pub async fn lost(&self) -> Loss {
        lost(&self.shared.state).await
    }

    /// Stops the renewals for good (a renewal already in flight is let finish, so that the
    /// `DELETE` comes after it), then releases the lease (also a lost one: the broker may still
    /// hold it for a moment). Idempotent: a second call sends nothing, and a lease that
    /// was gone at the broker (`404`, `409`) is not an error. An error means the broker could
    /// not be asked or refused otherwise; the lease then ends by its ttl. Each request is
    /// bounded by [`REQUEST_TIMEOUT`]; wrap the call in a timeout for a shorter bound.
    pub async fn release(&self) -> Result<Released, Error> {
        if self.shared.release_sent.swap(true, Ordering::SeqCst) {
            return Ok(Released::Before);
        }
        mark_released(&self.shared.state);
        let renewer = self.renewer.lock().expect("never poisoned").take();
        self.shared.release_after(renewer).await
    }
}

impl Shared {
    fn new(client: Client, claim: &Claim, grant: &Grant) -> Self {
        Self {
            client,
            resource: claim.resource(),
            token: grant.token.clone(),
            fence: grant.fence,
            fences: vec![(claim.resource().key, grant.fence)],
            several: false,
            ttl: Duration::from_millis(grant.ttl_ms.max(1)),
            state: watch::Sender::new(LeaseState::Held),
            release_sent: AtomicBool::new(false),
        }
    }

    /// A grant of several keys; the first one stands for the lease in its key and fence.
    fn several(client: Client, grant: &SeveralGrant) -> Self {
        let fences: Vec<(String, u64)> = grant
            .leases
            .iter()
            .map(|lease| (lease.key.clone(), lease.fence))
            .collect();
        let (key, fence) = fences.first().cloned().unwrap_or_default();
        Self {
            client,
            resource: Resource::lock(key),
            token: grant.token.clone(),
            fence,
            fences,
            several: true,
            ttl: Duration::from_millis(grant.ttl_ms.max(1)),
            state: watch::Sender::new(LeaseState::Held),
            release_sent: AtomicBool::new(false),
        }
    }

    /// Renews the lease: the one key, or every key ([`Client::renew_every_key`]).
    async fn renew(&self) -> Result<(), Error> {
        let (client, token, ttl) = (&self.client, &self.token, self.ttl);
        if self.several {
            return client.renew_every_key(&self.fences, token, ttl).await;
        }
        client
            .renew(&self.resource, token, Some(ttl))
            .await
            .map(drop)
    }

    /// Releases at the broker: the one key, or every key in one `DELETE /locks?keys=`.
    async fn release_now(&self) -> Result<Released, Error> {
        if self.several {
            return released_all(self.client.release_all(&self.keys(), &self.token).await?);
        }
        match self.client.release(&self.resource, &self.token).await {
            Ok(()) => Ok(Released::Now),
            Err(e) if e.is_gone() => Ok(Released::Gone(e)),
            Err(e) => Err(e),
        }
    }

    fn keys(&self) -> Vec<&str> {
        self.fences.iter().map(|(k, _)| k.as_str()).collect()
    }

    /// Waits for the renewal task to stop (it does between renewals, or after the one in
    /// flight, so the `DELETE` always comes after the last renewal), then releases.
    async fn release_after(&self, renewer: Option<JoinHandle<()>>) -> Result<Released, Error> {
        if let Some(renewer) = renewer {
            let _ = renewer.await;
        }
        self.release_now().await
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.shared.release_sent.swap(true, Ordering::SeqCst) {
            return;
        }
        mark_released(&self.shared.state);
        let renewer = self.renewer.get_mut().expect("never poisoned").take();
        let shared = self.shared.clone();
        end_in_background(renewer, |renewer| async move {
            let bound = shared.ttl.min(REQUEST_TIMEOUT);
            let _ = timeout(bound, shared.release_after(renewer)).await;
        });
    }
}

/// A session lease's follower: marks the lease lost when its session is lost, and released
/// (with nothing left to send) when its session is closed; stops when the lease is released.
async fn follow_session(shared: Arc<Shared>, mut session: watch::Receiver<LeaseState>) {
    let mut own = shared.state.subscribe();
    let ended = tokio::select! {
        ended = session.wait_for(|s| !matches!(s, LeaseState::Held)) => ended.map(|s| s.clone()),
        _ = own.wait_for(|s| !matches!(s, LeaseState::Held)) => return,
    };
    match ended {
        Ok(LeaseState::Lost(loss)) => lose(&shared.state, loss),
        Ok(_) => {
            shared.release_sent.store(true, Ordering::SeqCst);
            mark_released(&shared.state);
        }
        // The session's guard says `Released` before it goes: not reached.
        Err(_) => {}
    }
}
