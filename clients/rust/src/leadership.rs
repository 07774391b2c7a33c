//! [`Leadership`]: an election on one lock. It campaigns in the background (an exclusive
//! acquire with a long wait, in a loop, kept by the renewing [`Lease`]), says whether this node
//! leads and calls back when that starts and stops, and follows the key to tell who leads. A
//! broker out of reach or unavailable is asked again; a refusal that asking again cannot change
//! (a wrong bearer token, an invalid key) ends the campaign ([`Leadership::failed`]).

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

use crate::client::Client;
use crate::error::Error;
use crate::lease::{Lease, LeaseOptions, Loss, MAX_RETRY, MIN_RETRY};
use crate::types::{AcquireParams, Claim, new_request_id};

/// How long one campaign request waits at the broker before it is sent again (the broker's
/// `max_wait_ms` bounds it; a refusal halves it).
const CAMPAIGN_WAIT: Duration = Duration::from_secs(30);

/// Why this node stopped leading, for [`LeadershipBuilder::on_revoked`].
#[derive(Debug, Clone)]
pub enum Revoked {
    /// The lease was lost (a renewal refused, or none confirmed in time); the campaign goes on.
    Lost(Loss),
    /// [`Leadership::close`] (or a drop): the lease is released so a successor leads at once.
    Closed,
}

type Elected = Arc<dyn Fn(u64) + Send + Sync>;
type OnRevoked = Arc<dyn Fn(&Revoked) + Send + Sync>;

/// How to campaign: the key, this node's name, the lease's ttl, and the callbacks.
pub struct LeadershipBuilder {
    client: Client,
    key: String,
    owner: String,
    ttl: Duration,
    on_elected: Option<Elected>,
    on_revoked: Option<OnRevoked>,
}

impl fmt::Debug for LeadershipBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeadershipBuilder")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl LeadershipBuilder {
    /// Called with the lease's fence when this node becomes leader (on the campaign's task:
    /// keep it quick, hand work to another task).
    pub fn on_elected(mut self, f: impl Fn(u64) + Send + Sync + 'static) -> Self {
        self.on_elected = Some(Arc::new(f));
        self
    }

    /// Called once each time this node stops leading — before it campaigns again, so a node
    /// never sees itself elected twice without a revocation between.
    pub fn on_revoked(mut self, f: impl Fn(&Revoked) + Send + Sync + 'static) -> Self {
        self.on_revoked = Some(Arc::new(f));
        self
    }

    /// Starts campaigning and following the key (on the current tokio runtime).
    pub fn start(self) -> Leadership {
        let (closing, _) = watch::channel(false);
        let (leading, _) = watch::channel(false);
        let (leader, _) = watch::channel(None);
        let (failure, _) = watch::channel(None);
        let inner = Arc::new(Inner {
            leading,
            leader,
            closing,
            failure,
            last_error: Mutex::new(None),
        });
        let follower = tokio::spawn(follow(self.client.clone(), self.key.clone(), inner.clone()));
        let campaign = tokio::spawn(campaign(self, inner.clone()));
        Leadership {
            inner,
            campaign: Some(campaign),
            follower,
        }
    }
}

struct Inner {
    /// Whether this node leads.
    leading: watch::Sender<bool>,
    /// The leader's owner label as the last watch told it (`None`: nobody, or no label).
    leader: watch::Sender<Option<String>>,
    /// Set once by close (or drop).
    closing: watch::Sender<bool>,
    /// Set once when the campaign ends on a refusal that asking again cannot change.
    failure: watch::Sender<Option<Error>>,
    /// The campaign's or the follower's last failure, cleared by a success.
    last_error: Mutex<Option<Error>>,
}

impl Inner {
    fn record(&self, error: Option<Error>) {
        *self.last_error.lock().expect("never poisoned") = error;
    }
}

/// An election helper: campaigns for the lock `key` as `owner` until closed. At most one
/// [`Leadership`] on a key leads at a time (the broker's lease decides; the fence of
/// [`LeadershipBuilder::on_elected`] tells terms apart). Dropping it closes it in the
/// background; [`Leadership::close`] waits for the release.
pub struct Leadership {
    inner: Arc<Inner>,
    campaign: Option<JoinHandle<Result<(), Error>>>,
    follower: JoinHandle<()>,
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("is_leader", &self.is_leader())
            .field("leader", &self.leader())
            .finish_non_exhaustive()
    }
}

