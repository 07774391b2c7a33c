//! A checked model of lockbroker's store protocol (docs/model.md): the store's scripts as pure
//! step functions ([`store`]), and the brokers, clients, notices, time and store losses around
//! them as a `stateright` model ([`model`]), whose properties the checker (`src/main.rs`,
//! `scripts/model-check.sh`) verifies in every reachable state.

pub mod configs;
pub mod model;
pub mod store;
