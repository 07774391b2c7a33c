//! The harness: a throwaway `redis-server` per test (after redis-rs's `redis-test`), brokers run
//! in this process on port 0 (after zero-to-production's `spawn_app`), and small helpers that
//! speak the API over real HTTP.

use std::net::TcpListener as StdTcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lockbroker::config::{Config, LogFormat, StoreBackend};
use lockbroker::startup::Application;
use reqwest::header::HeaderMap;
use reqwest::{Client, Method, RequestBuilder, Response, StatusCode};
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long a fresh `redis-server` gets to answer PING before the test gives up.
const REDIS_START_LIMIT: Duration = Duration::from_secs(5);

/// Bound on any one HTTP request from a test: above the longest wait a test asks for (30 s in
/// the concurrency test) plus the store timeout, so only a hung broker trips it.
const REQUEST_LIMIT: Duration = Duration::from_secs(45);

/// Test logs are for debugging a failure: printed only when asked for with `TEST_LOG=1`.
pub fn init_test_log() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        if std::env::var_os("TEST_LOG").is_some() {
            lockbroker::telemetry::init(LogFormat::Text, "info,lockbroker=debug");
        }
    });
}

/// A loopback port that was free a moment ago. Whoever binds it next may lose a race with
/// another process; callers that start servers on it retry with another port.
pub fn free_port() -> u16 {
    StdTcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("cannot bind a loopback port")
        .port()
}

/// Unix epoch milliseconds on this host (the clock Redis reads too: it runs here).
pub fn now_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is past 1970");
    u64::try_from(since.as_millis()).expect("milliseconds fit in u64")
}

