//! Supervising a run: the last lease check before starting, the watchdog that
//! keeps the lease while the job runs, and the history record.
//!
//! The watchdog renews whenever less than a third of the lease is left. It
//! keeps the local deadline of docs/protocol.md (monotonic time the last successful claim
//! or renewal was *sent* + lease − margin/2 − 0.1% of the lease); at that
//! deadline without a renewal, or when a renewal is refused, the run is
//! killed and recorded `lease_lost`. SIGKILL comes no later than the moment
//! the store could let a peer in. A store that can end leases early (a
//! ZooKeeper holder's session) bounds runs further ([`crate::store::Locks::run_bound`]):
//! the earlier of the two applies.
//!
//! A run is recorded while its webhook events are spooled ([`Node::finish`]);
//! then the job's hooks follow on the same node, after its lease is handed
//! back if it was being handed back ([`Node::after_run`]): `on_failure` after
//! a failure (`failed`, `timeout`, `lease_lost`, `not_started`, `missed`),
//! `on_success` after `ok`, `on_recovery` after the first `ok` that follows a
//! failure.

use crate::telemetry::Rfc3339;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{JobState, LeaseClock, Node};
use crate::config::{Hook, Job};
use crate::exec::{Finished, RunSpec, StopReason};
use crate::metrics::Metrics;
use crate::store::{Outcome, Renewal, RunRecord, StoreError, TriggerId};

/// How many of a job's newest history records `on_recovery` looks through
/// for the run before the one that ended `ok`.
const RECOVERY_LOOKBACK: u32 = 20;

/// How a run ended, for the hooks that follow it.
pub(super) struct Ended {
    pub(super) outcome: Outcome,
    pub(super) exit_code: Option<i32>,
    pub(super) started_at: DateTime<Utc>,
    pub(super) finished_at: DateTime<Utc>,
    pub(super) duration_ms: i64,
    /// The output tail, as history keeps it.
    pub(super) output: String,
    /// An `ok` run whose previous run failed (looked up only when a hook
    /// or a webhook wants to know).
    pub(super) recovered: bool,
    /// A failure tried again (`retry`): the next attempt's request, in the
    /// store. Not the occurrence's final outcome: no `on_failure`, no
    /// failure event.
    pub(super) retry: Option<TriggerId>,
}

impl Ended {
    fn of(finished: &Finished) -> Ended {
        Ended {
            outcome: finished.outcome.clone(),
            exit_code: finished.exit_code,
            started_at: finished.started_at,
            finished_at: finished.finished_at,
            duration_ms: (finished.finished_at - finished.started_at)
                .num_milliseconds()
                .max(0),
            output: finished.output.clone(),
            recovered: false,
            retry: None,
        }
    }
}

/// The most of a run's output tail a hook gets in `CRONLEASE_OUTPUT_TAIL`.
const HOOK_TAIL: usize = 4096;

/// The end of `text`, at most `max` bytes, as an environment value:
/// control characters other than newline and tab (NUL among them) become
/// U+FFFD.
fn env_safe(text: &str, max: usize) -> String {
    let safe: String = text
        .chars()
        .map(|c| {
            if c.is_control() && c != '\n' && c != '\t' {
                char::REPLACEMENT_CHARACTER
            } else {
                c
            }
        })
        .collect();
    let mut start = safe.len().saturating_sub(max);
    while !safe.is_char_boundary(start) {
        start += 1;
    }
    safe[start..].to_string()
}

/// A won occurrence, to run.
#[derive(Debug, Clone, Copy)]
pub(super) struct RunTicket {
    pub fence: u64,
    pub occurrence: DateTime<Utc>,
    pub takeover: bool,
    /// From the claimed instant to the claim's answer, in milliseconds.
    pub decision_ms: u64,
    /// A manual run or a retry: its request's id.
    pub trigger: Option<TriggerId>,
}

impl RunTicket {
    /// Which try of its occurrence this run is: a retry's attempt, else 1.
    pub fn attempt(&self) -> u32 {
        TriggerId::attempt(self.trigger)
    }

    /// When this run was due: a retry's due time (a redelivery's: that of
    /// the attempt it hands back), else the occurrence.
    pub fn due(&self) -> DateTime<Utc> {
        self.trigger
            .and_then(TriggerId::daemons_attempt)
            .map_or(self.occurrence, |(_, due)| due)
    }
}

