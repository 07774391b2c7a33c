//! Several keys at once: every key or none (the busy ones named), a fence per key, two callers
//! asking in opposite orders both served, the loss of one key the loss of the lease (the rest
//! released at once), one release for all (and a drop), under a session, and an acquire
//! retried across `503`s with one request id.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lockbroker_client::{Client, Error, Lease, LeaseState, Loss, Released, Resource};
use tokio::time::timeout;

use super::{RENEWED, Setup, Store, eventually};

/// Long enough that nothing ends by itself during a test that does not wait for it.
const LONG: Duration = Duration::from_secs(30);

/// Checks that nobody holds any of `keys`.
async fn assert_free(client: &Client, keys: &[&str]) {
    for key in keys {
        match client.status(key).await {
            Err(Error::NotHeld { .. }) => {}
            other => panic!("{key} should be free, got {other:?}"),
        }
    }
}

/// Checks that `lease` holds each of `keys` with the fence the broker shows for it, and that
/// the first key stands for the lease.
async fn assert_holds_all(setup: &Setup, lease: &Lease, keys: &[&str]) {
    let held: Vec<&str> = lease.fences().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(held, keys, "every key, in the order asked");
    assert_eq!(lease.key(), keys[0]);
    assert_eq!(Some(lease.fence()), lease.fence_of(keys[0]));
    for key in keys {
        let status = setup.client.status(key).await.expect("held");
        assert_eq!(Some(status.fence), lease.fence_of(key), "{key}");
    }
    assert_eq!(lease.fence_of("not-asked"), None);
}

pub(crate) async fn every_key_or_none_with_the_busy_keys_named_and_a_fence_per_key(store: Store) {
    let setup = Setup::start(store).await;
    let keys = ["m:a", "m:b", "m:c"];
    let busy = setup.hold("m:b", LONG).await;
    match setup.client.acquire_all(&keys, LONG, Duration::ZERO).await {
        Err(e @ Error::Locked { .. }) => {
            let Error::Locked { held, .. } = &e else {
                unreachable!()
            };
            assert_eq!(held, &["m:b"], "{e}");
            assert!(e.to_string().contains("m:b"), "{e}");
        }
        other => panic!("m:b is busy, yet: {other:?}"),
    }
    assert_free(&setup.client, &["m:a", "m:c"]).await;

    // With a wait: granted once the busy key is let go, with a fence per key.
    let waiting = tokio::spawn({
        let client = setup.client.clone();
        async move { client.acquire_all(&keys, LONG, LONG).await }
    });
    let old_fence = busy.fence();
    busy.release().await.unwrap();
    let lease = waiting.await.unwrap().expect("granted once m:b is free");
    assert_holds_all(&setup, &lease, &keys).await;
    assert!(
        lease.fence_of("m:b").unwrap() > old_fence,
        "m:b's fence rises"
    );
    // A fence per key, each in its own key's sequence (keys granted in one step may share the
    // value: the store's clock then).
    let keyed: Vec<&str> = lease.fences().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keyed, keys, "{:?}", lease.fences());
    lease.release().await.unwrap();
}

pub(crate) async fn one_release_and_a_drop_let_every_key_go(store: Store) {
    let setup = Setup::start(store).await;
    let keys = ["r:a", "r:b", "r:c"];
    let lease = setup
        .client
        .acquire_all(&keys, LONG, Duration::ZERO)
        .await
        .unwrap();
    assert_holds_all(&setup, &lease, &keys).await;
    assert!(matches!(lease.release().await, Ok(Released::Now)));
    assert!(matches!(*lease.subscribe().borrow(), LeaseState::Released));
    assert_free(&setup.client, &keys).await;
    assert!(matches!(lease.release().await, Ok(Released::Before)));

    // A release of keys that were taken away is no error.
    let lease = setup
        .client
        .acquire_all(&keys, LONG, Duration::ZERO)
        .await
        .unwrap();
    for key in keys {
        setup
            .client
            .force_release(&Resource::lock(key))
            .await
            .unwrap();
    }
    assert!(matches!(lease.release().await, Ok(Released::Gone(_))));

    // Dropped: released in the background, every key.
    let lease = setup
        .client
        .acquire_all(&keys, LONG, Duration::ZERO)
        .await
        .unwrap();
    drop(lease);
    eventually("the dropped lease's keys are free", || async {
        let again = setup.client.acquire_all(&keys, LONG, Duration::ZERO).await;
        again.is_ok()
    })
    .await;
}

