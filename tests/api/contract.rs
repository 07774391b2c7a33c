//! The HTTP contract, as docs/api.md documents it, point by point, over real HTTP. Every check is
//! written once and runs twice: on the embedded store and on Redis.

use std::time::{Duration, Instant};

use lockbroker_test_support::app::Backend;
use lockbroker_test_support::http::{Grant, assert_fields, until_waiting};
use lockbroker_test_support::{now_ms, on_both_stores};
use reqwest::header::CONTENT_TYPE;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

on_both_stores!(
    a_free_key_is_granted_with_key_token_fence_ttl_and_expiry,
    every_grant_gets_a_different_url_safe_token,
    ttl_wait_and_owner_are_read_from_the_query_string,
    ttl_wait_and_owner_are_read_from_a_json_body,
    a_parameter_in_both_the_query_and_the_body_must_have_one_value,
    unknown_parameters_are_refused_on_every_endpoint,
    ttl_ms_must_be_a_positive_integer_within_the_bound,
    wait_ms_must_be_a_non_negative_integer_within_the_bound,
    a_body_must_be_a_well_formed_json_object,
    owner_is_at_most_128_characters_without_control_characters,
    a_body_over_16_kib_is_refused_as_payload_too_large,
    a_body_that_is_not_json_is_refused_as_unsupported_media_type,
    an_empty_body_is_fine_with_or_without_a_content_type,
    unknown_paths_are_404_not_found_in_the_api_error_format,
    wrong_methods_are_405_method_not_allowed_in_the_api_error_format,
    keys_are_compared_after_percent_decoding,
    keys_of_up_to_200_characters_are_accepted_and_longer_ones_refused,
    keys_outside_the_alphabet_are_refused_on_every_endpoint,
    a_held_lock_is_409_locked_with_retry_after_in_the_body_and_the_header,
    a_waiting_acquire_is_granted_when_the_holder_releases,
    a_wait_that_runs_out_is_409_locked_after_about_wait_ms,
    a_release_by_the_holder_is_204_and_a_second_one_is_404_not_held,
    a_release_with_another_token_is_409_not_owner_and_keeps_the_lock,
    a_token_is_taken_from_the_header_or_the_query_but_never_from_the_body,
    an_expired_lease_is_not_held_and_its_token_cannot_touch_the_next_lease,
    a_renewal_keeps_token_and_fence_and_moves_the_expiry,
    a_renewal_with_ttl_ms_outlives_the_original_lease,
    a_renewal_is_refused_like_a_release,
    inspecting_shows_the_lease_but_never_its_token,
    inspecting_a_free_key_is_404_not_held,
    fences_strictly_increase_across_grants_of_a_key,
    a_new_broker_grants_fences_above_those_of_the_broker_before_it,
    healthz_and_readyz_answer_200_while_the_store_answers,
    a_retried_acquire_with_the_same_request_id_gets_the_same_grant,
    request_id_is_1_to_64_characters_from_a_z_0_9_underscore_and_hyphen,
);

/// Allowed gap between this host's clock read around a request and the store's clock read
/// during it (both are this host's clock: Redis runs here).
const CLOCK_SLACK_MS: u64 = 20;

/// What a URL-safe token is made of (RFC 3986 unreserved characters).
fn is_url_safe(token: &str) -> bool {
    token
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~'))
}

async fn a_free_key_is_granted_with_key_token_fence_ttl_and_expiry(b: &Backend) {
    let app = &b.app;
    let before = now_ms();
    let answer = app.acquire("orders:42", "").await;
    let after = now_ms();
    assert!(
        answer
            .header("content-type")
            .is_some_and(|t| t.starts_with("application/json"))
    );
    // `Grant` refuses unknown fields: exactly key, token, fence, ttl_ms, expires_at_ms.
    let grant = answer.expect_grant(StatusCode::CREATED);
    assert_eq!(grant.key, "orders:42");
    assert!(grant.fence > 0);
    assert_eq!(grant.ttl_ms, 30_000, "the default ttl is 30000 ms");
    assert!(
        (before + 30_000 - CLOCK_SLACK_MS..=after + 30_000 + CLOCK_SLACK_MS)
            .contains(&grant.expires_at_ms),
        "expires_at_ms {} is not 30 s after the request ({before}..{after})",
        grant.expires_at_ms
    );
    assert!(!grant.token.is_empty() && grant.token.len() <= 128);
    assert!(is_url_safe(&grant.token), "token {:?}", grant.token);
}

