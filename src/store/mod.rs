//! The shared lock store: one small trait, a backend per URL scheme.
//!
//! Every backend gives the same answer to the same question (docs/protocol.md):
//! [`Locks::claim`] is one atomic step evaluated on the **store's clock**. It
//! succeeds iff the job's lease is free, expired or already ours, and the
//! occurrence is later than the last one claimed. It then bumps the fencing
//! token and, with `misfire = "run_once"`, may hand out the most recent missed
//! occurrence instead (a *catch-up*). Losing a race is an outcome
//! ([`ClaimOutcome::Lost`]) carrying what a peer needs to time its takeover,
//! not an error.
//!
//! Backends: [`sql`] (SQLite, MySQL/MariaDB, PostgreSQL through sqlx) and
//! [`redis`] (Lua scripts; also a master found through Sentinel, and
//! Redlock over independent masters), [`zookeeper`] (compare-and-set on a
//! node per job), [`etcd`] (transactions on a state key and a leased key
//! per job); `memory` (feature `memory`) is an in-process one
//! for tests, held to the same suite. Which one runs is decided at run time from the
//! URL by [`connect`] from one table of backends by scheme; a backend left
//! out of the build answers with a clear "not built in" error. A store is
//! five concerns, [`Locks`] (claims, leases, the clock), [`History`]
//! (finished runs), [`Registry`] (the live nodes), [`Outbox`] (what a
//! node hands over to a peer) and [`Audit`] (who acted on a job, and why);
//! [`Store`] is all five, what a backend
//! implements. Every backend is checked by the same conformance
//! suite in `tests/it/conformance.rs`.

pub mod audit;
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
mod cas;
#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "memory")]
pub mod memory;
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "zookeeper",
    feature = "etcd"
))]
mod notices;
pub mod outbox;
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
mod records;
#[cfg(feature = "redis")]
pub mod redis;
pub mod registry;
mod rule;
#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
pub mod sql;
mod trigger;
#[cfg(feature = "zookeeper")]
pub mod zookeeper;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, TimeZone, Utc};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::{JobName, Misfire, NodeName, StoreConfig, StoreKind};
pub use audit::{Act, Audit, AuditEntry};
pub use outbox::{Outbox, Parcel};
pub use registry::{ClaimProgress, DefinitionsBeat, Heartbeat, NodeRecord, Registry, RunningRun};
pub use rule::{
    Decision, LockRow, claim_row, claim_rows, clears_running, decide, ends_a_run, trigger_row,
};
pub use trigger::{
    MAX_REDELIVERIES, MAX_RETRY_ATTEMPTS, MAX_SHARDS, Redelivery, TRIGGER_RANDOM_BITS, TriggerId,
};
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
pub(crate) use trigger::{pending_from_entries, trigger_entry};

/// Who holds a lease: the node name plus a random suffix, unique per process
/// incarnation, so a restarted node never inherits its previous life's lease.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct Owner(String);

impl Owner {
    /// A fresh owner for this process: `node#xxxxxxxx`.
    pub fn new(node: &NodeName) -> Self {
        let mut bytes = [0u8; 4];
        // Without randomness, pid and time still make a restarted node distinct.
        if getrandom::fill(&mut bytes).is_err() {
            let now = Utc::now().timestamp_subsec_nanos() ^ std::process::id();
            bytes = now.to_le_bytes();
        }
        Owner(format!("{}#{:08x}", node, u32::from_le_bytes(bytes)))
    }

