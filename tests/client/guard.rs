//! The test bodies: each takes the store to run the broker on.

use std::time::Duration;

use lockbroker_client::{Claim, Error, LeaseOptions, LeaseState, Loss, Released, Resource};
use tokio::time::{Instant, timeout};

use super::{RENEWED, Setup, Store, eventually};

/// Long enough that nothing ends by itself during a test that does not wait for it.
const LONG: Duration = Duration::from_secs(30);

pub(crate) async fn grants_wait_and_answers_locked(store: Store) {
    let setup = Setup::start(store).await;
    let client = &setup.client;
    let first = setup.hold("orders:1", LONG).await;
    assert!(first.is_held());
    assert_eq!(first.key(), "orders:1");
    let token = first.token().as_str().to_owned();
    assert!(token.len() >= 32, "a real token");
    assert!(
        !format!("{first:?}").contains(&token),
        "no Debug output shows the token"
    );
    setup.assert_held("orders:1", &first).await;
    match client
        .acquire("orders:1", LONG, Duration::from_millis(300))
        .await
    {
        Err(Error::Locked { retry_after_ms, .. }) => assert!(retry_after_ms.is_some()),
        other => panic!("expected locked after the wait, got {other:?}"),
    }

    // A waiter parked at the broker gets the lock when the holder lets go.
    let waiter = tokio::spawn({
        let client = client.clone();
        async move { client.acquire("orders:1", LONG, LONG).await }
    });
    eventually("the waiter is parked at the broker", || async {
        setup.metric("lockbroker_waiters").await >= 1.0
    })
    .await;
    assert!(!waiter.is_finished());
    assert!(matches!(first.release().await, Ok(Released::Now)));
    assert!(!first.is_held());
    let second = waiter.await.unwrap().expect("the waiter is granted");
    assert!(second.fence() > first.fence(), "fences rise");
    assert!(
        matches!(first.release().await, Ok(Released::Before)),
        "a second release sends nothing"
    );
    second.release().await.unwrap();
}

pub(crate) async fn shared_leases_and_permits_hold_together_up_to_the_limit(store: Store) {
    let setup = Setup::start(store).await;
    let client = &setup.client;
    let shared = || LeaseOptions::new(LONG);
    let a = client
        .acquire_with(Claim::Shared("report".into()), shared())
        .await
        .unwrap();
    let b = client
        .acquire_with(Claim::Shared("report".into()), shared())
        .await
        .unwrap();
    assert_ne!(a.fence(), b.fence());
    assert!(
        client.try_acquire("report", LONG).await.unwrap().is_none(),
        "no exclusive lease beside shared ones"
    );
    let status = client.status("report").await.unwrap();
    assert_eq!(status.holders.map(|h| h.len()), Some(2));

    let permit = |limit| Claim::Permit {
        semaphore: "pool".into(),
        limit,
    };
    let one = client.acquire_with(permit(2), shared()).await.unwrap();
    let two = client.acquire_with(permit(2), shared()).await.unwrap();
    assert!(
        client
            .try_acquire_with(permit(2), shared())
            .await
            .unwrap()
            .is_none(),
        "every permit is taken"
    );
    match client.try_acquire_with(permit(3), shared()).await {
        Err(Error::LimitMismatch { limit, .. }) => assert_eq!(limit, Some(2)),
        other => panic!("expected limit_mismatch, got {other:?}"),
    }
    one.release().await.unwrap();
    let three = client
        .try_acquire_with(permit(2), shared())
        .await
        .unwrap()
        .expect("a permit freed");
    assert_eq!(three.resource(), &Resource::semaphore("pool"));
    for lease in [a, b, two, three] {
        lease.release().await.unwrap();
    }
}

pub(crate) async fn the_guard_holds_a_lease_for_three_times_its_ttl(store: Store) {
    let setup = Setup::start(store).await;
    let ttl = Duration::from_millis(900);
    let lease = setup.hold("long-job", ttl).await;
    // Holding for a span of time is what is tested: the lease would have ended three times
    // over without its renewals.
    tokio::time::sleep(ttl * 3 + ttl / 2).await;
    assert!(lease.is_held(), "{:?}", lease.state());
    setup.assert_held("long-job", &lease).await;
    assert!(setup.metric(RENEWED).await >= 3.0);
    lease.release().await.unwrap();
}

