//! Claiming: the node's one scheduler timer, the batch of claims it sends at
//! each instant, and the per-occurrence handler that acts on each answer
//! (docs/protocol.md).
//!
//! One instant, from timer to runs:
//! 1. [`Node::scheduler`] sleeps until the earliest next occurrence of any
//!    job (on tokio's clock, in steps of at most [`MAX_SLEEP`] so a wall-clock
//!    step is noticed), then takes every job due then ([`Node::take_due`]).
//! 2. [`Node::claim_instant`] builds one claim per due job and queues them as
//!    one group on the claim batcher ([`super::batch`]): one store call for
//!    the instant. Claims of jobs another node held when this one last
//!    looked go as a second group [`FOLLOWER_LEAD`] later: the holder's
//!    batch reaches the store first and is decided without waiting behind
//!    claims that will most likely lose (a released lease is still taken,
//!    those few ms late). It takes each job's claim gate and hands it to the
//!    job's handler, which holds it until the claim is answered and its run
//!    (if won) has started.
//! 3. One [`Node::handle_occurrence`] task per occurrence receives its answer:
//!    won, it starts the run ([`super::run`]); lost to a live lease of
//!    another owner who has not claimed this occurrence, it waits for the
//!    remaining lease the store reported and claims again (takeover within
//!    one margin), through the same batcher, so takeovers of many jobs at
//!    once are one call too. Store errors are retried with backoff until
//!    some node claims the occurrence or the next one is due.

use crate::telemetry::Rfc3339;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::batch::{self, Pending};
use super::membership::Deferral;
use super::progress::Mark;
use super::run::RunTicket;
use super::{JobState, Node, Standing};
use crate::config::{Delivery, JobName, Misfire};
use crate::exec::Finished;
use crate::metrics::ClaimLabel;
use crate::store::{ClaimOutcome, ClaimRequest, Lost, Outcome, StoreError, TriggerId, Won};

/// How often a replace (`overlap = "replace"`) is thrown again while the
/// run it stops is not over.
const REPLACE_AGAIN: Duration = Duration::from_millis(50);

/// Longest single sleep towards an occurrence: a wall-clock step is noticed
/// within this time.
pub(super) const MAX_SLEEP: Duration = Duration::from_secs(15);
/// How often a node whose clock is out of bounds looks at it again while an
/// occurrence is pending.
const CLOCK_RECHECK: Duration = Duration::from_millis(250);
/// Sleep past a reported lease end, so the store sees it expired.
const EXPIRY_SLACK: Duration = Duration::from_millis(2);
/// A takeover is not started in the last this much (at most a tenth of the
/// gap) before the next occurrence: that occurrence's claim catches it up.
const TAKEOVER_TAIL: Duration = Duration::from_millis(100);
/// How long before the next occurrence a node stops retrying an occurrence
/// whose claim went unanswered, to recheck it (at most a quarter of the gap).
const RECHECK_LEAD: Duration = Duration::from_millis(250);
/// How long after the instant a node sends the claims of jobs another node
/// held when it last looked, so the holder's batch reaches the store first
/// and is decided without queueing behind claims that will lose.
pub const FOLLOWER_LEAD: Duration = Duration::from_millis(5);

/// With `spread`, how long after the preferred node's head start the other
/// nodes send their claims of its jobs: the preferred node, refused by an
/// idle holder until the head start is over, asks again 1 ms after it, and
/// should be first then (else the job moves to its preferred node one
/// occurrence later).
const DEFERRED_LAG: Duration = Duration::from_millis(10);

/// How long after the head start a node sends its claims of the jobs a
/// step-down made it give up (`JobState::yielded`): after every other
/// node's, the deferred ones of `spread` included, so a live peer takes
/// each.
const YIELDED_LAG: Duration = Duration::from_millis(30);

/// `holder`'s count of leases given up as `due`'s claims saw it.
fn released_seen(due: &Due, holder: Option<&str>) -> Option<u64> {
    due.released_seen.get(holder?).copied()
}

/// Time from an occurrence to the next (a minute when there is none).
pub(super) fn gap(occurrence: DateTime<Utc>, next: Option<DateTime<Utc>>) -> Duration {
    next.and_then(|n| (n - occurrence).to_std().ok())
        .unwrap_or(Duration::from_secs(60))
}

/// How long after its instant an occurrence may still start: the job's
/// `starting_deadline`, at most the gap to the next one (the default); and
/// whether the deadline is what ends it (shorter than the gap).
pub(super) fn start_window(
    job: &crate::config::Job,
    occurrence: DateTime<Utc>,
    next: Option<DateTime<Utc>>,
) -> (Duration, bool) {
    let gap = gap(occurrence, next);
    match job.starting_deadline {
        Some(d) if d < gap => (d, true),
        _ => (gap, false),
    }
}

/// Why a catch-up the store handed out (`won`, `late` after its instant,
/// whose own window is `window`) is recorded `missed` instead of run, when
/// the occurrence claimed now is `behind` its instant with `gap` to the
/// next one:
/// - past its `starting_deadline`;
/// - a missed occurrence (not a redelivery) when half of the gap of the one
///   claimed now is gone: that one is then the latest missed occurrence,
///   and running the older one first could push it out of its window
///   (docs/protocol.md, "Missed occurrences").
pub(super) fn catch_up_refused(
    job: &crate::config::Job,
    won: &Won,
    late: Duration,
    window: Duration,
    behind: chrono::TimeDelta,
    gap: Duration,
) -> Option<String> {
    let found = if won.redelivered {
        "its holder died before recording its run (delivery = at_least_once); found"
    } else {
        "no node started it; caught up"
    };
    if job.starting_deadline.is_some() && late > window {
        return Some(format!(
            "{found} {} ms after its instant, past starting_deadline ({}, at most the gap)",
            late.as_millis(),
            humantime::format_duration(window)
        ));
    }
    let behind = behind.to_std().unwrap_or_default();
    (!won.redelivered && behind > gap / 2).then(|| {
        format!(
            "no node started it; caught up at the claim of the next occurrence, {} ms after that one's instant: the next occurrence ran instead (running this one first could push it out of its window)",
            behind.as_millis()
        )
    })
}

