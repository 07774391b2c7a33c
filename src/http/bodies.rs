//! The JSON bodies the lock routes (`super::locks`) and the semaphore routes
//! (`super::semaphores`) answer with, each documented in `/openapi.json` by its `ToSchema`
//! derive under the name its `#[schema(as = …)]` gives. None of them ever holds a token but a
//! grant's, shown once, to the one who acquired it.

use serde::Serialize;
use utoipa::ToSchema;

use super::requests::ModeName;
use crate::domain::{LockKey, Mode, Owner};
use crate::lock::HoldersView;
use crate::store::{Lease, Listed, Page};

/// A grant's body written as JSON: by `serde_json` unless the body writes itself faster (the
/// lock grant, every acquire's answer: see `GrantBody`).
pub(super) trait GrantJson: Serialize {
    /// Appends the body's JSON to `out`.
    fn write_json(&self, out: &mut Vec<u8>) {
        serde_json::to_writer(out, self).expect("a grant serializes to JSON");
    }
}

/// The body of a grant (acquire, renew). The token is shown here and nowhere else.
#[derive(Serialize, ToSchema)]
#[schema(as = Grant)]
pub(super) struct GrantBody<'a> {
    /// The lock's key, as decoded.
    key: &'a str,
    /// The secret that proves the lease is yours (release, renew): opaque, URL-safe, at most
    /// 128 characters. Only acquire returns it, once; renew echoes the one it was given.
    #[schema(max_length = 128)]
    token: &'a str,
    /// The fencing number: for this key, greater than every fence granted before, across
    /// broker and Redis restarts. Renewals keep it.
    #[schema(minimum = 1)]
    fence: u64,
    /// The lease length in ms.
    #[schema(minimum = 1)]
    ttl_ms: u64,
    /// When the lease ends, Unix epoch ms on the store's clock.
    expires_at_ms: u64,
    /// Only for a lease under a session: when the session ends if not kept alive (the lease
    /// lives as long as the session; `expires_at_ms` is the same).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = u64, required = false)]
    session_expires_at_ms: Option<u64>,
}

impl<'a> GrantBody<'a> {
    pub(super) fn new(key: &'a LockKey, lease: &'a Lease) -> Self {
        Self {
            key: key.as_str(),
            token: lease.token.as_str(),
            fence: lease.fence,
            ttl_ms: lease.ttl_ms,
            expires_at_ms: lease.expires_at_ms,
            session_expires_at_ms: under_session(lease).then_some(lease.expires_at_ms),
        }
    }
}

/// Whether `lease` is held under a session.
pub(super) fn under_session(lease: &Lease) -> bool {
    lease
        .owner
        .as_ref()
        .and_then(Owner::session_delay_ms)
        .is_some()
}

impl GrantJson for GrantBody<'_> {
    /// The JSON `serde_json` writes, byte for byte, without its serializer's steps: each field
    /// name as a constant, the key and token copied whole when nothing in them needs an escape
    /// (a token never does; a key rarely), else the whole body by `serde_json`.
    fn write_json(&self, out: &mut Vec<u8>) {
        let plain = |s: &str| !s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\');
        if !(plain(self.key) && plain(self.token)) {
            serde_json::to_writer(out, self).expect("a grant serializes to JSON");
            return;
        }
        let mut number = itoa::Buffer::new();
        out.extend_from_slice(b"{\"key\":\"");
        out.extend_from_slice(self.key.as_bytes());
        out.extend_from_slice(b"\",\"token\":\"");
        out.extend_from_slice(self.token.as_bytes());
        out.extend_from_slice(b"\",\"fence\":");
        out.extend_from_slice(number.format(self.fence).as_bytes());
        out.extend_from_slice(b",\"ttl_ms\":");
        out.extend_from_slice(number.format(self.ttl_ms).as_bytes());
        out.extend_from_slice(b",\"expires_at_ms\":");
        out.extend_from_slice(number.format(self.expires_at_ms).as_bytes());
        if let Some(ends) = self.session_expires_at_ms {
            out.extend_from_slice(b",\"session_expires_at_ms\":");
            out.extend_from_slice(number.format(ends).as_bytes());
        }
        out.push(b'}');
    }
}

