//! The Redis store's shared leases, semaphore permits, force release and listing, driven through
//! the store interface on a real Redis (the HTTP routes over them are tested elsewhere; these
//! check the scripts' answers one by one, and the put-back of every kind after a flush).

use std::sync::Arc;
use std::time::Duration;

use lockbroker::domain::{LockKey, Mode, Pool, RequestId, Space, Ttl};
use lockbroker::store::redis::{RedisSettings, RedisStore, RedisTls, RedisUrl};
use lockbroker::store::{
    AsHolder, Bid, GrantAnswer, Join, ListQuery, Metrics, Notice, Renewal, Store, StoreError,
};
use lockbroker_test_support::redis_server::RedisServer;
use tokio::sync::mpsc;

fn store(redis: &RedisServer, prefix: &str) -> (RedisStore, mpsc::Receiver<Notice>) {
    store_on(redis, prefix, Duration::from_secs(2))
}

/// A broker's store on `redis` under `prefix`, started, with its notices; `timeout` bounds its
/// calls (and is the offer window of its queue).
pub(crate) fn store_on(
    redis: &RedisServer,
    prefix: &str,
    timeout: Duration,
) -> (RedisStore, mpsc::Receiver<Notice>) {
    store_on_with(redis, prefix, timeout, Arc::default())
}

/// [`store_on`], counting into `metrics`.
pub(crate) fn store_on_with(
    redis: &RedisServer,
    prefix: &str,
    timeout: Duration,
    metrics: Arc<Metrics>,
) -> (RedisStore, mpsc::Receiver<Notice>) {
    let store = RedisStore::connect(
        &RedisSettings {
            url: RedisUrl::parse(&redis.url()).unwrap(),
            key_prefix: prefix.into(),
            timeout,
            store_loss_delay: Duration::ZERO,
            store_settle: Duration::from_millis(300),
            tls: RedisTls::default(),
            replica_acks: 0,
            batch_max: 64,
        },
        metrics,
    )
    .unwrap();
    let (tx, rx) = mpsc::channel(1024);
    store.start(tx);
    (store, rx)
}

pub(crate) fn key(k: &str) -> LockKey {
    LockKey::parse(k).unwrap()
}

/// A bid that does not wait.
fn bid(ttl_ms: u64) -> Bid {
    crate::store_queue::bid(ttl_ms, 0)
}

/// Joins until granted, riding out the settle hold of a new store.
pub(crate) async fn join(store: &RedisStore, k: &LockKey, pool: Pool, bid: &Bid) -> Join {
    for _ in 0..100 {
        match store.join(k, pool, bid).await.unwrap() {
            Join::OnHold(hold) => {
                tokio::time::sleep(Duration::from_millis(hold.retry_after_ms.min(100))).await
            }
            other => return other,
        }
    }
    panic!("the store stayed held");
}

fn granted(join: Join) -> lockbroker::store::Lease {
    match join {
        Join::Granted(lease) => lease,
        other => panic!("expected a grant, got {other:?}"),
    }
}

