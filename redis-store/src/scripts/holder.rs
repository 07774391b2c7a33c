//! The calls of the scripts that act on held leases and queued bids — RELEASE (`release.lua`),
//! RENEW (`renew.lua`), FORCE (`force.lua`) and LEAVE (`leave.lua`) — and their replies.

use redis::{FromRedisValue, ParsingError, Value};

use super::codes::HolderCode;
use super::grant::{Caller, GrantedLease, QueueContext, write_queue_keys};
use super::{Fields, Writer, hold_in, unknown};
use crate::keys::RedisKeys;
use lockbroker_core::domain::{Fence, Owner, RequestId, Token};
use lockbroker_core::store::{AsHolder, Hold, Renewal};

/// What every holder script takes (`holder_context` in `lib/queue.lua`): the key's queue keys,
/// and as arguments the token, the epoch this broker knows (the key is handed on only in it),
/// the caller's id and the queue context (with the client key, its space and the shared channel).
pub(crate) struct HolderContext<'a> {
    pub keys: &'a RedisKeys,
    pub marker: &'a str,
    /// The epoch this broker knows for the key ('' while it knows none, or a hold is in force:
    /// nothing is handed on then).
    pub epoch: &'a str,
    pub caller: &'a Caller<'a>,
    /// The shared channel: ends of leases written by older brokers are told there.
    pub channel: &'a str,
}

impl<'a> HolderContext<'a> {
    fn write(&self, call: &mut Writer<'_>, token: &str) {
        self.write_as(call, token, "x");
    }

    /// As `write`, with the queue context's kind `kind`: `x`, or for a RELEASE that takes a grant
    /// to this broker's own next bid, `g` (`hand_on` in `lib/queue.lua`).
    fn write_as(&self, call: &mut Writer<'_>, token: &str, kind: &str) {
        write_queue_keys(call, self.keys, self.marker);
        call.arg(token)
            .arg(self.epoch)
            .arg(self.caller.id)
            .arg_fmt(QueueContext {
                kind,
                ..self.queue_context()
            });
    }

    /// The context string of the key's queue (a holder script's last argument).
    fn queue_context(&self) -> QueueContext<'_> {
        QueueContext {
            wait_ms: 0,
            kind: "x",
            caller: self.caller,
            space: self.keys.space,
            key: &self.keys.key,
            shared: self.channel,
        }
    }
}

/// RELEASE's call: ends `token`'s lease and hands the key on — with `direct`, straight to this
/// broker's own next exclusive bid (not under a session) if that bid is the queue's head: the
/// reply then carries its grant ([`ReleaseReply::Released::handed`]).
pub(crate) struct Release<'a> {
    pub on: HolderContext<'a>,
    pub token: &'a Token,
    pub direct: bool,
}

script_call! {
    Release<'_> => release,
    type Reply = ReleaseReply;
    |this, call| {
        this.on.write_as(call, this.token.as_str(), if this.direct { "g" } else { "x" });
    }
}

/// RENEW's call: moves the end of `token`'s lease as `how` says.
pub(crate) struct Renew<'a> {
    pub on: HolderContext<'a>,
    pub token: &'a Token,
    pub how: Renewal,
}

script_call! {
    Renew<'_> => renew,
    type Reply = RenewReply;
    |this, call| {
        this.on.write(call, this.token.as_str());
        match this.how {
            Renewal::For(ttl) => call.arg(ttl.as_ms()).arg(""),
            Renewal::Until(ends) => call.arg(0).arg(ends),
        };
    }
}

/// KEEP's call: RENEW's `until` form on each of `leases` (their contexts must share the epoch
/// and the caller: one store, or one slot of a cluster), each lease with its token.
pub(crate) struct Keep<'a> {
    pub leases: Vec<(HolderContext<'a>, &'a Token)>,
    pub until_ms: u64,
}

script_call! {
    Keep<'_> => keep,
    type Reply = KeepReply;
    |this, call| {
        for (on, _) in &this.leases {
            write_queue_keys(call, on.keys, on.marker);
        }
        if let Some((first, _)) = this.leases.first() {
            call.arg(first.epoch).arg(first.caller.id).arg(this.until_ms);
        }
        for (on, token) in &this.leases {
            call.arg(token.as_str()).arg_fmt(on.queue_context());
        }
    }
}

/// KEEP's reply: RENEW's reply for each lease, in order.
pub(crate) struct KeepReply(pub Vec<RenewReply>);

impl FromRedisValue for KeepReply {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        match reply {
            Value::Array(items) => items
                .into_iter()
                .map(RenewReply::from_redis_value)
                .collect::<Result<_, _>>()
                .map(KeepReply),
            other => Err(format!("expected an array, got {other:?}").into()),
        }
    }
}

/// FORCE's call: ends every live lease on the key and hands it on.
pub(crate) struct Force<'a> {
    pub on: HolderContext<'a>,
}

script_call! {
    Force<'_> => force,
    type Reply = ForceReply;
    |this, call| {
        this.on.write(call, "");
    }
}

/// LEAVE's call: `token`'s queued bid stops waiting (an offer to it ends).
pub(crate) struct Leave<'a> {
    pub on: HolderContext<'a>,
    pub token: &'a Token,
}

