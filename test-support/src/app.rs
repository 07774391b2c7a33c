//! Brokers run in the test process, on port 0 ([`spawn_app`]), each with its own configuration;
//! [`TestApp`] sends the API's requests to one. [`Backend`] pairs a broker with the store it
//! needs, and [`on_both_stores!`](crate::on_both_stores) runs one contract on each store.

use std::sync::Arc;
use std::time::Duration;

use lockbroker::Application;
use lockbroker::config::{Config, Settings};
use reqwest::{Client, Method, RequestBuilder, StatusCode};
use serde_json::Value;
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;

use crate::http::{Answer, Grant, http_client, lock_path};
use crate::init_test_log;
use crate::redis_server::RedisServer;

/// A broker running in this process, on its own port.
pub struct TestApp {
    /// `http://127.0.0.1:PORT` (`https://` when the broker serves TLS)
    pub address: String,
    pub client: Client,
    /// Reads the auth and TLS files again, as `SIGHUP` does.
    reload: Arc<Notify>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<std::io::Result<()>>>,
}

/// A broker on Redis at `redis_url`, or on the embedded store with `None`.
pub async fn spawn_app(redis_url: Option<String>) -> TestApp {
    spawn_app_with(redis_url, |_| {}).await
}

/// `n` brokers on Redis at `redis_url`, each with its settings adjusted by `tweak` (as
/// [`spawn_app_with`]).
pub async fn spawn_apps(redis_url: &str, n: usize, tweak: impl Fn(&mut Settings)) -> Vec<TestApp> {
    let mut apps = Vec::with_capacity(n);
    for _ in 0..n {
        apps.push(spawn_app_with(Some(redis_url.to_owned()), &tweak).await);
    }
    apps
}

/// `N` brokers with the default settings on `redis`, once all `N` listen for its release
/// notices.
pub async fn listening_apps<const N: usize>(redis: &RedisServer) -> [TestApp; N] {
    let apps = spawn_apps(&redis.url(), N, |_| {}).await;
    redis.wait_until_listening(N as u64).await;
    apps.try_into().unwrap_or_else(|_| unreachable!("N apps"))
}

/// As [`spawn_app`], with the settings adjusted by `tweak` first (as flags would give them:
/// checked as a broker checks its own).
pub async fn spawn_app_with(
    redis_url: Option<String>,
    tweak: impl FnOnce(&mut Settings),
) -> TestApp {
    start(redis_url, tweak, false).await
}

/// A broker on the embedded store that also serves `GET /_test/panic`, whose handler panics
/// (see `Application::build_with_panic_route`).
pub async fn spawn_app_with_panic_route() -> TestApp {
    start(None, |_| {}, true).await
}

async fn start(
    redis_url: Option<String>,
    tweak: impl FnOnce(&mut Settings),
    panic_route: bool,
) -> TestApp {
    init_test_log();
    let mut settings = Settings {
        listen: Some("127.0.0.1:0".into()),
        redis_url,
        // A new Redis per test: no settling time before the first grant (the tests of the
        // settling set their own).
        store_settle_ms: Some(0),
        ..Settings::default()
    };
    tweak(&mut settings);
    let config =
        Config::resolve(settings, Settings::default()).expect("the settings must be valid");
    let app = match panic_route {
        false => Application::build(&config).await,
        true => Application::build_with_panic_route(&config).await,
    }
    .expect("the broker must build");
    let address = format!("{}://{}", app.scheme(), app.local_addr());
    let reload = app.reload_trigger();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until_stopped(async move {
        let _ = stopped.await;
    }));
    TestApp {
        address,
        client: http_client(),
        reload,
        stop: Some(stop),
        server: Some(server),
    }
}