/// An occurrence due now, taken from the schedule.
pub(super) struct Due {
    pub(super) state: Arc<JobState>,
    pub(super) stop: CancellationToken,
    pub(super) occurrence: DateTime<Utc>,
    pub(super) previous: Option<DateTime<Utc>>,
    pub(super) next: Option<DateTime<Utc>>,
    /// A catch-up ([`super::catch_up`]): claims `occurrence` itself, never
    /// an older missed one (`misfire = "skip"` to the store; with
    /// `at_least_once` the one before it may be redelivered first), naming
    /// `previous` so the occurrences before it nobody claimed are recorded.
    pub(super) catch_up_only: bool,
    /// Each live node's count of leases given up, as this node's view had
    /// it before any claim of this occurrence was sent: what a follower
    /// keeps with its belief in the holder ([`super::progress`]).
    pub(super) released_seen: Arc<std::collections::BTreeMap<String, u64>>,
}

/// A claim the scheduler already queued for a handler, with the job's gate.
pub(super) struct Queued {
    gate: OwnedMutexGuard<()>,
    answer: Pending<(ClaimOutcome, DateTime<Utc>)>,
    sent: Instant,
}

/// Where an occurrence's claim loop goes after a step.
enum Flow {
    /// Claim again (after whatever wait the step took).
    Again,
    /// Over; true when it gave up with a claim still unanswered.
    Done(bool),
}

/// The claim loop's state for one occurrence.
struct Attempts {
    /// The gap to the next occurrence.
    gap: Duration,
    /// The occurrence's window ends here: the next one is due, or its
    /// `starting_deadline` is over.
    give_up_at: Instant,
    /// `starting_deadline` ends the window, before the next occurrence.
    deadline: bool,
    /// With a claim unanswered, retrying ends a little before the next
    /// occurrence: the recheck must reach the store before that
    /// occurrence's claim does (which would record over it).
    recheck_at: Instant,
    backoff: Duration,
    /// Earliest send of a claim whose answer never came: it may have won.
    unanswered: Option<Instant>,
    reported_failure: bool,
}

impl Attempts {
    /// For an occurrence at `instant` with `gap` to the next one, that may
    /// start within `window` ([`start_window`]).
    fn new(instant: Instant, gap: Duration, (window, deadline): (Duration, bool)) -> Self {
        let give_up_at = instant + window;
        Attempts {
            gap,
            give_up_at,
            deadline,
            recheck_at: give_up_at
                .checked_sub(RECHECK_LEAD.min(window / 4))
                .unwrap_or(give_up_at),
            backoff: Duration::from_millis(100),
            unanswered: None,
            reported_failure: false,
        }
    }

    /// When claiming stops: the window's end, earlier with a claim
    /// unanswered.
    fn window_end(&self) -> Instant {
        if self.unanswered.is_some() {
            self.recheck_at
        } else {
            self.give_up_at
        }
    }

    /// Giving up: say whether a claim was left unanswered.
    fn gave_up(&self) -> Flow {
        Flow::Done(self.unanswered.is_some())
    }
}

impl Node {
    /// The monotonic instant at which the wall clock will show (or
    /// showed) `t`.
    pub(super) fn instant_of(&self, t: DateTime<Utc>) -> Instant {
        let now = Instant::now();
        let wall = self.wall.now();
        match (t - wall).to_std() {
            Ok(ahead) => now + ahead,
            // In the past: so long ago (a catch-up's occurrence), as far as
            // this clock reaches back.
            Err(_) => (wall - t)
                .to_std()
                .ok()
                .and_then(|behind| now.checked_sub(behind))
                .unwrap_or(now),
        }
    }

    /// The node's one timer: wakes at each instant some job is due and
    /// claims all of them together.
    pub(super) async fn scheduler(self: Arc<Self>) {
        loop {
            self.beat.last.store(
                self.beat.epoch.elapsed().as_millis() as u64,
                Ordering::Relaxed,
            );
            let next = self.next_instant();
            self.beat.next_due_ms.store(
                next.map_or(i64::MAX, |at| at.timestamp_millis()),
                Ordering::Relaxed,
            );
            let wake = match next {
                Some(at) => self.instant_of(at).min(Instant::now() + MAX_SLEEP),
                None => Instant::now() + MAX_SLEEP,
            };
            tokio::select! {
                () = self.life.claims.cancelled() => return,
                () = self.jobs_changed.notified() => continue,
                () = tokio::time::sleep_until(wake) => {}
            }
            let now = self.wall.now();
            let due = self.take_due(now);
            // A broadcast job's shards are requested right after its
            // instant: the trigger watcher looks often for a while.
            if let Some(d) = due.iter().find(|d| d.state.job().every_node) {
                self.beat
                    .broadcast_ms
                    .store(d.occurrence.timestamp_millis(), Ordering::Relaxed);
            }
            if let Some(d) = due.first() {
                tracing::debug!(
                    due = due.len(),
                    late_ms = (now - d.occurrence).num_milliseconds(),
                    "instant: claiming"
                );
            }
            if !due.is_empty() {
                self.claim_instant(due);
            }
        }
    }

    /// The earliest next occurrence of any job.
    pub(super) fn next_instant(&self) -> Option<DateTime<Utc>> {
        self.jobs.lock().ok()?.next_instant()
    }