/// Who holds a lock and until when. Never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = Lease)]
pub(super) struct LockBody<'a> {
    /// The lock's key, as decoded.
    key: &'a str,
    /// `exclusive` (one holder) or `shared` (one or more holders, listed in `holders`).
    #[schema(value_type = ModeName)]
    mode: &'static str,
    /// The fence of the live lease; for shared holders, the highest of theirs.
    #[schema(minimum = 1)]
    fence: u64,
    /// When the lease ends, Unix epoch ms on the store's clock; for shared holders, when the
    /// last of their leases ends.
    expires_at_ms: u64,
    /// Milliseconds until `expires_at_ms`.
    ttl_remaining_ms: u64,
    /// The `owner` label the acquire gave, or null; null for shared holders (each has its own,
    /// in `holders`).
    #[schema(required = true)]
    owner: Option<&'a str>,
    /// Only for an exclusive lease under a session: `true` (shared holders say it each).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    #[schema(required = false)]
    session: bool,
    /// Only for `shared`: every shared holder, by fence.
    #[serde(skip_serializing_if = "Option::is_none")]
    holders: Option<Vec<HolderBody<'a>>>,
    /// Only with `watch`: whether the holders differ from what the watch saw (false: its wait
    /// ran out with no change).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = bool, required = false)]
    changed: Option<bool>,
}

impl<'a> LockBody<'a> {
    /// The body of an inspect of `key`; `changed`: a watch's answer.
    pub(super) fn new(key: &'a LockKey, view: &'a HoldersView, changed: Option<bool>) -> Self {
        let (fence, expires_at_ms) = aggregate(&view.holders).unwrap_or_default();
        let mode = view.mode.unwrap_or(Mode::Exclusive);
        Self {
            key: key.as_str(),
            mode: mode_name(mode),
            fence,
            expires_at_ms,
            ttl_remaining_ms: expires_at_ms.saturating_sub(view.now_ms),
            owner: exclusive_owner(mode, &view.holders),
            session: exclusive_under_session(mode, &view.holders),
            holders: (mode == Mode::Shared).then(|| holder_bodies(view.now_ms, &view.holders)),
            changed,
        }
    }
}

/// The `owner` label of a lock's one exclusive holder; `None` for shared holders (each has its
/// own, in `holders`).
fn exclusive_owner(mode: Mode, holders: &[Lease]) -> Option<&str> {
    match (mode, holders) {
        (Mode::Exclusive, [only]) => only.owner.as_ref().and_then(Owner::label),
        _ => None,
    }
}

/// Whether a lock's one exclusive holder holds it under a session.
fn exclusive_under_session(mode: Mode, holders: &[Lease]) -> bool {
    mode == Mode::Exclusive && holders.iter().any(under_session)
}

pub(super) fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Exclusive => "exclusive",
        Mode::Shared => "shared",
    }
}

/// One holder of a shared lock or of a semaphore's permits. Never its token.
#[derive(Serialize, ToSchema)]
#[schema(as = Holder)]
pub(super) struct HolderBody<'a> {
    /// The fence of this holder's lease.
    #[schema(minimum = 1)]
    fence: u64,
    /// When this lease ends, Unix epoch ms on the store's clock.
    expires_at_ms: u64,
    /// Milliseconds until this lease ends.
    ttl_remaining_ms: u64,
    /// The `owner` label its acquire gave (or its session's), or null.
    #[schema(required = true)]
    owner: Option<&'a str>,
    /// Only for a lease under a session: `true`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    #[schema(required = false)]
    session: bool,
}

