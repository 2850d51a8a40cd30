//! The daemon proper: one scheduler, the claims of each instant in one
//! batch, each occurrence then handled on its own, runs supervised by a
//! lease watchdog, and an orderly shutdown.
//!
//! - [`Node::run`] starts one scheduler ([`claim`]) that sleeps on tokio's
//!   clock until the next instant any job is due (the job table keeps the
//!   jobs in the order of their next occurrence: an instant costs what is
//!   due then), sends the claims of every job due then as one batch
//!   ([`batch`]), and hands each occurrence to its
//!   own task, so waiting for a takeover, a catch-up or a running job never
//!   delays another occurrence.
//! - A won claim starts a run ([`run`]) guarded by the watchdog: the lease is
//!   renewed while a third of it is left, and the run is killed at the local
//!   lease deadline if renewals fail or are refused.
//! - Shutdown (`SIGTERM`/`SIGINT`): stop claiming, let runs finish within
//!   `shutdown_grace`, kill the rest, release this node's leases.
//! - Step-down (`SIGUSR1`): release every lease (a running job's when it
//!   ends) and claim nothing for one lease margin, so a peer takes over.
//! - Reload (`SIGHUP`): apply a new job set; removed jobs stop being claimed
//!   and their running runs finish.
//! - Manual runs (`cronlease trigger`): pending requests are looked for a
//!   few times a second and claimed like occurrences ([`trigger`]).
//!
//! Cancellation is one token tree under `root` (cancelled last, when the
//! node has shut down: it ends the batchers): `claims` (stop claiming) has a
//! child per job; `kill_runs` ends running jobs. Two task trackers let
//! shutdown wait for the handlers and then for the runs.
//!
//! Locks, always taken in this order and never held across an `await`
//! except the claim gate: the job table (`jobs`), then a job's claim gate,
//! then its [`JobRuntime`], then the count of held leases ([`held`]).

mod batch;
mod broadcast;
mod cancel;
mod catch_up;
mod claim;
pub mod clock;
pub mod definitions;
mod guard_link;
pub mod health;
mod held;
pub mod lease;
mod membership;
pub mod owed;
mod progress;
mod run;
mod service;
mod table;
mod trigger;

pub(crate) use catch_up::catch_up_open;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, Job, JobName, NodeName};
use crate::exec::{ProcessRunner, Runner};
use crate::guard::Guard;
use crate::metrics::{Metrics, OpLabel};
use crate::store::{ClaimOutcome, ClaimRequest, Owner, Renewal, RunRecord, Store, StoreError};
use crate::systemd::Notifier;
use crate::wallclock::{SystemClock, WallClock};
use batch::Batcher;
use chrono::{DateTime, Utc};
use clock::ClockWatch;
use guard_link::GuardLink;
use health::StoreHealth;
use held::LeaseBook;
use table::{JobEntry, JobTable};

/// How long renewals are gathered before their store call: those due
/// together (after a takeover) go as one.
const BATCH_WINDOW: Duration = Duration::from_millis(5);

/// How long history writes are gathered before their store call. Nothing
/// waits on them, and runs that start at one instant end over the time the
/// guard takes to start them all (0.4 s for a thousand here): a quarter of a
/// second makes those two or three writes instead of one every few ms.
const RECORD_WINDOW: Duration = Duration::from_millis(250);

/// When the last successful claim or renewal of a lease was sent, and how long
/// a lease it asked for (monotonic clock).
#[derive(Debug, Clone, Copy)]
struct LeaseClock {
    sent: Instant,
    lease: Duration,
}

impl LeaseClock {
    /// The local deadline of docs/protocol.md ([`lease::stop_after`]).
    fn deadline(&self, margin: Duration) -> Instant {
        self.sent + lease::stop_after(self.lease, margin)
    }

    /// When the watchdog renews ([`lease::renew_after`]).
    fn renew_at(&self, margin: Duration) -> Instant {
        self.sent + lease::renew_after(self.lease, margin)
    }

    /// The earliest moment the store may see the lease as expired
    /// ([`lease::kill_after`]).
    fn expiry(&self) -> Instant {
        self.sent + lease::kill_after(self.lease)
    }
}

/// What this node last knew of a job's lock, to log changes only.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Standing {
    Unknown,
    Holder,
    Follower(Option<String>),
}

/// What the node knows of one job, behind one lock.
struct JobRuntime {
    job: Arc<Job>,
    /// Highest fence seen from the store: the `fence_floor` of claims.
    fence_floor: u64,
    /// The last claim or renewal that succeeded, for the local deadline.
    lease: Option<LeaseClock>,
    /// A run of the job is going (its process has not ended).
    running: bool,
    /// That run is a manual one (`cronlease trigger`).
    manual_running: bool,
    /// Step-down came while a run was going: release when it ends.
    release_after_run: bool,
    /// Who holds the lease, as this node last saw it (to log changes).
    standing: Standing,
    /// With `standing` another node's: that node's count of leases given
    /// up as this node saw it before the claim that named it was sent
    /// (`None`: not seen), for leaving the job to it ([`progress`]).
    follow_released: Option<u64>,
    /// A step-down gave the job up: this node claims it only after its
    /// head start (so a live peer takes it), until another node is seen to
    /// hold it, or this node wins it because none did.
    yielded: bool,
}

/// Per-job state shared by the scheduler, the job's occurrence handlers and
/// its runs: one [`JobRuntime`] behind one lock, plus two waits (the end of
/// a run; a claim in flight).
pub(crate) struct JobState {
    runtime: Mutex<JobRuntime>,
    /// Told when a run's process is over (`running` back to false).
    run_ended: tokio::sync::Notify,
    /// Held from a claim until its run has started, so a step-down never
    /// sees a job as idle while a claim of it is in flight.
    claim_gate: Arc<tokio::sync::Mutex<()>>,
    /// Where the node counts its jobs' leases ([`held`]); none for a
    /// shard's lock.
    book: Option<Arc<Mutex<LeaseBook>>>,
}

