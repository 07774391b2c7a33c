//! The calls of the epoch's scripts — CHECK (`check.lua`), MARK (`mark.lua`), REPAIR
//! (`repair.lua`) and PUT_BACK (`put_back.lua`) — and their replies.

use redis::{FromRedisValue, ParsingError, Value};

use super::codes::PutBackCode;
use super::{Fields, unknown};
use crate::grant::STORE_LAYOUT;
use crate::keys::RedisKeys;
use crate::ledger::Entry;
use lockbroker_core::domain::{Fence, Kind};
use lockbroker_core::store::{EXPIRY_SLACK_MS, Hold, HoldReason};

/// CHECK's call: the epoch check of the shard whose epoch `marker` records.
pub(crate) struct Check<'a> {
    pub marker: &'a str,
    /// The epoch this broker knows of the shard, if any.
    pub known: Option<&'a str>,
    pub settle_ms: u64,
    pub loss_delay_ms: u64,
    pub channel: &'a str,
}

script_call! {
    Check<'_> => check,
    type Reply = Checked;
    |this, call| {
        call.key(this.marker);
        call.arg(this.known.unwrap_or(""))
            .arg(this.settle_ms)
            .arg(this.loss_delay_ms)
            .arg(this.channel);
    }
}

/// What the epoch check answered: the shard's epoch as the check left it.
#[derive(Clone)]
pub(crate) struct Checked {
    pub id: String,
    pub hold_until_ms: u64,
    pub now_ms: u64,
    pub reason: String,
    pub run_id: String,
    /// The newest store layout a broker on the shard runs (see `STORE_LAYOUT`).
    pub layout: u32,
}

impl Checked {
    /// The store-wide hold in force on the shard, if any.
    pub(crate) fn hold(&self) -> Option<Hold> {
        (self.now_ms < self.hold_until_ms).then(|| Hold {
            reason: if self.reason == "loss" {
                HoldReason::Loss
            } else {
                HoldReason::Settling
            },
            retry_after_ms: self.hold_until_ms - self.now_ms,
        })
    }
}

impl FromRedisValue for Checked {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        let checked = Checked {
            id: fields.next()?,
            hold_until_ms: fields.next()?,
            now_ms: fields.next()?,
            reason: fields.next()?,
            run_id: fields.next()?,
            layout: fields.next()?,
        };
        fields.finish()?;
        Ok(checked)
    }
}

/// MARK's call: copies the master's epoch, as `checked` says, to one slot's `marker`.
pub(crate) struct Mark<'a> {
    pub marker: &'a str,
    pub checked: &'a Checked,
}

script_call! {
    Mark<'_> => mark,
    /// Always 1.
    type Reply = i64;
    |this, call| {
        let checked = this.checked;
        call.key(this.marker);
        call.arg(&checked.id)
            .arg(&checked.run_id)
            .arg(checked.hold_until_ms)
            .arg(&checked.reason)
            .arg(checked.layout);
    }
}

/// REPAIR's call: gives a slot's `marker` back in `epoch`, held for `hold_ms`, and announces it
/// on `channel`.
pub(crate) struct Repair<'a> {
    pub marker: &'a str,
    pub epoch: &'a str,
    pub hold_ms: u64,
    pub channel: &'a str,
    pub announcement: &'a str,
}

script_call! {
    Repair<'_> => repair,
    /// Whether it wrote the marker (`false`: one was there).
    type Reply = bool;
    |this, call| {
        call.key(this.marker);
        call.arg(this.epoch)
            .arg(this.hold_ms)
            .arg(this.channel)
            .arg(this.announcement)
            .arg(STORE_LAYOUT);
    }
}

/// PUT_BACK's call: puts `leases` back into `epoch`, on the shard (or slot) of `marker`.
pub(crate) struct PutBack<'a> {
    pub marker: &'a str,
    pub epoch: &'a str,
    /// This broker's id: the leases put back record it (`by`).
    pub broker: &'a str,
    pub leases: Vec<LeaseBack<'a>>,
}

