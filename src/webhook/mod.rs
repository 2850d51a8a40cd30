//! Webhooks (`[[notify]]`, docs/configuration.md "Webhooks"): the events
//! of the runs this node recorded, posted to each webhook that asks for
//! them, signed, retried, and kept on disk until delivered.
//!
//! - Only the node that ran an occurrence knows how it ended, and it
//!   records it once; it alone sends the occurrence's events, so each
//!   event is sent by one node of the cluster ([`Webhooks::event`]).
//! - Each delivery is written to the spool ([`spool`]) before it is first
//!   sent and removed when it is delivered or given up: a daemon that stops
//!   or is killed with deliveries pending sends them when it starts again
//!   on that host. A host that is lost loses its spool.
//! - One worker ([`Webhooks::run`]) sends them, at most [`IN_FLIGHT`] at
//!   once, each bounded by its webhook's `timeout`; a 2xx answer delivers,
//!   a network error, 408, 425, 429 or 5xx is retried after 1 s, 2 s,
//!   4 s ... (at most [`MAX_BACKOFF`], ±20 %) for up to [`MAX_AGE`];
//!   any other answer (a redirect too: the body is signed for this URL)
//!   fails it at once. At most [`MAX_PENDING`] wait; past that the oldest
//!   is dropped, said in an ERROR.
//! - A retry after an answer that was lost can deliver an event twice: the
//!   `X-Cronlease-Delivery` header (`JOB-FENCE-EVENT`) is the same on every
//!   try, for the receiver to drop the second.
//! - No URL is logged (a chat webhook's path is its token): the
//!   webhook's name and host are.

pub mod body;
mod handover;
mod http;
pub mod spool;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::{Config, Webhook};
use crate::metrics::{Metrics, WebhookLabel};
use crate::spool::Spooled as _;
pub use body::Event;
pub use handover::{TAKE_EVERY, hand_over_spool};
use spool::{Pending, Spool};

/// Deliveries waiting at most; past that the oldest is dropped.
pub const MAX_PENDING: usize = 1000;
/// A delivery not made within this since its event is given up.
pub const MAX_AGE: Duration = Duration::from_secs(24 * 3600);
/// The longest wait between two tries of one delivery.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// The wait after a first failed try.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Deliveries sent at once.
pub const IN_FLIGHT: usize = 4;

/// Why the webhooks cannot start.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("cannot make the HTTP client for webhooks: {0}")]
    Client(String),
    /// `[[notify]]` in a binary built without the `webhooks` feature.
    #[error("[[notify]]: webhooks are not built into this binary (build with feature `webhooks`)")]
    NotBuiltIn,
}

/// The node's webhooks and their queue.
pub struct Webhooks {
    hooks: Vec<Webhook>,
    node: String,
    dashboard: Option<String>,
    /// `None` when the spool directory could not be opened (said at
    /// start): deliveries then live in memory only.
    spool: Option<Spool>,
    /// The spool's lock, held while this daemon sends what it keeps
    /// ([`handover::lock_spool`]).
    _spool_lock: Option<crate::spool::SpoolLock>,
    queue: Mutex<Queue>,
    wake: tokio::sync::Notify,
    client: http::Client,
    metrics: Arc<Metrics>,
}

#[derive(Default)]
struct Queue {
    /// Oldest first.
    pending: Vec<Pending>,
    /// File names of the deliveries being sent now.
    sending: HashSet<String>,
}

