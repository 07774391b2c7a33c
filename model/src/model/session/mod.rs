//! A client under a session, as `core/src/lock/sessions.rs` drives it: open; an acquire that
//! enters its token in the record before the grant, is granted a lease that ends at the
//! session's end plus the lock delay, and enters again after the grant (session ended → the
//! lease is released, `no_session`; kept alive meanwhile → the lease is extended with RENEW's
//! `until` form); a keep-alive that moves the record's end and then every entered lease's with
//! KEEP (it may fail between the two, and anything may run between them); a close that ends
//! the record and then releases its entries. A client that stops keeping its session alive
//! (abandons it) is every path in which ticks run out its session: time never waits for it.

mod steps;

use super::{LockModel, State};
use crate::store::{Fence, Key, SessionRec, Token};

/// The session client's bounds.
#[derive(Clone, Copy, Debug)]
pub struct SessionCfg {
    /// The broker of the session's own calls (open, keep-alive, close), and of its acquires.
    pub broker: u8,
    pub acquires_on: u8,
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
    Entered {
        token: Token,
        ends: u8,
    },
    /// Waiting in the key's queue (CLAIM that waits): its broker's timer rings in `timer`
    /// ticks; `due`: it asks before time passes (an offer, a requeue).
    Waiting {
        token: Token,
        ends: u8,
        timer: u8,
        due: bool,
    },
    /// Granted, not confirmed yet: the lease's end as the grant said (ticks left).
    Granted {
        token: Token,
        fence: Fence,
        left: u8,
    },
    /// Confirmed (answered 201); `ended`: force-released, or lost with every broker that
    /// remembered it.
    Holding {
        token: Token,
        fence: Fence,
        ended: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sess {
    pub life: Life,
    pub acq: Acq,
    pub attempt: u8,
    pub keeps: u8,
    /// A keep-alive whose record step ran: the end it moves the leases to, the session's end it
    /// will answer, the entries (ticks left).
    pub keeping: Option<Keeping>,
    /// The latest session end its client was told (open, keep-alive, acquire).
    pub told: End,
    /// Ghost: the latest end the session's record was given (open, keep-alive), kept across a
    /// store loss.
    pub written: End,
}

/// A keep-alive between its record step and its KEEP (ticks left).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Keeping {
    /// The end KEEP moves the leases to: the session's new end plus the lock delay.
    pub until: u8,
    /// The session's new end, which the keep-alive answers.
    pub end: u8,
    pub entries: Vec<(Key, Token)>,
}

/// An end on the store's clock: ticks until it, or ticks since it passed (capped).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct End {
    pub left: u8,
    pub past: u8,
}

impl End {
    /// Moves to `left` ticks from now unless it is later already.
    pub(in crate::model) fn move_to(&mut self, left: u8) {
        if self.past > 0 || left >= self.left {
            *self = End { left, past: 0 };
        }
    }

    fn tick(&mut self, cap: u8) {
        if self.left > 0 {
            self.left -= 1;
        } else {
            self.past = (self.past + 1).min(cap);
        }
    }

    /// Whether a lease with `left` ticks to go ends at most `slack` ticks after this end.
    pub fn within(&self, left: u8, slack: u8) -> bool {
        left + self.past <= self.left + slack
    }
}

