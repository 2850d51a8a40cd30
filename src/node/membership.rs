//! The node's record in the store's node registry (docs/protocol.md, "Node
//! registry"): a heartbeat at least three times per lease margin, with the
//! node's name, version, start, clock offset and leases held; the record
//! lives a margin plus one heartbeat period on the store's clock, so a
//! killed node drops out of `cronlease nodes` within that time. A node
//! shutting down deletes its record. Each heartbeat answers with the live
//! nodes, kept for `cronlease_nodes_alive` and for placement: with
//! `cluster.placement = "spread"` each job's preferred node is the
//! rendezvous hash's pick among the live node names ([`preferred_node`]).

use std::sync::Arc;
use std::time::Duration;

use crate::config::Placement;
use crate::store::{Heartbeat, NodeRecord};

use super::Node;

/// The shortest heartbeat period, whatever the margin.
const MIN_BEAT: Duration = Duration::from_millis(50);

/// How often a node with lease margin `margin` beats, and how long each
/// beat keeps its record alive: a third of the margin (at least
/// [`MIN_BEAT`]), and the margin plus one period, so two beats may be lost
/// or late before the record ends (with a margin of 150 ms or more).
pub(super) fn beat_timing(margin: Duration) -> (Duration, Duration) {
    let every = (margin / 3).max(MIN_BEAT);
    (every, margin + every)
}

impl Node {
    /// Keeps this node's record fresh until claiming stops; the first beat
    /// goes once the store is prepared (it may create the registry).
    pub(super) async fn keep_registered(self: Arc<Self>) {
        let (every, _) = beat_timing(self.margin);
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = self.claims.cancelled() => return,
                _ = tick.tick() => {}
            }
            if self.ensure_prepared().await.is_err() {
                continue;
            }
            let beat = self.heartbeat();
            if let Ok(nodes) = self
                .call("heartbeat", self.op_timeout, self.store.heartbeat(&beat))
                .await
            {
                self.metrics.nodes_alive.set(nodes.len() as i64);
                if let Ok(mut live) = self.live_nodes.lock() {
                    *live = nodes;
                }
            }
        }
    }

    /// What this node says of itself now.
    fn heartbeat(&self) -> Heartbeat {
        let (_, ttl) = beat_timing(self.margin);
        let (_, held) = self.job_and_lease_counts();
        Heartbeat {
            owner: self.owner.clone(),
            node: self.name.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            started_at: self.started_at,
            clock_offset_ms: self.clock.last_offset_ms(),
            jobs_held: u32::try_from(held).unwrap_or(u32::MAX),
            ttl,
        }
    }

    /// The live nodes as of this node's last heartbeat.
    pub fn live_nodes(&self) -> Vec<NodeRecord> {
        self.live_nodes
            .lock()
            .map(|l| l.clone())
            .unwrap_or_default()
    }

    /// Deletes this node's record (shutdown), so it leaves the registry at
    /// once instead of when its record ends; a failure only leaves it there
    /// until then.
    pub(super) async fn leave_registry(&self) {
        if let Err(e) = self
            .call("leave", self.op_timeout, self.store.leave(&self.owner))
            .await
        {
            tracing::debug!(
                "could not delete this node's registry record ({e}); it ends by itself"
            );
        }
    }
}

/// A 64-bit score of (job, node), the same on every host and version:
/// FNV-1a over both names (a zero byte between), then the SplitMix64
/// finalizer, so names that differ in one character score far apart.
pub(super) fn rendezvous_score(job: &str, node: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in job.bytes().chain([0]).chain(node.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The preferred node of `job` among `nodes` (names, in any order, a name
/// listed twice counting once): the highest score, ties to the smaller
/// name. Adding or removing a node moves only the jobs it wins or won.
pub(super) fn preferred_node<'a, S: AsRef<str>>(job: &str, nodes: &'a [S]) -> Option<&'a str> {
    nodes.iter().map(AsRef::as_ref).max_by(|a, b| {
        rendezvous_score(job, a)
            .cmp(&rendezvous_score(job, b))
            .then_with(|| b.cmp(a))
    })
}

impl Node {
    /// With `spread`, the names of the live nodes jobs are placed among, as
    /// of the last heartbeat: read once per instant, not once per job.
    /// `None` with `sticky`, and while this node is not in the registry yet
    /// (nothing known: claim as with `sticky`).
    pub(super) fn placement_view(&self) -> Option<Vec<String>> {
        if self.placement != Placement::Spread {
            return None;
        }
        let live = self.live_nodes.lock().ok()?;
        let names: Vec<String> = live.iter().map(|n| n.node.clone()).collect();
        names
            .iter()
            .any(|n| n == self.name.as_str())
            .then_some(names)
    }

    /// Whether this node should give `job` to a peer: `view` (see
    /// [`Node::placement_view`]) names another node as its preferred one.
    pub(super) fn defers_in(&self, job: &str, view: Option<&[String]>) -> bool {
        view.and_then(|names| preferred_node(job, names))
            .is_some_and(|p| p != self.name.as_str())
    }

    /// [`Node::defers_in`] the current view.
    pub(super) fn defers(&self, job: &str) -> bool {
        self.defers_in(job, self.placement_view().as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_spreads_evenly_and_moves_only_a_leavers_jobs() {
        let jobs: Vec<String> = (0..300).map(|i| format!("j{i:04}")).collect();
        let three = ["n1", "n2", "n3"];
        let pick = |nodes: &[&str]| -> Vec<String> {
            jobs.iter()
                .map(|j| preferred_node(j, nodes).unwrap_or("").to_string())
                .collect()
        };
        let before = pick(&three);
        for n in three {
            let share = before.iter().filter(|p| **p == n).count();
            assert!((85..=115).contains(&share), "{n}: {share} of 300");
        }
        // n2 leaves: only its jobs move, and they split over the others.
        let after = pick(&["n1", "n3"]);
        for (b, a) in before.iter().zip(&after) {
            if *b != "n2" {
                assert_eq!(b, a);
            }
        }
        // The order of the list does not matter.
        assert_eq!(pick(&["n3", "n1", "n2"]), before);
        assert_eq!(preferred_node::<&str>("j", &[]), None);
    }

    #[test]
    fn a_record_outlives_two_lost_beats_and_ends_within_two_margins() {
        for margin_ms in [150u64, 300, 1_000, 60_000] {
            let margin = Duration::from_millis(margin_ms);
            let (every, ttl) = beat_timing(margin);
            assert!(
                every <= margin.max(MIN_BEAT),
                "{margin:?}: beats every {every:?}"
            );
            assert!(ttl >= every * 2, "{margin:?}: {ttl:?} vs {every:?}");
            assert!(ttl <= margin * 2, "{margin:?}: lives {ttl:?}");
        }
    }
}
