//! Reading the scripts' replies: typed fields out of an array reply, and the answers that mean
//! "not yours" or "held".

use redis::{FromRedisValue, Value};

use crate::domain::Owner;
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

pub(super) type ReadReply = (
    u64,
    Option<String>,
    Option<u64>,
    Option<u64>,
    Option<u64>,
    Option<String>,
    Option<String>,
);
