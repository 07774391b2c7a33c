//! Extractors that turn a request into domain values, with every rejection in the API's error
//! format: the lock key from the path, and parameters from the query string and a JSON body.

use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::header;
use axum::http::request::Parts;
use serde_json::{Map, Value};
use utoipa::IntoParams;

use super::error::ApiError;
use super::requests::{LOCK_TOKEN_HEADER, Parameters};
use crate::domain::{LockKey, Token};

/// Request bodies are small JSON objects; anything larger is refused.
pub(crate) const BODY_LIMIT: usize = 16 * 1024;

/// The `{key}` path segment, percent-decoded and validated: the lock's name.
#[derive(IntoParams)]
#[into_params(names("key"), parameter_in = Path)]
pub(crate) struct KeyPath(
    /// 1 to 200 characters from `A-Z a-z 0-9 . _ - :`, compared after percent-decoding
    /// (`%41` is `A`; an escape that decodes to any other character, such as `%2F`, is `400`).
    #[param(
        value_type = String,
        min_length = 1,
        max_length = 200,
        pattern = r"^[A-Za-z0-9._:-]{1,200}$"
    )]
    pub LockKey,
);

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

/// A request's parameters `T`, from the query string and the JSON body together, and the
/// `Lock-Token` header. A parameter may come in either; in both, only with the same value. A
/// name `T` does not know, or a value it does not take, is refused with the name in the message.
pub(crate) struct Params<T> {
    /// The parameters.
    pub values: T,
    /// The `Lock-Token` header, if sent.
    pub token_header: Option<TokenHeader>,
}

/// The lease token, in a header (preferred: query strings end up in access logs).
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
pub(crate) struct TokenHeader {
    /// The token the acquire returned. Required here or in the `token` query parameter (if
    /// both, they must be equal); never in the body.
    #[param(
        rename = "Lock-Token",
        required = false,
        min_length = 1,
        max_length = 128,
        pattern = r"^[A-Za-z0-9._~-]{1,128}$"
    )]
    pub lock_token: String,
}

impl<S: Send + Sync, T: Parameters> FromRequest<S> for Params<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let query = req.uri().query().unwrap_or("").to_owned();
        let token_header = match req.headers().get(LOCK_TOKEN_HEADER) {
            None => None,
            Some(v) => Some(TokenHeader {
                lock_token: v
                    .to_str()
                    .map_err(|_| ApiError::invalid("The Lock-Token header is not a valid token."))?
                    .to_owned(),
            }),
        };
        let is_json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_json_content_type);
        // Read up to the limit here rather than through axum's `DefaultBodyLimit` layer, which
        // would store the limit in every request's extensions.
        let bytes = axum::body::to_bytes(req.into_body(), BODY_LIMIT)
            .await
            .map_err(|e| {
                if e.into_inner().is::<http_body_util::LengthLimitError>() {
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
            values: parse(&query, body)?,
            token_header,
        })
    }
}

/// `T` from the query string and the body's names, merged.
fn parse<T: Parameters>(query: &str, body: Map<String, Value>) -> Result<T, ApiError> {
    if let Some((_, why)) = T::QUERY_ONLY
        .iter()
        .find(|(name, _)| body.contains_key(*name))
    {
        return Err(ApiError::invalid(*why));
    }
    let from_query = from_query::<T>(query)?;
    if body.is_empty() {
        return Ok(from_query);
    }
    let from_body = from_body::<T>(body)?;
    if query.is_empty() {
        return Ok(from_body);
    }
    // Both: compare name by name, as JSON values of the same type.
    let (Ok(Value::Object(mut merged)), Ok(Value::Object(other))) = (
        serde_json::to_value(&from_query),
        serde_json::to_value(&from_body),
    ) else {
        unreachable!("a request's parameters serialize to a JSON object")
    };
    for (name, value) in other {
        match merged.get(&name) {
            Some(given) if *given != value => {
                return Err(ApiError::invalid(format!(
                    "{name} is given twice with different values."
                )));
            }
            _ => {
                merged.insert(name, value);
            }
        }
    }
    T::deserialize(Value::Object(merged))
        .map_err(|e| ApiError::invalid(format!("The parameters are refused: {e}.")))
}

