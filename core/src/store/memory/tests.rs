//! The memory store's unit tests, against its manual clock: the sweep, and the queue's rules for
//! exclusive bids and for every kind alike (order, direct grant, offer and take, lapse, leave,
//! deadlines, bids that do not wait, fences, release and force release handing
//! on). The rules particular to shared leases and permits are in `queue/tests.rs`.

use tokio::sync::mpsc;

use super::clock::ManualClock;
use super::queue::OFFER_WINDOW_MS;
use super::*;
use crate::domain::Ttl;
use crate::store::EXPIRY_SLACK_MS;

/// A store on a manual clock, with the notices it sends.
pub(super) struct Fixture {
    pub(super) clock: ManualClock,
    pub(super) store: MemoryStore,
    pub(super) key: LockKey,
    notices: mpsc::Receiver<Notice>,
}

impl Fixture {
    pub(super) fn new() -> Self {
        let clock = ManualClock::starting_at_ms(1_000_000);
        let store = MemoryStore::new(Arc::new(clock.clone()));
        let (tx, notices) = mpsc::channel(64);
        store.start(tx);
        Self {
            clock,
            store,
            key: LockKey::parse("k").unwrap(),
            notices,
        }
    }

    /// The notices sent since the last call.
    pub(super) fn notices(&mut self) -> Vec<Notice> {
        std::iter::from_fn(|| self.notices.try_recv().ok()).collect()
    }

    /// The tokens offered the key (in `space`) since the last call; no other notice was sent.
    pub(super) fn offered(&mut self, space: Space) -> Vec<Token> {
        let key = self.key.clone();
        self.notices()
            .into_iter()
            .map(|n| match n {
                Notice::Offered(s, k, token) if s == space && k == key => token,
                other => panic!("expected an offer on the key, got {other:?}"),
            })
            .collect()
    }

    pub(super) async fn claim(&self, bid: &Bid) -> GrantAnswer {
        self.store.claim(&self.key, bid).await.unwrap()
    }

    pub(super) async fn join(&self, pool: Pool, bid: &Bid) -> Join {
        self.store.join(&self.key, pool, bid).await.unwrap()
    }

    /// A lease granted now to a bid that does not wait.
    pub(super) async fn hold(&self, ttl_ms: u64) -> Lease {
        granted(self.claim(&bid(ttl_ms)).await)
    }

    pub(super) async fn release(&self, space: Space, token: &Token) -> AsHolder<Released> {
        self.store.release(space, &self.key, token).await.unwrap()
    }

    pub(super) async fn lease_in_key(&self) -> Option<Lease> {
        self.store.read(&self.key).await.unwrap().lease
    }
}

/// A bid that does not wait.
pub(crate) fn bid(ttl_ms: u64) -> Bid {
    Bid {
        token: Token::generate(),
        ttl: Ttl::from_ms(ttl_ms),
        owner: None,
        request_id: None,
        wait_ms: 0,
        ends: None,
    }
}

/// A bid that waits up to `wait_ms`.
pub(super) fn waiting(ttl_ms: u64, wait_ms: u64) -> Bid {
    Bid {
        wait_ms,
        ..bid(ttl_ms)
    }
}

#[track_caller]
pub(super) fn granted(answer: GrantAnswer) -> Lease {
    match answer {
        GrantAnswer::Granted(lease) => lease,
        other => panic!("expected a grant, got {other:?}"),
    }
}

#[track_caller]
pub(super) fn queued(answer: GrantAnswer) -> u64 {
    match answer {
        GrantAnswer::Queued { retry_after_ms } => retry_after_ms,
        other => panic!("expected to be queued, got {other:?}"),
    }
}

#[tokio::test]
async fn sweep_drops_keys_only_after_the_expiry_slack() {
    let f = Fixture::new();
    let first = f.hold(100).await;
    f.clock.advance_ms(100 + EXPIRY_SLACK_MS - 1);
    assert_eq!(f.store.sweep(), 0);
    f.clock.advance_ms(1);
    assert_eq!(f.store.sweep(), 1);
    assert!(f.store.slots().is_empty());
    // The counter went with the slot; the next fence is seeded from the clock, still above.
    assert!(f.hold(100).await.fence > first.fence);
}

#[tokio::test]
async fn sweep_keeps_a_key_whose_queue_still_waits() {
    let f = Fixture::new();
    f.hold(100).await;
    queued(f.claim(&waiting(100, 10_000)).await);
    f.clock.advance_ms(100 + EXPIRY_SLACK_MS);
    assert_eq!(f.store.sweep(), 0);
    f.clock.advance_ms(10_000);
    assert_eq!(f.store.sweep(), 1);
}

