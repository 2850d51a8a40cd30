//! Followers leave a live holder's jobs to it (docs/protocol.md, "Followers
//! leave held jobs to their holder"): how far this node's own claims have
//! gone, said in its beats, and the occurrences it does not claim because
//! their holder says it claimed them.
//!
//! At an instant where a follower has at least [`LEAVE_AT_LEAST`] jobs due
//! that one other live node held when the follower last claimed them, it
//! sends none of their claims. It reads the registry twice instead, once
//! for all of them ([`Read`]):
//! 1. [`Read::Early`]: a holder gone from it (a crashed daemon's guard
//!    deletes its record as it hands its leases over), or one whose count
//!    of leases given up ([`ClaimProgress`]'s `released`) moved since the
//!    follower's claim that named it, has its jobs claimed at once;
//! 2. [`Read::AfterHeadStart`]: a holder whose beat says every claim it
//!    made up to the instant was decided by the store (`through`), with the
//!    same count, claimed them, and the follower is done with them; any
//!    other answer (no such beat yet, a read that failed) and they are
//!    claimed.
//!
//! A node counts a lease given up ([`Progress::releasing`]) when it lets
//! one go while alive, and when it gives a claim of its own up without the
//! store's decision (its window over, store errors, stopped): `through`
//! passes only occurrences the store decided. A holder beats as soon as the
//! last claim of an instant at which it held at least [`LEAVE_AT_LEAST`]
//! jobs is decided, so the second read finds it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use tokio::sync::{Notify, OnceCell};
use tokio::time::Instant;

use super::Node;
use super::claim::{Due, FOLLOWER_LEAD};
use crate::config::Placement;
use crate::store::{ClaimProgress, NodeRecord};

/// A follower leaves a holder's jobs to it only at an instant where at
/// least this many of them are due: below it, their claims (one batch)
/// cost the store less than the two registry reads that replace them.
pub const LEAVE_AT_LEAST: usize = 8;

/// How long after the holder's head start the second read goes: the
/// holder's beat, sent once its claims are decided, is in by then.
const AFTER_HEAD_START: std::time::Duration = std::time::Duration::from_millis(10);

/// The two registry reads of an instant's occurrences left to a holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Read {
    /// [`FOLLOWER_LEAD`] after the instant: is the holder there, with no
    /// lease given up since?
    Early,
    /// [`AFTER_HEAD_START`] after its head start: has it said its claims of
    /// the instant are decided?
    AfterHeadStart,
}

/// Registry reads shared by the occurrences that wait on them: by instant
/// (ms) and which read.
type Reads = BTreeMap<(i64, Read), Arc<OnceCell<Option<Arc<Vec<NodeRecord>>>>>>;

/// This node's claims in flight, by instant, and what its beats say of
/// them.
#[derive(Default)]
pub(super) struct Progress {
    /// Scheduled occurrences claimed and not yet answered, by instant (ms):
    /// how many, and how many of those jobs this node held.
    pending: Mutex<BTreeMap<i64, (usize, usize)>>,
    /// Leases given up while alive, and claims given up without the
    /// store's decision ([`ClaimProgress::released`]).
    released: AtomicU64,
    /// Asks the heartbeat loop for a beat now.
    pub(super) beat_now: Notify,
    reads: tokio::sync::Mutex<Reads>,
}

/// One claimed occurrence not yet decided: holds the node's `through`
/// below its instant until dropped.
pub(super) struct Mark {
    progress: Arc<Progress>,
    at: i64,
}

impl Drop for Mark {
    fn drop(&mut self) {
        let Ok(mut pending) = self.progress.pending.lock() else {
            return;
        };
        let Some((open, held)) = pending.get_mut(&self.at) else {
            return;
        };
        *open = open.saturating_sub(1);
        if *open > 0 {
            return;
        }
        let held = *held;
        pending.remove(&self.at);
        drop(pending);
        if held >= LEAVE_AT_LEAST {
            // Followers may have left these to this node: say it claimed
            // them now, not at the next beat.
            self.progress.beat_now.notify_one();
        }
    }
}

impl Progress {
    /// Notes a claim of an occurrence at `at` (`held`: of a job this node
    /// holds), decided when the mark is dropped.
    pub(super) fn mark(self: &Arc<Self>, at: DateTime<Utc>, held: bool) -> Mark {
        let at = at.timestamp_millis();
        if let Ok(mut pending) = self.pending.lock() {
            let entry = pending.entry(at).or_default();
            entry.0 += 1;
            entry.1 += usize::from(held);
        }
        Mark {
            progress: self.clone(),
            at,
        }
    }

    /// What the beat says now, with the scheduler's next instant at
    /// `next_due_ms`: every claim of an occurrence before the earliest one
    /// still undecided, and before the next one not yet taken, was decided
    /// (or given up, and counted in `released`).
    pub(super) fn claim_progress(&self, next_due_ms: i64) -> Option<ClaimProgress> {
        let pending = self.pending.lock().ok()?;
        let open = pending.keys().next().copied().unwrap_or(i64::MAX);
        Some(ClaimProgress {
            through: open.min(next_due_ms).saturating_sub(1),
            released: self.released.load(Ordering::SeqCst),
        })
    }

