//! The systemd runner itself (feature `systemd`): see [`crate::units`].

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::io::AsyncRead;
use zbus::zvariant::{OwnedObjectPath, OwnedValue, Value};

use crate::config::{Config, Isolation, SandboxValue};
use crate::exec::{Finished, Output, RunSpec, Runner, StopReason};
use crate::guard::Guard;
use crate::launch::Launch;

const SYSTEMD: &str = "org.freedesktop.systemd1";
const MANAGER_PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";
const UNIT: &str = "org.freedesktop.systemd1.Unit";
const SERVICE: &str = "org.freedesktop.systemd1.Service";
const PROPERTIES: &str = "org.freedesktop.DBus.Properties";

/// What a run unit's Description ends with, before the daemon's unit.
const OF: &str = " of ";

/// Why the systemd runner cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UnitsError {
    #[error("this host was not booted with systemd")]
    NotBooted,
    #[error("the system bus does not answer: {0}")]
    Bus(#[from] zbus::Error),
    #[error("this daemon may not start units: {0}")]
    NotAllowed(String),
}

/// The unit name of a run: `cronlease-<job>-<fence>.service`, and
/// `...-on-failure.service` (`-on-success`, `-on-recovery`) for its hooks. Job names are
/// `[A-Za-z0-9_.-]`, all valid in a unit name.
pub fn unit_name(job: &str, fence: u64, hook: Option<crate::config::Hook>) -> String {
    format!(
        "cronlease-{}.service",
        crate::exec::run_label(job, fence, hook)
    )
}

/// A unit's object path: systemd's escaping of its name (every byte but
/// `[A-Za-z0-9]` as `_xx`).
pub fn unit_path(name: &str) -> String {
    let mut path = String::from("/org/freedesktop/systemd1/unit/");
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() {
            path.push(b as char);
        } else {
            path.push_str(&format!("_{b:02x}"));
        }
    }
    path
}

/// Starts runs as transient units ([`crate::units`]).
pub struct SystemdRunner {
    conn: zbus::Connection,
    /// Unit object path → the run waiting for its changes.
    watchers: Arc<Mutex<HashMap<String, tokio::sync::mpsc::UnboundedSender<()>>>>,
    /// Made inaccessible to every run: the daemon's configuration (the
    /// store's password, other jobs' environments) and key files.
    hidden: Vec<String>,
    /// The daemon's own unit, which each run's unit is bound to.
    daemon_unit: Option<String>,
    /// The user runs of jobs without `user` run as: the daemon's.
    own_uid: u32,
    /// The cgroup controllers this host's units can have.
    controllers: Vec<String>,
    /// This binary, for the units' `__unit-run`.
    exe: String,
}

impl SystemdRunner {
    /// Connects to the system bus and subscribes to unit changes; fails
    /// when the host was not booted with systemd or its bus does not answer.
    pub async fn connect(config: &Config) -> Result<SystemdRunner, UnitsError> {
        if !crate::systemd::booted() {
            return Err(UnitsError::NotBooted);
        }
        let conn = zbus::Connection::system().await?;
        may_manage_units(&conn)
            .await
            .map_err(UnitsError::NotAllowed)?;
        // systemd sends unit signals once a client subscribed.
        conn.call_method(Some(SYSTEMD), MANAGER_PATH, Some(MANAGER), "Subscribe", &())
            .await?;
        let rule = zbus::MatchRule::builder()
            .msg_type(zbus::message::Type::Signal)
            .sender(SYSTEMD)?
            .interface(PROPERTIES)?
            .member("PropertiesChanged")?
            .path_namespace("/org/freedesktop/systemd1/unit")?
            .build();
        let mut stream = zbus::MessageStream::for_match_rule(rule, &conn, None).await?;
        let watchers: Arc<Mutex<HashMap<String, tokio::sync::mpsc::UnboundedSender<()>>>> =
            Arc::default();
        let routes = watchers.clone();
        tokio::spawn(async move {
            // An item that is an error (a message it could not read) is
            // skipped; only the stream's end is the bus gone.
            while let Some(item) = stream.next().await {
                let Ok(msg) = item else { continue };
                let header = msg.header();
                let Some(path) = header.path() else { continue };
                if let Ok(w) = routes.lock()
                    && let Some(tx) = w.get(path.as_str())
                {
                    let _ = tx.send(());
                }
            }
            // The bus is gone (dbus-daemon restarted, or killed): this
            // daemon can neither follow nor stop its runs' units, nor start
            // new ones. It exits as on an internal error: its guard kills
            // the units (a connection of its own) and hands the leases
            // over, and systemd restarts it with a new connection. Waiting
            // runs would otherwise end as unknown with their units going
            // on, unfenced.
            tracing::error!(
                "the system bus connection ended: the runs' units can no longer be followed or stopped; exiting (70) for the guard to kill them and hand the leases over, and systemd to restart the daemon"
            );
            if let Ok(mut w) = routes.lock() {
                w.clear();
            }
            std::process::exit(i32::from(crate::app::EXIT_INTERNAL));
        });
        let daemon_unit = own_unit(&conn).await;
        Ok(SystemdRunner {
            conn,
            watchers,
            hidden: hidden_paths(config),
            daemon_unit,
            own_uid: nix::unistd::geteuid().as_raw(),
            controllers: controllers(),
            exe: own_binary(),
        })
    }

