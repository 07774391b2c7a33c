//! TLS to Redis (`rediss://`): the broker trusts the CA it is given, presents a client
//! certificate when the server asks for one, and says clearly — on `/readyz` and in its log, not
//! by hanging or panicking — when the server refuses it or it does not trust the server.

use std::time::{Duration, Instant};

use lockbroker_test_support::app::spawn_app_with;
use lockbroker_test_support::broker::{BrokerProcess, wait_until_ready};
use lockbroker_test_support::http::{granted_within, http_client, until_waiting};
use lockbroker_test_support::redis_server::wait_until_listening_on;
use lockbroker_test_support::tls::{Certificates, ClientCertificates, TlsRedis};
use reqwest::StatusCode;

/// Longer than any TLS handshake on loopback, far shorter than a hang.
const READY_LIMIT: Duration = Duration::from_secs(5);

/// A broker process on `url` with these extra flags, logging at the default level (`info`):
/// what an operator sees.
async fn broker_process(url: String, flags: Vec<String>) -> BrokerProcess {
    let mut all = vec!["--store-timeout-ms", "1000", "--store-settle-ms", "0"];
    all.extend(flags.iter().map(String::as_str));
    crate::broker_on(&url, &all).await
}

/// `/readyz` answers 503 `store_unavailable` promptly, and the broker's log names `why`.
async fn refused_with(broker: &BrokerProcess, why: &[&str]) {
    let client = http_client();
    let started = Instant::now();
    loop {
        let asked = Instant::now();
        let answer = client
            .get(broker.url("/readyz"))
            .send()
            .await
            .expect("the broker answers");
        assert!(asked.elapsed() < Duration::from_secs(2), "/readyz hung");
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body: serde_json::Value = answer.json().await.expect("a JSON error");
        assert_eq!(body["error"], "store_unavailable", "{body}");
        let log = broker.output();
        assert!(!log.contains("panicked"), "the broker panicked:\n{log}");
        if why.iter().any(|w| log.contains(w)) {
            return;
        }
        assert!(
            started.elapsed() < READY_LIMIT,
            "the broker's log does not say {why:?}:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_over_tls_grants_releases_and_wakes_waiters() {
    let certs = Certificates::generate();
    let redis = TlsRedis::start(&certs, ClientCertificates::NotAsked).await;
    let ca = certs.ca();
    let tweak = |settings: &mut lockbroker::config::Settings| {
        settings.redis_tls_ca = Some(ca.clone());
    };
    let one = spawn_app_with(Some(redis.url()), tweak).await;
    let two = spawn_app_with(Some(redis.url()), tweak).await;
    wait_until_ready(&one.address, READY_LIMIT).await;
    wait_until_listening_on(&mut redis.connection().await.expect("a TLS connection"), 2).await;

    let holder = one.grant("tls-key", "ttl_ms=20000").await;
    let waiter = two.spawn_acquire("tls-key", "wait_ms=10000");
    until_waiting(&two.address, 1).await;
    one.release_ok("tls-key", &holder.token).await;
    let next = granted_within(waiter, Instant::now(), Duration::from_millis(500)).await;
    assert!(next.fence > holder.fence);
    two.renew("tls-key", &next.token, "ttl_ms=5000")
        .await
        .expect_status(StatusCode::OK);
    two.release_ok("tls-key", &next.token).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_asks_for_client_certificates_admits_only_a_broker_with_one() {
    let certs = Certificates::generate();
    let redis = TlsRedis::start(&certs, ClientCertificates::Required).await;
    let path = |p: std::path::PathBuf| p.to_string_lossy().into_owned();
    let ca = vec!["--redis-tls-ca".to_owned(), path(certs.ca())];

    // The real binary: it picks its TLS crypto provider itself, with no help from the test.
    let mut with_cert = ca.clone();
    with_cert.extend([
        "--redis-tls-cert".to_owned(),
        path(certs.client_cert()),
        "--redis-tls-key".to_owned(),
        path(certs.client_key()),
    ]);
    let admitted = broker_process(redis.url(), with_cert).await;
    let without_cert = broker_process(redis.url(), ca).await;
    let wrong_ca = broker_process(
        redis.url(),
        vec!["--redis-tls-ca".to_owned(), path(certs.other_ca())],
    )
    .await;

    wait_until_ready(&admitted.address(), READY_LIMIT).await;
    let client = http_client();
    let granted = client
        .post(admitted.url("/locks/mtls?ttl_ms=5000"))
        .send()
        .await
        .expect("the broker answers");
    assert_eq!(granted.status(), StatusCode::CREATED);

    // Redis refuses the handshake (TLS 1.3: after it, on the first read) for want of a client
    // certificate; the broker says the store is unavailable, and its log says why.
    refused_with(
        &without_cert,
        &["CertificateRequired", "certificate required"],
    )
    .await;
    // The server's certificate does not chain to the CA given.
    refused_with(&wrong_ca, &["UnknownIssuer", "invalid peer certificate"]).await;
}

#[tokio::test]
async fn tls_files_are_read_for_cluster_and_sentinel_urls_too() {
    use lockbroker::store::redis::{
        ClientCertificate, RedisSettings, RedisStore, RedisTls, RedisUrl,
    };
    let certs = Certificates::generate();
    let settings = |url: &str, tls: RedisTls| RedisSettings {
        url: RedisUrl::parse(url).expect("a valid Redis URL"),
        key_prefix: "lockbroker:".into(),
        timeout: Duration::from_secs(1),
        store_loss_delay: Duration::ZERO,
        store_settle: Duration::ZERO,
        tls,
        replica_acks: 0,
        batch_max: 64,
    };
    let files = RedisTls {
        ca: Some(certs.ca()),
        client: Some(ClientCertificate {
            cert: certs.client_cert(),
            key: certs.client_key(),
        }),
    };
    // Built (certificates parsed, clients configured) without connecting.
    for url in [
        "rediss+cluster://127.0.0.1:7000,127.0.0.1:7001",
        "rediss+sentinel://127.0.0.1:26379/mymaster",
        "rediss://127.0.0.1:6380/",
    ] {
        if let Err(e) = RedisStore::connect(&settings(url, files.clone()), Default::default()) {
            panic!("{url}: {e}");
        }
    }
    // A key file that is not a key is refused at start, saying which file.
    let not_a_key = RedisTls {
        client: Some(ClientCertificate {
            cert: certs.client_cert(),
            key: certs.ca(),
        }),
        ..files
    };
    let error = RedisStore::connect(
        &settings("rediss+cluster://127.0.0.1:7000", not_a_key),
        Default::default(),
    )
    .err()
    .expect("a CA is not a private key")
    .to_string();
    assert!(error.contains("key"), "{error}");
}
