//! A client under a session, as `core/src/lock/sessions.rs` drives it: open; an acquire that
//! enters its token in the record before the grant, is granted a lease that ends at the
//! session's end plus the lock delay, and enters again after the grant (session ended → the
//! lease is released, `no_session`; kept alive meanwhile → the lease is extended with RENEW's
//! `until` form); a keep-alive that moves the record's end and then every entered lease's with
//! KEEP (it may fail between the two, and anything may run between them); a close that ends
//! the record and then releases its entries. A client that stops keeping its session alive
//! (abandons it) is every path in which ticks run out its session: time never waits for it.

use super::{Entry, LockModel, State};
use crate::store::{Answer, Bid, Bug, Fence, Key, Kind, Op, SessionOp, SessionRec, Token};

/// The session client's bounds.
#[derive(Clone, Copy, Debug)]
pub struct SessionCfg {
    pub broker: u8,
    pub key: Key,
    /// The session's TTL and lock delay, in ticks.
    pub ttl: u8,
    pub delay: u8,
    /// Acquires under the session, keep-alives.
    pub acquires: u8,
    pub keeps: u8,
}

/// Where the session is, as its client knows it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Life {
    NotOpen,
    Open,
    /// Closing: its record ended (or, with `close-releases-first`, its entries released); the
    /// leases to release (or none).
    Closing(Vec<(Key, Token)>),
    /// Closed, or found ended by a keep-alive.
    Over,
}

/// The acquire under the session.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Acq {
    Idle,
    /// Entered in the record, which said its leases end in `ends` ticks.
    Entered { token: Token, ends: u8 },
    /// Granted, not confirmed yet: the lease's end as the grant said (ticks left).
    Granted { token: Token, fence: Fence, left: u8 },
    /// Confirmed (answered 201); `ended`: force-released, or lost with every broker that
    /// remembered it.
    Holding { token: Token, fence: Fence, ended: bool },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sess {
    pub life: Life,
    pub acq: Acq,
    pub attempt: u8,
    pub keeps: u8,
    /// A keep-alive whose record step ran: the end it moves the leases to, the session's end it
    /// will answer, the entries (ticks left).
    pub keeping: Option<(u8, u8, Vec<(Key, Token)>)>,
    /// Ticks until the latest session end its client was told (open, keep-alive, acquire), and
    /// ticks since it passed (capped).
    pub told: u8,
    pub past: u8,
}

impl Sess {
    pub fn new() -> Self {
        Sess {
            life: Life::NotOpen,
            acq: Acq::Idle,
            attempt: 0,
            keeps: 0,
            keeping: None,
            told: 0,
            past: 0,
        }
    }

    /// The acquire's lease the client believes held: confirmed, its session not closed nor
    /// found ended, its last told end not passed.
    pub fn believed(&self) -> Option<Token> {
        match self.acq {
            Acq::Holding {
                token,
                ended: false,
                ..
            } if self.told > 0 && self.life == Life::Open => Some(token),
            _ => None,
        }
    }

    fn in_flight(&self) -> Option<Token> {
        match self.acq {
            Acq::Entered { token, .. } | Acq::Granted { token, .. } => Some(token),
            _ => None,
        }
    }

    fn tell(&mut self, rec: &SessionRec) {
        if rec.left >= self.told {
            self.told = rec.left;
            self.past = 0;
        }
    }

    fn done(&mut self) {
        self.acq = Acq::Idle;
        self.attempt += 1;
    }
}

impl Default for Sess {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SessAction {
    Open,
    /// The acquire's first step: SESSION enter.
    Enter,
    /// CLAIM (not waiting) with a lease that ends with the session.
    Claim,
    /// SESSION enter again, then RELEASE or RENEW `until` (one step).
    Confirm,
    /// The keep-alive's record step, then KEEP, or KEEP failing.
    KeepRecord,
    KeepLeases,
    KeepFails,
    /// The close's record step, then its releases (reversed by `close-releases-first`).
    Close,
    CloseFinish,
}

/// The session's id in the store; its client's id in tokens is the number of other clients.
const ID: u8 = 0;

impl LockModel {
    fn sc(&self) -> SessionCfg {
        self.cfg.session.expect("a session client")
    }

    /// The session client's id in tokens.
    pub(super) fn sess_client(&self) -> u8 {
        self.cfg.clients.len() as u8
    }