/// One lease to put back: its keys, its ledger entry, and what remains of it (ms, at least 1).
pub(crate) struct LeaseBack<'a> {
    pub keys: RedisKeys,
    pub entry: &'a Entry,
    pub remaining_ms: u64,
}

script_call! {
    PutBack<'_> => put_back,
    type Reply = PutBackReply;
    |this, call| {
        call.key(this.marker);
        for LeaseBack { keys, entry, .. } in &this.leases {
            match entry.kind {
                Kind::Exclusive => call
                    .key(&keys.lock)
                    .key(&keys.fence)
                    .key(&keys.pool)
                    .key(&keys.ends),
                Kind::Shared | Kind::Semaphore { .. } => call
                    .key(&keys.pool)
                    .key(&keys.ends)
                    .key(&keys.fence)
                    .key(&keys.lock),
            };
        }
        call.arg(this.epoch).arg(EXPIRY_SLACK_MS).arg(this.broker);
        // '' for none, else '=' and the value.
        let given = |v: Option<&str>| v.map_or(String::new(), |v| format!("={v}"));
        for LeaseBack {
            entry,
            remaining_ms,
            ..
        } in &this.leases
        {
            match entry.kind {
                Kind::Exclusive => call.arg("x"),
                Kind::Shared => call.arg("s"),
                Kind::Semaphore { limit } => call.arg(limit),
            };
            call.arg(entry.token.as_str())
                .arg(entry.fence)
                .arg(*remaining_ms)
                .arg(entry.ttl_ms)
                .arg(given(entry.owner.as_ref().map(|o| o.as_str())))
                .arg(given(entry.request_id.as_ref().map(|r| r.as_str())));
        }
    }
}

/// PUT_BACK's reply.
pub(crate) enum PutBackReply {
    /// `{EPOCH_MOVED}` ([`PutBackCode::EpochMoved`]): the store is no longer in the epoch (a
    /// loss during the put-back).
    OtherEpoch,
    /// What became of each lease, in the call's order.
    Placed(Vec<Placed>),
}

/// What became of one lease put back.
pub(crate) struct Placed {
    pub outcome: Placement,
    /// Its fence counter was below its fence, and was raised.
    pub counter_raised: bool,
}

pub(crate) enum Placement {
    /// [`PutBackCode::Written`]: written back.
    Written,
    /// [`PutBackCode::AlreadyThere`]: the key already held it (its end moved out if that was
    /// later).
    AlreadyThere,
    /// [`PutBackCode::OtherKept`]: another live lease with this higher fence was there, and
    /// stays.
    OtherKept { fence: Fence },
    /// [`PutBackCode::OtherReplaced`]: another live lease with this lower fence was there, and
    /// this one replaced it.
    OtherReplaced { fence: Fence },
}

impl FromRedisValue for PutBackReply {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        let mut placed = Vec::new();
        while !fields.is_empty() {
            let code = PutBackCode::try_from(fields.next::<i64>()?)
                .map_err(|code| unknown("put_back", code))?;
            if code == PutBackCode::EpochMoved && placed.is_empty() {
                fields.finish()?;
                return Ok(PutBackReply::OtherEpoch);
            }
            let other: Fence = fields.next()?;
            let outcome = match code {
                PutBackCode::Written => Placement::Written,
                PutBackCode::AlreadyThere => Placement::AlreadyThere,
                PutBackCode::OtherKept => Placement::OtherKept { fence: other },
                PutBackCode::OtherReplaced => Placement::OtherReplaced { fence: other },
                PutBackCode::EpochMoved => return Err(unknown("put_back", code as i64)),
            };
            placed.push(Placed {
                outcome,
                counter_raised: fields.next::<i64>()? == 1,
            });
        }
        Ok(PutBackReply::Placed(placed))
    }
}
