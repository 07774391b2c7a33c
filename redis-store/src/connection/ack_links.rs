//! Ack links: a few connections beside the main one, on one server or a Sentinel master, for
//! the writes that wait for replicas (`--redis-replica-acks` above 0; `replicas.rs` says why).
//!
//! A grant or a renewal goes over one ack link (`Replicas::link_for` chooses it), and so does the
//! `WAIT` that confirms it. Each link is made like the main connection — opened, then verified
//! by the epoch check before anything may use it — and to the same server: the main connection's
//! server, or the master it reached through the sentinels. It belongs to the main connection that
//! was up when it was made: when that one goes (it broke, or the sentinels named a new master),
//! its ack links go with it, and the next write that needs one makes a new one beside the new
//! main connection. Each link has a generation of its own, drawn from the same count as the main
//! connection's, so a generation names one connection, whichever it is.
//!
//! A cluster has none: there `WAIT` goes to the master of the lock's slot, over the cluster
//! client's own connection to that node.

use std::sync::atomic::Ordering;

use redis::{AsyncConnectionConfig, ErrorKind, RedisError, RedisResult};
use tokio::time::Instant;

use super::{Conn, Connector, Link, RECONNECT_PAUSE, RedisConnection, State, wait_for};
use crate::slots::slot_of;
use lockbroker_core::domain::LockKey;
use lockbroker_core::store::{StoreError, StoreResult};

/// Why an ack link was dropped, or not used: the main connection it belongs to went.
const MAIN_REPLACED: &str = "the main Redis connection was replaced";

impl Connector {
    /// A connection to the server the main connection reached: the server itself, or the
    /// master the last connection opened through the sentinels reached. A cluster has no ack
    /// links.
    async fn open_beside(&self, config: &AsyncConnectionConfig) -> RedisResult<Conn> {
        match self {
            Self::Single(_) => self.open(config).await,
            Self::Sentinel(sentinels) => Ok(Conn::Single(sentinels.open_connected(config).await?)),
            Self::Cluster { .. } => Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "a Redis Cluster has no ack links",
            ))),
        }
    }
}

impl RedisConnection {
    /// How many ack links the store keeps (0: none).
    pub(crate) fn ack_links(&self) -> usize {
        self.acks.len()
    }

    /// `key`'s own ack link, by its hash; `None` when there are no ack links.
    pub(crate) fn ack_link_of(&self, key: &LockKey) -> Option<usize> {
        (!self.acks.is_empty())
            .then(|| usize::from(slot_of(key.as_str().as_bytes())) % self.acks.len())
    }

    /// Which ack link is connection `generation`, if it is one and still up.
    pub(crate) fn ack_link_with(&self, generation: u64) -> Option<usize> {
        self.acks.iter().position(
            |ack| matches!(&*ack.borrow(), State::Up(link) if link.generation == generation),
        )
    }

    /// Ack link `index` if it is up now; never waits.
    pub(crate) fn current_ack(&self, index: usize) -> Option<Link> {
        match &*self.acks[index].borrow() {
            State::Up(link) => Some(link.clone()),
            _ => None,
        }
    }

    /// Ack link `index`; if it is not up, waits for the one being made, calling `connect` first
    /// if nobody is making one. Not bounded here: callers bound it.
    pub(crate) async fn get_ack(&self, index: usize, connect: impl Fn()) -> StoreResult<Link> {
        wait_for(&self.acks[index], connect).await
    }

    /// Opens a connection for an ack link, to the main connection's server. Not yet usable:
    /// [`RedisConnection::ack_up`] makes it so once verified.
    pub(crate) async fn open_ack(&self) -> StoreResult<Conn> {
        self.bounded_open(self.connector.open_beside(&self.config))
            .await
    }

    /// Makes a verified connection ack link `index`, if the main connection it was made beside
    /// (generation `of`) is still the one up; otherwise the next request makes another at once.
    pub(crate) fn ack_up(&self, index: usize, conn: Conn, of: u64) {
        let main_is_up =
            || matches!(&*self.state.borrow(), State::Up(main) if main.generation == of);
        if !main_is_up() {
            self.acks[index].send_replace(replaced());
            return;
        }
        let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        self.acks[index].send_replace(State::Up(Link { conn, generation }));
        // The main connection went between the check and now, before this link was up to be
        // dropped with it.
        if !main_is_up() {
            self.drop_ack_link(generation, &StoreError::Failed(MAIN_REPLACED.into()));
        }
    }

    /// An attempt to make ack link `index` failed.
    pub(crate) fn ack_down(&self, index: usize, error: StoreError) {
        self.acks[index].send_replace(State::Down {
            error,
            at: Instant::now(),
        });
    }

    /// The connection up now with `generation`, the main one or an ack link; `None` if it was
    /// replaced or went down.
    pub(crate) fn link_of(&self, generation: u64) -> Option<Link> {
        std::iter::once(&self.state)
            .chain(&self.acks)
            .find_map(|state| match &*state.borrow() {
                State::Up(link) if link.generation == generation => Some(link.clone()),
                _ => None,
            })
    }

    /// Stops using the ack link `generation`, if it is one.
    pub(super) fn drop_ack_link(&self, generation: u64, error: &StoreError) {
        for ack in &self.acks {
            ack.send_if_modified(|s| match s {
                State::Up(link) if link.generation == generation => {
                    *s = State::Down {
                        error: error.clone(),
                        at: Instant::now() - RECONNECT_PAUSE,
                    };
                    true
                }
                _ => false,
            });
        }
    }

    /// Stops using every ack link: the main connection they belong to went.
    pub(super) fn drop_ack_links(&self) {
        for ack in &self.acks {
            ack.send_if_modified(|s| match s {
                State::Up(_) => {
                    *s = replaced();
                    true
                }
                _ => false,
            });
        }
    }
}

/// An ack link that went with its main connection: the next request makes another at once.
fn replaced() -> State {
    State::Down {
        error: StoreError::Failed(MAIN_REPLACED.into()),
        at: Instant::now() - RECONNECT_PAUSE,
    }
}
