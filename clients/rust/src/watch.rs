//! Watching a key: [`Client::watch`] and [`Client::watch_semaphore`] ask the broker once who
//! holds a key, answered when that differs from the fence the caller last saw (or when the wait
//! runs out); a [`Follower`] watches again with each answer's fence, so it sees every change
//! without polling.

use std::time::Duration;

use reqwest::StatusCode;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tokio::time::{Instant, sleep};

use crate::client::{Client, REQUEST_TIMEOUT};
use crate::error::{Error, asked, error_chain, error_from_text, excerpt, retry_after_header};
use crate::lease::{MAX_RETRY, MIN_RETRY};
use crate::types::{LockStatus, Resource, SemaphoreStatus, millis};

/// How long a [`Follower`] lets one watch wait at the broker unless told otherwise.
pub const FOLLOW_WAIT: Duration = Duration::from_secs(30);

/// One watch's answer: who holds the key now, and whether that differs from the fence asked
/// about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watched<T> {
    /// The key's state, as its inspect shows it; `None` when the key is free.
    pub status: Option<T>,
    /// The fence to watch with next: the holder's (the highest, for shared holders or a
    /// semaphore's permits), `0` when the key is free.
    pub fence: u64,
    /// `false` when the wait ran out with the holders as they were.
    pub changed: bool,
}

/// What a watched status says its fence is: the one a watch compares.
pub trait WatchedFence {
    /// The fence the next watch asks about.
    fn watched_fence(&self) -> u64;
}

impl WatchedFence for LockStatus {
    fn watched_fence(&self) -> u64 {
        let holders = self.holders.iter().flatten().map(|h| h.fence);
        holders.fold(self.fence, u64::max)
    }
}

impl WatchedFence for SemaphoreStatus {
    fn watched_fence(&self) -> u64 {
        self.holders.iter().map(|h| h.fence).max().unwrap_or(0)
    }
}

/// The part of a watch's answer that is not the inspect body.
#[derive(Deserialize)]
struct Changed {
    changed: Option<bool>,
    error: Option<String>,
}

impl Client {
    /// `GET /locks/{key}?watch=seen&wait_ms=wait`: who holds `key`, answered at once if the
    /// holder's fence is not `seen` (`0`: free), else when it changes or `wait` runs out
    /// (`changed: false`). A renewal is not a change. A `503` (`429`, `502`, `504`) or no answer
    /// is asked again (reading changes nothing) until `wait` has run out; then the error is
    /// returned. Any other error answer is returned at once.
    pub async fn watch(
        &self,
        key: &str,
        seen: u64,
        wait: Duration,
    ) -> Result<Watched<LockStatus>, Error> {
        self.watch_resource(&Resource::lock(key), seen, wait).await
    }

    /// [`Client::watch`] for a semaphore's permits: `seen` is the highest permit fence seen.
    pub async fn watch_semaphore(
        &self,
        key: &str,
        seen: u64,
        wait: Duration,
    ) -> Result<Watched<SemaphoreStatus>, Error> {
        self.watch_resource(&Resource::semaphore(key), seen, wait)
            .await
    }

    /// A follower of the lock `key`, starting from "free": its first change is the key's
    /// holder now, if it has one.
    pub fn follow(&self, key: &str) -> Follower<LockStatus> {
        Follower::new(self.clone(), Resource::lock(key))
    }

    /// A follower of the semaphore `key`'s permits.
    pub fn follow_semaphore(&self, key: &str) -> Follower<SemaphoreStatus> {
        Follower::new(self.clone(), Resource::semaphore(key))
    }

