//! Logging: `tracing` to stderr, as text (console, journald) or JSON (log
//! shippers). `RUST_LOG`, when set, overrides `log.level`. Text is coloured
//! only on a terminal.

use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, LogFormat};

/// Changes the level filter of the installed subscriber (SIGHUP).
type LevelReload = Box<dyn Fn(EnvFilter) -> Result<(), String> + Send + Sync>;

static RELOAD: OnceLock<LevelReload> = OnceLock::new();

/// Installs the global subscriber; a second call is a no-op.
pub fn init(log: &LogConfig) {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new(&log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A closed log pipe must cost log lines, never the process: the
        // subscriber's own report of a failed write would go to the same
        // broken stderr with `eprintln!`, which panics.
        .log_internal_errors(false)
        // Colour only for a person at a terminal; never into journald or files.
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .with_target(false);
    match log.format {
        LogFormat::Text => {
            let builder = builder.with_filter_reloading();
            let handle = builder.reload_handle();
            if builder.try_init().is_ok() {
                let _ = RELOAD.set(Box::new(move |f| {
                    handle.reload(f).map_err(|e| e.to_string())
                }));
            }
        }
        LogFormat::Json => {
            let builder = builder
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .with_filter_reloading();
            let handle = builder.reload_handle();
            if builder.try_init().is_ok() {
                let _ = RELOAD.set(Box::new(move |f| {
                    handle.reload(f).map_err(|e| e.to_string())
                }));
            }
        }
    }
}

/// Applies a new `log.level` to the running daemon (`RUST_LOG`, when set,
/// still wins).
pub fn set_level(level: &str) -> Result<(), String> {
    if std::env::var_os("RUST_LOG").is_some() {
        return Err("RUST_LOG is set and takes precedence over log.level".into());
    }
    let filter = EnvFilter::try_new(level).map_err(|e| e.to_string())?;
    match RELOAD.get() {
        Some(reload) => reload(filter),
        None => Err("logging is not set up".into()),
    }
}

/// Makes a panic anywhere in the daemon end the process with a clear exit
/// (70, EX_SOFTWARE), not leave it half alive with a dead task (a signal
/// handler, the scheduler). The guard process then kills the jobs, and systemd
/// restarts the unit. The report goes to the log, which never panics itself.
pub fn exit_on_panic() {
    std::panic::set_hook(Box::new(|info| {
        let location = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        tracing::error!(%location, "internal error, exiting: {message}");
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            format!("cronlease: internal error at {location}: {message}; exiting\n").as_bytes(),
        );
        std::process::exit(i32::from(crate::app::EXIT_INTERNAL));
    }));
}

/// Logging for commands that run before (or without) a config.
pub fn init_default() {
    init(&LogConfig {
        format: LogFormat::Text,
        level: "warn".into(),
    });
}
