//! Watch, follow and the election helper against real brokers. On Redis the watching side uses
//! a second broker on the same Redis, so a change reaches it through the store's notices.

use std::time::Duration;

use lockbroker_client::{Claim, Client, Leadership, LeaseOptions, LockMode, Resource, Revoked};
use lockbroker_test_support::broker::BrokerProcess;
use tokio::sync::mpsc;
use tokio::time::timeout;

use super::{Setup, Store};

/// Long enough that nothing ends by itself during a test.
const LONG: Duration = Duration::from_secs(30);

/// Bound on waiting for an event that a change causes at once: far below [`LONG`], so an event
/// that came only because a lease ran out fails the test.
const SOON: Duration = Duration::from_secs(5);

/// A client for watching: on Redis, of a second broker (kept alive by the first element).
async fn watching_client(setup: &Setup, store: Store) -> (Option<BrokerProcess>, Client) {
    match store {
        Store::Embedded => (None, setup.client.clone()),
        Store::Redis => {
            let (broker, client) = setup.another_broker().await;
            (Some(broker), client)
        }
    }
}

pub(crate) async fn watch_sees_a_grant_and_a_release_and_times_out_unchanged(store: Store) {
    let setup = Setup::start(store).await;
    let (_other, watcher) = watching_client(&setup, store).await;

    let free = watcher
        .watch("job", 0, Duration::from_millis(200))
        .await
        .unwrap();
    assert!(!free.changed, "a free key watched as free times out");
    assert_eq!((free.status, free.fence), (None, 0));

    // A watch parked on the free key answers the grant.
    let parked = tokio::spawn({
        let watcher = watcher.clone();
        async move { watcher.watch("job", 0, LONG).await }
    });
    let lease = setup
        .client
        .acquire_with(
            Claim::Exclusive("job".into()),
            LeaseOptions::new(LONG).owner("node-a"),
        )
        .await
        .unwrap();
    let granted = timeout(SOON, parked).await.unwrap().unwrap().unwrap();
    assert!(granted.changed);
    assert_eq!(granted.fence, lease.fence());
    let status = granted.status.expect("held");
    assert_eq!(status.owner.as_deref(), Some("node-a"));
    assert_eq!(status.mode, LockMode::Exclusive);

    // Unchanged (a renewal is not a change): the wait runs out with the same view.
    setup
        .client
        .renew(&Resource::lock("job"), lease.token(), Some(LONG))
        .await
        .unwrap();
    let same = watcher
        .watch("job", lease.fence(), Duration::from_millis(300))
        .await
        .unwrap();
    assert!(!same.changed);
    assert_eq!(same.fence, lease.fence());

    // A watch with a stale fence answers at once.
    let stale = watcher.watch("job", 1, LONG).await.unwrap();
    assert!(stale.changed);
    assert_eq!(stale.fence, lease.fence());

    let parked = tokio::spawn({
        let watcher = watcher.clone();
        let fence = lease.fence();
        async move { watcher.watch("job", fence, LONG).await }
    });
    lease.release().await.unwrap();
    let released = timeout(SOON, parked).await.unwrap().unwrap().unwrap();
    assert!(released.changed);
    assert_eq!((released.status, released.fence), (None, 0));

    // Semaphores: the highest permit fence.
    let permit = setup
        .client
        .acquire_with(
            Claim::Permit {
                semaphore: "pool".into(),
                limit: 2,
            },
            LeaseOptions::new(LONG),
        )
        .await
        .unwrap();
    let seen = watcher.watch_semaphore("pool", 0, LONG).await.unwrap();
    assert!(seen.changed);
    assert_eq!(seen.fence, permit.fence());
    assert_eq!(seen.status.expect("held").holders.len(), 1);
    let same = watcher
        .watch_semaphore("pool", permit.fence(), Duration::from_millis(200))
        .await
        .unwrap();
    assert!(!same.changed);
    permit.release().await.unwrap();

    // Bad input is refused with the broker's message.
    let refused = watcher.watch("bad key", 0, LONG).await.unwrap_err();
    assert_eq!(refused.code(), "invalid_request", "{refused}");
}

pub(crate) async fn a_follower_yields_each_change_once_in_order(store: Store) {
    let setup = Setup::start(store).await;
    let (_other, watcher) = watching_client(&setup, store).await;
    let mut follower = watcher.follow("feed").wait(Duration::from_millis(500));
    let owned = |owner: &str| LeaseOptions::new(LONG).owner(owner);
    let take = |owner: &'static str| {
        let client = setup.client.clone();
        async move {
            client
                .acquire_with(Claim::Exclusive("feed".into()), owned(owner))
                .await
                .unwrap()
        }
    };
    // Each change is made after the follower saw the one before, so none merge; the follower
    // waits through several timed-out watches between them (its wait is 500 ms).
    let mut next = async || timeout(SOON * 2, follower.next()).await.unwrap().unwrap();

    let a = take("a").await;
    let seen = next().await;
    assert_eq!(seen.fence, a.fence());
    assert_eq!(seen.status.unwrap().owner.as_deref(), Some("a"));

    a.release().await.unwrap();
    let seen = next().await;
    assert_eq!((seen.status, seen.fence), (None, 0), "the release");

    let b = take("b").await;
    let seen = next().await;
    assert_eq!(seen.fence, b.fence());
    assert!(b.fence() > a.fence());
    assert_eq!(seen.status.unwrap().owner.as_deref(), Some("b"));

    setup
        .client
        .force_release(&Resource::lock("feed"))
        .await
        .unwrap();
    let seen = next().await;
    assert_eq!((seen.status, seen.fence), (None, 0), "the force release");
    assert!(seen.changed);
    drop(b);
}

