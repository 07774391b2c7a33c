//! `lockbroker status KEY --watch`: prints who holds a lock (or a semaphore's permits) now and
//! then every change as it happens — a grant, a release, an expiry, a takeover, a force release
//! — one line each (one JSON object each with `--json`), until interrupted. It follows the
//! broker's watch with the client's [`Follower`]: one request parked at a time, answered when
//! the holders change, so nothing polls.
//!
//! A watch answers with the broker's reading made when the holders changed. When a lock is
//! handed to a waiter queued for it (an `elect` candidate, an `acquire --wait`), that reading is
//! the *offer*: a lease the store writes for the waiter that lasts the offer window (2 s by
//! default) until the waiter's broker takes it, from when it runs its own TTL. Taking it changes
//! no holder, so no watch answers it. Each line's expiry therefore comes from a status read made
//! after the watch's answer, which shows the lease taken.

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::StatusCode;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::commands::StatusArgs;
use super::{fail, print_json};
use lockbroker_client::{
    Client, Error, Follower, LockStatus, SemaphoreStatus, Space, Watched, WatchedFence,
};

/// How long one watch request waits (at most; a broker whose `max_wait_ms` is lower refuses
/// it, and the next one asks for half).
const WATCH_WAIT: Duration = Duration::from_secs(30);

/// How soon to ask again after the broker could not be reached or answered 503 (502, 504, 429)
/// for a whole watch.
const RETRY: Duration = Duration::from_secs(1);

/// `lockbroker status --watch`.
pub(crate) async fn follow(args: &StatusArgs) -> ExitCode {
    // A reader that stops reading (`| head -1`) took what it wanted.
    super::closed_stdout_ends_with(0);
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    match args.target.resource().space {
        Space::Locks => follow_key::<LockStatus>(&client, args).await,
        Space::Semaphores => follow_key::<SemaphoreStatus>(&client, args).await,
    }
}

/// What `status --watch` follows: a lock's holders or a semaphore's permits.
trait Followed: DeserializeOwned + WatchedFence + Serialize + Sized {
    /// Who holds `key` now (`None`: nobody), answered at once.
    async fn now(client: &Client, key: &str) -> Result<Option<Self>, Error>;

    /// A follower of `key`.
    fn follower(client: &Client, key: &str) -> Follower<Self>;

    /// The line that shows it held (after the time).
    fn line(&self) -> String;

    /// The holders' fences: two statuses with the same ones show the same leases.
    fn fences(&self) -> Vec<u64>;
}

impl Followed for LockStatus {
    async fn now(client: &Client, key: &str) -> Result<Option<Self>, Error> {
        free_is_none(client.status(key).await)
    }

    fn follower(client: &Client, key: &str) -> Follower<Self> {
        client.follow(key)
    }

    fn line(&self) -> String {
        format!(
            "{}: fence {}, owner {}, {}",
            self.key,
            self.watched_fence(),
            self.owner.as_deref().unwrap_or("-"),
            self.mode
        )
    }

    fn fences(&self) -> Vec<u64> {
        match &self.holders {
            Some(holders) => holders.iter().map(|h| h.fence).collect(),
            None => vec![self.fence],
        }
    }
}

impl Followed for SemaphoreStatus {
    async fn now(client: &Client, key: &str) -> Result<Option<Self>, Error> {
        free_is_none(client.semaphore_status(key).await)
    }

    fn follower(client: &Client, key: &str) -> Follower<Self> {
        client.follow_semaphore(key)
    }

    fn line(&self) -> String {
        format!(
            "{}: {} of {} permits, highest fence {}",
            self.key,
            self.holders.len(),
            self.limit,
            self.watched_fence()
        )
    }

    fn fences(&self) -> Vec<u64> {
        self.holders.iter().map(|h| h.fence).collect()
    }
}

