//! `lockbroker status KEY --watch`: prints who holds a lock (or a semaphore's permits) now and
//! then every change as it happens — a grant, a release, an expiry, a takeover, a force release
//! — one line each (one JSON object each with `--json`), until interrupted. It follows the
//! broker's watch (`GET /locks/{key}?watch=F&wait_ms=W`): one request parked at a time, answered
//! when the holders change, so nothing polls.

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::StatusCode;
use serde_json::{Value, json};

use super::commands::StatusArgs;
use super::{exit, print_json};
use lockbroker_client::Space;

/// How long one watch request waits (at most; a broker whose `max_wait_ms` is lower refuses
/// it, and the next one asks for half).
const WATCH_WAIT_MS: u64 = 30_000;

/// How soon to ask again after the broker could not be reached or answered 5xx.
const RETRY: Duration = Duration::from_secs(1);

/// `lockbroker status --watch`.
pub async fn follow(args: &StatusArgs) -> ExitCode {
    let http = match args
        .broker
        .connect
        .apply(reqwest::Client::builder().connect_timeout(Duration::from_secs(5)))
        .and_then(|b| b.build().map_err(|e| e.to_string()))
    {
        Ok(http) => http,
        Err(why) => {
            eprintln!("lockbroker: {why}");
            return ExitCode::from(exit::ERROR);
        }
    };
    let resource = args.target.resource();
    let path = match resource.space {
        Space::Locks => "locks",
        Space::Semaphores => "semaphores",
    };
    let url = format!(
        "{}/{path}/{}",
        args.broker.url.trim_end_matches('/'),
        resource.key
    );
    let mut wait_ms = WATCH_WAIT_MS;
    // The fence last printed (0: free); `None` before the first line.
    let mut seen: Option<u64> = None;
    let mut troubled = false;
    loop {
        let query: Vec<(&str, String)> = match seen {
            // The first look answers at once.
            None => vec![],
            Some(fence) => vec![
                ("watch", fence.to_string()),
                ("wait_ms", wait_ms.to_string()),
            ],
        };
        let answer = http
            .get(&url)
            .query(&query)
            .timeout(Duration::from_millis(wait_ms) + Duration::from_secs(10))
            .send()
            .await;
        let (status, body) = match answer {
            Ok(response) => {
                let status = response.status();
                (
                    status,
                    response.json::<Value>().await.unwrap_or(Value::Null),
                )
            }
            Err(e) => {
                if !troubled {
                    eprintln!("lockbroker: cannot reach the broker at {url} ({e}); trying again");
                    troubled = true;
                }
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        let held = match (status, body["error"].as_str()) {
            (StatusCode::OK, _) => true,
            (StatusCode::NOT_FOUND, Some("not_held")) => false,
            (StatusCode::BAD_REQUEST, _)
                if seen.is_some()
                    && body["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("wait_ms"))
                    && wait_ms > 1_000 =>
            {
                wait_ms /= 2;
                continue;
            }
            (status, _) if status.is_server_error() => {
                if !troubled {
                    eprintln!("lockbroker: the broker answered {status} ({body}); trying again");
                    troubled = true;
                }
                tokio::time::sleep(RETRY).await;
                continue;
            }
            (status, _) => {
                eprintln!(
                    "lockbroker: cannot watch {resource}: the broker answered {status} {body}"
                );
                if args.json {
                    print_json(&body);
                }
                return ExitCode::from(exit::ERROR);
            }
        };
        troubled = false;
        let fence = if held { highest_fence(&body) } else { 0 };
        if seen.is_none() || body["changed"] == Value::Bool(true) {
            print_change(&resource.key, held, &body, args.json);
        }
        seen = Some(fence);
    }
}

/// The fence a watch compares: the top-level one (a lock; a watched semaphore), else the
/// highest of the holders' (a semaphore's first look).
fn highest_fence(body: &Value) -> u64 {
    body["fence"].as_u64().unwrap_or_else(|| {
        body["holders"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|h| h["fence"].as_u64())
            .max()
            .unwrap_or(0)
    })
}

/// One line: the time it was seen, and who holds the key (or that it is free).
fn print_change(key: &str, held: bool, body: &Value, json: bool) {
    let seen_at_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    if json {
        let mut line = if held {
            body.clone()
        } else {
            json!({ "key": key, "fence": null, "owner": null })
        };
        if let Some(object) = line.as_object_mut() {
            object.remove("changed");
            object.insert("held".into(), held.into());
            object.insert("seen_at_ms".into(), seen_at_ms.into());
        }
        print_json(&line);
        return;
    }
    let when = humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(seen_at_ms));
    if !held {
        out!("{when}  {key} is free");
        return;
    }
    let owner = body["owner"].as_str().unwrap_or("-");
    match body["limit"].as_u64() {
        Some(limit) => out!(
            "{when}  {key}: {} of {limit} permits, highest fence {}",
            body["holders"].as_array().map_or(0, Vec::len),
            highest_fence(body)
        ),
        None => out!(
            "{when}  {key}: fence {}, owner {owner}, {}",
            highest_fence(body),
            body["mode"].as_str().unwrap_or("exclusive")
        ),
    }
}
