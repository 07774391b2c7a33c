//! lockbroker's core: the lease vocabulary ([`domain`]), the store's primitives as a trait
//! ([`store::Store`]) with the embedded in-memory store ([`store::MemoryStore`]), the lock
//! service built on them ([`lock`]: the recipe, waiting, watching) and the broker's metrics
//! ([`metrics`]). Knows neither HTTP nor Redis: the Redis store (`lockbroker-redis`) and the
//! server (`lockbroker`) build on this crate.
#![forbid(unsafe_code)]

pub mod domain;
pub mod lock;
pub mod metrics;
pub mod store;
