//! Answers that asking again cannot change, and those it can: the policy every client shares.
//! `429`, `502`, `503`, `504` and no answer are asked again with the same request id until the
//! wait runs out; any other status (`500`, `501`, `505`…, which the broker itself never answers)
//! is an error at once naming the status, the key and the URL. A renewal refused `401` (a
//! revoked bearer token) loses the lease at once, saying so, while a renewal answered `500` is
//! asked again until the lease's end; a `Leadership` whose token is
//! refused fails instead of campaigning forever; an empty key is refused before anything is sent.
//! A session's open is asked again as an acquire is, and its keep-alives as renewals are.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use lockbroker_client::{Client, Error, Leadership, Loss};
use lockbroker_test_support::app::{TestApp, spawn_app_with};
use lockbroker_test_support::auth_entry;
use lockbroker_test_support::temp::temp_file;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};

const TTL: Duration = Duration::from_secs(10);

/// Something in front of the broker (a proxy, a server that is not a broker) that answers every
/// request with one status, and keeps each request's body.
struct StandIn {
    url: String,
    bodies: Arc<Mutex<Vec<String>>>,
    server: JoinHandle<()>,
}

impl StandIn {
    async fn answering(status: u16) -> Self {
        let status = StatusCode::from_u16(status).expect("a status");
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let router = Router::new()
            .fallback(
                async move |State(bodies): State<Arc<Mutex<Vec<String>>>>, body: String| {
                    bodies.lock().unwrap().push(body);
                    (status, "<html>not a broker</html>")
                },
            )
            .with_state(bodies.clone());
        let (url, server) = serve(router).await;
        Self {
            url,
            bodies,
            server,
        }
    }

    fn client(&self) -> Client {
        Client::new(&self.url).expect("a valid URL")
    }

