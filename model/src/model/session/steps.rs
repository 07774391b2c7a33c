//! The session client's steps: each runs the store calls its broker makes, in order.

use super::super::{Entry, LockModel, State};
use super::{Acq, ID, Keeping, Life, Sess, SessAction};
use crate::store::{Answer, Bid, Bug, Fence, Key, Kind, Op, SessionOp, SessionRec, Token};

impl LockModel {
    /// SESSION through broker `b`.
    fn session_call(&self, s: &mut State, b: u8, op: SessionOp) -> Option<SessionRec> {
        let writes = matches!(op, SessionOp::Open { .. } | SessionOp::Renew);
        match self.run(s, b, Op::Session { id: ID, op }) {
            Answer::Session(Some(rec)) => {
                if writes {
                    Self::sess(s).written.move_to(rec.left);
                }
                Some(rec)
            }
            _ => None,
        }
    }

    pub(super) fn sess(s: &mut State) -> &mut Sess {
        s.sess.as_mut().expect("a session client")
    }

    /// RELEASE of a lease under the session; whether the store answered (no hold in force).
    fn sess_release(&self, s: &mut State, b: u8, key: Key, token: Token) -> bool {
        let answer = self.run(s, b, crate::model::handed::release_op(key, token));
        s.brokers[b as usize].ledger.retain(|e| e.token != token);
        answer != Answer::HoldInForce
    }

    /// Records a lease under the session in broker `b`'s ledger.
    fn sess_remember(&self, s: &mut State, b: u8, token: Token, fence: Fence, left: u8) {
        let c = self.sc();
        let entry = Entry {
            key: c.key,
            token,
            kind: Kind::Exclusive,
            fence,
            left,
            session: true,
        };
        crate::model::remember(&mut s.brokers[b as usize].ledger, entry);
    }

