//! Watching without polling: one broker's watches (`GET /locks/{key}?watch=F`), parked until
//! their key's holders change.
//!
//! Per watched key this broker keeps one [`Watched`]: the last reading of the key (its holders,
//! or free), published to every watch of the key, and a count of wake-up requests. One keeper
//! per key (the lock service runs it, see `watching.rs`) reads the key when asked, at the
//! earliest end of its holders' leases (an expiry changes the holders without anyone saying so),
//! and once a second on a store that does not announce other brokers' changes:
//! so a change costs one store read per key per broker, however many watches wait on it, and a
//! key that does not change costs nothing. Wake-up requests come from this broker's own changes
//! (the lock service calls [`Watchers::changed`] after a grant, a release, a force release, an
//! offer ended for a waiter that left, and a renewal, which may move the earliest lease end),
//! from the store's [`Notice::Changed`](crate::store::Notice) for other brokers' changes, from a
//! watch that arrives and needs a reading, and from a store loss or missed notices
//! ([`Watchers::all_changed`]).
//!
//! A watch that arrives needs a reading that knows every change this broker made or was told of
//! before it came ([`Watched::first_reading`]): the keeper's latest one if no change was
//! signalled since and it is still current (the store announces the key's changes to this broker
//! and none of its leases has ended since: a reading as fresh as the one the parked watches
//! hold), or the one being read if that read began after the last change signalled; otherwise it
//! asks for a new one. So watches of one key arriving together share one read, and a watch that
//! follows a key (watching again from each answer) costs no read per answer. A key's entry and
//! its keeper outlive its last watch by [`LINGER`], still counting changes, so that the next
//! watch (a crowd arriving over a moment, each answered at once; a follower's next watch) can
//! take the reading it has.
//!
//! Watches count against `max_waiters` together with the waiting acquires.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::{HoldersView, LockError};
use crate::domain::{LockKey, Place, Space};

/// How long a key's entry and keeper stay after its last watch left, for the next watch to take
/// its reading.
pub(crate) const LINGER: Duration = Duration::from_secs(1);

/// One reading of a watched key, shared by every watch of it.
#[derive(Clone)]
pub(crate) struct Reading {
    /// The wake-up requests made before the read started: a reading answers every request up to
    /// this one. 0: no reading yet.
    pub generation: u64,
    /// When the read answered (this host's clock): the view's `now_ms` plus the time since is
    /// the store's clock now.
    pub at: Instant,
    /// The holders (`None`: free), or why the store did not say.
    pub view: Arc<Result<Option<HoldersView>, LockError>>,
    /// Until when the reading stays the key's holders unless a change is signalled (a wake-up
    /// request after `generation`): the store announces every change of the key to this broker
    /// until then, and none of its leases ends sooner. `None`: it may be out of date at once (the
    /// read failed, or the store does not announce the key's changes).
    pub current_until: Option<Instant>,
}

impl Reading {
    /// Whether a watch that comes now may take this reading as its first (see
    /// [`Watched::first_reading`]), as far as its own age goes.
    fn is_current(&self) -> bool {
        self.view.is_ok()
            && self
                .current_until
                .is_some_and(|until| Instant::now() < until)
    }
}

/// What a watch sees of its key's holders: their fences, in order (empty: free). A change of
/// holders changes it; a renewal does not (it moves an expiry only).
pub(crate) fn identity(view: &Option<HoldersView>) -> Vec<u64> {
    let mut fences: Vec<u64> = view
        .iter()
        .flat_map(|v| v.holders.iter().map(|l| l.fence))
        .collect();
    fences.sort_unstable();
    fences
}

/// The fence a watch compares with the one its caller last saw: the highest of the holders'
/// (the one `GET` shows), 0 when free.
pub(crate) fn shown_fence(view: &Option<HoldersView>) -> u64 {
    identity(view).last().copied().unwrap_or(0)
}