async fn every_grant_gets_a_different_url_safe_token(b: &Backend) {
    let app = &b.app;
    let mut seen = std::collections::HashSet::new();
    for i in 0..20 {
        let grant = app.grant(&format!("k{}", i % 2), "").await;
        // At least 128 bits: 22 characters even in base64url, the densest URL-safe alphabet.
        assert!((22..=128).contains(&grant.token.len()), "{:?}", grant.token);
        assert!(is_url_safe(&grant.token), "{:?}", grant.token);
        assert!(seen.insert(grant.token.clone()), "a token came twice");
        app.release_ok(&grant.key, &grant.token).await;
    }
}

async fn ttl_wait_and_owner_are_read_from_the_query_string(b: &Backend) {
    let app = &b.app;
    let before = now_ms();
    let grant = app.grant("q", "ttl_ms=12345&owner=worker%207").await;
    assert_eq!(grant.ttl_ms, 12_345);
    assert!(grant.expires_at_ms >= before + 12_345 - CLOCK_SLACK_MS);
    assert!(grant.expires_at_ms <= now_ms() + 12_345 + CLOCK_SLACK_MS);
    let shown = app.inspect_held("q").await;
    assert_eq!(shown["owner"], "worker 7");
    // wait_ms is read: the second acquire waits that long before its 409.
    let started = Instant::now();
    app.expect_locked("q", "wait_ms=300").await;
    assert!(started.elapsed() >= Duration::from_millis(300));
}

async fn ttl_wait_and_owner_are_read_from_a_json_body(b: &Backend) {
    let app = &b.app;
    let before = now_ms();
    let grant = app
        .acquire_json("j", "", json!({"ttl_ms": 23456, "owner": "büro — nightly"}))
        .await
        .expect_grant(StatusCode::CREATED);
    assert_eq!(grant.ttl_ms, 23_456);
    assert!(grant.expires_at_ms >= before + 23_456 - CLOCK_SLACK_MS);
    let shown = app.inspect_held("j").await;
    assert_eq!(shown["owner"], "büro — nightly");
    let started = Instant::now();
    app.acquire_json("j", "", json!({"wait_ms": 300}))
        .await
        .expect_error(StatusCode::CONFLICT, "locked");
    assert!(started.elapsed() >= Duration::from_millis(300));
}

