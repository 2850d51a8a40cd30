//! Metrics (docs/operations.md), encoded as OpenMetrics text by the
//! prometheus-client crate; [`crate::http`] serves them on `/metrics`.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WebhookLabel {
    /// The `[[notify]]` table's name.
    pub webhook: String,
    /// `sent`, `failed` (refused, or given up after retries) or `dropped`
    /// (the queue was full, or the webhook is no longer configured).
    pub result: String,
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

fn cpu_buckets() -> Histogram {
    // 1 ms .. 4.7 h
    Histogram::new(exponential_buckets(0.001, 4.0, 13))
}

fn memory_buckets() -> Histogram {
    // 1 MiB .. 64 GiB
    Histogram::new(exponential_buckets(1048576.0, 4.0, 9))
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
    /// CPU time of runs whose runner can tell (systemd units).
    pub run_cpu: Histograms<JobLabel>,
    /// Peak memory of runs whose runner can tell (systemd 254+ units).
    pub run_memory_peak: Histograms<JobLabel>,
    /// From an occurrence's instant to the claim's answer: what the engine
    /// costs, apart from spawning.
    pub claim_decision: Histogram,
    pub leases_lost: Family<JobLabel, Counter>,
    /// Failed runs whose next attempt was put in the store (`retry`).
    pub retries: Family<JobLabel, Counter>,
    pub store_errors: Counter,
    pub store_call: Histograms<OpLabel>,
    pub leases_held: Gauge,
    pub jobs: Gauge,
    /// Live nodes in the store's node registry, at this node's last heartbeat.
    pub nodes_alive: Gauge,
    /// Other live daemons in the registry under this node's name.
    pub node_name_twins: Gauge,
    /// This node's jobs that a live peer defines otherwise.
    pub jobs_defined_otherwise: Gauge,
    /// Manual runs' requests this node withdrew because they expired.
    pub triggers_expired: Counter,
    pub store_up: Gauge,
    /// store − local clock, seconds, from the last claim reply.
    pub clock_offset: Gauge<f64, AtomicU64>,
    /// Webhook deliveries that ended, by webhook and result.
    pub webhook_deliveries: Family<WebhookLabel, Counter>,
    /// Webhook deliveries waiting (spooled): to send, or to retry.
    pub webhook_pending: Gauge,
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
            run_cpu: Family::new_with_constructor(cpu_buckets),
            run_memory_peak: Family::new_with_constructor(memory_buckets),
            claim_decision: lateness_buckets(),
            leases_lost: Family::default(),
            retries: Family::default(),
            store_errors: Counter::default(),
            store_call: Family::new_with_constructor(store_call_buckets),
            leases_held: Gauge::default(),
            jobs: Gauge::default(),
            nodes_alive: Gauge::default(),
            node_name_twins: Gauge::default(),
            jobs_defined_otherwise: Gauge::default(),
            triggers_expired: Counter::default(),
            store_up: Gauge::default(),
            clock_offset: Gauge::default(),
            webhook_deliveries: Family::default(),
            webhook_pending: Gauge::default(),
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
            "cronlease_run_cpu_seconds",
            "CPU time runs used, user and system (runs started as systemd units)",
            m.run_cpu.clone(),
        );
        registry.register(
            "cronlease_run_memory_peak_bytes",
            "The most memory a run's processes held at once (runs started as systemd units, systemd 254 or newer)",
            m.run_memory_peak.clone(),
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
            "cronlease_retries",
            "Failed runs tried again: their next attempt scheduled (retry)",
            m.retries.clone(),
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
            "cronlease_triggers_expired",
            "Manual runs' requests this node withdrew because no node took them within cluster.trigger_expiry",
            m.triggers_expired.clone(),
        );
        registry.register(
            "cronlease_node_name_twins",
            "Other live daemons in the store's node registry under this node's name",
            m.node_name_twins.clone(),
        );
        registry.register(
            "cronlease_jobs_defined_otherwise",
            "This node's jobs that another live node of the registry defines otherwise (schedule, zone, command or policy)",
            m.jobs_defined_otherwise.clone(),
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
        registry.register(
            "cronlease_webhook_deliveries",
            "Webhook deliveries that ended, by webhook and result (sent, failed, dropped)",
            m.webhook_deliveries.clone(),
        );
        registry.register(
            "cronlease_webhook_pending",
            "Webhook deliveries waiting to be sent or retried (kept in the spool)",
            m.webhook_pending.clone(),
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
