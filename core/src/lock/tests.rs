//! The algorithm's edge cases, each named after the pitfall of the classic SETNX/GETSET recipe
//! it covers, over the embedded store with a manual clock. `Scripted` wraps the real store and
//! lets a test run another client's step between two of the algorithm's steps — the
//! interleavings that recipe's users hit.
//!
//! One file over the usual length on purpose: each test is short and named after the case it
//! covers, and they all share the `Scripted` store and the harness below.

use std::future::pending;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::executor::block_on;

use super::acquire::POLL_MIN;
use super::*;
use crate::domain::{Fence, LockKey, Mode, Pool, RequestId, Space, Token};
use crate::store::memory::clock::ManualClock;
use crate::store::memory::tests::bid;
use crate::store::{
    Bid, GrantAnswer, Join, ListQuery, MemoryStore, Notice, Page, Permits, Snapshot,
};

type Hook = Box<dyn FnOnce(&MemoryStore) + Send>;

/// How the next claim misbehaves.
enum ClaimFault {
    /// Redis ran the script, then the answer was lost (a response timeout).
    FailAfterApplying,
    /// Redis ran the script and the answer never comes.
    HangAfterApplying,
}

#[derive(Default)]
struct Calls {
    claim: AtomicUsize,
    read: AtomicUsize,
    take_over: AtomicUsize,
    release: AtomicUsize,
}

struct Scripted {
    inner: MemoryStore,
    before_read: Mutex<Option<Hook>>,
    before_take_over: Mutex<Option<Hook>>,
    claim_fault: Mutex<Option<ClaimFault>>,
    calls: Calls,
}

impl Scripted {
    fn new(inner: MemoryStore) -> Self {
        Self {
            inner,
            before_read: Mutex::default(),
            before_take_over: Mutex::default(),
            claim_fault: Mutex::default(),
            calls: Calls::default(),
        }
    }

    /// Runs `hook` (another client's step) just before the algorithm's next GET.
    fn before_next_read(&self, hook: impl FnOnce(&MemoryStore) + Send + 'static) {
        *self.before_read.lock().unwrap() = Some(Box::new(hook));
    }

    /// Runs `hook` just before the algorithm's next takeover (GETSET).
    fn before_next_take_over(&self, hook: impl FnOnce(&MemoryStore) + Send + 'static) {
        *self.before_take_over.lock().unwrap() = Some(Box::new(hook));
    }

    fn fault_next_claim(&self, fault: ClaimFault) {
        *self.claim_fault.lock().unwrap() = Some(fault);
    }

    fn count(counter: &AtomicUsize) -> usize {
        counter.load(Ordering::SeqCst)
    }
}

impl Store for Scripted {
    async fn claim(&self, key: &LockKey, bid: &Bid) -> StoreResult<GrantAnswer> {
        self.calls.claim.fetch_add(1, Ordering::SeqCst);
        let claimed = self.inner.claim(key, bid).await;
        let fault = self.claim_fault.lock().unwrap().take();
        match fault {
            None => claimed,
            Some(ClaimFault::FailAfterApplying) => Err(StoreError::Timeout(2000)),
            Some(ClaimFault::HangAfterApplying) => pending().await,
        }
    }

    async fn read(&self, key: &LockKey) -> StoreResult<Snapshot> {
        self.calls.read.fetch_add(1, Ordering::SeqCst);
        let hook = self.before_read.lock().unwrap().take();
        if let Some(hook) = hook {
            hook(&self.inner);
        }
        self.inner.read(key).await
    }

    async fn take_over(&self, key: &LockKey, seen: Fence, bid: &Bid) -> StoreResult<GrantAnswer> {
        self.calls.take_over.fetch_add(1, Ordering::SeqCst);
        let hook = self.before_take_over.lock().unwrap().take();
        if let Some(hook) = hook {
            hook(&self.inner);
        }
        self.inner.take_over(key, seen, bid).await
    }

