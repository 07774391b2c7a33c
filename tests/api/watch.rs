//! Watching a key (`GET /locks/{key}?watch=F&wait_ms=W`, and for semaphores): answered when the
//! holders differ from the fence seen or change within the wait — a grant, a release, an expiry,
//! a force release, each seen once and in order — on the embedded store and on Redis, on the
//! broker that made the change and on another one; a parked watch costs the store nothing while
//! nothing changes.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lockbroker_test_support::app::{Backend, TestApp, spawn_app, spawn_app_with};
use lockbroker_test_support::http::{metric, until_metric};
use lockbroker_test_support::on_both_stores;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::{Method, StatusCode};
use serde_json::Value;
use tokio::sync::mpsc;

/// How soon a watch on the broker that saw a change answers it.
const LATENCY: Duration = Duration::from_millis(100);

/// How soon a watch on another broker sharing Redis answers a change made there: the scripts
/// announce changes to a watched key on `<prefix>b:changes`, so as soon as on the broker that
/// saw it, plus a notice's delivery.
const CROSS_BROKER_LATENCY: Duration = LATENCY;

/// One change a watcher saw: the fence (`None`: free), the owner, and when (this host's wall
/// clock, ms, and a monotonic instant).
#[derive(Debug)]
struct Seen {
    fence: Option<u64>,
    owner: Option<String>,
    wall_ms: u64,
    at: Instant,
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A broker's address and a client for it, for tasks of their own.
#[derive(Clone)]
struct Remote {
    address: String,
    client: reqwest::Client,
}

fn remote(app: &TestApp) -> Remote {
    Remote {
        address: app.address.clone(),
        client: app.client.clone(),
    }
}

/// One watch; the answer's status and body.
async fn watch(app: &Remote, path: &str, fence: u64, wait_ms: u64) -> (StatusCode, Value) {
    try_watch(app, path, fence, wait_ms)
        .await
        .unwrap_or_else(|e| panic!("the watch of {path} got no answer: {e}"))
}

/// One watch; an error when the broker does not answer (it stopped: the test is over).
async fn try_watch(
    app: &Remote,
    path: &str,
    fence: u64,
    wait_ms: u64,
) -> Result<(StatusCode, Value), reqwest::Error> {
    let answer = app
        .client
        .get(format!(
            "{}{path}?watch={fence}&wait_ms={wait_ms}",
            app.address
        ))
        .send()
        .await?;
    let status = answer.status();
    let body: Value = answer.json().await?;
    assert!(
        body.get("token").is_none(),
        "a watch never shows a token: {body}"
    );
    Ok((status, body))
}

/// Follows `path` on `app` as a client would: watch from "free", and again from each fence
/// seen, sending every change (`changed: true`) it is answered.
fn follow(app: &TestApp, path: &str) -> mpsc::UnboundedReceiver<Seen> {
    let (tx, rx) = mpsc::unbounded_channel();
    let app = remote(app);
    let path = path.to_owned();
    tokio::spawn(async move {
        let mut fence = 0;
        loop {
            let Ok((status, body)) = try_watch(&app, &path, fence, 10_000).await else {
                return;
            };
            let at = Instant::now();
            let seen = match status {
                StatusCode::OK => body["fence"].as_u64(),
                StatusCode::NOT_FOUND => {
                    assert_eq!(body["fence"], Value::Null, "{body}");
                    None
                }
                other => panic!("the watch answered {other}: {body}"),
            };
            if body["changed"] == Value::Bool(true) {
                let sent = tx.send(Seen {
                    fence: seen,
                    owner: body["owner"].as_str().map(str::to_owned),
                    wall_ms: wall_ms(),
                    at,
                });
                if sent.is_err() {
                    return;
                }
            }
            fence = seen.unwrap_or(0);
        }
    });
    rx
}

/// The next change the follower saw, within `limit`; `what` names it.
async fn next(seen: &mut mpsc::UnboundedReceiver<Seen>, limit: Duration, what: &str) -> Seen {
    tokio::time::timeout(limit, seen.recv())
        .await
        .unwrap_or_else(|_| panic!("{what}: no change seen within {limit:?}"))
        .expect("the follower runs")
}

/// Waits until `n` watches are parked on `app` (its `lockbroker_watchers` gauge), for at most
/// a minute (a thousand connections to open on a loaded machine).
async fn until_parked(app: &TestApp, n: usize) {
    until_metric(
        &app.address,
        "lockbroker_watchers",
        n as f64,
        Duration::from_secs(60),
    )
    .await;
}

/// A grant, a release, an expiry and a force release made on `changes`, as a follower on
/// `watcher` sees them: each once, in order, within `latency` of the change.
async fn grant_release_expiry_force_release(
    changes: &TestApp,
    watcher: &TestApp,
    latency: Duration,
) {
    let key = "watched";
    let path = format!("/locks/{key}");
    let mut seen = follow(watcher, &path);
    until_parked(watcher, 1).await;
    let limit = latency + Duration::from_secs(5);

    // A grant.
    let grant = changes.grant(key, "owner=first&ttl_ms=30000").await;
    let done = Instant::now();
    let change = next(&mut seen, limit, "the grant").await;
    assert_eq!(
        (change.fence, change.owner.as_deref()),
        (Some(grant.fence), Some("first"))
    );
    let took = change.at.saturating_duration_since(done);
    assert!(took < latency, "the grant was seen {took:?} after it");

    // A release.
    changes.release_ok(key, &grant.token).await;
    let done = Instant::now();
    let change = next(&mut seen, limit, "the release").await;
    assert_eq!(change.fence, None, "the release: free");
    let took = change.at.saturating_duration_since(done);
    assert!(took < latency, "the release was seen {took:?} after it");

    // An expiry: nobody says anything; the watch answers at the lease's end. The lease lasts
    // longer than a change takes to be seen, or the grant could pass unseen.
    let ttl_ms = latency.as_millis() + 300;
    let short = changes
        .grant(key, &format!("owner=short&ttl_ms={ttl_ms}"))
        .await;
    let change = next(&mut seen, limit, "the short grant").await;
    assert_eq!(change.fence, Some(short.fence));
    let change = next(&mut seen, limit, "the expiry").await;
    assert_eq!(change.fence, None, "the expiry: free");
    assert!(
        change.wall_ms >= short.expires_at_ms,
        "free only once the lease ended"
    );
    let took = Duration::from_millis(change.wall_ms - short.expires_at_ms);
    assert!(
        took < latency,
        "the expiry was seen {took:?} after the lease's end"
    );

    // A force release.
    let forced = changes.grant(key, "owner=forced&ttl_ms=30000").await;
    let change = next(&mut seen, limit, "the grant to force").await;
    assert_eq!(change.fence, Some(forced.fence));
    changes
        .send(changes.request(Method::DELETE, &format!("{path}?force=true")))
        .await
        .expect_status(StatusCode::NO_CONTENT);
    let done = Instant::now();
    let change = next(&mut seen, limit, "the force release").await;
    assert_eq!(change.fence, None, "the force release: free");
    let took = change.at.saturating_duration_since(done);
    assert!(
        took < latency,
        "the force release was seen {took:?} after it"
    );

    // Each once: nothing else was seen.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(seen.try_recv().is_err(), "a change was seen twice");
}

fn allow_force(settings: &mut lockbroker::config::Settings) {
    settings.allow_force_release = Some(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_embedded_store_a_watcher_sees_a_grant_a_release_an_expiry_and_a_force_release_once_in_order()
 {
    let app = spawn_app_with(None, allow_force).await;
    grant_release_expiry_force_release(&app, &app, LATENCY).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_watcher_sees_a_grant_a_release_an_expiry_and_a_force_release_once_in_order() {
    let redis = RedisServer::start().await;
    let app = spawn_app_with(Some(redis.url()), allow_force).await;
    grant_release_expiry_force_release(&app, &app, LATENCY).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_watcher_on_another_broker_sees_each_change_once_in_order() {
    let redis = RedisServer::start().await;
    let changes = spawn_app_with(Some(redis.url()), allow_force).await;
    let watcher = spawn_app(Some(redis.url())).await;
    grant_release_expiry_force_release(&changes, &watcher, CROSS_BROKER_LATENCY).await;
}

on_both_stores!(
    a_watch_with_an_unchanged_fence_times_out_with_changed_false_and_a_renewal_is_no_change,
    a_watch_answers_at_once_when_the_holders_differ_from_the_fence_seen,
    a_semaphore_watch_sees_permits_taken_and_given_back,
    watches_count_against_max_waiters_and_bad_watches_are_refused,
);

async fn a_watch_with_an_unchanged_fence_times_out_with_changed_false_and_a_renewal_is_no_change(
    backend: &Backend,
) {
    let app = &backend.app;
    // Free, and still free.
    let started = Instant::now();
    let (status, body) = watch(&remote(app), "/locks/calm", 0, 300).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(
        (&body["error"], &body["fence"], &body["changed"]),
        (&"not_held".into(), &Value::Null, &false.into())
    );
    assert!(started.elapsed() >= Duration::from_millis(300));

    // Held, renewed meanwhile: still no change, and the answer shows the new expiry.
    let grant = app.grant("calm", "owner=me&ttl_ms=5000").await;
    let watching = {
        let app = remote(app);
        tokio::spawn(async move { watch(&app, "/locks/calm", grant.fence, 600).await })
    };
    until_parked(app, 1).await;
    let renewed = app
        .renew("calm", &grant.token, "ttl_ms=20000")
        .await
        .expect_grant(StatusCode::OK);
    let (status, body) = watching.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["changed"], false);
    assert_eq!(body["fence"], grant.fence);
    assert_eq!(body["owner"], "me");
    assert_eq!(body["expires_at_ms"], renewed.expires_at_ms);
    // Without a wait, the answer is at once.
    let (status, body) = watch(&remote(app), "/locks/calm", grant.fence, 0).await;
    assert_eq!((status, &body["changed"]), (StatusCode::OK, &false.into()));
}

async fn a_watch_answers_at_once_when_the_holders_differ_from_the_fence_seen(backend: &Backend) {
    let app = &backend.app;
    let first = app.grant("moved", "ttl_ms=1").await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let second = app.grant("moved", "owner=now").await;
    for seen in [0, first.fence] {
        let started = Instant::now();
        let (status, body) = watch(&remote(app), "/locks/moved", seen, 10_000).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["changed"], true);
        assert_eq!(body["fence"], second.fence);
        assert_eq!(body["owner"], "now");
        assert!(started.elapsed() < Duration::from_secs(5), "at once");
    }
    app.release_ok("moved", &second.token).await;
    let (status, body) = watch(&remote(app), "/locks/moved", second.fence, 10_000).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        (&body["fence"], &body["changed"]),
        (&Value::Null, &true.into())
    );
}

async fn a_semaphore_watch_sees_permits_taken_and_given_back(backend: &Backend) {
    let app = &backend.app;
    let take = async |owner: &str| {
        let permit = app
            .take("pool", &format!("limit=2&owner={owner}"))
            .await
            .expect_status(StatusCode::CREATED)
            .json();
        (
            permit["fence"].as_u64(),
            permit["token"].as_str().unwrap().to_owned(),
        )
    };
    let give_back = async |token: &str| {
        app.with_token(Method::DELETE, "/semaphores/pool", token)
            .await
            .expect_status(StatusCode::NO_CONTENT);
    };
    let (status, _) = watch(&remote(app), "/semaphores/pool", 0, 0).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let mut seen = follow(app, "/semaphores/pool");
    let mut next_fence = async || {
        next(&mut seen, Duration::from_secs(5), "a permit change")
            .await
            .fence
    };
    until_parked(app, 1).await;
    let (a_fence, a_token) = take("a").await;
    assert_eq!(next_fence().await, a_fence);
    let (b_fence, b_token) = take("b").await;
    assert_eq!(next_fence().await, b_fence);
    // Giving back the newest permit: the highest fence is the first's again.
    give_back(&b_token).await;
    assert_eq!(next_fence().await, a_fence);
    give_back(&a_token).await;
    assert_eq!(next_fence().await, None);
}

async fn watches_count_against_max_waiters_and_bad_watches_are_refused(backend: &Backend) {
    let app = backend
        .another_app(|settings| settings.max_waiters = Some(2))
        .await;
    // Refused before anything waits.
    for (query, _why) in [
        ("wait_ms=100", "wait_ms without watch"),
        ("watch=-1", "a negative fence"),
        ("watch=x", "a fence that is not a number"),
        (
            "watch=9223372036854775808",
            "a fence over the int64 the document states",
        ),
        (
            "watch=10000000000000000001",
            "a fence over int64, within u64",
        ),
        ("watch=0&wait_ms=60001", "a wait over max_wait_ms"),
        ("watch=0&wait_ms=1&nope=1", "an unknown parameter"),
    ] {
        for path in ["/locks/k", "/semaphores/k"] {
            app.get(&format!("{path}?{query}"))
                .await
                .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
        }
    }
    let parked: Vec<_> = (0..2)
        .map(|_| {
            let app = remote(&app);
            tokio::spawn(async move { watch(&app, "/locks/k", 0, 3_000).await })
        })
        .collect();
    until_parked(&app, 2).await;
    app.get("/locks/k?watch=0&wait_ms=1000")
        .await
        .expect_error(StatusCode::SERVICE_UNAVAILABLE, "too_many_waiters");
    // A waiting acquire counts against the same limit.
    let holder = app.grant("busy", "").await;
    app.acquire("busy", "wait_ms=1000")
        .await
        .expect_error(StatusCode::SERVICE_UNAVAILABLE, "too_many_waiters");
    for watch in parked {
        let (status, body) = watch.await.unwrap();
        assert_eq!(
            (status, &body["changed"]),
            (StatusCode::NOT_FOUND, &false.into())
        );
    }
    assert_eq!(metric(&app.address, "lockbroker_watchers").await, 0.0);
    app.release_ok("busy", &holder.token).await;
}

/// Store reads the broker made (its own count).
async fn broker_reads(app: &TestApp) -> f64 {
    metric(
        &app.address,
        "lockbroker_store_call_seconds_count{op=\"read\"}",
    )
    .await
}

/// 1,000 watches on 10 keys, parked while nothing changes: the store is asked nothing. The
/// broker reads nothing at all, and on Redis no script runs (the broker's background epoch check
/// aside: an EVAL a second, and the notice connection's PING).
async fn thousand_parked_watches(redis: Option<&RedisServer>) {
    const WATCHES: usize = 1_000;
    const KEYS: usize = 10;
    const QUIET: Duration = Duration::from_secs(3);
    let app = spawn_app(redis.map(RedisServer::url)).await;
    let mut fences = Vec::new();
    let mut tokens = Vec::new();
    for k in 0..KEYS {
        let grant = app.grant(&format!("quiet-{k}"), "ttl_ms=60000").await;
        fences.push(grant.fence);
        tokens.push(grant.token);
    }
    let watches: Vec<_> = (0..WATCHES)
        .map(|i| {
            let app = remote(&app);
            let k = i % KEYS;
            let fence = fences[k];
            tokio::spawn(async move {
                // As a client would: a watch the broker could not start in time (its first read
                // of the key outlasted the store timeout, as on a starved machine) is sent again.
                loop {
                    let answer = watch(&app, &format!("/locks/quiet-{k}"), fence, 30_000).await;
                    if answer.0 != StatusCode::SERVICE_UNAVAILABLE {
                        return answer;
                    }
                }
            })
        })
        .collect();
    until_parked(&app, WATCHES).await;
    let reads_before = broker_reads(&app).await;
    let calls_before = match redis {
        Some(redis) => redis.command_counts().await,
        None => Default::default(),
    };
    tokio::time::sleep(QUIET).await;
    let reads = broker_reads(&app).await - reads_before;
    match redis {
        Some(redis) => {
            let after = redis.command_counts().await;
            let by_command: Vec<_> = after
                .iter()
                .map(|(name, n)| (name, n - calls_before.get(name).copied().unwrap_or(0)))
                .filter(|(_, n)| *n > 0)
                .collect();
            println!("Redis calls by command: {by_command:?}");
            let calls: u64 = by_command.iter().map(|(_, n)| n).sum();
            println!(
                "{WATCHES} watches on {KEYS} keys over {QUIET:?}: {reads} broker reads, {calls} \
                 Redis calls"
            );
            assert_eq!(reads, 0.0, "a quiet watched key costs no read");
            // A read is an FCALL (or EVALSHA), a mark a SET; the epoch check is an EVAL a second.
            for (name, n) in &by_command {
                assert!(
                    !matches!(name.as_str(), "fcall" | "evalsha" | "set"),
                    "{n} {name} while nothing changed: {by_command:?}"
                );
            }
        }
        None => assert_eq!(reads, 0.0, "a quiet key costs the embedded store nothing"),
    }
    assert_eq!(
        metric(&app.address, "lockbroker_watchers").await,
        WATCHES as f64
    );

    // A change: the key's 100 watches all answer it, and the broker read the key once for them
    // (on Redis, fallback reads of the other keys may come in between).
    let before = broker_reads(&app).await;
    app.release_ok("quiet-0", &tokens[0]).await;
    for (i, watch) in watches.into_iter().enumerate() {
        if i % KEYS == 0 {
            let (status, body) = watch.await.expect("the watch task");
            assert_eq!(
                (status, &body["changed"]),
                (StatusCode::NOT_FOUND, &true.into())
            );
        } else {
            watch.abort();
        }
    }
    let reads = broker_reads(&app).await - before;
    match redis {
        None => assert_eq!(
            reads,
            1.0,
            "one read for the key's {} watches",
            WATCHES / KEYS
        ),
        Some(_) => assert!(reads <= 1.0 + KEYS as f64 * 2.0, "{reads} reads"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_parked_watches_cost_the_embedded_store_nothing() {
    thousand_parked_watches(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_parked_watches_cost_redis_nothing_while_nothing_changes() {
    let redis = RedisServer::start().await;
    thousand_parked_watches(Some(&redis)).await;
}

/// How many watches arrive together in [`concurrent_first_watches_of_a_key_share_its_reads`].
const CROWD: usize = 200;

/// [`CROWD`] watches of `path` sent at once, from the fence `seen`, waiting up to `wait_ms`; the
/// tasks, each answered with its status and body.
fn crowd(
    app: &TestApp,
    path: &str,
    seen: u64,
    wait_ms: u64,
) -> Vec<tokio::task::JoinHandle<(StatusCode, Value)>> {
    (0..CROWD)
        .map(|_| {
            let (app, path) = (remote(app), path.to_owned());
            tokio::spawn(async move { watch(&app, &path, seen, wait_ms).await })
        })
        .collect()
}

/// Each of `watches` answered `200`, changed, with `fence`.
async fn all_changed_to(watches: Vec<tokio::task::JoinHandle<(StatusCode, Value)>>, fence: u64) {
    for watch in watches {
        let (status, body) = watch.await.expect("the watch task");
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(
            (&body["fence"], &body["changed"]),
            (&fence.into(), &true.into())
        );
    }
}

/// Watches of one key arriving together (each the first its client sends) share the key's
/// reads: a handful for all of them, not one each — whether each is answered at once (the key is
/// held, they saw it free) or they all park until a grant. And each is answered what the key
/// holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_watches_of_a_key_share_its_reads() {
    let redis = RedisServer::start().await;
    let app = spawn_app(Some(redis.url())).await;

    let held = app.grant("crowd", "ttl_ms=60000").await;
    let before = broker_reads(&app).await;
    all_changed_to(crowd(&app, "/locks/crowd", 0, 10_000), held.fence).await;
    let reads_held = broker_reads(&app).await - before;

    let before = broker_reads(&app).await;
    let watches = crowd(&app, "/locks/crowd-free", 0, 30_000);
    until_parked(&app, CROWD).await;
    let reads_parking = broker_reads(&app).await - before;
    let grant = app.grant("crowd-free", "ttl_ms=60000").await;
    all_changed_to(watches, grant.fence).await;
    let reads_free = broker_reads(&app).await - before;
    println!(
        "{CROWD} watches of a held key: {reads_held} reads; of a free key: {reads_parking} reads \
         while they parked, {reads_free} in all"
    );
    // One read each, and one after the grant; a watch that comes between the keeper's look at
    // the requests and the start of its read asks for one more.
    assert!(reads_held <= 3.0, "{reads_held} reads for {CROWD} watches");
    assert!(
        reads_parking <= 3.0,
        "{reads_parking} reads for {CROWD} watches"
    );
    assert!(reads_free <= 5.0, "{reads_free} reads for {CROWD} watches");
}
