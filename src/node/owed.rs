//! Giving what runs are owed that their daemon could not give
//! ([`crate::guard::owed`]; docs/protocol.md, "Hooks and events a daemon
//! could not give"): a dead daemon's runs, which its guard recorded, are
//! owed their `on_failure` and webhook events; a run killed at the end of
//! `shutdown_grace` its `on_failure` ([`Node::owe`]).
//!
//! The node's next daemon reads them when it starts, and once more
//! [`SECOND_LOOK`] later ([`Node::settle_owed`]):
//! it spools the events (with the delivery ids the dead daemon would have
//! used, `JOB-FENCE-EVENT`), removes the file, then runs the hook: a daemon
//! that dies in between sends the events (from the webhook spool) and does
//! not run the hook again; one that cannot remove the file does not run it
//! now. What is older than [`OWED_LIFE`], or of a job no
//! longer configured, is dropped with a WARN. A host that does not come
//! back loses them, as it loses its webhook spool.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::Node;
use super::run::{Ended, RunTicket};
use crate::guard::owed::{Owed, write_owed};
use crate::spool::Spool;
use crate::store::{Outcome, TriggerId};

/// What is owed longer than this when a daemon starts is dropped (a WARN
/// each): as long as a webhook delivery is tried.
pub const OWED_LIFE: Duration = crate::webhook::MAX_AGE;

/// The second look for what is owed, after the start: longer than a dead
/// daemon's guard takes to hand over (systemd's stop waits for it at most
/// [`crate::systemd::GUARD_WITHIN`]).
pub const SECOND_LOOK: Duration = Duration::from_secs(crate::systemd::GUARD_WITHIN.as_secs() + 10);

/// The hook of a run of `job` that `ended` while its daemon stopped.
pub(super) fn of_run(job: &str, ticket: RunTicket, ended: &Ended, at: DateTime<Utc>) -> Owed {
    Owed {
        job: job.to_string(),
        fence: ticket.fence,
        occurrence: ticket.occurrence,
        started_at: ended.started_at,
        finished_at: ended.finished_at,
        outcome: ended.outcome.as_str().to_string(),
        exit_code: ended.exit_code,
        takeover: ticket.takeover,
        decision_ms: ticket.decision_ms,
        trigger: ticket.trigger.map(TriggerId::get),
        output: ended.output.clone(),
        events: false,
        at_ms: at.timestamp_millis(),
    }
}

/// The run `owed` is for, as its hook and events see it.
fn ticket(owed: &Owed) -> RunTicket {
    RunTicket {
        fence: owed.fence,
        occurrence: owed.occurrence,
        takeover: owed.takeover,
        decision_ms: owed.decision_ms,
        trigger: owed.trigger.and_then(TriggerId::from_stored),
    }
}

/// How the run `owed` is for ended.
fn ended(owed: &Owed) -> Ended {
    Ended {
        outcome: Outcome::parse(&owed.outcome),
        exit_code: owed.exit_code,
        started_at: owed.started_at,
        finished_at: owed.finished_at,
        duration_ms: (owed.finished_at - owed.started_at)
            .num_milliseconds()
            .max(0),
        output: owed.output.clone(),
        recovered: false,
        retry: None,
    }
}

impl Node {
    /// Gives what the node's previous daemons left owed: at start, and
    /// once more [`SECOND_LOOK`] later (a dead daemon's guard may still be
    /// handing over when a daemon started by hand, not by systemd, begins).
    /// Stops at shutdown, leaving the rest for the next start.
    pub(super) async fn settle_owed(self: &Arc<Self>) {
        let Some(spool) = self.owed.clone() else {
            return;
        };
        self.settle_owed_in(&spool).await;
        tokio::select! {
            () = self.life.claims.cancelled() => {}
            () = tokio::time::sleep(SECOND_LOOK) => self.settle_owed_in(&spool).await,
        }
    }

