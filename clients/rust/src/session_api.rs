//! The session calls, one request each — what `lockbroker session` uses; the [`Session`] guard
//! is built on them. A session's id is a secret like a lease token: it goes in the path, so
//! every error these calls return names the URL with `…` in its place.
//!
//! [`Session`]: crate::Session

use std::time::Duration;

use reqwest::StatusCode;
use serde::Serialize;

use crate::client::{Client, REQUEST_TIMEOUT};
use crate::error::Error;
use crate::request::{expect_json, expect_no_content};
use crate::types::{SessionGrant, SessionKept, SessionParams, SessionStatus, Space, Token, millis};

impl Client {
    /// `POST /sessions`: one request, no retry ([`Client::open_session`] is the retrying,
    /// keeping one).
    pub async fn create_session(&self, params: &SessionParams) -> Result<SessionGrant, Error> {
        #[derive(Serialize)]
        struct Body<'a> {
            #[serde(skip_serializing_if = "Option::is_none")]
            ttl_ms: Option<u64>,
            #[serde(skip_serializing_if = "Option::is_none")]
            lock_delay_ms: Option<u64>,
            #[serde(skip_serializing_if = "Option::is_none")]
            owner: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            request_id: Option<&'a str>,
        }
        let body = Body {
            ttl_ms: params.ttl.map(millis),
            lock_delay_ms: params.lock_delay.map(millis),
            owner: params.owner.as_deref(),
            request_id: params.request_id.as_deref(),
        };
        let request = self
            .http
            .post(format!("{}/sessions", self.base))
            .json(&body)
            .timeout(REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        expect_json(response, StatusCode::CREATED, Space::Locks).await
    }

    /// `POST /sessions/{id}/renew`, the keep-alive: the session then ends `ttl` from now (its
    /// own ttl when `None`; a `ttl` given becomes its length). [`Error::SessionEnded`] when it
    /// had ended.
    pub async fn keep_alive(
        &self,
        session: &Token,
        ttl: Option<Duration>,
    ) -> Result<SessionKept, Error> {
        let mut request = self
            .http
            .post(self.session_url(session, Some("renew")))
            .timeout(REQUEST_TIMEOUT);
        if let Some(ttl) = ttl {
            request = request.json(&serde_json::json!({ "ttl_ms": millis(ttl) }));
        }
        let answered = match self.send(request).await {
            Ok(response) => expect_json(response, StatusCode::OK, Space::Locks).await,
            Err(e) => Err(e),
        };
        answered.map_err(|e| unnamed(e, session))
    }

    /// `DELETE /sessions/{id}`: ends the session and releases every lease under it at once.
    /// [`Error::SessionEnded`] when it had ended already.
    pub async fn close_session(&self, session: &Token) -> Result<(), Error> {
        let request = self
            .http
            .delete(self.session_url(session, None))
            .timeout(REQUEST_TIMEOUT);
        let answered = match self.send(request).await {
            Ok(response) => expect_no_content(response, Space::Locks).await,
            Err(e) => Err(e),
        };
        answered.map_err(|e| unnamed(e, session))
    }

    /// `GET /sessions/{id}`: its label, length, end, lock delay and live leases.
    /// [`Error::SessionEnded`] when it has ended.
    pub async fn session(&self, session: &Token) -> Result<SessionStatus, Error> {
        let request = self
            .http
            .get(self.session_url(session, None))
            .timeout(REQUEST_TIMEOUT);
        let answered = match self.send(request).await {
            Ok(response) => expect_json(response, StatusCode::OK, Space::Locks).await,
            Err(e) => Err(e),
        };
        answered.map_err(|e| unnamed(e, session))
    }

    /// `{base}/sessions/{id}` (and `/{tail}`), the id percent-encoded as one path segment.
    fn session_url(&self, session: &Token, tail: Option<&str>) -> String {
        let mut url = reqwest::Url::parse(&self.base).expect("checked by Client::builder");
        {
            let mut path = url.path_segments_mut().expect("an http(s) URL has a path");
            path.pop_if_empty().push("sessions").push(session.as_str());
            if let Some(tail) = tail {
                path.push(tail);
            }
        }
        url.into()
    }
}

/// A session call's error: the session's `not_held` as [`Error::SessionEnded`], and the id
/// replaced by `…` wherever the error names the URL.
fn unnamed(e: Error, session: &Token) -> Error {
    let hide = |text: String| text.replace(session.as_str(), "…");
    match e {
        Error::NotHeld { .. } => Error::SessionEnded { code: "not_held" },
        Error::Transport { url, reason } => Error::Transport {
            url: hide(url),
            reason: hide(reason),
        },
        Error::BadResponse { url, reason } => Error::BadResponse {
            url: hide(url),
            reason: hide(reason),
        },
        Error::Api {
            status,
            code,
            message,
            retry_after,
            url,
        } => Error::Api {
            status,
            code,
            message,
            retry_after,
            url: hide(url),
        },
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_call_never_names_the_id() {
        let client = Client::new("http://h:1/base/").unwrap();
        let id = Token::new("s3cr3t-session-id");
        assert_eq!(
            client.session_url(&id, Some("renew")),
            "http://h:1/base/sessions/s3cr3t-session-id/renew"
        );
        let unreachable = unnamed(
            Error::Transport {
                url: client.session_url(&id, Some("renew")),
                reason: "connection refused".into(),
            },
            &id,
        );
        assert!(
            !unreachable.to_string().contains(id.as_str()),
            "{unreachable}"
        );
        assert!(unreachable.is_transient());
        let ended = unnamed(
            Error::NotHeld {
                space: Space::Locks,
            },
            &id,
        );
        assert!(matches!(ended, Error::SessionEnded { code: "not_held" }));
        assert!(ended.is_gone() && !ended.is_transient());
        let grant: SessionGrant = serde_json::from_str(
            r#"{"session":"s3cr3t-session-id","ttl_ms":1,"expires_at_ms":2,"owner":null,
                "lock_delay_ms":0}"#,
        )
        .unwrap();
        assert!(!format!("{grant:?}").contains(id.as_str()));
    }
}
