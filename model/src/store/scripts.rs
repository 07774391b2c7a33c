//! The scripts, one function each, named after `redis-store/src/scripts/<name>.lua`.

use super::bugs::Bug;
use super::queue::{
    Ctx, busy_for, drop_holder, ended, enqueue, exclusive_end, hand_on, kept_fence, live_count,
    requeue, settle, settle_pool, tell, wait_turn, write_lease,
};
use super::{
    Answer, Bid, Call, Effects, Fence, Key, KeyState, Kind, Lease, Marker, Notice, Op, Params,
    Store, Token,
};

pub(super) fn run(s: &mut Store, p: &Params, call: &Call, fx: &mut Effects) -> Answer {
    let ctx = |key: Key, hand: bool| Ctx {
        key,
        broker: call.broker,
        hand,
        requeued: 0,
        direct: false,
        handed: None,
        p,
    };
    match &call.op {
        Op::Claim { key, bid, wait } => match checked(s, p, call.known) {
            Some(no) => no,
            None => claim(s, &mut ctx(*key, true), fx, bid, *wait),
        },
        Op::TakeOver { key, bid, seen } => match checked(s, p, call.known) {
            Some(no) => no,
            None => take_over(s, &mut ctx(*key, true), fx, bid, *seen),
        },
        Op::Join { key, bid, wait } => match checked(s, p, call.known) {
            Some(no) => no,
            None => join(s, &mut ctx(*key, true), fx, bid, *wait),
        },
        Op::ClaimAll { keys, bid } => match checked(s, p, call.known) {
            Some(no) => no,
            None => super::fast::claim_all(s, p, call.broker, fx, keys, bid),
        },
        Op::Batch { ops } => super::fast::batch(s, p, call, fx, ops),
        Op::Release { key, token, direct } => {
            let mut c = ctx(*key, s.hand(call.known));
            c.direct = *direct;
            release(s, &mut c, fx, *token)
        }
        Op::Renew {
            key,
            token,
            ttl,
            until,
        } => renew(
            s,
            &mut ctx(*key, s.hand(call.known)),
            fx,
            *token,
            *ttl,
            *until,
        ),
        Op::Session { id, op } => super::session::session(s, *id, op),
        Op::Keep { until, leases } => {
            // The mistake `keep-for-ttl`: RENEW's ttl form (the session's TTL and delay from
            // now), which a lease under a session answers by keeping its end.
            let form = (p.bug != Some(Bug::KeepForTtl)).then_some(*until);
            Answer::Kept(
                leases
                    .iter()
                    .map(|(key, token)| {
                        renew(
                            s,
                            &mut ctx(*key, s.hand(call.known)),
                            fx,
                            *token,
                            *until,
                            form,
                        )
                    })
                    .collect(),
            )
        }
        Op::Force { key } => force(s, &mut ctx(*key, s.hand(call.known)), fx),
        Op::Leave { key, token } => leave(s, &mut ctx(*key, s.hand(call.known)), fx, *token),
        Op::Read { key } => {
            let l = s.keys[*key as usize].lock.as_ref();
            Answer::Record(l.map(|l| (l.token, l.fence, l.live())))
        }
        Op::PutBack { epoch, leases } => super::epoch::put_back(s, p, call.broker, *epoch, leases),
        Op::Check => super::epoch::check(s, p),
        Op::Tick => {
            tick(s);
            Answer::Done
        }
        Op::Flush => {
            let n = s.keys.len();
            s.keys = vec![KeyState::default(); n];
            s.marker = None;
            s.sessions.clear();
            Answer::Done
        }
        Op::Slack { key } => {
            s.keys[*key as usize] = KeyState::default();
            Answer::Done
        }
    }
}

/// One tick of the lease clock: every end and the hold come one tick nearer.
fn tick(s: &mut Store) {
    for k in &mut s.keys {
        if let Some(l) = &mut k.lock {
            l.left = l.left.saturating_sub(1);
        }
        for l in &mut k.pool {
            l.left = l.left.saturating_sub(1);
        }
    }
    if let Some(m) = &mut s.marker {
        m.hold = m.hold.saturating_sub(1);
    }
    for rec in &mut s.sessions {
        if let Some(r) = rec {
            r.left -= 1;
            if r.left == 0 {
                *rec = None;
            }
        }
    }
}

/// `checked` (lib/grant.lua): another epoch, or a hold in force.
pub(super) fn checked(s: &Store, p: &Params, known: Option<u8>) -> Option<Answer> {
    let id = s.marker.map(|m| m.id);
    if id != known && p.bug != Some(Bug::NoEpochCheck) {
        return Some(Answer::OtherEpoch);
    }
    match s.marker {
        Some(Marker { hold, .. }) if hold > 0 => Some(Answer::OnHold { left: hold }),
        _ => None,
    }
}

pub(super) fn granted(bid: &Bid, (fence, left): (Fence, u8)) -> Answer {
    Answer::Granted {
        token: bid.token,
        fence,
        left,
    }
}

