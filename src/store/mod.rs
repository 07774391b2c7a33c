//! The stores a broker runs on: the `Store` trait, its vocabulary and the embedded store from
//! `lockbroker-core`, the Redis store from `lockbroker-redis`, and `AnyStore`, the one the
//! configuration chose.

mod any;

pub(crate) use any::AnyStore;
/// The counters a store reports into (`RedisStore::connect` takes them), rendered as `/metrics`.
pub use lockbroker_core::metrics::Metrics;
pub use lockbroker_core::store::*;
/// The Redis store's crate, under the name its settings are known by here.
pub use lockbroker_redis as redis;
pub use lockbroker_redis::RedisStore;
#[cfg(feature = "bench")]
pub use lockbroker_redis::{LedgerCost, ledger_cost};
