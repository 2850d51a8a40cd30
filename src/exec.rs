//! Running one job: its own process group, its environment, its output in
//! the daemon's log, and the ways it can end.
//!
//! The child gets the job's `env`, plus `CRONLEASE_JOB`, `CRONLEASE_FENCE`,
//! `CRONLEASE_OCCURRENCE` (RFC 3339, UTC), `CRONLEASE_NODE`,
//! `CRONLEASE_ATTEMPT` (1, or a retry's attempt), for a manual run
//! `CRONLEASE_TRIGGER`, and for a broadcast job's shard
//! `CRONLEASE_SHARD_INDEX` and `CRONLEASE_SHARD_COUNT`; the daemon's
//! own secrets (`CRONLEASE_STORE_URL`) and systemd plumbing (`NOTIFY_SOCKET`)
//! are not passed on. It runs in a new process group so that a timeout,
//! a lost lease or shutdown can signal the whole tree: SIGTERM, then SIGKILL
//! after `kill_grace`. When the main process exits, whatever it left in its
//! group is killed too: a run ends when its command ends.
//!
//! The daemon builds the process ([`Launch`], whose room is
//! [`crate::launch`]) and the job guard starts it ([`crate::guard`]); the
//! daemon reads its output and waits for the exit the guard reports.
//! Without a guard (it is gone) the daemon starts it itself. The guard
//! knows nothing of this room: it gets a [`Launch`] and starts it.

use std::future::Future;
use std::pin::Pin;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::cgroup::{CONTROLLERS, CgroupError, RunCgroup, Runs};
use crate::config::{Command, Job, JobName, NodeName, StoreUrl};
use crate::guard::{Guard, RunNote, StartError};
use crate::launch::Launch;
use crate::output::{LogLines, Tail, escape_controls};
use crate::store::Outcome;
use crate::wallclock::WallClock;

/// What runs a job's command. A daemon runs processes ([`ProcessRunner`]);
/// node tests on paused time, where a real process cannot take virtual
/// time, bring a runner that takes it instead.
#[async_trait::async_trait]
pub trait Runner: Send + Sync {
    /// Runs `spec` until it ends or `stop` says why it must end.
    async fn run<'a>(
        &'a self,
        spec: RunSpec<'a>,
        guard: Option<&'a Guard>,
        stop: Pin<Box<dyn Future<Output = StopReason> + Send + 'a>>,
    ) -> Finished;

    /// Which runner this is, for what it can enforce
    /// ([`crate::config::Isolation::unenforced`]).
    fn kind(&self) -> crate::config::RunnerKind {
        crate::config::RunnerKind::Process
    }

    /// The cgroup controllers (`memory`, `pids`, `cpu`, `io`) its limits
    /// need and this host does not give it.
    fn lacking(&self) -> Vec<&'static str> {
        Vec::new()
    }
}

/// One WARN per job with settings `runner` cannot enforce, naming them.
pub fn warn_unenforced(jobs: &[Job], runner: &dyn Runner) {
    let lacking = runner.lacking();
    let process = runner.kind() == crate::config::RunnerKind::Process;
    for job in jobs {
        if process && job.identity.is_some() && !nix::unistd::geteuid().is_root() {
            tracing::warn!(
                job = %job.name,
                "user/group: runs start as processes and this daemon is not root: the job's runs cannot switch to its user and will not start (run the daemon as root, or let it start units: jobs.runner)"
            );
        }
        let missing = job.isolation().unenforced(runner.kind(), &lacking);
        if missing.is_empty() {
            continue;
        }
        if process {
            tracing::warn!(
                job = %job.name,
                "runs start as processes (jobs.runner): not enforced for this job: {} (the sandbox and credentials need the systemd runner; a limit, a cgroup per run with its controller: {})",
                missing.join(", "),
                if lacking.len() == CONTROLLERS.len() {
                    "Delegate=yes".to_string()
                } else {
                    format!("this host lacks {}", lacking.join(", "))
                }
            );
        } else {
            tracing::warn!(
                job = %job.name,
                "not enforced for this job: {} (this host's cgroups lack the {} controller)",
                missing.join(", "),
                lacking.join(", ")
            );
        }
    }
}

