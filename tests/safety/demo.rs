//! The check-then-insert demo, end to end. Application nodes behind a load balancer run "if no
//! business-log row named X exists, insert one" against one shared database, and a script fires
//! 10,000 requests at them. Without a distributed lock the check and the insert race across nodes
//! and the table gets duplicates; with the lock (as a typical Java wrapper takes it:
//! `RedisLockUtil(redisTemplate, key, 10000, 20000)`, here three brokers on one Redis) exactly
//! one row is left.
//!
//! Here: the database is a SQLite file that three app nodes (small HTTP servers in this process,
//! each with its own connections to the file) share; the load balancer is the test's TCP proxy
//! spreading connections over the nodes in turn; each node asks its own broker for the lock; 64
//! concurrent clients send the 10,000 requests. A sleep between the check and the insert widens
//! the race, as a slow database would.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use lockbroker_test_support::app::spawn_app;
use lockbroker_test_support::http::http_client;
use lockbroker_test_support::redis_server::RedisServer;
use rand::RngExt;
use rusqlite::Connection;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::proxy::Proxy;

/// The requests the load script sends.
const REQUESTS: usize = 10_000;
/// How many are in flight at once.
const CLIENTS: usize = 64;
/// Between "no row yet" and the insert: widens the race, as a slow database would.
const RACE_WIDENER: Duration = Duration::from_millis(100);
/// The lock the locked endpoint takes: the example's key, its 10 s wait and 20 s expiry.
const LOCK_KEY: &str = "DistributedServiceImpl.distributedSave";
const LOCK_QUERY: &str = "wait_ms=10000&ttl_ms=20000";
/// The business names of the example's two endpoints ("supports a distributed lock", "does not").
const WITH_LOCK: &str = "支持分布式锁";
const WITHOUT_LOCK: &str = "不支持分布式锁";

/// One application node: a "Tomcat" with its own database connections and its own broker.
struct Node {
    broker: String,
    db: PathBuf,
    pool: Mutex<Vec<Connection>>,
    http: reqwest::Client,
}

fn open(db: &Path) -> Connection {
    let conn = Connection::open(db).expect("open the business database");
    conn.busy_timeout(Duration::from_secs(10))
        .expect("set the busy timeout");
    conn
}

impl Node {
    /// The example's `count(params)` then `save(log)`, on a connection of this node's pool (a
    /// blocking call, so on tokio's blocking threads). Returns whether it inserted.
    async fn save_if_absent(self: &Arc<Self>, name: &'static str, fence: Option<u64>) -> bool {
        let node = self.clone();
        tokio::task::spawn_blocking(move || {
            let conn = node.pool.lock().unwrap().pop();
            let conn = conn.unwrap_or_else(|| open(&node.db));
            let count: i64 = conn
                .query_row(
                    "SELECT count(*) FROM ops_rt_businesslog WHERE business_name = ?1",
                    [name],
                    |row| row.get(0),
                )
                .expect("count the rows");
            let inserted = count < 1;
            if inserted {
                std::thread::sleep(RACE_WIDENER);
                let id = format!("{:032x}", rand::rng().random::<u128>());
                conn.execute(
                    "INSERT INTO ops_rt_businesslog (id, start_time, business_name, fence) \
                     VALUES (?1, ?2, ?3, ?4)",
                    rusqlite::params![
                        id,
                        lockbroker_test_support::now_ms().to_string(),
                        name,
                        fence.map(|f| f.to_string())
                    ],
                )
                .expect("insert the row");
            }
            node.pool.lock().unwrap().push(conn);
            inserted
        })
        .await
        .expect("the database task")
    }
}

/// `/distributedlock/able`: the check-then-insert under the distributed lock.
async fn able(State(node): State<Arc<Node>>) -> (StatusCode, String) {
    let lock = format!("{}/locks/{LOCK_KEY}?{LOCK_QUERY}", node.broker);
    let answer = match node.http.post(lock).send().await {
        Ok(answer) => answer,
        Err(e) => return (StatusCode::BAD_GATEWAY, format!("broker: {e}")),
    };
    if answer.status() != StatusCode::CREATED {
        let status = answer.status();
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "no lock: {status} {}",
                answer.text().await.unwrap_or_default()
            ),
        );
    }
    let grant: serde_json::Value = answer.json().await.expect("a grant");
    let token = grant["token"].as_str().expect("a token").to_owned();
    node.save_if_absent(WITH_LOCK, grant["fence"].as_u64())
        .await;
    let released = node
        .http
        .delete(format!("{}/locks/{LOCK_KEY}", node.broker))
        .header("Lock-Token", token)
        .send()
        .await;
    match released {
        Ok(r) if r.status() == StatusCode::NO_CONTENT => (StatusCode::OK, "success".into()),
        Ok(r) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("release: {}", r.status()),
        ),
        Err(e) => (StatusCode::BAD_GATEWAY, format!("release: {e}")),
    }
}

/// `/distributedlock/disable`: the same check-then-insert, unprotected.
async fn disable(State(node): State<Arc<Node>>) -> (StatusCode, String) {
    node.save_if_absent(WITHOUT_LOCK, None).await;
    (StatusCode::OK, "success".into())
}

