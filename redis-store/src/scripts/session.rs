//! SESSION's call (`session.lua`): one operation on a session's record, and its reply.

use redis::{FromRedisValue, ParsingError, Value};

use super::Fields;
use crate::keys::{LOCK_SPACE, SEMAPHORE_SPACE};
use lockbroker_core::domain::{LockKey, Owner, Space, Token};
use lockbroker_core::store::{SessionEntry, SessionOp, SessionRecord};

/// SESSION's call on the record `record`.
pub(crate) struct SessionCall<'a> {
    pub record: &'a str,
    pub op: SessionOp<'a>,
}

/// An entry's field in the record: `e|<space letter>|<token>|<key>`.
fn field(entry: &SessionEntry) -> String {
    let space = match entry.space {
        Space::Locks => LOCK_SPACE,
        Space::Semaphores => SEMAPHORE_SPACE,
    };
    // The key too: the keys of one several-keys grant share a token.
    format!("e|{space}|{}|{}", entry.token.as_str(), entry.key.as_str())
}

script_call! {
    SessionCall<'_> => session,
    type Reply = SessionReply;
    |this, call| {
        call.key(this.record);
        match this.op {
            SessionOp::Open(spec) => {
                let owner = spec.owner.as_ref().map_or(String::new(), |o| format!("={}", o.as_str()));
                call.arg("open").arg(spec.ttl.as_ms()).arg(owner).arg(spec.lock_delay_ms);
            }
            SessionOp::Renew(ttl) => {
                call.arg("renew").arg(ttl.map_or(String::new(), |t| t.as_ms().to_string()));
            }
            SessionOp::Read => {
                call.arg("read");
            }
            SessionOp::Close => {
                call.arg("close");
            }
            SessionOp::Enter(entry) => {
                call.arg("enter").arg(field(entry)).arg(entry.key.as_str());
            }
            SessionOp::Drop(entry) => {
                call.arg("drop").arg(field(entry)).arg(entry.key.as_str());
            }
        }
    }
}

/// SESSION's reply: the record (its id left empty: the caller knows it), or none.
pub(crate) struct SessionReply(pub Option<SessionRecord>);

impl FromRedisValue for SessionReply {
    fn from_redis_value(reply: Value) -> Result<Self, ParsingError> {
        let mut fields = Fields::of(reply)?;
        if fields.next::<i64>()? == 0 {
            fields.finish()?;
            return Ok(Self(None));
        }
        let now_ms = fields.next()?;
        let ttl_ms = fields.next()?;
        let expires_at_ms = fields.next()?;
        let owner: String = fields.next()?;
        let owner = match owner.strip_prefix('=') {
            Some(label) => {
                Some(Owner::parse(label).map_err(|_| ParsingError::from("a malformed owner"))?)
            }
            None => None,
        };
        let lock_delay_ms = fields.next()?;
        let mut entries = Vec::new();
        while !fields.is_empty() {
            let name: String = fields.next()?;
            let value: String = fields.next()?;
            entries.push(entry(&name, &value).ok_or_else(|| {
                ParsingError::from(format!("a malformed session entry {name:?}"))
            })?);
        }
        Ok(Self(Some(SessionRecord {
            id: Token::parse("-").map_err(|_| ParsingError::from("no id"))?,
            now_ms,
            ttl_ms,
            expires_at_ms,
            owner,
            lock_delay_ms,
            entries,
        })))
    }
}

/// An entry from its field and value (when it was entered, and the key).
fn entry(name: &str, value: &str) -> Option<SessionEntry> {
    let (entered_ms, key) = value.split_once(' ')?;
    // `e|<space>|<token>|<key>` (`e|<space>|<token>` as the first brokers with sessions wrote
    // it); the value names the key either way.
    let mut parts = name.splitn(4, '|');
    let (Some("e"), Some(space), Some(token)) = (parts.next(), parts.next(), parts.next()) else {
        return None;
    };
    let space = match space {
        LOCK_SPACE => Space::Locks,
        SEMAPHORE_SPACE => Space::Semaphores,
        _ => return None,
    };
    Some(SessionEntry {
        space,
        key: LockKey::parse(key).ok()?,
        token: Token::parse(token).ok()?,
        entered_ms: entered_ms.parse().ok()?,
    })
}
