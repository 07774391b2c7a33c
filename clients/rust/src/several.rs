//! Several keys at once: [`Client::acquire_all`] takes every key or none, as one [`Lease`]
//! with one token (a fence per key), and [`Client::release_all`] lets several go in one
//! request. The lease is kept as any other ([`crate::lease`]), key by key.

use std::time::Duration;

use reqwest::StatusCode;
use serde::{Deserialize, Serialize};

use crate::acquire::retrying;
use crate::client::{Client, GrantBody, REQUEST_TIMEOUT};
use crate::error::Error;
use crate::lease::{Lease, LeaseOptions, Released};
use crate::request::expect_json;
use crate::types::{AcquireParams, Resource, Space, Token};

/// A grant of several keys, as `POST /locks` answers it: one token for all, a fence per key in
/// the order asked, and `expires_at_ms` the earliest of the leases' ends. `Debug` hides the
/// token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeveralGrant {
    pub token: Token,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    pub leases: Vec<KeyFence>,
}

/// One key of a [`SeveralGrant`] and its fence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyFence {
    pub key: String,
    pub fence: u64,
}

/// What `DELETE /locks?keys=` answered for one key: the status its own `DELETE` would have
/// (`204` released, `404`/`409` not held by this token, `503` not told).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyReleased {
    pub key: String,
    pub status: u16,
}

impl Client {
    /// An exclusive lease on every one of `keys` (1 to 64 distinct keys) for `ttl`, or on none:
    /// the broker waits up to `wait` until all are free at once, and two callers asking for the
    /// same keys in opposite orders both get them in turn. [`Error::Locked`] with the busy keys
    /// in `held` when the wait ran out; retried as [`Client::acquire`] is, with one request id
    /// (a retry gets the same leases back). The lease renews every key with its one token; the
    /// loss of any key is the loss of the lease, and the rest are released.
    pub async fn acquire_all<S: AsRef<str>>(
        &self,
        keys: &[S],
        ttl: Duration,
        wait: Duration,
    ) -> Result<Lease, Error> {
        self.acquire_all_with(keys, LeaseOptions::new(ttl).wait(wait))
            .await
    }

    /// [`Client::acquire_all`] with an owner, a renewal interval or a trouble hook.
    pub async fn acquire_all_with<S: AsRef<str>>(
        &self,
        keys: &[S],
        options: LeaseOptions,
    ) -> Result<Lease, Error> {
        let params = AcquireParams {
            ttl: Some(options.ttl),
            owner: options.owner.clone(),
            ..AcquireParams::default()
        };
        let (grant, first_sent) = self.grant_all_retrying(keys, params, options.wait).await?;
        Ok(Lease::hold_all(self.clone(), &grant, first_sent, options))
    }

    /// [`Client::grant_all`] with a new request id, asked again within `wait`; the grant and
    /// when the first attempt was sent.
    pub(crate) async fn grant_all_retrying<S: AsRef<str>>(
        &self,
        keys: &[S],
        params: AcquireParams,
        wait: Duration,
    ) -> Result<(SeveralGrant, tokio::time::Instant), Error> {
        retrying(params, wait, |params| async move {
            self.grant_all(keys, &params).await
        })
        .await
    }

