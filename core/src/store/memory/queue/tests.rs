//! The queue's rules for shared leases and permits, through the memory store: consecutive
//! shared heads offered together, a queued exclusive bid holding later shared ones back,
//! permits to the heads while there is room, the limit checked against the queue too, and
//! request ids (answered by a taken lease, never by an offer).

use crate::domain::{Pool, RequestId, Space};
use crate::store::memory::clock::Clock;
use crate::store::memory::queue::OFFER_WINDOW_MS;
use crate::store::memory::tests::{Fixture, bid, granted, queued, waiting};
use crate::store::{AsHolder, Bid, GrantAnswer, Join, Lease, Store};

#[track_caller]
fn joined(answer: Join) -> Lease {
    match answer {
        Join::Granted(lease) => lease,
        other => panic!("expected a grant, got {other:?}"),
    }
}

#[track_caller]
fn waits(answer: Join) -> u64 {
    match answer {
        Join::Queued { retry_after_ms } => retry_after_ms,
        other => panic!("expected to be queued, got {other:?}"),
    }
}

const SEM: Pool = Pool::Semaphore { limit: 2 };

#[tokio::test]
async fn consecutive_shared_heads_are_offered_together_up_to_an_exclusive_one() {
    let mut f = Fixture::new();
    let holder = f.hold(60_000).await;
    let (s1, s2, e, s3) = (
        waiting(1_000, 60_000),
        waiting(1_000, 60_000),
        waiting(1_000, 60_000),
        waiting(1_000, 60_000),
    );
    waits(f.join(Pool::Shared, &s1).await);
    waits(f.join(Pool::Shared, &s2).await);
    queued(f.claim(&e).await);
    waits(f.join(Pool::Shared, &s3).await);
    f.release(Space::Locks, &holder.token).await;
    assert!(f.offered(Space::Locks) == vec![s1.token.clone(), s2.token.clone()]);
    let (l1, l2) = (
        joined(f.join(Pool::Shared, &s1).await),
        joined(f.join(Pool::Shared, &s2).await),
    );
    assert!(holder.fence < l1.fence && l1.fence < l2.fence);
    // The exclusive bid comes next, when the last shared lease ends; the shared bid behind it
    // waits for it.
    f.release(Space::Locks, &s1.token).await;
    assert!(f.notices().is_empty());
    f.release(Space::Locks, &s2.token).await;
    assert!(f.offered(Space::Locks) == vec![e.token.clone()]);
    granted(f.claim(&e).await);
    f.release(Space::Locks, &e.token).await;
    assert!(f.offered(Space::Locks) == vec![s3.token.clone()]);
}

#[tokio::test]
async fn a_queued_exclusive_bid_holds_later_shared_ones_back() {
    let mut f = Fixture::new();
    let reader = waiting(5_000, 60_000);
    joined(f.join(Pool::Shared, &reader).await);
    let writer = waiting(1_000, 60_000);
    // Behind a shared holder: queued until the last shared lease ends.
    assert_eq!(queued(f.claim(&writer).await), 5_000);
    // A shared bid after it is not granted beside the live shared lease, waiting or not.
    let later = waiting(1_000, 60_000);
    assert_eq!(waits(f.join(Pool::Shared, &later).await), 5_000);
    assert_eq!(
        f.join(Pool::Shared, &bid(1_000)).await,
        Join::Busy {
            retry_after_ms: 5_000
        }
    );
    f.release(Space::Locks, &reader.token).await;
    assert!(f.offered(Space::Locks) == vec![writer.token.clone()]);
    let lease = granted(f.claim(&writer).await);
    assert_eq!(waits(f.join(Pool::Shared, &later).await), 1_000);
    f.release(Space::Locks, &writer.token).await;
    assert!(f.offered(Space::Locks) == vec![later.token.clone()]);
    assert!(joined(f.join(Pool::Shared, &later).await).fence > lease.fence);
}