/// A watched key on this broker.
pub(crate) struct Watched {
    /// Wake-up requests so far; the keeper reads again while this is past its last reading's.
    wanted: AtomicU64,
    /// Wakes the keeper; `notify_one` keeps a permit when the keeper is busy reading, so a
    /// request made meanwhile is not lost.
    wake: Notify,
    /// The generation of the read under way, or of the last one.
    started: AtomicU64,
    /// Set while the key has no watch (changed under the watchers' lock): the keeper reads
    /// nothing, and stops after [`LINGER`] unless a watch comes.
    idle: AtomicBool,
    /// Set when the store may have lost the key's watched mark (a store loss, missed notices):
    /// the keeper marks it again before its next read, or its readings would count on
    /// announcements that no longer come.
    mark_again: AtomicBool,
    readings: watch::Sender<Reading>,
}

impl Watched {
    fn new() -> Self {
        let (readings, _) = watch::channel(Reading {
            generation: 0,
            at: Instant::now(),
            view: Arc::new(Ok(None)),
            current_until: None,
        });
        Self {
            wanted: AtomicU64::new(0),
            wake: Notify::new(),
            started: AtomicU64::new(0),
            idle: AtomicBool::new(false),
            mark_again: AtomicBool::new(false),
            readings,
        }
    }

    /// Asks the keeper for a reading made from now on; the generation that reading will carry
    /// (at least).
    pub(crate) fn ask(&self) -> u64 {
        let generation = self.wanted.fetch_add(1, Ordering::SeqCst) + 1;
        self.wake.notify_one();
        generation
    }

