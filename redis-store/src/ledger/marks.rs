//! The ledger's end marks (see the ledger's docs): the ends seen lately, by space and key, each
//! kept for the ledger's linger, so that the answer of a renewal Redis ran before an end does not
//! bring the ended lease back into the ledger.

use super::BySpace;
use lockbroker_core::domain::{Fence, Kind, Space};

/// The ends seen lately, by space and key.
#[derive(Debug, Default)]
pub(super) struct EndMarks(BySpace<Marks>);

/// The end marks of one key, and the highest fence among them: a lease with a higher fence is
/// covered by none of them (see [`Ended::covers`]), which a grant, whose fence is the newest,
/// finds without going through the marks (a busy key has a mark for every release of the last
/// few seconds).
#[derive(Debug, Default)]
struct Marks {
    list: Vec<Ended>,
    highest: Fence,
}

/// The mark of an end: the lease with `fence` on a key is over — and, with `all`, every lease on
/// the key up to it; on a lock, an exclusive lease up to it either way.
#[derive(Debug, Clone, Copy)]
struct Ended {
    fence: Fence,
    all: bool,
    /// Until when the mark is kept, in the ledger's milliseconds (as `Kept::ends_ms`).
    until_ms: u64,
}

impl Ended {
    /// Whether a lease of `kind` with `fence` is one this mark ended.
    fn covers(&self, kind: Kind, fence: Fence) -> bool {
        if kind == Kind::Exclusive || self.all {
            fence <= self.fence
        } else {
            fence == self.fence
        }
    }
}

impl EndMarks {
    /// Leaves the mark of an end on `key` in `space`, kept until `until_ms`.
    pub(super) fn mark(&mut self, space: Space, key: &str, fence: Fence, all: bool, until_ms: u64) {
        let by_key = self.0.of_mut(space);
        if !by_key.contains_key(key) {
            by_key.insert(key.into(), Marks::default());
        }
        let marks = by_key.get_mut(key).expect("inserted above");
        marks.highest = marks.highest.max(fence);
        marks.list.push(Ended {
            fence,
            all,
            until_ms,
        });
    }

    /// Whether a mark still kept at `now_ms` ended the lease of `kind` on `key` with `fence`.
    pub(super) fn ended(&self, key: &str, kind: Kind, fence: Fence, now_ms: u64) -> bool {
        self.0.of(kind.space()).get(key).is_some_and(|marks| {
            // No mark covers a fence above every mark's.
            fence <= marks.highest
                && marks
                    .list
                    .iter()
                    .any(|m| m.until_ms > now_ms && m.covers(kind, fence))
        })
    }

    /// Drops the marks kept until `now_ms` or before.
    pub(super) fn sweep(&mut self, now_ms: u64) {
        self.0.retain(|marks| {
            marks.list.retain(|m| m.until_ms > now_ms);
            marks.highest = marks.list.iter().map(|m| m.fence).max().unwrap_or(0);
            !marks.list.is_empty()
        });
    }
}
