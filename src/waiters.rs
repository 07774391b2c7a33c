//! Waiting without polling: one broker's queues of acquires waiting for a key, woken by release
//! notices instead of by a timer.
//!
//! Each key with waiters has a FIFO queue. A notice for the key wakes only the queue's head, so a
//! release costs this broker one attempt, not one per waiter, and waiters are served in arrival
//! order. Only the head keeps a timer (the holder's expiry, and a slow fallback poll in case a
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
}

const NO_HINT: u64 = u64::MAX;

impl Default for Waiter {
    fn default() -> Self {
        Self {
            wake: Notify::new(),
            hint_ms: AtomicU64::new(NO_HINT),
        }
    }
}

#[derive(Default)]
struct Queues {
    by_key: HashMap<LockKey, VecDeque<Arc<Waiter>>>,
    count: usize,
}

/// The broker's waiting acquires, by key.
pub struct Waiters {
    /// A std Mutex: nothing awaits while holding it, and each critical section is a hash lookup
    /// and a queue push or removal.
    queues: Mutex<Queues>,
    /// Most waiters at once; bounds the memory waiting can take.
    limit: usize,
}

impl Waiters {
    pub fn new(limit: usize) -> Arc<Self> {
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
    pub async fn hand_notices(waiters: Weak<Self>, mut notices: mpsc::Receiver<Notice>) {
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
                Notice::Released(Space::Locks, key) => waiters.wake(&key),
                // Semaphores wait on the lock service's own queues (not yet).
                Notice::Released(Space::Semaphores, _) => {}
                Notice::Missed => waiters.wake_all(),
            }
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Waiting acquires now.
    pub fn len(&self) -> usize {
        self.queues().count
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Joins the end of `key`'s queue; `None` when the broker already has `limit` waiters.
    pub fn enqueue(self: &Arc<Self>, key: &LockKey) -> Option<Ticket> {
        let me = Arc::new(Waiter::default());
        let mut queues = self.queues();
        if queues.count >= self.limit {
            return None;
        }
        queues.count += 1;
        queues
            .by_key
            .entry(key.clone())
            .or_default()
            .push_back(me.clone());
        Some(Ticket {
            waiters: self.clone(),
            key: key.clone(),
            me,
        })
    }

    /// A release notice for `key`: wakes the head of its queue, if any.
    pub fn wake(&self, key: &LockKey) {
        if let Some(head) = self.queues().by_key.get(key).and_then(|q| q.front()) {
            head.hint_ms.store(NO_HINT, Ordering::SeqCst);
            head.wake.notify_one();
        }
    }

    /// Wakes every queue's head: notices may have been lost (the notice channel reconnected).
    pub fn wake_all(&self) {
        for queue in self.queues().by_key.values() {
            if let Some(head) = queue.front() {
                head.hint_ms.store(NO_HINT, Ordering::SeqCst);
                head.wake.notify_one();
            }
        }
    }
}

/// A place in a key's queue; leaving (drop) hands the head's role to the next waiter.
pub struct Ticket {
    waiters: Arc<Waiters>,
    key: LockKey,
    me: Arc<Waiter>,
}

impl Ticket {
    /// Whether this waiter is first in line for its key on this broker.
    pub fn is_head(&self) -> bool {
        self.waiters
            .queues()
            .by_key
            .get(&self.key)
            .and_then(|q| q.front())
            .is_some_and(|head| Arc::ptr_eq(head, &self.me))
    }

    /// Completes when this waiter is woken: a notice while it is head, or its promotion to head.
    pub async fn woken(&self) {
        self.me.wake.notified().await;
    }

    /// After a wake: if it was a promotion behind a waiter that was granted the lock, how long
    /// that lease runs (the lock is held; no need to look).
    pub fn take_hint(&self) -> Option<u64> {
        match self.me.hint_ms.swap(NO_HINT, Ordering::SeqCst) {
            NO_HINT => None,
            ms => Some(ms),
        }
    }

    /// Leaves the queue as the lock's new holder, telling the next in line how long the lease
    /// runs instead of having it look: one store round trip saved per handoff.
    pub fn leave_as_holder(self, lease_ms: u64) {
        {
            let queues = self.waiters.queues();
            if let Some(queue) = queues.by_key.get(&self.key)
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
        let Some(queue) = queues.by_key.get_mut(&self.key) else {
            return;
        };
        let was_head = queue.front().is_some_and(|h| Arc::ptr_eq(h, &self.me));
        queue.retain(|w| !Arc::ptr_eq(w, &self.me));
        match queue.front() {
            None => {
                queues.by_key.remove(&self.key);
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
        let a = waiters.enqueue(&key("k")).unwrap();
        let b = waiters.enqueue(&key("k")).unwrap();
        let other = waiters.enqueue(&key("other")).unwrap();
        assert!(a.is_head() && !b.is_head() && other.is_head());
        assert_eq!(waiters.len(), 3);

        waiters.wake(&key("k"));
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
        assert!(waiters.is_empty());
        assert!(
            waiters.queues().by_key.is_empty(),
            "empty queues are dropped"
        );
    }

    #[tokio::test]
    async fn a_head_granted_the_lock_tells_the_next_how_long_it_holds_and_a_notice_clears_that() {
        let waiters = Waiters::new(10);
        let a = waiters.enqueue(&key("k")).unwrap();
        let b = waiters.enqueue(&key("k")).unwrap();
        let c = waiters.enqueue(&key("k")).unwrap();
        a.leave_as_holder(500);
        tokio::time::timeout(std::time::Duration::from_millis(10), b.woken())
            .await
            .expect("promotion wakes the new head");
        assert_eq!(b.take_hint(), Some(500));
        assert_eq!(b.take_hint(), None, "a hint is read once");
        // A waiter that is not head hands nothing on; a notice clears a hint not yet read.
        c.leave_as_holder(700);
        b.leave_as_holder(900);
        assert!(waiters.is_empty());
        let d = waiters.enqueue(&key("k")).unwrap();
        let e = waiters.enqueue(&key("k")).unwrap();
        d.leave_as_holder(300);
        waiters.wake(&key("k"));
        assert_eq!(
            e.take_hint(),
            None,
            "the lock may be free after a release notice"
        );
    }

    #[test]
    fn the_limit_bounds_waiters_across_keys_and_frees_on_leave() {
        let waiters = Waiters::new(2);
        let a = waiters.enqueue(&key("a")).unwrap();
        let _b = waiters.enqueue(&key("b")).unwrap();
        assert!(waiters.enqueue(&key("c")).is_none());
        drop(a);
        assert!(waiters.enqueue(&key("c")).is_some());
    }
}
