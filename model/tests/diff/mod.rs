//! The steps of a differential run, their generation from a seed (guided by the model's state,
//! so that asks again, releases and renewals name tokens that are queued or hold), the model's
//! side of a run, and the shrinking of a failing sequence.

mod batch;
mod handed;
mod real;
mod sessions;
mod several;

use std::collections::HashMap;

use lockbroker_model::store::{
    Answer, Back, Bid, Call, Fence, Kind, Notice, Op, Params, Store, Token,
};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

pub(crate) use batch::BatchStep;
pub(crate) use real::{Outcome, run_steps};
pub(crate) use sessions::SessStep;
pub(crate) use several::Tally;

/// The keys (lock keys `d0`, `d1`) and brokers of a run.
pub(crate) const KEYS: u8 = 3;
/// The last key is a semaphore of `LIMIT` permits (`d2` in the semaphores' space).
pub(crate) const SEMAPHORE: u8 = 2;
pub(crate) const LIMIT: u8 = 2;
/// A long lease, in ticks: it never ends in a run.
pub(crate) const LONG: u8 = 250;

/// One step. A token is a number; the real side makes one `Token` per number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// CLAIM (exclusive) or JOIN (shared; a permit on the semaphore) — a token seen before asks
    /// again with its bid.
    Claim {
        broker: u8,
        key: u8,
        token: usize,
        shared: bool,
        long: bool,
        wait: bool,
        /// Under a session: the lease carries the session mark (a renewal without `until`
        /// keeps its end).
        session: bool,
    },
    /// READ, then TAKE_OVER of the lease record seen.
    TakeOver {
        broker: u8,
        key: u8,
        token: usize,
        long: bool,
    },
    Release {
        broker: u8,
        key: u8,
        token: usize,
    },
    /// RENEW, by a TTL or (`until`) to a time unless the lease ends later already.
    Renew {
        broker: u8,
        key: u8,
        token: usize,
        long: bool,
        until: bool,
    },
    /// SESSION on session `id` (a number; the real side makes one id per number).
    Session {
        broker: u8,
        id: usize,
        op: SessStep,
    },
    /// KEEP: RENEW's `until` form on each lease (key, token), in order.
    Keep {
        broker: u8,
        leases: Vec<(u8, usize)>,
        long: bool,
    },
    Leave {
        broker: u8,
        key: u8,
        token: usize,
    },
    Force {
        broker: u8,
        key: u8,
    },
    /// CLAIM_ALL of the lock keys (in this order) for a fresh token, as a several-keys acquire's
    /// first try; the token may then ask key by key (`Claim`), as the one-by-one path does.
    ClaimAll {
        broker: u8,
        keys: Vec<u8>,
        token: usize,
        long: bool,
    },
    /// BATCH through `broker`, then each operation it answered SLOW alone.
    Batch {
        broker: u8,
        ops: Vec<BatchStep>,
    },
    /// Every short end passes.
    Tick,
    /// A tick, FLUSHALL, then both brokers catch up.
    Flush,
    /// A tick, FLUSHALL, this CLAIM_ALL by a broker that has not caught up (the model's in the
    /// epoch before the loss), then both brokers catch up.
    FlushClaimAll(Box<Step>),
    /// A tick, FLUSHALL, this BATCH by a broker that has not caught up (its SLOW operations are
    /// not run alone), then both brokers catch up.
    FlushBatch(Box<Step>),
}

pub(crate) fn token_of(t: usize) -> Token {
    Token {
        client: (t % 256) as u8,
        attempt: (t / 256) as u8,
    }
}

/// The model's side of a run: the store, the brokers' ledgers, the notices told since the
/// last tick.
pub(crate) struct ModelSide {
    pub store: Store,
    pub params: Params,
    pub ledgers: [Vec<Back>; 2],
    /// Each token's bid (its broker, key and kind), once it asked.
    pub bids: HashMap<usize, Bid>,
    /// Each token's key, once it asked (a CLAIM_ALL's: its first key).
    pub keys_of: HashMap<usize, u8>,
    /// A CLAIM_ALL's token's keys.
    pub several: HashMap<usize, Vec<u8>>,
    pub told: Vec<(u8, Notice)>,
    /// Per broker, the grants its releases handed to its own bids, not taken yet.
    pub handed: [Vec<handed::Handed>; 2],
    /// What became of them (handed, taken without a script, ...), for the run's tally.
    pub direct: Tally,
}