    pub(super) fn sess_actions(&self, s: &State, out: &mut Vec<super::Action>) {
        let (Some(c), Some(ss)) = (self.cfg.session, s.sess.as_ref()) else {
            return;
        };
        if !s.brokers[c.broker as usize].alive {
            return;
        }
        let mut push = |a| out.push(super::Action::Session(a));
        match &ss.life {
            Life::NotOpen => push(SessAction::Open),
            Life::Open => {
                if ss.keeping.is_none() && ss.keeps < c.keeps {
                    push(SessAction::KeepRecord);
                }
                push(SessAction::Close);
            }
            Life::Closing(_) => push(SessAction::CloseFinish),
            Life::Over => {}
        }
        if ss.keeping.is_some() {
            push(SessAction::KeepLeases);
            push(SessAction::KeepFails);
        }
        let live = matches!(ss.life, Life::Open | Life::Closing(_));
        match ss.acq {
            Acq::Idle if live && ss.attempt < c.acquires => push(SessAction::Enter),
            Acq::Entered { .. } => push(SessAction::Claim),
            Acq::Granted { .. } => push(SessAction::Confirm),
            _ => {}
        }
    }

    /// What the session client must do before time passes: a keep-alive's KEEP and a close's
    /// second step follow their first within a tick (a broker's calls of one request).
    pub(super) fn sess_due(&self, s: &State) -> bool {
        let (Some(c), Some(ss)) = (self.cfg.session, s.sess.as_ref()) else {
            return false;
        };
        s.brokers[c.broker as usize].alive
            && (ss.keeping.is_some() || matches!(ss.life, Life::Closing(_)))
    }

    fn session_call(&self, s: &mut State, op: SessionOp) -> Option<SessionRec> {
        match self.run(s, self.sc().broker, Op::Session { id: ID, op }) {
            Answer::Session(rec) => rec,
            _ => None,
        }
    }

    fn sess(s: &mut State) -> &mut Sess {
        s.sess.as_mut().expect("a session client")
    }

    /// RELEASE of a lease under the session; whether the store answered (no hold in force).
    fn sess_release(&self, s: &mut State, key: Key, token: Token) -> bool {
        let b = self.sc().broker;
        let answer = self.run(s, b, Op::Release { key, token });
        s.brokers[b as usize].ledger.retain(|e| e.token != token);
        answer != Answer::HoldInForce
    }

    fn sess_remember(&self, s: &mut State, token: Token, fence: Fence, left: u8) {
        let c = self.sc();
        let entry = Entry {
            key: c.key,
            token,
            kind: Kind::Exclusive,
            fence,
            left,
            session: true,
        };
        super::remember(&mut s.brokers[c.broker as usize].ledger, entry);
    }

