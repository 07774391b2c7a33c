//! `lockbroker-bench floor-proxy`: the floor the broker is measured against — a minimal HTTP
//! lock proxy on the broker's own foundations (hyper's HTTP/1.1 server, the redis crate's
//! multiplexed connection), without even a router, that does the textbook Redis lock and
//! nothing else. `POST /locks/{key}` is one
//! `SET key token NX PX ttl` (`201` with the token, `409` if taken); `DELETE /locks/{key}` with
//! the token in the `Lock-Token` header or the `token` query parameter is one Lua
//! compare-and-delete (`204`, or `409` if the token does not hold it). No fences, waiting,
//! metrics, auth, tracing or ledger.
//!
//! It runs as a process of its own (the bench's `--floor` starts it), so that its CPU time can
//! be read from `/proc` as the broker's is. It is never part of `serve`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
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
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    // The bench reads this line to learn the port.
    lockbroker_cli_support::out!("{}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        let proxy = proxy.clone();
        tokio::spawn(async move {
            let serve = service_fn(move |request| {
                let proxy = proxy.clone();
                async move { Ok::<_, Infallible>(proxy.answer(request).await) }
            });
            // A connection that breaks ends alone; the proxy goes on.
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), serve)
                .await;
        });
    }
}

type Answer = Response<Full<Bytes>>;

fn answer(status: StatusCode, body: impl Into<Bytes>) -> Answer {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
}

/// `name`'s value in a query string, undecoded (the bench's values need no decoding).
fn query_value<'q>(query: Option<&'q str>, name: &str) -> Option<&'q str> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == name).then_some(v)
    })
}

impl Proxy {
    /// `POST` and `DELETE` on `/locks/{key}`; anything else is 404 or 405.
    async fn answer(&self, request: Request<Incoming>) -> Answer {
        let Some(key) = request.uri().path().strip_prefix("/locks/") else {
            return answer(StatusCode::NOT_FOUND, "");
        };
        if key.is_empty() || key.contains('/') {
            return answer(StatusCode::NOT_FOUND, "");
        }
        let query = request.uri().query();
        match *request.method() {
            Method::POST => self.acquire(key, query).await,
            Method::DELETE => {
                let token = match request.headers().get("lock-token").map(|v| v.to_str()) {
                    Some(Ok(token)) => token,
                    Some(Err(_)) => return answer(StatusCode::BAD_REQUEST, "bad token"),
                    None => match query_value(query, "token") {
                        Some(token) => token,
                        None => return answer(StatusCode::BAD_REQUEST, "no token"),
                    },
                };
                self.release(key, token).await
            }
            _ => answer(StatusCode::METHOD_NOT_ALLOWED, ""),
        }
    }

    async fn acquire(&self, key: &str, query: Option<&str>) -> Answer {
        let ttl_ms = match query_value(query, "ttl_ms").map(str::parse::<u64>) {
            None => DEFAULT_TTL_MS,
            Some(Ok(ms)) if ms > 0 => ms,
            Some(_) => return answer(StatusCode::BAD_REQUEST, "bad ttl_ms"),
        };
        let token = Token::generate();
        let taken: redis::RedisResult<Option<String>> = redis::cmd("SET")
            .arg(format!("{}{key}", self.key_prefix))
            .arg(token.as_str())
            .arg("NX")
            .arg("PX")
            .arg(ttl_ms)
            .query_async(&mut self.redis.clone())
            .await;
        match taken {
            Ok(Some(_)) => {
                let mut granted = answer(
                    StatusCode::CREATED,
                    format!(r#"{{"token":"{}"}}"#, token.as_str()),
                );
                (granted.headers_mut())
                    .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                granted
            }
            Ok(None) => answer(StatusCode::CONFLICT, ""),
            Err(e) => answer(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    }

    async fn release(&self, key: &str, token: &str) -> Answer {
        let deleted: redis::RedisResult<i64> = self
            .release
            .key(format!("{}{key}", self.key_prefix))
            .arg(token)
            .invoke_async(&mut self.redis.clone())
            .await;
        match deleted {
            Ok(1) => answer(StatusCode::NO_CONTENT, ""),
            Ok(_) => answer(StatusCode::CONFLICT, ""),
            Err(e) => answer(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
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
