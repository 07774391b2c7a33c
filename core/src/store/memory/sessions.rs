//! The embedded store's session records (see [`SessionOp`]): a map by id, and the request ids
//! that opened them. An ended session is dropped when a call or a sweep finds it.

use std::collections::HashMap;

use crate::domain::Token;
use crate::store::{SessionEntry, SessionOp, SessionRecord};

#[derive(Default)]
pub(super) struct Sessions {
    live: HashMap<Token, SessionRecord>,
    /// Request id → the session it opened.
    opened_by: HashMap<String, Token>,
}

impl Sessions {
    /// Runs `op` on session `id` at `now_ms` (see [`SessionOp`]).
    pub(super) fn call(
        &mut self,
        id: &Token,
        op: SessionOp<'_>,
        now_ms: u64,
    ) -> Option<SessionRecord> {
        if let SessionOp::Open(spec) = op {
            let rid = spec.request_id.as_ref().map(|r| r.as_str().to_owned());
            if let Some(earlier) = rid.as_ref().and_then(|r| self.opened_by.get(r)).cloned()
                && let Some(record) = self.live_mut(&earlier, now_ms)
            {
                record.now_ms = now_ms;
                return Some(record.clone());
            }
            let record = SessionRecord {
                id: id.clone(),
                now_ms,
                ttl_ms: spec.ttl.as_ms(),
                expires_at_ms: now_ms + spec.ttl.as_ms(),
                owner: spec.owner.clone(),
                lock_delay_ms: spec.lock_delay_ms,
                entries: Vec::new(),
            };
            if let Some(rid) = rid {
                self.opened_by.insert(rid, id.clone());
            }
            self.live.insert(id.clone(), record.clone());
            return Some(record);
        }
        let record = self.live_mut(id, now_ms)?;
        record.now_ms = now_ms;
        match op {
            SessionOp::Open(_) | SessionOp::Read => {}
            SessionOp::Renew(ttl) => {
                if let Some(ttl) = ttl {
                    record.ttl_ms = ttl.as_ms();
                }
                record.expires_at_ms = now_ms + record.ttl_ms;
            }
            SessionOp::Enter(entry) => {
                record.entries.retain(|e| e != entry);
                record.entries.push(SessionEntry {
                    entered_ms: now_ms,
                    ..entry.clone()
                });
            }
            SessionOp::Drop(entry) => record.entries.retain(|e| e != entry),
            SessionOp::Close => {
                let closed = self.live.remove(id);
                self.opened_by.retain(|_, s| s != id);
                return closed;
            }
        }
        Some(record.clone())
    }

    /// The live record of `id`; an ended one is dropped.
    fn live_mut(&mut self, id: &Token, now_ms: u64) -> Option<&mut SessionRecord> {
        if self.live.get(id)?.expires_at_ms <= now_ms {
            self.live.remove(id);
            self.opened_by.retain(|_, s| s != id);
            return None;
        }
        self.live.get_mut(id)
    }

    /// Drops the sessions that ended before `now_ms`; how many.
    pub(super) fn sweep(&mut self, now_ms: u64) -> usize {
        let before = self.live.len();
        self.live.retain(|_, r| r.expires_at_ms > now_ms);
        let live = &self.live;
        self.opened_by.retain(|_, s| live.contains_key(s));
        before - self.live.len()
    }
}