/// Runs the job's command as a process ([`run`]), each run in a cgroup of
/// its own when the daemon has a delegated one ([`crate::cgroup`]).
#[derive(Default)]
pub struct ProcessRunner {
    cgroups: Option<Runs>,
}

impl ProcessRunner {
    /// The process runner, with a cgroup per run when systemd delegated the
    /// daemon's cgroup to it (said either way, once).
    pub fn with_cgroups() -> ProcessRunner {
        // Found now, while this executable's path is still its own.
        let (starter, _) = crate::launch::starter();
        tracing::debug!(starter, "runs that need it start through this");
        let cgroups = match Runs::set_up() {
            Ok(runs) => {
                tracing::info!(
                    cgroup = %runs.base().display(),
                    "each run gets a cgroup of its own below the daemon's (delegated): its processes are killed together and accounted"
                );
                Some(runs)
            }
            Err(CgroupError::NotDelegated(why)) => {
                tracing::info!(
                    "runs get no cgroup of their own ({why}): a run is its process group and what the job guard finds below it"
                );
                None
            }
            Err(e) => {
                tracing::warn!(
                    "runs get no cgroup of their own: {e} (under systemd the unit needs Delegate=yes and ProtectControlGroups=no)"
                );
                None
            }
        };
        ProcessRunner { cgroups }
    }
}

#[async_trait::async_trait]
impl Runner for ProcessRunner {
    async fn run<'a>(
        &'a self,
        spec: RunSpec<'a>,
        guard: Option<&'a Guard>,
        stop: Pin<Box<dyn Future<Output = StopReason> + Send + 'a>>,
    ) -> Finished {
        run(spec, guard, stop, self.cgroups.as_ref()).await
    }

    /// Without a cgroup per run, every controller; with one, those the
    /// host does not give the runs.
    fn lacking(&self) -> Vec<&'static str> {
        self.cgroups
            .as_ref()
            .map_or_else(|| CONTROLLERS.to_vec(), Runs::lacking)
    }
}

/// Why a run is being stopped from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The lease could not be proven any more. `grace` is how long SIGTERM
    /// may take before SIGKILL: `kill_grace`, cut to what is left before the
    /// store could let a peer in.
    LeaseLost { grace: Duration },
    /// The daemon is shutting down and the grace period is over.
    Shutdown,
    /// `cronlease cancel` (or the API) asked for it ([`crate::cancel`]).
    Cancelled,
    /// The job's next occurrence came and its `overlap` is `replace`.
    Replaced,
}

impl StopReason {
    /// The outcome of a run of `job` stopped for this reason, and how long
    /// its SIGTERM may take before SIGKILL; said in a WARN. Both runners
    /// stop their runs this way.
    pub(crate) fn outcome_and_grace(self, job: &Job, fence: u64) -> (Outcome, Duration) {
        match self {
            StopReason::LeaseLost { grace } => {
                tracing::warn!(job = %job.name, fence, "lease lost: stopping the run (SIGKILL in {grace:?})");
                (Outcome::LeaseLost, grace.min(job.kill_grace))
            }
            StopReason::Shutdown => {
                tracing::warn!(job = %job.name, fence, "shutdown grace over: stopping the run");
                (Outcome::Killed, job.kill_grace)
            }
            StopReason::Cancelled => {
                tracing::warn!(job = %job.name, fence, "cancelled: stopping the run (SIGKILL in {:?})", job.kill_grace);
                (Outcome::Cancelled, job.kill_grace)
            }
            StopReason::Replaced => {
                tracing::warn!(job = %job.name, fence, "replaced by the next occurrence: stopping the run (SIGKILL in {:?})", job.kill_grace);
                (Outcome::Replaced, job.kill_grace)
            }
        }
    }
}

/// How a run went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub outcome: Outcome,
    pub exit_code: Option<i32>,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    /// The output tail for history ([`crate::output`]; empty: none).
    pub output: String,
    /// What the run used, when its runner can tell.
    pub usage: Usage,
}

