//! The webhooks' HTTP client: reqwest with rustls, behind the `webhooks`
//! feature (a default one). A build without it still reads `[[notify]]`
//! tables but refuses to start with them ([`WebhookError::NotBuiltIn`]);
//! the fuzz targets are built so, without reqwest's compile.

use super::WebhookError;
use crate::config::Webhook;
use crate::webhook::Event;

/// One client for every webhook: its connections are reused.
pub struct Client {
    #[cfg(feature = "webhooks")]
    inner: reqwest::Client,
}

impl Client {
    /// Reads the system's trust roots from disk: call it off the runtime.
    #[cfg(feature = "webhooks")]
    pub fn new() -> Result<Client, WebhookError> {
        let inner = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("cronlease/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(std::time::Duration::from_secs(10))
            .build()
            .map_err(|e| WebhookError::Client(e.without_url().to_string()))?;
        Ok(Client { inner })
    }

    #[cfg(not(feature = "webhooks"))]
    pub fn new() -> Result<Client, WebhookError> {
        Err(WebhookError::NotBuiltIn)
    }

    /// POSTs `body` (JSON) to `hook` once, bounded by its `timeout`: the
    /// answer's status, or a network error in a few words without the URL.
    #[cfg(feature = "webhooks")]
    pub async fn post(
        &self,
        hook: &Webhook,
        event: &Event,
        signature: Option<String>,
        body: Vec<u8>,
    ) -> Result<u16, String> {
        let mut request = self
            .inner
            .post(hook.url.clone())
            .timeout(hook.timeout)
            .header("content-type", "application/json")
            .header("x-cronlease-event", event.event.as_str())
            .header("x-cronlease-delivery", event.delivery.as_str());
        if let Some(signature) = signature {
            request = request.header("x-cronlease-signature", signature);
        }
        match request.body(body).send().await {
            Ok(answer) => Ok(answer.status().as_u16()),
            Err(e) => Err(describe(e)),
        }
    }

    #[cfg(not(feature = "webhooks"))]
    pub async fn post(
        &self,
        _hook: &Webhook,
        _event: &Event,
        _signature: Option<String>,
        _body: Vec<u8>,
    ) -> Result<u16, String> {
        Err(WebhookError::NotBuiltIn.to_string())
    }
}

/// `503 Service Unavailable`: the code and, where known, its reason.
pub fn status_text(status: u16) -> String {
    #[cfg(feature = "webhooks")]
    if let Ok(s) = reqwest::StatusCode::from_u16(status) {
        return s.to_string();
    }
    status.to_string()
}

/// A send's error in a few words, without its URL.
#[cfg(feature = "webhooks")]
fn describe(e: reqwest::Error) -> String {
    let timeout = e.is_timeout();
    let e = e.without_url();
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    if timeout {
        text.push_str(" (timed out)");
    }
    text
}
