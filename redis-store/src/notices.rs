//! Notices and the epoch watch: the broker's background work on Redis.
//!
//! One subscriber connection per broker reads two channels. Its own, `<prefix>b:<id>`, where the
//! scripts tell it (and no other broker) what concerns it, space-separated with the key last:
//! `o <space> <token> <key>` the key was offered to its queued bid with that token
//! ([`Notice::Offered`]); `l <space> <ms> <key>` look again in that many ms ([`Notice::Look`]);
//! `r <space> <key>` its bids on the key left the queue ([`Notice::Requeue`]); `d <space> <fence>
//! <key>` a lease it remembers ended, and `D ...` every lease on the key up to that fence did
//! (dropped from its ledger). The space is `L` (locks) or `S` (semaphores). And the shared
//! `<prefix>released`, which every broker reads: a broker that starts a new epoch publishes
//! `!epoch` there (never a key: keys have no `!`), so the others catch up at once instead of at
//! their next check; and the end of a lease written by an older broker is published there as
//! older brokers read it, `[#]key[ fence[ *]]` (dropped from the ledger, and the key's waiters
//! look again: an older broker's release does not hand the key on).

use std::time::Duration;

use futures_util::StreamExt;
use redis::RedisError;
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio::time::Instant;

use super::RedisStore;
use super::connection::Connector;
use super::epoch::{CHECK_EVERY, SLOT_NOTICE};
use super::keys::{LOCK_SPACE, SEMAPHORE_NOTICE, SEMAPHORE_SPACE};
use lockbroker_core::domain::{Fence, LockKey, Space, Token, millis};
use lockbroker_core::store::{Notice, StoreError, StoreResult};

/// The payload of an epoch announcement.
pub(super) const EPOCH_NOTICE: &str = "!epoch";

/// How often the notice connection is checked with a PING: a connection that silently stopped
/// delivering (a half-open TCP connection) is replaced within this, plus the store timeout.
const NOTICE_HEALTH_EVERY: Duration = Duration::from_secs(1);

/// Checks the epoch at once, then every [`CHECK_EVERY`] and whenever woken, until `notices`
/// closes; drops ended leases from the ledger as it goes. The first check makes the broker's
/// connection, so a broker knows the store's epoch before its first request.
///
/// While Redis cannot be reached, it tries again after 100 ms, doubling up to the check
/// interval: a broker that knew the store must reach it again, and put its leases back, well
/// within the settle time of the broker that first meets the restarted store.
pub(super) async fn watch_epoch(store: RedisStore, notices: mpsc::Sender<Notice>) {
    let mut retry = RETRY_MIN;
    loop {
        if notices.is_closed() {
            return;
        }
        let checked = store.keeper.catch_up().await;
        // A broker with no requests still tells an outage in its logs (see `lockbroker_core::metrics::Outage`).
        store.metrics.outage().observe(&checked);
        let pause = match checked {
            Ok(_) => {
                retry = RETRY_MIN;
                CHECK_EVERY
            }
            Err(e) => {
                tracing::debug!(error = %e, "epoch check failed; retrying");
                retry = (retry * 2).min(CHECK_EVERY);
                retry / 2
            }
        };
        store.keeper.ledger.sweep(Instant::now());
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = store.keeper.epoch.wake.notified() => {}
        }
    }
}

/// The first pause of the epoch watch after a failed check.
const RETRY_MIN: Duration = Duration::from_millis(100);

