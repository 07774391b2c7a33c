//! The calls of the scripts that only look — READ (`read.lua`) and PERMITS (`permits.lua`) — and
//! their replies, which list leases six fields each.

use redis::{FromRedisValue, ParsingError, Value};

use super::Fields;
use crate::keys::RedisKeys;
use lockbroker_core::domain::{Lease, Owner, RequestId, Token};
use lockbroker_core::store::{Permits, Snapshot};

/// READ's reply (the store's [`Snapshot`], parsed here).
pub(crate) struct SnapshotReply(pub Snapshot);

/// PERMITS' reply (the store's [`Permits`], parsed here).
pub(crate) struct PermitsReply(pub Permits);

/// READ's call: a lock's exclusive lease and live shared leases, with Redis's clock.
pub(crate) struct Read<'a> {
    pub keys: &'a RedisKeys,
}

script_call! {
    Read<'_> => read,
    type Reply = SnapshotReply;
    |this, call| {
        call.key(&this.keys.lock)
            .key(&this.keys.pool)
            .key(&this.keys.ends);
    }
}

/// PERMITS' call: a semaphore's live holders, with Redis's clock.
pub(crate) struct ReadPermits<'a> {
    pub keys: &'a RedisKeys,
}

script_call! {
    ReadPermits<'_> => permits,
    type Reply = PermitsReply;
    |this, call| {
        call.key(&this.keys.pool).key(&this.keys.ends);
    }
}

impl FromRedisValue for SnapshotReply {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        Ok(SnapshotReply(Snapshot {
            now_ms: fields.next()?,
            lease: lease(&mut fields)?,
            shared: leases(fields)?,
        }))
    }
}

impl FromRedisValue for PermitsReply {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        let now_ms = fields.next()?;
        let limit: Option<String> = fields.next()?;
        let holders = leases(fields)?;
        // A limit left behind by holders that are all gone means nothing.
        let limit = match limit {
            Some(limit) if !holders.is_empty() => Some(
                limit
                    .parse()
                    .map_err(|_| ParsingError::from("a malformed limit"))?,
            ),
            _ => None,
        };
        Ok(PermitsReply(Permits {
            now_ms,
            limit,
            holders,
        }))
    }
}

/// The next six fields as a lease — token, fence, expires_at, ttl, owner, request id — or
/// `None` when the token is `false` (no lease).
fn lease(fields: &mut Fields) -> Result<Option<Lease>, ParsingError> {
    let token: Option<String> = fields.next()?;
    let fence: Option<u64> = fields.next()?;
    let expires_at_ms: Option<u64> = fields.next()?;
    let ttl_ms: Option<u64> = fields.next()?;
    let owner: Option<String> = fields.next()?;
    let request_id: Option<String> = fields.next()?;
    let Some(token) = token else {
        return Ok(None);
    };
    let missing = || ParsingError::from("a lease with a token but no fence, end or ttl");
    Ok(Some(Lease {
        token: Token::parse(&token).map_err(|_| ParsingError::from("a malformed token"))?,
        fence: fence.ok_or_else(missing)?,
        expires_at_ms: expires_at_ms.ok_or_else(missing)?,
        ttl_ms: ttl_ms.ok_or_else(missing)?,
        owner: owner
            .map(|o| Owner::from_stored(&o).map_err(|_| ParsingError::from("a malformed owner")))
            .transpose()?,
        request_id: request_id.and_then(|r| RequestId::parse(&r).ok()),
        limit: None,
    }))
}

/// The leases listed six fields each to the reply's end, by fence.
fn leases(mut fields: Fields) -> Result<Vec<Lease>, ParsingError> {
    let mut leases = Vec::new();
    while !fields.is_empty() {
        leases.push(
            lease(&mut fields)?.ok_or_else(|| ParsingError::from("a holder without a token"))?,
        );
    }
    leases.sort_by_key(|l| l.fence);
    Ok(leases)
}
