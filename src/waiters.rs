//! Waiting without polling: one broker's queues of acquires waiting for a key, woken by release
//! notices instead of by a timer.
//!
//! Each key with waiters has a FIFO queue, per key space (a lock and a semaphore of one name are
//! unrelated). A notice for the key wakes only the queue's head, so a release costs this broker
//! one attempt, not one per waiter, and waiters are served in arrival order: a shared acquire
//! does not try while an exclusive one that came before it waits ([`Ticket::exclusive_ahead`]). Only the head keeps a timer (the holder's expiry, and a slow fallback poll in case a
//! notice is lost); the others sleep until they are promoted or their wait runs out. A waiter
//! that leaves — granted, timed out, or its client gone — wakes the next in line.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};

use crate::domain::LockKey;
use crate::store::{Notice, Space};

/// One waiting acquire.
struct Waiter {
    /// `notify_one` keeps a permit when the waiter is not parked at that instant, so a notice
    /// that lands between two of its store calls is not lost.
    wake: Notify,
    /// Set when this waiter is promoted because the head before it was granted the lock: how
    /// long that new lease runs, so it need not look at the lock to learn it. `NO_HINT` if none;
    /// a release notice clears it (the lock may be free now).
    hint_ms: AtomicU64,
    /// Whether it asks for the key alone (an exclusive lock), rather than for a place beside
    /// other holders (a shared lease, a permit).
    exclusive: bool,
}

const NO_HINT: u64 = u64::MAX;

impl Waiter {
    fn new(exclusive: bool) -> Self {
        Self {
            wake: Notify::new(),
            hint_ms: AtomicU64::new(NO_HINT),
            exclusive,
        }
    }
}

/// A key in its space: what a queue is for.
type Place = (Space, LockKey);

#[derive(Default)]
struct Queues {
    by_key: HashMap<Place, VecDeque<Arc<Waiter>>>,
    count: usize,
}

/// The broker's waiting acquires, by key.
pub(crate) struct Waiters {
    /// A std Mutex: nothing awaits while holding it, and each critical section is a hash lookup
    /// and a queue push or removal.
    queues: Mutex<Queues>,
    /// Most waiters at once; bounds the memory waiting can take.
    limit: usize,
}

impl Waiters {
    pub(crate) fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            queues: Mutex::default(),
            limit,
        })
    }

    fn queues(&self) -> MutexGuard<'_, Queues> {
        // Every mutation completes before a panic could happen, so a poisoned lock is consistent.
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands the store's notices to the waiters, until the service is gone. Dropping the receiver
    /// then closes the channel, which ends the store's background work too.
    pub(crate) async fn hand_notices(waiters: Weak<Self>, mut notices: mpsc::Receiver<Notice>) {
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
                Notice::Released(space, key) => waiters.wake(space, &key),
                Notice::Requeue(space, key) | Notice::Look(space, key, _) => {
                    waiters.wake(space, &key)
                }
                Notice::Offered(space, key, _) => waiters.wake(space, &key),
                Notice::Missed => waiters.wake_all(),
            }
        }
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// Waiting acquires now.
    pub(crate) fn len(&self) -> usize {
        self.queues().count
    }

    /// Joins the end of the queue of `key` in `space`, asking for the key alone (`exclusive`) or
    /// for a place beside other holders; `None` when the broker already has `limit` waiters.
    pub(crate) fn enqueue(
        self: &Arc<Self>,
        space: Space,
        key: &LockKey,
        exclusive: bool,
    ) -> Option<Ticket> {
        let me = Arc::new(Waiter::new(exclusive));
        let place = (space, key.clone());
        let mut queues = self.queues();
        if queues.count >= self.limit {
            return None;
        }
        queues.count += 1;
        let queue = queues.by_key.entry(place.clone()).or_default();
        // Writers first: an exclusive acquire goes ahead of the shared ones waiting, behind the
        // exclusive ones. The store holds new shared leases back for a waiting exclusive
        // acquire anyway (its intent), so a shared acquire ahead of it here would only wait
        // for it while blocking it.
        match queue
            .iter()
            .position(|w| !w.exclusive)
            .filter(|_| exclusive)
        {
            Some(first_shared) => queue.insert(first_shared, me.clone()),
            None => queue.push_back(me.clone()),
        }
        Some(Ticket {
            waiters: self.clone(),
            place,
            me,
        })
    }

    /// Whether an acquire that asks for `key` in `space` alone waits on this broker.
    pub(crate) fn exclusive_waiting(&self, space: Space, key: &LockKey) -> bool {
        self.queues()
            .by_key
            .get(&(space, key.clone()))
            .is_some_and(|q| q.iter().any(|w| w.exclusive))
    }

    /// A release notice for `key` in `space`: wakes the head of its queue, if any.
    pub(crate) fn wake(&self, space: Space, key: &LockKey) {
        let place = (space, key.clone());
        if let Some(head) = self.queues().by_key.get(&place).and_then(|q| q.front()) {
            head.hint_ms.store(NO_HINT, Ordering::SeqCst);
            head.wake.notify_one();
        }
    }

    /// Wakes every queue's head: notices may have been lost (the notice channel reconnected).
    pub(crate) fn wake_all(&self) {
        for queue in self.queues().by_key.values() {
            if let Some(head) = queue.front() {
                head.hint_ms.store(NO_HINT, Ordering::SeqCst);
                head.wake.notify_one();
            }
        }
    }
}