/// How one try went.
enum Verdict {
    Delivered,
    Retry(String),
    Refused(String),
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

impl Webhooks {
    /// The node's webhooks, `None` without a `[[notify]]` table. Deliveries a
    /// previous daemon of this node left in the spool are queued again;
    /// those for a webhook no longer configured are dropped (a WARN each).
    pub async fn start(
        config: &Config,
        metrics: Arc<Metrics>,
    ) -> Result<Option<Arc<Webhooks>>, WebhookError> {
        if config.webhooks.is_empty() {
            return Ok(None);
        }
        // Building it reads the system's trust roots from disk.
        let client = tokio::task::spawn_blocking(http::Client::new)
            .await
            .map_err(|e| WebhookError::Client(e.to_string()))??;
        let dir = config
            .state_dir()
            .join(format!("notify-{}", config.node.as_str()));
        let opened = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || Spool::open(&dir))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
        };
        let (spool, spool_lock, found) = match opened {
            Ok(spool) => {
                // A dead daemon's guard may be handing over what is here.
                let lock = handover::lock_spool(&spool).await;
                let s = spool.clone();
                let (found, problems) = tokio::task::spawn_blocking(move || s.load::<Pending>())
                    .await
                    .unwrap_or_else(|e| (Vec::new(), vec![e.to_string()]));
                for p in problems {
                    tracing::warn!("webhook spool: {p}");
                }
                (Some(spool), lock, found)
            }
            Err(e) => {
                tracing::error!(dir = %dir.display(), "webhooks: cannot open the spool directory ({e}); deliveries will not survive a restart (set state_dir)");
                (None, None, Vec::new())
            }
        };
        let hooks = Webhooks {
            hooks: config.webhooks.clone(),
            node: config.node.as_str().to_string(),
            dashboard: config.public_url.as_ref().map(|u| u.to_string()),
            spool,
            _spool_lock: spool_lock,
            queue: Mutex::new(Queue::default()),
            wake: tokio::sync::Notify::new(),
            client,
            metrics,
        };
        let mut kept = Vec::new();
        for p in found {
            if hooks.hooks.iter().any(|h| h.name == p.target) {
                kept.push(p);
            } else {
                tracing::warn!(webhook = %p.target, delivery = %p.event.delivery, "webhook delivery dropped: no [[notify]] table has this name any more");
                hooks.count(&p.target, "dropped");
                hooks.unspool(p).await;
            }
        }
        if !kept.is_empty() {
            tracing::info!(
                pending = kept.len(),
                "webhook deliveries left by the previous daemon: sending them"
            );
        }
        hooks.wake.notify_one();
        hooks.with_queue(|q| q.pending = kept);
        hooks.set_pending_gauge();
        for h in &hooks.hooks {
            tracing::info!(webhook = %h.name, host = %h.host(), events = %h.events.join(","), signed = h.secret.is_some(), "webhook configured");
        }
        Ok(Some(Arc::new(hooks)))
    }

    /// Whether some webhook wants `job`'s `event`.
    pub fn wants(&self, job: &str, event: &str) -> bool {
        self.hooks.iter().any(|h| h.wants(job, event))
    }

    /// This node's name, the dashboard's URL: what every event says.
    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn dashboard(&self) -> Option<&str> {
        self.dashboard.as_deref()
    }

    /// The spool's directory, `None` without one: what a dead daemon's
    /// guard hands over ([`hand_over_spool`]).
    pub fn spool_dir(&self) -> Option<&std::path::Path> {
        self.spool.as_ref().map(Spool::dir)
    }

    /// Queues `event` for every webhook that wants it, spooled first.
    pub async fn event(&self, event: Event) {
        let now = now_ms();
        let new: Vec<Pending> = self
            .hooks
            .iter()
            .filter(|h| h.wants(&event.job, &event.event))
            .map(|h| Pending {
                target: h.name.clone(),
                event: event.clone(),
                attempts: 0,
                created_ms: now,
                next_ms: now,
            })
            .collect();
        self.enqueue(new).await;
    }

    /// Spools `new` and queues it (a delivery queued already is replaced);
    /// past [`MAX_PENDING`] the oldest not being sent are dropped.
    async fn enqueue(&self, new: Vec<Pending>) {
        if new.is_empty() {
            return;
        }
        for p in &new {
            self.spool_write(p).await;
        }
        let dropped = self.with_queue(|q| {
            let names: HashSet<String> = new.iter().map(Pending::file_name).collect();
            q.pending
                .retain(|p| !names.contains(&p.file_name()) || q.sending.contains(&p.file_name()));
            q.pending.extend(
                new.into_iter()
                    .filter(|p| !q.sending.contains(&p.file_name())),
            );
            q.pending.sort_by_cached_key(Pending::file_name);
            let mut dropped = Vec::new();
            while q.pending.len() > MAX_PENDING {
                let Some(i) = q
                    .pending
                    .iter()
                    .position(|p| !q.sending.contains(&p.file_name()))
                else {
                    break;
                };
                dropped.push(q.pending.remove(i));
            }
            dropped
        });
        for p in dropped {
            tracing::error!(webhook = %p.target, delivery = %p.event.delivery, "webhook delivery dropped: {MAX_PENDING} deliveries are waiting (is the receiver down?)");
            self.count(&p.target, "dropped");
            self.unspool(p).await;
        }
        self.set_pending_gauge();
        self.wake.notify_one();
    }

    /// Deliveries due now and not being sent, plus those being sent.
    pub fn busy(&self) -> usize {
        let now = now_ms();
        self.with_queue(|q| {
            q.pending
                .iter()
                .filter(|p| p.next_ms <= now || q.sending.contains(&p.file_name()))
                .count()
        })
    }

    /// Sends what is due until `stop`; what is left stays spooled.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut sends = tokio::task::JoinSet::new();
        loop {
            let now = now_ms();
            let room = IN_FLIGHT.saturating_sub(sends.len());
            let (due, next) = self.with_queue(|q| {
                let mut due = Vec::new();
                let mut next: Option<i64> = None;
                for p in &q.pending {
                    let name = p.file_name();
                    if q.sending.contains(&name) {
                        continue;
                    }
                    if p.next_ms <= now && due.len() < room {
                        due.push(p.clone());
                    } else if p.next_ms > now {
                        next = Some(next.map_or(p.next_ms, |n| n.min(p.next_ms)));
                    }
                }
                for p in &due {
                    q.sending.insert(p.file_name());
                }
                (due, next)
            });
            for p in due {
                let (me, stop) = (self.clone(), stop.clone());
                sends.spawn(async move { me.send(p, &stop).await });
            }
            let wait = next.map_or(Duration::from_secs(3600), |n| {
                Duration::from_millis(u64::try_from(n - now).unwrap_or(0))
            });
            tokio::select! {
                () = stop.cancelled() => break,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(wait) => {}
                Some(_) = sends.join_next(), if !sends.is_empty() => {}
            }
        }
        // Each send in flight gives up its request and leaves its delivery
        // as it was (spooled, queued): waited for, so that nothing writes
        // the spool after the stop (a delivery handed over next must not
        // come back).
        while sends.join_next().await.is_some() {}
    }

    /// One try of `p`, and what follows from it; given up, with `p` left
    /// as it was, when `stop` comes first.
    async fn send(&self, mut p: Pending, stop: &CancellationToken) {
        let name = p.file_name();
        let Some(hook) = self.hooks.iter().find(|h| h.name == p.target) else {
            // Not queued (see `start`); never left marked as being sent.
            self.with_queue(|q| {
                q.sending.remove(&name);
                q.pending.retain(|x| x.file_name() != name);
            });
            return;
        };
        let verdict = tokio::select! {
            verdict = self.post(hook, &p.event) => verdict,
            () = stop.cancelled() => {
                self.with_queue(|q| q.sending.remove(&name));
                return;
            }
        };
        p.attempts += 1;
        let now = now_ms();
        let age = p.age(now);
        let what = format!(
            "{} of {} (fence {})",
            p.event.event, p.event.job, p.event.fence
        );
        let ended = match verdict {
            Verdict::Delivered => {
                tracing::info!(webhook = %hook.name, delivery = %p.event.delivery, attempts = p.attempts, "webhook delivered: {what}");
                Some("sent")
            }
            Verdict::Refused(why) => {
                tracing::error!(webhook = %hook.name, host = %hook.host(), delivery = %p.event.delivery, attempts = p.attempts, "webhook delivery failed, not retried: {what}: {why}");
                Some("failed")
            }
            Verdict::Retry(why) if age >= MAX_AGE => {
                tracing::error!(webhook = %hook.name, host = %hook.host(), delivery = %p.event.delivery, attempts = p.attempts, "webhook delivery given up after {}: {what}: {why}", humantime::format_duration(MAX_AGE));
                Some("failed")
            }
            Verdict::Retry(why) => {
                let wait = backoff(p.attempts);
                p.next_ms = now.saturating_add(wait.as_millis() as i64);
                if p.attempts == 1 || p.attempts.is_multiple_of(10) {
                    tracing::warn!(webhook = %hook.name, host = %hook.host(), delivery = %p.event.delivery, attempts = p.attempts, "webhook delivery failed, retrying in {}: {what}: {why}", humantime::format_duration(Duration::from_secs(wait.as_secs().max(1))));
                } else {
                    tracing::debug!(webhook = %hook.name, delivery = %p.event.delivery, attempts = p.attempts, "webhook delivery failed, retrying: {why}");
                }
                self.spool_write(&p).await;
                None
            }
        };
        if let Some(result) = ended {
            self.count(&hook.name, result);
            self.unspool(p.clone()).await;
        }
        self.with_queue(|q| {
            q.sending.remove(&name);
            if let Some(i) = q.pending.iter().position(|x| x.file_name() == name) {
                if ended.is_some() {
                    q.pending.remove(i);
                } else {
                    q.pending[i] = p;
                }
            }
        });
        self.set_pending_gauge();
        self.wake.notify_one();
    }

    /// POSTs `event` to `hook` once.
    async fn post(&self, hook: &Webhook, event: &Event) -> Verdict {
        let body = body::render(event, hook);
        let signature = hook.secret.as_ref().map(|secret| {
            let unix = chrono::Utc::now().timestamp();
            body::signature(secret.bytes(), unix, &body)
        });
        match self.client.post(hook, event, signature, body).await {
            Ok(status) if (200..300).contains(&status) => Verdict::Delivered,
            Ok(status) if status >= 500 || matches!(status, 408 | 425 | 429) => {
                Verdict::Retry(format!("answered {}", http::status_text(status)))
            }
            Ok(status) => Verdict::Refused(format!("answered {}", http::status_text(status))),
            Err(why) => Verdict::Retry(why),
        }
    }

    fn with_queue<T>(&self, f: impl FnOnce(&mut Queue) -> T) -> T {
        let mut q = self
            .queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut q)
    }

    fn count(&self, webhook: &str, result: &str) {
        self.metrics
            .webhook_deliveries
            .get_or_create(&WebhookLabel {
                webhook: webhook.to_string(),
                result: result.to_string(),
            })
            .inc();
    }

    fn set_pending_gauge(&self) {
        let n = self.with_queue(|q| q.pending.len());
        self.metrics.webhook_pending.set(n as i64);
    }

    async fn spool_write(&self, p: &Pending) {
        let Some(spool) = &self.spool else {
            return;
        };
        let (s, p) = (spool.clone(), p.clone());
        let written = tokio::task::spawn_blocking(move || s.write(&p))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        if let Err(e) = written {
            tracing::error!(dir = %spool.dir().display(), "webhook spool: cannot write a delivery ({e}); it will not survive a restart");
        }
    }

    async fn unspool(&self, p: Pending) {
        let Some(spool) = &self.spool else {
            return;
        };
        let s = spool.clone();
        let removed = tokio::task::spawn_blocking(move || s.remove(&p))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        if let Err(e) = removed {
            tracing::warn!(dir = %spool.dir().display(), "webhook spool: cannot remove a finished delivery ({e}); it may be sent again after a restart");
        }
    }
}

/// The wait after `attempts` failed tries: 1 s doubling, at most
/// [`MAX_BACKOFF`], ±20 % so that many nodes' retries spread out.
fn backoff(attempts: u32) -> Duration {
    crate::backoff::exponential(FIRST_BACKOFF, MAX_BACKOFF, attempts)
}
