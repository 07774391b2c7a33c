//! Sessions on Redis: each session's record is one hash, `<prefix>session:{<id>}` (its own hash
//! tag, so on a cluster its own slot), run by SESSION (`scripts/session.lua`). A request id that
//! opened a session is remembered in `<prefix>session-id:{<request id>}` (the session's id, for
//! the session's TTL plus the slack): a second call on another key, since on a cluster the two
//! keys live on different slots.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::future::join_all;
use redis::RedisError;
use tokio::time::Instant;

use crate::RedisStore;
use crate::scripts::{Keep, KeepReply, SessionCall};
use lockbroker_core::domain::Token;
use lockbroker_core::store::{
    AsHolder, EXPIRY_SLACK_MS, Lease, Renewal, SessionEntry, SessionOp, SessionRecord, Store,
    StoreError, StoreResult,
};

/// The most leases one KEEP call carries: a session with more is kept by several calls.
const KEEP_MOST: usize = 128;

/// What a keep-alive answers for one lease.
type Kept = StoreResult<AsHolder<Lease>>;

impl RedisStore {
    /// One call on session `id`'s record (see [`SessionOp`]).
    pub(crate) async fn session_call(
        &self,
        id: &Token,
        op: SessionOp<'_>,
    ) -> StoreResult<Option<SessionRecord>> {
        if let SessionOp::Open(spec) = op
            && let Some(rid) = &spec.request_id
            && let Some(earlier) = self.opened_by(rid.as_str(), id, spec.ttl.as_ms()).await?
        {
            return Ok(Some(earlier));
        }
        self.run_session(id, op).await
    }

    /// A session's keep-alive on its leases (see `Store::renew_all`): on one Redis one KEEP call
    /// for up to [`KEEP_MOST`] leases, on a cluster one per slot. With replica acknowledgements
    /// asked, lease by lease (each renewal waits for its replicas as RENEW's do).
    pub(crate) async fn keep_leases(&self, entries: &[SessionEntry], until_ms: u64) -> Vec<Kept> {
        if self.replicas.asked() {
            let until = Renewal::Until(until_ms);
            let renewals = entries
                .iter()
                .map(|e| self.renew(e.space, &e.key, &e.token, until));
            return join_all(renewals).await;
        }
        let mut by_slot: BTreeMap<Option<u16>, Vec<usize>> = BTreeMap::new();
        for (i, entry) in entries.iter().enumerate() {
            by_slot
                .entry(self.layout.slot(&entry.key))
                .or_default()
                .push(i);
        }
        let groups = by_slot
            .values()
            .flat_map(|indices| indices.chunks(KEEP_MOST))
            .map(|indices| self.keep_group(entries, indices, until_ms));
        let mut answers: Vec<Option<Kept>> = entries.iter().map(|_| None).collect();
        for (i, kept) in join_all(groups).await.into_iter().flatten() {
            answers[i] = Some(kept);
        }
        answers
            .into_iter()
            .map(|kept| {
                kept.unwrap_or_else(|| Err(StoreError::Failed("a lease left unkept".into())))
            })
            .collect()
    }

    /// One KEEP call on the leases `indices` of `entries`, all on one slot.
    async fn keep_group(
        &self,
        entries: &[SessionEntry],
        indices: &[usize],
        until_ms: u64,
    ) -> Vec<(usize, Kept)> {
        let sites: Vec<_> = indices
            .iter()
            .map(|&i| self.layout.site(entries[i].space, &entries[i].key))
            .collect();
        let slot = sites.first().and_then(|s| s.slot);
        let (caller, known) = (self.broker.caller(), self.keeper.epoch_for(slot));
        let keep = Keep {
            leases: sites
                .iter()
                .zip(indices)
                .map(|(site, &i)| {
                    let on = self.keeper.holder_context(site, &caller, &known);
                    (on, &entries[i].token)
                })
                .collect(),
            until_ms,
        };
        let replies = match self.keeper.run(&keep).await {
            Ok(KeepReply(replies)) if replies.len() == indices.len() => replies,
            Ok(_) => {
                let e = StoreError::Failed("Redis answered KEEP for other leases".into());
                return indices.iter().map(|&i| (i, Err(e.clone()))).collect();
            }
            Err(e) => return indices.iter().map(|&i| (i, Err(e.clone()))).collect(),
        };
        let answered = Instant::now();
        indices
            .iter()
            .zip(replies)
            .map(|(&i, reply)| {
                let entry = &entries[i];
                let kept = match self.renewal(entry.space, &entry.key, &entry.token, reply) {
                    Err(e) => Err(e),
                    Ok(Err(refused)) => Ok(refused),
                    Ok(Ok((kind, lease, epoch))) => {
                        let ends = answered + Duration::from_millis(lease.ttl_ms);
                        self.keeper
                            .remember(&entry.key, kind, slot, &lease, ends, &epoch);
                        Ok(AsHolder::Done(lease))
                    }
                };
                (i, kept)
            })
            .collect()
    }

    async fn run_session(
        &self,
        id: &Token,
        op: SessionOp<'_>,
    ) -> StoreResult<Option<SessionRecord>> {
        let record = format!("{}session:{{{}}}", self.layout.prefix, id.as_str());
        let reply = self
            .keeper
            .run(&SessionCall {
                record: &record,
                op,
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
            && let Some(record) = self.run_session(&earlier, SessionOp::Read).await?
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
