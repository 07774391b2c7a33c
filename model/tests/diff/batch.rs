//! BATCH (group commit): a batch of 1–4 claims and releases on the lock keys, run on the real
//! side by calling `batch.lua` itself (the `Store` interface batches only calls that overlap in
//! time, and says nothing of SLOW), and on the model's side by its `batch`; each side then runs
//! the operations answered SLOW alone, in order, as the broker does (`run_batched`).
//!
//! The broker's ledger does not see the test's own BATCH calls: what a batch grants or releases
//! is neither remembered nor forgotten on either side (a lease the test's BATCH released is put
//! back after a loss by the broker that remembers it, on both sides). The ledger takes a grant
//! the same way whether it came alone or in a batch (`grant.rs`).

use lockbroker_model::store::{Answer, BatchOp, Bid, KeyState, Kind};
use rand::RngExt;
use rand::rngs::StdRng;

use super::{LONG, ModelSide, SEMAPHORE, Step, key_of, token_of};

/// One operation of a batch (`c` or `r`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum BatchStep {
    /// A claim; `wait`: the bid waits when it runs alone after SLOW.
    Claim {
        key: u8,
        token: usize,
        long: bool,
        wait: bool,
        session: bool,
    },
    Release {
        key: u8,
        token: usize,
    },
}

impl BatchStep {
    pub(crate) fn key(&self) -> u8 {
        match *self {
            BatchStep::Claim { key, .. } | BatchStep::Release { key, .. } => key,
        }
    }

    /// The step that runs it alone.
    pub(crate) fn alone(&self, broker: u8) -> Step {
        match *self {
            BatchStep::Claim {
                key,
                token,
                long,
                wait,
                session,
            } => Step::Claim {
                broker,
                key,
                token,
                shared: false,
                long,
                wait,
                session,
            },
            BatchStep::Release { key, token } => Step::Release { broker, key, token },
        }
    }
}

