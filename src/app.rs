//! The commands behind `main`: each loads the configuration, does its work and
//! maps the result to an exit code (docs/cli.md): 0 ok, 2 usage (clap),
//! 64 no such job, 69 store unreachable, 78 invalid configuration, 1 anything else.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use futures_util::StreamExt;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};
use signal_hook_tokio::Signals;
use tokio_util::sync::CancellationToken;

use crate::cli::{Cli, Commands};
use crate::config::{self, Config, JobName, Overrides};
use crate::node::Node;
use crate::pidfile::{self, PidFile};
use crate::store::{self, StoreError};
use crate::{drill, exec, guard, http, telemetry};

/// Exit code: no such job (sysexits EX_USAGE).
pub const EXIT_NO_SUCH_JOB: u8 = 64;
/// Exit code: store unreachable (sysexits EX_UNAVAILABLE).
pub const EXIT_UNAVAILABLE: u8 = 69;
/// Exit code: invalid configuration (sysexits EX_CONFIG).
pub const EXIT_CONFIG: u8 = 78;

/// Runs a parsed command line.
pub fn main(cli: Cli) -> ExitCode {
    match cli.command {
        Commands::Guard => guard::serve(),
        Commands::RunAs {
            uid,
            gid,
            user,
            command,
        } => exec::run_as(uid, gid, &user, &command),
        Commands::Check { config, next } => check(&config.config, next),
        Commands::Run(c) => with_runtime(|| run(c.config)),
        Commands::Status { config, json } => with_runtime(|| status(config.config, json)),
        Commands::Nodes { config, json } => with_runtime(|| nodes(config.config, json)),
        Commands::History {
            config,
            job,
            limit,
            json,
        } => with_runtime(|| history(config.config, job, limit, json)),
        Commands::Logs { config, job, fence } => with_runtime(|| logs(config.config, job, fence)),
        Commands::Trigger {
            config,
            job,
            wait,
            cancel: false,
        } => with_runtime(|| trigger(config.config, job, wait)),
        Commands::Trigger {
            config,
            job,
            cancel: true,
            ..
        } => with_runtime(|| cancel_trigger(config.config, job)),
        Commands::Pause(args) => with_runtime(|| set_paused(args, true)),
        Commands::Resume(args) => with_runtime(|| set_paused(args, false)),
        Commands::Migrate(c) => with_runtime(|| migrate(c.config)),
        Commands::StepDown(c) => step_down(&c.config),
        Commands::Drill {
            config,
            kill: _,
            term,
            step_down,
            jobs,
            force,
            json,
        } => {
            let how = if term {
                drill::Disturbance::Term
            } else if step_down {
                drill::Disturbance::StepDown
            } else {
                drill::Disturbance::Kill
            };
            with_runtime(|| run_drill(config.config, how, jobs, force, json))
        }
        Commands::ImportCrontab {
            file,
            system,
            user,
            timezone,
        } => import_crontab(file, system, user, timezone),
    }
}

