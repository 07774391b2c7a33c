//! The granting scripts' calls — CLAIM (`claim.lua`), TAKE_OVER (`take_over.lua`) and JOIN
//! (`join.lua`) — and their one reply.

use redis::{FromRedisValue, ParsingError, Value};

use super::{Fields, hold_in, unknown};
use crate::domain::Fence;
use crate::store::redis::keys::RedisKeys;
use crate::store::{Bid, EXPIRY_SLACK_MS, Hold, Pool};

/// CLAIM's call: SETNX for `bid` on the key of `keys`, in `epoch`.
pub(crate) struct Claim<'a> {
    pub keys: &'a RedisKeys,
    /// The key's epoch marker.
    pub marker: &'a str,
    pub bid: &'a Bid,
    /// The epoch this broker knows.
    pub epoch: &'a str,
}

script_call! {
    Claim<'_> => claim,
    type Reply = Epoched<GrantReply>;
    |this, call| {
        let (keys, bid) = (this.keys, this.bid);
        call.key(&keys.lock)
            .key(&keys.fence)
            .key(this.marker)
            .key(&keys.pool)
            .key(&keys.ends)
            .key(&keys.writers);
        call.arg(bid.token.as_str())
            .arg(bid.ttl.as_ms())
            .arg(if bid.owner.is_some() { "1" } else { "0" })
            .arg(bid.owner.as_ref().map_or("", |o| o.as_str()))
            .arg(EXPIRY_SLACK_MS)
            .arg(this.epoch)
            .arg(bid.request_id.as_ref().map_or("", |r| r.as_str()))
            .arg(if bid.waits() { "1" } else { "0" });
    }
}

/// TAKE_OVER's call: CLAIM's keys and arguments, then the fence of the expired lease seen.
pub(crate) struct TakeOver<'a> {
    pub claim: Claim<'a>,
    pub seen: Fence,
}

script_call! {
    TakeOver<'_> => take_over,
    type Reply = Epoched<GrantReply>;
    |this, call| {
        this.claim.write(call);
        call.arg(this.seen);
    }
}

/// JOIN's call: a shared lease or a permit for `bid` in `pool`.
pub(crate) struct Join<'a> {
    pub keys: &'a RedisKeys,
    pub marker: &'a str,
    pub pool: Pool,
    pub bid: &'a Bid,
    pub epoch: &'a str,
}

script_call! {
    Join<'_> => join,
    type Reply = Epoched<GrantReply>;
    |this, call| {
        let (keys, bid) = (this.keys, this.bid);
        call.key(&keys.pool)
            .key(&keys.ends)
            .key(&keys.fence)
            .key(this.marker);
        if this.pool == Pool::Shared {
            call.key(&keys.lock).key(&keys.writers);
        }
        call.arg(bid.token.as_str())
            .arg(bid.ttl.as_ms())
            // An owner label as the pool scripts take it: '' for none, else '=' and the label.
            .arg(
                bid.owner
                    .as_ref()
                    .map_or(String::new(), |o| format!("={}", o.as_str())),
            )
            .arg(EXPIRY_SLACK_MS)
            .arg(match this.pool {
                Pool::Shared => String::new(),
                Pool::Semaphore { limit } => limit.to_string(),
            })
            .arg(this.epoch)
            .arg(bid.request_id.as_ref().map_or("", |r| r.as_str()));
    }
}

/// A reply of a script that checks the epoch before it grants: its answer, or the store's epoch
/// when it is not the one the broker passed (code 3).
pub(crate) enum Epoched<T> {
    Answered(T),
    /// The store (on a cluster: the key's slot marker) is in another epoch: this one, or none
    /// when the marker is missing.
    OtherEpoch(Option<String>),
}

/// What a granting script answered in the broker's epoch.
pub(crate) enum GrantReply {
    /// Code 1.
    Granted(Granted),
    NotGranted(NotGranted),
}

/// A granting script's answers other than a grant.
pub(crate) enum NotGranted {
    /// Code 0 (CLAIM, TAKE_OVER): the key holds a lease, or another contender won it.
    Refused,
    /// Code 2: a store-wide hold is in force.
    OnHold(Hold),
    /// Code 4 (JOIN): no room now; something may change in this many ms.
    Busy { retry_after_ms: u64 },
    /// Code 5 (JOIN): the live holders use this other limit.
    LimitMismatch { limit: u32 },
}

/// A grant as the script wrote it.
pub(crate) struct Granted {
    pub fence: Fence,
    pub expires_at_ms: u64,
    /// The bid's own token, or that of the earlier grant with the bid's request id, handed back.
    pub token: String,
    pub ttl_ms: u64,
    /// Redis's clock when it granted.
    pub now_ms: u64,
}

impl FromRedisValue for Epoched<GrantReply> {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        let not = |not| Epoched::Answered(GrantReply::NotGranted(not));
        let reply = match fields.next::<i64>()? {
            0 => not(NotGranted::Refused),
            1 => Epoched::Answered(GrantReply::Granted(Granted {
                fence: fields.next()?,
                expires_at_ms: fields.next()?,
                token: fields.next()?,
                ttl_ms: fields.next()?,
                now_ms: fields.next()?,
            })),
            2 => not(NotGranted::OnHold(hold_in(&mut fields)?)),
            3 => Epoched::OtherEpoch(fields.next()?),
            4 => not(NotGranted::Busy {
                retry_after_ms: fields.next()?,
            }),
            5 => not(NotGranted::LimitMismatch {
                limit: fields.next()?,
            }),
            code => return Err(unknown("granting", code)),
        };
        fields.finish()?;
        Ok(reply)
    }
}
