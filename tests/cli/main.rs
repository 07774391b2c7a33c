//! The client commands' tests: the real `lockbroker` binary, run as a child process, against
//! brokers run in this process on port 0 (the embedded store, or a `redis-server` of the
//! test's own). Every wait is bounded. `docs.rs` checks the links of the repository's
//! Markdown files.

mod commands;
mod docs;
mod elect;
mod kinds;
mod run;
mod secure;
mod sessions;
mod support;
