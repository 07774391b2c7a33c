//! check.lua and put_back.lua: a new epoch after a loss, and the leases put back into it.

use super::queue::{drop_holder, kept_fence, live_count};
use super::{Answer, Back, BackCode, Fence, Kind, Lease, Marker, Params, Store};

/// check.lua: a missing marker begins a new epoch with the settle hold.
pub(super) fn check(s: &mut Store, p: &Params) -> Answer {
    let m = *s.marker.get_or_insert_with(|| {
        let id = s.next_epoch;
        s.next_epoch += 1;
        Marker { id, hold: p.settle }
    });
    Answer::Epoch(m.id)
}

/// put_back.lua: a broker's live leases back into a new epoch.
pub(super) fn put_back(
    s: &mut Store,
    p: &Params,
    broker: u8,
    epoch: u8,
    leases: &[Back],
) -> Answer {
    let us = s.us;
    let Some(m) = s.marker.as_mut().filter(|m| m.id == epoch) else {
        return Answer::EpochMoved;
    };
    m.hold = m.hold.max(p.put_back_hold);
    let me = 1u8 << broker;
    let mut out = Vec::new();
    for back in leases {
        let k = &mut s.keys[back.key as usize];
        if k.counter.unwrap_or(0) < back.fence {
            k.counter = Some(back.fence);
        }
        let mine = Lease {
            token: back.token,
            fence: back.fence,
            left: back.left,
            offered: false,
            by: me,
            session: back.session,
        };
        let mut code = BackCode::Written;
        if back.kind == Kind::Exclusive {
            let cur = k.lock.clone();
            kept_fence(k, cur.as_ref().map(|l| l.fence), us);
            if let Some(cur) = cur.filter(Lease::live) {
                if cur.token == back.token {
                    code = BackCode::AlreadyThere;
                    let l = k.lock.as_mut().expect("the lease");
                    l.by |= me;
                    l.left = l.left.max(back.left);
                } else if cur.fence > back.fence {
                    code = BackCode::OtherKept;
                } else {
                    code = BackCode::OtherReplaced;
                }
            }
            if matches!(code, BackCode::Written | BackCode::OtherReplaced) {
                let live: Vec<Fence> = k
                    .pool
                    .iter()
                    .filter(|l| l.live())
                    .map(|l| l.fence)
                    .collect();
                if live.iter().any(|f| *f > back.fence) {
                    code = BackCode::OtherKept;
                } else if !live.is_empty() {
                    code = BackCode::OtherReplaced;
                    k.pool.clear();
                    k.limit = None;
                }
            }
            if matches!(code, BackCode::Written | BackCode::OtherReplaced) {
                k.lock = Some(mine);
            }
        } else {
            if let Some(l) = k
                .pool
                .iter_mut()
                .find(|l| l.token == back.token && l.live())
            {
                code = BackCode::AlreadyThere;
                l.by |= me;
                l.left = l.left.max(back.left);
            }
            if code == BackCode::Written && back.kind == Kind::Shared {
                let cur = k.lock.clone();
                kept_fence(k, cur.as_ref().map(|l| l.fence), us);
                if let Some(cur) = cur {
                    if cur.live() && cur.fence > back.fence {
                        code = BackCode::OtherKept;
                    } else {
                        if cur.live() {
                            code = BackCode::OtherReplaced;
                        }
                        k.lock = None;
                    }
                }
            }
            if code != BackCode::AlreadyThere && code != BackCode::OtherKept {
                if let Kind::Permit(n) = back.kind
                    && live_count(k) == 0
                {
                    k.limit = Some(n);
                }
                drop_holder(k, back.token);
                k.pool.push(mine);
                k.pool.sort();
            }
        }
        out.push(code);
    }
    Answer::PutBack(out)
}
