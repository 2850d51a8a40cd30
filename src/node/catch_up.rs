//! Catch-up (`misfire = "run_once"`, docs/protocol.md "Missed
//! occurrences" and "Catch-up on resume"): the latest occurrence no node
//! claimed is claimed at once, by the occurrence's own claim rule, when
//! this node comes back ([`Node::catch_up_on_return`]) or when
//! `cronlease resume` asks for it ([`Node::catch_up_on_resume`]), while it
//! may still start; later, the next occurrence's claim handles it.

use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::claim::{Due, gap, start_window};
use super::{JobEntry, Node};
use crate::config::JobName;
use crate::store::TriggerId;

/// The occurrence a catch-up (on return, on resume) claims for the job of
/// `entry` at `now` (`misfire = "run_once"` only): its latest one before
/// `before` (occurrences from then on are the scheduler's), if it is still
/// within its start window ([`start_window`]) and the first half of its gap:
/// a catch-up later than that could still run when the next occurrence is
/// due and push it out (overlap = skip); the next one's claim catches it
/// up first and then runs in order. It names no previous occurrence, so
/// the store hands out no older one.
fn catch_up_due(entry: &JobEntry, before: DateTime<Utc>, now: DateTime<Utc>) -> Option<Due> {
    let job = entry.state.job();
    if job.misfire != crate::config::Misfire::RunOnce {
        return None;
    }
    let next = entry.next?;
    let occurrence = job.schedule.previous_before(next).filter(|p| *p < before)?;
    catch_up_open(&job, occurrence, Some(next), now).then(|| Due {
        state: entry.state.clone(),
        stop: entry.handlers_stop.clone(),
        occurrence,
        previous: None,
        next: Some(next),
    })
}

/// Whether a catch-up of `job`'s `occurrence` (whose next is `next`) may
/// still start at `now`: within its start window and the first half of
/// its gap (see [`catch_up_due`]).
pub(crate) fn catch_up_open(
    job: &crate::config::Job,
    occurrence: DateTime<Utc>,
    next: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> bool {
    let (window, _) = start_window(job, occurrence, next);
    let half = gap(occurrence, next) / 2;
    (now - occurrence)
        .to_std()
        .is_ok_and(|late| late < window && late < half)
}

impl Node {
    /// Catch-up on return (`misfire = "run_once"`): when this node can claim
    /// (at start, once the store answers), the latest occurrence before its
    /// start of each job that no node claimed, still within its start
    /// window ([`start_window`]) and the first half of its gap, is claimed
    /// at once, through the same claim
    /// rule as at its instant (one node wins it), instead of at the next
    /// occurrence. A job never claimed (no last occurrence in the store) or
    /// paused has nothing to catch up. The claim names no previous
    /// occurrence, so the store hands out no older one: older missed
    /// occurrences are not run.
    pub(super) async fn catch_up_on_return(self: &Arc<Self>) {
        let read = tokio::time::timeout(self.settings.op_timeout, self.store.status()).await;
        let rows = match read {
            Ok(Ok(rows)) => rows,
            Ok(Err(e)) => {
                tracing::warn!("no catch-up on return: the locks could not be read: {e}");
                return;
            }
            Err(_) => {
                tracing::warn!("no catch-up on return: the locks could not be read in time");
                return;
            }
        };
        let last: std::collections::HashMap<&str, (Option<DateTime<Utc>>, bool)> = rows
            .iter()
            .map(|r| (r.job.as_str(), (r.last_occurrence, r.paused)))
            .collect();
        let now = self.wall.now();
        // Occurrences from this node's start on are the scheduler's.
        let started = self.members.started_at;
        let due: Vec<Due> = {
            let Ok(jobs) = self.jobs.lock() else {
                return;
            };
            jobs.iter()
                .filter_map(|(name, entry)| {
                    let due = catch_up_due(entry, started, now)?;
                    let (claimed, paused) = last.get(name.as_str()).copied()?;
                    let missed = claimed.is_some_and(|c| c < due.occurrence);
                    (missed && !paused).then_some(due)
                })
                .collect()
        };
        if due.is_empty() {
            return;
        }
        tracing::info!(
            jobs = due.len(),
            "catching up occurrences no node claimed while this node was away"
        );
        self.claim_instant(due);
    }

    /// Catch-up on resume (`misfire = "run_once"`, docs/protocol.md
    /// "Catch-up on resume"): `cronlease resume` left request `id` for
    /// `job`; the latest occurrence before the resume that is still within
    /// its start window and the first half of its gap is claimed at once,
    /// by the occurrence's own claim rule (the store refuses it where
    /// another node won it, or where it was claimed before the pause), and
    /// the request is withdrawn. Nothing is claimed for a job running here
    /// (its run holds the lease: the store would refuse every node). While
    /// a claim of the job is in flight on this node (a handler that was
    /// waiting out a takeover through the pause), the request is left for
    /// the next look: two handlers of one occurrence on one node could
    /// take a lost reply's refusal for their own win.
    pub(super) async fn catch_up_on_resume(self: &Arc<Self>, job: &str, id: TriggerId) {
        let Some(resumed) = id.resumed_at() else {
            return;
        };
        let Ok(name) = JobName::parse(job) else {
            return;
        };
        let now = self.wall.now();
        let due = {
            let Ok(jobs) = self.jobs.lock() else {
                return;
            };
            let entry = jobs.get(&name);
            if entry.is_some_and(|e| e.state.claim_gate.try_lock().is_err()) {
                return;
            }
            entry
                .filter(|entry| !entry.state.is_running())
                .and_then(|entry| catch_up_due(entry, resumed, now))
        };
        if let Some(due) = due {
            tracing::info!(
                job,
                occurrence = %due.occurrence,
                "catching up the occurrence missed while the job was paused"
            );
            self.claim_instant(vec![due]);
        }
        // Withdrawn after the claim is queued: a node that dies in between
        // leaves the request to a peer. Another node's withdrawal first is
        // not an error (false); a failed one is tried again at the next
        // look, which finds the occurrence claimed.
        if let Err(e) = self
            .call(
                "withdraw_trigger",
                self.settings.op_timeout,
                self.store.withdraw_trigger(&name, id),
            )
            .await
        {
            tracing::debug!(job, %id, "a resume's request was not withdrawn: {e}");
        }
    }
}
