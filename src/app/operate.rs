//! The commands that act on a cluster: `step-down`, `reload`, `drill`, `trigger`
//! (with `--wait` and `--cancel`), `pause` and `resume`.

use super::*;

pub(super) fn step_down(path: &Path) -> ExitCode {
    let config = match load_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    signal_daemon(
        path,
        &config,
        nix::sys::signal::Signal::SIGUSR1,
        "step-down",
    )
}

/// `cronlease reload` (docs/cli.md; the unit's `ExecReload=`): validates the
/// configuration as `check` does and only then sends SIGHUP to the daemon
/// of the pid file (or to `pid`, as given: the unit passes `$MAINPID`), so
/// a broken configuration fails the reload (exit 78, the errors on stderr)
/// and the daemon keeps the one it runs.
pub(super) fn reload(path: &Path, pid: Option<i32>) -> ExitCode {
    let config = match load_config(path) {
        Ok(c) => c,
        Err(code) => {
            eprintln!(
                "cronlease: reload refused: {} is invalid (above); the daemon keeps its configuration",
                path.display()
            );
            return code;
        }
    };
    for warning in &config.warnings {
        eprintln!("warning: {warning}");
    }
    match pid {
        Some(pid) => send(pid, nix::sys::signal::Signal::SIGHUP, "reload"),
        None => signal_daemon(path, &config, nix::sys::signal::Signal::SIGHUP, "reload"),
    }
}

/// Sends `signal` to the daemon of `config`'s pid file (checked to be
/// `cronlease run` with this configuration) and says so: exit 1 with one
/// line when there is none.
fn signal_daemon(
    path: &Path,
    config: &Config,
    signal: nix::sys::signal::Signal,
    what: &str,
) -> ExitCode {
    let pid = match pidfile::daemon_pid(&config.pid_file, path) {
        Ok(pid) => pid,
        Err(e) => {
            eprintln!("cronlease: {e}");
            return ExitCode::FAILURE;
        }
    };
    send(pid, signal, what)
}

/// Sends `signal` to `pid` and says so; exit 1 with one line when it
/// cannot be sent.
fn send(pid: i32, signal: nix::sys::signal::Signal, what: &str) -> ExitCode {
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal) {
        Ok(()) => {
            println!("{what} requested from cronlease pid {pid}");
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
pub(super) async fn run_drill(
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

pub(super) fn print_drill(out: &mut impl Write, report: &drill::Report) {
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
            "the daemon on this host keeps running; it claims the jobs it gave up only after the head start, until another node holds them"
        }
    };
    let _ = writeln!(out, "{after}");
}

/// Exit 64 for a job `name` the configuration at `path` does not have.
pub(super) fn no_such_configured_job(name: &str, path: &Path) -> ExitCode {
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
pub(super) const TRIGGER_CLAIM_WAIT: Duration = Duration::from_secs(30);

/// How often `trigger --wait` looks at the store.
pub(super) const TRIGGER_POLL: Duration = Duration::from_millis(200);

/// How long `trigger --wait` goes on through store errors.
pub(super) const TRIGGER_STORE_PATIENCE: Duration = Duration::from_secs(30);

/// `trigger JOB [--wait]` (docs/cli.md): records a manual run's request in
/// the store, where a node claims and runs it. Exit 1 when refused (a run
/// of the job in progress, or another request still pending); with
/// `--wait`, 0 when the run ended `ok` and 1 otherwise.
pub(super) async fn trigger(
    path: PathBuf,
    name: JobName,
    wait: bool,
    reason: Option<String>,
) -> ExitCode {
    let (config, store) = match config_and_store(&path).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    let Some(job) = config.job(name.as_str()) else {
        return no_such_configured_job(name.as_str(), &path);
    };
    let run_on = job.run_on.clone();
    let job = job.name.clone();
    let actor = crate::actions::Actor::cli(reason.as_deref());
    let id = match crate::actions::trigger(&config, store.as_ref(), &job, None, &actor).await {
        Ok(Ok(id)) => id,
        Ok(Err(refused)) => {
            eprintln!("cronlease: refused: {}", refused.message(&job));
            return ExitCode::FAILURE;
        }
        Err(crate::actions::Unanswered { trigger, error }) => {
            let more = format!(
                "; trigger {trigger} of {job} may have been recorded: `cronlease history {job}` shows whether it ran"
            );
            return store_failure_with(&error, &more);
        }
    };
    println!("trigger {id}: requested a run of {job} on one node of the cluster");
    if !run_on.is_empty()
        && let Ok(nodes) = within(&config, store.nodes()).await
        && !nodes.iter().any(|n| run_on.allow(&n.tags))
    {
        eprintln!(
            "cronlease: warning: no live node has every tag of {job}'s run_on ({run_on}): the request waits until one does, for at most cluster.trigger_expiry ({})",
            humantime::format_duration(config.trigger_expiry)
        );
    }
    if !wait {
        return ExitCode::SUCCESS;
    }
    wait_for_trigger(&config, store.as_ref(), &job, id).await
}

/// `trigger --cancel`: withdraws the job's pending request, if there is one
/// (the job need not be in this configuration: it may have been removed).
pub(super) async fn cancel_trigger(
    path: PathBuf,
    job: JobName,
    reason: Option<String>,
) -> ExitCode {
    let (config, store) = match config_and_store(&path).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    let actor = crate::actions::Actor::cli(reason.as_deref());
    withdrawal(&config, store.as_ref(), &job, &actor).await
}

/// Withdraws `job`'s pending request and says so: exit 0 when withdrawn.
pub(super) async fn withdrawal(
    config: &Config,
    store: &dyn store::Store,
    job: &JobName,
    actor: &crate::actions::Actor,
) -> ExitCode {
    use crate::actions::Withdrawal;
    match crate::actions::withdraw(config, store, job, actor).await {
        Ok(w @ Withdrawal::Withdrawn(_)) => {
            println!("{}", w.message(job));
            ExitCode::SUCCESS
        }
        Ok(w) => {
            eprintln!("cronlease: {}", w.message(job));
            ExitCode::FAILURE
        }
        Err(e) => store_failure(&e),
    }
}

/// `trigger --wait`: waits until a node took the request and its run is in
/// history, and says how it ended.
pub(super) async fn wait_for_trigger(
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
                // A broadcast job's request is dispatched to its shards:
                // `history JOB` shows their runs.
                return if matches!(run.outcome, store::Outcome::Ok | store::Outcome::Dispatched) {
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
pub(super) async fn set_paused(args: crate::cli::PauseArgs, paused: bool) -> ExitCode {
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
    let actor = crate::actions::Actor::cli(args.reason.as_deref());
    let said =
        match crate::actions::set_paused(&config, store.as_ref(), &jobs, paused, &actor).await {
            Ok(said) => said,
            Err(e) => return store_failure(&e),
        };
    let names: Vec<&str> = jobs.iter().map(JobName::as_str).collect();
    if paused {
        println!(
            "paused {}: no node claims them until `cronlease resume`; a run in progress finishes",
            names.join(", ")
        );
        return ExitCode::SUCCESS;
    }
    println!("resumed {}", names.join(", "));
    let mut code = ExitCode::SUCCESS;
    for catch_up in said {
        match &catch_up.failed {
            None => println!("{}", catch_up.message),
            Some(e) => {
                eprintln!("cronlease: {}", catch_up.message);
                code = store_failure(e);
            }
        }
    }
    code
}