/// A place in a key's queue; leaving (drop) hands the head's role to the next waiter.
pub(crate) struct Ticket {
    waiters: Arc<Waiters>,
    place: Place,
    me: Arc<Waiter>,
}

impl Ticket {
    /// Whether this waiter is first in line for its key on this broker.
    pub(crate) fn is_head(&self) -> bool {
        self.waiters
            .queues()
            .by_key
            .get(&self.place)
            .and_then(|q| q.front())
            .is_some_and(|head| Arc::ptr_eq(head, &self.me))
    }

    /// Whether an acquire that asks for the key alone came before this one and still waits: a
    /// shared acquire does not try then, so that it is not granted ahead of it.
    pub(crate) fn exclusive_ahead(&self) -> bool {
        self.waiters
            .queues()
            .by_key
            .get(&self.place)
            .is_some_and(|q| {
                q.iter()
                    .take_while(|w| !Arc::ptr_eq(w, &self.me))
                    .any(|w| w.exclusive)
            })
    }

    /// Completes when this waiter is woken: a notice while it is head, or its promotion to head.
    pub(crate) async fn woken(&self) {
        self.me.wake.notified().await;
    }

    /// After a wake: if it was a promotion behind a waiter that was granted the lock, how long
    /// that lease runs (the lock is held; no need to look).
    pub(crate) fn take_hint(&self) -> Option<u64> {
        match self.me.hint_ms.swap(NO_HINT, Ordering::SeqCst) {
            NO_HINT => None,
            ms => Some(ms),
        }
    }

    /// Leaves the queue as the lock's new exclusive holder, telling the next in line how long the
    /// lease runs instead of having it look: one store round trip saved per handoff. (A shared
    /// holder or a permit's just leaves: the next in line may be granted too, so it looks.)
    pub(crate) fn leave_as_holder(self, lease_ms: u64) {
        {
            let queues = self.waiters.queues();
            if let Some(queue) = queues.by_key.get(&self.place)
                && queue.front().is_some_and(|h| Arc::ptr_eq(h, &self.me))
                && let Some(next) = queue.get(1)
            {
                next.hint_ms.store(lease_ms, Ordering::SeqCst);
            }
        }
        drop(self);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut queues = self.waiters.queues();
        queues.count -= 1;
        let Some(queue) = queues.by_key.get_mut(&self.place) else {
            return;
        };
        let was_head = queue.front().is_some_and(|h| Arc::ptr_eq(h, &self.me));
        queue.retain(|w| !Arc::ptr_eq(w, &self.me));
        match queue.front() {
            None => {
                queues.by_key.remove(&self.place);
            }
            // The new head takes over the timer and looks at the lock at once.
            Some(next) if was_head => next.wake.notify_one(),
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

    #[tokio::test]
    async fn notices_wake_the_head_only_and_leaving_promotes_the_next_in_arrival_order() {
        let waiters = Waiters::new(10);
        let a = waiters.enqueue(Space::Locks, &key("k"), true).unwrap();
        let b = waiters.enqueue(Space::Locks, &key("k"), true).unwrap();
        let other = waiters.enqueue(Space::Locks, &key("other"), true).unwrap();
        assert!(a.is_head() && !b.is_head() && other.is_head());
        assert_eq!(waiters.len(), 3);

        waiters.wake(Space::Locks, &key("k"));
        // a holds a permit now; b does not.
        tokio::time::timeout(std::time::Duration::from_millis(10), a.woken())
            .await
            .expect("the head is woken");
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(10), b.woken())
                .await
                .is_err(),
            "the second in line sleeps on"
        );
        drop(a);
        assert!(b.is_head());
        tokio::time::timeout(std::time::Duration::from_millis(10), b.woken())
            .await
            .expect("promotion wakes the new head");
        drop(b);
        drop(other);
        assert_eq!(waiters.len(), 0);
        assert!(
            waiters.queues().by_key.is_empty(),
            "empty queues are dropped"
        );
    }

