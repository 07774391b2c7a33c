//! lockbroker: a distributed-lock broker. The classic Redis SETNX/GETSET timestamp lock recipe,
//! with its known races closed, behind a small HTTP API, on Redis or on an embedded in-memory
//! store.
#![forbid(unsafe_code)]

pub mod auth;
pub mod config;
pub mod domain;
pub mod http;
pub mod lock;
pub mod metrics;
pub mod reload;
pub mod server;
pub mod startup;
pub mod store;
pub mod telemetry;
pub mod waiters;
