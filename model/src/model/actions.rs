//! The model's actions, each named after the script it runs (or the event it stands for), and
//! what a broker does with the answer (`src/lock/acquire.rs`, `waiters.rs`, `release.rs`; the
//! ledger and put-back of `src/store/`).

use super::{Client, Entry, LockModel, Phase, State};
use crate::store::{Answer, Back, Bid, Call, Effects, Key, Kind, Notice, Op, Token};

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
}

const DEATHS: usize = 0;
const LOSSES: usize = 1;
const FORCES: usize = 2;
const CLOCK_BACKS: usize = 3;
const SLACKS: usize = 4;

impl LockModel {
    pub(super) fn actions_of(&self, s: &State, out: &mut Vec<Action>) {
        let c = &self.cfg;
        for (i, cl) in s.clients.iter().enumerate() {
            let i = i as u8;
            let (b, _, _) = c.clients[i as usize];
            if !s.brokers[b as usize].alive {
                continue;
            }
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
        }
        for (b, br) in s.brokers.iter().enumerate() {
            let b = b as u8;
            if !br.alive {
                continue;
            }
            for n in &br.inbox {
                for keep in [false, true] {
                    out.push(Action::Deliver {
                        broker: b,
                        notice: n.clone(),
                        keep,
                    });
                }
                out.push(Action::Lose {
                    broker: b,
                    notice: n.clone(),
                });
            }
            if s.used[DEATHS] < c.deaths {
                out.push(Action::Die(b));
            }
            if s.used[FORCES] < c.forces {
                for k in 0..c.keys {
                    out.push(Action::Force(b, k));
                }
            }
            if br.catching.is_some() {
                out.push(Action::PutBack(b));
            } else if s.store.marker.map(|m| m.id) != br.known {
                out.push(Action::Check(b));
            }
        }
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
    fn fair_to_tick(&self, s: &State) -> bool {
        let marker = s.store.marker.map(|m| m.id);
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

    fn bid(&self, i: u8, token: Token) -> (Key, Bid) {
        let (broker, key, kind) = self.cfg.clients[i as usize];
        (
            key,
            Bid {
                token,
                broker,
                kind,
                ttl: self.cfg.ttl,
            },
        )
    }

    /// Runs one script for broker `b`, and records what the properties watch.
    fn run(&self, s: &mut State, b: u8, op: Op) -> Answer {
        let call = Call {
            broker: b,
            known: s.brokers[b as usize].known,
            op,
        };
        let (answer, fx) = s.store.apply(&self.cfg.params(), &call);
        self.effects(s, fx);
        answer
    }

    fn effects(&self, s: &mut State, fx: Effects) {
        for (k, f) in &fx.fences {
            if *f <= s.top[*k as usize] {
                s.fence_fault = true;
            }
            s.top[*k as usize] = s.top[*k as usize].max(*f);
        }
        for k in fx.freed {
            if self.head_fits(s, k) {
                s.lost_offer = true;
            }
        }
        for (b, n) in fx.notices {
            let br = &mut s.brokers[b as usize];
            let inbox = &mut br.inbox;
            if br.alive && !inbox.contains(&n) {
                inbox.push(n);
                inbox.sort();
            }
        }
    }

    /// After a step that freed key `k`: whether the queue's head could be granted now and the
    /// store may hand on (a lost offer).
    pub(super) fn head_fits(&self, s: &State, k: Key) -> bool {
        let ks = &s.store.keys[k as usize];
        let Some(head) = ks.queue.first() else {
            return false;
        };
        if !matches!(s.store.marker, Some(m) if m.hold == 0) {
            return false;
        }
        let xlive = ks.lock.as_ref().is_some_and(|l| l.live());
        let live = ks.pool.iter().filter(|l| l.live()).count();
        match head.kind {
            Kind::Exclusive => !xlive && live == 0,
            Kind::Shared => !xlive,
            Kind::Permit(n) => (live as u8) < n,
        }
    }

    /// What a broker does with a granting script's answer for client `i`.
    fn on_grant(&self, s: &mut State, i: u8, token: Token, answer: Answer) {
        let (b, key, kind) = self.cfg.clients[i as usize];
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
                let ledger = &mut s.brokers[b as usize].ledger;
                ledger.retain(|e| e.token != token);
                ledger.push(Entry {
                    key,
                    token,
                    kind,
                    fence,
                    left,
                });
                ledger.sort();
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
                    for (j, cl) in s.clients.iter_mut().enumerate() {
                        if let Phase::Holding { fence, ended, .. } = &mut cl.phase
                            && self.cfg.clients[j].1 == key
                            && fences.contains(fence)
                        {
                            *ended = true;
                        }
                    }
                    s.brokers[b as usize].ledger.retain(|e| e.key != key);
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
                for (j, cl) in s.clients.iter_mut().enumerate() {
                    if let Phase::Holding { token, ended, .. } = &mut cl.phase {
                        let remembered = s
                            .brokers
                            .iter()
                            .any(|br| br.alive && br.ledger.iter().any(|e| e.token == *token));
                        let _ = j;
                        if !remembered {
                            *ended = true;
                        }
                    }
                }
            }
            Action::Slack(k) => {
                s.used[SLACKS] += 1;
                self.run(s, 0, Op::Slack { key: k });
            }
            Action::ClockBack => {
                s.used[CLOCK_BACKS] += 1;
                s.store.us = s.store.us.saturating_sub(2 * crate::store::US_STEP);
            }
        }
    }