    pub(in crate::model) fn sess_step(&self, s: &mut State, a: &SessAction) {
        let c = self.sc();
        let me = self.sess_client();
        // The session's own calls go through its broker, the acquires through theirs.
        let (b, ab) = (c.broker, c.acquires_on);
        match a {
            SessAction::Open => {
                let op = SessionOp::Open {
                    ttl: c.ttl,
                    delay: c.delay,
                };
                let rec = self.session_call(s, b, op);
                let ss = Self::sess(s);
                match rec {
                    Some(rec) => {
                        ss.life = Life::Open;
                        ss.tell(&rec);
                    }
                    None => ss.life = Life::Over,
                }
            }
            SessAction::Enter => {
                let token = Token {
                    client: me,
                    attempt: Self::sess(s).attempt,
                };
                let rec = self.session_call(s, ab, SessionOp::Enter(c.key, token));
                let ss = Self::sess(s);
                match rec {
                    Some(rec) => {
                        ss.acq = Acq::Entered {
                            token,
                            ends: rec.leases_left(),
                        }
                    }
                    None => ss.done(),
                }
            }
            SessAction::Claim(wait) => {
                let Acq::Entered { token, ends } = Self::sess(s).acq else {
                    return;
                };
                self.sess_claim(s, token, ends, *wait);
            }
            SessAction::AskAgain => {
                let Acq::Waiting { token, ends, .. } = Self::sess(s).acq else {
                    return;
                };
                self.sess_claim(s, token, ends, true);
            }
            SessAction::Leave => {
                let Acq::Waiting { token, .. } = Self::sess(s).acq else {
                    return;
                };
                self.run(s, ab, Op::Leave { key: c.key, token });
                self.session_call(s, ab, SessionOp::Drop(c.key, token));
                Self::sess(s).done();
            }
            SessAction::Confirm => {
                let Acq::Granted { token, fence, left } = Self::sess(s).acq else {
                    return;
                };
                let confirmed = match self.session_call(s, ab, SessionOp::Enter(c.key, token)) {
                    None => false,
                    Some(rec) if left >= rec.leases_left() => {
                        Self::sess(s).tell(&rec);
                        true
                    }
                    Some(rec) => {
                        let until = Some(rec.leases_left());
                        let op = Op::Renew {
                            key: c.key,
                            token,
                            ttl: c.ttl,
                            until,
                        };
                        if let Answer::Held { fence } = self.run(s, ab, op) {
                            self.sess_remember(s, ab, token, fence, rec.leases_left());
                            Self::sess(s).tell(&rec);
                            true
                        } else {
                            false
                        }
                    }
                };
                if confirmed {
                    Self::sess(s).acq = Acq::Holding {
                        token,
                        fence,
                        ended: false,
                    };
                } else {
                    self.sess_release(s, ab, c.key, token);
                    Self::sess(s).done();
                }
            }
            SessAction::KeepRecord => {
                let rec = self.session_call(s, b, SessionOp::Renew);
                let ss = Self::sess(s);
                ss.keeps += 1;
                match rec {
                    Some(rec) => {
                        ss.keeping = Some(Keeping {
                            until: rec.leases_left(),
                            end: rec.left,
                            entries: rec.entries,
                        })
                    }
                    None => self.sess_lost(ss),
                }
            }
            SessAction::KeepLeases => {
                let Some(Keeping {
                    until,
                    end,
                    entries,
                }) = Self::sess(s).keeping.take()
                else {
                    return;
                };
                let op = Op::Keep {
                    until,
                    leases: entries.clone(),
                };
                let Answer::Kept(answers) = self.run(s, b, op) else {
                    return;
                };
                let mut failed = false;
                for (&(key, token), answer) in entries.iter().zip(answers) {
                    match answer {
                        Answer::Held { fence } => {
                            let left = s.store.keys[key as usize]
                                .lock
                                .as_ref()
                                .map_or(until, |l| l.left);
                            self.sess_remember(s, b, token, fence, left);
                        }
                        Answer::HoldInForce => failed = true,
                        // `keep-drops-entries` (`keep_alive` before its grace): an entry whose lease is
                        // not found leaves the record — also one whose acquire is in flight.
                        _ if self.cfg.bug == Some(Bug::KeepDropsEntries) => {
                            self.session_call(s, b, SessionOp::Drop(key, token));
                        }
                        _ => {}
                    }
                }
                if !failed {
                    let rec = SessionRec {
                        ttl: c.ttl,
                        left: end,
                        delay: c.delay,
                        entries: Vec::new(),
                    };
                    Self::sess(s).tell(&rec);
                }
            }
            SessAction::KeepFails => Self::sess(s).keeping = None,
            SessAction::Close => {
                let entries = if self.cfg.bug == Some(Bug::CloseReleasesFirst) {
                    // The mistake: the entries are released first, the record ended after.
                    match self.session_call(s, b, SessionOp::Read) {
                        Some(rec) => {
                            for &(key, token) in &rec.entries {
                                self.sess_release(s, b, key, token);
                            }
                            Some(Vec::new())
                        }
                        None => None,
                    }
                } else {
                    self.session_call(s, b, SessionOp::Close).map(|r| r.entries)
                };
                let ss = Self::sess(s);
                if let Acq::Holding { .. } = ss.acq {
                    ss.done();
                }
                match entries {
                    Some(entries) => ss.life = Life::Closing(entries),
                    None => ss.life = Life::Over,
                }
            }
            SessAction::CloseFinish => {
                let Life::Closing(entries) = Self::sess(s).life.clone() else {
                    return;
                };
                let mut answered = true;
                if self.cfg.bug == Some(Bug::CloseReleasesFirst) {
                    answered = self.session_call(s, b, SessionOp::Close).is_some();
                } else {
                    for (key, token) in entries {
                        answered &= self.sess_release(s, b, key, token);
                    }
                }
                Self::sess(s).life = Life::Over;
                if answered && self.held_after_close(s) {
                    s.close_fault = true;
                }
            }
        }
    }

    /// CLAIM under the session (first, or again while waiting), with a lease that ends when the
    /// record said its leases end; what the broker does with the answer.
    fn sess_claim(&self, s: &mut State, token: Token, ends: u8, wait: bool) {
        let c = self.sc();
        // The broker asks for what is left until the session's end (at least 1 ms): a grant of
        // that 1 ms once the end has passed is taken as none, and a waiter then leaves (its
        // session-ended look finds the session gone).
        let answer = if ends == 0 {
            Answer::Refused
        } else {
            let bid = Bid {
                token,
                broker: c.acquires_on,
                kind: Kind::Exclusive,
                ttl: ends,
                session: true,
            };
            let key = c.key;
            self.run(s, c.acquires_on, Op::Claim { key, bid, wait })
        };
        let waiting = |timer: u8, due: bool| Acq::Waiting {
            token,
            ends,
            timer,
            due,
        };
        let next = match answer {
            Answer::Granted { fence, left, .. } => {
                s.stall[c.key as usize] = 0;
                self.sess_remember(s, c.acquires_on, token, fence, left);
                Acq::Granted { token, fence, left }
            }
            Answer::Queued { retry } if wait => waiting(retry.min(self.cfg.poll).max(1), false),
            Answer::OnHold { left } if wait => waiting(left.max(1), false),
            // The broker catches up (CHECK, PUT_BACK), then asks again.
            Answer::OtherEpoch if wait => waiting(0, true),
            _ => {
                if wait {
                    self.run(s, c.acquires_on, Op::Leave { key: c.key, token });
                }
                self.session_call(s, c.acquires_on, SessionOp::Drop(c.key, token));
                Self::sess(s).done();
                return;
            }
        };
        Self::sess(s).acq = next;
    }
}
