//! BATCH's call (`batch.lua`): many claims and releases in one script call, each the lock
//! cycle's common case, answered one by one.

use redis::{FromRedisValue, Value};

use super::codes::{BatchCode, GrantCode, HolderCode};
use crate::keys::RedisKeys;

/// One operation of a batch: its key's five Redis keys and its arguments (as many as its kind
/// needs, see `batch.lua`), owned (it waits in the batcher's queue beyond its caller's borrows),
/// and for a claim the epoch it was asked in.
pub(crate) struct BatchOp {
    keys: [String; 5],
    args: Vec<String>,
    asked_in: Option<String>,
}

impl BatchOp {
    /// A claim of the key of `keys` for the bid's `token`, `ttl_ms`, `owner` ('' or '=' and the
    /// label) and `request_id` ('' for none), asked in the epoch `epoch` (its caller remembers a
    /// grant as made there).
    pub(crate) fn claim(
        keys: &RedisKeys,
        token: &str,
        ttl_ms: u64,
        owner: String,
        request_id: &str,
        epoch: &str,
    ) -> Self {
        Self {
            asked_in: Some(epoch.into()),
            keys: Self::keys_of(keys),
            args: if owner.is_empty() && request_id.is_empty() {
                vec!["c".into(), token.into(), ttl_ms.to_string()]
            } else {
                vec![
                    "C".into(),
                    token.into(),
                    ttl_ms.to_string(),
                    owner,
                    request_id.into(),
                ]
            },
        }
    }

    /// A release of `token`'s exclusive lease on the key of `keys`.
    pub(crate) fn release(keys: &RedisKeys, token: &str) -> Self {
        Self {
            asked_in: None,
            keys: Self::keys_of(keys),
            args: vec!["r".into(), token.into()],
        }
    }

    fn keys_of(keys: &RedisKeys) -> [String; 5] {
        [
            keys.lock.clone(),
            keys.fence.clone(),
            keys.ends.clone(),
            keys.queue.clone(),
            keys.watched.clone(),
        ]
    }
}

/// BATCH's call: `ops` in the epoch `epoch` this broker knows, on the store's marker.
pub(crate) struct Batch<'a> {
    pub marker: &'a str,
    pub epoch: &'a str,
    /// The broker's id.
    pub broker: &'a str,
    pub ops: &'a [BatchOp],
}

script_call! {
    Batch<'_> => batch,
    type Reply = Vec<Value>;
    |this, call| {
        call.key(this.marker);
        for op in this.ops {
            for key in &op.keys {
                call.key(key);
            }
        }
        call.arg(this.epoch).arg(this.broker);
        for op in this.ops {
            for arg in &op.args {
                call.arg(arg);
            }
        }
    }
}

/// Whether this operation may go in a batch run in `epoch`: a claim asked in another epoch may
/// not (the broker caught up while it waited), since its caller remembers a grant as made in
/// the epoch it asked in.
pub(crate) fn fits(op: &BatchOp, epoch: &str) -> bool {
    op.asked_in.as_deref().is_none_or(|asked| asked == epoch)
}

/// BATCH's flat reply (see `batch.lua`: a granted claim's fence as text, a release's held_ms and
/// fence, or SLOW alone), read back into one reply per operation of `ops`, each as CLAIM's or
/// RELEASE's fast path answers it alone — what their decoders read: a claim's
/// `{GRANTED, fence, expires_at, token, ttl, now_ms}` (the fence is Redis's clock in µs, the
/// token and ttl the claim's own), a release's `{HELD, held_ms, fence}`, or [`slow`].
pub(crate) fn unpack(ops: &[BatchOp], reply: Vec<Value>) -> Result<Vec<Value>, String> {
    let mut values = reply.into_iter();
    let mut next = || values.next().ok_or("fewer values than its operations need");
    let mut answers = Vec::with_capacity(ops.len());
    for op in ops {
        let first = next()?;
        if matches!(first, Value::Int(code) if BatchCode::try_from(code) == Ok(BatchCode::Slow)) {
            answers.push(slow());
            continue;
        }
        answers.push(match op.args.as_slice() {
            [kind, ..] if kind == "r" => {
                Value::Array(vec![Value::Int(HolderCode::Held as i64), first, next()?])
            }
            [_, token, ttl, ..] => {
                let fence = i64::from_redis_value(first)
                    .map_err(|_| "a claim's fence that is not a number")?;
                let ttl: i64 = ttl
                    .parse()
                    .map_err(|_| "a claim's ttl that is not a number")?;
                let now_ms = fence / 1000;
                Value::Array(vec![
                    Value::Int(GrantCode::Granted as i64),
                    Value::Int(fence),
                    Value::Int(now_ms + ttl),
                    Value::BulkString(token.as_bytes().to_vec()),
                    Value::Int(ttl),
                    Value::Int(now_ms),
                ])
            }
            _ => return Err("an operation without its arguments".into()),
        });
    }
    if values.next().is_some() {
        return Err("more values than its operations need".into());
    }
    Ok(answers)
}

/// BATCH's answer for an operation to run alone: [`BatchCode::Slow`].
pub(crate) fn slow() -> Value {
    Value::Array(vec![Value::Int(BatchCode::Slow as i64)])
}

/// Whether an operation's reply is BATCH's [`BatchCode::Slow`]: not the common case, to run
/// alone.
pub(crate) fn is_slow(reply: &Value) -> bool {
    match reply {
        Value::Array(fields) => matches!(
            fields.first(),
            Some(Value::Int(code)) if BatchCode::try_from(*code) == Ok(BatchCode::Slow)
        ),
        _ => false,
    }
}