#[tokio::test]
async fn a_waiting_bid_on_a_free_key_is_granted_at_once_without_a_notice() {
    let mut f = Fixture::new();
    let lease = granted(f.claim(&waiting(1_000, 5_000)).await);
    assert_eq!(lease.expires_at_ms, f.clock.now_ms() + 1_000);
    assert!(f.notices().is_empty());
}

#[tokio::test]
async fn a_held_key_queues_a_waiting_bid_until_the_holders_end() {
    let mut f = Fixture::new();
    f.hold(5_000).await;
    assert_eq!(queued(f.claim(&waiting(1_000, 60_000)).await), 5_000);
    f.clock.advance_ms(1_000);
    let again = waiting(1_000, 60_000);
    assert_eq!(queued(f.claim(&again).await), 4_000);
    // Asking again keeps its place: still queued, nothing offered.
    assert_eq!(queued(f.claim(&again).await), 4_000);
    assert!(f.notices().is_empty());
}

#[tokio::test]
async fn a_release_offers_the_key_to_the_head_which_takes_it_by_asking_again() {
    let mut f = Fixture::new();
    let holder = f.hold(60_000).await;
    let head = waiting(5_000, 60_000);
    queued(f.claim(&head).await);
    f.release(Space::Locks, &holder.token).await;
    assert!(f.offered(Space::Locks) == vec![head.token.clone()]);
    // The offer is a live holder for everyone else: held, for the offer window.
    let offer = f.lease_in_key().await.unwrap();
    assert!(offer.token == head.token);
    assert_eq!(offer.expires_at_ms, f.clock.now_ms() + OFFER_WINDOW_MS);
    assert!(offer.fence > holder.fence);
    assert!(matches!(f.claim(&bid(1_000)).await, GrantAnswer::Refused));
    f.clock.advance_ms(500);
    let taken = granted(f.claim(&head).await);
    // The fence of the offer; the TTL runs from the take.
    assert_eq!(taken.fence, offer.fence);
    assert_eq!(taken.expires_at_ms, f.clock.now_ms() + 5_000);
    // Taken, it is an ordinary lease: asking again answers it again, and it releases.
    assert_eq!(granted(f.claim(&head).await), taken);
    assert!(matches!(
        f.release(Space::Locks, &head.token).await,
        AsHolder::Done(_)
    ));
}

#[tokio::test]
async fn waiters_are_served_in_arrival_order() {
    let mut f = Fixture::new();
    let mut holder = f.hold(60_000).await;
    let bids: Vec<Bid> = (0..4).map(|_| waiting(1_000, 60_000)).collect();
    for b in &bids {
        queued(f.claim(b).await);
    }
    // The last asks again first: it keeps its place at the tail.
    queued(f.claim(&bids[3]).await);
    for b in &bids {
        f.release(Space::Locks, &holder.token).await;
        assert!(f.offered(Space::Locks) == vec![b.token.clone()]);
        holder = granted(f.claim(b).await);
    }
}

#[tokio::test]
async fn the_head_asking_when_the_lease_has_ended_is_granted_directly() {
    let mut f = Fixture::new();
    let holder = f.hold(100).await;
    let (head, next) = (waiting(1_000, 60_000), waiting(1_000, 60_000));
    queued(f.claim(&head).await);
    queued(f.claim(&next).await);
    f.clock.advance_ms(100);
    // The head asks first: granted in this step, no notice round.
    let lease = granted(f.claim(&head).await);
    assert!(lease.fence > holder.fence);
    assert!(f.notices().is_empty());
    // The next one is still queued behind it.
    assert_eq!(queued(f.claim(&next).await), 1_000);
}

#[tokio::test]
async fn a_bid_behind_the_head_asking_when_the_lease_has_ended_offers_it_to_the_head() {
    let mut f = Fixture::new();
    f.hold(100).await;
    let (head, next) = (waiting(1_000, 60_000), waiting(1_000, 60_000));
    queued(f.claim(&head).await);
    queued(f.claim(&next).await);
    f.clock.advance_ms(100);
    assert_eq!(queued(f.claim(&next).await), OFFER_WINDOW_MS);
    assert!(f.offered(Space::Locks) == vec![head.token.clone()]);
    granted(f.claim(&head).await);
}