/// What a [`Leadership`]'s callbacks report, in the order they fired.
#[derive(Debug, PartialEq, Eq)]
enum Event {
    Elected(&'static str, u64),
    Revoked(&'static str, bool),
}

fn candidate(
    client: &Client,
    name: &'static str,
    events: &mpsc::UnboundedSender<Event>,
) -> Leadership {
    candidate_for(client, name, LONG, events)
}

fn candidate_for(
    client: &Client,
    name: &'static str,
    ttl: Duration,
    events: &mpsc::UnboundedSender<Event>,
) -> Leadership {
    let elected = events.clone();
    let revoked = events.clone();
    Leadership::builder(client, "leader", name, ttl)
        .on_elected(move |fence| {
            let _ = elected.send(Event::Elected(name, fence));
        })
        .on_revoked(move |why| {
            let _ = revoked.send(Event::Revoked(name, matches!(why, Revoked::Closed)));
        })
        .start()
}

pub(crate) async fn two_candidates_one_leader_and_a_handover_on_close(store: Store) {
    let setup = Setup::start(store).await;
    let (_other, other_client) = watching_client(&setup, store).await;
    let (events, mut fired) = mpsc::unbounded_channel();
    let mut next = async || timeout(SOON, fired.recv()).await.unwrap().unwrap();

    let a = candidate(&setup.client, "a", &events);
    let b = candidate(&other_client, "b", &events);
    let Event::Elected(first, first_fence) = next().await else {
        panic!("the first event is an election")
    };
    let (leader, follower) = if first == "a" { (a, b) } else { (b, a) };
    assert!(leader.is_leader());
    assert!(!follower.is_leader(), "never two leaders");
    let status = setup.client.status("leader").await.unwrap();
    assert_eq!(
        (status.fence, status.owner.as_deref()),
        (first_fence, Some(first))
    );
    // Both learn who leads from the watch.
    for side in [&leader, &follower] {
        let mut told = side.subscribe_leader();
        timeout(SOON, told.wait_for(|l| l.as_deref() == Some(first)))
            .await
            .expect("the leader is reported")
            .unwrap();
    }

    let mut follower_leads = follower.subscribe();
    leader.close().await.unwrap();
    assert_eq!(
        next().await,
        Event::Revoked(first, true),
        "on_revoked fires on close"
    );
    let Event::Elected(second, second_fence) = next().await else {
        panic!("the follower is elected after the close")
    };
    assert_ne!(second, first);
    assert!(second_fence > first_fence, "a new term");
    timeout(SOON, follower_leads.wait_for(|l| *l))
        .await
        .unwrap()
        .unwrap();
    assert!(follower.is_leader());
    let mut told = follower.subscribe_leader();
    timeout(SOON, told.wait_for(|l| l.as_deref() == Some(second)))
        .await
        .expect("leader() reports the successor")
        .unwrap();

    follower.close().await.unwrap();
    assert_eq!(next().await, Event::Revoked(second, true));
    assert!(
        setup.client.status("leader").await.unwrap_err().is_gone(),
        "closing released the lease"
    );
    assert!(fired.try_recv().is_err(), "nothing else fired");
}

pub(crate) async fn a_lost_lease_is_revoked_before_the_campaign_goes_on(store: Store) {
    let setup = Setup::start(store).await;
    let (events, mut fired) = mpsc::unbounded_channel();
    let mut next = async || timeout(SOON, fired.recv()).await.unwrap().unwrap();
    // A short ttl, so that the first renewal (at a third of it) finds the lease gone.
    let only = candidate_for(&setup.client, "a", Duration::from_millis(1500), &events);
    let Event::Elected("a", first) = next().await else {
        panic!("the only candidate is elected")
    };
    setup
        .client
        .force_release(&Resource::lock("leader"))
        .await
        .unwrap();
    assert_eq!(
        next().await,
        Event::Revoked("a", false),
        "the loss is told before anything else"
    );
    let Event::Elected("a", again) = next().await else {
        panic!("the campaign goes on and wins the free key")
    };
    assert!(again > first, "a new term");
    assert!(only.is_leader());
    only.close().await.unwrap();
    assert_eq!(next().await, Event::Revoked("a", true));
}
