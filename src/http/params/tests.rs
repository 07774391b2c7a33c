//! The extractors' parsing: where a parameter may come from, and the refusals that name it.

use serde_json::json;

use super::*;
use crate::http::requests::{AcquireBody, ModeName, ReleaseQuery, RenewBody};

#[test]
fn only_plainly_distinct_names_take_the_short_way() {
    assert!(super::names_plainly_distinct(""));
    assert!(super::names_plainly_distinct("ttl_ms=10000&wait_ms=0"));
    assert!(super::names_plainly_distinct("&ttl_ms=1&&force"));
    assert!(!super::names_plainly_distinct("ttl_ms=1&ttl_ms=1"));
    assert!(!super::names_plainly_distinct("ttl_ms=1&ttl%5Fms=2"));
    assert!(!super::names_plainly_distinct("a+b=1"));
    assert!(!super::names_plainly_distinct("a&b&c&d&e&f&g&h&i"));
}

fn body(value: Value) -> Map<String, Value> {
    value.as_object().expect("an object").clone()
}

/// The sentence an `ApiError` says (its Debug shows the message).
fn refusal<T: std::fmt::Debug>(result: Result<T, ApiError>) -> String {
    format!("{:?}", result.expect_err("refused"))
}

#[test]
fn a_parameter_comes_from_the_query_string_the_body_or_both_alike() {
    let p: AcquireBody = parse("ttl_ms=5000&mode=shared", Map::new()).unwrap();
    assert_eq!((p.ttl_ms, p.mode), (Some(5000), Some(ModeName::Shared)));
    let p: AcquireBody = parse("", body(json!({"ttl_ms": 5000, "owner": "me"}))).unwrap();
    assert_eq!((p.ttl_ms, p.owner.as_deref()), (Some(5000), Some("me")));
    // The same value in both, 5000.0 being the integer 5000 as JSON Schema counts.
    let p: AcquireBody = parse(
        "ttl_ms=5000&ttl_ms=5000&wait_ms=3",
        body(json!({"ttl_ms": 5000.0, "request_id": "r"})),
    )
    .unwrap();
    assert_eq!(p.ttl_ms, Some(5000));
    assert_eq!(p.wait_ms, Some(3));
    assert_eq!(p.request_id.as_deref(), Some("r"));
}

#[test]
fn different_values_of_one_parameter_are_refused() {
    let both = refusal(parse::<AcquireBody>(
        "ttl_ms=5000",
        body(json!({"ttl_ms": 1})),
    ));
    assert!(
        both.contains("ttl_ms is given twice with different values"),
        "{both}"
    );
    let twice = refusal(parse::<AcquireBody>("ttl_ms=1&ttl_ms=2", Map::new()));
    assert!(
        twice.contains("ttl_ms is given twice in the query string"),
        "{twice}"
    );
}

#[test]
fn a_refusal_names_the_parameter() {
    for (query, json, says) in [
        (
            "ttl_ms=abc",
            json!({}),
            "ttl_ms must be a non-negative integer",
        ),
        (
            "wait_ms=-1",
            json!({}),
            "wait_ms must be a non-negative integer",
        ),
        (
            "",
            json!({"ttl_ms": "5000"}),
            "ttl_ms must be a non-negative integer",
        ),
        (
            "",
            json!({"ttl_ms": null}),
            "ttl_ms must be a non-negative integer",
        ),
        (
            "",
            json!({"ttl_ms": 1.5}),
            "ttl_ms must be a non-negative integer",
        ),
        ("", json!({"owner": 7}), "owner must be a string"),
        ("mode=both", json!({}), "mode must be exclusive or shared"),
        ("ttl=5", json!({}), "Unknown parameter: ttl"),
        ("ttl_ms=5", json!({"typo": 1}), "Unknown parameter: typo"),
    ] {
        let refused = refusal(parse::<AcquireBody>(query, body(json)));
        assert!(refused.contains(says), "{query}: {refused}");
    }
}

#[test]
fn the_token_and_force_come_in_the_query_string_never_the_body() {
    let p: RenewBody = parse("token=abc&ttl_ms=5", Map::new()).unwrap();
    assert_eq!(p.token.as_deref(), Some("abc"));
    let refused = refusal(parse::<RenewBody>("", body(json!({"token": "abc"}))));
    assert!(refused.contains("not in the body"), "{refused}");
    assert!(
        parse::<ReleaseQuery>("force=true", Map::new())
            .unwrap()
            .force
            .is_some()
    );
    let refused = refusal(parse::<ReleaseQuery>("", body(json!({"force": "true"}))));
    assert!(
        refused.contains("in the query string, not in the body"),
        "{refused}"
    );
    let refused = refusal(parse::<ReleaseQuery>("force=yes", Map::new()));
    assert!(refused.contains("force must be true"), "{refused}");
}

#[test]
fn the_token_is_the_header_or_the_query_parameter_equal_if_both() {
    let t = |h: Option<&str>, q: Option<&str>| {
        let header = h.map(|h| TokenHeader {
            lock_token: h.into(),
        });
        token(header, q.map(Into::into))
    };
    assert_eq!(t(Some("abc"), None).unwrap().as_str(), "abc");
    assert_eq!(t(None, Some("abc")).unwrap().as_str(), "abc");
    assert_eq!(t(Some("abc"), Some("abc")).unwrap().as_str(), "abc");
    assert!(refusal(t(Some("abc"), Some("abd"))).contains("different values"));
    assert!(refusal(t(None, None)).contains("A token is required"));
    assert!(refusal(t(Some("has space"), None)).contains("token"));
}
