//! The model's side of the Redis store's direct grants (`redis-store/src/handed.rs`): a RELEASE
//! of a lock key asks for them (kind `g`: the test's stores have no replica acks); a grant it
//! hands to its own broker's bid goes into that broker's ledger and map, and the broker tells its
//! waiter as an offer is told; the bid's CLAIM takes it without a script while the ledger still
//! holds it and it has time left; a LEAVE of a bid with a grant waiting releases that grant.

use lockbroker_model::store::{Answer, Back, Fence, Kind, Notice, Op, Token};
use rand::RngExt;
use rand::rngs::StdRng;

use super::{ModelSide, SEMAPHORE, Step, forget, make_room};

/// A grant kept for its waiter: its key, token, fence and ticks left (0: ended; the real map
/// keeps it until taken, and a take finds it ended).
pub(crate) struct Handed {
    key: u8,
    token: Token,
    fence: Fence,
    left: u8,
}

impl ModelSide {
    /// RELEASE through `broker` as its store sends it, the ledger's steps after it, and the
    /// grant it handed on, if one (answered as the release's `Held`).
    pub(super) fn release(&mut self, broker: u8, key: u8, token: Token) -> Answer {
        let op = Op::Release {
            key,
            token,
            direct: key != SEMAPHORE,
        };
        let (answer, handed) = match self.call(broker, op) {
            Answer::Handed {
                fence,
                token: to,
                granted,
                left,
            } => (Answer::Held { fence }, Some((to, granted, left))),
            answer => (answer, None),
        };
        // As the broker's release: the end's mark (`forget_ended`), the grant handed on (into
        // the ledger and the map, its waiter told), then the token.
        let ledger = &mut self.ledgers[broker as usize];
        if let Answer::Held { fence } = answer {
            forget(ledger, key, fence, false);
        }
        if let Some((to, fence, left)) = handed {
            make_room(ledger, key, Kind::Exclusive, to);
            ledger.push(Back {
                key,
                kind: Kind::Exclusive,
                token: to,
                fence,
                left,
                session: false,
            });
            let kept = &mut self.handed[broker as usize];
            kept.retain(|h| h.key != key || h.token != to);
            kept.push(Handed {
                key,
                token: to,
                fence,
                left,
            });
            self.told.push((broker, Notice::Offered(key, to)));
            self.direct.note("direct grant");
        }
        self.ledgers[broker as usize].retain(|e| e.token != token || e.key != key);
        answer
    }

    /// The grant waiting for `token`'s CLAIM on `key` through `broker`, if its ledger still
    /// holds it and it has time left (the entry goes either way).
    pub(super) fn take_handed(&mut self, broker: u8, key: u8, token: Token) -> Option<Answer> {
        let handed = &mut self.handed[broker as usize];
        let at = handed
            .iter()
            .position(|h| h.key == key && h.token == token)?;
        let h = handed.remove(at);
        // The ledger's entry of that lease (its fence), live: a renewal since may have moved its
        // end (the ledger drops an entry at its end).
        let held = self.ledgers[broker as usize].iter().any(|e| {
            e.key == key && e.token == token && e.kind == Kind::Exclusive && e.fence == h.fence
        });
        let usable = held && h.left > 0;
        self.direct.note(if usable {
            "direct grant taken without a script"
        } else if held {
            "direct grant ended before its ask (CLAIM)"
        } else {
            "direct grant gone from the ledger before its ask (CLAIM)"
        });
        usable.then_some(Answer::Granted {
            token,
            fence: h.fence,
            left: h.left,
        })
    }

    /// Often, while a grant waits for its bid: that bid asks again through its broker (its
    /// waiter woken by the notice), or now and then leaves (its waiter gone).
    pub(super) fn handed_step(&self, rng: &mut StdRng) -> Option<Step> {
        let waiting: Vec<(u8, &Handed)> = (0..2u8)
            .flat_map(|b| self.handed[b as usize].iter().map(move |h| (b, h)))
            .collect();
        if waiting.is_empty() || !rng.random_bool(0.3) {
            return None;
        }
        let (broker, h) = waiting[rng.random_range(0..waiting.len())];
        let token = h.token.client as usize + 256 * h.token.attempt as usize;
        let bid = self.bids.get(&token)?;
        Some(if rng.random_bool(0.8) {
            Step::Claim {
                broker,
                key: h.key,
                token,
                shared: false,
                long: bid.ttl == super::LONG,
                wait: true,
                session: bid.session,
            }
        } else {
            Step::Leave {
                broker,
                key: h.key,
                token,
            }
        })
    }

    /// A tick: the grants kept come one tick nearer their ends.
    pub(super) fn tick_handed(&mut self) {
        for h in self.handed.iter_mut().flatten() {
            h.left = h.left.saturating_sub(1);
        }
    }

    /// Whether a grant waits for `token` on `key` through `broker` (it goes).
    pub(super) fn unhand(&mut self, broker: u8, key: u8, token: Token) -> bool {
        let handed = &mut self.handed[broker as usize];
        let before = handed.len();
        handed.retain(|h| h.key != key || h.token != token);
        handed.len() != before
    }
}