    async fn release(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> StoreResult<AsHolder<crate::store::Released>> {
        self.calls.release.fetch_add(1, Ordering::SeqCst);
        self.inner.release(space, key, token).await
    }

    async fn renew(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
        how: crate::store::Renewal,
    ) -> StoreResult<AsHolder<Lease>> {
        self.inner.renew(space, key, token, how).await
    }

    async fn session(
        &self,
        id: &Token,
        op: crate::store::SessionOp<'_>,
    ) -> StoreResult<Option<crate::store::SessionRecord>> {
        self.inner.session(id, op).await
    }

    async fn join(&self, key: &LockKey, pool: Pool, bid: &Bid) -> StoreResult<Join> {
        self.inner.join(key, pool, bid).await
    }

    async fn permits(&self, key: &LockKey) -> StoreResult<Permits> {
        self.inner.permits(key).await
    }

    async fn leave(&self, space: Space, key: &LockKey, token: &Token) -> StoreResult<()> {
        self.inner.leave(space, key, token).await
    }

    async fn force_release(
        &self,
        space: Space,
        key: &LockKey,
    ) -> StoreResult<AsHolder<Vec<Fence>>> {
        self.inner.force_release(space, key).await
    }

    async fn list(&self, query: &ListQuery) -> StoreResult<Page> {
        self.inner.list(query).await
    }

    async fn ready(&self) -> StoreResult<Option<Hold>> {
        self.inner.ready().await
    }

    fn start(&self, notices: mpsc::Sender<Notice>) {
        self.inner.start(notices);
    }
}

const T0: u64 = 1_700_000_000_000;

struct Harness {
    clock: ManualClock,
    store: Arc<Scripted>,
    locks: LockService<Scripted>,
    stop: watch::Sender<bool>,
    key: LockKey,
}

fn harness() -> Harness {
    harness_with(16)
}

fn harness_with(max_waiters: usize) -> Harness {
    build_harness(max_waiters, false)
}

fn build_harness(max_waiters: usize, allow_force_release: bool) -> Harness {
    let clock = ManualClock::starting_at_ms(T0);
    let store = Arc::new(Scripted::new(MemoryStore::new(Arc::new(clock.clone()))));
    let (stop, stopped) = watch::channel(false);
    let locks = LockService::new(
        store.clone(),
        LockSettings {
            store_timeout: Duration::from_secs(2),
            max_waiters,
            allow_force_release,
        },
        stopped,
    );
    Harness {
        clock,
        store,
        locks,
        stop,
        key: LockKey::parse("orders:42").unwrap(),
    }
}

fn request(ttl_ms: u64, wait_ms: u64) -> AcquireRequest {
    AcquireRequest {
        kind: Kind::Exclusive,
        ttl: Ttl::from_ms(ttl_ms),
        wait: WaitFor::from_ms(wait_ms),
        owner: None,
        request_id: None,
        session: None,
    }
}

/// The token currently in the key, expired or not.
fn token_in_store(h: &Harness) -> Option<Token> {
    block_on(h.store.inner.read(&h.key))
        .unwrap()
        .lease
        .map(|l| l.token)
}

#[tokio::test]
async fn a_free_lock_is_claimed_with_setnx_in_one_store_call() {
    let h = harness();
    let lease = h.locks.acquire(&h.key, request(1000, 0)).await.unwrap();
    assert_eq!(lease.expires_at_ms, T0 + 1000);
    assert_eq!(Scripted::count(&h.store.calls.claim), 1);
    assert_eq!(Scripted::count(&h.store.calls.read), 0);
    assert_eq!(token_in_store(&h), Some(lease.token));
}

#[tokio::test]
async fn get_returning_nil_after_a_failed_setnx_goes_back_to_setnx_not_to_takeover() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(10_000, 0)).await.unwrap();
    // Between the second client's SETNX (fails: held) and its GET, the holder releases.
    let (key, token) = (h.key.clone(), first.token.clone());
    h.store.before_next_read(move |store| {
        assert!(matches!(
            block_on(store.release(Space::Locks, &key, &token)).unwrap(),
            AsHolder::Done(_)
        ));
    });
    let second = h.locks.acquire(&h.key, request(10_000, 0)).await.unwrap();
    assert!(second.fence > first.fence);
    assert_eq!(
        Scripted::count(&h.store.calls.claim),
        3,
        "back to SETNX after the nil GET"
    );
    assert_eq!(
        Scripted::count(&h.store.calls.take_over),
        0,
        "nil is not an expired lease"
    );
    assert_eq!(token_in_store(&h), Some(second.token));
}

#[tokio::test]
async fn getset_returning_nil_means_the_contender_holds_the_lock() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(100, 0)).await.unwrap();
    h.clock.advance_ms(150);
    // The expired key vanishes (Redis expired it, or its holder's cleanup deleted it) between
    // the contender's GET and its GETSET.
    let key = h.key.clone();
    h.store
        .before_next_take_over(move |store| store.evict(&key));
    let second = h.locks.acquire(&h.key, request(100, 0)).await.unwrap();
    assert_eq!(Scripted::count(&h.store.calls.take_over), 1);
    assert_eq!(token_in_store(&h), Some(second.token.clone()));
    // The counter went with the key; the reseeded fence is still above the old one.
    assert!(second.fence > first.fence);
}

#[tokio::test]
async fn a_lost_getset_race_writes_nothing_and_leaves_the_winners_lease_intact() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(100, 0)).await.unwrap();
    h.clock.advance_ms(150);
    // Another contender saw the same expired lease and takes it over first.
    let winner = bid(5_000);
    let (key, seen, winner_bid) = (h.key.clone(), first.fence, winner.clone());
    h.store.before_next_take_over(move |store| {
        let won = block_on(store.take_over(&key, seen, &winner_bid)).unwrap();
        assert!(matches!(won, GrantAnswer::Granted(_)));
    });
    let loser = h.locks.acquire(&h.key, request(100, 0)).await;
    match loser {
        Err(LockError::Locked { retry_after_ms }) => assert_eq!(retry_after_ms, 5_000),
        other => panic!("the loser must be told the lock is held, got {other:?}"),
    }
    // The classic recipe's blind GETSET would have put the loser's value in the key by now.
    assert_eq!(token_in_store(&h), Some(winner.token.clone()));
    h.locks
        .release(Space::Locks, &h.key, &winner.token)
        .await
        .unwrap();
}

