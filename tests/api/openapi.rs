//! The OpenAPI document, `GET /openapi.json`, against the broker that serves it: it is OpenAPI 3
//! with every reference resolving; it documents exactly the routes the router serves
//! (`lockbroker::ROUTES`, probed over HTTP with every method and with paths that are not
//! routes); and for every operation, the documented statuses are exactly the ones real requests
//! get, each answer's body matching the schema documented for it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use lockbroker::ROUTES;
use lockbroker_test_support::app::{TestApp, spawn_app, spawn_app_with};
use lockbroker_test_support::http::{Answer, lock_path, until_waiting};
use lockbroker_test_support::redis_server::RedisServer;
use lockbroker_test_support::temp::temp_file;
use reqwest::header::CONTENT_TYPE;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

const LOCK: &str = "/locks/{key}";
const RENEW: &str = "/locks/{key}/renew";
const LOCKS: &str = "/locks";
const SEMAPHORE: &str = "/semaphores/{key}";
const SEMAPHORE_RENEW: &str = "/semaphores/{key}/renew";
const SEMAPHORES: &str = "/semaphores";
const SESSIONS: &str = "/sessions";
const SESSION: &str = "/sessions/{session}";
const SESSION_RENEW: &str = "/sessions/{session}/renew";

/// The methods a probe tries on every documented path.
const METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE",
];

/// The error codes of docs/api.md's error table.
const ERROR_CODES: &[&str] = &[
    "unauthorized",
    "forbidden",
    "limit_mismatch",
    "request_header_fields_too_large",
    "invalid_request",
    "not_found",
    "not_held",
    "method_not_allowed",
    "locked",
    "not_owner",
    "payload_too_large",
    "unsupported_media_type",
    "too_many_waiters",
    "store_unavailable",
    "shutting_down",
    "no_session",
    "internal",
];

/// A body over the 16 KiB limit.
fn oversized_body() -> Value {
    json!({ "owner": "x".repeat(17 * 1024) })
}

async fn fetch_document(app: &TestApp) -> Value {
    let answer = app.get("/openapi.json").await;
    answer.expect_status(StatusCode::OK);
    assert_eq!(
        answer.header("content-type").map(media_type),
        Some("application/json".to_owned()),
        "the document is served as JSON"
    );
    answer.json()
}

/// `application/json; charset=utf-8` → `application/json`.
fn media_type(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// Every operation in the document, by (METHOD, path).
fn operations(doc: &Value) -> BTreeMap<(String, String), &Value> {
    const OPERATION_FIELDS: &[&str] = &[
        "get", "put", "post", "delete", "options", "head", "patch", "trace", "query",
    ];
    let paths = doc["paths"].as_object().expect("`paths` is an object");
    paths
        .iter()
        .flat_map(|(path, item)| {
            item.as_object()
                .expect("a path item is an object")
                .iter()
                .filter(|(field, _)| OPERATION_FIELDS.contains(&field.as_str()))
                .map(move |(method, op)| ((method.to_uppercase(), path.clone()), op))
        })
        .collect()
}

fn routes() -> BTreeSet<(String, String)> {
    ROUTES
        .iter()
        .map(|&(method, path)| (method.to_owned(), path.to_owned()))
        .collect()
}

/// The target of a local `$ref` (`#/components/...`).
fn resolve<'a>(doc: &'a Value, reference: &str) -> Option<&'a Value> {
    doc.pointer(reference.strip_prefix('#')?)
}

/// Every `$ref` in `value`, with where it is.
fn references(value: &Value, at: &str, found: &mut Vec<(String, String)>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                if k == "$ref" {
                    found.push((at.to_owned(), v.as_str().unwrap_or("").to_owned()));
                } else {
                    references(v, &format!("{at}/{k}"), found);
                }
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                references(v, &format!("{at}/{i}"), found);
            }
        }
        _ => {}
    }
}

/// Checks `value` against `schema`, for the part of JSON Schema the document uses: `$ref`,
/// `type` (one or several), `enum`, `required`, `properties`, `minimum`, `minLength` and
/// `maxLength`. An object whose schema names its properties may not carry others: the document
/// must show every field the broker sends.
fn check_schema(doc: &Value, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    if let Some(reference) = schema.get("$ref").and_then(Value::as_str) {
        let target =
            resolve(doc, reference).ok_or_else(|| format!("{at}: {reference} does not resolve"))?;
        return check_schema(doc, target, value, at);
    }
    if let Some(types) = schema.get("type") {
        let types: Vec<&str> = match types {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
            other => return Err(format!("{at}: a schema type of {other}")),
        };
        let fits = |t: &str| match t {
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            "string" => value.is_string(),
            "boolean" => value.is_boolean(),
            "null" => value.is_null(),
            "object" => value.is_object(),
            "array" => value.is_array(),
            _ => false,
        };
        if !types.iter().any(|t| fits(t)) {
            return Err(format!("{at}: {value} is not of type {types:?}"));
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        return Err(format!("{at}: {value} is not one of {allowed:?}"));
    }
    if let (Some(min), Some(n)) = (
        schema.get("minimum").and_then(Value::as_f64),
        value.as_f64(),
    ) && n < min
    {
        return Err(format!("{at}: {n} is below the minimum {min}"));
    }
    if let Some(s) = value.as_str() {
        let len = s.chars().count();
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
            && len as u64 > max
        {
            return Err(format!("{at}: {len} characters, over maxLength {max}"));
        }
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
            && (len as u64) < min
        {
            return Err(format!("{at}: {len} characters, under minLength {min}"));
        }
    }
    if let Some(object) = value.as_object() {
        for name in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let name = name.as_str().unwrap_or("");
            if !object.contains_key(name) {
                return Err(format!("{at}: the required field {name} is missing"));
            }
        }
        if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
            for (name, field) in object {
                let field_schema = properties.get(name).ok_or_else(|| {
                    format!("{at}: the field {name} is not in the documented schema")
                })?;
                check_schema(doc, field_schema, field, &format!("{at}.{name}"))?;
            }
        }
    }
    Ok(())
}