impl ModelSide {
    pub(crate) fn new() -> Self {
        ModelSide {
            store: Store::new(KEYS as usize),
            params: Params {
                window: 1,
                settle: 1,
                put_back_hold: 1,
                bug: None,
            },
            ledgers: [Vec::new(), Vec::new()],
            bids: HashMap::new(),
            keys_of: HashMap::new(),
            several: HashMap::new(),
            told: Vec::new(),
            handed: [Vec::new(), Vec::new()],
            direct: Tally::default(),
        }
    }

    fn call(&mut self, broker: u8, op: Op) -> Answer {
        let known = self.store.marker.map(|m| m.id);
        self.call_as(broker, known, op)
    }

    /// A call by a broker that knows the epoch `known`.
    fn call_as(&mut self, broker: u8, known: Option<u8>, op: Op) -> Answer {
        let (answer, fx) = self.store.apply(&self.params, &Call { broker, known, op });
        for (b, n) in fx.notices {
            match n {
                Notice::Ended(key, fence, all) => {
                    forget(&mut self.ledgers[b as usize], key, fence, all)
                }
                other => self.told.push((b, other)),
            }
        }
        answer
    }

    fn remember(
        &mut self,
        broker: u8,
        key: u8,
        (kind, session): (Kind, bool),
        token: Token,
        answer: &Answer,
    ) {
        if let Answer::Granted { fence, left, .. } = *answer {
            let ledger = &mut self.ledgers[broker as usize];
            make_room(ledger, key, kind, token);
            ledger.push(Back {
                key,
                kind,
                token,
                fence,
                left,
                session,
            });
        }
    }

