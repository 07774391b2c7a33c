//! Waiting without polling: one broker's acquires that wait in their keys' queues in the store.
//!
//! The queue that orders waiters is in the store, one per key and space, shared by every broker
//! (see [`Bid::wait_ms`](crate::store::Bid)): the store call that frees a key offers it to the
//! queue's head and tells that bid's broker ([`Notice::Offered`]). This module is the broker's
//! side of it: it parks each waiting acquire until its offer comes, finds it by token when it
//! does, and tells the store about an offer whose waiter has gone so the key passes on at once.
//!
//! Per key, the waiters of this broker are kept in arrival order; only the first of them keeps a
//! timer (the blocking lease's end, an offer to another broker that may lapse, a slow fallback
//! poll in case a notice is lost), so a key costs this broker at most one store call per timer,
//! not one per waiter. The others sleep until their offer, a `Requeue`, or their deadline.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use crate::domain::{LockKey, Place, Space, Token};
use crate::metrics::{Metrics, PassedOn};
use crate::store::Notice;

/// One waiting acquire.
struct Waiter {
    /// `notify_one` keeps a permit when the waiter is not parked at that instant, so a notice
    /// that lands during one of its store calls is not lost.
    wake: Notify,
    /// The token its bid waits in the store's queue with (a new one after a failed store call).
    token: Mutex<Token>,
    /// Set by a notice that calls for a store call: the key was offered to this waiter, or it
    /// must join the store's queue again (its entry was dropped, or notices were missed).
    ask: AtomicBool,
    /// Set by a `Look` notice: the first waiter asks the store again at this instant if nothing
    /// else came, when an offer to another broker may lapse.
    look_at: Mutex<Option<Instant>>,
}

#[derive(Default)]
struct Queues {
    by_key: HashMap<Place, VecDeque<Arc<Waiter>>>,
    count: usize,
}

/// What the broker does with an offer that found no waiter (it left): end it, so the key passes
/// on (the lock service calls [`Store::leave`](crate::store::Store::leave)).
pub(crate) type OnGone = Box<dyn Fn(Space, LockKey, Token) + Send + Sync>;

/// The broker's waiting acquires, by key.
pub(crate) struct Waiters {
    /// A std Mutex: nothing awaits while holding it, and each critical section is a hash lookup
    /// and a queue push, scan or removal.
    queues: Mutex<Queues>,
    /// Most waiters at once; bounds the memory waiting can take.
    limit: usize,
    /// Watches parked on this broker (`super::watchers`), which count against `limit` too.
    watching: Arc<AtomicUsize>,
}