impl JobState {
    /// A job's state, its lease counted in `book`.
    fn counted(job: Job, book: Arc<Mutex<LeaseBook>>) -> Self {
        JobState {
            book: Some(book),
            ..JobState::new(job)
        }
    }

    fn new(job: Job) -> Self {
        JobState {
            book: None,
            runtime: Mutex::new(JobRuntime {
                job: Arc::new(job),
                fence_floor: 0,
                lease: None,
                running: false,
                manual_running: false,
                release_after_run: false,
                standing: Standing::Unknown,
                follow_released: None,
                yielded: false,
            }),
            run_ended: tokio::sync::Notify::new(),
            claim_gate: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// The job's state (a poisoned lock is still the latest state: every
    /// change is a single assignment).
    fn rt(&self) -> std::sync::MutexGuard<'_, JobRuntime> {
        match self.runtime.lock() {
            Ok(rt) => rt,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    fn job(&self) -> Arc<Job> {
        self.rt().job.clone()
    }

    /// Sets the lease clock under `rt`, telling the node's count of held
    /// leases.
    fn set_lease(&self, rt: &mut JobRuntime, lease: Option<LeaseClock>) {
        let old = rt.lease.map(|c| c.expiry());
        rt.lease = lease;
        if let Some(book) = &self.book {
            // A poisoned count is still the count: every change is whole.
            let mut book = book
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            book.change(old, lease.map(|c| c.expiry()));
        }
    }

    fn set_job(&self, job: Job) {
        self.rt().job = Arc::new(job);
    }

    fn fence_floor(&self) -> u64 {
        self.rt().fence_floor
    }

    fn is_running(&self) -> bool {
        self.rt().running
    }

    /// Marks a run as started (`manual`: a manual one); false if one is
    /// going already.
    fn start_running(&self, manual: bool) -> bool {
        let mut rt = self.rt();
        if rt.running {
            return false;
        }
        rt.running = true;
        rt.manual_running = manual;
        true
    }

    /// Whether the run going now is a manual one.
    fn manual_running(&self) -> bool {
        let rt = self.rt();
        rt.running && rt.manual_running
    }

    /// The run's process is over: the next occurrence may start.
    fn run_is_over(&self) {
        {
            let mut rt = self.rt();
            rt.running = false;
            rt.manual_running = false;
        }
        self.run_ended.notify_waiters();
    }

    /// Waits until no run of the job is going.
    async fn until_idle(&self) {
        loop {
            // Registered before the check: a run ending in between is seen.
            let ended = self.run_ended.notified();
            if !self.is_running() {
                return;
            }
            ended.await;
        }
    }

    /// Step-down: an idle job's lease ends now (true: release it); a running
    /// job's ends with its run.
    fn step_down(&self) -> bool {
        let mut rt = self.rt();
        rt.yielded = true;
        if rt.running {
            rt.release_after_run = true;
            false
        } else {
            self.set_lease(&mut rt, None);
            true
        }
    }

    /// Whether a step-down asked for the lease to end with this run. Asked
    /// by a run's task once its process is over; if a later run of the job
    /// has started meanwhile (the occurrence after a catch-up), the request
    /// is left to that run: the lease must outlive every run on it.
    fn take_release_after_run(&self) -> bool {
        let mut rt = self.rt();
        !rt.running && std::mem::take(&mut rt.release_after_run)
    }

    fn saw_fence(&self, fence: u64) {
        let mut rt = self.rt();
        rt.fence_floor = rt.fence_floor.max(fence);
    }

    /// Whether a step-down gave the job up and no node has held it since.
    fn yielded(&self) -> bool {
        self.rt().yielded
    }

    /// Whether this node last saw another owner hold the job.
    fn follows(&self) -> bool {
        matches!(self.rt().standing, Standing::Follower(_))
    }

    /// Whether this node held the lease when it last looked.
    fn holds(&self) -> bool {
        matches!(self.rt().standing, Standing::Holder)
    }

    /// Another node holds the lease (`holder`, as the store named it), whose
    /// count of leases given up was `released` before this node's claim
    /// was sent.
    fn note_follower(&self, holder: Option<String>, released: Option<u64>, fence: u64) {
        self.note_standing(Standing::Follower(holder), fence);
        self.rt().follow_released = released;
    }

    /// The other node this node last saw hold the lease, and its count of
    /// leases given up then, when both are known.
    fn followed(&self) -> Option<(String, u64)> {
        let rt = self.rt();
        match (&rt.standing, rt.follow_released) {
            (Standing::Follower(Some(holder)), Some(released)) => Some((holder.clone(), released)),
            _ => None,
        }
    }

    /// The other owner this node last saw hold the job, if any.
    fn holder(&self) -> Option<String> {
        match &self.rt().standing {
            Standing::Follower(holder) => holder.clone(),
            _ => None,
        }
    }

    fn lease_clock(&self) -> Option<LeaseClock> {
        self.rt().lease
    }

    /// A claim or renewal sent at `sent` succeeded.
    fn lease_granted(&self, sent: Instant, lease: Duration) {
        let mut rt = self.rt();
        if rt.lease.is_none_or(|c| c.sent <= sent) {
            self.set_lease(&mut rt, Some(LeaseClock { sent, lease }));
        }
    }

    fn lease_ended(&self) {
        let mut rt = self.rt();
        self.set_lease(&mut rt, None);
    }

    /// Logs at info when this node's standing for the job changes.
    fn note_standing(&self, now: Standing, fence: u64) {
        let mut rt = self.rt();
        // Some node holds it (this one: no peer took it): the step-down's
        // deferral has done its work. Not while a run the step-down let
        // finish still holds this node's lease: its next occurrences are
        // won here on that lease, and the job is given up when it ends.
        if now != Standing::Unknown && !rt.release_after_run {
            rt.yielded = false;
        }
        if rt.standing == now {
            return;
        }
        let job = rt.job.name.clone();
        match &now {
            Standing::Holder => tracing::info!(job = %job, fence, "this node now holds the lease"),
            Standing::Follower(Some(holder)) => {
                tracing::info!(job = %job, fence, holder = %holder, "lease held by another node")
            }
            Standing::Follower(None) => {
                tracing::info!(job = %job, fence, "occurrence claimed elsewhere")
            }
            Standing::Unknown => {}
        }
        rt.follow_released = None;
        rt.standing = now;
    }
}

/// A running cronlease node.
pub struct Node {
    owner: Owner,
    name: NodeName,
    store: Arc<dyn Store>,
    /// The store's URL: its password never reaches an output tail.
    store_url: crate::config::StoreUrl,
    settings: Settings,
    clock: ClockWatch,
    health: StoreHealth,
    guard: GuardLink,
    prepare: Prepared,
    life: Lifecycle,
    jobs: Mutex<JobTable>,
    /// The leases its jobs hold, counted for the beats ([`held`]).
    leases: Arc<Mutex<LeaseBook>>,
    /// Wakes the scheduler when the job set changed.
    jobs_changed: tokio::sync::Notify,
    step_down_until: Mutex<Option<Instant>>,
    metrics: Arc<Metrics>,
    /// Where the runs' events are posted (`[[notify]]`), if anywhere.
    webhooks: Option<Arc<crate::webhook::Webhooks>>,
    /// Where what runs are owed is kept for the next start ([`owed`]).
    owed: Option<crate::spool::Spool>,
    notifier: Notifier,
    /// What time it is (occurrences are wall-clock instants).
    wall: Arc<dyn WallClock>,
    /// Runs the jobs' commands.
    runner: Arc<dyn Runner>,
    beat: SchedulerBeat,
    batch: Batchers,
    members: Membership,
    /// Manual runs' requests being claimed now ([`trigger`]).
    triggers: trigger::InFlight,
    /// Pending requests read by a heartbeat, for the trigger watcher.
    looks: trigger::Looks,
    /// The shard locks of broadcast jobs this node took a request of
    /// ([`broadcast`]).
    shards: Mutex<std::collections::HashMap<JobName, Arc<JobState>>>,
    /// How far its claims have gone, and the registry reads of the
    /// occurrences it leaves to their holder ([`progress`]).
    progress: Arc<progress::Progress>,
    /// A release the store did not take, since the node started: its
    /// stop's last line says the leases were left to expire.
    unreleased: AtomicBool,
}

/// The node's settings, from its configuration.
struct Settings {
    margin: Duration,
    /// `cluster.head_start` (docs/protocol.md, "Fast takeover").
    head_start: Duration,
    /// `cluster.trigger_expiry` ([`trigger`]).
    trigger_expiry: Duration,
    /// `cluster.placement`.
    placement: crate::config::Placement,
    /// `[node] tags` (a SIGHUP changes them, see [`Node::apply_settings`]).
    tags: Mutex<crate::config::Tags>,
    op_timeout: Duration,
    /// Settings a SIGHUP changes live (see [`Node::apply_settings`]).
    shutdown_grace_ms: AtomicU64,
    history_limit: std::sync::atomic::AtomicU32,
    /// Ping the store when it has been quiet for half a margin (`/healthz`).
    keep_health_fresh: bool,
}

/// Whether the store is prepared (schema, rows) for the current jobs.
struct Prepared {
    done: AtomicBool,
    lock: tokio::sync::Mutex<()>,
    /// Why the last prepare failed, until one succeeds: systemd's STATUS=.
    waiting: Mutex<Option<String>>,
}

/// How long a daemon whose store does not answer at start waits before it
/// tells systemd it is ready anyway (docs/operations.md, "The systemd
/// unit"): the unit's start then ends instead of hanging on the store.
pub const READY_WITHIN: Duration = Duration::from_secs(10);

/// The node's token tree and its tasks.
struct Lifecycle {
    /// The root of the token tree: cancelled once the node has shut down
    /// (it ends the batchers).
    root: CancellationToken,
    /// Cancelled: claim nothing more (shutdown). Parent of every job's tokens.
    claims: CancellationToken,
    /// Cancelled: running jobs are stopped now.
    kill_runs: CancellationToken,
    handlers: TaskTracker,
    runs: TaskTracker,
}

/// The scheduler's heartbeat, proof for the systemd watchdog that it is
/// not stuck.
struct SchedulerBeat {
    /// Zero point of the heartbeat.
    epoch: Instant,
    /// When the scheduler last woke (ms since `epoch`).
    last: AtomicU64,
    /// The earliest next occurrence of any job as the scheduler last saw
    /// it (Unix ms; `i64::MAX`: none), for the trigger watcher's pace.
    next_due_ms: std::sync::atomic::AtomicI64,
    /// The last instant a broadcast job was due at (Unix ms; `i64::MIN`:
    /// none), for the trigger watcher's pace ([`broadcast`]).
    broadcast_ms: std::sync::atomic::AtomicI64,
}

/// Claims, renewals and history writes, batched (see [`batch`]).
struct Batchers {
    /// Each answer with when it came (local wall clock).
    claims: Batcher<ClaimRequest, (ClaimOutcome, DateTime<Utc>)>,
    renewals: Batcher<Renewal, bool>,
    records: Batcher<RunRecord, ()>,
}

/// This node in the node registry ([`membership`]).
struct Membership {
    /// When this incarnation started (wall clock).
    started_at: DateTime<Utc>,
    /// The live nodes as of the last heartbeat.
    live_nodes: Mutex<Vec<crate::store::NodeRecord>>,
    /// Other live daemons under this node's name, already warned about.
    name_twins: Mutex<std::collections::BTreeSet<String>>,
    /// When the last heartbeat that went through was sent, on its own or
    /// in a claim batch.
    beaten_at: Mutex<Option<tokio::time::Instant>>,
    /// This node's job definitions against the live peers' ([`definitions`]).
    definitions: Mutex<definitions::Comparison>,
    /// Bumped by each job set applied: a digest computed for an older one
    /// is dropped.
    definitions_of: AtomicU64,
    /// The runs going on this node, by job and fence, for its beats
    /// ([`membership::RunningNow`]).
    running: Mutex<BTreeMap<(String, u64), cancel::Going>>,
    /// Told each time a run starts: wakes the cancel watcher of an idle
    /// node ([`cancel`]).
    run_started: tokio::sync::Notify,
    /// The jobs' `run_on` against the live nodes' tags
    /// ([`membership::Eligibility`]).
    eligibility: Mutex<membership::Eligibility>,
}

/// What a node is made of besides its config and store: the job guard, the
/// line to systemd and the wall clock. A daemon uses [`NodeParts::daemon`];
/// a test running nodes in-process brings its own.
pub struct NodeParts {
    pub guard: Option<Guard>,
    pub notifier: Notifier,
    pub wall: Arc<dyn WallClock>,
    pub runner: Arc<dyn Runner>,
    pub metrics: Arc<Metrics>,
    /// Where the runs' events are posted (`[[notify]]`), if anywhere.
    pub webhooks: Option<Arc<crate::webhook::Webhooks>>,
    /// Where the hooks and events of runs this daemon cannot follow (a
    /// dead daemon's, a stopping one's) are kept for the next start
    /// ([`owed`]); `None`: nowhere, they are not given.
    pub owed: Option<crate::spool::Spool>,
}

impl NodeParts {
    /// The guard process, `$NOTIFY_SOCKET` and the system clock.
    pub fn daemon() -> Self {
        let guard = match Guard::spawn() {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::error!(
                    "cannot start the job guard process ({e}): jobs would outlive a daemon killed by SIGKILL"
                );
                None
            }
        };
        raise_open_files_limit();
        NodeParts {
            guard,
            notifier: Notifier::from_env(),
            wall: Arc::new(SystemClock),
            runner: Arc::new(ProcessRunner::default()),
            metrics: Arc::new(Metrics::new()),
            webhooks: None,
            owed: None,
        }
    }

    /// No guard, no systemd, `wall` for the time (a [`crate::wallclock::TokioClock`]
    /// on paused time) and `runner` for the jobs.
    pub fn in_process(wall: Arc<dyn WallClock>, runner: Arc<dyn Runner>) -> Self {
        NodeParts {
            guard: None,
            notifier: Notifier::disabled(),
            wall,
            runner,
            metrics: Arc::new(Metrics::new()),
            webhooks: None,
            owed: None,
        }
    }
}

/// A thousand jobs running at once hold two thousand pipes: lift the soft
/// limit on open files to the hard one (systemd gives services 1024 and a
/// hard limit far above). The guard, started before this, keeps the soft
/// limit it was given, and so do the jobs it starts (some still `select()`).
fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::warn!("cannot raise the open files limit from {soft} to {hard}: {e}");
    }
}

