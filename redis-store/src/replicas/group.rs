//! Group commit of replica acknowledgements on one connection (see `replicas.rs`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lockbroker_core::domain::millis;
use lockbroker_core::store::{StoreError, StoreResult};

/// Group commit on one connection: the `WAIT`s sent on it, one at a time, and the outcome of the
/// last one, which answers every grant whose write completed before it was sent.
#[derive(Default)]
pub(super) struct Group {
    /// Held while a `WAIT` is in flight: the next grants wait for it, then share one `WAIT`.
    turn: tokio::sync::Mutex<()>,
    /// How many `WAIT`s were sent on this connection; counted up just before each is sent.
    sent: AtomicU64,
    /// The last `WAIT` that returned: its number, the generation of the connection it ran on,
    /// and how many replicas acknowledged.
    last: Mutex<Option<(u64, u64, StoreResult<u64>)>>,
}

impl Group {
    /// Whether no `WAIT` is in flight on this connection now: a write sent on it now runs at
    /// once rather than behind one.
    pub(super) fn idle(&self) -> bool {
        self.turn.try_lock().is_ok()
    }

    /// How many replicas acknowledged a `WAIT` sent after this call began, so after the
    /// caller's write completed, on the connection `generation` that carried that write: the
    /// last one's answer if it was sent late enough on that connection, or one this call sends
    /// (`wait` runs it on that connection, or fails), after the one in flight returns. Waits
    /// at most `limit` for its turn.
    pub(super) async fn acknowledged(
        &self,
        limit: Duration,
        generation: u64,
        wait: impl AsyncFnOnce() -> StoreResult<u64>,
    ) -> StoreResult<u64> {
        // Every WAIT numbered above `mark` is sent after this point.
        let mark = self.sent.load(Ordering::SeqCst);
        let answered = || {
            self.last
                .lock()
                .expect("the WAIT record is never poisoned")
                .as_ref()
                .filter(|(number, on, _)| *number > mark && *on == generation)
                .map(|(_, _, acked)| acked.clone())
        };
        let Ok(_turn) = tokio::time::timeout(limit, self.turn.lock()).await else {
            return Err(StoreError::Timeout(millis(limit)));
        };
        // A WAIT sent after `mark` returned while this call waited for its turn: it covers
        // this call's write (group commit).
        if let Some(acked) = answered() {
            return acked;
        }
        let number = self.sent.fetch_add(1, Ordering::SeqCst) + 1;
        let acked = wait().await;
        *self.last.lock().expect("the WAIT record is never poisoned") =
            Some((number, generation, acked.clone()));
        acked
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    use tokio::sync::oneshot;

    use super::*;

    /// Lets the spawned tasks run until `done` holds (a current-thread runtime: they run only
    /// when this task yields).
    async fn until(done: impl Fn() -> bool) {
        while !done() {
            tokio::task::yield_now().await;
        }
    }

    /// Three writes on one group: A's `WAIT` in flight, then B and C wait for their turn, C's
    /// write on connection `c_generation`. Returns how many `WAIT`s were sent in all.
    async fn waits_sent(c_generation: u64) -> usize {
        let group = Arc::new(Group::default());
        let sent = Arc::new(AtomicUsize::new(0));
        let limit = Duration::from_secs(5);
        let blocked_wait = |gate: oneshot::Receiver<()>| {
            let sent = sent.clone();
            async move || {
                sent.fetch_add(1, Ordering::SeqCst);
                gate.await.expect("the test opens the gate");
                Ok(1)
            }
        };
        let (open_a, gate_a) = oneshot::channel();
        let (open_b, gate_b) = oneshot::channel();
        let a = tokio::spawn({
            let (group, wait) = (group.clone(), blocked_wait(gate_a));
            async move { group.acknowledged(limit, 1, wait).await }
        });
        until(|| sent.load(Ordering::SeqCst) == 1).await;
        let b = tokio::spawn({
            let (group, wait) = (group.clone(), blocked_wait(gate_b));
            async move { group.acknowledged(limit, 1, wait).await }
        });
        tokio::task::yield_now().await;
        let c = tokio::spawn({
            let (group, sent) = (group.clone(), sent.clone());
            async move {
                group
                    .acknowledged(limit, c_generation, async || {
                        sent.fetch_add(1, Ordering::SeqCst);
                        Ok(1)
                    })
                    .await
            }
        });
        tokio::task::yield_now().await;
        open_a.send(()).unwrap();
        assert_eq!(a.await.unwrap().unwrap(), 1);
        // B's WAIT is sent after C's write completed.
        until(|| sent.load(Ordering::SeqCst) == 2).await;
        open_b.send(()).unwrap();
        assert_eq!(b.await.unwrap().unwrap(), 1);
        assert_eq!(c.await.unwrap().unwrap(), 1);
        sent.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn a_wait_sent_after_a_write_on_its_connection_answers_it_too() {
        assert_eq!(waits_sent(1).await, 2);
    }

    #[tokio::test]
    async fn a_wait_on_a_newer_connection_never_answers_a_write_made_on_an_older_one() {
        assert_eq!(waits_sent(2).await, 3);
    }
}
