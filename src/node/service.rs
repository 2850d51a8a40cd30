//! The node as a service: its own tick ([`Node::supervise_service`]):
//! the systemd watchdog ping (withheld while the scheduler is stuck),
//! `STATUS=` lines, the job and lease gauges, and a store ping that keeps
//! `/healthz` fresh; and the per-job "last run" gauges read from the
//! store's history at start and every few minutes
//! ([`Node::follow_job_metrics`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::{Node, claim};
use crate::config::JobName;
use crate::store::{LAST_RUNS_AT_ONCE, Outcome, RunRecord, bounded};

/// Job histories read at start to find the last success of jobs whose
/// newest run failed: at most this many jobs, each its newest
/// [`SEED_DEPTH`] runs (records carry output tails: kept small).
const SEED_JOBS: usize = 200;
const SEED_DEPTH: u32 = 20;
/// How often the newest run of every job is read again, so that a node
/// that does not hold a job still exports its last success (a holder that
/// dies takes its own series with it).
pub(super) const SEED_EVERY: Duration = Duration::from_secs(300);

/// The scheduler is stuck when its last heartbeat (ms since the node's
/// epoch) is older than two maximal sleeps plus slack: the systemd watchdog
/// ping is withheld, so systemd restarts a daemon whose claiming has stopped.
pub(super) fn scheduler_stuck(beat: u64, now_ms: u64) -> bool {
    let stale_after = (2 * claim::MAX_SLEEP).as_millis() as u64 + 5_000;
    now_ms.saturating_sub(beat) > stale_after
}

/// Feeds a finished run (one of ours, or one of the store's history) to
/// the per-job gauges; a skipped occurrence is not a run, nor a broadcast
/// job's dispatch, whose shards' runs count as the job's.
pub(super) fn feed_job_gauges(metrics: &crate::metrics::Metrics, run: &RunRecord) {
    if matches!(run.outcome, Outcome::Skipped | Outcome::Dispatched) {
        return;
    }
    let took = (run.finished_at - run.started_at).num_milliseconds().max(0) as f64 / 1000.0;
    let job = crate::metrics::Metrics::job_of(&run.job);
    metrics.run_finished(
        job,
        run.finished_at.timestamp_millis() as f64 / 1000.0,
        took,
        run.outcome == Outcome::Ok,
    );
}

impl Node {
    /// Keeps `cronlease_job_last_*` fed from the store's history, so that
    /// every node exports what the cluster did, not only its own runs (a
    /// node that restarted, or never ran the job): once the store is
    /// prepared, the newest run of every job, and for jobs whose newest run
    /// was not a success their recent history (at most [`SEED_JOBS`] jobs,
    /// [`SEED_DEPTH`] runs each); then the newest runs again every
    /// [`SEED_EVERY`]. Best effort, outside the node's store health: a read
    /// that fails is a DEBUG line, and the gauges keep what they had.
    pub(super) async fn follow_job_metrics(self: Arc<Self>) {
        let mut first = true;
        loop {
            self.seed_job_metrics(first).await;
            first = false;
            tokio::select! {
                () = self.life.claims.cancelled() => return,
                () = tokio::time::sleep(SEED_EVERY) => {}
            }
        }
    }

    async fn seed_job_metrics(&self, deep: bool) {
        let jobs: Vec<JobName> = self.states().iter().map(|s| s.job().name.clone()).collect();
        let budget = self.settings.op_timeout * 4;
        let last = match bounded(budget, self.store.last_runs(&jobs)).await {
            Ok(last) => last,
            Err(e) => {
                tracing::debug!("the jobs' last runs not read for their gauges: {e}");
                return;
            }
        };
        let mut failing = Vec::new();
        for (job, run) in jobs.iter().zip(last) {
            if let Some(run) = run {
                feed_job_gauges(&self.metrics, &run);
                if run.outcome != Outcome::Ok {
                    failing.push(job.clone());
                }
            }
        }
        if !deep {
            return;
        }
        failing.truncate(SEED_JOBS);
        for page in failing.chunks(LAST_RUNS_AT_ONCE) {
            let reads = page.iter().map(|job| {
                bounded(
                    self.settings.op_timeout,
                    self.store.history(Some(job), SEED_DEPTH),
                )
            });
            for read in futures_util::future::join_all(reads).await {
                match read {
                    Ok(runs) => runs.iter().for_each(|r| feed_job_gauges(&self.metrics, r)),
                    Err(e) => tracing::debug!("a job's history not read for its gauges: {e}"),
                }
            }
        }
    }

    /// How many jobs are configured and how many of their leases this node
    /// holds now.
    pub(super) fn job_and_lease_counts(&self) -> (usize, usize) {
        let jobs = self.jobs.lock().map_or(0, |jobs| jobs.len());
        let held = self
            .leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .held_at(Instant::now());
        (jobs, held)
    }

    /// `N jobs, holding M leases, store up|down` for `STATUS=` and logs.
    pub(super) fn status_line(&self, (jobs, held): (usize, usize)) -> String {
        if !self.prepare.done.load(Ordering::SeqCst)
            && let Some(why) = self.prepare.waiting.lock().ok().and_then(|w| w.clone())
        {
            return format!("{jobs} jobs, waiting for the store: {why}");
        }
        let store = if self.health.is_up() { "up" } else { "down" };
        format!("{jobs} jobs, holding {held} leases, store {store}")
    }

    /// The service's own tick, every 5 s (a third of the systemd watchdog's
    /// interval if that is shorter): watchdog pings (only while every job
    /// loop is alive), `STATUS=` lines and gauges (each beat sets the
    /// gauges too), and a store ping when the store has been quiet for a
    /// beat period and half a margin and `/healthz` is served. The beats
    /// keep the store from being quiet (a call each period: that is what
    /// `/healthz` waits for), so the ping is the net for when they did not
    /// go; the tick no longer runs at the beat's period, which woke an idle
    /// daemon once more a second.
    pub(super) async fn supervise_service(self: Arc<Self>) {
        let tick = self
            .notifier
            .watchdog()
            .map_or(Duration::from_secs(5), |w| {
                (w / 3).min(Duration::from_secs(5))
            });
        let mut interval = tokio::time::interval(tick.max(Duration::from_millis(100)));
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stuck_reported = false;
        loop {
            tokio::select! {
                () = self.life.claims.cancelled() => return,
                _ = interval.tick() => {}
            }
            #[cfg(feature = "failpoints")]
            if std::env::var_os("CRONLEASE_FAILPOINT_PANIC_IN_TASK").is_some() {
                panic!("failpoint: a task of the daemon panics");
            }
            let now_ms = self.beat.epoch.elapsed().as_millis() as u64;
            let beat = self.beat.last.load(Ordering::Relaxed);
            if !scheduler_stuck(beat, now_ms) {
                self.notifier.ping();
                stuck_reported = false;
            } else if !stuck_reported {
                tracing::error!("scheduler stuck: withholding the systemd watchdog ping");
                stuck_reported = true;
            }
            if self.clock.skewed() {
                // Claims are held back: notice here when the clock is fine again.
                self.recheck_clock().await;
            } else if self.settings.keep_health_fresh
                && self
                    .health
                    .last_ok()
                    .is_none_or(|t| t.elapsed() >= self.quiet_limit() - self.settings.margin / 2)
            {
                let _ = self
                    .call("ping", self.settings.op_timeout, self.store.ping())
                    .await;
            }
            let (jobs, held) = self.job_and_lease_counts();
            self.notifier.status(&self.status_line((jobs, held)));
            self.metrics.jobs.set(jobs as i64);
            self.metrics.leases_held.set(held as i64);
        }
    }
}
