//! `[[notify]]`: the webhooks a run's events are posted to ([`crate::webhook`]),
//! validated: a name, an http(s) URL, the events and jobs it wants, the
//! HMAC secret's file, the body's format, a time-out.

use super::*;

/// The events a webhook can ask for: a run's outcome, or `recovered` (the
/// first `ok` run after a failed one).
pub const WEBHOOK_EVENTS: &[&str] = &[
    "succeeded",
    "failed",
    "timeout",
    "not_started",
    "lease_lost",
    "killed",
    "missed",
    "recovered",
];

/// What a webhook gets unless `events` says otherwise: every event but
/// `succeeded` (each failure and the recovery from it).
pub fn default_webhook_events() -> Vec<String> {
    WEBHOOK_EVENTS
        .iter()
        .filter(|e| **e != "succeeded")
        .map(|e| e.to_string())
        .collect()
}

/// A webhook's time-out for one delivery unless `timeout` says otherwise.
pub const DEFAULT_WEBHOOK_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest `timeout` a webhook takes.
pub const MAX_WEBHOOK_TIMEOUT: Duration = Duration::from_secs(60);
/// How much of a run's output tail a webhook's body carries unless
/// `output_tail` says otherwise.
pub const DEFAULT_WEBHOOK_TAIL: usize = 2048;

/// The body a webhook is sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WebhookFormat {
    /// The event as a JSON object (docs/configuration.md, "Webhooks").
    #[default]
    Json,
    /// `{"text": "..."}`: what Slack's, Mattermost's and Rocket.Chat's
    /// incoming webhooks take.
    Slack,
}

/// The HMAC key of a webhook, from its `secret_file`; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret(Vec<u8>);

impl WebhookSecret {
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WebhookSecret(***)")
    }
}

/// One validated `[[notify]]` table. Its `Debug` shows the URL's scheme
/// and host only (a chat webhook's path is its token).
#[derive(Clone, PartialEq, Eq)]
pub struct Webhook {
    /// `name`, or `notify-N` for the N-th table: what the log, the
    /// metrics and the spool call it (the URL may hold a token).
    pub name: String,
    pub url: url::Url,
    /// Sorted, each one of [`WEBHOOK_EVENTS`].
    pub events: Vec<String>,
    /// Only these jobs' events (`None`: every job's).
    pub jobs: Option<Vec<String>>,
    pub secret: Option<WebhookSecret>,
    pub format: WebhookFormat,
    pub timeout: Duration,
    /// At most this many bytes of the run's output tail go in the body.
    pub output_tail: usize,
}

impl fmt::Debug for Webhook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Webhook")
            .field("name", &self.name)
            .field("url", &self.host())
            .field("events", &self.events)
            .field("jobs", &self.jobs)
            .field("secret", &self.secret)
            .field("format", &self.format)
            .field("timeout", &self.timeout)
            .field("output_tail", &self.output_tail)
            .finish()
    }
}

impl Webhook {
    /// Whether `job`'s `event` goes to this webhook.
    pub fn wants(&self, job: &str, event: &str) -> bool {
        // A broadcast job's shard (`JOB~NODE`) is the job's.
        let job = crate::metrics::Metrics::job_of(job);
        self.events.iter().any(|e| e == event)
            && self
                .jobs
                .as_ref()
                .is_none_or(|jobs| jobs.iter().any(|j| j == job))
    }

    /// The URL with its path, query and userinfo left out: what a log line
    /// may say of it (a chat webhook's path is its token).
    pub fn host(&self) -> String {
        format!(
            "{}://{}",
            self.url.scheme(),
            self.url.host_str().unwrap_or("?")
        )
    }
}

