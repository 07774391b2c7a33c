//! The Redis store's queue per key, driven through the store interface on a real Redis: two
//! `RedisStore`s on one server play two brokers, and each one's notices are read from the channel
//! its `start` was given. The service's use of the queue is tested elsewhere; these check the
//! scripts' answers and notices step by step.

use std::time::Duration;

use lockbroker::domain::{Lease, LockKey, Owner, Pool, RequestId, Space, Token, Ttl};
use lockbroker::store::redis::RedisStore;
use lockbroker::store::{AsHolder, Bid, GrantAnswer, Join, Notice, Renewal, Store, StoreError};
use lockbroker_test_support::redis::{self, AsyncCommands};
use lockbroker_test_support::redis_server::RedisServer;
use tokio::sync::mpsc;

use crate::store_pools::{join, key, store_on};

/// A broker's store on `redis`, started, with its notices; its offers stay open `window`.
fn broker(redis: &RedisServer, window: Duration) -> (RedisStore, mpsc::Receiver<Notice>) {
    store_on(redis, "q:", window)
}

pub(crate) fn bid(ttl_ms: u64, wait_ms: u64) -> Bid {
    Bid {
        token: Token::generate(),
        ttl: Ttl::from_ms(ttl_ms),
        owner: None,
        request_id: None,
        wait_ms,
        ends: None,
    }
}

/// CLAIM, riding out the settle hold of a new store.
async fn claim(store: &RedisStore, k: &LockKey, bid: &Bid) -> GrantAnswer {
    for _ in 0..100 {
        match store.claim(k, bid).await.unwrap() {
            GrantAnswer::OnHold(hold) => {
                tokio::time::sleep(Duration::from_millis(hold.retry_after_ms.min(100))).await
            }
            other => return other,
        }
    }
    panic!("the store stayed held");
}

