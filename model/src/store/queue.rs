//! `lib/queue.lua` and `lib/grant.lua`: the key's queue, the hand-on, the fence every grant
//! takes, and the helpers the scripts share. Each function is named after its Lua original.

use super::{Bid, Bug, Effects, Fence, Key, KeyState, Kind, Lease, Notice, Params, Store, Token};

/// A script's context (`c` in the Lua): the key, the caller, whether it may hand the key on,
/// the brokers already told to requeue, whether the hand-on may grant the key straight to the
/// caller's own broker's bid (`c.direct`, a RELEASE's kind `g`) and that grant (`c.handed`:
/// token, fence, ticks left).
pub(super) struct Ctx<'a> {
    pub key: Key,
    pub broker: u8,
    pub hand: bool,
    pub requeued: u8,
    pub direct: bool,
    pub handed: Option<(Token, Fence, u8)>,
    pub p: &'a Params,
}

impl Ctx<'_> {
    pub(super) fn bug(&self, bug: Bug) -> bool {
        self.p.bug == Some(bug)
    }
}

pub(super) fn tell(fx: &mut Effects, broker: u8, notice: Notice) {
    fx.notices.push((broker, notice));
}

/// `fence_for`: INCR, at least the last record's fence + 1, at least the clock.
pub(super) fn fence_for(k: &mut KeyState, us: Fence, last: Fence) -> Fence {
    let n = k.counter.unwrap_or(0) + 1;
    let fence = n.max(last + 1).max(us);
    k.counter = Some(fence);
    fence
}

/// `exclusive_fence`: an exclusive lease's fence, with the counter read, not written (the
/// record holds the fence, and every drop of the record keeps it: `kept_fence`).
pub(super) fn exclusive_fence(k: &KeyState, us: Fence, last: Fence) -> Fence {
    (k.counter.unwrap_or(0) + 1).max(last + 1).max(us)
}

/// `kept_fence`: before a lease record is dropped, its fence is kept in the counter if the
/// clock has not passed it.
pub(super) fn kept_fence(k: &mut KeyState, f: Option<Fence>, us: Fence) {
    let Some(f) = f else { return };
    if f < us {
        return;
    }
    if k.counter.unwrap_or(0) < f {
        k.counter = Some(f);
    }
}

/// `unqueue`.
fn unqueue(k: &mut KeyState, token: Token) {
    k.queue.retain(|b| b.token != token);
}

/// `requeue`: a broker that let an offer lapse loses its bids on the key, and is told.
pub(super) fn requeue(s: &mut Store, c: &mut Ctx, fx: &mut Effects, broker: u8) {
    if c.requeued & (1 << broker) != 0 {
        return;
    }
    c.requeued |= 1 << broker;
    if !c.bug(Bug::LapseKeepsQueue) {
        s.keys[c.key as usize].queue.retain(|b| b.broker != broker);
    }
    tell(fx, broker, Notice::Requeue(c.key));
}

/// `settle`: ends an ended exclusive lease or lapsed offer, and ended pool holders.
pub(super) fn settle(s: &mut Store, c: &mut Ctx, fx: &mut Effects) {
    let us = s.us;
    let k = c.key as usize;
    if let Some(l) = s.keys[k].lock.clone()
        && !l.live()
    {
        if l.offered {
            requeue_by(s, c, fx, l.by);
        }
        if !c.bug(Bug::SettleDropsKeptFence) {
            kept_fence(&mut s.keys[k], Some(l.fence), us);
        }
        s.keys[k].lock = None;
        fx.freed.push(c.key);
    }
    settle_pool(s, c, fx);
}

/// `settle_pool`: ends ended pool holders (a lapsed offer's broker requeues).
pub(super) fn settle_pool(s: &mut Store, c: &mut Ctx, fx: &mut Effects) {
    let k = c.key as usize;
    let gone: Vec<Lease> = s.keys[k]
        .pool
        .iter()
        .filter(|l| !l.live())
        .cloned()
        .collect();
    for l in gone {
        if l.offered {
            requeue_by(s, c, fx, l.by);
        }
        drop_holder(&mut s.keys[k], l.token);
        fx.freed.push(c.key);
    }
}

fn requeue_by(s: &mut Store, c: &mut Ctx, fx: &mut Effects, by: u8) {
    // An offer's `by` is the one broker it was offered to.
    for b in 0..8 {
        if by & (1 << b) != 0 {
            requeue(s, c, fx, b);
        }
    }
}

/// `drop_holder`.
pub(super) fn drop_holder(k: &mut KeyState, token: Token) {
    k.pool.retain(|l| l.token != token);
}

/// `live_count`.
pub(super) fn live_count(k: &KeyState) -> usize {
    k.pool.iter().filter(|l| l.live()).count()
}

/// `exclusive_end`: ticks left of the live exclusive lease or offer.
pub(super) fn exclusive_end(k: &KeyState) -> Option<u8> {
    k.lock.as_ref().filter(|l| l.live()).map(|l| l.left)
}

/// `busy_for`: `None` when a bid of `kind` may be granted now as far as the leases go, else
/// the ticks until what is in its way ends.
pub(super) fn busy_for(k: &KeyState, kind: Kind) -> Option<u8> {
    if let Some(e) = exclusive_end(k) {
        return Some(e);
    }
    let live = k.pool.iter().filter(|l| l.live());
    match kind {
        Kind::Exclusive => live.map(|l| l.left).max(),
        Kind::Shared => None,
        Kind::Permit(n) => {
            if live_count(k) >= n as usize {
                live.map(|l| l.left).min()
            } else {
                None
            }
        }
    }
}

