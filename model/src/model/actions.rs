//! The model's actions, each named after the script it runs (or the event it stands for), and
//! what a broker does with the answer (`core/src/lock/acquire.rs`, `waiters.rs`, `release.rs`; the
//! ledger and put-back of `redis-store/src/`).

use super::{Entry, LockModel, Phase, State, finish};
use crate::store::{Answer, Bid, Call, Fence, Key, Kind, Notice, Op, Token};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A waiting acquire's first CLAIM (exclusive) or JOIN (shared, permit).
    ClaimWaiting(u8),
    /// A waiting acquire asks again (CLAIM/JOIN with its token): takes an offer, rejoins.
    AskAgain(u8),
    /// An acquire that does not wait: CLAIM (then READ if refused) or JOIN.
    ClaimNow(u8),
    /// TAKE_OVER of the expired lease it read.
    TakeOver(u8),
    /// LEAVE: the waiter gives up (its wait ran out, its client went away).
    Leave(u8),
    Release(u8),
    Renew(u8),
    /// FORCE through a broker.
    Force(u8, Key),
    /// A notice reaches its broker (`keep`: it will arrive again — a duplicate).
    Deliver {
        broker: u8,
        notice: Notice,
        keep: bool,
    },
    Lose {
        broker: u8,
        notice: Notice,
    },
    Die(u8),
    /// CHECK, then (a separate step) PUT_BACK of the broker's ledger.
    Check(u8),
    PutBack(u8),
    Tick,
    Flush,
    Slack(Key),
    ClockBack,
    /// A step of the client under a session.
    Session(super::SessAction),
    /// A step of a several-keys client.
    Several(u8, super::SevAction),
    /// A claim or release joins its broker's next batch instead of going alone.
    Batched(u8, super::Pend),
    /// The broker's gathered operations go out as one BATCH call.
    Batch(u8),
    /// An operation that BATCH answered SLOW runs alone.
    Alone(u8),
}

pub(super) const DEATHS: usize = 0;
const LOSSES: usize = 1;
pub(super) const FORCES: usize = 2;
const CLOCK_BACKS: usize = 3;
const SLACKS: usize = 4;

impl LockModel {
    pub(super) fn actions_of(&self, s: &State, out: &mut Vec<Action>) {
        let c = &self.cfg;
        for (i, cl) in s.clients.iter().enumerate() {
            let i = i as u8;
            let (b, _, _) = c.clients[i as usize];
            if !s.brokers[b as usize].alive || self.in_batch(s, i) {
                continue;
            }
            if cl.slow.is_some() {
                out.push(Action::Alone(i));
                continue;
            }
            let first = out.len();
            match cl.phase {
                Phase::Idle if cl.attempt < c.attempts[i as usize] => {
                    out.push(Action::ClaimWaiting(i));
                    out.push(Action::ClaimNow(i));
                }
                Phase::Waiting { .. } => {
                    out.push(Action::AskAgain(i));
                    out.push(Action::Leave(i));
                }
                Phase::Seen { .. } => out.push(Action::TakeOver(i)),
                Phase::Holding { renewed, left, .. } if left > 0 => {
                    out.push(Action::Release(i));
                    if renewed < c.renews {
                        out.push(Action::Renew(i));
                    }
                }
                _ => {}
            }
            self.batch_actions(out, first);
        }
        self.broker_actions(s, out);
        self.sess_actions(s, out);
        self.sev_actions(s, out);
        if self.fair_to_tick(s) {
            out.push(Action::Tick);
        }
        if s.used[LOSSES] < c.losses && s.used[CLOCK_BACKS] == 0 {
            out.push(Action::Flush);
        }
        // Fences rise as long as the clock does not step back while nothing holds a key (see
        // fast/claim.lua): it steps back only while every key has a lease record.
        let all_held = s
            .store
            .keys
            .iter()
            .all(|k| k.lock.is_some() || !k.pool.is_empty());
        if s.used[CLOCK_BACKS] < c.clock_backs && s.used[LOSSES] == 0 && all_held {
            out.push(Action::ClockBack);
        }
        if s.used[SLACKS] < c.slacks && s.used[CLOCK_BACKS] == 0 {
            for (k, ks) in s.store.keys.iter().enumerate() {
                let idle = ks.queue.is_empty()
                    && ks.lock.as_ref().is_none_or(|l| !l.live())
                    && ks.pool.iter().all(|l| !l.live());
                if idle && (ks.lock.is_some() || !ks.pool.is_empty() || ks.counter.is_some()) {
                    out.push(Action::Slack(k as Key));
                }
            }
        }
    }