fn with_runtime<F: std::future::Future<Output = ExitCode>>(f: impl FnOnce() -> F) -> ExitCode {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(f()),
        Err(e) => {
            eprintln!("cronlease: cannot start the async runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Loads the configuration, printing every error (one per line) on failure.
fn load_config(path: &Path) -> Result<Config, ExitCode> {
    config::load(path, &Overrides::from_env()).map_err(|errors| {
        for e in &errors.0 {
            eprintln!("{e}");
        }
        ExitCode::from(EXIT_CONFIG)
    })
}

fn store_failure(e: &StoreError) -> ExitCode {
    store_failure_with(e, "")
}

/// [`store_failure`] with `more` said after the error, on the same line.
fn store_failure_with(e: &StoreError, more: &str) -> ExitCode {
    // One line, whatever a driver put in its message.
    eprintln!("cronlease: {}{more}", config::one_line(&e.to_string()));
    match e {
        StoreError::NotBuiltIn(_) => ExitCode::from(EXIT_CONFIG),
        e if e.is_unreachable() => ExitCode::from(EXIT_UNAVAILABLE),
        _ => ExitCode::FAILURE,
    }
}

/// What a command that reads the store starts with: the configuration,
/// default logging, and the store (not yet asked anything).
async fn config_and_store(path: &Path) -> Result<(Config, Arc<dyn store::Store>), ExitCode> {
    let config = load_config(path)?;
    telemetry::init_default();
    let store = store::connect(&config.store)
        .await
        .map_err(|e| store_failure(&e))?;
    Ok((config, store))
}

/// Runs a store call within the configured `op_timeout`.
async fn within<T>(
    config: &Config,
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    store::bounded(config.store.call_budget(), call).await
}

/// Prints `value` as pretty JSON on one stdout write.
fn print_json(out: &mut impl Write, value: &impl serde::Serialize) {
    let _ = writeln!(
        out,
        "{}",
        serde_json::to_string_pretty(value).unwrap_or_default()
    );
}

fn check(path: &Path, next: usize) -> ExitCode {
    let config = match load_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    for warning in &config.warnings {
        eprintln!("warning: {warning}");
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "{}: ok (node {}, store {}, {} job{})",
        path.display(),
        config.node,
        config.store.url,
        config.jobs.len(),
        if config.jobs.len() == 1 { "" } else { "s" }
    );
    let now = Utc::now();
    for job in &config.jobs {
        let _ = writeln!(
            out,
            "{}  {:?} ({})  {}",
            job.name,
            job.schedule.expr(),
            job.schedule.zone(),
            job.defined_at
        );
        for t in job.schedule.upcoming(now, next) {
            let local = t.with_timezone(&job.schedule.zone());
            let _ = writeln!(
                out,
                "  {}  ({})",
                rfc3339(t),
                local.format("%Y-%m-%d %H:%M:%S %Z")
            );
        }
    }
    ExitCode::SUCCESS
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

async fn run(path: PathBuf) -> ExitCode {
    let config = match load_config(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    telemetry::init(&config.log);
    telemetry::exit_on_panic();
    if config.jobs.is_empty() {
        tracing::warn!(config = %path.display(), "no jobs defined: this node will only hold the store connection");
    }
    let store = match store::connect(&config.store).await {
        Ok(s) => s,
        Err(e) => return store_failure(&e),
    };
    let signals = match Signals::new([SIGTERM, SIGINT, SIGHUP, SIGUSR1]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cronlease: cannot install signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    };
    for warning in &config.warnings {
        tracing::warn!("{warning}");
    }
    let node = Node::new(&config, store.clone());
    let shutdown = CancellationToken::new();
    // The dashboard reads the configuration a reload installs.
    let (config_tx, config_rx) = tokio::sync::watch::channel(Arc::new(config.clone()));
    if let Some(addr) = config.http_listen {
        match http::bind(addr).await {
            Ok(listener) => {
                let n = node.clone();
                let healthy: http::HealthCheck = Arc::new(move || n.health_problem());
                let api = http::Api::new(node.metrics().clone(), healthy, store, config_rx);
                tokio::spawn(http::serve(listener, Arc::new(api), shutdown.clone()));
                tracing::info!(%addr, "serving the dashboard on /, /api/*, /metrics and /healthz");
            }
            Err(e) => {
                eprintln!("cronlease: cannot listen on {addr} for the http listener: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let pid_file = match PidFile::create(&config.pid_file) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!(
                "pid file: {e}; `cronlease step-down` will not find this daemon (SIGUSR1 still works)"
            );
            None
        }
    };
    let signal_task = tokio::spawn(handle_signals(
        signals,
        node.clone(),
        shutdown.clone(),
        path.clone(),
        config.clone(),
        config_tx,
    ));
    node.run(config.jobs.clone(), shutdown).await;
    signal_task.abort();
    drop(pid_file);
    ExitCode::SUCCESS
}

async fn handle_signals(
    mut signals: Signals,
    node: Arc<Node>,
    shutdown: CancellationToken,
    path: PathBuf,
    current: Config,
    dashboard: tokio::sync::watch::Sender<Arc<Config>>,
) {
    // Reloads run in a task of their own, so a stop signal is acted on
    // while a large configuration loads; SIGHUPs during a load ask for one
    // more load after it.
    let reload = Arc::new(tokio::sync::Notify::new());
    let reloads = tokio::spawn(reload_on_request(
        reload.clone(),
        node.clone(),
        shutdown.clone(),
        path,
        current,
        dashboard,
    ));
    while let Some(signal) = signals.next().await {
        match signal {
            SIGTERM | SIGINT if shutdown.is_cancelled() => {
                tracing::warn!("second stop signal: stopping running jobs now");
                node.kill_running_jobs();
            }
            SIGTERM | SIGINT => {
                let name = if signal == SIGTERM {
                    "SIGTERM"
                } else {
                    "SIGINT"
                };
                tracing::info!("{name} received: shutting down");
                shutdown.cancel();
            }
            SIGHUP if !shutdown.is_cancelled() => reload.notify_one(),
            SIGUSR1 if !shutdown.is_cancelled() => {
                tracing::info!("SIGUSR1: stepping down");
                let node = node.clone();
                tokio::spawn(async move { node.step_down().await });
            }
            _ => {}
        }
    }
    reloads.abort();
}

/// Loads the configuration at each request (SIGHUP) and applies it, until
/// shutdown. The load (parsing, validating, reading every job file) runs
/// off the runtime: a large configuration takes seconds, and claims,
/// renewals and the watchdog must not wait for it. Applying the result is
/// one cheap step.
async fn reload_on_request(
    requested: Arc<tokio::sync::Notify>,
    node: Arc<Node>,
    shutdown: CancellationToken,
    path: PathBuf,
    mut current: Config,
    dashboard: tokio::sync::watch::Sender<Arc<Config>>,
) {
    // Restart-only settings are compared with what the daemon started with.
    let startup = current.clone();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = requested.notified() => {}
        }
        let load = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || config::load(&path, &Overrides::from_env()))
        };
        let loaded = tokio::select! {
            () = shutdown.cancelled() => return,
            loaded = load => loaded,
        };
        match loaded {
            Ok(Ok(new)) => {
                apply_reload(&node, &startup, &current, &new);
                dashboard.send_replace(Arc::new(new.clone()));
                current = new;
            }
            Ok(Err(errors)) => {
                for e in &errors.0 {
                    tracing::error!("{e}");
                }
                tracing::error!(
                    errors = errors.0.len(),
                    "SIGHUP: configuration invalid; keeping the current jobs"
                );
            }
            Err(e) => {
                tracing::error!(
                    "SIGHUP: the configuration load failed: {e}; keeping the current jobs"
                );
            }
        }
    }
}

/// Applies a reloaded configuration: its jobs and the settings that can
/// change live; names, in one WARN, each changed setting that needs a restart.
fn apply_reload(node: &Arc<Node>, startup: &Config, current: &Config, new: &Config) {
    let live = current.changes(new).live;
    let restart = startup.changes(new).restart;
    if !restart.is_empty() {
        tracing::warn!(
            "SIGHUP: these settings changed but take effect only after a restart: {}",
            restart.join(", ")
        );
    }
    tracing::info!(
        jobs = new.jobs.len(),
        "SIGHUP: configuration reloaded{}",
        if live.is_empty() {
            String::new()
        } else {
            format!("; applied now: {}", live.join(", "))
        }
    );
    node.apply_settings(new);
    node.apply_jobs(new.jobs.clone());
    if live.contains(&"log.level") {
        if let Err(e) = telemetry::set_level(&new.log.level) {
            tracing::warn!("SIGHUP: log.level not changed: {e}");
        }
    }
}

fn step_down(path: &Path) -> ExitCode {
    let config = match load_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let pid = match pidfile::daemon_pid(&config.pid_file, path) {
        Ok(pid) => pid,
        Err(e) => {
            eprintln!("cronlease: {e}");
            return ExitCode::FAILURE;
        }
    };
    match nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGUSR1,
    ) {
        Ok(()) => {
            println!("step-down requested from cronlease pid {pid}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cronlease: cannot signal pid {pid}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `cronlease drill` (docs/cli.md): exit 0 when every job was taken over
/// with nothing missed or doubled, 1 otherwise; nothing is disturbed when
/// the pid file's process is not this config's daemon (1) or the job is
/// unknown (64).
async fn run_drill(
    path: PathBuf,
    how: drill::Disturbance,
    jobs: Vec<JobName>,
    force: bool,
    json: bool,
) -> ExitCode {
    let (config, store) = match config_and_store(&path).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    let report = match drill::run(
        &config,
        store.as_ref(),
        drill::Ask {
            how,
            only: &jobs,
            force,
        },
        config.store.call_budget(),
    )
    .await
    {
        Ok(r) => r,
        Err(drill::DrillError::Store(e)) => return store_failure(&e),
        Err(e @ drill::DrillError::NoSuchJob(_)) => {
            eprintln!("cronlease: {e}");
            return ExitCode::from(EXIT_NO_SUCH_JOB);
        }
        Err(e) => {
            eprintln!("cronlease: {}", config::one_line(&e.to_string()));
            return ExitCode::FAILURE;
        }
    };
    let mut out = std::io::stdout().lock();
    if json {
        print_json(&mut out, &report);
    } else {
        print_drill(&mut out, &report);
    }
    if report.passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn print_drill(out: &mut impl Write, report: &drill::Report) {
    let signal = report.disturbance.describe();
    let _ = writeln!(
        out,
        "drill: {signal} to cronlease pid {} (node {}) at {}; watched {:.1} s",
        report.pid,
        report.node,
        report
            .disturbed_at
            .to_rfc3339_opts(SecondsFormat::Millis, true),
        report.watched_ms as f64 / 1000.0
    );
    let time = |t: Option<DateTime<Utc>>| t.map_or("-".to_string(), rfc3339);
    let rows: Vec<Vec<String>> = report
        .jobs
        .iter()
        .map(|j| {
            vec![
                j.job.clone(),
                j.old_holder.clone(),
                match (&j.new_holder, j.back_on_this_node) {
                    (Some(node), _) => node.clone(),
                    (None, Some(_)) => format!("none ({} again)", j.old_holder),
                    (None, None) => "none".to_string(),
                },
                format!(
                    "{} -> {}",
                    j.fence_before,
                    j.fence_after.map_or("-".to_string(), |f| f.to_string())
                ),
                time(j.takeover_occurrence),
                j.takeover_delay_ms
                    .map_or("-".to_string(), |d| format!("{d} ms")),
                j.missed.len().to_string(),
                j.doubled.len().to_string(),
            ]
        })
        .collect();
    print_table(
        out,
        &[
            "JOB",
            "OLD",
            "NEW",
            "FENCE",
            "TAKEOVER AT",
            "DELAY",
            "MISSED",
            "DOUBLED",
        ],
        &rows,
    );
    for j in &report.jobs {
        if let Some(e) = &j.error {
            let _ = writeln!(out, "{}: store error: {e}", j.job);
        }
        for (what, list) in [("missed", &j.missed), ("ran twice", &j.doubled)] {
            if !list.is_empty() {
                let at: Vec<String> = list.iter().map(|t| time(Some(*t))).collect();
                let _ = writeln!(out, "{}: {what}: {}", j.job, at.join(", "));
            }
        }
    }
    let verdict = if report.passed {
        "passed: every job taken over by another node, no occurrence missed or run twice"
    } else {
        "FAILED: see the table (NEW none: no other node took over before the watch ended)"
    };
    let _ = writeln!(out, "{verdict}");
    let after = match report.disturbance {
        drill::Disturbance::Kill => {
            "the daemon on this host was killed: systemd restarts it (Restart=on-failure)"
        }
        drill::Disturbance::Term => {
            "the daemon on this host stopped cleanly and stays stopped: `systemctl start cronlease`"
        }
        drill::Disturbance::StepDown => {
            "the daemon on this host keeps running and claims again after one margin"
        }
    };
    let _ = writeln!(out, "{after}");
}

/// Exit 64 for a job `name` the configuration at `path` does not have.
fn no_such_configured_job(name: &str, path: &Path) -> ExitCode {
    eprintln!(
        "cronlease: no job named {:?} in {}; `cronlease check -c {}` lists the jobs",
        config::one_line(name),
        path.display(),
        path.display()
    );
    ExitCode::from(EXIT_NO_SUCH_JOB)
}

/// How long `trigger --wait` waits for a node to take the request before
/// it gives up (the request stays pending).
const TRIGGER_CLAIM_WAIT: Duration = Duration::from_secs(30);
/// How often `trigger --wait` looks at the store.
const TRIGGER_POLL: Duration = Duration::from_millis(200);
/// How long `trigger --wait` goes on through store errors.
const TRIGGER_STORE_PATIENCE: Duration = Duration::from_secs(30);

/// `trigger JOB [--wait]` (docs/cli.md): records a manual run's request in
/// the store, where a node claims and runs it. Exit 1 when refused (a run
/// of the job in progress, or another request still pending); with
/// `--wait`, 0 when the run ended `ok` and 1 otherwise.
async fn trigger(path: PathBuf, name: JobName, wait: bool) -> ExitCode {
    let (config, store) = match config_and_store(&path).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    let Some(job) = config.job(name.as_str()) else {
        return no_such_configured_job(name.as_str(), &path);
    };
    let job = job.name.clone();
    // The request is stamped with the store's time, not this host's: nodes,
    // held to the store's clock, judge its age (`cluster.trigger_expiry`).
    let made = within(&config, store.clock())
        .await
        .unwrap_or_else(|_| Utc::now());
    let id = store::TriggerId::made_at(made);
    // A request whose answer was lost (a timeout, a failover) may have been
    // recorded: asked again with the same id, it is found pending as ours.
    let mut answer = within(&config, store.request_trigger(&job, id)).await;
    for _ in 0..2 {
        match &answer {
            Err(e) if e.is_unreachable() => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                answer = within(&config, store.request_trigger(&job, id)).await;
            }
            _ => break,
        }
    }
    match answer {
        Ok(store::TriggerAnswer::Accepted) => {}
        Ok(store::TriggerAnswer::Pending(pending)) if pending == id => {}
        Ok(store::TriggerAnswer::Running { holder }) => {
            eprintln!(
                "cronlease: refused: a run of {job} is in progress{} (overlap); trigger it again once it has ended (`cronlease status` shows it)",
                holder.map_or(String::new(), |h| format!(
                    " on {}",
                    store::Owner::node_of(&config::one_line(&h))
                ))
            );
            return ExitCode::FAILURE;
        }
        Ok(store::TriggerAnswer::Pending(pending)) => {
            eprintln!(
                "cronlease: refused: a manual run of {job} was requested already (trigger {pending}{}) and has not started yet; it runs once a node takes it, expires after cluster.trigger_expiry, and `cronlease trigger --cancel {job}` withdraws it",
                request_age(pending).map_or(String::new(), |age| format!(", {age} ago"))
            );
            return ExitCode::FAILURE;
        }
        Err(e) => {
            let more = format!(
                "; trigger {id} of {job} may have been recorded: `cronlease history {job}` shows whether it ran"
            );
            return store_failure_with(&e, &more);
        }
    }
    println!("trigger {id}: requested a run of {job} on one node of the cluster");
    if !wait {
        return ExitCode::SUCCESS;
    }
    wait_for_trigger(&config, store.as_ref(), &job, id).await
}

/// How long ago request `id` was made, for people (`None` for an id that
/// carries no time).
fn request_age(id: store::TriggerId) -> Option<String> {
    let age = id.age(Utc::now())?;
    Some(humantime::format_duration(Duration::from_secs(age.as_secs())).to_string())
}

/// `trigger --cancel`: withdraws the job's pending request, if there is one
/// (the job need not be in this configuration: it may have been removed).
async fn cancel_trigger(path: PathBuf, job: JobName) -> ExitCode {
    let (config, store) = match config_and_store(&path).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    let pending = match within(&config, store.pending_triggers()).await {
        Ok(p) => p,
        Err(e) => return store_failure(&e),
    };
    let Some((_, id)) = pending.into_iter().find(|(j, _)| j == job.as_str()) else {
        eprintln!("cronlease: no manual run of {job} is pending");
        return ExitCode::FAILURE;
    };
    match within(&config, store.withdraw_trigger(&job, id)).await {
        Ok(true) => {
            println!(
                "trigger {id}: withdrawn{}; {job} was not run for it",
                request_age(id).map_or(String::new(), |age| format!(" (requested {age} ago)"))
            );
            ExitCode::SUCCESS
        }
        Ok(false) => {
            eprintln!(
                "cronlease: trigger {id} of {job} was taken by a node meanwhile: `cronlease history {job}` shows its run"
            );
            ExitCode::FAILURE
        }
        Err(e) => store_failure(&e),
    }
}

/// `trigger --wait`: waits until a node took the request and its run is in
/// history, and says how it ended.
async fn wait_for_trigger(
    config: &Config,
    store: &dyn store::Store,
    job: &JobName,
    id: store::TriggerId,
) -> ExitCode {
    let asked = tokio::time::Instant::now();
    let mut claimed = false;
    let mut failing_since: Option<tokio::time::Instant> = None;
    // Who held the job at the first look after the request was taken (the
    // node running it), and looks in a row that found the job held by
    // nobody or by another owner with no record of the run: its node
    // stopped holding it without recording it.
    let mut runner: Option<String> = None;
    let mut unheld = 0;
    loop {
        tokio::time::sleep(TRIGGER_POLL).await;
        let look = async {
            if !claimed {
                let pending = within(config, store.pending_triggers()).await?;
                claimed = !pending.iter().any(|(_, p)| *p == id);
                if !claimed {
                    return Ok(None);
                }
            }
            let keep = config.store.history_limit.max(1);
            let runs = within(config, store.history(Some(job), keep)).await?;
            if let Some(run) = runs.into_iter().find(|r| r.trigger == Some(id)) {
                return Ok(Some(Ok(run)));
            }
            let locks = within(config, store.status()).await?;
            let holder = locks
                .iter()
                .find(|l| l.job == job.as_str())
                .and_then(|l| l.holder.clone());
            let still = holder.is_some() && (runner.is_none() || runner == holder);
            if runner.is_none() {
                runner = holder;
            }
            unheld = if still { 0 } else { unheld + 1 };
            Ok(Some(Err(())))
        };
        match look.await {
            Ok(Some(Ok(run))) => {
                let exit = match run.exit_code {
                    Some(code) => format!(" (exit code {code})"),
                    None => String::new(),
                };
                if run.outcome == store::Outcome::Expired {
                    println!(
                        "trigger {id}: expired (no node ran it within cluster.trigger_expiry; taken out by {} with fence {}, not run)",
                        run.node, run.fence
                    );
                } else {
                    println!(
                        "trigger {id}: {job} ran on {} with fence {}: {}{exit}",
                        run.node, run.fence, run.outcome
                    );
                }
                return if run.outcome == store::Outcome::Ok {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                };
            }
            Ok(result) => {
                failing_since = None;
                if result.is_none() && asked.elapsed() >= TRIGGER_CLAIM_WAIT {
                    eprintln!(
                        "cronlease: no node took trigger {id} within {TRIGGER_CLAIM_WAIT:?}: is a daemon with job {job} running? The request stays pending and runs once one takes it"
                    );
                    return ExitCode::FAILURE;
                }
                if unheld >= 3 {
                    eprintln!(
                        "cronlease: trigger {id} was taken, but no node holds {job} and history has no record of its run: the node running it stopped without recording it (its host died?)"
                    );
                    return ExitCode::FAILURE;
                }
            }
            Err(e) => {
                let since = *failing_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() >= TRIGGER_STORE_PATIENCE {
                    return store_failure(&e);
                }
            }
        }
    }
}

/// `cronlease pause` / `resume`: the mark kept with each job's lock, which
/// every claim reads atomically (docs/cli.md).
async fn set_paused(args: crate::cli::PauseArgs, paused: bool) -> ExitCode {
    let (config, store) = match config_and_store(&args.config.config).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    let jobs: Vec<JobName> = if args.all {
        config.jobs.iter().map(|j| j.name.clone()).collect()
    } else {
        let mut jobs = Vec::new();
        for name in &args.jobs {
            match config.job(name.as_str()) {
                Some(j) if !jobs.contains(&j.name) => jobs.push(j.name.clone()),
                Some(_) => {}
                None => return no_such_configured_job(name.as_str(), &args.config.config),
            }
        }
        jobs
    };
    if jobs.is_empty() {
        println!(
            "no jobs in the configuration: nothing to {}",
            if paused { "pause" } else { "resume" }
        );
        return ExitCode::SUCCESS;
    }
    if let Err(e) = within(&config, store.set_paused(&jobs, paused)).await {
        return store_failure(&e);
    }
    let names: Vec<&str> = jobs.iter().map(JobName::as_str).collect();
    if paused {
        println!(
            "paused {}: no node claims them until `cronlease resume`; a run in progress finishes",
            names.join(", ")
        );
    } else {
        println!("resumed {}", names.join(", "));
    }
    ExitCode::SUCCESS
}

/// `cronlease import-crontab`: a crontab in, `[[job]]` TOML out (docs/cli.md).
/// Exit 1 when the file cannot be read, 2 for a bad `--timezone`, 78 for a
/// malformed crontab line (file:line:column); warnings go to stderr.
fn import_crontab(
    file: Option<PathBuf>,
    system: bool,
    user: bool,
    timezone: Option<String>,
) -> ExitCode {
    use std::io::Read;
    let stdin = file.as_deref().is_none_or(|f| f == Path::new("-"));
    let (text, origin) = if stdin {
        let mut bytes = Vec::new();
        if let Err(e) = std::io::stdin().read_to_end(&mut bytes) {
            eprintln!("cronlease: cannot read standard input: {e}");
            return ExitCode::FAILURE;
        }
        (bytes, "-".to_string())
    } else {
        let path = file.unwrap_or_default();
        match std::fs::read(&path) {
            Ok(bytes) => (bytes, path.display().to_string()),
            Err(e) => {
                eprintln!(
                    "cronlease: cannot read {}: {e}; name a readable crontab, or - for standard input",
                    path.display()
                );
                return ExitCode::FAILURE;
            }
        }
    };
    let Ok(text) = String::from_utf8(text) else {
        eprintln!("cronlease: {origin} is not UTF-8 text: a crontab is expected");
        return ExitCode::from(EXIT_CONFIG);
    };
    let options = crate::crontab::Options {
        system: system || (!user && !stdin && crate::crontab::is_system_path(Path::new(&origin))),
        timezone,
    };
    match crate::crontab::import(&text, &origin, &options) {
        Ok(import) => {
            for w in &import.warnings {
                eprintln!("warning: {w}");
            }
            let mut out = std::io::stdout().lock();
            if let Err(e) = out
                .write_all(import.toml.as_bytes())
                .and_then(|()| out.flush())
            {
                eprintln!("cronlease: cannot write the TOML: {e}");
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e @ crate::crontab::ImportError::Zone(_)) => {
            eprintln!("cronlease: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("cronlease: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

async fn migrate(path: PathBuf) -> ExitCode {
    let (_, store) = match config_and_store(&path).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    match tokio::time::timeout(Duration::from_secs(60), store.prepare()).await {
        Ok(Ok(())) => {
            match store.schema_notice() {
                Some(note) => println!("{}: {note}; nothing applied", store.describe()),
                None => println!("{}: schema up to date", store.describe()),
            }
            ExitCode::SUCCESS
        }
        Ok(Err(e)) => store_failure(&e),
        Err(_) => store_failure(&StoreError::Timeout(Duration::from_secs(60))),
    }
}

async fn status(path: PathBuf, json: bool) -> ExitCode {
    let (config, store) = match config_and_store(&path).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    let rows =
        match crate::status::gather(&config, store.as_ref(), config.store.call_budget()).await {
            Ok(rows) => rows,
            Err(e) => return store_failure(&e),
        };
    let sent = Utc::now();
    let clock_offset = match within(&config, store.clock()).await {
        Ok(store_now) => crate::node::clock::offset_ms(store_now, sent, Utc::now()),
        Err(e) => return store_failure(&e),
    };
    let mut out = std::io::stdout().lock();
    if json {
        print_json(&mut out, &rows);
        return ExitCode::SUCCESS;
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let last = r.last_run.as_ref().map_or("-".to_string(), |run| {
                let code = run.exit_code.map(|c| format!(" ({c})")).unwrap_or_default();
                format!("{}{code} on {}", run.outcome, run.node)
            });
            vec![
                format!(
                    "{}{}",
                    r.job,
                    if r.configured {
                        ""
                    } else {
                        " (not configured here)"
                    }
                ),
                r.holder.clone().unwrap_or_else(|| "-".into()),
                match (r.holder_alive, r.holder_clock_offset_ms) {
                    (Some(true), Some(offset)) => format!("yes ({offset:+} ms)"),
                    (Some(true), None) => "yes".into(),
                    (Some(false), _) => "no heartbeat".into(),
                    (None, _) => "-".into(),
                },
                if r.holder.is_some() {
                    format!("{:.1}s", r.lease_remaining_ms as f64 / 1000.0)
                } else {
                    "-".into()
                },
                r.fence.to_string(),
                if r.paused { "yes" } else { "-" }.into(),
                r.last_occurrence.map_or("-".into(), rfc3339),
                last,
            ]
        })
        .collect();
    print_table(
        &mut out,
        &[
            "JOB",
            "HOLDER",
            "ALIVE",
            "LEASE LEFT",
            "FENCE",
            "PAUSED",
            "LAST OCCURRENCE",
            "LAST RUN",
        ],
        &table,
    );
    for r in &rows {
        if let Some(p) = &r.pending_trigger {
            let age = p.age_ms.map_or(String::new(), |ms| {
                format!(
                    ", requested {} ago",
                    humantime::format_duration(Duration::from_secs(ms / 1000))
                )
            });
            let _ = writeln!(
                out,
                "PENDING TRIGGER: {} (trigger {}{age}): no node has taken it yet; `cronlease trigger --cancel {}` withdraws it",
                r.job, p.id, r.job
            );
        }
    }
    let bound = config.max_clock_offset.as_millis();
    let verdict = if crate::node::clock::beyond_bound(clock_offset, config.max_clock_offset) {
        "OUT OF BOUNDS: a daemon on this host claims nothing; fix time sync"
    } else {
        "ok"
    };
    let _ = writeln!(
        out,
        "\nclock offset of this host: {clock_offset:+} ms (store - local; cluster.max_clock_offset {bound} ms): {verdict}"
    );
    ExitCode::SUCCESS
}

/// `cronlease nodes`: the live records of the node registry.
async fn nodes(path: PathBuf, json: bool) -> ExitCode {
    let (config, store) = match config_and_store(&path).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    let nodes = match within(&config, store.nodes()).await {
        Ok(n) => n,
        Err(e) => return store_failure(&e),
    };
    let mut out = std::io::stdout().lock();
    if json {
        print_json(&mut out, &nodes);
        return ExitCode::SUCCESS;
    }
    let bound = config.max_clock_offset;
    let table: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            let offset = n.clock_offset_ms.map_or("-".to_string(), |ms| {
                let flag = if crate::node::clock::beyond_bound(ms, bound) {
                    " OUT OF BOUNDS"
                } else {
                    ""
                };
                format!("{ms:+} ms{flag}")
            });
            vec![
                n.node.clone(),
                n.owner.clone(),
                n.version.clone(),
                rfc3339(n.started_at),
                rfc3339(n.last_seen),
                offset,
                n.jobs_held.to_string(),
            ]
        })
        .collect();
    print_table(
        &mut out,
        &[
            "NODE",
            "OWNER",
            "VERSION",
            "STARTED",
            "LAST SEEN",
            "CLOCK OFFSET",
            "JOBS HELD",
        ],
        &table,
    );
    let _ = writeln!(
        out,
        "\n{} live node{} (clock offset: store - node; cluster.max_clock_offset {} ms)",
        nodes.len(),
        if nodes.len() == 1 { "" } else { "s" },
        bound.as_millis()
    );
    for (name, owners) in name_twins(&nodes) {
        let _ = writeln!(
            out,
            "WARNING: {} live daemons use the node name {name} ({}): give each host its own `node`",
            owners.len(),
            owners.join(", ")
        );
    }
    ExitCode::SUCCESS
}

/// Node names more than one live daemon uses, with their owners.
fn name_twins(nodes: &[store::NodeRecord]) -> Vec<(&str, Vec<&str>)> {
    let mut by_name: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for n in nodes {
        by_name
            .entry(n.node.as_str())
            .or_default()
            .push(n.owner.as_str());
    }
    by_name.into_iter().filter(|(_, o)| o.len() > 1).collect()
}

async fn history(path: PathBuf, job: Option<JobName>, limit: u32, json: bool) -> ExitCode {
    let config = match load_config(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    telemetry::init_default();
    let store = match store::connect(&config.store).await {
        Ok(s) => s,
        Err(e) => return store_failure(&e),
    };
    let runs = match within(&config, store.history(job.as_ref(), limit)).await {
        Ok(r) => r,
        Err(e) => return store_failure(&e),
    };
    if let Some(job) = &job {
        // A job removed from the configuration still has its history.
        if runs.is_empty() && config.job(job.as_str()).is_none() {
            eprintln!(
                "cronlease: no such job {job:?}: not in {} and no history in the store (`cronlease check` lists the jobs)",
                path.display()
            );
            return ExitCode::from(EXIT_NO_SUCH_JOB);
        }
    }
    let mut out = std::io::stdout().lock();
    if json {
        print_json(&mut out, &runs);
        return ExitCode::SUCCESS;
    }
    let table: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                r.job.clone(),
                r.fence.to_string(),
                r.node.clone(),
                rfc3339(r.occurrence),
                format!("{:.3}s", r.delay_ms as f64 / 1000.0),
                format!(
                    "{:.3}s",
                    (r.finished_at - r.started_at).num_milliseconds() as f64 / 1000.0
                ),
                match r.exit_code {
                    Some(c) => format!("{} ({c})", r.outcome),
                    None => r.outcome.to_string(),
                },
                if r.takeover {
                    "yes".into()
                } else {
                    "no".into()
                },
                r.trigger.map_or_else(|| "-".into(), |id| id.to_string()),
                crate::output::excerpt(&r.output),
            ]
        })
        .collect();
    print_table(
        &mut out,
        &[
            "JOB",
            "FENCE",
            "NODE",
            "OCCURRENCE",
            "LATE",
            "TOOK",
            "OUTCOME",
            "TAKEOVER",
            "TRIGGER",
            "OUTPUT",
        ],
        &table,
    );
    ExitCode::SUCCESS
}

/// `logs JOB [--fence N]`: the output tail of the job's newest run in
/// history, or of run N; exit 1 when history has no such run.
async fn logs(path: PathBuf, job: JobName, fence: Option<u64>) -> ExitCode {
    let config = match load_config(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    telemetry::init_default();
    let store = match store::connect(&config.store).await {
        Ok(s) => s,
        Err(e) => return store_failure(&e),
    };
    // A given run is looked for among every run history keeps of the job.
    let limit = match fence {
        Some(_) => config.store.history_limit.max(1),
        None => 1,
    };
    let runs = match within(&config, store.history(Some(&job), limit)).await {
        Ok(r) => r,
        Err(e) => return store_failure(&e),
    };
    if runs.is_empty() && config.job(job.as_str()).is_none() {
        eprintln!(
            "cronlease: no such job {job:?}: not in {} and no history in the store (`cronlease check` lists the jobs)",
            path.display()
        );
        return ExitCode::from(EXIT_NO_SUCH_JOB);
    }
    let run = match fence {
        Some(n) => runs.iter().find(|r| r.fence == n),
        None => runs.first(),
    };
    let Some(run) = run else {
        match fence {
            Some(n) => eprintln!(
                "cronlease: job {job} has no run with fence {n} in history (it keeps the last {} runs of each job; `cronlease history {job}` lists them)",
                config.store.history_limit
            ),
            None => eprintln!("cronlease: job {job} has no run in history yet"),
        }
        return ExitCode::from(1);
    };
    if run.output.is_empty() {
        eprintln!(
            "cronlease: run {} of {job} ({}) left no output in history (none written, or output_tail = 0)",
            run.fence, run.outcome
        );
        return ExitCode::SUCCESS;
    }
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(run.output.as_bytes());
    if !run.output.ends_with('\n') {
        let _ = out.write_all(b"\n");
    }
    ExitCode::SUCCESS
}

fn print_table(out: &mut impl Write, header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let _ = writeln!(out, "{}", line(header.to_vec()));
    for row in rows {
        let _ = writeln!(out, "{}", line(row.iter().map(String::as_str).collect()));
    }
}
