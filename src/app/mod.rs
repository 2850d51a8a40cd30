//! The commands behind `main`: each loads the configuration, does its work and
//! maps the result to an exit code (docs/cli.md): 0 ok, 2 usage (clap),
//! 64 no such job, 69 store unreachable, 77 store refused this node,
//! 78 invalid configuration, 1 anything else.

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
use crate::{drill, guard, http, launch, telemetry};

mod cancel;
mod daemon;
mod operate;
mod reports;
use cancel::*;
use daemon::*;
use operate::*;
use reports::*;

/// Exit code: no such job (sysexits EX_USAGE).
pub const EXIT_NO_SUCH_JOB: u8 = 64;
/// Exit code: store unreachable (sysexits EX_UNAVAILABLE).
pub const EXIT_UNAVAILABLE: u8 = 69;
/// Exit code: an internal error the daemon cannot go on from (a panic, the
/// system bus gone under the systemd runner) (sysexits EX_SOFTWARE); its
/// guard hands over, systemd restarts it.
pub const EXIT_INTERNAL: u8 = 70;
/// Exit code: the store refused this node: credentials, no such database,
/// TLS (sysexits EX_NOPERM). The unit does not restart on it.
pub const EXIT_REFUSED: u8 = 77;
/// Exit code: invalid configuration (sysexits EX_CONFIG).
pub const EXIT_CONFIG: u8 = 78;

/// The job guard's process (`cronlease __guard`, started by the daemon):
/// serves the daemon until it is gone ([`guard::serve`]).
pub fn guard() -> ExitCode {
    telemetry::init_guard();
    guard::serve()
}

/// `cronlease-guard __guard VERSION`: the small guard
/// ([`guard::serve_small`]) of a daemon of `VERSION`.
pub fn guard_small(daemon_version: &str) -> ExitCode {
    telemetry::init_guard();
    guard::serve_small(daemon_version)
}

/// `cronlease __guard --gone`, which `cronlease-guard` executes in its
/// place when its daemon died: hands over ([`guard::resume`]).
pub fn guard_gone() -> ExitCode {
    telemetry::init_guard();
    guard::resume()
}

/// Runs a parsed command line.
pub fn main(cli: Cli) -> ExitCode {
    match cli.command {
        Commands::Guard => self::guard(),
        Commands::WaitGuard => crate::systemd::wait_for_guard(crate::systemd::GUARD_WITHIN),
        Commands::UnitRun {
            identifier,
            arg0,
            command,
        } => crate::units::tee::unit_run(&identifier, arg0.as_deref(), &command),
        Commands::RunAs {
            cgroup,
            user,
            nice,
            open_files,
            command,
        } => launch::run_as(
            cgroup.as_deref(),
            user.as_deref(),
            nice,
            open_files,
            &command,
        ),
        Commands::Check {
            config,
            next,
            strict,
        } => check(&config.config, next, strict),
        Commands::Run(c) => with_runtime(|| run(c.config)),
        Commands::Status { config, json } => with_runtime(|| status(config.config, json)),
        Commands::Nodes { config, json } => with_runtime(|| nodes(config.config, json)),
        Commands::History {
            config,
            job,
            limit,
            json,
            actions,
        } => with_runtime(|| history(config.config, job, limit, json, actions)),
        Commands::Logs { config, job, fence } => with_runtime(|| logs(config.config, job, fence)),
        Commands::Trigger {
            config,
            job,
            wait,
            cancel: false,
            reason,
        } => with_runtime(|| trigger(config.config, job, wait, reason)),
        Commands::Trigger {
            config,
            job,
            cancel: true,
            reason,
            ..
        } => with_runtime(|| cancel_trigger(config.config, job, reason)),
        Commands::Cancel {
            config,
            job,
            reason,
        } => with_runtime(|| cancel(config.config, job, reason)),
        Commands::Pause(args) => with_runtime(|| set_paused(args, true)),
        Commands::Resume(args) => with_runtime(|| set_paused(args, false)),
        Commands::Migrate(c) => with_runtime(|| migrate(c.config)),
        Commands::StepDown(c) => step_down(&c.config),
        Commands::Reload(r) => reload(&r.config.config, r.pid),
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
        Commands::Token { name, scope } => make_token(&name, scope),
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
    telemetry::fatal(&format!("{}{more}", config::one_line(&e.to_string())));
    match e {
        StoreError::NotBuiltIn(_) => ExitCode::from(EXIT_CONFIG),
        e if e.is_unreachable() => ExitCode::from(EXIT_UNAVAILABLE),
        e if e.is_refused() => ExitCode::from(EXIT_REFUSED),
        _ => ExitCode::FAILURE,
    }
}

/// `cronlease token NAME`: a new API token's secret on the first line of
/// stdout, then the `[[token]]` table for `tokens_file`.
fn make_token(name: &str, scope: crate::cli::TokenScope) -> ExitCode {
    let scope = match scope {
        crate::cli::TokenScope::Read => config::Scope::Read,
        crate::cli::TokenScope::Operate => config::Scope::Operate,
    };
    match config::new_token(name, scope) {
        Ok((secret, table)) => {
            println!("{secret}");
            println!(
                "# add to [http] tokens_file (the secret above is not in it; keep it elsewhere):"
            );
            print!("{table}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cronlease: {e}");
            ExitCode::from(2)
        }
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

fn check(path: &Path, next: usize, strict: bool) -> ExitCode {
    let config = match load_config(path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if strict && !config.warnings.is_empty() {
        // Errors now: one line each, as load errors are.
        for warning in &config.warnings {
            eprintln!("{warning}");
        }
        return ExitCode::from(EXIT_CONFIG);
    }
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
        let jitter = job.schedule.jitter().map_or_else(String::new, |j| {
            format!("  jitter {}", humantime::format_duration(j))
        });
        let _ = writeln!(
            out,
            "{}  {:?} ({}){jitter}  {}",
            job.name,
            job.schedule.expr(),
            job.schedule.zone(),
            job.defined_at
        );
        for t in job.schedule.upcoming(now, next) {
            let local = t.with_timezone(&job.schedule.zone());
            // A jittered time names the scheduled one it was moved from.
            let moved = match job.schedule.unjittered(t) {
                Some(at) if job.schedule.jitter().is_some() => format!(
                    "  scheduled {} +{}",
                    at.with_timezone(&job.schedule.zone()).format("%H:%M:%S"),
                    humantime::format_duration((t - at).to_std().unwrap_or_default())
                ),
                _ => String::new(),
            };
            let _ = writeln!(
                out,
                "  {}  ({}){moved}",
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
