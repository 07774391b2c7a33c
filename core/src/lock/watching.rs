//! Watching a key: answer a watch when the key's holders differ from what its caller saw, or
//! when they change within its wait. The watches themselves are parked in
//! [`super::watchers`]; this file runs each watched key's keeper, the one task per key and
//! broker that reads the store for all of the key's watches.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::watchers::{LINGER, Reading, Watched, identity, shown_fence};
use super::{HoldersView, LockError, LockService};
use crate::domain::{LockKey, Space, millis};
use crate::store::{Store, StoreError, WATCH_MARK};

/// How soon a keeper reads again after the store did not answer.
const STORE_RETRY: Duration = Duration::from_millis(500);

/// How often a keeper reads its key anyway when the store does not announce other brokers'
/// changes (see [`Store::sees_every_change`]), or could not mark the key watched: the most a
/// change made elsewhere can take to reach this broker's watches then.
pub(crate) const FALLBACK_READ: Duration = Duration::from_secs(1);

/// How long before its mark ends a keeper marks its key watched again (see
/// [`Store::mark_watched`]): one store call per key and broker per half mark, none per watch.
const MARK_AGAIN_BEFORE: Duration = Duration::from_secs(WATCH_MARK.as_secs() / 2);

/// What a watch answers: the key's holders now (`None`: free), and whether they differ from
/// what the caller saw.
#[derive(Debug)]
pub struct Watch {
    pub view: Option<HoldersView>,
    pub changed: bool,
}

impl<S: Store> LockService<S> {
    /// Answers at once if the key's holders differ from `seen` (the highest fence the caller
    /// saw; 0: free), otherwise when they change within `wait`, or with the unchanged view when
    /// `wait` runs out. Counts against `max_waiters` while it waits.
    pub async fn watch(
        &self,
        space: Space,
        key: &LockKey,
        seen: u64,
        wait: Duration,
    ) -> Result<Watch, LockError> {
        let limit = self.settings.max_waiters;
        let place = (space, key.clone());
        let busy = self.waiters.len() + self.watchers.len();
        let (ticket, fresh) = self
            .watchers
            .enter(&place, busy, limit)
            .ok_or(LockError::TooManyWaiters { limit })?;
        let watched = ticket.watched().clone();
        if fresh {
            tokio::spawn(self.clone().keep(watched.clone(), space, key.clone()));
        }
        let mut readings = watched.subscribe();
        let asked = watched.first_reading();
        let deadline = Instant::now() + wait;
        let mut shutdown = self.shutdown.clone();
        // A reading that knows every change signalled before this watch came (see
        // `Watched::first_reading`; the keeper may publish an earlier one first).
        let bound = self.settings.store_timeout * 2;
        let first = tokio::select! {
            first = tokio::time::timeout(bound, reading_from(&mut readings, asked)) => first,
            _ = shutdown.wait_for(|stopping| *stopping) => return Err(LockError::ShuttingDown),
        };
        let Ok(Some(first)) = first else {
            return Err(StoreError::Timeout(millis(self.settings.store_timeout)).into());
        };
        let base = match &*first.view {
            Err(e) => return Err(again(e)),
            Ok(view) if shown_fence(view) != seen => return Ok(answer(&first, true)),
            Ok(view) => identity(view),
        };
        let mut latest = first;
        while Instant::now() < deadline {
            tokio::select! {
                moved = readings.changed() => {
                    if moved.is_err() {
                        break;
                    }
                    let reading = readings.borrow_and_update().clone();
                    if matches!(&*reading.view, Ok(view) if identity(view) != base) {
                        return Ok(answer(&reading, true));
                    }
                    latest = reading;
                }
                () = tokio::time::sleep_until(deadline) => break,
                _ = shutdown.wait_for(|stopping| *stopping) => return Err(LockError::ShuttingDown),
            }
        }
        drop(ticket);
        match &*latest.view {
            Err(e) => Err(again(e)),
            Ok(_) => Ok(answer(&latest, false)),
        }
    }