    async fn watch_resource<T: DeserializeOwned + WatchedFence>(
        &self,
        resource: &Resource,
        seen: u64,
        wait: Duration,
    ) -> Result<Watched<T>, Error> {
        let deadline = Instant::now() + wait;
        let mut pause = MIN_RETRY * 5;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.watch_once(resource, seen, left).await {
                Err(e) if e.is_transient() && Instant::now() < deadline => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    sleep(e.retry_after().unwrap_or(pause).min(left)).await;
                    pause = (pause * 2).min(MAX_RETRY);
                }
                answer => return answer,
            }
        }
    }

    async fn watch_once<T: DeserializeOwned + WatchedFence>(
        &self,
        resource: &Resource,
        seen: u64,
        wait: Duration,
    ) -> Result<Watched<T>, Error> {
        let request = self
            .http
            .get(self.resource_url(resource)?)
            .query(&[
                ("watch", seen.to_string()),
                ("wait_ms", millis(wait).to_string()),
            ])
            .timeout(wait + REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        let status = response.status();
        let retry_after = retry_after_header(&response);
        let url = asked(response.url());
        let text = response.text().await.map_err(|e| Error::BadResponse {
            url: url.clone(),
            reason: error_chain(&e.without_url()),
        })?;
        let unreadable = |e: serde_json::Error| Error::BadResponse {
            url: url.clone(),
            reason: format!("{e} in a watch's answer: {}", excerpt(&text)),
        };
        if status == StatusCode::OK {
            let changed: Changed = serde_json::from_str(&text).map_err(unreadable)?;
            let view: T = serde_json::from_str(&text).map_err(unreadable)?;
            return Ok(Watched {
                fence: view.watched_fence(),
                status: Some(view),
                changed: changed.changed.unwrap_or(true),
            });
        }
        // Free: `404 not_held`, with `changed`.
        if status == StatusCode::NOT_FOUND
            && let Ok(Changed {
                changed,
                error: Some(code),
            }) = serde_json::from_str::<Changed>(&text)
            && code == "not_held"
        {
            return Ok(Watched {
                status: None,
                fence: 0,
                changed: changed.unwrap_or(true),
            });
        }
        Err(error_from_text(
            status,
            retry_after,
            &text,
            resource.space,
            url,
        ))
    }
}

/// Follows a key: each [`Follower::next`] watches with the fence of the last answer and returns
/// the next change, so every change is seen once, in order (changes made between two watches
/// show as one: the key as it is then). Stop by dropping it.
#[derive(Debug)]
pub struct Follower<T> {
    client: Client,
    resource: Resource,
    seen: u64,
    wait: Duration,
    _status: std::marker::PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned + WatchedFence> Follower<T> {
    fn new(client: Client, resource: Resource) -> Self {
        Self {
            client,
            resource,
            seen: 0,
            wait: FOLLOW_WAIT,
            _status: std::marker::PhantomData,
        }
    }

    /// Starts from `fence` (as seen by an earlier watch or status) instead of "free".
    pub fn from_fence(mut self, fence: u64) -> Self {
        self.seen = fence;
        self
    }

    /// How long one watch waits at the broker ([`FOLLOW_WAIT`] by default); at most the
    /// broker's `max_wait_ms`.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// How long one watch waits at the broker.
    pub fn wait_for(&self) -> Duration {
        self.wait
    }

    /// The fence of the last answer (`0`: free).
    pub fn fence(&self) -> u64 {
        self.seen
    }

    /// What is followed.
    pub fn resource(&self) -> &Resource {
        &self.resource
    }

    /// The next change: watches until the holders differ from the last answer's. An error
    /// (the broker unavailable for a whole wait, a refusal) leaves the follower where it was:
    /// calling again watches from the same fence.
    pub async fn next(&mut self) -> Result<Watched<T>, Error> {
        loop {
            let answer: Watched<T> = self
                .client
                .watch_resource(&self.resource, self.seen, self.wait)
                .await?;
            self.seen = answer.fence;
            if answer.changed {
                return Ok(answer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_watched_is_the_highest_holders() {
        let shared: LockStatus = serde_json::from_str(
            r#"{"key":"a","mode":"shared","fence":7,"expires_at_ms":1,"ttl_remaining_ms":1,
                "owner":null,"changed":true,"holders":[
                {"fence":5,"expires_at_ms":1,"ttl_remaining_ms":1,"owner":null},
                {"fence":9,"expires_at_ms":1,"ttl_remaining_ms":1,"owner":"b"}]}"#,
        )
        .unwrap();
        assert_eq!(shared.watched_fence(), 9);
        let permits: SemaphoreStatus = serde_json::from_str(
            r#"{"key":"s","limit":3,"fence":4,"changed":false,"holders":[
                {"fence":4,"expires_at_ms":1,"ttl_remaining_ms":1,"owner":null},
                {"fence":2,"expires_at_ms":1,"ttl_remaining_ms":1,"owner":null}]}"#,
        )
        .unwrap();
        assert_eq!(permits.watched_fence(), 4);
        let changed: Changed = serde_json::from_str(
            r#"{"error":"not_held","message":"free","fence":null,"changed":false}"#,
        )
        .unwrap();
        assert_eq!(
            (changed.changed, changed.error.as_deref()),
            (Some(false), Some("not_held"))
        );
    }
}
