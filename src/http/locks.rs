//! The lock routes — acquire (exclusive or shared), release (by token or by force), renew and
//! inspect a lease on `/locks/{key}`, list held locks on `/locks` — and the JSON bodies they
//! answer with, some of which the semaphore routes (`super::semaphores`) share. The handlers
//! are written by `lease_routes!` (`super::leases`) from what differs here: the paths, the
//! words, the acquire's parameters and the bodies ([`LockRoutes`]); every refusal is an
//! [`ApiError`].

use serde::Serialize;
use utoipa::ToSchema;

use super::Limits;
use super::error::ApiError;
use super::error::responses::Locked;
use super::leases::{GrantJson, LeaseSpace, lease_routes};
use super::requests::{AcquireBody, ModeName, acquire_request};
use crate::domain::{Kind, LockKey, Mode, Owner, Space};
use crate::lock::{AcquireRequest, HoldersView};
use crate::store::{Lease, Listed, Page, Store};

lease_routes! {
    LockRoutes "locks" ["/locks" "/locks/{key}" "/locks/{key}/renew"]
    operations ["acquire" "release" "renew" "inspect" "list_locks"]
    types [AcquireBody "#/components/schemas/AcquireBody" Locked GrantBody InspectBody LockListBody]
    answers [
        "The parameters, instead of or besides the query string; may be empty."
        "Granted: the lease is held."
        "Released (with `force=true`: every lease on the key ended)."
        "Renewed: the grant again, with the new expiry."
        "Held: the live lease."
        "A page of held locks."
    ]
    /// Acquire a lock
    ///
    /// Grants a lease on `key` if nobody holds it (or the holder's lease has expired), waiting up
    /// to `wait_ms` while someone else holds it. Answers `201` only when the lease is really held.
    /// With `mode=shared`, a shared lease: granted beside other shared ones, never with an exclusive
    /// one; an exclusive acquire that waits holds new shared ones back, so it is not starved.
    ;
    /// Release a lock
    ///
    /// Ends the lease that the token holds (the exclusive one, or one shared lease). The token
    /// comes in the `Lock-Token` header or the `token` query parameter, never in a body. After a
    /// `503`, the lease may still be held. With `force=true` and no token, ends every lease on the
    /// key instead.
    ;
    /// Renew a lease
    ///
    /// Moves the end of the token's live lease to `ttl_ms` after the renewal. Same token, same
    /// fence. The token comes as for release.
    ;
    /// Inspect or watch a lock
    ///
    /// Who holds the lock, in which mode and until when; never a token. For shared holders,
    /// `fence` is the highest of theirs, `expires_at_ms` the latest end, `owner` null, and
    /// `holders` lists each. With `watch=F` (the fence last seen, 0 for free) it answers at once if
    /// the holders differ from that, otherwise when they change within `wait_ms` (a grant, a
    /// release, an expiry, a takeover, a force release; not a renewal), with `changed`; when the
    /// wait runs out, the unchanged view with `changed: false`. A free key is `404 not_held` with
    /// `fence: null`. A watch waits like an acquire (it counts against `max_waiters`).
    ;
    /// List held locks
    ///
    /// The locks with live leases whose keys start with `prefix`, a page at a time, in key order;
    /// never a token. Follow `next_cursor` until it is null. A page may hold fewer than `limit`
    /// entries and still have a next one. With auth, needs `read` or `lock` on a prefix of `prefix`
    /// (so a token limited to `orders:` lists with `prefix=orders:` or longer).
    ;
}

/// The lock routes' space: exclusive and shared leases on `/locks/{key}`.
pub(super) struct LockRoutes;

impl LeaseSpace for LockRoutes {
    const SPACE: Space = Space::Locks;
    type Acquire = AcquireBody;
    type Grant<'a> = GrantBody<'a>;
    type Inspect<'a> = InspectBody<'a>;
    type List<'a> = LockListBody<'a>;

    fn acquire_request(v: AcquireBody, limits: &Limits) -> Result<AcquireRequest, ApiError> {
        let kind = match v.mode {
            None | Some(ModeName::Exclusive) => Kind::Exclusive,
            Some(ModeName::Shared) => Kind::Shared,
        };
        acquire_request(kind, v.ttl_ms, v.wait_ms, v.owner, v.request_id, limits)
    }

    fn grant<'a>(key: &'a LockKey, lease: &'a Lease, _: Option<u32>) -> GrantBody<'a> {
        GrantBody::new(key, lease)
    }

