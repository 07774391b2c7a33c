//! The request plumbing under [`Client`]'s calls: where a request goes (a key's URL), sending
//! it (a failed connection as [`Error::Transport`]), and reading the answer (the expected
//! status's JSON body, or the broker's error).

use reqwest::StatusCode;

use crate::client::{Client, REQUEST_TIMEOUT};
use crate::error::{Error, asked, error_chain, error_from, excerpt};
use crate::types::{Page, Resource, Space};

impl Client {
    /// `{base}/{space}/{key}`, the key percent-encoded as one path segment (a valid key needs
    /// no encoding; an invalid one reaches the broker intact and is refused with `400`). An
    /// empty key is refused here: it would name the space's listing, not a key.
    pub(crate) fn resource_url(&self, resource: &Resource) -> Result<String, Error> {
        if resource.key.is_empty() {
            return Err(Error::Invalid(
                match resource.space {
                    Space::Locks => "a key is required: an empty key names no lock",
                    Space::Semaphores => "a name is required: an empty name names no semaphore",
                }
                .to_owned(),
            ));
        }
        let mut url = reqwest::Url::parse(&self.base).expect("checked by Client::builder");
        url.path_segments_mut()
            .expect("an http(s) URL has a path")
            .pop_if_empty()
            .push(resource.space.path())
            .push(&resource.key);
        Ok(url.into())
    }

    /// `GET` one key's view: [`Error::NotHeld`] when nobody holds it.
    pub(crate) async fn read<T: serde::de::DeserializeOwned>(
        &self,
        resource: &Resource,
    ) -> Result<T, Error> {
        let request = self
            .http
            .get(self.resource_url(resource)?)
            .timeout(REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        expect_json(response, StatusCode::OK, resource.space).await
    }

    /// `GET /{space}?prefix=&limit=&cursor=`: one page of the space's held keys.
    pub(crate) async fn list<T: serde::de::DeserializeOwned>(
        &self,
        space: Space,
        prefix: &str,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<Page<T>, Error> {
        let mut query = vec![("limit", limit.to_string())];
        if !prefix.is_empty() {
            query.push(("prefix", prefix.to_owned()));
        }
        if let Some(cursor) = cursor {
            query.push(("cursor", cursor.to_owned()));
        }
        let request = self
            .http
            .get(format!("{}/{}", self.base, space.path()))
            .query(&query)
            .timeout(REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        expect_json(response, StatusCode::OK, space).await
    }

    /// Sends `request`; a failed connection (or a timeout) is [`Error::Transport`].
    pub(crate) async fn send(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, Error> {
        request.send().await.map_err(|e| Error::Transport {
            url: e.url().map_or_else(|| self.base.clone(), asked),
            // The URL is said once, in `url`.
            reason: error_chain(&e.without_url()),
        })
    }
}

/// Reads a success body of type `T` if the status is `expected`, the error otherwise.
pub(crate) async fn expect_json<T: serde::de::DeserializeOwned>(
    response: reqwest::Response,
    expected: StatusCode,
    space: Space,
) -> Result<T, Error> {
    if response.status() != expected {
        return Err(error_from(response, space).await);
    }
    let url = asked(response.url());
    let text = response.text().await.map_err(|e| Error::BadResponse {
        url: url.clone(),
        reason: error_chain(&e.without_url()),
    })?;
    serde_json::from_str(&text).map_err(|e| Error::BadResponse {
        url,
        reason: format!("{e} in {}", excerpt(&text)),
    })
}

/// `Ok` for `204 No Content`, the error otherwise.
pub(crate) async fn expect_no_content(
    response: reqwest::Response,
    space: Space,
) -> Result<(), Error> {
    if response.status() == StatusCode::NO_CONTENT {
        Ok(())
    } else {
        Err(error_from(response, space).await)
    }
}
