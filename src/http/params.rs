//! Extractors that turn a request into domain values, with every rejection in the API's error
//! format: the lock key from the path, and parameters from the query string and a JSON body.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use serde_json::{Map, Value};

use super::error::ApiError;
use crate::domain::{LockKey, Token};

/// Request bodies are small JSON objects; anything larger is refused.
pub const BODY_LIMIT: usize = 16 * 1024;

/// The `{key}` path segment, percent-decoded and validated.
pub struct KeyPath(pub LockKey);

impl<S: Send + Sync> FromRequestParts<S> for KeyPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| {
                ApiError::invalid("The lock key is not valid UTF-8 once percent-decoded.")
            })?;
        Ok(Self(LockKey::parse(&raw)?))
    }
}

/// Parameters from the query string and the JSON body together. A handler takes the ones it
/// knows with `int`/`text` and calls `finish`, which refuses whatever is left, so typos fail.
pub struct Params {
    query: Vec<(String, String)>,
    body: Map<String, Value>,
    /// The `Lock-Token` header, if sent.
    token_header: Option<String>,
}

impl<S: Send + Sync> FromRequest<S> for Params {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let Query(query) = Query::<Vec<(String, String)>>::try_from_uri(req.uri())
            .map_err(|_| ApiError::invalid("The query string is malformed."))?;
        let token_header = match req.headers().get("lock-token") {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .map_err(|_| ApiError::invalid("The Lock-Token header is not a valid token."))?
                    .to_owned(),
            ),
        };
        let is_json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_json_content_type);
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e: BytesRejection| {
                if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::payload_too_large(BODY_LIMIT)
                } else {
                    ApiError::invalid("The request body could not be read.")
                }
            })?;
        let body = if bytes.iter().all(u8::is_ascii_whitespace) {
            Map::new()
        } else if !is_json {
            return Err(ApiError::unsupported_media_type());
        } else {
            match serde_json::from_slice::<Body>(&bytes) {
                Ok(Body(map)) => map,
                Err(e) if e.is_data() => {
                    return Err(ApiError::invalid(format!("The JSON body is refused: {e}.")));
                }
                Err(e) => {
                    return Err(ApiError::invalid(format!(
                        "The JSON body is malformed: {e}."
                    )));
                }
            }
        };
        Ok(Self {
            query,
            body,
            token_header,
        })
    }
}

/// A JSON body: an object whose top-level names are each given once. (serde_json's own map
/// keeps the last of two equal names, which would let `{"ttl_ms":5000,"ttl_ms":1}` through.)
struct Body(Map<String, Value>);

impl<'de> serde::Deserialize<'de> for Body {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Body;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut access: A,
            ) -> Result<Body, A::Error> {
                let mut map = Map::new();
                while let Some((name, value)) = access.next_entry::<String, Value>()? {
                    if map.contains_key(&name) {
                        return Err(serde::de::Error::custom(format!("{name} is given twice")));
                    }
                    map.insert(name, value);
                }
                Ok(Body(map))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

fn is_json_content_type(v: &str) -> bool {
    let essence = v
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

impl Params {
    /// The query's value for `name`, refusing a name given twice with different values.
    fn take_query(&mut self, name: &str) -> Result<Option<String>, ApiError> {
        let mut found: Option<String> = None;
        let mut i = 0;
        while i < self.query.len() {
            if self.query[i].0 == name {
                let (_, v) = self.query.remove(i);
                if found.as_ref().is_some_and(|f| *f != v) {
                    return Err(ApiError::invalid(format!(
                        "{name} is given twice in the query string with different values."
                    )));
                }
                found = Some(v);
            } else {
                i += 1;
            }
        }
        Ok(found)
    }

    /// A non-negative integer parameter, from the query or the body (a JSON number).
    pub fn int(&mut self, name: &str) -> Result<Option<u64>, ApiError> {
        let not_int = || ApiError::invalid(format!("{name} must be a non-negative integer."));
        let from_query = match self.take_query(name)? {
            None => None,
            Some(s) => Some(s.parse::<u64>().map_err(|_| not_int())?),
        };
        let from_body = match self.body.remove(name) {
            None => None,
            Some(v) => Some(v.as_u64().ok_or_else(not_int)?),
        };
        same_in_both(name, from_query, from_body)
    }

    /// A string parameter, from the query or the body (a JSON string).
    pub fn text(&mut self, name: &str) -> Result<Option<String>, ApiError> {
        let from_query = self.take_query(name)?;
        let from_body = match self.body.remove(name) {
            None => None,
            Some(Value::String(s)) => Some(s),
            Some(_) => return Err(ApiError::invalid(format!("{name} must be a string."))),
        };
        same_in_both(name, from_query, from_body)
    }

    /// The lease token: the `Lock-Token` header or the `token` query parameter, never the body
    /// (bodies end up in logs and proxies' caches more often than headers).
    pub fn token(&mut self) -> Result<Token, ApiError> {
        if self.body.contains_key("token") {
            return Err(ApiError::invalid(
                "Send the token in the Lock-Token header or the token query parameter, not in the body.",
            ));
        }
        let from_query = self.take_query("token")?;
        let raw =
            same_in_both("token", self.token_header.take(), from_query)?.ok_or_else(|| {
                ApiError::invalid(
                    "A token is required, in the Lock-Token header or the token query parameter.",
                )
            })?;
        Ok(Token::parse(&raw)?)
    }

    /// Whether a release is a force release: `force=true` in the query string ends every lease
    /// on the key without a token. Only `true` is a value (leave it out otherwise); never in the
    /// body, since the auth layer decides from the query string alone who may send it; and a
    /// force release takes no token, so one given with it is refused as a mistake.
    pub fn force(&mut self) -> Result<bool, ApiError> {
        if self.body.contains_key("force") {
            return Err(ApiError::invalid(
                "Send force=true in the query string, not in the body.",
            ));
        }
        match self.take_query("force")?.as_deref() {
            None => Ok(false),
            Some("true") => {
                if self.token_header.is_some()
                    || self.query.iter().any(|(name, _)| name == "token")
                    || self.body.contains_key("token")
                {
                    return Err(ApiError::invalid(
                        "A force release takes no token: it ends every lease on the key; leave \
                         out either the token or force=true.",
                    ));
                }
                Ok(true)
            }
            Some(_) => Err(ApiError::invalid(
                "force must be true (or left out for a release by token).",
            )),
        }
    }

    /// Refuses any parameter no handler took.
    pub fn finish(self) -> Result<(), ApiError> {
        let mut unknown: Vec<&str> = self
            .query
            .iter()
            .map(|(k, _)| k.as_str())
            .chain(self.body.keys().map(String::as_str))
            .collect();
        unknown.sort_unstable();
        unknown.dedup();
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(ApiError::invalid(format!(
                "Unknown parameter(s): {}.",
                unknown.join(", ")
            )))
        }
    }
}

fn same_in_both<T: PartialEq>(
    name: &str,
    a: Option<T>,
    b: Option<T>,
) -> Result<Option<T>, ApiError> {
    match (a, b) {
        (Some(a), Some(b)) if a != b => Err(ApiError::invalid(format!(
            "{name} is given twice with different values."
        ))),
        (a, b) => Ok(a.or(b)),
    }
}
