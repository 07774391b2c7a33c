//! The uncontended phase's client on a plain `http://` broker: one hyper HTTP/1.1 connection
//! per client, with no pool, no URL parsing and no redirect or cookie handling per request. On a
//! machine whose cores the load generator shares with the broker and Redis, every microsecond
//! the client spends is one the broker does not get; this client spends about as little per
//! request as the raw phase's Redis client does per command, so the two are compared on equal
//! terms. HTTPS, HTTP/2 and the other phases use the general client (`reqwest`).

use anyhow::{Context, bail};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{AUTHORIZATION, HOST, HeaderValue};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// The part of a grant's JSON the bench reads (every HTTP phase, the lean client's and
/// reqwest's alike): the broker's grants carry a fence, the minimal proxy's do not.
#[derive(serde::Deserialize)]
pub(super) struct Granted {
    pub(super) token: String,
    pub(super) fence: Option<u64>,
}

/// One kept-alive connection to the broker.
pub(super) struct LeanClient {
    sender: SendRequest<Empty<Bytes>>,
    host: HeaderValue,
    auth: Option<HeaderValue>,
}

/// `host:port` of a plain `http://` base URL; `None` for anything else (HTTPS).
pub(super) fn plain_authority(base: &str) -> Option<&str> {
    let rest = base.strip_prefix("http://")?;
    Some(rest.split('/').next().unwrap_or(rest))
}

impl LeanClient {
    pub(super) async fn connect(authority: &str, auth_token: Option<&str>) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(authority)
            .await
            .with_context(|| format!("cannot connect to {authority}"))?;
        stream.set_nodelay(true)?;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        // Ends when the sender is dropped, or the broker closes the connection.
        tokio::spawn(connection);
        let auth = auth_token
            .map(|t| HeaderValue::from_str(&format!("Bearer {t}")))
            .transpose()
            .context("--auth-token must be printable ASCII")?;
        Ok(Self {
            sender,
            host: HeaderValue::from_str(authority)?,
            auth,
        })
    }

    pub(super) async fn send(
        &mut self,
        method: Method,
        path: &str,
        token: Option<&str>,
    ) -> anyhow::Result<(StatusCode, Bytes)> {
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, self.host.clone());
        if let Some(auth) = &self.auth {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        if let Some(token) = token {
            request = request.header("lock-token", token);
        }
        self.sender.ready().await?;
        let response = self
            .sender
            .send_request(request.body(Empty::new())?)
            .await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }

    /// Acquires at `path_and_query` and releases at `path`: one lock cycle.
    pub(super) async fn cycle(&mut self, path: &str, path_and_query: &str) -> anyhow::Result<()> {
        let token = self.acquire(path_and_query).await?;
        self.release(path, &token).await
    }

    /// Acquires at `path_and_query`; returns the lease's token.
    pub(super) async fn acquire(&mut self, path_and_query: &str) -> anyhow::Result<String> {
        let (status, body) = self.send(Method::POST, path_and_query, None).await?;
        if status != StatusCode::CREATED {
            bail!("acquire answered {status}");
        }
        let granted: Granted = serde_json::from_slice(&body)?;
        Ok(granted.token)
    }

    /// Releases the lease `token` holds at `path`.
    pub(super) async fn release(&mut self, path: &str, token: &str) -> anyhow::Result<()> {
        let (status, _) = self.send(Method::DELETE, path, Some(token)).await?;
        if status != StatusCode::NO_CONTENT {
            bail!("release answered {status}");
        }
        Ok(())
    }
}
