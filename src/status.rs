//! What `status --json` prints and the dashboard's `/api/status` serves:
//! one row per job, gathered from the store's locks, its node registry,
//! each job's newest history record and the audit's newest entries (one
//! place, so the two never differ).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::config::{Config, JobName};
use crate::store::{
    Act, AuditEntry, LockStatus, NodeRecord, Owner, RunRecord, RunningRun, Store, StoreError,
    TriggerId, bounded,
};

/// The audit's newest entries across the cluster a status reads: each
/// job's last action is its newest among them.
pub const STATUS_ACTIONS: u32 = 256;

/// One job's line of `status`.
#[derive(Debug, Clone, Serialize)]
pub struct JobStatus {
    pub job: String,
    /// Defined in this node's configuration.
    pub configured: bool,
    /// A shard's lock of a broadcast job (`JOB~NODE`, docs/protocol.md
    /// "Broadcast"): the job's name.
    pub shard_of: Option<String>,
    pub holder: Option<String>,
    pub holder_node: Option<String>,
    /// The holder has a live record in the node registry (`None`: no holder).
    pub holder_alive: Option<bool>,
    /// The holder's clock offset as its registry record says (store −
    /// node; on etcd against the median of the live nodes' clocks).
    pub holder_clock_offset_ms: Option<i64>,
    pub lease_remaining_ms: u64,
    pub fence: u64,
    /// Paused cluster-wide by `cronlease pause`.
    pub paused: bool,
    /// A paused job's newest `pause` in the audit: who paused it, when and
    /// why (`None` when not paused, or not among the audit's newest
    /// [`STATUS_ACTIONS`] entries).
    pub paused_by: Option<AuditEntry>,
    /// The job's newest entry in the audit (among the cluster's newest
    /// [`STATUS_ACTIONS`]): who last paused, resumed, triggered or
    /// cancelled it, and why.
    pub last_action: Option<AuditEntry>,
    pub last_occurrence: Option<DateTime<Utc>>,
    pub last_run: Option<RunRecord>,
    /// The job's next scheduled instant after now, by this node's
    /// configuration (`None` for a job not configured here).
    pub next_fire: Option<DateTime<Utc>>,
    /// A manual run's request no node has taken yet.
    pub pending_trigger: Option<PendingTrigger>,
    /// The runs of this job going now, as the live nodes' last beats say
    /// (docs/protocol.md, "Running now"), the longest-running first.
    pub running: Vec<RunGoing>,
    /// Live nodes that say another live node defines this job otherwise
    /// (docs/protocol.md, "Job definitions across nodes"): empty when every
    /// live node that has it agrees.
    pub defined_otherwise_on: Vec<String>,
    /// The job's `run_on` by this node's configuration: the tags a node
    /// must have to run it (empty: any node).
    pub run_on: Vec<String>,
    /// The live nodes that may run it (every tag of `run_on`), by name:
    /// `None` when the registry could not be read or the job is not
    /// configured here.
    pub eligible_nodes: Option<Vec<String>>,
}

/// A run going now on a live node.
#[derive(Debug, Clone, Serialize)]
pub struct RunGoing {
    pub node: String,
    pub owner: String,
    pub fence: u64,
    pub occurrence: DateTime<Utc>,
    /// By the node's clock.
    pub started_at: DateTime<Utc>,
    /// How long it had run at the node's last beat (its monotonic clock;
    /// up to a heartbeat period behind).
    pub elapsed_ms: u64,
    /// `scheduled` (its occurrence), `manual` (`cronlease trigger`),
    /// `retry`, `redelivery` or `catch_up` (of an occurrence missed while
    /// paused).
    pub kind: &'static str,
    /// Which try of its occurrence it is.
    pub attempt: u32,
    /// The request it runs (all but `scheduled`).
    pub trigger: Option<TriggerId>,
}

impl RunGoing {
    fn of(node: &NodeRecord, run: &RunningRun) -> RunGoing {
        let kind = match run.trigger {
            None => "scheduled",
            Some(id) if id.retry_of().is_some() => "retry",
            Some(id) if id.redelivery_of().is_some() => "redelivery",
            Some(id) if id.resumed_at().is_some() => "catch_up",
            Some(_) => "manual",
        };
        RunGoing {
            node: node.node.clone(),
            owner: node.owner.clone(),
            fence: run.fence,
            occurrence: run.occurrence,
            started_at: run.started_at,
            elapsed_ms: run.elapsed_ms,
            kind,
            attempt: run.attempt,
            trigger: run.trigger,
        }
    }
}

/// A pending manual run's request (`cronlease trigger`), with its age, or
/// a retry's (`retry`), with its attempt and when it is due.
#[derive(Debug, Clone, Serialize)]
pub struct PendingTrigger {
    pub id: TriggerId,
    /// When it was made (the store's clock, as `trigger` read it); `None` for an id of
    /// an earlier build, which carries no time, and for a retry's.
    pub requested_at: Option<DateTime<Utc>>,
    pub age_ms: Option<u64>,
    /// A retry's: which attempt of its occurrence it is.
    pub attempt: Option<u32>,
    /// A retry's: when it is due; a redelivery's: when the attempt it
    /// hands back was due.
    pub due_at: Option<DateTime<Utc>>,
    /// A redelivery's: a claim a dead daemon's guard handed back.
    pub redelivered: bool,
    /// A resume's: the catch-up of an occurrence missed while paused
    /// (docs/protocol.md, "Catch-up on resume").
    pub resumed: bool,
}