/// A status that says "nobody holds it" as `None`.
fn free_is_none<T>(answer: Result<T, Error>) -> Result<Option<T>, Error> {
    match answer {
        Ok(status) => Ok(Some(status)),
        Err(Error::NotHeld { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Prints the key's state now, then follows it from that state's fence, until interrupted or
/// refused. The broker unreachable (or answering 503, 502, 504, 429) is said once and tried
/// again each [`RETRY`]; a wait over the broker's `max_wait_ms` is halved.
async fn follow_key<T: Followed>(client: &Client, args: &StatusArgs) -> ExitCode {
    let resource = args.target.resource();
    let mut troubled = false;
    let now = loop {
        match T::now(client, &resource.key).await {
            Ok(now) => break now,
            Err(e) if e.is_transient() => trouble(&e, &mut troubled).await,
            Err(e) => return fail(&format!("cannot watch {resource}"), &e, args.json),
        }
    };
    troubled = false;
    let fence = now.as_ref().map_or(0, T::watched_fence);
    print_change(&resource.key, now.as_ref(), fence, args.json);
    let mut follower = T::follower(client, &resource.key)
        .from_fence(fence)
        .wait(WATCH_WAIT);
    loop {
        match follower.next().await {
            Ok(Watched { status, fence, .. }) => {
                troubled = false;
                let status = match status {
                    Some(seen) => Some(taken(client, &resource.key, seen).await),
                    None => None,
                };
                print_change(&resource.key, status.as_ref(), fence, args.json);
            }
            Err(e) if e.is_transient() => trouble(&e, &mut troubled).await,
            Err(Error::Api {
                status, message, ..
            }) if status == StatusCode::BAD_REQUEST
                && message.contains("wait_ms")
                && follower.wait_for() > Duration::from_secs(1) =>
            {
                let half = follower.wait_for() / 2;
                follower = follower.wait(half);
            }
            Err(e) => return fail(&format!("cannot watch {resource}"), &e, args.json),
        }
    }
}

/// The holders a watch answered with, as a status read made now shows them: the same leases,
/// with their expiry as it is now — for a lock handed to a queued waiter, the lease it took
/// rather than the offer the watch saw (see the module's note). The watch's own view when the
/// read fails or shows other holders (a change the follower sees next).
async fn taken<T: Followed>(client: &Client, key: &str, seen: T) -> T {
    match T::now(client, key).await {
        Ok(Some(now)) if now.fences() == seen.fences() => now,
        _ => seen,
    }
}

/// Says once (until an answer comes) that the broker is unreachable or failing, and waits
/// [`RETRY`] before the next try.
async fn trouble(e: &Error, troubled: &mut bool) {
    if !*troubled {
        eprintln!("lockbroker: {e}; trying again");
        *troubled = true;
    }
    tokio::time::sleep(RETRY).await;
}

/// One line: the time it was seen, and who holds the key (or that it is free). As JSON, the
/// status with `held`, `seen_at_ms` and the watched `fence` (`null` when free).
fn print_change<T: Followed>(key: &str, status: Option<&T>, fence: u64, json: bool) {
    let seen_at_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    if json {
        let mut line = match status {
            Some(status) => serde_json::to_value(status).unwrap_or(Value::Null),
            None => json!({ "key": key, "fence": null, "owner": null }),
        };
        if let Some(object) = line.as_object_mut() {
            if status.is_some() {
                object.insert("fence".into(), fence.into());
            }
            object.insert("held".into(), status.is_some().into());
            object.insert("seen_at_ms".into(), seen_at_ms.into());
        }
        print_json(&line);
        return;
    }
    let when = humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(seen_at_ms));
    match status {
        Some(status) => out!("{when}  {}", status.line()),
        None => out!("{when}  {key} is free"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_says_who_holds_the_key_and_its_fence() {
        let shared: LockStatus = serde_json::from_str(
            r#"{"key":"a","mode":"shared","fence":7,"expires_at_ms":1,"ttl_remaining_ms":1,
                "owner":null,"holders":[
                {"fence":5,"expires_at_ms":1,"ttl_remaining_ms":1,"owner":null},
                {"fence":9,"expires_at_ms":1,"ttl_remaining_ms":1,"owner":"b"}]}"#,
        )
        .unwrap();
        assert_eq!(shared.line(), "a: fence 9, owner -, shared");
        let permits: SemaphoreStatus = serde_json::from_str(
            r#"{"key":"s","limit":3,"holders":[
                {"fence":4,"expires_at_ms":1,"ttl_remaining_ms":1,"owner":null},
                {"fence":2,"expires_at_ms":1,"ttl_remaining_ms":1,"owner":null}]}"#,
        )
        .unwrap();
        assert_eq!(permits.line(), "s: 2 of 3 permits, highest fence 4");
    }
}
