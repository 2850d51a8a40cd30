//! Broadcast with shards (`placement = "every_node"`, docs/protocol.md
//! "Broadcast"): each occurrence runs once on every live node that may run
//! the job, each run claimed and fenced on its own.
//!
//! - The job's own lock is claimed as any job's: the node that wins the
//!   occurrence **dispatches** it ([`Node::dispatch_occurrence`]): it takes
//!   the live nodes that may run the job as its last heartbeat listed them,
//!   sorted by name (this node among them), and leaves one request per node
//!   in that node's shard lock (`JOB~NODE`, [`crate::config::JobName::shard`]),
//!   a [`TriggerId::shard`] carrying the occurrence, the node's index and
//!   the count. The occurrence itself is recorded `dispatched`, naming them.
//! - Each node takes the request in its own shard lock like a manual run's
//!   ([`Node::take_shard`]): claimed through the same atomic step, with a
//!   fence of its own, run with `CRONLEASE_SHARD_INDEX` and
//!   `CRONLEASE_SHARD_COUNT`, recorded in history under the shard's lock.
//! - A shard whose node did not take it (the node died after the dispatch,
//!   or is cut off) is taken by a peer that may run the job: at once when
//!   that node is no longer in the peer's view of the registry, after
//!   [`steal_after`] otherwise. One claim wins it, so it runs once. One not
//!   started within the occurrence's window (`starting_deadline`, at most
//!   the gap) is recorded `missed` by whichever node finds it.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::run::{Ended, RunTicket};
use super::{JobState, Node};
use crate::config::{Job, JobName};
use crate::exec::Finished;
use crate::store::{Outcome, TriggerAnswer, TriggerId};
use crate::telemetry::Rfc3339;

/// How long a shard waits for its own node while that node is live (in
/// this node's view): two beat periods and a margin. A live node takes its
/// request at once where the store notifies and within a beat elsewhere.
fn steal_after(every: Duration, margin: Duration) -> Duration {
    every * 2 + margin
}

