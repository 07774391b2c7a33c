//! The granting scripts' calls — CLAIM (`claim.lua`), TAKE_OVER (`take_over.lua`) and JOIN
//! (`join.lua`) — and their one reply, and what every script on the key's queue takes.

use redis::{FromRedisValue, ParsingError, Value};

use super::codes::GrantCode;
use super::{Fields, Writer, hold_in, unknown};
use crate::keys::RedisKeys;
use lockbroker_core::domain::{Fence, Pool};
use lockbroker_core::store::{Bid, Hold};

/// Who calls, as the queue's scripts need it: the broker's id (what queued bids and leases
/// record), the prefix of every broker's own channel, and the offer window.
pub(crate) struct Caller<'a> {
    pub id: &'a str,
    pub channels: &'a str,
    pub window_ms: u64,
}

/// The keys every queue script takes, in `lib/queue.lua`'s order.
pub(crate) fn write_queue_keys(call: &mut Writer<'_>, keys: &RedisKeys, marker: &str) {
    call.key(&keys.lock)
        .key(&keys.fence)
        .key(marker)
        .key(&keys.pool)
        .key(&keys.ends)
        .key(&keys.queue)
        .key(&keys.bids)
        .key(&keys.watched);
}

/// The last argument of every queue script (`context_of` in `lib/queue.lua`): what only its slow
/// paths read, in one string, because each argument of a script call costs Redis more than
/// splitting one string does — `wait|kind|window|space|#chan|#shared|` and then the brokers'
/// channel prefix, the shared channel and the client key, back to back (their lengths first,
/// as any of them may hold a `|`). Written straight into the command ([`Call::arg_fmt`]): a
/// `format!` here grew its string step by step, four reallocations per call.
pub(crate) struct QueueContext<'a> {
    pub wait_ms: u64,
    pub kind: &'a str,
    pub caller: &'a Caller<'a>,
    pub space: &'a str,
    pub key: &'a str,
    /// The shared channel ('' for a granting script).
    pub shared: &'a str,
}

impl std::fmt::Display for QueueContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            wait_ms,
            kind,
            caller,
            space,
            key,
            shared,
        } = self;
        let chan = caller.channels;
        write!(
            f,
            "{wait_ms}|{kind}|{}|{space}|{}|{}|{chan}{shared}{key}",
            caller.window_ms,
            chan.len(),
            shared.len()
        )
    }
}

/// CLAIM's call: SETNX for `bid` on the key of `keys`, in `epoch` — or the bid's turn in the
/// key's queue if it waits.
pub(crate) struct Claim<'a> {
    pub keys: &'a RedisKeys,
    /// The key's epoch marker.
    pub marker: &'a str,
    pub bid: &'a Bid,
    /// The epoch this broker knows.
    pub epoch: &'a str,
    pub caller: &'a Caller<'a>,
}

impl Claim<'_> {
    /// The claim as an operation of a BATCH call.
    pub(crate) fn batch_op(&self) -> super::BatchOp {
        let bid = self.bid;
        super::BatchOp::claim(
            self.keys,
            bid.token.as_str(),
            bid.lease_ttl().as_ms(),
            owner_arg(bid),
            bid.request_id.as_ref().map_or("", |r| r.as_str()),
            self.epoch,
        )
    }

    /// The arguments of `grant_context` (`lib/queue.lua`), for a bid of `kind`.
    fn write_bid(&self, call: &mut Writer<'_>, kind: &str) {
        let (keys, bid, caller) = (self.keys, self.bid, self.caller);
        write_queue_keys(call, keys, self.marker);
        call.arg(bid.token.as_str())
            .arg(bid.lease_ttl().as_ms())
            .arg(owner_arg(bid))
            .arg(self.epoch)
            .arg(bid.request_id.as_ref().map_or("", |r| r.as_str()))
            .arg(caller.id)
            .arg_fmt(QueueContext {
                wait_ms: bid.wait_ms,
                kind,
                caller,
                space: keys.space,
                key: &keys.key,
                shared: "",
            });
    }
}

script_call! {
    Claim<'_> => claim,
    type Reply = Epoched<GrantReply>;
    |this, call| {
        this.write_bid(call, "x");
    }
}

/// CLAIM_ALL's call (`claim_all.lua`): every key of `keys` for `bid` in one step if each is free,
/// in `epoch`. The keys must share a slot on a cluster.
pub(crate) struct ClaimAll<'a> {
    pub keys: &'a [RedisKeys],
    /// The keys' epoch marker.
    pub marker: &'a str,
    pub bid: &'a Bid,
    pub epoch: &'a str,
    /// The broker's id.
    pub broker: &'a str,
}

