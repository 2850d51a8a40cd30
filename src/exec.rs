//! Running one job: its own process group, its environment, its output in
//! the daemon's log, and the ways it can end.
//!
//! The child gets the job's `env`, plus `CRONLEASE_JOB`, `CRONLEASE_FENCE`,
//! `CRONLEASE_OCCURRENCE` (RFC 3339, UTC) and `CRONLEASE_NODE`; the daemon's
//! own secrets (`CRONLEASE_STORE_URL`) and systemd plumbing (`NOTIFY_SOCKET`)
//! are not passed on. It runs in a new process group so that a timeout,
//! a lost lease or shutdown can signal the whole tree: SIGTERM, then SIGKILL
//! after `kill_grace`. When the main process exits, whatever it left in its
//! group is killed too: a run ends when its command ends.

use std::future::Future;
use std::pin::Pin;
use std::process::Stdio;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::process::Child;

use crate::config::{Command, Job, NodeName};
use crate::guard::Guard;
use crate::node::clock::WallClock;
use crate::store::Outcome;

/// Longest output line logged as one event; longer lines are split.
const MAX_LINE: u64 = 16 * 1024;

/// Environment variables of the daemon that a job must not inherit.
const WITHHELD_ENV: &[&str] = &[
    "CRONLEASE_STORE_URL",
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
];

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
}

/// Runs the job's command as a process ([`run`]).
pub struct ProcessRunner;

#[async_trait::async_trait]
impl Runner for ProcessRunner {
    async fn run<'a>(
        &'a self,
        spec: RunSpec<'a>,
        guard: Option<&'a Guard>,
        stop: Pin<Box<dyn Future<Output = StopReason> + Send + 'a>>,
    ) -> Finished {
        run(spec, guard, stop).await
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
}

/// How a run went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub outcome: Outcome,
    pub exit_code: Option<i32>,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
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
        }
    }
}

/// One run to start.
pub struct RunSpec<'a> {
    pub job: &'a Job,
    pub fence: u64,
    pub occurrence: DateTime<Utc>,
    pub node: &'a NodeName,
    /// The node's wall clock: when the run started and ended.
    pub clock: &'a dyn WallClock,
}

fn build_command(spec: &RunSpec<'_>) -> tokio::process::Command {
    let argv: Vec<&str> = match &spec.job.command {
        Command::Argv(argv) => argv.iter().map(String::as_str).collect(),
        Command::Shell(script) => vec!["/bin/sh", "-c", script],
    };
    let mut cmd = match &spec.job.identity {
        // std's Command can set uid and gid but not the user's supplementary
        // groups; this binary's `__run-as` does (initgroups) and then
        // executes the command in place, same pid and process group.
        Some(id) => {
            // Not current_exe(): after a package upgrade that path names the
            // new binary, or nothing ("(deleted)"); /proc/self/exe is this one.
            let mut c = tokio::process::Command::new("/proc/self/exe");
            c.arg("__run-as")
                .arg(id.uid.to_string())
                .arg(id.gid.to_string())
                .arg(id.user.as_ref().map_or("", |(name, _)| name.as_str()))
                .arg("--")
                .args(&argv);
            c
        }
        None => {
            let mut c = tokio::process::Command::new(argv[0]);
            c.args(&argv[1..]);
            c
        }
    };
    for key in WITHHELD_ENV {
        cmd.env_remove(key);
    }
    if let Some(id) = &spec.job.identity {
        if let Some((name, home)) = &id.user {
            cmd.env("USER", name).env("LOGNAME", name).env("HOME", home);
        }
    }
    cmd.envs(&spec.job.env)
        .env("CRONLEASE_JOB", spec.job.name.as_str())
        .env("CRONLEASE_FENCE", spec.fence.to_string())
        .env(
            "CRONLEASE_OCCURRENCE",
            spec.occurrence.to_rfc3339_opts(SecondsFormat::Secs, true),
        )
        .env("CRONLEASE_NODE", spec.node.as_str())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(false);
    if let Some(dir) = &spec.job.working_dir {
        cmd.current_dir(dir);
    }
    cmd
}

/// `cronlease __run-as UID GID USER -- PROGRAM ARGS...`: takes the user's
/// supplementary groups (`initgroups`, or only GID when USER is empty), then
/// GID and UID, and executes PROGRAM in place. Exits 127 when any step fails,
/// as a shell does for a command it cannot run.
pub fn run_as(
    uid: u32,
    gid: u32,
    user: &str,
    command: &[std::ffi::OsString],
) -> std::process::ExitCode {
    use nix::unistd::{Gid, Uid};
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        eprintln!("cronlease: cannot run the job as uid {uid} gid {gid}: {what}: {e}");
        std::process::ExitCode::from(127)
    };
    let gid_ = Gid::from_raw(gid);
    let groups = if user.is_empty() {
        nix::unistd::setgroups(&[gid_])
    } else {
        match CString::new(user) {
            Ok(name) => nix::unistd::initgroups(&name, gid_),
            Err(e) => return fail("user name", &e),
        }
    };
    if let Err(e) = groups {
        return fail("setting the supplementary groups", &e);
    }
    if let Err(e) = nix::unistd::setgid(gid_) {
        return fail("setgid", &e);
    }
    if let Err(e) = nix::unistd::setuid(Uid::from_raw(uid)) {
        return fail("setuid", &e);
    }
    let argv: Result<Vec<CString>, _> =
        command.iter().map(|a| CString::new(a.as_bytes())).collect();
    let argv = match argv {
        Ok(argv) if !argv.is_empty() => argv,
        Ok(_) => return fail("command", &"empty"),
        Err(e) => return fail("command", &e),
    };
    match nix::unistd::execvp(&argv[0], &argv) {
        Ok(never) => match never {},
        Err(e) => fail(&format!("executing {:?}", argv[0]), &e),
    }
}