/// Every `[[notify]]` table, validated; names unique.
pub(super) fn webhooks(
    src: &Source,
    raw: &[raw::RawNotify],
    base: &Path,
    job_names: &[&str],
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<String>,
) -> Vec<Webhook> {
    let mut out: Vec<Webhook> = Vec::new();
    for (i, n) in raw.iter().enumerate() {
        let before = errors.len();
        let name = match &n.name {
            Some(v) => {
                let s = v.get_ref();
                if s.is_empty()
                    || s.len() > 64
                    || !s
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
                {
                    errors.push(src.at(
                        v,
                        format!("invalid notify name {s:?}: 1 to 64 of A-Z a-z 0-9 _ . -"),
                    ));
                } else if out.iter().any(|w| w.name == *s) {
                    errors.push(src.at(v, format!("a second notify table named {s:?}")));
                }
                s.clone()
            }
            None => format!("notify-{}", i + 1),
        };
        let url = match url::Url::parse(n.url.get_ref()) {
            Ok(u) if matches!(u.scheme(), "http" | "https") && u.host_str().is_some() => Some(u),
            // The URL itself is not repeated: its path may be a token.
            Ok(_) => {
                errors.push(src.at(
                    &n.url,
                    "notify url must be an http:// or https:// URL with a host",
                ));
                None
            }
            Err(e) => {
                errors.push(src.at(&n.url, format!("invalid notify url: {e}")));
                None
            }
        };
        let mut events: Vec<String> = match &n.events {
            None => default_webhook_events(),
            Some(list) => {
                if list.get_ref().is_empty() {
                    errors.push(src.at(list, "notify events is empty: name at least one event"));
                }
                list.get_ref()
                    .iter()
                    .filter_map(|e| {
                        if WEBHOOK_EVENTS.contains(&e.get_ref().as_str()) {
                            Some(e.get_ref().clone())
                        } else {
                            errors.push(src.at(
                                e,
                                format!(
                                    "unknown notify event {:?}: expected one of {}",
                                    e.get_ref(),
                                    WEBHOOK_EVENTS.join(", ")
                                ),
                            ));
                            None
                        }
                    })
                    .collect()
            }
        };
        events.sort();
        events.dedup();
        let jobs = n.jobs.as_ref().map(|list| {
            for j in list.get_ref() {
                if !job_names.contains(&j.get_ref().as_str()) {
                    warnings.push(format!(
                        "{}: notify {name:?} names job {:?}, which this node does not define",
                        src.origin,
                        j.get_ref()
                    ));
                }
            }
            list.get_ref().iter().map(|j| j.get_ref().clone()).collect()
        });
        let secret = n.secret_file.as_ref().and_then(|f| {
            let path = base.join(f.get_ref());
            super::job::warn_if_world_readable(&path, "is a webhook secret", warnings);
            match std::fs::read(&path) {
                Ok(mut bytes) => {
                    while bytes.last().is_some_and(|b| matches!(b, b'\n' | b'\r')) {
                        bytes.pop();
                    }
                    if bytes.is_empty() {
                        errors.push(src.at(f, format!("secret_file {} is empty", path.display())));
                        None
                    } else {
                        Some(WebhookSecret(bytes))
                    }
                }
                Err(e) => {
                    errors.push(src.at(
                        f,
                        format!("cannot read secret_file {}: {e}", path.display()),
                    ));
                    None
                }
            }
        });
        let timeout = bounded_duration_or(
            src,
            &n.timeout,
            "notify timeout",
            DEFAULT_WEBHOOK_TIMEOUT,
            MAX_WEBHOOK_TIMEOUT,
            errors,
        );
        let output_tail = match &n.output_tail {
            Some(v) => super::job::byte_size(src, v, "notify output_tail", MAX_OUTPUT_TAIL, errors)
                .unwrap_or(0),
            None => DEFAULT_WEBHOOK_TAIL,
        };
        if errors.len() > before {
            continue;
        }
        if let Some(url) = url {
            out.push(Webhook {
                name,
                url,
                events,
                jobs,
                secret,
                format: n.format.unwrap_or_default(),
                timeout,
                output_tail,
            });
        }
    }
    out
}