/// The holders of a key, one body each, by fence.
pub(super) fn holder_bodies(now_ms: u64, holders: &[Lease]) -> Vec<HolderBody<'_>> {
    holders
        .iter()
        .map(|lease| HolderBody {
            fence: lease.fence,
            expires_at_ms: lease.expires_at_ms,
            ttl_remaining_ms: lease.expires_at_ms.saturating_sub(now_ms),
            owner: lease.owner.as_ref().and_then(Owner::label),
            session: under_session(lease),
        })
        .collect()
}

/// What a key's top-level fence and expiry are when several leases hold it: the highest fence
/// and the latest end (when the key is free again, unless renewed). `None` for no holder.
pub(super) fn aggregate(holders: &[Lease]) -> Option<(u64, u64)> {
    let fence = holders.iter().map(|l| l.fence).max()?;
    let end = holders.iter().map(|l| l.expires_at_ms).max()?;
    Some((fence, end))
}

/// One held lock in a listing. Never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = ListedLock)]
struct ListedLockBody<'a> {
    /// The lock's key.
    key: &'a str,
    /// `exclusive` or `shared`.
    #[schema(value_type = ModeName)]
    mode: &'static str,
    /// The lease's fence; for shared holders, the highest.
    #[schema(minimum = 1)]
    fence: u64,
    /// When the lease ends; for shared holders, when the last one does.
    expires_at_ms: u64,
    /// Milliseconds until `expires_at_ms`.
    ttl_remaining_ms: u64,
    /// The exclusive holder's `owner` label, or null (always null for shared holders).
    #[schema(required = true)]
    owner: Option<&'a str>,
    /// Only for an exclusive lease under a session: `true`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    #[schema(required = false)]
    session: bool,
}

/// A page of held locks.
#[derive(Serialize, ToSchema)]
#[schema(as = LockList)]
pub(super) struct LockListBody<'a> {
    /// The held locks whose keys start with the prefix, in key order.
    locks: Vec<ListedLockBody<'a>>,
    /// Give it as `cursor` for the next page; null on the last page.
    #[schema(required = true)]
    next_cursor: Option<&'a str>,
}

impl<'a> LockListBody<'a> {
    /// A listing's page of locks.
    pub(super) fn new(page: &'a Page) -> Self {
        Self {
            locks: page
                .entries
                .iter()
                .filter_map(|entry| listed_lock(page.now_ms, entry))
                .collect(),
            next_cursor: page.next_cursor.as_deref(),
        }
    }
}

fn listed_lock(now_ms: u64, entry: &Listed) -> Option<ListedLockBody<'_>> {
    let (fence, expires_at_ms) = aggregate(&entry.holders)?;
    let mode = entry.mode.unwrap_or(Mode::Exclusive);
    Some(ListedLockBody {
        key: entry.key.as_str(),
        mode: mode_name(mode),
        fence,
        expires_at_ms,
        ttl_remaining_ms: expires_at_ms.saturating_sub(now_ms),
        owner: exclusive_owner(mode, &entry.holders),
        session: exclusive_under_session(mode, &entry.holders),
    })
}

/// The body of a permit taken: a grant, with the semaphore's limit.
#[derive(Serialize, ToSchema)]
#[schema(as = PermitGrant)]
pub(super) struct PermitBody<'a> {
    /// The semaphore's key, as decoded.
    key: &'a str,
    /// The secret that proves the permit is yours (release, renew). Shown once, here.
    #[schema(max_length = 128)]
    token: &'a str,
    /// The permit's fencing number: for this semaphore, greater than every fence granted
    /// before.
    #[schema(minimum = 1)]
    fence: u64,
    /// The lease length in ms.
    #[schema(minimum = 1)]
    ttl_ms: u64,
    /// When the permit ends, Unix epoch ms on the store's clock.
    expires_at_ms: u64,
    /// How many permits the semaphore has.
    #[schema(minimum = 1)]
    limit: u32,
    /// Only for a permit under a session: when the session ends if not kept alive.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = u64, required = false)]
    session_expires_at_ms: Option<u64>,
}