    /// Fair scheduling, as time is concerned: a tick waits until every live broker has done
    /// what is due before it — a waiter whose timer rang or that was offered the key or told to
    /// requeue asks, and a broker that is not in the store's epoch catches up (the settle hold
    /// is longer than a broker takes to notice a loss and put its leases back: the assumption
    /// `store_settle_ms` documents).
    pub(super) fn fair_to_tick(&self, s: &State) -> bool {
        let marker = s.store.marker.map(|m| m.id);
        if self.sess_due(s) || self.sev_due(s) || self.batch_due(s) {
            return false;
        }
        for (b, br) in s.brokers.iter().enumerate() {
            if br.alive && br.known != marker {
                return false;
            }
            for (i, cl) in s.clients.iter().enumerate() {
                if self.cfg.clients[i].0 as usize != b || !br.alive {
                    continue;
                }
                if let Phase::Waiting { timer, due, .. } = cl.phase
                    && (timer == 0 || due)
                {
                    return false;
                }
            }
        }
        true
    }

    pub(super) fn bid(&self, i: u8, token: Token) -> (Key, Bid) {
        let (broker, key, kind) = self.cfg.clients[i as usize];
        (
            key,
            Bid {
                token,
                broker,
                kind,
                ttl: self.cfg.ttl,
                session: false,
            },
        )
    }

    /// Runs one script for broker `b`, and records what the properties watch (`run`, in
    /// handed.rs, is the Redis store's call around it).
    pub(super) fn script(&self, s: &mut State, b: u8, op: Op) -> Answer {
        let call = Call {
            broker: b,
            known: s.brokers[b as usize].known,
            op,
        };
        let (answer, fx) = s.store.apply(&self.cfg.params(), &call);
        self.effects(s, fx);
        answer
    }

    /// What a broker does with a granting script's answer for client `i`.
    /// Records client `i`'s lease, granted or renewed through its broker, in that broker's
    /// ledger.
    pub(super) fn remember_client(
        &self,
        s: &mut State,
        i: u8,
        token: Token,
        fence: Fence,
        left: u8,
    ) {
        let (b, key, kind) = self.cfg.clients[i as usize];
        let entry = Entry {
            key,
            token,
            kind,
            fence,
            left,
            session: false,
        };
        super::remember(&mut s.brokers[b as usize].ledger, entry);
    }

    pub(super) fn on_grant(&self, s: &mut State, i: u8, token: Token, answer: Answer) {
        let (_, key, _) = self.cfg.clients[i as usize];
        let cl = &mut s.clients[i as usize];
        match answer {
            Answer::Granted { fence, left, .. } => {
                cl.phase = Phase::Holding {
                    token,
                    fence,
                    left,
                    renewed: 0,
                    ended: false,
                };
                s.stall[key as usize] = 0;
                self.remember_client(s, i, token, fence, left);
            }
            Answer::Queued { retry } => {
                let timer = retry.min(self.cfg.poll).max(1);
                cl.phase = Phase::Waiting {
                    token,
                    timer,
                    due: false,
                };
            }
            Answer::OnHold { left } => {
                cl.phase = Phase::Waiting {
                    token,
                    timer: left.max(1),
                    due: false,
                };
            }
            // The broker catches up (CHECK, PUT_BACK), then asks again.
            Answer::OtherEpoch => {
                cl.phase = Phase::Waiting {
                    token,
                    timer: 0,
                    due: true,
                }
            }
            _ => finish(cl),
        }
    }

