//! The lease ledger: the live leases this broker granted or renewed, so that it can put them
//! back into a store that lost them (a restart without persistence, a flush, a failover to a
//! replica that missed the last writes).
//!
//! An entry is added on a grant or renew and dropped on release, on an answer that the lease is
//! gone, or once its end has passed. The ledger is bounded by the broker's live leases; an entry
//! is a key, a token, a fence, a few numbers and the owner label (see `bench ledger` for the
//! measured bytes per lease).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::domain::{Fence, Lease, LockKey, Owner, RequestId, Token};

/// One live lease as the granting broker remembers it (as handed out by [`Ledger::live`] and
/// [`Ledger::get`]; the ledger itself keeps a compact form).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub token: Token,
    pub fence: Fence,
    /// When the lease ends, on this host's monotonic clock: the moment its grant or renewal was
    /// answered plus its TTL, rounded up to the millisecond. The store started the lease a little
    /// earlier than that answer, so this is never before the real end: a put-back errs towards
    /// keeping a key a few milliseconds longer, never towards ending a lease early.
    pub ends: Instant,
    pub ttl_ms: u64,
    pub owner: Option<Owner>,
    pub request_id: Option<RequestId>,
}

impl Entry {
    /// What is left of the lease at `now`; zero once it has ended.
    pub fn remaining(&self, now: Instant) -> Duration {
        self.ends.saturating_duration_since(now)
    }
}

/// An entry as the ledger keeps it: a broker may hold a hundred thousand live leases, so each
/// field is as small as it can be (about 200 bytes a lease in all; `lockbroker bench --ledger`).
#[derive(Debug)]
struct Kept {
    token: KeptToken,
    fence: Fence,
    /// [`Entry::ends`] as milliseconds after the ledger's base instant.
    ends_ms: u64,
    /// At most a day (`max_ttl_ms`'s ceiling).
    ttl_ms: u32,
    owner: Option<Box<str>>,
    request_id: Option<Box<str>>,
}

/// A token as kept: the broker's own tokens (48 lowercase hex digits) as their 24 bytes, inline;
/// anything else (a token from another version, presented to renew) as it came.
#[derive(Debug, PartialEq, Eq)]
enum KeptToken {
    Generated([u8; 24]),
    Other(Box<str>),
}

impl KeptToken {
    fn of(token: &Token) -> Self {
        let hex = token.as_str().as_bytes();
        let mut bytes = [0u8; 24];
        let decoded = hex.len() == 48
            && hex.chunks(2).zip(bytes.iter_mut()).all(|(pair, byte)| {
                match (nibble(pair[0]), nibble(pair[1])) {
                    (Some(high), Some(low)) => {
                        *byte = high << 4 | low;
                        true
                    }
                    _ => false,
                }
            });
        if decoded {
            Self::Generated(bytes)
        } else {
            Self::Other(token.as_str().into())
        }
    }

    fn token(&self) -> Token {
        let text = match self {
            Self::Generated(bytes) => bytes
                .iter()
                .flat_map(|b| [b >> 4, b & 0xf])
                .map(|n| char::from(b"0123456789abcdef"[usize::from(n)]))
                .collect(),
            Self::Other(text) => text.to_string(),
        };
        Token::parse(&text).expect("a token the ledger kept was valid when it came")
    }
}

/// A lowercase hex digit's value (the broker's tokens use no capitals).
fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

/// The broker's live leases, by key.
#[derive(Debug)]
pub struct Ledger {
    /// A std Mutex: nothing awaits while holding it, and each critical section is one map
    /// operation (or one pass over the map, once a second, to drop ended leases).
    leases: Mutex<HashMap<Box<str>, Kept>>,
    /// What `Kept::ends_ms` counts from.
    base: Instant,
}

impl Default for Ledger {
    fn default() -> Self {
        Self {
            leases: Mutex::default(),
            base: Instant::now(),
        }
    }
}

impl Ledger {
    fn leases(&self) -> MutexGuard<'_, HashMap<Box<str>, Kept>> {
        // Each write is one map operation, so a poisoned map is still consistent.
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Milliseconds after the base, rounded up: never before `at`.
    fn ms_after_base(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.base);
        u64::try_from(since.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }

    fn expand(&self, key: &str, kept: &Kept) -> (LockKey, Entry) {
        let entry = Entry {
            token: kept.token.token(),
            fence: kept.fence,
            ends: self.base + Duration::from_millis(kept.ends_ms),
            ttl_ms: u64::from(kept.ttl_ms),
            owner: kept.owner.as_deref().and_then(|o| Owner::parse(o).ok()),
            request_id: kept
                .request_id
                .as_deref()
                .and_then(|r| RequestId::parse(r).ok()),
        };
        (
            LockKey::parse(key).expect("a key the ledger kept was valid when it came"),
            entry,
        )
    }