pub(crate) async fn opposite_orders_from_two_tasks_all_complete(store: Store) {
    let setup = Setup::start(store).await;
    let inside = Arc::new(AtomicBool::new(false));
    let rounds = 25;
    let task = |keys: [&'static str; 2]| {
        let client = setup.client.clone();
        let inside = inside.clone();
        tokio::spawn(async move {
            for _ in 0..rounds {
                let lease = client
                    .acquire_all(&keys, LONG, Duration::from_secs(10))
                    .await
                    .expect("served within the wait");
                assert!(
                    !inside.swap(true, Ordering::SeqCst),
                    "two holders of {keys:?}"
                );
                tokio::task::yield_now().await;
                inside.store(false, Ordering::SeqCst);
                lease.release().await.unwrap();
            }
        })
    };
    let one = task(["o:x", "o:y"]);
    let other = task(["o:y", "o:x"]);
    let both = async { (one.await, other.await) };
    let (one, other) = timeout(Duration::from_secs(60), both)
        .await
        .expect("no deadlock: both complete");
    one.unwrap();
    other.unwrap();
    assert_free(&setup.client, &["o:x", "o:y"]).await;
}

pub(crate) async fn a_lost_key_loses_the_lease_and_the_rest_are_released(store: Store) {
    let setup = Setup::start(store).await;
    let ttl = Duration::from_millis(1500);
    let keys = ["l:a", "l:b", "l:c"];
    let lease = setup
        .client
        .acquire_all(&keys, ttl, Duration::ZERO)
        .await
        .unwrap();
    setup
        .client
        .force_release(&Resource::lock("l:b"))
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
    // Released before the loss was told, not at the ttl's end.
    assert_free(&setup.client, &keys).await;
    assert!(matches!(lease.release().await, Ok(Released::Gone(_))));
}

pub(crate) async fn several_keys_under_a_session_live_on_its_keep_alives(store: Store) {
    let setup = Setup::start(store).await;
    let ttl = Duration::from_millis(900);
    let session = setup
        .client
        .open_session(ttl, Duration::ZERO)
        .await
        .unwrap();
    let keys = ["s:a", "s:b"];
    let lease = session.acquire_all(&keys, Duration::ZERO).await.unwrap();
    assert_eq!(lease.ttl(), ttl, "as long as the session");
    match session.acquire_all(&["s:c", "s:b"], Duration::ZERO).await {
        Err(Error::Locked { held, .. }) => assert_eq!(held, ["s:b"]),
        other => panic!("not reentrant: s:b is busy, yet {other:?}"),
    }
    // Holding for a span of time is what is tested: the keys would have ended three times over
    // without the session's keep-alives, and none is renewed on its own.
    tokio::time::sleep(ttl * 3).await;
    assert!(lease.is_held(), "{:?}", lease.state());
    assert_holds_all(&setup, &lease, &keys).await;
    assert_eq!(
        setup.metric(RENEWED).await,
        0.0,
        "no key renewed on its own"
    );
    assert!(matches!(lease.release().await, Ok(Released::Now)));
    assert_free(&setup.client, &keys).await;
    assert!(session.is_alive());

    // Closing the session lets them go, and the lease says so.
    let lease = session.acquire_all(&keys, Duration::ZERO).await.unwrap();
    session.close().await;
    let mut state = lease.subscribe();
    state
        .wait_for(|s| matches!(s, LeaseState::Released))
        .await
        .unwrap();
    assert_free(&setup.client, &keys).await;
    match session.acquire_all(&keys, Duration::ZERO).await {
        Err(Error::SessionEnded { .. }) => {}
        other => panic!("the session is closed, yet {other:?}"),
    }
}

pub(crate) async fn an_acquire_of_several_keys_answered_503_is_retried_and_grants_once() {
    let setup = Setup::start_unready(Store::Redis).await;
    let ready = reqwest::get(format!("{}/readyz", setup.broker.address()))
        .await
        .unwrap();
    assert_eq!(ready.status(), 503, "the broker is settling");
    let keys = ["t:a", "t:b"];
    // A second grant under another request id would wait on the first, and time out.
    let lease = setup
        .client
        .acquire_all(&keys, LONG, Duration::from_secs(15))
        .await
        .expect("granted once the broker grants");
    assert_holds_all(&setup, &lease, &keys).await;
    lease.release().await.unwrap();
    assert_free(&setup.client, &keys).await;
}
