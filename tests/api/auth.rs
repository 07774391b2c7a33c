//! Auth: the full permission matrix (each permission, in and out of its prefixes, on each route),
//! `401`/`403` before any store work or waiting, the open operations routes, reloads of the auth
//! file on change and on request (a broken file keeps the previous set), and a randomized pass
//! over the authenticated API that must never grant without a valid token nor answer a 5xx
//! other than 503.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lockbroker_test_support::app::{TestApp, spawn_app_with};
use lockbroker_test_support::auth_entry;
use lockbroker_test_support::http::{Answer, lock_path};
use lockbroker_test_support::temp::temp_file;
use rand::RngExt;
use reqwest::{Method, StatusCode};

const LOCKER: &str = "locker-secret-0123456789";
const READER: &str = "reader-secret-0123456789";
const ADMIN: &str = "admin-secret-0123456789ab";
const WATCHER: &str = "watcher-secret-0123456789";

/// Four tokens: `lock` and `read` on `orders:`, `admin` on a prefix no test key has (admin
/// ignores prefixes), and `read` on every key (which may read `/metrics`).
fn auth_file_text() -> String {
    [
        auth_entry(
            "locker",
            &format!("token = {LOCKER:?}"),
            &["orders:", "invoices:"],
            &["lock"],
        ),
        auth_entry(
            "reader",
            &format!("token_sha256 = {:?}", lockbroker::sha256_hex(READER)),
            &["orders:"],
            &["read"],
        ),
        auth_entry(
            "admin",
            &format!("token = {ADMIN:?}"),
            &["nothing:"],
            &["admin"],
        ),
        auth_entry("watcher", &format!("token = {WATCHER:?}"), &[""], &["read"]),
    ]
    .concat()
}

/// An auth file, removed when dropped.
struct AuthFile(PathBuf);

