//! The client commands against a secured broker: the bearer token (`--auth-token` or
//! `LOCKBROKER_AUTH_TOKEN`), HTTPS with `--cacert`, and a client certificate for mTLS.

use lockbroker_test_support::app::{TestApp, spawn_app_with};
use lockbroker_test_support::auth_entry;
use lockbroker_test_support::certs::TestCa;
use lockbroker_test_support::temp::temp_file;

use crate::support::{finish, lockbroker, lockbroker_command};

const TOKEN: &str = "cli-secret-0123456789abcdef";

/// A broker on HTTPS (certificate by `ca`), with client certificates from `ca` required, and an
/// auth file with one `lock` token on `jobs:`.
async fn secured_broker(ca: &TestCa) -> TestApp {
    let server = ca.server("server");
    let auth = temp_file("auth", "toml");
    let secret = format!("token = {TOKEN:?}");
    std::fs::write(&auth, auth_entry("cli", &secret, &["jobs:"], &["lock"])).unwrap();
    let client_ca = ca.cert.clone();
    spawn_app_with(None, move |c| {
        c.auth_file = Some(auth);
        c.tls_cert = Some(server.cert);
        c.tls_key = Some(server.key);
        c.tls_client_ca = Some(client_ca);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_speaks_https_with_a_client_certificate_and_sends_the_bearer_token() {
    let ca = TestCa::new("cli");
    let app = secured_broker(&ca).await;
    let client = ca.client("cli-client");
    let (cacert, cert, key) = (
        ca.cert.to_str().unwrap().to_owned(),
        client.cert.to_str().unwrap().to_owned(),
        client.key.to_str().unwrap().to_owned(),
    );
    let tls: Vec<&str> = vec![
        "--cacert",
        &cacert,
        "--client-cert",
        &cert,
        "--client-key",
        &key,
    ];
    let with = |args: &[&str]| -> Vec<String> {
        args.iter()
            .chain(tls.iter())
            .chain(["--auth-token", TOKEN].iter())
            .map(|s| (*s).to_owned())
            .collect()
    };
    let run = async |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        lockbroker(&app.address, &args).await
    };

    let acquired = run(with(&["acquire", "jobs:nightly"])).await;
    acquired.expect_code(0);
    let token = acquired.field("token");
    run(with(&["status", "jobs:nightly"])).await.expect_code(0);
    run(with(&["renew", "jobs:nightly", "--token", &token]))
        .await
        .expect_code(0);
    run(with(&["release", "jobs:nightly", "--token", &token]))
        .await
        .expect_code(0);

    // `run`, with the bearer token from the environment.
    let args: Vec<&str> = ["run", "jobs:run"]
        .into_iter()
        .chain(tls.iter().copied())
        .chain(["--", "true"])
        .collect();
    let mut command = lockbroker_command(&app.address, &args);
    command.env("LOCKBROKER_AUTH_TOKEN", TOKEN);
    finish(command.spawn().unwrap()).await.expect_code(0);

    // Outside the token's prefixes: 403, an error (exit 1) that says so.
    let refused = run(with(&["acquire", "orders:1"])).await;
    refused.expect_failure(1, &["403", "forbidden"]);
    // No token: 401.
    let args: Vec<&str> = ["status", "jobs:nightly"]
        .into_iter()
        .chain(tls.iter().copied())
        .collect();
    let anonymous = lockbroker(&app.address, &args).await;
    anonymous.expect_failure(1, &["unauthorized"]);
    // No client certificate, or no CA to trust the broker by: no connection at all.
    let no_cert = lockbroker(
        &app.address,
        &[
            "status",
            "jobs:nightly",
            "--cacert",
            &cacert,
            "--auth-token",
            TOKEN,
        ],
    )
    .await;
    no_cert.expect_failure(1, &["cannot reach"]);
    let no_ca = lockbroker(
        &app.address,
        &["status", "jobs:nightly", "--auth-token", TOKEN],
    )
    .await;
    no_ca.expect_code(1);
    // The token is never printed, not even in an error.
    for outcome in [&acquired, &refused, &no_cert] {
        assert!(!outcome.stdout.contains(TOKEN) && !outcome.stderr.contains(TOKEN));
    }
}
