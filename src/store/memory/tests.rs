//! The memory store's unit tests: the sweep against its manual clock.

use super::clock::ManualClock;
use super::*;
use crate::store::EXPIRY_SLACK_MS;

fn bid(ttl: u64) -> Bid {
    Bid {
        token: Token::generate(),
        ttl: Ttl::from_ms(ttl),
        owner: None,
        request_id: None,
        wait_ms: 0,
    }
}

#[tokio::test]
async fn sweep_drops_keys_only_after_the_expiry_slack() {
    let clock = ManualClock::starting_at_ms(1_000_000);
    let store = MemoryStore::new(Arc::new(clock.clone()));
    let key = LockKey::parse("k").unwrap();
    let GrantAnswer::Granted(first) = store.claim(&key, &bid(100)).await.unwrap() else {
        panic!("a free key must be granted");
    };
    clock.advance_ms(100 + EXPIRY_SLACK_MS - 1);
    assert_eq!(store.sweep(), 0);
    clock.advance_ms(1);
    assert_eq!(store.sweep(), 1);
    assert!(store.slots().is_empty());
    // The counter went with the slot; the next fence is seeded from the clock, still above.
    let GrantAnswer::Granted(second) = store.claim(&key, &bid(100)).await.unwrap() else {
        panic!("a swept key must be free");
    };
    assert!(second.fence > first.fence);
}