    /// An owner string as stored (for tests and tools).
    pub fn from_raw(s: impl Into<String>) -> Self {
        Owner(s.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The node part of an owner string.
    pub fn node_of(owner: &str) -> &str {
        owner.rsplit_once('#').map_or(owner, |(node, _)| node)
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The store's answer to a manual run's request ([`Locks::request_trigger`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TriggerAnswer {
    /// Recorded with the job's lock: a node claims it.
    Accepted,
    /// A run of the job is in progress (its lease is live and its run not
    /// recorded): refused, nothing recorded.
    Running { holder: Option<String> },
    /// Another request of the job is pending, not yet claimed: refused.
    Pending(TriggerId),
}

/// One claim of one occurrence of one job.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    pub job: JobName,
    /// The scheduled instant being claimed.
    pub occurrence: DateTime<Utc>,
    /// The occurrence before it, so a missed one can be caught up atomically.
    pub previous: Option<DateTime<Utc>>,
    /// The occurrence before `previous`: with `run_once`, a catch-up of
    /// `previous` over a lock whose last occurrence is older than this one
    /// leaves occurrences nobody claimed ([`Won::unclaimed_after`]).
    pub before_previous: Option<DateTime<Utc>>,
    pub misfire: Misfire,
    pub owner: Owner,
    /// Lease length, counted on the store's clock from the moment it decides.
    pub lease: Duration,
    /// The highest fence this node has seen for the job.
    pub fence_floor: u64,
    /// `cluster.max_clock_offset`: an occurrence later than the store's now
    /// plus this is refused, so a node whose clock runs ahead never runs a
    /// job early.
    pub max_offset: Duration,
    /// `cluster.head_start`: another owner's live lease whose last claimed
    /// run has finished (an idle holder) is taken over once the store's
    /// clock is this far past the occurrence. `None`: a live lease is
    /// waited out whatever its holder does.
    pub head_start: Option<Duration>,
    /// An earlier claim of this occurrence by this owner got no answer (a
    /// timeout, a dropped link): it may have won. If the store shows this
    /// owner holding the job with a fence above `fence_floor` and the
    /// occurrence (or, with `run_once`, its catch-up) recorded, that win is
    /// answered again with its own fence instead of being lost.
    pub after_unanswered: bool,
    /// Only asks, with `after_unanswered`, whether that earlier claim won:
    /// the store answers such a win again (same fence) without extending its
    /// lease, and refuses anything else without writing. Sent when the
    /// occurrence's window closed on an unanswered claim, so a win nobody
    /// ran is recorded instead of vanishing.
    pub recheck_only: bool,
    /// Where the occurrence's window ends (the next occurrence): a claim
    /// the store decides at or after this instant, by its clock, is stale
    /// (it waited behind a stall) and is refused without writing anything
    /// (docs/protocol.md, "Claims answered late"). `None`: no bound (a
    /// manual run, a tool).
    pub window_end: Option<DateTime<Utc>>,
    /// A manual run: claims the pending request with this id instead of an
    /// occurrence ([`decide`]). `occurrence`, `previous`, `misfire`,
    /// `max_offset` and `head_start` are not used, the pause mark is not
    /// checked, and the job's last occurrence stays as it is.
    pub manual: Option<TriggerId>,
    /// The job's `delivery = "at_least_once"` (docs/protocol.md, "At least
    /// once"): a claim of the occurrence after `previous` finds the lock's
    /// last occurrence equal to `previous`, its run not recorded (the
    /// running mark), set by a scheduled claim, and its lease ended with
    /// another owner: that holder died (with its guard) during or before
    /// the run. The claim wins `previous` again, as a catch-up marked
    /// [`Won::redelivered`], whatever `misfire` says.
    pub redeliver: bool,
}

/// One lease renewal in a batch.
#[derive(Debug, Clone)]
pub struct Renewal {
    pub job: JobName,
    /// The new lease length, from the store's now.
    pub lease: Duration,
}

/// A won claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Won {
    pub fence: u64,
    /// The occurrence now owned: the requested one, or the missed one caught up.
    pub occurrence: DateTime<Utc>,
    /// `occurrence` is a missed one; the requested occurrence is still to claim.
    pub catch_up: bool,
    /// With `catch_up`: `occurrence` was claimed before by a holder that
    /// never recorded its run, and runs again ([`ClaimRequest::redeliver`]).
    pub redelivered: bool,
    /// The lock's last occurrence when the occurrences after it and before
    /// `occurrence` were claimed by nobody (docs/protocol.md, "Occurrences
    /// nobody claimed"): the fence below `fence` is kept for their
    /// `missed` record. `None` when there are none (or the win is one
    /// answered again).
    pub unclaimed_after: Option<DateTime<Utc>>,
    /// Who held the lock before (live or not): a different node means takeover.
    pub previous_owner: Option<String>,
}

/// A refused claim, with what the store knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lost {
    /// The owner of the live lease, if any.
    pub holder: Option<String>,
    /// Time left on that lease by the store's clock (zero if none).
    pub remaining: Duration,
    /// The last occurrence claimed by anyone.
    pub last_occurrence: Option<DateTime<Utc>>,
    /// The job's current fence.
    pub fence: u64,
    /// Refused because the occurrence is later than the store's now plus
    /// the allowed clock offset: the claimer's clock runs ahead.
    pub too_early: bool,
    /// The live holder is idle (its last claimed run finished) and has not
    /// claimed this occurrence: a claim may win it after this much more
    /// store time (the rest of the head start). `None`: the holder is busy,
    /// or the request asked for no head start rule.
    pub idle_wait: Option<Duration>,
    /// Refused because the job is paused (`cronlease pause`): no node
    /// claims an occurrence of it until it is resumed, so there is nothing
    /// to wait for.
    pub paused: bool,
    /// A manual claim refused because its request is no longer pending
    /// (claimed already, or never recorded): nothing to try again.
    pub trigger_gone: bool,
    /// Refused because the store decided it after the occurrence's window
    /// ([`ClaimRequest::window_end`]): too late to run, nothing written.
    pub stale: bool,
}

/// The answer to a [`ClaimRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    Won(Won),
    Lost(Lost),
    /// This request could not be decided (its fence is exhausted, its row is
    /// malformed); the other requests of the batch were decided as usual.
    Failed(String),
}

/// The answers to a batch of claims, with the store's clock when it decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    /// The store's clock while it decided (for the node's clock offset).
    pub store_now: DateTime<Utc>,
    /// One answer per request, in request order.
    pub outcomes: Vec<ClaimOutcome>,
}

/// A job's lock as the store has it, for `status`.
#[derive(Debug, Clone, Serialize)]
pub struct LockStatus {
    pub job: String,
    /// Owner of the live lease, if any.
    pub holder: Option<String>,
    /// Lease time left, in milliseconds of store time (0 when free).
    pub lease_remaining_ms: u64,
    pub fence: u64,
    pub last_occurrence: Option<DateTime<Utc>>,
    /// Last owner, even after the lease ended.
    pub last_owner: Option<String>,
    /// Paused by `cronlease pause`: every claim of the job is refused.
    pub paused: bool,
}

/// How a run ended (docs/protocol.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Failed,
    Timeout,
    LeaseLost,
    Killed,
    /// The command could not be spawned (no such file, no permission).
    NotStarted,
    /// Claimed, but the previous run was still going (`overlap = "skip"`).
    Skipped,
    /// Not started within its `starting_deadline` (the record's output
    /// says why); never run late.
    Missed,
    /// Stopped by `cronlease cancel` (or the API): who and why follow the
    /// output in the record. Not a failure: no `on_failure`, no retry.
    Cancelled,
    /// A broadcast job's occurrence (`placement = "every_node"`): not run
    /// under the job's own lock but handed to its shards, each a request in
    /// its own lock that one node runs (the output names them).
    Dispatched,
    /// Stopped because the job's next occurrence came (`overlap =
    /// "replace"`): the run of that occurrence follows. Not a failure.
    Replaced,
    /// A manual run's request no node took within `cluster.trigger_expiry`:
    /// claimed by the node that found it expired, recorded, never run.
    Expired,
    /// A history row this version does not understand (a newer version's
    /// outcome, a hand edit, a malformed entry): shown, never an error.
    Unknown(String),
}