    /// A lease (or an undecided claim) is given up while this node lives:
    /// followers claim what they left to it.
    pub(super) fn releasing(&self) {
        self.released.fetch_add(1, Ordering::SeqCst);
        self.beat_now.notify_one();
    }
}

/// An occurrence left to its holder: who, and its `released` count then.
#[derive(Debug, Clone)]
pub(super) struct Left {
    holder: String,
    released: u64,
}

impl Left {
    /// Whether `nodes`, read as `read`, say the holder still has what this
    /// node left to it: alive, with no lease given up since, and (after its
    /// head start) its claims up to the occurrence decided.
    fn kept(&self, nodes: &[NodeRecord], occurrence: i64, read: Read) -> bool {
        nodes
            .iter()
            .find(|n| n.owner == self.holder)
            .and_then(|n| n.progress)
            .is_some_and(|p| {
                p.released == self.released && (read == Read::Early || p.through >= occurrence)
            })
    }
}

impl Node {
    /// Each live node's count of leases given up, as this node's view has
    /// it now (owner → count).
    pub(super) fn released_seen(&self) -> Arc<BTreeMap<String, u64>> {
        let seen = self.members.live_nodes.lock().map(|live| {
            live.iter()
                .filter_map(|n| Some((n.owner.clone(), n.progress?.released)))
                .collect()
        });
        Arc::new(seen.unwrap_or_default())
    }

    /// Which of an instant's due occurrences this node leaves to their
    /// holder (see the module's doc): `None` for each it claims. Never one
    /// of a job a live peer defines otherwise (each node claims the
    /// instants of its own definition), a catch-up or a broadcast.
    pub(super) fn to_leave(&self, due: &[Due]) -> Vec<Option<Left>> {
        let mut left: Vec<Option<Left>> = due.iter().map(|_| None).collect();
        if self.settings.placement != Placement::Sticky {
            return left;
        }
        let differing = self
            .members
            .definitions
            .lock()
            .map(|c| c.differing())
            .unwrap_or_default();
        let Ok(live) = self.members.live_nodes.lock() else {
            return left;
        };
        let mut by_holder: BTreeMap<(String, u64), Vec<usize>> = BTreeMap::new();
        for (i, d) in due.iter().enumerate() {
            let job = d.state.job();
            if d.catch_up_only || job.every_node || differing.contains_key(&job.name) {
                continue;
            }
            if let Some((holder, released)) = d.state.followed()
                && holder != self.owner.as_str()
                && live
                    .iter()
                    .any(|n| n.owner == holder && n.progress.is_some())
            {
                by_holder.entry((holder, released)).or_default().push(i);
            }
        }
        for ((holder, released), indices) in by_holder {
            if indices.len() < LEAVE_AT_LEAST {
                continue;
            }
            for i in indices {
                left[i] = Some(Left {
                    holder: holder.clone(),
                    released,
                });
            }
        }
        left
    }

    /// Hands the occurrences this node leaves to their holders to one task
    /// per holder and instant ([`Node::left_to_holder`]), not one per
    /// occurrence: at an instant of many jobs, what a follower keeps while
    /// it waits is one small entry per occurrence.
    pub(super) fn leave_to_holders(self: &Arc<Self>, left: Vec<(Left, Due)>) {
        let mut groups: BTreeMap<(String, u64, i64), (Left, Vec<Due>)> = BTreeMap::new();
        for (left, due) in left {
            let key = (
                left.holder.clone(),
                left.released,
                due.occurrence.timestamp_millis(),
            );
            groups
                .entry(key)
                .or_insert_with(|| (left, Vec::new()))
                .1
                .push(due);
        }
        for (left, dues) in groups.into_values() {
            let node = self.clone();
            self.life.handlers.spawn(async move {
                node.left_to_holder(&left, dues).await;
            });
        }
    }