    /// Takes every occurrence due at `now` off the schedule. A job woken
    /// late (a paused process, a suspended VM) claims only its latest due
    /// occurrence; the store's misfire rule covers the rest, and a stale
    /// occurrence is never started.
    pub(super) fn take_due(&self, now: DateTime<Utc>) -> Vec<Due> {
        let Ok(mut jobs) = self.jobs.lock() else {
            return Vec::new();
        };
        let mut due = Vec::new();
        for (name, mut occurrence) in jobs.take_due(now) {
            let Some(entry) = jobs.get(&name) else {
                continue;
            };
            let job = entry.state.job();
            let schedule = &job.schedule;
            while let Some(next) = schedule.next_after(occurrence).filter(|n| *n <= now) {
                occurrence = next;
            }
            let next = schedule.next_after(occurrence);
            if next.is_none() {
                tracing::warn!(job = %name, "the schedule has no further occurrence");
            }
            due.push(Due {
                state: entry.state.clone(),
                stop: entry.handlers_stop.clone(),
                occurrence,
                previous: schedule.previous_before(occurrence),
                next,
                catch_up_only: false,
                released_seen: Arc::default(),
            });
            jobs.requeue(name, next);
        }
        due
    }

    /// Sends the claims of one instant as one batch and starts a handler
    /// per occurrence with its answer to come. Jobs that cannot be claimed
    /// right now (claiming paused, clock out of bounds, store not prepared,
    /// a claim of the job still in flight) go to their handler without a
    /// queued claim: it waits and claims on its own.
    pub(super) fn claim_instant(self: &Arc<Self>, mut due: Vec<Due>) {
        let seen = self.released_seen();
        for d in &mut due {
            d.released_seen = seen.clone();
        }
        let ready = self.ready_to_claim();
        let sent = Instant::now();
        // [0]: jobs this node holds or has not seen held, sent at once;
        // [1]: jobs another node held, sent FOLLOWER_LEAD later;
        // [2]: with `spread`, jobs another live node is preferred for and
        // does not hold, sent after the head start and DEFERRED_LAG (see
        // `Deferral`); [3]: jobs a step-down gave up, after YIELDED_LAG.
        let mut requests = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        let mut gates = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        let mut queued_for = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        let view = self.placement_view();
        // Occurrences left to their live holder ([`super::progress`]): not
        // claimed unless the registry says otherwise.
        let left = if ready {
            self.to_leave(&due)
        } else {
            due.iter().map(|_| None).collect()
        };
        for (i, d) in due.iter().enumerate() {
            if !ready {
                break;
            }
            if left[i].is_some() {
                continue;
            }
            let Ok(gate) = d.state.claim_gate.clone().try_lock_owned() else {
                continue;
            };
            let group = match view.as_deref() {
                // Given up by a step-down: a live peer takes it first
                // (unless its window would be over by then).
                _ if d.state.yielded()
                    && self.settings.head_start + YIELDED_LAG * 2
                        < start_window(&d.state.job(), d.occurrence, d.next).0 =>
                {
                    3
                }
                Some(view) => {
                    let holder = d.state.holder();
                    match self.deferral_in(&d.state.job(), holder.as_deref(), Some(view)) {
                        Deferral::AtOnce => 0,
                        Deferral::BehindHolder => 1,
                        Deferral::BehindHeadStart => 2,
                    }
                }
                None => usize::from(d.state.follows()),
            };
            requests[group].push(self.request(
                &d.state,
                d.occurrence,
                d.previous,
                d.next,
                false,
                d.catch_up_only,
            ));
            gates[group].push(gate);
            queued_for[group].push(i);
        }
        let mut queued: Vec<Option<Queued>> = due.iter().map(|_| None).collect();
        let [first, later, deferred, yielded] = requests;
        let answers = [
            self.batch.claims.submit(first),
            self.batch.claims.submit_after(later, FOLLOWER_LEAD),
            self.batch
                .claims
                .submit_after(deferred, self.settings.head_start + DEFERRED_LAG),
            self.batch
                .claims
                .submit_after(yielded, self.settings.head_start + YIELDED_LAG),
        ];
        for ((indices, gates), answers) in queued_for.into_iter().zip(gates).zip(answers) {
            for ((i, gate), answer) in indices.into_iter().zip(gates).zip(answers) {
                // `sent` before the lead: the lease counts from no later
                // than the real send, so the local deadline stays safe.
                queued[i] = Some(Queued { gate, answer, sent });
            }
        }
        // Until decided, this node's beats say its claims of this instant
        // are not: every mark first, so the instant's count of held jobs is
        // whole when an early answer comes.
        let marks: Vec<Option<Mark>> = due
            .iter()
            .zip(&left)
            .map(|(d, left)| {
                left.is_none()
                    .then(|| self.progress.mark(d.occurrence, d.state.holds()))
            })
            .collect();
        let mut left_to_holders = Vec::new();
        for (((d, queued), left), mark) in due.into_iter().zip(queued).zip(left).zip(marks) {
            if let Some(left) = left {
                left_to_holders.push((left, d));
                continue;
            }
            // Spawned as it is: a wrapping block would hold its arguments
            // a second time in every claim in flight.
            self.life
                .handlers
                .spawn(self.clone().handle_occurrence(d, queued, mark));
        }
        self.leave_to_holders(left_to_holders);
    }

    /// Whether this node claims now: not stepped down, its clock within
    /// bounds, the store prepared. (A node that is not yet claims nothing,
    /// scheduled or manual.)
    pub(super) fn ready_to_claim(&self) -> bool {
        self.paused_until().is_none()
            && !self.clock.skewed()
            && self.prepare.done.load(Ordering::SeqCst)
    }

