//! Listing held locks and semaphores (`GET /locks`, `GET /semaphores`): by prefix, a page at a
//! time, never a token; the parameters' bounds; and, with auth, which prefixes a token may list.
//! Written once, run on the embedded store and on Redis.

use std::collections::BTreeSet;

use lockbroker_test_support::app::{Backend, TestApp, spawn_app_with};
use lockbroker_test_support::auth_entry;
use lockbroker_test_support::http::assert_fields;
use lockbroker_test_support::on_both_stores;
use lockbroker_test_support::temp::temp_file;
use reqwest::{Method, StatusCode};
use serde_json::Value;

on_both_stores!(
    held_locks_are_listed_by_prefix_with_their_mode_and_never_a_token,
    pages_follow_next_cursor_until_it_is_null_and_cover_every_held_key,
    held_semaphores_are_listed_with_their_limit_and_number_of_holders,
    listing_parameters_are_validated,
);

/// Every entry of a listing, following `next_cursor` with pages of `limit`.
async fn list_all(app: &TestApp, what: &str, query: &str, limit: usize) -> Vec<Value> {
    let mut entries = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..1_000 {
        let mut path = format!("/{what}?{query}&limit={limit}");
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let page = app.get(&path).await.expect_status(StatusCode::OK).json();
        let found = page[what].as_array().expect("a list").clone();
        assert!(
            found.len() <= limit,
            "{} entries over limit {limit}",
            found.len()
        );
        entries.extend(found);
        match page["next_cursor"].as_str() {
            None => {
                assert!(page["next_cursor"].is_null(), "{page}");
                return entries;
            }
            Some(c) => cursor = Some(c.to_owned()),
        }
    }
    panic!("the listing never ended");
}

fn keys(entries: &[Value]) -> BTreeSet<String> {
    entries
        .iter()
        .map(|e| e["key"].as_str().expect("a key").to_owned())
        .collect()
}

async fn held_locks_are_listed_by_prefix_with_their_mode_and_never_a_token(b: &Backend) {
    let app = &b.app;
    let solo = app.grant("ls:a", "owner=writer").await;
    let r1 = app.grant("ls:b", "mode=shared&ttl_ms=20000").await;
    let r2 = app.grant("ls:b", "mode=shared&ttl_ms=40000").await;
    app.grant("other:c", "").await;
    let gone = app.grant("ls:gone", "").await;
    app.release_ok("ls:gone", &gone.token).await;
    app.send(app.request(Method::POST, "/semaphores/ls:sem?limit=2"))
        .await
        .expect_status(StatusCode::CREATED);

    let answer = app.get("/locks?prefix=ls:").await;
    answer.expect_status(StatusCode::OK);
    for token in [&solo.token, &r1.token, &r2.token] {
        assert!(
            !answer.text.contains(token.as_str()),
            "a token in {}",
            answer.text
        );
    }
    assert!(!answer.text.contains("\"token\""));
    let mut entries = answer.json()["locks"].as_array().unwrap().clone();
    entries.dedup_by(|x, y| x["key"] == y["key"]);
    assert_eq!(
        keys(&entries),
        ["ls:a", "ls:b"].map(String::from).into(),
        "released locks, other prefixes and semaphores are not listed"
    );
    let a = entries.iter().find(|e| e["key"] == "ls:a").unwrap();
    assert_eq!(a["mode"], "exclusive");
    assert_eq!(a["fence"], solo.fence);
    assert_eq!(a["owner"], "writer");
    assert_eq!(a["expires_at_ms"], solo.expires_at_ms);
    assert!(a["ttl_remaining_ms"].as_u64().unwrap() > 0);
    let shared = entries.iter().find(|e| e["key"] == "ls:b").unwrap();
    assert_eq!(shared["mode"], "shared");
    assert_eq!(shared["fence"], r2.fence);
    assert_eq!(shared["expires_at_ms"], r2.expires_at_ms);
    assert_fields(
        a,
        &[
            "expires_at_ms",
            "fence",
            "key",
            "mode",
            "owner",
            "ttl_remaining_ms",
        ],
    );
    // No prefix: every held lock.
    let everything = keys(&list_all(app, "locks", "", 100).await);
    assert!(everything.contains("other:c") && everything.contains("ls:a"));
}

