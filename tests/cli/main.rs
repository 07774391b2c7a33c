//! The client commands' tests: the real `lockbroker` binary, run as a child process, against
//! brokers run in this process on port 0 (the embedded store, or a `redis-server` of the
//! test's own). Every wait is bounded.

// The API suite's harness (spawn_app, RedisServer), shared read-only; this binary uses part of it.
#[path = "../api/helpers.rs"]
#[allow(dead_code, unused_imports, unused_macros)]
mod helpers;

mod commands;
mod run;
mod support;
