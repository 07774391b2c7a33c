//! An async client for lockbroker, the distributed-lock broker.
//!
//! [`Client::acquire`] takes a lease (the broker does the waiting); the [`Lease`] it returns
//! renews itself in the background at a third of its ttl, tells when it is lost
//! ([`Lease::is_held`], [`Lease::lost`], [`Lease::subscribe`]), and is released by
//! [`Lease::release`] or, best effort, when dropped. Acquires carry a generated request id, so
//! a 503 or a lost answer is asked again without ever making a second holder; an error answer
//! that asking again cannot change (a `401`, a proxy's `500`) is returned at once, naming the
//! URL (and so the key) it came from. [`Client::from_env`] reads `LOCKBROKER_URL` and
//! `LOCKBROKER_AUTH_TOKEN`. Shared leases and
//! semaphore permits go through [`Client::acquire_with`] and a [`Claim`]. [`Client::acquire_all`]
//! takes several keys at once, all or none, as one [`Lease`] (a fence per key,
//! [`Lease::fences`]).
//!
//! [`Client::open_session`] opens a [`Session`]: one keep-alive for every lease taken under it
//! ([`Session::acquire`], [`Session::acquire_all`]), all lost together when it is lost, all released when it is closed.
//!
//! [`Client::watch`] tells who holds a key when that changes, without polling; a [`Follower`]
//! sees every change; [`Leadership`] elects one leader among the nodes that campaign for a key.
//!
//! The one-request calls the command line uses ([`Client::grant`], [`Client::renew`],
//! [`Client::release`], status and listings) are public too.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! let broker = lockbroker_client::Client::new("http://127.0.0.1:8080")?;
//! let lease = broker
//!     .acquire("orders:42", Duration::from_secs(10), Duration::from_secs(5))
//!     .await?;
//! tokio::select! {
//!     loss = lease.lost() => eprintln!("stop writing: {loss}"),
//!     () = async { /* the work, sending lease.fence() with each write */ } => {}
//! }
//! lease.release().await?;
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

mod acquire;
mod client;
mod error;
mod keep;
mod leadership;
mod lease;
mod request;
mod session;
mod session_api;
mod several;
mod types;
mod watch;

pub use crate::client::{
    AUTH_TOKEN_ENV, BuildError, Client, ClientBuilder, DEFAULT_URL, REQUEST_TIMEOUT, URL_ENV,
};
pub use crate::error::Error;
pub use crate::leadership::{Leadership, LeadershipBuilder, Revoked};
pub use crate::lease::{Lease, LeaseOptions, LeaseState, Loss, Released, Trouble, TroubleHook};
pub use crate::session::{Session, SessionOptions};
pub use crate::several::{KeyFence, KeyReleased, SeveralGrant};
pub use crate::types::{
    AcquireParams, Claim, Grant, Holder, LockEntry, LockMode, LockStatus, MAX_PAGE,
    MAX_SEMAPHORE_LIMIT, Page, Resource, SemaphoreEntry, SemaphoreStatus, SessionGrant,
    SessionKept, SessionLeaseEntry, SessionParams, SessionStatus, Space, Token, format_ms,
    new_request_id,
};
pub use crate::watch::{FOLLOW_WAIT, Follower, Watched, WatchedFence};