/// What the scenarios got, checked against the document as they go.
struct Coverage {
    doc: Value,
    seen: BTreeSet<(String, String, u16)>,
}

impl Coverage {
    fn new(doc: Value) -> Self {
        Self {
            doc,
            seen: BTreeSet::new(),
        }
    }

    fn operation(&self, method: &str, path: &str) -> &Value {
        self.doc["paths"][path]
            .get(method.to_lowercase())
            .unwrap_or_else(|| panic!("{method} {path} is not in the document"))
    }

    /// Records the answer to `method path` (a path of the document, such as `/locks/{key}`)
    /// and checks that its status is documented for that operation, with a body of the
    /// documented media type and schema.
    fn record(&mut self, method: &str, path: &str, answer: &Answer) {
        let status = answer.status.as_u16();
        let response = self.operation(method, path)["responses"]
            .get(status.to_string())
            .unwrap_or_else(|| {
                panic!(
                    "{method} {path} answered {status}, which the document does not give for it; \
                     body: {}",
                    answer.text
                )
            });
        match response.get("content").and_then(Value::as_object) {
            None => assert!(
                answer.text.is_empty(),
                "{method} {path} {status} is documented without a body, but has {:?}",
                answer.text
            ),
            Some(content) => {
                let sent = answer
                    .header("content-type")
                    .map(media_type)
                    .unwrap_or_else(|| panic!("{method} {path} {status} has no content-type"));
                let (_, media) = content
                    .iter()
                    .find(|(documented, _)| media_type(documented) == sent)
                    .unwrap_or_else(|| {
                        panic!(
                            "{method} {path} {status} is {sent}, documented as {:?}",
                            content.keys().collect::<Vec<_>>()
                        )
                    });
                if sent == "application/json" {
                    let schema = &media["schema"];
                    if let Err(why) = check_schema(&self.doc, schema, &answer.json(), "body") {
                        panic!(
                            "{method} {path} {status}: the body does not match the documented \
                             schema: {why}; body: {}",
                            answer.text
                        );
                    }
                }
            }
        }
        self.seen
            .insert((method.to_owned(), path.to_owned(), status));
    }

    /// Checks a JSON body a scenario sends against the operation's documented request body.
    fn check_request(&self, method: &str, path: &str, body: &Value) {
        let schema =
            &self.operation(method, path)["requestBody"]["content"]["application/json"]["schema"];
        assert!(
            !schema.is_null(),
            "{method} {path} documents no JSON request body"
        );
        if let Err(why) = check_schema(&self.doc, schema, body, "request") {
            panic!("{method} {path}: {body} does not match the documented request body: {why}");
        }
    }