#[tokio::test]
async fn a_shared_head_asking_when_the_exclusive_lease_has_ended_is_granted_with_those_behind_it() {
    let mut f = Fixture::new();
    f.hold(100).await;
    let (s1, s2) = (waiting(1_000, 60_000), waiting(1_000, 60_000));
    assert_eq!(waits(f.join(Pool::Shared, &s1).await), 100);
    waits(f.join(Pool::Shared, &s2).await);
    f.clock.advance_ms(100);
    joined(f.join(Pool::Shared, &s1).await);
    assert!(f.offered(Space::Locks) == vec![s2.token.clone()]);
    let snapshot = f.store.read(&f.key).await.unwrap();
    // The expired exclusive lease made way for them; the offer counts as a holder.
    assert_eq!(snapshot.lease, None);
    assert_eq!(snapshot.shared.len(), 2);
}

#[tokio::test]
async fn permits_go_to_the_queues_heads_while_there_is_room() {
    let mut f = Fixture::new();
    let first = joined(f.join(SEM, &bid(60_000)).await);
    let second = joined(f.join(SEM, &bid(60_000)).await);
    let bids: Vec<_> = (0..3).map(|_| waiting(1_000, 60_000)).collect();
    for b in &bids {
        // Told when the first permit ends.
        assert_eq!(waits(f.join(SEM, b).await), 60_000);
    }
    f.release(Space::Semaphores, &first.token).await;
    assert!(f.offered(Space::Semaphores) == vec![bids[0].token.clone()]);
    let forced = f.store.force_release(Space::Semaphores, &f.key).await;
    assert!(matches!(forced.unwrap(), AsHolder::Done(ended) if ended.len() == 2));
    // Room for two: the next two heads, and the third waits.
    assert!(f.offered(Space::Semaphores) == vec![bids[1].token.clone(), bids[2].token.clone()]);
    let taken = joined(f.join(SEM, &bids[1]).await);
    assert_eq!(taken.limit, Some(2));
    assert!(taken.fence > second.fence);
    let permits = f.store.permits(&f.key).await.unwrap();
    assert_eq!((permits.limit, permits.holders.len()), (Some(2), 2));
}

#[tokio::test]
async fn a_permit_with_another_limit_than_the_holders_or_the_queues_is_refused_without_joining() {
    let mut f = Fixture::new();
    let holder = joined(f.join(SEM, &bid(100)).await);
    joined(f.join(SEM, &bid(100)).await);
    let other = Pool::Semaphore { limit: 3 };
    let mismatch = Join::LimitMismatch { limit: 2 };
    assert_eq!(f.join(other, &waiting(1_000, 60_000)).await, mismatch);
    let queued_bid = waiting(1_000, 60_000);
    waits(f.join(SEM, &queued_bid).await);
    // The holders' permits end; the queue still has the limit.
    f.clock.advance_ms(100);
    assert_eq!(f.join(other, &waiting(1_000, 60_000)).await, mismatch);
    assert_eq!(f.join(other, &bid(1_000)).await, mismatch);
    // The refused bids did not join: the queued one is the head, granted directly, and the
    // other permit is free.
    assert!(joined(f.join(SEM, &queued_bid).await).fence > holder.fence);
    joined(f.join(SEM, &bid(1_000)).await);
    assert!(f.notices().is_empty());
}

#[tokio::test]
async fn a_request_id_answers_with_a_taken_permit_never_with_an_offer() {
    let mut f = Fixture::new();
    let id = RequestId::parse("permit-1").unwrap();
    let holder = joined(f.join(Pool::Semaphore { limit: 1 }, &bid(60_000)).await);
    let one = Pool::Semaphore { limit: 1 };
    let first = Bid {
        request_id: Some(id.clone()),
        ..waiting(1_000, 60_000)
    };
    waits(f.join(one, &first).await);
    f.release(Space::Semaphores, &holder.token).await;
    assert_eq!(f.offered(Space::Semaphores).len(), 1);
    let repeat = || Bid {
        request_id: Some(id.clone()),
        ..waiting(1_000, 60_000)
    };
    waits(f.join(one, &repeat()).await);
    let taken = joined(f.join(one, &first).await);
    assert_eq!(joined(f.join(one, &repeat()).await), taken);
}