#[tokio::test]
async fn shared_leases_exclude_exclusive_ones_and_a_queued_exclusive_holds_new_shared_back() {
    let redis = RedisServer::start().await;
    let (store, mut notices) = store(&redis, "p:");
    let k = key("cache");
    let r1 = granted(join(&store, &k, Pool::Shared, &bid(10_000)).await);
    let r2 = granted(join(&store, &k, Pool::Shared, &bid(10_000)).await);
    assert!(r2.fence > r1.fence);
    assert_ne!(r1.token, r2.token);

    // An exclusive claim is refused while they are live; GET shows them.
    assert_eq!(
        store.claim(&k, &bid(1_000)).await.unwrap(),
        GrantAnswer::Refused
    );
    let seen = store.read(&k).await.unwrap();
    assert!(seen.lease.is_none());
    assert_eq!(
        seen.shared.iter().map(|l| l.fence).collect::<Vec<_>>(),
        [r1.fence, r2.fence]
    );

    // A claim that will wait joins the key's queue: no new shared lease goes ahead of it.
    let writer = Bid {
        wait_ms: 10_000,
        ..bid(5_000)
    };
    match store.claim(&k, &writer).await.unwrap() {
        GrantAnswer::Queued { retry_after_ms } => {
            assert!(
                (1..=10_000).contains(&retry_after_ms),
                "the shared leases' end"
            )
        }
        other => panic!("a waiting claim queues: {other:?}"),
    }
    match store.join(&k, Pool::Shared, &bid(1_000)).await.unwrap() {
        Join::Busy { retry_after_ms } => assert!((1..=10_000).contains(&retry_after_ms)),
        other => panic!("a shared join must wait behind the queued writer: {other:?}"),
    }

    // Shared holders release by their own tokens; the last release offers the key to the
    // writer, which takes it by asking again.
    assert!(matches!(
        store.release(Space::Locks, &k, &r1.token).await.unwrap(),
        AsHolder::Done(_)
    ));
    assert_eq!(
        store.release(Space::Locks, &k, &r1.token).await.unwrap(),
        AsHolder::NotOwner,
        "r2 still holds the key"
    );
    let renewed = match store
        .renew(
            Space::Locks,
            &k,
            &r2.token,
            Renewal::For(Ttl::from_ms(20_000)),
        )
        .await
        .unwrap()
    {
        AsHolder::Done(lease) => lease,
        other => panic!("{other:?}"),
    };
    assert_eq!(renewed.fence, r2.fence);
    assert!(renewed.expires_at_ms > r2.expires_at_ms);
    store.release(Space::Locks, &k, &r2.token).await.unwrap();
    let offer = Notice::Offered(Space::Locks, k.clone(), writer.token.clone());
    let told = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(notice) = notices.recv().await {
            if notice == offer {
                return;
            }
        }
    })
    .await;
    assert!(told.is_ok(), "the writer's broker is told of the offer");
    let GrantAnswer::Granted(w) = store.claim(&k, &writer).await.unwrap() else {
        panic!("the writer wins once the shared leases are gone");
    };
    assert!(w.fence > r2.fence, "one fence counter for both modes");
    // The writer left the queue with its grant; its exclusive lease now keeps shared joins out.
    match store.join(&k, Pool::Shared, &bid(1_000)).await.unwrap() {
        Join::Busy { retry_after_ms } => assert!(retry_after_ms > 2_000),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        store.release(Space::Locks, &k, &r2.token).await.unwrap(),
        AsHolder::NotOwner
    );
}

