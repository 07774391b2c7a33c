//! Where the broker's data is in Redis: the keys of one client key in one space, the epoch
//! markers, and on a cluster the slot a key's scripts run on (the layout itself is described in
//! `README.md`, beside this file).

use std::borrow::Cow;

use super::slots::{slot_of, tag_for};
use lockbroker_core::domain::{LockKey, Space};

/// A semaphore's release notices carry its key after this (a lock key never has it).
pub(super) const SEMAPHORE_NOTICE: &str = "#";

/// A lock key's space in the notices on a broker's own channel.
pub(super) const LOCK_SPACE: &str = "L";

/// A semaphore's space in those notices.
pub(super) const SEMAPHORE_SPACE: &str = "S";

/// Where every Redis key of the broker is: the key layout (`README.md`), apart from the store
/// layout, the version of what brokers keep there (`STORE_LAYOUT`).
pub(super) struct KeyLayout {
    /// Prepended to every Redis key the broker writes.
    pub prefix: String,
    /// `<prefix>epoch`: the store's epoch marker (see `epoch.rs`); on a cluster, one per slot.
    pub marker: String,
    /// On a Redis Cluster: per-master epochs, per-slot markers (see `epoch.rs`).
    pub cluster: bool,
}

/// The Redis keys of one client key in one space, all with the client key as their hash tag.
pub(super) struct RedisKeys {
    /// The exclusive lease (for a semaphore: its pool, where no such lease is).
    pub lock: String,
    pub fence: String,
    pub pool: String,
    pub ends: String,
    /// The key's queue: token → sequence, in arrival order.
    pub queue: String,
    /// The queued bids: token → `broker|deadline_ms|kind|ttl|request_id|owner`, and `#seq`.
    pub bids: String,
    /// Present while a broker has watches on the key: the scripts then announce its changes on
    /// `<prefix>b:changes` (see `lib/queue.lua`'s `changed`).
    pub watched: String,
    /// What release notices on the shared channel carry for the key (as older brokers read them).
    pub notice: String,
    /// The client key, as the notices on a broker's own channel carry it.
    pub key: String,
    /// The space's letter in those notices.
    pub space: &'static str,
}

/// A key's site in Redis: what a script on one key needs to know of where it runs (the key's
/// Redis keys, its slot on a cluster, and the epoch marker on that slot).
pub(super) struct Site<'a> {
    pub keys: RedisKeys,
    pub slot: Option<u16>,
    pub marker: Cow<'a, str>,
}

impl KeyLayout {
    /// `key`'s exclusive lease and fence counter in the lock space.
    pub(super) fn keys(&self, key: &LockKey) -> [String; 2] {
        let prefix = &self.prefix;
        [
            format!("{prefix}{{{key}}}:lock"),
            format!("{prefix}{{{key}}}:fence"),
        ]
    }

    /// The Redis keys of `key` in `space`.
    ///
    /// Each name is its prefix and suffix copied into a string of its size: two calls per lock
    /// cycle build these names, and `format!` took about a tenth of the broker's instructions
    /// per cycle.
    pub(super) fn names(&self, space: Space, key: &LockKey) -> RedisKeys {
        let prefix = self.prefix.as_str();
        let mut base = String::with_capacity(prefix.len() + key.as_str().len() + 2);
        base.push_str(prefix);
        base.push('{');
        base.push_str(key.as_str());
        base.push('}');
        let name = |suffix: &str| {
            let mut name = String::with_capacity(base.len() + suffix.len());
            name.push_str(&base);
            name.push_str(suffix);
            name
        };
        match space {
            Space::Locks => RedisKeys {
                lock: name(":lock"),
                fence: name(":fence"),
                pool: name(":shared"),
                ends: name(":shared:ends"),
                queue: name(":queue"),
                bids: name(":bids"),
                watched: name(":watched"),
                notice: key.as_str().into(),
                key: key.as_str().into(),
                space: LOCK_SPACE,
            },
            Space::Semaphores => RedisKeys {
                // A semaphore has no exclusive lease: the scripts find none in its pool.
                lock: name(":sem"),
                fence: name(":sem:fence"),
                pool: name(":sem"),
                ends: name(":sem:ends"),
                queue: name(":sem:queue"),
                bids: name(":sem:bids"),
                watched: name(":sem:watched"),
                notice: [SEMAPHORE_NOTICE, key.as_str()].concat(),
                key: key.as_str().into(),
                space: SEMAPHORE_SPACE,
            },
        }
    }

    /// Where a script on `key` in `space` runs.
    pub(super) fn site(&self, space: Space, key: &LockKey) -> Site<'_> {
        Site {
            keys: self.names(space, key),
            slot: self.slot(key),
            marker: self.marker_for(key),
        }
    }

    /// On a cluster, the slot of `key`'s Redis keys.
    pub(super) fn slot(&self, key: &LockKey) -> Option<u16> {
        self.cluster
            .then(|| slot_of(format!("{}{{{}}}", self.prefix, key).as_bytes()))
    }

    /// The epoch marker a script on `key` reads: the store's, or on a cluster its slot's.
    pub(super) fn marker_for(&self, key: &LockKey) -> Cow<'_, str> {
        match self.slot(key) {
            Some(slot) => Cow::Owned(self.marker_of(slot)),
            None => Cow::Borrowed(&self.marker),
        }
    }

    /// The epoch marker of `slot` (on one server, the store's one marker).
    pub(super) fn marker_of(&self, slot: u16) -> String {
        if self.cluster {
            format!("{}{{{}}}", self.marker, tag_for(slot))
        } else {
            self.marker.clone()
        }
    }
}