    async fn manager(
        &self,
        method: &str,
        body: &(impl serde::Serialize + zbus::zvariant::DynamicType),
    ) -> zbus::Result<zbus::Message> {
        self.conn
            .call_method(Some(SYSTEMD), MANAGER_PATH, Some(MANAGER), method, body)
            .await
    }

    /// All properties of `interface` of the unit at `path`.
    async fn properties(
        &self,
        path: &str,
        interface: &str,
    ) -> zbus::Result<HashMap<String, OwnedValue>> {
        let reply = self
            .conn
            .call_method(
                Some(SYSTEMD),
                path,
                Some(PROPERTIES),
                "GetAll",
                &(interface,),
            )
            .await?;
        reply.body().deserialize()
    }

    /// Sends `signal` to every process of the unit.
    async fn kill(&self, unit: &str, signal: nix::sys::signal::Signal) {
        if let Err(e) = self
            .manager("KillUnit", &(unit, "all", signal as i32))
            .await
        {
            tracing::debug!(unit, "KillUnit {signal}: {e}");
        }
    }

    /// The properties of the unit for `spec`, with its stdout and stderr,
    /// and as its stdin the pipe `__unit-run` says it started the command
    /// on ([`super::tee`]).
    fn properties_of(
        &self,
        spec: &RunSpec<'_>,
        launch: &Launch,
        [started, out, err]: [OwnedFd; 3],
    ) -> Result<Vec<(&'static str, Value<'static>)>, String> {
        let job = spec.job;
        let program = launch.program_path()?.to_string_lossy().into_owned();
        // The unit's main process is this binary's `__unit-run` ([`super::tee`]),
        // which runs the command and copies its output to the journal.
        let mut argv = vec![
            "cronlease".to_string(),
            "__unit-run".to_string(),
            format!("--identifier=cronlease-{}", job.name),
            format!("--arg0={}", launch.program),
            "--".to_string(),
            program,
        ];
        argv.extend(launch.args.iter().cloned());
        let mut env: Vec<String> = Vec::new();
        if !launch.env.iter().any(|(k, _)| k == "PATH")
            && let Some(path) = std::env::var_os("PATH")
        {
            env.push(format!("PATH={}", path.to_string_lossy()));
        }
        env.extend(launch.env.iter().map(|(k, v)| format!("{k}={v}")));
        let mut p: Vec<(&'static str, Value<'static>)> = vec![
            (
                "Description",
                Value::from(format!(
                    "cronlease job {} (fence {}, occurrence {}){}",
                    job.name,
                    spec.fence,
                    spec.occurrence.to_rfc3339(),
                    self.daemon_unit
                        .as_ref()
                        .map_or_else(String::new, |u| format!("{OF}{u}"))
                )),
            ),
            ("Type", Value::from("exec")),
            (
                "ExecStart",
                Value::from(vec![(self.exe.clone(), argv, false)]),
            ),
            ("Environment", Value::from(env)),
            ("StandardInputFileDescriptor", Value::Fd(started.into())),
            ("StandardOutputFileDescriptor", Value::Fd(out.into())),
            ("StandardErrorFileDescriptor", Value::Fd(err.into())),
            (
                "SyslogIdentifier",
                Value::from(format!("cronlease-{}", job.name)),
            ),
            ("AddRef", Value::from(true)),
            ("CollectMode", Value::from("inactive-or-failed")),
            ("KillMode", Value::from("control-group")),
            (
                "KillSignal",
                Value::from(nix::sys::signal::Signal::SIGKILL as i32),
            ),
            ("SendSIGHUP", Value::from(false)),
            ("CPUAccounting", Value::from(true)),
            ("MemoryAccounting", Value::from(true)),
            ("TasksAccounting", Value::from(true)),
        ];
        match &job.identity {
            Some(id) => {
                let user = id
                    .user
                    .as_ref()
                    .map_or_else(|| id.uid.to_string(), |(name, _)| name.clone());
                p.push(("User", Value::from(user)));
                p.push(("Group", Value::from(id.gid.to_string())));
            }
            None => p.push(("User", Value::from(self.own_uid.to_string()))),
        }
        if let Some(dir) = &launch.cwd {
            p.push((
                "WorkingDirectory",
                Value::from(dir.to_string_lossy().into_owned()),
            ));
        }
        limits(job.isolation(), &mut p);
        self.sandbox(job.isolation(), &mut p);
        if !job.isolation().credentials.is_empty() {
            let creds: Vec<(String, String)> = job
                .isolation()
                .credentials
                .iter()
                .map(|(k, v)| (k.clone(), v.to_string_lossy().into_owned()))
                .collect();
            p.push(("LoadCredential", Value::from(creds)));
        }
        Ok(p)
    }

