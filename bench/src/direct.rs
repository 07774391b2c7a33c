//! The direct-Redis phase: the uncontended cycle done by this process straight on Redis with the
//! broker's own scripts, to compare the broker against.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::http::drive;
use super::{BenchArgs, Phase};
use lockbroker::domain::{LockKey, Space, Token, Ttl};
use lockbroker::store::{AsHolder, Bid, GrantAnswer, RedisStore, Store};

pub(super) async fn uncontended_direct(
    store: Arc<RedisStore>,
    args: &BenchArgs,
    run_id: &str,
    progress: bool,
) -> Phase {
    drive(
        "uncontended (direct Redis)",
        args.clients,
        args,
        progress,
        |i, tally| {
            let store = store.clone();
            let key = LockKey::parse(&format!("bench-{run_id}-d{i}")).expect("a valid key");
            async move {
                let mut local = Vec::new();
                while !tally.stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let bid = Bid {
                        token: Token::generate(),
                        ttl: Ttl::from_ms(10_000),
                        owner: None,
                        request_id: None,
                        wait_ms: 0,
                        ends: None,
                    };
                    let ok = match store.claim(&key, &bid).await {
                        Ok(GrantAnswer::Granted(_)) => {
                            matches!(
                                store.release(Space::Locks, &key, &bid.token).await,
                                Ok(AsHolder::Done(_))
                            )
                        }
                        _ => false,
                    };
                    tally.count(ok, started, &mut local);
                }
                tally.record(local);
            }
        },
    )
    .await
}