impl Node {
    /// A daemon's node for `config` on `store`, with a fresh owner identity.
    pub fn new(config: &Config, store: Arc<dyn Store>) -> Arc<Node> {
        Self::with_parts(config, store, NodeParts::daemon())
    }

    /// A node made of `parts` (see [`NodeParts`]).
    pub fn with_parts(config: &Config, store: Arc<dyn Store>, parts: NodeParts) -> Arc<Node> {
        let NodeParts {
            guard,
            notifier,
            wall,
            runner,
            metrics,
            webhooks,
            owed,
        } = parts;
        let root = CancellationToken::new();
        let started_at = wall.now();
        Arc::new(Node {
            owner: Owner::new(&config.node),
            name: config.node.clone(),
            health: StoreHealth::new(store.describe()),
            store,
            store_url: config.store.url.clone(),
            settings: Settings {
                margin: config.lease_margin,
                head_start: config.head_start,
                trigger_expiry: config.trigger_expiry,
                placement: config.placement,
                tags: Mutex::new(config.tags.clone()),
                op_timeout: config.store.op_timeout,
                shutdown_grace_ms: AtomicU64::new(config.shutdown_grace.as_millis() as u64),
                history_limit: std::sync::atomic::AtomicU32::new(config.store.history_limit),
                keep_health_fresh: config.http_listen.is_some(),
            },
            clock: ClockWatch::new(config.max_clock_offset),
            guard: GuardLink {
                process: guard,
                handover: config.store.handover(),
                told: tokio::sync::Mutex::new(()),
            },
            prepare: Prepared {
                done: AtomicBool::new(false),
                lock: tokio::sync::Mutex::new(()),
                waiting: Mutex::new(None),
            },
            life: Lifecycle {
                claims: root.child_token(),
                kill_runs: root.child_token(),
                root,
                handlers: TaskTracker::new(),
                runs: TaskTracker::new(),
            },
            jobs: Mutex::new(JobTable::default()),
            leases: Arc::default(),
            jobs_changed: tokio::sync::Notify::new(),
            step_down_until: Mutex::new(None),
            metrics,
            webhooks,
            owed,
            notifier,
            wall,
            runner,
            beat: SchedulerBeat {
                epoch: Instant::now(),
                last: AtomicU64::new(0),
                next_due_ms: std::sync::atomic::AtomicI64::new(i64::MAX),
                broadcast_ms: std::sync::atomic::AtomicI64::new(i64::MIN),
            },
            batch: Batchers {
                claims: Batcher::new(Duration::ZERO),
                renewals: Batcher::new(BATCH_WINDOW),
                records: Batcher::new(RECORD_WINDOW),
            },
            members: Membership {
                started_at,
                live_nodes: Mutex::new(Vec::new()),
                name_twins: Mutex::new(std::collections::BTreeSet::new()),
                beaten_at: Mutex::new(None),
                definitions: Mutex::new(definitions::Comparison::default()),
                definitions_of: AtomicU64::new(0),
                eligibility: Mutex::new(membership::Eligibility::default()),
                running: Mutex::new(BTreeMap::new()),
                run_started: tokio::sync::Notify::new(),
            },
            triggers: trigger::InFlight::default(),
            looks: trigger::Looks::default(),
            shards: Mutex::new(std::collections::HashMap::new()),
            progress: Arc::default(),
            unreleased: AtomicBool::new(false),
        })
    }

