//! The bounds of the exhaustive check (docs/model.md says why these).

use crate::model::{Config, SessionCfg, SeveralCfg};
use crate::store::{Bug, Kind};

/// The configurations `scripts/model-check.sh` checks, each exhaustively.
pub fn all(bug: Option<Bug>) -> Vec<Config> {
    vec![
        locks(bug),
        dead_broker(bug),
        two_keys(bug),
        clock(bug),
        semaphore(bug),
        sessions(bug),
        several(bug),
        batch(bug),
    ]
}

/// Three brokers; one lock key with two exclusive clients and a shared one (the shared one
/// on the second exclusive one's broker, so that a broker has two bids in one queue). A broker may die, the store may be lost once (or the clock step back once), one
/// force release, one slack expiry.
pub fn locks(bug: Option<Bug>) -> Config {
    Config {
        name: "locks",
        brokers: 3,
        clients: vec![
            (0, 0, Kind::Exclusive),
            (1, 0, Kind::Exclusive),
            (1, 0, Kind::Shared),
        ],
        keys: 1,
        attempts: vec![1, 1, 1],
        ttl: 2,
        window: 2,
        settle: 2,
        put_back_hold: 1,
        poll: 3,
        renews: 1,
        deaths: 1,
        losses: 1,
        forces: 0,
        clock_backs: 0,
        slacks: 0,
        session: None,
        several: Vec::new(),
        batch: false,
        bug,
    }
}

/// A broker with two bids in one queue dies: two brokers, the second with two exclusive
/// clients; the first client acquires twice, so that it can wait behind the dead broker's bids.
pub fn dead_broker(bug: Option<Bug>) -> Config {
    Config {
        name: "dead-broker",
        brokers: 2,
        clients: vec![
            (0, 0, Kind::Exclusive),
            (1, 0, Kind::Exclusive),
            (1, 0, Kind::Exclusive),
        ],
        keys: 1,
        attempts: vec![2, 1, 1],
        renews: 0,
        losses: 0,
        ..locks(bug)
    }
}

/// Two brokers, two exclusive clients on one lock key; the clock may step back once (never in
/// a run with a store loss: fences after a loss rely on the clock), one slack expiry, one force
/// release.
pub fn clock(bug: Option<Bug>) -> Config {
    Config {
        name: "clock",
        brokers: 2,
        clients: vec![(0, 0, Kind::Exclusive), (1, 0, Kind::Exclusive)],
        keys: 1,
        attempts: vec![1, 1],
        deaths: 0,
        losses: 0,
        forces: 1,
        clock_backs: 1,
        slacks: 1,
        ..locks(bug)
    }
}

/// Two lock keys on two brokers: two exclusive clients on the first key, one on the second,
/// so that a store loss, a death and the epoch meet several keys.
pub fn two_keys(bug: Option<Bug>) -> Config {
    Config {
        name: "two-keys",
        brokers: 2,
        clients: vec![
            (0, 0, Kind::Exclusive),
            (1, 0, Kind::Exclusive),
            (1, 1, Kind::Exclusive),
        ],
        keys: 2,
        attempts: vec![1, 1, 1],
        renews: 0,
        deaths: 1,
        forces: 1,
        ..locks(bug)
    }
}

/// A semaphore of two permits and three clients on three brokers.
pub fn semaphore(bug: Option<Bug>) -> Config {
    Config {
        name: "semaphore",
        brokers: 3,
        clients: vec![
            (0, 0, Kind::Permit(2)),
            (1, 0, Kind::Permit(2)),
            (2, 0, Kind::Permit(2)),
        ],
        ..locks(bug)
    }
}

/// A client under a session and an exclusive client on one key (ticks: session TTL 2, lock
/// delay 1, lease TTL 2, offer window 2). The session's own calls go through broker 1 (the
/// exclusive client's), its acquires through broker 0. The session is opened, kept alive at
/// most twice (each keep-alive's KEEP may fail), closed or abandoned (its client stops: ticks
/// run its session out); two acquires under it, each waiting or not. A broker may die (broker 0
/// mid-acquire, or broker 1: the session is abandoned), the store may be lost once.
pub fn sessions(bug: Option<Bug>) -> Config {
    Config {
        name: "sessions",
        brokers: 2,
        clients: vec![(1, 0, Kind::Exclusive)],
        keys: 1,
        attempts: vec![1],
        renews: 0,
        session: Some(SessionCfg {
            broker: 1,
            acquires_on: 0,
            key: 0,
            ttl: 2,
            delay: 1,
            acquires: 2,
            keeps: 2,
        }),
        ..locks(bug)
    }
}

/// Several keys at once: two brokers, two keys; a several-keys client on broker 0 naming the
/// keys (0, 1) and one on broker 1 naming them (1, 0) — each takes them sorted — and a
/// single-key exclusive client on key 1 (broker 1). Each acquires once; each several-keys
/// client may give up mid-way (its wait ran out, its client went away). A broker may die
/// (mid-way through a several-keys acquire, leaving its keys to their TTL); one force release.
/// No store loss, clock step or slack here: `two-keys` and `locks` meet those with the same
/// scripts.
pub fn several(bug: Option<Bug>) -> Config {
    Config {
        name: "several",
        brokers: 2,
        clients: vec![(1, 1, Kind::Exclusive)],
        keys: 2,
        attempts: vec![1],
        renews: 0,
        losses: 0,
        forces: 1,
        several: vec![
            SeveralCfg {
                broker: 0,
                keys: [0, 1],
            },
            SeveralCfg {
                broker: 1,
                keys: [1, 0],
            },
        ],
        ..locks(bug)
    }
}

/// Group commit: two brokers, two keys; broker 0's two clients on key 0 (a release and a claim
/// of one key, or two claims, in one batch) and one on key 1 (a batch over both keys), broker
/// 1's client on key 0. Every claim and release may go alone or in its broker's batch; one store
/// loss (a batch of a broker that has not caught up). No death, force, clock step or slack: the
/// other configurations meet those with the same scripts.
pub fn batch(bug: Option<Bug>) -> Config {
    Config {
        name: "batch",
        brokers: 2,
        clients: vec![
            (0, 0, Kind::Exclusive),
            (0, 0, Kind::Exclusive),
            (0, 1, Kind::Exclusive),
        ],
        keys: 2,
        attempts: vec![1, 1, 1],
        renews: 0,
        deaths: 1,
        batch: true,
        ..locks(bug)
    }
}
