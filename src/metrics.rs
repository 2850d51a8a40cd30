//! Metrics (docs/operations.md) and the HTTP endpoint that serves them.
//!
//! `[metrics] listen` serves `/metrics` (Prometheus scrapes it; OpenMetrics
//! text, via the prometheus-client crate) and `/healthz` (200 when the store
//! answered within the last lease margin, 503 otherwise). The endpoint is a
//! deliberately small HTTP/1.1 responder: two GET paths, a bounded request,
//! a timeout per connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobLabel {
    pub job: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClaimLabel {
    pub job: String,
    /// `won`, `caught_up`, `lost` or `error`.
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RunLabel {
    pub job: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    /// `claim`, `renew`, `release`, `record`, `prepare`, `ping`.
    pub op: String,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn lateness_buckets() -> Histogram {
    // 1 ms .. 65 s
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

fn duration_buckets() -> Histogram {
    // 10 ms .. 11.6 h
    Histogram::new(exponential_buckets(0.01, 4.0, 12))
}

fn store_call_buckets() -> Histogram {
    // 0.5 ms .. 4 s
    Histogram::new(exponential_buckets(0.0005, 2.0, 14))
}

/// Every series cronlease exports.
pub struct Metrics {
    pub claims: Family<ClaimLabel, Counter>,
    pub runs: Family<RunLabel, Counter>,
    pub run_duration: Histograms<JobLabel>,
    pub start_lateness: Histograms<JobLabel>,
    /// From an occurrence's instant to the claim's answer: what the engine
    /// costs, apart from spawning.
    pub claim_decision: Histogram,
    pub leases_lost: Family<JobLabel, Counter>,
    pub store_errors: Counter,
    pub store_call: Histograms<OpLabel>,
    pub leases_held: Gauge,
    pub jobs: Gauge,
    /// Live nodes in the store's node registry, at this node's last heartbeat.
    pub nodes_alive: Gauge,
    pub store_up: Gauge,
    /// store − local clock, seconds, from the last claim reply.
    pub clock_offset: Gauge<f64, AtomicU64>,
    registry: Registry,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let m = Metrics {
            claims: Family::default(),
            runs: Family::default(),
            run_duration: Family::new_with_constructor(duration_buckets),
            start_lateness: Family::new_with_constructor(lateness_buckets),
            claim_decision: lateness_buckets(),
            leases_lost: Family::default(),
            store_errors: Counter::default(),
            store_call: Family::new_with_constructor(store_call_buckets),
            leases_held: Gauge::default(),
            jobs: Gauge::default(),
            nodes_alive: Gauge::default(),
            store_up: Gauge::default(),
            clock_offset: Gauge::default(),
            registry: Registry::default(),
        };
        let mut registry = Registry::default();
        registry.register(
            "cronlease_claims",
            "Claims of occurrences, by result",
            m.claims.clone(),
        );
        registry.register(
            "cronlease_runs",
            "Finished runs, by outcome",
            m.runs.clone(),
        );
        registry.register(
            "cronlease_run_duration_seconds",
            "How long runs took",
            m.run_duration.clone(),
        );
        registry.register(
            "cronlease_start_lateness_seconds",
            "Run start after the scheduled instant",
            m.start_lateness.clone(),
        );
        registry.register(
            "cronlease_claim_decision_seconds",
            "From the scheduled instant to the claim's answer",
            m.claim_decision.clone(),
        );
        registry.register(
            "cronlease_leases_lost",
            "Runs killed because their lease could not be proven",
            m.leases_lost.clone(),
        );
        registry.register(
            "cronlease_store_errors",
            "Store calls that failed or timed out",
            m.store_errors.clone(),
        );
        registry.register(
            "cronlease_store_call_seconds",
            "Store call latency, by operation",
            m.store_call.clone(),
        );
        registry.register(
            "cronlease_leases_held",
            "Job leases this node holds now",
            m.leases_held.clone(),
        );
        registry.register(
            "cronlease_jobs_held",
            "Job leases this node holds now (the same as cronlease_leases_held)",
            m.leases_held.clone(),
        );
        registry.register(
            "cronlease_jobs",
            "Jobs configured on this node",
            m.jobs.clone(),
        );
        registry.register(
            "cronlease_nodes_alive",
            "Live nodes in the store's node registry, at this node's last heartbeat",
            m.nodes_alive.clone(),
        );
        registry.register(
            "cronlease_store_up",
            "1 when the last store call answered",
            m.store_up.clone(),
        );
        registry.register(
            "cronlease_clock_offset_seconds",
            "The store's clock minus this node's, from the last claim reply",
            m.clock_offset.clone(),
        );
        Metrics { registry, ..m }
    }

    pub fn job(job: &str) -> JobLabel {
        JobLabel {
            job: job.to_string(),
        }
    }

    /// The exposition text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Answers `/healthz`: `None` when healthy, else the reason.
pub type HealthCheck = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// Serves `/metrics` and `/healthz` until `stop`; `healthy` answers `/healthz`.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    healthy: HealthCheck,
    stop: CancellationToken,
) {
    loop {
        let (conn, _) = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("metrics endpoint: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let metrics = metrics.clone();
        let healthy = healthy.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                respond(conn, &metrics, healthy.as_ref()),
            )
            .await;
        });
    }
}

/// Binds the endpoint's listener (done at start, so a taken port fails fast).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

async fn respond(
    mut conn: TcpStream,
    metrics: &Metrics,
    healthy: &(dyn Fn() -> Option<String> + Send + Sync),
) -> std::io::Result<()> {
    let mut request = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = conn.read(&mut buf).await?;
        if n == 0 || request.len() > 16 * 1024 {
            return Ok(());
        }
        request.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&request);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET", "/metrics") => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        ("GET", "/healthz") => match healthy() {
            None => ("200 OK", "text/plain; charset=utf-8", "ok\n".to_string()),
            Some(reason) => (
                "503 Service Unavailable",
                "text/plain; charset=utf-8",
                format!("{reason}\n"),
            ),
        },
        ("GET", _) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found: try /metrics or /healthz\n".to_string(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "GET only\n".to_string(),
        ),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await?;
    if method != "HEAD" {
        conn.write_all(body.as_bytes()).await?;
    }
    conn.shutdown().await
}
