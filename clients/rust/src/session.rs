//! The session guard: the [`Session`] that [`Client::open_session`] returns keeps one
//! keep-alive for every lease taken under it ([`Session::acquire`] and its kin), says once when
//! it is lost — and every lease under it with it — and is closed by [`Session::close`] or, on a
//! best-effort basis, when dropped, which releases every lease under it at once.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};

use crate::acquire::asking_again;
use crate::client::{Client, REQUEST_TIMEOUT};
use crate::error::Error;
use crate::keep::{Plan, end_in_background, keep, lost, mark_released};
use crate::lease::{Lease, LeaseState, Loss, Released, TroubleHook};
use crate::types::{AcquireParams, Claim, Grant, SessionParams, Token, new_request_id};

/// What [`Client::open_session_with`] asks for.
#[derive(Clone)]
pub struct SessionOptions {
    /// The session's length: with no keep-alive for this long, it ends, and every lease under
    /// it with it.
    pub ttl: Duration,
    /// How long the keys of a session that ends by expiry stay held after its end (at most
    /// 60 s); a close or a release has none.
    pub lock_delay: Duration,
    /// A label for people, shown for the session and its leases.
    pub owner: Option<String>,
    /// How often the keep-alive is sent; a third of `ttl` when `None`.
    pub keep_alive_every: Option<Duration>,
    /// Called from the keep-alive task when a keep-alive fails without ending the session, and
    /// when one gets through again.
    pub on_trouble: Option<TroubleHook>,
}

impl fmt::Debug for SessionOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionOptions")
            .field("ttl", &self.ttl)
            .field("lock_delay", &self.lock_delay)
            .field("owner", &self.owner)
            .field("keep_alive_every", &self.keep_alive_every)
            .finish_non_exhaustive()
    }
}

impl SessionOptions {
    /// A session of `ttl`, no lock delay, no owner, kept alive every third of `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            lock_delay: Duration::ZERO,
            owner: None,
            keep_alive_every: None,
            on_trouble: None,
        }
    }

    /// Holds the keys of a session that ends by expiry for `delay` after its end.
    pub fn lock_delay(mut self, delay: Duration) -> Self {
        self.lock_delay = delay;
        self
    }

    /// Labels the session for people.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }
}

/// An open session: one keep-alive (at a third of its ttl) keeps every lease taken under it.
/// Lost once — a keep-alive answered `404`, or its end passed without a confirmed keep-alive —
/// and then every lease under it is lost too. Closing it (or dropping it, which closes it in the
/// background as a dropped [`Lease`] is released) releases them all. The leases do not keep the
/// session: they end with it. `Debug` shows no id.
pub struct Session {
    shared: Arc<Shared>,
    keeper: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    client: Client,
    id: Token,
    ttl: Duration,
    lock_delay: Duration,
    owner: Option<String>,
    /// `Held` while alive; `Released` once closed, or `Lost`: whoever changes it first decides.
    state: watch::Sender<LeaseState>,
    /// Set by the first close (or drop): later ones send nothing.
    close_sent: AtomicBool,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("ttl", &self.shared.ttl)
            .field("owner", &self.shared.owner)
            .field("state", &*self.shared.state.borrow())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Opens a session of `ttl` whose keys stay held `lock_delay` after it ends by expiry.
    pub async fn open_session(
        &self,
        ttl: Duration,
        lock_delay: Duration,
    ) -> Result<Session, Error> {
        self.open_session_with(SessionOptions::new(ttl).lock_delay(lock_delay))
            .await
    }

    /// Opens a session as `options` say. A `503` (429, 502, 504) or a lost connection is asked
    /// again with the same request id (so a session whose answer was lost is returned, never
    /// opened twice) within the session's ttl, and at least once.
    pub async fn open_session_with(&self, options: SessionOptions) -> Result<Session, Error> {
        let params = SessionParams {
            ttl: Some(options.ttl),
            lock_delay: Some(options.lock_delay),
            owner: options.owner.clone(),
            request_id: Some(new_request_id()),
        };
        let sent_at = Instant::now();
        let grant = asking_again(sent_at + options.ttl, |_| self.create_session(&params)).await?;
        let ttl = Duration::from_millis(grant.ttl_ms.max(1));
        let shared = Arc::new(Shared {
            client: self.clone(),
            id: grant.session,
            ttl,
            lock_delay: Duration::from_millis(grant.lock_delay_ms),
            owner: grant.owner,
            state: watch::Sender::new(LeaseState::Held),
            close_sent: AtomicBool::new(false),
        });
        let plan = Plan {
            sent_at,
            ttl,
            every: options
                .keep_alive_every
                .unwrap_or(ttl / 3)
                .max(Duration::from_millis(1)),
            on_trouble: options.on_trouble,
        };
        let kept = shared.clone();
        let keeper = tokio::spawn(async move {
            let renew = || kept.client.keep_alive(&kept.id, None);
            let url = || format!("{}/sessions/…/renew", kept.client.url());
            keep(&kept.state, plan, renew, url).await;
        });
        Ok(Session {
            shared,
            keeper: Mutex::new(Some(keeper)),
        })
    }
}

impl Session {
    /// The session's id: the secret that keeps it alive, closes it and takes leases under it,
    /// for handing it to another process.
    pub fn id(&self) -> &Token {
        &self.shared.id
    }

    /// Its length, as the broker granted it.
    pub fn ttl(&self) -> Duration {
        self.shared.ttl
    }

    /// How long its keys stay held after it ends by expiry.
    pub fn lock_delay(&self) -> Duration {
        self.shared.lock_delay
    }