#[tokio::test]
async fn timestamps_have_millisecond_precision() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(1_500, 0)).await.unwrap();
    assert_eq!(first.expires_at_ms, T0 + 1_500);
    h.clock.advance_ms(1_499);
    match h.locks.acquire(&h.key, request(1_000, 0)).await {
        Err(LockError::Locked { retry_after_ms }) => assert_eq!(retry_after_ms, 1),
        other => panic!("held for one more millisecond, got {other:?}"),
    }
    h.clock.advance_ms(1);
    let second = h.locks.acquire(&h.key, request(1_000, 0)).await.unwrap();
    assert_eq!(second.expires_at_ms, T0 + 1_500 + 1_000);
}

#[tokio::test]
async fn releasing_a_lease_that_expired_and_was_taken_over_is_not_owner_and_keeps_the_new_lease() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(100, 0)).await.unwrap();
    h.clock.advance_ms(150);
    let second = h.locks.acquire(&h.key, request(1_000, 0)).await.unwrap();
    assert!(second.fence > first.fence);
    assert!(matches!(
        h.locks.release(Space::Locks, &h.key, &first.token).await,
        Err(LockError::NotOwner)
    ));
    assert_eq!(token_in_store(&h), Some(second.token.clone()));
    h.locks
        .release(Space::Locks, &h.key, &second.token)
        .await
        .unwrap();
}

#[tokio::test]
async fn releasing_a_lease_that_expired_untaken_is_not_held() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(100, 0)).await.unwrap();
    h.clock.advance_ms(100);
    assert!(matches!(
        h.locks.release(Space::Locks, &h.key, &first.token).await,
        Err(LockError::NotHeld)
    ));
    assert!(matches!(
        h.locks.inspect(&h.key).await,
        Err(LockError::NotHeld)
    ));
}

#[tokio::test]
async fn renewing_an_expired_lease_is_refused_and_never_revives_it() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(100, 0)).await.unwrap();
    h.clock.advance_ms(100);
    let ttl = Ttl::from_ms(10_000);
    assert!(matches!(
        h.locks.renew(Space::Locks, &h.key, &first.token, ttl).await,
        Err(LockError::NotHeld)
    ));
    let second = h.locks.acquire(&h.key, request(1_000, 0)).await.unwrap();
    assert!(matches!(
        h.locks.renew(Space::Locks, &h.key, &first.token, ttl).await,
        Err(LockError::NotOwner)
    ));
    assert_eq!(token_in_store(&h), Some(second.token));
}

#[tokio::test]
async fn renewing_keeps_token_and_fence_and_ends_the_lease_ttl_after_now() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(1_000, 0)).await.unwrap();
    h.clock.advance_ms(600);
    let renewed = h
        .locks
        .renew(Space::Locks, &h.key, &first.token, Ttl::from_ms(2_000))
        .await
        .unwrap();
    assert_eq!(renewed.token, first.token);
    assert_eq!(renewed.fence, first.fence);
    assert_eq!(renewed.expires_at_ms, T0 + 600 + 2_000);
    h.clock.advance_ms(1_000);
    let view = h.locks.inspect(&h.key).await.unwrap();
    assert_eq!(view.holders[0].expires_at_ms - view.now_ms, 1_000);
}

#[tokio::test]
async fn fences_rise_in_grant_order_through_claims_releases_and_takeovers() {
    let h = harness();
    let mut last = 0;
    for round in 0..20 {
        let lease = h.locks.acquire(&h.key, request(100, 0)).await.unwrap();
        assert!(
            lease.fence > last,
            "round {round}: {} after {last}",
            lease.fence
        );
        last = lease.fence;
        if round % 2 == 0 {
            h.locks
                .release(Space::Locks, &h.key, &lease.token)
                .await
                .unwrap();
        } else {
            h.clock.advance_ms(100); // left to expire: the next grant is a takeover
        }
    }
    assert_eq!(Scripted::count(&h.store.calls.take_over), 9);
}

#[tokio::test]
async fn a_host_clock_step_backwards_does_not_lower_fences_after_the_counter_is_lost() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(100, 0)).await.unwrap();
    h.locks
        .release(Space::Locks, &h.key, &first.token)
        .await
        .unwrap();
    // The counter is lost (the store restarted empty) and the clock went back a little.
    h.store.inner.evict(&h.key);
    h.clock.advance_ms(crate::store::EXPIRY_SLACK_MS);
    h.clock.rewind_ms(1_000);
    let second = h.locks.acquire(&h.key, request(100, 0)).await.unwrap();
    assert!(second.fence > first.fence);
}