    /// The job's sandbox over the defaults, the daemon's secrets always
    /// inaccessible.
    fn sandbox(&self, iso: &Isolation, p: &mut Vec<(&'static str, Value<'static>)>) {
        let mut sandbox = iso.sandbox();
        if !self.hidden.is_empty() {
            let hidden = sandbox
                .entry("InaccessiblePaths")
                .or_insert_with(|| SandboxValue::Paths(Vec::new()));
            if let SandboxValue::Paths(paths) = hidden {
                paths.extend(self.hidden.iter().cloned());
            }
        }
        p.extend(sandbox.into_iter().map(|(name, value)| {
            let value = match value {
                SandboxValue::Bool(b) => Value::from(b),
                SandboxValue::Word(w) => Value::from(w),
                SandboxValue::Paths(paths) => Value::from(paths),
            };
            (name, value)
        }));
    }

    /// Waits until the unit at `path` has ended: not active and no job
    /// pending, woken by its changes.
    async fn ended(
        &self,
        path: &str,
        changes: &mut tokio::sync::mpsc::UnboundedReceiver<()>,
    ) -> Result<(), String> {
        loop {
            let unit = self
                .properties(path, UNIT)
                .await
                .map_err(|e| format!("cannot read the unit's state: {e}"))?;
            let state = text(&unit, "ActiveState");
            let job_pending = unit
                .get("Job")
                .and_then(|v| <(u32, OwnedObjectPath)>::try_from(v.clone()).ok())
                .is_some_and(|(id, _)| id != 0);
            if matches!(state.as_deref(), Some("inactive" | "failed")) && !job_pending {
                return Ok(());
            }
            if changes.recv().await.is_none() {
                return Err("the system bus connection ended".into());
            }
        }
    }
}

/// Text property `key`.
fn text(props: &HashMap<String, OwnedValue>, key: &str) -> Option<String> {
    props
        .get(key)
        .and_then(|v| String::try_from(v.clone()).ok())
}

/// Unsigned property `key`, unless systemd's "unset" (`u64::MAX`).
fn number(props: &HashMap<String, OwnedValue>, key: &str) -> Option<u64> {
    props
        .get(key)
        .and_then(|v| u64::try_from(v.clone()).ok())
        .filter(|n| *n != u64::MAX)
}

/// `[job.limits]` as unit properties.
fn limits(iso: &Isolation, p: &mut Vec<(&'static str, Value<'static>)>) {
    let l = &iso.limits;
    if let Some(m) = l.memory_max {
        p.push(("MemoryMax", Value::from(m)));
        // Past the limit the run is killed, not swapped to a crawl.
        p.push(("MemorySwapMax", Value::from(0u64)));
    }
    if let Some(q) = l.cpu_quota {
        p.push(("CPUQuotaPerSecUSec", Value::from(u64::from(q) * 10_000)));
    }
    if let Some(t) = l.tasks_max {
        p.push(("TasksMax", Value::from(t)));
    }
    if let Some(w) = l.io_weight {
        p.push(("IOWeight", Value::from(w)));
    }
    if let Some(w) = l.cpu_weight {
        p.push(("CPUWeight", Value::from(w)));
    }
    if let Some(n) = l.nice {
        p.push(("Nice", Value::from(n)));
    }
    if let Some(n) = l.open_files {
        p.push(("LimitNOFILE", Value::from(n)));
        p.push(("LimitNOFILESoft", Value::from(n)));
    }
}

