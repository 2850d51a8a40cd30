//! Manual runs (`cronlease trigger`, docs/protocol.md "Manual runs"): the
//! node looks for pending requests once a heartbeat period, in the same
//! call as its heartbeat when that goes on its own
//! ([`crate::store::Registry::heartbeat_looking`]: an idle node makes one
//! call a period), on its own otherwise, and at the time a retry it saw is
//! due; it claims each one of a job it runs through the same batcher, and
//! the same atomic step, as an occurrence
//! ([`crate::store::ClaimRequest::manual`]).
//!
//! The store decides: a request is won by exactly one node, only while no
//! run of the job is in progress, with a fence of its own; it never moves
//! the job's last occurrence. A refused claim is left alone: a request still
//! pending (a run was in progress) is found again at the next look. A claim
//! without an answer is asked again, saying so, so a win whose reply was
//! lost is answered again instead of being lost.
//!
//! A job's retries (`retry`, docs/protocol.md "Retries") are requests too,
//! made by the node whose run failed ([`crate::store::TriggerId::retry`]):
//! each is claimed by one node once it is due, and runs as its
//! occurrence's next attempt; one whose occurrence's next is due (or that
//! nobody took within `cluster.trigger_expiry`) is claimed and recorded
//! `missed` instead ([`Node::end_retry`]).
//!
//! A resume's request ([`crate::store::TriggerId::resumed`]) is no run of
//! its own: it tells the nodes to catch up at once the occurrence missed
//! while the job was paused ([`Node::catch_up_on_resume`]).

use crate::telemetry::Rfc3339;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::run::RunTicket;
use super::{JobState, Node, Standing};
use crate::exec::Finished;
use crate::store::{ClaimOutcome, ClaimRequest, Outcome, StoreError, TriggerId, lock};

/// The next notice of a request from the store; never, without any (a
/// subscription that ended for good is dropped after one last look).
async fn next_notice(notices: &mut Option<tokio::sync::mpsc::Receiver<()>>) {
    let closed = match notices.as_mut() {
        Some(rx) => rx.recv().await.is_none(),
        None => std::future::pending::<bool>().await,
    };
    if closed {
        *notices = None;
    }
}

/// How often a node looks for requests while some job is due within
/// [`BUSY_WITHIN`], on a store that does not announce them: a request
/// handed back by a crashed daemon's guard (a redelivery) must start within
/// its occurrence's window, a second for a job every second, so such a node
/// looks as often as it used to.
const BUSY_LOOK: Duration = Duration::from_millis(250);
/// [`BUSY_LOOK`] where the store announces requests
/// ([`crate::store::Locks::notices`] gave a subscription): the hand-back and
/// a broadcast's shards come with their notice, and the node's own look is
/// there for a notice lost (the subscription being made again, or refused
/// and tried again), so it comes half as often, still twice within a
/// second.
const NOTIFIED_BUSY_LOOK: Duration = Duration::from_millis(500);
/// A node with an occurrence due within this is busy ([`BUSY_LOOK`]).
const BUSY_WITHIN: chrono::TimeDelta = chrono::TimeDelta::seconds(2);
/// How long a resume's request waits for a node that has its job: a
/// catch-up is over by the first half of the gap anyway, and a pending
/// request holds up the job's other requests (`trigger`, a retry's).
const RESUME_REQUEST_LIFE: Duration = Duration::from_secs(60);
/// Claims of one request whose answer was lost, before the node gives up
/// on it (a win among them stays unrun: its lease and running mark end
/// with the lease, and `trigger --wait` says the run was not recorded).
const ATTEMPTS: usize = 3;

/// The requests this node is claiming now (not looked for again meanwhile),
/// by job and id: the daemons' own requests (retries, redeliveries) of jobs
/// on one schedule have the same ids.
#[derive(Default)]
pub(super) struct InFlight(std::sync::Mutex<HashSet<(String, TriggerId)>>);

