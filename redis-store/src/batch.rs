//! Group commit: claims and releases that arrive while the batcher's calls are in flight wait,
//! then go out together in one BATCH call (`scripts/batch.lua`), which pays Redis's clock, the
//! epoch check and the call's own cost once for all of them. No timer, no added latency when
//! idle: an operation that finds fewer than [`IN_FLIGHT`] calls of the batcher in flight runs at
//! once, alone, with its own script; the ones that arrive meanwhile are gathered, and when a call
//! ends they go out as one batch (at most `max` operations; more wait for the next), and so on
//! while any wait.
//!
//! BATCH does each operation's common case alone (a free key claimed, the broker's own lease on
//! a key nobody queues for released); an operation that is not answers SLOW, having written
//! nothing, and its caller runs it alone with its own script, as if it had come after the batch.
//! A key that answered SLOW goes alone, without the batch, for a second after (a hot key: its
//! claims queue and its releases hand it on, so the batch would only add a round trip). A claim
//! asked in another epoch than the batch runs in (the broker caught up while it waited) is
//! answered SLOW without being sent.
//!
//! One Redis or a Sentinel's master only: on a cluster a script's keys must share a slot, and
//! each client key is a hash tag of its own, so the calls go alone there. Nor claims whose
//! replicas are asked for (`--redis-replica-acks`): they go alone over their key's ack link, where
//! the `WAIT` that confirms them runs (`replicas.rs`); releases are still batched.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redis::{FromRedisValue, Value};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::epoch::EpochKeeper;
use super::scripts::{Batch, BatchOp, ScriptCall, fits, is_slow, slow, unpack};
use lockbroker_core::store::{StoreError, StoreResult};

/// How many calls of the batcher may be in flight at once: while one is, the next gathers and
/// may go before the first is answered (the connection pipelines them), so Redis never waits for
/// a round trip to the broker between two batches.
const IN_FLIGHT: usize = 2;

/// How long a key that was not the common case in a batch goes alone.
const HOT_FOR: Duration = Duration::from_secs(1);

/// The most hot keys remembered; past it the oldest half is forgotten.
const HOT_KEYS: usize = 4096;

/// An operation's answer from a batch: its reply and the generation of the connection it went
/// over (see `replicas.rs`).
type Answer = StoreResult<(Value, u64)>;

/// The batcher of one store (see the module's comment).
pub(super) struct Batcher {
    /// The most operations one BATCH call carries; 1 or less: no batching.
    max: usize,
    state: Mutex<State>,
    /// Keys that answered SLOW lately, and when.
    hot: Mutex<HashMap<String, Instant>>,
}

#[derive(Default)]
struct State {
    /// How many calls of the batcher are in flight (operations alone or batches).
    in_flight: usize,
    waiting: VecDeque<(BatchOp, oneshot::Sender<Answer>)>,
}

/// What joining the batcher gave an operation.
enum Entered {
    /// Nothing in flight: run alone now; the turn starts the next batch when dropped.
    Alone(Turn),
    /// In the next batch: its answer comes here.
    Waiting(oneshot::Receiver<Answer>),
}

/// An operation running alone while the batcher gathers the next batch behind it.
struct Turn {
    keeper: Arc<EpochKeeper>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.keeper.next_batch();
    }
}