impl<'a> PermitBody<'a> {
    /// The grant of `lease` on `key`, a semaphore of `limit` permits.
    pub(super) fn new(key: &'a LockKey, lease: &'a Lease, limit: u32) -> Self {
        Self {
            key: key.as_str(),
            token: lease.token.as_str(),
            fence: lease.fence,
            ttl_ms: lease.ttl_ms,
            expires_at_ms: lease.expires_at_ms,
            limit,
            session_expires_at_ms: under_session(lease).then_some(lease.expires_at_ms),
        }
    }
}

/// By `serde_json`: a permit's body has more fields, and semaphores are the rarer path.
impl GrantJson for PermitBody<'_> {}

/// Who holds a semaphore's permits. Never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = Semaphore)]
pub(super) struct SemaphoreBody<'a> {
    /// The semaphore's key, as decoded.
    key: &'a str,
    /// The limit the holders took their permits with.
    #[schema(minimum = 1)]
    limit: u32,
    /// Each live permit, by fence.
    holders: Vec<HolderBody<'a>>,
    /// Only with `watch`: the highest fence of the live permits (what a next watch gives).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = u64, required = false, minimum = 1)]
    fence: Option<u64>,
    /// Only with `watch`: whether the permits differ from what the watch saw (false: its wait
    /// ran out with no change).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = bool, required = false)]
    changed: Option<bool>,
}

impl<'a> SemaphoreBody<'a> {
    /// The body of an inspect of `key`; `changed`: a watch's answer (which adds `fence`).
    pub(super) fn new(key: &'a LockKey, view: &'a HoldersView, changed: Option<bool>) -> Self {
        Self {
            key: key.as_str(),
            limit: view.limit.unwrap_or_default(),
            holders: holder_bodies(view.now_ms, &view.holders),
            fence: changed.and_then(|_| view.holders.iter().map(|l| l.fence).max()),
            changed,
        }
    }
}

/// One held semaphore in a listing. Never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = ListedSemaphore)]
struct ListedSemaphoreBody<'a> {
    /// The semaphore's key.
    key: &'a str,
    /// The limit its holders use.
    #[schema(minimum = 1)]
    limit: u32,
    /// How many permits are taken.
    #[schema(minimum = 1)]
    holders: usize,
    /// The highest fence among the permits.
    #[schema(minimum = 1)]
    fence: u64,
    /// When the last permit ends.
    expires_at_ms: u64,
    /// Milliseconds until `expires_at_ms`.
    ttl_remaining_ms: u64,
}

/// A page of held semaphores.
#[derive(Serialize, ToSchema)]
#[schema(as = SemaphoreList)]
pub(super) struct SemaphoreListBody<'a> {
    /// The held semaphores whose keys start with the prefix, in key order.
    semaphores: Vec<ListedSemaphoreBody<'a>>,
    /// Give it as `cursor` for the next page; null on the last page.
    #[schema(required = true)]
    next_cursor: Option<&'a str>,
}

impl<'a> SemaphoreListBody<'a> {
    /// A listing's page of semaphores.
    pub(super) fn new(page: &'a Page) -> Self {
        Self {
            semaphores: page
                .entries
                .iter()
                .filter_map(|entry| listed_semaphore(page.now_ms, entry))
                .collect(),
            next_cursor: page.next_cursor.as_deref(),
        }
    }
}

fn listed_semaphore(now_ms: u64, entry: &Listed) -> Option<ListedSemaphoreBody<'_>> {
    let (fence, expires_at_ms) = aggregate(&entry.holders)?;
    Some(ListedSemaphoreBody {
        key: entry.key.as_str(),
        limit: entry.limit?,
        holders: entry.holders.len(),
        fence,
        expires_at_ms,
        ttl_remaining_ms: expires_at_ms.saturating_sub(now_ms),
    })
}

#[cfg(test)]
mod tests;