    fn release(&self, s: &mut State, i: u8) {
        let Phase::Holding { token, .. } = s.clients[i as usize].phase else {
            return;
        };
        let (b, key, _) = self.cfg.clients[i as usize];
        match self.run(s, b, Op::Release { key, token }) {
            Answer::HoldInForce => {}
            _ => {
                s.brokers[b as usize].ledger.retain(|e| e.token != token);
                finish(&mut s.clients[i as usize]);
            }
        }
    }

    fn renew(&self, s: &mut State, i: u8) {
        let Phase::Holding { token, .. } = s.clients[i as usize].phase else {
            return;
        };
        let (b, key, kind) = self.cfg.clients[i as usize];
        let ttl = self.cfg.ttl;
        match self.run(s, b, Op::Renew { key, token, ttl }) {
            Answer::Held { fence } => {
                if let Phase::Holding { left, renewed, .. } = &mut s.clients[i as usize].phase {
                    *left = ttl;
                    *renewed += 1;
                }
                let ledger = &mut s.brokers[b as usize].ledger;
                ledger.retain(|e| e.token != token);
                ledger.push(Entry {
                    key,
                    token,
                    kind,
                    fence,
                    left: ttl,
                });
                ledger.sort();
            }
            Answer::HoldInForce => {}
            _ => {
                s.brokers[b as usize].ledger.retain(|e| e.token != token);
                finish(&mut s.clients[i as usize]);
            }
        }
    }

    fn put_back(&self, s: &mut State, b: u8) {
        let Some(epoch) = s.brokers[b as usize].catching else {
            return;
        };
        let leases: Vec<Back> = s.brokers[b as usize]
            .ledger
            .iter()
            .map(|e| Back {
                key: e.key,
                kind: e.kind,
                token: e.token,
                fence: e.fence,
                left: e.left,
            })
            .collect();
        let answer = self.run(s, b, Op::PutBack { epoch, leases });
        let br = &mut s.brokers[b as usize];
        br.catching = None;
        if answer != Answer::EpochMoved {
            br.known = Some(epoch);
        }
    }

    fn deliver(&self, s: &mut State, b: u8, notice: &Notice) {
        match *notice {
            Notice::Offered(key, token) => {
                let waiting = s.clients.iter().enumerate().position(|(j, cl)| {
                    self.cfg.clients[j].0 == b
                        && matches!(cl.phase, Phase::Waiting { token: t, .. } if t == token)
                });
                match waiting {
                    Some(j) => {
                        if let Phase::Waiting { due, .. } = &mut s.clients[j].phase {
                            *due = true;
                        }
                    }
                    // No waiter of that token (it left): the key passes on at once.
                    None => {
                        self.run(s, b, Op::Leave { key, token });
                    }
                }
            }
            Notice::Look(key, ticks) => {
                for (j, cl) in s.clients.iter_mut().enumerate() {
                    if self.cfg.clients[j].0 == b
                        && self.cfg.clients[j].1 == key
                        && let Phase::Waiting { timer, .. } = &mut cl.phase
                    {
                        *timer = (*timer).min(ticks);
                    }
                }
            }
            Notice::Requeue(key) => self.all_waiters_due(s, b, Some(key)),
            Notice::Ended(key, fence, all) => {
                s.brokers[b as usize]
                    .ledger
                    .retain(|e| e.key != key || !(e.fence == fence || (all && e.fence <= fence)));
            }
        }
    }

    fn all_waiters_due(&self, s: &mut State, b: u8, key: Option<Key>) {
        for (j, cl) in s.clients.iter_mut().enumerate() {
            let (cb, ck, _) = self.cfg.clients[j];
            if cb == b
                && key.is_none_or(|k| k == ck)
                && let Phase::Waiting { due, .. } = &mut cl.phase
            {
                *due = true;
            }
        }
    }

    fn tick(&self, s: &mut State) {
        // What held each key back in the tick that ends now.
        for k in 0..self.cfg.keys {
            let ks = &s.store.keys[k as usize];
            let dead_offer = |l: &crate::store::Lease| {
                l.live() && l.offered && (0..8).all(|b| l.by & (1 << b) == 0 || !s.brokers[b].alive)
            };
            let blockers: Vec<_> = ks
                .lock
                .iter()
                .chain(ks.pool.iter())
                .filter(|l| l.live())
                .collect();
            let live_waiter = s.clients.iter().enumerate().any(|(j, cl)| {
                let (b, ck, _) = self.cfg.clients[j];
                ck == k && s.brokers[b as usize].alive && matches!(cl.phase, Phase::Waiting { .. })
            });
            let only_dead = !blockers.is_empty() && blockers.iter().all(|l| dead_offer(l));
            let d = &mut s.dead_block[k as usize];
            *d = if only_dead && live_waiter {
                d.saturating_add(1).min(100)
            } else {
                0
            };
            let cap = self.cfg.max_stall() + 1;
            let st = &mut s.stall[k as usize];
            *st = if live_waiter { (*st + 1).min(cap) } else { 0 };
        }
        self.run(s, 0, Op::Tick);
        for cl in &mut s.clients {
            match &mut cl.phase {
                Phase::Waiting { timer, .. } => *timer = timer.saturating_sub(1),
                Phase::Holding { left, .. } => {
                    *left -= 1;
                    if *left == 0 {
                        finish(cl);
                    }
                }
                _ => {}
            }
        }
        for br in &mut s.brokers {
            for e in &mut br.ledger {
                e.left -= 1;
            }
            br.ledger.retain(|e| e.left > 0);
        }
    }
}

/// The acquire is over (released, ended, refused, given up): the next one may start.
fn finish(cl: &mut Client) {
    cl.phase = Phase::Idle;
    cl.attempt += 1;
}
