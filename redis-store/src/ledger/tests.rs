//! The ledger's unit tests: recording, forgetting, sweeping and listing leases.

use super::*;

fn lease(token: &Token, fence: Fence, ttl_ms: u64) -> Lease {
    Lease {
        token: token.clone(),
        fence,
        expires_at_ms: 0,
        ttl_ms,
        owner: None,
        request_id: None,
        limit: None,
    }
}

#[tokio::test(start_paused = true)]
async fn a_lease_is_kept_until_it_ends_or_its_holder_lets_go() {
    let ledger = Ledger::default();
    let (a, b) = (LockKey::parse("a").unwrap(), LockKey::parse("b").unwrap());
    let (ta, tb) = (Token::generate(), Token::generate());
    let start = Instant::now();
    ledger.record(
        &a,
        Kind::Exclusive,
        &lease(&ta, 1, 1_000),
        start + Duration::from_millis(1_000),
    );
    ledger.record(
        &b,
        Kind::Exclusive,
        &lease(&tb, 2, 5_000),
        start + Duration::from_millis(5_000),
    );
    // Someone else's token does not forget the entry.
    ledger.forget(&a, &tb);
    assert!(ledger.holds(&a, Kind::Exclusive, &ta));
    let live = ledger.live(start + Duration::from_millis(999));
    assert_eq!(live.len(), 2);
    assert_eq!(ledger.sweep(start + Duration::from_millis(1_000)), 1);
    assert!(!ledger.holds(&a, Kind::Exclusive, &ta));
    assert_eq!(
        ledger
            .get(&b, Kind::Exclusive, &tb)
            .unwrap()
            .remaining(start + Duration::from_millis(1_000)),
        Duration::from_millis(4_000)
    );
    ledger.forget(&b, &tb);
    assert!(ledger.is_empty());
}

#[tokio::test(start_paused = true)]
async fn tokens_come_back_as_they_went_in_generated_or_not() {
    let ledger = Ledger::default();
    let key = LockKey::parse("k").unwrap();
    for token in [
        Token::generate(),
        Token::parse("a-token-from-another-version_0123").unwrap(),
        // 48 characters, but not all lowercase hex.
        Token::parse(&"A".repeat(48)).unwrap(),
    ] {
        ledger.record(
            &key,
            Kind::Exclusive,
            &lease(&token, 1, 1_000),
            Instant::now() + Duration::from_millis(1_000),
        );
        assert!(ledger.holds(&key, Kind::Exclusive, &token));
        assert_eq!(
            ledger.get(&key, Kind::Exclusive, &token).unwrap().token,
            token
        );
        let (_, live) = ledger.live(Instant::now()).pop().unwrap();
        assert_eq!(live.token, token);
    }
}

#[tokio::test(start_paused = true)]
async fn a_renewal_moves_the_end_and_keeps_the_grants_request_id() {
    let ledger = Ledger::default();
    let key = LockKey::parse("k").unwrap();
    let token = Token::generate();
    let start = Instant::now();
    let mut granted = lease(&token, 7, 1_000);
    granted.request_id = Some(RequestId::parse("job-1").unwrap());
    ledger.record(
        &key,
        Kind::Exclusive,
        &granted,
        start + Duration::from_millis(1_000),
    );
    // Renewed half a second in, for 3 s.
    ledger.record(
        &key,
        Kind::Exclusive,
        &lease(&token, 7, 3_000),
        start + Duration::from_millis(3_500),
    );
    let entry = ledger.get(&key, Kind::Exclusive, &token).unwrap();
    assert_eq!(entry.ends, start + Duration::from_millis(3_500));
    assert_eq!(entry.request_id.unwrap().as_str(), "job-1");
}

