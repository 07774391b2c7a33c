//! The safety and fault-injection suite: the check-then-insert demo end to end, a torture check of mutual
//! exclusion shared by every fault test, and the faults themselves — a broker killed, a holder
//! paused past its TTL, Redis stopped, slowed, cut off or restarted empty, host clocks skewed —
//! each bounded in time. `soak.rs` runs the same torture longer with random faults.
//!
//! Brokers run in this process (`spawn_app`) where that is enough, and as real processes
//! (`BrokerProcess`) where the fault needs one (SIGKILL, `faketime`); both, and the Redis
//! servers, come from `lockbroker-test-support`.

/// The binary the broker processes run: Cargo builds it before this suite and names it only to
/// the package's own test targets, so the suite hands it to the fixtures.
const LOCKBROKER: &str = env!("CARGO_BIN_EXE_lockbroker");

mod batching;
mod cluster_failover;
mod demo;
mod faults;
mod kinds;
mod proxy;
mod queue;
mod sessions;
mod several;
mod skew;
mod soak;
mod store_loss;
mod torture;