    /// Every (operation, status) of the document was seen, and nothing else.
    fn finish(self) {
        let documented: BTreeSet<(String, String, u16)> = operations(&self.doc)
            .into_iter()
            .flat_map(|((method, path), op)| {
                op["responses"]
                    .as_object()
                    .expect("responses")
                    .keys()
                    .map(|status| {
                        let status = status.parse().expect("a numeric status");
                        (method.clone(), path.clone(), status)
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        let never_seen: Vec<_> = documented.difference(&self.seen).collect();
        assert!(
            never_seen.is_empty(),
            "documented, but no scenario got them: {never_seen:?}"
        );
        let undocumented: Vec<_> = self.seen.difference(&documented).collect();
        assert!(
            undocumented.is_empty(),
            "got, but not documented: {undocumented:?}"
        );
    }
}

fn retry_after(answer: &Answer) -> Option<u64> {
    answer
        .header("retry-after")
        .map(|s| s.parse().expect("Retry-After is whole seconds"))
}

/// The document is built once per broker, from that broker's configuration: every request gets
/// the same bytes, and two brokers configured differently each state their own bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_broker_serves_one_document_of_its_own_configuration() {
    let app = spawn_app_with(None, |c| c.max_ttl_ms = Some(120_000)).await;
    let other = spawn_app_with(None, |c| c.max_ttl_ms = Some(240_000)).await;

    let first = app.get("/openapi.json").await;
    let second = app.get("/openapi.json").await;
    first.expect_status(StatusCode::OK);
    second.expect_status(StatusCode::OK);
    assert_eq!(
        first.text, second.text,
        "two requests, two different documents"
    );

    let max_ttl = |doc: &Value| {
        doc["components"]["schemas"]["AcquireBody"]["properties"]["ttl_ms"]["maximum"].clone()
    };
    assert_eq!(max_ttl(&first.json()), json!(120_000));
    assert_eq!(max_ttl(&fetch_document(&other).await), json!(240_000));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_is_openapi_3_and_every_reference_resolves() {
    let app = spawn_app(None).await;
    let doc = fetch_document(&app).await;

    let version = doc["openapi"].as_str().expect("`openapi` is a string");
    assert!(version.starts_with("3."), "openapi is {version}");
    assert!(doc["info"]["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(
        doc["info"]["version"]
            .as_str()
            .is_some_and(|v| !v.is_empty())
    );

    let mut refs = Vec::new();
    references(&doc, "#", &mut refs);
    assert!(
        !refs.is_empty(),
        "the bodies are described by named schemas"
    );
    for (at, reference) in &refs {
        assert!(
            resolve(&doc, reference).is_some(),
            "{reference} at {at} does not resolve"
        );
    }

    let mut ids = BTreeSet::new();
    for ((method, path), op) in operations(&doc) {
        let id = op["operationId"]
            .as_str()
            .expect("every operation has an id");
        assert!(ids.insert(id.to_owned()), "operationId {id} is used twice");
        let responses = op["responses"].as_object().expect("responses");
        assert!(
            !responses.is_empty(),
            "{method} {path} documents no response"
        );
        for (status, response) in responses {
            assert!(
                status.len() == 3 && status.parse::<u16>().is_ok(),
                "{method} {path}: status {status}"
            );
            assert!(
                response["description"]
                    .as_str()
                    .is_some_and(|d| !d.is_empty()),
                "{method} {path} {status} has no description"
            );
        }
        // Every `{param}` of the path is a required path parameter, and no other is.
        let in_path: BTreeSet<&str> = path
            .split('/')
            .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
            .collect();
        let declared: BTreeSet<&str> = op["parameters"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["in"] == "path")
            .map(|p| {
                assert_eq!(p["required"], true, "{method} {path}: {p}");
                p["name"].as_str().expect("a parameter name")
            })
            .collect();
        assert_eq!(in_path, declared, "{method} {path}: path parameters");
    }

    // The error body documents every code of the contract, and no other.
    let codes: BTreeSet<&str> = doc["components"]["schemas"]["ErrorCode"]["enum"]
        .as_array()
        .expect("ErrorCode is an enum")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(codes, ERROR_CODES.iter().copied().collect());
    let error = &doc["components"]["schemas"]["Error"];
    assert_eq!(error["required"], json!(["error", "message"]));
    assert_eq!(
        error["properties"]["error"]["$ref"],
        "#/components/schemas/ErrorCode"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_lists_exactly_the_routes_the_router_serves() {
    let app = spawn_app(None).await;
    let doc = fetch_document(&app).await;

    let documented: BTreeSet<(String, String)> = operations(&doc).into_keys().collect();
    assert_eq!(documented, routes(), "the document and ROUTES differ");

    // Every documented path answers its documented methods (HEAD too, with GET) and refuses
    // every other method with 405 and an Allow header naming exactly the documented ones.
    let paths: BTreeSet<&str> = ROUTES.iter().map(|&(_, path)| path).collect();
    for path in paths {
        let url = path.replace("{key}", "oa-probe");
        let mut allowed: BTreeSet<&str> = ROUTES
            .iter()
            .filter(|&&(_, p)| p == path)
            .map(|&(m, _)| m)
            .collect();
        if allowed.contains("GET") {
            allowed.insert("HEAD");
        }
        for &method in METHODS {
            let answer = app
                .send(app.request(Method::from_bytes(method.as_bytes()).unwrap(), &url))
                .await;
            if allowed.contains(method) {
                assert_ne!(
                    answer.status,
                    StatusCode::METHOD_NOT_ALLOWED,
                    "{method} {url} is documented but refused: {}",
                    answer.text
                );
                if answer.status == StatusCode::NOT_FOUND && method != "HEAD" {
                    assert_ne!(answer.json()["error"], "not_found", "{method} {url}");
                }
                continue;
            }
            assert_eq!(
                answer.status,
                StatusCode::METHOD_NOT_ALLOWED,
                "{method} {url} is not in the document, yet the router serves it: {}",
                answer.text
            );
            if method != "HEAD" {
                answer.expect_error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
            }
            let allow: BTreeSet<&str> = answer
                .header("allow")
                .unwrap_or_else(|| panic!("{method} {url}: 405 without Allow"))
                .split(',')
                .map(str::trim)
                .collect();
            assert_eq!(allow, allowed, "{method} {url}: Allow");
        }
    }

    // Paths that are not routes, near misses of the real ones included, are 404 not_found.
    for path in [
        "/",
        "/locks/",
        "/semaphores/",
        "/semaphores/oa-probe/",
        "/semaphore/oa-probe",
        "/locks/oa-probe/",
        "/locks/oa-probe/renew/",
        "/locks/oa-probe/renew/x",
        "/locks/oa-probe/release",
        "/locks/a/b",
        "/lock/oa-probe",
        "/healthz/",
        "/health",
        "/readyz/x",
        "/ready",
        "/metrics/",
        "/openapi",
        "/openapi.json/",
        "/openapi.yaml",
        "/docs",
        "/swagger-ui",
        "/api/locks/oa-probe",
        "/version",
    ] {
        for method in [Method::GET, Method::POST, Method::DELETE] {
            let answer = app.send(app.request(method.clone(), path)).await;
            assert_eq!(
                answer.status,
                StatusCode::NOT_FOUND,
                "{method} {path} is not in the document, yet the router serves it: {}",
                answer.text
            );
            answer.expect_error(StatusCode::NOT_FOUND, "not_found");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_status_is_one_a_request_gets_and_no_other() {
    let app = spawn_app(None).await;
    let mut cov = Coverage::new(fetch_document(&app).await);
    lock_scenarios(&app, &mut cov).await;
    shared_and_semaphore_scenarios(&app, &mut cov).await;
    session_scenarios(&app, &mut cov).await;
    several_scenarios(&app, &mut cov).await;
    operations_scenarios(&app, &mut cov).await;
    waiting_scenarios(&mut cov).await;
    dead_store_scenarios(&mut cov).await;
    data_loss_scenario(&mut cov).await;
    auth_scenarios(&mut cov).await;
    cov.finish();
}

/// The 401s and 403s, on a broker with an auth file and `auth_metrics`.
async fn auth_scenarios(cov: &mut Coverage) {
    let file = temp_file("auth", "toml");
    std::fs::write(
        &file,
        "[[tokens]]\nname = \"narrow\"\ntoken = \"narrow-secret-0123456789\"\n\
         prefixes = [\"mine:\"]\npermissions = [\"lock\"]\n\
         [[tokens]]\nname = \"reader\"\ntoken = \"reader-secret-0123456789\"\n\
         prefixes = [\"\"]\npermissions = [\"read\"]\n",
    )
    .unwrap();
    let path = file.clone();
    let app = spawn_app_with(None, move |c| {
        c.auth_file = Some(path);
        c.auth_metrics = Some(true);
    })
    .await;
    let cases = [
        ("POST", LOCK, "/locks/theirs"),
        ("DELETE", LOCK, "/locks/theirs"),
        ("GET", LOCK, "/locks/theirs"),
        ("POST", RENEW, "/locks/theirs/renew"),
        ("GET", LOCKS, "/locks?prefix=theirs"),
        ("POST", SEMAPHORE, "/semaphores/theirs?limit=2"),
        ("DELETE", SEMAPHORE, "/semaphores/theirs"),
        ("GET", SEMAPHORE, "/semaphores/theirs"),
        ("POST", SEMAPHORE_RENEW, "/semaphores/theirs/renew"),
        ("GET", SEMAPHORES, "/semaphores?prefix=theirs"),
        ("GET", "/metrics", "/metrics"),
        ("GET", "/openapi.json", "/openapi.json"),
    ];
    for (method, documented, path) in cases {
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let request = app
            .request(method.clone(), path)
            .header("Lock-Token", "abcdefghijklmnopqrstuvwx");
        let answer = app.send(request).await;
        answer.expect_error(StatusCode::UNAUTHORIZED, "unauthorized");
        cov.record(method.as_str(), documented, &answer);
        let request = app
            .request(method.clone(), path)
            .header("Lock-Token", "abcdefghijklmnopqrstuvwx")
            .bearer_auth("narrow-secret-0123456789");
        let answer = app.send(request).await;
        answer.expect_error(StatusCode::FORBIDDEN, "forbidden");
        cov.record(method.as_str(), documented, &answer);
    }
    // Several keys: each key is checked; a key outside the token's prefixes is refused.
    for (method, request) in [
        (
            "POST",
            app.request(Method::POST, "/locks")
                .json(&json!({"keys": ["mine:a", "theirs"]})),
        ),
        (
            "DELETE",
            app.request(Method::DELETE, "/locks?keys=mine:a,theirs")
                .header("Lock-Token", "abcdefghijklmnopqrstuvwx"),
        ),
    ] {
        let unauthorized = request.try_clone().unwrap();
        let answer = app.send(unauthorized).await;
        answer.expect_error(StatusCode::UNAUTHORIZED, "unauthorized");
        cov.record(method, LOCKS, &answer);
        let answer = app
            .send(request.bearer_auth("narrow-secret-0123456789"))
            .await;
        answer.expect_error(StatusCode::FORBIDDEN, "forbidden");
        cov.record(method, LOCKS, &answer);
    }
    // Sessions need `lock` on some prefix: a reader is refused.
    let cases = [
        ("POST", SESSIONS, "/sessions"),
        ("POST", SESSION_RENEW, "/sessions/some-session/renew"),
        ("DELETE", SESSION, "/sessions/some-session"),
        ("GET", SESSION, "/sessions/some-session"),
    ];
    for (method, documented, path) in cases {
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let answer = app.send(app.request(method.clone(), path)).await;
        answer.expect_error(StatusCode::UNAUTHORIZED, "unauthorized");
        cov.record(method.as_str(), documented, &answer);
        let request = app
            .request(method.clone(), path)
            .bearer_auth("reader-secret-0123456789");
        let answer = app.send(request).await;
        answer.expect_error(StatusCode::FORBIDDEN, "forbidden");
        cov.record(method.as_str(), documented, &answer);
    }
    let _ = std::fs::remove_file(&file);
}

/// Several keys at once on the embedded store: every status but 401, 403 and 503.
async fn several_scenarios(app: &TestApp, cov: &mut Coverage) {
    let body = json!({"keys": ["oa-m1", "oa-m2"], "ttl_ms": 20000, "wait_ms": 0, "owner": "doc", "request_id": "oa-m", "mode": "exclusive"});
    cov.check_request("POST", LOCKS, &body);
    let answer = app
        .send(app.request(Method::POST, "/locks").json(&body))
        .await;
    cov.record("POST", LOCKS, &answer);
    let token = answer.expect_status(StatusCode::CREATED).json()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let answer = app
        .send(
            app.request(Method::POST, "/locks")
                .json(&json!({"keys": ["oa-m2", "oa-m3"]})),
        )
        .await;
    cov.record("POST", LOCKS, &answer);
    assert_eq!(
        answer.expect_error(StatusCode::CONFLICT, "locked")["held"],
        json!(["oa-m2"])
    );
    for bad in [json!({"keys": ["a", "a"]}), json!({"keys": []})] {
        let answer = app
            .send(app.request(Method::POST, "/locks").json(&bad))
            .await;
        cov.record("POST", LOCKS, &answer);
        answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    let answer = app
        .send(
            app.request(Method::POST, "/locks")
                .json(&json!({"keys": ["oa-m4"], "session": "no-such-session"})),
        )
        .await;
    cov.record("POST", LOCKS, &answer);
    answer.expect_error(StatusCode::NOT_FOUND, "no_session");
    refusals(app, cov, "POST", LOCKS, "/locks").await;

    let path = "/locks?keys=oa-m1,oa-m2";
    let answer = app
        .send(
            app.request(Method::DELETE, path)
                .header("Lock-Token", &token),
        )
        .await;
    cov.record("DELETE", LOCKS, &answer);
    answer.expect_status(StatusCode::OK);
    let answer = app
        .send(
            app.request(Method::DELETE, "/locks?keys=oa-m1,oa-m1")
                .header("Lock-Token", &token),
        )
        .await;
    cov.record("DELETE", LOCKS, &answer);
    answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    let answer = app.send(app.request(Method::DELETE, path)).await;
    cov.record("DELETE", LOCKS, &answer);
    answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    refusals(app, cov, "DELETE", LOCKS, &format!("{path}&token={token}")).await;
}

/// Sessions on the embedded store: open, keep alive, read and close, an acquire under one, and
/// what each refuses (every status but 401, 403 and 503).
async fn session_scenarios(app: &TestApp, cov: &mut Coverage) {
    let body = json!({"ttl_ms": 20000, "owner": "doc", "lock_delay_ms": 0, "request_id": "oa-s-1"});
    cov.check_request("POST", SESSIONS, &body);
    let answer = app
        .send(app.request(Method::POST, "/sessions").json(&body))
        .await;
    cov.record("POST", SESSIONS, &answer);
    let id = answer.expect_status(StatusCode::CREATED).json()["session"]
        .as_str()
        .unwrap()
        .to_owned();
    let answer = app
        .send(app.request(Method::POST, "/sessions?lock_delay_ms=60001"))
        .await;
    cov.record("POST", SESSIONS, &answer);
    answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    refusals(app, cov, "POST", SESSIONS, "/sessions").await;

    let answer = app.acquire("oa-s-lock", &format!("session={id}")).await;
    cov.record("POST", LOCK, &answer);
    answer.expect_grant(StatusCode::CREATED);
    let answer = app.take("oa-s-sem", &format!("session={id}&limit=2")).await;
    cov.record("POST", SEMAPHORE, &answer);
    answer.expect_status(StatusCode::CREATED);
    for (documented, path) in [
        (LOCK, "/locks/oa-s-none?session=no-such-session"),
        (
            SEMAPHORE,
            "/semaphores/oa-s-none?session=no-such-session&limit=2",
        ),
    ] {
        let answer = app.send(app.request(Method::POST, path)).await;
        cov.record("POST", documented, &answer);
        answer.expect_error(StatusCode::NOT_FOUND, "no_session");
    }

    let renew = format!("/sessions/{id}/renew");
    let body = json!({"ttl_ms": 25000});
    cov.check_request("POST", SESSION_RENEW, &body);
    let answer = app
        .send(app.request(Method::POST, &renew).json(&body))
        .await;
    cov.record("POST", SESSION_RENEW, &answer);
    assert_eq!(answer.expect_status(StatusCode::OK).json()["ttl_ms"], 25000);
    refusals(app, cov, "POST", SESSION_RENEW, &renew).await;
    let path = format!("/sessions/{id}");
    let answer = app.get(&path).await;
    cov.record("GET", SESSION, &answer);
    assert_eq!(
        answer.expect_status(StatusCode::OK).json()["leases"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    refusals(app, cov, "GET", SESSION, &path).await;
    refusals(app, cov, "DELETE", SESSION, &path).await;
    for (method, documented, path) in [
        ("POST", SESSION_RENEW, "/sessions/not%20one/renew"),
        ("GET", SESSION, "/sessions/not%20one"),
        ("DELETE", SESSION, "/sessions/not%20one"),
    ] {
        let answer = app
            .send(app.request(Method::from_bytes(method.as_bytes()).unwrap(), path))
            .await;
        cov.record(method, documented, &answer);
        answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    let answer = app.send(app.request(Method::DELETE, &path)).await;
    cov.record("DELETE", SESSION, &answer);
    answer.expect_status(StatusCode::NO_CONTENT);
    for (method, documented, path) in [
        ("POST", SESSION_RENEW, renew.as_str()),
        ("GET", SESSION, path.as_str()),
        ("DELETE", SESSION, path.as_str()),
    ] {
        let answer = app
            .send(app.request(Method::from_bytes(method.as_bytes()).unwrap(), path))
            .await;
        cov.record(method, documented, &answer);
        answer.expect_error(StatusCode::NOT_FOUND, "not_held");
    }
}

/// Acquire, renew, inspect and release on the embedded store: every status but 503.
async fn lock_scenarios(app: &TestApp, cov: &mut Coverage) {
    let key = "oa-held";
    let free = "oa-free";
    let with_id = "ttl_ms=30000&owner=doc-check&request_id=oa-req-1";

    // Acquire.
    let answer = app.acquire(key, with_id).await;
    cov.record("POST", LOCK, &answer);
    let grant = answer.expect_grant(StatusCode::CREATED);
    // The same request again (a retry): the same grant.
    let answer = app.acquire(key, with_id).await;
    cov.record("POST", LOCK, &answer);
    let again = answer.expect_grant(StatusCode::CREATED);
    assert_eq!(
        (&again.token, again.fence),
        (&grant.token, grant.fence),
        "a repeated request_id returns the same grant"
    );
    let answer = app.acquire(key, "").await;
    cov.record("POST", LOCK, &answer);
    let body = answer.expect_error(StatusCode::CONFLICT, "locked");
    assert!(body["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0));
    assert!(
        retry_after(&answer).is_some_and(|s| s >= 1),
        "409 has Retry-After"
    );
    let body = json!({"ttl_ms": 5000, "wait_ms": 0, "owner": "doc", "request_id": "oa-req-2"});
    cov.check_request("POST", LOCK, &body);
    let answer = app.acquire_json("oa-body", "", body).await;
    cov.record("POST", LOCK, &answer);
    answer.expect_grant(StatusCode::CREATED);
    let answer = app.acquire(free, "ttl_ms=0").await;
    cov.record("POST", LOCK, &answer);
    answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    let answer = app.acquire("a%2Fb", "").await;
    cov.record("POST", LOCK, &answer);
    answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    refusals(app, cov, "POST", LOCK, &lock_path(free, "")).await;

    // Renew.
    let answer = app.renew(key, &grant.token, "ttl_ms=60000").await;
    cov.record("POST", RENEW, &answer);
    let renewed = answer.expect_grant(StatusCode::OK);
    assert_eq!((&renewed.token, renewed.fence), (&grant.token, grant.fence));
    let body = json!({"ttl_ms": 45000});
    cov.check_request("POST", RENEW, &body);
    let renew_path = lock_path(&format!("{key}/renew"), "");
    let answer = app
        .send(
            app.request(Method::POST, &renew_path)
                .header("Lock-Token", &grant.token)
                .json(&body),
        )
        .await;
    cov.record("POST", RENEW, &answer);
    answer.expect_grant(StatusCode::OK);
    let answer = app.send(app.request(Method::POST, &renew_path)).await;
    cov.record("POST", RENEW, &answer);
    answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    let answer = app.renew(free, &grant.token, "").await;
    cov.record("POST", RENEW, &answer);
    answer.expect_error(StatusCode::NOT_FOUND, "not_held");
    let answer = app.renew(key, "not-the-token", "").await;
    cov.record("POST", RENEW, &answer);
    answer.expect_error(StatusCode::CONFLICT, "not_owner");
    refusals(app, cov, "POST", RENEW, &renew_path).await;

    // Inspect.
    let answer = app.inspect(key).await;
    cov.record("GET", LOCK, &answer);
    answer.expect_status(StatusCode::OK);
    assert_eq!(answer.json()["owner"], "doc-check");
    let answer = app.inspect("oa-body").await;
    cov.record("GET", LOCK, &answer);
    let answer = app.inspect(free).await;
    cov.record("GET", LOCK, &answer);
    answer.expect_error(StatusCode::NOT_FOUND, "not_held");
    // Watches: a change at once (the fence seen differs), and no change within the wait.
    let answer = app.get(&lock_path(key, "watch=0&wait_ms=10")).await;
    cov.record("GET", LOCK, &answer);
    assert_eq!(answer.expect_status(StatusCode::OK).json()["changed"], true);
    let answer = app.get(&lock_path(free, "watch=0&wait_ms=10")).await;
    cov.record("GET", LOCK, &answer);
    let body = answer.expect_status(StatusCode::NOT_FOUND).json();
    assert_eq!(
        (&body["fence"], &body["changed"]),
        (&Value::Null, &false.into())
    );
    let answer = app.inspect("a%2Fb").await;
    cov.record("GET", LOCK, &answer);
    answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    refusals(app, cov, "GET", LOCK, &lock_path(key, "")).await;

    // Release.
    let answer = app
        .send(app.request(Method::DELETE, &lock_path(key, "")))
        .await;
    cov.record("DELETE", LOCK, &answer);
    answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    let answer = app.release(free, &grant.token).await;
    cov.record("DELETE", LOCK, &answer);
    answer.expect_error(StatusCode::NOT_FOUND, "not_held");
    let answer = app.release(key, "not-the-token").await;
    cov.record("DELETE", LOCK, &answer);
    answer.expect_error(StatusCode::CONFLICT, "not_owner");
    refusals(app, cov, "DELETE", LOCK, &lock_path(key, "")).await;
    let answer = app.release(key, &grant.token).await;
    cov.record("DELETE", LOCK, &answer);
    answer.expect_status(StatusCode::NO_CONTENT);
}

/// What every route that reads parameters refuses before it does anything: an unknown
/// parameter (400), a body over the limit (413), a body that is not JSON (415).
async fn refusals(app: &TestApp, cov: &mut Coverage, method: &str, documented: &str, url: &str) {
    let method_ = Method::from_bytes(method.as_bytes()).unwrap();
    let sep = if url.contains('?') { '&' } else { '?' };
    let answer = app
        .send(app.request(method_.clone(), &format!("{url}{sep}bogus=1")))
        .await;
    cov.record(method, documented, &answer);
    answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    let answer = app
        .send(app.request(method_.clone(), url).json(&oversized_body()))
        .await;
    cov.record(method, documented, &answer);
    answer.expect_error(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    let answer = app
        .send(
            app.request(method_, url)
                .header(CONTENT_TYPE, "text/plain")
                .body("hello"),
        )
        .await;
    cov.record(method, documented, &answer);
    answer.expect_error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type");
}

/// Shared locks, semaphores and the listings on the embedded store: every status but 401, 403
/// and 503.
async fn shared_and_semaphore_scenarios(app: &TestApp, cov: &mut Coverage) {
    // A shared lock, inspected and listed.
    let answer = app.acquire("oa-shared", "mode=shared&owner=reader").await;
    cov.record("POST", LOCK, &answer);
    answer.expect_grant(StatusCode::CREATED);
    let answer = app.inspect("oa-shared").await;
    cov.record("GET", LOCK, &answer);
    assert_eq!(
        answer.expect_status(StatusCode::OK).json()["mode"],
        "shared"
    );
    let answer = app.get("/locks?prefix=oa-&limit=1").await;
    cov.record("GET", LOCKS, &answer);
    let page = answer.expect_status(StatusCode::OK).json();
    let cursor = page["next_cursor"]
        .as_str()
        .expect("more than one held lock");
    let answer = app.get(&format!("/locks?prefix=oa-&cursor={cursor}")).await;
    cov.record("GET", LOCKS, &answer);
    answer.expect_status(StatusCode::OK);
    refusals(app, cov, "GET", LOCKS, "/locks").await;

    // A semaphore.
    let key = "/semaphores/oa-sem";
    let body = json!({"limit": 1, "ttl_ms": 30000, "wait_ms": 0, "owner": "doc", "request_id": "oa-sem-1"});
    cov.check_request("POST", SEMAPHORE, &body);
    let answer = app.send(app.request(Method::POST, key).json(&body)).await;
    cov.record("POST", SEMAPHORE, &answer);
    answer.expect_status(StatusCode::CREATED);
    let token = answer.json()["token"].as_str().unwrap().to_owned();
    let answer = app.take("oa-sem", "limit=1").await;
    cov.record("POST", SEMAPHORE, &answer);
    answer.expect_error(StatusCode::CONFLICT, "locked");
    let answer = app.take("oa-sem", "limit=2").await;
    cov.record("POST", SEMAPHORE, &answer);
    answer.expect_error(StatusCode::CONFLICT, "limit_mismatch");
    refusals(app, cov, "POST", SEMAPHORE, &format!("{key}?limit=1")).await;

    let renew = format!("{key}/renew");
    let answer = app
        .send(
            app.request(Method::POST, &renew)
                .header("Lock-Token", &token)
                .json(&json!({"ttl_ms": 20000})),
        )
        .await;
    cov.record("POST", SEMAPHORE_RENEW, &answer);
    answer.expect_status(StatusCode::OK);
    assert_eq!(answer.json()["limit"], 1, "{}", answer.text);
    let answer = app.with_token(Method::POST, &renew, "not-the-token").await;
    cov.record("POST", SEMAPHORE_RENEW, &answer);
    answer.expect_error(StatusCode::CONFLICT, "not_owner");
    let answer = app
        .with_token(Method::POST, "/semaphores/oa-free/renew", &token)
        .await;
    cov.record("POST", SEMAPHORE_RENEW, &answer);
    answer.expect_error(StatusCode::NOT_FOUND, "not_held");
    refusals(app, cov, "POST", SEMAPHORE_RENEW, &renew).await;

    let answer = app.get(key).await;
    cov.record("GET", SEMAPHORE, &answer);
    assert_eq!(answer.expect_status(StatusCode::OK).json()["limit"], 1);
    let answer = app.get("/semaphores/oa-free").await;
    cov.record("GET", SEMAPHORE, &answer);
    answer.expect_error(StatusCode::NOT_FOUND, "not_held");
    let answer = app.get(&format!("{key}?watch=0&wait_ms=10")).await;
    cov.record("GET", SEMAPHORE, &answer);
    assert_eq!(answer.expect_status(StatusCode::OK).json()["changed"], true);
    refusals(app, cov, "GET", SEMAPHORE, key).await;

    let answer = app.get("/semaphores?prefix=oa-").await;
    cov.record("GET", SEMAPHORES, &answer);
    assert_eq!(
        answer.expect_status(StatusCode::OK).json()["semaphores"][0]["holders"],
        1
    );
    refusals(app, cov, "GET", SEMAPHORES, "/semaphores").await;

    let answer = app.with_token(Method::DELETE, key, "not-the-token").await;
    cov.record("DELETE", SEMAPHORE, &answer);
    answer.expect_error(StatusCode::CONFLICT, "not_owner");
    // Force release is off on a broker without auth unless it runs with allow_force_release.
    let answer = app
        .send(app.request(Method::DELETE, &format!("{key}?force=true")))
        .await;
    cov.record("DELETE", SEMAPHORE, &answer);
    answer.expect_error(StatusCode::FORBIDDEN, "forbidden");
    let answer = app
        .send(app.request(Method::DELETE, "/locks/oa-shared?force=true"))
        .await;
    cov.record("DELETE", LOCK, &answer);
    answer.expect_error(StatusCode::FORBIDDEN, "forbidden");
    refusals(app, cov, "DELETE", SEMAPHORE, key).await;
    let answer = app.with_token(Method::DELETE, key, &token).await;
    cov.record("DELETE", SEMAPHORE, &answer);
    answer.expect_status(StatusCode::NO_CONTENT);
    let answer = app.with_token(Method::DELETE, key, &token).await;
    cov.record("DELETE", SEMAPHORE, &answer);
    answer.expect_error(StatusCode::NOT_FOUND, "not_held");
}

/// Health, readiness, metrics and the document itself.
async fn operations_scenarios(app: &TestApp, cov: &mut Coverage) {
    for path in ["/healthz", "/readyz", "/metrics", "/openapi.json"] {
        let answer = app.get(path).await;
        cov.record("GET", path, &answer);
        answer.expect_status(StatusCode::OK);
    }
}

/// The 503s of a waiting acquire: too many waiters, then the broker shutting down.
async fn waiting_scenarios(cov: &mut Coverage) {
    let app = spawn_app_with(None, |c| c.max_waiters = Some(1)).await;
    let key = "oa-busy";
    let holder = app.acquire(key, "ttl_ms=30000").await;
    cov.record("POST", LOCK, &holder);
    holder.expect_grant(StatusCode::CREATED);
    let waiter = app.spawn_acquire(key, "wait_ms=20000");
    until_waiting(&app.address, 1).await;

    let answer = app.acquire(key, "wait_ms=20000").await;
    cov.record("POST", LOCK, &answer);
    answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "too_many_waiters");
    assert_eq!(retry_after(&answer), Some(1));

    app.shutdown().await;
    let answer = waiter.await.expect("the waiting request completes");
    cov.record("POST", LOCK, &answer);
    answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "shutting_down");
}

/// Every store call fails: a broker whose Redis URL points at a closed port.
async fn dead_store_scenarios(cov: &mut Coverage) {
    let app = spawn_app_with(Some("redis://127.0.0.1:1/".to_owned()), |c| {
        c.store_timeout_ms = Some(200);
    })
    .await;
    let key = "oa-dead";
    let token = "a-token-the-store-never-sees";
    let (sem, renew) = ("/semaphores/oa-dead", "/semaphores/oa-dead/renew");
    let answers = [
        ("POST", LOCK, app.acquire(key, "ttl_ms=1000").await),
        ("DELETE", LOCK, app.release(key, token).await),
        ("POST", RENEW, app.renew(key, token, "").await),
        ("GET", LOCK, app.inspect(key).await),
        ("GET", LOCKS, app.get("/locks").await),
        ("POST", SEMAPHORE, app.take(key, "limit=2").await),
        (
            "DELETE",
            SEMAPHORE,
            app.with_token(Method::DELETE, sem, token).await,
        ),
        (
            "POST",
            SEMAPHORE_RENEW,
            app.with_token(Method::POST, renew, token).await,
        ),
        ("GET", SEMAPHORE, app.get(sem).await),
        ("GET", SEMAPHORES, app.get("/semaphores").await),
        (
            "POST",
            LOCKS,
            app.send(
                app.request(Method::POST, "/locks")
                    .json(&json!({"keys": ["oa-dead"]})),
            )
            .await,
        ),
        (
            "POST",
            SESSIONS,
            app.send(app.request(Method::POST, "/sessions")).await,
        ),
        (
            "POST",
            SESSION_RENEW,
            app.send(app.request(Method::POST, "/sessions/s/renew"))
                .await,
        ),
        ("GET", SESSION, app.get("/sessions/s").await),
        (
            "DELETE",
            SESSION,
            app.send(app.request(Method::DELETE, "/sessions/s")).await,
        ),
        ("GET", "/readyz", app.get("/readyz").await),
    ];
    for (method, path, answer) in &answers {
        cov.record(method, path, answer);
        answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
    }
    // What does not need the store still answers.
    for path in ["/healthz", "/metrics", "/openapi.json"] {
        let answer = app.get(path).await;
        cov.record("GET", path, &answer);
        answer.expect_status(StatusCode::OK);
    }
}

/// After Redis restarts without its data, the broker holds grants back: 503 store_unavailable
/// with Retry-After.
async fn data_loss_scenario(cov: &mut Coverage) {
    let mut redis = RedisServer::start().await;
    let app = spawn_app_with(Some(redis.url()), |c| {
        c.store_loss_delay_ms = Some(60_000);
        c.store_timeout_ms = Some(500);
    })
    .await;
    let answer = app.acquire("oa-before-loss", "ttl_ms=1000").await;
    cov.record("POST", LOCK, &answer);
    answer.expect_grant(StatusCode::CREATED);

    redis.restart().await;
    // The first calls may still meet the dropped connection; each answer must be documented.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = app.acquire("oa-after-loss", "ttl_ms=1000").await;
        cov.record("POST", LOCK, &answer);
        answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
        if let Some(seconds) = retry_after(&answer) {
            assert!(
                (1..=60).contains(&seconds),
                "held back for {seconds} s, the delay is 60 s"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the broker never held grants back after the data loss"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