impl Outcome {
    /// The stored form.
    pub fn as_str(&self) -> &str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Failed => "failed",
            Outcome::Timeout => "timeout",
            Outcome::LeaseLost => "lease_lost",
            Outcome::Killed => "killed",
            Outcome::NotStarted => "not_started",
            Outcome::Skipped => "skipped",
            Outcome::Expired => "expired",
            Outcome::Missed => "missed",
            Outcome::Cancelled => "cancelled",
            Outcome::Replaced => "replaced",
            Outcome::Dispatched => "dispatched",
            Outcome::Unknown(raw) => raw,
        }
    }

    /// The job did not do its work: `failed`, `timeout`, `lease_lost`,
    /// `killed`, `not_started`, `missed` (what `on_failure` follows, and
    /// what `on_recovery` recovers from).
    pub fn is_failure(&self) -> bool {
        matches!(
            self,
            Outcome::Failed
                | Outcome::Timeout
                | Outcome::LeaseLost
                | Outcome::Killed
                | Outcome::NotStarted
                | Outcome::Missed
        )
    }

    /// The stored form read back; anything else is [`Outcome::Unknown`].
    pub fn parse(s: &str) -> Self {
        match s {
            "ok" => Outcome::Ok,
            "failed" => Outcome::Failed,
            "timeout" => Outcome::Timeout,
            "lease_lost" => Outcome::LeaseLost,
            "killed" => Outcome::Killed,
            "missed" => Outcome::Missed,
            "not_started" => Outcome::NotStarted,
            "skipped" => Outcome::Skipped,
            "expired" => Outcome::Expired,
            "cancelled" => Outcome::Cancelled,
            "replaced" => Outcome::Replaced,
            "dispatched" => Outcome::Dispatched,
            other => Outcome::Unknown(other.chars().take(64).collect()),
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Unknown(raw) => write!(f, "unknown({raw})"),
            known => f.write_str(known.as_str()),
        }
    }
}

impl Serialize for Outcome {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// One finished run, as kept in the store's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RunRecord {
    pub job: String,
    pub fence: u64,
    pub owner: String,
    pub node: String,
    pub occurrence: DateTime<Utc>,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub outcome: Outcome,
    pub exit_code: Option<i32>,
    /// The lock changed owner with this claim.
    pub takeover: bool,
    /// Start lateness after the scheduled instant, in milliseconds.
    pub delay_ms: u64,
    /// From the scheduled instant to the claim's answer, in milliseconds:
    /// the part of `delay_ms` the claim took (0 in records of older versions).
    pub decision_ms: u64,
    /// The run's output tail (`output_tail`, [`crate::output`]); empty when
    /// none was kept, and in records of older versions.
    pub output: String,
    /// A manual run (`cronlease trigger`) or a retry (`retry`): its
    /// request's id.
    pub trigger: Option<TriggerId>,
    /// CPU time the run used, user and system, in milliseconds (systemd
    /// runner; `None` where the runner cannot tell, and in records of
    /// older versions).
    pub cpu_ms: Option<u64>,
    /// The most memory the run's processes held at once, in bytes (systemd
    /// 254 or newer).
    pub memory_peak: Option<u64>,
}

/// A history record as `history --json` and `/api/history` show it: the
/// record's fields and which try of its occurrence the run was.
#[derive(Debug, Clone, Serialize)]
pub struct ShownRecord {
    #[serde(flatten)]
    pub record: RunRecord,
    /// 1, or a retry's attempt (`retry`, [`TriggerId::retry`]).
    pub attempt: u32,
    /// A run of a claim handed back by a dead daemon's guard
    /// ([`TriggerId::redelivery`]).
    pub redelivered: bool,
}

