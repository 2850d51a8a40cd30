//! Claiming: the per-job loop that waits for each occurrence, and the
//! per-occurrence handler that claims it (docs/protocol.md).
//!
//! A handler claims its occurrence once at the scheduled instant. If another
//! owner holds a live lease and has not claimed this occurrence, it waits for
//! the remaining lease the store reported (counted from when the reply came,
//! on the monotonic clock) and claims again: that is the takeover of a dead
//! holder within one margin. It gives up when some node has claimed the
//! occurrence or the next one is due. Store errors are retried with backoff
//! within the same window.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::run::RunTicket;
use super::{JobState, Node, Standing};
use crate::config::JobName;
use crate::metrics::ClaimLabel;
use crate::store::{ClaimOutcome, ClaimRequest, StoreError, Won};

/// Longest single sleep towards an occurrence: a wall-clock step is noticed
/// within this time.
pub(super) const MAX_SLEEP: Duration = Duration::from_secs(15);
/// How often a node whose clock is out of bounds looks at it again while an
/// occurrence is pending.
const CLOCK_RECHECK: Duration = Duration::from_millis(250);
/// Sleep past a reported lease end, so the store sees it expired.
const EXPIRY_SLACK: Duration = Duration::from_millis(2);

/// Sleeps until the wall clock reaches `target`; false if `stop` came first.
async fn sleep_until_wall(
    target: DateTime<Utc>,
    stop: &CancellationToken,
    beat: &(dyn Fn() + Sync),
) -> bool {
    loop {
        beat();
        let Ok(left) = (target - Utc::now()).to_std() else {
            return true;
        };
        if left.is_zero() {
            return true;
        }
        tokio::select! {
            () = stop.cancelled() => return false,
            () = tokio::time::sleep(left.min(MAX_SLEEP)) => {}
        }
    }
}

/// The monotonic instant at which the wall clock will show `t`.
fn instant_of(t: DateTime<Utc>) -> Instant {
    let now = Instant::now();
    match (t - Utc::now()).to_std() {
        Ok(ahead) => now + ahead,
        Err(_) => now,
    }
}

impl Node {
    /// Waits for each occurrence of the job and hands it to its own task.
    pub(super) async fn job_loop(
        self: Arc<Self>,
        state: Arc<JobState>,
        schedule_stop: CancellationToken,
        handlers_stop: CancellationToken,
    ) {
        let job = state.job();
        let schedule = &job.schedule;
        let mut after = Utc::now();
        loop {
            let Some(mut occurrence) = schedule.next_after(after) else {
                tracing::warn!(job = %job.name, "the schedule has no further occurrence");
                return;
            };
            let beat = || {
                state.heartbeat.store(
                    self.epoch.elapsed().as_millis() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                )
            };
            if !sleep_until_wall(occurrence, &schedule_stop, &beat).await {
                return;
            }
            // Woken late (a paused process, a suspended VM): claim only the
            // latest due occurrence; the store's misfire rule covers the rest,
            // and a stale occurrence is never started.
            let now = Utc::now();
            while let Some(next) = schedule.next_after(occurrence).filter(|n| *n <= now) {
                occurrence = next;
            }
            after = occurrence;
            let next = schedule.next_after(occurrence);
            let previous = schedule.previous_before(occurrence);
            let node = self.clone();
            let state = state.clone();
            let stop = handlers_stop.clone();
            self.handlers.spawn(async move {
                node.handle_occurrence(state, occurrence, previous, next, stop)
                    .await;
            });
        }
    }