    /// The node's metrics.
    /// Warns of the settings of `jobs` this node's runner cannot enforce.
    pub fn warn_unenforced(&self, jobs: &[crate::config::Job]) {
        crate::exec::warn_unenforced(jobs, self.runner.as_ref());
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Why this node is not healthy (`/healthz`), if it is not: its clock is
    /// out of bounds, the store has not answered within a heartbeat period
    /// and a lease margin ([`Node::quiet_limit`]), or store calls are
    /// failing.
    pub fn health_problem(&self) -> Option<String> {
        if let Some(clock) = self.clock.problem() {
            return Some(clock);
        }
        let answered = self
            .health
            .last_ok()
            .is_some_and(|t| t.elapsed() <= self.quiet_limit());
        if !answered {
            return Some("store not answering".to_string());
        }
        (!self.health.is_up()).then(|| "store calls failing".to_string())
    }

    /// How long the store may be quiet before `/healthz` fails: a
    /// heartbeat period (an idle node's one call a period) and a margin.
    pub(super) fn quiet_limit(&self) -> Duration {
        let (every, _) = membership::beat_timing(self.settings.margin);
        every + self.settings.margin
    }

    /// Applies the settings of a reloaded configuration that take effect
    /// without a restart: `shutdown_grace`, `store.history_limit` and
    /// `cluster.max_clock_offset` (jobs go through [`Node::apply_jobs`]).
    pub fn apply_settings(&self, config: &Config) {
        self.settings
            .shutdown_grace_ms
            .store(config.shutdown_grace.as_millis() as u64, Ordering::SeqCst);
        self.settings
            .history_limit
            .store(config.store.history_limit, Ordering::SeqCst);
        self.clock.set_bound(config.max_clock_offset);
        if let Ok(mut tags) = self.settings.tags.lock()
            && *tags != config.tags
        {
            tracing::info!(tags = %config.tags, "node tags changed");
            *tags = config.tags.clone();
        }
    }

    /// This node's tags now.
    pub(crate) fn tags(&self) -> crate::config::Tags {
        self.settings
            .tags
            .lock()
            .map(|t| t.clone())
            .unwrap_or_default()
    }

    fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.settings.shutdown_grace_ms.load(Ordering::SeqCst))
    }

    fn history_limit(&self) -> u32 {
        self.settings.history_limit.load(Ordering::SeqCst)
    }

    /// Records a reading of the store's clock taken between `sent` and
    /// `received` (local wall clock).
    fn observe_clock(
        &self,
        store_now: chrono::DateTime<chrono::Utc>,
        sent: chrono::DateTime<chrono::Utc>,
        received: chrono::DateTime<chrono::Utc>,
    ) {
        if let Some(offset) = self.clock.observe(store_now, sent, received) {
            self.metrics.clock_offset.set(offset as f64 / 1000.0);
        }
    }

    /// Reads the store's clock once more (claims are held back while the
    /// last reading was out of bounds); true when the clock is fine now.
    async fn recheck_clock(&self) -> bool {
        let sent = self.wall.now();
        if let Ok(now) = self
            .call("clock", self.settings.op_timeout, self.store.clock())
            .await
        {
            self.observe_clock(now, sent, self.wall.now());
        }
        !self.clock.skewed()
    }

    /// One store call: bounded by `budget`, timed, counted, and reported to
    /// the health tracker.
    async fn call<T>(
        &self,
        op: &str,
        budget: Duration,
        fut: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = match tokio::time::timeout(budget, fut).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(budget)),
        };
        self.metrics
            .store_call
            .get_or_create(&OpLabel { op: op.to_string() })
            .observe(started.elapsed().as_secs_f64());
        match &result {
            Ok(_) => {
                self.health.ok(op);
                self.metrics.store_up.set(1);
            }
            Err(e) => {
                self.health.failed(op, e);
                self.metrics.store_errors.inc();
                self.metrics.store_up.set(0);
            }
        }
        result
    }

    /// This incarnation's owner string.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// The store's health as seen from here.
    pub fn health(&self) -> &StoreHealth {
        &self.health
    }

    /// Runs `jobs` until `shutdown` is cancelled, then shuts down gracefully:
    /// returns once runs are over and this node's leases are released.
    pub async fn run(self: &Arc<Self>, jobs: Vec<Job>, shutdown: CancellationToken) {
        tracing::info!(node = %self.name, owner = %self.owner, store = %self.store.describe(), jobs = jobs.len(), "cronlease node starting");
        // The jobs first: the catch-up on return, once the store is
        // prepared, looks at them.
        self.start_batchers();
        self.apply_jobs(jobs);
        let node = self.clone();
        self.life
            .handlers
            .spawn(async move { node.prepare_until_ready().await });
        let node = self.clone();
        self.life
            .handlers
            .spawn(async move { node.supervise_service().await });
        let node = self.clone();
        self.life
            .handlers
            .spawn(async move { node.keep_registered().await });
        let node = self.clone();
        self.life
            .handlers
            .spawn(async move { node.scheduler().await });
        let node = self.clone();
        self.life
            .handlers
            .spawn(async move { node.watch_triggers().await });
        let node = self.clone();
        self.life
            .handlers
            .spawn(async move { node.settle_owed().await });
        let node = self.clone();
        self.life
            .handlers
            .spawn(async move { node.watch_cancels().await });
        shutdown.cancelled().await;
        self.shut_down().await;
        self.life.root.cancel();
    }

    /// Starts the tasks that send batched claims, renewals and history
    /// writes. They end with `root`, after the node has shut down (runs
    /// still write their history during shutdown).
    fn start_batchers(self: &Arc<Self>) {
        let node = self.clone();
        tokio::spawn(async move {
            let n = &node;
            let claims = n.batch.claims.serve(move |requests| async move {
                let sent = n.wall.now();
                let claimed = match n.beat_for_batch() {
                    None => {
                        n.call("claim", n.settings.op_timeout, n.store.claim(&requests))
                            .await?
                    }
                    Some(beat) => {
                        let beat_sent = tokio::time::Instant::now();
                        let (claimed, nodes) = n
                            .call(
                                "claim",
                                n.settings.op_timeout,
                                n.store.claim_beating(&requests, &beat),
                            )
                            .await?;
                        if let Some(nodes) = nodes {
                            n.beaten(nodes, beat_sent);
                        }
                        claimed
                    }
                };
                let answered = n.wall.now();
                tracing::debug!(
                    requests = requests.len(),
                    round_trip_ms = (answered - sent).num_milliseconds(),
                    "claim batch answered"
                );
                n.observe_clock(claimed.store_now, sent, answered);
                // Test-only: the daemon dies as the store's answer comes,
                // before it or its guard heard of the win.
                #[cfg(feature = "failpoints")]
                if let Some(job) = std::env::var_os("CRONLEASE_FAILPOINT_DIE_BEFORE_ANSWER")
                    && requests
                        .iter()
                        .zip(&claimed.outcomes)
                        .any(|(r, o)| matches!(o, ClaimOutcome::Won(_)) && r.job.as_str() == job)
                {
                    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
                }
                n.tell_guard_claimed(&requests, &claimed.outcomes, answered)
                    .await;
                Ok(claimed
                    .outcomes
                    .into_iter()
                    .map(|o| (o, answered))
                    .collect())
            });
            let renewals = n.batch.renewals.serve(move |renewals| async move {
                n.call(
                    "renew",
                    n.settings.op_timeout,
                    n.store.renew_many(&n.owner, &renewals),
                )
                .await
            });
            let records = n.batch.records.serve(move |runs| async move {
                // Before the write: a daemon that dies after it must not
                // have its guard hand back a claim history says it skipped.
                n.tell_guard_settled(&runs).await;
                n.call(
                    "record",
                    n.settings.op_timeout,
                    n.store.record_runs(&runs, n.history_limit()),
                )
                .await?;
                Ok(vec![(); runs.len()])
            });
            // One task serves all three queues, each call still on its own.
            tokio::select! {
                () = n.life.root.cancelled() => {}
                _ = async { tokio::join!(claims, renewals, records) } => {}
            }
        });
    }

    /// The daemon's first [`crate::store::Locks::prepare`], before the node
    /// runs: a store that refuses this node ([`StoreError::is_refused`])
    /// fails the start at once; any other error is left to the node's
    /// retries.
    pub async fn preflight(&self) -> Result<(), StoreError> {
        self.prepare_once(false).await
    }

    /// Retries [`crate::store::Locks::prepare`] (migrations, scripts) until it
    /// succeeds. Meanwhile systemd's STATUS= says why (`waiting for the
    /// store: …`), and after [`READY_WITHIN`] the daemon reports ready
    /// anyway, so a store that is down does not hold the unit's start
    /// (`/healthz` answers 503 until the store answers).
    async fn prepare_until_ready(self: Arc<Self>) {
        let mut backoff = Duration::from_millis(200);
        let began = Instant::now();
        let mut told_ready = false;
        loop {
            let prepared = tokio::select! {
                () = self.life.claims.cancelled() => return,
                r = self.ensure_prepared() => r,
            };
            match prepared {
                Ok(()) => {
                    let node = self.clone();
                    self.life
                        .handlers
                        .spawn(async move { node.follow_job_metrics().await });
                    self.catch_up_on_return().await;
                    return;
                }
                Err(e) => {
                    if let Ok(mut waiting) = self.prepare.waiting.lock() {
                        *waiting = Some(e.to_string());
                    }
                    let status = self.status_line(self.job_and_lease_counts());
                    if !told_ready && began.elapsed() >= READY_WITHIN {
                        told_ready = true;
                        tracing::warn!(
                            "the store has not answered for {READY_WITHIN:?}: reporting ready to systemd anyway; claiming starts once it answers ({e})"
                        );
                        self.notifier.ready(&status);
                    } else {
                        self.notifier.status(&status);
                    }
                    tokio::select! {
                        () = self.life.claims.cancelled() => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Prepares the store once (and again after it reported missing tables).
    async fn ensure_prepared(&self) -> Result<(), StoreError> {
        self.prepare_once(true).await
    }

    /// [`Node::ensure_prepared`]; with `as_outage` its failure counts in the
    /// store's health (logged as an outage, the metrics), without it (the
    /// daemon's preflight, which exits on a refusal) it is the caller's.
    async fn prepare_once(&self, as_outage: bool) -> Result<(), StoreError> {
        if self.prepare.done.load(Ordering::SeqCst) {
            return Ok(());
        }
        let _one_at_a_time = self.prepare.lock.lock().await;
        if self.prepare.done.load(Ordering::SeqCst) {
            return Ok(());
        }
        // Migrations may wait for another node's migration lock.
        let budget = self.settings.op_timeout.max(Duration::from_secs(30));
        let result = if as_outage {
            self.call("prepare", budget, self.store.prepare()).await
        } else {
            tokio::time::timeout(budget, self.store.prepare())
                .await
                .unwrap_or(Err(StoreError::Timeout(budget)))
        };
        if result.is_ok() && !self.prepare.done.swap(true, Ordering::SeqCst) {
            self.notifier
                .ready(&self.status_line(self.job_and_lease_counts()));
        }
        result
    }

    /// Makes `jobs` the node's job set: new jobs start, removed jobs stop
    /// being claimed (their runs finish), changed jobs restart their loop.
    /// A job whose `run_on` asks for a tag this node lacks is kept (its
    /// definition counts in the digest, `status` shows it) but not claimed;
    /// one that stops being this node's is let go as a removed one is.
    pub fn apply_jobs(self: &Arc<Self>, jobs: Vec<Job>) {
        let tags = self.tags();
        let Ok(mut current) = self.jobs.lock() else {
            return;
        };
        let wanted: BTreeMap<JobName, Job> =
            jobs.into_iter().map(|j| (j.name.clone(), j)).collect();
        let removed: Vec<JobName> = current
            .keys()
            .filter(|n| !wanted.contains_key(*n))
            .cloned()
            .collect();
        for name in removed {
            if let Some(entry) = current.remove(&name) {
                tracing::info!(job = %name, "job removed: no longer claimed");
                entry.handlers_stop.cancel();
                self.release_when_idle(entry.state);
            }
        }
        let now = self.wall.now();
        let mut not_here = Vec::new();
        let mut run_on: BTreeMap<crate::config::Tags, Vec<JobName>> = BTreeMap::new();
        for (name, job) in wanted {
            if !job.run_on.is_empty() {
                run_on
                    .entry(job.run_on.clone())
                    .or_default()
                    .push(name.clone());
            }
            let allowed = job.run_on.allow(tags.as_slice());
            if !allowed {
                not_here.push(name.clone());
            }
            match current.get_mut(&name) {
                Some(entry) => {
                    let mut next = entry.next();
                    if !entry.state.job().same_definition(&job) {
                        tracing::info!(job = %name, "job changed: applying the new definition");
                        next = job.schedule.next_after(now).filter(|_| allowed);
                        entry.state.set_job(job);
                    }
                    if allowed && !entry.allowed {
                        tracing::info!(job = %name, "this node has the job's run_on tags now: claiming it");
                        next = entry.state.job().schedule.next_after(now);
                    } else if !allowed && entry.allowed {
                        tracing::info!(job = %name, "this node lacks a tag of the job's run_on now: no longer claimed here");
                        next = None;
                        entry.handlers_stop.cancel();
                        entry.handlers_stop = self.life.claims.child_token();
                        self.release_when_idle(entry.state.clone());
                    }
                    entry.allowed = allowed;
                    current.set_next(&name, next);
                }
                None => {
                    let next = job.schedule.next_after(now).filter(|_| allowed);
                    let entry = JobEntry::new(
                        Arc::new(JobState::counted(job, self.leases.clone())),
                        next,
                        self.life.claims.child_token(),
                        allowed,
                    );
                    current.insert(name, entry);
                }
            }
        }
        drop(current);
        if let Ok(mut eligibility) = self.members.eligibility.lock() {
            eligibility.set_jobs(run_on);
        }
        if !not_here.is_empty() {
            tracing::info!(
                jobs = not_here.len(),
                first = %membership::first_names(&not_here),
                node_tags = %tags,
                "jobs not claimed on this node: their run_on asks for tags it does not have"
            );
        }
        self.jobs_changed.notify_one();
        self.tell_guard();
        self.digest_definitions();
    }

    /// Names of the jobs currently configured.
    pub fn job_names(&self) -> Vec<JobName> {
        self.jobs
            .lock()
            .map(|j| j.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// The locks this node may hold: its jobs', and for each broadcast job
    /// its own shard's and those of other nodes' shards it took
    /// ([`broadcast`]).
    pub(crate) fn lock_names(&self) -> Vec<JobName> {
        let mut names = Vec::new();
        if let Ok(jobs) = self.jobs.lock() {
            for (name, entry) in jobs.iter() {
                names.push(name.clone());
                if entry.allowed && entry.state.job().every_node {
                    names.push(name.shard(self.name.as_str()));
                }
            }
        }
        for state in self.shard_states() {
            let name = state.job().name.clone();
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names
    }

    /// The states of the shard locks this node took a request of.
    fn shard_states(&self) -> Vec<Arc<JobState>> {
        self.shards
            .lock()
            .map(|s| s.values().cloned().collect())
            .unwrap_or_default()
    }

    fn states(&self) -> Vec<Arc<JobState>> {
        self.jobs
            .lock()
            .map(|j| j.values().map(|e| e.state.clone()).collect())
            .unwrap_or_default()
    }

    /// Until when claiming is paused by a step-down, if it is.
    fn paused_until(&self) -> Option<Instant> {
        let until = self.step_down_until.lock().ok().and_then(|u| *u)?;
        (until > Instant::now()).then_some(until)
    }

    /// How many occurrence handlers are going now (in-process tests: what a
    /// node keeps per occurrence while it waits).
    #[cfg(feature = "memory")]
    pub fn handlers_in_flight(&self) -> usize {
        self.life.handlers.len()
    }

    /// Step-down: release every lease of this node (a running job's as soon
    /// as its run ends) and claim nothing for one lease margin.
    pub async fn step_down(self: &Arc<Self>) {
        let until = Instant::now() + self.settings.margin;
        if let Ok(mut u) = self.step_down_until.lock() {
            *u = Some(until);
        }
        match self.release_leases_now_or_after_runs().await {
            Some(released) => tracing::info!(
                released,
                "stepped down: leases released, claiming nothing for {:?}, then each job only after its head start until another node holds it",
                self.settings.margin
            ),
            None => tracing::warn!(
                "stepped down, but the store did not take the release: peers take over as the leases expire; claiming nothing for {:?}",
                self.settings.margin
            ),
        }
    }

    /// Releases the leases of the jobs not running now, and marks each
    /// running job's to be released as its run ends; the count released now
    /// (`None`: the store did not take the release).
    async fn release_leases_now_or_after_runs(&self) -> Option<usize> {
        let mut idle = Vec::new();
        for state in self.states().into_iter().chain(self.shard_states()) {
            // Wait out a claim in flight: its run, if it won, counts as running.
            let _gate = state.claim_gate.lock().await;
            if state.step_down() {
                idle.push(state.job().name.clone());
            }
        }
        self.release(&idle).await
    }

    /// Releases this node's leases on `jobs` (owner-checked in the store):
    /// the count released, or `None` when three tries failed (the leases
    /// then expire by themselves). The caller says which, once.
    async fn release(&self, jobs: &[JobName]) -> Option<usize> {
        if jobs.is_empty() {
            return Some(0);
        }
        // Followers that left these jobs to this node claim them again.
        self.progress.releasing();
        for attempt in 0..3 {
            if let Ok(n) = self
                .call(
                    "release",
                    self.settings.op_timeout,
                    self.store.release(jobs, &self.owner),
                )
                .await
            {
                return Some(n);
            }
            if attempt < 2 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        self.unreleased.store(true, Ordering::SeqCst);
        None
    }

    /// [`Self::release`] of one job, saying so when the store did not take
    /// it (during a stop, its last line says it for every job).
    pub(crate) async fn release_one(&self, job: &JobName) {
        if self.release(std::slice::from_ref(job)).await.is_none()
            && !self.life.claims.is_cancelled()
        {
            tracing::warn!(job = %job, "could not release the lease: peers take over when it expires");
        }
    }

    /// Releases a removed job's lease once no run of it is going.
    fn release_when_idle(self: &Arc<Self>, state: Arc<JobState>) {
        if !state.step_down() {
            return;
        }
        let node = self.clone();
        self.life.handlers.spawn(async move {
            node.release_one(&state.job().name).await;
        });
    }

    async fn shut_down(self: &Arc<Self>) {
        tracing::info!("shutting down: claiming nothing more");
        self.notifier.stopping();
        self.life.claims.cancel();
        self.life.handlers.close();
        self.life.handlers.wait().await;
        self.life.runs.close();
        // The leases of jobs not running go at once, and each running job's
        // as its run ends (as a step-down does): peers claim their next
        // occurrences on time, not once the slowest run is over (the
        // randomized drill on SQLite missed an occurrence so, a stopping
        // node holding an idle lease while its load jobs finished).
        // What the store took; whether it took every release is kept in
        // `unreleased` (also those of runs ending during the stop): the
        // last line says what happened to the leases, once and truly.
        // Bounded as a whole, as the last release below: with a store
        // that cannot be written, the leases expire by themselves, and the
        // exit must not wait for that.
        let budget = self.settings.op_timeout * 2 + Duration::from_millis(500);
        let mut released =
            match tokio::time::timeout(budget, self.release_leases_now_or_after_runs()).await {
                Ok(n) => n.unwrap_or(0),
                Err(_) => {
                    self.unreleased.store(true, Ordering::SeqCst);
                    0
                }
            };
        let running = self.life.runs.len();
        if running > 0 {
            // The record stays until the runs end: it says now that leases
            // were given up, so followers that left jobs to this node claim
            // them at their next instant ([`progress`]).
            self.beat_once().await;
            tracing::info!(
                running,
                "waiting up to {:?} for running jobs",
                self.shutdown_grace()
            );
            if tokio::time::timeout(self.shutdown_grace(), self.life.runs.wait())
                .await
                .is_err()
            {
                self.life.kill_runs.cancel();
                self.life.runs.wait().await;
            }
        }
        match tokio::time::timeout(budget, self.release(&self.lock_names())).await {
            Ok(Some(n)) => released += n,
            Ok(None) => {}
            Err(_) => self.unreleased.store(true, Ordering::SeqCst),
        }
        self.leave_registry().await;
        if let Some(guard) = &self.guard.process {
            // Runs over and (as far as the store let us) recorded, leases
            // released or left to expire: nothing for the guard to do.
            guard.bye().await;
        }
        if !self.unreleased.load(Ordering::SeqCst) {
            tracing::info!(released, "leases released; stopped");
        } else {
            tracing::warn!(
                released,
                "stopped without releasing every lease (the store did not answer): peers take over when they expire"
            );
        }
    }

    /// Stops running jobs at once (a second SIGTERM during shutdown).
    pub fn kill_running_jobs(&self) {
        self.life.kill_runs.cancel();
    }
}

#[cfg(test)]
mod tests;
