//! What the properties of several-keys requests read (docs/model.md, 1 and 10–12): the keys a
//! request holds, whether one that is over holds none, whether two wait for each other, and
//! which way a request was granted.

use super::{LockModel, State, Step};
use crate::store::{Key, Token};

impl LockModel {
    /// Whether a several-keys request holds both keys, granted in one step (`one`: one fence,
    /// CLAIM_ALL's) or one by one (two fences).
    pub(in crate::model) fn sev_granted(&self, s: &State, one: bool) -> bool {
        s.several.iter().any(|sv| {
            sv.step == Step::Holding
                && sv.took.len() == 2
                && (sv.took[0].fence == sv.took[1].fence) == one
        })
    }

    /// Every live several-keys client's kept keys count as held (for mutual exclusion).
    pub(in crate::model) fn sev_holders(&self, s: &State, k: Key) -> usize {
        s.several
            .iter()
            .flat_map(|sv| sv.took.iter())
            .filter(|t| t.key == k && t.left > 0 && !t.ended)
            .count()
    }

    /// A several-keys request that is over holds no key afterwards (its broker alive: a dead
    /// broker's leases end at their TTL): no live lease record of its token but an offer.
    pub(in crate::model) fn sev_over_holds_none(&self, s: &State) -> bool {
        s.several.iter().enumerate().all(|(m, sv)| {
            !matches!(sv.step, Step::Done { .. })
                || !s.brokers[self.cfg.several[m].broker as usize].alive
                || s.store.keys.iter().all(|ks| {
                    ks.lock
                        .iter()
                        .all(|l| !l.live() || l.offered || l.token != sv.token)
                })
        })
    }

    /// The key live several-keys client `m` waits for, and the token whose lease (or offer)
    /// holds it now.
    fn sev_blocked_by(&self, s: &State, m: usize) -> Option<Token> {
        let Step::Taking { next, .. } = s.several[m].step else {
            return None;
        };
        if !s.brokers[self.cfg.several[m].broker as usize].alive {
            return None;
        }
        let ks = &s.store.keys[self.order(m)[next as usize] as usize];
        ks.lock.as_ref().filter(|l| l.live()).map(|l| l.token)
    }

    /// No cycle of waits (a deadlock): no two live several-keys requests each wait for a key
    /// the other holds.
    pub(in crate::model) fn sev_no_cycle(&self, s: &State) -> bool {
        let n = s.several.len();
        (0..n).all(|a| {
            (0..n).all(|b| {
                a == b
                    || self.sev_blocked_by(s, a) != Some(s.several[b].token)
                    || self.sev_blocked_by(s, b) != Some(s.several[a].token)
            })
        })
    }
}
