//! Cancel requests for this node's runs (docs/protocol.md, "Cancel"): while
//! runs are going, the node takes the requests left for it in the store's
//! outbox ([`crate::cancel`]) every [`LOOK_EVERY`] and stops each run asked
//! for, which its supervisor then records `cancelled` with who asked and
//! why. A node idle for [`LINGER`] asks the store nothing, and does not
//! wake until a run starts.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Node;
use crate::cancel::CancelRequest;
use crate::store::outbox::TAKE_AT_MOST;

/// How often a node with runs going looks for requests to cancel them: a
/// run is stopped within this and a store round trip of the request.
pub(super) const LOOK_EVERY: Duration = Duration::from_millis(500);

/// How long a node goes on looking once its last run ended: a request made
/// from a beat that still showed the run (up to a beat period old), or
/// while the run was ending, is taken and dropped, not left in the store.
const LINGER: Duration = Duration::from_secs(5);

/// A run going on this node, and its stop switch.
pub(super) type Going = (
    crate::store::RunningRun,
    tokio::time::Instant,
    Arc<CancelSlot>,
);

/// A running run's stop switches: a cancel request's, and the next
/// occurrence's (`overlap = "replace"`), each with what threw it.
#[derive(Default)]
pub(super) struct CancelSlot {
    token: CancellationToken,
    asked: Mutex<Option<CancelRequest>>,
    replace: CancellationToken,
    replaced_by: Mutex<Option<String>>,
}

impl CancelSlot {
    /// Stops the run for `request` (the first request wins).
    fn cancel(&self, request: CancelRequest) {
        if let Ok(mut asked) = self.asked.lock() {
            asked.get_or_insert(request);
        }
        self.token.cancel();
    }

    /// Returns once the run is to stop.
    pub(super) async fn cancelled(&self) {
        self.token.cancelled().await;
    }

    /// The request that stopped the run, if one did.
    pub(super) fn asked(&self) -> Option<CancelRequest> {
        self.asked.lock().ok().and_then(|a| a.clone())
    }

    /// Stops the run for the occurrence `said` names (the first wins).
    pub(super) fn replace(&self, said: &str) {
        if let Ok(mut by) = self.replaced_by.lock() {
            by.get_or_insert_with(|| said.to_string());
        }
        self.replace.cancel();
    }

    /// Returns once the run is to stop for the next occurrence.
    pub(super) async fn replaced(&self) {
        self.replace.cancelled().await;
    }

    /// What replaced the run, if something did.
    pub(super) fn replaced_by(&self) -> Option<String> {
        self.replaced_by.lock().ok().and_then(|b| b.clone())
    }
}

impl Node {
    /// Takes the requests to cancel this node's runs while it has any,
    /// until claiming stops.
    pub(super) async fn watch_cancels(self: Arc<Self>) {
        let prefix = crate::cancel::prefix_of(&self.owner);
        let mut tick = tokio::time::interval(LOOK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut going_at: Option<tokio::time::Instant> = None;
        loop {
            if !self.has_runs_going() && going_at.is_none_or(|at| at.elapsed() > LINGER) {
                // Idle: nothing to look for until a run starts.
                tokio::select! {
                    () = self.life.claims.cancelled() => return,
                    () = self.members.run_started.notified() => {}
                }
                tick.reset();
            }
            tokio::select! {
                () = self.life.claims.cancelled() => return,
                _ = tick.tick() => {}
            }
            if self.has_runs_going() {
                going_at = Some(tokio::time::Instant::now());
            } else if going_at.is_none_or(|at| at.elapsed() > LINGER) {
                continue;
            }
            let Ok(parcels) = self
                .call(
                    "take_cancels",
                    self.settings.op_timeout,
                    self.store
                        .take_handed_over(&self.owner, &prefix, TAKE_AT_MOST),
                )
                .await
            else {
                continue;
            };
            for parcel in parcels {
                let Some(request) = CancelRequest::of(&parcel) else {
                    tracing::warn!(parcel = %parcel.id, "a cancel request this version cannot read: dropped");
                    continue;
                };
                let reason = request.reason.clone().unwrap_or_default();
                match self.cancel_slot(&request.job, request.fence) {
                    Some(slot) => {
                        tracing::warn!(job = %request.job, fence = request.fence, by = %request.by, reason = %reason, "cancel asked: stopping the run");
                        slot.cancel(request);
                    }
                    None => {
                        tracing::info!(job = %request.job, fence = request.fence, by = %request.by, "cancel asked for a run not going on this node (it ended): nothing to stop");
                    }
                }
            }
        }
    }
}