/// What no run may read: the configuration's directory (the store's
/// password, every job's environment), `password_file`, the jobs'
/// directory and the TLS key, each `-`-prefixed (no error when missing).
fn hidden_paths(config: &Config) -> Vec<String> {
    let mut paths: Vec<std::path::PathBuf> = Vec::new();
    if let Some(dir) = config.path.parent().filter(|d| d.as_os_str().len() > 1) {
        paths.push(dir.to_path_buf());
    }
    paths.extend(config.job_files.iter().cloned());
    paths.extend(config.store.secret_files());
    // The daemon's own credentials (the packaged unit's LoadCredential=).
    if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY") {
        paths.push(dir.into());
    }
    let mut out: Vec<String> = paths
        .into_iter()
        .filter(|p| p.is_absolute())
        .map(|p| format!("-{}", p.display()))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The controllers of the unified cgroup hierarchy's root (empty on a
/// host without one, or whose kernel keeps them on v1 hierarchies: a
/// container's systemd then cannot enforce those limits).
fn controllers() -> Vec<String> {
    std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// This binary's path, as installed (after a package upgrade the path
/// names the new binary, whose `__unit-run` is the same).
fn own_binary() -> String {
    let exe = std::env::current_exe()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "/usr/bin/cronlease".into());
    exe.strip_suffix(" (deleted)")
        .map_or(exe.clone(), str::to_string)
}

/// The unit this process runs in, if it runs in one.
async fn own_unit(conn: &zbus::Connection) -> Option<String> {
    let reply = conn
        .call_method(
            Some(SYSTEMD),
            MANAGER_PATH,
            Some(MANAGER),
            "GetUnitByPID",
            &(std::process::id(),),
        )
        .await
        .ok()?;
    let path: OwnedObjectPath = reply.body().deserialize().ok()?;
    let reply = conn
        .call_method(
            Some(SYSTEMD),
            path.as_str(),
            Some(PROPERTIES),
            "Get",
            &(UNIT, "Id"),
        )
        .await
        .ok()?;
    let id: OwnedValue = reply.body().deserialize().ok()?;
    String::try_from(id)
        .ok()
        .filter(|id| id.ends_with(".service"))
}

/// How a unit ended, read back from it.
struct UnitEnd {
    /// The wait status's exit code or 128 + signal, as for a process.
    exit_code: Option<i32>,
    success: bool,
    /// systemd's `Result`: `success`, `exit-code`, `signal`, `oom-kill`...
    result: String,
    cpu_ns: Option<u64>,
    memory_peak: Option<u64>,
    /// When systemd started the unit's main process (µs since the epoch).
    started_us: Option<u64>,
}

#[async_trait::async_trait]
impl Runner for SystemdRunner {
    async fn run<'a>(
        &'a self,
        spec: RunSpec<'a>,
        guard: Option<&'a Guard>,
        stop: Pin<Box<dyn Future<Output = StopReason> + Send + 'a>>,
    ) -> Finished {
        let unit = unit_name(spec.job.name.as_str(), spec.fence, spec.hook);
        let path = unit_path(&unit);
        let (tx, mut changes) = tokio::sync::mpsc::unbounded_channel();
        if let Ok(mut w) = self.watchers.lock() {
            w.insert(path.clone(), tx);
        }
        let finished = self
            .run_unit(&unit, &path, &mut changes, spec, guard, stop)
            .await;
        if let Ok(mut w) = self.watchers.lock() {
            w.remove(&path);
        }
        finished
    }

    fn kind(&self) -> crate::config::RunnerKind {
        crate::config::RunnerKind::Systemd
    }

    fn lacking(&self) -> Vec<&'static str> {
        ["memory", "pids", "cpu", "io"]
            .into_iter()
            .filter(|c| !self.controllers.iter().any(|have| have == c))
            .collect()
    }
}