/// A batch through `broker` (half the time, where there is one, through the broker that alone
/// answers a lease the fast release takes): fresh claims, mostly of a key free for the fast claim,
/// and asks again of its own exclusive bids; releases of the lock keys' records (live, expired or
/// offered; those the fast release takes, or this broker's bids', first) and of a lease claimed
/// earlier in the same batch; keys drawn from the two lock keys, so that one key often comes
/// twice. `claims_only`: no releases (a batch right after a loss: a release there would race with
/// the broker's own put-back).
pub(crate) fn step(
    rng: &mut StdRng,
    model: &ModelSide,
    broker: u8,
    next: &mut usize,
    claims_only: bool,
) -> Step {
    let n = rng.random_range(1..=4);
    // Half the time through the broker a lease the fast release takes is answered by, if any.
    let takes = |k: &KeyState, b: u8| {
        k.lock
            .as_ref()
            .is_some_and(|l| l.live() && !l.offered && l.by == 1 << b)
            && k.queue.is_empty()
            && k.pool.is_empty()
            && k.counter.is_none()
    };
    let owners: Vec<u8> = (0..2u8)
        .filter(|&b| {
            model.store.keys[..SEMAPHORE as usize]
                .iter()
                .any(|k| takes(k, b))
        })
        .collect();
    let broker = match owners.len() {
        0 => broker,
        _ if rng.random_bool(0.5) => broker,
        n => owners[rng.random_range(0..n)],
    };
    let mut ops = Vec::with_capacity(n);
    let mut mine: Vec<(usize, &Bid)> = model
        .bids
        .iter()
        .filter(|(t, b)| {
            b.broker == broker
                && b.kind == Kind::Exclusive
                && key_of(model, **t).is_some_and(|k| k != SEMAPHORE)
                && !model.several.contains_key(t)
        })
        .map(|(t, b)| (*t, b))
        .collect();
    // The bids' map iterates in no fixed order: sorted, a seed replays.
    mine.sort_unstable_by_key(|(t, _)| *t);
    // The lock keys' records (live, expired, offered), those of this broker's bids first.
    let mut records: Vec<(u8, usize)> = (0..SEMAPHORE)
        .filter_map(|k| {
            let l = model.store.keys[k as usize].lock.as_ref()?;
            Some((k, l.token.client as usize + 256 * l.token.attempt as usize))
        })
        .collect();
    let home = |t: &usize| model.bids.get(t).is_some_and(|b| b.broker == broker);
    // Half the time, the ones the fast release takes, if any: this broker's alone, live, on a key
    // with nothing else.
    let fast = |k: u8| takes(&model.store.keys[k as usize], broker);
    if records.iter().any(|(k, _)| fast(*k)) && rng.random_bool(0.5) {
        records.retain(|(k, _)| fast(*k));
    } else if records.iter().any(|(_, t)| home(t)) && rng.random_bool(0.75) {
        records.retain(|(_, t)| home(t));
    }
    let free = free_keys(model);
    let mut claimed: Vec<(u8, usize)> = Vec::new();
    for _ in 0..n {
        let release =
            !claims_only && (!claimed.is_empty() || !records.is_empty()) && rng.random_bool(0.5);
        let op = if release {
            let from = if claimed.is_empty() || (!records.is_empty() && rng.random_bool(0.75)) {
                &records
            } else {
                &claimed
            };
            let (key, token) = from[rng.random_range(0..from.len())];
            BatchStep::Release { key, token }
        } else if !mine.is_empty() && rng.random_bool(0.2) {
            let (token, bid) = mine[rng.random_range(0..mine.len())];
            BatchStep::Claim {
                key: key_of(model, token).unwrap_or(0),
                token,
                long: bid.ttl == LONG,
                wait: true,
                session: bid.session,
            }
        } else {
            // A key free as the fast claim finds it, mostly, where there is one.
            let key = match free.len() {
                0 => rng.random_range(0..SEMAPHORE),
                _ if rng.random_bool(0.3) => rng.random_range(0..SEMAPHORE),
                n => free[rng.random_range(0..n)],
            };
            let token = *next;
            *next += 1;
            claimed.push((key, token));
            BatchStep::Claim {
                key,
                token,
                long: rng.random_bool(0.3),
                wait: rng.random_bool(0.7),
                session: rng.random_bool(0.2),
            }
        };
        ops.push(op);
    }
    Step::Batch { broker, ops }
}

/// The set steps every run begins with (before CLAIM_ALL's): each case of BATCH once, leaving
/// both lock keys as they were (nothing in them, no fence counter).
pub(crate) fn prefix(next: &mut usize) -> Vec<Step> {
    let mut fresh = || {
        *next += 1;
        *next - 1
    };
    let [a, b, c, d, e, f, g, h, i, j, k, l] = std::array::from_fn(|_| fresh());
    let claim = |key, token, long, wait| BatchStep::Claim {
        key,
        token,
        long,
        wait,
        session: false,
    };
    let release = |key, token| BatchStep::Release { key, token };
    let batch = |broker, ops| Step::Batch { broker, ops };
    vec![
        // Two free keys, granted with one clock.
        batch(0, vec![claim(0, a, true, true), claim(1, b, true, true)]),
        // Released and granted again in one batch (the new fence, the batch's clock, is above
        // the released one); a second claim of the key: SLOW, refused alone.
        batch(
            0,
            vec![
                release(0, a),
                claim(0, c, true, true),
                claim(0, d, true, false),
            ],
        ),
        // A lease the other broker granted: SLOW, released alone.
        batch(1, vec![release(0, c)]),
        // Granted and released in one batch: the release SLOW (the lease's fence is the clock).
        batch(0, vec![claim(0, e, false, true), release(0, e)]),
        // Released, then released again: SLOW, not held alone.
        batch(0, vec![release(1, b), release(1, b)]),
        // An expired lease: its release and a claim of its key SLOW (not held; refused).
        batch(0, vec![claim(1, f, false, true)]),
        Step::Tick,
        batch(0, vec![release(1, f), claim(1, g, true, false)]),
        Step::Force { broker: 0, key: 1 },
        // A queued key: a claim and the holder's release SLOW; released alone, the key is
        // offered to the queued bid, whose release is then SLOW (not its holder yet).
        batch(0, vec![claim(0, h, true, true)]),
        Step::Claim {
            broker: 1,
            key: 0,
            token: i,
            shared: false,
            long: true,
            wait: true,
            session: false,
        },
        batch(0, vec![claim(0, j, true, false), release(0, h)]),
        batch(1, vec![release(0, i)]),
        Step::Leave {
            broker: 1,
            key: 0,
            token: i,
        },
        // A batch right after a loss, by a broker that has not caught up: every claim SLOW.
        Step::FlushBatch(Box::new(batch(
            1,
            vec![claim(0, k, true, true), claim(1, l, true, true)],
        ))),
    ]
}