    /// The claim of `occurrence` as this node sends it now (`only`: a
    /// catch-up's, [`Due::catch_up_only`]).
    fn request(
        &self,
        state: &JobState,
        occurrence: DateTime<Utc>,
        previous: Option<DateTime<Utc>>,
        next: Option<DateTime<Utc>>,
        after_unanswered: bool,
        only: bool,
    ) -> ClaimRequest {
        let job = state.job();
        ClaimRequest {
            job: job.name.clone(),
            occurrence,
            previous,
            before_previous: previous.and_then(|p| job.schedule.previous_before(p)),
            misfire: if only { Misfire::Skip } else { job.misfire },
            owner: self.owner.clone(),
            lease: self.lease_for(occurrence, next),
            fence_floor: state.fence_floor(),
            max_offset: self.clock.bound(),
            head_start: Some(self.settings.head_start),
            after_unanswered,
            recheck_only: false,
            // The next occurrence (a minute on when there is none) or the
            // end of the starting deadline, plus the clock bound: a node
            // whose clock lags the store's within the bound still claims
            // the whole of its window.
            window_end: chrono::TimeDelta::from_std(start_window(&job, occurrence, next).0)
                .ok()
                .and_then(|window| occurrence.checked_add_signed(window))
                .and_then(|end| {
                    chrono::TimeDelta::from_std(self.clock.bound())
                        .ok()
                        .and_then(|bound| end.checked_add_signed(bound))
                }),
            manual: None,
            redeliver: job.delivery == Delivery::AtLeastOnce,
        }
    }

    /// lease = time to the next occurrence + margin.
    pub(super) fn lease_for(
        &self,
        occurrence: DateTime<Utc>,
        next: Option<DateTime<Utc>>,
    ) -> Duration {
        gap(occurrence, next) + self.settings.margin
    }

    /// Claims one occurrence until it is claimed by someone or the next is
    /// due, starting from the claim the scheduler queued, if it did. When
    /// its window closes on a claim that never got an answer, asks once
    /// whether that claim won ([`Node::recheck_unanswered`]).
    pub(super) async fn handle_occurrence(
        self: Arc<Self>,
        due: Due,
        queued: Option<Queued>,
        mark: Option<Mark>,
    ) {
        let (state, stop) = (due.state.clone(), due.stop.clone());
        let (occurrence, previous, next, only) =
            (due.occurrence, due.previous, due.next, due.catch_up_only);
        let gave_up_unanswered = self.claim_occurrence(due, queued, mark).await;
        if gave_up_unanswered && !stop.is_cancelled() {
            Box::pin(self.recheck_unanswered(&state, &stop, occurrence, previous, next, only))
                .await;
        }
    }

    /// The occurrence's window closed while a claim of it was unanswered:
    /// the store may have granted it, and peers leave an occurrence claimed
    /// by this node alone. A recheck asks without taking anything; a win
    /// found now is too late to run, so it is recorded `lease_lost` (as a
    /// run whose lease could not be proven at its start), never lost
    /// silently. Not sent once the node stops.
    pub(super) async fn recheck_unanswered(
        &self,
        state: &JobState,
        stop: &CancellationToken,
        occurrence: DateTime<Utc>,
        previous: Option<DateTime<Utc>>,
        next: Option<DateTime<Utc>>,
        only: bool,
    ) {
        // Under the job's claim gate, like every claim of the job: no other
        // claim of it is in flight meanwhile, and the request's fence floor
        // counts every fence this node won before. Sent beside a claim
        // whose answer was still to come, a recheck found that claim's win
        // (the next occurrence's retry, handed the unanswered win again as
        // its catch-up) and recorded the fence being run as `lease_lost`:
        // the record ended the run's lease and a peer ran the next
        // occurrence beside it (an overlap under flapping partitions).
        let gate = tokio::select! {
            () = stop.cancelled() => return,
            gate = state.claim_gate.lock() => gate,
        };
        if stop.is_cancelled() {
            return;
        }
        let mut request = self.request(state, occurrence, previous, next, true, only);
        request.recheck_only = true;
        let answer =
            tokio::time::timeout(self.settings.op_timeout, self.batch.claims.call(request)).await;
        let job = state.job();
        match answer {
            Ok(Ok((ClaimOutcome::Won(won), answered))) => {
                state.saw_fence(won.fence);
                drop(gate);
                // It holds the lease: a follower that lost to it leaves the
                // job to it (docs/protocol.md, "Followers leave held jobs to
                // their holder"), so it must claim the next occurrence.
                state.note_standing(Standing::Holder, won.fence);
                let decision_ms = (answered - occurrence).num_milliseconds().max(0) as u64;
                tracing::warn!(job = %job.name, fence = won.fence, occurrence = %Rfc3339(won.occurrence), "a claim answered only after its occurrence was over: not run, recorded as lease_lost");
                self.record(
                    state,
                    self.ticket(&won, decision_ms),
                    Finished::without_process(Outcome::LeaseLost, self.wall.now()),
                )
                .await;
            }
            Ok(Ok((ClaimOutcome::Lost(lost), _))) => state.saw_fence(lost.fence),
            Ok(Ok((ClaimOutcome::Failed(_), _))) => {}
            Ok(Err(e)) => {
                tracing::warn!(job = %job.name, occurrence = %Rfc3339(occurrence), "a claim of this occurrence went unanswered and cannot be checked ({e}): if it won, the occurrence did not run")
            }
            Err(_) => {
                tracing::warn!(job = %job.name, occurrence = %Rfc3339(occurrence), "a claim of this occurrence went unanswered and cannot be checked (timed out): if it won, the occurrence did not run")
            }
        }
    }

    /// The claim loop of [`Node::handle_occurrence`]: true when it gave up
    /// (the next occurrence due, or stopped) with a claim still unanswered.
    /// Each turn sends a claim (or takes the one the scheduler queued),
    /// awaits its answer, and acts on it: [`Node::send_claim`],
    /// [`Node::await_claim`], [`Node::on_won`], [`Node::on_lost`].
    /// `mark` (this node's claim of a scheduled occurrence, for its beats'
    /// progress) is dropped once the store decided the occurrence: won, or
    /// lost for good. Given up without a decision (the window over on this
    /// node's clock, store errors, stopped), it counts as a lease given up
    /// ([`super::progress`]): a follower that left the occurrence to this
    /// node claims it.
    async fn claim_occurrence(
        self: &Arc<Self>,
        due: Due,
        queued: Option<Queued>,
        mut mark: Option<Mark>,
    ) -> bool {
        let mut decided = false;
        let unanswered = self
            .claim_occurrence_loop(due, queued, &mut mark, &mut decided)
            .await;
        if mark.is_some() && !decided {
            self.progress.releasing();
        }
        unanswered
    }