impl From<RunRecord> for ShownRecord {
    fn from(record: RunRecord) -> Self {
        ShownRecord {
            attempt: TriggerId::attempt(record.trigger),
            redelivered: record.trigger.is_some_and(|t| t.redelivery_of().is_some()),
            record,
        }
    }
}

/// How long a run on a lease may go when the store can end leases before
/// their time ([`Locks::run_bound`]): monotonic instants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunBound {
    /// Stop the run (SIGTERM) once this passes without a newer bound.
    pub stop_by: tokio::time::Instant,
    /// The run must be gone (SIGKILL) by then: a peer may take over after.
    pub kill_by: tokio::time::Instant,
}

/// A store call that did not give an answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store {store} unreachable: {reason}")]
    Unavailable { store: String, reason: String },
    #[error("store call timed out after {0:?}")]
    Timeout(Duration),
    #[error("store {store} failed: {reason}")]
    Backend { store: String, reason: String },
    /// The store answered and refused this node for good: credentials
    /// rejected, no such database, a TLS handshake that fails. Retrying
    /// changes nothing until the configuration or the store does.
    #[error("store {store} refused this node: {reason}")]
    Refused { store: String, reason: String },
    #[error(
        "store {store} has no cronlease tables yet: run `cronlease migrate` (or start `cronlease run`, which applies them)"
    )]
    NotMigrated { store: String },
    #[error(
        "store {store} has cronlease schema version {found}, newer than this binary knows ({known}) and marked incompatible with it (versions {breaking} and up): claiming nothing; upgrade cronlease on this host (docs/operations.md, \"Upgrade\")"
    )]
    SchemaTooNew {
        store: String,
        found: i64,
        known: i64,
        breaking: i64,
    },
    #[error("{0}")]
    NotBuiltIn(String),
}

/// Schema versions are numbered so that a change older binaries cannot work
/// with starts a new block of this many: a binary refuses a schema from a
/// later block, and claims on a newer one of its own block with a WARN
/// (docs/operations.md, "Upgrade").
pub const SCHEMA_BLOCK: i64 = 100;

/// What a binary that knows schema versions up to `known` makes of a store
/// at version `found`: `None` when it knows it; `Some(Ok(note))` for a newer
/// version it may still use (the note says so); `Some(Err(e))` for one it
/// must not claim on.
pub fn newer_schema(store: &str, found: i64, known: i64) -> Option<Result<String, StoreError>> {
    if found <= known {
        return None;
    }
    if found / SCHEMA_BLOCK > known / SCHEMA_BLOCK {
        return Some(Err(StoreError::SchemaTooNew {
            store: store.to_string(),
            found,
            known,
            breaking: found / SCHEMA_BLOCK * SCHEMA_BLOCK,
        }));
    }
    Some(Ok(format!(
        "schema version {found} is newer than this binary knows ({known}); it is compatible, so this binary claims on it, but upgrade cronlease on this host"
    )))
}

/// The record format version of the key-value stores (Redis, Sentinel,
/// Redlock, ZooKeeper, etcd): their schema version, kept in one `format`
/// record that [`Locks::prepare`] reads and raises to this when it is
/// missing or older. Numbered in blocks of [`SCHEMA_BLOCK`] as the SQL
/// schema is (docs/operations.md, "Upgrade").
pub const RECORD_FORMAT: i64 = 1;

/// A `format` record's text as a version: a whole number from 1, or an
/// error naming the record (a stray write, another program's key).
#[cfg(any(feature = "redis", feature = "etcd", feature = "zookeeper"))]
pub(crate) fn parse_format(store: &str, record: &str, text: &str) -> Result<i64, StoreError> {
    match text.trim().parse::<i64>() {
        Ok(v) if v >= 1 => Ok(v),
        _ => {
            let shown: String = text.chars().take(32).collect();
            Err(StoreError::Backend {
                store: store.to_string(),
                reason: format!(
                    "the format record {record} holds {shown:?}, not a cronlease format version: claiming nothing; remove it if no cronlease wrote it (docs/operations.md, \"Upgrade\")"
                ),
            })
        }
    }
}

/// How often a key-value store reads its `format` record again when another
/// node changed it between the read and the conditional write.
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
pub(crate) const FORMAT_ATTEMPTS: usize = 5;

/// The `format` record changed under every one of [`FORMAT_ATTEMPTS`].
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
pub(crate) fn format_contended(store: &str, record: &str) -> StoreError {
    StoreError::Unavailable {
        store: store.to_string(),
        reason: format!(
            "the format record {record} changed under each of {FORMAT_ATTEMPTS} attempts to read it"
        ),
    }
}

/// What the last [`Locks::prepare`] found about the store's schema, for
/// [`Locks::schema_notice`].
#[derive(Debug, Default)]
pub(crate) struct SchemaNotice(std::sync::Mutex<Option<String>>);