impl InFlight {
    /// Marks `job`'s request `id` as being claimed; false when it is
    /// already.
    pub(super) fn start(&self, job: &str, id: TriggerId) -> bool {
        lock(&self.0).insert((job.to_string(), id))
    }

    /// The claim of `job`'s request `id` is over (won, refused or given
    /// up).
    pub(super) fn end(&self, job: &str, id: TriggerId) {
        lock(&self.0).remove(&(job.to_string(), id));
    }
}

/// Pending requests as a look reads them: (job, id), sorted by job.
type Pending = Vec<(String, TriggerId)>;

/// The pending requests a heartbeat read ([`Node::beat_once`]), handed to
/// [`Node::watch_triggers`].
#[derive(Default)]
pub(super) struct Looks {
    /// The list, and when the beat that read it was sent.
    pending: std::sync::Mutex<Option<(Instant, Pending)>>,
    ready: tokio::sync::Notify,
}

impl Looks {
    /// A heartbeat sent at `sent` read `pending`: the watcher takes it at
    /// once.
    pub(super) fn deliver(&self, sent: Instant, pending: Pending) {
        *lock(&self.pending) = Some((sent, pending));
        self.ready.notify_one();
    }

    /// The list delivered, unless it is older than the watcher's own last
    /// look (`looked`): then it is dropped, as its requests were seen.
    fn take(&self, looked: Option<Instant>) -> Option<(Instant, Pending)> {
        let (sent, pending) = lock(&self.pending).take()?;
        looked.is_none_or(|at| sent > at).then_some((sent, pending))
    }
}