impl Leadership {
    /// An election on `key` in which this node is `owner` (the label others see as leader),
    /// with leases of `ttl`: set the callbacks, then [`LeadershipBuilder::start`].
    pub fn builder(
        client: &Client,
        key: impl Into<String>,
        owner: impl Into<String>,
        ttl: Duration,
    ) -> LeadershipBuilder {
        LeadershipBuilder {
            client: client.clone(),
            key: key.into(),
            owner: owner.into(),
            ttl,
            on_elected: None,
            on_revoked: None,
        }
    }

    /// Whether this node leads now (its lease is held, as far as its renewals tell).
    pub fn is_leader(&self) -> bool {
        *self.inner.leading.borrow()
    }

    /// A receiver that sees [`Leadership::is_leader`] change.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.inner.leading.subscribe()
    }

    /// The current leader's owner label, from watching the key; `None` while nobody leads.
    pub fn leader(&self) -> Option<String> {
        self.inner.leader.borrow().clone()
    }

    /// A receiver that sees [`Leadership::leader`] change.
    pub fn subscribe_leader(&self) -> watch::Receiver<Option<String>> {
        self.inner.leader.subscribe()
    }

    /// The last error the campaign or the watch met, if the latest attempt failed: a broker
    /// that stays out of reach or unavailable (both keep trying), or the refusal that ended
    /// them.
    pub fn last_error(&self) -> Option<Error> {
        self.inner
            .last_error
            .lock()
            .expect("never poisoned")
            .clone()
    }

    /// Why the campaign ended by itself, if it did: the broker refused it in a way asking again
    /// cannot change (`401`/`403` for a wrong or revoked bearer token, `400` for an invalid key,
    /// a `500` from something that is not a broker). This node then never leads again.
    pub fn failure(&self) -> Option<Error> {
        self.inner.failure.borrow().clone()
    }

    /// Resolves with the refusal that ended the campaign (at once if it has); never while the
    /// campaign goes on. Made for `tokio::select!` beside the node's work.
    pub async fn failed(&self) -> Error {
        let mut failure = self.inner.failure.subscribe();
        match failure.wait_for(Option::is_some).await {
            Ok(failure) => failure.clone().expect("waited for Some"),
            // The sender lives in `self.inner`, which outlives this borrow.
            Err(_) => std::future::pending().await,
        }
    }

    /// Stops campaigning; if this node leads, calls `on_revoked(Closed)` and releases the
    /// lease, so a successor leads at once. Returns the release's error, if the broker could
    /// not be told (the lease then ends by its ttl), or the [`Leadership::failure`] that ended
    /// the campaign.
    pub async fn close(mut self) -> Result<(), Error> {
        self.inner.closing.send_replace(true);
        self.follower.abort();
        match self.campaign.take() {
            Some(campaign) => campaign.await.unwrap_or(Ok(())),
            None => Ok(()),
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        // The campaign task releases in the background.
        self.inner.closing.send_replace(true);
        self.follower.abort();
    }
}

/// The campaign: acquire (waiting), lead until the lease is lost or the election is closed,
/// and again.
async fn campaign(builder: LeadershipBuilder, inner: Arc<Inner>) -> Result<(), Error> {
    let claim = Claim::Exclusive(builder.key.clone());
    let mut closing = inner.closing.subscribe();
    let mut wait = CAMPAIGN_WAIT;
    loop {
        if *closing.borrow() {
            return Ok(());
        }
        let (lease, grant_fence) = match request(&builder, &claim, &mut wait, &inner).await {
            Asked::Granted(lease) => {
                let fence = lease.fence();
                (lease, fence)
            }
            Asked::Again => continue,
            Asked::Closed => return Ok(()),
            Asked::Refused(e) => {
                inner.record(Some(e.clone()));
                inner.failure.send_replace(Some(e.clone()));
                return Err(e);
            }
        };
        inner.leading.send_replace(true);
        if let Some(elected) = &builder.on_elected {
            elected(grant_fence);
        }
        let revoked = tokio::select! {
            loss = lease.lost() => Revoked::Lost(loss),
            () = closed(&mut closing) => Revoked::Closed,
        };
        inner.leading.send_replace(false);
        if let Some(on_revoked) = &builder.on_revoked {
            on_revoked(&revoked);
        }
        let released = lease.release().await;
        if matches!(revoked, Revoked::Closed) {
            return released.map(|_| ());
        }
    }
}