impl SystemdRunner {
    async fn run_unit<'a>(
        &'a self,
        unit: &str,
        path: &str,
        changes: &mut tokio::sync::mpsc::UnboundedReceiver<()>,
        spec: RunSpec<'a>,
        guard: Option<&'a Guard>,
        stop: Pin<Box<dyn Future<Output = StopReason> + Send + 'a>>,
    ) -> Finished {
        let job = spec.job;
        let fence = spec.fence;
        let started_at = spec.clock.now();
        let launch = Launch::for_unit(&spec);
        let not_started = |why: String, spec: &RunSpec<'_>| {
            tracing::error!(job = %job.name, fence, unit, "cannot start the unit: {why}");
            Finished {
                outcome: crate::store::Outcome::NotStarted,
                exit_code: None,
                started_at,
                finished_at: spec.clock.now(),
                output: format!("cronlease: cannot start the unit {unit}: {why}\n"),
                usage: Default::default(),
            }
        };
        let pipes = crate::exec::output_pipes().and_then(|p| {
            let (r, w) =
                nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
                    .map_err(|e| format!("cannot open a pipe: {e}"))?;
            Ok((p, (r, w)))
        });
        let (((out_r, out_w), (err_r, err_w)), (started_r, started_w)) = match pipes {
            Ok(p) => p,
            Err(e) => return not_started(e, &spec),
        };
        let properties = match self.properties_of(&spec, &launch, [started_w, out_w, err_w]) {
            Ok(p) => p,
            Err(e) => return not_started(e, &spec),
        };
        let note = crate::exec::run_note(&spec, started_at);
        if let Some(g) = guard {
            g.watch_unit(unit, note.as_ref()).await;
        }
        let aux: Vec<(&str, Vec<(&str, Value<'_>)>)> = Vec::new();
        let started = self
            .manager("StartTransientUnit", &(unit, "fail", properties, aux))
            .await;
        // The call carried the write ends over; dropping `properties`
        // closed ours, so the pipes end when the unit's processes close
        // theirs.
        if let Err(e) = started {
            if let Some(g) = guard {
                g.forget_unit(unit).await;
            }
            return not_started(e.to_string(), &spec);
        }
        let reader = |r: OwnedFd| -> Option<Output> {
            tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(r)
                .ok()
                .map(|r| Box::new(r) as Box<dyn AsyncRead + Unpin + Send>)
        };
        // The unit puts the lines in the journal itself: the daemon's log
        // has them at debug only.
        let collector = crate::exec::Collector::start(
            &spec,
            reader(out_r),
            reader(err_r),
            tracing::Level::DEBUG,
        );

        let timeout = async {
            match job.timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        let ended = self.ended(path, changes);
        tokio::pin!(ended);
        let (outcome, ended) = tokio::select! {
            end = &mut ended => (None, end),
            () = timeout => {
                tracing::warn!(job = %job.name, fence, unit, "timed out after {:?}: stopping it", job.timeout.unwrap_or_default());
                (Some(crate::store::Outcome::Timeout), self.terminate(unit, &mut ended, job.kill_grace).await)
            }
            reason = stop => {
                let (outcome, grace) = reason.outcome_and_grace(job, fence);
                (Some(outcome), self.terminate(unit, &mut ended, grace).await)
            }
        };
        let end = match ended {
            Ok(()) => Some(self.read_end(path).await),
            Err(e) => {
                tracing::error!(job = %job.name, fence, unit, "{e}: the run's end is unknown");
                None
            }
        };
        // The unit is ended and read: systemd may let it go.
        let _ = self
            .conn
            .call_method(Some(SYSTEMD), path, Some(UNIT), "Unref", &())
            .await;
        if let Some(g) = guard {
            g.forget_unit(unit).await;
        }
        let mut output = collector.finish(&spec).await;
        // `__unit-run` wrote a byte once it had started the command: without
        // it systemd could not set the unit up (its user, working
        // directory, credentials, namespaces), and the command never ran.
        let mut byte = [0u8; 1];
        let command_ran = matches!(nix::unistd::read(&started_r, &mut byte), Ok(1));
        let setup_failed = outcome.is_none() && !command_ran && end.is_some();
        let outcome = outcome.unwrap_or(match &end {
            _ if setup_failed => crate::store::Outcome::NotStarted,
            Some(e) if e.success => crate::store::Outcome::Ok,
            _ => crate::store::Outcome::Failed,
        });
        let why = end.as_ref().and_then(|e| {
            if setup_failed {
                Some(setup_failure(e))
            } else {
                reason_line(e, job.isolation())
            }
        });
        let hint = (outcome != crate::store::Outcome::Ok)
            .then(|| crate::hints::unit_sandbox_hint(&output).map(str::to_string))
            .flatten();
        for line in why.into_iter().chain(hint) {
            tracing::warn!(job = %job.name, fence, unit, "{line}");
            if !output.is_empty() && !output.ends_with('\n') {
                output.push('\n');
            }
            output.push_str(&line);
            output.push('\n');
        }
        let usage = crate::exec::Usage {
            cpu_ms: end.as_ref().and_then(|e| e.cpu_ns).map(|ns| ns / 1_000_000),
            memory_peak: end.as_ref().and_then(|e| e.memory_peak),
        };
        // When the command's process really started (history's LATE), not
        // when the unit was asked for.
        let started_at = end
            .as_ref()
            .and_then(|e| e.started_us)
            .and_then(|us| i64::try_from(us).ok())
            .and_then(chrono::DateTime::from_timestamp_micros)
            .unwrap_or(started_at);
        Finished {
            outcome,
            exit_code: end.and_then(|e| e.exit_code).filter(|_| !setup_failed),
            started_at,
            finished_at: spec.clock.now(),
            output,
            usage,
        }
    }

    /// SIGTERM to the unit's processes, SIGKILL after `grace` (at once when
    /// zero), and the wait for its end.
    async fn terminate(
        &self,
        unit: &str,
        ended: &mut (impl Future<Output = Result<(), String>> + Unpin),
        grace: Duration,
    ) -> Result<(), String> {
        use nix::sys::signal::Signal;
        if !grace.is_zero() {
            self.kill(unit, Signal::SIGTERM).await;
            if let Ok(end) = tokio::time::timeout(grace, &mut *ended).await {
                return end;
            }
        }
        self.kill(unit, Signal::SIGKILL).await;
        ended.await
    }

    /// How the unit's main process ended and what the unit used.
    async fn read_end(&self, path: &str) -> UnitEnd {
        let service = self.properties(path, SERVICE).await.unwrap_or_default();
        let code = service
            .get("ExecMainCode")
            .and_then(|v| i32::try_from(v.clone()).ok());
        let status = service
            .get("ExecMainStatus")
            .and_then(|v| i32::try_from(v.clone()).ok());
        // CLD_EXITED 1, CLD_KILLED 2, CLD_DUMPED 3.
        let exit_code = match (code, status) {
            (Some(1), Some(s)) => Some(s),
            (Some(2 | 3), Some(sig)) => Some(128 + sig),
            _ => None,
        };
        let result = text(&service, "Result").unwrap_or_default();
        UnitEnd {
            exit_code,
            success: result == "success" && exit_code == Some(0),
            result,
            cpu_ns: number(&service, "CPUUsageNSec"),
            memory_peak: number(&service, "MemoryPeak"),
            started_us: number(&service, "ExecMainStartTimestamp").filter(|us| *us > 0),
        }
    }
}

/// The line a run's output ends with when systemd ended it for a reason
/// of its own (a limit), naming the limit.
fn reason_line(end: &UnitEnd, iso: &Isolation) -> Option<String> {
    match end.result.as_str() {
        "oom-kill" => Some(match iso.limits.memory_max {
            Some(m) => format!(
                "cronlease: the run was killed: out of memory (limits.memory_max = {m} bytes)"
            ),
            None => "cronlease: the run was killed: out of memory".to_string(),
        }),
        _ => None,
    }
}

/// The line a run's output ends with when systemd could not set its unit
/// up: its exit code (systemd.exec(5)) and what it stands for.
fn setup_failure(end: &UnitEnd) -> String {
    let code = end.exit_code.unwrap_or_default();
    let what = match code {
        200 => "changing to the working directory (working_dir)",
        203 => "executing the command",
        216 => "the group (group)",
        217 => "the user (user)",
        226 => "the sandbox's namespaces ([job.sandbox])",
        243 => "the credentials (credentials: a file missing or unreadable?)",
        _ => "setting the unit up",
    };
    format!(
        "cronlease: the command did not start: systemd failed at {what} (result {}, exit code {code}); see journalctl -u for the unit",
        end.result
    )
}

/// For the job guard of a daemon that died: SIGKILLs every process of
/// `units` and waits until each is no longer active (or unloaded), at most
/// `limit`; true if they all went. Its own connection and runtime: the
/// guard has neither.
pub fn kill_and_wait(units: &std::collections::BTreeSet<String>, limit: Duration) -> bool {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(process = "guard", "cannot stop the runs' units: {e}");
            return false;
        }
    };
    runtime.block_on(async {
        let conn = match tokio::time::timeout(limit, zbus::Connection::system()).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                tracing::error!(
                    process = "guard",
                    "cannot reach systemd to stop the runs' units: {e}"
                );
                return false;
            }
            Err(_) => return false,
        };
        kill_units(&conn, units, limit).await
    })
}

