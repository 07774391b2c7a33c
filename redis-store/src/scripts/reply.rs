//! Reading a script's reply: its fields in order, and the parts several replies share.

use redis::{FromRedisValue, ParsingError, Value};

use lockbroker_core::store::{Hold, HoldReason};

/// The fields of a script's array reply, read in order, as mini-redis's `Parse` reads a frame:
/// each read says what type it expects, and a reply that ends early or has fields left over is
/// malformed.
pub(crate) struct Fields(std::vec::IntoIter<Value>);

impl Fields {
    pub(super) fn of(reply: Value) -> Result<Self, ParsingError> {
        match reply {
            Value::Array(items) => Ok(Self(items.into_iter())),
            other => Err(format!("expected an array, got {other:?}").into()),
        }
    }

    /// The next field, as a `T`.
    pub(super) fn next<T: FromRedisValue>(&mut self) -> Result<T, ParsingError> {
        let value = self
            .0
            .next()
            .ok_or_else(|| ParsingError::from("the reply ended early"))?;
        T::from_redis_value(value)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.len() == 0
    }

    /// The end of the reply: nothing may be left.
    pub(super) fn finish(self) -> Result<(), ParsingError> {
        if self.is_empty() {
            Ok(())
        } else {
            Err(format!("{} fields left over", self.0.len()).into())
        }
    }
}

/// A store-wide hold as the scripts report it: its end and Redis's clock (ms), and its reason.
pub(super) fn hold_in(fields: &mut Fields) -> Result<Hold, ParsingError> {
    let hold_until_ms: u64 = fields.next()?;
    let now_ms: u64 = fields.next()?;
    let reason: String = fields.next()?;
    Ok(Hold {
        reason: if reason == "loss" {
            HoldReason::Loss
        } else {
            HoldReason::Settling
        },
        retry_after_ms: hold_until_ms.saturating_sub(now_ms).max(1),
    })
}

/// A reply code that `script` never answers.
pub(super) fn unknown(script: &str, code: i64) -> ParsingError {
    format!("unexpected {script} reply code {code}").into()
}