    /// Remembers `lease` on `key`, ending at `ends` (the moment its grant or renewal was answered
    /// plus what the store said remained of it). A renewal keeps the request id the grant had
    /// (the store does not echo it).
    pub fn record(&self, key: &LockKey, lease: &Lease, ends: Instant) {
        let ends_ms = self.ms_after_base(ends);
        let token = KeptToken::of(&lease.token);
        let mut leases = self.leases();
        let request_id = match (leases.get(key.as_str()), &lease.request_id) {
            (_, Some(id)) => Some(id.as_str().into()),
            (Some(old), None) if old.token == token => old.request_id.clone(),
            _ => None,
        };
        leases.insert(
            key.as_str().into(),
            Kept {
                token,
                fence: lease.fence,
                ends_ms,
                ttl_ms: u32::try_from(lease.ttl_ms).unwrap_or(u32::MAX),
                owner: lease.owner.as_ref().map(|o| o.as_str().into()),
                request_id,
            },
        );
    }

    /// Forgets `token`'s lease on `key` (released, or found gone). Another token's entry stays.
    pub fn forget(&self, key: &LockKey, token: &Token) {
        let mut leases = self.leases();
        if leases
            .get(key.as_str())
            .is_some_and(|e| e.token == KeptToken::of(token))
        {
            leases.remove(key.as_str());
        }
    }

    /// Forgets the lease on `key` if its fence is at most `fence`: a release notice from any
    /// broker says the lease with that fence is over, and so is any older one.
    pub fn forget_released(&self, key: &str, fence: Fence) {
        let mut leases = self.leases();
        if leases.get(key).is_some_and(|e| e.fence <= fence) {
            leases.remove(key);
        }
    }

    /// Whether `token`'s lease on `key` is still remembered.
    pub fn holds(&self, key: &LockKey, token: &Token) -> bool {
        self.leases()
            .get(key.as_str())
            .is_some_and(|e| e.token == KeptToken::of(token))
    }

    /// The entry for `key`, if any.
    pub fn get(&self, key: &LockKey) -> Option<Entry> {
        self.leases()
            .get(key.as_str())
            .map(|kept| self.expand(key.as_str(), kept).1)
    }

    /// Drops the leases that have ended by `now`; returns how many.
    pub fn sweep(&self, now: Instant) -> usize {
        let now_ms = self.ms_after_base(now);
        let mut leases = self.leases();
        let before = leases.len();
        leases.retain(|_, e| e.ends_ms > now_ms);
        before - leases.len()
    }

    /// The leases still live at `now`, to put back.
    pub fn live(&self, now: Instant) -> Vec<(LockKey, Entry)> {
        let now_ms = self.ms_after_base(now);
        self.leases()
            .iter()
            .filter(|(_, e)| e.ends_ms > now_ms)
            .map(|(k, e)| self.expand(k, e))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.leases().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(token: &Token, fence: Fence, ttl_ms: u64) -> Lease {
        Lease {
            token: token.clone(),
            fence,
            expires_at_ms: 0,
            ttl_ms,
            owner: None,
            request_id: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_is_kept_until_it_ends_or_its_holder_lets_go() {
        let ledger = Ledger::default();
        let (a, b) = (LockKey::parse("a").unwrap(), LockKey::parse("b").unwrap());
        let (ta, tb) = (Token::generate(), Token::generate());
        let start = Instant::now();
        ledger.record(
            &a,
            &lease(&ta, 1, 1_000),
            start + Duration::from_millis(1_000),
        );
        ledger.record(
            &b,
            &lease(&tb, 2, 5_000),
            start + Duration::from_millis(5_000),
        );
        // Someone else's token does not forget the entry.
        ledger.forget(&a, &tb);
        assert!(ledger.holds(&a, &ta));
        let live = ledger.live(start + Duration::from_millis(999));
        assert_eq!(live.len(), 2);
        assert_eq!(ledger.sweep(start + Duration::from_millis(1_000)), 1);
        assert!(!ledger.holds(&a, &ta));
        assert_eq!(
            ledger
                .get(&b)
                .unwrap()
                .remaining(start + Duration::from_millis(1_000)),
            Duration::from_millis(4_000)
        );
        ledger.forget(&b, &tb);
        assert!(ledger.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_come_back_as_they_went_in_generated_or_not() {
        let ledger = Ledger::default();
        let key = LockKey::parse("k").unwrap();
        for token in [
            Token::generate(),
            Token::parse("a-token-from-another-version_0123").unwrap(),
            // 48 characters, but not all lowercase hex.
            Token::parse(&"A".repeat(48)).unwrap(),
        ] {
            ledger.record(
                &key,
                &lease(&token, 1, 1_000),
                Instant::now() + Duration::from_millis(1_000),
            );
            assert!(ledger.holds(&key, &token));
            assert_eq!(ledger.get(&key).unwrap().token, token);
            let (_, live) = ledger.live(Instant::now()).pop().unwrap();
            assert_eq!(live.token, token);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_moves_the_end_and_keeps_the_grants_request_id() {
        let ledger = Ledger::default();
        let key = LockKey::parse("k").unwrap();
        let token = Token::generate();
        let start = Instant::now();
        let mut granted = lease(&token, 7, 1_000);
        granted.request_id = Some(RequestId::parse("job-1").unwrap());
        ledger.record(&key, &granted, start + Duration::from_millis(1_000));
        // Renewed half a second in, for 3 s.
        ledger.record(
            &key,
            &lease(&token, 7, 3_000),
            start + Duration::from_millis(3_500),
        );
        let entry = ledger.get(&key).unwrap();
        assert_eq!(entry.ends, start + Duration::from_millis(3_500));
        assert_eq!(entry.request_id.unwrap().as_str(), "job-1");
    }
}