impl Node {
    /// Takes the pending requests until claiming stops, and claims those of
    /// this node's jobs: those a heartbeat read (an idle node's beat goes
    /// on its own once a period, [`Node::beat_once`]), else read here once
    /// a period has passed without them (beats riding in claim batches),
    /// at once when the store sends a notice of a request
    /// ([`crate::store::Locks::notices`]), and again when a retry seen
    /// waiting is due.
    pub(super) async fn watch_triggers(self: Arc<Self>) {
        let (every, _) = super::membership::beat_timing(self.settings.margin);
        let mut notices = self.store.clone().notices(self.life.claims.child_token());
        let mut looked: Option<Instant> = None;
        let mut retry_due: Option<Instant> = None;
        loop {
            // Idle, a quarter period later than the beat due then: the
            // beat's look comes first whenever the beat goes on its own.
            let next_due = self
                .beat
                .next_due_ms
                .load(std::sync::atomic::Ordering::Relaxed);
            let now_ms = self.wall.now().timestamp_millis();
            let broadcast = self
                .beat
                .broadcast_ms
                .load(std::sync::atomic::Ordering::Relaxed);
            // Busy before an instant, and after a broadcast job's (its
            // shards' requests come then).
            let busy = next_due.saturating_sub(now_ms) <= BUSY_WITHIN.num_milliseconds()
                || now_ms.saturating_sub(broadcast) <= BUSY_WITHIN.num_milliseconds();
            let period = match (busy, notices.is_some()) {
                (true, false) => BUSY_LOOK,
                (true, true) => NOTIFIED_BUSY_LOOK,
                (false, _) => every + every / 4,
            };
            let due = looked.map_or_else(Instant::now, |at| at + period);
            let wake = retry_due.map_or(due, |r| r.min(due));
            let mut noticed = false;
            let delivered = tokio::select! {
                () = self.life.claims.cancelled() => return,
                () = self.looks.ready.notified() => self.looks.take(looked),
                () = next_notice(&mut notices) => {
                    noticed = true;
                    None
                }
                () = tokio::time::sleep_until(wake) => None,
            };
            let (read_at, pending) = match delivered {
                Some(delivered) => delivered,
                None if !noticed && Instant::now() < wake => continue,
                None if !self.ready_to_claim() => {
                    looked = Some(Instant::now());
                    retry_due = retry_due.map(|r| r.max(Instant::now() + BUSY_LOOK));
                    continue;
                }
                None => {
                    let asked = Instant::now();
                    let read = self
                        .call(
                            "pending_triggers",
                            self.settings.op_timeout,
                            self.store.pending_triggers(),
                        )
                        .await;
                    match read {
                        Ok(pending) => (asked, pending),
                        Err(_) => {
                            looked = Some(asked);
                            // A waiting retry is looked for again soon, not
                            // forgotten until the next beat.
                            retry_due = retry_due.map(|r| r.max(Instant::now() + BUSY_LOOK));
                            continue;
                        }
                    }
                }
            };
            looked = Some(read_at);
            if !self.ready_to_claim() {
                retry_due = retry_due.map(|r| r.max(Instant::now() + BUSY_LOOK));
                continue;
            }
            // This list shows every retry still waiting: their times are
            // taken again below.
            retry_due = None;
            let now = self.wall.now();
            for (job, id) in pending {
                // A broadcast job's shard (its lock `JOB~NODE`): this
                // node's, one its node left, or one past its window.
                if id.shard_of().is_some() && job.contains(crate::config::SHARD_SEPARATOR) {
                    self.take_shard(&job, id, now);
                    continue;
                }
                // A resume's request: the occurrence missed while paused is
                // claimed by its own rule, never as a manual run; one that
                // no node with the job took within RESUME_REQUEST_LIFE is
                // withdrawn by any node.
                if id.resumed_at().is_some() {
                    let mine = self.claimable_state_of(&job).is_some();
                    let stale = id.age(now).is_some_and(|age| age > RESUME_REQUEST_LIFE);
                    if (mine || stale) && self.triggers.start(&job, id) {
                        let node = self.clone();
                        self.life.handlers.spawn(async move {
                            node.catch_up_on_resume(&job, id).await;
                            node.triggers.end(&job, id);
                        });
                    }
                    continue;
                }
                if let Some((_, due)) = id.daemons_attempt() {
                    // A retry waits for its time (looked for again then);
                    // one whose occurrence's next is due, a redelivered
                    // first run past its starting window, or one nobody
                    // took within `cluster.trigger_expiry`, ends unrun.
                    if due > now {
                        let wait = (due - now).to_std().unwrap_or_default();
                        let at = Instant::now() + wait;
                        retry_due = Some(retry_due.map_or(at, |r| r.min(at)));
                        continue;
                    }
                    // A job this node does not run: only its expiry, below.
                    if let Some(state) = self.claimable_state_of(&job) {
                        let ending = self.attempt_ending(&state.job(), id, now);
                        if state.is_running() || !self.triggers.start(&job, id) {
                            continue;
                        }
                        let node = self.clone();
                        self.life.handlers.spawn(async move {
                            match ending {
                                Some(why) => node.end_retry(&state, id, why).await,
                                None => node.claim_trigger(&state, id).await,
                            }
                            node.triggers.end(&job, id);
                        });
                        continue;
                    }
                }
                if self.expired(id) {
                    if self.triggers.start(&job, id) {
                        let node = self.clone();
                        self.life.handlers.spawn(async move {
                            node.expire(&job, id).await;
                            node.triggers.end(&job, id);
                        });
                    }
                    continue;
                }
                let Some(state) = self.claimable_state_of(&job) else {
                    continue;
                };
                // A run of the job going here: the store would refuse.
                if state.is_running() || !self.triggers.start(&job, id) {
                    continue;
                }
                let node = self.clone();
                self.life.handlers.spawn(async move {
                    node.claim_trigger(&state, id).await;
                    node.triggers.end(&job, id);
                });
            }
        }
    }

