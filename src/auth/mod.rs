//! Who may do what: the auth file (named bearer tokens, each with key prefixes and
//! permissions), parsed into a [`Policy`], and the decision for one request ([`Policy::decide`]).
//! Knows nothing of HTTP: `crate::http::auth` maps a route to an [`Action`] and a decision to
//! `401`/`403`. The policy in force is swapped whole on a reload (`crate::reload`).
//!
//! Tokens are kept only as SHA-256 digests, whether the file gives them by value or by digest,
//! and a presented token is hashed and compared with every entry in constant time, so neither
//! the comparison nor the lookup tells an attacker how much of a guess was right.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use toml::Spanned;

use crate::domain::LockKey;

/// What a token may be allowed, as written in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Permission {
    /// Acquire, renew, release, inspect and list keys under the token's prefixes.
    Lock,
    /// Inspect (and list) keys under the token's prefixes; with the prefix `""`, also read
    /// `/metrics` and `/openapi.json` when they are guarded.
    Read,
    /// Everything, on every key, prefixes notwithstanding, force release included.
    Admin,
}

/// What one request does, as the auth layer tells it from the route and the key.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Action<'a> {
    Acquire(&'a LockKey),
    Release(&'a LockKey),
    Renew(&'a LockKey),
    Inspect(&'a LockKey),
    /// Ending every lease on a key without its token (`DELETE …?force=true`): `admin` only.
    ForceRelease(&'a LockKey),
    /// Listing the held keys that start with this prefix: `read` or `lock` on a prefix of it,
    /// so that every key the listing could show is one the token may inspect.
    List(&'a str),
    /// Opening, keeping, reading or closing a session (`/sessions…`): `lock` on at least one
    /// prefix; each acquire under the session is checked against its own key.
    Session,
    /// `/metrics` and `/openapi.json` under `auth_metrics`.
    Operations,
    /// A request the layer has no rule for: only `admin` passes, so a route added without a rule
    /// is closed rather than open.
    Unlisted,
}

/// The file's shape. Unknown fields are errors, as in the config file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    tokens: Vec<Spanned<TokenEntry>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    token: Option<String>,
    token_sha256: Option<String>,
    prefixes: Vec<String>,
    permissions: Vec<Permission>,
}

/// Longest token name: it is a metrics label and a log field.
const MAX_NAME_LEN: usize = 64;

/// Shortest token given by value: anything shorter can be guessed.
const MIN_TOKEN_LEN: usize = 16;

/// One named token. `Debug` shows no digest.
pub(crate) struct Client {
    name: Arc<str>,
    digest: [u8; 32],
    prefixes: Vec<String>,
    lock: bool,
    read: bool,
    admin: bool,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("name", &self.name)
            .field("prefixes", &self.prefixes)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// The token's name, for logs and metrics.
    pub(crate) fn name(&self) -> &Arc<str> {
        &self.name
    }

    fn covers(&self, key: &LockKey) -> bool {
        self.prefixes.iter().any(|p| key.as_str().starts_with(p))
    }

    /// Whether this token may do `action`.
    pub(crate) fn allows(&self, action: Action<'_>) -> bool {
        if self.admin {
            return true;
        }
        match action {
            Action::Acquire(key) | Action::Release(key) | Action::Renew(key) => {
                self.lock && self.covers(key)
            }
            Action::Inspect(key) => (self.lock || self.read) && self.covers(key),
            Action::List(prefix) => {
                (self.lock || self.read) && self.prefixes.iter().any(|p| prefix.starts_with(p))
            }
            Action::Session => self.lock && !self.prefixes.is_empty(),
            Action::Operations => self.read && self.prefixes.iter().any(String::is_empty),
            Action::ForceRelease(_) | Action::Unlisted => false,
        }
    }
}

/// The tokens in force.
#[derive(Debug, Default)]
pub(crate) struct Policy {
    clients: Vec<Client>,
}

/// A file that cannot be used, with the line that is wrong when there is one.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct PolicyError(String);

impl Policy {
    /// Reads and parses the auth file.
    pub(crate) fn load(path: &Path) -> Result<Self, PolicyError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            PolicyError(format!("cannot read the auth file {}: {e}", path.display()))
        })?;
        Self::parse(&text)
            .map_err(|e| PolicyError(format!("the auth file {} is invalid: {e}", path.display())))
    }

    /// Parses the file's text. Errors name the line (and for TOML syntax, the column).
    pub(crate) fn parse(text: &str) -> Result<Self, PolicyError> {
        let line_of = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
        let file: File = toml::from_str(text).map_err(|e| {
            // toml's message starts with "TOML parse error at line N, column M" and quotes the
            // line, which may hold a token: keep the position and the reason only.
            let at = e.span().map(|s| format!("line {}: ", line_of(s.start)));
            PolicyError(format!(
                "{}{}",
                at.unwrap_or_default(),
                e.message().trim_end()
            ))
        })?;
        let mut clients: Vec<Client> = Vec::with_capacity(file.tokens.len());
        for spanned in file.tokens {
            let line = line_of(spanned.span().start);
            let entry = spanned.into_inner();
            let fail =
                |why: String| PolicyError(format!("line {line}: token {:?}: {why}", entry.name));
            if entry.name.is_empty()
                || entry.name.len() > MAX_NAME_LEN
                || !entry
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
            {
                return Err(fail(format!(
                    "a name is 1 to {MAX_NAME_LEN} characters from A-Z a-z 0-9 . _ -"
                )));
            }
            if clients.iter().any(|c| *c.name == *entry.name) {
                return Err(fail("the name is given twice".into()));
            }
            let digest = match (&entry.token, &entry.token_sha256) {
                (Some(token), None) => {
                    if token.len() < MIN_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
                        return Err(fail(format!(
                            "a token is at least {MIN_TOKEN_LEN} printable ASCII characters, \
                             without spaces"
                        )));
                    }
                    digest(token)
                }
                (None, Some(hex)) => parse_hex_digest(hex)
                    .ok_or_else(|| fail("token_sha256 must be 64 hexadecimal characters".into()))?,
                _ => return Err(fail("give exactly one of token and token_sha256".into())),
            };
            if clients.iter().any(|c| bool::from(c.digest.ct_eq(&digest))) {
                return Err(fail("the same token is given to another name".into()));
            }
            if entry.prefixes.is_empty() {
                return Err(fail(
                    "prefixes is empty; [\"\"] gives every key, [\"orders:\"] the keys that \
                     start with orders:"
                        .into(),
                ));
            }
            if entry.permissions.is_empty() {
                return Err(fail(
                    "permissions is empty; give any of \"lock\", \"read\", \"admin\"".into(),
                ));
            }
            let has = |p: Permission| entry.permissions.contains(&p);
            clients.push(Client {
                name: entry.name.as_str().into(),
                digest,
                lock: has(Permission::Lock),
                read: has(Permission::Read),
                admin: has(Permission::Admin),
                prefixes: entry.prefixes,
            });
        }
        Ok(Self { clients })
    }

    /// How many tokens the policy knows.
    pub(crate) fn len(&self) -> usize {
        self.clients.len()
    }

    /// The entry whose token is `bearer`. Every entry is compared, in constant time, whatever
    /// matches.
    pub(crate) fn authenticate(&self, bearer: &str) -> Option<&Client> {
        let presented = digest(bearer);
        let mut found = None;
        for client in &self.clients {
            if bool::from(client.digest.ct_eq(&presented)) {
                found = Some(client);
            }
        }
        found
    }
}

/// The token of an `Authorization: Bearer <token>` value (the scheme in any case).
pub(crate) fn bearer_token(value: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(value).ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim_start();
    (scheme.eq_ignore_ascii_case("bearer")
        && !token.is_empty()
        && token.bytes().all(|b| b.is_ascii_graphic()))
    .then_some(token)
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The SHA-256 of a token in lower-case hex, as `token_sha256` takes it.
pub fn sha256_hex(token: &str) -> String {
    digest(token).iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex_digest(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests;
