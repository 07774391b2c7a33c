//! The layers around the whole router (`src/http/layers.rs`): a handler's panic answers
//! `500 internal` and its keep-alive connection goes on serving; `x-request-id` is taken when
//! valid, made otherwise, returned on every answer and written in the request's log lines; the
//! bearer and lease tokens never reach the log, even at `TRACE`.

use std::time::Duration;

use lockbroker_test_support::app::{spawn_app, spawn_app_with_panic_route};
use lockbroker_test_support::auth_entry;
use lockbroker_test_support::broker::{BrokerCommand, BrokerProcess, listen_on};
use lockbroker_test_support::http::{Answer, lock_path};
use lockbroker_test_support::temp::temp_file;
use reqwest::{Client, Method, StatusCode};
use tokio::io::AsyncWriteExt;

use crate::limits::{connect, read_answer};

/// The binary under test; Cargo builds it before this suite.
const BINARY: &str = env!("CARGO_BIN_EXE_lockbroker");

/// The route whose handler panics, served only by a broker built to serve it
/// (`Application::build_with_panic_route`, which no flag, variable or file reaches).
const PANIC_ROUTE: &str = "/_test/panic";

/// The value of header `name` in a raw answer's head.
fn head_header<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.lines().find_map(|line| {
        let (field, value) = line.split_once(':')?;
        field.eq_ignore_ascii_case(name).then(|| value.trim())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_answers_500_internal_and_its_connection_serves_the_next_request() {
    let app = spawn_app_with_panic_route().await;
    let mut stream = connect(&app).await;
    let panic_request =
        format!("GET {PANIC_ROUTE} HTTP/1.1\r\nHost: x\r\nX-Request-Id: the-panic-1\r\n\r\n");
    stream.write_all(panic_request.as_bytes()).await.unwrap();
    let (status, head, body) = read_answer(&mut stream).await;
    assert_eq!(status, 500, "{head}\n{body}");
    assert_eq!(body["error"], "internal", "{body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert_eq!(head_header(&head, "content-type"), Some("application/json"));
    assert_eq!(head_header(&head, "x-request-id"), Some("the-panic-1"));
    assert!(
        !head.to_ascii_lowercase().contains("connection: close"),
        "the panic closed the connection:\n{head}"
    );

    // The same connection, kept alive: a lock is granted on it, and inspected.
    stream
        .write_all(b"POST /locks/after-the-panic HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        .await
        .expect("the connection is still open");
    let (status, head, grant) = read_answer(&mut stream).await;
    assert_eq!(status, 201, "{head}\n{grant}");
    stream
        .write_all(b"GET /locks/after-the-panic HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (status, head, held) = read_answer(&mut stream).await;
    assert_eq!(status, 200, "{head}\n{held}");
    assert_eq!(held["fence"], grant["fence"], "{held}");

    // And the broker as a whole goes on: another panic, another 500, from a pooled client.
    app.get(PANIC_ROUTE)
        .await
        .expect_error(StatusCode::INTERNAL_SERVER_ERROR, "internal");
    app.get("/readyz").await.expect_status(StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_panic_route_is_not_served_by_a_broker_built_as_usual() {
    let app = spawn_app(None).await;
    app.get(PANIC_ROUTE)
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_found");
}

/// The request id of an answer, which every answer has.
fn request_id(answer: &Answer) -> String {
    answer
        .header("x-request-id")
        .unwrap_or_else(|| panic!("no x-request-id on the answer: {answer:?}"))
        .to_owned()
}

fn assert_made(id: &str) {
    assert!(
        (1..=20).contains(&id.len()) && id.bytes().all(|c| c.is_ascii_digit()),
        "{id:?} is not a made request id (a 64-bit number in decimal)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_sent_comes_back_on_every_kind_of_answer() {
    let app = spawn_app(None).await;
    let cases: [(Method, &str, &str, usize, u16); 7] = [
        (Method::POST, "/locks/ids", "acquire-1", 0, 201),
        (Method::POST, "/locks/ids", "acquire-2", 0, 409),
        (
            Method::GET,
            "/healthz",
            "0f8fad5b-d9cb-469f-a165-70867728950e",
            0,
            200,
        ),
        (Method::GET, "/no/such/path", "svc.a:42/x+y=", 0, 404),
        (Method::PUT, "/locks/ids", "put", 0, 405),
        (Method::POST, "/locks/ids?ttl=1", "typo", 0, 400),
        // Refused by the body limit before any route runs.
        (Method::POST, "/locks/big", "too-big", 20 * 1024, 413),
    ];
    for (method, path, id, body, status) in cases {
        let request = app
            .request(method, path)
            .header("x-request-id", id)
            .body(vec![b'x'; body]);
        let answer = app.send(request).await;
        answer.expect_status(StatusCode::from_u16(status).unwrap());
        assert_eq!(request_id(&answer), id, "{answer:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_valid_id_gets_a_new_one() {
    let app = spawn_app(None).await;
    let first = request_id(&app.get("/healthz").await);
    let second = request_id(&app.acquire("made-ids", "").await);
    assert_made(&first);
    assert_made(&second);
    assert_ne!(first, second, "two requests got the same id");

    let too_long = "x".repeat(65);
    for invalid in [too_long.as_str(), "two words", "quote\"d", "{json}", ""] {
        let answer = app
            .send(
                app.request(Method::GET, "/healthz")
                    .header("x-request-id", invalid),
            )
            .await;
        answer.expect_status(StatusCode::OK);
        let id = request_id(&answer);
        assert_made(&id);
        assert_ne!(id, invalid);
    }
    // Bytes that are not text at all.
    let answer = app
        .send(app.request(Method::GET, "/healthz").header(
            "x-request-id",
            reqwest::header::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
        ))
        .await;
    assert_made(&request_id(&answer));
    // The longest kept.
    let longest = "y".repeat(64);
    let answer = app
        .send(
            app.request(Method::GET, "/healthz")
                .header("x-request-id", &longest),
        )
        .await;
    assert_eq!(request_id(&answer), longest);
}

const BEARER: &str = "bearer-secret-never-logged-4f1c9a";
const UNKNOWN_BEARER: &str = "unknown-secret-never-logged-77d0e2";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_in_headers_never_reach_the_log_even_at_trace() {
    let auth = temp_file("auth", "toml");
    std::fs::write(
        &auth,
        auth_entry(
            "locker",
            &format!("token = {BEARER:?}"),
            &["jobs:"],
            &["lock"],
        ),
    )
    .unwrap();
    let auth_path = auth.clone();
    let mut broker = BrokerProcess::start(BrokerCommand::configured(BINARY, move |c, port| {
        listen_on(c, port);
        c.arg("--auth-file")
            .arg(&auth_path)
            .env("LOCKBROKER_LOG_LEVEL", "trace");
    }))
    .await;
    let mut lease_tokens = Vec::new();
    // HTTP/1.1 and HTTP/2 (whose library logs frames at TRACE).
    let http1 = Client::new();
    let http2 = Client::builder().http2_prior_knowledge().build().unwrap();
    for (n, client) in [http1, http2].iter().enumerate() {
        let path = broker.url(&lock_path(&format!("jobs:{n}"), ""));
        let grant = Answer::read(
            client
                .post(&path)
                .bearer_auth(BEARER)
                .header("x-request-id", format!("traced-{n}"))
                .send()
                .await
                .unwrap(),
        )
        .await
        .expect_grant(StatusCode::CREATED);
        let renew = broker.url(&lock_path(&format!("jobs:{n}/renew"), ""));
        let renewed = client
            .post(&renew)
            .bearer_auth(BEARER)
            .header("Lock-Token", &grant.token)
            .send()
            .await
            .unwrap();
        assert_eq!(renewed.status(), StatusCode::OK);
        let refused = client
            .delete(&path)
            .bearer_auth(UNKNOWN_BEARER)
            .header("Lock-Token", &grant.token)
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
        let released = client
            .delete(&path)
            .bearer_auth(BEARER)
            .header("Lock-Token", &grant.token)
            .send()
            .await
            .unwrap();
        assert_eq!(released.status(), StatusCode::NO_CONTENT);
        lease_tokens.push(grant.token);
    }
    // Every line written: the broker has stopped.
    assert!(broker.terminate(Duration::from_secs(10)).await.success());
    let output = broker.output();
    let _ = std::fs::remove_file(&auth);

    for secret in [BEARER, UNKNOWN_BEARER]
        .into_iter()
        .chain(lease_tokens.iter().map(String::as_str))
    {
        assert!(
            !output.contains(secret),
            "{secret} is in the broker's log:\n{output}"
        );
    }
    // And it looked where the headers would be: the TRACE line of each request's headers,
    // with the sensitive ones masked, in the span that carries the request id.
    assert!(
        output.contains("request headers") && output.contains("Sensitive"),
        "no TRACE line of the request headers:\n{output}"
    );
    for n in 0..2 {
        assert!(
            output.contains(&format!("request_id=traced-{n}")),
            "the request id is not in the request's log lines:\n{output}"
        );
    }
}
