//! The real binary with an auth file and its limits: `SIGHUP` reloads the file (and a broken
//! one is logged and ignored), a broken file at start stops the broker naming the line,
//! `SIGTERM` is not held up by a half-sent request head, and no bearer token nor lock token
//! appears in its log even at `trace`.

use std::process::Stdio;
use std::time::{Duration, Instant};

use lockbroker_test_support::broker::{BrokerCommand, BrokerProcess, serve_command};
use lockbroker_test_support::http::{Answer, http_client};
use lockbroker_test_support::send_signal;
use lockbroker_test_support::temp::{temp_file, temp_log};
use reqwest::StatusCode;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const BINARY: &str = env!("CARGO_BIN_EXE_lockbroker");

const TOKEN: &str = "process-secret-0123456789";
const ROTATED: &str = "rotated-secret-0123456789";

fn auth_file(token: &str, name: &str) -> String {
    format!(
        "[[tokens]]\nname = \"{name}\"\ntoken = \"{token}\"\nprefixes = [\"\"]\npermissions = [\"lock\"]\n"
    )
}

/// A broker process on `auth` with `extra` flags.
async fn start(auth: &std::path::Path, extra: &'static [&'static str]) -> BrokerProcess {
    let auth = auth.to_owned();
    BrokerProcess::start(BrokerCommand::configured(BINARY, move |command, port| {
        command
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--auth-file")
            .arg(&auth)
            .args(extra);
    }))
    .await
}

async fn inspect(broker: &BrokerProcess, token: &str) -> StatusCode {
    http_client()
        .get(broker.url("/locks/sighup"))
        .bearer_auth(token)
        .send()
        .await
        .expect("an answer")
        .status()
}

