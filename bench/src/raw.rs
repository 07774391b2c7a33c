//! The raw-Redis phase: the textbook lock cycle done by this process straight on Redis, with
//! nothing of the broker's — `SET key token NX PX 10000` to take the lock and a Lua
//! compare-and-delete to release it. It is the baseline a client could reach by talking to Redis
//! itself, without fences, epochs, waiters or an HTTP hop.
//!
//! Each client has a connection of its own with one command in flight, as each HTTP client has
//! one connection with one request in flight, and as `redis-benchmark -c N` drives Redis: one
//! shared, pipelined connection would let Redis answer many clients per read and write, a
//! batching the HTTP phases do not get.

use std::sync::atomic::Ordering;
use std::time::Instant;

use redis::aio::MultiplexedConnection;

use super::http::drive;
use super::{BenchArgs, Phase};
use lockbroker::domain::Token;

/// Deletes the key only if it still holds this token: the release every Redis lock recipe uses.
const COMPARE_AND_DELETE: &str = include_str!("compare_and_delete.lua");

pub(super) async fn uncontended_raw(
    client: &redis::Client,
    args: &BenchArgs,
    run_id: &str,
    progress: bool,
) -> anyhow::Result<Phase> {
    let release = redis::Script::new(COMPARE_AND_DELETE);
    let mut conns: Vec<MultiplexedConnection> = Vec::with_capacity(args.clients);
    for _ in 0..args.clients {
        conns.push(client.get_multiplexed_async_connection().await?);
    }
    let phase = drive(
        "uncontended (raw Redis)",
        args.clients,
        args,
        progress,
        |i, tally| {
            let mut conn = conns[i].clone();
            let release = release.clone();
            let key = format!("{}bench-{run_id}-r{i}", args.key_prefix);
            async move {
                let mut local = Vec::new();
                while !tally.stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let token = Token::generate();
                    let taken: redis::RedisResult<Option<String>> = redis::cmd("SET")
                        .arg(&key)
                        .arg(token.as_str())
                        .arg("NX")
                        .arg("PX")
                        .arg(10_000)
                        .query_async(&mut conn)
                        .await;
                    let ok = match taken {
                        Ok(Some(_)) => matches!(
                            release
                                .key(&key)
                                .arg(token.as_str())
                                .invoke_async::<i64>(&mut conn)
                                .await,
                            Ok(1)
                        ),
                        _ => false,
                    };
                    tally.count(ok, started, &mut local);
                }
                tally.record(local);
            }
        },
    )
    .await;
    Ok(phase)
}