/// Every configured job, and every job the store has a lock for, in name
/// order; each store call bounded by `call`.
pub async fn gather(
    config: &Config,
    store: &dyn Store,
    call: Duration,
) -> Result<Vec<JobStatus>, StoreError> {
    let locks = bounded(call, store.status()).await?;
    // Unknown (not failed) when the registry cannot be read: a store an
    // older version migrated has no registry until a daemon of this one
    // starts on it.
    let nodes = bounded(call, store.nodes()).await.ok();
    let live: Option<HashMap<String, Option<i64>>> = nodes.as_ref().map(|nodes| {
        nodes
            .iter()
            .map(|n| (n.owner.clone(), n.clock_offset_ms))
            .collect()
    });
    let now = Utc::now();
    let mut running: HashMap<&str, Vec<RunGoing>> = HashMap::new();
    for n in nodes.iter().flatten() {
        for run in &n.running {
            running
                .entry(run.job.as_str())
                .or_default()
                .push(RunGoing::of(n, run));
        }
    }
    for runs in running.values_mut() {
        runs.sort_by(|a, b| (a.started_at, &a.owner).cmp(&(b.started_at, &b.owner)));
    }
    let mut otherwise: HashMap<&str, Vec<String>> = HashMap::new();
    for n in nodes.iter().flatten() {
        for job in n.definitions.iter().flat_map(|d| &d.differ) {
            let on = otherwise.entry(job.as_str()).or_default();
            if !on.contains(&n.node) {
                on.push(n.node.clone());
            }
        }
    }
    let mut by_job: BTreeMap<String, Option<LockStatus>> = config
        .jobs
        .iter()
        .map(|j| (j.name.to_string(), None))
        .collect();
    for lock in locks {
        by_job.insert(lock.job.clone(), Some(lock));
    }
    for job in running.keys() {
        by_job.entry(job.to_string()).or_insert(None);
    }
    let mut pending: HashMap<String, PendingTrigger> = bounded(call, store.pending_triggers())
        .await?
        .into_iter()
        .map(|(job, id)| {
            let retry = id.daemons_attempt();
            let requested_at = id.requested_at().filter(|_| retry.is_none());
            let age_ms = id
                .age(now)
                .filter(|_| retry.is_none())
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            (
                job,
                PendingTrigger {
                    id,
                    requested_at,
                    age_ms,
                    attempt: retry.map(|(k, _)| k),
                    due_at: retry.map(|(_, due)| due),
                    redelivered: id.redelivery_of().is_some(),
                    resumed: id.resumed_at().is_some(),
                },
            )
        })
        .collect();
    for job in pending.keys() {
        by_job.entry(job.clone()).or_insert(None);
    }
    // The newest run of every job, in one read per page of jobs: a
    // dashboard of 20,000 jobs is not 20,000 round trips a refresh. A lock
    // whose name is no job name (written by hand) has no history to read.
    let names: Vec<JobName> = by_job
        .keys()
        .filter_map(|job| JobName::parse(job).ok())
        .collect();
    let mut last_runs: HashMap<String, RunRecord> = bounded(call, store.last_runs(&names))
        .await?
        .into_iter()
        .flatten()
        .map(|r| (r.job.clone(), r))
        .collect();
    // Unknown (not failed) when the audit cannot be read: a store an older
    // version migrated has none until this one migrates it.
    let mut actions: HashMap<String, Vec<AuditEntry>> = HashMap::new();
    for entry in bounded(call, store.actions(None, STATUS_ACTIONS))
        .await
        .unwrap_or_default()
    {
        actions.entry(entry.job.clone()).or_default().push(entry);
    }
    let mut rows = Vec::with_capacity(by_job.len());
    for (job, lock) in by_job {
        let last_run = last_runs.remove(&job);
        let paused = lock.as_ref().is_some_and(|l| l.paused);
        // Newest first, as the store answers them.
        let acted = actions.remove(&job).unwrap_or_default();
        // The newest pause since the last resume (a pause whose entry was
        // not written leaves none, never an older pauser).
        let paused_by = acted
            .iter()
            .take_while(|a| a.action != Act::Resume)
            .find(|a| a.action == Act::Pause)
            .filter(|_| paused)
            .cloned();
        let configured = config.job(&job);
        let run_on = configured.map(|j| j.run_on.clone()).unwrap_or_default();
        let eligible_nodes = nodes
            .as_ref()
            .filter(|_| configured.is_some())
            .map(|nodes| {
                let mut names: Vec<String> = nodes
                    .iter()
                    .filter(|n| run_on.allow(&n.tags))
                    .map(|n| n.node.clone())
                    .collect();
                names.dedup();
                names
            });
        let holder = lock.as_ref().and_then(|l| l.holder.clone());
        let live_entry = holder.as_ref().zip(live.as_ref());
        rows.push(JobStatus {
            configured: configured.is_some(),
            shard_of: JobName::parse(&job)
                .ok()
                .and_then(|n| n.shard_of().map(str::to_string)),
            next_fire: configured.and_then(|j| j.schedule.next_after(now)),
            holder_node: holder.as_deref().map(|h| Owner::node_of(h).to_string()),
            holder_alive: live_entry.map(|(h, live)| live.contains_key(h)),
            holder_clock_offset_ms: live_entry.and_then(|(h, live)| live.get(h).copied().flatten()),
            holder,
            lease_remaining_ms: lock.as_ref().map_or(0, |l| l.lease_remaining_ms),
            fence: lock.as_ref().map_or(0, |l| l.fence),
            paused,
            paused_by,
            last_action: acted.into_iter().next(),
            last_occurrence: lock.as_ref().and_then(|l| l.last_occurrence),
            last_run,
            pending_trigger: pending.remove(&job),
            running: running.remove(job.as_str()).unwrap_or_default(),
            defined_otherwise_on: otherwise.remove(job.as_str()).unwrap_or_default(),
            run_on: run_on.as_slice().to_vec(),
            eligible_nodes,
            job,
        });
    }
    Ok(rows)
}
