//! Following a Sentinel failover: the broker listens to every sentinel's `+switch-master`
//! announcements, and when one names a new master for the URL's master name it stops using its
//! connection to the old one at once.
//!
//! Connection errors lead to the new master too: a master that was killed breaks the broker's
//! connection, a demoted one answers writes with `READONLY`, and either drops the connection
//! (`breaks_connection`); every new connection asks the sentinels for the master and confirms it
//! with `ROLE` (`connection.rs`). The announcement covers what errors do not: an old master
//! that is still up and still answers, such as one cut off from the sentinels but not from this
//! broker, or one whose demotion the broker would otherwise learn of only at its next write.
//!
//! A new master counts as a possible loss (a replica may have missed the last writes): the
//! connection to it is verified like every new connection, by the epoch check, which meets
//! another server process (`run_id`) and begins a new epoch, so this broker puts its live leases
//! back before it grants again (`epoch.rs`). The announcement also wakes the epoch watch, so that
//! happens at once rather than at the next request, and moves the notice subscriber.

use std::sync::Mutex;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::mpsc;

use super::RedisStore;
use super::connection::Connector;
use crate::domain::millis;
use crate::store::{Notice, StoreError, StoreResult};

/// The sentinels' channel for a finished failover. Its messages read
/// `<master name> <old ip> <old port> <new ip> <new port>`.
const SWITCH_MASTER: &str = "+switch-master";

/// How often each sentinel connection is checked with a PING, so that one that silently stopped
/// delivering is replaced (as the notice subscriber does).
const HEALTH_EVERY: Duration = Duration::from_secs(1);

/// The first pause before subscribing again to a sentinel that could not be reached; it doubles
/// up to [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// Listens to every sentinel for a new master of the URL's name, until `notices` closes (the
/// broker stops). Returns at once unless the store is reached through sentinels.
pub(super) async fn follow_failovers(store: RedisStore, notices: mpsc::Sender<Notice>) {
    let Connector::Sentinel {
        sentinels, master, ..
    } = &store.connection.connector
    else {
        return;
    };
    // Every sentinel announces the same switch as it learns of it, over a second or two: only
    // the first announcement of a new master moves the broker.
    let last = Mutex::new(None);
    futures_util::future::join_all(
        sentinels
            .iter()
            .map(|sentinel| listen(&store, sentinel, master, &notices, &last)),
    )
    .await;
}

/// One sentinel's announcements, resubscribing with backoff when its connection fails.
async fn listen(
    store: &RedisStore,
    sentinel: &redis::Client,
    master: &str,
    notices: &mpsc::Sender<Notice>,
    last: &Mutex<Option<String>>,
) {
    let addr = sentinel.get_connection_info().addr().to_string();
    let mut backoff = RETRY_MIN;
    loop {
        if notices.is_closed() {
            return;
        }
        match subscribe(sentinel, store.timeout).await {
            Ok((mut sink, mut stream)) => {
                tracing::debug!(sentinel = %addr, "listening for failovers");
                backoff = RETRY_MIN;
                let mut health = tokio::time::interval(HEALTH_EVERY);
                health.tick().await;
                loop {
                    tokio::select! {
                        message = stream.next() => {
                            let Some(message) = message else { break };
                            if let Some(to) = new_master(message.get_payload_bytes(), master) {
                                switched(store, last, to);
                            }
                        }
                        _ = health.tick() => {
                            if notices.is_closed() {
                                return;
                            }
                            let pong = tokio::time::timeout(
                                store.timeout,
                                sink.ping::<redis::Value>(),
                            )
                            .await;
                            if !matches!(pong, Ok(Ok(_))) {
                                break;
                            }
                        }
                    }
                }
                tracing::debug!(sentinel = %addr, "lost a sentinel's failover announcements");
            }
            Err(e) => tracing::debug!(sentinel = %addr, error = %e, "cannot reach a sentinel"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

async fn subscribe(
    sentinel: &redis::Client,
    timeout: Duration,
) -> StoreResult<(PubSubSink, PubSubStream)> {
    let connect = async {
        let mut pubsub = sentinel.get_async_pubsub().await?;
        pubsub.subscribe(SWITCH_MASTER).await?;
        Ok::<_, redis::RedisError>(pubsub.split())
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(split)) => Ok(split),
        Ok(Err(e)) => Err(StoreError::Failed(e.to_string())),
        Err(_) => Err(StoreError::Timeout(millis(timeout))),
    }
}

/// The new master's `ip:port` if `payload` announces a switch of `master`.
fn new_master(payload: &[u8], master: &str) -> Option<String> {
    let text = std::str::from_utf8(payload).ok()?;
    match text.split_whitespace().collect::<Vec<_>>().as_slice() {
        [name, _, _, ip, port] if *name == master => Some(format!("{ip}:{port}")),
        _ => None,
    }
}

/// A sentinel announced `to` as the master: unless that was already known, drop the connection
/// to the old one, move the notice subscriber, and check the epoch on the new one now.
fn switched(store: &RedisStore, last: &Mutex<Option<String>>, to: String) {
    {
        // Nothing awaits while it is held: a std mutex.
        let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
        if last.as_deref() == Some(to.as_str()) {
            return;
        }
        *last = Some(to.clone());
    }
    tracing::warn!(
        new_master = %to,
        "the sentinels switched to a new Redis master: reconnecting; leases are put back before \
         grants resume"
    );
    store.connection.master_switched();
    store.epoch.wake.notify_one();
}

#[cfg(test)]
mod tests {
    use super::new_master;

    #[test]
    fn a_switch_of_our_master_names_the_new_address() {
        assert_eq!(
            new_master(b"lockbroker 127.0.0.1 6379 127.0.0.1 6380", "lockbroker").as_deref(),
            Some("127.0.0.1:6380")
        );
    }

    #[test]
    fn a_switch_of_another_master_or_a_garbled_one_is_ignored() {
        assert_eq!(
            new_master(b"other 127.0.0.1 6379 127.0.0.1 6380", "lockbroker"),
            None
        );
        assert_eq!(new_master(b"lockbroker 127.0.0.1 6379", "lockbroker"), None);
        assert_eq!(new_master(&[0xff, 0xfe], "lockbroker"), None);
    }
}