impl SchemaNotice {
    /// Settles the store's version `found` (0: none recorded yet) against
    /// this binary's `known`: a newer one of a later block is refused, a
    /// newer one of this block is logged once per prepare and kept as the
    /// notice, anything else clears it.
    pub(crate) fn settle(&self, store: &str, found: i64, known: i64) -> Result<(), StoreError> {
        let notice = match newer_schema(store, found, known) {
            Some(Err(e)) => return Err(e),
            Some(Ok(note)) => {
                tracing::warn!(store = %store, "{note}");
                Some(note)
            }
            None => None,
        };
        *lock(&self.0) = notice;
        Ok(())
    }

    pub(crate) fn get(&self) -> Option<String> {
        lock(&self.0).clone()
    }
}

impl StoreError {
    /// A backend opened with another backend's URL (`what`: the URL it
    /// takes, `"a zk:// URL"`).
    #[cfg(any(
        feature = "sqlite",
        feature = "mysql",
        feature = "postgres",
        feature = "redlock",
        feature = "zookeeper",
        feature = "etcd"
    ))]
    pub(crate) fn not_a(config: &StoreConfig, what: &str) -> StoreError {
        StoreError::Backend {
            store: config.url.redacted().into(),
            reason: format!("not {what}"),
        }
    }

    /// Unreachable or too slow, as opposed to a refused or broken request.
    /// The store refused this node for good ([`StoreError::Refused`]).
    pub fn is_refused(&self) -> bool {
        matches!(self, StoreError::Refused { .. })
    }

    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable { .. } | StoreError::Timeout(_)
        )
    }
}

/// The lock half of a store: claims, leases and the clock they are counted
/// on. Object-safe so the backend is chosen at run time.
#[async_trait]
pub trait Locks: Send + Sync + 'static {
    /// Makes the store ready: SQL applies migrations, Redis loads its scripts
    /// and checks persistence. Idempotent and safe to run from several nodes.
    async fn prepare(&self) -> Result<(), StoreError>;

    /// Claims every request in one atomic step per request (docs/protocol.md),
    /// answering in request order. Requests for distinct jobs due at the same
    /// instant go to the store together (one round trip on Redis, one
    /// transaction on SQL).
    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Claimed, StoreError>;

    /// The store's clock, the one leases are counted on.
    async fn clock(&self) -> Result<DateTime<Utc>, StoreError>;

    /// Extends each of `owner`'s live leases to its new length from now
    /// (store clock), in one round trip; per renewal, `false` when the lease
    /// is not `owner`'s or has already expired.
    async fn renew_many(
        &self,
        owner: &Owner,
        renewals: &[Renewal],
    ) -> Result<Vec<bool>, StoreError>;

    /// [`Locks::renew_many`] of one lease.
    async fn renew(
        &self,
        job: &JobName,
        owner: &Owner,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let renewal = Renewal {
            job: job.clone(),
            lease,
        };
        let done = self
            .renew_many(owner, std::slice::from_ref(&renewal))
            .await?;
        Ok(done.first() == Some(&true))
    }

    /// Ends `owner`'s live leases on `jobs`; another owner's are left alone.
    /// Fence and last occurrence stay. Returns how many leases ended.
    async fn release(&self, jobs: &[JobName], owner: &Owner) -> Result<usize, StoreError>;

    /// Pauses (`true`) or resumes `jobs` cluster-wide: the mark is kept with
    /// each job's lock (a lock is created for a job never claimed), so every
    /// claim sees it atomically and a paused job's claims are refused
    /// ([`Lost::paused`]). Leases, fences and running runs are left alone.
    async fn set_paused(&self, jobs: &[JobName], paused: bool) -> Result<(), StoreError>;

    /// Records a manual run's request with the job's lock (a lock is
    /// created for a job never claimed), atomically refused while a run of
    /// the job is in progress or another request is pending
    /// ([`trigger_row`]). A node finds it through
    /// [`Locks::pending_triggers`] and claims it with
    /// [`ClaimRequest::manual`].
    async fn request_trigger(
        &self,
        job: &JobName,
        id: TriggerId,
    ) -> Result<TriggerAnswer, StoreError>;

    /// A notice each time a request is written ([`Locks::request_trigger`]:
    /// a manual run, a resume's catch-up, a retry, a redelivery), pushed by
    /// the store where it can push (Redis and Sentinel pub/sub, PostgreSQL
    /// LISTEN/NOTIFY, ZooKeeper and etcd watches), until `stop`: the node
    /// then looks for requests at
    /// once rather than at its next heartbeat. `None` where the store
    /// cannot. Notices coalesce (one waiting at most); one is also sent each
    /// time the subscription is made again, for what was written while it
    /// was down; and the heartbeats still look, so a notice lost (a writer
    /// of an older version, a subscription refused) costs latency only.
    fn notices(
        self: Arc<Self>,
        stop: CancellationToken,
    ) -> Option<tokio::sync::mpsc::Receiver<()>> {
        let _ = stop;
        None
    }

    /// The pending manual runs' requests: (job, id), sorted by job. Asked by
    /// every node once a second (while a job is due within 2 s, four times
    /// where the store announces no request, twice where it does:
    /// [`Locks::notices`]),
    /// so kept cheap (an index, a set, a directory), never a read of every
    /// lock.
    async fn pending_triggers(&self) -> Result<Vec<(String, TriggerId)>, StoreError>;

    /// Withdraws request `id` of `job` if it is still the job's pending one
    /// (`trigger --cancel`, or an expired request): true when it was, false
    /// when it was claimed or withdrawn already. Nothing else changes.
    async fn withdraw_trigger(&self, job: &JobName, id: TriggerId) -> Result<bool, StoreError>;

    /// A cheap round trip, to tell whether the store answers.
    async fn ping(&self) -> Result<(), StoreError>;

    /// Every job lock the store knows, sorted by job.
    async fn status(&self) -> Result<Vec<LockStatus>, StoreError>;

    /// The URL with secrets redacted, for messages.
    fn describe(&self) -> &str;

    /// After [`Locks::prepare`]: a note about the store's schema an operator
    /// should read (a newer version than this binary knows), if any.
    fn schema_notice(&self) -> Option<String> {
        None
    }

    /// For a store where a holder's leases can end before their length, the
    /// bound on a run whose claim or last renewal was sent at `sent`:
    /// ZooKeeper frees a holder's jobs once its session ends, so runs must
    /// end before the server could end it. `None` (the default): the lease
    /// alone bounds runs. Asked again whenever the bound is reached, since it
    /// moves on while the store keeps confirming its session.
    fn run_bound(&self, _sent: tokio::time::Instant) -> Option<RunBound> {
        None
    }

    /// For a store where another owner's live lease can end before its
    /// time (ZooKeeper: with the holder's session), how soon a claimer
    /// waiting for it should ask again. `None` (the default): when the
    /// remaining lease has passed.
    fn recheck_within(&self) -> Option<Duration> {
        None
    }

    /// Returns when another owner's lease on `job` may have ended before
    /// its time ran out (etcd: its lease key was deleted, as a release
    /// does), so a claimer waiting it out claims again at once. Never, by
    /// default: the claimer waits the remaining lease.
    async fn lease_freed(&self, _job: &JobName) {
        std::future::pending::<()>().await;
    }
}