/// The broker's one subscriber connection: hands every notice to `notices`, reconnecting with
/// backoff until `notices` closes. After each (re)connect every waiter is told to look
/// ([`Notice::Missed`]), since notices published while disconnected are lost, and the epoch
/// is checked (Redis may be back after a restart).
pub(super) async fn listen(store: RedisStore, notices: mpsc::Sender<Notice>) {
    let (channel, timeout) = (&store.channel, store.keeper.connection.timeout());
    let own = store.broker.channel.as_str();
    let changes = store.broker.changes.as_str();
    let mut backoff = Duration::from_millis(100);
    let mut attempt = 0;
    // A master switch the sentinels announced (`failovers.rs`) moves the subscriber at once.
    let mut switches = store.keeper.connection.switches();
    loop {
        attempt += 1;
        switches.borrow_and_update();
        match subscribe(
            &store.keeper.connection.connector,
            attempt,
            &[channel, own, changes],
            timeout,
        )
        .await
        {
            Ok((mut sink, mut stream)) => {
                tracing::debug!(%channel, "listening for release notices");
                backoff = Duration::from_millis(100);
                store.keeper.epoch.wake.notify_one();
                if !deliver(&notices, Notice::Missed) {
                    return;
                }
                let mut health = tokio::time::interval(NOTICE_HEALTH_EVERY);
                health.tick().await;
                loop {
                    tokio::select! {
                        message = stream.next() => {
                            let Some(message) = message else { break };
                            let payload = message.get_payload_bytes();
                            let from = message.get_channel_name();
                            if from == changes {
                                // Only a change notice counts here: the channel is everyone's.
                                if let Some(Told::Notice(notice @ Notice::Changed(..))) = parse_own(payload)
                                    && !deliver(&notices, notice)
                                {
                                    return;
                                }
                            } else if from == own {
                                let Some(told) = parse_own(payload) else { continue };
                                let notice = match told {
                                    Told::Notice(notice) => notice,
                                    Told::Ended { space, key, fence, all } => {
                                        store.keeper.ledger.forget_ended(space, key.as_str(), fence, all);
                                        continue;
                                    }
                                };
                                if !deliver(&notices, notice) {
                                    return;
                                }
                            } else if payload == EPOCH_NOTICE.as_bytes() {
                                store.keeper.epoch.wake.notify_one();
                            } else if let Some(slot) = payload
                                .strip_prefix(SLOT_NOTICE.as_bytes())
                                .and_then(|s| std::str::from_utf8(s).ok()?.parse::<u16>().ok())
                            {
                                let store = store.clone();
                                tokio::spawn(async move {
                                    if let Err(e) = store.keeper.put_back_slot(slot).await {
                                        tracing::warn!(slot, error = %e, "cannot put leases back on a repaired slot");
                                    }
                                });
                            } else if let Some(notice) = parse_notice(payload) {
                                if let Some(fence) = notice.fence {
                                    store.keeper.ledger.forget_ended(notice.space, notice.key.as_str(), fence, notice.all);
                                }
                                if !deliver(&notices, Notice::Look(notice.space, notice.key, 0)) {
                                    return;
                                }
                            }
                        }
                        _ = health.tick() => {
                            if notices.is_closed() {
                                return;
                            }
                            let pong = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
                            if !matches!(pong, Ok(Ok(_))) {
                                break;
                            }
                        }
                        _ = switches.changed() => break,
                    }
                }
                // INFO, not WARN: it comes with a store outage, which is logged on its own.
                tracing::info!(
                    "release notices disconnected; waiters fall back to polling until they return"
                );
            }
            Err(e) => tracing::debug!(error = %e, "cannot subscribe to release notices yet"),
        }
        if notices.is_closed() {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = switches.changed() => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// A release notice as published: `[#]key[ fence[ *]]`.
#[derive(Debug, PartialEq, Eq)]
struct Published {
    space: Space,
    key: LockKey,
    /// The released lease's fence (a renew that shortened a lease publishes the key alone).
    fence: Option<Fence>,
    /// Every lease on the key up to that fence ended (a force release).
    all: bool,
}

fn parse_notice(payload: &[u8]) -> Option<Published> {
    let text = std::str::from_utf8(payload).ok()?;
    let (space, text) = match text.strip_prefix(SEMAPHORE_NOTICE) {
        Some(rest) => (Space::Semaphores, rest),
        None => (Space::Locks, text),
    };
    let mut parts = text.split(' ');
    let key = LockKey::parse(parts.next()?).ok()?;
    let fence = match parts.next() {
        Some(fence) => Some(fence.parse().ok()?),
        None => None,
    };
    let all = match parts.next() {
        None => false,
        Some("*") => true,
        Some(_) => return None,
    };
    Some(Published {
        space,
        key,
        fence,
        all,
    })
}

/// What a broker's own channel told it.
#[derive(Debug, PartialEq, Eq)]
enum Told {
    /// For the waiters.
    Notice(Notice),
    /// For the ledger: the lease on the key with that fence ended (with `all`: every lease up
    /// to it).
    Ended {
        space: Space,
        key: LockKey,
        fence: Fence,
        all: bool,
    },
}

/// A notice on the broker's own channel (see the module's docs); `None` if it is not one.
fn parse_own(payload: &[u8]) -> Option<Told> {
    let text = std::str::from_utf8(payload).ok()?;
    let (kind, rest) = text.split_once(' ')?;
    let (space, rest) = rest.split_once(' ')?;
    let space = match space {
        LOCK_SPACE => Space::Locks,
        SEMAPHORE_SPACE => Space::Semaphores,
        _ => return None,
    };
    Some(match kind {
        "r" => Told::Notice(Notice::Requeue(space, LockKey::parse(rest).ok()?)),
        "c" => Told::Notice(Notice::Changed(space, LockKey::parse(rest).ok()?)),
        _ => {
            let (word, key) = rest.split_once(' ')?;
            let key = LockKey::parse(key).ok()?;
            match kind {
                "o" => Told::Notice(Notice::Offered(space, key, Token::parse(word).ok()?)),
                "l" => Told::Notice(Notice::Look(space, key, word.parse().ok()?)),
                "d" | "D" => Told::Ended {
                    space,
                    key,
                    fence: word.parse().ok()?,
                    all: kind == "D",
                },
                _ => return None,
            }
        }
    })
}

/// Hands a notice on; `false` once nobody listens any more. A full channel drops the notice:
/// waiters also wake at the holder's expiry and on their fallback poll.
fn deliver(notices: &mpsc::Sender<Notice>, notice: Notice) -> bool {
    !matches!(notices.try_send(notice), Err(TrySendError::Closed(_)))
}

async fn subscribe(
    connector: &Connector,
    attempt: usize,
    channels: &[&str],
    timeout: Duration,
) -> StoreResult<(PubSubSink, PubSubStream)> {
    let connect = async {
        let mut pubsub = connector
            .notice_client(attempt)
            .await?
            .get_async_pubsub()
            .await?;
        pubsub.subscribe(channels).await?;
        Ok::<_, RedisError>(pubsub.split())
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(split)) => Ok(split),
        Ok(Err(e)) => Err(StoreError::Failed(e.to_string())),
        Err(_) => Err(StoreError::Timeout(millis(timeout))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_brokers_own_notices_parse_with_the_key_last_and_nothing_else_does() {
        let key = LockKey::parse("orders:42").unwrap();
        let token = Token::parse("abc123").unwrap();
        assert_eq!(
            parse_own(b"o L abc123 orders:42"),
            Some(Told::Notice(Notice::Offered(
                Space::Locks,
                key.clone(),
                token
            )))
        );
        assert_eq!(
            parse_own(b"l S 2000 orders:42"),
            Some(Told::Notice(Notice::Look(
                Space::Semaphores,
                key.clone(),
                2000
            )))
        );
        assert_eq!(
            parse_own(b"r L orders:42"),
            Some(Told::Notice(Notice::Requeue(Space::Locks, key.clone())))
        );
        assert_eq!(
            parse_own(b"D S 17 orders:42"),
            Some(Told::Ended {
                space: Space::Semaphores,
                key: key.clone(),
                fence: 17,
                all: true
            })
        );
        for bad in [
            &b"o X abc orders:42"[..],
            b"l L soon orders:42",
            b"d L 5",
            b"q L 5 orders:42",
            b"o L abc bad key",
            b"",
        ] {
            assert_eq!(parse_own(bad), None, "{bad:?}");
        }
    }
}