    /// Runs one step (not `Flush`'s catching up, see `flush`); the answer, and for TAKE_OVER the
    /// fence it saw.
    pub(crate) fn step(&mut self, step: &Step) -> Answer {
        if let Step::Claim { token, key, .. } | Step::TakeOver { token, key, .. } = *step {
            self.keys_of.entry(token).or_insert(key);
        }
        match *step {
            Step::Claim {
                broker,
                key,
                token,
                shared,
                long,
                wait,
                session,
            } => {
                let kind = if key == SEMAPHORE {
                    Kind::Permit(LIMIT)
                } else if shared {
                    Kind::Shared
                } else {
                    Kind::Exclusive
                };
                let ttl = if long { LONG } else { 1 };
                let bid = self
                    .bids
                    .entry(token)
                    .or_insert(Bid {
                        token: token_of(token),
                        broker,
                        kind,
                        ttl,
                        session,
                    })
                    .clone();
                let op = if kind != Kind::Exclusive {
                    Op::Join {
                        key,
                        bid: bid.clone(),
                        wait,
                    }
                } else if let Some(answer) = self.take_handed(broker, key, bid.token) {
                    // The grant a release of this broker handed the bid: no script.
                    return answer;
                } else {
                    Op::Claim {
                        key,
                        bid: bid.clone(),
                        wait,
                    }
                };
                let answer = self.call(broker, op);
                self.remember(broker, key, (kind, bid.session), bid.token, &answer);
                answer
            }
            Step::TakeOver {
                broker,
                key,
                token,
                long,
            } => {
                let seen = self.store.keys[key as usize]
                    .lock
                    .as_ref()
                    .map_or(0, |l| l.fence);
                let ttl = if long { LONG } else { 1 };
                let bid = Bid {
                    token: token_of(token),
                    broker,
                    kind: Kind::Exclusive,
                    ttl,
                    session: false,
                };
                self.bids.entry(token).or_insert(bid.clone());
                let answer = self.call(broker, Op::TakeOver { key, bid, seen });
                self.remember(
                    broker,
                    key,
                    (Kind::Exclusive, false),
                    token_of(token),
                    &answer,
                );
                answer
            }
            Step::Release { broker, key, token } => self.release(broker, key, token_of(token)),
            Step::Renew {
                broker,
                key,
                token,
                long,
                until,
            } => {
                let ttl = if long { LONG } else { 1 };
                let t = token_of(token);
                let until = until.then_some(ttl);
                let op = Op::Renew {
                    key,
                    token: t,
                    ttl,
                    until,
                };
                let answer = self.call(broker, op);
                self.ledgers[broker as usize].retain(|e| e.token != t || e.key != key);
                if let Answer::Held { .. } = answer {
                    self.remember_held(broker, key, token);
                }
                answer
            }
            Step::Session { broker, id, ref op } => self.call(
                broker,
                Op::Session {
                    id: id as u8,
                    op: op.op(),
                },
            ),
            Step::Keep {
                broker,
                ref leases,
                long,
            } => {
                let until = if long { LONG } else { 1 };
                let op = Op::Keep {
                    until,
                    leases: leases.iter().map(|&(k, t)| (k, token_of(t))).collect(),
                };
                let answer = self.call(broker, op);
                if let Answer::Kept(answers) = &answer {
                    for (&(key, token), a) in leases.iter().zip(answers) {
                        if let Answer::Held { .. } = a {
                            self.remember_held(broker, key, token);
                        }
                    }
                }
                answer
            }
            Step::Leave { broker, key, token } => {
                let t = token_of(token);
                // A grant its waiter did not take is released (LEAVE leaves a granted lease).
                if key != SEMAPHORE && self.unhand(broker, key, t) {
                    self.direct.note("direct grant released on a leave");
                    self.release(broker, key, t);
                    return Answer::Left(false);
                }
                self.call(broker, Op::Leave { key, token: t })
            }
            Step::Force { broker, key } => {
                let answer = self.call(broker, Op::Force { key });
                if let Answer::Forced(fences) = &answer
                    && let Some(top) = fences.iter().max()
                {
                    forget(&mut self.ledgers[broker as usize], key, *top, true);
                }
                answer
            }
            Step::ClaimAll { .. } => self.claim_all(step, None),
            Step::Batch { .. } => self.batch(step, None),
            Step::Tick => {
                self.call(0, Op::Tick);
                for ledger in &mut self.ledgers {
                    for e in ledger.iter_mut() {
                        e.left -= 1;
                    }
                    ledger.retain(|e| e.left > 0);
                }
                self.tick_handed();
                Answer::Done
            }
            Step::Flush => {
                self.step(&Step::Tick);
                self.flush();
                Answer::Done
            }
            Step::FlushClaimAll(ref claim) => {
                self.step(&Step::Tick);
                let answer = self.stale_claim_all(claim);
                self.catch_up();
                answer
            }
            Step::FlushBatch(ref batch) => {
                self.step(&Step::Tick);
                let answer = self.stale_batch(batch);
                self.catch_up();
                answer
            }
        }
    }

    /// FLUSHALL, then each broker's CHECK and PUT_BACK, and the hold ticked out.
    pub(crate) fn flush(&mut self) {
        self.call(0, Op::Flush);
        self.catch_up();
    }

    /// Each broker's CHECK and PUT_BACK after a loss, and the hold ticked out.
    pub(crate) fn catch_up(&mut self) {
        for b in 0..2u8 {
            let Answer::Epoch(epoch) = self.call(b, Op::Check) else {
                unreachable!()
            };
            let leases = self.ledgers[b as usize].clone();
            let op = Op::PutBack { epoch, leases };
            self.store.apply(
                &self.params,
                &Call {
                    broker: b,
                    known: Some(epoch),
                    op,
                },
            );
        }
        while self.store.marker.is_some_and(|m| m.hold > 0) {
            self.step(&Step::Tick);
        }
        self.told.clear();
    }
}

/// Before a lease of `kind` for `token` on `key` is recorded, as the broker's ledger records it
/// (`Ledger::record`): the token's entry on the key goes, and an exclusive lease replaces
/// whatever exclusive lease the key had (the ledger keeps one per key).
fn make_room(ledger: &mut Vec<Back>, key: u8, kind: Kind, token: Token) {
    let exclusive = kind == Kind::Exclusive;
    ledger.retain(|e| e.key != key || (e.token != token && !(exclusive && e.kind == kind)));
}

