//! The safety and fault-injection suite: the seeds' demo end to end, a torture check of mutual
//! exclusion shared by every fault test, and the faults themselves — a broker killed, a holder
//! paused past its TTL, Redis stopped, slowed, cut off or restarted empty, host clocks skewed —
//! each bounded in time. `soak.rs` runs the same torture longer with random faults.
//!
//! Brokers run in this process (`spawn_app`) where that is enough, and as real processes
//! ([`broker::BrokerProcess`]) where the fault needs one (SIGKILL, `faketime`).

// The API suite's harness (spawn_app, RedisServer), shared read-only; this binary uses part of it.
#[path = "../api/helpers.rs"]
#[allow(dead_code, unused_imports, unused_macros)]
mod helpers;

mod broker;
mod demo;
mod faults;
mod proxy;
mod skew;
mod soak;
mod store_loss;
mod torture;