#[tokio::test]
async fn semaphores_grant_up_to_their_limit_refuse_another_limit_and_repeat_by_request_id() {
    let redis = RedisServer::start().await;
    let (store, _notices) = store(&redis, "p:");
    let k = key("partner-api");
    let two = Pool::Semaphore { limit: 2 };
    let a = granted(join(&store, &k, two, &bid(10_000)).await);
    let with_id = Bid {
        request_id: Some(RequestId::parse("job-7").unwrap()),
        ..bid(10_000)
    };
    let b = granted(join(&store, &k, two, &with_id).await);
    // The same request id answers the same permit, even though the semaphore is full.
    let again = granted(join(&store, &k, two, &with_id).await);
    assert_eq!(
        (again.token.clone(), again.fence),
        (b.token.clone(), b.fence)
    );
    // Repeated with another limit, it is refused: the permit was taken under the holders' one.
    assert_eq!(
        join(&store, &k, Pool::Semaphore { limit: 3 }, &with_id).await,
        Join::LimitMismatch { limit: 2 }
    );
    match join(&store, &k, two, &bid(1_000)).await {
        Join::Busy { retry_after_ms } => assert!((9_000..=10_000).contains(&retry_after_ms)),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        join(&store, &k, Pool::Semaphore { limit: 3 }, &bid(1_000)).await,
        Join::LimitMismatch { limit: 2 }
    );
    // A lock of the same name is another space.
    assert!(matches!(
        store.claim(&k, &bid(1_000)).await.unwrap(),
        GrantAnswer::Granted(_)
    ));
    let permits = store.permits(&k).await.unwrap();
    assert_eq!(permits.limit, Some(2));
    assert_eq!(
        permits.holders.iter().map(|l| l.fence).collect::<Vec<_>>(),
        [a.fence, b.fence]
    );
    assert_eq!(
        store.release(Space::Locks, &k, &a.token).await.unwrap(),
        AsHolder::NotOwner,
        "a permit's token means nothing on the lock"
    );
    assert!(matches!(
        store
            .release(Space::Semaphores, &k, &a.token)
            .await
            .unwrap(),
        AsHolder::Done(_)
    ));
    let c = granted(join(&store, &k, two, &bid(10_000)).await);
    assert!(c.fence > b.fence);

    // Force release ends every permit; the limit goes with the holders.
    let AsHolder::Done(mut ended) = store.force_release(Space::Semaphores, &k).await.unwrap()
    else {
        panic!("two permits were live");
    };
    ended.sort_unstable();
    assert_eq!(ended, [b.fence, c.fence]);
    assert_eq!(
        store.force_release(Space::Semaphores, &k).await.unwrap(),
        AsHolder::NotHeld
    );
    assert!(matches!(
        join(&store, &k, Pool::Semaphore { limit: 5 }, &bid(1_000)).await,
        Join::Granted(_)
    ));
}

#[tokio::test]
async fn expired_permits_free_their_places_and_renewals_move_their_ends() {
    let redis = RedisServer::start().await;
    let (store, _notices) = store(&redis, "p:");
    let k = key("licences");
    let one = Pool::Semaphore { limit: 1 };
    let short = granted(join(&store, &k, one, &bid(150)).await);
    assert!(matches!(
        join(&store, &k, one, &bid(1_000)).await,
        Join::Busy { .. }
    ));
    let AsHolder::Done(renewed) = store
        .renew(
            Space::Semaphores,
            &k,
            &short.token,
            Renewal::For(Ttl::from_ms(300)),
        )
        .await
        .unwrap()
    else {
        panic!("the permit is live");
    };
    assert_eq!(renewed.fence, short.fence);
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(
        store
            .renew(
                Space::Semaphores,
                &k,
                &short.token,
                Renewal::For(Ttl::from_ms(300))
            )
            .await
            .unwrap(),
        AsHolder::NotHeld
    );
    let next = granted(join(&store, &k, one, &bid(1_000)).await);
    assert!(next.fence > short.fence);
}