/// What a run used (a systemd unit's accounting).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// CPU time, user and system, in milliseconds.
    pub cpu_ms: Option<u64>,
    /// The most memory its processes held at once, in bytes.
    pub memory_peak: Option<u64>,
}

impl Finished {
    /// An occurrence that ended without a process (skipped, or not started
    /// because its lease could not be proven), at `now`.
    pub fn without_process(outcome: Outcome, now: DateTime<Utc>) -> Finished {
        Finished {
            outcome,
            exit_code: None,
            started_at: now,
            finished_at: now,
            output: String::new(),
            usage: Usage::default(),
        }
    }
}

/// One run to start.
pub struct RunSpec<'a> {
    pub job: &'a Job,
    pub fence: u64,
    pub occurrence: DateTime<Utc>,
    pub node: &'a NodeName,
    /// The claim changed the job's owner.
    pub takeover: bool,
    /// From the scheduled instant to the claim's answer, in milliseconds.
    pub decision_ms: u64,
    /// The node's wall clock: when the run started and ended.
    pub clock: &'a dyn WallClock,
    /// The store's URL, whose password (from it or `password_file`) never
    /// reaches the output tail or the log.
    pub secrets: &'a StoreUrl,
    /// `None` for a run of the job, which the guard records `killed` if the
    /// daemon dies during it; the hook for one of its hooks (`on_failure`, ...).
    pub hook: Option<crate::config::Hook>,
    /// A manual run (`cronlease trigger`): its request's id, given to the
    /// process as `CRONLEASE_TRIGGER`.
    pub trigger: Option<crate::store::TriggerId>,
}

impl Launch {
    /// The process of a run: its command, through `cronlease-run-as`
    /// ([`crate::launch::starter`]) when it has a `cgroup` to enter, a user
    /// to become, or `nice` or `open_files` to apply.
    fn new(spec: &RunSpec<'_>, cgroup: Option<&std::path::Path>) -> Launch {
        let argv = command_argv(spec);
        let limits = &spec.job.isolation().limits;
        let wrapped = cgroup.is_some()
            || spec.job.identity.is_some()
            || limits.nice.is_some()
            || limits.open_files.is_some();
        let (program, args) = if wrapped {
            // std's Command can set uid and gid but not the user's
            // supplementary groups, nor a cgroup, a priority or an rlimit
            // without `unsafe` pre_exec; `cronlease-run-as` (or this
            // binary's `__run-as`) does them and then executes the command
            // in place, same pid and process group.
            let (program, mut args) = crate::launch::starter();
            if let Some(dir) = cgroup {
                args.push(format!("--cgroup={}", dir.display()));
            }
            if let Some(id) = &spec.job.identity {
                let name = id.user.as_ref().map_or("", |(name, _)| name.as_str());
                args.push(format!("--user={}:{}:{name}", id.uid, id.gid));
            }
            if let Some(n) = limits.nice {
                args.push(format!("--nice={n}"));
            }
            if let Some(n) = limits.open_files {
                args.push(format!("--open-files={n}"));
            }
            args.push("--".to_string());
            args.extend(argv);
            (program, args)
        } else {
            let mut argv = argv.into_iter();
            (argv.next().unwrap_or_default(), argv.collect())
        };
        let mut env = Vec::new();
        if let Some(id) = &spec.job.identity
            && let Some((name, home)) = &id.user
        {
            env.push(("USER".into(), name.clone()));
            env.push(("LOGNAME".into(), name.clone()));
            env.push(("HOME".into(), home.to_string_lossy().into_owned()));
        }
        env.extend(run_env(spec));
        Launch {
            program,
            args,
            env,
            cwd: spec.job.working_dir.clone(),
        }
    }

    /// The command of a run started as a systemd unit: systemd takes the
    /// user (and sets USER, LOGNAME, HOME), the limits and the priority.
    #[cfg(feature = "systemd")]
    pub(crate) fn for_unit(spec: &RunSpec<'_>) -> Launch {
        let mut argv = command_argv(spec).into_iter();
        Launch {
            program: argv.next().unwrap_or_default(),
            args: argv.collect(),
            env: run_env(spec),
            cwd: spec.job.working_dir.clone(),
        }
    }
}