impl Node {
    /// Dispatches `ticket`'s occurrence of broadcast job `state` to its
    /// shards (see the module), and records it `dispatched`, as a run's
    /// supervisor records its run.
    pub(super) async fn dispatch_occurrence(
        self: &Arc<Self>,
        state: &JobState,
        ticket: RunTicket,
    ) -> Ended {
        let job = state.job();
        // A missed occurrence handed out for a catch-up (the one after it
        // is due already): its shards would meet that one's, which end
        // them. Recorded missed instead (docs/protocol.md, "Broadcast").
        let operators = ticket.trigger.is_some_and(TriggerId::is_operators);
        if !operators
            && let Some(next) = job
                .schedule
                .next_after(ticket.occurrence)
                .filter(|next| *next <= self.wall.now())
        {
            tracing::warn!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), "a broadcast job's missed occurrence is not caught up: recorded missed");
            let finished = Finished {
                output: format!(
                    "cronlease: missed: a broadcast job's occurrence is not caught up (the next one, {}, is due)",
                    Rfc3339(next)
                ),
                ..Finished::without_process(Outcome::Missed, self.wall.now())
            };
            state.run_is_over();
            return self.finish(state, ticket, finished).await;
        }
        let mut members: Vec<String> = self
            .live_nodes()
            .into_iter()
            .filter(|n| job.run_on.allow(&n.tags))
            .map(|n| n.node)
            .collect();
        // This node may run it (it claimed it), whether or not its own
        // record was in the last answer.
        members.push(self.name.to_string());
        members.sort();
        members.dedup();
        let max = crate::store::MAX_SHARDS as usize;
        if members.len() > max {
            tracing::warn!(job = %job.name, nodes = members.len(), "more live nodes than shards: the first {max} by name run it");
            members.truncate(max);
        }
        let count = members.len() as u32;
        // A claim handed back by a dead dispatcher's guard: the shards it
        // requested and that ran are not requested again.
        // When that cannot be read, none is requested: a shard that ran
        // would run again (at most once, as the claim it hands back).
        let ran_already: Option<Vec<JobName>> =
            match ticket.trigger.and_then(TriggerId::redelivery_of) {
                Some(_) => self.shards_run(&job, &members, ticket.occurrence).await,
                None => Some(Vec::new()),
            };
        let job_ref: &Job = &job;
        let asks = members.iter().enumerate().map(|(i, node)| {
            let job = job_ref;
            let lock = job.name.shard(node);
            let id = TriggerId::shard(ticket.occurrence, i as u32, count);
            let done = ran_already.as_ref().map(|ran| ran.contains(&lock));
            async move {
                let said = match id {
                    _ if done == Some(true) => ": ran already".to_string(),
                    _ if done.is_none() => {
                        ": not requested (whether it ran could not be read)".to_string()
                    }
                    Some(id) => self.ask_shard(job, &lock, id).await,
                    None => "not requested (no id)".to_string(),
                };
                format!("{node} (shard {i}{said})")
            }
        });
        let said = futures_util::future::join_all(asks).await;
        // This node's own shard at once, not at its next look.
        if let Some(i) = members.iter().position(|m| m == self.name.as_str())
            && let Some(id) = TriggerId::shard(ticket.occurrence, i as u32, count)
        {
            self.take_shard(
                job.name.shard(self.name.as_str()).as_str(),
                id,
                self.wall.now(),
            );
        }
        tracing::info!(job = %job.name, fence = ticket.fence, occurrence = %Rfc3339(ticket.occurrence), shards = count, "occurrence dispatched to every node");
        let finished = Finished {
            output: format!(
                "cronlease: dispatched to {count} node{}: {}",
                if count == 1 { "" } else { "s" },
                said.join(", ")
            ),
            ..Finished::without_process(Outcome::Dispatched, self.wall.now())
        };
        state.run_is_over();
        self.finish(state, ticket, finished).await
    }

    /// The shard locks of `members` whose last run is of `occurrence`;
    /// `None` when their history could not be read.
    async fn shards_run(
        &self,
        job: &Job,
        members: &[String],
        occurrence: DateTime<Utc>,
    ) -> Option<Vec<JobName>> {
        let locks: Vec<JobName> = members.iter().map(|m| job.name.shard(m)).collect();
        match self
            .call(
                "last_runs",
                self.settings.op_timeout,
                self.store.last_runs(&locks),
            )
            .await
        {
            Ok(last) => Some(
                locks
                    .into_iter()
                    .zip(last)
                    .filter(|(_, r)| r.as_ref().is_some_and(|r| r.occurrence == occurrence))
                    .map(|(lock, _)| lock)
                    .collect(),
            ),
            Err(_) => None,
        }
    }

    /// Leaves shard request `id` in `lock`; what became of it, for the
    /// dispatch's record (empty: requested). An older occurrence's shard
    /// still pending there (its node never took it, and no peer did within
    /// its window) is recorded `missed` first.
    async fn ask_shard(self: &Arc<Self>, job: &Job, lock: &JobName, id: TriggerId) -> String {
        let ask = || {
            self.call(
                "request_trigger",
                self.settings.op_timeout,
                self.store.request_trigger(lock, id),
            )
        };
        let mut answer = ask().await;
        if let Ok(TriggerAnswer::Pending(old)) = &answer
            && old
                .shard_of()
                .is_some_and(|(at, ..)| Some(at) < id.requested_at())
        {
            let state = self.shard_state(job, lock);
            self.end_shard(
                &state,
                *old,
                "the next occurrence was dispatched before any node took it".into(),
            )
            .await;
            answer = ask().await;
        }
        match answer {
            Ok(TriggerAnswer::Accepted) => String::new(),
            Ok(TriggerAnswer::Pending(p)) if p == id => String::new(),
            Ok(TriggerAnswer::Pending(p)) => format!(": not requested, request {p} pending"),
            Ok(TriggerAnswer::Running { .. }) => {
                ": not requested, its previous run still going (overlap)".to_string()
            }
            Err(e) => format!(": not requested ({e})"),
        }
    }

    /// Takes shard request `id` of shard lock `lock` (docs/protocol.md,
    /// "Broadcast") if it is this node's, or one its node left (see the
    /// module), or ends it past its window; otherwise leaves it for a
    /// later look. Only a node that may run the broadcast job takes any.
    pub(super) fn take_shard(self: &Arc<Self>, lock: &str, id: TriggerId, now: DateTime<Utc>) {
        let Some((at, ..)) = id.shard_of() else {
            return;
        };
        let Ok(lock) = JobName::parse(lock) else {
            return;
        };
        let Some(base) = lock.shard_of().and_then(|b| self.claimable_state_of(b)) else {
            return;
        };
        let job = base.job();
        if !job.every_node {
            return;
        }
        let next = job.schedule.next_after(at);
        let (every, _) = super::membership::beat_timing(self.settings.margin);
        // At least long enough for a peer to take a dead node's shard (a
        // manual run's occurrence may come just before an instant); the
        // next occurrence's dispatch ends one still pending then anyway.
        let (window, _) = super::claim::start_window(&job, at, next);
        let window = window.max(steal_after(every, self.settings.margin) + every);
        let late = (now - at).to_std().unwrap_or_default();
        let mine = job.name.shard(self.name.as_str()) == lock;
        let owner_live = self
            .live_nodes()
            .iter()
            .any(|n| job.name.shard(&n.node) == lock);
        let wait = if owner_live {
            steal_after(every, self.settings.margin)
        } else {
            every
        };
        let ending = late > window;
        if !(mine || ending || late >= wait) {
            return;
        }
        let state = self.shard_state(&job, &lock);
        if state.is_running() || !self.triggers.start(lock.as_str(), id) {
            return;
        }
        if !mine && !ending {
            tracing::warn!(job = %job.name, shard = %lock, occurrence = %Rfc3339(at), "a shard its node did not take: taking it here");
        }
        let node = self.clone();
        self.life.handlers.spawn(async move {
            if ending {
                let why = format!(
                    "not taken within its window ({})",
                    humantime::format_duration(window)
                );
                node.end_shard(&state, id, why).await;
            } else {
                node.claim_trigger(&state, id).await;
            }
            node.triggers.end(lock.as_str(), id);
        });
    }

    /// Claims shard request `id` and records it `missed` (`why`), not run.
    async fn end_shard(self: &Arc<Self>, state: &Arc<JobState>, id: TriggerId, why: String) {
        let Ok(_gate) = state.claim_gate.clone().try_lock_owned() else {
            return;
        };
        let Some((at, index, count)) = id.shard_of() else {
            return;
        };
        let why = format!("shard {index} of {count} not run: {why}");
        self.claim_as_missed(state, id, Some(at), why).await;
    }

    /// The state of shard lock `lock` of broadcast job `job` on this node:
    /// the job's definition under the shard's name, kept while the node
    /// runs (made again when the job's definition changed).
    fn shard_state(&self, job: &Job, lock: &JobName) -> Arc<JobState> {
        let wanted = Job {
            name: lock.clone(),
            ..job.clone()
        };
        let Ok(mut shards) = self.shards.lock() else {
            return Arc::new(JobState::new(wanted));
        };
        let state = shards
            .entry(lock.clone())
            .or_insert_with(|| Arc::new(JobState::new(wanted.clone())))
            .clone();
        if !state.job().same_definition(&wanted) {
            state.set_job(wanted);
        }
        state
    }
}
