//! Redis going away, freezing, filling up and coming back: the broker answers 503
//! `store_unavailable` within its store timeout, never a grant it is not sure of, and recovers by
//! itself; a full Redis still takes releases.

use std::time::{Duration, Instant};

use lockbroker_test_support::app::{TestApp, spawn_app, spawn_app_with};
use lockbroker_test_support::broker::{self, BrokerProcess, BrokerSpec};
use lockbroker_test_support::http::{Answer, http_client, until_waiting};
use lockbroker_test_support::redis;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::StatusCode;

use crate::cross_broker::wait_until_ready;
use crate::waiting::{granted_promptly, parked, released};

/// A small store timeout keeps these tests fast.
const STORE_TIMEOUT_MS: u64 = 500;

/// How much later than the store timeout a 503 may come: scheduling, the HTTP round trip.
const LATENESS: Duration = Duration::from_millis(1500);

/// A broker with a short store timeout. Grants resume at once after Redis loses its data: the
/// hold while leases are put back has tests of its own (`store_loss`).
async fn broker_on(redis: &RedisServer) -> TestApp {
    spawn_app_with(Some(redis.url()), |c| {
        c.store_timeout_ms = Some(STORE_TIMEOUT_MS);
        c.store_loss_delay_ms = Some(0);
    })
    .await
}

fn store_bound() -> Duration {
    Duration::from_millis(STORE_TIMEOUT_MS) + LATENESS
}

/// Sends the request `call` makes and asserts a prompt 503 `store_unavailable`.
async fn expect_unavailable(what: &str, call: impl Future<Output = Answer>) -> Answer {
    let started = Instant::now();
    let answer = call.await;
    let took = started.elapsed();
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{what}: {}",
        answer.text
    );
    answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
    assert!(took < store_bound(), "{what} took {took:?} to give up");
    answer
}