/// A run's name where the host shows it (its systemd unit, its cgroup):
/// `JOB-FENCE`, `JOB-FENCE-on-failure` (`-on-success`, `-on-recovery`) for
/// the job's hook after that run. A shard's lock `JOB~NODE` shows as
/// `JOB:NODE` (systemd refuses `~` in a unit name; no job name has `:`).
pub fn run_label(job: &str, fence: u64, hook: Option<crate::config::Hook>) -> String {
    let job = job.replace(crate::config::SHARD_SEPARATOR, ":");
    match hook {
        None => format!("{job}-{fence}"),
        Some(hook) => format!("{job}-{fence}-{}", hook.label()),
    }
}

/// The run's argv: the job's command (`on_failure`'s for that run).
fn command_argv(spec: &RunSpec<'_>) -> Vec<String> {
    match &spec.job.command {
        Command::Argv(argv) => argv.clone(),
        Command::Shell(script) => vec!["/bin/sh".into(), "-c".into(), script.clone()],
    }
}

/// The job's `env` and the CRONLEASE_* variables of the run.
fn run_env(spec: &RunSpec<'_>) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = spec
        .job
        .env
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    // A shard's lock is `JOB~NODE`: the job is JOB.
    let job = spec.job.name.shard_of().unwrap_or(spec.job.name.as_str());
    env.push(("CRONLEASE_JOB".into(), job.to_string()));
    env.push(("CRONLEASE_FENCE".into(), spec.fence.to_string()));
    env.push((
        "CRONLEASE_OCCURRENCE".into(),
        spec.occurrence.to_rfc3339_opts(SecondsFormat::Secs, true),
    ));
    env.push(("CRONLEASE_NODE".into(), spec.node.as_str().to_string()));
    // A retry's or a redelivery's request is no operator's: only a manual
    // run names one.
    if let Some(id) = spec.trigger.filter(|t| t.is_operators()) {
        env.push(("CRONLEASE_TRIGGER".into(), id.to_string()));
    }
    if spec.trigger.is_some_and(|t| t.redelivery_of().is_some()) {
        env.push(("CRONLEASE_REDELIVERY".into(), "1".into()));
    }
    env.push((
        "CRONLEASE_ATTEMPT".into(),
        crate::store::TriggerId::attempt(spec.trigger).to_string(),
    ));
    if let Some((_, index, count)) = spec.trigger.and_then(crate::store::TriggerId::shard_of) {
        env.push(("CRONLEASE_SHARD_INDEX".into(), index.to_string()));
        env.push(("CRONLEASE_SHARD_COUNT".into(), count.to_string()));
    }
    env
}

/// What the guard records for the run if the daemon dies during it
/// (none for a hook).
pub(crate) fn run_note(spec: &RunSpec<'_>, started_at: DateTime<Utc>) -> Option<RunNote> {
    spec.hook.is_none().then(|| RunNote {
        job: spec.job.name.to_string(),
        fence: spec.fence,
        occurrence: spec.occurrence,
        takeover: spec.takeover,
        decision_ms: spec.decision_ms,
        started_at,
        trigger: spec.trigger.map(crate::store::TriggerId::get),
    })
}

/// A run's output: a task per stream logging its lines and keeping the
/// tail ([`pump`]).
pub(crate) struct Collector {
    pumps: Vec<tokio::task::JoinHandle<()>>,
    tail: std::sync::Arc<std::sync::Mutex<Tail>>,
}

