//! The semaphore routes — take, give back, renew and inspect a permit on `/semaphores/{key}`,
//! list held semaphores on `/semaphores` — and their JSON bodies. A semaphore of `limit` permits
//! is a key whose leases are at most `limit` at once; each permit is a lease as a lock's is
//! (token, fence, expiry). Semaphore keys are a space of their own: `/semaphores/a` and
//! `/locks/a` are unrelated. The handlers are written by `lease_routes!` (`super::leases`), as
//! the lock routes' are, from what differs here ([`SemaphoreRoutes`]).

use serde::Serialize;
use utoipa::ToSchema;

use super::Limits;
use super::error::ApiError;
use super::error::responses::PermitRefused;
use super::leases::{GrantJson, LeaseSpace, lease_routes};
use super::locks::{HolderBody, aggregate, holder_bodies};
use super::requests::{SemaphoreAcquireBody, acquire_request};
use crate::domain::{Kind, LockKey, Space};
use crate::lock::{AcquireRequest, HoldersView};
use crate::store::{Lease, Listed, MAX_SEMAPHORE_LIMIT, Page, Store};

lease_routes! {
    SemaphoreRoutes "semaphores" ["/semaphores" "/semaphores/{key}" "/semaphores/{key}/renew"]
    operations [
        "acquire_permit" "release_permit" "renew_permit" "inspect_semaphore" "list_semaphores"
    ]
    types [
        SemaphoreAcquireBody "#/components/schemas/SemaphoreAcquireBody"
        PermitRefused PermitBody InspectBody ListBody
    ]
    answers [
        "The parameters, instead of or besides the query string."
        "Granted: the permit is held."
        "Released (with `force=true`: every permit ended)."
        "Renewed: the grant again, with the new expiry."
        "Held: the live permits."
        "A page of held semaphores."
    ]
    /// Take a permit
    ///
    /// Grants one of the semaphore's `limit` permits if one is free, waiting up to `wait_ms` while
    /// all are taken. Every holder must use the same `limit`: another one is `409 limit_mismatch`
    /// while permits taken with the first are live.
    ;
    /// Give back a permit
    ///
    /// Ends the permit that the token holds; the token comes as for locks. With `force=true` and no
    /// token, ends every permit of the semaphore instead.
    ;
    /// Renew a permit
    ///
    /// Moves the end of the token's live permit to `ttl_ms` after the renewal. Same token, same
    /// fence. The token comes as for release.
    ;
    /// Inspect or watch a semaphore
    ///
    /// Its limit and its live permits; never a token. With `watch=F` (the highest permit fence
    /// last seen, 0 for free) it answers at once if the permits differ from that, otherwise when
    /// they change within `wait_ms` (a permit taken, given back, expired or force-released; not a
    /// renewal), adding `fence` (the highest) and `changed`; as for locks.
    ;
    /// List held semaphores
    ///
    /// The semaphores with live permits whose keys start with `prefix`, a page at a time, in key
    /// order; never a token. Paged and authorised as `GET /locks`.
    ;
}

/// The semaphore routes' space: permits on `/semaphores/{key}`.
pub(super) struct SemaphoreRoutes;

impl LeaseSpace for SemaphoreRoutes {
    const SPACE: Space = Space::Semaphores;
    type Acquire = SemaphoreAcquireBody;
    type Grant<'a> = PermitBody<'a>;
    type Inspect<'a> = InspectBody<'a>;
    type List<'a> = ListBody<'a>;

    fn acquire_request(
        v: SemaphoreAcquireBody,
        limits: &Limits,
    ) -> Result<AcquireRequest, ApiError> {
        let limit = match v.limit {
            Some(n) if (1..=u64::from(MAX_SEMAPHORE_LIMIT)).contains(&n) => n as u32,
            Some(_) => {
                return Err(ApiError::invalid(format!(
                    "limit must be between 1 and {MAX_SEMAPHORE_LIMIT}."
                )));
            }
            None => {
                return Err(ApiError::invalid(format!(
                    "limit is required: how many permits the semaphore has (1 to \
                     {MAX_SEMAPHORE_LIMIT})."
                )));
            }
        };
        let kind = Kind::Semaphore { limit };
        acquire_request(kind, v.ttl_ms, v.wait_ms, v.owner, v.request_id, limits)
    }

    fn grant<'a>(key: &'a LockKey, lease: &'a Lease, limit: Option<u32>) -> PermitBody<'a> {
        PermitBody {
            key: key.as_str(),
            token: lease.token.as_str(),
            fence: lease.fence,
            ttl_ms: lease.ttl_ms,
            expires_at_ms: lease.expires_at_ms,
            limit: limit.unwrap_or_default(),
        }
    }

    fn inspect<'a>(
        key: &'a LockKey,
        view: &'a HoldersView,
        changed: Option<bool>,
    ) -> InspectBody<'a> {
        InspectBody {
            key: key.as_str(),
            limit: view.limit.unwrap_or_default(),
            holders: holder_bodies(view.now_ms, &view.holders),
            fence: changed.and_then(|_| view.holders.iter().map(|l| l.fence).max()),
            changed,
        }
    }

    fn list(page: &Page) -> ListBody<'_> {
        ListBody {
            semaphores: page
                .entries
                .iter()
                .filter_map(|entry| listed(page.now_ms, entry))
                .collect(),
            next_cursor: page.next_cursor.as_deref(),
        }
    }
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
}

/// By `serde_json`: a permit's body has more fields, and semaphores are the rarer path.
impl GrantJson for PermitBody<'_> {}

/// Who holds a semaphore's permits. Never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = Semaphore)]
pub(super) struct InspectBody<'a> {
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

/// One held semaphore in a listing. Never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = ListedSemaphore)]
struct ListedBody<'a> {
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
pub(super) struct ListBody<'a> {
    /// The held semaphores whose keys start with the prefix, in key order.
    semaphores: Vec<ListedBody<'a>>,
    /// Give it as `cursor` for the next page; null on the last page.
    #[schema(required = true)]
    next_cursor: Option<&'a str>,
}

fn listed(now_ms: u64, entry: &Listed) -> Option<ListedBody<'_>> {
    let (fence, expires_at_ms) = aggregate(&entry.holders)?;
    Some(ListedBody {
        key: entry.key.as_str(),
        limit: entry.limit?,
        holders: entry.holders.len(),
        fence,
        expires_at_ms,
        ttl_remaining_ms: expires_at_ms.saturating_sub(now_ms),
    })
}
