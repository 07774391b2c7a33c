//! Sessions on Redis: each session's record is one hash, `<prefix>session:{<id>}` (its own hash
//! tag, so on a cluster its own slot), run by SESSION (`scripts/session.lua`). A request id that
//! opened a session is remembered in `<prefix>session-id:{<request id>}` (the session's id, for
//! the session's TTL plus the slack): a second call on another key, since on a cluster the two
//! keys live on different slots.

use redis::RedisError;

use crate::RedisStore;
use crate::scripts::{SessionAct, SessionCall};
use lockbroker_core::domain::Token;
use lockbroker_core::store::{EXPIRY_SLACK_MS, SessionOp, SessionRecord, StoreResult};

impl RedisStore {
    /// One call on session `id`'s record (see [`SessionOp`]).
    pub(crate) async fn session_call(
        &self,
        id: &Token,
        op: SessionOp<'_>,
    ) -> StoreResult<Option<SessionRecord>> {
        let act = match op {
            SessionOp::Open(spec) => {
                if let Some(rid) = &spec.request_id
                    && let Some(earlier) =
                        self.opened_by(rid.as_str(), id, spec.ttl.as_ms()).await?
                {
                    return Ok(Some(earlier));
                }
                SessionAct::Open(spec)
            }
            SessionOp::Renew(ttl) => SessionAct::Renew(ttl.map(|t| t.as_ms())),
            SessionOp::Read => SessionAct::Read,
            SessionOp::Close => SessionAct::Close,
            SessionOp::Enter(entry) => SessionAct::Enter(entry),
            SessionOp::Drop(entry) => SessionAct::Drop(entry),
        };
        self.run_session(id, act).await
    }

    async fn run_session(
        &self,
        id: &Token,
        act: SessionAct<'_>,
    ) -> StoreResult<Option<SessionRecord>> {
        let record = format!("{}session:{{{}}}", self.layout.prefix, id.as_str());
        let reply = self
            .keeper
            .run(&SessionCall {
                record: &record,
                act,
            })
            .await?;
        Ok(reply.0.map(|mut r| {
            r.id = id.clone();
            r
        }))
    }

    /// The session an earlier open with request id `rid` made, if one did; otherwise `id` is
    /// remembered as the one it opens now (`None`). An earlier session that has ended since is
    /// replaced by `id`.
    async fn opened_by(
        &self,
        rid: &str,
        id: &Token,
        ttl_ms: u64,
    ) -> StoreResult<Option<SessionRecord>> {
        let index = format!("{}session-id:{{{rid}}}", self.layout.prefix);
        let px = ttl_ms + EXPIRY_SLACK_MS;
        let earlier: Option<String> = self
            .keeper
            .with_link(async |conn| {
                // SET … NX GET: the earlier id if there was one (nothing written then), else
                // nil with `id` written.
                let earlier: Option<String> = redis::cmd("SET")
                    .arg(&index)
                    .arg(id.as_str())
                    .arg("NX")
                    .arg("GET")
                    .arg("PX")
                    .arg(px)
                    .query_async(conn)
                    .await?;
                Ok::<_, RedisError>(earlier)
            })
            .await?;
        let Some(earlier) = earlier else {
            return Ok(None);
        };
        if let Ok(earlier) = Token::parse(&earlier)
            && let Some(record) = self.run_session(&earlier, SessionAct::Read).await?
        {
            return Ok(Some(record));
        }
        // The earlier session ended: this open takes the request id over.
        self.keeper
            .with_link(async |conn| {
                redis::cmd("SET")
                    .arg(&index)
                    .arg(id.as_str())
                    .arg("PX")
                    .arg(px)
                    .query_async::<()>(conn)
                    .await
            })
            .await?;
        Ok(None)
    }
}
