//! The hot path's cost in Redis round trips, counted by Redis itself (`INFO commandstats`): a
//! count, not a timing, so a change that adds a round trip fails here whatever the machine.

use std::time::Duration;

use lockbroker_test_support::app::{TestApp, spawn_app};
use lockbroker_test_support::redis;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::StatusCode;

/// Lock script calls Redis has served (`FCALL`s of the broker's function library, or
/// `EVALSHA`s where it cannot run functions): each is one round trip of a lock operation (the
/// commands a script runs inside are counted apart by Redis, under their own names, and the
/// broker's background epoch check, once a second, runs as plain EVAL).
async fn script_calls(redis: &RedisServer) -> u64 {
    redis.script_calls().await
}

/// A broker on a fresh Redis, its scripts already loaded (the first call costs a "Function not
/// found" and the library's load, once per Redis).
async fn warmed_up() -> (RedisServer, TestApp) {
    let redis = RedisServer::start().await;
    let app = spawn_app(Some(redis.url())).await;
    let grant = app.grant("warm-up", "").await;
    app.renew("warm-up", &grant.token, "")
        .await
        .expect_status(StatusCode::OK);
    app.inspect("warm-up").await.expect_status(StatusCode::OK);
    app.release_ok("warm-up", &grant.token).await;
    // Expired, then taken over: loads the takeover script.
    let short = app.grant("warm-up", "ttl_ms=1").await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let taken = app.grant("warm-up", "").await;
    assert!(taken.fence > short.fence);
    app.release_ok("warm-up", &taken.token).await;
    (redis, app)
}

#[tokio::test]
async fn an_uncontended_acquire_release_renew_and_inspect_cost_one_round_trip_each() {
    let (redis, app) = warmed_up().await;
    let before = script_calls(&redis).await;
    let grant = app.grant("k", "").await;
    assert_eq!(script_calls(&redis).await - before, 1, "acquire");
    app.renew("k", &grant.token, "ttl_ms=5000")
        .await
        .expect_status(StatusCode::OK);
    assert_eq!(script_calls(&redis).await - before, 2, "renew");
    app.inspect("k").await.expect_status(StatusCode::OK);
    assert_eq!(script_calls(&redis).await - before, 3, "inspect");
    app.release_ok("k", &grant.token).await;
    assert_eq!(script_calls(&redis).await - before, 4, "release");

    let before = script_calls(&redis).await;
    for i in 0..25 {
        let key = format!("cycle-{i}");
        let grant = app.grant(&key, "").await;
        app.release_ok(&key, &grant.token).await;
    }
    assert_eq!(script_calls(&redis).await - before, 50);
}

#[tokio::test]
async fn an_acquire_that_waits_costs_a_handful_of_round_trips_however_long_it_waits() {
    let (redis, app) = warmed_up().await;
    redis.wait_until_listening(1).await;
    let holder = app.grant("held", "ttl_ms=30000").await;
    let before = script_calls(&redis).await;
    let waiter = app.spawn_acquire("held", "wait_ms=20000");
    // Let it wait 3.5 s: a poll every 5 ms would cost about 1,400 round trips; with release
    // notices it is one look on arrival (claim and read) and a few slow fallback polls.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let waiting = script_calls(&redis).await - before;
    assert!(
        (2..=6).contains(&waiting),
        "{waiting} round trips while waiting 3.5 s"
    );
    app.release_ok("held", &holder.token).await;
    let grant = waiter
        .await
        .expect("the waiter task")
        .expect_grant(StatusCode::CREATED);
    assert!(grant.fence > holder.fence);
    // The release, which grants the key to the waiter outright (one broker): the waiter's ask
    // takes that grant without another call.
    let total = script_calls(&redis).await - before;
    assert_eq!(total, waiting + 1, "{total} round trips in all");
}

/// The names of the function libraries loaded on `redis`.
async fn libraries(redis: &RedisServer) -> Vec<String> {
    let mut conn = redis.connection().await;
    let listed: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("FUNCTION")
        .arg("LIST")
        .query_async(&mut conn)
        .await
        .expect("FUNCTION LIST");
    listed
        .iter()
        .map(|library| redis::from_redis_value_ref(&library["library_name"]).unwrap())
        .collect()
}

#[tokio::test]
async fn the_scripts_run_as_one_library_loaded_once_per_server_and_again_where_it_was_lost() {
    let (redis, app) = warmed_up().await;
    let loaded = libraries(&redis).await;
    assert_eq!(loaded.len(), 1, "{loaded:?}");
    assert!(loaded[0].starts_with("lockbroker_"), "{loaded:?}");
    assert_eq!(redis.command_calls("function|load").await, 1);
    assert_eq!(
        redis.command_calls("evalsha").await,
        0,
        "every lock script ran as a function"
    );
    let before = redis.command_calls("fcall").await;
    let grant = app.grant("k", "").await;
    app.release_ok("k", &grant.token).await;
    assert_eq!(redis.command_calls("fcall").await - before, 2);

    // An operator's FUNCTION FLUSH: the next call finds no function, loads the library again
    // and runs; nothing answers an error.
    let mut conn = redis.connection().await;
    let () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .expect("FUNCTION FLUSH");
    assert!(libraries(&redis).await.is_empty());
    let grant = app.grant("k", "").await;
    app.release_ok("k", &grant.token).await;
    assert_eq!(libraries(&redis).await, loaded);
    assert_eq!(redis.command_calls("function|load").await, 2);
    assert_eq!(redis.command_calls("evalsha").await, 0);
}