impl Batcher {
    pub(super) fn new(max: usize) -> Self {
        Self {
            max,
            state: Mutex::default(),
            hot: Mutex::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every change under the lock is one assignment or one push or pop.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn hot(&self) -> MutexGuard<'_, HashMap<String, Instant>> {
        self.hot.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_hot(&self, lock: &str) -> bool {
        let mut hot = self.hot();
        match hot.get(lock) {
            Some(since) if since.elapsed() < HOT_FOR => true,
            Some(_) => {
                hot.remove(lock);
                false
            }
            None => false,
        }
    }

    fn mark_hot(&self, lock: &str) {
        let mut hot = self.hot();
        if hot.len() >= HOT_KEYS {
            let now = Instant::now();
            hot.retain(|_, since| now.duration_since(*since) < HOT_FOR / 2);
        }
        hot.insert(lock.to_owned(), Instant::now());
    }

    /// The next batch, at most `max` operations whose callers still wait; `None` (and nothing in
    /// flight any more) when none waits.
    fn take(&self) -> Option<Vec<(BatchOp, oneshot::Sender<Answer>)>> {
        let mut state = self.state();
        let mut batch = Vec::new();
        while batch.len() < self.max {
            let Some((op, answer)) = state.waiting.pop_front() else {
                break;
            };
            // A caller that went away: its operation is not run (as a call never sent).
            if !answer.is_closed() {
                batch.push((op, answer));
            }
        }
        if batch.is_empty() {
            state.in_flight -= 1;
            return None;
        }
        Some(batch)
    }
}

impl EpochKeeper {
    /// Runs `script` — a claim or a release on the key whose lease is `lock`, which `op` says as a
    /// batch operation — alone or in a batch (see the module's comment): its reply and the generation of the connection it went
    /// over, as [`EpochKeeper::run_tracked`] answers.
    pub(super) async fn run_batched<S: ScriptCall>(
        self: &Arc<Self>,
        script: &S,
        lock: &str,
        op: impl FnOnce() -> BatchOp,
    ) -> StoreResult<(S::Reply, u64)> {
        if self.batcher.max <= 1 || self.layout.cluster || self.batcher.is_hot(lock) {
            return self.run_tracked(script).await;
        }
        let waiting = match self.enter(op) {
            Entered::Alone(turn) => {
                let answer = self.run_tracked(script).await;
                drop(turn);
                return answer;
            }
            Entered::Waiting(waiting) => waiting,
        };
        let (reply, generation) = waiting.await.unwrap_or_else(|_| {
            Err(StoreError::Failed(
                "the broker dropped a batch before it was answered".into(),
            ))
        })?;
        if is_slow(&reply) {
            self.batcher.mark_hot(lock);
            return self.run_tracked(script).await;
        }
        let reply = S::Reply::from_redis_value(reply).map_err(|e| {
            StoreError::Failed(format!(
                "Redis answered an operation of the batch script with a malformed reply: {e}"
            ))
        })?;
        Ok((reply, generation))
    }

    /// Joins the batcher: alone if fewer than [`IN_FLIGHT`] calls are in flight, else in the next
    /// batch (`op` is made only then: an operation that goes alone needs no copy of its keys).
    fn enter(self: &Arc<Self>, op: impl FnOnce() -> BatchOp) -> Entered {
        let mut state = self.batcher.state();
        if state.in_flight >= IN_FLIGHT {
            let (answer, waiting) = oneshot::channel();
            state.waiting.push_back((op(), answer));
            return Entered::Waiting(waiting);
        }
        state.in_flight += 1;
        Entered::Alone(Turn {
            keeper: Arc::clone(self),
        })
    }

    /// After a call of the batcher: the operations gathered meanwhile go out as batches, one
    /// after another, in a task of their own, until none waits.
    fn next_batch(self: &Arc<Self>) {
        let Some(batch) = self.batcher.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime (the broker is going away): the callers' answers are dropped.
            self.batcher.state().in_flight -= 1;
            return;
        };
        let keeper = Arc::clone(self);
        runtime.spawn(async move {
            let mut batch = batch;
            loop {
                keeper.run_batch(batch).await;
                match keeper.batcher.take() {
                    Some(next) => batch = next,
                    None => return,
                }
            }
        });
    }

    /// One BATCH call, and each operation's answer to its caller.
    async fn run_batch(self: &Arc<Self>, batch: Vec<(BatchOp, oneshot::Sender<Answer>)>) {
        let epoch = self.epoch_for(None);
        // A claim asked in another epoch than this batch's — the broker caught up while it
        // waited, say its first check while its first claims gathered — goes alone, as SLOW: a
        // grant made here would be remembered in the epoch it asked in, taken for one that
        // raced a loss, and put back late under a store-wide hold.
        let (batch, apart): (Vec<_>, Vec<_>) =
            batch.into_iter().partition(|(op, _)| fits(op, &epoch));
        for (_, answer) in apart {
            let _ = answer.send(Ok((slow(), 0)));
        }
        if batch.is_empty() {
            return;
        }
        let (ops, answers): (Vec<BatchOp>, Vec<_>) = batch.into_iter().unzip();
        self.metrics.store_batch(ops.len());
        let call = Batch {
            marker: &self.layout.marker,
            epoch: &epoch,
            broker: &self.broker.id,
            ops: &ops,
        };
        let replies = self
            .run_tracked(&call)
            .await
            .and_then(|(reply, generation)| {
                let count = reply.len();
                let replies = unpack(&ops, reply).map_err(|why| {
                    StoreError::Failed(format!(
                        "Redis answered a batch of {} operations with {count} values: {why}",
                        ops.len()
                    ))
                })?;
                Ok((replies, generation))
            });
        match replies {
            Ok((replies, generation)) => {
                for (reply, answer) in replies.into_iter().zip(answers) {
                    let _ = answer.send(Ok((reply, generation)));
                }
            }
            Err(e) => {
                for answer in answers {
                    let _ = answer.send(Err(e.clone()));
                }
            }
        }
    }
}
