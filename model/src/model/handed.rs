//! The Redis store around the scripts (`redis-store/src/`): a RELEASE that granted the key
//! straight to a queued bid of its own broker (`Answer::Handed`) is recorded in the ledger at
//! once, kept in the broker's `handed` map and its waiter woken by a notice on the broker's own
//! channel; the waiter's ask takes it without a script while the ledger still holds it and it
//! has time left; a waiter gone releases it instead of leaving.

use super::{Entry, Handed, LockModel, Phase, State};
use crate::store::{Answer, Bug, Fence, Key, Kind, Notice, Op, Token};

impl LockModel {
    /// One store call of broker `b`: its script — or none, for a waiter's ask that takes the
    /// grant its broker was handed. A RELEASE's grant to this broker's own bid is handled here;
    /// its caller sees the release's `Held`.
    pub(super) fn run(&self, s: &mut State, b: u8, op: Op) -> Answer {
        let op = match op {
            Op::Claim { key, ref bid, .. } => match self.take_handed(s, b, key, bid.token) {
                Some(answer) => return answer,
                None => op,
            },
            // LEAVE leaves a granted lease alone: the store releases a handed one.
            Op::Leave { key, token } if self.unhand(s, b, key, token) => {
                let answer = self.run(s, b, release_op(key, token));
                s.brokers[b as usize]
                    .ledger
                    .retain(|e| e.token != token || e.key != key);
                return answer;
            }
            op => op,
        };
        let released = match op {
            Op::Release { key, .. } => Some(key),
            _ => None,
        };
        match (self.script(s, b, op), released) {
            (
                Answer::Handed {
                    fence,
                    token,
                    granted,
                    left,
                },
                Some(key),
            ) => {
                self.handed(s, b, key, token, granted, left);
                Answer::Held { fence }
            }
            (answer, _) => answer,
        }
    }

    /// A grant RELEASE handed to broker `b`'s own bid: in the ledger at once (a call is one step
    /// here, so the epoch it ran in is the broker's newest: the late put-back of a grant whose
    /// answer raced a loss has nothing to do), in the map, and a notice on the broker's own
    /// channel (as if Redis had offered it; delivered, delayed or lost as any notice).
    fn handed(&self, s: &mut State, b: u8, key: Key, token: Token, fence: Fence, left: u8) {
        let br = &mut s.brokers[b as usize];
        // One token may hold several keys (a several-keys acquire): an entry per key.
        br.ledger.retain(|e| e.token != token || e.key != key);
        br.ledger.push(Entry {
            key,
            token,
            kind: Kind::Exclusive,
            fence,
            left,
            session: false,
        });
        br.ledger.sort();
        br.handed.push(Handed {
            key,
            token,
            fence,
            left,
            forced: false,
        });
        br.handed.sort();
        let notice = Notice::Offered(key, token);
        if br.alive && !br.inbox.contains(&notice) {
            br.inbox.push(notice);
            br.inbox.sort();
        }
    }

    /// A waiter's ask (CLAIM with its token): the grant its broker was handed, if the ledger
    /// still holds that lease (the mistake `handed-without-ledger` does not look) — it has time
    /// left, or the tick that ended it dropped it. The entry goes either way: an ask that finds
    /// it unusable runs CLAIM.
    fn take_handed(&self, s: &mut State, b: u8, key: Key, token: Token) -> Option<Answer> {
        let br = &mut s.brokers[b as usize];
        let i = br
            .handed
            .iter()
            .position(|h| h.key == key && h.token == token)?;
        let h = br.handed.remove(i);
        let kept = br
            .ledger
            .iter()
            .any(|e| e.key == key && e.token == token && e.fence == h.fence);
        if !kept && self.cfg.bug != Some(Bug::HandedWithoutLedger) {
            return None;
        }
        // A lease forced before its broker knew: its waiter is told it holds it, as a holder
        // of a forced lease believes it does (by design). Once the broker knows (its ledger
        // dropped it), answering it is a second holder.
        if h.forced && kept {
            s.taken_forced.push((key, h.fence));
        }
        Some(Answer::Granted {
            token,
            fence: h.fence,
            left: h.left,
        })
    }

    /// Whether broker `b` was handed `token`'s lease on `key` (the entry goes).
    fn unhand(&self, s: &mut State, b: u8, key: Key, token: Token) -> bool {
        let handed = &mut s.brokers[b as usize].handed;
        let before = handed.len();
        handed.retain(|h| h.key != key || h.token != token);
        handed.len() != before
    }

    /// A force release ended the leases with `fences` on `key`: the holders no longer count
    /// (by design), nor do the handed leases among them once taken.
    pub(super) fn forced(&self, s: &mut State, key: Key, fences: &[Fence]) {
        for (j, cl) in s.clients.iter_mut().enumerate() {
            if let Phase::Holding { fence, ended, .. } = &mut cl.phase
                && self.cfg.clients[j].1 == key
                && fences.contains(fence)
            {
                *ended = true;
            }
        }
        for br in &mut s.brokers {
            for h in &mut br.handed {
                if h.key == key && fences.contains(&h.fence) {
                    h.forced = true;
                }
            }
        }
        self.sess_ended(s, |t| t.1 == key && fences.contains(&t.0));
        self.sev_ended(s, |t| t.1 == key && fences.contains(&t.0));
    }

    /// After a step: the handed leases taken in it that a force release had ended count as
    /// forced.
    pub(super) fn settle_taken(&self, s: &mut State) {
        for (key, fence) in std::mem::take(&mut s.taken_forced) {
            self.forced(s, key, &[fence]);
        }
    }
}

/// RELEASE as the Redis store sends it without replica acks (the model has none): `direct`
/// (context kind `g`). On a semaphore the store sends `x`, which is the same here: the scripts
/// grant only an exclusive bid directly, and a semaphore's bids are permits.
pub(super) fn release_op(key: Key, token: Token) -> Op {
    Op::Release {
        key,
        token,
        direct: true,
    }
}