/// An end notice, as the broker's ledger takes it (`Ledger::forget_ended`): the lease with
/// `fence` is over, and so is every exclusive lease on the key with a lower fence (the ended
/// one came after it) — with `all`, every lease up to `fence`.
fn forget(ledger: &mut Vec<Back>, key: u8, fence: Fence, all: bool) {
    ledger.retain(|e| {
        let up_to = all || e.kind == Kind::Exclusive;
        e.key != key || !(e.fence == fence || (up_to && e.fence <= fence))
    });
}

/// A sequence of `n` steps from `seed`, each chosen from what the model's state offers.
pub(crate) fn generate(seed: u64, n: usize) -> Vec<Step> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut model = ModelSide::new();
    let mut steps = Vec::with_capacity(n);
    let mut next_token = 0usize;
    let mut since_tick = 0;
    let mut set = batch::prefix(&mut next_token);
    let batch_set = set.len();
    set.extend(several::prefix(&mut next_token));
    for (i, step) in set.into_iter().take(n).enumerate() {
        if i == batch_set {
            // CLAIM_ALL's set steps begin on free keys.
            assert_eq!(
                several::why(&model, &[0, 1]),
                "free",
                "after BATCH's set steps"
            );
        }
        since_tick = if matches!(step, Step::Tick | Step::FlushBatch(_)) {
            0
        } else {
            since_tick + 1
        };
        model.step(&step);
        steps.push(step);
    }
    while steps.len() < n {
        let broker = rng.random_range(0..2u8);
        let key = rng.random_range(0..KEYS);
        // Tokens queued or holding on some key, by the model.
        let mut known: Vec<usize> = model.bids.keys().copied().collect();
        known.sort_unstable();
        let pick = |rng: &mut StdRng, known: &[usize], fresh: usize| {
            if known.is_empty() || rng.random_bool(0.1) {
                fresh
            } else {
                known[rng.random_range(known.len().saturating_sub(8)..known.len())]
            }
        };
        let roll = rng.random_range(0..100);
        let step = if since_tick >= 16 || roll < 2 {
            Step::Tick
        } else if let Some(step) = model.handed_step(&mut rng) {
            step
        } else if rng.random_bool(0.004) {
            match rng.random_range(0..3) {
                0 => Step::Flush,
                1 => {
                    let claim = several::claim_all(&mut rng, broker, next_token);
                    Step::FlushClaimAll(Box::new(claim))
                }
                _ => Step::FlushBatch(Box::new(batch::step(
                    &mut rng,
                    &model,
                    broker,
                    &mut next_token,
                    true,
                ))),
            }
        } else if rng.random_bool(if batch::free_keys(&model).is_empty() {
            0.05
        } else {
            0.2
        }) {
            batch::step(&mut rng, &model, broker, &mut next_token, false)
        } else if rng.random_bool(several::chance(&model)) {
            several::claim_all(&mut rng, broker, next_token)
        } else if rng.random_bool(0.12) {
            sessions::step(&mut rng, &model, broker, key, &known, next_token)
        } else if roll < 40 {
            let token = pick(&mut rng, &known, next_token);
            match model.bids.get(&token) {
                // The same bid asks again through its broker.
                Some(b) => Step::Claim {
                    broker: b.broker,
                    key: key_of(&model, token).unwrap_or(key),
                    token,
                    shared: b.kind != Kind::Exclusive,
                    long: b.ttl == LONG,
                    wait: true,
                    session: b.session,
                },
                None => Step::Claim {
                    broker,
                    key,
                    token,
                    shared: rng.random_bool(0.3),
                    long: rng.random_bool(0.3),
                    wait: rng.random_bool(0.7),
                    session: rng.random_bool(0.2),
                },
            }
        } else if roll < 45 {
            // TAKE_OVER is for lock keys.
            Step::TakeOver {
                broker,
                key: key % SEMAPHORE,
                token: next_token,
                long: rng.random_bool(0.3),
            }
        } else if roll < 65 {
            let token = pick(&mut rng, &known, next_token);
            let (broker, key) = several::home(&mut rng, &model, token).unwrap_or((broker, key));
            Step::Release { broker, key, token }
        } else if roll < 78 {
            // Half of the renewals are of a lease held now.
            let held = holding(&model);
            let token = if !held.is_empty() && rng.random_bool(0.5) {
                held[rng.random_range(0..held.len())]
            } else {
                pick(&mut rng, &known, next_token)
            };
            let (broker, key) = several::home(&mut rng, &model, token).unwrap_or((broker, key));
            Step::Renew {
                broker,
                key,
                token,
                long: rng.random_bool(0.3),
                until: rng.random_bool(0.3),
            }
        } else if roll < 94 {
            let token = pick(&mut rng, &known, next_token);
            let (broker, key) = home(&model, token).unwrap_or((broker, key));
            Step::Leave { broker, key, token }
        } else {
            Step::Force { broker, key }
        };
        if let Step::Claim { token, .. }
        | Step::TakeOver { token, .. }
        | Step::ClaimAll { token, .. }
        | Step::Session {
            op: SessStep::Enter { token, .. },
            ..
        } = step
            && token == next_token
        {
            next_token += 1;
        }
        if let Step::FlushClaimAll(_) = step {
            next_token += 1;
        }
        let ticked = matches!(
            step,
            Step::Tick | Step::Flush | Step::FlushClaimAll(_) | Step::FlushBatch(_)
        );
        since_tick = if ticked { 0 } else { since_tick + 1 };
        model.step(&step);
        steps.push(step);
    }
    steps
}

