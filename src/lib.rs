//! lockbroker: a distributed-lock broker. The classic Redis SETNX/GETSET timestamp lock recipe,
//! with its known races closed, behind a small HTTP API, on Redis or on an embedded in-memory
//! store.
//!
//! The lease vocabulary, the lock service and the embedded store are `lockbroker-core`'s; the
//! Redis store is `lockbroker-redis`'s; this crate is the server around them (configuration,
//! HTTP, TLS, startup) and the command line.
//!
//! Its users outside this library are the `lockbroker` binary (`serve`), `lockbroker-bench`
//! (`bench/`, which drives a [`store::RedisStore`] directly, and with the `bench` feature
//! measures the lease ledger), the test suites and `test-support`: they reach the
//! settings ([`config`]), the lease vocabulary ([`domain`]), the stores ([`store`]) and the few
//! items re-exported here. Everything else is private, so the compiler keeps the layers apart.
#![forbid(unsafe_code)]

mod auth;
pub mod config;
mod http;
mod reload;
mod server;
mod startup;
pub mod store;
mod telemetry;

pub use auth::sha256_hex;
pub use http::ROUTES;
pub use lockbroker_core::domain;
use lockbroker_core::{lock, metrics};
pub use startup::{Application, shutdown_signal};
pub use telemetry::init as init_logging;