    pub(super) fn step(&self, s: &mut State, action: &Action) {
        match *action {
            Action::ClaimWaiting(i) | Action::AskAgain(i) => {
                let token = match s.clients[i as usize].phase {
                    Phase::Waiting { token, .. } => token,
                    _ => Token {
                        client: i,
                        attempt: s.clients[i as usize].attempt,
                    },
                };
                let (key, bid) = self.bid(i, token);
                let b = bid.broker;
                let op = match bid.kind {
                    Kind::Exclusive => Op::Claim {
                        key,
                        bid,
                        wait: true,
                    },
                    _ => Op::Join {
                        key,
                        bid,
                        wait: true,
                    },
                };
                let answer = self.run(s, b, op);
                self.on_grant(s, i, token, answer);
            }
            Action::ClaimNow(i) => {
                let token = Token {
                    client: i,
                    attempt: s.clients[i as usize].attempt,
                };
                let (key, bid) = self.bid(i, token);
                let b = bid.broker;
                let exclusive = bid.kind == Kind::Exclusive;
                let op = if exclusive {
                    Op::Claim {
                        key,
                        bid,
                        wait: false,
                    }
                } else {
                    Op::Join {
                        key,
                        bid,
                        wait: false,
                    }
                };
                let answer = self.run(s, b, op);
                if exclusive && answer == Answer::Refused {
                    // The recipe reads the key; an expired lease may be taken over.
                    if let Answer::Record(Some((_, fence, false))) =
                        self.run(s, b, Op::Read { key })
                    {
                        s.clients[i as usize].phase = Phase::Seen { token, fence };
                        return;
                    }
                }
                self.on_grant(s, i, token, answer);
                if let Phase::Waiting { .. } = s.clients[i as usize].phase {
                    // A bid that does not wait is never queued; on a hold or another epoch it
                    // is answered "not now".
                    finish(&mut s.clients[i as usize]);
                }
            }
            Action::TakeOver(i) => {
                let Phase::Seen { token, fence } = s.clients[i as usize].phase else {
                    return;
                };
                let (key, bid) = self.bid(i, token);
                let answer = self.run(
                    s,
                    bid.broker,
                    Op::TakeOver {
                        key,
                        bid,
                        seen: fence,
                    },
                );
                self.on_grant(s, i, token, answer);
                if let Phase::Waiting { .. } = s.clients[i as usize].phase {
                    finish(&mut s.clients[i as usize]);
                }
            }
            Action::Leave(i) => {
                let Phase::Waiting { token, .. } = s.clients[i as usize].phase else {
                    return;
                };
                let (b, key, _) = self.cfg.clients[i as usize];
                self.run(s, b, Op::Leave { key, token });
                finish(&mut s.clients[i as usize]);
            }
            Action::Release(i) => self.release(s, i),
            Action::Renew(i) => self.renew(s, i),
            Action::Force(b, key) => {
                s.used[FORCES] += 1;
                if let Answer::Forced(fences) = self.run(s, b, Op::Force { key }) {
                    s.brokers[b as usize].ledger.retain(|e| e.key != key);
                    self.forced(s, key, &fences);
                }
            }
            Action::Deliver {
                broker,
                ref notice,
                keep,
            } => {
                if !keep {
                    s.brokers[broker as usize].inbox.retain(|n| n != notice);
                }
                self.deliver(s, broker, notice);
            }
            Action::Lose { broker, ref notice } => {
                s.brokers[broker as usize].inbox.retain(|n| n != notice);
            }
            Action::Die(b) => {
                s.used[DEATHS] += 1;
                let br = &mut s.brokers[b as usize];
                br.alive = false;
                br.inbox.clear();
                br.handed.clear();
            }
            Action::Check(b) => {
                if let Answer::Epoch(id) = self.run(s, b, Op::Check) {
                    let br = &mut s.brokers[b as usize];
                    if br.known != Some(id) {
                        br.catching = Some(id);
                        // Notice::Missed: every waiter asks again once caught up.
                        self.all_waiters_due(s, b, None);
                    }
                }
            }
            Action::PutBack(b) => self.put_back(s, b),
            Action::Tick => self.tick(s),
            Action::Flush => {
                s.used[LOSSES] += 1;
                self.run(s, 0, Op::Flush);
                // A lease no live broker remembers is not put back (documented; the paranoid
                // `store_loss_delay_ms` covers it): its holder no longer counts.
                for cl in &mut s.clients {
                    if let Phase::Holding { token, ended, .. } = &mut cl.phase {
                        let remembered = s
                            .brokers
                            .iter()
                            .any(|br| br.alive && br.ledger.iter().any(|e| e.token == *token));
                        if !remembered {
                            *ended = true;
                        }
                    }
                }
                let brokers = s.brokers.clone();
                let gone = |(_, key, token): (Fence, Key, Token)| {
                    !brokers.iter().any(|br| {
                        br.alive && br.ledger.iter().any(|e| e.token == token && e.key == key)
                    })
                };
                self.sess_ended(s, gone);
                self.sev_ended(s, gone);
            }
            Action::Slack(k) => {
                s.used[SLACKS] += 1;
                self.run(s, 0, Op::Slack { key: k });
            }
            Action::ClockBack => {
                s.used[CLOCK_BACKS] += 1;
                s.store.us = s.store.us.saturating_sub(2 * crate::store::US_STEP);
            }
            Action::Session(ref a) => self.sess_step(s, a),
            Action::Several(m, ref a) => self.sev_step(s, m, a),
            Action::Batched(i, pend) => {
                let b = self.cfg.clients[i as usize].0;
                s.brokers[b as usize].batch.push((i, pend));
            }
            Action::Batch(b) => self.run_batch(s, b),
            Action::Alone(i) => self.run_alone(s, i),
        }
    }
}
