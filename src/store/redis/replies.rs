//! Reading the scripts' replies: typed fields out of an array reply, and the answers that mean
//! "not yours" or "held".

use redis::{FromRedisValue, Value};

use crate::domain::{Lease, Owner, RequestId, Token};
use crate::store::{Hold, HoldReason, Holder, StoreError, StoreResult};

/// A hold as the scripts report it.
pub(super) fn held(hold_until_ms: u64, now_ms: u64, reason: &str) -> Hold {
    Hold {
        reason: if reason == "loss" {
            HoldReason::Loss
        } else {
            HoldReason::Settling
        },
        retry_after_ms: hold_until_ms.saturating_sub(now_ms).max(1),
    }
}

/// Element `i` of a script's array reply.
pub(super) fn field<T: FromRedisValue>(reply: &[Value], i: usize) -> StoreResult<T> {
    reply
        .get(i)
        .ok_or_else(|| corrupt("reply"))
        .and_then(|v| T::from_redis_value_ref(v).map_err(|_| corrupt("reply")))
}

pub(super) fn corrupt(what: &str) -> StoreError {
    StoreError::Failed(format!("the lock in Redis has a malformed {what}"))
}

/// The holder script's answers other than "yours".
pub(super) fn refusal<T>(reply: &[Value]) -> StoreResult<Holder<T>> {
    match field::<u8>(reply, 0)? {
        0 => Ok(Holder::NotHeld),
        2 => Ok(Holder::NotOwner),
        3 => Ok(Holder::Held(held(
            field(reply, 1)?,
            field(reply, 2)?,
            &field::<String>(reply, 3)?,
        ))),
        code => Err(StoreError::Failed(format!(
            "unexpected holder code {code} from Redis"
        ))),
    }
}

pub(super) fn parse_owner(raw: Option<String>) -> StoreResult<Option<Owner>> {
    raw.map(|o| Owner::parse(&o).map_err(|_| corrupt("owner")))
        .transpose()
}

/// The lease whose six fields (token, fence, expires_at, ttl, owner, request id) start at
/// element `at` of a reply.
pub(super) fn lease_at(reply: &[Value], at: usize) -> StoreResult<Lease> {
    let token: String = field(reply, at)?;
    Ok(Lease {
        token: Token::parse(&token).map_err(|_| corrupt("token"))?,
        fence: field(reply, at + 1)?,
        expires_at_ms: field(reply, at + 2)?,
        ttl_ms: field(reply, at + 3)?,
        owner: parse_owner(field(reply, at + 4)?)?,
        request_id: field::<Option<String>>(reply, at + 5)?.and_then(|r| RequestId::parse(&r).ok()),
        limit: None,
    })
}

/// The leases listed six fields each from element `from` to the reply's end, by fence.
pub(super) fn leases_from(reply: &[Value], from: usize) -> StoreResult<Vec<Lease>> {
    if reply.len() < from || !(reply.len() - from).is_multiple_of(6) {
        return Err(corrupt("reply"));
    }
    let mut leases = (from..reply.len())
        .step_by(6)
        .map(|at| lease_at(reply, at))
        .collect::<StoreResult<Vec<_>>>()?;
    leases.sort_by_key(|l| l.fence);
    Ok(leases)
}