/// `write_lease`: a lease in a bid's name, granted or offered; the fence is taken now.
pub(super) fn write_lease(
    s: &mut Store,
    c: &Ctx,
    fx: &mut Effects,
    bid: &Bid,
    offer: bool,
) -> (Fence, u8) {
    let us = s.us;
    let k = &mut s.keys[c.key as usize];
    // A lock key has an exclusive lease record (a semaphore has none: `EXCL`).
    let excl = !matches!(bid.kind, Kind::Permit(_));
    let last = if excl {
        k.lock.as_ref().map_or(0, |l| l.fence)
    } else {
        0
    };
    let fence = if offer && c.bug(Bug::OfferWithoutFence) {
        // The mistake: the offer carries the counter as it is; the fence is "taken" when the
        // offer is (it is not: the take keeps the record's fence).
        k.counter.unwrap_or(last).max(last)
    } else if bid.kind == Kind::Exclusive {
        exclusive_fence(k, us, last)
    } else {
        fence_for(k, us, last)
    };
    let left = if offer { c.p.window } else { bid.ttl };
    let lease = Lease {
        token: bid.token,
        fence,
        left,
        offered: offer,
        by: 1 << bid.broker,
        session: bid.session,
    };
    match bid.kind {
        Kind::Exclusive => k.lock = Some(lease),
        Kind::Shared | Kind::Permit(_) => {
            drop_holder(k, bid.token);
            k.pool.push(lease);
            k.pool.sort();
            if let Kind::Permit(n) = bid.kind {
                k.limit = Some(n);
            }
        }
    }
    fx.fences.push((c.key, fence));
    (fence, left)
}

/// `look`: the first queued bid of a broker not just offered to is told to look when the
/// window ends.
fn look(s: &Store, c: &Ctx, fx: &mut Effects, offered: u8) {
    for b in s.keys[c.key as usize].queue.iter().take(32) {
        if offered & (1 << b.broker) == 0 {
            tell(fx, b.broker, Notice::Look(c.key, c.p.window));
            return;
        }
    }
}

/// `hand_on`: offers the key to the queue's head while it fits; the bid `me` is granted
/// instead of offered (its grant is returned), and so is, with `c.direct`, an exclusive bid of
/// the caller's own broker not under a session (its grant is `c.handed`; nobody is told).
pub(super) fn hand_on(
    s: &mut Store,
    c: &mut Ctx,
    fx: &mut Effects,
    me: Option<Token>,
) -> Option<(Fence, u8)> {
    if !c.hand {
        return None;
    }
    settle(s, c, fx);
    let k = c.key as usize;
    if s.keys[k].queue.is_empty() {
        return None;
    }
    let xend = exclusive_end(&s.keys[k]);
    let mut live = live_count(&s.keys[k]);
    let mut limit = s.keys[k].limit;
    let (mut offered, mut any, mut granted) = (0u8, false, None);
    while let Some(head) = s.keys[k].queue.first().cloned() {
        let fits = match head.kind {
            Kind::Exclusive => xend.is_none() && live == 0,
            Kind::Shared => xend.is_none(),
            Kind::Permit(n) => (live as u8) < n && (live == 0 || limit == Some(n)),
        };
        if !fits {
            break;
        }
        unqueue(&mut s.keys[k], head.token);
        let mine = Some(head.token) == me;
        let direct = !mine
            && c.direct
            && head.kind == Kind::Exclusive
            && head.broker == c.broker
            && !head.session;
        let got = write_lease(s, c, fx, &head, !(mine || direct));
        if mine {
            granted = Some(got);
        } else if direct {
            c.handed = Some((head.token, got.0, got.1));
        } else {
            offered |= 1 << head.broker;
            any = true;
            tell(fx, head.broker, Notice::Offered(c.key, head.token));
        }
        if head.kind == Kind::Exclusive {
            break;
        }
        live += 1;
        if let Kind::Permit(n) = head.kind {
            limit = Some(n);
        }
    }
    if any {
        look(s, c, fx, offered);
    }
    granted
}

/// `enqueue`: the bid joins the tail, or keeps its place — with the TTL it asks for now: a bid
/// under a session asks for what is left until its session's end, and a grant on its own ask
/// must end then, not that long after (the embedded store computes it at the grant; the
/// known-bad variant `queued-ttl` keeps the TTL of the first ask, as `lib/queue.lua` does).
pub(super) fn enqueue(c: &Ctx, k: &mut KeyState, bid: &Bid) {
    if let Some(queued) = k.queue.iter_mut().find(|b| b.token == bid.token) {
        if !c.bug(Bug::QueuedTtl) {
            queued.ttl = bid.ttl;
        }
        return;
    }
    k.queue.push(bid.clone());
}

/// `wait_turn`: joins (or keeps its place), the key is handed on, granted if its turn came,
/// else queued with the ticks until what blocks it ends.
pub(super) fn wait_turn(s: &mut Store, c: &mut Ctx, fx: &mut Effects, bid: &Bid) -> super::Answer {
    settle(s, c, fx);
    enqueue(c, &mut s.keys[c.key as usize], bid);
    if let Some((fence, left)) = hand_on(s, c, fx, Some(bid.token)) {
        return super::Answer::Granted {
            token: bid.token,
            fence,
            left,
        };
    }
    let k = &s.keys[c.key as usize];
    let retry = busy_for(k, bid.kind)
        .or(busy_for(k, Kind::Exclusive))
        .unwrap_or(c.p.window);
    super::Answer::Queued { retry }
}

/// `ended`: the brokers that remember a lease (but the caller) are told that it ended.
pub(super) fn ended(c: &Ctx, fx: &mut Effects, by: u8, fence: Fence, all: bool) {
    for b in 0..8u8 {
        if by & (1 << b) != 0 && b != c.broker {
            tell(fx, b, Notice::Ended(c.key, fence, all));
        }
    }
}