    /// Waits for the registry's word on occurrences of one instant left to
    /// one holder (its two reads, shared with every other occurrence of the
    /// instant): when the holder claimed them, counts each `left`; else
    /// claims each after all, in a handler of its own. An occurrence whose
    /// job's handlers stopped meanwhile (a reload that removed it) is
    /// dropped, and a stop of claiming (shutdown) drops them all.
    async fn left_to_holder(self: Arc<Self>, left: &Left, dues: Vec<Due>) {
        let Some(occurrence) = dues.first().map(|d| d.occurrence) else {
            return;
        };
        let instant = self.instant_of(occurrence);
        let at = occurrence.timestamp_millis();
        let mut kept = true;
        for (read, after) in [
            (Read::Early, FOLLOWER_LEAD),
            (
                Read::AfterHeadStart,
                self.settings.head_start + AFTER_HEAD_START,
            ),
        ] {
            // A stop claims nothing more: not the occurrences this node
            // left either (before, a stopping node's follower went on to
            // read the registry, and took over what its reads said).
            let nodes = tokio::select! {
                () = self.life.claims.cancelled() => return,
                nodes = self.registry_read((at, read), instant + after) => nodes,
            };
            if !nodes.is_some_and(|nodes| left.kept(&nodes, at, read)) {
                kept = false;
                break;
            }
        }
        for due in dues {
            if due.stop.is_cancelled() {
                continue;
            }
            if kept {
                self.count_claim(&due.state.job().name, "left");
                continue;
            }
            // Claimed after all: marked as any claim of it.
            let mark = self.progress.mark(due.occurrence, false);
            self.life
                .handlers
                .spawn(self.clone().handle_occurrence(due, None, Some(mark)));
        }
    }

    /// The live records as read once, at `at`, for the read `key` (an
    /// instant and which of its reads: every occurrence of that instant
    /// shares it); `None` if the read failed.
    async fn registry_read(&self, key: (i64, Read), at: Instant) -> Option<Arc<Vec<NodeRecord>>> {
        let cell = {
            let mut reads = self.progress.reads.lock().await;
            // An occurrence asks for its reads within a head start of its
            // instant: those of instants 10 s older are not asked for again.
            reads.retain(|(t, _), _| *t >= key.0 - 10_000);
            reads.entry(key).or_default().clone()
        };
        tokio::time::sleep_until(at).await;
        cell.get_or_init(|| async {
            self.call("nodes", self.settings.op_timeout, self.store.nodes())
                .await
                .ok()
                .map(Arc::new)
        })
        .await
        .clone()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn at(ms: i64) -> DateTime<Utc> {
        chrono::TimeZone::timestamp_millis_opt(&Utc, ms).unwrap()
    }

    #[test]
    fn through_stops_below_the_earliest_unanswered_claim_and_the_next_instant() {
        let p = Arc::new(Progress::default());
        let said = |next| p.claim_progress(next).unwrap().through;
        assert_eq!(said(10_000), 9_999, "nothing open: up to the next instant");
        let a = p.mark(at(5_000), true);
        let b = p.mark(at(5_000), false);
        let c = p.mark(at(6_000), true);
        assert_eq!(said(10_000), 4_999);
        drop(a);
        assert_eq!(said(10_000), 4_999, "one claim of 5 s still open");
        drop(b);
        assert_eq!(said(10_000), 5_999);
        drop(c);
        assert_eq!(said(10_000), 9_999);
        assert_eq!(said(i64::MAX), i64::MAX - 1);
    }

    /// Whether a beat was asked for (within 20 ms of tokio's clock).
    async fn beat_asked(p: &Progress) -> bool {
        tokio::time::timeout(std::time::Duration::from_millis(20), p.beat_now.notified())
            .await
            .is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn an_answered_instant_of_many_held_jobs_asks_for_a_beat_and_a_release_counts() {
        let p = Arc::new(Progress::default());
        let few: Vec<Mark> = (0..LEAVE_AT_LEAST - 1)
            .map(|_| p.mark(at(1_000), true))
            .collect();
        drop(few);
        assert!(!beat_asked(&p).await, "too few held: no beat of its own");
        let many: Vec<Mark> = (0..LEAVE_AT_LEAST)
            .map(|_| p.mark(at(2_000), true))
            .collect();
        drop(many);
        assert!(beat_asked(&p).await, "a beat asked for");
        assert_eq!(p.claim_progress(0).unwrap().released, 0);
        p.releasing();
        assert_eq!(p.claim_progress(0).unwrap().released, 1);
    }

    #[test]
    fn a_holder_keeps_what_was_left_only_alive_unreleased_and_through_it() {
        let left = Left {
            holder: "h#1".into(),
            released: 3,
        };
        let with = |through, released| {
            let mut r = NodeRecord::test_record("h#1", "h");
            r.progress = Some(ClaimProgress { through, released });
            vec![NodeRecord::test_record("f#1", "f"), r]
        };
        let (early, late) = (Read::Early, Read::AfterHeadStart);
        assert!(left.kept(&with(999, 3), 1_000, early));
        assert!(!left.kept(&with(999, 3), 1_000, late));
        assert!(left.kept(&with(1_000, 3), 1_000, late));
        assert!(!left.kept(&with(5_000, 4), 1_000, late), "released since");
        assert!(!left.kept(&with(5_000, 4), 1_000, early));
        assert!(
            !left.kept(&[NodeRecord::test_record("f#1", "f")], 1_000, early),
            "gone"
        );
        let mut silent = NodeRecord::test_record("h#1", "h");
        silent.progress = None;
        assert!(
            !left.kept(&[silent], 1_000, early),
            "an older version says nothing"
        );
    }
}
