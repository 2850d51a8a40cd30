//! `cronlease run`: the daemon's life: its store, guard, node and
//! listener started, signals handled, reloads applied, a clean stop.

use super::*;

pub(super) async fn run(path: PathBuf) -> ExitCode {
    // One copy of the configuration, shared by the dashboard and the reload
    // task (the node keeps its own jobs): 20,000 jobs are megabytes a copy.
    let config = match load_config(&path) {
        Ok(c) => Arc::new(c),
        Err(code) => return code,
    };
    telemetry::init(&config.log, Some(config.node.as_str()));
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
            telemetry::fatal(&format!("cannot install signal handlers: {e}"));
            return ExitCode::FAILURE;
        }
    };
    for warning in &config.warnings {
        tracing::warn!("{warning}");
    }
    let runner = match crate::units::choose(&config).await {
        Ok(r) => r,
        Err(e) => {
            telemetry::fatal(&format!("jobs.runner = \"systemd\": {e}"));
            return ExitCode::from(crate::app::EXIT_CONFIG);
        }
    };
    tracing::info!(
        runner = runner.kind().as_str(),
        "runs start as {}",
        match runner.kind() {
            crate::config::RunnerKind::Systemd => "transient systemd units",
            crate::config::RunnerKind::Process => "processes of the job guard",
        }
    );
    crate::exec::warn_unenforced(&config.jobs, runner.as_ref());
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let webhooks = match crate::webhook::Webhooks::start(&config, metrics.clone()).await {
        Ok(w) => w,
        Err(e @ crate::webhook::WebhookError::NotBuiltIn) => {
            telemetry::fatal(&format!("{e}"));
            return ExitCode::from(crate::app::EXIT_CONFIG);
        }
        Err(e) => {
            telemetry::fatal(&format!("{e}"));
            return ExitCode::FAILURE;
        }
    };
    let node = Node::with_parts(
        &config,
        store.clone(),
        crate::node::NodeParts {
            runner,
            metrics,
            webhooks: webhooks.clone(),
            owed: Some(crate::spool::Spool::at(&crate::guard::owed::owed_dir(
                &config.state_dir(),
                config.node.as_str(),
            ))),
            ..crate::node::NodeParts::daemon()
        },
    );
    // A store that refuses this node (credentials, no such database, TLS)
    // will not change its mind: fail the start at once, with the reason,
    // so `systemctl enable --now` fails instead of waiting. A store that
    // is only down is retried by the node.
    if let Err(e) = node.preflight().await {
        if e.is_refused() {
            return store_failure(&e);
        }
        tracing::warn!("{e}; retrying until it answers");
    }
    let shutdown = CancellationToken::new();
    // The dashboard reads the configuration a reload installs.
    let (config_tx, config_rx) = tokio::sync::watch::channel(config.clone());
    if let Some(addr) = config.http_listen {
        match http::bind(addr).await {
            Ok(listener) => {
                let n = node.clone();
                let healthy: http::HealthCheck = Arc::new(move || n.health_problem());
                let api = http::Api::new(node.metrics().clone(), healthy, store.clone(), config_rx);
                tokio::spawn(http::serve(listener, Arc::new(api), shutdown.clone()));
                let access = &config.http_access;
                let scheme = if access.tls.is_some() {
                    "https"
                } else {
                    "http"
                };
                match &access.tokens {
                    None => {
                        tracing::info!(%addr, scheme, "serving the dashboard on /, /api/*, /metrics and /healthz; read-only: no http.tokens_file, so writes need the CLI")
                    }
                    Some(tokens) => {
                        tracing::info!(%addr, scheme, tokens = tokens.len(), read_requires_token = access.read_requires_token, "serving the dashboard on /, /api/*, /metrics and /healthz; writes with a token of scope operate")
                    }
                }
            }
            Err(e) => {
                telemetry::fatal(&format!(
                    "cannot listen on {addr} for the http listener: {e}"
                ));
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
    let sending = CancellationToken::new();
    let sender = webhooks
        .clone()
        .map(|w| tokio::spawn(w.run(sending.clone())));
    // Deliveries a node that stopped handed over (docs/protocol.md,
    // "Webhook deliveries handed over").
    // It stops taking once the daemon is asked to stop.
    let collector = webhooks.clone().map(|w| {
        tokio::spawn(w.collect(
            store.clone(),
            node.owner().clone(),
            config.store.op_timeout,
            shutdown.clone(),
        ))
    });
    node.run(config.jobs.clone(), shutdown).await;
    if let (Some(w), Some(sender)) = (webhooks, sender) {
        flush_webhooks(&w).await;
        sending.cancel();
        let _ = sender.await;
        if let Some(collector) = collector {
            let _ = collector.await;
        }
        w.hand_over_left(store.as_ref(), config.store.op_timeout)
            .await;
    }
    signal_task.abort();
    drop(pid_file);
    ExitCode::SUCCESS
}

/// At shutdown, gives the webhook deliveries due now (the last runs'
/// events among them) [`WEBHOOK_FLUSH`] to go out; the rest stay spooled for
/// the next start.
async fn flush_webhooks(w: &crate::webhook::Webhooks) {
    let until = tokio::time::Instant::now() + WEBHOOK_FLUSH;
    while w.busy() > 0 && tokio::time::Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let left = w.busy();
    if left > 0 {
        tracing::info!(
            pending = left,
            "webhook deliveries not sent before the stop: handing them over"
        );
    }
}

/// How long a stopping daemon waits for webhook deliveries due now.
const WEBHOOK_FLUSH: std::time::Duration = std::time::Duration::from_secs(2);

pub(super) async fn handle_signals(
    mut signals: Signals,
    node: Arc<Node>,
    shutdown: CancellationToken,
    path: PathBuf,
    current: Arc<Config>,
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
pub(super) async fn reload_on_request(
    requested: Arc<tokio::sync::Notify>,
    node: Arc<Node>,
    shutdown: CancellationToken,
    path: PathBuf,
    mut current: Arc<Config>,
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
                let new = Arc::new(new);
                // The listener first (tokens, TLS), so that once the reload
                // is logged every request sees it.
                dashboard.send_replace(new.clone());
                apply_reload(&node, &startup, &current, &new);
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
pub(super) fn apply_reload(node: &Arc<Node>, startup: &Config, current: &Config, new: &Config) {
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
    node.warn_unenforced(&new.jobs);
    node.apply_jobs(new.jobs.clone());
    if live.contains(&"log.level")
        && let Err(e) = telemetry::set_level(&new.log.level)
    {
        tracing::warn!("SIGHUP: log.level not changed: {e}");
    }
}