impl Sess {
    pub fn new() -> Self {
        Sess {
            life: Life::NotOpen,
            acq: Acq::Idle,
            attempt: 0,
            keeps: 0,
            keeping: None,
            told: End::default(),
            written: End::default(),
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
            } if self.told.left > 0 && self.life == Life::Open => Some(token),
            _ => None,
        }
    }

    fn in_flight(&self) -> Option<Token> {
        match self.acq {
            Acq::Entered { token, .. }
            | Acq::Waiting { token, .. }
            | Acq::Granted { token, .. } => Some(token),
            _ => None,
        }
    }

    pub(in crate::model) fn tell(&mut self, rec: &SessionRec) {
        self.told.move_to(rec.left);
    }

    pub(in crate::model) fn done(&mut self) {
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
    /// CLAIM (waiting or not) with a lease that ends with the session.
    Claim(bool),
    /// A waiting acquire asks again (its timer rang, an offer or a requeue reached it).
    AskAgain,
    /// A waiting acquire stops waiting (its session ended, or its wait ran out): LEAVE, and
    /// its entry leaves the record.
    Leave,
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
pub(super) const ID: u8 = 0;

impl LockModel {
    pub(in crate::model) fn sc(&self) -> SessionCfg {
        self.cfg.session.expect("a session client")
    }

    /// The session client's id in tokens.
    pub(in crate::model) fn sess_client(&self) -> u8 {
        self.cfg.clients.len() as u8
    }

    pub(in crate::model) fn sess_actions(&self, s: &State, out: &mut Vec<super::Action>) {
        let (Some(c), Some(ss)) = (self.cfg.session, s.sess.as_ref()) else {
            return;
        };
        let (live_b, live_ab) = (
            s.brokers[c.broker as usize].alive,
            s.brokers[c.acquires_on as usize].alive,
        );
        let mut push = |a| out.push(super::Action::Session(a));
        match &ss.life {
            _ if !live_b => {}
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
        if ss.keeping.is_some() && live_b {
            push(SessAction::KeepLeases);
            push(SessAction::KeepFails);
        }
        let live = matches!(ss.life, Life::Open | Life::Closing(_));
        match ss.acq {
            _ if !live_ab => {}
            Acq::Idle if live && ss.attempt < c.acquires => push(SessAction::Enter),
            Acq::Entered { .. } => {
                push(SessAction::Claim(false));
                push(SessAction::Claim(true));
            }
            Acq::Waiting { .. } => {
                push(SessAction::AskAgain);
                push(SessAction::Leave);
            }
            Acq::Granted { .. } => push(SessAction::Confirm),
            _ => {}
        }
    }

    /// What the session client must do before time passes: a keep-alive's KEEP and a close's
    /// second step follow their first within a tick (a broker's calls of one request).
    pub(in crate::model) fn sess_due(&self, s: &State) -> bool {
        let (Some(c), Some(ss)) = (self.cfg.session, s.sess.as_ref()) else {
            return false;
        };
        let own = ss.keeping.is_some() || matches!(ss.life, Life::Closing(_));
        let asks = matches!(ss.acq, Acq::Waiting { timer, due, .. } if timer == 0 || due);
        (own && s.brokers[c.broker as usize].alive)
            || (asks && s.brokers[c.acquires_on as usize].alive)
    }

    /// Whether the session client waits for key `k` on a live broker.
    pub(in crate::model) fn sess_waits(&self, s: &State, k: Key) -> bool {
        let (Some(c), Some(ss)) = (self.cfg.session, s.sess.as_ref()) else {
            return false;
        };
        c.key == k
            && s.brokers[c.acquires_on as usize].alive
            && matches!(ss.acq, Acq::Waiting { .. })
    }

    /// A notice for broker `b` reached the session client's waiter: an offer to its token
    /// (whether it was its), a requeue (`token` none), or a look in `look` ticks.
    pub(in crate::model) fn sess_notice(
        &self,
        s: &mut State,
        b: u8,
        key: Option<Key>,
        token: Option<Token>,
        look: Option<u8>,
    ) -> bool {
        let (Some(c), Some(ss)) = (self.cfg.session, s.sess.as_mut()) else {
            return false;
        };
        if c.acquires_on != b || key.is_some_and(|k| k != c.key) {
            return false;
        }
        let Acq::Waiting {
            token: mine,
            timer,
            due,
            ..
        } = &mut ss.acq
        else {
            return false;
        };
        if let Some(ticks) = look {
            *timer = (*timer).min(ticks);
            return true;
        }
        if token.is_some_and(|t| t != *mine) {
            return false;
        }
        *due = true;
        true
    }

    /// The acquire's lease, if confirmed and `gone((fence, key, token))`, no longer counts as
    /// held (force-released; lost with every broker that remembered it).
    pub(in crate::model) fn sess_ended(
        &self,
        s: &mut State,
        gone: impl Fn((Fence, Key, Token)) -> bool,
    ) {
        let Some(c) = self.cfg.session else { return };
        if let Some(Sess {
            acq:
                Acq::Holding {
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
    pub(in crate::model) fn sess_lost(&self, ss: &mut Sess) {
        ss.life = Life::Over;
        if let Acq::Holding { .. } = ss.acq {
            ss.done();
        }
    }

    /// After a close answered: a lease of the session still held in the store that no acquire
    /// in flight (on a live broker) will release. (An offer to a waiter of a dead broker is not
    /// a lease: it lapses after the offer window, as every such offer.)
    pub(in crate::model) fn held_after_close(&self, s: &State) -> bool {
        let me = self.sess_client();
        let flying = s
            .sess
            .as_ref()
            .and_then(Sess::in_flight)
            .filter(|_| s.brokers[self.sc().acquires_on as usize].alive);
        s.store.keys.iter().any(|k| {
            k.lock
                .iter()
                .chain(k.pool.iter())
                .any(|l| l.live() && !l.offered && l.token.client == me && Some(l.token) != flying)
        })
    }

    /// A tick for the session client: its told end, the ends it carries.
    pub(in crate::model) fn sess_tick(&self, s: &mut State) {
        let Some(ss) = s.sess.as_mut() else { return };
        if ss.life != Life::NotOpen {
            let cap = self.sess_slack() + 1;
            ss.told.tick(cap);
            ss.written.tick(cap);
        }
        match &mut ss.acq {
            Acq::Entered { ends, .. } => *ends = ends.saturating_sub(1),
            Acq::Waiting { ends, timer, .. } => {
                *ends = ends.saturating_sub(1);
                *timer = timer.saturating_sub(1);
            }
            Acq::Granted { left, .. } => *left = left.saturating_sub(1),
            _ => {}
        }
        if let Some(k) = &mut ss.keeping {
            k.until = k.until.saturating_sub(1);
            k.end = k.end.saturating_sub(1);
        }
    }

    /// How long a lease may outlive its session's last told end: the lock delay and one TTL.
    pub(in crate::model) fn sess_slack(&self) -> u8 {
        self.cfg.session.map_or(0, |c| c.delay + c.ttl)
    }

    /// No lease under the session outlives the latest end its client was told by more than the
    /// lock delay plus one TTL; nor the latest end its record was given by more than the lock
    /// delay. (An offer to its waiter is not a lease: like any offer it lapses after the offer
    /// window.)
    pub fn outlive_ok(&self, s: &State, written: bool) -> bool {
        let (Some(c), Some(ss)) = (self.cfg.session, s.sess.as_ref()) else {
            return true;
        };
        let me = self.sess_client();
        let (end, slack) = if written {
            (ss.written, c.delay)
        } else {
            (ss.told, self.sess_slack())
        };
        s.store.keys.iter().all(|k| {
            k.lock.iter().chain(k.pool.iter()).all(|l| {
                !l.live() || l.offered || l.token.client != me || end.within(l.left, slack)
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
