//! Host clocks that disagree. The classic SETNX/GETSET recipe compares timestamps written by one host with
//! another host's clock, so brokers whose clocks are seconds apart would take over each other's
//! live leases. Two brokers run under `faketime`, one 5 s ahead and one 5 s behind (10 s apart,
//! five times the TTL), and hammer one key: nothing may overlap.

use std::time::Duration;

use lockbroker_test_support::broker::{
    BrokerProcess, BrokerSpec, clock_offset_s, parse_http_date, wait_until_ready,
};
use lockbroker_test_support::http::{Answer, http_client};
use lockbroker_test_support::now_ms;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::StatusCode;

use crate::torture::{self, Brokers, Plan};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faketime_really_shifts_a_process_clock() {
    // The tool itself, before trusting it with a broker: `date` under it is 5 s ahead.
    let date = |faked: bool| {
        let mut command = if faked {
            let mut c = std::process::Command::new("faketime");
            c.args(["-f", "+5s", "date", "+%s"]);
            c
        } else {
            let mut c = std::process::Command::new("date");
            c.arg("+%s");
            c
        };
        let out = command.output().unwrap_or_else(|e| {
            panic!(
                "cannot run {command:?} ({e}): the clock-skew tests need `faketime`. Run the \
                 README's test command, scripts/test.sh, which installs it (on Debian/Ubuntu: \
                 apt-get install faketime)."
            )
        });
        assert!(out.status.success(), "{command:?} failed: {out:?}");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<i64>()
            .expect("date prints seconds")
    };
    let (real, faked) = (date(false), date(true));
    assert!(
        (4..=6).contains(&(faked - real)),
        "faketime -f +5s gave {faked}, the real clock {real}"
    );
}

/// Two brokers of `spec`, under `faketime` at +5 s and -5 s: ten seconds apart. Asserts that the
/// skew is real, by each broker's own clock as it stamps its answers' Date header, and returns
/// the offsets seen, in seconds, with the brokers.
pub(crate) async fn skewed_five_seconds_each_way(
    spec: &BrokerSpec,
) -> ([BrokerProcess; 2], [i64; 2]) {
    let ahead = BrokerProcess::start(spec.clone().skewed("+5s")).await;
    let behind = BrokerProcess::start(spec.clone().skewed("-5s")).await;
    let (ahead_s, behind_s) = (
        clock_offset_s(&ahead.address()).await,
        clock_offset_s(&behind.address()).await,
    );
    assert!(
        (3..=7).contains(&ahead_s) && (-7..=-3).contains(&behind_s),
        "faketime did not skew the brokers' clocks: {ahead_s:+} s and {behind_s:+} s"
    );
    ([ahead, behind], [ahead_s, behind_s])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_whose_host_clocks_are_ten_seconds_apart_never_let_two_clients_hold_one_key() {
    let redis = RedisServer::start().await;
    let ([ahead, behind], [ahead_s, behind_s]) =
        skewed_five_seconds_each_way(&BrokerSpec::on(crate::LOCKBROKER, redis.url())).await;
    redis.wait_until_listening(2).await;
    for broker in [&ahead, &behind] {
        wait_until_ready(&broker.address(), Duration::from_secs(8)).await;
    }

    // Both report a lease's expiry on the store's clock, the real one, whatever their own say.
    let http = http_client();
    let before = now_ms();
    let grant = Answer::send(http.post(format!("{}/locks/shown?ttl_ms=2000", ahead.address())))
        .await
        .expect_grant(StatusCode::CREATED);
    assert!(
        grant.expires_at_ms >= before + 2000 && grant.expires_at_ms < now_ms() + 2000 + 500,
        "the expiry {} is not on the real clock (now {})",
        grant.expires_at_ms,
        now_ms()
    );
    let shown = Answer::send(http.get(format!("{}/locks/shown", behind.address())))
        .await
        .expect_status(StatusCode::OK)
        .json();
    assert_eq!(shown["expires_at_ms"], grant.expires_at_ms);

    // Leases of 2 s, held up to 20 ms: a broker judging expiry on its own clock would see the
    // other one's leases as long expired and take them over while they are held.
    let brokers = Brokers::new(vec![ahead.address(), behind.address()]);
    let plan = Plan {
        ttl_ms: 2000,
        wait_ms: 3000,
        hold_ms: 0..=20,
        limit: Duration::from_secs(20),
        answer_bound: Duration::from_millis(3000 + 500 + 1500),
        ..Plan::new("hot", 16, 15)
    };
    let report = torture::run(&brokers, &plan).await;
    let summary = report.check();
    assert_eq!(
        summary.sections,
        16 * 15,
        "every client must finish its rounds"
    );
    let by_ahead = report
        .sections
        .iter()
        .filter(|s| s.broker == ahead.address())
        .count();
    assert!(
        by_ahead >= summary.sections / 10 && by_ahead <= summary.sections * 9 / 10,
        "both brokers must grant a fair share ({by_ahead} of {} by the one ahead)",
        summary.sections
    );
    eprintln!(
        "{summary} in {:?}, brokers at {ahead_s:+} s and {behind_s:+} s",
        report.took
    );
}

#[test]
fn http_dates_are_read_as_unix_seconds() {
    assert_eq!(parse_http_date("Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
    assert_eq!(
        parse_http_date("Sat, 21 Nov 2026 23:31:42 GMT"),
        Some(1_795_303_902)
    );
}
