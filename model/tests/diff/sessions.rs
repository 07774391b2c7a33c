//! Session steps of a differential run: SESSION calls on two session records (open with a
//! short or long TTL, renew, read, close, enter, drop) and KEEP on a record's entries, whose
//! answers both sides must give alike (a record or none, its entries; each lease's RENEW
//! answer). Leases under a session are CLAIMs with the session mark (`Step::Claim`'s
//! `session`), whose plain renewals keep their end.

use lockbroker_model::store::SessionOp;
use rand::RngExt;
use rand::rngs::StdRng;

use super::{LONG, ModelSide, Step, holding, key_of, token_of};

/// One SESSION call (the lock delay is 0: a lease's end is the session's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SessStep {
    Open { long: bool },
    Renew,
    Read,
    Close,
    Enter { key: u8, token: usize },
    Drop { key: u8, token: usize },
}

impl SessStep {
    pub(crate) fn op(&self) -> SessionOp {
        match *self {
            SessStep::Open { long } => SessionOp::Open {
                ttl: if long { LONG } else { 1 },
                delay: 0,
            },
            SessStep::Renew => SessionOp::Renew,
            SessStep::Read => SessionOp::Read,
            SessStep::Close => SessionOp::Close,
            SessStep::Enter { key, token } => SessionOp::Enter(key, token_of(token)),
            SessStep::Drop { key, token } => SessionOp::Drop(key, token_of(token)),
        }
    }
}

/// A session step, chosen from what the model's state offers: entries of tokens that asked
/// (or a fresh one), KEEP on a live record's entries.
pub(crate) fn step(
    rng: &mut StdRng,
    model: &ModelSide,
    broker: u8,
    key: u8,
    known: &[usize],
    fresh: usize,
) -> Step {
    let id = rng.random_range(0..2usize);
    let entries: Vec<(u8, usize)> = model
        .store
        .sessions
        .get(id)
        .and_then(Option::as_ref)
        .map(|r| {
            r.entries
                .iter()
                .map(|(k, t)| (*k, t.client as usize + 256 * t.attempt as usize))
                .collect()
        })
        .unwrap_or_default();
    let roll = rng.random_range(0..100);
    let op = if roll < 15 {
        SessStep::Open {
            long: rng.random_bool(0.5),
        }
    } else if roll < 35 {
        SessStep::Renew
    } else if roll < 42 {
        SessStep::Read
    } else if roll < 50 {
        SessStep::Close
    } else if roll < 75 {
        let held = holding(model);
        let token = if !held.is_empty() && rng.random_bool(0.5) {
            held[rng.random_range(0..held.len())]
        } else if known.is_empty() || rng.random_bool(0.1) {
            fresh
        } else {
            known[rng.random_range(known.len().saturating_sub(8)..known.len())]
        };
        let key = key_of(model, token).unwrap_or(key);
        SessStep::Enter { key, token }
    } else if roll < 80 && !entries.is_empty() {
        let (key, token) = entries[rng.random_range(0..entries.len())];
        SessStep::Drop { key, token }
    } else if !entries.is_empty() {
        return Step::Keep {
            broker,
            leases: entries,
            long: rng.random_bool(0.5),
        };
    } else {
        SessStep::Read
    };
    Step::Session { broker, id, op }
}