    /// Its label, if it has one.
    pub fn owner(&self) -> Option<&str> {
        self.shared.owner.as_deref()
    }

    /// Whether it is alive: neither closed nor lost.
    pub fn is_alive(&self) -> bool {
        matches!(*self.shared.state.borrow(), LeaseState::Held)
    }

    /// Where it stands now: `Held` while alive, `Released` once closed, or `Lost`.
    pub fn state(&self) -> LeaseState {
        self.shared.state.borrow().clone()
    }

    /// A receiver that sees its state change (once: to closed or to lost).
    pub fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.shared.state.subscribe()
    }

    /// Resolves when the session is lost (at once if it was already); never if it is closed
    /// instead.
    pub async fn lost(&self) -> Loss {
        lost(&self.shared.state).await
    }

    /// An exclusive lease on `key` under the session, waiting up to `wait` while someone else
    /// holds it; as [`Client::acquire`], except that the lease is kept by the session.
    /// [`Error::SessionEnded`] when the session has ended (also while the acquire waited).
    pub async fn acquire(&self, key: &str, wait: Duration) -> Result<Lease, Error> {
        self.acquire_with(Claim::Exclusive(key.to_owned()), wait)
            .await
    }

    /// An exclusive lease on `key` under the session if it is free now, `None` if someone else
    /// holds it.
    pub async fn try_acquire(&self, key: &str) -> Result<Option<Lease>, Error> {
        self.try_acquire_with(Claim::Exclusive(key.to_owned()))
            .await
    }

    /// [`Session::try_acquire`] for any claim (a shared lease, a permit).
    pub async fn try_acquire_with(&self, claim: Claim) -> Result<Option<Lease>, Error> {
        match self.acquire_with(claim, Duration::ZERO).await {
            Ok(lease) => Ok(Some(lease)),
            Err(Error::Locked { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A lease for `claim` (exclusive, shared, or a semaphore's permit) under the session,
    /// asked again as [`Client::acquire_with`] does.
    pub async fn acquire_with(&self, claim: Claim, wait: Duration) -> Result<Lease, Error> {
        let params = self.params()?;
        let client = &self.shared.client;
        let (grant, _) = client.grant_retrying(&claim, params, wait).await?;
        Ok(self.hold(&claim, &grant))
    }

    /// An exclusive lease on every one of `keys` under the session, or on none, waiting up to
    /// `wait` until all are free at once; as [`Client::acquire_all`], except that the session
    /// keeps the keys (they are not renewed one by one). [`Error::SessionEnded`] when the
    /// session has ended.
    pub async fn acquire_all<S: AsRef<str>>(
        &self,
        keys: &[S],
        wait: Duration,
    ) -> Result<Lease, Error> {
        let params = self.params()?;
        let client = &self.shared.client;
        let (grant, _) = client.grant_all_retrying(keys, params, wait).await?;
        let session = self.shared.state.subscribe();
        Ok(Lease::under_session_all(client.clone(), &grant, session))
    }

    /// An acquire's parameters under this session; [`Error::SessionEnded`] once it has ended.
    fn params(&self) -> Result<AcquireParams, Error> {
        if !self.is_alive() {
            return Err(Error::SessionEnded { code: "no_session" });
        }
        Ok(AcquireParams {
            session: Some(self.shared.id.clone()),
            ..AcquireParams::default()
        })
    }

    /// Takes over a lease granted under this session by a call of the caller's own
    /// ([`Client::grant`] with [`AcquireParams::session`]), as [`Session::acquire_with`] does.
    pub fn hold(&self, claim: &Claim, grant: &Grant) -> Lease {
        let client = self.shared.client.clone();
        Lease::under_session(client, claim, grant, self.shared.state.subscribe())
    }

    /// Closes the session: stops the keep-alive (one in flight is let finish, so the `DELETE`
    /// comes after it), marks every lease under it released, and sends `DELETE /sessions/{id}`,
    /// which releases them at the broker. Never fails: if the broker cannot be told, the leases
    /// end with the session's ttl. [`Session::try_close`] says what happened.
    pub async fn close(&self) {
        let _ = self.try_close().await;
    }

    /// [`Session::close`], saying whether the broker confirmed: [`Released::Now`], or
    /// [`Released::Gone`] if the session had ended already, or [`Released::Before`] if an
    /// earlier close sent it; an error if the broker could not be told.
    pub async fn try_close(&self) -> Result<Released, Error> {
        if self.shared.close_sent.swap(true, Ordering::SeqCst) {
            return Ok(Released::Before);
        }
        mark_released(&self.shared.state);
        let keeper = self.keeper.lock().expect("never poisoned").take();
        self.shared.close_after(keeper).await
    }
}

impl Shared {
    async fn close_after(&self, keeper: Option<JoinHandle<()>>) -> Result<Released, Error> {
        if let Some(keeper) = keeper {
            let _ = keeper.await;
        }
        match self.client.close_session(&self.id).await {
            Ok(()) => Ok(Released::Now),
            Err(e) if e.is_gone() => Ok(Released::Gone(e)),
            Err(e) => Err(e),
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if self.shared.close_sent.swap(true, Ordering::SeqCst) {
            return;
        }
        mark_released(&self.shared.state);
        let keeper = self.keeper.get_mut().expect("never poisoned").take();
        let shared = self.shared.clone();
        end_in_background(keeper, |keeper| async move {
            let bound = shared.ttl.min(REQUEST_TIMEOUT);
            let _ = timeout(bound, shared.close_after(keeper)).await;
        });
    }
}