impl Collector {
    /// `level`: what the daemon logs each line at.
    pub(crate) fn start(
        spec: &RunSpec<'_>,
        stdout: Option<Output>,
        stderr: Option<Output>,
        level: tracing::Level,
    ) -> Collector {
        let tail = std::sync::Arc::new(std::sync::Mutex::new(Tail::new(spec.job.output_tail)));
        let mut pumps = Vec::new();
        for (stream, name) in [(stdout, "stdout"), (stderr, "stderr")] {
            if let Some(stream) = stream {
                pumps.push(tokio::spawn(pump(
                    stream,
                    Pumped {
                        job: spec.job.name.to_string(),
                        fence: spec.fence,
                        name,
                        tail: tail.clone(),
                        secrets: spec.secrets.clone(),
                        level,
                    },
                )));
            }
        }
        Collector { pumps, tail }
    }

    /// The tail, once the streams ended (at most 2 s after the run: what
    /// a run left behind may hold them open), without the store's
    /// password.
    pub(crate) async fn finish(self, spec: &RunSpec<'_>) -> String {
        for p in self.pumps {
            let _ = tokio::time::timeout(Duration::from_secs(2), p).await;
        }
        match self.tail.lock() {
            Ok(tail) => tail.finish(|text| spec.secrets.scrub(text)),
            Err(_) => String::new(),
        }
    }
}

/// The daemon's read end (non-blocking) and the job's write end (blocking)
/// of a run's stdout and of its stderr.
pub(crate) type OutputPipes = (
    (std::os::fd::OwnedFd, std::os::fd::OwnedFd),
    (std::os::fd::OwnedFd, std::os::fd::OwnedFd),
);

/// Opens a run's output pipes: non-blocking for the daemon's read end as
/// made, blocking again for the job's write end (two calls less per pipe
/// than tokio's checked conversion: a thousand jobs at one instant are two
/// thousand pipes).
pub(crate) fn output_pipes() -> Result<OutputPipes, String> {
    let pipe = || {
        use nix::fcntl::{FcntlArg, OFlag, fcntl};
        let (r, w) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)?;
        fcntl(&w, FcntlArg::F_SETFL(OFlag::empty()))?;
        Ok::<_, nix::Error>((r, w))
    };
    pipe()
        .and_then(|out| Ok((out, pipe()?)))
        .map_err(|e| format!("cannot open the output pipes: {e}"))
}