/// Runs the job to its end. `stop` resolving ends the run early (the reason
/// picks the outcome). The process group is registered with `guard` while it
/// lives.
pub async fn run(
    spec: RunSpec<'_>,
    guard: Option<&Guard>,
    stop: impl Future<Output = StopReason>,
) -> Finished {
    let started_at = spec.clock.now();
    let job = spec.job;
    let fence = spec.fence;
    let mut child = match build_command(&spec).spawn() {
        Ok(child) => child,
        Err(e) => {
            tracing::error!(job = %job.name, fence, "cannot start the command: {e}");
            return Finished {
                outcome: Outcome::NotStarted,
                exit_code: None,
                started_at,
                finished_at: spec.clock.now(),
            };
        }
    };
    let pgid = child.id().unwrap_or_default();
    if let Some(g) = guard {
        g.watch(pgid);
    }
    let mut pumps = Vec::new();
    if let Some(out) = child.stdout.take() {
        pumps.push(tokio::spawn(pump(
            out,
            job.name.to_string(),
            fence,
            "stdout",
        )));
    }
    if let Some(err) = child.stderr.take() {
        pumps.push(tokio::spawn(pump(
            err,
            job.name.to_string(),
            fence,
            "stderr",
        )));
    }

    let timeout = async {
        match job.timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    let (outcome, status) = tokio::select! {
        status = child.wait() => (None, status.ok()),
        () = timeout => {
            tracing::warn!(job = %job.name, fence, "timed out after {:?}: stopping it", job.timeout.unwrap_or_default());
            (Some(Outcome::Timeout), terminate(&mut child, pgid, job.kill_grace).await)
        }
        reason = stop => {
            let (outcome, grace) = match reason {
                StopReason::LeaseLost { grace } => {
                    tracing::warn!(job = %job.name, fence, "lease lost: stopping the run (SIGKILL in {grace:?})");
                    (Outcome::LeaseLost, grace.min(job.kill_grace))
                }
                StopReason::Shutdown => {
                    tracing::warn!(job = %job.name, fence, "shutdown grace over: stopping the run");
                    (Outcome::Killed, job.kill_grace)
                }
            };
            (Some(outcome), terminate(&mut child, pgid, grace).await)
        }
    };
    // Whatever the command left behind in its group goes with it.
    signal_group(pgid, Signal::SIGKILL);
    if let Some(g) = guard {
        g.forget(pgid);
    }
    for p in pumps {
        let _ = tokio::time::timeout(Duration::from_secs(2), p).await;
    }
    let exit_code = status.and_then(|s| {
        use std::os::unix::process::ExitStatusExt;
        s.code().or_else(|| s.signal().map(|sig| 128 + sig))
    });
    let outcome = outcome.unwrap_or(match status {
        Some(s) if s.success() => Outcome::Ok,
        _ => Outcome::Failed,
    });
    Finished {
        outcome,
        exit_code,
        started_at,
        finished_at: spec.clock.now(),
    }
}

fn signal_group(pgid: u32, sig: Signal) {
    if let Ok(pgid) = i32::try_from(pgid) {
        if pgid > 1 {
            let _ = killpg(Pid::from_raw(pgid), sig);
        }
    }
}

/// SIGTERM to the group, SIGKILL after `grace` (at once when zero), and reap.
async fn terminate(
    child: &mut Child,
    pgid: u32,
    grace: Duration,
) -> Option<std::process::ExitStatus> {
    if !grace.is_zero() {
        signal_group(pgid, Signal::SIGTERM);
        if let Ok(status) = tokio::time::timeout(grace, child.wait()).await {
            return status.ok();
        }
    }
    signal_group(pgid, Signal::SIGKILL);
    child.wait().await.ok()
}

/// Logs a stream line by line, tagged with job and fence.
async fn pump(stream: impl AsyncRead + Unpin, job: String, fence: u64, name: &'static str) {
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        match (&mut reader)
            .take(MAX_LINE)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                    line.pop();
                }
                let text = String::from_utf8_lossy(&line);
                tracing::info!(target: "cronlease::job", job = %job, fence, stream = name, "{text}");
            }
        }
    }
}