/// The lock keys free as the fast claim finds a key free (no record, queue, pool or counter):
/// while there is one, batches are drawn more often, to meet the fast paths.
pub(crate) fn free_keys(model: &ModelSide) -> Vec<u8> {
    (0..SEMAPHORE)
        .filter(|&k| {
            let k = &model.store.keys[k as usize];
            k.lock.is_none() && k.queue.is_empty() && k.pool.is_empty() && k.counter.is_none()
        })
        .collect()
}

impl ModelSide {
    /// BATCH by `broker` in the epoch `known` (none given: the store's), then — unless `stale` —
    /// each operation it answered SLOW alone, in order: every answer, the batch's first.
    pub(crate) fn batch(&mut self, step: &Step, known: Option<Option<u8>>) -> Answer {
        let Step::Batch { broker, ref ops } = *step else {
            unreachable!("a BATCH step")
        };
        let calls: Vec<BatchOp> = ops
            .iter()
            .map(|op| match *op {
                BatchStep::Claim {
                    key,
                    token,
                    long,
                    session,
                    ..
                } => {
                    self.keys_of.entry(token).or_insert(key);
                    let bid = self.bids.entry(token).or_insert(Bid {
                        token: token_of(token),
                        broker,
                        kind: Kind::Exclusive,
                        ttl: if long { LONG } else { 1 },
                        session,
                    });
                    BatchOp::Claim {
                        key,
                        bid: bid.clone(),
                    }
                }
                BatchStep::Release { key, token } => BatchOp::Release {
                    key,
                    token: token_of(token),
                },
            })
            .collect();
        let stale = known.is_some();
        let known = known.unwrap_or(self.store.marker.map(|m| m.id));
        let Answer::Batch(mut all) = self.call_as(
            broker,
            known,
            lockbroker_model::store::Op::Batch { ops: calls },
        ) else {
            unreachable!("BATCH answers a batch")
        };
        if !stale {
            for (i, op) in ops.iter().enumerate() {
                if all[i] == Answer::Slow {
                    let answer = self.step(&op.alone(broker));
                    all.push(answer);
                }
            }
        }
        Answer::Batch(all)
    }

    /// FLUSHALL, then `batch` by a broker still in the epoch before the loss.
    pub(crate) fn stale_batch(&mut self, batch: &Step) -> Answer {
        let known = self.store.marker.map(|m| m.id);
        self.call(0, lockbroker_model::store::Op::Flush);
        self.batch(batch, Some(known))
    }
}

/// The keys of a batch's answers, in order: each operation's, then each SLOW one's again.
pub(crate) fn keys_of_answers(ops: &[BatchStep], answers: &[Answer]) -> Vec<u8> {
    let mut keys: Vec<u8> = ops.iter().map(BatchStep::key).collect();
    for (op, a) in ops.iter().zip(answers) {
        if *a == Answer::Slow {
            keys.push(op.key());
        }
    }
    keys
}
