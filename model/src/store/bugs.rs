//! The known-bad variants of the scripts (`scripts/model-check.sh --bug NAME`).

/// Known-bad variants of the protocol: each a mistake someone could make in the scripts. The
/// checker must find a counterexample for each (`scripts/model-check.sh --bug NAME`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bug {
    /// `checked` does not compare the epoch: a broker grants into an emptied store before the
    /// others put their leases back.
    NoEpochCheck,
    /// The hand-on writes an offer without taking a fence; the take keeps the record's (stale)
    /// fence.
    OfferWithoutFence,
    /// RELEASE drops the lease record without `kept_fence`: after the clock steps back, the
    /// fast path's clock fence is below the released one.
    ReleaseDropsKeptFence,
    /// A lapsed offer's broker keeps its other bids in the queue (`requeue` only tells it).
    LapseKeepsQueue,
    /// RELEASE does not hand the key on: the queue's head is left waiting on a free key.
    ReleaseWithoutHandOn,
    /// A session's keep-alive renews its leases with RENEW's ttl form instead of `until`: a
    /// lease under a session keeps its end on such a renewal, so the keep-alive extends none.
    KeepForTtl,
    /// A close releases the session's entries first and ends its record after: an acquire
    /// that enters and is granted between the two is left held.
    CloseReleasesFirst,
    /// A queued bid granted on its own ask gets the TTL it was queued with, not the one it asks
    /// for now: a lease under a session granted after a wait outlives its session's end by the
    /// time it waited (what `lib/queue.lua`'s `hand_on` did before it took the ask's TTL).
    QueuedTtl,
    /// A keep-alive drops the entries whose leases it does not find at once (what `keep_alive` in
    /// core/src/lock/sessions.rs did before `ENTRY_GRACE_MS`): an acquire entered but not granted
    /// yet loses its
    /// entry, and if its broker dies between its grant and its confirmation, a close misses it.
    KeepDropsEntries,
    /// A several-keys acquire takes its keys in the order the client named them, not sorted:
    /// two requests for the same keys in opposite orders each hold one and wait for the other.
    GivenOrder,
    /// A several-keys acquire refused (or given up) mid-way leaves the queue it waits in but
    /// does not release the keys it took.
    RefusalKeepsKeys,
    /// CLAIM_ALL grants the free keys among its keys and refuses only because of the busy ones
    /// (not all or nothing): the request, told "refused", holds keys it does not know of.
    PartialGrant,
    /// BATCH's claims skip `checked` (as its releases may, RELEASE's fast path checking no
    /// epoch): a broker that has not caught up with a store loss grants into the emptied store
    /// before the holders' brokers put their leases back.
    BatchSkipsEpoch,
    /// `settle` drops an ended lease record without `kept_fence`: the next exclusive grant
    /// reads the counter but does not write it, so after the clock steps back its fence is
    /// below the ended lease's.
    SettleDropsKeptFence,
    /// A broker answers a waiter's ask from the grants its RELEASE handed straight to its own
    /// bids (`handed`) without checking that its ledger still holds that lease: after a force
    /// release it has learned of (or a put-back refused), it tells the waiter "granted" for a
    /// lease that is gone while the key has another holder.
    HandedWithoutLedger,
}

impl Bug {
    pub const ALL: [Bug; 15] = [
        Bug::NoEpochCheck,
        Bug::OfferWithoutFence,
        Bug::ReleaseDropsKeptFence,
        Bug::LapseKeepsQueue,
        Bug::ReleaseWithoutHandOn,
        Bug::KeepForTtl,
        Bug::CloseReleasesFirst,
        Bug::QueuedTtl,
        Bug::KeepDropsEntries,
        Bug::GivenOrder,
        Bug::RefusalKeepsKeys,
        Bug::PartialGrant,
        Bug::BatchSkipsEpoch,
        Bug::SettleDropsKeptFence,
        Bug::HandedWithoutLedger,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Bug::NoEpochCheck => "no-epoch-check",
            Bug::OfferWithoutFence => "offer-without-fence",
            Bug::ReleaseDropsKeptFence => "release-drops-kept-fence",
            Bug::LapseKeepsQueue => "lapse-keeps-queue",
            Bug::ReleaseWithoutHandOn => "release-without-hand-on",
            Bug::KeepForTtl => "keep-for-ttl",
            Bug::CloseReleasesFirst => "close-releases-first",
            Bug::QueuedTtl => "queued-ttl",
            Bug::KeepDropsEntries => "keep-drops-entries",
            Bug::GivenOrder => "given-order",
            Bug::RefusalKeepsKeys => "refusal-keeps-keys",
            Bug::PartialGrant => "partial-grant",
            Bug::BatchSkipsEpoch => "batch-skips-epoch",
            Bug::SettleDropsKeptFence => "settle-drops-kept-fence",
            Bug::HandedWithoutLedger => "handed-without-ledger",
        }
    }

    pub fn parse(name: &str) -> Option<Bug> {
        Bug::ALL.into_iter().find(|b| b.name() == name)
    }
}