async fn pages_follow_next_cursor_until_it_is_null_and_cover_every_held_key(b: &Backend) {
    let app = &b.app;
    let held: BTreeSet<String> = (0..7).map(|i| format!("page:{i}")).collect();
    for key in &held {
        app.grant(key, "").await;
    }
    app.grant("pager:not-this", "").await;
    for limit in [1, 2, 3, 1000] {
        let found = list_all(app, "locks", "prefix=page:", limit).await;
        assert_eq!(keys(&found), held, "pages of {limit}");
    }
}

async fn held_semaphores_are_listed_with_their_limit_and_number_of_holders(b: &Backend) {
    let app = &b.app;
    let mut fences = Vec::new();
    for ttl in [10_000, 20_000] {
        let body = app
            .send(app.request(
                Method::POST,
                &format!("/semaphores/lsem:a?limit=3&ttl_ms={ttl}"),
            ))
            .await
            .expect_status(StatusCode::CREATED)
            .json();
        fences.push(body["fence"].as_u64().unwrap());
    }
    app.grant("lsem:lock", "").await;
    let found = list_all(app, "semaphores", "prefix=lsem:", 10).await;
    assert_eq!(found.len(), 1, "{found:?}");
    let entry = &found[0];
    assert_eq!(entry["key"], "lsem:a");
    assert_eq!(entry["limit"], 3);
    assert_eq!(entry["holders"], 2);
    assert_eq!(entry["fence"], *fences.iter().max().unwrap());
    assert!(entry["ttl_remaining_ms"].as_u64().unwrap() > 10_000);
    assert_fields(
        entry,
        &[
            "expires_at_ms",
            "fence",
            "holders",
            "key",
            "limit",
            "ttl_remaining_ms",
        ],
    );
}

async fn listing_parameters_are_validated(b: &Backend) {
    let app = &b.app;
    for path in [
        "/locks?limit=0",
        "/locks?limit=1001",
        "/locks?limit=ten",
        "/locks?prefix=a%7Bb",
        "/locks?prefix=a%2Fb",
        "/locks?cursor=not-a-cursor!",
        "/locks?bogus=1",
        "/semaphores?limit=0",
        "/semaphores?prefix=%20",
    ] {
        app.get(path)
            .await
            .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    for path in ["/locks?limit=1000&prefix=", "/semaphores?limit=1"] {
        app.get(path).await.expect_status(StatusCode::OK);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_auth_a_token_lists_only_under_prefixes_it_covers() {
    let file = temp_file("listing-auth", "toml");
    let reader = r#"token = "listing-reader-0123456789""#;
    let admin = r#"token = "listing-admin-0123456789""#;
    let text = auth_entry("reader", reader, &["orders:"], &["read"])
        + &auth_entry("admin", admin, &["nothing:"], &["admin"]);
    std::fs::write(&file, text).unwrap();
    let path = file.clone();
    let app = spawn_app_with(None, move |c| c.auth_file = Some(path)).await;
    let list = |path: &str, bearer: &str| app.request(Method::GET, path).bearer_auth(bearer);
    let reader = "listing-reader-0123456789";
    for ok in [
        "/locks?prefix=orders:",
        "/locks?prefix=orders:42",
        "/semaphores?prefix=orders:",
    ] {
        app.send(list(ok, reader))
            .await
            .expect_status(StatusCode::OK);
    }
    // In a JSON body too: the auth layer reads the prefix where the handler does.
    app.send(list("/locks", reader).json(&serde_json::json!({"prefix": "orders:1"})))
        .await
        .expect_status(StatusCode::OK);
    for refused in ["/locks", "/locks?prefix=order", "/locks?prefix=invoices:"] {
        app.send(list(refused, reader))
            .await
            .expect_error(StatusCode::FORBIDDEN, "forbidden");
    }
    app.send(list("/locks", reader).json(&serde_json::json!({"prefix": "invoices:"})))
        .await
        .expect_error(StatusCode::FORBIDDEN, "forbidden");
    app.send(list("/locks", "listing-admin-0123456789"))
        .await
        .expect_status(StatusCode::OK);
    app.send(app.request(Method::GET, "/locks"))
        .await
        .expect_error(StatusCode::UNAUTHORIZED, "unauthorized");
    // Force release needs admin.
    let lock = |bearer: &str| {
        app.request(Method::DELETE, "/locks/orders:1?force=true")
            .bearer_auth(bearer)
    };
    app.send(lock(reader))
        .await
        .expect_error(StatusCode::FORBIDDEN, "forbidden");
    app.send(lock("listing-admin-0123456789"))
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    let _ = std::fs::remove_file(&file);
}