    /// Why a daemon's own request `id` (a retry's, a redelivery's) of `job`
    /// will not run at `now`, if it will not: its occurrence's next is due,
    /// its occurrence left the schedule, a redelivered first run is past
    /// its starting window (`starting_deadline`, at most the gap), or
    /// nobody took it within `cluster.trigger_expiry`.
    fn attempt_ending(
        &self,
        job: &crate::config::Job,
        id: TriggerId,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Option<String> {
        let Some((occurrence, next)) = attempt_occurrence(job, id) else {
            return Some("its occurrence is no longer in the schedule".into());
        };
        if let Some(next) = next.filter(|next| *next <= now) {
            return Some(format!(
                "the next occurrence ({next}) is due: the attempts of this one end"
            ));
        }
        let (window, deadline) = super::claim::start_window(job, occurrence, next);
        let late = (now - occurrence).to_std().unwrap_or_default();
        if id.redelivery_of().is_some_and(|r| r.attempt == 1) && late > window {
            return Some(format!(
                "{} ms after its instant, past {}",
                late.as_millis(),
                match deadline {
                    true => format!("starting_deadline ({})", humantime::format_duration(window)),
                    false => "its window".to_string(),
                }
            ));
        }
        self.expired(id).then(|| {
            format!(
                "no node ran it within cluster.trigger_expiry ({})",
                humantime::format_duration(self.settings.trigger_expiry)
            )
        })
    }

    /// Whether request `id` is older than `cluster.trigger_expiry`: no node
    /// took it in that time (the job is on no daemon, or always running).
    fn expired(&self, id: TriggerId) -> bool {
        id.age(self.wall.now())
            .is_some_and(|age| age > self.settings.trigger_expiry)
    }

    /// An expired request (docs/cli.md, `trigger`): claimed like any manual
    /// run, so it gets a fence and a history record (`expired`), but not
    /// run; the lease goes back at once. Where the store refuses the claim
    /// (a run of the job going all this time) it is withdrawn instead. The
    /// node that took it out says so.
    async fn expire(&self, job: &str, id: TriggerId) {
        let Ok(name) = crate::config::JobName::parse(job) else {
            return;
        };
        let state = self.state_of(job);
        // A job of this node: its claim gate is held throughout, so no claim
        // of this node wins the job between this claim and the release
        // below (which would give that claim's lease away). Busy: next time.
        let _gate = match &state {
            Some(s) => match s.claim_gate.clone().try_lock_owned() {
                Ok(gate) => Some(gate),
                Err(_) => return,
            },
            None => None,
        };
        let mut request = self.manual_request(
            name.clone(),
            id,
            crate::config::Misfire::Skip,
            state.as_ref().map_or(0, |s| s.fence_floor()),
        );
        // Whole seconds since the request, a number in JSON logs.
        let age_s = id.age(self.wall.now()).map(|d| d.as_secs());
        let expiry = humantime::format_duration(self.settings.trigger_expiry);
        // A claim whose answer was lost is asked again saying so: a win it
        // had is answered again, and recorded, instead of being left unrun
        // and unrecorded.
        let mut answer = None;
        for _ in 0..ATTEMPTS {
            match tokio::time::timeout(
                self.settings.op_timeout,
                self.batch.claims.call(request.clone()),
            )
            .await
            {
                Ok(Ok(a)) => {
                    answer = Some(a);
                    break;
                }
                _ => request.after_unanswered = true,
            }
        }
        match answer {
            Some((ClaimOutcome::Won(won), _)) => {
                if let Some(state) = &state {
                    state.saw_fence(won.fence);
                }
                let now = self.wall.now();
                let record = crate::store::RunRecord {
                    job: name.to_string(),
                    fence: won.fence,
                    owner: self.owner.to_string(),
                    node: self.name.to_string(),
                    occurrence: won.occurrence,
                    started_at: now,
                    finished_at: now,
                    outcome: Outcome::Expired,
                    exit_code: None,
                    takeover: false,
                    delay_ms: 0,
                    decision_ms: 0,
                    output: String::new(),
                    trigger: Some(id),
                    cpu_ms: None,
                    memory_peak: None,
                };
                if let Err(e) = self.batch.records.call(record).await {
                    tracing::warn!(job = %name, fence = won.fence, "expired request not recorded in history: {e}");
                }
                if !state.as_ref().is_some_and(|s| s.is_running()) {
                    self.progress.releasing();
                    let _ = self
                        .call(
                            "release",
                            self.settings.op_timeout,
                            self.store.release(std::slice::from_ref(&name), &self.owner),
                        )
                        .await;
                }
                self.metrics.triggers_expired.inc();
                tracing::warn!(job = %name, trigger = %id, fence = won.fence, age_s, "a manual run's request expired: no node ran it within cluster.trigger_expiry ({expiry}); recorded as expired, not run");
            }
            Some((ClaimOutcome::Lost(lost), _)) if !lost.trigger_gone => {
                // A run of the job in progress: no fence to record it with.
                let withdrawn = self
                    .call(
                        "withdraw_trigger",
                        self.settings.op_timeout,
                        self.store.withdraw_trigger(&name, id),
                    )
                    .await;
                if let Ok(true) = withdrawn {
                    self.metrics.triggers_expired.inc();
                    tracing::warn!(job = %name, trigger = %id, age_s, "a manual run's request expired while a run of the job went on: withdrawn after cluster.trigger_expiry ({expiry}), not run");
                }
            }
            // Taken meanwhile, or no answer: looked at again next time.
            _ => {}
        }
    }

    /// A retry's request that will not run (see [`Node::watch_triggers`]):
    /// claimed like any, so it gets a fence, and recorded `missed` with
    /// `why`, as the occurrence's final outcome (`on_failure` and the
    /// `missed` event follow). Where the store refuses the claim (a run of
    /// the job going: the next occurrence's) it is looked at again next
    /// time, unless `cluster.trigger_expiry` has passed since it was due:
    /// then it is withdrawn, said in a WARN.
    async fn end_retry(self: &Arc<Self>, state: &Arc<JobState>, id: TriggerId, why: String) {
        let Ok(_gate) = state.claim_gate.clone().try_lock_owned() else {
            return;
        };
        let job = state.job();
        let Some((attempt, due)) = id.daemons_attempt() else {
            return;
        };
        let total = job.retry.as_ref().map_or(attempt, |r| r.attempts);
        let what = attempt_word(id);
        let answer = self
            .claim_as_missed(
                state,
                id,
                attempt_occurrence(&job, id).map(|(t, _)| t),
                format!("{what} {attempt}/{total} (due {due}) not run: {why}"),
            )
            .await;
        match answer {
            Some(ClaimOutcome::Lost(lost)) if !lost.trigger_gone && self.expired(id) => {
                let withdrawn = self
                    .call(
                        "withdraw_trigger",
                        self.settings.op_timeout,
                        self.store.withdraw_trigger(&job.name, id),
                    )
                    .await;
                if let Ok(true) = withdrawn {
                    tracing::warn!(job = %job.name, trigger = %id, "{what} {attempt}/{total} (due {due}) withdrawn, not run: {why}; a run of the job went on all the while, so it is not recorded");
                }
            }
            // Taken meanwhile, or no answer: looked at again next time.
            _ => {}
        }
    }

    /// Claims request `id` of `state`'s job (its claim gate held by the
    /// caller) and, won, records it `missed` with `why`, not run, as of
    /// `occurrence` (else the claim's). The answer when it did not win;
    /// `None` without one.
    pub(super) async fn claim_as_missed(
        self: &Arc<Self>,
        state: &Arc<JobState>,
        id: TriggerId,
        occurrence: Option<chrono::DateTime<chrono::Utc>>,
        why: String,
    ) -> Option<ClaimOutcome> {
        let job = state.job();
        let request = self.manual_request(job.name.clone(), id, job.misfire, state.fence_floor());
        let answer =
            tokio::time::timeout(self.settings.op_timeout, self.batch.claims.call(request)).await;
        match answer {
            Ok(Ok((ClaimOutcome::Won(won), _))) => {
                state.saw_fence(won.fence);
                let ticket = RunTicket {
                    fence: won.fence,
                    occurrence: occurrence.unwrap_or(won.occurrence),
                    decision_ms: 0,
                    takeover: false,
                    trigger: Some(id),
                };
                self.record_not_run(state, ticket, Outcome::Missed, why);
                None
            }
            Ok(Ok((other, _))) => Some(other),
            _ => None,
        }
    }

    /// The claim of manual request `id` of `job`, as this node sends it now:
    /// a lease of two margins (see [`Node::claim_trigger`]), taken from an
    /// idle holder at once (Redlock's first phase), no window.
    pub(super) fn manual_request(
        &self,
        job: crate::config::JobName,
        id: TriggerId,
        misfire: crate::config::Misfire,
        fence_floor: u64,
    ) -> ClaimRequest {
        ClaimRequest {
            job,
            occurrence: self.wall.now(),
            previous: None,
            misfire,
            owner: self.owner.clone(),
            lease: self.settings.margin * 2,
            fence_floor,
            max_offset: self.clock.bound(),
            head_start: Some(Duration::ZERO),
            after_unanswered: false,
            recheck_only: false,
            window_end: None,
            manual: Some(id),
            redeliver: false,
            before_previous: None,
        }
    }

    /// The state of the configured job named `job`, if there is one.
    pub(super) fn state_of(&self, job: &str) -> Option<Arc<JobState>> {
        let name = crate::config::JobName::parse(job).ok()?;
        let jobs = self.jobs.lock().ok()?;
        jobs.get(&name).map(|e| e.state.clone())
    }

    /// The state of the configured job named `job` if this node may claim
    /// it (it has every tag of the job's `run_on`).
    pub(super) fn claimable_state_of(&self, job: &str) -> Option<Arc<JobState>> {
        let name = crate::config::JobName::parse(job).ok()?;
        let jobs = self.jobs.lock().ok()?;
        jobs.get(&name)
            .filter(|e| e.allowed)
            .map(|e| e.state.clone())
    }

    /// Claims request `id` of the job and, won, runs it.
    pub(super) async fn claim_trigger(self: &Arc<Self>, state: &Arc<JobState>, id: TriggerId) {
        // Another claim of the job in flight: look again next time.
        let Ok(gate) = state.claim_gate.clone().try_lock_owned() else {
            return;
        };
        let job = state.job();
        // Two margins, renewed while the run goes: a node that dies during
        // a manual run holds the job no longer than that, so the next
        // occurrence is claimed as after any busy holder's death (a lease of
        // the job's interval would keep a yearly job's next occurrence out,
        // and keep Redlock's restarted masters out of its quorums for a year).
        let mut request =
            self.manual_request(job.name.clone(), id, job.misfire, state.fence_floor());
        let lease = request.lease;
        let mut first_sent: Option<Instant> = None;
        for attempt in 0..ATTEMPTS {
            let sent = Instant::now();
            let answer = match tokio::time::timeout(
                self.settings.op_timeout,
                self.batch.claims.call(request.clone()),
            )
            .await
            {
                Ok(answer) => answer,
                Err(_) => Err(StoreError::Timeout(self.settings.op_timeout)),
            };
            match answer {
                Ok((ClaimOutcome::Won(won), answered)) => {
                    self.count_claim(&job.name, "won");
                    state.saw_fence(won.fence);
                    state.lease_granted(first_sent.unwrap_or(sent).min(sent), lease);
                    state.note_standing(Standing::Holder, won.fence);
                    // A retry or a redelivery runs as its occurrence's
                    // (history, the run's environment); a manual run as of
                    // its claim.
                    let of = attempt_occurrence(&job, id);
                    let retry = id.daemons_attempt().and_then(|(k, _)| Some((k, of?.0)));
                    // A shard runs as its occurrence's too.
                    let shard = id.shard_of();
                    let ticket = RunTicket {
                        fence: won.fence,
                        occurrence: retry
                            .map(|(_, t)| t)
                            .or(shard.map(|(t, ..)| t))
                            .unwrap_or(won.occurrence),
                        decision_ms: 0,
                        takeover: won
                            .previous_owner
                            .as_deref()
                            .is_some_and(|p| p != self.owner.as_str()),
                        trigger: Some(id),
                    };
                    // Answered once the next occurrence was due (by this
                    // node's clock): that occurrence's claim may have run
                    // already, so this one is not run late behind it.
                    if let Some(next) = of
                        .and_then(|(_, next)| next)
                        .filter(|next| retry.is_some() && answered >= *next)
                    {
                        drop(gate);
                        self.record_not_run(
                            state,
                            ticket,
                            Outcome::Missed,
                            format!("claimed after the next occurrence ({next}) was due"),
                        );
                        return;
                    }
                    match retry {
                        Some((k, occurrence)) => {
                            let of = job.retry.as_ref().map_or(k, |r| r.attempts);
                            let what = attempt_word(id);
                            tracing::info!(job = %job.name, fence = won.fence, occurrence = %Rfc3339(occurrence), "{what} {k}/{of} claimed");
                        }
                        None => match shard {
                            Some((at, index, count)) => {
                                tracing::info!(job = %job.name, fence = won.fence, occurrence = %Rfc3339(at), "shard {index} of {count} claimed")
                            }
                            None => {
                                tracing::info!(job = %job.name, fence = won.fence, trigger = %id, "manual run claimed")
                            }
                        },
                    }
                    if self.start_run(state, ticket).is_none() {
                        drop(gate);
                        // Not expected while the store refuses a manual
                        // claim during a run of the job; recorded (an
                        // outcome that ends the lock's running mark) so
                        // the job is not held busy until the lease ends.
                        self.record(
                            state,
                            ticket,
                            Finished::without_process(Outcome::NotStarted, self.wall.now()),
                        )
                        .await;
                    }
                    return;
                }
                Ok((ClaimOutcome::Lost(lost), _)) => {
                    self.count_claim(&job.name, "lost");
                    state.saw_fence(lost.fence);
                    if first_sent.is_some() {
                        tracing::debug!(job = %job.name, trigger = %id, "an unanswered manual claim had not won");
                    }
                    return;
                }
                Ok((ClaimOutcome::Failed(reason), _)) => {
                    self.count_claim(&job.name, "error");
                    tracing::error!(job = %job.name, trigger = %id, "manual claim failed: {reason}");
                    return;
                }
                Err(e) => {
                    self.count_claim(&job.name, "error");
                    first_sent.get_or_insert(sent);
                    request.after_unanswered = true;
                    if attempt + 1 == ATTEMPTS {
                        tracing::warn!(job = %job.name, trigger = %id, "a manual claim went unanswered ({e}); if it won, the request is taken and its run did not start");
                        return;
                    }
                    tokio::select! {
                        () = self.life.claims.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(200)) => {}
                    }
                }
            }
        }
    }
}