    #[tokio::test]
    async fn a_head_granted_the_lock_tells_the_next_how_long_it_holds_and_a_notice_clears_that() {
        let waiters = Waiters::new(10);
        let a = waiters.enqueue(Space::Locks, &key("k"), true).unwrap();
        let b = waiters.enqueue(Space::Locks, &key("k"), true).unwrap();
        let c = waiters.enqueue(Space::Locks, &key("k"), true).unwrap();
        a.leave_as_holder(500);
        tokio::time::timeout(std::time::Duration::from_millis(10), b.woken())
            .await
            .expect("promotion wakes the new head");
        assert_eq!(b.take_hint(), Some(500));
        assert_eq!(b.take_hint(), None, "a hint is read once");
        // A waiter that is not head hands nothing on; a notice clears a hint not yet read.
        c.leave_as_holder(700);
        b.leave_as_holder(900);
        assert_eq!(waiters.len(), 0);
        let d = waiters.enqueue(Space::Locks, &key("k"), true).unwrap();
        let e = waiters.enqueue(Space::Locks, &key("k"), true).unwrap();
        d.leave_as_holder(300);
        waiters.wake(Space::Locks, &key("k"));
        assert_eq!(
            e.take_hint(),
            None,
            "the lock may be free after a release notice"
        );
    }

    #[test]
    fn the_limit_bounds_waiters_across_keys_and_frees_on_leave() {
        let waiters = Waiters::new(2);
        let a = waiters.enqueue(Space::Locks, &key("a"), true).unwrap();
        let _b = waiters.enqueue(Space::Locks, &key("b"), true).unwrap();
        assert!(waiters.enqueue(Space::Locks, &key("c"), true).is_none());
        drop(a);
        assert!(waiters.enqueue(Space::Locks, &key("c"), true).is_some());
    }

    #[tokio::test]
    async fn a_semaphore_and_a_lock_of_one_name_queue_apart_and_each_notice_wakes_its_own() {
        let waiters = Waiters::new(10);
        let lock = waiters.enqueue(Space::Locks, &key("k"), true).unwrap();
        let permit = waiters
            .enqueue(Space::Semaphores, &key("k"), false)
            .unwrap();
        assert!(lock.is_head() && permit.is_head());
        waiters.wake(Space::Semaphores, &key("k"));
        tokio::time::timeout(std::time::Duration::from_millis(10), permit.woken())
            .await
            .expect("the semaphore's head is woken");
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(10), lock.woken())
                .await
                .is_err(),
            "the lock's waiter sleeps on"
        );
    }

    #[test]
    fn exclusive_waiters_go_ahead_of_shared_ones_and_stay_in_arrival_order_among_themselves() {
        let waiters = Waiters::new(10);
        let first_shared = waiters.enqueue(Space::Locks, &key("k"), false).unwrap();
        assert!(first_shared.is_head());
        let writer = waiters.enqueue(Space::Locks, &key("k"), true).unwrap();
        let later_shared = waiters.enqueue(Space::Locks, &key("k"), false).unwrap();
        let second_writer = waiters.enqueue(Space::Locks, &key("k"), true).unwrap();
        // The writers went ahead of both shared waiters, the first writer first.
        assert!(writer.is_head());
        assert!(first_shared.exclusive_ahead() && later_shared.exclusive_ahead());
        assert!(waiters.exclusive_waiting(Space::Locks, &key("k")));
        assert!(!waiters.exclusive_waiting(Space::Semaphores, &key("k")));
        drop(writer);
        assert!(second_writer.is_head());
        drop(second_writer);
        // Then the shared waiters, in their own order.
        assert!(first_shared.is_head());
        assert!(!later_shared.exclusive_ahead());
        assert!(!waiters.exclusive_waiting(Space::Locks, &key("k")));
    }
}