pub(crate) async fn a_force_release_is_signalled_as_a_loss_within_the_ttl(store: Store) {
    let setup = Setup::start(store).await;
    let ttl = Duration::from_secs(2);
    let lease = setup.hold("taken-away", ttl).await;
    let mut state = lease.subscribe();
    setup
        .client
        .force_release(&Resource::lock("taken-away"))
        .await
        .unwrap();
    let loss = timeout(ttl, lease.lost())
        .await
        .expect("the loss is signalled within the ttl");
    assert!(
        matches!(loss, Loss::Refused(Error::NotHeld { .. })),
        "{loss}"
    );
    assert!(!lease.is_held());
    state.changed().await.unwrap();
    assert!(matches!(*state.borrow(), LeaseState::Lost(_)));
    // Released after the loss: the broker had nothing left, and that is no error.
    assert!(matches!(lease.release().await, Ok(Released::Gone(_))));
}

pub(crate) async fn a_stopped_broker_is_signalled_as_a_loss_within_the_ttl(store: Store) {
    let mut setup = Setup::start(store).await;
    let ttl = Duration::from_secs(2);
    let lease = setup.hold("orphaned", ttl).await;
    setup.renewed_once().await;
    setup.broker.kill();
    let loss = timeout(ttl, lease.lost())
        .await
        .expect("the loss is signalled within the ttl of the stop");
    assert!(matches!(loss, Loss::Expired { last: Some(_) }), "{loss}");
    assert!(!lease.is_held());
    // The release of a lease whose broker is gone says so, and only once.
    assert!(lease.release().await.unwrap_err().is_transient());
    assert!(matches!(lease.release().await, Ok(Released::Before)));
}

pub(crate) async fn no_renewal_is_sent_after_release_or_drop(store: Store) {
    let setup = Setup::start(store).await;
    let ttl = Duration::from_millis(300);
    let lease = setup.hold("brief", ttl).await;
    setup.renewed_once().await;
    lease.release().await.unwrap();
    let dropped = setup.hold("dropped", ttl).await;
    drop(dropped);
    eventually("the dropped lease is released", || async {
        matches!(
            setup.client.status("dropped").await,
            Err(Error::NotHeld { .. })
        )
    })
    .await;
    let renewed = setup.metric(RENEWED).await;
    // Absence over a span is what is tested: ten renewal intervals of both leases.
    tokio::time::sleep(ttl * 3).await;
    assert_eq!(
        setup.metric(RENEWED).await,
        renewed,
        "renewed after release"
    );
    let renew_errors = r#"lockbroker_renewals_total{space="locks",result="not_held"}"#;
    assert_eq!(setup.metric(renew_errors).await, 0.0);
    assert!(matches!(
        setup.client.status("brief").await,
        Err(Error::NotHeld { .. })
    ));
}

/// Two brokers on one Redis; the lease's broker is killed. The holder learns of the loss
/// before the other broker can grant the key to anyone else: the guard judges the lease's end
/// from when its last confirmed renewal was sent, which is never later than the store's.
pub(crate) async fn a_lease_is_lost_before_another_broker_can_grant_it() {
    let mut setup = Setup::start(Store::Redis).await;
    let (_other, other_client) = setup.another_broker().await;
    let ttl = Duration::from_secs(2);
    let lease = setup.hold("handed-over", ttl).await;
    setup.renewed_once().await;
    setup.broker.kill();
    let (loss, next) = tokio::join!(
        async {
            let loss = timeout(ttl * 2, lease.lost())
                .await
                .expect("the loss is signalled");
            (loss, Instant::now())
        },
        async {
            let next = other_client
                .acquire("handed-over", LONG, ttl * 3)
                .await
                .expect("the other broker grants the key once the lease ends");
            (next, Instant::now())
        },
    );
    assert!(matches!(loss.0, Loss::Expired { .. }), "{}", loss.0);
    assert!(
        loss.1 <= next.1,
        "the loss was signalled {:?} after the key was granted again",
        loss.1 - next.1
    );
    assert!(next.0.fence() > lease.fence());
    next.0.release().await.unwrap();
}

/// A broker on a new Redis settles before its first grant, answering `503` with a
/// `Retry-After`: an acquire waiting meanwhile keeps asking with its request id, and is granted
/// exactly once when the broker starts granting.
pub(crate) async fn an_acquire_answered_503_is_retried_and_grants_once() {
    let setup = Setup::start_unready(Store::Redis).await;
    let granted = r#"lockbroker_acquisitions_total{kind="exclusive",result="granted"}"#;
    let ready = reqwest::get(format!("{}/readyz", setup.broker.address()))
        .await
        .unwrap();
    assert_eq!(ready.status(), 503, "the broker is settling");
    let lease = setup
        .client
        .acquire("through-503", LONG, LONG)
        .await
        .expect("granted once the broker grants");
    assert_eq!(setup.metric(granted).await, 1.0, "one grant, not two");
    setup.assert_held("through-503", &lease).await;
    lease.release().await.unwrap();
}