#[tokio::test]
async fn an_offer_not_taken_in_its_window_lapses_and_the_key_passes_on() {
    let mut f = Fixture::new();
    let holder = f.hold(60_000).await;
    let bids: Vec<Bid> = (0..3).map(|_| waiting(1_000, 60_000)).collect();
    for b in &bids {
        queued(f.claim(b).await);
    }
    f.release(Space::Locks, &holder.token).await;
    assert!(f.offered(Space::Locks) == vec![bids[0].token.clone()]);
    f.clock.advance_ms(OFFER_WINDOW_MS - 1);
    assert_eq!(queued(f.claim(&bids[2]).await), 1);
    f.clock.advance_ms(1);
    // The last asks: the lapsed offer ends and the next in line is offered the key.
    assert_eq!(queued(f.claim(&bids[2]).await), OFFER_WINDOW_MS);
    assert!(f.offered(Space::Locks) == vec![bids[1].token.clone()]);
    // The first, too late, no longer has the offer: it joins the queue anew, at its tail.
    queued(f.claim(&bids[0]).await);
    f.clock.advance_ms(OFFER_WINDOW_MS);
    // The second lapses too; the third is the head now and is granted directly.
    granted(f.claim(&bids[2]).await);
    assert!(f.notices().is_empty());
}

#[tokio::test]
async fn leaving_ends_an_offer_not_taken_and_the_key_passes_on_at_once() {
    let mut f = Fixture::new();
    let holder = f.hold(60_000).await;
    let (gone, next) = (waiting(1_000, 60_000), waiting(1_000, 60_000));
    queued(f.claim(&gone).await);
    queued(f.claim(&next).await);
    f.release(Space::Locks, &holder.token).await;
    assert!(f.offered(Space::Locks) == vec![gone.token.clone()]);
    f.store
        .leave(Space::Locks, &f.key, &gone.token)
        .await
        .unwrap();
    assert!(f.offered(Space::Locks) == vec![next.token.clone()]);
    // Idempotent.
    f.store
        .leave(Space::Locks, &f.key, &gone.token)
        .await
        .unwrap();
    assert!(f.notices().is_empty());
    // A lease taken is left alone.
    let taken = granted(f.claim(&next).await);
    f.store
        .leave(Space::Locks, &f.key, &next.token)
        .await
        .unwrap();
    assert_eq!(f.lease_in_key().await, Some(taken));
}

#[tokio::test]
async fn leaving_the_queue_drops_the_entry_and_makes_no_slot_for_an_unknown_key() {
    let mut f = Fixture::new();
    let holder = f.hold(60_000).await;
    let (gone, next) = (waiting(1_000, 60_000), waiting(1_000, 60_000));
    queued(f.claim(&gone).await);
    queued(f.claim(&next).await);
    f.store
        .leave(Space::Locks, &f.key, &gone.token)
        .await
        .unwrap();
    assert!(f.notices().is_empty());
    f.release(Space::Locks, &holder.token).await;
    assert!(f.offered(Space::Locks) == vec![next.token.clone()]);
    let other = LockKey::parse("other").unwrap();
    f.store
        .leave(Space::Locks, &other, &gone.token)
        .await
        .unwrap();
    assert!(!f.store.slots().contains_key(&(Space::Locks, other)));
}

#[tokio::test]
async fn heads_whose_deadline_passed_are_skipped() {
    let mut f = Fixture::new();
    let holder = f.hold(60_000).await;
    let (short, long) = (waiting(1_000, 100), waiting(1_000, 60_000));
    queued(f.claim(&short).await);
    queued(f.claim(&long).await);
    f.clock.advance_ms(100);
    f.release(Space::Locks, &holder.token).await;
    assert!(f.offered(Space::Locks) == vec![long.token.clone()]);
}

#[tokio::test]
async fn a_bid_that_does_not_wait_never_goes_ahead_of_the_queue() {
    let mut f = Fixture::new();
    let holder = f.hold(100).await;
    let head = waiting(1_000, 60_000);
    queued(f.claim(&head).await);
    f.clock.advance_ms(100);
    // SETNX on a key whose lease ended, with a queue: refused, and the head is offered the key.
    assert!(matches!(f.claim(&bid(1_000)).await, GrantAnswer::Refused));
    assert!(f.offered(Space::Locks) == vec![head.token.clone()]);
    // A shared lease that does not wait: busy while the head's offer is live.
    let shared = f.join(Pool::Shared, &bid(1_000)).await;
    assert_eq!(
        shared,
        Join::Busy {
            retry_after_ms: OFFER_WINDOW_MS
        }
    );
    // And after the head took the key and released it, with nobody queued, free again.
    assert!(granted(f.claim(&head).await).fence > holder.fence);
    f.release(Space::Locks, &head.token).await;
    assert!(matches!(
        f.join(Pool::Shared, &bid(1_000)).await,
        Join::Granted(_)
    ));
    assert!(f.notices().is_empty());
}