script_call! {
    ClaimAll<'_> => claim_all,
    type Reply = Epoched<GrantReply>;
    |this, call| {
        call.key(this.marker);
        for keys in this.keys {
            call.key(&keys.lock)
                .key(&keys.fence)
                .key(&keys.ends)
                .key(&keys.queue)
                .key(&keys.watched);
        }
        let bid = this.bid;
        call.arg(bid.token.as_str())
            .arg(bid.ttl.as_ms())
            .arg(owner_arg(bid))
            .arg(this.epoch)
            .arg(bid.request_id.as_ref().map_or("", |r| r.as_str()))
            .arg(this.broker);
    }
}

/// An owner label as the scripts take it: '' for none, else '=' and the label.
fn owner_arg(bid: &Bid) -> String {
    bid.owner
        .as_ref()
        .map_or(String::new(), |o| format!("={}", o.as_str()))
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

/// JOIN's call: a shared lease or a permit for the claim's bid in `pool`.
pub(crate) struct JoinPool<'a> {
    pub claim: Claim<'a>,
    pub pool: Pool,
}

script_call! {
    JoinPool<'_> => join,
    type Reply = Epoched<GrantReply>;
    |this, call| {
        let kind = match this.pool {
            Pool::Shared => "s".to_owned(),
            Pool::Semaphore { limit } => limit.to_string(),
        };
        this.claim.write_bid(call, &kind);
    }
}

/// A reply of a script that checks the epoch before it grants: its answer, or the store's epoch
/// when it is not the one the broker passed ([`GrantCode::OtherEpoch`]).
pub(crate) enum Epoched<T> {
    Answered(T),
    /// The store (on a cluster: the key's slot marker) is in another epoch: this one, or none
    /// when the marker is missing.
    OtherEpoch(Option<String>),
}

/// What a granting script answered in the broker's epoch.
pub(crate) enum GrantReply {
    /// [`GrantCode::Granted`].
    Granted(GrantedLease),
    NoGrant(NoGrant),
}

/// A granting script's answers other than a grant.
pub(crate) enum NoGrant {
    /// [`GrantCode::Refused`] (CLAIM, TAKE_OVER): the key holds a lease, or another contender
    /// won it.
    Refused,
    /// [`GrantCode::OnHold`]: a store-wide hold is in force.
    OnHold(Hold),
    /// [`GrantCode::NoRoom`] (JOIN): no room now; something may change in this many ms.
    Busy { retry_after_ms: u64 },
    /// [`GrantCode::OtherLimit`] (JOIN): the live holders (or the queued bids) use this other
    /// limit.
    LimitMismatch { limit: u32 },
    /// [`GrantCode::Queued`]: the bid waits in the key's queue; what blocks it ends in this many
    /// ms.
    Queued { retry_after_ms: u64 },
    /// [`GrantCode::NewerLayout`]: a broker of this newer store layout runs on the store.
    NewerLayout { layout: u32 },
}

/// A grant as the script wrote it.
pub(crate) struct GrantedLease {
    pub fence: Fence,
    pub expires_at_ms: u64,
    /// The bid's own token, or that of the earlier grant with the bid's request id, handed back.
    pub token: String,
    pub ttl_ms: u64,
    /// Redis's clock when it granted.
    pub now_ms: u64,
    /// The bid held this live lease already (CLAIM's trailing 1): granted before this call.
    pub again: bool,
}

impl FromRedisValue for Epoched<GrantReply> {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        let not = |not| Epoched::Answered(GrantReply::NoGrant(not));
        let code = fields.next::<i64>()?;
        let code = GrantCode::try_from(code).map_err(|code| unknown("granting", code))?;
        let reply = match code {
            GrantCode::Refused => not(NoGrant::Refused),
            GrantCode::Granted => Epoched::Answered(GrantReply::Granted(GrantedLease {
                fence: fields.next()?,
                expires_at_ms: fields.next()?,
                token: fields.next()?,
                ttl_ms: fields.next()?,
                now_ms: fields.next()?,
                again: !fields.is_empty() && fields.next::<i64>()? == 1,
            })),
            GrantCode::OnHold => not(NoGrant::OnHold(hold_in(&mut fields)?)),
            GrantCode::OtherEpoch => Epoched::OtherEpoch(fields.next()?),
            GrantCode::NoRoom => not(NoGrant::Busy {
                retry_after_ms: fields.next()?,
            }),
            GrantCode::OtherLimit => not(NoGrant::LimitMismatch {
                limit: fields.next()?,
            }),
            GrantCode::NewerLayout => not(NoGrant::NewerLayout {
                layout: fields.next()?,
            }),
            GrantCode::Queued => not(NoGrant::Queued {
                retry_after_ms: fields.next()?,
            }),
        };
        fields.finish()?;
        Ok(reply)
    }
}
