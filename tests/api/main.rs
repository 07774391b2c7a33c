//! The API test suite: one binary, brokers over real HTTP, each test with its own Redis or keys.
//! The fixtures (brokers, Redis servers, the HTTP helpers) are in `lockbroker-test-support`.

mod auth;
mod batching;
mod concurrency;
mod contract;
mod cross_broker;
mod dashboard;
mod hardening;
mod layers;
mod limits;
mod listing;
mod metrics;
mod openapi;
mod outage;
mod process;
mod round_trips;
mod semaphores;
mod sessions;
mod several;
mod shared;
mod store_loss;
mod store_pools;
mod store_queue;
mod tls;
mod waiting;
mod watch;
