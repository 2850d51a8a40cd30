//! What a webhook is sent: the event as JSON or as a chat message, cut to
//! the webhook's share of the output tail, and its HMAC-SHA256 signature.

use hmac::{KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::config::{Webhook, WebhookFormat};

/// One event of one run, as kept in the spool and rendered for each
/// webhook (docs/configuration.md, "Webhooks").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// `JOB-FENCE-EVENT`: the same on every retry, so a receiver can drop a
    /// second delivery of one event.
    pub delivery: String,
    pub event: String,
    pub job: String,
    /// RFC 3339, UTC.
    pub occurrence: String,
    pub outcome: String,
    pub exit_code: Option<i32>,
    pub node: String,
    pub fence: u64,
    pub started_at: String,
    pub finished_at: String,
    pub duration_ms: i64,
    /// A manual run's request id (as `CRONLEASE_TRIGGER` says it).
    pub trigger: Option<String>,
    /// Which try of the occurrence the run was (`retry`; as
    /// `CRONLEASE_ATTEMPT` says it): 1 for the first. Events spooled by an
    /// earlier version have none: 1.
    #[serde(default = "first_attempt")]
    pub attempt: u32,
    /// The run's output tail, as history keeps it (passwords removed).
    pub output_tail: String,
    /// `http.public_url`, when set.
    pub dashboard: Option<String>,
}

fn first_attempt() -> u32 {
    1
}

/// The last `max` bytes of `text`, cut at a character boundary.
fn last_bytes(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// The body `hook` is sent for `event`.
pub fn render(event: &Event, hook: &Webhook) -> Vec<u8> {
    let tail = last_bytes(&event.output_tail, hook.output_tail);
    match hook.format {
        WebhookFormat::Json => {
            let mut e = event.clone();
            e.output_tail = tail.to_string();
            serde_json::to_vec(&e).unwrap_or_default()
        }
        WebhookFormat::Slack => {
            let mut text = format!(
                "cronlease: job `{}` {} on {} (occurrence {}, fence {}, {} ms",
                event.job,
                match event.event.as_str() {
                    "succeeded" => "succeeded".to_string(),
                    "recovered" => "recovered: ok after a failure".to_string(),
                    other => format!("ended {other}"),
                },
                event.node,
                event.occurrence,
                event.fence,
                event.duration_ms,
            );
            if let Some(code) = event.exit_code {
                text.push_str(&format!(", exit code {code}"));
            }
            if event.attempt > 1 {
                text.push_str(&format!(", attempt {}", event.attempt));
            }
            text.push(')');
            if let Some(url) = &event.dashboard {
                text.push_str(&format!(" <{url}|dashboard>"));
            }
            if !tail.trim().is_empty() {
                // A fence of backticks in the output would end the block.
                text.push_str(&format!("\n```\n{}\n```", tail.replace("```", "'''")));
            }
            serde_json::to_vec(&serde_json::json!({ "text": text })).unwrap_or_default()
        }
    }
}

/// The `X-Cronlease-Signature` header's value for `body` sent at `unix`
/// seconds: `t=UNIX,v1=HEX`, HEX the HMAC-SHA256 of `UNIX.BODY` under
/// `secret` (the timestamp is signed, so a captured request cannot be
/// replayed later as new).
pub fn signature(secret: &[u8], unix: i64, body: &[u8]) -> String {
    let mut mac = match <hmac::Hmac<Sha256> as KeyInit>::new_from_slice(secret) {
        Ok(m) => m,
        // HMAC takes a key of any length; this arm is not reached.
        Err(_) => return String::new(),
    };
    mac.update(unix.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let sum = mac.finalize().into_bytes();
    format!("t={unix},v1={}", crate::config::hex(&sum))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_hmac_sha256_of_the_timestamp_dot_body() {
        // Python: hmac.new(b"Jefe", b'1700000000.{"a":1}', hashlib.sha256).hexdigest()
        assert_eq!(
            signature(b"Jefe", 1_700_000_000, br#"{"a":1}"#),
            "t=1700000000,v1=fa5f6481efc59da48b19c9dc10196c9953e5651f8304b3a318b6b87d70272e0a"
        );
    }

    #[test]
    fn a_tail_is_cut_at_a_character_boundary() {
        // h é(2 bytes) l l o: the 4 last bytes would split é.
        assert_eq!(last_bytes("héllo", 4), "llo");
        assert_eq!(last_bytes("héllo", 5), "éllo");
        assert_eq!(last_bytes("héllo", 6), "héllo");
        assert_eq!(last_bytes("ab", 0), "");
    }
}
