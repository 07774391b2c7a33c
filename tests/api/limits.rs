//! Connection limits over raw sockets: the header timeout (a slow head, an idle connection),
//! heads over 16 KiB answered `431`, a huge announced body answered `413` at once, hyper's own
//! rejections with the JSON error body, `max_connections`, and many idle connections that do not
//! keep other clients from being served.

use std::time::{Duration, Instant};

use lockbroker_test_support::app::{TestApp, spawn_app_with};
use reqwest::StatusCode;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub(crate) async fn connect(app: &TestApp) -> TcpStream {
    let addr = app.address.trim_start_matches("http://");
    TcpStream::connect(addr)
        .await
        .expect("connect to the broker")
}

/// Reads until the peer closes (or `limit` passes, which fails the test); returns what came.
async fn read_to_close(stream: &mut TcpStream, limit: Duration) -> Vec<u8> {
    let mut out = Vec::new();
    tokio::time::timeout(limit, stream.read_to_end(&mut out))
        .await
        .unwrap_or_else(|_| panic!("the broker kept the connection open past {limit:?}"))
        .ok();
    out
}

/// Sends raw bytes on a new connection and reads one answer (status and JSON body) until the
/// broker closes the connection or the body is complete.
async fn raw_answer(app: &TestApp, request: &[u8]) -> (u16, Value) {
    let mut stream = connect(app).await;
    stream.write_all(request).await.expect("send the request");
    let (status, _head, json) = read_answer(&mut stream).await;
    (status, json)
}

/// Reads one answer from `stream`: its status, its head (status line and header fields) and its
/// JSON body, complete by its `Content-Length` or by the broker closing the connection.
pub(crate) async fn read_answer(stream: &mut TcpStream) -> (u16, String, Value) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = tokio::time::timeout_at(deadline.into(), stream.read(&mut buf))
            .await
            .expect("an answer within 5 s")
            .unwrap_or(0);
        out.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&out);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse::<usize>().unwrap())
            });
            if n == 0 || length.is_some_and(|len| body.len() >= len) {
                let status = head[9..12].parse().expect("a status");
                let json = serde_json::from_str(body)
                    .unwrap_or_else(|e| panic!("not a JSON body ({e}): {text:?}"));
                return (status, head.to_owned(), json);
            }
        }
        assert!(n > 0, "the connection closed before an answer: {text:?}");
    }
}

fn assert_error(answer: &(u16, Value), status: u16, code: &str) {
    assert_eq!(answer.0, status, "{}", answer.1);
    assert_eq!(answer.1["error"], code, "{}", answer.1);
    assert!(answer.1["message"].as_str().is_some_and(|m| !m.is_empty()));
}