    /// The keeper of a watched key: reads it when asked and when the earliest of its leases
    /// ends, publishing each reading to the key's watches, until [`LINGER`] after the last watch
    /// left (meanwhile it reads nothing, and a watch that comes may take its latest reading).
    async fn keep(self, watched: Arc<Watched>, space: Space, key: LockKey) {
        let place = (space, key);
        let key = &place.1;
        let mut done = 0;
        let mut timer: Option<Instant> = None;
        // Until when the store announces the key's changes made through other brokers.
        let mut announced_until: Option<Instant> = None;
        // When the key's last watch left, while it has none.
        let mut idle_since: Option<Instant> = None;
        loop {
            if watched.is_idle() {
                let retire_at = *idle_since.get_or_insert_with(Instant::now) + LINGER;
                if Instant::now() >= retire_at {
                    if self.watchers.retire(&place, &watched) {
                        return;
                    }
                } else {
                    tokio::select! {
                        () = watched.woken() => {}
                        () = tokio::time::sleep_until(retire_at) => {}
                    }
                }
                continue;
            }
            idle_since = None;
            let wanted = watched.wanted();
            let due = timer.is_some_and(|at| at <= Instant::now());
            if wanted > done || due {
                // A read of its own (a lease ended) gets a generation too, for the watches that
                // come meanwhile to share.
                let generation = if wanted > done {
                    wanted
                } else {
                    watched.next_generation()
                };
                watched.reading(generation);
                if watched.take_mark_again() {
                    announced_until = None;
                }
                let now = Instant::now();
                // Marked before the read: a change after the read is announced.
                if announced_until.is_none_or(|until| until <= now + MARK_AGAIN_BEFORE) {
                    announced_until = match self.store.mark_watched(space, key).await {
                        Ok(true) => Some(now + WATCH_MARK),
                        Ok(false) | Err(_) => None,
                    };
                }
                let view = self.read_view(space, key).await;
                done = generation;
                let ends = first_end(&view);
                timer = self.next_read(ends, view.is_err(), announced_until);
                let current_until = match (&view, announced_until) {
                    (Ok(_), Some(until)) => Some(ends.map_or(until, |end| end.min(until))),
                    _ => None,
                };
                watched.publish(Reading {
                    generation,
                    at: Instant::now(),
                    view: Arc::new(view),
                    current_until,
                });
                continue;
            }
            match timer {
                Some(at) => tokio::select! {
                    () = watched.woken() => {}
                    () = tokio::time::sleep_until(at) => {}
                },
                None => watched.woken().await,
            }
        }
    }

    /// The key's live holders, `None` when free.
    async fn read_view(
        &self,
        space: Space,
        key: &LockKey,
    ) -> Result<Option<HoldersView>, LockError> {
        let view = match space {
            Space::Locks => self.inspect(key).await,
            Space::Semaphores => self.permits(key).await,
        };
        match view {
            Ok(view) => Ok(Some(view)),
            Err(LockError::NotHeld) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// When the keeper reads by itself: just after the first of the leases ends (`ends`: an
    /// expiry changes the holders and nobody announces it), soon after a failed read, on the
    /// fallback timer when other brokers' changes are not announced, and in time to mark the key
    /// again while they are.
    fn next_read(
        &self,
        ends: Option<Instant>,
        failed: bool,
        announced_until: Option<Instant>,
    ) -> Option<Instant> {
        let now = Instant::now();
        let at = if failed {
            Some(now + STORE_RETRY)
        } else {
            ends
        };
        let next = match announced_until {
            Some(until) if !self.store.sees_every_change() => until - MARK_AGAIN_BEFORE,
            Some(_) => return at,
            None if self.store.sees_every_change() => return at,
            None => now + FALLBACK_READ,
        };
        Some(at.map_or(next, |at| at.min(next)))
    }
}

/// Just after the first of a reading's leases ends (this host's clock, as the read answered).
fn first_end(view: &Result<Option<HoldersView>, LockError>) -> Option<Instant> {
    let Ok(Some(view)) = view else { return None };
    let now = Instant::now();
    view.holders
        .iter()
        .map(|l| l.expires_at_ms)
        .min()
        // A lease ends *after* its last millisecond.
        .map(|end| now + Duration::from_millis(end.saturating_sub(view.now_ms) + 1))
}

/// The first reading of generation `asked` or later; `None` if the keeper is gone.
async fn reading_from(readings: &mut watch::Receiver<Reading>, asked: u64) -> Option<Reading> {
    let reading = readings.wait_for(|r| r.generation >= asked).await.ok()?;
    Some(reading.clone())
}

/// A reading as a watch answers it: the store's clock moved on by the time since the read.
fn answer(reading: &Reading, changed: bool) -> Watch {
    let view = match &*reading.view {
        Ok(view) => view.clone().map(|mut view| {
            view.now_ms += millis(reading.at.elapsed());
            view
        }),
        Err(_) => None,
    };
    Watch { view, changed }
}

/// A reading's error again, for each watch that answers with it.
fn again(e: &LockError) -> LockError {
    match e {
        LockError::OnHold(hold) => LockError::OnHold(*hold),
        LockError::StoreUnavailable(e) => LockError::StoreUnavailable(e.clone()),
        LockError::ShuttingDown => LockError::ShuttingDown,
        other => LockError::StoreUnavailable(StoreError::Failed(other.to_string())),
    }
}
