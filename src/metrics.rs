//! Metrics (docs/operations.md), encoded as OpenMetrics text by the
//! prometheus-client crate; [`crate::http`] serves them on `/metrics`.
//!
//! The per-job label is `cron_job` (since 0.2.0; `job` before): Prometheus
//! reserves `job` for the scrape job and would store ours as `exported_job`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use chrono::{DateTime, Utc};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The cronlease job a series is about. Never `job`, which Prometheus
/// keeps for the scrape job.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobLabel {
    pub cron_job: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClaimLabel {
    pub cron_job: String,
    /// `won`, `caught_up`, `lost` or `error`.
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RunLabel {
    pub cron_job: String,
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

/// The schedule a job's interval was computed for, and when it ends (its
/// next occurrence then).
type IntervalEnd = (String, DateTime<Utc>);

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
    /// Jobs whose `run_on` no live node of the registry satisfies.
    pub jobs_without_eligible_node: Gauge,
    /// Manual runs' requests this node withdrew because they expired.
    pub triggers_expired: Counter,
    pub store_up: Gauge,
    /// store − local clock, seconds, from the last claim reply.
    pub clock_offset: Gauge<f64, AtomicU64>,
    /// Webhook deliveries that ended, by webhook and result.
    pub webhook_deliveries: Family<WebhookLabel, Counter>,
    /// Webhook deliveries waiting (spooled): to send, or to retry.
    pub webhook_pending: Gauge,
    /// When the job's last run that ended `ok` finished (Unix seconds), as
    /// far as this node knows: its own runs, and the store's history (read
    /// at start and every few minutes).
    pub job_last_success: Family<JobLabel, Gauge<f64, AtomicU64>>,
    /// When the job's last run finished, whatever its outcome (skipped
    /// occurrences aside), as far as this node knows.
    pub job_last_run: Family<JobLabel, Gauge<f64, AtomicU64>>,
    /// How long the job's last run known to this node took.
    pub job_last_duration: Family<JobLabel, Gauge<f64, AtomicU64>>,
    /// Runs of the job going on this node now.
    pub job_running: Family<JobLabel, Gauge>,
    /// 1 when the job was paused at its last claim by this node (or a pause
    /// this node saw since), else 0.
    pub job_paused: Family<JobLabel, Gauge>,
    /// The gap from the job's latest occurrence to its next one, seconds:
    /// what "no success within 2 intervals" is measured against.
    pub job_interval: Family<JobLabel, Gauge<f64, AtomicU64>>,
    /// Every configured job at the last [`Metrics::refresh_jobs`], with the
    /// schedule its interval was computed for and when that interval ends.
    intervals: Mutex<HashMap<String, Option<IntervalEnd>>>,
    /// Jobs whose per-job gauges were set (by runs, claims, history), so
    /// that a job removed by a reload loses them all.
    touched: Mutex<std::collections::HashSet<String>>,
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
            jobs_without_eligible_node: Gauge::default(),
            triggers_expired: Counter::default(),
            store_up: Gauge::default(),
            clock_offset: Gauge::default(),
            webhook_deliveries: Family::default(),
            webhook_pending: Gauge::default(),
            job_last_success: Family::default(),
            job_last_run: Family::default(),
            job_last_duration: Family::default(),
            job_running: Family::default(),
            job_paused: Family::default(),
            job_interval: Family::default(),
            intervals: Mutex::default(),
            touched: Mutex::default(),
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
            "cronlease_jobs_without_eligible_node",
            "Jobs whose run_on no live node of the registry has every tag of: nobody runs them",
            m.jobs_without_eligible_node.clone(),
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
        registry.register(
            "cronlease_job_last_success_timestamp_seconds",
            "When the job's last successful run (outcome ok) finished, Unix time, as far as this node knows (its runs, and the store's history every 5 minutes)",
            m.job_last_success.clone(),
        );
        registry.register(
            "cronlease_job_last_run_timestamp_seconds",
            "When the job's last run finished, whatever its outcome, Unix time, as far as this node knows",
            m.job_last_run.clone(),
        );
        registry.register(
            "cronlease_job_last_duration_seconds",
            "How long the job's last run known to this node took",
            m.job_last_duration.clone(),
        );
        registry.register(
            "cronlease_job_running",
            "Runs of the job going on this node now",
            m.job_running.clone(),
        );
        registry.register(
            "cronlease_job_paused",
            "1 when the job was paused at this node's last claim of it, else 0",
            m.job_paused.clone(),
        );
        registry.register(
            "cronlease_job_interval_seconds",
            "The gap from the job's latest occurrence to its next one (its expected interval), seconds",
            m.job_interval.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The `cron_job` label of `job`: a broadcast job's shard (its lock
    /// `JOB~NODE`) counts as the job.
    pub fn job(job: &str) -> JobLabel {
        JobLabel {
            cron_job: Self::job_of(job).to_string(),
        }
    }

    /// The job a lock's runs count for: `JOB` for a shard's `JOB~NODE`.
    pub fn job_of(lock: &str) -> &str {
        lock.split_once(crate::config::SHARD_SEPARATOR)
            .map_or(lock, |(job, _)| job)
    }

    /// A finished run (skipped occurrences are not runs): the job's last-run,
    /// last-duration and, for `ok`, last-success series. A run older than
    /// the one the series shows (history read at start, arriving late)
    /// changes nothing.
    pub fn run_finished(&self, job: &str, finished_at: f64, took: f64, ok: bool) {
        // One update at a time: a history read racing a run of ours must
        // not set an older value over a newer one.
        let _one_at_a_time = self.touch(job);
        let label = Metrics::job(job);
        let last = self.job_last_run.get_or_create(&label);
        if finished_at >= last.get() {
            last.set(finished_at);
            self.job_last_duration.get_or_create(&label).set(took);
        }
        if ok {
            let success = self.job_last_success.get_or_create(&label);
            if finished_at > success.get() {
                success.set(finished_at);
            }
        }
    }

    /// The job's `cronlease_job_paused`, from a claim's result: set by
    /// `paused`, cleared by a result the store decided on a running job.
    pub fn claim_result(&self, job: &str, result: &str) {
        let paused = match result {
            "paused" => 1,
            "won" | "caught_up" | "lost" => 0,
            _ => return,
        };
        drop(self.touch(job));
        self.job_paused
            .get_or_create(&Metrics::job(job))
            .set(paused);
    }

    /// `cronlease_job_running` of `job` at 1 until the answer is dropped
    /// (the run's process is over, or its task ended some other way).
    pub fn running(&self, job: &str) -> Running {
        drop(self.touch(job));
        let gauge = self.job_running.get_or_create_owned(&Metrics::job(job));
        gauge.set(1);
        Running(gauge)
    }

    /// Notes that `job` has per-job gauges (allocating only the first
    /// time: this is on every claim's path); answers the held lock.
    fn touch(&self, job: &str) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        let job = Self::job_of(job);
        let mut touched = self.touched();
        if !touched.contains(job) {
            touched.insert(job.to_string());
        }
        touched
    }

    fn touched(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.touched
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sets `cronlease_job_interval_seconds` of every configured job
    /// (`jobs`: name and schedule) at `now`, and forgets the per-job gauges
    /// of jobs no longer configured (a reload removed them), so a removed
    /// job does not alert forever; counters and histograms stay, as
    /// Prometheus expects of counters. Called before each scrape; a job's
    /// interval is computed again only once its next occurrence has passed.
    pub fn refresh_jobs<'a>(
        &self,
        jobs: impl Iterator<Item = (&'a str, &'a crate::schedule::Schedule)>,
        now: DateTime<Utc>,
    ) {
        let mut intervals = self
            .intervals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut seen = std::collections::HashSet::new();
        for (name, schedule) in jobs {
            seen.insert(name);
            let fresh = intervals.get(name).is_some_and(|known| {
                known
                    .as_ref()
                    .is_some_and(|(expr, next)| expr == schedule.expr() && *next > now)
            });
            if fresh {
                continue;
            }
            let label = Metrics::job(name);
            let known = match (schedule.previous_before(now), schedule.next_after(now)) {
                (Some(prev), Some(next)) => {
                    let gap = (next - prev).num_milliseconds() as f64 / 1000.0;
                    self.job_interval.get_or_create(&label).set(gap);
                    Some((schedule.expr().to_string(), next))
                }
                // No occurrence before now (a date not reached yet), or none
                // after: no interval to hold the job to.
                _ => {
                    self.job_interval.remove(&label);
                    None
                }
            };
            intervals.insert(name.to_string(), known);
        }
        let mut touched = self.touched();
        let gone: Vec<String> = intervals
            .keys()
            .chain(touched.iter())
            .filter(|j| !seen.contains(j.as_str()))
            .cloned()
            .collect();
        for job in gone {
            intervals.remove(&job);
            touched.remove(&job);
            let label = Metrics::job(&job);
            self.job_interval.remove(&label);
            self.job_last_success.remove(&label);
            self.job_last_run.remove(&label);
            self.job_last_duration.remove(&label);
            self.job_running.remove(&label);
            self.job_paused.remove(&label);
        }
    }

    /// The exposition text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// A run going: `cronlease_job_running` back to 0 when dropped.
pub struct Running(Gauge);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.set(0);
    }
}
