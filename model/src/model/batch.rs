//! A broker's group commit (`redis-store/src/batch.rs`, `run_batched`): a claim (a first ask,
//! waiting or not, or a waiter's ask again) or a release may join the batch its broker gathers
//! while a call is in flight instead of going alone; the batch goes out as one BATCH call
//! (`Action::Batch`); an operation answered SLOW is then run alone, as its own later step
//! (`Action::Alone`), as if it had come after the batch. Both come before the next tick: a
//! batch goes out when the call in flight ends, well under a tick after.

use super::finish;
use super::{Action, LockModel, Phase, State};
use crate::store::{Answer, BatchOp, Token};

/// A client's operation in a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pend {
    /// CLAIM: a first ask (waiting or not) or a waiter's ask again (`wait`).
    Claim {
        wait: bool,
    },
    Release,
}

impl LockModel {
    /// Whether client `i`'s operation waits in its broker's batch.
    pub(super) fn in_batch(&self, s: &State, i: u8) -> bool {
        let b = self.cfg.clients[i as usize].0;
        s.brokers[b as usize].batch.iter().any(|(j, _)| *j == i)
    }

    /// Where brokers batch, every claim and release a client could run (the actions in
    /// `out[first..]`) joins its broker's batch instead: an operation that goes alone because
    /// nothing was in flight is a batch of one (the fast path's answer, or SLOW and then the
    /// script alone, which may run at once).
    pub(super) fn batch_actions(&self, out: &mut [Action], first: usize) {
        if !self.cfg.batch {
            return;
        }
        for a in &mut out[first..] {
            *a = match *a {
                Action::ClaimWaiting(i) | Action::AskAgain(i) => {
                    Action::Batched(i, Pend::Claim { wait: true })
                }
                Action::ClaimNow(i) => Action::Batched(i, Pend::Claim { wait: false }),
                Action::Release(i) => Action::Batched(i, Pend::Release),
                ref other => other.clone(),
            };
        }
    }

    /// Whether a batch or an operation answered SLOW is due before the next tick.
    pub(super) fn batch_due(&self, s: &State) -> bool {
        s.brokers.iter().any(|br| br.alive && !br.batch.is_empty())
            || s.clients
                .iter()
                .enumerate()
                .any(|(i, cl)| cl.slow.is_some() && s.brokers[self.cfg.clients[i].0 as usize].alive)
    }

    /// The token client `i` claims with: its waiter's, or its next acquire's.
    fn claim_token(s: &State, i: u8) -> Token {
        match s.clients[i as usize].phase {
            Phase::Waiting { token, .. } => token,
            _ => Token {
                client: i,
                attempt: s.clients[i as usize].attempt,
            },
        }
    }

    /// One BATCH call of broker `b`'s gathered operations, and each answer to its client.
    pub(super) fn run_batch(&self, s: &mut State, b: u8) {
        let gathered = std::mem::take(&mut s.brokers[b as usize].batch);
        let ops: Vec<BatchOp> = gathered
            .iter()
            .map(|&(i, pend)| {
                let (_, key, _) = self.cfg.clients[i as usize];
                match pend {
                    Pend::Claim { .. } => BatchOp::Claim {
                        key,
                        bid: self.bid(i, Self::claim_token(s, i)).1,
                    },
                    Pend::Release => BatchOp::Release {
                        key,
                        token: Self::claim_token(s, i),
                    },
                }
            })
            .collect();
        let Answer::Batch(answers) = self.run(s, b, crate::store::Op::Batch { ops: ops.clone() })
        else {
            unreachable!("BATCH answers a batch");
        };
        for ((i, pend), (answer, op)) in gathered.into_iter().zip(answers.into_iter().zip(ops)) {
            match (answer, op) {
                (Answer::Slow, _) => s.clients[i as usize].slow = Some(pend),
                (Answer::Held { .. }, BatchOp::Release { token, .. }) => {
                    s.brokers[b as usize].ledger.retain(|e| e.token != token);
                    finish(&mut s.clients[i as usize]);
                }
                (answer, BatchOp::Claim { bid, .. }) => {
                    self.on_grant(s, i, bid.token, answer);
                    if !pend_waits(pend)
                        && matches!(s.clients[i as usize].phase, Phase::Waiting { .. })
                    {
                        finish(&mut s.clients[i as usize]);
                    }
                }
                (answer, op) => unreachable!("BATCH answered {answer:?} to {op:?}"),
            }
        }
    }

    /// Client `i`'s operation that BATCH answered SLOW, run alone with its own script.
    pub(super) fn run_alone(&self, s: &mut State, i: u8) {
        match s.clients[i as usize].slow.take() {
            Some(Pend::Claim { wait: true }) => self.step(s, &Action::ClaimWaiting(i)),
            Some(Pend::Claim { wait: false }) => self.step(s, &Action::ClaimNow(i)),
            Some(Pend::Release) => self.release(s, i),
            None => {}
        }
    }
}

fn pend_waits(pend: Pend) -> bool {
    matches!(pend, Pend::Claim { wait: true })
}