    fn requests(&self) -> Vec<String> {
        self.bodies.lock().unwrap().clone()
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.server.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_the_broker_never_answers_is_an_error_at_once_naming_status_key_and_url() {
    for status in [500, 501, 505] {
        let stand_in = StandIn::answering(status).await;
        let client = stand_in.client();
        let started = Instant::now();
        let refused = client
            .acquire("orders:42", TTL, Duration::from_secs(5))
            .await
            .expect_err("no grant from a stand-in");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{status} was asked again for {:?}",
            started.elapsed()
        );
        assert_eq!(stand_in.requests().len(), 1, "{status}: one request");
        match &refused {
            Error::Api { status: got, .. } => assert_eq!(got.as_u16(), status),
            other => panic!("expected the {status} answer, got {other:?}"),
        }
        assert!(!refused.is_transient());
        let message = refused.to_string();
        for part in [&status.to_string(), "orders:42", &stand_in.url] {
            assert!(message.contains(part), "{message:?} does not name {part}");
        }

        // A watch is not asked again either.
        let watched = client
            .watch("orders:42", 0, Duration::from_secs(5))
            .await
            .expect_err("no answer from a stand-in");
        assert!(started.elapsed() < Duration::from_secs(3));
        assert_eq!(stand_in.requests().len(), 2, "{status}: one watch");
        assert!(watched.to_string().contains("orders:42"), "{watched}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_or_proxy_in_trouble_is_asked_again_with_the_same_request_id_until_the_wait_ends()
{
    let wait = Duration::from_millis(400);
    for status in [429, 502, 503, 504] {
        let stand_in = StandIn::answering(status).await;
        let started = Instant::now();
        let unavailable = stand_in
            .client()
            .acquire("orders:42", TTL, wait)
            .await
            .expect_err("no grant from a stand-in");
        assert!(
            started.elapsed() >= wait,
            "{status}: gave up before the wait"
        );
        assert!(unavailable.is_transient(), "{status}: {unavailable}");
        assert!(
            unavailable.to_string().contains(&stand_in.url),
            "{unavailable}"
        );
        let ids: Vec<String> = stand_in
            .requests()
            .iter()
            .map(|body| {
                let body: serde_json::Value = serde_json::from_str(body).expect("a JSON body");
                body["request_id"]
                    .as_str()
                    .expect("a request id")
                    .to_owned()
            })
            .collect();
        assert!(
            ids.len() >= 2,
            "{status}: asked again ({} requests)",
            ids.len()
        );
        assert!(
            ids.iter().all(|id| *id == ids[0]),
            "{status}: one request id"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_key_is_refused_before_anything_is_sent() {
    let stand_in = StandIn::answering(503).await;
    let client = stand_in.client();
    let refusals = [
        client.acquire("", TTL, TTL).await.map(drop),
        client.try_acquire("", TTL).await.map(drop),
        client.status("").await.map(drop),
        client.semaphore_status("").await.map(drop),
        client.watch("", 0, TTL).await.map(drop),
    ];
    for refused in refusals {
        match refused {
            Err(e @ Error::Invalid(_)) => assert!(e.to_string().contains("required"), "{e}"),
            other => panic!("expected the key refused, got {other:?}"),
        }
    }
    let election = Leadership::builder(&client, "", "node-a", TTL).start();
    let failure = timeout(Duration::from_secs(5), election.failed())
        .await
        .expect("the campaign fails at once");
    assert!(matches!(failure, Error::Invalid(_)), "{failure}");
    assert!(stand_in.requests().is_empty(), "nothing was sent");
}

const TOKEN: &str = "client-secret-0123456789abcdef";

/// A broker with an auth file that knows [`TOKEN`] (allowed to lock every key), and the file.
async fn guarded_broker() -> (TestApp, std::path::PathBuf) {
    let auth = temp_file("auth", "toml");
    let secret = format!("token = {TOKEN:?}");
    std::fs::write(&auth, auth_entry("app", &secret, &[""], &["lock"])).unwrap();
    let file = auth.clone();
    let app = spawn_app_with(None, move |settings| settings.auth_file = Some(file)).await;
    (app, auth)
}

fn client_with(app: &TestApp, token: &str) -> Client {
    Client::builder(&app.address)
        .unwrap()
        .auth_token(token)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_bearer_token_loses_the_lease_at_its_next_renewal_saying_401() {
    let (app, auth) = guarded_broker().await;
    let ttl = Duration::from_secs(3);
    let lease = client_with(&app, TOKEN)
        .acquire("revoked", ttl, Duration::ZERO)
        .await
        .expect("the token is known");
    // The token is taken away: the broker reads its auth file again.
    let other = "another-secret-0123456789abcdef";
    std::fs::write(
        &auth,
        auth_entry("other", &format!("token = {other:?}"), &[""], &["lock"]),
    )
    .unwrap();
    app.reload();
    let loss = timeout(ttl, lease.lost())
        .await
        .expect("the loss is signalled at the next renewal, before the lease's end");
    match &loss {
        Loss::Refused(e) => assert!(e.is_unauthorized(), "{e}"),
        other => panic!("expected a refusal, got {other}"),
    }
    let reason = loss.to_string();
    assert!(
        reason.contains("401") && reason.contains("unauthorized"),
        "{reason}"
    );
    assert!(!reason.contains("before it ended"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leadership_with_a_wrong_token_fails_instead_of_campaigning_forever() {
    let (app, _auth) = guarded_broker().await;
    let client = client_with(&app, "wrong-secret-0123456789abcdef");
    let election = Leadership::builder(&client, "scheduler", "node-a", TTL).start();
    let failure = timeout(Duration::from_secs(5), election.failed())
        .await
        .expect("the campaign fails within a few seconds");
    assert!(failure.is_unauthorized(), "{failure}");
    assert!(!election.is_leader());
    assert!(election.failure().is_some_and(|e| e.is_unauthorized()));
    let closed = election.close().await.expect_err("close says why it ended");
    assert!(closed.to_string().contains("401"), "{closed}");
    // The right token on the same key leads.
    let rightful =
        Leadership::builder(&client_with(&app, TOKEN), "scheduler", "node-b", TTL).start();
    let mut leading = rightful.subscribe();
    timeout(Duration::from_secs(5), leading.wait_for(|leads| *leads))
        .await
        .expect("the known token leads")
        .unwrap();
    rightful.close().await.unwrap();
}

/// A proxy in front of a real broker that passes every request on, but answers each renewal
/// `500` itself; it counts the renewals it refused.
async fn failing_renewals_in_front_of(app: &TestApp) -> (String, Arc<Mutex<u32>>, JoinHandle<()>) {
    let renewals = Arc::new(Mutex::new(0));
    let broker = app.address.clone();
    let counted = renewals.clone();
    let router = Router::new().fallback(
        async move |method: axum::http::Method,
                    uri: axum::http::Uri,
                    headers: axum::http::HeaderMap,
                    body: String| {
            if uri.path().ends_with("/renew") {
                *counted.lock().unwrap() += 1;
                return (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    String::from("proxy trouble"),
                );
            }
            let mut forwarded = reqwest::Client::new().request(method, format!("{broker}{uri}"));
            for (name, value) in &headers {
                if name != axum::http::header::HOST {
                    forwarded = forwarded.header(name, value);
                }
            }
            let answer = forwarded
                .body(body)
                .send()
                .await
                .expect("the broker answers");
            let status = StatusCode::from_u16(answer.status().as_u16()).unwrap();
            (status, answer.text().await.unwrap())
        },
    );
    let (url, server) = serve(router).await;
    (url, renewals, server)
}

/// Serves `router` on a free loopback port: its URL, and the task serving it.
async fn serve(router: Router) -> (String, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        axum::serve(listener, router).await.expect("it serves");
    });
    (url, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_answered_500_is_asked_again_until_the_lease_ends() {
    let app = spawn_app_with(None, |_| {}).await;
    let (url, renewals, server) = failing_renewals_in_front_of(&app).await;
    let ttl = Duration::from_millis(1500);
    let acquired = Instant::now();
    let lease = Client::new(&url)
        .unwrap()
        .acquire("renewed-through-trouble", ttl, Duration::ZERO)
        .await
        .expect("the acquire passes through");
    let loss = timeout(ttl * 2, lease.lost())
        .await
        .expect("the lease is lost by its end");
    // Not at the first 500 (a third of the ttl in), but when no renewal got through in time.
    assert!(
        acquired.elapsed() >= ttl * 8 / 10,
        "lost after {:?}: {loss}",
        acquired.elapsed()
    );
    assert!(matches!(loss, Loss::Expired { .. }), "{loss}");
    assert!(loss.to_string().contains("500"), "{loss}");
    assert!(*renewals.lock().unwrap() >= 2, "renewals were asked again");
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_open_answered_503_is_asked_again_with_one_request_id_within_its_ttl() {
    let stand_in = StandIn::answering(503).await;
    let ttl = Duration::from_millis(400);
    let started = Instant::now();
    let unavailable = stand_in
        .client()
        .open_session(ttl, Duration::ZERO)
        .await
        .expect_err("no session from a stand-in");
    assert!(started.elapsed() >= ttl, "gave up before the session's ttl");
    assert!(unavailable.is_transient(), "{unavailable}");
    let ids: Vec<String> = stand_in
        .requests()
        .iter()
        .map(|body| {
            let body: serde_json::Value = serde_json::from_str(body).expect("a JSON body");
            body["request_id"]
                .as_str()
                .expect("a request id")
                .to_owned()
        })
        .collect();
    assert!(ids.len() >= 2, "asked again ({} requests)", ids.len());
    assert!(ids.iter().all(|id| *id == ids[0]), "one request id");
}

/// A session's keep-alives answered `500` (by the proxy in front): asked again until the
/// session's end, then the session is lost, and its lease with it; no error names the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_keep_alives_fail_is_lost_with_its_leases_by_its_end() {
    let app = spawn_app_with(None, |_| {}).await;
    let (url, keep_alives, server) = failing_renewals_in_front_of(&app).await;
    let ttl = Duration::from_millis(1500);
    let opened = Instant::now();
    let session = Client::new(&url)
        .unwrap()
        .open_session(ttl, Duration::ZERO)
        .await
        .expect("the open passes through");
    let lease = session
        .acquire("kept-through-trouble", Duration::ZERO)
        .await
        .expect("the acquire passes through");
    let loss = timeout(ttl * 2, session.lost())
        .await
        .expect("the session is lost by its end");
    assert!(
        opened.elapsed() >= ttl * 8 / 10,
        "lost after {:?}: {loss}",
        opened.elapsed()
    );
    assert!(matches!(loss, Loss::Expired { .. }), "{loss}");
    assert!(loss.to_string().contains("500"), "{loss}");
    assert!(
        !loss.to_string().contains(session.id().as_str()),
        "the loss names the session's id: {loss}"
    );
    let lease_loss = timeout(Duration::from_secs(1), lease.lost())
        .await
        .expect("the lease is lost with its session");
    assert!(matches!(lease_loss, Loss::Expired { .. }), "{lease_loss}");
    assert!(
        *keep_alives.lock().unwrap() >= 2,
        "keep-alives were asked again"
    );
    session.close().await;
    server.abort();
}