#[tokio::test]
async fn listing_pages_through_held_locks_and_semaphores_by_prefix_without_losing_any() {
    let redis = RedisServer::start().await;
    let (store, _notices) = store(&redis, "p:");
    let mut expected = Vec::new();
    for i in 0..25 {
        let k = key(&format!("orders:{i:02}"));
        if i % 3 == 0 {
            granted(join(&store, &k, Pool::Shared, &bid(10_000)).await);
        } else {
            loop {
                match store.claim(&k, &bid(10_000)).await.unwrap() {
                    GrantAnswer::Granted(_) => break,
                    GrantAnswer::OnHold(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    other => panic!("a free key: {other:?}"),
                }
            }
        }
        expected.push(k);
    }
    // Released and never-held keys, other prefixes and semaphores are not listed as locks.
    let GrantAnswer::Granted(g) = store
        .claim(&key("orders:gone"), &bid(10_000))
        .await
        .unwrap()
    else {
        panic!();
    };
    store
        .release(Space::Locks, &key("orders:gone"), &g.token)
        .await
        .unwrap();
    store.claim(&key("invoices:1"), &bid(10_000)).await.unwrap();
    granted(
        join(
            &store,
            &key("orders:sem"),
            Pool::Semaphore { limit: 2 },
            &bid(10_000),
        )
        .await,
    );

    let mut listed = Vec::new();
    let mut cursor = None;
    let mut pages = 0;
    loop {
        let page = store
            .list(&ListQuery {
                space: Space::Locks,
                prefix: "orders:".into(),
                limit: 4,
                cursor: cursor.take(),
            })
            .await
            .unwrap();
        assert!(page.entries.len() <= 4);
        for entry in page.entries {
            let shared = entry.key.as_str()[7..].parse::<u32>().unwrap() % 3 == 0;
            assert_eq!(
                entry.mode,
                Some(if shared {
                    Mode::Shared
                } else {
                    Mode::Exclusive
                })
            );
            assert_eq!(entry.holders.len(), 1);
            listed.push(entry.key);
        }
        pages += 1;
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => break,
        }
        assert!(pages < 100, "the listing ends");
    }
    listed.sort();
    listed.dedup();
    assert_eq!(listed, expected);
    assert!(pages >= 7, "25 locks in pages of at most 4");

    let semaphores = store
        .list(&ListQuery {
            space: Space::Semaphores,
            prefix: String::new(),
            limit: 100,
            cursor: None,
        })
        .await
        .unwrap();
    assert_eq!(semaphores.entries.len(), 1);
    assert_eq!(semaphores.entries[0].limit, Some(2));
    assert!(matches!(
        store
            .list(&ListQuery {
                space: Space::Locks,
                prefix: String::new(),
                limit: 1,
                cursor: Some("not a cursor".into()),
            })
            .await,
        Err(StoreError::BadCursor)
    ));
}

#[tokio::test]
async fn shared_leases_and_permits_are_put_back_after_a_flush_with_their_tokens() {
    let redis = RedisServer::start().await;
    let (store, _notices) = store(&redis, "p:");
    let lock = key("report");
    let sem = key("workers");
    let r = granted(join(&store, &lock, Pool::Shared, &bid(20_000)).await);
    let p = granted(join(&store, &sem, Pool::Semaphore { limit: 1 }, &bid(20_000)).await);
    assert_eq!(store.ledger_len(), 2);
    redis.flushall().await;
    // Once the put-back is done, the shared lease keeps the exclusive claim out, the permit
    // keeps the semaphore full, and both tokens still work.
    let mut refused = false;
    for _ in 0..100 {
        match store.claim(&lock, &bid(1_000)).await.unwrap() {
            GrantAnswer::OnHold(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            GrantAnswer::Refused => {
                refused = true;
                break;
            }
            other => panic!("the shared lease was not put back: {other:?}"),
        }
    }
    assert!(refused, "the store stayed held");
    assert!(matches!(
        join(&store, &sem, Pool::Semaphore { limit: 1 }, &bid(1_000)).await,
        Join::Busy { .. }
    ));
    assert!(matches!(
        store.release(Space::Locks, &lock, &r.token).await.unwrap(),
        AsHolder::Done(_)
    ));
    let AsHolder::Done(renewed) = store
        .renew(
            Space::Semaphores,
            &sem,
            &p.token,
            Renewal::For(Ttl::from_ms(5_000)),
        )
        .await
        .unwrap()
    else {
        panic!("the permit was put back");
    };
    assert_eq!(renewed.fence, p.fence);
    assert_eq!(
        join(&store, &sem, Pool::Semaphore { limit: 2 }, &bid(1_000)).await,
        Join::LimitMismatch { limit: 1 },
        "the limit was put back with the permit"
    );
    store
        .release(Space::Semaphores, &sem, &p.token)
        .await
        .unwrap();
    let next = granted(join(&store, &sem, Pool::Semaphore { limit: 2 }, &bid(1_000)).await);
    assert!(next.fence > p.fence);
}