    /// For the keeper: a new generation for a read it makes by itself (a lease ended), so that
    /// the watches that come meanwhile share it.
    pub(crate) fn next_generation(&self) -> u64 {
        self.wanted.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// For the keeper: whether the key must be marked watched again (see `mark_again`); clears
    /// the request.
    pub(crate) fn take_mark_again(&self) -> bool {
        self.mark_again.swap(false, Ordering::SeqCst)
    }

    /// For the keeper: the read of `generation` begins.
    pub(crate) fn reading(&self, generation: u64) {
        self.started.store(generation, Ordering::SeqCst);
    }

    /// The generation of the first reading a watch that comes now can answer from: one that
    /// knows every change signalled so far. The latest, if it is still current; the one being
    /// read, if that read began after the last change signalled; otherwise a new one, asked for.
    pub(crate) fn first_reading(&self) -> u64 {
        let wanted = self.wanted();
        if wanted > 0 && self.started.load(Ordering::SeqCst) == wanted {
            let latest = self.readings.borrow();
            if latest.generation < wanted || latest.is_current() {
                return wanted;
            }
        }
        self.ask()
    }

    /// The wake-up requests so far.
    pub(crate) fn wanted(&self) -> u64 {
        self.wanted.load(Ordering::SeqCst)
    }

    /// Completes when the keeper is asked for something, or the key's last watch left, or a
    /// watch came to an idle key.
    pub(crate) async fn woken(&self) {
        self.wake.notified().await;
    }

    /// Whether the key has no watch now (see [`LINGER`]).
    pub(crate) fn is_idle(&self) -> bool {
        self.idle.load(Ordering::SeqCst)
    }

    /// Hands a reading to every watch of the key.
    pub(crate) fn publish(&self, reading: Reading) {
        self.readings.send_replace(reading);
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Reading> {
        self.readings.subscribe()
    }
}

/// One key's entry: its watches here, and what they share.
struct Entry {
    watches: usize,
    watched: Arc<Watched>,
}

/// The broker's watches, by key.
pub(crate) struct Watchers {
    /// A std Mutex: nothing awaits while holding it; each critical section is a hash lookup.
    keys: Mutex<HashMap<Place, Entry>>,
    /// Watches parked now; shared with the waiters, whose limit they count against.
    count: Arc<AtomicUsize>,
}

impl Watchers {
    /// `count` is the waiters' count of watches (see `super::waiters::Waiters::watching`).
    pub(crate) fn new(count: Arc<AtomicUsize>) -> Arc<Self> {
        Arc::new(Self {
            keys: Mutex::default(),
            count,
        })
    }

    fn keys(&self) -> MutexGuard<'_, HashMap<Place, Entry>> {
        // Every mutation completes before a panic could happen, so a poisoned lock is consistent.
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Watches parked now.
    pub(crate) fn len(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// Keys watched now.
    #[cfg(test)]
    pub(crate) fn keys_watched(&self) -> usize {
        self.keys().len()
    }

    /// Parks a watch on `place`, unless `busy` (the waiters and watches parked already) reaches
    /// `limit`. The flag is true when the key had no entry here (no watch within [`LINGER`]):
    /// the caller starts its keeper.
    pub(crate) fn enter(
        self: &Arc<Self>,
        place: &Place,
        busy: usize,
        limit: usize,
    ) -> Option<(WatchTicket, bool)> {
        let mut keys = self.keys();
        if busy >= limit {
            return None;
        }
        self.count.fetch_add(1, Ordering::SeqCst);
        let mut fresh = false;
        let entry = keys.entry(place.clone()).or_insert_with(|| {
            fresh = true;
            Entry {
                watches: 0,
                watched: Arc::new(Watched::new()),
            }
        });
        entry.watches += 1;
        if entry.watches == 1 && !fresh {
            // A lingering keeper: it serves watches again.
            entry.watched.idle.store(false, Ordering::SeqCst);
            entry.watched.wake.notify_one();
        }
        let ticket = WatchTicket {
            watchers: self.clone(),
            place: place.clone(),
            watched: entry.watched.clone(),
        };
        Some((ticket, fresh))
    }

    /// The holders of `place` may have changed: its keeper (if it is watched here) reads it again.
    pub(crate) fn changed(&self, space: Space, key: &LockKey) {
        if let Some(entry) = self.keys().get(&(space, key.clone())) {
            entry.watched.ask();
        }
    }

    /// Any key may have changed (a store loss, a put-back, missed notices): every keeper reads
    /// its key again.
    pub(crate) fn all_changed(&self) {
        for entry in self.keys().values() {
            entry.watched.mark_again.store(true, Ordering::SeqCst);
            entry.watched.ask();
        }
    }

    /// For a keeper that lingered [`LINGER`] without a watch: removes its key's entry, so that
    /// the keeper may stop (`true`), unless a watch came meanwhile (`false`: it goes on). Under
    /// the lock: a watch that comes after finds no entry and starts a new keeper.
    pub(crate) fn retire(&self, place: &Place, watched: &Arc<Watched>) -> bool {
        let mut keys = self.keys();
        match keys.get(place) {
            Some(entry) if Arc::ptr_eq(&entry.watched, watched) => {
                if entry.watches > 0 {
                    return false;
                }
                keys.remove(place);
                true
            }
            // Not this keeper's entry (it cannot be): nothing of it to remove.
            _ => true,
        }
    }
}

/// A parked watch; leaving (drop) idles the key's keeper when it was the last (see [`LINGER`]).
pub(crate) struct WatchTicket {
    watchers: Arc<Watchers>,
    place: Place,
    watched: Arc<Watched>,
}

impl WatchTicket {
    pub(crate) fn watched(&self) -> &Arc<Watched> {
        &self.watched
    }
}

impl Drop for WatchTicket {
    fn drop(&mut self) {
        let mut keys = self.watchers.keys();
        self.watchers.count.fetch_sub(1, Ordering::SeqCst);
        let Some(entry) = keys.get_mut(&self.place) else {
            return;
        };
        entry.watches -= 1;
        if entry.watches == 0 {
            // Under the lock: a watch that comes now finds the entry, and wakes the keeper.
            self.watched.idle.store(true, Ordering::SeqCst);
            self.watched.wake.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(k: &str) -> Place {
        (Space::Locks, LockKey::parse(k).unwrap())
    }

    #[test]
    fn watches_of_one_key_share_its_entry_and_the_last_to_leave_idles_it_until_retired() {
        let watchers = Watchers::new(Arc::default());
        let (a, fresh_a) = watchers.enter(&place("k"), 0, 10).unwrap();
        let (b, fresh_b) = watchers.enter(&place("k"), 1, 10).unwrap();
        assert!(fresh_a && !fresh_b, "only the first watch starts a keeper");
        assert!(Arc::ptr_eq(a.watched(), b.watched()));
        assert_eq!(watchers.len(), 2);
        let watched = a.watched().clone();
        drop(a);
        assert!(!watched.is_idle());
        drop(b);
        assert!(watched.is_idle(), "the keeper idles with the last watch");
        assert_eq!((watchers.len(), watchers.keys_watched()), (0, 1));

        // A watch within the linger takes the same keeper back.
        let (c, fresh_c) = watchers.enter(&place("k"), 0, 10).unwrap();
        assert!(!fresh_c && Arc::ptr_eq(c.watched(), &watched));
        assert!(!watched.is_idle());
        assert!(
            !watchers.retire(&place("k"), &watched),
            "a keeper with a watch goes on"
        );
        drop(c);
        assert!(watchers.retire(&place("k"), &watched));
        assert_eq!(watchers.keys_watched(), 0);
        let (_d, fresh_d) = watchers.enter(&place("k"), 0, 10).unwrap();
        assert!(fresh_d, "a watch after that starts a new keeper");
    }

    /// A reading of `generation`, current for `for_ms` (`None`: not current at all).
    fn publish(watched: &Watched, generation: u64, for_ms: Option<u64>) {
        watched.publish(Reading {
            generation,
            at: Instant::now(),
            view: Arc::new(Ok(None)),
            current_until: for_ms.map(|ms| Instant::now() + Duration::from_millis(ms)),
        });
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_takes_the_reading_under_way_or_a_current_one_and_asks_otherwise() {
        let watchers = Watchers::new(Arc::default());
        let (a, _) = watchers.enter(&place("k"), 0, 10).unwrap();
        let watched = a.watched();
        assert_eq!(watched.first_reading(), 1, "no reading yet: it asks");
        assert_eq!(watched.first_reading(), 2, "nor a read under way");
        watched.reading(2);
        assert_eq!(watched.first_reading(), 2, "it shares the read under way");
        publish(watched, 2, Some(1000));
        assert_eq!(watched.first_reading(), 2, "it takes the current reading");
        tokio::time::advance(Duration::from_millis(1000)).await;
        assert_eq!(
            watched.first_reading(),
            3,
            "past its lease end or mark: it asks"
        );
        watched.reading(3);
        publish(watched, 3, Some(1000));
        watchers.changed(Space::Locks, &LockKey::parse("k").unwrap());
        assert_eq!(watched.first_reading(), 5, "a change since: it asks");
        watched.reading(5);
        publish(watched, 5, None);
        assert_eq!(
            watched.first_reading(),
            6,
            "a reading not kept current: it asks"
        );
    }

    #[test]
    fn a_change_asks_only_its_keys_keeper_and_all_changed_asks_every_keeper() {
        let watchers = Watchers::new(Arc::default());
        let (a, _) = watchers.enter(&place("a"), 0, 10).unwrap();
        let (b, _) = watchers.enter(&place("b"), 1, 10).unwrap();
        watchers.changed(Space::Locks, &LockKey::parse("a").unwrap());
        watchers.changed(Space::Semaphores, &LockKey::parse("b").unwrap());
        assert_eq!((a.watched().wanted(), b.watched().wanted()), (1, 0));
        assert!(!a.watched().take_mark_again());
        watchers.all_changed();
        assert_eq!((a.watched().wanted(), b.watched().wanted()), (2, 1));
        assert!(a.watched().take_mark_again() && b.watched().take_mark_again());
        assert!(!a.watched().take_mark_again(), "asked once");
    }

    #[test]
    fn the_limit_counts_what_the_caller_says_is_parked_and_frees_on_leave() {
        let count = Arc::new(AtomicUsize::new(0));
        let watchers = Watchers::new(count.clone());
        assert!(watchers.enter(&place("k"), 2, 2).is_none());
        let (t, _) = watchers.enter(&place("k"), 1, 2).unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 1, "the shared count sees it");
        drop(t);
        assert_eq!(count.load(Ordering::SeqCst), 0);
    }
}
