//! Sessions: leases under one keep-alive, freed together by a close or a drop, and lost
//! together when the keep-alive fails; an open retried across `503`s with one request id.

use std::time::Duration;

use lockbroker_client::{Claim, Error, LeaseState, Loss, Released, Resource};
use tokio::time::timeout;

use super::{RENEWED, Setup, Store, eventually};

/// Long enough that nothing ends by itself during a test that does not wait for it.
const LONG: Duration = Duration::from_secs(30);

/// Keep-alives the broker confirmed.
const KEPT: &str = r#"lockbroker_sessions_total{event="kept"}"#;

/// Permits renewed on their own.
const PERMITS_RENEWED: &str = r#"lockbroker_renewals_total{space="semaphores",result="renewed"}"#;

fn permit() -> Claim {
    Claim::Permit {
        semaphore: "s:pool".into(),
        limit: 2,
    }
}

pub(crate) async fn leases_live_past_three_ttls_on_keep_alives_alone(store: Store) {
    let setup = Setup::start(store).await;
    let ttl = Duration::from_millis(900);
    let session = setup
        .client
        .open_session(ttl, Duration::ZERO)
        .await
        .unwrap();
    let id = session.id().as_str().to_owned();
    assert!(id.len() >= 32, "a real session id");
    assert!(
        !format!("{session:?}").contains(&id),
        "no Debug shows the id"
    );
    let lock = session.acquire("s:lock", Duration::ZERO).await.unwrap();
    let shared = session
        .acquire_with(Claim::Shared("s:shared".into()), Duration::ZERO)
        .await
        .unwrap();
    let permit = session.try_acquire_with(permit()).await.unwrap().unwrap();
    assert_eq!(
        lock.ttl(),
        ttl,
        "a session's lease lives as long as the session"
    );

    // Holding for a span of time is what is tested: the leases would have ended three times
    // over without the session's keep-alives, and none of them is renewed on its own.
    tokio::time::sleep(ttl * 3 + ttl / 2).await;
    assert!(session.is_alive(), "{:?}", session.state());
    for lease in [&lock, &shared, &permit] {
        assert!(lease.is_held(), "{lease:?}");
    }
    setup.assert_held("s:lock", &lock).await;
    assert!(
        session.try_acquire("s:lock").await.unwrap().is_none(),
        "not reentrant: the session's own second acquire is refused too"
    );
    let read = setup.client.session(session.id()).await.unwrap();
    let mut fences: Vec<u64> = read.leases.iter().map(|l| l.fence).collect();
    fences.sort_unstable();
    let mut expected = vec![lock.fence(), shared.fence(), permit.fence()];
    expected.sort_unstable();
    assert_eq!(fences, expected, "{read:?}");
    assert!(setup.metric(KEPT).await >= 3.0, "kept by keep-alives");
    assert_eq!(
        setup.metric(RENEWED).await,
        0.0,
        "no lock renewed on its own"
    );
    assert_eq!(setup.metric(PERMITS_RENEWED).await, 0.0, "nor a permit");

    // Releasing one lease leaves the session and the others.
    assert!(matches!(lock.release().await, Ok(Released::Now)));
    assert!(session.is_alive() && shared.is_held() && permit.is_held());
    assert!(matches!(
        setup.client.status("s:lock").await,
        Err(Error::NotHeld { .. })
    ));
    session.close().await;
}

pub(crate) async fn a_closed_or_dropped_session_frees_its_keys_at_once(store: Store) {
    let setup = Setup::start(store).await;
    let client = &setup.client;
    let session = client.open_session(LONG, Duration::ZERO).await.unwrap();
    let lock = session.acquire("c:lock", Duration::ZERO).await.unwrap();
    let permit = session
        .acquire_with(permit(), Duration::ZERO)
        .await
        .unwrap();
    let mut state = lock.subscribe();
    session.close().await;
    // At once: the close has returned, and the keys are free (the session's ttl is 30 s).
    assert!(matches!(
        client.status("c:lock").await,
        Err(Error::NotHeld { .. })
    ));
    assert!(matches!(
        client.semaphore_status("s:pool").await,
        Err(Error::NotHeld { .. })
    ));
    state.changed().await.unwrap();
    assert!(matches!(*state.borrow(), LeaseState::Released));
    assert!(!session.is_alive() && !lock.is_held() && !permit.is_held());
    assert!(
        matches!(lock.release().await, Ok(Released::Before)),
        "released with its session: nothing left to send"
    );
    assert!(matches!(session.try_close().await, Ok(Released::Before)));
    assert!(matches!(
        client.session(session.id()).await,
        Err(Error::SessionEnded { code: "not_held" })
    ));
    assert!(matches!(
        session.acquire("c:other", Duration::ZERO).await,
        Err(Error::SessionEnded { .. })
    ));
    let granted = client.try_acquire("c:lock", LONG).await.unwrap();
    let granted = granted.expect("the key is free for anyone");
    assert!(granted.fence() > lock.fence());
    granted.release().await.unwrap();

    // Dropped: closed in the background, long before the session's ttl.
    let dropped = client.open_session(LONG, Duration::ZERO).await.unwrap();
    let kept = dropped.acquire("c:dropped", Duration::ZERO).await.unwrap();
    drop(dropped);
    eventually("the dropped session's key is free", || async {
        matches!(client.status("c:dropped").await, Err(Error::NotHeld { .. }))
    })
    .await;
    assert!(!kept.is_held());
}

