//! The store a running broker uses, whichever the configuration chose: each primitive delegated
//! to the embedded store or to Redis.

use tokio::sync::mpsc;

use super::{
    AsHolder, Bid, GrantAnswer, Hold, Join, ListQuery, MemoryStore, Notice, Page, Permits,
    RedisStore, Released, Renewal, SessionEntry, SessionOp, SessionRecord, Snapshot, Store,
    StoreResult,
};
use crate::domain::{Fence, Lease, LockKey, Pool, Space, Token};

/// The store a running broker uses: chosen at start from the configuration.
// One value per broker, behind an Arc: the size difference costs nothing, a Box an indirection.
#[allow(clippy::large_enum_variant)]
pub(crate) enum AnyStore {
    Memory(MemoryStore),
    Redis(RedisStore),
}

macro_rules! delegate {
    ($self:ident, $s:ident => $call:expr) => {
        match $self {
            AnyStore::Memory($s) => $call.await,
            AnyStore::Redis($s) => $call.await,
        }
    };
}

impl Store for AnyStore {
    async fn claim(&self, key: &LockKey, bid: &Bid) -> StoreResult<GrantAnswer> {
        delegate!(self, s => s.claim(key, bid))
    }

    async fn claim_all(&self, keys: &[LockKey], bid: &Bid) -> StoreResult<Option<Vec<Lease>>> {
        delegate!(self, s => s.claim_all(keys, bid))
    }

    async fn read(&self, key: &LockKey) -> StoreResult<Snapshot> {
        delegate!(self, s => s.read(key))
    }

    async fn take_over(&self, key: &LockKey, seen: Fence, bid: &Bid) -> StoreResult<GrantAnswer> {
        delegate!(self, s => s.take_over(key, seen, bid))
    }

    async fn release(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> StoreResult<AsHolder<Released>> {
        delegate!(self, s => s.release(space, key, token))
    }

    async fn renew(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
        how: Renewal,
    ) -> StoreResult<AsHolder<Lease>> {
        delegate!(self, s => s.renew(space, key, token, how))
    }

    async fn session(&self, id: &Token, op: SessionOp<'_>) -> StoreResult<Option<SessionRecord>> {
        delegate!(self, s => s.session(id, op))
    }

    async fn renew_all(
        &self,
        entries: &[SessionEntry],
        until_ms: u64,
    ) -> Vec<StoreResult<AsHolder<Lease>>> {
        delegate!(self, s => s.renew_all(entries, until_ms))
    }

    async fn join(&self, key: &LockKey, pool: Pool, bid: &Bid) -> StoreResult<Join> {
        delegate!(self, s => s.join(key, pool, bid))
    }

    async fn permits(&self, key: &LockKey) -> StoreResult<Permits> {
        delegate!(self, s => s.permits(key))
    }

    async fn leave(&self, space: Space, key: &LockKey, token: &Token) -> StoreResult<()> {
        delegate!(self, s => s.leave(space, key, token))
    }

    async fn force_release(
        &self,
        space: Space,
        key: &LockKey,
    ) -> StoreResult<AsHolder<Vec<Fence>>> {
        delegate!(self, s => s.force_release(space, key))
    }

    async fn list(&self, query: &ListQuery) -> StoreResult<Page> {
        delegate!(self, s => s.list(query))
    }

    fn cursor_pattern(&self) -> Option<&'static str> {
        match self {
            AnyStore::Memory(s) => s.cursor_pattern(),
            AnyStore::Redis(s) => s.cursor_pattern(),
        }
    }

    async fn ready(&self) -> StoreResult<Option<Hold>> {
        delegate!(self, s => s.ready())
    }

    fn start(&self, notices: mpsc::Sender<Notice>) {
        match self {
            AnyStore::Memory(s) => s.start(notices),
            AnyStore::Redis(s) => s.start(notices),
        }
    }

    fn sees_every_change(&self) -> bool {
        match self {
            // One broker per embedded store: every change is made through it.
            AnyStore::Memory(_) => true,
            AnyStore::Redis(s) => s.sees_every_change(),
        }
    }

    async fn mark_watched(&self, space: Space, key: &LockKey) -> StoreResult<bool> {
        delegate!(self, s => s.mark_watched(space, key))
    }

    fn ledger_len(&self) -> usize {
        match self {
            AnyStore::Memory(s) => s.ledger_len(),
            AnyStore::Redis(s) => s.ledger_len(),
        }
    }
}