impl TestApp {
    /// Asks the broker to read its auth and TLS files again, as `SIGHUP` does.
    pub fn reload(&self) {
        self.reload.notify_one();
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.address)
    }

    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.client.request(method, self.url(path))
    }

    /// Sends a request and reads the whole answer.
    pub async fn send(&self, request: RequestBuilder) -> Answer {
        Answer::send(request).await
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.send(self.request(Method::GET, path)).await
    }

    /// `POST /locks/{key}?{query}` with no body. `key` goes into the path as given, so a test
    /// can send percent-escapes.
    pub async fn acquire(&self, key: &str, query: &str) -> Answer {
        self.send(self.request(Method::POST, &lock_path(key, query)))
            .await
    }

    /// `POST /locks/{key}?{query}` with a JSON body.
    pub async fn acquire_json(&self, key: &str, query: &str, body: Value) -> Answer {
        self.send(
            self.request(Method::POST, &lock_path(key, query))
                .json(&body),
        )
        .await
    }

    /// Starts `POST /locks/{key}?{query}` as a task of its own, for a request that waits.
    /// Aborting the task drops the request: the client goes away and its connection closes.
    pub fn spawn_acquire(&self, key: &str, query: &str) -> JoinHandle<Answer> {
        spawn(self.request(Method::POST, &lock_path(key, query)))
    }

    /// Acquires and asserts `201`.
    pub async fn grant(&self, key: &str, query: &str) -> Grant {
        self.acquire(key, query)
            .await
            .expect_grant(StatusCode::CREATED)
    }

    /// `DELETE /locks/{key}` with the token in the `Lock-Token` header.
    pub async fn release(&self, key: &str, token: &str) -> Answer {
        self.with_token(Method::DELETE, &lock_path(key, ""), token)
            .await
    }

    /// Releases and asserts `204`.
    pub async fn release_ok(&self, key: &str, token: &str) {
        self.release(key, token)
            .await
            .expect_status(StatusCode::NO_CONTENT);
    }

    /// Acquires and asserts `409` `locked`; the error body.
    pub async fn expect_locked(&self, key: &str, query: &str) -> Value {
        self.acquire(key, query)
            .await
            .expect_error(StatusCode::CONFLICT, "locked")
    }

    /// `POST /locks/{key}/renew?{query}` with the token in the `Lock-Token` header.
    pub async fn renew(&self, key: &str, token: &str, query: &str) -> Answer {
        let path = lock_path(&format!("{key}/renew"), query);
        self.with_token(Method::POST, &path, token).await
    }

    /// `POST /semaphores/{key}?{query}`: takes a permit.
    pub async fn take(&self, key: &str, query: &str) -> Answer {
        self.send(self.request(Method::POST, &semaphore_path(key, query)))
            .await
    }

    /// Starts `POST /semaphores/{key}?{query}` as a task of its own, as [`Self::spawn_acquire`].
    pub fn spawn_take(&self, key: &str, query: &str) -> JoinHandle<Answer> {
        spawn(self.request(Method::POST, &semaphore_path(key, query)))
    }

    /// `method path` with `token` in the `Lock-Token` header.
    pub async fn with_token(&self, method: Method, path: &str, token: &str) -> Answer {
        self.send(self.request(method, path).header("Lock-Token", token))
            .await
    }

    /// `GET /locks/{key}`.
    pub async fn inspect(&self, key: &str) -> Answer {
        self.get(&lock_path(key, "")).await
    }

    /// `GET /locks/{key}`, asserted `200`: the body that shows the key's holders.
    pub async fn inspect_held(&self, key: &str) -> Value {
        self.inspect(key).await.expect_status(StatusCode::OK).json()
    }

    /// Stops the broker gracefully and waits until it has stopped.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let server = self.server.take().expect("the server task is there");
        let result = tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the broker must stop within 10 s")
            .expect("the server task must not panic");
        result.expect("the broker must stop cleanly");
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

/// Which store a broker keeps its locks in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    Embedded,
    Redis,
}

/// A broker together with the store it needs: the tests that hold for both stores take one.
pub struct Backend {
    /// Declared before `redis` so the broker stops before its Redis does.
    pub app: TestApp,
    pub redis: Option<RedisServer>,
}

impl Backend {
    pub async fn start(kind: StoreKind) -> Self {
        Self::start_with(kind, |_| {}).await
    }

    pub async fn start_with(kind: StoreKind, tweak: impl FnOnce(&mut Settings)) -> Self {
        let redis = match kind {
            StoreKind::Embedded => None,
            StoreKind::Redis => Some(RedisServer::start().await),
        };
        let app = spawn_app_with(redis.as_ref().map(RedisServer::url), tweak).await;
        Self { app, redis }
    }

    /// Another broker on the same store: on Redis it shares the locks; the embedded store is
    /// per broker, so there it is a fresh, unrelated broker.
    pub async fn another_app(&self, tweak: impl FnOnce(&mut Settings)) -> TestApp {
        spawn_app_with(self.redis.as_ref().map(RedisServer::url), tweak).await
    }
}

/// Runs each named `async fn(&Backend)` as two tests, one per store:
/// `<module>::on_the_embedded_store::<name>` and `<module>::on_redis::<name>`. The contract is
/// written once and holds for both. The calling crate needs `tokio` (for `#[tokio::test]`).
#[macro_export]
macro_rules! on_both_stores {
    ($($name:ident),+ $(,)?) => {
        mod on_the_embedded_store {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let backend = $crate::app::Backend::start(
                        $crate::app::StoreKind::Embedded,
                    )
                    .await;
                    super::$name(&backend).await;
                }
            )+
        }

        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let backend =
                        $crate::app::Backend::start($crate::app::StoreKind::Redis).await;
                    super::$name(&backend).await;
                }
            )+
        }
    };
}

/// Sends `request` as a task of its own, for a request that waits. Aborting the task drops the
/// request: the client goes away and its connection closes.
fn spawn(request: RequestBuilder) -> JoinHandle<Answer> {
    tokio::spawn(Answer::send(request))
}

/// `/semaphores/{key}`, with `?{query}` unless it is empty.
pub fn semaphore_path(key: &str, query: &str) -> String {
    if query.is_empty() {
        format!("/semaphores/{key}")
    } else {
        format!("/semaphores/{key}?{query}")
    }
}