#[tokio::test(start_paused = true)]
async fn a_waiting_acquire_is_granted_when_the_holder_releases() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(60_000, 0)).await.unwrap();
    let waiter = {
        let (locks, key) = (h.locks.clone(), h.key.clone());
        tokio::spawn(async move { locks.acquire(&key, request(1_000, 5_000)).await })
    };
    while h.locks.waiting() == 0 {
        tokio::task::yield_now().await;
    }
    h.locks
        .release(Space::Locks, &h.key, &first.token)
        .await
        .unwrap();
    let second = waiter.await.unwrap().unwrap();
    assert!(second.fence > first.fence);
    assert_eq!(h.locks.waiting(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_waiting_acquire_takes_over_when_the_holders_lease_ends() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(300, 0)).await.unwrap();
    let waiter = {
        let (locks, key) = (h.locks.clone(), h.key.clone());
        tokio::spawn(async move { locks.acquire(&key, request(1_000, 5_000)).await })
    };
    while h.locks.waiting() == 0 {
        tokio::task::yield_now().await;
    }
    h.clock.advance_ms(300);
    let second = waiter.await.unwrap().unwrap();
    assert!(second.fence > first.fence);
    // A waiting bid at the head of the queue takes an expired lease over in its own claim (the
    // store does it in that step); the separate GETSET is for bids that do not wait.
    assert_eq!(Scripted::count(&h.store.calls.claim), 3);
    assert_eq!(Scripted::count(&h.store.calls.take_over), 0);
}

#[tokio::test(start_paused = true)]
async fn a_wait_that_runs_out_answers_locked_after_the_wait_with_the_time_left() {
    let h = harness();
    h.locks.acquire(&h.key, request(60_000, 0)).await.unwrap();
    let started = Instant::now();
    match h.locks.acquire(&h.key, request(1_000, 250)).await {
        Err(LockError::Locked { retry_after_ms }) => assert_eq!(retry_after_ms, 60_000),
        other => panic!("expected locked, got {other:?}"),
    }
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
    assert!(
        waited < Duration::from_millis(250) + POLL_MIN * 2,
        "{waited:?}"
    );
    // No polling while the holder's lease is far from its end: one look on arrival, one at the
    // deadline.
    let passes = Scripted::count(&h.store.calls.claim) - 1;
    assert_eq!(passes, 2);
    assert_eq!(h.locks.waiting(), 0);
}

#[tokio::test(start_paused = true)]
async fn waiters_beyond_the_cap_are_refused_at_once() {
    let h = harness_with(1);
    h.locks.acquire(&h.key, request(60_000, 0)).await.unwrap();
    let first_waiter = {
        let (locks, key) = (h.locks.clone(), h.key.clone());
        tokio::spawn(async move { locks.acquire(&key, request(1_000, 5_000)).await })
    };
    while h.locks.waiting() == 0 {
        tokio::task::yield_now().await;
    }
    assert!(matches!(
        h.locks.acquire(&h.key, request(1_000, 5_000)).await,
        Err(LockError::TooManyWaiters { limit: 1 })
    ));
    // A request that need not wait is still answered.
    assert!(matches!(
        h.locks.acquire(&h.key, request(1_000, 0)).await,
        Err(LockError::Locked { .. })
    ));
    first_waiter.abort();
}