/// SIGKILLs every process of `units` and waits until each is no longer
/// active (or unloaded), at most `limit`; true if they all went.
async fn kill_units(
    conn: &zbus::Connection,
    units: &std::collections::BTreeSet<String>,
    limit: Duration,
) -> bool {
    for unit in units {
        let _ = conn
            .call_method(
                Some(SYSTEMD),
                MANAGER_PATH,
                Some(MANAGER),
                "KillUnit",
                &(
                    unit.as_str(),
                    "all",
                    nix::sys::signal::Signal::SIGKILL as i32,
                ),
            )
            .await;
    }
    let since = std::time::Instant::now();
    loop {
        let mut alive = false;
        for unit in units {
            let state = conn
                .call_method(
                    Some(SYSTEMD),
                    unit_path(unit).as_str(),
                    Some(PROPERTIES),
                    "Get",
                    &(UNIT, "ActiveState"),
                )
                .await
                .ok()
                .and_then(|r| r.body().deserialize::<OwnedValue>().ok())
                .and_then(|v| String::try_from(v).ok());
            // No answer: the unit is unloaded, gone.
            if state.is_some_and(|s| s != "inactive" && s != "failed") {
                alive = true;
            }
        }
        if !alive {
            return true;
        }
        if since.elapsed() >= limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// For the daemon's unit's `ExecStopPost=`, once its daemon and guard are
/// gone: SIGKILLs the run units they left (running units named
/// `cronlease-*.service` whose Description ends with ` of <this unit>`)
/// and waits for them to go, at most `limit`. Answers how many there were.
pub fn sweep(limit: Duration) -> Result<usize, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let conn = zbus::Connection::system()
            .await
            .map_err(|e| e.to_string())?;
        let Some(me) = own_unit(&conn).await else {
            return Ok(0);
        };
        type Listed = (
            String,
            String,
            String,
            String,
            String,
            String,
            OwnedObjectPath,
            u32,
            String,
            OwnedObjectPath,
        );
        let reply = conn
            .call_method(
                Some(SYSTEMD),
                MANAGER_PATH,
                Some(MANAGER),
                "ListUnitsByPatterns",
                &(
                    Vec::<String>::new(),
                    vec!["cronlease-*.service".to_string()],
                ),
            )
            .await
            .map_err(|e| e.to_string())?;
        let listed: Vec<Listed> = reply.body().deserialize().map_err(|e| e.to_string())?;
        let suffix = format!("{OF}{me}");
        let left: std::collections::BTreeSet<String> = listed
            .into_iter()
            .filter(|u| u.1.ends_with(&suffix) && u.3 != "inactive" && u.3 != "failed")
            .map(|u| u.0)
            .collect();
        if left.is_empty() {
            return Ok(0);
        }
        let n = left.len();
        if kill_units(&conn, &left, limit).await {
            Ok(n)
        } else {
            Err(format!("{n} run unit(s) still there after {limit:?}"))
        }
    })
}