/// The history half of a store: finished runs, one record per (job, fence).
/// A separate concern from the locks (a store could keep them elsewhere);
/// every backend today keeps both, next to each other.
#[async_trait]
pub trait History: Send + Sync + 'static {
    /// Appends finished runs to their jobs' histories in one round trip,
    /// keeping per job the runs of the newest `keep` fences. Idempotent: a run
    /// whose (job, fence) is recorded already is not recorded again, so a
    /// write retried after a timeout that did commit leaves one record.
    async fn record_runs(&self, runs: &[RunRecord], keep: u32) -> Result<(), StoreError>;

    /// [`History::record_runs`] of one run.
    async fn record_run(&self, run: &RunRecord, keep: u32) -> Result<(), StoreError> {
        self.record_runs(std::slice::from_ref(run), keep).await
    }

    /// Runs, newest first, of one job or all.
    async fn history(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError>;

    /// The newest run of each of `jobs`, in that order (`None`: never run),
    /// what `status` shows per job. A store that can answers in one round
    /// trip per [`LAST_RUNS_PAGE`] jobs (SQL, Redis); this default reads each
    /// job's history, [`LAST_RUNS_AT_ONCE`] at a time.
    async fn last_runs(&self, jobs: &[JobName]) -> Result<Vec<Option<RunRecord>>, StoreError> {
        let mut last = Vec::with_capacity(jobs.len());
        for page in jobs.chunks(LAST_RUNS_AT_ONCE) {
            let mut reads = Vec::with_capacity(page.len());
            for job in page {
                reads.push(self.history(Some(job), 1));
            }
            for read in futures_util::future::join_all(reads).await {
                last.push(read?.pop());
            }
        }
        Ok(last)
    }
}

/// Jobs per round trip of [`History::last_runs`] where the store reads
/// them together.
pub const LAST_RUNS_PAGE: usize = 500;

/// Job histories read at once by the default [`History::last_runs`].
pub const LAST_RUNS_AT_ONCE: usize = 16;

/// `runs` (newest runs, any order, at most one per job) in the order of
/// `jobs`: the answer of [`History::last_runs`] from a store that read
/// them together.
pub fn in_job_order(jobs: &[JobName], runs: Vec<RunRecord>) -> Vec<Option<RunRecord>> {
    let mut by_job: std::collections::HashMap<String, RunRecord> =
        runs.into_iter().map(|r| (r.job.clone(), r)).collect();
    jobs.iter().map(|j| by_job.remove(j.as_str())).collect()
}

/// A whole store, what a backend is: its locks, its history, the node
/// registry, the outbox and the audit.
pub trait Store: Locks + History + Registry + Outbox + Audit {}

impl<T: Locks + History + Registry + Outbox + Audit + ?Sized> Store for T {}

/// A store call, failed with [`StoreError::Timeout`] after `limit`: what
/// bounds every call a command or the guard makes.
pub async fn bounded<T>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or(Err(StoreError::Timeout(limit)))
}

/// Opens a backend's store for a config.
type Open = fn(&StoreConfig) -> Result<Arc<dyn Store>, StoreError>;

/// A backend: the store kinds (URL schemes) it serves, the cargo feature
/// that builds it in, and how it opens.
struct Backend {
    serves: fn(&StoreKind) -> bool,
    feature: &'static str,
    schemes: &'static str,
    open: Option<Open>,
}