#[tokio::test]
async fn a_request_id_answers_with_a_taken_lease_never_with_an_offer() {
    let mut f = Fixture::new();
    let id = RequestId::parse("req-1").unwrap();
    let holder = f.hold(60_000).await;
    let first = Bid {
        request_id: Some(id.clone()),
        ..waiting(1_000, 60_000)
    };
    queued(f.claim(&first).await);
    f.release(Space::Locks, &holder.token).await;
    assert_eq!(f.offered(Space::Locks).len(), 1);
    // A repeat (a new token, the same request id) while the offer is not taken: not granted.
    let repeat = Bid {
        request_id: Some(id.clone()),
        ..waiting(1_000, 60_000)
    };
    queued(f.claim(&repeat).await);
    let taken = granted(f.claim(&first).await);
    // Taken, it answers the repeat, which leaves the queue in that step: nothing is offered to
    // it when the lease ends.
    assert_eq!(granted(f.claim(&repeat).await), taken);
    f.release(Space::Locks, &first.token).await;
    assert!(f.notices().is_empty());
}

#[tokio::test]
async fn a_shared_bid_that_does_not_wait_comes_after_the_shared_heads_it_hands_the_key_to() {
    let mut f = Fixture::new();
    f.hold(100).await;
    let (s1, s2) = (waiting(1_000, 60_000), waiting(1_000, 60_000));
    waits(f.join(Pool::Shared, &s1).await);
    waits(f.join(Pool::Shared, &s2).await);
    f.clock.advance_ms(100);
    // The queued shared bids are offered the key first; with nobody left waiting, the bid that
    // does not wait joins them.
    let lease = joined(f.join(Pool::Shared, &bid(1_000)).await);
    assert!(f.offered(Space::Locks) == vec![s1.token.clone(), s2.token.clone()]);
    // By fence: the two offers, then its lease.
    let shared = f.store.read(&f.key).await.unwrap().shared;
    assert_eq!(shared.len(), 3);
    assert_eq!(shared.last(), Some(&lease));
}

#[tokio::test]
async fn a_lapsed_offer_with_nobody_left_queued_ends_and_frees_the_key() {
    let mut f = Fixture::new();
    let holder = f.hold(60_000).await;
    let gone = waiting(1_000, 60_000);
    queued(f.claim(&gone).await);
    f.release(Space::Locks, &holder.token).await;
    assert_eq!(f.offered(Space::Locks).len(), 1);
    let offer = f.lease_in_key().await.unwrap();
    f.clock.advance_ms(OFFER_WINDOW_MS - 1);
    assert!(matches!(f.claim(&bid(1_000)).await, GrantAnswer::Refused));
    f.clock.advance_ms(1);
    // GET shows the lapsed offer as an expired lease; a takeover of its fence wins the key.
    let seen = f.lease_in_key().await.unwrap();
    assert_eq!(
        (seen.fence, seen.expires_at_ms),
        (offer.fence, f.clock.now_ms())
    );
    let answer = f.store.take_over(&f.key, seen.fence, &bid(1_000)).await;
    let taken = granted(answer.unwrap());
    assert!(taken.fence > offer.fence);
    // A SETNX that comes first ends the lapsed offer itself (its token was never given out),
    // and wins the key in that step.
    queued(f.claim(&gone).await);
    f.release(Space::Locks, &taken.token).await;
    assert_eq!(f.offered(Space::Locks).len(), 1);
    f.clock.advance_ms(OFFER_WINDOW_MS);
    assert!(granted(f.claim(&bid(1_000)).await).fence > taken.fence);
    assert!(f.notices().is_empty());
}

/// Where a worker of the concurrency test is: the holders' count (-1: an exclusive holder), the
/// highest fence that entered and the last exclusive one.
#[derive(Default)]
struct Held {
    holders: i64,
    max_fence: u64,
    last_exclusive: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_waiters_of_every_kind_never_overlap_and_fences_rise() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use tokio::sync::mpsc;

    use crate::domain::{LockKey, Token};
    use crate::store::Notice;
    use crate::store::memory::MemoryStore;

