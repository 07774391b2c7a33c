//! Redis Sentinel: following the master's failovers (finding it is `sentinel.rs`).
//!
//! **Following failovers.** A master that was killed breaks the broker's connection, a demoted
//! one answers writes with `READONLY`, and either drops the connection (`breaks_connection`), so
//! the next one asks the sentinels again. What errors do not cover, an old master that is still
//! up and still answers, the broker learns from the sentinels: it listens to every sentinel's
//! `+switch-master` announcements, and once a second it asks them which master they name; when
//! that is not the one it is connected to, it stops using its connection at once.
//!
//! A new master counts as a possible loss (a replica may have missed the last writes): the
//! connection to it is verified like every new connection, by the epoch check, which meets
//! another server process (`run_id`) and begins a new epoch, so this broker puts its live leases
//! back before it grants again (`epoch.rs`). The announcement also wakes the epoch watch, so that
//! happens at once rather than at the next request, and moves the notice subscriber.

use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::mpsc;

use super::RedisStore;
use super::connection::Connector;
use super::sentinel::{Addr, Sentinels};
use lockbroker_core::domain::millis;
use lockbroker_core::store::{Notice, StoreError, StoreResult};

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

/// How often the broker asks the sentinels which master they name, in case it missed an
/// announcement (a sentinel connection that was down, a failover while it was connecting).
const RECONCILE_EVERY: Duration = Duration::from_secs(1);

/// Follows the master's failovers until `notices` closes (the broker stops): listens to every
/// sentinel's announcements, and asks them once a second. Returns at once unless the store is
/// reached through sentinels.
pub(super) async fn follow_failovers(store: RedisStore, notices: mpsc::Sender<Notice>) {
    let Connector::Sentinel(sentinels) = &store.keeper.connection.connector else {
        return;
    };
    let listening = futures_util::future::join_all(
        sentinels
            .sentinels
            .iter()
            .map(|sentinel| listen(&store, sentinels, &sentinel.client, &notices)),
    );
    tokio::join!(listening, reconcile(&store, sentinels, &notices));
}

/// Once a second, while a connection is up: if a majority of the sentinels name another master
/// than the one it reached, the master moved without this broker hearing of it.
async fn reconcile(store: &RedisStore, sentinels: &Sentinels, notices: &mpsc::Sender<Notice>) {
    let mut every = tokio::time::interval(RECONCILE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        if notices.is_closed() {
            return;
        }
        if store.keeper.connection.current().is_none() {
            // No connection: the next one asks the sentinels anyway.
            continue;
        }
        if let Ok(named) = sentinels.master().await {
            switched(store, sentinels, named);
        }
    }
}

/// One sentinel's announcements, resubscribing with backoff when its connection fails.
async fn listen(
    store: &RedisStore,
    sentinels: &Sentinels,
    sentinel: &redis::Client,
    notices: &mpsc::Sender<Notice>,
) {
    let addr = sentinel.get_connection_info().addr().to_string();
    let mut backoff = RETRY_MIN;
    loop {
        if notices.is_closed() {
            return;
        }
        match subscribe(sentinel, store.keeper.connection.timeout()).await {
            Ok((mut sink, mut stream)) => {
                tracing::debug!(sentinel = %addr, "listening for failovers");
                backoff = RETRY_MIN;
                let mut health = tokio::time::interval(HEALTH_EVERY);
                health.tick().await;
                loop {
                    tokio::select! {
                        message = stream.next() => {
                            let Some(message) = message else { break };
                            let payload = message.get_payload_bytes();
                            if let Some(to) = new_master(payload, &sentinels.master) {
                                switched(store, sentinels, to);
                            }
                        }
                        _ = health.tick() => {
                            if notices.is_closed() {
                                return;
                            }
                            let pong = tokio::time::timeout(
                                store.keeper.connection.timeout(),
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

/// The new master's address if `payload` announces a switch of `master`.
fn new_master(payload: &[u8], master: &str) -> Option<Addr> {
    let text = std::str::from_utf8(payload).ok()?;
    match text.split_whitespace().collect::<Vec<_>>().as_slice() {
        [name, _, _, ip, port] if *name == master => Some(((*ip).to_owned(), port.parse().ok()?)),
        _ => None,
    }
}

/// The sentinels name `to` as the master. Unless the connection up now reached it, drop that
/// connection (and any being made), move the notice subscriber, and check the epoch on the new
/// master now rather than at the next request.
fn switched(store: &RedisStore, sentinels: &Sentinels, to: Addr) {
    {
        let mut moving_to = sentinels
            .moving_to
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let up = store.keeper.connection.current().is_some();
        // Already there; or already on the way, on a connection begun after the move was
        // ordered (each sentinel announces the same switch, within milliseconds or seconds).
        if (up && sentinels.connected().as_ref() == Some(&to))
            || (!up && moving_to.as_ref() == Some(&to))
        {
            return;
        }
        *moving_to = Some(to.clone());
    }
    tracing::warn!(
        new_master = %format_args!("{}:{}", to.0, to.1),
        "the sentinels name a new Redis master: reconnecting; leases are put back before grants \
         resume"
    );
    store.keeper.connection.master_switched();
    store.keeper.epoch.wake.notify_one();
}

#[cfg(test)]
mod tests {
    use super::new_master;

    #[test]
    fn a_switch_of_our_master_names_the_new_address() {
        assert_eq!(
            new_master(b"lockbroker 127.0.0.1 6379 127.0.0.1 6380", "lockbroker"),
            Some(("127.0.0.1".to_owned(), 6380))
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