/// Every backend, by the URL schemes it serves. A backend left out of the
/// build has no `open` and answers "not built in".
const BACKENDS: &[Backend] = &[
    Backend {
        serves: |k| matches!(k, StoreKind::Sqlite { .. }),
        feature: "sqlite",
        schemes: "sqlite://",
        #[cfg(feature = "sqlite")]
        open: Some(open_sql),
        #[cfg(not(feature = "sqlite"))]
        open: None,
    },
    Backend {
        serves: |k| matches!(k, StoreKind::Mysql),
        feature: "mysql",
        schemes: "mysql:// and mariadb://",
        #[cfg(feature = "mysql")]
        open: Some(open_sql),
        #[cfg(not(feature = "mysql"))]
        open: None,
    },
    Backend {
        serves: |k| matches!(k, StoreKind::Postgres),
        feature: "postgres",
        schemes: "postgres://",
        #[cfg(feature = "postgres")]
        open: Some(open_sql),
        #[cfg(not(feature = "postgres"))]
        open: None,
    },
    Backend {
        serves: |k| matches!(k, StoreKind::Redis),
        feature: "redis",
        schemes: "redis:// and rediss://",
        #[cfg(feature = "redis")]
        open: Some(open_redis),
        #[cfg(not(feature = "redis"))]
        open: None,
    },
    Backend {
        serves: |k| matches!(k, StoreKind::RedisSentinel(_)),
        feature: "sentinel",
        schemes: "redis+sentinel://",
        #[cfg(feature = "sentinel")]
        open: Some(open_redis),
        #[cfg(not(feature = "sentinel"))]
        open: None,
    },
    Backend {
        serves: |k| matches!(k, StoreKind::Redlock(_)),
        feature: "redlock",
        schemes: "Redlock (store.urls)",
        #[cfg(feature = "redlock")]
        open: Some(open_redlock),
        #[cfg(not(feature = "redlock"))]
        open: None,
    },
    Backend {
        serves: |k| matches!(k, StoreKind::ZooKeeper(_)),
        feature: "zookeeper",
        schemes: "zk://",
        #[cfg(feature = "zookeeper")]
        open: Some(open_zookeeper),
        #[cfg(not(feature = "zookeeper"))]
        open: None,
    },
    Backend {
        serves: |k| matches!(k, StoreKind::Etcd(_)),
        feature: "etcd",
        schemes: "etcd:// and etcds://",
        #[cfg(feature = "etcd")]
        open: Some(open_etcd),
        #[cfg(not(feature = "etcd"))]
        open: None,
    },
];

#[cfg(feature = "zookeeper")]
fn open_zookeeper(config: &StoreConfig) -> Result<Arc<dyn Store>, StoreError> {
    Ok(Arc::new(zookeeper::ZkStore::open(config)?))
}

#[cfg(feature = "etcd")]
fn open_etcd(config: &StoreConfig) -> Result<Arc<dyn Store>, StoreError> {
    Ok(Arc::new(etcd::EtcdStore::open(config)?))
}

#[cfg(feature = "redlock")]
fn open_redlock(config: &StoreConfig) -> Result<Arc<dyn Store>, StoreError> {
    Ok(Arc::new(redis::redlock::RedlockStore::open(config)?))
}

#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
fn open_sql(config: &StoreConfig) -> Result<Arc<dyn Store>, StoreError> {
    Ok(Arc::new(sql::SqlStore::open(config)?))
}

#[cfg(feature = "redis")]
fn open_redis(config: &StoreConfig) -> Result<Arc<dyn Store>, StoreError> {
    Ok(Arc::new(redis::RedisStore::open(config)?))
}

/// The stores this binary serves, by their feature names (`cronlease
/// --version` lists them).
pub fn built_in() -> Vec<&'static str> {
    BACKENDS
        .iter()
        .filter(|b| b.open.is_some())
        .map(|b| b.feature)
        .collect()
}

/// Opens the store a config names, with the backend that serves its URL's
/// scheme ([`BACKENDS`]). Connections are made lazily, so a store that is
/// down now is not an error here: calls fail until it is back.
pub async fn connect(config: &StoreConfig) -> Result<Arc<dyn Store>, StoreError> {
    let kind = config.url.kind();
    let Some(backend) = BACKENDS.iter().find(|b| (b.serves)(kind)) else {
        return Err(StoreError::NotBuiltIn(format!(
            "{}: no backend serves this URL",
            config.url
        )));
    };
    match backend.open {
        Some(open) => open(config),
        None => Err(StoreError::NotBuiltIn(format!(
            "{}: {} support is not built into this binary (build with feature `{}`)",
            config.url, backend.schemes, backend.feature
        ))),
    }
}

/// The error for a job whose fence reached its maximum (2^63 − 1).
pub fn fence_exhausted(job: &str) -> String {
    format!(
        "the fence of job {job} is at its maximum ({}): it cannot be claimed without repeating or wrapping; rename the job (a new lock) after checking what consumes its fences",
        i64::MAX
    )
}

