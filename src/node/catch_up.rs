//! Catch-up (`misfire = "run_once"`, docs/protocol.md "Missed
//! occurrences" and "Catch-up on resume"): the latest occurrence no node
//! claimed is claimed at once, by the occurrence's own claim rule, when
//! this node comes back ([`Node::catch_up_on_return`]) or when
//! `cronlease resume` asks for it ([`Node::catch_up_on_resume`]), while it
//! may still start; later, the next occurrence's claim handles it. The
//! occurrences nobody claimed before a win are recorded `missed`, one
//! record per gap ([`Node::record_unclaimed`], docs/protocol.md
//! "Occurrences nobody claimed").

use crate::telemetry::Rfc3339;
use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::claim::{Due, gap, start_window};
use super::run::RunTicket;
use super::{JobEntry, JobState, Node};
use crate::config::JobName;
use crate::schedule::Schedule;
use crate::store::{Outcome, TriggerId, Won};

/// The most occurrences nobody claimed that a `missed` record counts one
/// by one: past it, it says "more than".
const UNCLAIMED_COUNT_LIMIT: usize = 100_000;

/// The occurrences of `schedule` after `after` and before `before`: how
/// many (at most [`UNCLAIMED_COUNT_LIMIT`], and whether there are more),
/// the first and the latest. `None` when there are none.
pub(super) fn unclaimed_between(
    schedule: &Schedule,
    after: DateTime<Utc>,
    before: DateTime<Utc>,
) -> Option<(usize, bool, DateTime<Utc>, DateTime<Utc>)> {
    let latest = schedule.previous_before(before).filter(|l| *l > after)?;
    let first = schedule.next_after(after).filter(|f| *f <= latest)?;
    let (mut count, mut at) = (1, first);
    while at < latest {
        if count == UNCLAIMED_COUNT_LIMIT {
            return Some((count, true, first, latest));
        }
        match schedule.next_after(at) {
            Some(next) if next <= latest => {
                count += 1;
                at = next;
            }
            _ => break,
        }
    }
    Some((count, false, first, latest))
}

/// The output of the `missed` record of `count` (`more`: more than that)
/// occurrences nobody claimed, from `first` to `latest`.
fn unclaimed_why(count: usize, more: bool, first: DateTime<Utc>, latest: DateTime<Utc>) -> String {
    let why =
        "no node with the job was running, the store could not be reached, or the job was paused";
    let at = |t: DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    if count == 1 && !more {
        format!("no node claimed it ({why})")
    } else {
        format!(
            "{}{count} occurrences from {} to {} were claimed by no node ({why}); this record stands for all of them",
            if more { "more than " } else { "" },
            at(first),
            at(latest)
        )
    }
}