/// Runs the job to its end. `stop` resolving ends the run early (the reason
/// picks the outcome). The process group is registered with `guard` while it
/// lives. With `cgroups` the run has a cgroup of its own: everything in it
/// is killed when the run ends, and its usage is read from it.
pub async fn run(
    spec: RunSpec<'_>,
    guard: Option<&Guard>,
    stop: impl Future<Output = StopReason>,
    cgroups: Option<&Runs>,
) -> Finished {
    let started_at = spec.clock.now();
    let job = spec.job;
    let fence = spec.fence;
    let note = run_note(&spec, started_at);
    // A cgroup that cannot be made leaves the run as it would be without
    // delegation (its group and what the guard finds), said once per run.
    let cgroup = cgroups.and_then(|c| {
        c.create(
            &run_label(job.name.as_str(), fence, spec.hook),
            &job.isolation().limits,
        )
            .map_err(|e| {
                tracing::warn!(job = %job.name, fence, "cannot make the run's cgroup ({e}): it runs without one");
            })
            .ok()
    });
    let launch = Launch::new(&spec, cgroup.as_ref().map(RunCgroup::path));
    let started = start(&launch, note.as_ref(), guard).await;
    let mut process = match started {
        Ok(process) => process,
        Err(e) => {
            if let Some(c) = cgroup {
                c.finish(crate::cgroup::EMPTY_WITHIN).await;
            }
            tracing::error!(job = %job.name, fence, "cannot start the command: {e}");
            return Finished {
                outcome: Outcome::NotStarted,
                exit_code: None,
                started_at,
                finished_at: spec.clock.now(),
                output: with_sandbox_hint(
                    &job.name,
                    fence,
                    &e,
                    spec.secrets
                        .scrub(&format!("cronlease: the command did not start: {e}\n")),
                ),
                usage: Usage::default(),
            };
        }
    };
    let started_at = process.started_at.unwrap_or(started_at);
    let pgid = process.pgid;
    let collector = Collector::start(
        &spec,
        process.stdout.take(),
        process.stderr.take(),
        tracing::Level::INFO,
    );

    let timeout = async {
        match job.timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    let exit = &mut process.exit;
    let (outcome, status) = tokio::select! {
        status = &mut *exit => (None, status),
        () = timeout => {
            tracing::warn!(job = %job.name, fence, "timed out after {:?}: stopping it", job.timeout.unwrap_or_default());
            (Some(Outcome::Timeout), terminate(exit, pgid, job.kill_grace, cgroup.as_ref()).await)
        }
        reason = stop => {
            let (outcome, grace) = reason.outcome_and_grace(job, fence);
            (Some(outcome), terminate(exit, pgid, grace, cgroup.as_ref()).await)
        }
    };
    if !process.guarded {
        // Whatever the command left behind in its group goes with it (the
        // guard does this itself for the jobs it starts).
        signal_group(pgid, Signal::SIGKILL);
        if let Some(g) = guard {
            g.forget(pgid).await;
        }
    }
    // Everything the run left in its cgroup goes, however it got away from
    // the group (`setsid`, a double fork), as systemd does for a unit.
    let usage = match cgroup {
        Some(c) => c.finish(crate::cgroup::EMPTY_WITHIN).await.into(),
        None => Usage::default(),
    };
    let exit_code = status.and_then(|s| {
        use std::os::unix::process::ExitStatusExt;
        s.code().or_else(|| s.signal().map(|sig| 128 + sig))
    });
    let outcome = outcome.unwrap_or(match status {
        Some(s) if s.success() => Outcome::Ok,
        _ => Outcome::Failed,
    });
    let output = collector.finish(&spec).await;
    let output = if outcome == Outcome::Ok {
        output
    } else {
        let text = output.clone();
        with_sandbox_hint(&job.name, fence, &text, output)
    };
    Finished {
        outcome,
        exit_code,
        started_at,
        finished_at: spec.clock.now(),
        output,
        usage,
    }
}

impl From<crate::cgroup::Accounted> for Usage {
    fn from(a: crate::cgroup::Accounted) -> Usage {
        Usage {
            cpu_ms: a.cpu_ms,
            memory_peak: a.memory_peak,
        }
    }
}

/// `output` with a last line naming the unit's setting to relax, when the
/// daemon runs under systemd and `seen` (the output, or why the command
/// could not start) shows an error its sandbox causes ([`crate::hints`]);
/// the hint is logged as a WARN too.
fn with_sandbox_hint(job: &JobName, fence: u64, seen: &str, mut output: String) -> String {
    if !crate::hints::under_systemd() {
        return output;
    }
    if let Some(hint) = crate::hints::sandbox_hint(seen) {
        tracing::warn!(job = %job, fence, "{hint}");
        if !output.is_empty() && !output.ends_with('\n') {
            output.push('\n');
        }
        output.push_str(hint);
        output.push('\n');
    }
    output
}

pub(crate) type Output = Box<dyn AsyncRead + Unpin + Send>;

/// How a started process ends (`None`: unknown).
type Exit = Pin<Box<dyn Future<Output = Option<ExitStatus>> + Send>>;

/// A started job process.
struct Process {
    /// Its pid, which is also its process group.
    pgid: u32,
    stdout: Option<Output>,
    stderr: Option<Output>,
    exit: Exit,
    /// Started, reaped and cleaned up after by the guard.
    guarded: bool,
    /// When the guard started it (a process the daemon starts itself
    /// starts when `run` says).
    started_at: Option<DateTime<Utc>>,
}

/// Starts `launch` through the guard, or in this process when there is no
/// guard or it cannot take the request.
async fn start(
    launch: &Launch,
    note: Option<&RunNote>,
    guard: Option<&Guard>,
) -> Result<Process, String> {
    if let Some(g) = guard {
        let ((out_r, out_w), (err_r, err_w)) = output_pipes()?;
        match g.start(launch, note, out_w, err_w).await {
            Ok(child) => {
                let reader = |r: std::os::fd::OwnedFd| -> Option<Output> {
                    tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(r)
                        .ok()
                        .map(|r| Box::new(r) as Output)
                };
                let exit = child.exit;
                return Ok(Process {
                    pgid: child.pid,
                    stdout: reader(out_r),
                    stderr: reader(err_r),
                    exit: Box::pin(async move { exit.await.ok() }),
                    guarded: true,
                    started_at: Some(child.started_at),
                });
            }
            Err(StartError::Failed(e)) => return Err(e),
            Err(StartError::Gone) => {}
            Err(StartError::NotSent(e)) => {
                tracing::warn!("the job guard cannot start this job ({e}): the daemon starts it");
            }
        }
    }
    // Started here, unseen by the guard until `watch` below: its claim is
    // settled first, so a daemon dying in between is not handed back (and
    // run by a peer beside this process).
    if let (Some(g), Some(note)) = (guard, note) {
        g.starts_itself(note).await;
    }
    let mut command = tokio::process::Command::from(launch.command()?);
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(false);
    let mut child = command.spawn().map_err(|e| e.to_string())?;
    let pgid = child.id().unwrap_or_default();
    if let Some(g) = guard {
        g.watch(pgid, note).await;
    }
    let stdout = child.stdout.take().map(|s| Box::new(s) as Output);
    let stderr = child.stderr.take().map(|s| Box::new(s) as Output);
    Ok(Process {
        pgid,
        stdout,
        stderr,
        exit: Box::pin(async move { child.wait().await.ok() }),
        guarded: false,
        started_at: None,
    })
}

fn signal_group(pgid: u32, sig: Signal) {
    if let Ok(pgid) = i32::try_from(pgid)
        && pgid > 1
    {
        let _ = killpg(Pid::from_raw(pgid), sig);
    }
}

/// SIGTERM to the group (and each process of the run's cgroup), SIGKILL
/// after `grace` (at once when zero) to the group and the whole cgroup,
/// and wait for the end.
async fn terminate(
    exit: &mut Exit,
    pgid: u32,
    grace: Duration,
    cgroup: Option<&RunCgroup>,
) -> Option<ExitStatus> {
    if !grace.is_zero() {
        signal_group(pgid, Signal::SIGTERM);
        if let Some(c) = cgroup {
            c.terminate();
        }
        if let Ok(status) = tokio::time::timeout(grace, &mut *exit).await {
            return status;
        }
    }
    signal_group(pgid, Signal::SIGKILL);
    if let Some(c) = cgroup {
        c.kill();
    }
    exit.await
}

/// Where a run's output stream goes ([`pump`]).
struct Pumped {
    job: String,
    fence: u64,
    /// `stdout` or `stderr`.
    name: &'static str,
    tail: std::sync::Arc<std::sync::Mutex<Tail>>,
    /// The store's URL: its password is removed from every logged line.
    secrets: StoreUrl,
    /// What each line is logged at.
    level: tracing::Level,
}

/// Logs a stream line by line, tagged with job and fence, without the
/// store's password (never split between two events: [`LogLines`]) and
/// with control characters escaped, and keeps its end in the tail.
async fn pump(mut stream: impl AsyncRead + Unpin, to: Pumped) {
    let Pumped {
        job,
        fence,
        name,
        tail,
        secrets,
        level,
    } = to;
    let log = |event: Vec<u8>| {
        let text = secrets.scrub(&String::from_utf8_lossy(&event));
        let text = escape_controls(&text);
        if level == tracing::Level::INFO {
            tracing::info!(target: "cronlease::job", job = %job, fence, stream = name, "{text}");
        } else {
            tracing::debug!(target: "cronlease::job", job = %job, fence, stream = name, "{text}");
        }
    };
    let mut lines = LogLines::new(secrets.secret_forms());
    let mut chunk = vec![0u8; 8192];
    loop {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if let Ok(mut tail) = tail.lock() {
                    tail.push(&chunk[..n]);
                }
                lines.push(&chunk[..n]).into_iter().for_each(log);
            }
        }
    }
    lines.finish().into_iter().for_each(log);
}