/// A std mutex's guard, also after a panic while it was held: every value
/// kept behind one in the stores is whole after each write.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Orders runs as `History::history` answers: newest first by end, then
/// by fence; at most `limit`.
#[cfg(any(feature = "redis", feature = "etcd", feature = "zookeeper"))]
pub(crate) fn newest_first(runs: &mut Vec<RunRecord>, limit: u32) {
    runs.sort_by(|a, b| {
        b.finished_at
            .cmp(&a.finished_at)
            .then(b.fence.cmp(&a.fence))
    });
    runs.truncate(limit as usize);
}

/// A finished run as the key-value stores (ZooKeeper, etcd) keep it: JSON,
/// instants in milliseconds of the recording node's clock.
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
#[derive(Debug, Serialize, serde::Deserialize)]
pub(crate) struct RunData {
    pub(crate) job: String,
    pub(crate) fence: u64,
    pub(crate) owner: String,
    pub(crate) node: String,
    pub(crate) occurrence: i64,
    pub(crate) started_at: i64,
    pub(crate) finished_at: i64,
    pub(crate) outcome: String,
    pub(crate) exit_code: Option<i32>,
    pub(crate) takeover: bool,
    pub(crate) delay_ms: u64,
    #[serde(default)]
    pub(crate) decision_ms: u64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub(crate) output: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) trigger: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cpu_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) memory_peak: Option<u64>,
}

#[cfg(any(feature = "zookeeper", feature = "etcd"))]
impl From<&RunRecord> for RunData {
    fn from(run: &RunRecord) -> Self {
        RunData {
            job: run.job.clone(),
            fence: run.fence,
            owner: run.owner.clone(),
            node: run.node.clone(),
            occurrence: to_ms(run.occurrence),
            started_at: to_ms(run.started_at),
            finished_at: to_ms(run.finished_at),
            outcome: run.outcome.as_str().to_string(),
            exit_code: run.exit_code,
            takeover: run.takeover,
            delay_ms: run.delay_ms,
            decision_ms: run.decision_ms,
            output: run.output.clone(),
            trigger: run.trigger.map(TriggerId::get),
            cpu_ms: run.cpu_ms,
            memory_peak: run.memory_peak,
        }
    }
}

/// A stored run read back (`name` is its entry's name, the zero-padded
/// fence); one this version cannot read is shown as
/// `unknown(malformed entry NAME)`, at `mtime` (ms; the entry's modification
/// time where the store keeps one).
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
pub(crate) fn run_from_json(job: &str, name: &str, data: &[u8], mtime: i64) -> RunRecord {
    match serde_json::from_slice::<RunData>(data) {
        Ok(r) => RunRecord {
            job: r.job,
            fence: r.fence,
            owner: r.owner,
            node: r.node,
            occurrence: from_ms(r.occurrence),
            started_at: from_ms(r.started_at),
            finished_at: from_ms(r.finished_at),
            outcome: Outcome::parse(&r.outcome),
            exit_code: r.exit_code,
            takeover: r.takeover,
            delay_ms: r.delay_ms,
            decision_ms: r.decision_ms,
            output: r.output,
            trigger: r.trigger.and_then(TriggerId::from_stored),
            cpu_ms: r.cpu_ms,
            memory_peak: r.memory_peak,
        },
        Err(_) => RunRecord {
            job: job.to_string(),
            fence: name.parse().unwrap_or(0),
            owner: String::new(),
            node: String::new(),
            occurrence: from_ms(mtime),
            started_at: from_ms(mtime),
            finished_at: from_ms(mtime),
            outcome: Outcome::Unknown(format!("malformed entry {name}")),
            exit_code: None,
            takeover: false,
            delay_ms: 0,
            decision_ms: 0,
            output: String::new(),
            trigger: None,
            cpu_ms: None,
            memory_peak: None,
        },
    }
}

/// `runs` in consecutive groups of at most `count` runs whose output tails
/// add up to at most `bytes` (a run whose tail alone is larger goes alone),
/// so one write per group stays inside the store's request limits.
#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
pub(crate) fn run_groups(runs: &[RunRecord], count: usize, bytes: usize) -> Vec<&[RunRecord]> {
    let mut groups = Vec::new();
    let (mut start, mut size) = (0, 0);
    for (i, run) in runs.iter().enumerate() {
        let len = run.output.len();
        if i > start && (i - start >= count.max(1) || size + len > bytes) {
            groups.push(&runs[start..i]);
            (start, size) = (i, 0);
        }
        size += len;
    }
    if start < runs.len() {
        groups.push(&runs[start..]);
    }
    groups
}

/// Milliseconds since the Unix epoch: how every store keeps instants.
pub fn to_ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

/// The inverse of [`to_ms`].
pub fn from_ms(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms).single().unwrap_or_default()
}

/// Duration as whole milliseconds, saturating.
pub fn duration_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn owner_node_part() {
        assert_eq!(Owner::node_of("web-1#0a0b0c0d"), "web-1");
        let o = Owner::new(&NodeName::parse("web-1").unwrap());
        assert_eq!(Owner::node_of(o.as_str()), "web-1");
        assert_ne!(o, Owner::new(&NodeName::parse("web-1").unwrap()));
    }
}