/// The bid's own live lease: an offer it takes now (its lease for its whole TTL from now), or
/// its lease again.
fn taken(l: &mut Lease, bid: &Bid, broker: u8) -> Answer {
    if l.offered {
        l.left = bid.ttl;
        l.offered = false;
        l.by = 1 << broker;
    }
    Answer::Granted {
        token: bid.token,
        fence: l.fence,
        left: l.left,
    }
}

/// A bid that does not wait never goes ahead of the queue: with bids queued, the key is handed
/// on first; whether bids are still queued then.
fn still_queued(s: &mut Store, c: &mut Ctx, fx: &mut Effects) -> bool {
    if s.keys[c.key as usize].queue.is_empty() {
        return false;
    }
    hand_on(s, c, fx, None);
    !s.keys[c.key as usize].queue.is_empty()
}

/// claim.lua (with fast/claim.lua in front).
fn claim(s: &mut Store, c: &mut Ctx, fx: &mut Effects, bid: &Bid, wait: bool) -> Answer {
    // fast/claim.lua: no record, queue, pool, counter: the clock is the fence, no counter kept.
    if super::fast::fast_free(&s.keys[c.key as usize]) {
        let fence = super::fast::fast_grant(s, c.broker, fx, c.key, bid);
        return granted(bid, (fence, bid.ttl));
    }
    let k = &mut s.keys[c.key as usize];
    if let Some(cur) = k.lock.as_mut().filter(|l| l.live() && l.token == bid.token) {
        return taken(cur, bid, c.broker);
    }
    // Another's lease or offer is live: the bid is refused, or joins the queue and waits for
    // its end, without a hand-on.
    if let Some(left) = exclusive_end(&s.keys[c.key as usize]) {
        settle_pool(s, c, fx);
        if !wait {
            return Answer::Refused;
        }
        enqueue(c, &mut s.keys[c.key as usize], bid);
        return Answer::Queued { retry: left };
    }
    if !wait {
        if still_queued(s, c, fx) {
            return Answer::Refused;
        }
        let k = &s.keys[c.key as usize];
        if k.lock.is_some() || busy_for(k, Kind::Exclusive).is_some() {
            return Answer::Refused;
        }
        return granted(bid, write_lease(s, c, fx, bid, false));
    }
    if s.keys[c.key as usize].queue.is_empty() {
        settle(s, c, fx);
        if busy_for(&s.keys[c.key as usize], Kind::Exclusive).is_none() {
            return granted(bid, write_lease(s, c, fx, bid, false));
        }
    }
    wait_turn(s, c, fx, bid)
}

/// take_over.lua: GETSET made safe.
fn take_over(s: &mut Store, c: &mut Ctx, fx: &mut Effects, bid: &Bid, seen: Fence) -> Answer {
    if still_queued(s, c, fx) {
        return Answer::Refused;
    }
    if let Some(cur) = s.keys[c.key as usize].lock.clone() {
        if cur.fence != seen || cur.live() {
            return Answer::Refused;
        }
        if cur.offered {
            for b in 0..8 {
                if cur.by & (1 << b) != 0 {
                    requeue(s, c, fx, b);
                }
            }
        }
        fx.freed.push(c.key);
    }
    if live_count(&s.keys[c.key as usize]) > 0 {
        return Answer::Refused;
    }
    granted(bid, write_lease(s, c, fx, bid, false))
}

/// join.lua: a shared lease or a permit.
fn join(s: &mut Store, c: &mut Ctx, fx: &mut Effects, bid: &Bid, wait: bool) -> Answer {
    settle(s, c, fx);
    let k = &mut s.keys[c.key as usize];
    if let Some(l) = k.pool.iter_mut().find(|l| l.token == bid.token && l.live()) {
        return taken(l, bid, c.broker);
    }
    if !wait {
        if still_queued(s, c, fx) {
            return Answer::NoRoom;
        }
        if busy_for(&s.keys[c.key as usize], bid.kind).is_some() {
            return Answer::NoRoom;
        }
        return granted(bid, write_lease(s, c, fx, bid, false));
    }
    let k = &s.keys[c.key as usize];
    if k.queue.is_empty() && busy_for(k, bid.kind).is_none() {
        return granted(bid, write_lease(s, c, fx, bid, false));
    }
    wait_turn(s, c, fx, bid)
}

/// `holder` (lib/holder.lua).
enum Holder {
    Held(Lease),
    HeldPooled(Lease),
    Code(Answer),
}

fn holder(s: &Store, key: Key, token: Token) -> Holder {
    let k = &s.keys[key as usize];
    if let Some(l) = k
        .lock
        .as_ref()
        .filter(|l| l.token == token && l.live() && !l.offered)
    {
        return Holder::Held(l.clone());
    }
    if let Some(l) = k
        .pool
        .iter()
        .find(|l| l.token == token && !l.offered && l.live())
    {
        return Holder::HeldPooled(l.clone());
    }
    match s.marker {
        None => return Holder::Code(Answer::HoldInForce),
        Some(m) if m.hold > 0 => return Holder::Code(Answer::HoldInForce),
        _ => {}
    }
    if exclusive_end(k).is_none() && live_count(k) == 0 {
        return Holder::Code(Answer::NotHeld);
    }
    Holder::Code(Answer::NotOwner)
}