impl Node {
    /// Records a won occurrence skipped because the previous run of the job
    /// is still going (`overlap = "skip"`).
    pub(super) async fn skip_occurrence(&self, state: &JobState, ticket: RunTicket) {
        let job = state.job();
        tracing::info!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), "previous run still going: skipping this occurrence (overlap = skip)");
        self.record(
            state,
            ticket,
            Finished::without_process(Outcome::Skipped, self.wall.now()),
        )
        .await;
    }

    /// Starts a run unless one of the job is still going (`overlap = "skip"`).
    pub(super) fn start_run(
        self: &Arc<Self>,
        state: &Arc<JobState>,
        ticket: RunTicket,
    ) -> Option<JoinHandle<()>> {
        let job = state.job();
        // Test-only: the daemon dies here, having won the claim (its guard
        // told) and started nothing.
        #[cfg(feature = "failpoints")]
        if std::env::var("CRONLEASE_FAILPOINT_DIE_BEFORE_START")
            .is_ok_and(|j| j == job.name.as_str())
        {
            tracing::warn!(job = %job.name, fence = ticket.fence, "failpoint: the daemon dies before starting the run");
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        }
        if !state.start_running(ticket.trigger.is_some()) {
            tracing::info!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), "previous run still going: skipping this occurrence (overlap = skip)");
            return None;
        }
        // A broadcast job's own occurrence runs nowhere: it is handed to
        // its shards ([`super::broadcast`]); a shard's runs.
        let dispatch = job.every_node && job.name.shard_of().is_none();
        let task = self.clone().run_task(state.clone(), ticket, dispatch);
        Some(self.life.runs.spawn(task))
    }

    /// A run's task, from its start to what follows its record. Its size is
    /// what every run in flight holds (at an instant where a thousand jobs
    /// end together, a thousand of them wait for their records' batch), so
    /// the large and the short-lived steps are boxed: the size of the
    /// longest of them is held only while it runs
    /// (`runs_and_claims_in_flight_hold_small_tasks`).
    pub(super) async fn run_task(
        self: Arc<Self>,
        state: Arc<JobState>,
        ticket: RunTicket,
        dispatch: bool,
    ) {
        let ended = if dispatch {
            Box::pin(self.dispatch_occurrence(&state, ticket)).await
        } else {
            self.supervise(&state, ticket).await
        };
        // A step-down during the run, or (spread) a job whose preferred
        // node is another: hand it back, so the next occurrence goes to
        // a peer on time.
        // Not while a later run of the job goes (the occurrence that
        // replaced this one): its lease is that run's.
        let hand_back = self.defers(&state.job()) && !state.is_running();
        if state.take_release_after_run() || hand_back {
            state.lease_ended();
            self.release_one(&state.job().name).await;
        }
        Box::pin(self.after_run(&state, ticket, &ended)).await;
    }

    /// Records `ticket`'s occurrence, won but not run, as `outcome`
    /// (`missed`, `lease_lost`) with `why` as its output, and what follows
    /// a failure (its events, `on_failure`), in a task of its own: the
    /// claim that found it goes on at once.
    pub(super) fn record_not_run(
        self: &Arc<Self>,
        state: &Arc<JobState>,
        ticket: RunTicket,
        outcome: Outcome,
        why: String,
    ) {
        tracing::warn!(job = %state.job().name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), %outcome, "occurrence not run, recorded {outcome}: {why}");
        let (node, state) = (self.clone(), state.clone());
        self.life.runs.spawn(async move {
            let finished = Finished {
                output: format!("cronlease: {outcome}: {why}"),
                ..Finished::without_process(outcome.clone(), node.wall.now())
            };
            let ended = node.finish(&state, ticket, finished).await;
            Box::pin(node.after_run(&state, ticket, &ended)).await;
        });
    }

    /// The run's record and its events, at once: the events go to the
    /// spool of the webhooks that want them ([`crate::webhook`]) while the
    /// record waits for its batch, so a daemon that dies in that wait has
    /// its events spooled already. Answers how the run ended, with
    /// `recovered` looked up (history below the run's fence) when a hook or
    /// a webhook wants it.
    pub(super) async fn finish(
        &self,
        state: &JobState,
        ticket: RunTicket,
        finished: Finished,
    ) -> Ended {
        let job = state.job();
        let name = job.name.as_str();
        let mut ended = Ended::of(&finished);
        let webhooks = self.webhooks.as_deref();
        let retry = self.plan_retry(&job, ticket, &ended);
        // Boxed: what it holds (a spool write, a history read, a webhook
        // event) is held only while it goes, not by every run in flight
        // while its record waits for the batch.
        let notify = Box::pin(async {
            // The outcome's event first: spooled at once. `recovered` needs
            // a history read. A failure to be tried again has none (yet).
            if retry.is_none() {
                self.spool_events(name, ticket, &ended).await;
            }
            let recovered = ended.outcome == Outcome::Ok
                && (job.on_recovery.is_some()
                    || webhooks.is_some_and(|w| w.wants(name, "recovered")))
                && self
                    .follows_failure(&job.name, ticket.fence, ticket.occurrence)
                    .await;
            if let Some(w) = webhooks.filter(|w| recovered && w.wants(name, "recovered")) {
                w.event(self.webhook_event(w, name, ticket, &ended, "recovered"))
                    .await;
            }
            recovered
        });
        let ((), recovered) = tokio::join!(self.record(state, ticket, finished), notify);
        ended.recovered = recovered;
        if let Some(id) = retry {
            // After the record: the store takes no request while the run's
            // record is missing (its running mark).
            if self.request_retry(&job, ticket, id).await {
                ended.retry = Some(id);
            } else {
                // Not tried again after all: the failure is final.
                Box::pin(self.spool_events(name, ticket, &ended)).await;
            }
        }
        ended
    }

    /// Spools the event of the final outcome of the run that `ended` (`ok`:
    /// `succeeded`; a failure: its outcome) for the webhooks that want it.
    pub(super) async fn spool_events(&self, job: &str, ticket: RunTicket, ended: &Ended) {
        let event = match &ended.outcome {
            Outcome::Ok => "succeeded",
            o if o.is_failure() => o.as_str(),
            _ => return,
        };
        if let Some(w) = self.webhooks.as_deref().filter(|w| w.wants(job, event)) {
            w.event(self.webhook_event(w, job, ticket, ended, event))
                .await;
        }
    }

    /// The next attempt's request if the run that `ended` is tried again
    /// (`retry`): the job has it, the outcome is one of its `on`, attempts
    /// are left, it is no manual run, and the backoff ends before the next
    /// occurrence (which would end the attempts anyway).
    fn plan_retry(
        &self,
        job: &crate::config::Job,
        ticket: RunTicket,
        ended: &Ended,
    ) -> Option<TriggerId> {
        let retry = job.retry.as_ref()?;
        let attempt = ticket.attempt();
        // An operator's run is not retried; a redelivered first run is.
        let manual = ticket.trigger.is_some_and(TriggerId::is_operators);
        if manual || !retry.retries(&ended.outcome) {
            return None;
        }
        if attempt >= retry.attempts {
            tracing::warn!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), "attempt {attempt}/{} ended {}: no attempt left", retry.attempts, ended.outcome);
            return None;
        }
        let wait = chrono::Duration::from_std(retry.wait(attempt)).ok()?;
        let due = ended.finished_at.checked_add_signed(wait)?;
        if let Some(next) = job.schedule.next_after(ticket.occurrence)
            && due >= next
        {
            tracing::warn!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), "attempt {attempt}/{} ended {}: not tried again, the next occurrence ({next}) comes before the backoff ends", retry.attempts, ended.outcome);
            return None;
        }
        Some(TriggerId::retry(due, attempt + 1))
    }

    /// Puts retry `id` in the store for any node to claim when it is due;
    /// false when the store refused it (a manual run's request pending, a
    /// run of the job going, the store down): the failure is then final.
    /// A request that got no answer is made again with the same id (it is
    /// ours if the store has it pending), so a write that landed is never
    /// taken for a refusal. An earlier occurrence's attempt still pending
    /// (overtaken: no node ran it before this occurrence) is withdrawn
    /// first, said in a WARN.
    async fn request_retry(
        &self,
        job: &crate::config::Job,
        ticket: RunTicket,
        id: TriggerId,
    ) -> bool {
        use crate::store::TriggerAnswer;
        let Some((attempt, due)) = id.retry_of() else {
            return false;
        };
        let total = job.retry.as_ref().map_or(attempt, |r| r.attempts);
        let mut answer = Err(StoreError::Timeout(self.settings.op_timeout));
        for _ in 0..3 {
            answer = self
                .call(
                    "request_trigger",
                    self.settings.op_timeout,
                    self.store.request_trigger(&job.name, id),
                )
                .await;
            match &answer {
                Ok(TriggerAnswer::Pending(p))
                    if p.daemons_attempt()
                        .is_some_and(|(_, d)| d < ticket.occurrence) =>
                {
                    let withdrawn = self
                        .call(
                            "withdraw_trigger",
                            self.settings.op_timeout,
                            self.store.withdraw_trigger(&job.name, *p),
                        )
                        .await;
                    if let Ok(true) = withdrawn {
                        tracing::warn!(job = %job.name, trigger = %p, "an earlier occurrence's pending attempt withdrawn, not run: this occurrence came before any node could run it");
                    }
                }
                Ok(_) => break,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        // Pending with our id: our own write, whose first answer was lost.
        let scheduled = matches!(&answer, Ok(TriggerAnswer::Accepted))
            || matches!(&answer, Ok(TriggerAnswer::Pending(p)) if *p == id);
        match answer {
            _ if scheduled => {
                self.metrics
                    .retries
                    .get_or_create(&Metrics::job(job.name.as_str()))
                    .inc();
                tracing::warn!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), trigger = %id, "attempt {attempt}/{total} due at {due}: any node may run it");
                true
            }
            Ok(other) => {
                tracing::error!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), "attempt {attempt}/{total} not scheduled: the store refused its request ({other:?}); the failure is final");
                false
            }
            Err(e) => {
                tracing::error!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), "attempt {attempt}/{total} not scheduled: {e}; the failure is final");
                false
            }
        }
    }

    /// The job's hooks after a run of it ended: `on_failure` after a
    /// failure ([`Outcome::is_failure`]); after `ok`, `on_success`, and
    /// `on_recovery` when the job's previous run in history (any node's)
    /// failed. Both of those go at once.
    pub(super) async fn after_run(&self, state: &JobState, ticket: RunTicket, ended: &Ended) {
        if ended.outcome.is_failure() {
            if ended.retry.is_none() {
                self.hook(state, ticket, Hook::Failure, ended).await;
            }
            return;
        }
        if ended.outcome != Outcome::Ok {
            return;
        }
        let recovery = async {
            if ended.recovered {
                self.hook(state, ticket, Hook::Recovery, ended).await;
            }
        };
        tokio::join!(self.hook(state, ticket, Hook::Success, ended), recovery);
    }

    /// `event` of the run that `ended`, as the webhooks are sent it.
    fn webhook_event(
        &self,
        w: &crate::webhook::Webhooks,
        job: &str,
        ticket: RunTicket,
        ended: &Ended,
        event: &str,
    ) -> crate::webhook::Event {
        let rfc = |t: DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        crate::webhook::Event {
            delivery: format!("{job}-{}-{event}", ticket.fence),
            event: event.to_string(),
            job: job.to_string(),
            occurrence: ticket
                .occurrence
                .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            outcome: ended.outcome.as_str().to_string(),
            exit_code: ended.exit_code,
            node: w.node().to_string(),
            fence: ticket.fence,
            started_at: rfc(ended.started_at),
            finished_at: rfc(ended.finished_at),
            duration_ms: ended.duration_ms,
            trigger: ticket
                .trigger
                .filter(|t| t.is_operators())
                .map(|t| t.to_string()),
            attempt: ticket.attempt(),
            output_tail: ended.output.clone(),
            dashboard: w.dashboard().map(str::to_string),
        }
    }

    /// Whether the job's run before `fence` (the newest in history below
    /// it that ran or failed to: skipped and expired occurrences are passed
    /// over) failed. A history the store cannot read now is a WARN and no.
    async fn follows_failure(
        &self,
        job: &crate::config::JobName,
        fence: u64,
        occurrence: DateTime<Utc>,
    ) -> bool {
        let read = tokio::time::timeout(
            self.settings.op_timeout,
            self.store.history(Some(job), RECOVERY_LOOKBACK),
        )
        .await;
        let runs = match read {
            Ok(Ok(runs)) => runs,
            Ok(Err(e)) => {
                tracing::warn!(job = %job, fence, "on_recovery not started: the job's history could not be read: {e}");
                return false;
            }
            Err(_) => {
                tracing::warn!(job = %job, fence, "on_recovery not started: the job's history could not be read in {:?}", self.settings.op_timeout);
                return false;
            }
        };
        // Earlier attempts of the same occurrence are passed over: their
        // failures were not final (no `on_failure` said them).
        runs.iter()
            .filter(|r| r.fence < fence && r.occurrence != occurrence)
            .filter(|r| r.outcome == Outcome::Ok || r.outcome.is_failure())
            .max_by_key(|r| r.fence)
            .is_some_and(|r| r.outcome.is_failure())
    }

    /// Runs the job's `hook` command, if it has one, after the run that
    /// `ended`: the run's environment plus `CRONLEASE_HOOK`,
    /// `CRONLEASE_OUTCOME`, `CRONLEASE_EXIT_CODE` (empty without one),
    /// `CRONLEASE_DURATION_MS` and `CRONLEASE_OUTPUT_TAIL` (the run's
    /// tail as history keeps it, control characters but newline and tab
    /// as U+FFFD), its user and directory, bounded by the job's `timeout`;
    /// not claimed and not in history (its output goes to the log like
    /// the job's). Stopped at shutdown, and none starts then.
    async fn hook(&self, state: &JobState, ticket: RunTicket, which: Hook, ended: &Ended) {
        let job = state.job();
        let Some(command) = job.hook(which) else {
            return;
        };
        let key = which.key();
        let mut hook = (*job).clone();
        hook.command = command.clone();
        hook.output_tail = 0;
        for (name, value) in [
            ("CRONLEASE_HOOK", key.to_string()),
            ("CRONLEASE_OUTCOME", ended.outcome.as_str().to_string()),
            (
                "CRONLEASE_EXIT_CODE",
                ended.exit_code.map(|c| c.to_string()).unwrap_or_default(),
            ),
            ("CRONLEASE_DURATION_MS", ended.duration_ms.to_string()),
            ("CRONLEASE_OUTPUT_TAIL", env_safe(&ended.output, HOOK_TAIL)),
        ] {
            hook.env.insert(name.into(), value);
        }
        if self.life.kill_runs.is_cancelled() {
            // A failure's hook is kept for the next start ([`super::owed`]).
            match which {
                Hook::Failure => {
                    let owed =
                        super::owed::of_run(job.name.as_str(), ticket, ended, self.wall.now());
                    self.owe(owed).await;
                }
                _ => {
                    tracing::info!(job = %job.name, fence = ticket.fence, outcome = %ended.outcome, "{key} not started: the daemon is shutting down")
                }
            }
            return;
        }
        let spec = RunSpec {
            hook: Some(which),
            ..self.spec(&hook, ticket)
        };
        tracing::info!(job = %job.name, fence = ticket.fence, outcome = %ended.outcome, "{key} starting");
        let stop = async {
            self.life.kill_runs.cancelled().await;
            StopReason::Shutdown
        };
        let finished = self
            .runner
            .run(spec, self.guard.process.as_ref(), Box::pin(stop))
            .await;
        match &finished.outcome {
            Outcome::Ok => {
                tracing::info!(job = %job.name, fence = ticket.fence, hook_outcome = "ok", "{key} finished: ok")
            }
            done => {
                tracing::warn!(job = %job.name, fence = ticket.fence, hook_outcome = %done, exit_code = finished.exit_code, "{key} finished: {done}")
            }
        }
    }

    /// What the runner needs to run `job` (the job, or one of its hooks) on
    /// `ticket`.
    fn spec<'a>(&'a self, job: &'a crate::config::Job, ticket: RunTicket) -> RunSpec<'a> {
        RunSpec {
            job,
            fence: ticket.fence,
            occurrence: ticket.occurrence,
            node: &self.name,
            takeover: ticket.takeover,
            decision_ms: ticket.decision_ms,
            clock: self.wall.as_ref(),
            secrets: &self.store_url,
            hook: None,
            trigger: ticket.trigger,
        }
    }

    /// Supervises the run; answers how it ended, for its hooks.
    async fn supervise(&self, state: &JobState, ticket: RunTicket) -> Ended {
        let job = state.job();
        let provable = state
            .lease_clock()
            .is_some_and(|c| Instant::now() < self.stop_and_kill(&c).0);
        if !provable {
            // Paused between claim and start: the lease may be gone already.
            tracing::warn!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), "lease deadline passed before the run could start: not starting it");
            state.run_is_over();
            return self
                .finish(
                    state,
                    ticket,
                    Finished::without_process(Outcome::LeaseLost, self.wall.now()),
                )
                .await;
        }
        let going = self.run_going(crate::store::RunningRun {
            job: job.name.to_string(),
            fence: ticket.fence,
            occurrence: ticket.occurrence,
            started_at: self.wall.now(),
            trigger: ticket.trigger,
            attempt: ticket.attempt(),
            elapsed_ms: 0,
        });
        let slot = going.slot.clone();
        let stop = async {
            tokio::select! {
                grace = self.watchdog(state) => StopReason::LeaseLost { grace },
                () = self.life.kill_runs.cancelled() => StopReason::Shutdown,
                () = slot.cancelled() => StopReason::Cancelled,
                () = slot.replaced() => StopReason::Replaced,
            }
        };
        let lateness = (self.wall.now() - ticket.due()).num_milliseconds();
        tracing::info!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), lateness_ms = lateness, takeover = ticket.takeover, "run starting");
        let spec = self.spec(&job, ticket);
        self.metrics
            .start_lateness
            .get_or_create(&Metrics::job(job.name.as_str()))
            .observe(lateness.max(0) as f64 / 1000.0);
        let running = self.metrics.running(job.name.as_str());
        let mut finished = self
            .runner
            .run(spec, self.guard.process.as_ref(), Box::pin(stop))
            .await;
        drop((running, going));
        let said = match finished.outcome {
            Outcome::Cancelled => slot.asked().map(|asked| asked.said()),
            Outcome::Replaced => slot.replaced_by(),
            _ => None,
        };
        if let Some(said) = said {
            if !finished.output.is_empty() && !finished.output.ends_with('\n') {
                finished.output.push('\n');
            }
            finished.output.push_str(&said);
        }
        // The process is over: the next occurrence may start, whatever
        // recording the run takes.
        state.run_is_over();
        let took = (finished.finished_at - finished.started_at).num_milliseconds();
        match &finished.outcome {
            Outcome::Ok => {
                tracing::info!(job = %job.name, fence = ticket.fence, outcome = "ok", duration_ms = took, cpu_ms = finished.usage.cpu_ms, memory_peak = finished.usage.memory_peak, "run finished: ok")
            }
            outcome => {
                tracing::warn!(job = %job.name, fence = ticket.fence, %outcome, duration_ms = took, exit_code = finished.exit_code, cpu_ms = finished.usage.cpu_ms, memory_peak = finished.usage.memory_peak, "run finished: {outcome}")
            }
        }
        self.finish(state, ticket, finished).await
    }

    /// Keeps the job's lease while its run goes; returns when the lease is
    /// lost, with how long SIGTERM may take before SIGKILL.
    async fn watchdog(&self, state: &JobState) -> Duration {
        let job = state.job();
        loop {
            let Some(clock) = state.lease_clock() else {
                return Duration::ZERO;
            };
            let (deadline, kill_by) = self.stop_and_kill(&clock);
            let renew_at = clock.renew_at(self.settings.margin);
            let now = Instant::now();
            if now >= deadline {
                if deadline < clock.deadline(self.settings.margin) {
                    tracing::warn!(job = %job.name, "the store's session is no longer confirmed: stopping the run before a peer may take the job over");
                } else {
                    tracing::warn!(job = %job.name, "lease deadline reached without a renewal");
                }
                return kill_by.saturating_duration_since(now);
            }
            if now < renew_at {
                tokio::time::sleep_until(renew_at.min(deadline)).await;
                continue;
            }
            let sent = Instant::now();
            let budget = self.settings.op_timeout.min(deadline - sent);
            // Batched with the renewals due at the same moment.
            let renewal = Renewal {
                job: job.name.clone(),
                lease: clock.lease,
            };
            let answer = match tokio::time::timeout(budget, self.batch.renewals.call(renewal)).await
            {
                Ok(answer) => answer,
                Err(_) => Err(StoreError::Timeout(budget)),
            };
            match answer {
                Ok(true) => {
                    state.lease_granted(sent, clock.lease);
                }
                Ok(false) => {
                    tracing::warn!(job = %job.name, "lease renewal refused: the lease is no longer this node's");
                    state.lease_ended();
                    return Duration::ZERO;
                }
                Err(_) => {
                    let retry = (Instant::now() + Duration::from_millis(200)).min(deadline);
                    tokio::time::sleep_until(retry).await;
                }
            }
        }
    }

    /// When a run on `clock`'s lease must stop and when it must be gone: the
    /// local deadline and the lease's expiry, or the store's earlier bound.
    fn stop_and_kill(&self, clock: &LeaseClock) -> (Instant, Instant) {
        let (stop, kill) = (clock.deadline(self.settings.margin), clock.expiry());
        match self.store.run_bound(clock.sent) {
            Some(b) => (stop.min(b.stop_by), kill.min(b.kill_by)),
            None => (stop, kill),
        }
    }

    /// The history record of `finished`, counted in the metrics.
    fn counted_record(&self, job: &Job, ticket: RunTicket, finished: Finished) -> RunRecord {
        let record = RunRecord {
            job: job.name.to_string(),
            fence: ticket.fence,
            owner: self.owner.to_string(),
            node: self.name.to_string(),
            occurrence: ticket.occurrence,
            started_at: finished.started_at,
            finished_at: finished.finished_at,
            outcome: finished.outcome,
            exit_code: finished.exit_code,
            takeover: ticket.takeover,
            delay_ms: (finished.started_at - ticket.due())
                .num_milliseconds()
                .max(0) as u64,
            decision_ms: ticket.decision_ms,
            output: finished.output,
            trigger: ticket.trigger,
            cpu_ms: finished.usage.cpu_ms,
            memory_peak: finished.usage.memory_peak,
        };
        let labels = crate::metrics::RunLabel {
            cron_job: Metrics::job_of(job.name.as_str()).to_string(),
            outcome: record.outcome.to_string(),
        };
        self.metrics.runs.get_or_create(&labels).inc();
        let took = (record.finished_at - record.started_at)
            .num_milliseconds()
            .max(0) as f64
            / 1000.0;
        if record.outcome != Outcome::Skipped {
            self.metrics
                .run_duration
                .get_or_create(&Metrics::job(job.name.as_str()))
                .observe(took);
        }
        super::service::feed_job_gauges(&self.metrics, &record);
        if let Some(ms) = record.cpu_ms {
            self.metrics
                .run_cpu
                .get_or_create(&Metrics::job(job.name.as_str()))
                .observe(ms as f64 / 1000.0);
        }
        if let Some(bytes) = record.memory_peak {
            self.metrics
                .run_memory_peak
                .get_or_create(&Metrics::job(job.name.as_str()))
                .observe(bytes as f64);
        }
        if record.outcome == Outcome::LeaseLost {
            self.metrics
                .leases_lost
                .get_or_create(&Metrics::job(job.name.as_str()))
                .inc();
        }
        record
    }

    /// Writes the run to the store's history (a few tries; a record lost to
    /// an outage is logged, never retried forever).
    pub(super) async fn record(&self, state: &JobState, ticket: RunTicket, finished: Finished) {
        // Built and counted before the first wait: what the wait holds is
        // the record alone (every run ending at one instant waits here for
        // the batch).
        let record = self.counted_record(&state.job(), ticket, finished);
        let mut last_error = None;
        // A stopping node tries once: a store that cannot take the write
        // now (a peer frozen holding SQLite's write lock) must not hold the
        // exit past systemd's stop timeout; the loss is logged.
        let attempts = if self.life.claims.is_cancelled() {
            1
        } else {
            3
        };
        for attempt in 0..attempts {
            // Batched with the runs that end at the same moment; recording
            // is idempotent, so a retry after a lost answer adds nothing.
            match self.batch.records.call(record.clone()).await {
                Ok(()) => return,
                Err(e) => last_error = Some(e),
            }
            if attempt + 1 < attempts {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        if let Some(e) = last_error {
            tracing::warn!(job = %record.job, fence = record.fence, outcome = %record.outcome, "run not recorded in history: {e}");
        }
    }
}
