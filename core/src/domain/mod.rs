//! Domain values, parsed once at the edge: a value of one of these types that exists is valid,
//! and nothing downstream checks it again.

use std::fmt;
use std::time::Duration;

use rand::Rng;

mod lease;
pub use lease::Place;
pub use lease::{Kind, Lease, Mode, Pool, Space};

/// A duration in whole milliseconds, the unit of the API and of the store (saturating: no
/// duration the broker handles comes near `u64::MAX` ms).
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Why a raw value was refused; the message is one human sentence for the API's `message`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidValue(pub String);

fn invalid(message: impl Into<String>) -> InvalidValue {
    InvalidValue(message.into())
}

/// A lock's name as clients see it: 1 to 200 characters from `A-Z a-z 0-9 . _ - :`.
///
/// The alphabet has no `{`, `}` or spaces, so a key embeds safely in a Redis key and inside a
/// Redis Cluster hash tag.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(String);

impl LockKey {
    /// Longest key accepted, in characters.
    pub const MAX_LEN: usize = 200;

    /// Parses an already percent-decoded key.
    pub fn parse(raw: &str) -> Result<Self, InvalidValue> {
        if raw.is_empty() {
            return Err(invalid("The lock key is empty."));
        }
        if raw.len() > Self::MAX_LEN {
            return Err(invalid(format!(
                "The lock key is {} characters long; the limit is {}.",
                raw.chars().count(),
                Self::MAX_LEN
            )));
        }
        if let Some(bad) = raw
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':')))
        {
            return Err(invalid(format!(
                "The lock key contains {bad:?}; keys use only A-Z a-z 0-9 . _ - :"
            )));
        }
        Ok(Self(raw.to_owned()))
    }

    /// Checks a key prefix (for listings): what a key may start with, so 0 to 200 characters
    /// from the keys' alphabet.
    pub fn parse_prefix(raw: &str) -> Result<String, InvalidValue> {
        if raw.is_empty() {
            return Ok(String::new());
        }
        Self::parse(raw)
            .map(|key| key.0)
            .map_err(|e| invalid(e.0.replacen("The lock key", "The prefix", 1)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The secret that proves who holds a lease: 192 bits from the thread-local CSPRNG
/// (ChaCha, seeded from the OS), hex-encoded, so it is URL-safe and 48 characters long.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Token(String);

impl Token {
    /// Longest token a client may present; longer ones cannot be ours.
    pub const MAX_LEN: usize = 128;
    const BYTES: usize = 24;

    /// A new, unguessable token.
    pub fn generate() -> Self {
        let mut bytes = [0u8; Self::BYTES];
        rand::rng().fill_bytes(&mut bytes);
        let mut hex = String::with_capacity(Self::BYTES * 2);
        for b in bytes {
            hex.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
            hex.push(char::from(b"0123456789abcdef"[usize::from(b & 0xf)]));
        }
        Self(hex)
    }

    /// Parses a token a client presented. Any URL-safe string up to 128 characters is accepted
    /// (a token issued by a later version may look different); the store decides if it matches.
    pub fn parse(raw: &str) -> Result<Self, InvalidValue> {
        if raw.is_empty() {
            return Err(invalid("The lock token is empty."));
        }
        if raw.len() > Self::MAX_LEN {
            return Err(invalid(format!(
                "The lock token is longer than {} characters.",
                Self::MAX_LEN
            )));
        }
        if !raw
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~'))
        {
            return Err(invalid("The lock token has characters a token never has."));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Tokens are secrets: they never appear in logs through `Debug`.
impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(…)")
    }
}

/// A fencing token: for one key, every grant gets a fence greater than every fence before it.
pub type Fence = u64;

/// A lease length in milliseconds, at least 1 and at most the configured `max_ttl_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ttl(u64);

impl Ttl {
    pub fn parse(ms: u64, max_ms: u64) -> Result<Self, InvalidValue> {
        if ms == 0 {
            return Err(invalid("ttl_ms must be at least 1."));
        }
        if ms > max_ms {
            return Err(invalid(format!(
                "ttl_ms is {ms}; this broker allows at most {max_ms}."
            )));
        }
        Ok(Self(ms))
    }

    /// For values that are valid by construction (configuration already validated, tests).
    pub const fn from_ms(ms: u64) -> Self {
        Self(ms)
    }

    pub fn as_ms(self) -> u64 {
        self.0
    }
}

/// How long an acquire may wait while someone else holds the lock, 0 ..= `max_wait_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct WaitFor(u64);

impl WaitFor {
    pub fn parse(ms: u64, max_ms: u64) -> Result<Self, InvalidValue> {
        if ms > max_ms {
            return Err(invalid(format!(
                "wait_ms is {ms}; this broker allows at most {max_ms}."
            )));
        }
        Ok(Self(ms))
    }

    /// What is left of a wait already parsed (a several-keys acquire's, key after key), and
    /// for tests.
    pub const fn from_ms(ms: u64) -> Self {
        Self(ms)
    }

    pub fn as_duration(self) -> Duration {
        Duration::from_millis(self.0)
    }
}

/// A free label for people, shown by `GET /locks/{key}`: at most 128 characters, no control
/// characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner(String);

impl Owner {
    pub const MAX_LEN: usize = 128;

    pub fn parse(raw: &str) -> Result<Self, InvalidValue> {
        if raw.chars().count() > Self::MAX_LEN {
            return Err(invalid(format!(
                "owner is longer than {} characters.",
                Self::MAX_LEN
            )));
        }
        if raw.chars().any(char::is_control) {
            return Err(invalid("owner contains a control character."));
        }
        Ok(Self(raw.to_owned()))
    }

    /// The label as stored: for a lease held under a session, the session's mark, its lock
    /// delay and then the label (see [`Owner::for_session`]). What a store keeps and hands back.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The stored form of a lease's label when the lease is held under a session with the lock
    /// delay `lock_delay_ms`: a control character no client label may contain, the delay, the
    /// same character, then the label (empty for none). Every store keeps the label as it keeps
    /// any other, so "held under a session" and the delay travel with the lease without a field
    /// of their own: inspect and list show `"session": true`, and a renewal by token leaves the
    /// lease's end (the session's, plus the delay) alone.
    pub fn for_session(label: Option<&Owner>, lock_delay_ms: u64) -> Self {
        let label = label.map_or("", Owner::as_str);
        Self(format!(
            "{SESSION_MARK}{lock_delay_ms}{SESSION_MARK}{label}"
        ))
    }

    /// A label as a store kept it: a client's label, or [`Owner::for_session`]'s form.
    pub fn from_stored(raw: &str) -> Result<Self, InvalidValue> {
        match raw.strip_prefix(SESSION_MARK) {
            Some(rest) => {
                let (delay, label) = rest
                    .split_once(SESSION_MARK)
                    .ok_or_else(|| invalid("a session lease's label without its delay."))?;
                let delay = delay
                    .parse()
                    .map_err(|_| invalid("a session lease's label with a malformed delay."))?;
                let label = (!label.is_empty())
                    .then(|| Owner::parse(label))
                    .transpose()?;
                Ok(Self::for_session(label.as_ref(), delay))
            }
            None => Self::parse(raw),
        }
    }

    /// The label for people (`None` for a session lease without one).
    pub fn label(&self) -> Option<&str> {
        match self.0.strip_prefix(SESSION_MARK) {
            Some(rest) => rest
                .split_once(SESSION_MARK)
                .map(|(_, label)| label)
                .filter(|l| !l.is_empty()),
            None => Some(&self.0),
        }
    }

    /// The lock delay of a lease held under a session; `None` for any other lease.
    pub fn session_delay_ms(&self) -> Option<u64> {
        let rest = self.0.strip_prefix(SESSION_MARK)?;
        rest.split_once(SESSION_MARK)?.0.parse().ok()
    }
}

/// Marks the stored label of a lease held under a session (see [`Owner::for_session`]).
const SESSION_MARK: char = '\u{1e}';

/// A client-chosen id that makes an acquire safe to repeat: 1 to 64 characters of
/// `A-Z a-z 0-9 _ -`. Repeating an acquire of the same key with the same id while the lease it
/// produced is held returns that lease again. Anyone who knows the key and the id gets the token,
/// so it should be random (a UUID).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(String);

impl RequestId {
    pub const MAX_LEN: usize = 64;

    pub fn parse(raw: &str) -> Result<Self, InvalidValue> {
        if raw.is_empty() || raw.len() > Self::MAX_LEN {
            return Err(invalid(format!(
                "request_id must be 1 to {} characters long.",
                Self::MAX_LEN
            )));
        }
        if !raw
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(invalid("request_id uses only A-Z a-z 0-9 _ -"));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_accept_the_documented_alphabet_and_length() {
        assert!(LockKey::parse("orders:42.a_b-C").is_ok());
        assert!(LockKey::parse(&"k".repeat(200)).is_ok());
        assert!(LockKey::parse(&"k".repeat(201)).is_err());
        assert!(LockKey::parse("").is_err());
        for bad in ["a/b", "a b", "{x}", "é", "a%41"] {
            assert!(LockKey::parse(bad).is_err(), "{bad} must be refused");
        }
    }

    #[test]
    fn generated_tokens_are_distinct_url_safe_and_parse_back() {
        let a = Token::generate();
        let b = Token::generate();
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 48);
        assert_eq!(Token::parse(a.as_str()).unwrap(), a);
        assert!(Token::parse("has space").is_err());
        assert!(Token::parse(&"a".repeat(129)).is_err());
        assert_eq!(format!("{a:?}"), "Token(…)");
    }

    #[test]
    fn ttl_and_wait_respect_their_bounds() {
        assert!(Ttl::parse(0, 10).is_err());
        assert!(Ttl::parse(11, 10).is_err());
        assert_eq!(Ttl::parse(10, 10).unwrap().as_ms(), 10);
        assert!(WaitFor::parse(0, 10).is_ok());
        assert!(WaitFor::parse(11, 10).is_err());
    }

    #[test]
    fn request_ids_are_short_plain_strings() {
        assert!(RequestId::parse("3f2a-77_b").is_ok());
        assert!(RequestId::parse(&"r".repeat(64)).is_ok());
        assert!(RequestId::parse(&"r".repeat(65)).is_err());
        assert!(RequestId::parse("").is_err());
        assert!(RequestId::parse("a.b").is_err());
    }

    #[test]
    fn owners_refuse_control_characters_and_long_labels() {
        assert!(Owner::parse("worker 7 — büro").is_ok());
        assert!(Owner::parse("a\nb").is_err());
        assert!(Owner::parse(&"x".repeat(129)).is_err());
        assert!(Owner::parse(&"é".repeat(128)).is_ok());
    }
}