/// The occurrence a catch-up (on return, on resume) claims for the job of
/// `entry` at `now` (`misfire = "run_once"` only): its latest one before
/// `before` (occurrences from then on are the scheduler's), if it is still
/// within its start window ([`start_window`]) and the first half of its gap:
/// a catch-up later than that could still run when the next occurrence is
/// due and push it out (overlap = skip); the next one's claim catches it
/// up first and then runs in order. It claims that occurrence only (the
/// store hands out no older one), naming the one before it so those
/// nobody claimed are recorded ([`Node::record_unclaimed`]).
fn catch_up_due(entry: &JobEntry, before: DateTime<Utc>, now: DateTime<Utc>) -> Option<Due> {
    let job = entry.state.job();
    // A broadcast job's missed occurrence is not caught up: its shards
    // would run beside the next one's (docs/protocol.md, "Broadcast").
    if job.misfire != crate::config::Misfire::RunOnce || job.every_node {
        return None;
    }
    let next = entry.next()?;
    let occurrence = job.schedule.previous_before(next).filter(|p| *p < before)?;
    catch_up_open(&job, occurrence, Some(next), now).then(|| Due {
        released_seen: Arc::default(),
        state: entry.state.clone(),
        stop: entry.handlers_stop.clone(),
        occurrence,
        previous: job.schedule.previous_before(occurrence),
        next: Some(next),
        catch_up_only: true,
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
    /// A win that left occurrences nobody claimed before it
    /// ([`Won::unclaimed_after`]) records them `missed`, as one record
    /// under the fence the store kept below the win's, with the latest of
    /// them as its occurrence (docs/protocol.md, "Occurrences nobody
    /// claimed"): `on_failure` and the `missed` event follow, once.
    /// Counted off the claim's path: a job of seconds after a long outage
    /// has many to count, and the win's own run starts meanwhile.
    pub(super) fn record_unclaimed(
        self: &Arc<Self>,
        state: &Arc<JobState>,
        won: &Won,
        decision_ms: u64,
    ) {
        let Some(after) = won.unclaimed_after else {
            return;
        };
        let (node, state) = (self.clone(), state.clone());
        let (before, fence) = (won.occurrence, won.fence.saturating_sub(1));
        self.life.runs.spawn(async move {
            let schedule = state.job().schedule.clone();
            let counted =
                tokio::task::spawn_blocking(move || unclaimed_between(&schedule, after, before))
                    .await;
            let Ok(Some((count, more, first, latest))) = counted else {
                return;
            };
            let ticket = RunTicket {
                fence,
                occurrence: latest,
                takeover: false,
                decision_ms,
                trigger: None,
            };
            let why = unclaimed_why(count, more, first, latest);
            node.record_not_run(&state, ticket, Outcome::Missed, why);
        });
    }

    /// Catch-up on return (`misfire = "run_once"`): when this node can claim
    /// (at start, once the store answers), the latest occurrence before its
    /// start of each job that no node claimed, still within its start
    /// window ([`start_window`]) and the first half of its gap, is claimed
    /// at once, through the same claim
    /// rule as at its instant (one node wins it), instead of at the next
    /// occurrence. A job never claimed (no last occurrence in the store) or
    /// paused has nothing to catch up. The claim takes that occurrence only,
    /// so the store hands out no older one: older missed occurrences are
    /// not run, and recorded `missed` ([`Node::record_unclaimed`]).
    pub(super) async fn catch_up_on_return(self: &Arc<Self>) {
        // Registered first: a store that measures clocks against the live
        // nodes' (etcd) then knows whose readings to wait for and refuses
        // the claim until it has them. Before, a node whose clock ran 5 s
        // ahead caught up an occurrence its peers had not reached, and ran
        // it 5 s early (clock::etcd_measures_each_node_against_the_median
        // _of_the_live_clocks, once in the long tier).
        if self.beaten_at().is_none() {
            self.beat_once().await;
        }
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
                occurrence = %Rfc3339(due.occurrence),
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().to_utc()
    }

    #[test]
    fn the_occurrences_nobody_claimed_are_those_strictly_between() {
        let every_minute = Schedule::parse("0 * * * * *", "UTC").unwrap();
        let (after, before) = (at("2026-12-02T10:00:00Z"), at("2026-12-02T10:05:00Z"));
        assert_eq!(
            unclaimed_between(&every_minute, after, before),
            Some((
                4,
                false,
                at("2026-12-02T10:01:00Z"),
                at("2026-12-02T10:04:00Z")
            ))
        );
        // Next to each other: none.
        assert_eq!(
            unclaimed_between(&every_minute, after, at("2026-12-02T10:01:00Z")),
            None
        );
        let why = unclaimed_why(
            4,
            false,
            at("2026-12-02T10:01:00Z"),
            at("2026-12-02T10:04:00Z"),
        );
        assert!(
            why.starts_with("4 occurrences from 2026-12-02T10:01:00Z to 2026-12-02T10:04:00Z were claimed by no node"),
            "{why}"
        );
        assert!(unclaimed_why(1, false, after, after).starts_with("no node claimed it ("));
        // A year of seconds: counted up to the limit.
        let every_second = Schedule::parse("* * * * * *", "UTC").unwrap();
        let (n, more, first, latest) =
            unclaimed_between(&every_second, after, at("2027-12-02T10:00:00Z")).unwrap();
        assert_eq!((n, more), (UNCLAIMED_COUNT_LIMIT, true));
        assert_eq!(
            (first, latest),
            (at("2026-12-02T10:00:01Z"), at("2027-12-02T09:59:59Z"))
        );
        assert!(unclaimed_why(n, more, first, latest).starts_with("more than 100000 occurrences"));
    }
}