    /// The loop of [`Node::claim_occurrence`]; `decided` once the store
    /// decided the occurrence, when `mark` is dropped.
    async fn claim_occurrence_loop(
        self: &Arc<Self>,
        due: Due,
        mut queued: Option<Queued>,
        mark: &mut Option<Mark>,
        decided: &mut bool,
    ) -> bool {
        let mut at = Attempts::new(
            self.instant_of(due.occurrence),
            gap(due.occurrence, due.next),
            start_window(&due.state.job(), due.occurrence, due.next),
        );
        loop {
            // A claim already queued is always awaited: a claim the store
            // granted must not be dropped unrun. It ends within op_timeout.
            let claim = match queued.take() {
                Some(q) => q,
                None => match self.send_claim(&due, &mut at).await {
                    Ok(q) => q,
                    Err(Flow::Again) => continue,
                    Err(Flow::Done(unanswered)) => return unanswered,
                },
            };
            let sent = claim.sent;
            let (gate, outcome, answered) = match self.await_claim(&due, &mut at, claim).await {
                Ok(answer) => answer,
                Err(Flow::Again) => continue,
                Err(Flow::Done(unanswered)) => return unanswered,
            };
            at.backoff = Duration::from_millis(100);
            if let ClaimOutcome::Won(won) = &outcome
                && !won.catch_up
                && won.occurrence == due.occurrence
            {
                // This occurrence is this node's: say so at once.
                *decided = true;
                drop(mark.take());
            }
            let answered_for_good = !matches!(outcome, ClaimOutcome::Failed(_));
            let decision_ms = self.count_answer(&due, &outcome, answered);
            let flow = match outcome {
                ClaimOutcome::Won(won) => {
                    self.on_won(&due, &mut at, gate, won, sent, decision_ms)
                        .await
                }
                ClaimOutcome::Lost(lost) => {
                    self.on_lost(&due, &mut at, gate, lost, decision_ms).await
                }
                ClaimOutcome::Failed(_) => Flow::Again,
            };
            match flow {
                Flow::Again => continue,
                Flow::Done(unanswered) => {
                    *decided |= answered_for_good;
                    return unanswered;
                }
            }
        }
    }

    /// Sends a claim of the occurrence, holding the job's claim gate, unless
    /// the node is paused, its clock out of bounds or the store unprepared
    /// (each waited on within the window).
    async fn send_claim(self: &Arc<Self>, due: &Due, at: &mut Attempts) -> Result<Queued, Flow> {
        let (state, stop) = (&due.state, &due.stop);
        if stop.is_cancelled() || Instant::now() >= at.window_end() {
            return Err(at.gave_up());
        }
        let gate = state.claim_gate.clone().lock_owned().await;
        if let Some(until) = self.paused_until() {
            drop(gate);
            if !self.sleep_within(until, at.window_end(), stop).await {
                return Err(at.gave_up());
            }
            return Err(Flow::Again);
        }
        if state.yielded() {
            // Given up by a step-down: a live peer takes it first.
            let after = chrono::TimeDelta::from_std(self.settings.head_start + YIELDED_LAG)
                .unwrap_or_default();
            let wait = (due.occurrence + after - self.wall.now())
                .to_std()
                .unwrap_or_default();
            // A window shorter than the head start: claimed now, never
            // given up for the deferral's sake.
            let until = Instant::now() + wait;
            if !wait.is_zero() && until + YIELDED_LAG < at.window_end() {
                drop(gate);
                if !self.sleep_within(until, at.window_end(), stop).await {
                    return Err(at.gave_up());
                }
                return Err(Flow::Again);
            }
        }
        if self.clock.skewed() && !self.recheck_clock().await {
            // Out of bounds: claim nothing, look again shortly.
            drop(gate);
            let retry_at = (Instant::now() + CLOCK_RECHECK).min(at.window_end());
            if !self.sleep_within(retry_at, at.window_end(), stop).await {
                return Err(at.gave_up());
            }
            return Err(Flow::Again);
        }
        let prepared = tokio::select! {
            () = stop.cancelled() => return Err(at.gave_up()),
            r = self.ensure_prepared() => r,
        };
        // Taken after any migration wait: the claim's own round trip times
        // the lease.
        let sent = Instant::now();
        let request = self.request(
            state,
            due.occurrence,
            due.previous,
            due.next,
            at.unanswered.is_some(),
            due.catch_up_only,
        );
        let answer = match prepared {
            Ok(()) => self.batch.claims.submit(vec![request]).pop(),
            Err(_) => None,
        };
        match answer {
            Some(answer) => Ok(Queued { gate, answer, sent }),
            None => {
                drop(gate);
                self.count_claim(&state.job().name, "error");
                Err(self.retry_in_window(at, stop).await)
            }
        }
    }