/// The runner for `config`'s `jobs.runner`: `auto` takes systemd when this
/// host was booted with it, its bus answers and this daemon may start
/// units (root, or polkit says so: the package's rule lets user
/// `cronlease`), else processes (said once); `systemd` fails the start
/// without them.
pub async fn choose(config: &Config) -> Result<Arc<dyn Runner>, UnitsError> {
    use crate::config::RunnerChoice;
    let process = || -> Arc<dyn Runner> { Arc::new(crate::exec::ProcessRunner::with_cgroups()) };
    match config.runner {
        RunnerChoice::Process => Ok(process()),
        RunnerChoice::Systemd => Ok(Arc::new(SystemdRunner::connect(config).await?)),
        RunnerChoice::Auto => match SystemdRunner::connect(config).await {
            Ok(r) => Ok(Arc::new(r)),
            Err(UnitsError::NotBooted) => Ok(process()),
            Err(e) => {
                tracing::warn!("jobs.runner = \"auto\": {e}; runs start as processes");
                Ok(process())
            }
        },
    }
}

/// Whether this process may start and stop units: root may; another user
/// if polkit answers yes for `org.freedesktop.systemd1.manage-units`
/// without asking anyone (what systemd will ask it).
async fn may_manage_units(conn: &zbus::Connection) -> Result<(), String> {
    if nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    let me = conn
        .unique_name()
        .map(|n| n.to_string())
        .ok_or("no name on the system bus")?;
    let subject: (&str, HashMap<&str, Value<'_>>) = (
        "system-bus-name",
        HashMap::from([("name", Value::from(me))]),
    );
    let details: HashMap<&str, &str> = HashMap::new();
    let reply = conn
        .call_method(
            Some("org.freedesktop.PolicyKit1"),
            "/org/freedesktop/PolicyKit1/Authority",
            Some("org.freedesktop.PolicyKit1.Authority"),
            "CheckAuthorization",
            &(
                subject,
                "org.freedesktop.systemd1.manage-units",
                details,
                0u32,
                "",
            ),
        )
        .await
        .map_err(|e| format!("polkit does not answer ({e}); is polkitd installed?"))?;
    let (authorized, _challenge, _details): (bool, bool, HashMap<String, String>) = reply
        .body()
        .deserialize()
        .map_err(|e| format!("polkit's answer: {e}"))?;
    if authorized {
        Ok(())
    } else {
        Err(format!(
            "polkit does not let user {} start units (org.freedesktop.systemd1.manage-units); the package's rule is /usr/share/polkit-1/rules.d/50-cronlease.rules",
            nix::unistd::User::from_uid(nix::unistd::geteuid())
                .ok()
                .flatten()
                .map_or_else(|| nix::unistd::geteuid().to_string(), |u| u.name)
        ))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::Limits;

    #[test]
    fn unit_names_and_their_object_paths() {
        assert_eq!(
            unit_name("backup.db", 42, None),
            "cronlease-backup.db-42.service"
        );
        // A broadcast job's shard: `~` is no unit name's.
        assert_eq!(
            unit_name("backup~web-1", 3, None),
            "cronlease-backup:web-1-3.service"
        );
        assert_eq!(
            unit_name("a_b", 7, Some(crate::config::Hook::Failure)),
            "cronlease-a_b-7-on-failure.service"
        );
        assert_eq!(
            unit_name("a_b", 7, Some(crate::config::Hook::Recovery)),
            "cronlease-a_b-7-on-recovery.service"
        );
        // systemd's escaping: every byte but [A-Za-z0-9] as _xx.
        assert_eq!(
            unit_path("cronlease-a_b.c-7.service"),
            "/org/freedesktop/systemd1/unit/cronlease_2da_5fb_2ec_2d7_2eservice"
        );
    }

    #[test]
    fn limits_become_unit_properties() {
        let iso = Isolation {
            limits: Limits {
                memory_max: Some(64 << 20),
                cpu_quota: Some(150),
                tasks_max: Some(16),
                io_weight: Some(10),
                cpu_weight: Some(20),
                nice: Some(-3),
                open_files: Some(333),
            },
            ..Isolation::default()
        };
        let mut p = Vec::new();
        limits(&iso, &mut p);
        let got: BTreeMap<&str, String> = p.iter().map(|(k, v)| (*k, v.to_string())).collect();
        let want = [
            ("MemoryMax", "uint64 67108864"),
            ("MemorySwapMax", "uint64 0"),
            ("CPUQuotaPerSecUSec", "uint64 1500000"),
            ("TasksMax", "uint64 16"),
            ("IOWeight", "uint64 10"),
            ("CPUWeight", "uint64 20"),
            ("Nice", "-3"),
            ("LimitNOFILE", "uint64 333"),
            ("LimitNOFILESoft", "uint64 333"),
        ];
        for (k, v) in want {
            assert_eq!(got.get(k).map(String::as_str), Some(v), "{k}: {got:?}");
        }
        let mut none = Vec::new();
        limits(&Isolation::default(), &mut none);
        assert!(none.is_empty(), "no limit, no property: {none:?}");
    }

    use std::collections::BTreeMap;

    fn end(result: &str, exit_code: Option<i32>) -> UnitEnd {
        UnitEnd {
            exit_code,
            success: false,
            result: result.into(),
            cpu_ns: None,
            memory_peak: None,
            started_us: None,
        }
    }

    #[test]
    fn a_run_systemd_ended_says_why() {
        let iso = Isolation {
            limits: Limits {
                memory_max: Some(64 << 20),
                ..Limits::default()
            },
            ..Isolation::default()
        };
        let oom = reason_line(&end("oom-kill", Some(137)), &iso).unwrap();
        assert!(
            oom.contains("out of memory (limits.memory_max = 67108864 bytes)"),
            "{oom}"
        );
        let creds = setup_failure(&end("exit-code", Some(243)));
        assert!(
            creds.contains("credentials") && creds.contains("did not start"),
            "{creds}"
        );
        let user = setup_failure(&end("exit-code", Some(217)));
        assert!(user.contains("(user)"), "{user}");
        assert_eq!(reason_line(&end("exit-code", Some(3)), &iso), None);
        assert_eq!(reason_line(&end("success", Some(0)), &iso), None);
        assert_eq!(reason_line(&end("signal", Some(143)), &iso), None);
    }
}
