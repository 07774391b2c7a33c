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
