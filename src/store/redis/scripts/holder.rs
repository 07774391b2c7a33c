//! The calls of the scripts that act on held leases — RELEASE (`release.lua`), RENEW
//! (`renew.lua`) and FORCE (`force.lua`) — and their replies.

use redis::{FromRedisValue, ParsingError, Value};

use super::{Call, Fields, hold_in, unknown};
use crate::domain::{Fence, Owner, Token, Ttl};
use crate::store::redis::keys::{Place, RedisKeys};
use crate::store::{EXPIRY_SLACK_MS, Hold, Holder};

/// The keys every holder script takes (`lib/holder.lua`): the exclusive lock (for a semaphore:
/// its pool again), the epoch marker, the pool and its ends.
pub(crate) struct HolderKeys<'a> {
    pub keys: &'a RedisKeys,
    pub marker: &'a str,
}

impl<'a> HolderKeys<'a> {
    pub(crate) fn of(place: &'a Place<'_>) -> Self {
        Self {
            keys: &place.keys,
            marker: &place.marker,
        }
    }

    fn write(&self, call: &mut Call<'_>) {
        call.key(&self.keys.lock)
            .key(self.marker)
            .key(&self.keys.pool)
            .key(&self.keys.ends);
    }
}

/// RELEASE's call: ends `token`'s lease and publishes the release notice on `channel`.
pub(crate) struct Release<'a> {
    pub on: HolderKeys<'a>,
    pub token: &'a Token,
    pub channel: &'a str,
}

script_call! {
    Release<'_> => release,
    type Reply = ReleaseReply;
    |this, call| {
        this.on.write(call);
        call.arg(this.token.as_str())
            .arg(this.channel)
            .arg(&this.on.keys.notice);
    }
}

/// RENEW's call: moves the end of `token`'s lease to `ttl` from now.
pub(crate) struct Renew<'a> {
    pub on: HolderKeys<'a>,
    pub token: &'a Token,
    pub ttl: Ttl,
    pub channel: &'a str,
}

script_call! {
    Renew<'_> => renew,
    type Reply = RenewReply;
    |this, call| {
        this.on.write(call);
        call.arg(this.token.as_str())
            .arg(this.ttl.as_ms())
            .arg(EXPIRY_SLACK_MS)
            .arg(this.channel)
            .arg(&this.on.keys.notice);
    }
}

/// FORCE's call: ends every live lease on the key.
pub(crate) struct Force<'a> {
    pub on: HolderKeys<'a>,
    pub channel: &'a str,
}

script_call! {
    Force<'_> => force,
    type Reply = ForceReply;
    |this, call| {
        this.on.write(call);
        call.arg(this.channel).arg(&this.on.keys.notice);
    }
}

/// A holder script's answers other than "done".
pub(crate) enum Refusal {
    /// Code 0: absent or expired.
    NotHeld,
    /// Code 2: another token's live lease.
    NotOwner,
    /// Code 3: not this token's, but a store-wide hold is in force.
    OnHold(Hold),
}

impl Refusal {
    fn decode(code: i64, fields: &mut Fields, script: &str) -> Result<Self, ParsingError> {
        Ok(match code {
            0 => Refusal::NotHeld,
            2 => Refusal::NotOwner,
            3 => Refusal::OnHold(hold_in(fields)?),
            code => return Err(unknown(script, code)),
        })
    }

    pub(crate) fn answer<T>(self) -> Holder<T> {
        match self {
            Refusal::NotHeld => Holder::NotHeld,
            Refusal::NotOwner => Holder::NotOwner,
            Refusal::OnHold(hold) => Holder::OnHold(hold),
        }
    }
}

/// RELEASE's reply.
pub(crate) enum ReleaseReply {
    /// Code 1: released after this long held, on Redis's clock.
    Released {
        held_ms: u64,
    },
    Refused(Refusal),
}

impl FromRedisValue for ReleaseReply {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        let reply = match fields.next()? {
            1 => ReleaseReply::Released {
                held_ms: fields.next()?,
            },
            code => ReleaseReply::Refused(Refusal::decode(code, &mut fields, "release")?),
        };
        fields.finish()?;
        Ok(reply)
    }
}

/// A lease as RENEW left it.
pub(crate) struct Renewed {
    pub fence: Fence,
    pub expires_at_ms: u64,
    pub owner: Option<Owner>,
    /// The epoch the store is in (empty without a marker).
    pub epoch: String,
}

/// RENEW's reply.
pub(crate) enum RenewReply {
    /// Code 1: the exclusive lease.
    Exclusive(Renewed),
    /// Code 4: a shared lease (`limit` `None`) or a semaphore's permit.
    Pooled {
        renewed: Renewed,
        limit: Option<u32>,
    },
    Refused(Refusal),
}

impl FromRedisValue for RenewReply {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        let code = fields.next()?;
        let reply = match code {
            1 | 4 => {
                let renewed = Renewed {
                    fence: fields.next()?,
                    expires_at_ms: fields.next()?,
                    owner: fields
                        .next::<Option<String>>()?
                        .map(|o| {
                            Owner::parse(&o).map_err(|_| ParsingError::from("a malformed owner"))
                        })
                        .transpose()?,
                    epoch: fields.next()?,
                };
                if code == 1 {
                    RenewReply::Exclusive(renewed)
                } else {
                    let limit: String = fields.next()?;
                    RenewReply::Pooled {
                        renewed,
                        limit: match limit.as_str() {
                            "" => None,
                            limit => Some(
                                limit
                                    .parse()
                                    .map_err(|_| ParsingError::from("a malformed limit"))?,
                            ),
                        },
                    }
                }
            }
            code => RenewReply::Refused(Refusal::decode(code, &mut fields, "renew")?),
        };
        fields.finish()?;
        Ok(reply)
    }
}

/// FORCE's reply.
pub(crate) enum ForceReply {
    /// Code 1: the fences of the leases ended (none: nothing was live).
    Ended(Vec<Fence>),
    Refused(Refusal),
}

impl FromRedisValue for ForceReply {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        let reply = match fields.next()? {
            1 => {
                let mut fences = Vec::new();
                while !fields.is_empty() {
                    fences.push(fields.next()?);
                }
                ForceReply::Ended(fences)
            }
            code => ForceReply::Refused(Refusal::decode(code, &mut fields, "force")?),
        };
        fields.finish()?;
        Ok(reply)
    }
}