/// A unique path in the temp directory for a child process's output.
pub fn temp_log(what: &str) -> PathBuf {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    std::env::temp_dir().join(format!(
        "lockbroker-api-test-{what}-{}-{}.log",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A `redis-server` of this test's own, on a free loopback port, with no persistence: killed
/// (and reaped) when dropped.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    log: PathBuf,
    /// Where the append-only file lives once [`RedisServer::persist_to_aof`] turned it on; a
    /// restart then loads it.
    aof_dir: Option<PathBuf>,
}

/// Why one launch of `redis-server` did not come up.
enum LaunchError {
    /// The port was taken between picking it and redis binding it.
    PortBusy,
    Other(String),
}

impl RedisServer {
    /// Starts a server on a free port, trying another port if the one picked was taken.
    pub async fn start() -> Self {
        let mut last = String::new();
        for _ in 0..10 {
            let port = free_port();
            let mut server = Self {
                port,
                child: None,
                log: temp_log(&format!("redis-{port}")),
                aof_dir: None,
            };
            match server.launch().await {
                Ok(()) => return server,
                Err(LaunchError::PortBusy) => last = format!("port {port} was busy"),
                Err(LaunchError::Other(why)) => panic!("redis-server did not start: {why}"),
            }
        }
        panic!("redis-server did not start on any free port ({last})");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// A connection of the test's own, to look at what the brokers wrote.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("a valid URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to the test Redis")
    }

    /// Polls until `brokers` brokers listen for release notices on Redis. Each broker listens on
    /// one subscriber connection, on the channel `<prefix>released`.
    pub async fn wait_until_listening(&self, brokers: u64) {
        let mut conn = self.connection().await;
        let started = Instant::now();
        loop {
            let (_, listening): (String, u64) = redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg("lockbroker:released")
                .query_async(&mut conn)
                .await
                .expect("PUBSUB NUMSUB");
            if listening >= brokers {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "only {listening} of {brokers} brokers listen for release notices after 5 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the server and waits for it: its data is gone, like a Redis that crashed.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts an empty server again on the same port (the brokers keep their URL). The port can
    /// stay busy for a moment after the old server died, so this retries for a few seconds.
    pub async fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + REDIS_START_LIMIT;
        loop {
            match self.launch().await {
                Ok(()) => return,
                Err(LaunchError::PortBusy) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(LaunchError::PortBusy) => {
                    panic!("port {} stayed busy; cannot restart redis", self.port)
                }
                Err(LaunchError::Other(why)) => panic!("redis-server did not restart: {why}"),
            }
        }
    }

    /// Restarts the server with an append-only file (every write fsynced) in a directory of its
    /// own: from then on a restart loads it, as a Redis with persistence does. Call it before
    /// the brokers start.
    pub async fn persist_to_aof(&mut self) {
        let dir = temp_log(&format!("redis-{}-aof", self.port));
        std::fs::create_dir_all(&dir).expect("cannot create the AOF directory");
        self.aof_dir = Some(dir);
        self.restart().await;
    }

    /// Freezes the server (SIGSTOP): connections stay open but nothing is answered, as with a
    /// Redis stuck in a long command or a network that drops packets.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server (SIGCONT); it then runs what was sent to it meanwhile.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("redis-server is running");
        send_signal(child.id(), signal);
    }

    async fn launch(&mut self) -> Result<(), LaunchError> {
        let log = std::fs::File::create(&self.log).expect("cannot create the redis log file");
        let log_err = log.try_clone().expect("cannot clone the log file handle");
        let spawned = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(match self.aof_dir {
                Some(_) => ["--appendonly", "yes", "--appendfsync", "always"],
                None => ["--appendonly", "no", "--appendfsync", "everysec"],
            })
            .arg("--dir")
            .arg(self.aof_dir.clone().unwrap_or_else(std::env::temp_dir))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not on PATH: the API tests start their own Redis. Run the \
                 README's test command, scripts/test.sh, which installs it."
            ),
            Err(e) => {
                return Err(LaunchError::Other(format!(
                    "cannot spawn redis-server: {e}"
                )));
            }
        };
        let child = self.child.insert(child);
        let deadline = Instant::now() + REDIS_START_LIMIT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                let log = self.log_text();
                return Err(if log.contains("Address already in use") {
                    LaunchError::PortBusy
                } else {
                    LaunchError::Other(format!("it exited with {status}; its log:\n{log}"))
                });
            }
            if ping(self.port).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.stop();
                return Err(LaunchError::Other(format!(
                    "it did not answer PING within {REDIS_START_LIMIT:?}; its log:\n{}",
                    self.log_text()
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_else(|e| format!("(no log: {e})"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_file(&self.log);
        if let Some(dir) = &self.aof_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Whether a Redis on `port` answers `PING` with `PONG`.
async fn ping(port: u16) -> bool {
    let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}/")) else {
        return false;
    };
    let exchange = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    matches!(
        tokio::time::timeout(Duration::from_millis(500), exchange).await,
        Ok(Ok(pong)) if pong == "PONG"
    )
}

/// Sends `signal` (such as `-TERM`) to a process with the system's `kill`.
pub fn send_signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .arg(signal)
        .arg(pid.to_string())
        .status()
        .expect("cannot run kill");
    assert!(status.success(), "kill {signal} {pid} failed: {status}");
}

/// A client for the tests: never through a proxy (the brokers are on loopback), and bounded.
pub fn http_client() -> Client {
    Client::builder()
        .no_proxy()
        .timeout(REQUEST_LIMIT)
        .build()
        .expect("cannot build the HTTP client")
}

/// A broker running in this process, on its own port.
pub struct TestApp {
    /// `http://127.0.0.1:PORT`
    pub address: String,
    pub client: Client,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<std::io::Result<()>>>,
}

/// A broker on Redis at `redis_url`, or on the embedded store with `None`.
pub async fn spawn_app(redis_url: Option<String>) -> TestApp {
    spawn_app_with(redis_url, |_| {}).await
}

/// As [`spawn_app`], with the configuration adjusted by `tweak` first.
pub async fn spawn_app_with(redis_url: Option<String>, tweak: impl FnOnce(&mut Config)) -> TestApp {
    init_test_log();
    let mut config = Config {
        listen: "127.0.0.1:0".parse().expect("a valid address"),
        redis_url: StoreBackend::parse(redis_url.as_deref().unwrap_or_default())
            .expect("a valid Redis URL"),
        // A new Redis per test: no settling time before the first grant (the tests of the
        // settling set their own).
        store_settle_ms: 0,
        ..Config::default()
    };
    tweak(&mut config);
    let app = Application::build(&config)
        .await
        .expect("the broker must build");
    let address = format!("http://{}", app.local_addr());
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until_stopped(async move {
        let _ = stopped.await;
    }));
    TestApp {
        address,
        client: http_client(),
        stop: Some(stop),
        server: Some(server),
    }
}

/// The body of a grant (`201` on acquire, `200` on renew). Exactly these fields: an extra one
/// (a second token, say) fails to parse.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    pub key: String,
    pub token: String,
    pub fence: u64,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
}

/// A response read to the end: status, headers and the raw body.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub text: String,
}

impl Answer {
    pub async fn read(response: Response) -> Self {
        let status = response.status();
        let headers = response.headers().clone();
        let text = response
            .text()
            .await
            .expect("cannot read the response body");
        Self {
            status,
            headers,
            text,
        }
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("the body is not JSON ({e}): {:?}", self.text))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("an ASCII header"))
    }

    /// Asserts the status, with the body in the failure message.
    pub fn expect_status(&self, status: StatusCode) -> &Self {
        assert_eq!(
            self.status, status,
            "unexpected answer, body: {}",
            self.text
        );
        self
    }

    /// Asserts an error answer in the API's format: this status, a JSON body whose `error` is
    /// `code` and whose `message` is a non-empty sentence. Returns the body.
    pub fn expect_error(&self, status: StatusCode, code: &str) -> Value {
        self.expect_status(status);
        assert!(
            self.header("content-type")
                .is_some_and(|t| t.starts_with("application/json")),
            "an error must be JSON, got content-type {:?}",
            self.header("content-type")
        );
        let body = self.json();
        assert_eq!(body["error"], code, "wrong error code in {body}");
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|m| !m.trim().is_empty()),
            "an error needs a message: {body}"
        );
        let extra: Vec<&String> = body
            .as_object()
            .expect("an error body is an object")
            .keys()
            .filter(|k| !matches!(k.as_str(), "error" | "message" | "retry_after_ms"))
            .collect();
        assert!(extra.is_empty(), "unexpected fields {extra:?} in {body}");
        body
    }

    /// Asserts a grant with this status and parses it.
    pub fn expect_grant(&self, status: StatusCode) -> Grant {
        self.expect_status(status);
        serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("not a grant body ({e}): {}", self.text))
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.address)
    }

    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.client.request(method, self.url(path))
    }

    /// Sends a request and reads the whole answer.
    pub async fn send(&self, request: RequestBuilder) -> Answer {
        Answer::read(
            request
                .send()
                .await
                .expect("the request must reach the broker"),
        )
        .await
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
        let request = self.request(Method::POST, &lock_path(key, query));
        tokio::spawn(async move {
            let response = request
                .send()
                .await
                .expect("the request must reach the broker");
            Answer::read(response).await
        })
    }

    /// Acquires and asserts `201`.
    pub async fn grant(&self, key: &str, query: &str) -> Grant {
        self.acquire(key, query)
            .await
            .expect_grant(StatusCode::CREATED)
    }

    /// `DELETE /locks/{key}` with the token in the `Lock-Token` header.
    pub async fn release(&self, key: &str, token: &str) -> Answer {
        self.send(
            self.request(Method::DELETE, &lock_path(key, ""))
                .header("Lock-Token", token),
        )
        .await
    }

    /// `POST /locks/{key}/renew?{query}` with the token in the `Lock-Token` header.
    pub async fn renew(&self, key: &str, token: &str, query: &str) -> Answer {
        self.send(
            self.request(Method::POST, &lock_path(&format!("{key}/renew"), query))
                .header("Lock-Token", token),
        )
        .await
    }

    /// `GET /locks/{key}`.
    pub async fn inspect(&self, key: &str) -> Answer {
        self.get(&lock_path(key, "")).await
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

pub fn lock_path(key: &str, query: &str) -> String {
    if query.is_empty() {
        format!("/locks/{key}")
    } else {
        format!("/locks/{key}?{query}")
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

    pub async fn start_with(kind: StoreKind, tweak: impl FnOnce(&mut Config)) -> Self {
        let redis = match kind {
            StoreKind::Embedded => None,
            StoreKind::Redis => Some(RedisServer::start().await),
        };
        let app = spawn_app_with(redis.as_ref().map(RedisServer::url), tweak).await;
        Self { app, redis }
    }

    /// Another broker on the same store: on Redis it shares the locks; the embedded store is
    /// per broker, so there it is a fresh, unrelated broker.
    pub async fn another_app(&self, tweak: impl FnOnce(&mut Config)) -> TestApp {
        spawn_app_with(self.redis.as_ref().map(RedisServer::url), tweak).await
    }
}

/// Runs each named `async fn(&Backend)` as two tests, one per store: `<module>::on_the_embedded_store::<name>`
/// and `<module>::on_redis::<name>`. The contract is written once and holds for both.
macro_rules! on_both_stores {
    ($($name:ident),+ $(,)?) => {
        mod on_the_embedded_store {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let backend = $crate::helpers::Backend::start(
                        $crate::helpers::StoreKind::Embedded,
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
                        $crate::helpers::Backend::start($crate::helpers::StoreKind::Redis).await;
                    super::$name(&backend).await;
                }
            )+
        }
    };
}
pub(crate) use on_both_stores;
