//! `GET /metrics` after known traffic over HTTP: every series counts exactly what was sent, on
//! the embedded store and on Redis (where an outage must show as store errors), and the
//! exposition is well-formed OpenMetrics text that Prometheus can scrape.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lockbroker_test_support::app::{TestApp, spawn_app_with};
use lockbroker_test_support::http::Grant;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::StatusCode;

use crate::waiting::answer_within;

/// The content type of the OpenMetrics text format, which Prometheus negotiates for.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long the tests give a waiter to show in `lockbroker_waiters` (or to leave it).
const GAUGE_LIMIT: Duration = Duration::from_secs(10);

/// A short store timeout keeps the outage quick; Redis is killed, so calls fail at once anyway.
const STORE_TIMEOUT_MS: u64 = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_known_traffic_on_the_embedded_store() {
    let app = spawn_app_with(None, |_| {}).await;
    known_traffic(&app).await;
    let m = scrape(&app).await;
    assert!(
        m.samples_of("lockbroker_store_errors_total")
            .all(|s| s.value == 0.0),
        "the embedded store never fails: {:?}",
        m.samples_of("lockbroker_store_errors_total")
            .collect::<Vec<_>>()
    );
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_known_traffic_and_a_redis_outage_on_redis() {
    let mut redis = RedisServer::start().await;
    let app = spawn_app_with(Some(redis.url()), |c| {
        c.store_timeout_ms = Some(STORE_TIMEOUT_MS);
    })
    .await;
    // Release notices wake the waiter at once rather than at its fallback poll.
    redis.wait_until_listening(1).await;
    let held = known_traffic(&app).await;
    let before = scrape(&app).await;
    assert_eq!(
        before.sum_of("lockbroker_store_errors_total"),
        0.0,
        "no store errors before the outage"
    );

    // Redis dies: every store call fails, and each kind is counted.
    redis.stop();
    for _ in 0..2 {
        app.acquire("m:outage", "")
            .await
            .expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
    }
    app.release("m:a", &held.token)
        .await
        .expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
    app.renew("m:a", &held.token, "")
        .await
        .expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");

    // /metrics does not need the store: it still answers.
    let m = scrape(&app).await;
    m.expect(
        "lockbroker_acquisitions_total",
        &[("kind", "exclusive"), ("result", "error")],
        2.0,
    );
    m.expect(
        "lockbroker_releases_total",
        &[("space", "locks"), ("result", "error")],
        1.0,
    );
    m.expect(
        "lockbroker_renewals_total",
        &[("space", "locks"), ("result", "error")],
        1.0,
    );
    // The counts from before the outage stand.
    m.expect(
        "lockbroker_acquisitions_total",
        &[("kind", "exclusive"), ("result", "granted")],
        6.0,
    );
    m.expect(
        "lockbroker_releases_total",
        &[("space", "locks"), ("result", "released")],
        2.0,
    );
    // One failed claim per acquire (each acquire gave up on its first store call).
    let claim_errors = m.value("lockbroker_store_errors_total", &[("op", "claim")]);
    assert!(
        (1.0..=2.0).contains(&claim_errors),
        "store errors on claim during the outage: {claim_errors}"
    );
    for op in ["release", "renew"] {
        assert!(
            m.value("lockbroker_store_errors_total", &[("op", op)]) >= 1.0,
            "no store error counted for {op} during the outage"
        );
    }
    assert!(m.value("lockbroker_store_call_seconds_count", &[("op", "claim")]) >= 8.0);
    m.expect("lockbroker_waiters", &[], 0.0);
    app.shutdown().await;
}

/// Sends known traffic to a fresh broker, checks the counts after it, and returns the grant
/// still held at the end (key `m:a`).
async fn known_traffic(app: &TestApp) -> Grant {
    // Nothing counted yet, but every result's series is there from the first scrape.
    let fresh = scrape(app).await;
    for result in ["granted", "locked", "error"] {
        fresh.expect(
            "lockbroker_acquisitions_total",
            &[("kind", "exclusive"), ("result", result)],
            0.0,
        );
    }
    for family in ["lockbroker_renewals_total", "lockbroker_releases_total"] {
        let results = if family == "lockbroker_renewals_total" {
            ["renewed", "not_held", "not_owner", "error"]
        } else {
            ["released", "not_held", "not_owner", "error"]
        };
        for result in results {
            fresh.expect(family, &[("space", "locks"), ("result", result)], 0.0);
        }
    }
    fresh.expect("lockbroker_takeovers_total", &[], 0.0);
    fresh.expect("lockbroker_acquire_wait_seconds_count", &[], 0.0);
    fresh.expect("lockbroker_hold_seconds_count", &[], 0.0);
    fresh.expect("lockbroker_waiters", &[], 0.0);

    // 3 grants, then 2 acquires refused as locked.
    let a = app.grant("m:a", "ttl_ms=30000").await;
    let b = app.grant("m:b", "ttl_ms=30000").await;
    let c = app.grant("m:c", "ttl_ms=30000").await;
    for _ in 0..2 {
        app.expect_locked("m:a", "wait_ms=0").await;
    }

    // Renewals: renewed, not_owner (someone else's live lease), not_held (a free key).
    app.renew("m:a", &a.token, "ttl_ms=30000")
        .await
        .expect_status(StatusCode::OK);
    app.renew("m:b", &c.token, "")
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
    app.renew("m:free", &c.token, "")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");

    // Releases: not_owner, released, then not_held.
    app.release("m:b", &c.token)
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
    app.release_ok("m:b", &b.token).await;
    app.release("m:b", &b.token)
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");

    // A takeover: a short lease expires and the next acquire takes it over; its old holder's
    // release then finds someone else's lease.
    let short = app.grant("m:short", "ttl_ms=50").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let took = app.grant("m:short", "ttl_ms=30000").await;
    assert!(took.fence > short.fence);
    app.release("m:short", &short.token)
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");

    let m = scrape(app).await;
    m.expect(
        "lockbroker_acquisitions_total",
        &[("kind", "exclusive"), ("result", "granted")],
        5.0,
    );
    m.expect("lockbroker_takeovers_total", &[], 1.0);
    m.expect("lockbroker_waiters", &[], 0.0);

    // A waiter parks on m:a, shows in the gauge, is granted when m:a is released, and leaves.
    let waiter = app.spawn_acquire("m:a", "wait_ms=10000&ttl_ms=30000");
    let parked = wait_for_waiters(app, 1.0).await;
    parked.expect(
        "lockbroker_acquisitions_total",
        &[("kind", "exclusive"), ("result", "granted")],
        5.0,
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    app.release_ok("m:a", &a.token).await;
    let next = answer_within(waiter, Duration::from_secs(5))
        .await
        .expect_grant(StatusCode::CREATED);
    wait_for_waiters(app, 0.0).await;

    let m = scrape(app).await;
    m.expect(
        "lockbroker_acquisitions_total",
        &[("kind", "exclusive"), ("result", "granted")],
        6.0,
    );
    m.expect(
        "lockbroker_acquisitions_total",
        &[("kind", "exclusive"), ("result", "locked")],
        2.0,
    );
    m.expect(
        "lockbroker_acquisitions_total",
        &[("kind", "exclusive"), ("result", "error")],
        0.0,
    );
    m.expect(
        "lockbroker_renewals_total",
        &[("space", "locks"), ("result", "renewed")],
        1.0,
    );
    m.expect(
        "lockbroker_renewals_total",
        &[("space", "locks"), ("result", "not_owner")],
        1.0,
    );
    m.expect(
        "lockbroker_renewals_total",
        &[("space", "locks"), ("result", "not_held")],
        1.0,
    );
    m.expect(
        "lockbroker_renewals_total",
        &[("space", "locks"), ("result", "error")],
        0.0,
    );
    m.expect(
        "lockbroker_releases_total",
        &[("space", "locks"), ("result", "released")],
        2.0,
    );
    m.expect(
        "lockbroker_releases_total",
        &[("space", "locks"), ("result", "not_owner")],
        2.0,
    );
    m.expect(
        "lockbroker_releases_total",
        &[("space", "locks"), ("result", "not_held")],
        1.0,
    );
    m.expect(
        "lockbroker_releases_total",
        &[("space", "locks"), ("result", "error")],
        0.0,
    );
    m.expect("lockbroker_takeovers_total", &[], 1.0);
    // A wait is observed per grant; a hold per release that released.
    m.expect("lockbroker_acquire_wait_seconds_count", &[], 6.0);
    m.expect("lockbroker_hold_seconds_count", &[], 2.0);
    let waited = m.value("lockbroker_acquire_wait_seconds_sum", &[]);
    assert!(waited >= 0.1, "the waiter waited ≥ 100 ms, sum {waited}");
    let held = m.value("lockbroker_hold_seconds_sum", &[]);
    assert!(held >= 0.1, "m:a was held ≥ 100 ms, sum {held}");
    m.expect("lockbroker_waiters", &[], 0.0);
    // Exactly one takeover was attempted; every acquire started with a claim.
    m.expect(
        "lockbroker_store_call_seconds_count",
        &[("op", "take_over")],
        1.0,
    );
    assert!(m.value("lockbroker_store_call_seconds_count", &[("op", "claim")]) >= 8.0);
    next
}

/// Polls `/metrics` until `lockbroker_waiters` shows `count`, for at most [`GAUGE_LIMIT`].
async fn wait_for_waiters(app: &TestApp, count: f64) -> Metrics {
    let started = Instant::now();
    loop {
        let m = scrape(app).await;
        let now = m.value("lockbroker_waiters", &[]);
        if now == count {
            return m;
        }
        assert!(
            started.elapsed() < GAUGE_LIMIT,
            "lockbroker_waiters is {now}, not {count}, after {GAUGE_LIMIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `GET /metrics`: asserts `200`, the OpenMetrics content type and a well-formed exposition.
pub(crate) async fn scrape(app: &TestApp) -> Metrics {
    let answer = app.get("/metrics").await;
    answer.expect_status(StatusCode::OK);
    assert_eq!(answer.header("content-type"), Some(OPENMETRICS));
    Metrics::parse(&answer.text)
}

/// One sample line: `name{label="value",...} value`.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    pub(crate) name: String,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) value: f64,
}

/// A parsed exposition.
pub(crate) struct Metrics {
    pub(crate) samples: Vec<Sample>,
    pub(crate) text: String,
}

impl Metrics {
    /// Parses the OpenMetrics text format, asserting as it goes that it is well-formed: comment
    /// lines are `# HELP`, `# TYPE`, `# UNIT` or the final `# EOF`; every other line is one
    /// sample, `name{labels} value`, of the family the last `# TYPE` declared, with a suffix
    /// that family's type allows; no series appears twice; and histograms are consistent.
    fn parse(text: &str) -> Self {
        let body = text
            .strip_suffix("# EOF\n")
            .or_else(|| text.strip_suffix("# EOF"))
            .unwrap_or_else(|| panic!("the exposition must end with `# EOF`:\n{text}"));
        let mut samples = Vec::new();
        let mut family: Option<(String, String)> = None;
        let mut families_seen = Vec::new();
        for line in body.lines() {
            assert!(!line.is_empty(), "an empty line in the exposition:\n{text}");
            if let Some(comment) = line.strip_prefix("# ") {
                let mut parts = comment.splitn(3, ' ');
                let (kind, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                assert!(valid_name(name), "bad metric name in {line:?}");
                match kind {
                    "TYPE" => {
                        let ty = parts.next().unwrap_or("");
                        assert!(
                            matches!(
                                ty,
                                "counter"
                                    | "gauge"
                                    | "histogram"
                                    | "gaugehistogram"
                                    | "summary"
                                    | "info"
                                    | "stateset"
                                    | "unknown"
                            ),
                            "unknown type in {line:?}"
                        );
                        assert!(
                            !families_seen.contains(&name.to_owned()),
                            "family {name} declared twice"
                        );
                        families_seen.push(name.to_owned());
                        family = Some((name.to_owned(), ty.to_owned()));
                    }
                    "HELP" | "UNIT" => {}
                    _ => panic!("unexpected comment line {line:?}"),
                }
                continue;
            }
            let sample = parse_sample(line);
            let (fam, ty) = family
                .as_ref()
                .unwrap_or_else(|| panic!("sample {line:?} before any # TYPE"));
            let suffix = sample.name.strip_prefix(fam.as_str()).unwrap_or_else(|| {
                panic!("sample {line:?} is not of the family {fam} declared before it")
            });
            let allowed: &[&str] = match ty.as_str() {
                "counter" => &["_total", "_created"],
                "histogram" | "gaugehistogram" => &["_bucket", "_count", "_sum", "_created"],
                "summary" => &["", "_count", "_sum", "_created"],
                "info" => &["_info"],
                _ => &[""],
            };
            assert!(
                allowed.contains(&suffix),
                "sample {line:?}: suffix {suffix:?} does not fit a {ty}"
            );
            if ty == "counter" && suffix == "_total" {
                assert!(sample.value >= 0.0, "a negative counter: {line:?}");
            }
            assert!(
                !samples
                    .iter()
                    .any(|s: &Sample| s.name == sample.name && s.labels == sample.labels),
                "series {line:?} appears twice"
            );
            samples.push(sample);
        }
        let metrics = Self {
            samples,
            text: text.to_owned(),
        };
        metrics.check_histograms();
        metrics
    }

    /// Each histogram series: buckets never decrease, and the `+Inf` bucket equals `_count`.
    fn check_histograms(&self) {
        for count in self.samples.iter().filter(|s| s.name.ends_with("_count")) {
            let base = count.name.trim_end_matches("_count");
            let bucket_name = format!("{base}_bucket");
            let mut buckets: Vec<(f64, f64)> = self
                .samples
                .iter()
                .filter(|s| s.name == bucket_name)
                .filter(|s| {
                    let mut rest = s.labels.clone();
                    rest.remove("le");
                    rest == count.labels
                })
                .map(|s| {
                    let le = s.labels.get("le").expect("a bucket has an le label");
                    let bound = if le == "+Inf" {
                        f64::INFINITY
                    } else {
                        le.parse().expect("a numeric le")
                    };
                    (bound, s.value)
                })
                .collect();
            if buckets.is_empty() {
                continue; // a summary's _count
            }
            buckets.sort_by(|x, y| x.0.total_cmp(&y.0));
            assert!(
                buckets.windows(2).all(|w| w[0].1 <= w[1].1),
                "{bucket_name}{:?}: buckets decrease: {buckets:?}",
                count.labels
            );
            let last = buckets.last().expect("not empty");
            assert!(
                last.0.is_infinite() && last.1 == count.value,
                "{bucket_name}{:?}: the +Inf bucket must equal _count {}: {buckets:?}",
                count.labels,
                count.value
            );
        }
    }

    fn find(&self, name: &str, labels: &[(&str, &str)]) -> Option<&Sample> {
        let wanted: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.samples
            .iter()
            .find(|s| s.name == name && s.labels == wanted)
    }

    /// The value of one series; panics (with the exposition) when it is missing.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.find(name, labels)
            .unwrap_or_else(|| panic!("no series {name}{labels:?} in\n{}", self.text))
            .value
    }

    fn expect(&self, name: &str, labels: &[(&str, &str)], value: f64) {
        let got = self.value(name, labels);
        assert!(
            got == value,
            "{name}{labels:?} is {got}, expected {value}; the exposition:\n{}",
            self.text
        );
    }

    fn samples_of<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    fn sum_of(&self, name: &str) -> f64 {
        self.samples_of(name).map(|s| s.value).sum()
    }
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*`
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Parses `name{label="value",...} value` (labels optional), strictly: one space before the
/// value and nothing after it.
fn parse_sample(line: &str) -> Sample {
    let bad = |why: &str| -> ! { panic!("malformed sample line {line:?}: {why}") };
    let name_end = line
        .find(['{', ' '])
        .unwrap_or_else(|| bad("no value after the name"));
    let name = &line[..name_end];
    if !valid_name(name) {
        bad("invalid metric name");
    }
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if let Some(after_brace) = rest.strip_prefix('{') {
        let mut chars = after_brace.char_indices().peekable();
        loop {
            // A label name up to `=`, or the closing brace.
            let start = match chars.peek() {
                Some(&(i, '}')) => {
                    rest = &after_brace[i + 1..];
                    break;
                }
                Some(&(i, _)) => i,
                None => bad("unterminated label set"),
            };
            let eq = after_brace[start..]
                .find('=')
                .map(|j| start + j)
                .unwrap_or_else(|| bad("a label without `=`"));
            let label = &after_brace[start..eq];
            if !valid_name(label) || label.contains(':') {
                bad("invalid label name");
            }
            while chars.peek().is_some_and(|&(i, _)| i <= eq) {
                chars.next();
            }
            if chars.next().map(|(_, c)| c) != Some('"') {
                bad("a label value must be quoted");
            }
            let mut value = String::new();
            loop {
                match chars.next() {
                    Some((_, '"')) => break,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c @ ('\\' | '"'))) => value.push(c),
                        _ => bad("a bad escape in a label value"),
                    },
                    Some((_, c)) => value.push(c),
                    None => bad("an unterminated label value"),
                }
            }
            if labels.insert(label.to_owned(), value).is_some() {
                bad("a label given twice");
            }
            match chars.peek() {
                Some(&(_, ',')) => {
                    chars.next();
                }
                Some(&(_, '}')) => {}
                _ => bad("expected `,` or `}` after a label"),
            }
        }
    }
    let value = rest
        .strip_prefix(' ')
        .unwrap_or_else(|| bad("expected one space before the value"));
    if value.is_empty() || value.contains(' ') {
        bad("expected exactly one value");
    }
    let value: f64 = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v
            .parse()
            .unwrap_or_else(|_| bad("the value is not a number")),
    };
    Sample {
        name: name.to_owned(),
        labels,
        value,
    }
}

#[test]
fn the_parser_refuses_what_prometheus_would_refuse() {
    let good = "# HELP x_total A thing.\n# TYPE x counter\nx_total{a=\"1\",b=\"q\\\"\"} 3\n# EOF\n";
    let m = Metrics::parse(good);
    assert_eq!(m.value("x_total", &[("a", "1"), ("b", "q\"")]), 3.0);
    for bad in [
        "# TYPE x counter\nx_total 3\n",                   // no # EOF
        "# TYPE x counter\nx_total 3 4\n# EOF\n",          // two values
        "# TYPE x counter\nx_total{a=1} 3\n# EOF\n",       // unquoted label
        "# TYPE x counter\ny_total 3\n# EOF\n",            // wrong family
        "# TYPE x counter\nx 3\n# EOF\n",                  // counter without _total
        "x_total 3\n# EOF\n",                              // no # TYPE
        "# TYPE x counter\nx_total three\n# EOF\n",        // not a number
        "# TYPE x counter\nx_total 1\nx_total 2\n# EOF\n", // a series twice
        "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 3\nh_sum 1\n# EOF\n", // +Inf ≠ count
    ] {
        let outcome = std::panic::catch_unwind(|| Metrics::parse(bad));
        assert!(outcome.is_err(), "accepted {bad:?}");
    }
}
