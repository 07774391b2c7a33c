//! Speaking the API over HTTP: the test client, an answer read to its end with assertions on
//! the API's formats ([`Answer`]), and the grant body ([`Grant`]). These follow the API's
//! contract and do not reuse `lockbroker-client`'s types, so that a change to the API fails
//! the tests even when the client changed along with it. Also what tests wait for: a metric to
//! reach a value ([`until_metric`], [`until_waiting`]), a waiter's grant soon after a release
//! ([`granted_within`]).

use std::time::{Duration, Instant};

use reqwest::header::HeaderMap;
use reqwest::{Client, RequestBuilder, Response, StatusCode};
use serde::Deserialize;
use serde_json::Value;
use tokio::task::JoinHandle;

/// Bound on any one HTTP request from a test: above the longest wait a test asks for (30 s in
/// the concurrency test) plus the store timeout, so only a hung broker trips it.
const REQUEST_LIMIT: Duration = Duration::from_secs(45);

/// A client for the tests: never through a proxy (the brokers are on loopback), and bounded.
pub fn http_client() -> Client {
    Client::builder()
        .no_proxy()
        .timeout(REQUEST_LIMIT)
        .build()
        .expect("cannot build the HTTP client")
}

/// The body of a grant (`201` on acquire, `200` on renew). Exactly these fields: an extra one
/// (a second token, say) fails to parse.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    pub key: String,
    pub token: String,
    pub fence: u64,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    /// A lease under a session: when the session ends (equal to `expires_at_ms`).
    #[serde(default)]
    pub session_expires_at_ms: Option<u64>,
}

impl Grant {
    /// Asserts that this grant's fence is above `earlier`'s, granted before `what` happened (a
    /// restart, a loss of the store's data): fences never go back.
    pub fn assert_fence_above(&self, earlier: &Grant, what: &str) {
        assert!(
            self.fence > earlier.fence,
            "fence {} after {what}, {} before",
            self.fence,
            earlier.fence
        );
    }
}

/// A response read to the end: status, headers and the raw body.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub text: String,
}

impl Answer {
    /// Sends `request` (it must reach the server) and reads its whole answer.
    pub async fn send(request: RequestBuilder) -> Self {
        Self::read(
            request
                .send()
                .await
                .expect("the request must reach the broker"),
        )
        .await
    }

    pub async fn read(response: Response) -> Self {
        let status = response.status();
        let headers = response.headers().clone();
        let text = response
            .text()
            .await
            .expect("cannot read the response body");
        Self {
            status,
            headers,
            text,
        }
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("the body is not JSON ({e}): {:?}", self.text))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("an ASCII header"))
    }

    /// Asserts the status, with the body in the failure message.
    pub fn expect_status(&self, status: StatusCode) -> &Self {
        assert_eq!(
            self.status, status,
            "unexpected answer, body: {}",
            self.text
        );
        self
    }

    /// Asserts an error answer in the API's format: this status, a JSON body whose `error` is
    /// `code` and whose `message` is a non-empty sentence. Returns the body.
    pub fn expect_error(&self, status: StatusCode, code: &str) -> Value {
        self.expect_status(status);
        assert!(
            self.header("content-type")
                .is_some_and(|t| t.starts_with("application/json")),
            "an error must be JSON, got content-type {:?}",
            self.header("content-type")
        );
        let body = self.json();
        assert_eq!(body["error"], code, "wrong error code in {body}");
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|m| !m.trim().is_empty()),
            "an error needs a message: {body}"
        );
        let extra: Vec<&String> = body
            .as_object()
            .expect("an error body is an object")
            .keys()
            .filter(|k| !matches!(k.as_str(), "error" | "message" | "retry_after_ms"))
            // `limit_mismatch` names the limit the semaphore's holders use.
            .filter(|k| !(code == "limit_mismatch" && k.as_str() == "limit"))
            // A several-keys acquire's `locked` names the keys that were busy.
            .filter(|k| !(code == "locked" && k.as_str() == "held"))
            .collect();
        assert!(extra.is_empty(), "unexpected fields {extra:?} in {body}");
        body
    }

    /// Asserts a grant with this status and parses it.
    pub fn expect_grant(&self, status: StatusCode) -> Grant {
        self.expect_status(status);
        serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("not a grant body ({e}): {}", self.text))
    }
}

/// `/locks/{key}`, with `?{query}` when there is one.
pub fn lock_path(key: &str, query: &str) -> String {
    if query.is_empty() {
        format!("/locks/{key}")
    } else {
        format!("/locks/{key}?{query}")
    }
}

/// Asserts that the JSON object `value` has exactly the fields `expected`, in any order: what
/// the broker sends, and nothing more.
pub fn assert_fields(value: &Value, expected: &[&str]) {
    let mut fields: Vec<&str> = value
        .as_object()
        .unwrap_or_else(|| panic!("not a JSON object: {value}"))
        .keys()
        .map(String::as_str)
        .collect();
    fields.sort_unstable();
    let mut expected = expected.to_vec();
    expected.sort_unstable();
    assert_eq!(fields, expected, "{value}");
}

/// A series' value on the broker at `address` (its `/metrics`), 0 if it is not there yet.
pub async fn metric(address: &str, series: &str) -> f64 {
    let text = http_client()
        .get(format!("{address}/metrics"))
        .send()
        .await
        .expect("the broker answers")
        .text()
        .await
        .expect("a metrics body");
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits until `series` on the broker at `address` reaches `at_least`, for at most `limit`.
pub async fn until_metric(address: &str, series: &str, at_least: f64, limit: Duration) {
    let started = Instant::now();
    loop {
        let value = metric(address, series).await;
        if value >= at_least {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "{series} was {value}, not {at_least}, after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `n` acquires wait on the broker at `address` (its `lockbroker_waiters`), for
/// at most 5 s.
pub async fn until_waiting(address: &str, n: u64) {
    until_metric(
        address,
        "lockbroker_waiters",
        n as f64,
        Duration::from_secs(5),
    )
    .await;
}

/// A waiting acquire's grant (`201`), which must come within `limit` of `released` (the
/// release notice woke it, not its own poll).
pub async fn granted_within(
    waiter: JoinHandle<Answer>,
    released: Instant,
    limit: Duration,
) -> Grant {
    let grant = waiter
        .await
        .expect("the waiter task")
        .expect_grant(StatusCode::CREATED);
    assert!(
        released.elapsed() < limit,
        "the waiter was granted {:?} after the release: the notice did not wake it",
        released.elapsed()
    );
    grant
}