    /// Each entry in `spool`: its events spooled, its file removed, then its
    /// `on_failure` started (in the runs' tracker: shutdown waits for it,
    /// and kills it with the runs). An entry whose file cannot be removed
    /// is not given now (it would be given again at every start).
    async fn settle_owed_in(self: &Arc<Self>, spool: &Spool) {
        let loaded = {
            let spool = spool.clone();
            tokio::task::spawn_blocking(move || spool.load::<Owed>())
                .await
                .unwrap_or_else(|e| (Vec::new(), vec![e.to_string()]))
        };
        let (found, problems) = loaded;
        for p in problems {
            tracing::warn!("what earlier runs are owed: {p}");
        }
        if !found.is_empty() {
            tracing::info!(
                owed = found.len(),
                dir = %spool.dir().display(),
                "runs of an earlier daemon of this node are owed their on_failure and events: giving them"
            );
        }
        for owed in found {
            if self.life.claims.is_cancelled() {
                return;
            }
            let age = self
                .wall
                .now()
                .timestamp_millis()
                .saturating_sub(owed.at_ms);
            let fresh = age <= OWED_LIFE.as_millis() as i64;
            let state = self.state_of(&owed.job).filter(|_| fresh);
            if !fresh {
                tracing::warn!(job = %owed.job, fence = owed.fence, outcome = %owed.outcome, "the on_failure and events this run is owed are dropped: older than {OWED_LIFE:?}");
            } else if state.is_none() {
                tracing::warn!(job = %owed.job, fence = owed.fence, outcome = %owed.outcome, "the on_failure and events this run is owed are dropped: the job is not configured any more");
            } else if owed.events {
                self.spool_events(&owed.job, ticket(&owed), &ended(&owed))
                    .await;
            }
            let removed = {
                let (spool, owed) = (spool.clone(), owed.clone());
                tokio::task::spawn_blocking(move || spool.remove(&owed))
                    .await
                    .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
            };
            if let Err(e) = removed {
                tracing::warn!(job = %owed.job, fence = owed.fence, dir = %spool.dir().display(), "cannot remove what a run is owed ({e}): its on_failure is not started now, and it is given again at the next start");
                continue;
            }
            if let Some(state) = state {
                tracing::info!(job = %owed.job, fence = owed.fence, outcome = %owed.outcome, "a run of an earlier daemon of this node ended {}: its on_failure follows now", owed.outcome);
                let node = self.clone();
                self.life.runs.spawn(async move {
                    node.after_run(&state, ticket(&owed), &ended(&owed)).await;
                });
            }
        }
    }

    /// Keeps `owed` for the node's next daemon; a write that fails is an
    /// ERROR (the hook is lost).
    pub(super) async fn owe(&self, owed: Owed) {
        let Some(spool) = self.owed.clone() else {
            tracing::info!(job = %owed.job, fence = owed.fence, "on_failure not started: the daemon is shutting down (no state directory to keep it for the next start)");
            return;
        };
        let dir = spool.dir().to_path_buf();
        let (job, fence) = (owed.job.clone(), owed.fence);
        let problems = tokio::task::spawn_blocking(move || write_owed(&dir, &[owed]))
            .await
            .unwrap_or_else(|e| vec![e.to_string()]);
        match problems.first() {
            None => {
                tracing::info!(job = %job, fence, "on_failure not started: the daemon is shutting down; kept for its next start")
            }
            Some(p) => {
                tracing::error!(job = %job, fence, "on_failure not started: the daemon is shutting down, and it cannot be kept for the next start: {p}")
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::guard::owed::tests::record;

    #[test]
    fn an_owed_entry_reads_back_as_the_run_it_was_and_a_stopping_daemons_owes_no_events() {
        let owed = Owed::of_record(&record("backup", 7, Outcome::Killed), Utc::now());
        let (t, e) = (ticket(&owed), ended(&owed));
        assert_eq!((t.fence, t.takeover, t.decision_ms), (7, true, 12));
        assert!(t.trigger.is_some());
        assert_eq!(t.trigger, TriggerId::from_stored(0x1234_5678_9abc));
        assert_eq!(t.occurrence, owed.occurrence);
        assert_eq!(
            (e.outcome.clone(), e.exit_code),
            (Outcome::Killed, Some(137))
        );
        assert_eq!(e.duration_ms, 7480);
        assert_eq!(e.output, "cronlease: killed\n");
        assert!(!e.recovered && e.retry.is_none());
        let again = of_run("backup", t, &e, Utc::now());
        assert!(!again.events);
        assert_eq!(
            (again.fence, again.outcome.as_str(), again.trigger),
            (7, "killed", owed.trigger)
        );
    }
}