/// Starts a node on a free loopback port; it stops when the handle is aborted.
async fn start_node(broker: String, db: PathBuf) -> (std::net::SocketAddr, JoinHandle<()>) {
    let node = Arc::new(Node {
        broker,
        db,
        pool: Mutex::new(Vec::new()),
        http: http_client(),
    });
    let router = Router::new()
        .route("/distributedlock/able", post(able))
        .route("/distributedlock/disable", post(disable))
        .with_state(node);
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port for the node");
    let addr = listener.local_addr().expect("an address");
    let server = tokio::spawn(async move {
        axum::serve(listener, router)
            .await
            .expect("the node serves");
    });
    (addr, server)
}

/// The load script: `REQUESTS` POSTs to `url`, `CLIENTS` at a time. Returns how they were
/// answered (status, count) and how long it took.
async fn fire(url: &str) -> (Vec<(u16, usize)>, Duration) {
    let client = http_client();
    let issued = Arc::new(AtomicUsize::new(0));
    // Every client sends its first request at the same moment, as a burst of traffic does: the
    // race the unlocked endpoint has must show however slowly the tasks get going.
    let start_line = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let started = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (client, issued, url) = (client.clone(), issued.clone(), url.to_owned());
            let start_line = start_line.clone();
            tokio::spawn(async move {
                start_line.wait().await;
                let mut statuses = Vec::new();
                while issued.fetch_add(1, Ordering::Relaxed) < REQUESTS {
                    let status = match client.post(&url).send().await {
                        Ok(r) => r.status().as_u16(),
                        Err(_) => 0,
                    };
                    statuses.push(status);
                }
                statuses
            })
        })
        .collect();
    let limit = Duration::from_secs(120);
    let mut counts = std::collections::BTreeMap::new();
    for joined in tokio::time::timeout(limit, futures::future::join_all(tasks))
        .await
        .unwrap_or_else(|_| panic!("{REQUESTS} requests did not finish within {limit:?}"))
    {
        for status in joined.expect("a client task") {
            *counts.entry(status).or_insert(0) += 1;
        }
    }
    (counts.into_iter().collect(), started.elapsed())
}

fn rows(db: &Path, name: &str) -> i64 {
    open(db)
        .query_row(
            "SELECT count(*) FROM ops_rt_businesslog WHERE business_name = ?1",
            [name],
            |row| row.get(0),
        )
        .expect("count the rows")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_requests_through_three_brokers_leave_exactly_one_row_and_without_the_lock_more_than_one()
 {
    let redis = RedisServer::start().await;
    let brokers = [
        spawn_app(Some(redis.url())).await,
        spawn_app(Some(redis.url())).await,
        spawn_app(Some(redis.url())).await,
    ];
    let dir = std::env::temp_dir().join(format!(
        "lockbroker-demo-{}-{:x}",
        std::process::id(),
        rand::rng().random::<u32>()
    ));
    std::fs::create_dir_all(&dir).expect("a directory for the database");
    let db = dir.join("business.sqlite3");
    let setup = open(&db);
    setup
        .pragma_update(None, "journal_mode", "WAL")
        .expect("WAL mode");
    setup
        .execute(
            "CREATE TABLE ops_rt_businesslog (id TEXT PRIMARY KEY, start_time TEXT NOT NULL, \
             business_name TEXT NOT NULL, fence INTEGER)",
            [],
        )
        .expect("create the table");
    drop(setup);
    let mut nodes = Vec::new();
    let mut servers = Vec::new();
    for broker in &brokers {
        let (addr, server) = start_node(broker.address.clone(), db.clone()).await;
        nodes.push(addr);
        servers.push(server);
    }
    let balancer = Proxy::balance(nodes).await;

    let (without, took_without) =
        fire(&format!("{}/distributedlock/disable", balancer.http_url())).await;
    let rows_without = rows(&db, WITHOUT_LOCK);
    eprintln!(
        "without the lock: {REQUESTS} requests from {CLIENTS} clients over 3 nodes took \
         {took_without:?}, answered {without:?}, and left {rows_without} rows"
    );
    let (with, took_with) = fire(&format!("{}/distributedlock/able", balancer.http_url())).await;
    let rows_with = rows(&db, WITH_LOCK);
    eprintln!(
        "with the lock: {REQUESTS} requests from {CLIENTS} clients over 3 nodes and 3 brokers \
         took {took_with:?}, answered {with:?}, and left {rows_with} row(s)"
    );

    for server in servers {
        server.abort();
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        without,
        vec![(200, REQUESTS)],
        "every unlocked request must succeed"
    );
    assert!(
        rows_without > 1,
        "without the lock the race must show (it left {rows_without} row): otherwise this test \
         cannot tell the lock works"
    );
    assert_eq!(
        with,
        vec![(200, REQUESTS)],
        "every locked request must get the lock and succeed"
    );
    assert_eq!(rows_with, 1, "with the lock, exactly one row");
}