fn granted(answer: GrantAnswer) -> Lease {
    match answer {
        GrantAnswer::Granted(lease) => lease,
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn joined(answer: Join) -> Lease {
    match answer {
        Join::Granted(lease) => lease,
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn queued(answer: GrantAnswer) -> u64 {
    match answer {
        GrantAnswer::Queued { retry_after_ms } => retry_after_ms,
        other => panic!("expected the bid queued, got {other:?}"),
    }
}

fn join_queued(answer: Join) -> u64 {
    match answer {
        Join::Queued { retry_after_ms } => retry_after_ms,
        other => panic!("expected the bid queued, got {other:?}"),
    }
}

/// Waits (bounded) for the notice `want` on a broker's channel, skipping any other.
async fn told(notices: &mut mpsc::Receiver<Notice>, want: &Notice) {
    let found = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(notice) = notices.recv().await {
            if &notice == want {
                return;
            }
        }
        panic!("the notices ended");
    })
    .await;
    assert!(found.is_ok(), "no {want:?} within 5 s");
}

/// The notices a broker was told so far (up to the first 50 ms without one).
async fn drain(notices: &mut mpsc::Receiver<Notice>) -> Vec<Notice> {
    let mut out = Vec::new();
    while let Ok(Some(n)) = tokio::time::timeout(Duration::from_millis(50), notices.recv()).await {
        out.push(n);
    }
    out
}

fn offered(k: &LockKey, token: &Token) -> Notice {
    Notice::Offered(Space::Locks, k.clone(), token.clone())
}

async fn conn(redis: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

#[tokio::test]
async fn waiters_on_two_brokers_are_served_in_arrival_order_with_rising_fences() {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let (b, mut b_told) = broker(&redis, Duration::from_secs(2));
    let k = key("orders");
    // Held through B: B's release offers the key to A's bid (a release grants outright only to
    // its own broker's bids, see below).
    let holder = granted(claim(&b, &k, &bid(10_000, 0)).await);
    // Arrival order: a1 (on A), b1 (on B), a2 (on A).
    let (a1, b1, a2) = (
        bid(10_000, 10_000),
        bid(10_000, 10_000),
        bid(10_000, 10_000),
    );
    let retry = queued(claim(&a, &k, &a1).await);
    assert!(
        (1..=10_000).contains(&retry),
        "the holder's lease ends in {retry} ms"
    );
    queued(claim(&b, &k, &b1).await);
    queued(claim(&a, &k, &a2).await);
    // Asking again keeps a bid's place; a bid that does not wait is refused behind the queue.
    queued(claim(&b, &k, &b1).await);
    assert_eq!(claim(&b, &k, &bid(1_000, 0)).await, GrantAnswer::Refused);

    // The release offers the key to the head, on its broker's channel; the next broker in
    // line is told to look when the offer's window ends.
    assert!(matches!(
        b.release(Space::Locks, &k, &holder.token).await.unwrap(),
        AsHolder::Done(_)
    ));
    told(&mut a_told, &offered(&k, &a1.token)).await;
    told(&mut b_told, &Notice::Look(Space::Locks, k.clone(), 2_000)).await;
    // GET shows the offer as held; the offer's token cannot release or renew it yet.
    let seen = a.read(&k).await.unwrap();
    assert_eq!(seen.lease.as_ref().map(|l| &l.token), Some(&a1.token));
    assert_eq!(
        a.release(Space::Locks, &k, &a1.token).await.unwrap(),
        AsHolder::NotOwner
    );
    let first = granted(claim(&a, &k, &a1).await);
    assert!(first.fence > holder.fence);
    assert_eq!(first.token, a1.token);
    assert!(
        first.expires_at_ms >= seen.now_ms + 9_000,
        "its TTL runs from the take"
    );
    // Taken: the same bid asking again gets the same lease.
    assert_eq!(granted(claim(&a, &k, &a1).await).fence, first.fence);

    a.release(Space::Locks, &k, &a1.token).await.unwrap();
    told(&mut b_told, &offered(&k, &b1.token)).await;
    let second = granted(claim(&b, &k, &b1).await);
    assert!(second.fence > first.fence);
    // B's release hands on to A's waiter.
    b.release(Space::Locks, &k, &b1.token).await.unwrap();
    told(&mut a_told, &offered(&k, &a2.token)).await;
    let third = granted(claim(&a, &k, &a2).await);
    assert!(third.fence > second.fence);
    a.release(Space::Locks, &k, &a2.token).await.unwrap();
    // The queue is empty: a bid that does not wait is granted at once.
    granted(claim(&b, &k, &bid(1_000, 0)).await);
}

#[tokio::test]
async fn the_head_is_granted_directly_when_the_lease_before_it_expired() {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let k = key("expiring");
    let short = granted(claim(&a, &k, &bid(200, 0)).await);
    let head = bid(5_000, 10_000);
    let retry = queued(claim(&a, &k, &head).await);
    assert!((1..=200).contains(&retry));
    // Nobody releases: the head asks again when the lease ends, as its answer said.
    tokio::time::sleep(Duration::from_millis(retry + 20)).await;
    let lease = granted(claim(&a, &k, &head).await);
    assert!(lease.fence > short.fence);
    assert!(
        !drain(&mut a_told).await.contains(&offered(&k, &head.token)),
        "granted in the call, without an offer"
    );
}

#[tokio::test]
async fn an_offer_not_taken_lapses_and_the_key_passes_on_and_its_broker_requeues() {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_millis(300));
    let (b, mut b_told) = broker(&redis, Duration::from_millis(300));
    let k = key("dead-broker");
    let holder = granted(claim(&a, &k, &bid(10_000, 0)).await);
    // B's two bids first (B will "die"), then A's.
    let (b1, b2, a1) = (bid(5_000, 20_000), bid(5_000, 20_000), bid(5_000, 20_000));
    queued(claim(&b, &k, &b1).await);
    queued(claim(&b, &k, &b2).await);
    queued(claim(&a, &k, &a1).await);
    a.release(Space::Locks, &k, &holder.token).await.unwrap();
    told(&mut b_told, &offered(&k, &b1.token)).await;
    // A is told to look when B's offer lapses (A's bid is the first of another broker).
    told(&mut a_told, &Notice::Look(Space::Locks, k.clone(), 300)).await;
    // B never takes it. When the window has passed, A's bid asks again: the lapsed offer ends,
    // B's other bid leaves the queue with it (B is told to requeue), and A's bid is the head.
    tokio::time::sleep(Duration::from_millis(320)).await;
    let lease = granted(claim(&a, &k, &a1).await);
    assert_eq!(lease.token, a1.token);
    told(&mut b_told, &Notice::Requeue(Space::Locks, k.clone())).await;
    // B's bid, alive after all, joins anew at the tail; its old offer is gone.
    queued(claim(&b, &k, &b1).await);
    a.release(Space::Locks, &k, &a1.token).await.unwrap();
    told(&mut b_told, &offered(&k, &b1.token)).await;
    assert!(granted(claim(&b, &k, &b1).await).fence > lease.fence);
}

#[tokio::test]
async fn leaving_ends_an_offer_and_the_key_passes_on_at_once() {
    let redis = RedisServer::start().await;
    let (a, _a_told) = broker(&redis, Duration::from_secs(2));
    let (b, mut b_told) = broker(&redis, Duration::from_secs(2));
    let k = key("leaving");
    let holder = granted(claim(&a, &k, &bid(10_000, 0)).await);
    let (gone, next, quitter) = (bid(5_000, 10_000), bid(5_000, 10_000), bid(5_000, 10_000));
    queued(claim(&b, &k, &gone).await);
    queued(claim(&b, &k, &quitter).await);
    queued(claim(&b, &k, &next).await);
    // A queued bid leaves: nothing else changes (and leaving twice is harmless).
    b.leave(Space::Locks, &k, &quitter.token).await.unwrap();
    b.leave(Space::Locks, &k, &quitter.token).await.unwrap();
    a.release(Space::Locks, &k, &holder.token).await.unwrap();
    told(&mut b_told, &offered(&k, &gone.token)).await;
    // Its waiter went away: the broker leaves, and the offer passes on in the same step.
    b.leave(Space::Locks, &k, &gone.token).await.unwrap();
    told(&mut b_told, &offered(&k, &next.token)).await;
    let lease = granted(claim(&b, &k, &next).await);
    assert!(lease.fence > holder.fence);
    // A taken lease is left alone by a leave.
    b.leave(Space::Locks, &k, &next.token).await.unwrap();
    assert_eq!(
        b.read(&k).await.unwrap().lease.map(|l| l.fence),
        Some(lease.fence)
    );
    // The leaver, had it asked again, would join anew, behind nobody now but the holder.
    queued(claim(&b, &k, &quitter).await);
}

#[tokio::test]
async fn consecutive_shared_heads_are_offered_together_and_an_exclusive_one_holds_later_ones_back()
{
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let (b, mut b_told) = broker(&redis, Duration::from_secs(2));
    let k = key("report");
    let writer = granted(claim(&a, &k, &bid(10_000, 0)).await);
    let (s1, s2, x, s3) = (
        bid(5_000, 10_000),
        bid(5_000, 10_000),
        bid(5_000, 10_000),
        bid(5_000, 10_000),
    );
    join_queued(join(&a, &k, Pool::Shared, &s1).await);
    join_queued(join(&b, &k, Pool::Shared, &s2).await);
    queued(claim(&a, &k, &x).await);
    join_queued(join(&b, &k, Pool::Shared, &s3).await);
    // A shared bid that does not wait goes ahead of nobody.
    assert!(matches!(
        b.join(&k, Pool::Shared, &bid(1_000, 0)).await.unwrap(),
        Join::Busy { .. }
    ));
    a.release(Space::Locks, &k, &writer.token).await.unwrap();
    told(&mut a_told, &offered(&k, &s1.token)).await;
    told(&mut b_told, &offered(&k, &s2.token)).await;
    let r1 = joined(join(&a, &k, Pool::Shared, &s1).await);
    let r2 = joined(join(&b, &k, Pool::Shared, &s2).await);
    assert!(r1.fence > writer.fence && r2.fence > r1.fence);
    // The queued exclusive bid holds s3 back although only shared leases are live.
    join_queued(join(&b, &k, Pool::Shared, &s3).await);
    a.release(Space::Locks, &k, &r1.token).await.unwrap();
    queued(claim(&a, &k, &x).await);
    b.release(Space::Locks, &k, &r2.token).await.unwrap();
    told(&mut a_told, &offered(&k, &x.token)).await;
    let w = granted(claim(&a, &k, &x).await);
    assert!(w.fence > r2.fence);
    a.release(Space::Locks, &k, &x.token).await.unwrap();
    told(&mut b_told, &offered(&k, &s3.token)).await;
    assert!(joined(join(&b, &k, Pool::Shared, &s3).await).fence > w.fence);
}

#[tokio::test]
async fn semaphore_permits_go_to_the_queue_heads_while_there_is_room() {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let k = key("workers");
    let two = Pool::Semaphore { limit: 2 };
    let p1 = joined(join(&a, &k, two, &bid(10_000, 0)).await);
    let p2 = joined(join(&a, &k, two, &bid(10_000, 0)).await);
    let (q1, q2, q3) = (bid(5_000, 10_000), bid(5_000, 10_000), bid(5_000, 10_000));
    join_queued(join(&a, &k, two, &q1).await);
    join_queued(join(&a, &k, two, &q2).await);
    // A queued bid with another limit is refused, as a holder's would be.
    assert_eq!(
        join(&a, &k, Pool::Semaphore { limit: 3 }, &bid(1_000, 10_000)).await,
        Join::LimitMismatch { limit: 2 }
    );
    join_queued(join(&a, &k, two, &q3).await);
    let permit = |t: &Token| Notice::Offered(Space::Semaphores, k.clone(), t.clone());
    a.release(Space::Semaphores, &k, &p1.token).await.unwrap();
    told(&mut a_told, &permit(&q1.token)).await;
    // One place freed, one offer: q2 still waits.
    join_queued(join(&a, &k, two, &q2).await);
    assert_eq!(
        a.permits(&k).await.unwrap().holders.len(),
        2,
        "the offer counts"
    );
    a.release(Space::Semaphores, &k, &p2.token).await.unwrap();
    told(&mut a_told, &permit(&q2.token)).await;
    let g1 = joined(join(&a, &k, two, &q1).await);
    let g2 = joined(join(&a, &k, two, &q2).await);
    assert!(g2.fence > g1.fence && g1.fence > p2.fence);
    join_queued(join(&a, &k, two, &q3).await);
}

#[tokio::test]
async fn an_offer_answers_no_request_id_repeat_until_it_is_taken_and_dead_bids_are_skipped() {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let (b, _b_told) = broker(&redis, Duration::from_secs(2));
    let k = key("jobs");
    // Held through B, which offers the key to A's bids.
    let holder = granted(claim(&b, &k, &bid(10_000, 0)).await);
    let impatient = bid(5_000, 150);
    let with_id = Bid {
        request_id: Some(RequestId::parse("job-1").unwrap()),
        ..bid(5_000, 10_000)
    };
    queued(claim(&a, &k, &impatient).await);
    queued(claim(&a, &k, &with_id).await);
    // The first bid's wait runs out in the queue; the release skips it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    b.release(Space::Locks, &k, &holder.token).await.unwrap();
    told(&mut a_told, &offered(&k, &with_id.token)).await;
    // A repeat of the acquire (a new token, the same request id) does not get the offer.
    let repeat = Bid {
        token: Token::generate(),
        ..with_id.clone()
    };
    queued(claim(&a, &k, &repeat).await);
    let lease = granted(claim(&a, &k, &with_id).await);
    let again = granted(
        claim(
            &a,
            &k,
            &Bid {
                wait_ms: 0,
                ..repeat
            },
        )
        .await,
    );
    assert_eq!((again.token, again.fence), (lease.token, lease.fence));
}

#[tokio::test]
async fn a_release_grants_its_own_brokers_next_bid_outright_and_the_bids_ask_takes_it_without_a_call()
 {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let k = key("own");
    let holder = granted(claim(&a, &k, &bid(10_000, 0)).await);
    let next = bid(10_000, 10_000);
    queued(claim(&a, &k, &next).await);
    let mut c = conn(&redis).await;
    a.release(Space::Locks, &k, &holder.token).await.unwrap();
    // Its waiter is told as of an offer; in Redis the lease is the bid's, granted, not offered,
    // and the broker remembers it.
    told(&mut a_told, &offered(&k, &next.token)).await;
    let (token, offer): (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg("q:{own}:lock")
        .arg("token")
        .arg("offered")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(token.as_deref(), Some(next.token.as_str()));
    assert_eq!(offer, None, "granted, not offered");
    assert_eq!(a.ledger_len(), 1, "the grant is in the ledger");
    let before = redis.script_calls().await;
    let lease = granted(claim(&a, &k, &next).await);
    assert_eq!(
        redis.script_calls().await,
        before,
        "taken without a script call"
    );
    assert_eq!(lease.token, next.token);
    assert!(lease.fence > holder.fence);
    // Asked again, the bid gets the same lease, from Redis.
    assert_eq!(granted(claim(&a, &k, &next).await).fence, lease.fence);
    assert_eq!(redis.script_calls().await, before + 1);

    // A grant asked for late (more than 100 ms after the release handed it) is answered by
    // CLAIM, from what Redis holds.
    let late = bid(10_000, 10_000);
    queued(claim(&a, &k, &late).await);
    a.release(Space::Locks, &k, &next.token).await.unwrap();
    told(&mut a_told, &offered(&k, &late.token)).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let before = redis.script_calls().await;
    let third = granted(claim(&a, &k, &late).await);
    assert_eq!(redis.script_calls().await, before + 1, "answered by CLAIM");
    assert!(third.fence > lease.fence);
}

#[tokio::test]
async fn a_grant_handed_to_a_waiter_that_left_is_released_and_passes_on() {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let k = key("own-gone");
    let holder = granted(claim(&a, &k, &bid(10_000, 0)).await);
    let (gone, next) = (bid(10_000, 10_000), bid(10_000, 10_000));
    queued(claim(&a, &k, &gone).await);
    queued(claim(&a, &k, &next).await);
    a.release(Space::Locks, &k, &holder.token).await.unwrap();
    told(&mut a_told, &offered(&k, &gone.token)).await;
    // Its waiter went away: the broker leaves, which releases the grant and hands it on.
    a.leave(Space::Locks, &k, &gone.token).await.unwrap();
    told(&mut a_told, &offered(&k, &next.token)).await;
    let lease = granted(claim(&a, &k, &next).await);
    assert!(lease.fence > holder.fence);
    assert_eq!(a.ledger_len(), 1, "only the taken grant is remembered");
    // The gone bid's grant is over: asking with its token joins the queue anew.
    queued(claim(&a, &k, &gone).await);
}

#[tokio::test]
async fn a_sessions_bid_and_another_brokers_bid_are_offered_not_granted() {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let (b, mut b_told) = broker(&redis, Duration::from_secs(2));
    let k = key("offered");
    let mut c = conn(&redis).await;
    let holder = granted(claim(&a, &k, &bid(10_000, 0)).await);
    // A bid under a session: its lease must end with its session, which only its ask says.
    let in_session = Bid {
        owner: Some(Owner::for_session(None, 0)),
        ..bid(10_000, 10_000)
    };
    let elsewhere = bid(10_000, 10_000);
    queued(claim(&a, &k, &in_session).await);
    queued(claim(&b, &k, &elsewhere).await);
    let offer = async |c: &mut redis::aio::MultiplexedConnection| -> Option<String> {
        c.hget("q:{offered}:lock", "offered").await.unwrap()
    };
    a.release(Space::Locks, &k, &holder.token).await.unwrap();
    told(&mut a_told, &offered(&k, &in_session.token)).await;
    assert_eq!(offer(&mut c).await.as_deref(), Some("1"));
    let first = granted(claim(&a, &k, &in_session).await);
    // A's release, B's bid next: offered.
    a.release(Space::Locks, &k, &first.token).await.unwrap();
    told(&mut b_told, &offered(&k, &elsewhere.token)).await;
    assert_eq!(offer(&mut c).await.as_deref(), Some("1"));
    assert!(granted(claim(&b, &k, &elsewhere).await).fence > first.fence);
}

#[tokio::test]
async fn an_uncontended_cycle_costs_one_script_each_way_and_a_contended_acquisition_two_or_three() {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let (b, mut b_told) = broker(&redis, Duration::from_secs(2));
    let k = key("counted");
    granted(claim(&a, &k, &bid(1_000, 0)).await);
    let k2 = key("uncontended");
    let before = redis.script_calls().await;
    for _ in 0..10 {
        let lease = granted(a.claim(&k2, &bid(1_000, 5_000)).await.unwrap());
        a.release(Space::Locks, &k2, &lease.token).await.unwrap();
    }
    assert_eq!(redis.script_calls().await - before, 20);
    println!("uncontended: 2 EVALSHA per acquire + release");

    // Contended: the holder on A, a waiter on B; per acquisition: the claim that queues, the
    // claim that takes the offer, and the release that hands on.
    let mut holder = granted(a.claim(&k2, &bid(10_000, 0)).await.unwrap());
    let mut on = &a;
    let before = redis.script_calls().await;
    for i in 0..10 {
        let (next, told_rx) = if i % 2 == 0 {
            (&b, &mut b_told)
        } else {
            (&a, &mut a_told)
        };
        let waiter = bid(10_000, 10_000);
        queued(next.claim(&k2, &waiter).await.unwrap());
        on.release(Space::Locks, &k2, &holder.token).await.unwrap();
        told(told_rx, &offered(&k2, &waiter.token)).await;
        holder = granted(next.claim(&k2, &waiter).await.unwrap());
        on = next;
    }
    let per = (redis.script_calls().await - before) as f64 / 10.0;
    println!("contended across brokers: {per} EVALSHA per acquisition");
    assert_eq!(per, 3.0);

    // On one broker the release grants the key to the waiter outright: the claim that queues
    // and the release.
    let before = redis.script_calls().await;
    for _ in 0..10 {
        let waiter = bid(10_000, 10_000);
        queued(on.claim(&k2, &waiter).await.unwrap());
        on.release(Space::Locks, &k2, &holder.token).await.unwrap();
        holder = granted(on.claim(&k2, &waiter).await.unwrap());
    }
    let per = (redis.script_calls().await - before) as f64 / 10.0;
    println!("contended on one broker: {per} EVALSHA per acquisition");
    assert_eq!(per, 2.0);
}

#[tokio::test]
async fn a_marker_of_a_newer_layout_stops_grants_with_a_clear_error() {
    let redis = RedisServer::start().await;
    let (a, _told) = broker(&redis, Duration::from_secs(2));
    let k = key("upgraded");
    granted(claim(&a, &k, &bid(1_000, 0)).await);
    let mut c = conn(&redis).await;
    let layout: u32 = c.hget("q:epoch", "layout").await.unwrap();
    assert_eq!(layout, 2, "the marker records this broker's layout");
    let () = c.hset("q:epoch", "layout", 3).await.unwrap();
    match a.claim(&key("other"), &bid(1_000, 0)).await {
        Err(StoreError::Failed(words)) => {
            assert!(words.contains("newer store layout (3)"), "{words}");
            assert!(words.contains("upgrade this broker"), "{words}");
        }
        other => panic!("a newer layout must stop grants: {other:?}"),
    }
    assert!(matches!(
        a.join(&k, Pool::Shared, &bid(1_000, 0)).await,
        Err(StoreError::Failed(_))
    ));
    // The broker says it is not ready (its epoch check reads the marker), and the check does
    // not lower the layout.
    assert!(matches!(a.ready().await, Err(StoreError::Failed(words)) if words.contains("(3)")));
    let layout: u32 = c.hget("q:epoch", "layout").await.unwrap();
    assert_eq!(layout, 3);
}

#[tokio::test]
async fn a_lease_an_older_broker_wrote_is_released_with_the_notice_older_brokers_read() {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let k = key("legacy");
    // Settle first; then write the lease as a broker of layout 1 leaves it (no `by`).
    let warm = granted(claim(&a, &k, &bid(1_000, 0)).await);
    a.release(Space::Locks, &k, &warm.token).await.unwrap();
    let mut c = conn(&redis).await;
    let now_ms: u64 = {
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut c).await.unwrap();
        s * 1000 + us / 1000
    };
    let old = Token::generate();
    let fence = warm.fence + 1;
    let () = redis::cmd("HSET")
        .arg("q:{legacy}:lock")
        .arg(&[
            ("token", old.as_str().to_owned()),
            ("fence", fence.to_string()),
            ("expires_at", (now_ms + 10_000).to_string()),
            ("ttl", "10000".to_owned()),
            ("granted_at", now_ms.to_string()),
        ])
        .query_async(&mut c)
        .await
        .unwrap();
    let waiter = bid(5_000, 10_000);
    queued(claim(&a, &k, &waiter).await);
    let mut pubsub = redis::Client::open(redis.url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    pubsub.subscribe("q:released").await.unwrap();
    let mut messages = pubsub.on_message();
    assert!(matches!(
        a.release(Space::Locks, &k, &old).await.unwrap(),
        AsHolder::Done(_)
    ));
    use futures_util::StreamExt;
    let message = tokio::time::timeout(Duration::from_secs(5), messages.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        message.get_payload::<String>().unwrap(),
        format!("legacy {fence}")
    );
    told(&mut a_told, &offered(&k, &waiter.token)).await;
}

#[tokio::test]
async fn a_store_loss_tells_every_waiter_to_ask_again() {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let k = key("lost");
    granted(claim(&a, &k, &bid(20_000, 0)).await);
    queued(claim(&a, &k, &bid(5_000, 20_000)).await);
    drain(&mut a_told).await;
    redis.flushall().await;
    told(&mut a_told, &Notice::Missed).await;
}

/// Waits (at most 3 s) until `store` remembers no lease; false if it still does then.
async fn ledger_empties(store: &RedisStore) -> bool {
    let started = std::time::Instant::now();
    while store.ledger_len() > 0 {
        if started.elapsed() > Duration::from_secs(3) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_releases_racing_renewals_leave_nothing_in_the_ledger_to_put_back() {
    let redis = RedisServer::start().await;
    let (a, _a_told) = broker(&redis, Duration::from_secs(2));
    let (b, _b_told) = broker(&redis, Duration::from_secs(2));
    let k = key("raced");
    granted(claim(&a, &k, &bid(1_000, 0)).await);
    a.force_release(Space::Locks, &k).await.unwrap();
    assert!(ledger_empties(&a).await);
    // Each round: A holds a long lease; A renews it while a force release (on B, or on A
    // itself) ends it. Whichever Redis runs first, A's ledger must end up without the lease:
    // a renewal answered after the end's notice must not bring it back.
    for round in 0..60 {
        let lease = granted(a.claim(&k, &bid(60_000, 0)).await.unwrap());
        let forcer = if round % 2 == 0 { b.clone() } else { a.clone() };
        // Two tasks, so that either answer may be handled first.
        let renewal = {
            let (a, k, token) = (a.clone(), k.clone(), lease.token.clone());
            tokio::spawn(async move {
                a.renew(Space::Locks, &k, &token, Renewal::For(Ttl::from_ms(60_000)))
                    .await
            })
        };
        let force = {
            let k = k.clone();
            tokio::spawn(async move { forcer.force_release(Space::Locks, &k).await })
        };
        let (renewed, forced) = (renewal.await.unwrap(), force.await.unwrap());
        assert!(matches!(
            renewed.unwrap(),
            AsHolder::Done(_) | AsHolder::NotHeld
        ));
        assert_eq!(forced.unwrap(), AsHolder::Done(vec![lease.fence]));
        assert!(
            ledger_empties(&a).await,
            "round {round}: the force-released lease stayed in the ledger"
        );
    }
}

/// A claim as a broker of store layout 1 (before the queue) runs it: its script verbatim.
async fn layout1_claim(
    c: &mut redis::aio::MultiplexedConnection,
    k: &str,
    token: &Token,
    waits: bool,
) -> Vec<redis::Value> {
    let epoch: String = c.hget("q:epoch", "id").await.unwrap();
    redis::cmd("EVAL")
        .arg(include_str!("layout1/claim.lua"))
        .arg(6)
        .arg(format!("q:{{{k}}}:lock"))
        .arg(format!("q:{{{k}}}:fence"))
        .arg("q:epoch")
        .arg(format!("q:{{{k}}}:shared"))
        .arg(format!("q:{{{k}}}:shared:ends"))
        .arg(format!("q:{{{k}}}:writers"))
        .arg(token.as_str())
        .arg(10_000)
        .arg("0")
        .arg("")
        .arg(60_000)
        .arg(epoch)
        .arg("")
        .arg(if waits { "1" } else { "0" })
        .query_async(c)
        .await
        .unwrap()
}

fn code(reply: &[redis::Value]) -> i64 {
    match reply.first() {
        Some(redis::Value::Int(code)) => *code,
        other => panic!("a reply code, not {other:?}"),
    }
}

#[tokio::test]
async fn brokers_of_layouts_1_and_2_on_one_store_never_both_grant_a_key() {
    let redis = RedisServer::start().await;
    let (a, mut a_told) = broker(&redis, Duration::from_secs(2));
    let mut c = conn(&redis).await;
    let k = key("mixed");
    let holder = granted(claim(&a, &k, &bid(10_000, 0)).await);
    let waiter = bid(10_000, 10_000);
    queued(claim(&a, &k, &waiter).await);
    // Held by layout 2: layout 1 is refused, waiting or not.
    assert_eq!(
        code(&layout1_claim(&mut c, "mixed", &Token::generate(), true).await),
        0
    );
    // Offered to the queue's head, not yet taken: the offer is a lease to layout 1 too.
    a.release(Space::Locks, &k, &holder.token).await.unwrap();
    told(&mut a_told, &offered(&k, &waiter.token)).await;
    assert_eq!(
        code(&layout1_claim(&mut c, "mixed", &Token::generate(), false).await),
        0
    );
    let taken = granted(claim(&a, &k, &waiter).await);
    assert_eq!(
        code(&layout1_claim(&mut c, "mixed", &Token::generate(), false).await),
        0
    );
    a.release(Space::Locks, &k, &taken.token).await.unwrap();
    // Free and nobody queued: layout 1 grants, with a higher fence; layout 2 then queues
    // behind its lease, or is refused, and never grants over it.
    let old = Token::generate();
    let reply = layout1_claim(&mut c, "mixed", &old, false).await;
    assert_eq!(code(&reply), 1);
    let old_fence: u64 = redis::from_redis_value(reply[1].clone()).unwrap();
    assert!(old_fence > taken.fence);
    assert_eq!(claim(&a, &k, &bid(1_000, 0)).await, GrantAnswer::Refused);
    let next = bid(10_000, 10_000);
    queued(claim(&a, &k, &next).await);
    // Layout 2 releases the layout 1 lease (by its token) and hands the key on.
    assert!(matches!(
        a.release(Space::Locks, &k, &old).await.unwrap(),
        AsHolder::Done(_)
    ));
    told(&mut a_told, &offered(&k, &next.token)).await;
    assert!(granted(claim(&a, &k, &next).await).fence > old_fence);
}

#[tokio::test]
async fn an_exclusive_head_that_leaves_lets_the_shared_bids_behind_it_in_at_once() {
    let redis = RedisServer::start().await;
    let (a, mut a_notices) = broker(&redis, Duration::from_secs(2));
    let k = key("leaving-writer");
    // A shared holder; an exclusive bid queues behind it, and a shared bid behind that.
    joined(join(&a, &k, Pool::Shared, &bid(60_000, 0)).await);
    let writer = bid(10_000, 30_000);
    queued(claim(&a, &k, &writer).await);
    let reader = bid(10_000, 30_000);
    join_queued(join(&a, &k, Pool::Shared, &reader).await);
    // The writer's client goes away: the reader is offered a shared lease beside the holder in
    // that step, not when the holder's lease ends a minute later.
    a.leave(Space::Locks, &k, &writer.token).await.unwrap();
    told(
        &mut a_notices,
        &Notice::Offered(Space::Locks, k.clone(), reader.token.clone()),
    )
    .await;
    joined(join(&a, &k, Pool::Shared, &reader).await);
}