/// Polls until `check` holds, for at most `limit`.
async fn until(limit: Duration, what: &str, mut check: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !check().await {
        assert!(started.elapsed() < limit, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_auth_file_and_a_broken_one_is_logged_and_ignored() {
    let file = temp_file("auth", "toml");
    std::fs::write(&file, auth_file(TOKEN, "first")).unwrap();
    let mut broker = start(&file, &[]).await;
    assert_eq!(inspect(&broker, TOKEN).await, StatusCode::NOT_FOUND);

    // A broken file: logged with its line, and the old token keeps working.
    std::fs::write(&file, "[[tokens]]\nname = \"x\"\ntoken = \n").unwrap();
    send_signal(broker.pid(), "-HUP");
    until(
        Duration::from_secs(2),
        "the broken file logged",
        async || broker.output().contains("not reloaded"),
    )
    .await;
    let output = broker.output();
    assert!(
        output.contains("line 3"),
        "the log does not name the line:\n{output}"
    );
    assert!(output.contains("SIGHUP"), "{output}");
    assert_eq!(inspect(&broker, TOKEN).await, StatusCode::NOT_FOUND);

    // Rotated: the new token works within 2 s of the signal, the old one no longer does.
    std::fs::write(&file, auth_file(ROTATED, "second")).unwrap();
    send_signal(broker.pid(), "-HUP");
    until(
        Duration::from_secs(2),
        "the rotated token accepted",
        async || inspect(&broker, ROTATED).await == StatusCode::NOT_FOUND,
    )
    .await;
    assert_eq!(inspect(&broker, TOKEN).await, StatusCode::UNAUTHORIZED);
    assert!(broker.terminate(Duration::from_secs(5)).await.success());
    let _ = std::fs::remove_file(&file);
}

#[test]
fn a_broken_auth_file_at_start_stops_the_broker_with_the_line_that_is_wrong() {
    let file = temp_file("auth", "toml");
    std::fs::write(
        &file,
        format!("{}\n[[tokens]]\nname = \"b\"\ntoken = \"{TOKEN}x\"\nprefixes = [\"\"]\npermissions = [\"write\"]\n", auth_file(TOKEN, "a")),
    )
    .unwrap();
    let log = temp_log("broken-auth");
    let out = std::fs::File::create(&log).unwrap();
    let status = serve_command(BINARY)
        .args(["--listen", "127.0.0.1:0", "--auth-file"])
        .arg(&file)
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .stdin(Stdio::null())
        .status()
        .expect("run the broker");
    let output = std::fs::read_to_string(&log).unwrap();
    assert!(
        !status.success(),
        "the broker started with a broken auth file:\n{output}"
    );
    assert!(
        output.contains("line 11"),
        "the error does not name the line:\n{output}"
    );
    assert!(
        !output.contains(TOKEN),
        "the error repeats a token:\n{output}"
    );
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_is_not_held_up_by_a_client_with_a_half_sent_head() {
    let file = temp_file("auth", "toml");
    std::fs::write(&file, auth_file(TOKEN, "first")).unwrap();
    let mut broker = start(&file, &[]).await;
    let addr = broker.address().trim_start_matches("http://").to_owned();
    let mut half = TcpStream::connect(&addr).await.unwrap();
    half.write_all(b"POST /locks/half HTTP/1.1\r\nHost: x\r\nAuthor")
        .await
        .unwrap();
    let mut silent = TcpStream::connect(&addr).await.unwrap();
    silent.flush().await.unwrap();
    let signalled = Instant::now();
    let status = broker.terminate(Duration::from_secs(5)).await;
    assert!(status.success(), "{}", broker.output());
    assert!(
        signalled.elapsed() < Duration::from_secs(2),
        "SIGTERM took {:?} beside a half-sent head",
        signalled.elapsed()
    );
    let _ = std::fs::remove_file(&file);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_bearer_token_nor_lock_token_is_logged_even_at_trace_level() {
    let file = temp_file("auth", "toml");
    std::fs::write(&file, auth_file(TOKEN, "redaction-check")).unwrap();
    let mut broker = start(&file, &["--log-level", "trace"]).await;
    let mut lock_tokens = Vec::new();
    let h1 = http_client();
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    for client in [&h1, &h2] {
        let grant = Answer::send(
            client
                .post(broker.url("/locks/secret-key?ttl_ms=30000"))
                .bearer_auth(TOKEN),
        )
        .await
        .expect_grant(StatusCode::CREATED);
        let renew = broker.url(&format!("/locks/secret-key/renew?token={}", grant.token));
        Answer::send(client.post(renew).bearer_auth(TOKEN))
            .await
            .expect_status(StatusCode::OK);
        let release = client.delete(broker.url("/locks/secret-key"));
        Answer::send(
            release
                .header("Lock-Token", &grant.token)
                .bearer_auth(TOKEN),
        )
        .await
        .expect_status(StatusCode::NO_CONTENT);
        // Refusals too: a wrong bearer, and a lock token sent without one.
        let release = broker.url(&format!("/locks/secret-key?token={}", grant.token));
        Answer::send(client.delete(release).bearer_auth(format!("{TOKEN}-wrong")))
            .await
            .expect_status(StatusCode::UNAUTHORIZED);
        lock_tokens.push(grant.token);
    }
    assert!(broker.terminate(Duration::from_secs(5)).await.success());
    let output = broker.output();
    assert!(
        output.contains("TRACE") && output.lines().count() > 20,
        "the broker did not log at trace:\n{output}"
    );
    assert!(
        output.contains("redaction-check"),
        "the access log does not name the token:\n{output}"
    );
    assert!(
        !output.contains(TOKEN),
        "a bearer token is in the log:\n{output}"
    );
    for token in &lock_tokens {
        assert!(
            !output.contains(token.as_str()),
            "a lock token is in the log:\n{output}"
        );
    }
}

#[test]
fn inconsistent_security_settings_stop_the_broker_with_a_message() {
    let missing = temp_file("missing", "pem");
    let missing = missing.to_str().unwrap();
    let cases: [(&[&str], &str); 7] = [
        (&["--tls-cert", missing], "tls_cert and tls_key go together"),
        (
            &["--tls-client-ca", missing],
            "tls_client_ca needs tls_cert",
        ),
        (&["--auth-metrics"], "auth_metrics needs auth_file"),
        (&["--header-timeout-ms", "0"], "header_timeout_ms"),
        (&["--max-connections", "0"], "max_connections"),
        (&["--listen-backlog", "0"], "listen_backlog"),
        (&["--tls-cert", missing, "--tls-key", missing], "tls_cert"),
    ];
    for (args, mentions) in cases {
        let log = temp_log("bad-security");
        let out = std::fs::File::create(&log).unwrap();
        let status = serve_command(BINARY)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .status()
            .expect("run the broker");
        let output = std::fs::read_to_string(&log).unwrap();
        let _ = std::fs::remove_file(&log);
        assert!(!status.success(), "serve {args:?} started:\n{output}");
        assert!(
            output.contains(mentions),
            "serve {args:?} must say {mentions:?}:\n{output}"
        );
    }
}
