//! The Grafana dashboard, `deploy/grafana/lockbroker.json`, against a broker's real `/metrics`:
//! every series its PromQL queries (panel targets and template variables) is one the broker
//! exports, with the label values its `=` matchers name, and every `lockbroker_` family the
//! broker exports has a panel. A renamed or misspelled metric fails here, not as an empty panel.

use std::collections::BTreeSet;

use lockbroker_test_support::app::{TestApp, spawn_app_with};
use lockbroker_test_support::auth_entry;
use lockbroker_test_support::http::{Answer, lock_path};
use lockbroker_test_support::temp::temp_file;
use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::metrics::{Metrics, scrape};

/// The dashboard as Grafana provisions it (deploy/compose.yaml mounts this file).
const DASHBOARD: &str = include_str!("../../deploy/grafana/lockbroker.json");

/// The prefixes of the broker's own series; `up` and other Prometheus series are not checked.
const PREFIXES: [&str; 2] = ["lockbroker_", "process_"];

const LOCKER: &str = "dashboard-locker-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_series_the_dashboard_queries_is_exported_by_the_broker() {
    let dashboard = dashboard();
    let selectors = selectors_of(&dashboard);
    let names: BTreeSet<&str> = selectors.iter().map(|s| s.name.as_str()).collect();
    // The extraction itself works: the dashboard queries many series, histograms among them.
    assert!(
        names.len() >= 15,
        "only {} series found in the dashboard's queries: {names:?}",
        names.len()
    );
    assert!(names.iter().any(|n| n.ends_with("_bucket")), "{names:?}");

    let (exported, _guard) = exercised_broker_metrics().await;
    let problems = problems(&selectors, &exported);
    assert!(
        problems.is_empty(),
        "the dashboard queries what /metrics does not export:\n  {}\nthe exposition:\n{}",
        problems.join("\n  "),
        exported.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lockbroker_family_the_broker_exports_has_a_panel() {
    let queried: BTreeSet<String> = selectors_of(&dashboard())
        .iter()
        .map(|s| family(&s.name).to_owned())
        .collect();
    let (exported, _guard) = exercised_broker_metrics().await;
    let missing: BTreeSet<&str> = exported
        .samples
        .iter()
        .map(|s| family(&s.name))
        .filter(|f| PREFIXES.iter().any(|p| f.starts_with(p)) && !queried.contains(*f))
        .collect();
    assert!(
        missing.is_empty(),
        "exported but on no panel of deploy/grafana/lockbroker.json: {missing:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_catches_a_dashboard_that_names_a_missing_series() {
    let (exported, _guard) = exercised_broker_metrics().await;
    let mut dashboard = dashboard();
    let bad = [
        // A misspelled counter, a histogram queried without `_bucket`, a `_bucket` of a
        // counter, and a label value no series has.
        "sum(rate(lockbroker_acquisition_total[5m]))",
        "histogram_quantile(0.99, sum by (le) (rate(lockbroker_acquire_wait_seconds[5m])))",
        "rate(lockbroker_takeovers_bucket[5m])",
        "sum(rate(lockbroker_acquisitions_total{result=\"grant\"}[5m]))",
    ];
    let targets: Vec<Value> = bad
        .iter()
        .map(|expr| serde_json::json!({ "refId": "X", "expr": expr }))
        .collect();
    dashboard["panels"]
        .as_array_mut()
        .expect("the dashboard has panels")
        .push(serde_json::json!({ "type": "timeseries", "targets": targets }));
    let problems = problems(&selectors_of(&dashboard), &exported);
    assert_eq!(problems.len(), bad.len(), "{problems:#?}");
    for name in [
        "lockbroker_acquisition_total",
        "lockbroker_acquire_wait_seconds",
        "lockbroker_takeovers_bucket",
        "result=\"grant\"",
    ] {
        assert!(
            problems.iter().any(|p| p.contains(name)),
            "{name} not reported: {problems:#?}"
        );
    }
}

/// The selector parser: names outside strings, matchers with escapes, several per query.
#[test]
fn selectors_are_read_from_promql() {
    let found = selectors_in(
        r#"sum by (op) (rate(lockbroker_a_total{job=~"$job", op="cl\"aim"}[$__rate_interval])) / on() label_replace(process_b, "x", "lockbroker_in_a_string", "", "")"#,
    );
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(found[0].name, "lockbroker_a_total");
    assert_eq!(
        found[0].matchers,
        vec![
            ("job".to_owned(), "=~".to_owned(), "$job".to_owned()),
            ("op".to_owned(), "=".to_owned(), "cl\"aim".to_owned()),
        ]
    );
    assert_eq!(found[1].name, "process_b");
    assert!(found[1].matchers.is_empty());
}

fn dashboard() -> Value {
    serde_json::from_str(DASHBOARD).expect("deploy/grafana/lockbroker.json is JSON")
}

/// A broker on the embedded store with an auth file, after traffic that makes every series
/// show: a grant and a release (store calls, wait and hold times), and one request each that
/// the auth layer allows, forbids and refuses as unauthorized. `/metrics` stays open.
async fn exercised_broker_metrics() -> (Metrics, AuthFile) {
    let secret = format!("token = {LOCKER:?}");
    let file = AuthFile::new(&auth_entry("locker", &secret, &["dash:"], &["lock"]));
    let path = file.0.clone();
    let app = spawn_app_with(None, move |c| c.auth_file = Some(path)).await;

    let granted = send(&app, Method::POST, "dash:a", Some(LOCKER))
        .await
        .expect_grant(StatusCode::CREATED);
    let release = app
        .request(Method::DELETE, &lock_path("dash:a", ""))
        .bearer_auth(LOCKER)
        .header("Lock-Token", &granted.token);
    app.send(release)
        .await
        .expect_status(StatusCode::NO_CONTENT);
    send(&app, Method::POST, "other:a", Some(LOCKER))
        .await
        .expect_error(StatusCode::FORBIDDEN, "forbidden");
    send(&app, Method::POST, "dash:a", None)
        .await
        .expect_error(StatusCode::UNAUTHORIZED, "unauthorized");

    let exported = scrape(&app).await;
    app.shutdown().await;
    (exported, file)
}

async fn send(app: &TestApp, method: Method, key: &str, bearer: Option<&str>) -> Answer {
    let mut request = app.request(method, &lock_path(key, ""));
    if let Some(token) = bearer {
        request = request.bearer_auth(token);
    }
    app.send(request).await
}

/// An auth file, removed when dropped.
struct AuthFile(std::path::PathBuf);

impl AuthFile {
    fn new(text: &str) -> Self {
        let path = temp_file("dashboard-auth", "toml");
        std::fs::write(&path, text).expect("write the auth file");
        Self(path)
    }
}

impl Drop for AuthFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// What is wrong with the queried selectors, given the exposition: a series name no sample has
/// (names are compared as Prometheus stores them, so a histogram is `NAME_bucket`, `_sum` or
/// `_count`, never `NAME`), or an `=` matcher whose value no sample of that name has (matchers
/// on template variables, `$…`, and on labels Prometheus adds, `job` and `instance`, aside).
fn problems(selectors: &[Selector], exported: &Metrics) -> Vec<String> {
    let mut problems = BTreeSet::new();
    for selector in selectors {
        let samples: Vec<_> = exported
            .samples
            .iter()
            .filter(|s| s.name == selector.name)
            .collect();
        if samples.is_empty() {
            problems.insert(format!("{}: no such series", selector.name));
            continue;
        }
        for (label, op, value) in &selector.matchers {
            if op != "=" || value.contains('$') || label == "job" || label == "instance" {
                continue;
            }
            if !samples.iter().any(|s| s.labels.get(label) == Some(value)) {
                problems.insert(format!(
                    "{}{{{label}=\"{value}\"}}: no series has this label value",
                    selector.name
                ));
            }
        }
    }
    problems.into_iter().collect()
}

/// The family a sample or queried series belongs to: its name without the suffix the
/// exposition adds (`_total` for counters; `_bucket`, `_sum`, `_count` for histograms).
fn family(name: &str) -> &str {
    ["_bucket", "_sum", "_count", "_total", "_created"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
}

/// A series selector in a query: the metric name and its label matchers `(label, op, value)`.
#[derive(Debug)]
struct Selector {
    name: String,
    matchers: Vec<(String, String, String)>,
}

/// Every selector of the broker's series in the dashboard's PromQL: the panels' `expr` and the
/// template variables' `query` and `definition`, wherever they are nested.
fn selectors_of(dashboard: &Value) -> Vec<Selector> {
    let mut queries = Vec::new();
    collect_queries(dashboard, &mut queries);
    queries.iter().flat_map(|q| selectors_in(q)).collect()
}

fn collect_queries<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr" | "query" | "definition", Value::String(q)) => out.push(q),
                    _ => collect_queries(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_queries(v, out)),
        _ => {}
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// The selectors of the broker's series ([`PREFIXES`]) in one PromQL query. Names inside
/// string literals are skipped; a `{…}` right after a name is read as its label matchers.
fn selectors_in(query: &str) -> Vec<Selector> {
    let chars: Vec<char> = query.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if matches!(c, '"' | '\'' | '`') {
            i = read_string(&chars, i).1;
            continue;
        }
        if !is_name_char(c) {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && is_name_char(chars[i]) {
            i += 1;
        }
        let name: String = chars[start..i].iter().collect();
        if !PREFIXES.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let mut matchers = Vec::new();
        if chars.get(i) == Some(&'{') {
            i += 1;
            loop {
                while chars.get(i).is_some_and(|c| c.is_whitespace() || *c == ',') {
                    i += 1;
                }
                match chars.get(i) {
                    Some('}') => {
                        i += 1;
                        break;
                    }
                    None => panic!("an unterminated selector in {query:?}"),
                    _ => {}
                }
                let label_start = i;
                while chars.get(i).is_some_and(|c| is_name_char(*c)) {
                    i += 1;
                }
                let label: String = chars[label_start..i].iter().collect();
                while chars.get(i).is_some_and(|c| c.is_whitespace()) {
                    i += 1;
                }
                let op_start = i;
                while chars.get(i).is_some_and(|c| matches!(c, '=' | '!' | '~')) {
                    i += 1;
                }
                let op: String = chars[op_start..i].iter().collect();
                assert!(
                    !label.is_empty() && matches!(op.as_str(), "=" | "!=" | "=~" | "!~"),
                    "a malformed label matcher in {query:?}"
                );
                while chars.get(i).is_some_and(|c| c.is_whitespace()) {
                    i += 1;
                }
                assert!(
                    chars.get(i).is_some_and(|c| matches!(c, '"' | '\'' | '`')),
                    "an unquoted label value in {query:?}"
                );
                let (value, next) = read_string(&chars, i);
                i = next;
                matchers.push((label, op, value));
            }
        }
        found.push(Selector { name, matchers });
    }
    found
}

/// The string literal opening at `chars[at]`: its value (escapes undone, except in backtick
/// raw strings) and the index after its closing quote.
fn read_string(chars: &[char], at: usize) -> (String, usize) {
    let quote = chars[at];
    let mut value = String::new();
    let mut i = at + 1;
    while let Some(&c) = chars.get(i) {
        i += 1;
        if c == quote {
            return (value, i);
        }
        if c == '\\' && quote != '`' {
            if let Some(&escaped) = chars.get(i) {
                value.push(escaped);
                i += 1;
            }
            continue;
        }
        value.push(c);
    }
    panic!(
        "an unterminated string in {:?}",
        chars.iter().collect::<String>()
    );
}