    /// A claim's answer: the outcome (with the gate still held) or, for a
    /// failed claim or a store error, the retry after a backoff.
    async fn await_claim(
        &self,
        due: &Due,
        at: &mut Attempts,
        claim: Queued,
    ) -> Result<(OwnedMutexGuard<()>, ClaimOutcome, DateTime<Utc>), Flow> {
        let job = due.state.job();
        let Queued { gate, answer, sent } = claim;
        match batch::answer(answer).await {
            Ok((ClaimOutcome::Failed(reason), _)) => {
                drop(gate);
                // This job's row only: the rest of the batch was decided.
                if !at.reported_failure {
                    tracing::error!(job = %job.name, occurrence = %Rfc3339(due.occurrence), "claim failed: {reason}");
                    at.reported_failure = true;
                }
                self.count_claim(&job.name, "error");
                Err(self.retry_in_window(at, &due.stop).await)
            }
            Ok((outcome, answered)) => Ok((gate, outcome, answered)),
            Err(e) => {
                drop(gate);
                if matches!(e, StoreError::NotMigrated { .. }) {
                    self.prepare.done.store(false, Ordering::SeqCst);
                }
                // Whatever the error, the store may have applied the claim
                // before it (a reply lost, a script that failed after some
                // writes): the retry says so, and the store answers a win
                // of ours again rather than refuse it.
                at.unanswered.get_or_insert(sent);
                self.count_claim(&job.name, "error");
                Err(self.retry_in_window(at, &due.stop).await)
            }
        }
    }

    /// Sleeps for the backoff (doubling it, up to 1 s) and claims again,
    /// unless the window ends first: then it sleeps until it does and gives
    /// up.
    async fn retry_in_window(&self, at: &mut Attempts, stop: &CancellationToken) -> Flow {
        let window_end = at.window_end();
        let retry_at = Instant::now() + at.backoff;
        at.backoff = (at.backoff * 2).min(Duration::from_secs(1));
        if retry_at >= window_end {
            // No retry fits: wait out the window anyway, so whatever comes
            // after it (a recheck of an unanswered claim) is sent as late,
            // and as likely to be answered, as it can be.
            tokio::select! {
                () = stop.cancelled() => {}
                () = tokio::time::sleep_until(window_end) => {}
            }
            return at.gave_up();
        }
        if self.sleep_within(retry_at, window_end, stop).await {
            Flow::Again
        } else {
            at.gave_up()
        }
    }

    /// Counts an answer (`cronlease_claims_total`, the decision time) and
    /// returns the decision time: from the instant to the store's answer.
    fn count_answer(&self, due: &Due, outcome: &ClaimOutcome, answered: DateTime<Utc>) -> u64 {
        let decision_ms = (answered - due.occurrence).num_milliseconds().max(0) as u64;
        self.metrics
            .claim_decision
            .observe(decision_ms as f64 / 1000.0);
        let result = match outcome {
            ClaimOutcome::Won(w) if w.catch_up => "caught_up",
            ClaimOutcome::Won(_) => "won",
            ClaimOutcome::Lost(l) if l.paused => "paused",
            ClaimOutcome::Lost(l) if l.stale => "stale",
            ClaimOutcome::Lost(l) if l.too_early => "too_early",
            ClaimOutcome::Lost(_) => "lost",
            ClaimOutcome::Failed(_) => "error",
        };
        self.count_claim(&due.state.job().name, result);
        // Scheduled claims only: a manual run is claimed while its job is
        // paused, and says nothing of the pause.
        self.metrics
            .claim_result(due.state.job().name.as_str(), result);
        decision_ms
    }

