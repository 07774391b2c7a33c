//! session.lua: one call on a session's record. The record lives in a key of its own; the
//! leases under it are kept in step by the broker (`crate::model`'s session client), each in
//! its own key's scripts (CLAIM, RENEW's `until` form, KEEP, RELEASE).

use super::{Answer, SessionOp, SessionRec, Store};

/// session.lua: `open` writes the record; every other call on a record that is missing or
/// ended answers none and writes nothing.
pub(super) fn session(s: &mut Store, id: u8, op: &SessionOp) -> Answer {
    let i = id as usize;
    if s.sessions.len() <= i {
        s.sessions.resize(i + 1, None);
    }
    if let SessionOp::Open { ttl, delay } = *op {
        let rec = SessionRec {
            ttl,
            left: ttl,
            delay,
            entries: Vec::new(),
        };
        s.sessions[i] = Some(rec.clone());
        return Answer::Session(Some(rec));
    }
    let Some(rec) = s.sessions[i].as_mut() else {
        return Answer::Session(None);
    };
    match *op {
        SessionOp::Open { .. } | SessionOp::Read => {}
        SessionOp::Renew => rec.left = rec.ttl,
        SessionOp::Enter(key, token) => {
            if !rec.entries.contains(&(key, token)) {
                rec.entries.push((key, token));
                rec.entries.sort();
            }
        }
        SessionOp::Drop(key, token) => rec.entries.retain(|e| *e != (key, token)),
        SessionOp::Close => return Answer::Session(s.sessions[i].take()),
    }
    Answer::Session(Some(rec.clone()))
}
