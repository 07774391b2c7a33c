//! The properties checked in every reachable state, and the `stateright::Model` impl.

use stateright::{Model, Property};

use super::{Action, LockModel, Phase, State, canonical};
use crate::store::{Effects, Key, Kind};

/// The properties' names, as the check prints them.
const MUTUAL_EXCLUSION: &str = "never two holders of an exclusive lease";
const FENCES_RISE: &str = "fences per key strictly rise in grant order, across store loss";
const NO_LOST_OFFER: &str = "a freed key goes to its queue's head or stays free";
const SERVED: &str = "a key a live waiter waits for is granted within the bound (bounded progress)";
const DEAD_BROKER: &str = "a dead broker's entries hold a key back at most one offer window";
const BELIEVED: &str = "a client that believes it holds a lease under a session is its holder";
const OUTLIVE: &str =
    "no session lease outlives its last answered keep-alive by more than lock delay + TTL";
const WRITTEN: &str = "a session lease ends by its session's latest end plus the lock delay";
const CLOSED: &str = "a close leaves no lease of its session held";
const SEVERAL_DONE: &str = "a several-keys request on a live broker completes within the bound";
const SEVERAL_CYCLE: &str =
    "no two several-keys requests each wait for a key the other holds (no deadlock)";
const SEVERAL_NONE: &str = "a several-keys request that is over holds no key afterwards";

impl LockModel {
    /// The ghost state a step updates: the fences it took (each above the key's highest so
    /// far), the keys it freed (the queue's head must not fit them now), the notices it told.
    pub(super) fn effects(&self, s: &mut State, fx: Effects) {
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

    /// Which hand-ons the configuration can meet: an offer (two brokers act on one key), a
    /// direct grant (a broker acts twice on one key: a release and a wait). Who acts on a key:
    /// its clients' brokers, a several-keys client's on both its keys, the session's acquires'
    /// broker and its own (a close releases the session's leases there).
    fn hand_ons(&self) -> (bool, bool) {
        let c = &self.cfg;
        let mut acts: Vec<(u8, Key)> = c.clients.iter().map(|&(b, k, _)| (b, k)).collect();
        for sv in &c.several {
            acts.extend(sv.keys.iter().map(|&k| (sv.broker, k)));
        }
        if let Some(sc) = c.session {
            acts.extend([(sc.acquires_on, sc.key), (sc.broker, sc.key)]);
        }
        let on = |k: Key| acts.iter().filter(move |a| a.1 == k).map(|a| a.0);
        let offers = (0..c.keys).any(|k| on(k).any(|b| on(k).any(|o| o != b)));
        let direct = (0..c.keys).any(|k| on(k).any(|b| on(k).filter(|o| *o == b).count() > 1));
        (offers, direct)
    }

    /// Whether the live holders of each key respect its kind: one exclusive holder and nobody
    /// else, or shared holders only, or at most `limit` permits.
    pub fn exclusive_ok(&self, s: &State) -> bool {
        for k in 0..self.cfg.keys {
            let (mut x, mut shared, mut permits, mut limit) = (0, 0, 0u8, u8::MAX);
            for (j, cl) in s.clients.iter().enumerate() {
                let (_, ck, kind) = self.cfg.clients[j];
                if ck != k {
                    continue;
                }
                if let Phase::Holding {
                    left, ended: false, ..
                } = cl.phase
                    && left > 0
                {
                    match kind {
                        Kind::Exclusive => x += 1,
                        Kind::Shared => shared += 1,
                        Kind::Permit(n) => {
                            permits += 1;
                            limit = n;
                        }
                    }
                }
            }
            if let (Some(c), Some(ss)) = (self.cfg.session, s.sess.as_ref())
                && c.key == k
                && ss.believed().is_some()
            {
                x += 1;
            }
            x += self.sev_holders(s, k);
            if x > 1 || (x == 1 && shared > 0) || permits > limit {
                return false;
            }
        }
        true
    }
}

impl Model for LockModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.init()]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        self.actions_of(state, actions);
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut next = last.clone();
        self.step(&mut next, &action);
        self.settle_taken(&mut next);
        canonical(&mut next);
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut all = vec![
            Property::always(MUTUAL_EXCLUSION, |m: &LockModel, s| m.exclusive_ok(s)),
            Property::always(FENCES_RISE, |_, s: &State| !s.fence_fault),
            Property::always(NO_LOST_OFFER, |_, s: &State| !s.lost_offer),
            Property::always(SERVED, |m: &LockModel, s: &State| {
                s.stall.iter().all(|t| *t <= m.cfg.max_stall())
            }),
            Property::always(DEAD_BROKER, |m: &LockModel, s: &State| {
                let bound = m.cfg.window * s.used[0];
                s.dead_block.iter().all(|d| *d <= bound)
            }),
        ];
        // Examples only where the configuration has the bids for them: an offer needs bids of
        // two brokers on a key, a direct grant a broker that releases a key and waits for it.
        let (offers, direct) = self.hand_ons();
        if offers {
            all.push(Property::sometimes(
                "a key is offered to a queued waiter",
                |_, s: &State| {
                    s.store.keys.iter().any(|k| {
                        k.lock
                            .iter()
                            .chain(k.pool.iter())
                            .any(|l| l.live() && l.offered)
                    })
                },
            ));
        }
        if direct {
            all.push(Property::sometimes(
                "a release grants the key straight to its own broker's waiter",
                |_, s: &State| s.brokers.iter().any(|b| !b.handed.is_empty()),
            ));
        }
        if self.cfg.session.is_some() {
            all.push(Property::always(BELIEVED, |m: &LockModel, s: &State| {
                m.believed_ok(s)
            }));
            all.push(Property::always(OUTLIVE, |m: &LockModel, s: &State| {
                m.outlive_ok(s, false)
            }));
            all.push(Property::always(WRITTEN, |m: &LockModel, s: &State| {
                m.outlive_ok(s, true)
            }));
            all.push(Property::always(CLOSED, |_, s: &State| !s.close_fault));
            all.push(Property::sometimes(
                "a session lease is held past a keep-alive",
                |m: &LockModel, s: &State| {
                    let ttl = m.cfg.session.map_or(0, |c| c.ttl);
                    s.sess.as_ref().is_some_and(|ss| {
                        ss.keeps > 0 && ss.believed().is_some() && ss.told.left == ttl
                    })
                },
            ));
        }
        if !self.cfg.several.is_empty() {
            all.push(Property::always(
                SEVERAL_CYCLE,
                |m: &LockModel, s: &State| m.sev_no_cycle(s),
            ));
            all.push(Property::always(
                SEVERAL_DONE,
                |m: &LockModel, s: &State| s.several.iter().all(|sv| sv.waited <= m.sev_bound()),
            ));
            all.push(Property::always(
                SEVERAL_NONE,
                |m: &LockModel, s: &State| m.sev_over_holds_none(s),
            ));
            all.push(Property::sometimes(
                "a several-keys request is granted both keys in one step (CLAIM_ALL)",
                |m: &LockModel, s: &State| m.sev_granted(s, true),
            ));
            all.push(Property::sometimes(
                "a several-keys request is granted both keys one by one",
                |m: &LockModel, s: &State| m.sev_granted(s, false),
            ));
        }
        if self.cfg.losses == 0 {
            return all;
        }
        all.push(Property::sometimes(
            "a lease is put back after a loss",
            |_, s: &State| {
                s.used[1] > 0
                    && s.store
                        .keys
                        .iter()
                        .any(|k| k.lock.iter().chain(k.pool.iter()).any(|l| l.live()))
            },
        ));
        all
    }
}
