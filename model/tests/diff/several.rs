//! CLAIM_ALL steps of a differential run: the lock keys at once for a fresh token, as a
//! several-keys acquire's first try (`acquire_all` in core/src/lock/several.rs), drawn often
//! when every lock key is free (so that grants happen) and now and then otherwise (refusals:
//! a live or expired lease, an offer, a queue, a shared lease, a kept fence counter); and right
//! after a loss by a broker that has not caught up (another epoch). Both sides must answer alike
//! (granted every key with one fence each, or nothing written) and hold alike afterwards.

use std::collections::BTreeMap;

use lockbroker_model::store::{Answer, Bid, KeyState, Kind, Op};
use rand::RngExt;
use rand::rngs::StdRng;

use super::{LONG, ModelSide, SEMAPHORE, Step, token_of};

/// A CLAIM_ALL of the lock keys (in either order) for `token`.
pub(crate) fn claim_all(rng: &mut StdRng, broker: u8, token: usize) -> Step {
    let mut keys: Vec<u8> = (0..SEMAPHORE).collect();
    if rng.random_bool(0.5) {
        keys.reverse();
    }
    Step::ClaimAll {
        broker,
        keys,
        token,
        long: rng.random_bool(0.2),
    }
}

/// How likely a CLAIM_ALL is drawn now: often while every lock key is free, less often while
/// one is not (each refusal alone), else seldom.
pub(crate) fn chance(model: &ModelSide) -> f64 {
    match why(model, &[0, 1]).as_str() {
        "free" => 0.5,
        "both keys not free" => 0.03,
        _ => 0.3,
    }
}

/// Why CLAIM_ALL finds `keys` not all free (by the model, before the step): what the one key
/// that is not free has, "both keys not free", or "free".
pub(crate) fn why(model: &ModelSide, keys: &[u8]) -> String {
    let reason = |k: &KeyState| {
        let mut has = Vec::new();
        match &k.lock {
            Some(l) if l.offered => has.push("an offer"),
            Some(l) if l.live() => has.push("a live lease"),
            Some(_) => has.push("an expired lease"),
            None => {}
        }
        if !k.queue.is_empty() {
            has.push("a queue");
        }
        if !k.pool.is_empty() {
            has.push("a shared lease");
        }
        if k.counter.is_some() {
            has.push("a kept fence counter");
        }
        (!has.is_empty()).then(|| has.join(" + "))
    };
    let mut not_free = keys
        .iter()
        .filter_map(|&k| reason(&model.store.keys[k as usize]));
    match (not_free.next(), not_free.next()) {
        (None, _) => "free".into(),
        (Some(one), None) => one,
        (Some(_), Some(_)) => "both keys not free".into(),
    }
}

/// The first steps of every run: CLAIM_ALL granted on free keys, then refused by each thing a
/// key may have (a live lease, a queue behind it, an offer, a kept fence counter alone, an
/// expired lease), from fresh tokens `next..`. The run's random steps follow.
pub(crate) fn prefix(next: &mut usize) -> Vec<Step> {
    let t: Vec<usize> = (*next..*next + 9).collect();
    *next += t.len();
    let all = |broker, keys: [u8; 2], token| Step::ClaimAll {
        broker,
        keys: keys.to_vec(),
        token,
        long: false,
    };
    let claim = |broker, token| Step::Claim {
        broker,
        key: 1,
        token,
        shared: false,
        long: false,
        wait: true,
        session: false,
    };
    let release = |broker, key, token| Step::Release { broker, key, token };
    vec![
        all(0, [0, 1], t[0]),
        release(0, 0, t[0]),
        release(0, 1, t[0]),
        claim(1, t[1]),
        all(0, [1, 0], t[2]),
        claim(0, t[3]),
        all(1, [0, 1], t[4]),
        release(1, 1, t[1]),
        all(0, [0, 1], t[5]),
        claim(0, t[3]),
        release(0, 1, t[3]),
        all(1, [1, 0], t[6]),
        claim(1, t[7]),
        Step::Tick,
        all(0, [0, 1], t[8]),
    ]
}

/// A token's broker and one of its keys (a CLAIM_ALL's: either), for a release or a renewal.
pub(crate) fn home(rng: &mut StdRng, model: &ModelSide, token: usize) -> Option<(u8, u8)> {
    match model.several.get(&token) {
        Some(keys) => {
            let key = keys[rng.random_range(0..keys.len())];
            Some((model.bids.get(&token)?.broker, key))
        }
        None => super::home(model, token),
    }
}

/// The CLAIM_ALLs of a run by what the model answered (refusals by why).
#[derive(Debug, Default)]
pub(crate) struct Tally(pub BTreeMap<String, usize>);

impl Tally {
    pub(crate) fn count(&mut self, answer: &Answer, why: &str) {
        let what = match answer {
            Answer::Granted { .. } => "granted".to_string(),
            Answer::Refused => format!("refused ({why})"),
            Answer::OtherEpoch => "another epoch".to_string(),
            other => format!("{other:?}"),
        };
        *self.0.entry(what).or_default() += 1;
    }

    pub(crate) fn note(&mut self, what: &str) {
        *self.0.entry(what.to_string()).or_default() += 1;
    }

    pub(crate) fn add(&mut self, other: &Tally) {
        for (what, n) in &other.0 {
            *self.0.entry(what.clone()).or_default() += n;
        }
    }
}

impl ModelSide {
    /// CLAIM_ALL, by a broker that knows the epoch `known` (none given: the store's).
    pub(crate) fn claim_all(&mut self, step: &Step, known: Option<Option<u8>>) -> Answer {
        let Step::ClaimAll {
            broker,
            ref keys,
            token,
            long,
        } = *step
        else {
            unreachable!("a CLAIM_ALL step")
        };
        let bid = Bid {
            token: token_of(token),
            broker,
            kind: Kind::Exclusive,
            ttl: if long { LONG } else { 1 },
            session: false,
        };
        self.bids.entry(token).or_insert(bid.clone());
        self.keys_of.entry(token).or_insert(keys[0]);
        self.several.insert(token, keys.clone());
        let known = known.unwrap_or(self.store.marker.map(|m| m.id));
        let op = Op::ClaimAll {
            keys: keys.clone(),
            bid,
        };
        let answer = self.call_as(broker, known, op);
        let t = token_of(token);
        for &key in keys {
            self.remember(broker, key, (Kind::Exclusive, false), t, &answer);
        }
        answer
    }

    /// FLUSHALL, then `claim` by a broker still in the epoch before the loss.
    pub(crate) fn stale_claim_all(&mut self, claim: &Step) -> Answer {
        let known = self.store.marker.map(|m| m.id);
        self.call(0, Op::Flush);
        self.claim_all(claim, Some(known))
    }
}