    const WORKERS: usize = 8;
    const ROUNDS: usize = 12;
    let store = MemoryStore::default();
    let key = LockKey::parse("hot").unwrap();
    let (tx, mut notices) = mpsc::channel(1024);
    store.start(tx);
    // Offers go to the worker whose bid has the token, as the lock service routes them.
    let routes: Arc<Mutex<HashMap<Token, mpsc::UnboundedSender<()>>>> = Arc::default();
    let offers = Arc::new(AtomicUsize::new(0));
    let router = {
        let (routes, offers) = (routes.clone(), offers.clone());
        tokio::spawn(async move {
            while let Some(notice) = notices.recv().await {
                if let Notice::Offered(_, _, token) = notice {
                    offers.fetch_add(1, Ordering::SeqCst);
                    if let Some(worker) = routes.lock().unwrap().get(&token) {
                        let _ = worker.send(());
                    }
                }
            }
        })
    };
    let held = Arc::new(Mutex::new(Held::default()));
    let workers = (0..WORKERS).map(|w| {
        let (store, key, routes, held) = (store.clone(), key.clone(), routes.clone(), held.clone());
        tokio::spawn(async move {
            let shared = w % 3 == 0;
            for round in 0..ROUNDS {
                let bid = waiting(10_000, 30_000);
                let (tx, mut offered) = mpsc::unbounded_channel();
                routes.lock().unwrap().insert(bid.token.clone(), tx);
                let lease = loop {
                    let (lease, retry_after_ms) = if shared {
                        match store.join(&key, Pool::Shared, &bid).await.unwrap() {
                            Join::Granted(lease) => (Some(lease), 0),
                            Join::Queued { retry_after_ms } => (None, retry_after_ms),
                            other => panic!("a waiting bid got {other:?}"),
                        }
                    } else {
                        match store.claim(&key, &bid).await.unwrap() {
                            GrantAnswer::Granted(lease) => (Some(lease), 0),
                            GrantAnswer::Queued { retry_after_ms } => (None, retry_after_ms),
                            other => panic!("a waiting bid got {other:?}"),
                        }
                    };
                    if let Some(lease) = lease {
                        break Some(lease);
                    }
                    // Every fourth wait is abandoned (its client went away): it leaves.
                    if (w + round) % 4 == 3 {
                        store.leave(Space::Locks, &key, &bid.token).await.unwrap();
                        break None;
                    }
                    let wait = std::time::Duration::from_millis(retry_after_ms);
                    let _ = tokio::time::timeout(wait, offered.recv()).await;
                };
                routes.lock().unwrap().remove(&bid.token);
                let Some(lease) = lease else { continue };
                {
                    let mut h = held.lock().unwrap();
                    if shared {
                        assert!(h.holders >= 0, "a shared lease beside an exclusive one");
                        assert!(lease.fence > h.last_exclusive);
                        h.holders += 1;
                    } else {
                        assert_eq!(h.holders, 0, "an exclusive lease beside another holder");
                        assert!(lease.fence > h.max_fence, "fences fell");
                        h.holders = -1;
                        h.last_exclusive = lease.fence;
                    }
                    h.max_fence = h.max_fence.max(lease.fence);
                }
                tokio::task::yield_now().await;
                {
                    let mut h = held.lock().unwrap();
                    h.holders = if shared { h.holders - 1 } else { 0 };
                }
                let released = store
                    .release(Space::Locks, &key, &lease.token)
                    .await
                    .unwrap();
                assert!(matches!(released, AsHolder::Done(_)));
            }
        })
    });
    for worker in workers.collect::<Vec<_>>() {
        worker.await.unwrap();
    }
    router.abort();
    // The waits were contended: the key was handed on by offers.
    assert!(offers.load(Ordering::SeqCst) > 0);
    // Nothing left behind: no lease, no offer, nobody queued.
    let snapshot = store.read(&key).await.unwrap();
    assert!(
        snapshot
            .lease
            .is_none_or(|l| !l.is_live_at(snapshot.now_ms))
    );
    assert!(snapshot.shared.is_empty());
    assert!(store.slots().values().all(|slot| slot.queue.is_empty()));
}