    pub(super) fn sess_step(&self, s: &mut State, a: &SessAction) {
        let c = self.sc();
        let me = self.sess_client();
        match a {
            SessAction::Open => {
                let op = SessionOp::Open {
                    ttl: c.ttl,
                    delay: c.delay,
                };
                let rec = self.session_call(s, op);
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
                let rec = self.session_call(s, SessionOp::Enter(c.key, token));
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
            SessAction::Claim => {
                let Acq::Entered { token, ends } = Self::sess(s).acq else {
                    return;
                };
                // A grant of the 1 ms the broker asks for once the session's end has passed
                // is taken as none.
                let answer = if ends == 0 {
                    Answer::Refused
                } else {
                    let bid = Bid {
                        token,
                        broker: c.broker,
                        kind: Kind::Exclusive,
                        ttl: ends,
                        session: true,
                    };
                    let op = Op::Claim {
                        key: c.key,
                        bid,
                        wait: false,
                    };
                    self.run(s, c.broker, op)
                };
                if let Answer::Granted { fence, left, .. } = answer {
                    Self::sess(s).acq = Acq::Granted { token, fence, left };
                    s.stall[c.key as usize] = 0;
                    self.sess_remember(s, token, fence, left);
                } else {
                    self.session_call(s, SessionOp::Drop(c.key, token));
                    Self::sess(s).done();
                }
            }
            SessAction::Confirm => {
                let Acq::Granted { token, fence, left } = Self::sess(s).acq else {
                    return;
                };
                let confirmed = match self.session_call(s, SessionOp::Enter(c.key, token)) {
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
                        if let Answer::Held { fence } = self.run(s, c.broker, op) {
                            self.sess_remember(s, token, fence, rec.leases_left());
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
                    self.sess_release(s, c.key, token);
                    Self::sess(s).done();
                }
            }
            SessAction::KeepRecord => {
                let rec = self.session_call(s, SessionOp::Renew);
                let ss = Self::sess(s);
                ss.keeps += 1;
                match rec {
                    Some(rec) => ss.keeping = Some((rec.leases_left(), rec.left, rec.entries)),
                    None => self.sess_lost(ss),
                }
            }
            SessAction::KeepLeases => {
                let Some((until, end, entries)) = Self::sess(s).keeping.take() else {
                    return;
                };
                let op = Op::Keep {
                    until,
                    leases: entries.clone(),
                };
                let Answer::Kept(answers) = self.run(s, c.broker, op) else {
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
                            self.sess_remember(s, token, fence, left);
                        }
                        Answer::HoldInForce => failed = true,
                        _ => {
                            self.session_call(s, SessionOp::Drop(key, token));
                        }
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
                    match self.session_call(s, SessionOp::Read) {
                        Some(rec) => {
                            for &(key, token) in &rec.entries {
                                self.sess_release(s, key, token);
                            }
                            Some(Vec::new())
                        }
                        None => None,
                    }
                } else {
                    self.session_call(s, SessionOp::Close).map(|r| r.entries)
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
                    answered = self.session_call(s, SessionOp::Close).is_some();
                } else {
                    for (key, token) in entries {
                        answered &= self.sess_release(s, key, token);
                    }
                }
                Self::sess(s).life = Life::Over;
                if answered && self.held_after_close(s) {
                    s.close_fault = true;
                }
            }
        }
    }

    /// The acquire's lease, if confirmed and `gone((fence, key, token))`, no longer counts as
    /// held (force-released; lost with every broker that remembered it).
    pub(super) fn sess_ended(&self, s: &mut State, gone: impl Fn((Fence, Key, Token)) -> bool) {
        let Some(c) = self.cfg.session else { return };
        if let Some(Sess {
            acq: Acq::Holding {
                token,
                fence,
                ended,
            },
            ..
        }) = s.sess.as_mut()
            && gone((*fence, c.key, *token))
        {
            *ended = true;
        }
    }

    /// A keep-alive found the session ended: every lease under it is lost to its client.
    fn sess_lost(&self, ss: &mut Sess) {
        ss.life = Life::Over;
        if let Acq::Holding { .. } = ss.acq {
            ss.done();
        }
    }

    /// After a close answered: a lease of the session still held in the store that no acquire
    /// in flight will release.
    fn held_after_close(&self, s: &State) -> bool {
        let me = self.sess_client();
        let flying = s.sess.as_ref().and_then(Sess::in_flight);
        s.store.keys.iter().any(|k| {
            k.lock
                .iter()
                .chain(k.pool.iter())
                .any(|l| l.live() && l.token.client == me && Some(l.token) != flying)
        })
    }

    /// A tick for the session client: its told end, the ends it carries.
    pub(super) fn sess_tick(&self, s: &mut State) {
        let Some(ss) = s.sess.as_mut() else { return };
        if ss.told > 0 {
            ss.told -= 1;
        } else if ss.life != Life::NotOpen {
            ss.past = ss.past.saturating_add(1).min(self.sess_slack() + 1);
        }
        match &mut ss.acq {
            Acq::Entered { ends, .. } => *ends = ends.saturating_sub(1),
            Acq::Granted { left, .. } => *left = left.saturating_sub(1),
            _ => {}
        }
        if let Some((until, end, _)) = &mut ss.keeping {
            *until = until.saturating_sub(1);
            *end = end.saturating_sub(1);
        }
    }

    /// How long a lease may outlive its session's last told end: the lock delay and one TTL.
    pub(super) fn sess_slack(&self) -> u8 {
        self.cfg.session.map_or(0, |c| c.delay + c.ttl)
    }

    /// No lease under the session outlives the latest end its client was told by more than the
    /// lock delay plus one TTL.
    pub fn outlive_ok(&self, s: &State) -> bool {
        let Some(ss) = s.sess.as_ref() else {
            return true;
        };
        let me = self.sess_client();
        let bound = self.sess_slack();
        s.store.keys.iter().all(|k| {
            k.lock.iter().chain(k.pool.iter()).all(|l| {
                !l.live() || l.token.client != me || l.left + ss.past <= ss.told + bound
            })
        })
    }

    /// A client that believes it holds a lease under its session is its holder in the store
    /// (checked while the store answers: not between a loss and the end of its holds).
    pub fn believed_ok(&self, s: &State) -> bool {
        let Some(token) = s.sess.as_ref().and_then(Sess::believed) else {
            return true;
        };
        if !matches!(s.store.marker, Some(m) if m.hold == 0) {
            return true;
        }
        let k = &s.store.keys[self.sc().key as usize];
        k.lock
            .iter()
            .any(|l| l.token == token && l.live() && !l.offered)
    }
}
