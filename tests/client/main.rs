//! The `lockbroker-client` crate against a real broker process (`lockbroker serve`, built from
//! this package), on the embedded store and on a real `redis-server`: grants, waiting, `409`,
//! shared leases and permits, the renewing guard, the loss signal, retries across `503`s, and
//! no renewal after a release; sessions (`sessions`): leases on keep-alives alone, freed by a
//! close or a drop, lost with their session; several keys at once (`several`): all or none,
//! a fence per key, opposite orders, one lost key losing all; and the answers not worth asking again (`refusals`, against a
//! broker in the test process and a stand-in that is not a broker): a `500`, a revoked bearer
//! token, a `Leadership` with a wrong token, an empty key. The suite lives in this package, not
//! in the crate's, because Cargo tells only the package's own tests where its binary is.

mod guard;
mod refusals;
mod sessions;
mod several;
mod watching;

use std::process::Command;
use std::time::Duration;

use lockbroker_client::{Client, Lease};
use lockbroker_test_support::broker::{BrokerCommand, BrokerProcess, listen_on, wait_until_ready};
use lockbroker_test_support::http::metric;
use lockbroker_test_support::redis_server::RedisServer;

/// A broker process on the embedded store or on a Redis of its own, force release allowed,
/// and a client for it.
struct Setup {
    broker: BrokerProcess,
    /// Kept alive as long as the broker uses it; `None` for the embedded store.
    redis: Option<RedisServer>,
    /// How the broker was started, to start a second one on the same store.
    command: BrokerCommand,
    client: Client,
}

#[derive(Debug, Clone, Copy)]
enum Store {
    Embedded,
    Redis,
}

impl Setup {
    /// Starts the broker and waits until it grants (`/readyz`): a broker on a new Redis settles
    /// for a moment first.
    async fn start(store: Store) -> Self {
        let setup = Self::start_unready(store).await;
        wait_until_ready(&setup.broker.address(), Duration::from_secs(10)).await;
        setup
    }

    /// Starts the broker without waiting for it to grant.
    async fn start_unready(store: Store) -> Self {
        let redis = match store {
            Store::Embedded => None,
            Store::Redis => Some(RedisServer::start().await),
        };
        let redis_url = redis.as_ref().map(RedisServer::url);
        let command = BrokerCommand::configured(
            env!("CARGO_BIN_EXE_lockbroker"),
            move |command: &mut Command, port| {
                listen_on(command, port);
                command.arg("--allow-force-release");
                if let Some(url) = &redis_url {
                    command.args(["--redis-url", url]);
                }
            },
        );
        let broker = BrokerProcess::start(command.clone()).await;
        let client = Client::new(&broker.address()).expect("a valid URL");
        Self {
            broker,
            redis,
            command,
            client,
        }
    }

    /// Another broker on the same Redis, ready to grant, and a client for it.
    async fn another_broker(&self) -> (BrokerProcess, Client) {
        assert!(
            self.redis.is_some(),
            "brokers share a Redis, not an embedded store"
        );
        let broker = BrokerProcess::start(self.command.clone()).await;
        wait_until_ready(&broker.address(), Duration::from_secs(10)).await;
        let client = Client::new(&broker.address()).expect("a valid URL");
        (broker, client)
    }

    /// A series of the broker's `/metrics`.
    async fn metric(&self, series: &str) -> f64 {
        metric(&self.broker.address(), series).await
    }

    /// An exclusive lease on `key` for `ttl`, taken without waiting (the key must be free).
    async fn hold(&self, key: &str, ttl: Duration) -> Lease {
        self.client
            .acquire(key, ttl, Duration::ZERO)
            .await
            .unwrap_or_else(|e| panic!("{key} is free, yet: {e}"))
    }

    /// Waits until the broker has confirmed a renewal.
    async fn renewed_once(&self) {
        eventually("a renewal got through", || async {
            self.metric(RENEWED).await >= 1.0
        })
        .await;
    }

    /// Checks that `lease` holds `key`: the broker shows its fence, and nobody else is granted
    /// the key.
    async fn assert_held(&self, key: &str, lease: &Lease) {
        let status = self.client.status(key).await.expect("held");
        assert_eq!(status.fence, lease.fence());
        assert!(
            self.client
                .try_acquire(key, Duration::from_secs(30))
                .await
                .unwrap()
                .is_none(),
            "another acquire of a held key is not granted"
        );
    }
}

/// Renewals the broker confirmed on locks.
const RENEWED: &str = r#"lockbroker_renewals_total{space="locks",result="renewed"}"#;

/// Waits (bounded) until `check` holds, polling every 20 ms: for events seen only from outside.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs the async test body `$body` (a function of a [`Store`]) on both stores.
macro_rules! on_both_stores {
    ($($name:ident => $body:path;)*) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn on_the_embedded_store() {
                    $body(super::Store::Embedded).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn on_redis() {
                    $body(super::Store::Redis).await;
                }
            }
        )*
    };
}

on_both_stores! {
    grants_wait_and_409 => crate::guard::grants_wait_and_answers_locked;
    shared_leases_and_permits => crate::guard::shared_leases_and_permits_hold_together_up_to_the_limit;
    renewal_holds_past_the_ttl => crate::guard::the_guard_holds_a_lease_for_three_times_its_ttl;
    loss_after_force_release => crate::guard::a_force_release_is_signalled_as_a_loss_within_the_ttl;
    loss_after_broker_stop => crate::guard::a_stopped_broker_is_signalled_as_a_loss_within_the_ttl;
    no_renewal_after_release => crate::guard::no_renewal_is_sent_after_release_or_drop;
    watch_grant_release_timeout => crate::watching::watch_sees_a_grant_and_a_release_and_times_out_unchanged;
    follow_each_change => crate::watching::a_follower_yields_each_change_once_in_order;
    leadership_handover => crate::watching::two_candidates_one_leader_and_a_handover_on_close;
    leadership_loss => crate::watching::a_lost_lease_is_revoked_before_the_campaign_goes_on;
    session_keeps_leases => crate::sessions::leases_live_past_three_ttls_on_keep_alives_alone;
    session_close_frees => crate::sessions::a_closed_or_dropped_session_frees_its_keys_at_once;
    session_ended_elsewhere => crate::sessions::a_session_ended_elsewhere_is_lost_with_its_leases;
    session_broker_stopped => crate::sessions::a_session_whose_broker_stopped_is_lost_with_its_leases;
    several_all_or_none => crate::several::every_key_or_none_with_the_busy_keys_named_and_a_fence_per_key;
    several_release_all => crate::several::one_release_and_a_drop_let_every_key_go;
    several_opposite_orders => crate::several::opposite_orders_from_two_tasks_all_complete;
    several_lost_key => crate::several::a_lost_key_loses_the_lease_and_the_rest_are_released;
    several_under_a_session => crate::several::several_keys_under_a_session_live_on_its_keep_alives;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_keys_answered_503_are_retried_within_the_wait_and_granted_once() {
    several::an_acquire_of_several_keys_answered_503_is_retried_and_grants_once().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_under_a_session_answered_503_is_retried_within_its_wait_and_grants_once() {
    sessions::an_acquire_under_a_session_answered_503_is_retried_and_grants_once().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_broker_died_is_lost_before_another_broker_grants_its_key() {
    guard::a_lease_is_lost_before_another_broker_can_grant_it().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_answered_503_is_retried_within_its_wait_and_grants_once() {
    guard::an_acquire_answered_503_is_retried_and_grants_once().await;
}
