//! `lib/fast.lua`, the lock cycle's common case (CLAIM's and RELEASE's fast paths), and the
//! scripts built on it alone: claim_all.lua (every key of a several-keys request in one step)
//! and batch.lua (many claims and releases in one call, the broker's group commit).

use super::scripts::{checked, granted};
use super::{
    Answer, BatchOp, Bid, Bug, Call, Effects, Fence, Key, KeyState, Lease, Params, Store, Token,
};

/// Whether fast/claim.lua finds the key free: no lease record (live or expired), queue, pool or
/// fence counter.
pub(super) fn fast_free(k: &KeyState) -> bool {
    k.lock.is_none() && k.queue.is_empty() && k.pool.is_empty() && k.counter.is_none()
}

/// The fast claim's write: a lease with the clock as its fence, no counter kept.
pub(super) fn fast_grant(
    s: &mut Store,
    broker: u8,
    fx: &mut Effects,
    key: Key,
    bid: &Bid,
) -> Fence {
    let fence = s.us;
    s.keys[key as usize].lock = Some(Lease {
        token: bid.token,
        fence,
        left: bid.ttl,
        offered: false,
        by: 1 << broker,
        session: bid.session,
    });
    fx.fences.push((key, fence));
    fence
}

/// claim_all.lua (after `checked`): every key for the bid, each with the clock as its fence, if
/// every one is free as the fast claim finds a key free; else nothing written. (The mistake
/// `partial-grant`: the free ones are granted all the same.)
pub(super) fn claim_all(
    s: &mut Store,
    p: &Params,
    broker: u8,
    fx: &mut Effects,
    keys: &[Key],
    bid: &Bid,
) -> Answer {
    let free: Vec<Key> = keys
        .iter()
        .copied()
        .filter(|&k| fast_free(&s.keys[k as usize]))
        .collect();
    if free.len() < keys.len() {
        if p.bug == Some(Bug::PartialGrant) {
            for k in free {
                fast_grant(s, broker, fx, k, bid);
            }
        }
        return Answer::Refused;
    }
    let mut fence = 0;
    for &k in keys {
        fence = fast_grant(s, broker, fx, k, bid);
    }
    granted(bid, (fence, bid.ttl))
}

/// batch.lua: many claims and releases in one call, each the common case of the fast paths
/// (`fast_claim`, `fast_release` in lib/fast.lua), with Redis's clock read and `checked` run
/// once for all. An operation that is not that case writes nothing and answers
/// [`Answer::Slow`]: its broker then runs it alone, with CLAIM or RELEASE.
pub(super) fn batch(
    s: &mut Store,
    p: &Params,
    call: &Call,
    fx: &mut Effects,
    ops: &[BatchOp],
) -> Answer {
    // `checked` once: while the store is not in the broker's epoch (or a hold is in force) every
    // claim answers SLOW; releases go on as RELEASE's fast path does, which checks no epoch. (The
    // mistake `batch-skips-epoch`: the claims do not look at it.)
    let held = checked(s, p, call.known).is_some() && p.bug != Some(Bug::BatchSkipsEpoch);
    let answers = ops
        .iter()
        .map(|op| match op {
            BatchOp::Claim { key, bid } => {
                if held || !fast_free(&s.keys[*key as usize]) {
                    return Answer::Slow;
                }
                let fence = fast_grant(s, call.broker, fx, *key, bid);
                granted(bid, (fence, bid.ttl))
            }
            BatchOp::Release { key, token } => fast_release(s, call.broker, fx, *key, *token),
        })
        .collect();
    Answer::Batch(answers)
}

/// `fast_release`: the token's own live exclusive lease, remembered by this broker alone, on a
/// key that nobody queues for or shares, with no fence counter and a fence below the clock
/// (nothing then needs the fence kept, nobody is told, nothing is handed on), released; else
/// SLOW with nothing written.
fn fast_release(s: &mut Store, broker: u8, fx: &mut Effects, key: Key, token: Token) -> Answer {
    let us = s.us;
    let k = &mut s.keys[key as usize];
    let fast = k.lock.as_ref().is_some_and(|l| {
        l.token == token && !l.offered && l.by == 1 << broker && l.live() && l.fence < us
    }) && k.queue.is_empty()
        && k.pool.is_empty()
        && k.counter.is_none();
    if !fast {
        return Answer::Slow;
    }
    let l = k.lock.take().expect("the lease");
    fx.freed.push(key);
    Answer::Held { fence: l.fence }
}