async fn spawn_with_header_timeout(ms: u64) -> TestApp {
    spawn_app_with(None, |c| c.header_timeout_ms = Some(ms)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sending_its_head_a_byte_at_a_time_is_cut_off_after_the_header_timeout() {
    let app = spawn_with_header_timeout(600).await;
    let mut stream = connect(&app).await;
    let started = Instant::now();
    let head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut cut_off = false;
    for byte in head {
        // The slow client itself: one byte every 50 ms, never the end of the head.
        if stream.write_all(&[*byte]).await.is_err() {
            cut_off = true;
            break;
        }
        let mut probe = [0u8; 1];
        if let Ok(Ok(0)) =
            tokio::time::timeout(Duration::from_millis(50), stream.read(&mut probe)).await
        {
            cut_off = true;
            break;
        }
    }
    assert!(
        cut_off,
        "a head sent a byte every 50 ms was still read after {:?}",
        started.elapsed()
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(550) && took < Duration::from_millis(2000),
        "cut off after {took:?}, not about the 600 ms header timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_after_the_header_timeout_before_and_between_requests() {
    let app = spawn_with_header_timeout(500).await;
    // Nothing sent at all.
    let mut silent = connect(&app).await;
    let started = Instant::now();
    read_to_close(&mut silent, Duration::from_secs(3)).await;
    assert!(started.elapsed() >= Duration::from_millis(450));
    // A request, then nothing: the kept-alive connection is closed after the same time.
    let mut kept = connect(&app).await;
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let answer = read_to_close(&mut kept, Duration::from_secs(3)).await;
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
    assert!(started.elapsed() >= Duration::from_millis(450));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_heads_over_16_kib_are_answered_431_with_the_json_error_body() {
    let app = spawn_app_with(None, |_| {}).await;
    for size in [20 * 1024, 100 * 1024] {
        let request = format!(
            "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
            "a".repeat(size)
        );
        let answer = raw_answer(&app, request.as_bytes()).await;
        assert_error(&answer, 431, "request_header_fields_too_large");
    }
    // Through a real client too, and a head just under the limit is served.
    let big = app
        .send(
            app.request(reqwest::Method::GET, "/healthz")
                .header("X-Big", "a".repeat(20 * 1024)),
        )
        .await;
    big.expect_error(
        StatusCode::from_u16(431).unwrap(),
        "request_header_fields_too_large",
    );
    let fits = app
        .send(
            app.request(reqwest::Method::GET, "/healthz")
                .header("X-Big", "a".repeat(15 * 1024)),
        )
        .await;
    fits.expect_status(StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_framework_s_own_rejections_carry_the_json_error_body() {
    let app = spawn_app_with(None, |_| {}).await;
    let many_headers: String = (0..120).map(|i| format!("X-H{i}: a\r\n")).collect();
    let cases: [(&[u8], u16, &str); 5] = [
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, "invalid_request"),
        (b"GET /health\x01z HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_request"),
        (b"GET /healthz HTTP/1.1\r\nHo st: x\r\n\r\n", 400, "invalid_request"),
        (
            b"POST /locks/a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            400,
            "invalid_request",
        ),
        (
            format!("GET /healthz HTTP/1.1\r\nHost: x\r\n{many_headers}\r\n").leak().as_bytes(),
            431,
            "request_header_fields_too_large",
        ),
    ];
    for (request, status, code) in cases {
        let answer = raw_answer(&app, request).await;
        assert_error(&answer, status, code);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_announced_body_is_answered_413_at_once() {
    let app = spawn_app_with(None, |_| {}).await;
    let started = Instant::now();
    let answer = raw_answer(
        &app,
        b"POST /locks/huge HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n{}",
    )
    .await;
    assert_error(&answer, 413, "payload_too_large");
    assert!(started.elapsed() < Duration::from_secs(1));
    // And nothing was granted.
    app.inspect("huge")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_max_connections_wait_until_one_closes() {
    let app = spawn_app_with(None, |c| c.max_connections = Some(2)).await;
    let first = connect(&app).await;
    let _second = connect(&app).await;
    // Both taken (idle, within the header timeout): a third client is not answered...
    let mut third = connect(&app).await;
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    assert!(
        tokio::time::timeout(Duration::from_millis(300), third.read(&mut buf))
            .await
            .is_err(),
        "a third connection was served past max_connections = 2"
    );
    // ...until one of them goes.
    drop(first);
    let answer = read_to_close(&mut third, Duration::from_secs(3)).await;
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_connections_behind_max_connections_50_all_connect_and_are_served() {
    const CLIENTS: usize = 200;
    // Idle connections are not cut off while the test holds them.
    let app = spawn_app_with(None, |c| {
        c.max_connections = Some(50);
        c.header_timeout_ms = Some(60_000);
    })
    .await;
    let addr = app.address.trim_start_matches("http://").to_owned();
    // Every client connects, all at once, and sends nothing until all of them are connected:
    // 50 are taken by the broker, the other 150 wait in the kernel's listen queue. With a queue
    // shorter than that, the connects past it are dropped and retried in vain, as no taken
    // connection goes away meanwhile.
    let connected = std::sync::Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..CLIENTS {
        let (addr, connected) = (addr.clone(), connected.clone());
        clients.spawn(async move {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            connected.wait().await;
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .expect("send the request");
            let mut answer = Vec::new();
            stream
                .read_to_end(&mut answer)
                .await
                .expect("read the answer");
            answer
        });
    }
    let mut served = 0;
    // A bound on the whole run, not a measurement: a connect the queue dropped is retried for
    // minutes.
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(answer) = clients.join_next().await {
            let answer = answer.expect("a client task");
            assert!(
                answer.starts_with(b"HTTP/1.1 200"),
                "{:?}",
                String::from_utf8_lossy(&answer)
            );
            served += 1;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{served} of {CLIENTS} connections were served within 60 s"));
    assert_eq!(served, CLIENTS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_idle_and_slow_connections_do_not_keep_other_clients_from_being_served() {
    let app = spawn_app_with(None, |_| {}).await;
    let mut idle = Vec::new();
    for i in 0..300 {
        let mut stream = connect(&app).await;
        if i % 2 == 0 {
            // Half of them start a head and stall.
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost")
                .await
                .unwrap();
        }
        idle.push(stream);
    }
    let started = Instant::now();
    for i in 0..20 {
        let key = format!("busy-{i}");
        let grant = app.grant(&key, "").await;
        app.release_ok(&key, &grant.token).await;
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "20 lock cycles took {:?} beside 300 idle connections",
        started.elapsed()
    );
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_with_no_stream_is_closed_after_the_header_timeout() {
    let app = spawn_with_header_timeout(500).await;
    // Served over HTTP/2 first: the broker speaks h2c with prior knowledge.
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let answer = h2.get(app.url("/healthz")).send().await.unwrap();
    assert_eq!(answer.version(), reqwest::Version::HTTP_2);
    // A connection that opens no stream: the preface and an empty SETTINGS frame, then nothing.
    let mut stream = connect(&app).await;
    stream
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let started = Instant::now();
    // It sends GOAWAY after 500 ms; this client answers no ping, so it is dropped 500 ms later.
    let got = read_to_close(&mut stream, Duration::from_secs(3)).await;
    assert!(
        started.elapsed() >= Duration::from_millis(450),
        "closed after {:?}",
        started.elapsed()
    );
    // The broker said goodbye properly: a GOAWAY frame (type 7) is among what it sent.
    let mut at = 0;
    let mut goaway = false;
    while at + 9 <= got.len() {
        let len =
            usize::from(got[at]) << 16 | usize::from(got[at + 1]) << 8 | usize::from(got[at + 2]);
        goaway |= got[at + 3] == 7;
        at += 9 + len;
    }
    assert!(goaway, "no GOAWAY in {got:?}");
}