pub(crate) async fn a_session_ended_elsewhere_is_lost_with_its_leases(store: Store) {
    let setup = Setup::start(store).await;
    let ttl = Duration::from_secs(2);
    let session = setup
        .client
        .open_session(ttl, Duration::ZERO)
        .await
        .unwrap();
    let lock = session.acquire("e:lock", Duration::ZERO).await.unwrap();
    let permit = session
        .acquire_with(permit(), Duration::ZERO)
        .await
        .unwrap();
    // Another holder of the id closes it: the next keep-alive answers 404.
    setup.client.close_session(session.id()).await.unwrap();
    let loss = timeout(ttl, session.lost())
        .await
        .expect("the loss is signalled within the ttl");
    assert!(
        matches!(loss, Loss::Refused(Error::SessionEnded { .. })),
        "{loss}"
    );
    for lease in [&lock, &permit] {
        let lost = timeout(Duration::from_secs(1), lease.lost())
            .await
            .expect("each lease is lost with its session");
        assert!(
            matches!(lost, Loss::Refused(Error::SessionEnded { .. })),
            "{lost}"
        );
        assert!(!lease.is_held());
    }
    assert!(!session.is_alive());
    assert!(matches!(session.try_close().await, Ok(Released::Gone(_))));
}

pub(crate) async fn a_session_whose_broker_stopped_is_lost_with_its_leases(store: Store) {
    let mut setup = Setup::start(store).await;
    let ttl = Duration::from_secs(2);
    let session = setup
        .client
        .open_session(ttl, Duration::ZERO)
        .await
        .unwrap();
    let lock = session.acquire("k:lock", Duration::ZERO).await.unwrap();
    eventually("a keep-alive got through", || async {
        setup.metric(KEPT).await >= 1.0
    })
    .await;
    setup.broker.kill();
    let loss = timeout(ttl, session.lost())
        .await
        .expect("the loss is signalled within the ttl of the stop");
    assert!(matches!(loss, Loss::Expired { last: Some(_) }), "{loss}");
    let lost = timeout(Duration::from_secs(1), lock.lost())
        .await
        .expect("the lease is lost with its session");
    assert!(matches!(lost, Loss::Expired { .. }), "{lost}");
    assert!(!lock.is_held() && !session.is_alive());
    // Closing never fails; it says the broker could not be told.
    assert!(session.try_close().await.unwrap_err().is_transient());
    session.close().await;
    assert_eq!(lock.resource(), &Resource::lock("k:lock"));
}

/// A broker on a new Redis settles before its first grant, answering `503` with a
/// `Retry-After` (a session opens meanwhile): an acquire under the session keeps asking with its
/// request id, and is granted exactly once.
pub(crate) async fn an_acquire_under_a_session_answered_503_is_retried_and_grants_once() {
    let setup = Setup::start_unready(Store::Redis).await;
    let granted = r#"lockbroker_acquisitions_total{kind="exclusive",result="granted"}"#;
    let session = setup
        .client
        .open_session(LONG, Duration::ZERO)
        .await
        .unwrap();
    let ready = reqwest::get(format!("{}/readyz", setup.broker.address()))
        .await
        .unwrap();
    assert_eq!(ready.status(), 503, "the broker is settling");
    let lease = session
        .acquire("through-503", LONG)
        .await
        .expect("granted once the broker grants");
    assert_eq!(setup.metric(granted).await, 1.0, "one grant, not two");
    setup.assert_held("through-503", &lease).await;
    session.close().await;
}