/// `T` from the query string. A name given twice must have the same value each time.
fn from_query<T: Parameters>(query: &str) -> Result<T, ApiError> {
    // The usual query (a few names, each once, none encoded) is read once, straight into `T`;
    // any other, or one `T` refuses, goes the long way below, which finds the name to blame.
    if names_plainly_distinct(query)
        && let Ok(values) = serde_urlencoded::from_str::<T>(query)
    {
        return Ok(values);
    }
    let malformed = || ApiError::invalid("The query string is malformed.");
    let pairs: Vec<(String, String)> =
        serde_urlencoded::from_str(query).map_err(|_| malformed())?;
    let mut unique: Vec<(String, String)> = Vec::with_capacity(pairs.len());
    let mut repeated = false;
    for (name, value) in pairs {
        match unique.iter().find(|(n, _)| *n == name) {
            Some((_, v)) if *v != value => {
                return Err(ApiError::invalid(format!(
                    "{name} is given twice in the query string with different values."
                )));
            }
            Some(_) => repeated = true,
            None => unique.push((name, value)),
        }
    }
    let deduplicated;
    let query = if !repeated {
        query
    } else {
        deduplicated = serde_urlencoded::to_string(&unique).map_err(|_| malformed())?;
        &deduplicated
    };
    serde_urlencoded::from_str::<T>(query).map_err(|_| {
        // Which one: each name alone (only on this error path).
        let culprit = unique.iter().find_map(|pair| {
            let one = serde_urlencoded::to_string([pair]).ok()?;
            serde_urlencoded::from_str::<T>(&one)
                .err()
                .map(|e| (pair.0.as_str(), e.to_string()))
        });
        refused(culprit)
    })
}

/// Whether the query's names are all different as written, and none is percent- or
/// plus-encoded (so decoding cannot make two of them equal). Up to [`PLAIN_NAMES`] names.
fn names_plainly_distinct(query: &str) -> bool {
    let mut seen: [&str; PLAIN_NAMES] = [""; PLAIN_NAMES];
    // As the form decoder does: empty pieces are skipped, a piece without `=` is a name.
    for (count, piece) in query.split('&').filter(|p| !p.is_empty()).enumerate() {
        let name = piece.split_once('=').map_or(piece, |(name, _)| name);
        if count == PLAIN_NAMES || name.contains(['%', '+']) || seen[..count].contains(&name) {
            return false;
        }
        seen[count] = name;
    }
    true
}

/// The most names [`names_plainly_distinct`] looks at: more than any request takes.
const PLAIN_NAMES: usize = 8;

/// `T` from a JSON body's names.
fn from_body<T: Parameters>(body: Map<String, Value>) -> Result<T, ApiError> {
    let body = Value::Object(body);
    T::deserialize(&body).map_err(|_| {
        // Which one: each name alone (only on this error path).
        let culprit = body
            .as_object()
            .into_iter()
            .flatten()
            .find_map(|(name, value)| {
                let one = Value::Object(Map::from_iter([(name.clone(), value.clone())]));
                T::deserialize(&one)
                    .err()
                    .map(|e| (name.as_str(), e.to_string()))
            });
        refused(culprit)
    })
}

/// The refusal of one parameter, by its name and serde's reason.
fn refused(culprit: Option<(&str, String)>) -> ApiError {
    match culprit {
        Some((name, e)) if e.starts_with("unknown field") => {
            ApiError::invalid(format!("Unknown parameter: {name}."))
        }
        Some((name, e)) => ApiError::invalid(format!("{name} {e}.")),
        None => ApiError::invalid("The parameters are refused."),
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

/// The lease token: the `Lock-Token` header or the `token` query parameter (equal if both).
pub(crate) fn token(header: Option<TokenHeader>, query: Option<String>) -> Result<Token, ApiError> {
    let raw = match (header.map(|h| h.lock_token), query) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::invalid(
                "token is given twice with different values.",
            ));
        }
        (a, b) => a.or(b).ok_or_else(|| {
            ApiError::invalid(
                "A token is required, in the Lock-Token header or the token query parameter.",
            )
        })?,
    };
    Ok(Token::parse(&raw)?)
}

#[cfg(test)]
mod tests;
