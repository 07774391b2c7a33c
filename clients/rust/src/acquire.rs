//! Taking a lease: [`Client::acquire`], [`Client::try_acquire`] and their forms for any
//! [`Claim`]. The broker does the waiting; a `503` (or `429`, `502`, `504`) or a lost connection
//! is asked again with the same request id, so a retry can never make a second holder nor strand
//! a lease. Any other error answer is returned at once.

use std::time::Duration;

use tokio::time::{Instant, sleep};

use crate::client::Client;
use crate::error::Error;
use crate::lease::{Lease, LeaseOptions, MAX_RETRY, MIN_RETRY};
use crate::types::{AcquireParams, Claim, new_request_id};

impl Client {
    /// An exclusive lease on `key` for `ttl`, waiting up to `wait` while someone else holds it.
    /// [`Error::Locked`] when the wait ran out; an error with [`Error::is_transient`] when the
    /// broker stayed unreachable or unavailable; any other error answer (a `401`, a proxy's
    /// `500`) at once; [`Error::Invalid`] for an empty key, before anything is sent.
    pub async fn acquire(&self, key: &str, ttl: Duration, wait: Duration) -> Result<Lease, Error> {
        self.acquire_with(
            Claim::Exclusive(key.to_owned()),
            LeaseOptions::new(ttl).wait(wait),
        )
        .await
    }

    /// An exclusive lease on `key` if it is free now, `None` if someone else holds it.
    pub async fn try_acquire(&self, key: &str, ttl: Duration) -> Result<Option<Lease>, Error> {
        self.try_acquire_with(Claim::Exclusive(key.to_owned()), LeaseOptions::new(ttl))
            .await
    }

    /// [`Client::try_acquire`] for any claim (a shared lease, a permit); `options.wait` is not
    /// used.
    pub async fn try_acquire_with(
        &self,
        claim: Claim,
        options: LeaseOptions,
    ) -> Result<Option<Lease>, Error> {
        match self.acquire_with(claim, options.wait(Duration::ZERO)).await {
            Ok(lease) => Ok(Some(lease)),
            Err(Error::Locked { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A lease for `claim` (exclusive, shared, or a semaphore's permit). One request id for
    /// every attempt: a 503 (429, 502, 504) or a lost connection is asked again after the
    /// broker's `Retry-After` (or a short pause) until `options.wait` has run out, and at least
    /// once, so a grant whose answer was lost is returned rather than left behind.
    pub async fn acquire_with(&self, claim: Claim, options: LeaseOptions) -> Result<Lease, Error> {
        let first_sent = Instant::now();
        let deadline = first_sent + options.wait;
        let mut params = AcquireParams {
            ttl: Some(options.ttl),
            wait: None,
            owner: options.owner.clone(),
            request_id: Some(new_request_id()),
        };
        let mut retried = false;
        let mut pause = MIN_RETRY * 5;
        loop {
            params.wait = Some(deadline.saturating_duration_since(Instant::now()));
            match self.grant(&claim, &params).await {
                Ok(grant) => {
                    // The lease began after the first attempt was sent, whichever attempt's
                    // answer brought it: its end is judged from then.
                    return Ok(Lease::hold(
                        self.clone(),
                        &claim,
                        &grant,
                        first_sent,
                        options,
                    ));
                }
                Err(e) if e.is_transient() && (!retried || Instant::now() < deadline) => {
                    // Never past the caller's deadline, except for the one attempt that settles
                    // an outcome left unsure when no wait was left at all.
                    let left = deadline.saturating_duration_since(Instant::now());
                    let wanted = e.retry_after().unwrap_or(pause);
                    sleep(if left.is_zero() {
                        wanted.min(MAX_RETRY)
                    } else {
                        wanted.min(left)
                    })
                    .await;
                    pause = (pause * 2).min(MAX_RETRY);
                    retried = true;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