#[tokio::test]
async fn a_takeover_with_a_queue_hands_the_expired_key_to_the_head() {
    let mut f = Fixture::new();
    let holder = f.hold(100).await;
    let head = waiting(1_000, 60_000);
    queued(f.claim(&head).await);
    f.clock.advance_ms(100);
    let answer = f.store.take_over(&f.key, holder.fence, &bid(1_000)).await;
    assert!(matches!(answer.unwrap(), GrantAnswer::Refused));
    assert!(f.offered(Space::Locks) == vec![head.token.clone()]);
}

#[tokio::test]
async fn fences_rise_in_grant_order_an_offer_taking_its_fence_when_offered() {
    let mut f = Fixture::new();
    let holder = f.hold(60_000).await;
    let (a, b) = (waiting(1_000, 60_000), waiting(1_000, 60_000));
    queued(f.claim(&a).await);
    queued(f.claim(&b).await);
    f.release(Space::Locks, &holder.token).await;
    f.clock.advance_ms(1_500);
    let taken_a = granted(f.claim(&a).await);
    f.release(Space::Locks, &a.token).await;
    let taken_b = granted(f.claim(&b).await);
    assert!(holder.fence < taken_a.fence && taken_a.fence < taken_b.fence);
    assert_eq!(f.offered(Space::Locks).len(), 2);
}

#[tokio::test]
async fn an_offer_is_not_its_tokens_to_release_or_renew() {
    let mut f = Fixture::new();
    let holder = f.hold(60_000).await;
    let head = waiting(1_000, 60_000);
    queued(f.claim(&head).await);
    f.release(Space::Locks, &holder.token).await;
    f.offered(Space::Locks);
    let ttl = Ttl::from_ms(30_000);
    let renewed = f
        .store
        .renew(Space::Locks, &f.key, &head.token, Renewal::For(ttl))
        .await;
    assert!(matches!(renewed.unwrap(), AsHolder::NotOwner));
    assert!(matches!(
        f.release(Space::Locks, &head.token).await,
        AsHolder::NotOwner
    ));
    assert!(granted(f.claim(&head).await).token == head.token);
}

#[tokio::test]
async fn a_force_release_ends_offers_too_and_hands_the_key_on() {
    let mut f = Fixture::new();
    let holder = f.hold(60_000).await;
    let (a, b) = (waiting(1_000, 60_000), waiting(1_000, 60_000));
    queued(f.claim(&a).await);
    queued(f.claim(&b).await);
    let forced = f.store.force_release(Space::Locks, &f.key).await.unwrap();
    assert_eq!(forced, AsHolder::Done(vec![holder.fence]));
    assert!(f.offered(Space::Locks) == vec![a.token.clone()]);
    let offer = f.lease_in_key().await.unwrap();
    let forced = f.store.force_release(Space::Locks, &f.key).await.unwrap();
    assert_eq!(forced, AsHolder::Done(vec![offer.fence]));
    assert!(f.offered(Space::Locks) == vec![b.token.clone()]);
    // The first bid's offer is gone: asking again, it queues.
    queued(f.claim(&a).await);
}

#[tokio::test]
async fn a_renewal_that_shortens_a_lease_tells_the_queue_to_look_again() {
    let mut f = Fixture::new();
    let holder = f.hold(60_000).await;
    let short = Ttl::from_ms(500);
    f.store
        .renew(Space::Locks, &f.key, &holder.token, Renewal::For(short))
        .await
        .unwrap();
    // Nobody queued: nobody to tell.
    assert!(f.notices().is_empty());
    queued(f.claim(&waiting(1_000, 60_000)).await);
    let shorter = Ttl::from_ms(200);
    f.store
        .renew(Space::Locks, &f.key, &holder.token, Renewal::For(shorter))
        .await
        .unwrap();
    assert_eq!(
        f.notices(),
        vec![Notice::Look(Space::Locks, f.key.clone(), 200)]
    );
    // Lengthening tells nobody.
    f.store
        .renew(Space::Locks, &f.key, &holder.token, Renewal::For(short))
        .await
        .unwrap();
    assert!(f.notices().is_empty());
}
