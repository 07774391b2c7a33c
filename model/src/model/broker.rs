//! What a broker does besides asking: releases, renewals, its put-back after a loss, the
//! notices it receives, and what a tick does to its waiters' timers and its ledger.

use super::actions::{Action, DEATHS, FORCES};
use super::finish;
use super::{LockModel, Phase, State};
use crate::store::{Answer, Back, BackCode, Key, Notice, Op};

impl LockModel {
    pub(super) fn release(&self, s: &mut State, i: u8) {
        let Phase::Holding { token, .. } = s.clients[i as usize].phase else {
            return;
        };
        let (b, key, _) = self.cfg.clients[i as usize];
        match self.run(s, b, super::handed::release_op(key, token)) {
            Answer::HoldInForce => {}
            _ => {
                s.brokers[b as usize].ledger.retain(|e| e.token != token);
                finish(&mut s.clients[i as usize]);
            }
        }
    }

    pub(super) fn renew(&self, s: &mut State, i: u8) {
        let Phase::Holding { token, .. } = s.clients[i as usize].phase else {
            return;
        };
        let (b, key, _) = self.cfg.clients[i as usize];
        let ttl = self.cfg.ttl;
        match self.run(
            s,
            b,
            Op::Renew {
                key,
                token,
                ttl,
                until: None,
            },
        ) {
            Answer::Held { fence } => {
                if let Phase::Holding { left, renewed, .. } = &mut s.clients[i as usize].phase {
                    *left = ttl;
                    *renewed += 1;
                }
                self.remember_client(s, i, token, fence, ttl);
            }
            Answer::HoldInForce => {}
            _ => {
                s.brokers[b as usize].ledger.retain(|e| e.token != token);
                finish(&mut s.clients[i as usize]);
            }
        }
    }

    pub(super) fn put_back(&self, s: &mut State, b: u8) {
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
                session: e.session,
            })
            .collect();
        let answer = self.run(
            s,
            b,
            Op::PutBack {
                epoch,
                leases: leases.clone(),
            },
        );
        let br = &mut s.brokers[b as usize];
        // A lease another one with a higher fence displaced leaves the ledger (put_back.rs).
        if let Answer::PutBack(codes) = &answer {
            for (back, code) in leases.iter().zip(codes) {
                if *code == BackCode::OtherKept {
                    br.ledger
                        .retain(|e| e.token != back.token || e.key != back.key);
                }
            }
        }
        br.catching = None;
        if answer != Answer::EpochMoved {
            br.known = Some(epoch);
        }
    }

    pub(super) fn deliver(&self, s: &mut State, b: u8, notice: &Notice) {
        match *notice {
            Notice::Offered(key, token) => {
                if self.sess_notice(s, b, Some(key), Some(token), None)
                    || self.sev_notice(s, b, Some(key), Some(token), None)
                {
                    return;
                }
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
                self.sess_notice(s, b, Some(key), None, Some(ticks));
                self.sev_notice(s, b, Some(key), None, Some(ticks));
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

    pub(super) fn all_waiters_due(&self, s: &mut State, b: u8, key: Option<Key>) {
        self.sess_notice(s, b, key, None, None);
        self.sev_notice(s, b, key, None, None);
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

    pub(super) fn tick(&self, s: &mut State) {
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
            }) || self.sess_waits(s, k)
                || self.sev_waits(s, k);
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
        self.sess_tick(s);
        self.sev_tick(s);
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
            for h in &mut br.handed {
                h.left -= 1;
            }
            br.handed.retain(|h| h.left > 0);
        }
    }
}

impl LockModel {
    /// What each live broker may do next: take a notice (or lose it, or take it twice), die,
    /// force-release a key, send its gathered batch, put its leases back or check the epoch.
    pub(super) fn broker_actions(&self, s: &State, out: &mut Vec<Action>) {
        let c = &self.cfg;
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
            if !br.batch.is_empty() {
                out.push(Action::Batch(b));
            }
            if br.catching.is_some() {
                out.push(Action::PutBack(b));
            } else if s.store.marker.map(|m| m.id) != br.known {
                out.push(Action::Check(b));
            }
        }
    }
}