impl AuthFile {
    fn new(text: &str) -> Self {
        let path = temp_file("auth", "toml");
        std::fs::write(&path, text).expect("write the auth file");
        Self(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    /// Replaces the content the way an editor or a secret mount does: a new file renamed over
    /// the old one, so the broker never reads half of it.
    fn replace(&self, text: &str) {
        let next = self.0.with_extension("next");
        std::fs::write(&next, text).expect("write the new auth file");
        std::fs::rename(&next, &self.0).expect("rename the new auth file");
    }
}

impl Drop for AuthFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn spawn_guarded(file: &AuthFile, auth_metrics: bool) -> TestApp {
    let path = file.path().to_owned();
    spawn_app_with(None, move |c| {
        c.auth_file = Some(path);
        c.auth_metrics = Some(auth_metrics);
    })
    .await
}

async fn send(app: &TestApp, method: Method, path: &str, bearer: Option<&str>) -> Answer {
    let mut request = app.request(method, path);
    if let Some(token) = bearer {
        request = request.bearer_auth(token);
    }
    app.send(request).await
}

/// A lease on `key`, taken with the admin token.
async fn hold(app: &TestApp, key: &str) -> String {
    let answer = send(app, Method::POST, &lock_path(key, ""), Some(ADMIN)).await;
    answer.expect_grant(StatusCode::CREATED).token
}

fn expect_unauthorized(answer: &Answer, challenge: &str) {
    answer.expect_error(StatusCode::UNAUTHORIZED, "unauthorized");
    assert_eq!(answer.header("www-authenticate"), Some(challenge));
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Route {
    Acquire,
    Renew,
    Release,
    Inspect,
    ForceRelease,
    Metrics,
    Document,
}

impl Route {
    const ALL: [Self; 7] = [
        Self::Acquire,
        Self::Renew,
        Self::Release,
        Self::Inspect,
        Self::ForceRelease,
        Self::Metrics,
        Self::Document,
    ];

    /// Sends this route's request on `key` with `bearer`; the lease token (where the route takes
    /// one) is a live lease's, so an allowed request reaches its handler and succeeds.
    async fn send(self, app: &TestApp, key: &str, bearer: Option<&str>) -> Answer {
        let with_token = |method, path: &str, token: &str| {
            let mut request = app.request(method, path).header("Lock-Token", token);
            if let Some(b) = bearer {
                request = request.bearer_auth(b);
            }
            request
        };
        match self {
            Self::Acquire => send(app, Method::POST, &lock_path(key, ""), bearer).await,
            Self::Renew => {
                let token = hold(app, key).await;
                app.send(with_token(
                    Method::POST,
                    &lock_path(&format!("{key}/renew"), ""),
                    &token,
                ))
                .await
            }
            Self::Release => {
                let token = hold(app, key).await;
                app.send(with_token(Method::DELETE, &lock_path(key, ""), &token))
                    .await
            }
            Self::Inspect => send(app, Method::GET, &lock_path(key, ""), bearer).await,
            Self::ForceRelease => {
                send(app, Method::DELETE, &lock_path(key, "force=true"), bearer).await
            }
            Self::Metrics => send(app, Method::GET, "/metrics", bearer).await,
            Self::Document => send(app, Method::GET, "/openapi.json", bearer).await,
        }
    }

    /// What an allowed request gets from the handler.
    fn allowed_status(self) -> StatusCode {
        match self {
            // Each case's key is free.
            Self::Acquire => StatusCode::CREATED,
            Self::Renew | Self::Inspect | Self::Metrics | Self::Document => StatusCode::OK,
            Self::Release => StatusCode::NO_CONTENT,
            // Each case's key is free: nothing to end.
            Self::ForceRelease => StatusCode::NOT_FOUND,
        }
    }
}

/// Whether `token` may use `route` on a key inside (`true`) or outside its prefixes.
fn allowed(token: &str, route: Route, inside: bool) -> bool {
    match token {
        ADMIN => true,
        LOCKER => {
            inside
                && !matches!(
                    route,
                    Route::ForceRelease | Route::Metrics | Route::Document
                )
        }
        READER => inside && route == Route::Inspect,
        WATCHER => matches!(route, Route::Inspect | Route::Metrics | Route::Document),
        _ => unreachable!(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_permission_in_and_out_of_its_prefixes_gets_its_answer_on_every_route() {
    let file = AuthFile::new(&auth_file_text());
    let app = spawn_guarded(&file, true).await;
    let mut case_no = 0;
    for token in [LOCKER, READER, ADMIN, WATCHER] {
        for route in Route::ALL {
            for inside in [true, false] {
                // A key of its own per case, so no case sees another's lease.
                case_no += 1;
                let key = if inside {
                    format!("orders:m{case_no}")
                } else {
                    format!("billing:m{case_no}")
                };
                if route == Route::Inspect {
                    hold(&app, &key).await;
                }
                let answer = route.send(&app, &key, Some(token)).await;
                let case = format!("{route:?} on {key} with the token of {}", name(token));
                if allowed(token, route, inside) {
                    assert_eq!(
                        answer.status,
                        route.allowed_status(),
                        "{case} must be let through: {}",
                        answer.text
                    );
                    continue;
                }
                let body = answer.expect_error(StatusCode::FORBIDDEN, "forbidden");
                assert!(
                    !body.to_string().contains(token),
                    "the refusal repeats the token: {body}"
                );
                // Nothing changed: a refused acquire granted nothing, a refused renew or
                // release left the lease as it was.
                let after = send(&app, Method::GET, &lock_path(&key, ""), Some(ADMIN)).await;
                match route {
                    Route::Acquire | Route::ForceRelease => {
                        after.expect_error(StatusCode::NOT_FOUND, "not_held");
                    }
                    Route::Renew | Route::Release | Route::Inspect => {
                        after.expect_status(StatusCode::OK);
                    }
                    Route::Metrics | Route::Document => {}
                }
            }
        }
    }
}

fn name(token: &str) -> &'static str {
    match token {
        LOCKER => "locker",
        READER => "reader",
        ADMIN => "admin",
        WATCHER => "watcher",
        _ => "someone else",
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_or_an_unknown_one_is_401_on_every_guarded_route_and_nothing_is_granted() {
    let file = AuthFile::new(&auth_file_text());
    let app = spawn_guarded(&file, true).await;
    let challenge = "Bearer realm=\"lockbroker\"";
    let invalid = "Bearer realm=\"lockbroker\", error=\"invalid_token\"";
    for route in [
        Route::Acquire,
        Route::Inspect,
        Route::ForceRelease,
        Route::Metrics,
        Route::Document,
    ] {
        expect_unauthorized(&route.send(&app, "orders:u", None).await, challenge);
        expect_unauthorized(
            &route
                .send(&app, "orders:u", Some("not-a-known-token-at-all"))
                .await,
            invalid,
        );
        let basic = app
            .send(
                app.request(Method::POST, "/locks/orders:u")
                    .header("Authorization", "Basic bG9ja2VyOnNlY3JldA=="),
            )
            .await;
        expect_unauthorized(&basic, challenge);
    }
    // Renew and release with a real lease token but no bearer: refused, and the lease stays.
    let token = hold(&app, "orders:u").await;
    for (method, path) in [
        (Method::POST, "/locks/orders:u/renew"),
        (Method::DELETE, "/locks/orders:u"),
    ] {
        let answer = app
            .send(app.request(method, path).header("Lock-Token", &token))
            .await;
        expect_unauthorized(&answer, challenge);
    }
    let still = send(&app, Method::GET, "/locks/orders:u", Some(ADMIN)).await;
    still.expect_status(StatusCode::OK);
    // Nothing was granted to the refused acquires: the admin's lease is the only one seen.
    let metrics = send(&app, Method::GET, "/metrics", Some(WATCHER)).await;
    assert!(
        metrics
            .text
            .lines()
            .any(|l| l == "lockbroker_acquisitions_total{kind=\"exclusive\",result=\"granted\"} 1"),
        "{}",
        metrics.text
    );
    assert!(
        metrics
            .text
            .contains("lockbroker_auth_requests_total{token=\"\",result=\"unauthorized\"}"),
        "{}",
        metrics.text
    );
    assert!(!metrics.text.contains(ADMIN) && !metrics.text.contains(&token));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_acquire_on_a_held_key_answers_at_once_instead_of_waiting() {
    let file = AuthFile::new(&auth_file_text());
    let app = spawn_guarded(&file, false).await;
    hold(&app, "billing:w").await;
    let started = Instant::now();
    let answer = send(
        &app,
        Method::POST,
        "/locks/billing:w?wait_ms=20000",
        Some(LOCKER),
    )
    .await;
    answer.expect_error(StatusCode::FORBIDDEN, "forbidden");
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_readiness_are_always_open_and_metrics_only_guarded_when_asked() {
    let file = AuthFile::new(&auth_file_text());
    let open = spawn_guarded(&file, false).await;
    let guarded = spawn_guarded(&file, true).await;
    for app in [&open, &guarded] {
        for path in ["/healthz", "/readyz"] {
            app.get(path).await.expect_status(StatusCode::OK);
        }
    }
    for path in ["/metrics", "/openapi.json"] {
        open.get(path).await.expect_status(StatusCode::OK);
        guarded
            .get(path)
            .await
            .expect_error(StatusCode::UNAUTHORIZED, "unauthorized");
        send(&guarded, Method::GET, path, Some(READER))
            .await
            .expect_error(StatusCode::FORBIDDEN, "forbidden");
    }
    // Unknown paths are still 404 with or without a token: auth guards routes, not the 404.
    guarded
        .get("/nope")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_found");
}

/// Polls until `token` gets `status` on an inspect of `key`, for at most `limit`.
async fn until_answered(app: &TestApp, token: &str, status: StatusCode, limit: Duration) {
    let started = Instant::now();
    loop {
        let answer = send(app, Method::GET, "/locks/orders:r", Some(token)).await;
        if answer.status == status {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "still {} after {limit:?}: {}",
            answer.status,
            answer.text
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_auth_file_is_in_force_within_two_seconds() {
    let file = AuthFile::new(&auth_file_text());
    let app = spawn_guarded(&file, false).await;
    let newcomer = "newcomer-secret-0123456789";
    send(&app, Method::GET, "/locks/orders:r", Some(newcomer))
        .await
        .expect_error(StatusCode::UNAUTHORIZED, "unauthorized");
    // The locker's token is taken away; a new one comes.
    file.replace(&format!(
        "[[tokens]]\nname = \"newcomer\"\ntoken = \"{newcomer}\"\nprefixes = [\"orders:\"]\npermissions = [\"read\"]\n"
    ));
    until_answered(
        &app,
        newcomer,
        StatusCode::NOT_FOUND,
        Duration::from_secs(2),
    )
    .await;
    send(&app, Method::GET, "/locks/orders:r", Some(LOCKER))
        .await
        .expect_error(StatusCode::UNAUTHORIZED, "unauthorized");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_auth_file_on_reload_keeps_the_previous_set_in_force() {
    let file = AuthFile::new(&auth_file_text());
    let app = spawn_guarded(&file, false).await;
    file.replace("[[tokens]]\nname = \"x\"\ntoken = \n");
    app.reload();
    // Whatever the reload (or the file watch) did with it, the old set still answers.
    for _ in 0..5 {
        send(&app, Method::GET, "/locks/orders:r", Some(LOCKER))
            .await
            .expect_error(StatusCode::NOT_FOUND, "not_held");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A good file after the broken one is taken.
    file.replace(
        "[[tokens]]\nname = \"fixed\"\ntoken = \"fixed-secret-0123456789\"\nprefixes = [\"\"]\npermissions = [\"read\"]\n",
    );
    app.reload();
    until_answered(
        &app,
        "fixed-secret-0123456789",
        StatusCode::NOT_FOUND,
        Duration::from_secs(2),
    )
    .await;
}

/// A bearer header for the fuzz pass: a valid token, a near miss, junk, or none.
fn random_bearer(rng: &mut impl rand::Rng) -> Option<String> {
    let junk: String = (0..rng.random_range(0..40))
        .map(|_| char::from(rng.random_range(0x20u8..0x7f)))
        .collect();
    match rng.random_range(0..8) {
        0 => None,
        1 => Some(LOCKER.to_owned()),
        2 => Some(READER.to_owned()),
        3 => Some(ADMIN.to_owned()),
        4 => Some(format!("{LOCKER}x")),
        5 => Some(LOCKER[..LOCKER.len() - 1].to_owned()),
        _ => Some(junk),
    }
}

fn random_key(rng: &mut impl rand::Rng) -> String {
    let prefix = [
        "orders:",
        "invoices:",
        "billing:",
        "",
        "orders",
        "%6Frders:",
    ][rng.random_range(0..6)];
    let tail: String = (0..rng.random_range(0..6))
        .map(|_| {
            let alphabet = b"abcXYZ019.:_-%/{} ";
            char::from(alphabet[rng.random_range(0..alphabet.len())])
        })
        .collect();
    format!("{prefix}{tail}")
}

/// The authenticated API under random requests: never a 5xx but 503, never a 201 or a 200
/// grant without a token that may take that key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_never_get_a_5xx_nor_a_grant_without_a_valid_token() {
    let file = AuthFile::new(&auth_file_text());
    let app = spawn_guarded(&file, true).await;
    let seed: u64 = rand::rng().random();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
    let mut tokens: Vec<String> = Vec::new();
    for i in 0..400 {
        let key = random_key(&mut rng);
        let bearer = random_bearer(&mut rng);
        let method = [
            Method::POST,
            Method::GET,
            Method::DELETE,
            Method::PUT,
            Method::HEAD,
        ][rng.random_range(0..5)]
        .clone();
        let suffix = ["", "/renew", "/x"][rng.random_range(0..3)];
        let query = [
            "",
            "ttl_ms=1000",
            "wait_ms=0",
            "force=true",
            "token=abc",
            "ttl_ms=-1",
            "owner=%00",
            "wait_ms=99999999999999999999",
        ][rng.random_range(0..8)];
        let path = format!(
            "/locks/{key}{suffix}{}{query}",
            if query.is_empty() { "" } else { "?" }
        );
        let Ok(url) = reqwest::Url::parse(&app.url(&path)) else {
            continue;
        };
        let mut request = app.client.request(method.clone(), url);
        if let Some(b) = &bearer {
            request = request.header("Authorization", format!("Bearer {b}"));
        }
        if rng.random_bool(0.3) && !tokens.is_empty() {
            request = request.header("Lock-Token", &tokens[rng.random_range(0..tokens.len())]);
        }
        if rng.random_bool(0.2) {
            request = request
                .header("Content-Type", "application/json")
                .body(["{}", "{\"ttl_ms\":5}", "[", "{\"token\":1}"][rng.random_range(0..4)]);
        }
        let answer = app.send(request).await;
        let case = format!(
            "seed {seed} #{i}: {method} {path} with {bearer:?}: {} {}",
            answer.status, answer.text
        );
        assert!(
            !answer.status.is_server_error() || answer.status == StatusCode::SERVICE_UNAVAILABLE,
            "{case}"
        );
        if answer.status == StatusCode::CREATED
            || (answer.status == StatusCode::OK && suffix == "/renew")
        {
            let key = key.replace("%6F", "o");
            let may = match bearer.as_deref() {
                Some(ADMIN) => true,
                Some(LOCKER) => key.starts_with("orders:") || key.starts_with("invoices:"),
                _ => false,
            };
            assert!(may, "granted without a valid token: {case}");
            if let Ok(grant) = serde_json::from_str::<serde_json::Value>(&answer.text)
                && let Some(token) = grant["token"].as_str()
            {
                tokens.push(token.to_owned());
            }
        }
        if matches!(
            answer.status,
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
        ) {
            assert!(
                !answer.text.contains(LOCKER) && !answer.text.contains(ADMIN),
                "{case}"
            );
        }
    }
}