/// release.lua (fast/release.lua is the same step on a key with nothing else in it); with
/// `direct`, its hand-on may grant the key to the caller's own broker's next bid (answered).
fn release(s: &mut Store, c: &mut Ctx, fx: &mut Effects, token: Token) -> Answer {
    let us = s.us;
    let lease = match holder(s, c.key, token) {
        Holder::Code(answer) => return answer,
        Holder::HeldPooled(l) => {
            drop_holder(&mut s.keys[c.key as usize], token);
            l
        }
        Holder::Held(l) => {
            let k = &mut s.keys[c.key as usize];
            if !c.bug(super::Bug::ReleaseDropsKeptFence) {
                kept_fence(k, Some(l.fence), us);
            }
            k.lock = None;
            l
        }
    };
    ended(c, fx, lease.by, lease.fence, false);
    fx.freed.push(c.key);
    if !c.bug(super::Bug::ReleaseWithoutHandOn) {
        hand_on(s, c, fx, None);
    }
    // `released`: the grant `hand_on` made to the caller's own broker's bid follows.
    match c.handed {
        Some((token, granted, left)) => Answer::Handed {
            fence: lease.fence,
            token,
            granted,
            left,
        },
        None => Answer::Held { fence: lease.fence },
    }
}

/// renew.lua (`lib/renewal.lua`): the end moves to `ttl` from now — a lease under a session
/// keeps its end — or with `until` to that time unless it ends later already; this broker
/// joins the ones that answer it. A renewal that ends the lease sooner tells the broker of the
/// queue's first bid to look then (`sooner`; the checker's renewals are all by the full TTL and
/// never shorten one, the differential test's do).
fn renew(
    s: &mut Store,
    c: &mut Ctx,
    fx: &mut Effects,
    token: Token,
    ttl: u8,
    until: Option<u8>,
) -> Answer {
    let found = holder(s, c.key, token);
    let k = &mut s.keys[c.key as usize];
    let l = match found {
        Holder::Code(answer) => return answer,
        Holder::Held(_) => k.lock.as_mut(),
        Holder::HeldPooled(_) => k.pool.iter_mut().find(|l| l.token == token),
    };
    let l = l.expect("the holder's lease");
    let before = l.left;
    l.left = match until {
        Some(until) => l.left.max(until),
        None if l.session => l.left,
        None => ttl,
    };
    l.by |= 1 << c.broker;
    let (fence, left) = (l.fence, l.left);
    if left < before
        && let Some(head) = k.queue.first()
    {
        tell(fx, head.broker, Notice::Look(c.key, left));
    }
    Answer::Held { fence }
}

/// force.lua: ends every live lease (offers included) without a token.
fn force(s: &mut Store, c: &mut Ctx, fx: &mut Effects) -> Answer {
    let us = s.us;
    if matches!(s.marker, None | Some(Marker { hold: 1.., .. })) {
        return Answer::HoldInForce;
    }
    let k = &mut s.keys[c.key as usize];
    let mut out = Vec::new();
    let mut tops = [0 as Fence; 8];
    let mut note = |by: u8, f: Fence| {
        for (b, top) in tops.iter_mut().enumerate() {
            if by & (1 << b) != 0 && *top < f {
                *top = f;
            }
        }
    };
    if let Some(l) = k.lock.take() {
        if l.live() {
            out.push(l.fence);
            note(l.by, l.fence);
        }
        kept_fence(k, Some(l.fence), us);
    }
    for l in k.pool.drain(..).filter(|l| l.live()) {
        out.push(l.fence);
        note(l.by, l.fence);
    }
    k.limit = None;
    for (b, top) in tops.into_iter().enumerate() {
        if top > 0 {
            ended(c, fx, 1 << b, top, true);
        }
    }
    fx.freed.push(c.key);
    hand_on(s, c, fx, None);
    Answer::Forced(out)
}

/// leave.lua: a queued bid stops waiting; an offer to it not taken ends.
fn leave(s: &mut Store, c: &mut Ctx, fx: &mut Effects, token: Token) -> Answer {
    let us = s.us;
    let k = &mut s.keys[c.key as usize];
    let before = k.queue.len();
    k.queue.retain(|b| b.token != token);
    let queued = k.queue.len() != before;
    let mut offer = false;
    if let Some(l) = k.lock.clone().filter(|l| l.token == token && l.offered) {
        kept_fence(k, Some(l.fence), us);
        k.lock = None;
        offer = true;
    }
    if !offer && k.pool.iter().any(|l| l.token == token && l.offered) {
        drop_holder(k, token);
        offer = true;
    }
    if offer || queued {
        if offer {
            fx.freed.push(c.key);
        }
        hand_on(s, c, fx, None);
    }
    Answer::Left(offer)
}
