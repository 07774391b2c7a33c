//! HTTPS with certificates made in the test: HTTP/1.1 and HTTP/2 by ALPN, client certificates
//! (mTLS), a certificate reloaded without dropping the connections already open, and a broken
//! certificate on reload that keeps the previous one.

use std::time::{Duration, Instant};

use lockbroker_test_support::app::{TestApp, spawn_app_with};
use lockbroker_test_support::certs::{PemPair, TestCa};
use reqwest::{Client, StatusCode, Version};

async fn spawn_https(server: &PemPair, client_ca: Option<&TestCa>) -> TestApp {
    let (cert, key) = (server.cert.clone(), server.key.clone());
    let client_ca = client_ca.map(|ca| ca.cert.clone());
    let app = spawn_app_with(None, move |c| {
        c.tls_cert = Some(cert);
        c.tls_key = Some(key);
        c.tls_client_ca = client_ca;
    })
    .await;
    assert!(
        app.address.starts_with("https://127.0.0.1:"),
        "{}",
        app.address
    );
    app
}

async fn healthz(client: &Client, app: &TestApp) -> reqwest::Result<reqwest::Response> {
    client.get(app.url("/healthz")).send().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_serves_http_1_1_and_http_2_as_alpn_picks_and_refuses_plain_http() {
    let ca = TestCa::new("alpn");
    let app = spawn_https(&ca.server("server"), None).await;
    let h2 = ca.client_builder(None).build().unwrap();
    let answer = healthz(&h2, &app).await.expect("an HTTPS answer");
    assert_eq!(answer.status(), StatusCode::OK);
    assert_eq!(answer.version(), Version::HTTP_2);
    let h1 = ca.client_builder(None).http1_only().build().unwrap();
    let answer = healthz(&h1, &app).await.expect("an HTTPS answer");
    assert_eq!(answer.version(), Version::HTTP_11);
    // A whole lock cycle over HTTPS.
    let grant: serde_json::Value = h2
        .post(app.url("/locks/tls-cycle"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let released = h2
        .delete(app.url("/locks/tls-cycle"))
        .header("Lock-Token", grant["token"].as_str().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(released.status(), StatusCode::NO_CONTENT);
    // A client that does not trust the CA, and plain HTTP, get nothing.
    let untrusting = Client::builder().no_proxy().build().unwrap();
    assert!(healthz(&untrusting, &app).await.is_err());
    let plain = app.address.replace("https://", "http://");
    let answer = Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
        .get(format!("{plain}/healthz"))
        .send()
        .await;
    assert!(
        answer.is_err(),
        "plain HTTP to the HTTPS port was answered: {answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_only_clients_with_a_certificate_it_signed_are_served() {
    let ca = TestCa::new("mtls");
    let clients_ca = TestCa::new("clients");
    let stranger_ca = TestCa::new("strangers");
    let app = spawn_https(&ca.server("server"), Some(&clients_ca)).await;
    let with_cert = ca
        .client_builder(Some(&clients_ca.client("orders-app")))
        .build()
        .unwrap();
    let answer = healthz(&with_cert, &app)
        .await
        .expect("served with a certificate");
    assert_eq!(answer.status(), StatusCode::OK);
    let without = ca.client_builder(None).build().unwrap();
    assert!(
        healthz(&without, &app).await.is_err(),
        "served without a certificate"
    );
    let stranger = ca
        .client_builder(Some(&stranger_ca.client("stranger")))
        .build()
        .unwrap();
    assert!(
        healthz(&stranger, &app).await.is_err(),
        "served with a certificate another CA signed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_certificate_is_used_for_new_connections_and_open_ones_stay() {
    let old_ca = TestCa::new("old");
    let new_ca = TestCa::new("new");
    let server = old_ca.server("server");
    let app = spawn_https(&server, None).await;
    // An HTTP/2 connection open before the change (one connection, reused by this client).
    let old_client = old_ca.client_builder(None).build().unwrap();
    assert_eq!(
        healthz(&old_client, &app).await.unwrap().status(),
        StatusCode::OK
    );

    // A broken pair first (the new certificate with the old key): the old one stays.
    let next = new_ca.server("next");
    std::fs::copy(&next.cert, &server.cert).unwrap();
    app.reload();
    let fresh_old = old_ca.client_builder(None).build().unwrap();
    for _ in 0..3 {
        assert_eq!(
            healthz(&fresh_old, &app).await.unwrap().status(),
            StatusCode::OK,
            "a mismatched key replaced the working certificate"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Then the key: the new pair is in force within 2 s for new connections.
    std::fs::copy(&next.key, &server.key).unwrap();
    let started = Instant::now();
    loop {
        let new_client = new_ca.client_builder(None).build().unwrap();
        if healthz(&new_client, &app).await.is_ok() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the new certificate was not in force within 2 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fresh_old = old_ca.client_builder(None).build().unwrap();
    assert!(
        healthz(&fresh_old, &app).await.is_err(),
        "new connections still get the old certificate"
    );
    // The connection opened before the change is still served.
    assert_eq!(
        healthz(&old_client, &app).await.unwrap().status(),
        StatusCode::OK
    );
}