script_call! {
    Leave<'_> => leave,
    /// Whether an offer to the token ended.
    type Reply = bool;
    |this, call| {
        this.on.write(call, this.token.as_str());
    }
}

/// A holder script's answers other than "done".
pub(crate) enum Refusal {
    /// [`HolderCode::NotHeld`]: absent or expired.
    NotHeld,
    /// [`HolderCode::NotOwner`]: another token's live lease.
    NotOwner,
    /// [`HolderCode::HoldInForce`]: not this token's, but a store-wide hold is in force.
    OnHold(Hold),
}

/// A holder script's code, or which script answered a code it never answers.
fn holder_code(fields: &mut Fields, script: &str) -> Result<HolderCode, ParsingError> {
    HolderCode::try_from(fields.next::<i64>()?).map_err(|code| unknown(script, code))
}

impl Refusal {
    /// The refusal that `code` stands for, with its fields; any other code is an error that names
    /// `script`.
    fn decode(code: HolderCode, fields: &mut Fields, script: &str) -> Result<Self, ParsingError> {
        Ok(match code {
            HolderCode::NotHeld => Refusal::NotHeld,
            HolderCode::NotOwner => Refusal::NotOwner,
            HolderCode::HoldInForce => Refusal::OnHold(hold_in(fields)?),
            HolderCode::Held | HolderCode::HeldPooled => {
                return Err(unknown(script, code as i64));
            }
        })
    }

    pub(crate) fn answer<T>(self) -> AsHolder<T> {
        match self {
            Refusal::NotHeld => AsHolder::NotHeld,
            Refusal::NotOwner => AsHolder::NotOwner,
            Refusal::OnHold(hold) => AsHolder::OnHold(hold),
        }
    }
}

/// RELEASE's reply.
pub(crate) enum ReleaseReply {
    /// [`HolderCode::Held`]: released after this long held, on Redis's clock; the lease's fence.
    Released {
        held_ms: u64,
        fence: Fence,
        /// The grant the release made to this broker's own next bid, if it made one.
        handed: Option<Handed>,
    },
    Refused(Refusal),
}

/// A grant a RELEASE made to a bid of this broker: the lease as written, and what the bid
/// asked with (its request id and owner label) — what the ledger keeps of it.
pub(crate) struct Handed {
    pub granted: GrantedLease,
    pub request_id: Option<RequestId>,
    pub owner: Option<Owner>,
}

impl Handed {
    fn decode(fields: &mut Fields) -> Result<Self, ParsingError> {
        let granted = GrantedLease {
            token: fields.next()?,
            fence: fields.next()?,
            expires_at_ms: fields.next()?,
            ttl_ms: fields.next()?,
            now_ms: fields.next()?,
            again: false,
        };
        let rid: String = fields.next()?;
        let owner: String = fields.next()?;
        let bad = |what: &str| {
            ParsingError::from(format!("release handed on a bid with a malformed {what}"))
        };
        Ok(Self {
            granted,
            request_id: (!rid.is_empty())
                .then(|| RequestId::parse(&rid).map_err(|_| bad("request id")))
                .transpose()?,
            owner: owner
                .strip_prefix('=')
                .map(|label| Owner::from_stored(label).map_err(|_| bad("owner")))
                .transpose()?,
        })
    }
}

impl FromRedisValue for ReleaseReply {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        let reply = match holder_code(&mut fields, "release")? {
            HolderCode::Held => ReleaseReply::Released {
                held_ms: fields.next()?,
                fence: fields.next()?,
                handed: if fields.is_empty() {
                    None
                } else {
                    Some(Handed::decode(&mut fields)?)
                },
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
    /// Its length from the renewal on.
    pub ttl_ms: u64,
    pub owner: Option<Owner>,
    /// The epoch the store is in (empty without a marker).
    pub epoch: String,
}

/// RENEW's reply.
pub(crate) enum RenewReply {
    /// [`HolderCode::Held`]: the exclusive lease.
    Exclusive(Renewed),
    /// [`HolderCode::HeldPooled`]: a shared lease (`limit` `None`) or a semaphore's permit.
    Pooled {
        renewed: Renewed,
        limit: Option<u32>,
    },
    Refused(Refusal),
}

impl FromRedisValue for RenewReply {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        let code = holder_code(&mut fields, "renew")?;
        let reply = match code {
            HolderCode::Held | HolderCode::HeldPooled => {
                let renewed = Renewed {
                    fence: fields.next()?,
                    expires_at_ms: fields.next()?,
                    ttl_ms: fields.next()?,
                    owner: fields
                        .next::<Option<String>>()?
                        .map(|o| {
                            Owner::from_stored(&o)
                                .map_err(|_| ParsingError::from("a malformed owner"))
                        })
                        .transpose()?,
                    epoch: fields.next()?,
                };
                if code == HolderCode::Held {
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
    /// [`HolderCode::Held`]: the fences of the leases ended (none: nothing was live).
    Ended(Vec<Fence>),
    Refused(Refusal),
}

impl FromRedisValue for ForceReply {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        let reply = match holder_code(&mut fields, "force")? {
            HolderCode::Held => {
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
