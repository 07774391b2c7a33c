//! Taking a lease: [`Client::acquire`], [`Client::try_acquire`] and their forms for any
//! [`Claim`]. The broker does the waiting; a `503` (or `429`, `502`, `504`) or a lost connection
//! is asked again with the same request id, so a retry can never make a second holder nor strand
//! a lease. Any other error answer is returned at once.

use std::time::Duration;

use tokio::time::{Instant, sleep};

use crate::client::Client;
use crate::error::Error;
use crate::lease::{Lease, LeaseOptions, MAX_RETRY, MIN_RETRY};
use crate::types::{AcquireParams, Claim, Grant, new_request_id};

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
        let params = AcquireParams {
            ttl: Some(options.ttl),
            owner: options.owner.clone(),
            ..AcquireParams::default()
        };
        let (grant, first_sent) = self.grant_retrying(&claim, params, options.wait).await?;
        Ok(Lease::hold(
            self.clone(),
            &claim,
            &grant,
            first_sent,
            options,
        ))
    }

    /// [`Client::grant`] with a new request id, asked again as [`Client::acquire_with`] says
    /// within `wait`; the grant, and when the first attempt was sent (the lease began after
    /// that, whichever attempt's answer brought it: its end is judged from then).
    pub(crate) async fn grant_retrying(
        &self,
        claim: &Claim,
        params: AcquireParams,
        wait: Duration,
    ) -> Result<(Grant, Instant), Error> {
        retrying(params, wait, |params| async move {
            self.grant(claim, &params).await
        })
        .await
    }
}

/// `ask(params)` with a new request id in `params`, asked again by [`asking_again`] within
/// `wait` (each attempt's `params.wait` what is left of it); the answer, and when the first
/// attempt was sent.
pub(crate) async fn retrying<T, F, Fut>(
    params: AcquireParams,
    wait: Duration,
    ask: F,
) -> Result<(T, Instant), Error>
where
    F: Fn(AcquireParams) -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let first_sent = Instant::now();
    let params = AcquireParams {
        request_id: Some(new_request_id()),
        ..params
    };
    let answer = asking_again(first_sent + wait, |left| {
        ask(AcquireParams {
            wait: Some(left),
            ..params.clone()
        })
    })
    .await?;
    Ok((answer, first_sent))
}

/// Asks `ask(what is left of the wait)` again while it fails transiently (a 503, 429, 502, 504,
/// or no answer) and the `deadline` has not passed, after the broker's `Retry-After` (or a pause
/// that doubles up to [`MAX_RETRY`]), and at least twice, so that an outcome left unsure when no
/// wait was left at all is settled. The caller sends one request id in every attempt.
pub(crate) async fn asking_again<T, F, Fut>(deadline: Instant, mut ask: F) -> Result<T, Error>
where
    F: FnMut(Duration) -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let mut retried = false;
    let mut pause = MIN_RETRY * 5;
    loop {
        match ask(deadline.saturating_duration_since(Instant::now())).await {
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
            other => return other,
        }
    }
}