/// Records a lease that a renewal answered held in the broker's ledger, with its end as the
/// store now has it (a renewal by `until`, or of a lease under a session, may keep it).
impl ModelSide {
    fn remember_held(&mut self, broker: u8, key: u8, token: usize) {
        let t = token_of(token);
        let k = &self.store.keys[key as usize];
        let Some(l) = k.lock.iter().chain(k.pool.iter()).find(|l| l.token == t) else {
            return;
        };
        let (fence, left) = (l.fence, l.left);
        let (kind, session) = self
            .bids
            .get(&token)
            .map_or((Kind::Exclusive, false), |b| (b.kind, b.session));
        let ledger = &mut self.ledgers[broker as usize];
        make_room(ledger, key, kind, t);
        ledger.push(Back {
            key,
            kind,
            token: t,
            fence,
            left,
            session,
        });
    }
}

/// The tokens that hold a live lease (not an offer), by the model.
pub(crate) fn holding(model: &ModelSide) -> Vec<usize> {
    let mut out: Vec<usize> = model
        .store
        .keys
        .iter()
        .flat_map(|k| k.lock.iter().chain(k.pool.iter()))
        .filter(|l| l.live() && !l.offered)
        .map(|l| l.token.client as usize + 256 * l.token.attempt as usize)
        .collect();
    out.sort_unstable();
    out
}

pub(crate) fn key_of(model: &ModelSide, token: usize) -> Option<u8> {
    model.keys_of.get(&token).copied()
}

fn home(model: &ModelSide, token: usize) -> Option<(u8, u8)> {
    Some((model.bids.get(&token)?.broker, key_of(model, token)?))
}

/// Drops steps from a failing sequence while it still fails (chunks halving down to single
/// steps), within a time budget: the shortest failing sequence found, and its disagreement.
pub(crate) async fn shrink(mut steps: Vec<Step>, mut what: String) -> (Vec<Step>, String) {
    let budget = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut chunk = steps.len() / 2;
    while chunk >= 1 && std::time::Instant::now() < budget {
        let mut i = 0;
        while i < steps.len() && std::time::Instant::now() < budget {
            let mut trial = steps.clone();
            trial.drain(i..(i + chunk).min(steps.len()));
            match run_steps(&trial).await {
                Outcome::Disagreed { at, what: w } => {
                    trial.truncate(at + 1);
                    steps = trial;
                    what = w;
                }
                _ => i += chunk,
            }
        }
        chunk /= 2;
    }
    (steps, what)
}
