//! `lockbroker-bench floor-proxy`: the floor the broker is measured against — a minimal HTTP
//! lock proxy in the broker's own stack (axum, hyper, the redis crate's multiplexed connection)
//! that does the textbook Redis lock and nothing else. `POST /locks/{key}` is one
//! `SET key token NX PX ttl` (`201` with the token, `409` if taken); `DELETE /locks/{key}` with
//! the token in the `Lock-Token` header or the `token` query parameter is one Lua
//! compare-and-delete (`204`, or `409` if the token does not hold it). No fences, waiting,
//! metrics, auth, tracing or ledger.
//!
//! It runs as a process of its own (the bench's `--floor` starts it), so that its CPU time can
//! be read from `/proc` as the broker's is. It is never part of `serve`.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use clap::Args;
use redis::aio::MultiplexedConnection;

use lockbroker::domain::Token;

/// `lockbroker-bench floor-proxy` flags.
#[derive(Debug, Clone, Args)]
pub struct FloorProxyArgs {
    /// Where to listen; port 0 picks a free one. The address is printed on stdout once bound.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// The Redis to keep the locks in (one server).
    #[arg(long)]
    pub redis_url: String,
    /// Prefix of the proxy's keys in Redis.
    #[arg(long, default_value = "floor:")]
    pub key_prefix: String,
}

/// Deletes the key only if it still holds the token (the raw phase's release too).
const COMPARE_AND_DELETE: &str = include_str!("compare_and_delete.lua");

/// A lease length for an acquire that gives no `ttl_ms`.
const DEFAULT_TTL_MS: u64 = 10_000;

struct Proxy {
    redis: MultiplexedConnection,
    release: redis::Script,
    key_prefix: String,
}

/// Serves the proxy until the process is stopped.
pub(crate) async fn serve(args: FloorProxyArgs) -> anyhow::Result<()> {
    let client = redis::Client::open(args.redis_url.as_str())?;
    let redis = client
        .get_multiplexed_async_connection()
        .await
        .with_context(|| format!("cannot connect to {}", args.redis_url))?;
    let proxy = Arc::new(Proxy {
        redis,
        release: redis::Script::new(COMPARE_AND_DELETE),
        key_prefix: args.key_prefix,
    });
    let app = Router::new()
        .route("/locks/{key}", post(acquire).delete(release))
        .with_state(proxy);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    // The bench reads this line to learn the port.
    lockbroker_cli_support::out!("{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// `name`'s value in a query string, undecoded (the bench's values need no decoding).
fn query_value<'q>(query: Option<&'q str>, name: &str) -> Option<&'q str> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == name).then_some(v)
    })
}

async fn acquire(
    State(proxy): State<Arc<Proxy>>,
    Path(key): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let ttl_ms = match query_value(query.as_deref(), "ttl_ms").map(str::parse::<u64>) {
        None => DEFAULT_TTL_MS,
        Some(Ok(ms)) if ms > 0 => ms,
        Some(_) => return (StatusCode::BAD_REQUEST, "bad ttl_ms").into_response(),
    };
    let token = Token::generate();
    let taken: redis::RedisResult<Option<String>> = redis::cmd("SET")
        .arg(format!("{}{key}", proxy.key_prefix))
        .arg(token.as_str())
        .arg("NX")
        .arg("PX")
        .arg(ttl_ms)
        .query_async(&mut proxy.redis.clone())
        .await;
    match taken {
        Ok(Some(_)) => (
            StatusCode::CREATED,
            [("content-type", "application/json")],
            format!(r#"{{"token":"{}"}}"#, token.as_str()),
        )
            .into_response(),
        Ok(None) => StatusCode::CONFLICT.into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

async fn release(
    State(proxy): State<Arc<Proxy>>,
    Path(key): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Response {
    let token = match headers.get("lock-token").map(|v| v.to_str()) {
        Some(Ok(token)) => token,
        Some(Err(_)) => return (StatusCode::BAD_REQUEST, "bad token").into_response(),
        None => match query_value(query.as_deref(), "token") {
            Some(token) => token,
            None => return (StatusCode::BAD_REQUEST, "no token").into_response(),
        },
    };
    let deleted: redis::RedisResult<i64> = proxy
        .release
        .key(format!("{}{key}", proxy.key_prefix))
        .arg(token)
        .invoke_async(&mut proxy.redis.clone())
        .await;
    match deleted {
        Ok(1) => StatusCode::NO_CONTENT.into_response(),
        Ok(_) => StatusCode::CONFLICT.into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::query_value;

    #[test]
    fn query_values_are_found_by_exact_name() {
        let q = Some("ttl_ms=10000&wait_ms=0&token=abc");
        assert_eq!(query_value(q, "ttl_ms"), Some("10000"));
        assert_eq!(query_value(q, "token"), Some("abc"));
        assert_eq!(query_value(q, "ttl"), None);
        assert_eq!(query_value(None, "ttl_ms"), None);
    }
}