    /// Claims one occurrence until it is claimed by someone or the next is due.
    async fn handle_occurrence(
        self: Arc<Self>,
        state: Arc<JobState>,
        occurrence: DateTime<Utc>,
        previous: Option<DateTime<Utc>>,
        next: Option<DateTime<Utc>>,
        stop: CancellationToken,
    ) {
        let job = state.job();
        let gap = next
            .and_then(|n| (n - occurrence).to_std().ok())
            .unwrap_or(Duration::from_secs(60));
        let lease = gap + self.margin;
        let give_up_at = instant_of(occurrence) + gap;
        let mut backoff = Duration::from_millis(100);
        // Earliest send of a claim whose answer never came: it may have won.
        let mut unanswered: Option<Instant> = None;
        loop {
            if stop.is_cancelled() || Instant::now() >= give_up_at {
                return;
            }
            let gate = state.claim_gate.lock().await;
            if let Some(until) = self.paused_until() {
                drop(gate);
                if !self.sleep_within(until, give_up_at, &stop).await {
                    return;
                }
                continue;
            }
            if self.clock.skewed() && !self.recheck_clock().await {
                // Out of bounds: claim nothing, look again shortly.
                drop(gate);
                let retry_at = (Instant::now() + CLOCK_RECHECK).min(give_up_at);
                if !self.sleep_within(retry_at, give_up_at, &stop).await {
                    return;
                }
                continue;
            }
            let prepared = tokio::select! {
                () = stop.cancelled() => return,
                r = self.ensure_prepared() => r,
            };
            // Taken after any migration wait: the claim's own round trip
            // times the lease and the clock reading.
            let sent = Instant::now();
            let sent_wall = Utc::now();
            let result = match prepared {
                Ok(()) => {
                    let request = ClaimRequest {
                        job: job.name.clone(),
                        occurrence,
                        previous,
                        misfire: job.misfire,
                        owner: self.owner.clone(),
                        lease,
                        fence_floor: state.fence_floor.load(std::sync::atomic::Ordering::SeqCst),
                        max_offset: self.clock.bound(),
                    };
                    // Not cancelled by shutdown: a claim the store granted must
                    // not be dropped unrun. It ends within op_timeout.
                    self.call(
                        "claim",
                        self.op_timeout,
                        self.store.claim(std::slice::from_ref(&request)),
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            let answer = result.and_then(|claimed| {
                self.observe_clock(claimed.store_now, sent_wall, Utc::now());
                claimed
                    .outcomes
                    .into_iter()
                    .next()
                    .ok_or_else(|| StoreError::Backend {
                        store: self.store.describe().into(),
                        reason: "empty claim reply".into(),
                    })
            });
            let outcome = match answer {
                Ok(outcome) => outcome,
                Err(e) => {
                    drop(gate);
                    if matches!(e, StoreError::NotMigrated { .. }) {
                        self.prepared
                            .store(false, std::sync::atomic::Ordering::SeqCst);
                    }
                    if e.is_unreachable() {
                        unanswered.get_or_insert(sent);
                    }
                    self.count_claim(&job.name, "error");
                    let retry_at = (Instant::now() + backoff).min(give_up_at);
                    if !self.sleep_within(retry_at, give_up_at, &stop).await {
                        return;
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            let result = match &outcome {
                ClaimOutcome::Won(w) if w.catch_up => "caught_up",
                ClaimOutcome::Won(_) => "won",
                ClaimOutcome::Lost(l) if l.too_early => "too_early",
                ClaimOutcome::Lost(_) => "lost",
            };
            self.count_claim(&job.name, result);
            match outcome {
                ClaimOutcome::Won(won) => {
                    state.saw_fence(won.fence);
                    state.lease_granted(sent, lease);
                    state.note_standing(Standing::Holder, won.fence);
                    let ticket = self.ticket(&won);
                    if won.catch_up {
                        tracing::info!(job = %job.name, fence = won.fence, missed = %won.occurrence, "catching up a missed occurrence");
                        let run = self.start_run(&state, ticket);
                        drop(gate);
                        if let Some(run) = run {
                            // The missed run goes first; the occurrence itself
                            // is claimed when it is over (no overlap).
                            tokio::select! {
                                () = stop.cancelled() => return,
                                _ = run => {}
                            }
                        }
                        continue;
                    }
                    if state.running.load(std::sync::atomic::Ordering::SeqCst) {
                        // overlap = "skip": the previous run is still going at
                        // this instant. Skip this occurrence now (keeping the
                        // lease this claim renewed) rather than start it late
                        // and push every later run back.
                        drop(gate);
                        self.skip_occurrence(&state, ticket).await;
                        return;
                    }
                    self.start_run(&state, ticket);
                    return;
                }
                ClaimOutcome::Lost(lost) if lost.too_early => {
                    // The store's clock has not reached this occurrence: ours
                    // runs ahead. The offset reading above holds claims back
                    // while it is out of bounds; try again shortly.
                    drop(gate);
                    state.saw_fence(lost.fence);
                    tracing::debug!(job = %job.name, %occurrence, "refused by the store: occurrence not due yet by its clock");
                    let retry_at = (Instant::now() + CLOCK_RECHECK).min(give_up_at);
                    if !self.sleep_within(retry_at, give_up_at, &stop).await {
                        return;
                    }
                }
                ClaimOutcome::Lost(lost) => {
                    drop(gate);
                    state.saw_fence(lost.fence);
                    let claimed = lost.last_occurrence.is_some_and(|last| last >= occurrence);
                    if claimed {
                        let ours = lost.holder.as_deref() == Some(self.owner.as_str());
                        if ours && lost.last_occurrence == Some(occurrence) {
                            if let Some(first_send) = unanswered {
                                // A claim whose reply was lost did win: run it,
                                // with the lease counted from that first send.
                                tracing::info!(job = %job.name, fence = lost.fence, "an unanswered claim had won: running it");
                                state.lease_granted(first_send, lease);
                                state.note_standing(Standing::Holder, lost.fence);
                                let won = Won {
                                    fence: lost.fence,
                                    occurrence,
                                    catch_up: false,
                                    previous_owner: None,
                                };
                                self.start_run(&state, self.ticket(&won));
                            }
                        } else {
                            state
                                .note_standing(Standing::Follower(lost.holder.clone()), lost.fence);
                        }
                        return;
                    }
                    state.note_standing(Standing::Follower(lost.holder.clone()), lost.fence);
                    // Another owner's live lease: wait it out and try again.
                    let retry_at = Instant::now()
                        + lost.remaining.max(Duration::from_millis(10))
                        + EXPIRY_SLACK;
                    if retry_at >= give_up_at {
                        tracing::debug!(job = %job.name, %occurrence, "lease outlasts this occurrence; leaving it");
                        return;
                    }
                    tracing::debug!(job = %job.name, %occurrence, holder = ?lost.holder, "lease held; retrying in {:?}", lost.remaining);
                    if !self.sleep_within(retry_at, give_up_at, &stop).await {
                        return;
                    }
                }
            }
        }
    }

    /// Counts one claim attempt in `cronlease_claims_total{job,result}`.
    fn count_claim(&self, job: &JobName, result: &str) {
        self.metrics
            .claims
            .get_or_create(&ClaimLabel {
                job: job.to_string(),
                result: result.into(),
            })
            .inc();
    }

    fn ticket(&self, won: &Won) -> RunTicket {
        RunTicket {
            fence: won.fence,
            occurrence: won.occurrence,
            takeover: won
                .previous_owner
                .as_deref()
                .is_some_and(|p| p != self.owner.as_str()),
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