    fn inspect<'a>(
        key: &'a LockKey,
        view: &'a HoldersView,
        changed: Option<bool>,
    ) -> InspectBody<'a> {
        inspect_body(key, view, changed)
    }

    fn list(page: &Page) -> LockListBody<'_> {
        LockListBody {
            locks: page
                .entries
                .iter()
                .filter_map(|entry| listed_lock(page.now_ms, entry))
                .collect(),
            next_cursor: page.next_cursor.as_deref(),
        }
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
}

impl<'a> GrantBody<'a> {
    pub(super) fn new(key: &'a LockKey, lease: &'a Lease) -> Self {
        Self {
            key: key.as_str(),
            token: lease.token.as_str(),
            fence: lease.fence,
            ttl_ms: lease.ttl_ms,
            expires_at_ms: lease.expires_at_ms,
        }
    }
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
        out.push(b'}');
    }
}

/// Who holds a lock and until when. Never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = Lease)]
pub(super) struct InspectBody<'a> {
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
    /// Only for `shared`: every shared holder, by fence.
    #[serde(skip_serializing_if = "Option::is_none")]
    holders: Option<Vec<HolderBody<'a>>>,
    /// Only with `watch`: whether the holders differ from what the watch saw (false: its wait
    /// ran out with no change).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = bool, required = false)]
    changed: Option<bool>,
}

fn mode_name(mode: Mode) -> &'static str {
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
    /// The `owner` label its acquire gave, or null.
    #[schema(required = true)]
    owner: Option<&'a str>,
}

/// The holders of a key, one body each, by fence.
pub(super) fn holder_bodies(now_ms: u64, holders: &[Lease]) -> Vec<HolderBody<'_>> {
    holders
        .iter()
        .map(|lease| HolderBody {
            fence: lease.fence,
            expires_at_ms: lease.expires_at_ms,
            ttl_remaining_ms: lease.expires_at_ms.saturating_sub(now_ms),
            owner: lease.owner.as_ref().map(Owner::as_str),
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

fn inspect_body<'a>(
    key: &'a LockKey,
    view: &'a HoldersView,
    changed: Option<bool>,
) -> InspectBody<'a> {
    let (fence, expires_at_ms) = aggregate(&view.holders).unwrap_or_default();
    let shared = view.mode == Some(Mode::Shared);
    InspectBody {
        key: key.as_str(),
        mode: mode_name(view.mode.unwrap_or(Mode::Exclusive)),
        fence,
        expires_at_ms,
        ttl_remaining_ms: expires_at_ms.saturating_sub(view.now_ms),
        owner: match view.holders.as_slice() {
            [only] if !shared => only.owner.as_ref().map(Owner::as_str),
            _ => None,
        },
        holders: shared.then(|| holder_bodies(view.now_ms, &view.holders)),
        changed,
    }
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

fn listed_lock(now_ms: u64, entry: &Listed) -> Option<ListedLockBody<'_>> {
    let (fence, expires_at_ms) = aggregate(&entry.holders)?;
    let mode = entry.mode.unwrap_or(Mode::Exclusive);
    Some(ListedLockBody {
        key: entry.key.as_str(),
        mode: mode_name(mode),
        fence,
        expires_at_ms,
        ttl_remaining_ms: expires_at_ms.saturating_sub(now_ms),
        owner: match (mode, entry.holders.as_slice()) {
            (Mode::Exclusive, [only]) => only.owner.as_ref().map(Owner::as_str),
            _ => None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::{GrantBody, GrantJson};

    #[test]
    fn a_grant_writes_the_json_serde_json_writes() {
        let keys = [
            "orders:42",
            "",
            "quote\"d",
            "back\\slash",
            "tab\tand\nline",
            "\u{1}\u{1f}\u{7f}",
            "ключ/é/🔒",
            "</script>",
        ];
        for key in keys {
            for token in ["d23f5ce94ec844df830f8f01820348ae", "to\"ken"] {
                let body = GrantBody {
                    key,
                    token,
                    fence: 1_795_302_504_036_625,
                    ttl_ms: 30_000,
                    expires_at_ms: u64::MAX,
                };
                let mut written = Vec::new();
                body.write_json(&mut written);
                assert_eq!(
                    String::from_utf8(written).unwrap(),
                    serde_json::to_string(&body).unwrap(),
                    "key {key:?}, token {token:?}"
                );
            }
        }
    }
}
