//! The document's own checks: its operations are the routes, its bounds the configuration's
//! and the store's, its token header the one the parser reads. (`tests/api/openapi.rs` checks
//! it against the broker's answers.)

use std::collections::BTreeSet;

use super::*;
use crate::http::requests::LOCK_TOKEN_HEADER;

fn limits() -> Limits {
    Limits {
        default_ttl_ms: 30_000,
        max_ttl_ms: 3_600_000,
        default_wait_ms: 0,
        max_wait_ms: 60_000,
    }
}

#[test]
fn the_document_has_one_operation_per_route() {
    let doc = document(&limits(), None);
    let documented: BTreeSet<(String, String)> = doc["paths"]
        .as_object()
        .expect("paths")
        .iter()
        .flat_map(|(path, item)| {
            item.as_object()
                .expect("a path item")
                .keys()
                .map(|method| (method.to_uppercase(), path.clone()))
        })
        .collect();
    let routes: BTreeSet<(String, String)> = super::super::ROUTES
        .iter()
        .map(|&(m, p)| (m.to_owned(), p.to_owned()))
        .collect();
    assert_eq!(documented, routes);
}

#[test]
fn the_token_header_is_the_one_the_parser_reads() {
    let doc = document(
        &Limits {
            default_ttl_ms: 1,
            max_ttl_ms: 2,
            default_wait_ms: 0,
            max_wait_ms: 3,
        },
        None,
    );
    for (path, method) in [
        ("/locks/{key}", "delete"),
        ("/locks/{key}/renew", "post"),
        ("/semaphores/{key}", "delete"),
        ("/semaphores/{key}/renew", "post"),
    ] {
        let headers: Vec<&str> = doc["paths"][path][method]["parameters"]
            .as_array()
            .expect("parameters")
            .iter()
            .filter(|p| p["in"] == "header")
            .filter_map(|p| p["name"].as_str())
            .collect();
        assert_eq!(headers, [LOCK_TOKEN_HEADER], "{method} {path}");
    }
}

#[test]
fn bounds_come_from_the_configuration_and_the_store() {
    let doc = document(
        &Limits {
            default_ttl_ms: 1,
            max_ttl_ms: 1234,
            default_wait_ms: 0,
            max_wait_ms: 567,
        },
        Some("^c$"),
    );
    let param = |path: &str, method: &str, name: &str| -> Value {
        doc["paths"][path][method]["parameters"]
            .as_array()
            .expect("parameters")
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("{method} {path} has no {name}"))["schema"]["maximum"]
            .clone()
    };
    assert_eq!(param("/locks/{key}", "post", "ttl_ms"), 1234);
    assert_eq!(param("/locks/{key}", "post", "wait_ms"), 567);
    assert_eq!(param("/locks/{key}/renew", "post", "ttl_ms"), 1234);
    assert_eq!(
        param("/semaphores/{key}", "post", "limit"),
        MAX_SEMAPHORE_LIMIT
    );
    assert_eq!(param("/locks", "get", "limit"), MAX_LIST_LIMIT as u64);
    assert_eq!(param("/locks/{key}", "get", "watch"), MAX_WATCH);
    assert_eq!(param("/semaphores/{key}", "get", "watch"), MAX_WATCH);
    assert_eq!(param("/semaphores", "get", "limit"), MAX_LIST_LIMIT as u64);
    let property = |schema: &str, name: &str| {
        doc["components"]["schemas"][schema]["properties"][name]["maximum"].clone()
    };
    assert_eq!(property("AcquireBody", "ttl_ms"), 1234);
    assert_eq!(property("SemaphoreAcquireBody", "wait_ms"), 567);
    assert_eq!(property("RenewBody", "ttl_ms"), 1234);
    for schema in [
        "SemaphoreAcquireBody",
        "PermitGrant",
        "Semaphore",
        "ListedSemaphore",
    ] {
        assert_eq!(property(schema, "limit"), MAX_SEMAPHORE_LIMIT, "{schema}");
    }
    for path in ["/locks", "/semaphores"] {
        let cursor = doc["paths"][path]["get"]["parameters"]
            .as_array()
            .expect("parameters")
            .iter()
            .find(|p| p["name"] == "cursor")
            .expect("a cursor parameter");
        assert_eq!(cursor["schema"]["pattern"], "^c$", "{path}");
    }
    // An answer's ttl_ms is what was granted; no bound is written into it.
    assert_eq!(property("Grant", "ttl_ms"), Value::Null);
}