#[tokio::test(start_paused = true)]
async fn pool_leases_are_kept_one_per_token_and_forgotten_by_fence_or_all_at_once() {
    let ledger = Ledger::default();
    let key = LockKey::parse("k").unwrap();
    let ends = Instant::now() + Duration::from_millis(1_000);
    let tokens: Vec<Token> = (0..3).map(|_| Token::generate()).collect();
    for (i, token) in tokens.iter().enumerate() {
        ledger.record(
            &key,
            Kind::Shared,
            &lease(token, 10 + i as u64, 1_000),
            ends,
        );
    }
    ledger.record(
        &key,
        Kind::Semaphore { limit: 2 },
        &lease(&tokens[0], 7, 1_000),
        ends,
    );
    ledger.record(&key, Kind::Exclusive, &lease(&tokens[1], 5, 1_000), ends);
    assert_eq!(ledger.len(), 5);
    // A renewal replaces its own entry.
    ledger.record(&key, Kind::Shared, &lease(&tokens[0], 10, 2_000), ends);
    assert_eq!(ledger.len(), 5);
    // A notice for shared fence 11 ends that lease and the older exclusive one, not fence 10.
    ledger.forget_ended(Space::Locks, "k", 11, false);
    assert!(!ledger.holds(&key, Kind::Shared, &tokens[1]));
    assert!(!ledger.holds(&key, Kind::Exclusive, &tokens[1]));
    assert!(ledger.holds(&key, Kind::Shared, &tokens[0]));
    let permit = ledger
        .get(&key, Kind::Semaphore { limit: 2 }, &tokens[0])
        .unwrap();
    assert_eq!(
        (permit.fence, permit.kind),
        (7, Kind::Semaphore { limit: 2 })
    );
    // A force release up to fence 12 ends every shared lease; the semaphore is another space.
    ledger.forget_ended(Space::Locks, "k", 12, true);
    assert_eq!(ledger.len(), 1);
    ledger.forget_any(Space::Semaphores, &key, &tokens[0]);
    assert!(ledger.is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_end_seen_before_a_renewals_answer_keeps_the_renewal_out_until_its_mark_goes() {
    let ledger = Ledger::with_linger(Duration::from_secs(5));
    let key = LockKey::parse("k").unwrap();
    let (renewed, later) = (Token::generate(), Token::generate());
    let ends = Instant::now() + Duration::from_secs(30);
    // A force release ended fence 7 (and all before it); the renewal of fence 7, which Redis
    // ran before it, is answered after: it must not come back.
    ledger.forget_ended(Space::Locks, "k", 7, true);
    assert!(!ledger.record(&key, Kind::Exclusive, &lease(&renewed, 7, 30_000), ends));
    assert!(!ledger.record(&key, Kind::Shared, &lease(&renewed, 6, 30_000), ends));
    assert!(ledger.is_empty());
    // A lease granted after the end has a higher fence and is kept.
    assert!(ledger.record(&key, Kind::Exclusive, &lease(&later, 8, 30_000), ends));
    assert!(ledger.holds(&key, Kind::Exclusive, &later));
    // A release of one pool lease (not all) marks that fence alone.
    ledger.forget_ended(Space::Semaphores, "k", 20, false);
    assert!(!ledger.record(
        &key,
        Kind::Semaphore { limit: 2 },
        &lease(&renewed, 20, 30_000),
        ends
    ));
    assert!(ledger.record(
        &key,
        Kind::Semaphore { limit: 2 },
        &lease(&renewed, 19, 30_000),
        ends
    ));
    // Once the mark has lingered, it is swept and stops nothing.
    tokio::time::advance(Duration::from_secs(5)).await;
    ledger.sweep(Instant::now());
    assert!(ledger.record(&key, Kind::Shared, &lease(&renewed, 6, 30_000), ends));
}

/// A renewal's answer recorded on one thread while the end of the same lease is handled on
/// another: whichever runs first, the ledger ends up without the lease. (The check for an end's
/// mark and the insert are one step; were they two, an end handled between them would find
/// nothing to drop and leave no bar to the insert that followed.)
#[test]
fn an_end_handled_while_a_renewal_is_recorded_never_leaves_the_lease_behind() {
    let ledger = std::sync::Arc::new(Ledger::default());
    let key = LockKey::parse("raced").unwrap();
    let rounds: Fence = 20_000;
    let start = std::sync::Arc::new(std::sync::Barrier::new(2));
    let recorder = {
        let (ledger, key, start) = (ledger.clone(), key.clone(), start.clone());
        std::thread::spawn(move || {
            for fence in 1..=rounds {
                let renewed = lease(&Token::generate(), fence, 60_000);
                start.wait();
                let ends = Instant::now() + Duration::from_secs(60);
                ledger.record(&key, Kind::Exclusive, &renewed, ends);
                start.wait();
            }
        })
    };
    for fence in 1..=rounds {
        start.wait();
        ledger.forget_ended(Space::Locks, key.as_str(), fence, true);
        start.wait();
        // Both steps of this round are done: the lease is gone either way.
        assert_eq!(ledger.len(), 0, "round {fence}: the ended lease stayed");
    }
    recorder.join().unwrap();
}