/// How one campaign request ended.
enum Asked {
    Granted(Lease),
    /// Ask again: the wait ran out, or the broker asked for a shorter one.
    Again,
    /// The election was closed.
    Closed,
    /// A refusal that asking again cannot change: the campaign ends.
    Refused(Error),
}

/// One campaign request, with its retries while the broker is out of reach or unavailable. A
/// grant whose request was cut short by closing is asked for again with the same request id
/// and no wait, and released, so that closing never strands a lease.
async fn request(
    builder: &LeadershipBuilder,
    claim: &Claim,
    wait: &mut Duration,
    inner: &Inner,
) -> Asked {
    let mut closing = inner.closing.subscribe();
    let mut params = AcquireParams {
        ttl: Some(builder.ttl),
        wait: Some(*wait),
        owner: Some(builder.owner.clone()),
        request_id: Some(new_request_id()),
        session: None,
    };
    let first_sent = Instant::now();
    let mut pause = MIN_RETRY * 5;
    loop {
        let granted = tokio::select! {
            biased;
            () = closed(&mut closing) => {
                params.wait = Some(Duration::ZERO);
                if let Ok(grant) = builder.client.grant(claim, &params).await {
                    let _ = builder.client.release(&claim.resource(), &grant.token).await;
                }
                return Asked::Closed;
            }
            granted = builder.client.grant(claim, &params) => granted,
        };
        match granted {
            Ok(grant) => {
                inner.record(None);
                let options = LeaseOptions::new(builder.ttl).owner(builder.owner.clone());
                let lease = Lease::hold(builder.client.clone(), claim, &grant, first_sent, options);
                return Asked::Granted(lease);
            }
            Err(Error::Locked { .. }) => {
                inner.record(None);
                return Asked::Again;
            }
            Err(e) if too_long_a_wait(&e, *wait) => {
                // Perhaps a broker whose max_wait_ms is lower: ask with less.
                *wait /= 2;
                inner.record(Some(e));
                return Asked::Again;
            }
            Err(e) if !e.is_transient() => return Asked::Refused(e),
            Err(e) => {
                inner.record(Some(e.clone()));
                let paused = e.retry_after().unwrap_or(pause).min(MAX_RETRY * 5);
                tokio::select! {
                    () = sleep(paused) => {}
                    () = closed(&mut closing) => {}
                }
                pause = (pause * 2).min(MAX_RETRY);
                // The same request id: a grant whose answer was lost is returned, not doubled.
            }
        }
    }
}

/// Whether `e` refused a request that waited longer than a second as too long (a broker whose
/// `max_wait_ms` is lower than asked): asking with half the wait may do.
fn too_long_a_wait(e: &Error, wait: Duration) -> bool {
    e.code() == "invalid_request"
        && !matches!(e, Error::Invalid(_))
        && wait > Duration::from_secs(1)
}

/// Follows the key and keeps [`Leadership::leader`] current, until aborted, or until the broker
/// refuses the watch in a way asking again cannot change (recorded in `last_error`).
async fn follow(client: Client, key: String, inner: Arc<Inner>) {
    let mut follower = client.follow(&key);
    loop {
        match follower.next().await {
            Ok(change) => {
                inner
                    .leader
                    .send_replace(change.status.and_then(|s| s.owner));
            }
            Err(e) if too_long_a_wait(&e, follower.wait_for()) => {
                let wait = follower.wait_for();
                follower = client
                    .follow(&key)
                    .from_fence(follower.fence())
                    .wait(wait / 2);
            }
            Err(e) if !e.is_transient() => return inner.record(Some(e)),
            Err(e) => {
                inner.record(Some(e));
                sleep(MAX_RETRY).await;
            }
        }
    }
}

/// Resolves once the election is closed.
async fn closed(closing: &mut watch::Receiver<bool>) {
    // An error means the sender is gone: the election with it.
    let _ = closing.wait_for(|c| *c).await;
}