    /// `POST /locks` with `{"keys": [...]}`: one request, no retry; every key or
    /// [`Error::Locked`] naming the busy ones. [`Client::acquire_all`] is the retrying,
    /// renewing form.
    pub async fn grant_all<S: AsRef<str>>(
        &self,
        keys: &[S],
        params: &AcquireParams,
    ) -> Result<SeveralGrant, Error> {
        let mut body = GrantBody::new(params);
        body.keys = Some(keys.iter().map(AsRef::as_ref).collect());
        let request = self
            .http
            .post(format!("{}/{}", self.base, Space::Locks.path()))
            .json(&body)
            .timeout(params.wait.unwrap_or_default() + REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        expect_json(response, StatusCode::CREATED, Space::Locks).await
    }

    /// `DELETE /locks?keys=k1,k2,…` with `token` in `Lock-Token`: releases the listed keys in
    /// one request; what each key's own `DELETE` would have answered.
    pub async fn release_all<S: AsRef<str>>(
        &self,
        keys: &[S],
        token: &Token,
    ) -> Result<Vec<KeyReleased>, Error> {
        #[derive(Deserialize)]
        struct Results {
            results: Vec<KeyReleased>,
        }
        let keys: Vec<&str> = keys.iter().map(AsRef::as_ref).collect();
        let request = self
            .http
            .delete(format!("{}/{}", self.base, Space::Locks.path()))
            .query(&[("keys", keys.join(","))])
            .header("Lock-Token", token.as_str())
            .timeout(REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        let answer: Results = expect_json(response, StatusCode::OK, Space::Locks).await?;
        Ok(answer.results)
    }
}

impl Client {
    /// Renews each of `keys` with `token`, in turn. A key whose renewal is refused (an answer
    /// that asking again would not change) is lost, and so the whole lease: every key is
    /// released before the refusal is returned, so the rest are free before the loss is told.
    pub(crate) async fn renew_every_key(
        &self,
        keys: &[(String, u64)],
        token: &Token,
        ttl: Duration,
    ) -> Result<(), Error> {
        for (key, _) in keys {
            if let Err(e) = self.renew(&Resource::lock(key), token, Some(ttl)).await {
                if !e.is_transient() && !e.is_server_error() {
                    let keys: Vec<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
                    let _ = self.release_all(&keys, token).await;
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

/// What releasing a lease of several keys did: [`Released::Now`] if the broker let any key go
/// now, [`Released::Gone`] if it held none of them any more, an error naming the keys it could
/// not be told about (a `503`: those end by their ttl).
pub(crate) fn released_all(results: Vec<KeyReleased>) -> Result<Released, Error> {
    let untold: Vec<&KeyReleased> = results
        .iter()
        .filter(|r| ![204, 404, 409].contains(&r.status))
        .collect();
    if let Some(first) = untold.first() {
        let keys: Vec<&str> = untold.iter().map(|r| r.key.as_str()).collect();
        return Err(Error::Api {
            status: StatusCode::from_u16(first.status).unwrap_or(StatusCode::BAD_GATEWAY),
            code: "not_released".into(),
            message: format!("{} not released; they end by their ttl", keys.join(", ")),
            retry_after: None,
            url: format!("DELETE /locks?keys={}", keys.join(",")),
        });
    }
    if results.iter().any(|r| r.status == 204) {
        Ok(Released::Now)
    } else {
        Ok(Released::Gone(Error::NotHeld {
            space: Space::Locks,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(statuses: &[(&str, u16)]) -> Vec<KeyReleased> {
        let released = |&(key, status): &(&str, u16)| KeyReleased {
            key: key.into(),
            status,
        };
        statuses.iter().map(released).collect()
    }

    #[test]
    fn a_release_of_several_keys_says_now_gone_or_which_keys_were_not_told() {
        let now = released_all(answered(&[("a", 204), ("b", 404)]));
        assert!(matches!(now, Ok(Released::Now)), "{now:?}");
        let gone = released_all(answered(&[("a", 409), ("b", 404)]));
        assert!(matches!(gone, Ok(Released::Gone(_))), "{gone:?}");
        let untold = released_all(answered(&[("a", 204), ("b", 503), ("c", 503)])).unwrap_err();
        assert!(untold.is_transient(), "{untold}");
        assert!(untold.to_string().contains("b, c not released"), "{untold}");
    }

    #[test]
    fn a_busy_answer_names_the_busy_keys() {
        let text = r#"{"error":"locked","message":"m","held":["b","c"],"retry_after_ms":1500}"#;
        let e = crate::error::error_from_text(
            StatusCode::CONFLICT,
            None,
            text,
            Space::Locks,
            "http://h:1/locks".into(),
        );
        match &e {
            Error::Locked { held, .. } => assert_eq!(held, &["b", "c"]),
            other => panic!("expected locked, got {other:?}"),
        }
        assert_eq!(
            e.to_string(),
            "held by someone else: b, c (none of the keys was taken); its lease ends in 1s 500ms"
        );
    }
}
