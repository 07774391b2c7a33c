//! lockbroker: a distributed-lock broker. The classic Redis SETNX/GETSET timestamp lock recipe,
//! with its known races closed, behind a small HTTP API, on Redis or on an embedded in-memory
//! store.
//!
//! Its users outside this library are the `lockbroker` binary (`serve`), `lockbroker-bench`
//! (`bench/`, which drives a [`store::RedisStore`] directly, and with the `bench` feature
//! measures the lease ledger), the test suites and `test-support`: they reach the
//! settings ([`config`]), the lease vocabulary ([`domain`]), the stores ([`store`]) and the few
//! items re-exported here. Everything else is private, so the compiler keeps the layers apart.
#![forbid(unsafe_code)]

mod auth;
pub mod config;
pub mod domain;
mod http;
mod lock;
mod metrics;
mod reload;
mod server;
mod startup;
pub mod store;
mod telemetry;

pub use auth::sha256_hex;
pub use http::ROUTES;
pub use startup::{Application, shutdown_signal};
pub use telemetry::init as init_logging;