    /// A won claim: too late to run (recorded), a missed occurrence caught
    /// up first, skipped as an overlap, or run.
    async fn on_won(
        self: &Arc<Self>,
        due: &Due,
        at: &mut Attempts,
        gate: OwnedMutexGuard<()>,
        won: Won,
        sent: Instant,
        decision_ms: u64,
    ) -> Flow {
        let (state, stop) = (&due.state, &due.stop);
        let job = state.job();
        state.saw_fence(won.fence);
        self.record_unclaimed(state, &won, decision_ms);
        if Instant::now() >= at.give_up_at {
            // Answered after the occurrence's window (it waited behind a
            // stalled store): too late to run, and running it would push
            // out the occurrence due now. Recorded, so the win is not lost
            // silently (docs/protocol.md, "Claims answered late").
            drop(gate);
            state.note_standing(Standing::Holder, won.fence);
            let late_ms = (self.wall.now() - due.occurrence).num_milliseconds();
            let (outcome, why) = if at.deadline {
                (
                    Outcome::Missed,
                    format!(
                        "the claim was answered {late_ms} ms after the instant, past starting_deadline ({})",
                        humantime::format_duration(job.starting_deadline.unwrap_or_default())
                    ),
                )
            } else {
                (
                    Outcome::LeaseLost,
                    format!(
                        "the claim was answered {late_ms} ms after the instant, after the occurrence's window"
                    ),
                )
            };
            self.record_not_run(state, self.ticket(&won, decision_ms), outcome, why);
            return Flow::Done(false);
        }
        // A retried claim that won earlier: its lease counts from the first
        // send.
        state.lease_granted(
            at.unanswered.unwrap_or(sent).min(sent),
            self.lease_for(due.occurrence, due.next),
        );
        state.note_standing(Standing::Holder, won.fence);
        let ticket = self.ticket(&won, decision_ms);
        let late = (self.wall.now() - won.occurrence)
            .to_std()
            .unwrap_or_default();
        // The missed occurrence's own window: its deadline, at most the gap
        // to the occurrence claimed now.
        let missed_window = start_window(&job, won.occurrence, Some(due.occurrence)).0;
        if won.catch_up
            && let Some(why) = catch_up_refused(
                &job,
                &won,
                late,
                missed_window,
                self.wall.now() - due.occurrence,
                at.gap,
            )
        {
            // A missed (or redelivered) occurrence the store handed out,
            // too late to start: recorded, and the occurrence itself is
            // claimed now.
            drop(gate);
            self.record_not_run(state, ticket, Outcome::Missed, why);
            at.unanswered = None;
            return Flow::Again;
        }
        if won.catch_up {
            if won.redelivered {
                tracing::warn!(job = %job.name, fence = won.fence, occurrence = %Rfc3339(won.occurrence), "its holder died before recording its run: running it again (delivery = at_least_once)");
            } else {
                tracing::info!(job = %job.name, fence = won.fence, missed = %Rfc3339(won.occurrence), "catching up a missed occurrence");
            }
            self.after_manual_run(state, won.fence, at.give_up_at, stop)
                .await;
            let started = self.start_run(state, ticket).is_some();
            drop(gate);
            if started {
                // The missed run goes first; the occurrence itself is
                // claimed when its process is over (no overlap).
                tokio::select! {
                    () = stop.cancelled() => return Flow::Done(false),
                    () = state.until_idle() => {}
                }
            }
            at.unanswered = None;
            return Flow::Again;
        }
        if job.overlap == crate::config::Overlap::Replace && state.is_running() {
            // overlap = "replace": the run going (scheduled or manual) is
            // stopped, and this occurrence starts once its process is over.
            // The claim gate is held meanwhile, and the lease this claim
            // renewed covers the wait.
            let said = format!(
                "cronlease: replaced by the occurrence of {} (fence {})",
                Rfc3339(ticket.occurrence),
                ticket.fence
            );
            tracing::warn!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), "previous run still going: stopping it (overlap = replace)");
            loop {
                // Thrown again until the run is over: a run marked going
                // whose stop switch was not set up yet is stopped too.
                self.replace_runs_of(job.name.as_str(), &said);
                tokio::select! {
                    () = stop.cancelled() => {
                        drop(gate);
                        self.record_not_run(
                            state,
                            ticket,
                            Outcome::Skipped,
                            "the node stopped claiming the job while the run it replaces was ending".into(),
                        );
                        return Flow::Done(false);
                    }
                    () = tokio::time::sleep_until(at.give_up_at) => {
                        drop(gate);
                        self.record_not_run(
                            state,
                            ticket,
                            Outcome::Missed,
                            "the run it replaces did not end within this occurrence's window".into(),
                        );
                        return Flow::Done(false);
                    }
                    () = state.until_idle() => break,
                    () = tokio::time::sleep(REPLACE_AGAIN) => {}
                }
            }
            self.start_run(state, ticket);
            drop(gate);
            return Flow::Done(false);
        }
        self.after_manual_run(state, won.fence, at.give_up_at, stop)
            .await;
        if state.is_running() {
            // overlap = "skip": the previous run is still going at this
            // instant. Skip this occurrence now (keeping the lease this
            // claim renewed) rather than start it late and push every later
            // run back.
            drop(gate);
            Box::pin(self.skip_occurrence(state, ticket)).await;
            return Flow::Done(false);
        }
        self.start_run(state, ticket);
        drop(gate);
        Flow::Done(false)
    }

    /// A lost claim: paused, stale, too early by the store's clock, claimed
    /// already (by this node's unanswered claim, perhaps), or held by a live
    /// lease, waited out for a takeover within the window.
    async fn on_lost(
        self: &Arc<Self>,
        due: &Due,
        at: &mut Attempts,
        gate: OwnedMutexGuard<()>,
        lost: Lost,
        decision_ms: u64,
    ) -> Flow {
        let (state, stop, occurrence) = (&due.state, &due.stop, due.occurrence);
        let job = state.job();
        drop(gate);
        state.saw_fence(lost.fence);
        if lost.paused {
            // `cronlease pause`: no node claims it, so there is no lease to
            // wait out. With `misfire = "run_once"`, `resume` catches the
            // latest refused occurrence up at once, or the next claim does
            // (docs/protocol.md, "Catch-up on resume").
            tracing::debug!(job = %job.name, occurrence = %Rfc3339(occurrence), "job paused; occurrence not claimed");
            return Flow::Done(false);
        }
        if lost.stale {
            // The store decided it after the window: nothing won, nothing
            // written; the next occurrence is claimed on its own.
            tracing::info!(job = %job.name, occurrence = %Rfc3339(occurrence), "the store answered this claim only after the occurrence's window: not run");
            return Flow::Done(false);
        }
        if lost.too_early {
            // The store's clock has not reached this occurrence: ours runs
            // ahead. The offset reading holds claims back while it is out
            // of bounds; try again shortly. (An earlier unanswered claim
            // did not win: the store said so.)
            at.unanswered = None;
            tracing::debug!(job = %job.name, occurrence = %Rfc3339(occurrence), "refused by the store: occurrence not due yet by its clock");
            let retry_at = (Instant::now() + CLOCK_RECHECK).min(at.give_up_at);
            if !self.sleep_within(retry_at, at.give_up_at, stop).await {
                return Flow::Done(false);
            }
            return Flow::Again;
        }
        if lost.last_occurrence.is_some_and(|last| last >= occurrence) {
            return self.claimed_already(due, at, lost, decision_ms);
        }
        state.note_follower(
            lost.holder.clone(),
            released_seen(due, lost.holder.as_deref()),
            lost.fence,
        );
        // Another owner's live lease: wait it out and try again (an earlier
        // unanswered claim did not win).
        at.unanswered = None;
        // (Sooner where the store can end it early.)
        let mut wait = match self.store.recheck_within() {
            Some(within) if within < lost.remaining => within,
            _ => lost.remaining.max(Duration::from_millis(10)) + EXPIRY_SLACK,
        };
        // An idle holder keeps the occurrence only for its head start
        // (store time, counted from the reply's arrival, which comes after
        // the store read its clock).
        if let Some(idle_wait) = lost.idle_wait {
            wait = wait.min(idle_wait + Duration::from_millis(1));
        }
        let retry_at = Instant::now() + wait;
        // A takeover that could only start in the last stretch of the
        // window is left to the next occurrence's claim, which catches this
        // one up first (misfire = "run_once") and then runs in order.
        // Started this late, it would still be going when the next
        // occurrence is due, and that one would be skipped (overlap =
        // "skip").
        let tail = (at.gap / 10).min(TAKEOVER_TAIL);
        if retry_at + tail >= at.give_up_at {
            tracing::debug!(job = %job.name, occurrence = %Rfc3339(occurrence), "lease outlasts this occurrence; leaving it");
            return Flow::Done(false);
        }
        tracing::debug!(job = %job.name, occurrence = %Rfc3339(occurrence), holder = lost.holder.as_deref(), remaining_ms = lost.remaining.as_millis() as u64, "lease held; retrying in {wait:?}");
        tokio::select! {
            go = self.sleep_within(retry_at, at.give_up_at, stop) => {
                if !go {
                    return Flow::Done(false);
                }
            }
            () = self.store.lease_freed(&job.name) => {
                tracing::debug!(job = %job.name, occurrence = %Rfc3339(occurrence), "lease released; claiming again");
            }
        }
        Flow::Again
    }

    /// Refused because the occurrence is claimed already: by this node's
    /// claim whose reply was lost (run it now), or by another (follow it).
    fn claimed_already(
        self: &Arc<Self>,
        due: &Due,
        at: &Attempts,
        lost: Lost,
        decision_ms: u64,
    ) -> Flow {
        let (state, occurrence) = (&due.state, due.occurrence);
        let ours = lost.holder.as_deref() == Some(self.owner.as_str());
        if ours
            && lost.last_occurrence == Some(occurrence)
            && let Some(first_send) = at.unanswered
        {
            // A claim whose reply was lost did win (a store that
            // answered "claimed" before it knew the retry rule): run
            // it, with the lease counted from that first send.
            tracing::info!(job = %state.job().name, fence = lost.fence, "an unanswered claim had won: running it");
            state.lease_granted(first_send, self.lease_for(occurrence, due.next));
            state.note_standing(Standing::Holder, lost.fence);
            let won = Won {
                fence: lost.fence,
                occurrence,
                catch_up: false,
                previous_owner: None,
                redelivered: false,
                unclaimed_after: None,
            };
            self.start_run(state, self.ticket(&won, decision_ms));
            return Flow::Done(false);
        }
        // The store names the holder; this node, when it is that holder,
        // claims the next occurrence itself.
        if ours {
            state.note_standing(Standing::Holder, lost.fence);
        } else {
            state.note_follower(
                lost.holder.clone(),
                released_seen(due, lost.holder.as_deref()),
                lost.fence,
            );
        }
        Flow::Done(false)
    }

    /// A manual run never costs a scheduled occurrence (docs/protocol.md,
    /// "Manual runs"): one won while a manual run of the job goes starts
    /// when that run ends, within the occurrence's window (`until`).
    async fn after_manual_run(
        &self,
        state: &JobState,
        fence: u64,
        until: Instant,
        stop: &CancellationToken,
    ) {
        if !state.manual_running() {
            return;
        }
        tracing::info!(job = %state.job().name, fence, "a manual run is going: this occurrence starts when it ends");
        tokio::select! {
            () = stop.cancelled() => {}
            () = state.until_idle() => {}
            () = tokio::time::sleep_until(until) => {}
        }
    }

    /// Counts one claim attempt in `cronlease_claims_total{cron_job,result}`.
    pub(super) fn count_claim(&self, job: &JobName, result: &str) {
        self.metrics
            .claims
            .get_or_create(&ClaimLabel {
                cron_job: job.to_string(),
                result: result.into(),
            })
            .inc();
    }

    fn ticket(&self, won: &Won, decision_ms: u64) -> RunTicket {
        RunTicket {
            fence: won.fence,
            occurrence: won.occurrence,
            decision_ms,
            takeover: won
                .previous_owner
                .as_deref()
                .is_some_and(|p| p != self.owner.as_str()),
            // A redelivery (at_least_once) is told so, as a hand-back's
            // is (`CRONLEASE_REDELIVERY=1`, `redelivered` in history): the
            // mark lives on this node only.
            trigger: if won.redelivered {
                TriggerId::redelivery(won.occurrence, 1, 1)
            } else {
                None
            },
        }
    }

    /// Sleeps until `until` unless `limit` or `stop` comes first; true when
    /// the caller should go on.
    async fn sleep_within(&self, until: Instant, limit: Instant, stop: &CancellationToken) -> bool {
        if until >= limit {
            return false;
        }
        tokio::select! {
            () = stop.cancelled() => false,
            () = tokio::time::sleep_until(until) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::store::from_ms;

    fn won(redelivered: bool) -> Won {
        Won {
            fence: 8,
            occurrence: from_ms(19_000),
            catch_up: true,
            redelivered,
            previous_owner: None,
            unclaimed_after: None,
        }
    }

    #[test]
    fn a_catch_up_is_refused_past_its_deadline_or_when_it_would_push_the_next_one_out() {
        let mut job = crate::config::test_job("j", "* * * * * *", "true");
        let (sec, ms) = (Duration::from_secs(1), chrono::TimeDelta::milliseconds);
        // Claimed at the next occurrence's instant: run first.
        assert_eq!(
            catch_up_refused(&job, &won(false), sec, sec, ms(10), sec),
            None
        );
        // More than half of the next occurrence's gap gone: that one runs.
        let why = catch_up_refused(&job, &won(false), sec, sec, ms(700), sec).unwrap();
        assert!(why.contains("700 ms after that one's instant"), "{why}");
        // A redelivery (at_least_once) runs all the same.
        assert_eq!(
            catch_up_refused(&job, &won(true), sec, sec, ms(700), sec),
            None
        );
        // Past its starting_deadline: refused, a redelivery too.
        job.starting_deadline = Some(Duration::from_millis(500));
        let half = Duration::from_millis(500);
        for redelivered in [false, true] {
            let why = catch_up_refused(&job, &won(redelivered), sec, half, ms(10), sec).unwrap();
            assert!(why.contains("past starting_deadline (500ms"), "{why}");
            assert_eq!(why.contains("at_least_once"), redelivered, "{why}");
        }
    }
}