/// What a daemon's own request `id` is, for its log lines and records:
/// an `attempt`, or a `redelivered attempt`.
fn attempt_word(id: TriggerId) -> &'static str {
    match id.redelivery_of() {
        Some(_) => "redelivered attempt",
        None => "attempt",
    }
}

/// The occurrence a daemon's own request `id` runs again, and the one
/// after it: for a retry due at `due`, the job's last instant before `due`
/// (a retry is due after its occurrence, before the next); for a
/// redelivery, the last instant at or before its due time (a first
/// attempt's due time is its occurrence). `None` for an operator's request,
/// or when the schedule has none (it changed since).
fn attempt_occurrence(
    job: &crate::config::Job,
    id: TriggerId,
) -> Option<(
    chrono::DateTime<chrono::Utc>,
    Option<chrono::DateTime<chrono::Utc>>,
)> {
    let (_, due) = id.daemons_attempt()?;
    let redelivery = id.redelivery_of();
    let before = match redelivery {
        Some(_) => due + chrono::Duration::milliseconds(1),
        None => due,
    };
    let occurrence = job.schedule.previous_before(before)?;
    // A first attempt handed back names its instant: one the schedule no
    // longer has is gone.
    if redelivery.is_some_and(|r| r.attempt == 1) && occurrence != due {
        return None;
    }
    Some((occurrence, job.schedule.next_after(occurrence)))
}