#[tokio::test(start_paused = true)]
async fn shutdown_answers_waiting_acquires_with_shutting_down() {
    let h = harness();
    h.locks.acquire(&h.key, request(60_000, 0)).await.unwrap();
    let waiter = {
        let (locks, key) = (h.locks.clone(), h.key.clone());
        tokio::spawn(async move { locks.acquire(&key, request(1_000, 30_000)).await })
    };
    while h.locks.waiting() == 0 {
        tokio::task::yield_now().await;
    }
    let started = Instant::now();
    h.stop.send(true).unwrap();
    assert!(matches!(
        waiter.await.unwrap(),
        Err(LockError::ShuttingDown)
    ));
    assert!(started.elapsed() < Duration::from_millis(1));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_leaves_the_queue_and_no_lease_behind() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(60_000, 0)).await.unwrap();
    let waiter = {
        let (locks, key) = (h.locks.clone(), h.key.clone());
        tokio::spawn(async move { locks.acquire(&key, request(1_000, 30_000)).await })
    };
    while h.locks.waiting() == 0 {
        tokio::task::yield_now().await;
    }
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    assert_eq!(h.locks.waiting(), 0);
    // Its entry in the store's queue goes with it (a spawned leave).
    settle().await;
    h.locks
        .release(Space::Locks, &h.key, &first.token)
        .await
        .unwrap();
    assert_eq!(token_in_store(&h), None);
    // Nobody waits: a request that may not wait is granted the free key.
    h.locks.acquire(&h.key, request(1_000, 0)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_offer_to_a_waiter_that_is_not_here_any_more_is_ended_and_passes_on_at_once() {
    let h = harness();
    let holder = h.locks.acquire(&h.key, request(60_000, 0)).await.unwrap();
    // A bid in the store's queue that no waiter on this broker has (its waiter left just as the
    // offer was made).
    let stray = Bid {
        wait_ms: 30_000,
        ..bid(1_000)
    };
    assert!(matches!(
        h.store.inner.claim(&h.key, &stray).await.unwrap(),
        GrantAnswer::Queued { .. }
    ));
    let next = spawn_waiting(&h, request(1_000, 30_000)).await;
    h.locks
        .release(Space::Locks, &h.key, &holder.token)
        .await
        .unwrap();
    // The stray bid is offered the key first. The store's clock stands still here, so the offer
    // never lapses: only the broker ending it lets the waiter behind it in.
    let lease = tokio::time::timeout(Duration::from_secs(5), next)
        .await
        .expect("the waiter behind the stray bid is granted")
        .unwrap()
        .unwrap();
    assert!(lease.fence > holder.fence);
    assert!(
        h.locks
            .render_metrics()
            .contains("lockbroker_offers_passed_on_total{reason=\"gone\"} 1")
    );
}

#[tokio::test(start_paused = true)]
async fn a_contended_acquisition_costs_two_claims_and_waiters_promoted_here_ask_the_store_nothing()
{
    let h = harness();
    let holder = h.locks.acquire(&h.key, request(60_000, 0)).await.unwrap();
    let mut waiting = Vec::new();
    for _ in 0..4 {
        waiting.push(spawn_waiting(&h, request(60_000, 30_000)).await);
    }
    let claims = Scripted::count(&h.store.calls.claim);
    assert_eq!(
        claims, 5,
        "one claim each: the holder's, and each waiter's that queued it"
    );
    let mut token = holder.token;
    for waiter in waiting {
        h.locks.release(Space::Locks, &h.key, &token).await.unwrap();
        let lease = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("granted in turn")
            .unwrap()
            .unwrap();
        token = lease.token;
    }
    // Per waiter, one more claim: the one that took the offer. The others, promoted to first
    // waiter here as each one before them left, asked nothing.
    assert_eq!(Scripted::count(&h.store.calls.claim), claims + 4);
    assert_eq!(Scripted::count(&h.store.calls.read), 0);
    assert!(
        h.locks
            .render_metrics()
            .contains("lockbroker_handoffs_total{space=\"locks\"} 4")
    );
}

/// Lets spawned cleanup tasks run to completion.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn a_grant_whose_answer_was_lost_is_released_by_its_token_and_reported_unavailable() {
    let h = harness();
    h.store.fault_next_claim(ClaimFault::FailAfterApplying);
    let outcome = h.locks.acquire(&h.key, request(60_000, 0)).await;
    assert!(matches!(
        outcome,
        Err(LockError::StoreUnavailable(StoreError::Timeout(_)))
    ));
    settle().await;
    assert_eq!(Scripted::count(&h.store.calls.release), 1);
    assert_eq!(
        token_in_store(&h),
        None,
        "nobody knows that lease's token: it must go"
    );
    // The key is free for the next client at once, not after 60 s.
    h.locks.acquire(&h.key, request(1_000, 0)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_during_a_grant_call_leaves_no_lease_behind() {
    let h = harness();
    h.store.fault_next_claim(ClaimFault::HangAfterApplying);
    let acquire = {
        let (locks, key) = (h.locks.clone(), h.key.clone());
        tokio::spawn(async move { locks.acquire(&key, request(60_000, 0)).await })
    };
    while Scripted::count(&h.store.calls.claim) == 0 {
        tokio::task::yield_now().await;
    }
    assert!(token_in_store(&h).is_some(), "the store applied the claim");
    acquire.abort();
    let _ = acquire.await;
    settle().await;
    assert_eq!(token_in_store(&h), None);
}

#[tokio::test(start_paused = true)]
async fn a_hanging_store_call_ends_in_unavailable_within_the_wait_plus_the_store_bound() {
    let h = harness();
    h.store.fault_next_claim(ClaimFault::HangAfterApplying);
    let started = Instant::now();
    let outcome = h.locks.acquire(&h.key, request(60_000, 100)).await;
    assert!(matches!(
        outcome,
        Err(LockError::StoreUnavailable(StoreError::Timeout(_)))
    ));
    assert_eq!(
        started.elapsed(),
        Duration::from_millis(100) + Duration::from_secs(2)
    );
    settle().await;
    assert_eq!(token_in_store(&h), None);
}

#[tokio::test]
async fn an_owner_label_is_kept_with_the_lease() {
    let h = harness();
    let owner = Owner::parse("worker-7").unwrap();
    let req = AcquireRequest {
        owner: Some(owner.clone()),
        ..request(1_000, 0)
    };
    h.locks.acquire(&h.key, req).await.unwrap();
    let view = h.locks.inspect(&h.key).await.unwrap();
    assert_eq!(view.holders[0].owner, Some(owner));
    assert_eq!(view.holders[0].expires_at_ms - view.now_ms, 1_000);
}

fn with_request_id(req: AcquireRequest, id: &str) -> AcquireRequest {
    AcquireRequest {
        request_id: Some(RequestId::parse(id).unwrap()),
        ..req
    }
}

#[tokio::test]
async fn repeating_an_acquire_with_its_request_id_returns_the_same_grant_while_it_is_held() {
    let h = harness();
    let first = h
        .locks
        .acquire(&h.key, with_request_id(request(1_000, 0), "r-1"))
        .await
        .unwrap();
    h.clock.advance_ms(400);
    let again = h
        .locks
        .acquire(&h.key, with_request_id(request(1_000, 0), "r-1"))
        .await
        .unwrap();
    assert_eq!(again.token, first.token);
    assert_eq!(again.fence, first.fence);
    assert_eq!(again.expires_at_ms, first.expires_at_ms);
    // Another request id, or none, is just another contender.
    for req in [with_request_id(request(1_000, 0), "r-2"), request(1_000, 0)] {
        assert!(matches!(
            h.locks.acquire(&h.key, req).await,
            Err(LockError::Locked { .. })
        ));
    }
    // Once the lease is gone, the same id gets a new grant, not the old one.
    h.locks
        .release(Space::Locks, &h.key, &first.token)
        .await
        .unwrap();
    let later = h
        .locks
        .acquire(&h.key, with_request_id(request(1_000, 0), "r-1"))
        .await
        .unwrap();
    assert_ne!(later.token, first.token);
    assert!(later.fence > first.fence);
}

#[tokio::test]
async fn a_request_id_never_revives_an_expired_lease() {
    let h = harness();
    let first = h
        .locks
        .acquire(&h.key, with_request_id(request(100, 0), "r-1"))
        .await
        .unwrap();
    h.clock.advance_ms(100);
    let again = h
        .locks
        .acquire(&h.key, with_request_id(request(100, 0), "r-1"))
        .await
        .unwrap();
    assert_ne!(again.token, first.token);
    assert!(again.fence > first.fence);
}

#[tokio::test]
async fn metrics_count_known_traffic_by_result() {
    let h = harness();
    let first = h.locks.acquire(&h.key, request(100, 0)).await.unwrap();
    assert!(h.locks.acquire(&h.key, request(100, 0)).await.is_err()); // locked
    h.locks
        .renew(Space::Locks, &h.key, &first.token, Ttl::from_ms(100))
        .await
        .unwrap();
    h.clock.advance_ms(100);
    h.locks.acquire(&h.key, request(100, 0)).await.unwrap(); // a takeover
    assert!(
        h.locks
            .release(Space::Locks, &h.key, &first.token)
            .await
            .is_err()
    ); // not_owner
    assert!(
        h.locks
            .renew(Space::Locks, &h.key, &first.token, Ttl::from_ms(1))
            .await
            .is_err()
    ); // not_owner
    let text = h.locks.render_metrics();
    for line in [
        "lockbroker_acquisitions_total{kind=\"exclusive\",result=\"granted\"} 2",
        "lockbroker_acquisitions_total{kind=\"exclusive\",result=\"locked\"} 1",
        "lockbroker_acquisitions_total{kind=\"exclusive\",result=\"error\"} 0",
        "lockbroker_takeovers_total 1",
        "lockbroker_renewals_total{space=\"locks\",result=\"renewed\"} 1",
        "lockbroker_renewals_total{space=\"locks\",result=\"not_owner\"} 1",
        "lockbroker_releases_total{space=\"locks\",result=\"not_owner\"} 1",
        "lockbroker_releases_total{space=\"locks\",result=\"released\"} 0",
        "lockbroker_store_call_seconds_count{op=\"claim\"} 3",
        "lockbroker_store_call_seconds_count{op=\"take_over\"} 1",
        "lockbroker_waiters 0",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}

#[tokio::test]
async fn a_grant_with_a_request_id_whose_answer_was_lost_is_kept_for_the_repeat() {
    let h = harness();
    h.store.fault_next_claim(ClaimFault::FailAfterApplying);
    let lost = h
        .locks
        .acquire(&h.key, with_request_id(request(60_000, 0), "r-lost"))
        .await;
    assert!(matches!(lost, Err(LockError::StoreUnavailable(_))));
    settle().await;
    // The client repeats its acquire and gets the grant the store did make...
    let again = h
        .locks
        .acquire(&h.key, with_request_id(request(60_000, 0), "r-lost"))
        .await
        .unwrap();
    settle().await;
    // ...and no cleanup takes it away afterwards.
    assert_eq!(Scripted::count(&h.store.calls.release), 0);
    assert_eq!(token_in_store(&h), Some(again.token.clone()));
    h.locks
        .renew(Space::Locks, &h.key, &again.token, Ttl::from_ms(1_000))
        .await
        .unwrap();
}

fn shared(ttl_ms: u64, wait_ms: u64) -> AcquireRequest {
    AcquireRequest {
        kind: Kind::Shared,
        ..request(ttl_ms, wait_ms)
    }
}

fn permit(limit: u32, ttl_ms: u64, wait_ms: u64) -> AcquireRequest {
    AcquireRequest {
        kind: Kind::Semaphore { limit },
        ..request(ttl_ms, wait_ms)
    }
}

/// Starts an acquire as a task of its own and returns once it waits on the broker.
async fn spawn_waiting(
    h: &Harness,
    req: AcquireRequest,
) -> tokio::task::JoinHandle<Result<Lease, LockError>> {
    let before = h.locks.waiting();
    let (locks, key) = (h.locks.clone(), h.key.clone());
    let task = tokio::spawn(async move { locks.acquire(&key, req).await });
    while h.locks.waiting() == before {
        tokio::task::yield_now().await;
    }
    task
}

#[tokio::test]
async fn shared_leases_are_held_together_each_with_its_own_token_and_fence() {
    let h = harness();
    let one = h.locks.acquire(&h.key, shared(1_000, 0)).await.unwrap();
    let two = h.locks.acquire(&h.key, shared(2_000, 0)).await.unwrap();
    assert_ne!(one.token, two.token);
    assert!(two.fence > one.fence);
    let view = h.locks.inspect(&h.key).await.unwrap();
    assert_eq!(view.mode, Some(Mode::Shared));
    assert_eq!(view.holders.len(), 2);
    // No exclusive lease beside them; one shared lease's release leaves the other.
    assert!(matches!(
        h.locks.acquire(&h.key, request(1_000, 0)).await,
        Err(LockError::Locked {
            retry_after_ms: 2_000
        })
    ));
    h.locks
        .release(Space::Locks, &h.key, &one.token)
        .await
        .unwrap();
    let renewed = h
        .locks
        .renew(Space::Locks, &h.key, &two.token, Ttl::from_ms(500))
        .await
        .unwrap();
    assert_eq!(renewed.fence, two.fence);
    h.clock.advance_ms(500);
    let exclusive = h.locks.acquire(&h.key, request(1_000, 0)).await.unwrap();
    assert!(exclusive.fence > two.fence);
}

#[tokio::test(start_paused = true)]
async fn a_shared_acquire_is_not_granted_ahead_of_an_exclusive_one_queued_before_it() {
    let h = harness();
    let holder = h.locks.acquire(&h.key, request(60_000, 0)).await.unwrap();
    let exclusive = spawn_waiting(&h, request(1_000, 5_000)).await;
    let reader = spawn_waiting(&h, shared(1_000, 5_000)).await;
    // A shared request that may not wait is refused while the exclusive one waits ahead.
    assert!(matches!(
        h.locks.acquire(&h.key, shared(1_000, 0)).await,
        Err(LockError::Locked { .. })
    ));
    h.locks
        .release(Space::Locks, &h.key, &holder.token)
        .await
        .unwrap();
    let writer = exclusive.await.unwrap().unwrap();
    assert!(writer.fence > holder.fence);
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(!reader.is_finished(), "the reader waits for the writer");
    h.locks
        .release(Space::Locks, &h.key, &writer.token)
        .await
        .unwrap();
    let read = reader.await.unwrap().unwrap();
    assert!(read.fence > writer.fence);
}

#[tokio::test(start_paused = true)]
async fn a_waiting_exclusive_acquire_holds_new_shared_ones_back_and_gets_the_lock_after_the_last_shared_one()
 {
    let h = harness();
    let one = h.locks.acquire(&h.key, shared(60_000, 0)).await.unwrap();
    let two = h.locks.acquire(&h.key, shared(60_000, 0)).await.unwrap();
    let exclusive = spawn_waiting(&h, request(1_000, 10_000)).await;
    // On this broker, by the queue; on any broker, by the exclusive acquire's intent.
    assert!(matches!(
        h.locks.acquire(&h.key, shared(1_000, 0)).await,
        Err(LockError::Locked { .. })
    ));
    assert!(matches!(
        h.store
            .inner
            .join(&h.key, Pool::Shared, &bid(1_000))
            .await
            .unwrap(),
        Join::Busy { .. }
    ));
    h.locks
        .release(Space::Locks, &h.key, &one.token)
        .await
        .unwrap();
    tokio::task::yield_now().await;
    assert!(!exclusive.is_finished(), "one shared lease is still held");
    h.locks
        .release(Space::Locks, &h.key, &two.token)
        .await
        .unwrap();
    let writer = exclusive.await.unwrap().unwrap();
    assert!(writer.fence > two.fence);
}

#[tokio::test(start_paused = true)]
async fn a_granted_shared_waiter_wakes_the_next_which_is_granted_at_once_too() {
    let h = harness();
    let holder = h.locks.acquire(&h.key, request(60_000, 0)).await.unwrap();
    let first = spawn_waiting(&h, shared(1_000, 5_000)).await;
    let second = spawn_waiting(&h, shared(1_000, 5_000)).await;
    let released = Instant::now();
    h.locks
        .release(Space::Locks, &h.key, &holder.token)
        .await
        .unwrap();
    let (first, second) = (
        first.await.unwrap().unwrap(),
        second.await.unwrap().unwrap(),
    );
    assert!(
        released.elapsed() < POLL_MIN,
        "the second reader waited {:?}",
        released.elapsed()
    );
    assert_ne!(first.token, second.token);
    assert_eq!(h.locks.inspect(&h.key).await.unwrap().holders.len(), 2);
}

#[tokio::test]
async fn a_semaphore_grants_up_to_its_limit_and_refuses_another_limit_while_held() {
    let h = harness();
    let one = h.locks.acquire(&h.key, permit(2, 1_000, 0)).await.unwrap();
    h.clock.advance_ms(100);
    let two = h.locks.acquire(&h.key, permit(2, 1_000, 0)).await.unwrap();
    assert!(two.fence > one.fence);
    // Full: the first permit ends soonest.
    assert!(matches!(
        h.locks.acquire(&h.key, permit(2, 1_000, 0)).await,
        Err(LockError::Locked {
            retry_after_ms: 900
        })
    ));
    assert!(matches!(
        h.locks.acquire(&h.key, permit(3, 1_000, 0)).await,
        Err(LockError::LimitMismatch { limit: 2 })
    ));
    // A lock of the same name is another key.
    h.locks.acquire(&h.key, request(1_000, 0)).await.unwrap();
    let view = h.locks.permits(&h.key).await.unwrap();
    assert_eq!((view.limit, view.holders.len()), (Some(2), 2));
    h.locks
        .release(Space::Semaphores, &h.key, &one.token)
        .await
        .unwrap();
    h.locks.acquire(&h.key, permit(2, 1_000, 0)).await.unwrap();
    // Once every permit has ended, a new limit is fine.
    h.clock.advance_ms(1_000);
    h.locks.acquire(&h.key, permit(5, 1_000, 0)).await.unwrap();
    let text = h.locks.render_metrics();
    for line in [
        "lockbroker_acquisitions_total{kind=\"semaphore\",result=\"granted\"} 4",
        "lockbroker_acquisitions_total{kind=\"semaphore\",result=\"locked\"} 1",
        "lockbroker_acquisitions_total{kind=\"semaphore\",result=\"limit_mismatch\"} 1",
        "lockbroker_releases_total{space=\"semaphores\",result=\"released\"} 1",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_waiting_permit_is_granted_when_a_permit_is_released_and_not_on_a_lock_release() {
    let h = harness();
    let permit_held = h.locks.acquire(&h.key, permit(1, 60_000, 0)).await.unwrap();
    let lock_held = h.locks.acquire(&h.key, request(60_000, 0)).await.unwrap();
    let waiter = spawn_waiting(&h, permit(1, 1_000, 5_000)).await;
    let claims = Scripted::count(&h.store.calls.claim);
    h.locks
        .release(Space::Locks, &h.key, &lock_held.token)
        .await
        .unwrap();
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(!waiter.is_finished());
    assert_eq!(Scripted::count(&h.store.calls.claim), claims);
    let released = Instant::now();
    h.locks
        .release(Space::Semaphores, &h.key, &permit_held.token)
        .await
        .unwrap();
    let granted = waiter.await.unwrap().unwrap();
    assert!(granted.fence > permit_held.fence);
    assert!(released.elapsed() < POLL_MIN);
}

#[tokio::test]
async fn force_release_is_refused_unless_allowed_and_ends_every_lease_on_the_key() {
    let h = harness();
    h.locks.acquire(&h.key, shared(60_000, 0)).await.unwrap();
    assert!(matches!(
        h.locks.force_release(Space::Locks, &h.key).await,
        Err(LockError::ForceReleaseOff)
    ));

    let h = build_harness(16, true);
    let one = h.locks.acquire(&h.key, shared(60_000, 0)).await.unwrap();
    let two = h.locks.acquire(&h.key, shared(60_000, 0)).await.unwrap();
    let mut ended = h.locks.force_release(Space::Locks, &h.key).await.unwrap();
    ended.sort_unstable();
    assert_eq!(ended, vec![one.fence, two.fence]);
    assert!(matches!(
        h.locks.inspect(&h.key).await,
        Err(LockError::NotHeld)
    ));
    assert!(matches!(
        h.locks.force_release(Space::Locks, &h.key).await,
        Err(LockError::NotHeld)
    ));
    assert!(matches!(
        h.locks.release(Space::Locks, &h.key, &one.token).await,
        Err(LockError::NotHeld)
    ));
    let text = h.locks.render_metrics();
    for line in [
        "lockbroker_force_releases_total{space=\"locks\",result=\"released\"} 1",
        "lockbroker_force_releases_total{space=\"locks\",result=\"not_held\"} 1",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}