/// `/readyz` answers 503 while the store does not answer, saying when to look again.
async fn expect_not_ready(app: &TestApp) {
    let answer = expect_unavailable("readyz", app.get("/readyz")).await;
    let retry = answer.header("retry-after");
    assert_eq!(retry, Some("1"), "Retry-After of {}", answer.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_redis_is_down_answers_503_and_recovers_when_redis_returns() {
    let mut redis = RedisServer::start().await;
    let app = broker_on(&redis).await;
    let held = app.grant("before", "").await;

    redis.stop();
    expect_unavailable("acquire", app.acquire("new", "")).await;
    expect_unavailable("waiting acquire", app.acquire("new", "wait_ms=200")).await;
    expect_unavailable("release", app.release("before", &held.token)).await;
    expect_unavailable("renew", app.renew("before", &held.token, "")).await;
    expect_unavailable("inspect", app.inspect("before")).await;
    expect_not_ready(&app).await;
    app.get("/healthz").await.expect_status(StatusCode::OK);

    redis.restart().await;
    let took = wait_until_ready(&app, Duration::from_secs(5)).await;
    eprintln!("ready again {took:?} after Redis restarted");
    let grant = app.grant("new", "").await;
    assert!(grant.fence > 0);
    app.release_ok("new", &grant.token).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_started_while_redis_is_down_becomes_ready_when_redis_comes() {
    let mut redis = RedisServer::start().await;
    redis.stop();
    let app = broker_on(&redis).await;
    app.get("/healthz").await.expect_status(StatusCode::OK);
    expect_not_ready(&app).await;
    expect_unavailable("acquire", app.acquire("k", "")).await;
    redis.restart().await;
    wait_until_ready(&app, Duration::from_secs(5)).await;
    app.grant("k", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_stops_answering_gives_503_within_the_store_timeout() {
    let redis = RedisServer::start().await;
    let app = broker_on(&redis).await;
    let held = app.grant("frozen", "").await;
    redis.pause();
    let started = Instant::now();
    expect_unavailable("inspect", app.inspect("frozen")).await;
    assert!(
        started.elapsed() >= Duration::from_millis(STORE_TIMEOUT_MS - 50),
        "a frozen Redis cannot have answered"
    );
    expect_unavailable("release", app.release("frozen", &held.token)).await;
    expect_unavailable("renew", app.renew("frozen", &held.token, "")).await;
    expect_not_ready(&app).await;
    app.get("/healthz").await.expect_status(StatusCode::OK);
    redis.resume();
    wait_until_ready(&app, Duration::from_secs(5)).await;
    app.grant("after", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_answer_was_lost_does_not_leave_the_key_blocked() {
    let redis = RedisServer::start().await;
    let app = broker_on(&redis).await;
    // Warm the connection and Redis's script cache, so that the claim below is sent as one
    // EVALSHA that Redis runs as soon as it thaws.
    app.grant("warm-up", "").await;
    // From here, the only lease that Redis writes (and gives an expiry) is the lost claim's.
    let mut conn = redis.connection().await;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .expect("CONFIG RESETSTAT");
    redis.pause();
    // Redis will run this claim when it thaws, but its answer comes too late: nobody gets the
    // token, so the broker must clean the lease up rather than let it block for 60 s.
    expect_unavailable("acquire", app.acquire("orphan", "ttl_ms=60000")).await;
    redis.resume();
    wait_until_ready(&app, Duration::from_secs(5)).await;
    let started = Instant::now();
    loop {
        let answer = app.inspect("orphan").await;
        if answer.status == StatusCode::NOT_FOUND {
            answer.expect_error(StatusCode::NOT_FOUND, "not_held");
            break;
        }
        answer.expect_status(StatusCode::OK);
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "a lease nobody has the token of still blocks the key: {}",
            answer.text
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The claim did run in Redis (a lease was written with its expiry): the key really was
    // blocked by a lease nobody had the token of, until the broker cleaned it up.
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .expect("INFO commandstats");
    assert!(
        stats.contains("cmdstat_pexpire:calls="),
        "the lost claim never reached Redis, so this test proved nothing: {stats}"
    );
    app.grant("orphan", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquire_ends_by_its_wait_plus_the_store_timeout_when_redis_stops_answering() {
    let redis = RedisServer::start().await;
    let app = broker_on(&redis).await;
    app.grant("stuck", "ttl_ms=60000").await;
    const WAIT_MS: u64 = 1500;
    let started = Instant::now();
    let waiter = app.spawn_acquire("stuck", &format!("wait_ms={WAIT_MS}"));
    // Once the waiter is parked (the broker counts it), freeze Redis under it.
    until_waiting(&app.address, 1).await;
    assert!(!waiter.is_finished());
    redis.pause();
    let answer = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter must end")
        .expect("the waiter task");
    let took = started.elapsed();
    redis.resume();
    answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
    assert!(
        took < Duration::from_millis(WAIT_MS + STORE_TIMEOUT_MS) + LATENESS,
        "the waiter ended after {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_notices_reach_waiters_on_other_brokers_again_after_redis_restarts() {
    let mut redis = RedisServer::start().await;
    let one = broker_on(&redis).await;
    let two = broker_on(&redis).await;
    // Both listen before the restart, so the restart cuts connections that were established.
    redis.wait_until_listening(2).await;
    redis.restart().await;
    wait_until_ready(&one, Duration::from_secs(5)).await;
    wait_until_ready(&two, Duration::from_secs(5)).await;
    // Both must listen again by themselves.
    redis.wait_until_listening(2).await;
    let holder = one.grant("after-restart", "ttl_ms=30000").await;
    let waiter = parked(&two, "after-restart").await;
    let since = released(&one, "after-restart", &holder.token).await;
    granted_promptly(waiter, since).await;
}

#[tokio::test]
async fn fences_keep_rising_when_redis_rolls_its_fence_counter_back() {
    let redis = RedisServer::start().await;
    let app = spawn_app(Some(redis.url())).await;
    let first = app.grant("k", "").await;
    app.release_ok("k", &first.token).await;
    // As a restart from an older snapshot, or a failover to a lagging replica, would leave it.
    let mut conn = redis.connection().await;
    let _: () = redis::cmd("SET")
        .arg("lockbroker:{k}:fence")
        .arg(first.fence.saturating_sub(1000))
        .query_async(&mut conn)
        .await
        .expect("SET");
    let second = app.grant("k", "").await;
    second.assert_fence_above(&first, "the fence counter went back");
}

/// Redis's clock in microseconds, as the scripts read it.
async fn redis_now_us(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.expect("TIME");
    secs * 1_000_000 + micros
}

async fn exists(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(conn)
        .await
        .expect("EXISTS")
        == 1
}

/// One grant of `key` (with `params`), whose fence must be above `last`, released at once; its
/// fence. `what` names the step in a failure.
async fn cycle_above(app: &TestApp, key: &str, params: &str, last: u64, what: &str) -> u64 {
    let held = app.grant(key, params).await;
    assert!(
        held.fence > last,
        "{what}: fence {} after {last}",
        held.fence
    );
    app.release_ok(key, &held.token).await;
    held.fence
}

#[tokio::test]
async fn a_released_lock_leaves_no_key_in_redis() {
    let redis = RedisServer::start().await;
    let app = spawn_app(Some(redis.url())).await;
    let mut conn = redis.connection().await;
    for round in 0..3 {
        let held = app.grant("gone", "ttl_ms=30000").await;
        assert!(
            exists(&mut conn, "lockbroker:{gone}:lock").await,
            "round {round}"
        );
        app.release_ok("gone", &held.token).await;
        let left: Vec<String> = redis::cmd("KEYS")
            .arg("*{gone}*")
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        assert!(left.is_empty(), "round {round} left {left:?}");
    }
}

#[tokio::test]
async fn fences_keep_rising_when_redis_clock_is_behind_the_fences_granted() {
    // As a Redis whose clock stepped back leaves a key: a counter and a lease whose fences are
    // ahead of the clock. Every later fence must still be above them, and the counter must stay
    // while the clock has not passed it.
    let redis = RedisServer::start().await;
    let app = spawn_app(Some(redis.url())).await;
    let mut conn = redis.connection().await;
    let ahead = redis_now_us(&mut conn).await + 600_000_000;
    let _: () = redis::cmd("SET")
        .arg("lockbroker:{ahead}:fence")
        .arg(ahead)
        .query_async(&mut conn)
        .await
        .expect("SET");
    let mut last = ahead;
    for round in 0..3 {
        last = cycle_above(&app, "ahead", "", last, &format!("round {round}")).await;
        assert!(
            exists(&mut conn, "lockbroker:{ahead}:fence").await,
            "round {round}: the counter ahead of the clock went"
        );
    }

    // An expired lease record, alone, with a fence ahead of the clock: taken over by a claim
    // that does not wait, and ended (then granted) by one that does.
    for wait in ["", "wait_ms=1000"] {
        let now = redis_now_us(&mut conn).await;
        let ahead = now + 600_000_000;
        let _: () = redis::cmd("HSET")
            .arg("lockbroker:{record}:lock")
            .arg(&["token", "t0", "fence", &ahead.to_string(), "expires_at"])
            .arg(now / 1000 - 1)
            .arg(&["ttl", "1000", "granted_at"])
            .arg(now / 1000 - 1001)
            .query_async(&mut conn)
            .await
            .expect("HSET");
        let mut last = ahead;
        for round in 0..3 {
            last = cycle_above(
                &app,
                "record",
                wait,
                last,
                &format!("{wait:?} round {round}"),
            )
            .await;
        }
        let _: () = redis::cmd("DEL")
            .arg("lockbroker:{record}:fence")
            .query_async(&mut conn)
            .await
            .expect("DEL");
    }
}

#[tokio::test]
async fn fences_keep_rising_when_redis_clock_steps_back_under_a_lease() {
    // A lease granted when the key had no counter, whose fence Redis's clock is then behind (as
    // after a step back of the clock): its release must keep the fence for the next grant.
    let redis = RedisServer::start().await;
    let app = spawn_app(Some(redis.url())).await;
    let mut conn = redis.connection().await;
    let mut last = 0;
    for round in 0..2 {
        let held = app.grant("stepped", "ttl_ms=30000").await;
        assert!(held.fence > last, "fence {} after {last}", held.fence);
        let ahead = redis_now_us(&mut conn).await + 600_000_000;
        let _: () = redis::cmd("HSET")
            .arg("lockbroker:{stepped}:lock")
            .arg("fence")
            .arg(ahead)
            .query_async(&mut conn)
            .await
            .expect("HSET");
        app.release_ok("stepped", &held.token).await;
        last = cycle_above(&app, "stepped", "", ahead, &format!("round {round}")).await;
    }
}

/// Waits until the broker's log has a line containing `needle`, polling the log file; the first
/// such line.
pub(crate) async fn wait_for_log_line(
    broker: &BrokerProcess,
    needle: &str,
    limit: Duration,
) -> String {
    let started = Instant::now();
    loop {
        let output = broker.output();
        if let Some(line) = output.lines().find(|line| line.contains(needle)) {
            return line.to_owned();
        }
        assert!(
            started.elapsed() < limit,
            "no log line with {needle:?} within {limit:?}:\n{output}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The number after `name=` in a log line (tracing's text format writes fields so).
pub(crate) fn log_field(line: &str, name: &str) -> u64 {
    line.split_whitespace()
        .find_map(|field| field.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {line}"))
}

/// What the clients of [`a_redis_restart_under_load_is_logged_as_two_warnings_and_no_error`]
/// were answered.
#[derive(Debug, Default)]
struct Answers {
    granted: u64,
    /// `503 store_unavailable` because the store did not answer (no `Retry-After`; a store-wide
    /// hold's carries one).
    refused: u64,
    held_back: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_under_load_is_logged_as_two_warnings_and_no_error() {
    const BEGAN: &str = "the lock store stopped answering";
    const ENDED: &str = "the lock store answers again";
    const CLIENTS: usize = 16;
    let mut redis = RedisServer::start().await;
    let spec = BrokerSpec {
        store_timeout_ms: STORE_TIMEOUT_MS,
        ..BrokerSpec::on(env!("CARGO_BIN_EXE_lockbroker"), redis.url())
    };
    let broker = BrokerProcess::start(spec).await;
    broker::wait_until_ready(&broker.address(), Duration::from_secs(5)).await;

    // Clients that take and give back short leases as fast as they are answered, through the
    // outage and the hold after it. A refused acquire may have been granted in Redis before the
    // answer was lost: the broker tries to clean each one up, and with Redis down for seconds and
    // a 300 ms lease, gives up (the lease would end by itself by then).
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let (first_grants, mut first_granted) = tokio::sync::mpsc::channel(CLIENTS);
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let key = broker.url(&format!("/locks/loaded-{i}"));
            let acquire = format!("{key}?ttl_ms=300");
            let mut stopped = stopped.clone();
            let first_grant = first_grants.clone();
            tokio::spawn(async move {
                let client = http_client();
                let mut seen = Answers::default();
                while !*stopped.borrow_and_update() {
                    let answer = Answer::send(client.post(&acquire)).await;
                    let answer = match answer.status {
                        StatusCode::CREATED => {
                            if seen.granted == 0 {
                                first_grant.send(()).await.expect("the test listens");
                            }
                            seen.granted += 1;
                            let token = answer.json()["token"].as_str().unwrap().to_owned();
                            let released = client
                                .delete(&key)
                                .header("Lock-Token", token)
                                .send()
                                .await
                                .expect("release");
                            match Answer::read(released).await {
                                released if released.status == StatusCode::SERVICE_UNAVAILABLE => {
                                    released
                                }
                                released => {
                                    assert!(
                                        matches!(
                                            released.status,
                                            StatusCode::NO_CONTENT | StatusCode::NOT_FOUND
                                        ),
                                        "release answered {}: {}",
                                        released.status,
                                        released.text
                                    );
                                    continue;
                                }
                            }
                        }
                        StatusCode::CONFLICT => continue,
                        StatusCode::SERVICE_UNAVAILABLE => answer,
                        other => panic!("acquire answered {other}: {}", answer.text),
                    };
                    answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
                    if answer.header("retry-after").is_some() {
                        seen.held_back += 1;
                    } else {
                        seen.refused += 1;
                    }
                    // As a client backing off would, a little.
                    let _ = tokio::time::timeout(Duration::from_millis(5), stopped.changed()).await;
                }
                seen
            })
        })
        .collect();

    // Every client is under way before Redis goes.
    for _ in 0..CLIENTS {
        first_granted.recv().await.expect("a client's first grant");
    }
    redis.stop();
    wait_for_log_line(&broker, BEGAN, Duration::from_secs(10)).await;
    // About three seconds out, as a Redis restart takes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    redis.restart().await;
    // Back, past the hold while leases are put back, and quiet for a second.
    wait_for_log_line(&broker, ENDED, Duration::from_secs(20)).await;
    stop.send(true).expect("the clients listen");
    let mut seen = Answers::default();
    for client in clients {
        let answers = client.await.expect("a client");
        seen.granted += answers.granted;
        seen.refused += answers.refused;
        seen.held_back += answers.held_back;
    }
    eprintln!("the clients saw {seen:?}");
    assert!(
        seen.refused > 50,
        "the clients barely saw the outage: {seen:?}"
    );
    assert!(seen.granted > 0, "{seen:?}");

    let log = broker.output();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert!(errors.is_empty(), "error lines for a Redis restart:\n{log}");
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    eprintln!("the broker's warnings:\n{}", warnings.join("\n"));
    // The outage's two lines, and the put-back after the restart (Redis lost its data): no line
    // per request however many were refused.
    assert!(
        warnings.len() <= 3,
        "{} warning lines for one outage:\n{log}",
        warnings.len()
    );
    let began: Vec<&str> = log.lines().filter(|l| l.contains(BEGAN)).collect();
    let ended: Vec<&str> = log.lines().filter(|l| l.contains(ENDED)).collect();
    assert_eq!(began.len(), 1, "{log}");
    assert_eq!(ended.len(), 1, "{log}");
    for line in began.iter().chain(&ended) {
        assert!(line.contains("WARN"), "{line}");
    }
    // The end counts what the clients were refused, the cleanups given up, and the time out.
    let end = ended[0];
    assert_eq!(log_field(end, "refused"), seen.refused, "{end}");
    let cleanups = log_field(end, "cleanups_failed");
    assert!(
        cleanups > 0 && cleanups <= seen.refused,
        "{cleanups} failed cleanups for {} refused requests: {end}",
        seen.refused
    );
    let lasted_ms = log_field(end, "lasted_ms");
    assert!(
        (3_000..20_000).contains(&lasted_ms),
        "an outage of about 3 s lasted {lasted_ms} ms: {end}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_refuses_grants_with_503_and_still_releases_closes_sessions_and_hands_on() {
    let redis = RedisServer::start().await;
    let app = broker_on(&redis).await;
    let held = app.grant("full", "ttl_ms=30000").await;
    let (session, _) = crate::sessions::open(&app, "ttl_ms=30000").await;
    let other = app.grant("full-2", "ttl_ms=30000").await;
    let waiter = app.spawn_acquire("full-2", "ttl_ms=30000&wait_ms=10000");
    until_waiting(&app.address, 1).await;

    // Over maxmemory (noeviction, Redis's default): nothing that adds a lease runs.
    redis.config_set("maxmemory", 1).await;
    expect_unavailable("a grant", app.acquire("full-3", "")).await;
    expect_unavailable("a renewal", app.renew("full", &held.token, "ttl_ms=60000")).await;
    // A release frees memory: it runs. So does a session's close.
    app.release_ok("full", &held.token).await;
    crate::sessions::close(&app, &session)
        .await
        .expect_status(StatusCode::NO_CONTENT);
    // Even where the function library went and a full Redis refuses to load it again (the
    // release then runs by its source), a release runs and hands the key on to the bid queued
    // before.
    let () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(&mut redis.connection().await)
        .await
        .unwrap();
    app.release_ok("full-2", &other.token).await;
    let next = waiter.await.unwrap().expect_grant(StatusCode::CREATED);
    assert!(next.fence > other.fence);

    redis.config_set("maxmemory", 0).await;
    app.release_ok("full-2", &next.token).await;
    app.grant("full-3", "").await;
}