impl Waiters {
    pub(crate) fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            queues: Mutex::default(),
            limit,
            watching: Arc::default(),
        })
    }

    fn queues(&self) -> MutexGuard<'_, Queues> {
        // Every mutation completes before a panic could happen, so a poisoned lock is consistent.
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands the store's notices to the waiters, until the service is gone. Dropping the receiver
    /// then closes the channel, which ends the store's background work too. An offer whose
    /// waiter is not here goes to `on_gone`.
    pub(crate) async fn hand_notices(
        waiters: Weak<Self>,
        mut notices: mpsc::Receiver<Notice>,
        on_gone: OnGone,
        metrics: Arc<Metrics>,
    ) {
        loop {
            let notice = tokio::select! {
                notice = notices.recv() => notice,
                // An idle broker that was dropped gets no notice to find that out with.
                () = tokio::time::sleep(Duration::from_secs(1)) => {
                    if waiters.strong_count() == 0 {
                        return;
                    }
                    continue;
                }
            };
            let (Some(notice), Some(waiters)) = (notice, waiters.upgrade()) else {
                return;
            };
            match notice {
                Notice::Offered(space, key, token) => {
                    if !waiters.offered(space, &key, &token) {
                        on_gone(space, key, token);
                    }
                }
                Notice::Look(space, key, ms) => {
                    waiters.look(space, &key, Duration::from_millis(ms));
                }
                Notice::Requeue(space, key) => {
                    metrics.offer_passed_on(PassedOn::Lapsed);
                    waiters.ask_all(Some(&(space, key)));
                }
                Notice::Missed => waiters.ask_all(None),
                // For watchers (`super::watchers`); the lock service hands those over itself.
                Notice::Changed(..) => {}
            }
        }
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// The count of parked watches, which share `limit` with the waiters.
    pub(crate) fn watching(&self) -> Arc<AtomicUsize> {
        self.watching.clone()
    }

    /// Waiting acquires now.
    pub(crate) fn len(&self) -> usize {
        self.queues().count
    }

    /// Waiting acquires now, in `space`.
    pub(crate) fn len_in(&self, space: Space) -> usize {
        self.queues()
            .by_key
            .iter()
            .filter(|((s, _), _)| *s == space)
            .map(|(_, q)| q.len())
            .sum()
    }

    /// Joins the end of this broker's queue of `key` in `space`, waiting in the store's queue
    /// with `token`; `None` when the broker already has `limit` waiters.
    pub(crate) fn enqueue(
        self: &Arc<Self>,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> Option<Ticket> {
        let me = Arc::new(Waiter {
            wake: Notify::new(),
            token: Mutex::new(token.clone()),
            ask: AtomicBool::new(false),
            look_at: Mutex::new(None),
        });
        let place = (space, key.clone());
        let mut queues = self.queues();
        if queues.count + self.watching.load(Ordering::SeqCst) >= self.limit {
            return None;
        }
        queues.count += 1;
        queues
            .by_key
            .entry(place.clone())
            .or_default()
            .push_back(me.clone());
        Some(Ticket {
            waiters: self.clone(),
            place,
            me,
        })
    }

    /// An offer to the waiter with `token`: wakes it to take the offer. False if no waiter here
    /// has that token (it left).
    fn offered(&self, space: Space, key: &LockKey, token: &Token) -> bool {
        let queues = self.queues();
        let Some(queue) = queues.by_key.get(&(space, key.clone())) else {
            return false;
        };
        let Some(waiter) = queue.iter().find(|w| *lock(&w.token) == *token) else {
            return false;
        };
        waiter.ask.store(true, Ordering::SeqCst);
        waiter.wake.notify_one();
        true
    }

    /// A `Look` notice: the key's first waiter here asks the store again after `after`.
    fn look(&self, space: Space, key: &LockKey, after: Duration) {
        if let Some(head) = self
            .queues()
            .by_key
            .get(&(space, key.clone()))
            .and_then(|q| q.front())
        {
            let at = Instant::now() + after;
            let mut look_at = lock(&head.look_at);
            *look_at = Some(look_at.map_or(at, |earlier| earlier.min(at)));
            drop(look_at);
            head.wake.notify_one();
        }
    }

    /// Every waiter of `place` (or of every key) asks the store again: their queue entries were
    /// dropped, or notices may have been missed.
    fn ask_all(&self, place: Option<&Place>) {
        let queues = self.queues();
        let chosen: Box<dyn Iterator<Item = &VecDeque<Arc<Waiter>>>> = match place {
            Some(place) => Box::new(queues.by_key.get(place).into_iter()),
            None => Box::new(queues.by_key.values()),
        };
        for waiter in chosen.flatten() {
            waiter.ask.store(true, Ordering::SeqCst);
            waiter.wake.notify_one();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why a parked waiter woke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wake {
    /// Ask the store again: an offer came, or the waiter must join the queue anew.
    Ask,
    /// Nothing for the store: it became the first waiter here, or a `Look` moved its timer.
    Recheck,
}

/// A place in a key's queue on this broker; leaving (drop) hands the timer to the next waiter.
pub(crate) struct Ticket {
    waiters: Arc<Waiters>,
    place: Place,
    me: Arc<Waiter>,
}

impl Ticket {
    /// Whether this waiter is the first of this broker's waiters on its key (it keeps the timer).
    pub(crate) fn is_first(&self) -> bool {
        self.waiters
            .queues()
            .by_key
            .get(&self.place)
            .and_then(|q| q.front())
            .is_some_and(|head| Arc::ptr_eq(head, &self.me))
    }

    /// The bid waits with a new token from now on (a store call failed; see the lock service).
    pub(crate) fn set_token(&self, token: &Token) {
        *lock(&self.me.token) = token.clone();
    }

    /// Completes when this waiter is woken, saying why.
    pub(crate) async fn woken(&self) -> Wake {
        self.me.wake.notified().await;
        if self.me.ask.swap(false, Ordering::SeqCst) {
            Wake::Ask
        } else {
            Wake::Recheck
        }
    }

    /// When a `Look` notice asked this waiter to ask the store again (clears it once passed).
    pub(crate) fn look_at(&self) -> Option<Instant> {
        let mut look_at = lock(&self.me.look_at);
        if look_at.is_some_and(|at| at <= Instant::now()) {
            return look_at.take();
        }
        *look_at
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut queues = self.waiters.queues();
        queues.count -= 1;
        let Some(queue) = queues.by_key.get_mut(&self.place) else {
            return;
        };
        let was_first = queue.front().is_some_and(|h| Arc::ptr_eq(h, &self.me));
        queue.retain(|w| !Arc::ptr_eq(w, &self.me));
        match queue.front() {
            None => {
                queues.by_key.remove(&self.place);
            }
            // The next waiter takes over the timer (and a look asked of this one).
            Some(next) if was_first => {
                if let Some(at) = *lock(&self.me.look_at) {
                    let mut look_at = lock(&next.look_at);
                    *look_at = Some(look_at.map_or(at, |earlier| earlier.min(at)));
                }
                next.wake.notify_one();
            }
            Some(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &str) -> LockKey {
        LockKey::parse(k).unwrap()
    }

    const SOON: Duration = Duration::from_millis(50);

    #[tokio::test]
    async fn an_offer_wakes_the_waiter_with_its_token_only_and_asks_it_to_take_it() {
        let waiters = Waiters::new(10);
        let (ta, tb) = (Token::generate(), Token::generate());
        let a = waiters.enqueue(Space::Locks, &key("k"), &ta).unwrap();
        let b = waiters.enqueue(Space::Locks, &key("k"), &tb).unwrap();
        assert!(a.is_first() && !b.is_first());
        assert!(waiters.offered(Space::Locks, &key("k"), &tb));
        let woke = tokio::time::timeout(SOON, b.woken()).await;
        assert_eq!(woke.ok(), Some(Wake::Ask));
        assert!(
            tokio::time::timeout(SOON, a.woken()).await.is_err(),
            "the other waiter sleeps on"
        );
        // A token nobody here waits with, or the same token in the other space: gone.
        assert!(!waiters.offered(Space::Locks, &key("k"), &Token::generate()));
        assert!(!waiters.offered(Space::Semaphores, &key("k"), &tb));
        // A waiter that retried with a new token is found by the new one only.
        let tc = Token::generate();
        b.set_token(&tc);
        assert!(!waiters.offered(Space::Locks, &key("k"), &tb));
        assert!(waiters.offered(Space::Locks, &key("k"), &tc));
    }

    #[tokio::test]
    async fn leaving_hands_the_timer_to_the_next_waiter_without_asking_the_store() {
        let waiters = Waiters::new(10);
        let a = waiters
            .enqueue(Space::Locks, &key("k"), &Token::generate())
            .unwrap();
        let b = waiters
            .enqueue(Space::Locks, &key("k"), &Token::generate())
            .unwrap();
        waiters.look(Space::Locks, &key("k"), Duration::from_secs(5));
        assert_eq!(
            tokio::time::timeout(SOON, a.woken()).await.ok(),
            Some(Wake::Recheck)
        );
        assert!(a.look_at().is_some());
        assert!(b.look_at().is_none(), "a look goes to the first waiter");
        drop(a);
        assert!(b.is_first());
        assert_eq!(
            tokio::time::timeout(SOON, b.woken()).await.ok(),
            Some(Wake::Recheck),
            "promotion wakes the next waiter, which needs no store call"
        );
        assert!(b.look_at().is_some(), "the look passes on with the timer");
        drop(b);
        assert_eq!(waiters.len(), 0);
        assert!(waiters.queues().by_key.is_empty(), "empty queues go");
    }

    #[tokio::test]
    async fn requeue_asks_every_waiter_of_its_key_and_missed_asks_every_waiter() {
        let waiters = Waiters::new(10);
        let t = || Token::generate();
        let a = waiters.enqueue(Space::Locks, &key("k"), &t()).unwrap();
        let b = waiters.enqueue(Space::Locks, &key("k"), &t()).unwrap();
        let s = waiters.enqueue(Space::Semaphores, &key("k"), &t()).unwrap();
        waiters.ask_all(Some(&(Space::Locks, key("k"))));
        for w in [&a, &b] {
            assert_eq!(
                tokio::time::timeout(SOON, w.woken()).await.ok(),
                Some(Wake::Ask)
            );
        }
        assert!(tokio::time::timeout(SOON, s.woken()).await.is_err());
        assert_eq!(waiters.len_in(Space::Locks), 2);
        assert_eq!(waiters.len_in(Space::Semaphores), 1);
        waiters.ask_all(None);
        for w in [&a, &b, &s] {
            assert_eq!(
                tokio::time::timeout(SOON, w.woken()).await.ok(),
                Some(Wake::Ask),
                "every waiter is asked"
            );
        }
    }

    #[test]
    fn the_limit_bounds_waiters_across_keys_and_frees_on_leave() {
        let waiters = Waiters::new(2);
        let t = || Token::generate();
        let a = waiters.enqueue(Space::Locks, &key("a"), &t()).unwrap();
        let _b = waiters.enqueue(Space::Locks, &key("b"), &t()).unwrap();
        assert!(waiters.enqueue(Space::Locks, &key("c"), &t()).is_none());
        drop(a);
        assert!(waiters.enqueue(Space::Locks, &key("c"), &t()).is_some());
    }
}
