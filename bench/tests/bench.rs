//! `lockbroker-bench` end to end, briefly, against a broker on a real Redis: every phase runs
//! and completes cycles without an error, the raw Redis phase makes its two round trips per
//! cycle, the summary carries both ratios, the lean HTTP client sends the bearer token to a
//! broker with an auth file, and `--floor --breakdown` runs the broker beside the minimal proxy
//! and reads their Redis calls. No figure is asserted: figures belong to the machine.

use lockbroker_test_support::app::{spawn_app, spawn_app_with};
use lockbroker_test_support::auth_entry;
use lockbroker_test_support::broker::wait_until_ready;
use lockbroker_test_support::command::run;
use lockbroker_test_support::redis_server::RedisServer;
use lockbroker_test_support::temp::temp_file;
use std::time::Duration;

use serde_json::Value;

/// The binary under test.
const BENCH: &str = env!("CARGO_BIN_EXE_lockbroker-bench");

const TOKEN: &str = "bench-secret-0123456789abcdef";

/// `lockbroker-bench --json` for a short run; the summary.
async fn bench(url: &str, redis_url: &str, extra: &[&str]) -> Value {
    let mut args = vec![
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
    let out = run(BENCH, url, &args).await;
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
    // Without the token the bench stops at once and says why — once the broker is ready again:
    // on a loaded machine a store call of the run above may have timed out, and the broker is
    // not ready until its connection is made anew.
    wait_until_ready(&app.address, Duration::from_secs(10)).await;
    let refused = run(
        BENCH,
        &app.url(""),
        &["--duration", "300ms", "--clients", "2", "--contenders", "2"],
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
    let out = run(
        BENCH,
        "http://127.0.0.1:9",
        &[
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

/// The commands of one step of a `--breakdown`, by name, with their calls per lock.
fn step_calls(step: &Value) -> Vec<(String, f64)> {
    step["commands"]
        .as_array()
        .expect("commands")
        .iter()
        .map(|c| {
            (
                c["command"].as_str().expect("a name").to_owned(),
                c["calls"].as_f64().expect("calls"),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floor_runs_the_broker_and_the_minimal_proxy_and_breaks_down_their_redis_calls() {
    let redis = RedisServer::start().await;
    // The broker runs in this test's process: the bench finds it by its port.
    let app = spawn_app(Some(redis.url())).await;
    let summary = bench(
        &app.url(""),
        &redis.url(),
        &[
            "--floor",
            "--rounds",
            "2",
            "--breakdown",
            "--breakdown-locks",
            "30",
            "--leftover-duration",
            "300ms",
        ],
    )
    .await;

    let floor = &summary["floor"];
    let rounds = floor["rounds"].as_array().expect("rounds");
    assert_eq!(rounds.len(), 2, "{floor}");
    for run in rounds.iter().flat_map(|r| [&r["broker"], &r["proxy"]]) {
        assert!(
            run["cycles_per_sec"].as_f64().expect("cycles/s") > 0.0,
            "{run}"
        );
        assert_eq!(run["errors"], 0, "{run}");
        for cost in ["server_cpu_us", "redis_cpu_us"] {
            assert!(run[cost].as_f64().expect(cost) >= 0.0, "{run}");
        }
    }
    let ratio = floor["cycles_ratio"].as_f64().expect("ratio");
    let expected = floor["broker"]["cycles_per_sec"].as_f64().unwrap()
        / floor["proxy"]["cycles_per_sec"].as_f64().unwrap();
    assert!((ratio - expected).abs() < 1e-9, "{floor}");

    // The proxy's cycle is the textbook one: SET, then one script that GETs and DELs.
    let breakdown = summary["breakdown"].as_array().expect("breakdown");
    let servers: Vec<_> = breakdown.iter().map(|b| b["server"].clone()).collect();
    assert_eq!(servers, ["broker", "proxy"]);
    let proxy = &breakdown[1];
    let (acquire, release) = (&proxy["steps"][0], &proxy["steps"][1]);
    assert_eq!(step_calls(acquire), [("set".to_owned(), 1.0)], "{proxy}");
    let mut released = step_calls(release);
    released.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        released,
        [
            ("del".to_owned(), 1.0),
            ("evalsha".to_owned(), 1.0),
            ("get".to_owned(), 1.0)
        ],
        "{proxy}"
    );
    assert!(acquire["script_overhead_usec"].is_null(), "{proxy}");
    // The broker: a script call per step (its background epoch check may add one to a step) —
    // an `FCALL` of its function library on one Redis — and the commands the scripts call
    // beside it.
    for step in breakdown[0]["steps"].as_array().unwrap() {
        let calls = step_calls(step);
        assert_eq!(calls[0].0, "fcall", "{step}");
        assert!((1.0..1.5).contains(&calls[0].1), "{step}");
        assert!(calls.len() > 1, "{step}");
    }

    // A released proxy lock leaves no key behind.
    let leftover = summary["leftover"].as_array().expect("leftover");
    assert_eq!(leftover.len(), 2, "{summary}");
    let proxy = &leftover[1];
    assert_eq!(proxy["server"], "proxy");
    assert!(proxy["cycles"].as_u64().unwrap() > 0, "{proxy}");
    assert!(
        proxy["keys_after"].as_i64().unwrap() <= proxy["keys_before"].as_i64().unwrap(),
        "{proxy}"
    );
}
