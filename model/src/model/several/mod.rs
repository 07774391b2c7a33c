//! A client that acquires several keys at once, as `core/src/lock/several.rs` does: first every
//! key in one step (CLAIM_ALL, granted only if every key is free); when that is refused, the keys
//! taken one after another in sorted order (whatever order it named them in), each through its
//! key's own queue as a single waiting acquire, with the same token; the keys it holds kept
//! renewed while it waits for the next; on a refusal (its wait ran out) or when its client goes
//! away it leaves the queue it waits in and releases every key it took; a broker that dies
//! mid-way leaves them to end at their TTL (nothing renews them any more).

mod props;

use super::{Entry, LockModel, State};
use crate::store::{Answer, Bid, Bug, Fence, Key, Kind, Op, Token};

/// A several-keys client: its broker and its two keys, in the order it names them.
#[derive(Clone, Copy, Debug)]
pub struct SeveralCfg {
    pub broker: u8,
    pub keys: [Key; 2],
}

/// A key it took: its fence, ticks left, and whether it ended under it (force-released, or its
/// renewal found it gone).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Took {
    pub key: Key,
    pub fence: Fence,
    pub left: u8,
    pub ended: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    Idle,
    /// Taking the keys: it asks for the `next`-th key of its order (CLAIM that waits; `timer`
    /// and `due` as a single waiter's).
    Taking {
        next: u8,
        timer: u8,
        due: bool,
    },
    /// Granted every key.
    Holding,
    /// Over: granted and released (or ended), or refused / given up.
    Done {
        granted: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Several {
    pub step: Step,
    pub token: Token,
    pub took: Vec<Took>,
    /// Ticks it has been taking the keys on a live broker (capped past the bound).
    pub waited: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SevAction {
    /// The acquire starts: CLAIM_ALL of its keys; refused, it asks for the first key of its
    /// order next (a step of its own).
    Start,
    /// It asks (again) for the key it waits for.
    Ask,
    /// RENEW of every key it holds while it waits.
    Keep,
    /// Its wait ran out, or its client went away: LEAVE, then RELEASE of every key taken.
    GiveUp,
    /// Granted: RELEASE of every key.
    Release,
}

impl LockModel {
    /// Client `m`'s keys in the order it takes them: sorted (given, with `given-order`).
    pub(in crate::model) fn order(&self, m: usize) -> [Key; 2] {
        let mut keys = self.cfg.several[m].keys;
        if self.cfg.bug != Some(Bug::GivenOrder) {
            keys.sort();
        }
        keys
    }

    /// Its id in tokens: after the single-key clients and the session client.
    fn sev_client(&self, m: usize) -> u8 {
        (self.cfg.clients.len() + usize::from(self.cfg.session.is_some()) + m) as u8
    }

    /// The bound on a several-keys request's wait (ticks): each key's bounded progress in turn.
    pub(in crate::model) fn sev_bound(&self) -> u8 {
        2 * self.cfg.max_stall()
    }

    pub(in crate::model) fn sev_actions(&self, s: &State, out: &mut Vec<super::Action>) {
        for (m, sv) in s.several.iter().enumerate() {
            if !s.brokers[self.cfg.several[m].broker as usize].alive {
                continue;
            }
            let mut push = |a| out.push(super::Action::Several(m as u8, a));
            match sv.step {
                Step::Idle => push(SevAction::Start),
                Step::Taking { .. } => {
                    push(SevAction::Ask);
                    push(SevAction::GiveUp);
                    if self.sev_keep_due(sv) {
                        push(SevAction::Keep);
                    }
                }
                Step::Holding if sv.took.iter().any(|t| t.left > 0) => push(SevAction::Release),
                _ => {}
            }
        }
    }

    fn sev_keep_due(&self, sv: &Several) -> bool {
        sv.took.iter().any(|t| !t.ended && t.left < self.cfg.ttl)
    }

    /// What a live several-keys client must do before time passes: ask when its timer rang or
    /// it was offered or told to requeue, and renew the keys it holds (every third of their TTL
    /// in the code: within every tick here).
    pub(in crate::model) fn sev_due(&self, s: &State) -> bool {
        s.several.iter().enumerate().any(|(m, sv)| {
            s.brokers[self.cfg.several[m].broker as usize].alive
                && matches!(sv.step, Step::Taking { timer, due, .. }
                    if timer == 0 || due || self.sev_keep_due(sv))
        })
    }

    /// Whether a live several-keys client waits for key `k`.
    pub(in crate::model) fn sev_waits(&self, s: &State, k: Key) -> bool {
        s.several.iter().enumerate().any(|(m, sv)| {
            s.brokers[self.cfg.several[m].broker as usize].alive
                && matches!(sv.step, Step::Taking { next, .. } if self.order(m)[next as usize] == k)
        })
    }

    /// A notice for broker `b`: an offer to `token` (whether it was a several-keys client's),
    /// a requeue or missed notices (`token` none), or a look in `look` ticks.
    pub(in crate::model) fn sev_notice(
        &self,
        s: &mut State,
        b: u8,
        key: Option<Key>,
        token: Option<Token>,
        look: Option<u8>,
    ) -> bool {
        let mut mine = false;
        for (m, sv) in s.several.iter_mut().enumerate() {
            let order = self.order(m);
            let Step::Taking { next, timer, due } = &mut sv.step else {
                continue;
            };
            if self.cfg.several[m].broker != b || key.is_some_and(|k| k != order[*next as usize]) {
                continue;
            }
            if let Some(ticks) = look {
                *timer = (*timer).min(ticks);
            } else if token.is_none_or(|t| t == sv.token) {
                *due = true;
                mine |= token.is_some();
            }
        }
        mine
    }

    /// The keys taken whose `gone((fence, key, token))` no longer count as held.
    pub(in crate::model) fn sev_ended(
        &self,
        s: &mut State,
        gone: impl Fn((Fence, Key, Token)) -> bool,
    ) {
        for sv in &mut s.several {
            for t in &mut sv.took {
                if gone((t.fence, t.key, sv.token)) {
                    t.ended = true;
                }
            }
        }
    }

    pub(in crate::model) fn sev_tick(&self, s: &mut State) {
        let cap = self.sev_bound() + 1;
        for (m, sv) in s.several.iter_mut().enumerate() {
            let alive = s.brokers[self.cfg.several[m].broker as usize].alive;
            if let Step::Taking { timer, .. } = &mut sv.step {
                *timer = timer.saturating_sub(1);
                if alive {
                    sv.waited = (sv.waited + 1).min(cap);
                }
            }
            for t in &mut sv.took {
                t.left = t.left.saturating_sub(1);
            }
            sv.took.retain(|t| t.left > 0);
            if sv.step == Step::Holding && sv.took.is_empty() {
                sv.step = Step::Done { granted: true };
            }
        }
    }

    pub(in crate::model) fn sev_step(&self, s: &mut State, m: u8, a: &SevAction) {
        let m = m as usize;
        let b = self.cfg.several[m].broker;
        match a {
            SevAction::Start => {
                let sv = &mut s.several[m];
                sv.token = Token {
                    client: self.sev_client(m),
                    attempt: 0,
                };
                sv.step = Step::Taking {
                    next: 0,
                    timer: 0,
                    due: true,
                };
                sv.waited = 0;
                self.sev_claim_all(s, m);
            }
            SevAction::Ask => self.sev_ask(s, m),
            SevAction::Keep => {
                let (token, ttl) = (s.several[m].token, self.cfg.ttl);
                for j in 0..s.several[m].took.len() {
                    let Took { key, ended, .. } = s.several[m].took[j];
                    if ended {
                        continue;
                    }
                    let until = None;
                    match self.run(
                        s,
                        b,
                        Op::Renew {
                            key,
                            token,
                            ttl,
                            until,
                        },
                    ) {
                        Answer::Held { fence } => {
                            s.several[m].took[j].left = ttl;
                            self.sev_remember(s, b, key, token, fence);
                        }
                        Answer::HoldInForce => {}
                        // A renewal that fails is not fatal (several.rs): the lease is gone.
                        _ => s.several[m].took[j].ended = true,
                    }
                }
            }
            SevAction::GiveUp => {
                let order = self.order(m);
                let sv = &s.several[m];
                let (token, next) = match sv.step {
                    Step::Taking { next, .. } => (sv.token, next),
                    _ => return,
                };
                self.run(
                    s,
                    b,
                    Op::Leave {
                        key: order[next as usize],
                        token,
                    },
                );
                if self.cfg.bug != Some(Bug::RefusalKeepsKeys) {
                    self.sev_release(s, m);
                }
                let sv = &mut s.several[m];
                sv.took.clear();
                sv.step = Step::Done { granted: false };
            }
            SevAction::Release => {
                self.sev_release(s, m);
                let sv = &mut s.several[m];
                sv.took.clear();
                sv.step = Step::Done { granted: true };
            }
        }
    }

    fn sev_remember(&self, s: &mut State, b: u8, key: Key, token: Token, fence: Fence) {
        let entry = Entry {
            key,
            token,
            kind: Kind::Exclusive,
            fence,
            left: self.cfg.ttl,
            session: false,
        };
        // One token for every key: a ledger entry per key.
        let ledger = &mut s.brokers[b as usize].ledger;
        ledger.retain(|e| e.token != token || e.key != key);
        ledger.push(entry);
        ledger.sort();
    }

    /// RELEASE of every key it took (the code releases them together; one step here).
    fn sev_release(&self, s: &mut State, m: usize) {
        let b = self.cfg.several[m].broker;
        let token = s.several[m].token;
        let took: Vec<Key> = s.several[m].took.iter().map(|t| t.key).collect();
        for key in took {
            self.run(s, b, crate::model::handed::release_op(key, token));
        }
        s.brokers[b as usize].ledger.retain(|e| e.token != token);
    }

    /// CLAIM_ALL (`all_free` in several.rs): granted, it holds every key (one fence, the
    /// store's clock); otherwise nothing was written and it goes on with the sorted path, its
    /// first ask due before time passes. (Another epoch or a hold goes on the same way: the
    /// first key's CLAIM meets it as any ask.)
    fn sev_claim_all(&self, s: &mut State, m: usize) {
        let b = self.cfg.several[m].broker;
        let token = s.several[m].token;
        let bid = Bid {
            token,
            broker: b,
            kind: Kind::Exclusive,
            ttl: self.cfg.ttl,
            session: false,
        };
        let op = Op::ClaimAll {
            keys: self.cfg.several[m].keys.to_vec(),
            bid,
        };
        if let Answer::Granted { fence, left, .. } = self.run(s, b, op) {
            for key in self.order(m) {
                s.stall[key as usize] = 0;
                self.sev_remember(s, b, key, token, fence);
                s.several[m].took.push(Took {
                    key,
                    fence,
                    left,
                    ended: false,
                });
            }
            s.several[m].step = Step::Holding;
        }
    }

    /// CLAIM that waits, for the key it asks for now, and what it does with the answer.
    fn sev_ask(&self, s: &mut State, m: usize) {
        let b = self.cfg.several[m].broker;
        let order = self.order(m);
        let Step::Taking { next, .. } = s.several[m].step else {
            return;
        };
        let (key, token, ttl) = (order[next as usize], s.several[m].token, self.cfg.ttl);
        let bid = Bid {
            token,
            broker: b,
            kind: Kind::Exclusive,
            ttl,
            session: false,
        };
        let answer = self.run(
            s,
            b,
            Op::Claim {
                key,
                bid,
                wait: true,
            },
        );
        let (timer, due) = match answer {
            Answer::Granted { fence, left, .. } => {
                s.stall[key as usize] = 0;
                self.sev_remember(s, b, key, token, fence);
                let sv = &mut s.several[m];
                sv.took.push(Took {
                    key,
                    fence,
                    left,
                    ended: false,
                });
                if next == 1 {
                    sv.step = Step::Holding;
                    return;
                }
                sv.step = Step::Taking {
                    next: 1,
                    timer: 0,
                    due: true,
                };
                return;
            }
            Answer::Queued { retry } => (retry.min(self.cfg.poll).max(1), false),
            Answer::OnHold { left } => (left.max(1), false),
            Answer::OtherEpoch => (0, true),
            // Not granted, not queued: refused (what it took is released).
            _ => {
                self.sev_release(s, m);
                let sv = &mut s.several[m];
                sv.took.clear();
                sv.step = Step::Done { granted: false };
                return;
            }
        };
        s.several[m].step = Step::Taking { next, timer, due };
    }
}

impl Several {
    pub(in crate::model) fn new() -> Several {
        Several {
            step: Step::Idle,
            token: Token {
                client: 0,
                attempt: 0,
            },
            took: Vec::new(),
            waited: 0,
        }
    }
}
