//! `lockbroker bench` end to end, briefly, against a broker on a real Redis: every phase runs
//! and completes cycles without an error, the raw Redis phase makes its two round trips per
//! cycle, the summary carries both ratios, and the lean HTTP client sends the bearer token to a
//! broker with an auth file. No figure is asserted: figures belong to the machine.

use lockbroker_test_support::app::{spawn_app, spawn_app_with};
use lockbroker_test_support::auth_entry;
use lockbroker_test_support::redis_server::RedisServer;
use lockbroker_test_support::temp::temp_file;
use serde_json::Value;

use crate::support::lockbroker;

const TOKEN: &str = "bench-secret-0123456789abcdef";

/// `lockbroker bench --json` for a short run; the summary.
async fn bench(url: &str, redis_url: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "bench",
        "--redis-url",
        redis_url,
        "--duration",
        "300ms",
        "--clients",
        "3",
        "--contenders",
        "2",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = lockbroker(url, &args).await;
    out.expect_code(0);
    serde_json::from_str(&out.stdout).expect("bench --json prints one JSON document")
}

fn phase<'a>(summary: &'a Value, name: &str) -> &'a Value {
    summary["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no phase {name:?} in {summary}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_runs_every_phase_and_compares_the_broker_with_direct_and_raw_redis() {
    let redis = RedisServer::start().await;
    let app = spawn_app(Some(redis.url())).await;
    let summary = bench(&app.url(""), &redis.url(), &[]).await;

    let names: Vec<_> = summary["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .map(|p| p["name"].as_str().expect("a name").to_owned())
        .collect();
    assert_eq!(
        names,
        [
            "uncontended (HTTP)",
            "hot key (HTTP)",
            "uncontended (direct Redis)",
            "uncontended (raw Redis)"
        ]
    );
    for name in &names {
        let p = phase(&summary, name);
        assert!(p["cycles"].as_u64().expect("cycles") > 0, "{p}");
        assert_eq!(p["errors"], 0, "{p}");
    }
    // The raw cycle: one SET and one script call; a broker's background epoch check (one a
    // second) may add a script call to the phase.
    let raw = phase(&summary, "uncontended (raw Redis)");
    let calls = raw["redis_calls_per_cycle"].as_f64().expect("calls");
    assert!((2.0..2.1).contains(&calls), "{raw}");
    let uncontended = phase(&summary, "uncontended (HTTP)")["cycles_per_sec"]
        .as_f64()
        .unwrap();
    for (ratio, baseline) in [
        ("broker_over_raw", "uncontended (raw Redis)"),
        ("broker_over_direct", "uncontended (direct Redis)"),
    ] {
        let expected = uncontended
            / phase(&summary, baseline)["cycles_per_sec"]
                .as_f64()
                .unwrap();
        let printed = summary[ratio].as_f64().expect(ratio);
        assert!((printed - expected).abs() < 1e-9, "{ratio}: {summary}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_sends_the_bearer_token_on_every_phase_to_a_broker_with_an_auth_file() {
    let redis = RedisServer::start().await;
    let auth = temp_file("auth", "toml");
    let secret = format!("token = {TOKEN:?}");
    let text = auth_entry("bench", &secret, &["bench-"], &["lock", "read"]);
    std::fs::write(&auth, text).unwrap();
    let app = spawn_app_with(Some(redis.url()), move |c| c.auth_file = Some(auth)).await;
    let summary = bench(&app.url(""), &redis.url(), &["--auth-token", TOKEN]).await;
    for name in ["uncontended (HTTP)", "hot key (HTTP)"] {
        let p = phase(&summary, name);
        assert!(p["cycles"].as_u64().expect("cycles") > 0, "{p}");
        assert_eq!(p["errors"], 0, "{p}");
    }
    // Without the token the bench stops at once and says why.
    let refused = lockbroker(
        &app.url(""),
        &[
            "bench",
            "--duration",
            "300ms",
            "--clients",
            "2",
            "--contenders",
            "2",
        ],
    )
    .await;
    refused.expect_failure(1, &["401", "--auth-token"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_bench_spreads_the_clients_over_every_broker_and_counts_each_acquisition_once() {
    let redis = RedisServer::start().await;
    let brokers = [
        spawn_app(Some(redis.url())).await,
        spawn_app(Some(redis.url())).await,
    ];
    let urls = format!("{},{}", brokers[0].url(""), brokers[1].url(""));
    let out = lockbroker(
        "http://127.0.0.1:9",
        &[
            "bench",
            "--urls",
            &urls,
            "--redis-url",
            &redis.url(),
            "--contenders",
            "4",
            "--duration",
            "500ms",
            "--json",
        ],
    )
    .await;
    out.expect_code(0);
    let summary: Value = serde_json::from_str(&out.stdout).expect("one JSON document");
    assert_eq!(summary["brokers"], 2, "{summary}");
    assert_eq!(summary["clients"], 4, "{summary}");
    assert_eq!(summary["errors"], 0, "{summary}");
    let per_client: Vec<u64> = summary["per_client"]
        .as_array()
        .expect("per_client")
        .iter()
        .map(|n| n.as_u64().expect("a count"))
        .collect();
    assert_eq!(per_client.len(), 4, "{summary}");
    let acquisitions = summary["acquisitions"].as_u64().expect("acquisitions");
    assert_eq!(per_client.iter().sum::<u64>(), acquisitions, "{summary}");
    assert_eq!(summary["wait"]["samples"], acquisitions, "{summary}");
    assert_eq!(
        summary["spread"]["most"],
        *per_client.iter().max().unwrap(),
        "{summary}"
    );
    // Every acquisition was released: one handoff between each two consecutive grants.
    assert_eq!(
        summary["handoff"]["samples"].as_u64().expect("handoffs"),
        acquisitions - 1,
        "{summary}"
    );
    // Each grant costs Redis at least its claim and its release.
    let calls = summary["script_calls_per_acquisition"]
        .as_f64()
        .expect("script calls");
    assert!(calls >= 2.0, "{summary}");
    // Client i talks to broker i % 2: the brokers' own grant counters differ by exactly what
    // their clients acquired (each broker also granted the bench's readiness probes, the same
    // number on each).
    let mut granted = Vec::new();
    for broker in &brokers {
        let metrics = reqwest::get(broker.url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let line = "lockbroker_acquisitions_total{kind=\"exclusive\",result=\"granted\"} ";
        let n: i64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix(line))
            .unwrap_or_else(|| panic!("no granted counter in {metrics}"))
            .trim()
            .parse()
            .unwrap();
        granted.push(n);
    }
    let share = |b: usize| -> i64 {
        per_client
            .iter()
            .skip(b)
            .step_by(2)
            .map(|&n| n as i64)
            .sum()
    };
    assert_eq!(granted[0] - granted[1], share(0) - share(1), "{summary}");
}