async fn a_parameter_in_both_the_query_and_the_body_must_have_one_value(b: &Backend) {
    let app = &b.app;
    for (query, body) in [
        ("ttl_ms=5000", json!({"ttl_ms": 6000})),
        ("wait_ms=0", json!({"wait_ms": 10})),
        ("owner=alice", json!({"owner": "bob"})),
    ] {
        app.acquire_json("both", query, body)
            .await
            .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    // The same name twice in the body is refused too, not settled by the last one.
    app.send(
        app.request(Method::POST, "/locks/both")
            .header("Content-Type", "application/json")
            .body(r#"{"ttl_ms": 5000, "ttl_ms": 1}"#),
    )
    .await
    .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.inspect("both")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    let grant = app
        .acquire_json(
            "both",
            "ttl_ms=5000&owner=alice",
            json!({"ttl_ms": 5000, "owner": "alice"}),
        )
        .await
        .expect_grant(StatusCode::CREATED);
    assert_eq!(grant.ttl_ms, 5000);
    // Renew reads ttl_ms the same way.
    app.send(
        app.request(Method::POST, "/locks/both/renew?ttl_ms=7000")
            .header("Lock-Token", &grant.token)
            .json(&json!({"ttl_ms": 8000})),
    )
    .await
    .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    let renewed = app
        .send(
            app.request(Method::POST, "/locks/both/renew?ttl_ms=7000")
                .header("Lock-Token", &grant.token)
                .json(&json!({"ttl_ms": 7000})),
        )
        .await
        .expect_grant(StatusCode::OK);
    assert_eq!(renewed.ttl_ms, 7000);
}

async fn unknown_parameters_are_refused_on_every_endpoint(b: &Backend) {
    let app = &b.app;
    app.acquire("u", "ttl=5000")
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.acquire_json("u", "", json!({"ttl_ms": 5000, "tll_ms": 5000}))
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    // Nothing was granted by the refused requests.
    app.inspect("u")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    let grant = app.grant("u", "").await;
    app.renew("u", &grant.token, "ttl=100")
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.get("/locks/u?verbose=1")
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.send(
        app.request(Method::DELETE, "/locks/u?force=1")
            .header("Lock-Token", &grant.token),
    )
    .await
    .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    // The refused release did not release.
    app.inspect("u").await.expect_status(StatusCode::OK);
}

async fn ttl_ms_must_be_a_positive_integer_within_the_bound(b: &Backend) {
    let app = &b.app;
    for bad in [
        "abc",
        "-1",
        "0",
        "1.5",
        "1e3",
        "",
        "3600001",
        "99999999999999999999999",
    ] {
        let answer = app.acquire("t", &format!("ttl_ms={bad}")).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "ttl_ms={bad:?}");
        answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    for bad in [
        json!("1000"),
        json!(-1),
        json!(0),
        json!(1.5),
        json!(3_600_001),
        json!(true),
    ] {
        let answer = app.acquire_json("t", "", json!({ "ttl_ms": bad })).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "ttl_ms: {bad}");
        answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    app.inspect("t")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    // The bounds are inclusive.
    let longest = app.grant("t", "ttl_ms=3600000").await;
    assert_eq!(longest.ttl_ms, 3_600_000);
    let shortest = app.grant("t1", "ttl_ms=1").await;
    assert_eq!(shortest.ttl_ms, 1);
}

async fn wait_ms_must_be_a_non_negative_integer_within_the_bound(b: &Backend) {
    let app = &b.app;
    for bad in ["-1", "x", "0.5", "60001"] {
        let answer = app.acquire("w", &format!("wait_ms={bad}")).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "wait_ms={bad:?}");
        answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    for bad in [json!(-1), json!("10"), json!(60_001)] {
        app.acquire_json("w", "", json!({ "wait_ms": bad }))
            .await
            .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    app.inspect("w")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    // 0 and the bound itself are fine; a free key is granted at once either way.
    app.grant("w", "wait_ms=60000").await;
    app.grant("w0", "wait_ms=0").await;
}

async fn a_body_must_be_a_well_formed_json_object(b: &Backend) {
    let app = &b.app;
    for body in [
        "{\"ttl_ms\": ",
        "{ttl_ms: 5}",
        "{\"ttl_ms\": 5,}",
        "[1, 2]",
        "5000",
        "\"ttl_ms\"",
        "null",
    ] {
        let answer = app
            .send(
                app.request(Method::POST, "/locks/json")
                    .header(CONTENT_TYPE, "application/json")
                    .body(body),
            )
            .await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "body {body:?}");
        answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    app.inspect("json")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}

async fn owner_is_at_most_128_characters_without_control_characters(b: &Backend) {
    let app = &b.app;
    let refused = [
        "x".repeat(129),
        "é".repeat(129),
        "line\nbreak".into(),
        "tab\there".into(),
        "bell\u{7}".into(),
        "delete\u{7f}".into(),
    ];
    for owner in refused {
        app.acquire_json("o", "", json!({ "owner": owner }))
            .await
            .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    app.acquire("o", &format!("owner={}", "x".repeat(129)))
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.acquire("o", "owner=a%0Ab")
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.acquire_json("o", "", json!({ "owner": 7 }))
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.inspect("o")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    // 128 characters, multi-byte ones included, are fine and shown back unchanged.
    for (key, owner) in [("o1", "x".repeat(128)), ("o2", "é".repeat(128))] {
        app.acquire_json(key, "", json!({ "owner": owner }))
            .await
            .expect_status(StatusCode::CREATED);
        let shown = app.inspect_held(key).await;
        assert_eq!(shown["owner"], owner.as_str());
    }
}

async fn a_body_over_16_kib_is_refused_as_payload_too_large(b: &Backend) {
    let app = &b.app;
    let json_of_len = |len: usize| {
        let head = "{\"ttl_ms\": 5000";
        format!("{head}{}}}", " ".repeat(len - head.len() - 1))
    };
    let too_big = json_of_len(16 * 1024 + 1);
    assert_eq!(too_big.len(), 16 * 1024 + 1);
    app.send(
        app.request(Method::POST, "/locks/big")
            .header(CONTENT_TYPE, "application/json")
            .body(too_big),
    )
    .await
    .expect_error(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    let huge = json!({ "owner": "x".repeat(100_000) });
    app.acquire_json("big", "", huge)
        .await
        .expect_error(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    app.inspect("big")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    // Exactly 16 KiB is within the limit.
    let at_limit = json_of_len(16 * 1024);
    let grant = app
        .send(
            app.request(Method::POST, "/locks/big")
                .header(CONTENT_TYPE, "application/json")
                .body(at_limit),
        )
        .await
        .expect_grant(StatusCode::CREATED);
    assert_eq!(grant.ttl_ms, 5000);
}

async fn a_body_that_is_not_json_is_refused_as_unsupported_media_type(b: &Backend) {
    let app = &b.app;
    for content_type in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        None,
    ] {
        let mut request = app
            .request(Method::POST, "/locks/media")
            .body("{\"ttl_ms\": 5000}");
        if let Some(t) = content_type {
            request = request.header(CONTENT_TYPE, t);
        }
        let answer = app.send(request).await;
        assert_eq!(
            answer.status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "content type {content_type:?}"
        );
        answer.expect_error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type");
    }
    app.inspect("media")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    let grant = app
        .send(
            app.request(Method::POST, "/locks/media")
                .header(CONTENT_TYPE, "application/json; charset=utf-8")
                .body("{\"ttl_ms\": 5000}"),
        )
        .await
        .expect_grant(StatusCode::CREATED);
    // Renew reads a body the same way.
    app.send(
        app.request(Method::POST, "/locks/media/renew")
            .header("Lock-Token", &grant.token)
            .header(CONTENT_TYPE, "text/plain")
            .body("ttl_ms=100"),
    )
    .await
    .expect_error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type");
}

async fn an_empty_body_is_fine_with_or_without_a_content_type(b: &Backend) {
    let app = &b.app;
    app.send(app.request(Method::POST, "/locks/e1"))
        .await
        .expect_grant(StatusCode::CREATED);
    app.send(
        app.request(Method::POST, "/locks/e2")
            .header(CONTENT_TYPE, "application/json"),
    )
    .await
    .expect_grant(StatusCode::CREATED);
    app.send(
        app.request(Method::POST, "/locks/e3")
            .header(CONTENT_TYPE, "text/plain"),
    )
    .await
    .expect_grant(StatusCode::CREATED);
}

async fn unknown_paths_are_404_not_found_in_the_api_error_format(b: &Backend) {
    let app = &b.app;
    for (method, path) in [
        (Method::GET, "/"),
        (Method::GET, "/nope"),
        (Method::GET, "/locks/"),
        (Method::GET, "/semaphores/"),
        (Method::POST, "/locks/"),
        (Method::GET, "/locks/a/b"),
        (Method::POST, "/locks/a/b"),
        (Method::DELETE, "/locks/a/b"),
        (Method::POST, "/locks/a/b/renew"),
        (Method::POST, "/locks/a/renew/now"),
    ] {
        let answer = app.send(app.request(method.clone(), path)).await;
        assert_eq!(answer.status, StatusCode::NOT_FOUND, "{method} {path}");
        answer.expect_error(StatusCode::NOT_FOUND, "not_found");
    }
}

async fn wrong_methods_are_405_method_not_allowed_in_the_api_error_format(b: &Backend) {
    let app = &b.app;
    for (method, path) in [
        (Method::PUT, "/locks/x"),
        (Method::PATCH, "/locks/x"),
        (Method::GET, "/locks/x/renew"),
        (Method::DELETE, "/locks/x/renew"),
        (Method::PUT, "/locks/x/renew"),
        (Method::POST, "/healthz"),
        (Method::DELETE, "/readyz"),
    ] {
        let answer = app.send(app.request(method.clone(), path)).await;
        assert_eq!(
            answer.status,
            StatusCode::METHOD_NOT_ALLOWED,
            "{method} {path}"
        );
        answer.expect_error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
    }
}

async fn keys_are_compared_after_percent_decoding(b: &Backend) {
    let app = &b.app;
    let grant = app.grant("%41", "").await;
    assert_eq!(grant.key, "A");
    let shown = app.inspect_held("A").await;
    assert_eq!(shown["key"], "A");
    assert_eq!(shown["fence"], grant.fence);
    app.expect_locked("A", "").await;
    // An escape of an allowed character is that character.
    let colon = app.grant("a%3Ab", "").await;
    assert_eq!(colon.key, "a:b");
    app.expect_locked("a:b", "").await;
    // Released under the plain spelling, what was taken under the escaped one.
    app.release_ok("A", &grant.token).await;
    app.inspect("%41")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}

async fn keys_of_up_to_200_characters_are_accepted_and_longer_ones_refused(b: &Backend) {
    let app = &b.app;
    let longest = "k".repeat(200);
    let grant = app.grant(&longest, "").await;
    assert_eq!(grant.key, longest);
    app.inspect(&longest).await.expect_status(StatusCode::OK);
    let too_long = "k".repeat(201);
    app.acquire(&too_long, "")
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.inspect(&too_long)
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    // Every character of the alphabet.
    let all = "AZaz09._-:";
    assert_eq!(app.grant(all, "").await.key, all);
}

async fn keys_outside_the_alphabet_are_refused_on_every_endpoint(b: &Backend) {
    let app = &b.app;
    let holder = app.grant("fine", "").await;
    for key in [
        "{x}",
        "%7Bx%7D",
        "a b",
        "a%20b",
        "%C3%A9",
        "caf%C3%A9",
        "a%2Fb",
        "%2F",
        "a%25b",
        "%FF",
        "a+b",
        "a,b",
        "a@b",
    ] {
        let answers = [
            app.acquire(key, "").await,
            app.inspect(key).await,
            app.release(key, &holder.token).await,
            app.renew(key, &holder.token, "").await,
        ];
        for answer in answers {
            assert_eq!(answer.status, StatusCode::BAD_REQUEST, "key {key:?}");
            answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
        }
    }
}

async fn a_held_lock_is_409_locked_with_retry_after_in_the_body_and_the_header(b: &Backend) {
    let app = &b.app;
    let holder = app.grant("busy", "ttl_ms=30000").await;
    let answer = app.acquire("busy", "").await;
    let body = answer.expect_error(StatusCode::CONFLICT, "locked");
    let retry_after_ms = body["retry_after_ms"]
        .as_u64()
        .unwrap_or_else(|| panic!("retry_after_ms must be an integer: {body}"));
    let left = holder.expires_at_ms.saturating_sub(now_ms());
    assert!(
        retry_after_ms <= 30_000 && retry_after_ms + CLOCK_SLACK_MS >= left,
        "retry_after_ms {retry_after_ms} is not the time until the lease ends ({left})"
    );
    let header: u64 = answer
        .header("retry-after")
        .expect("a Retry-After header")
        .parse()
        .expect("Retry-After in whole seconds");
    assert_eq!(header, retry_after_ms.div_ceil(1000).max(1));

    // A lease ending in less than a second still says "1", never "0".
    app.grant("soon", "ttl_ms=400").await;
    let answer = app.acquire("soon", "").await;
    let body = answer.expect_error(StatusCode::CONFLICT, "locked");
    assert!(body["retry_after_ms"].as_u64().is_some_and(|ms| ms <= 400));
    assert_eq!(answer.header("retry-after"), Some("1"));
}

async fn a_waiting_acquire_is_granted_when_the_holder_releases(b: &Backend) {
    let holder = b.app.grant("queue", "ttl_ms=30000").await;
    let waiter = b.app.spawn_acquire("queue", "wait_ms=10000");
    // The waiter finds the lock held and parks (the broker counts it); it must still be waiting
    // while the lease is held.
    until_waiting(&b.app.address, 1).await;
    assert!(
        !waiter.is_finished(),
        "the waiter must wait while the lock is held"
    );
    let released_at = Instant::now();
    b.app.release_ok("queue", &holder.token).await;
    let answer = tokio::time::timeout(Duration::from_secs(3), waiter)
        .await
        .expect("the waiter must be granted soon after the release")
        .expect("the waiter task");
    let grant = answer.expect_grant(StatusCode::CREATED);
    assert!(
        released_at.elapsed() < Duration::from_secs(2),
        "the handover took {:?}",
        released_at.elapsed()
    );
    assert!(grant.fence > holder.fence);
    assert_ne!(grant.token, holder.token);
}

async fn a_wait_that_runs_out_is_409_locked_after_about_wait_ms(b: &Backend) {
    let app = &b.app;
    app.grant("long", "ttl_ms=30000").await;
    let started = Instant::now();
    let answer = app.acquire("long", "wait_ms=700").await;
    let took = started.elapsed();
    let body = answer.expect_error(StatusCode::CONFLICT, "locked");
    assert!(body["retry_after_ms"].as_u64().is_some());
    assert!(took >= Duration::from_millis(700), "gave up after {took:?}");
    assert!(
        took < Duration::from_millis(700 + 2000),
        "waited {took:?} for wait_ms=700"
    );
}

async fn a_release_by_the_holder_is_204_and_a_second_one_is_404_not_held(b: &Backend) {
    let app = &b.app;
    let grant = app.grant("r", "").await;
    let answer = app.release("r", &grant.token).await;
    answer.expect_status(StatusCode::NO_CONTENT);
    assert!(answer.text.is_empty(), "204 has no body");
    app.inspect("r")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    app.release("r", &grant.token)
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    // A key never taken is not held either.
    app.release("never", &grant.token)
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    // Released means free: the next acquire is granted at once.
    app.grant("r", "").await;
}

async fn a_release_with_another_token_is_409_not_owner_and_keeps_the_lock(b: &Backend) {
    let app = &b.app;
    let holder = app.grant("mine", "").await;
    let other = app.grant("other", "").await;
    app.release("mine", &other.token)
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
    app.release("mine", "made-up-token_0123456789abcdef")
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
    let shown = app.inspect_held("mine").await;
    assert_eq!(shown["fence"], holder.fence);
    app.release_ok("mine", &holder.token).await;
}

async fn a_token_is_taken_from_the_header_or_the_query_but_never_from_the_body(b: &Backend) {
    let app = &b.app;
    let grant = app.grant("tok", "").await;
    // No token at all.
    app.send(app.request(Method::DELETE, "/locks/tok"))
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.send(app.request(Method::POST, "/locks/tok/renew"))
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    // In a JSON body: refused, and the lock stays held.
    app.send(
        app.request(Method::DELETE, "/locks/tok")
            .json(&json!({ "token": grant.token })),
    )
    .await
    .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.send(
        app.request(Method::POST, "/locks/tok/renew")
            .json(&json!({ "token": grant.token })),
    )
    .await
    .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.inspect("tok").await.expect_status(StatusCode::OK);
    // In the query string: works for renew and release.
    let renewed = app
        .send(app.request(
            Method::POST,
            &format!("/locks/tok/renew?token={}&ttl_ms=60000", grant.token),
        ))
        .await
        .expect_grant(StatusCode::OK);
    assert_eq!(renewed.token, grant.token);
    app.send(app.request(Method::DELETE, &format!("/locks/tok?token={}", grant.token)))
        .await
        .expect_status(StatusCode::NO_CONTENT);
    app.inspect("tok")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    // In the Lock-Token header (the helpers' way): works too.
    let again = app.grant("tok", "").await;
    app.release_ok("tok", &again.token).await;
}

async fn an_expired_lease_is_not_held_and_its_token_cannot_touch_the_next_lease(b: &Backend) {
    let app = &b.app;
    let old = app.grant("exp", "ttl_ms=250").await;
    // Let the lease run out.
    tokio::time::sleep(Duration::from_millis(400)).await;
    app.inspect("exp")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    app.release("exp", &old.token)
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    app.renew("exp", &old.token, "")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    // Free for the next client, with a larger fence.
    let new = app.grant("exp", "ttl_ms=30000").await;
    assert!(new.fence > old.fence, "{} after {}", new.fence, old.fence);
    app.release("exp", &old.token)
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
    app.renew("exp", &old.token, "")
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
    let shown = app.inspect_held("exp").await;
    assert_eq!(shown["fence"], new.fence);
    assert_eq!(shown["expires_at_ms"], new.expires_at_ms);
}

async fn a_renewal_keeps_token_and_fence_and_moves_the_expiry(b: &Backend) {
    let app = &b.app;
    let grant = app.grant("ren", "ttl_ms=1000&owner=cron").await;
    let before = now_ms();
    // Without ttl_ms, the default: 30 s from now.
    let answer = app.renew("ren", &grant.token, "").await;
    let renewed = answer.expect_grant(StatusCode::OK);
    assert_eq!(renewed.key, "ren");
    assert_eq!(renewed.token, grant.token);
    assert_eq!(renewed.fence, grant.fence);
    assert_eq!(renewed.ttl_ms, 30_000);
    assert!(renewed.expires_at_ms > grant.expires_at_ms);
    assert!(renewed.expires_at_ms + CLOCK_SLACK_MS >= before + 30_000);
    assert!(renewed.expires_at_ms <= now_ms() + 30_000 + CLOCK_SLACK_MS);
    let shown = app.inspect_held("ren").await;
    assert_eq!(shown["expires_at_ms"], renewed.expires_at_ms);
    assert_eq!(shown["fence"], grant.fence);
    assert_eq!(shown["owner"], "cron", "a renewal keeps the owner");
    // With ttl_ms in a JSON body.
    let shorter = app
        .send(
            app.request(Method::POST, "/locks/ren/renew")
                .header("Lock-Token", &grant.token)
                .json(&json!({"ttl_ms": 5000})),
        )
        .await
        .expect_grant(StatusCode::OK);
    assert_eq!(shorter.ttl_ms, 5000);
    assert!(shorter.expires_at_ms < renewed.expires_at_ms);
    assert_eq!(shorter.fence, grant.fence);
}

async fn a_renewal_with_ttl_ms_outlives_the_original_lease(b: &Backend) {
    let app = &b.app;
    let grant = app.grant("keep", "ttl_ms=300").await;
    let renewed = app
        .renew("keep", &grant.token, "ttl_ms=5000")
        .await
        .expect_grant(StatusCode::OK);
    assert_eq!(renewed.ttl_ms, 5000);
    // Past the original lease's end, the renewed one is still held.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let shown = app.inspect_held("keep").await;
    assert_eq!(shown["fence"], grant.fence);
    app.expect_locked("keep", "").await;
    app.release_ok("keep", &grant.token).await;
}

async fn a_renewal_is_refused_like_a_release(b: &Backend) {
    let app = &b.app;
    let grant = app.grant("rr", "").await;
    let other = app.grant("rr2", "").await;
    app.renew("rr", &other.token, "")
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
    for bad in ["0", "-5", "abc", "3600001"] {
        app.renew("rr", &grant.token, &format!("ttl_ms={bad}"))
            .await
            .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    app.renew("free", &grant.token, "")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    app.release_ok("rr", &grant.token).await;
    app.renew("rr", &grant.token, "")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}

async fn inspecting_shows_the_lease_but_never_its_token(b: &Backend) {
    let app = &b.app;
    for (key, query, owner) in [
        ("seen", "ttl_ms=20000&owner=deploy-7", json!("deploy-7")),
        ("anon", "ttl_ms=20000", Value::Null),
    ] {
        let grant: Grant = app.grant(key, query).await;
        let answer = app.inspect(key).await;
        answer.expect_status(StatusCode::OK);
        assert!(
            !answer.text.contains(&grant.token),
            "GET must never show the token: {}",
            answer.text
        );
        let shown = answer.json();
        assert_fields(
            &shown,
            &[
                "expires_at_ms",
                "fence",
                "key",
                "mode",
                "owner",
                "ttl_remaining_ms",
            ],
        );
        assert_eq!(shown["key"], key);
        assert_eq!(shown["mode"], "exclusive");
        assert_eq!(shown["fence"], grant.fence);
        assert_eq!(shown["expires_at_ms"], grant.expires_at_ms);
        assert_eq!(shown["owner"], owner, "owner is null when none was given");
        let remaining = shown["ttl_remaining_ms"].as_u64().expect("an integer");
        assert!(remaining > 0 && remaining <= 20_000, "{remaining}");
        let left = grant.expires_at_ms.saturating_sub(now_ms());
        assert!(remaining + CLOCK_SLACK_MS >= left, "{remaining} < {left}");
    }
}

async fn inspecting_a_free_key_is_404_not_held(b: &Backend) {
    let app = &b.app;
    app.inspect("nobody")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    app.grant("brief", "ttl_ms=200").await;
    app.inspect("brief").await.expect_status(StatusCode::OK);
    // Let the lease run out.
    tokio::time::sleep(Duration::from_millis(350)).await;
    app.inspect("brief")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    let released = app.grant("gone", "").await;
    app.release_ok("gone", &released.token).await;
    app.inspect("gone")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}

async fn fences_strictly_increase_across_grants_of_a_key(b: &Backend) {
    let app = &b.app;
    let mut last = 0;
    for _ in 0..5 {
        let grant = app.grant("fenced", "").await;
        assert!(grant.fence > last, "fence {} after {last}", grant.fence);
        last = grant.fence;
        app.release_ok("fenced", &grant.token).await;
    }
    // A takeover of an expired lease, too.
    let expiring = app.grant("fenced", "ttl_ms=200").await;
    assert!(expiring.fence > last);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let taken_over = app.grant("fenced", "").await;
    assert!(taken_over.fence > expiring.fence);
    // Other keys have their own sequence; it does not matter to this one.
    app.grant("other-key", "").await;
    app.release_ok("fenced", &taken_over.token).await;
    assert!(app.grant("fenced", "").await.fence > taken_over.fence);
}

async fn a_new_broker_grants_fences_above_those_of_the_broker_before_it(b: &Backend) {
    let first = b.another_app(|_| {}).await;
    let grant = first.grant("restart", "").await;
    first.release_ok("restart", &grant.token).await;
    first.shutdown().await;
    let second = b.another_app(|_| {}).await;
    let next = second.grant("restart", "").await;
    next.assert_fence_above(&grant, "a broker restart");
}

async fn healthz_and_readyz_answer_200_while_the_store_answers(b: &Backend) {
    let app = &b.app;
    app.get("/healthz").await.expect_status(StatusCode::OK);
    app.get("/readyz").await.expect_status(StatusCode::OK);
}

async fn a_retried_acquire_with_the_same_request_id_gets_the_same_grant(b: &Backend) {
    let app = &b.app;
    let first = app.grant("idem", "request_id=job-42_a&ttl_ms=30000").await;
    // The client did not get the answer and retries: the same grant, not a 409.
    let again = app.grant("idem", "request_id=job-42_a&ttl_ms=30000").await;
    assert_eq!(again.token, first.token);
    assert_eq!(again.fence, first.fence);
    let from_body = app
        .acquire_json("idem", "", json!({"request_id": "job-42_a"}))
        .await
        .expect_grant(StatusCode::CREATED);
    assert_eq!(from_body.token, first.token);
    // Another request id, or none, is an ordinary contender.
    app.expect_locked("idem", "request_id=job-43").await;
    app.expect_locked("idem", "").await;
    // The id belongs to that lease only: once it is released, the id gets a new one.
    app.release_ok("idem", &first.token).await;
    let next = app.grant("idem", "request_id=job-42_a").await;
    assert_ne!(next.token, first.token);
    assert!(next.fence > first.fence);
}

async fn request_id_is_1_to_64_characters_from_a_z_0_9_underscore_and_hyphen(b: &Backend) {
    let app = &b.app;
    let too_long = "r".repeat(65);
    for bad in ["", "a.b", "a%20b", "a:b", "%C3%A9", too_long.as_str()] {
        let answer = app.acquire("rid", &format!("request_id={bad}")).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "request_id={bad:?}");
        answer.expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    app.acquire_json("rid", "", json!({"request_id": 5}))
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.inspect("rid")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    app.grant("rid", &format!("request_id={}", "r".repeat(64)))
        .await;
}
