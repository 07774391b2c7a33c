//! The metrics' labels: the store primitives, kinds and key spaces as label values, the label
//! sets, and the counters by result that are created up front so every series shows from the
//! first scrape; and the outcomes the service counts by (an acquire's, a holder's call's, an offer
//! passed on).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::domain::{Kind, Space};

/// A store primitive, as a label value.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)] // label values are written as the variants are named
pub enum StoreOp {
    claim,
    /// Several free keys in one step (see `Store::claim_all`).
    claim_all,
    read,
    take_over,
    release,
    renew,
    ping,
    join,
    permits,
    force_release,
    list,
    session,
    /// A session's keep-alive on its leases (one call or several, see `Store::renew_all`).
    keep,
}

impl StoreOp {
    pub(super) const ALL: [Self; 13] = [
        Self::claim,
        Self::claim_all,
        Self::read,
        Self::take_over,
        Self::release,
        Self::renew,
        Self::ping,
        Self::join,
        Self::permits,
        Self::force_release,
        Self::list,
        Self::session,
        Self::keep,
    ];
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct OpLabels {
    pub(super) op: StoreOp,
}

/// A decision of the auth layer: the token's name (bounded by the auth file; empty when no
/// known token was sent) and the result. Never the token itself.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct AuthLabels {
    pub(super) token: String,
    pub(super) result: &'static str,
}

/// A session call's outcome.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct SessionLabels {
    pub(super) event: &'static str,
}

/// A kind of acquire, as a label value.
pub(super) fn kind_label(kind: Kind) -> &'static str {
    match kind {
        Kind::Exclusive => "exclusive",
        Kind::Shared => "shared",
        Kind::Semaphore { .. } => "semaphore",
    }
}

/// A key space, as a label value.
pub(super) fn space_label(space: Space) -> &'static str {
    match space {
        Space::Locks => "locks",
        Space::Semaphores => "semaphores",
    }
}

/// An acquire's labels: what it asked for and how it ended.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct KindLabels {
    pub(super) kind: &'static str,
    pub(super) result: &'static str,
}

/// A holder-checked operation's labels: its key space and how it ended.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct SpaceLabels {
    pub(super) space: &'static str,
    pub(super) result: &'static str,
}

/// A key space alone, as a label set (the queue's gauges and counters).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct QueueLabels {
    pub(super) space: &'static str,
}

/// Why an offer to one of this broker's waiters passed on to the next in line.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct PassedOnLabels {
    pub(super) reason: &'static str,
}

/// Counters by result and one more label (a kind or a space), each series created up front so
/// that every one shows from the first scrape.
pub(super) struct ByResult<L> {
    pub(super) family: Family<L, Counter>,
    /// The result label of each result (`AcquireResult` or `HolderResult`, as `usize`).
    pub(super) results: &'static [&'static str],
    /// The series created up front, by their labels: a count goes straight to its counter
    /// instead of hashing its labels into the family's map under its lock.
    handles: Vec<(L, Counter)>,
}

impl<L: EncodeLabelSet + Clone + Eq + std::hash::Hash + std::fmt::Debug + Send + Sync + 'static>
    ByResult<L>
{
    pub(super) fn register(
        registry: &mut Registry,
        name: &str,
        help: &str,
        results: &'static [&'static str],
        series: impl IntoIterator<Item = L>,
    ) -> Self {
        let family = Family::<L, Counter>::default();
        registry.register(name, help, family.clone());
        let handles = series
            .into_iter()
            .map(|labels| {
                let counter = family.get_or_create(&labels).clone();
                (labels, counter)
            })
            .collect();
        Self {
            family,
            results,
            handles,
        }
    }

    /// Counts one for `labels`: on its counter made up front (a few series, compared by
    /// their `&'static str` labels), or through the family for any other.
    pub(super) fn inc(&self, labels: &L) {
        match self.handles.iter().find(|(l, _)| l == labels) {
            Some((_, counter)) => {
                counter.inc();
            }
            None => {
                self.family.get_or_create(labels).inc();
            }
        }
    }
}

/// Every (space, result) pair of `results`.
pub(super) fn by_space(results: &'static [&'static str]) -> impl Iterator<Item = SpaceLabels> {
    [Space::Locks, Space::Semaphores]
        .into_iter()
        .flat_map(move |space| {
            results.iter().map(move |result| SpaceLabels {
                space: space_label(space),
                result,
            })
        })
}

pub(super) const ACQUIRE_RESULTS: &[&str] = &["granted", "locked", "error", "limit_mismatch"];
pub(super) const RENEW_RESULTS: &[&str] = &["renewed", "not_held", "not_owner", "error"];
pub(super) const RELEASE_RESULTS: &[&str] = &["released", "not_held", "not_owner", "error"];
/// Force release knows no owner: a `not_owner` from the store would be a bug, counted as error.
pub(super) const FORCE_RESULTS: &[&str] = &["released", "not_held", "error"];

/// An acquire's outcome, for `lockbroker_acquisitions_total`.
#[derive(Debug, Clone, Copy)]
pub enum AcquireResult {
    Granted,
    Locked,
    Error,
    /// A semaphore acquire whose limit differs from the holders'.
    LimitMismatch,
}

/// Why an offer to one of this broker's waiters passed on to the next in line.
#[derive(Debug, Clone, Copy)]
pub enum PassedOn {
    /// The waiter had left (its wait ran out, its client went away): the offer was ended at once.
    Gone,
    /// The offer was not taken within the store's offer window, and the store dropped this
    /// broker's entries from the key's queue (its waiters joined again).
    Lapsed,
}

impl PassedOn {
    pub(super) fn label(self) -> &'static str {
        match self {
            PassedOn::Gone => "gone",
            PassedOn::Lapsed => "lapsed",
        }
    }
}

/// A release's or renewal's outcome.
#[derive(Debug, Clone, Copy)]
pub enum HolderResult {
    Done,
    NotHeld,
    NotOwner,
    Error,
}
