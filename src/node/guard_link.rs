//! The node's line to its job guard ([`crate::guard`]): what the guard is
//! told so that it can hand this daemon's work over if the daemon dies
//! (docs/protocol.md, "A crashed daemon hands over at once" and
//! "Redelivery"): the store, the owner and the job names
//! ([`Node::tell_guard`]), each claim won before it starts
//! ([`Node::tell_guard_claimed`]), and each claim settled without a run
//! ([`Node::tell_guard_settled`]).

use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::Node;
use crate::guard::Guard;
use crate::store::{ClaimOutcome, ClaimRequest, Outcome, RunRecord};

/// The job guard process and what it is told.
pub(super) struct GuardLink {
    pub(super) process: Option<Guard>,
    /// The store, as the guard needs it to hand over for this daemon if it
    /// dies ([`Node::tell_guard`]).
    pub(super) handover: crate::config::StoreHandover,
    /// Keeps what the guard is told in order.
    pub(super) told: tokio::sync::Mutex<()>,
}

impl Node {
    /// Tells the guard of the claims a batch won, before any of them starts
    /// (their answers go to the claimers after this): a claim the daemon
    /// dies without starting is handed back by the guard.
    pub(super) async fn tell_guard_claimed(
        &self,
        requests: &[ClaimRequest],
        outcomes: &[ClaimOutcome],
        answered: DateTime<Utc>,
    ) {
        let Some(guard) = &self.guard.process else {
            return;
        };
        let claims: Vec<crate::guard::RunNote> = requests
            .iter()
            .zip(outcomes)
            .filter_map(|(req, outcome)| match outcome {
                ClaimOutcome::Won(won) => Some(crate::guard::RunNote {
                    job: req.job.to_string(),
                    fence: won.fence,
                    occurrence: won.occurrence,
                    takeover: won
                        .previous_owner
                        .as_deref()
                        .is_some_and(|p| p != self.owner.as_str()),
                    decision_ms: u64::try_from((answered - won.occurrence).num_milliseconds())
                        .unwrap_or(0),
                    started_at: answered,
                    trigger: req.manual.map(crate::store::TriggerId::get),
                }),
                _ => None,
            })
            .collect();
        if !claims.is_empty() {
            guard.claimed(claims).await;
        }
    }

    /// Tells the guard of claims settled without a run: their records (of
    /// an outcome no started run has) are about to be written.
    pub(super) async fn tell_guard_settled(&self, runs: &[RunRecord]) {
        let Some(guard) = &self.guard.process else {
            return;
        };
        let settled: Vec<(String, u64)> = runs
            .iter()
            .filter(|r| {
                matches!(
                    r.outcome,
                    Outcome::Skipped
                        | Outcome::Dispatched
                        | Outcome::Missed
                        | Outcome::LeaseLost
                        | Outcome::NotStarted
                        | Outcome::Expired
                )
            })
            .map(|r| (r.job.clone(), r.fence))
            .collect();
        if !settled.is_empty() {
            guard.settled(settled).await;
        }
    }

    /// Tells the guard what it needs to hand over if this daemon dies
    /// (docs/protocol.md, "A crashed daemon hands over at once"): the
    /// store, the owner, the history limit and the job names. Sent again
    /// whenever the jobs change (a reload applies the settings first).
    pub(super) fn tell_guard(self: &Arc<Self>) {
        if self.guard.process.is_none() {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            let Some(guard) = &node.guard.process else {
                return;
            };
            // Read under the lock: the last message holds the last state.
            let _in_order = node.guard.told.lock().await;
            let handover = crate::guard::Handover {
                store: node.guard.handover.clone(),
                owner: node.owner.to_string(),
                node: node.name.to_string(),
                keep: node.history_limit(),
                jobs: node.lock_names().iter().map(ToString::to_string).collect(),
                owed_dir: node.owed.as_ref().map(|s| s.dir().to_path_buf()),
                notify_dir: node
                    .webhooks
                    .as_ref()
                    .and_then(|w| w.spool_dir())
                    .map(std::path::Path::to_path_buf),
            };
            if !guard.hand_over(handover).await {
                tracing::warn!(
                    "the job guard did not take what it needs to hand over: if this daemon dies, peers wait for its leases to expire"
                );
            }
        });
    }
}
