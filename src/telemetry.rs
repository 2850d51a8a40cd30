//! Logging: `tracing`, to one of three sinks (docs/operations.md, "Logs"):
//!
//! - **journald, natively**, when `log.format = "text"` (the default) and
//!   stderr is the journal (`JOURNAL_STREAM` names it, as systemd sets it
//!   for a service): a priority per level and the events' fields as journal
//!   fields (`JOB`, `FENCE`, `OUTCOME`, ... and `NODE` on every entry);
//! - **text** on stderr, coloured only on a terminal, without our own
//!   timestamp when stderr is the journal but its socket cannot be reached;
//! - **JSON**, one object per line (`log.format = "json"`), fields typed:
//!   numbers as numbers, never a Debug string.
//!
//! The guard process logs to the same sink as its daemon (told through the
//! environment, [`guard_env`]), and a panic is one more event of the sink:
//! in JSON a JSON line too. `RUST_LOG`, when set, overrides `log.level`.

use std::io::IsTerminal;
use std::sync::OnceLock;

use chrono::{DateTime, SecondsFormat, Utc};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::{LogConfig, LogFormat};

/// Changes the level filter of the installed subscriber (SIGHUP).
type LevelReload = Box<dyn Fn(EnvFilter) -> Result<(), String> + Send + Sync>;

static RELOAD: OnceLock<LevelReload> = OnceLock::new();

/// Where this process's log goes, once [`init`] chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    Text,
    Json,
    Journald,
}

/// What [`init`] set up: the sink, and what the guard is told.
struct Installed {
    sink: Sink,
    format: LogFormat,
    level: String,
    node: Option<String>,
}

static INSTALLED: OnceLock<Installed> = OnceLock::new();

/// The guard's environment: the daemon's log format, level and node name.
const ENV_FORMAT: &str = "CRONLEASE_LOG_FORMAT";
const ENV_LEVEL: &str = "CRONLEASE_LOG_LEVEL";
const ENV_NODE: &str = "CRONLEASE_LOG_NODE";

/// An instant as RFC 3339 in UTC (`2026-11-27T11:12:20Z`, with a fraction
/// only when it has one), for log fields a machine reads.
pub struct Rfc3339(pub DateTime<Utc>);

impl std::fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.to_rfc3339_opts(SecondsFormat::AutoSi, true))
    }
}

/// Whether stderr is the journal: `JOURNAL_STREAM` (`DEVICE:INODE`, set by
/// systemd for a unit whose output goes to the journal) names the file
/// stderr is. A child that inherited the variable but whose stderr was
/// redirected elsewhere keeps logging there.
pub fn stderr_is_journal() -> bool {
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = stream.to_str().and_then(|s| s.split_once(':')) else {
        return false;
    };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else {
        return false;
    };
    rustix::fs::fstat(std::io::stderr()).is_ok_and(|st| st.st_dev == dev && st.st_ino == ino)
}

/// Installs the global subscriber for `log` (`node`: this node's name, a
/// field of every journal entry); a second call is a no-op.
pub fn init(log: &LogConfig, node: Option<&str>) {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new(&log.level));
    let journal = stderr_is_journal();
    let sink = match log.format {
        LogFormat::Json => install_json(filter),
        LogFormat::Text if journal => match journald_layer(node) {
            Ok(layer) => install_journald(filter, layer),
            Err(e) => {
                let sink = install_text(filter, true);
                tracing::warn!("journald's socket cannot be reached ({e}): logging text to stderr");
                sink
            }
        },
        LogFormat::Text => install_text(filter, false),
    };
    let _ = INSTALLED.set(Installed {
        sink,
        format: log.format,
        level: log.level.clone(),
        node: node.map(str::to_string),
    });
}

/// The sink [`init`] installed (text before it ran).
pub fn sink() -> Sink {
    INSTALLED.get().map_or(Sink::Text, |i| i.sink)
}

fn journald_layer(node: Option<&str>) -> std::io::Result<tracing_journald::Layer> {
    use tracing_journald::{Priority, PriorityMappings};
    let layer = tracing_journald::layer()?
        // Our fields as they are (JOB, not F_JOB): none is a journal field.
        .with_field_prefix(None)
        .with_syslog_identifier("cronlease".into())
        .with_priority_mappings(PriorityMappings {
            error: Priority::Error,
            warn: Priority::Warning,
            info: Priority::Informational,
            debug: Priority::Debug,
            trace: Priority::Debug,
        });
    Ok(match node {
        Some(node) => layer.with_custom_fields([("NODE", node)]),
        None => layer,
    })
}

fn install_journald(filter: EnvFilter, layer: tracing_journald::Layer) -> Sink {
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    if tracing_subscriber::registry()
        .with(filter)
        .with(layer)
        .try_init()
        .is_ok()
    {
        let _ = RELOAD.set(reloader(move |f| {
            handle.reload(f).map_err(|e| e.to_string())
        }));
    }
    Sink::Journald
}

fn install_text(filter: EnvFilter, journal: bool) -> Sink {
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
    let installed = if journal {
        // The journal stamps each line itself.
        let builder = builder.without_time().with_filter_reloading();
        let handle = builder.reload_handle();
        builder
            .try_init()
            .is_ok()
            .then(|| reloader(move |f| handle.reload(f).map_err(|e| e.to_string())))
    } else {
        let builder = builder.with_filter_reloading();
        let handle = builder.reload_handle();
        builder
            .try_init()
            .is_ok()
            .then(|| reloader(move |f| handle.reload(f).map_err(|e| e.to_string())))
    };
    if let Some(reload) = installed {
        let _ = RELOAD.set(reload);
    }
    Sink::Text
}

fn install_json(filter: EnvFilter) -> Sink {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .log_internal_errors(false)
        .with_ansi(false)
        .with_target(false)
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_filter_reloading();
    let handle = builder.reload_handle();
    if builder.try_init().is_ok() {
        let _ = RELOAD.set(reloader(move |f| {
            handle.reload(f).map_err(|e| e.to_string())
        }));
    }
    Sink::Json
}

fn reloader(f: impl Fn(EnvFilter) -> Result<(), String> + Send + Sync + 'static) -> LevelReload {
    Box::new(f)
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

/// What the daemon's guard process is started with, so that it logs as
/// the daemon does.
pub fn guard_env() -> Vec<(&'static str, String)> {
    let Some(i) = INSTALLED.get() else {
        return Vec::new();
    };
    let format = match i.format {
        LogFormat::Text => "text",
        LogFormat::Json => "json",
    };
    let mut env = vec![
        (ENV_FORMAT, format.to_string()),
        (ENV_LEVEL, i.level.clone()),
    ];
    if let Some(node) = &i.node {
        env.push((ENV_NODE, node.clone()));
    }
    env
}

/// The guard's logging: the sink its daemon told it ([`guard_env`]), and
/// panics reported through it.
pub fn init_guard() {
    let format = match std::env::var(ENV_FORMAT).as_deref() {
        Ok("json") => LogFormat::Json,
        _ => LogFormat::Text,
    };
    let level = std::env::var(ENV_LEVEL).unwrap_or_else(|_| "info".into());
    let node = std::env::var(ENV_NODE).ok();
    init(&LogConfig { format, level }, node.as_deref());
    std::panic::set_hook(Box::new(|info| {
        let (location, message) = panic_report(info);
        tracing::error!(process = "guard", %location, "internal error: {message}");
        if sink() == Sink::Text && RELOAD.get().is_none() {
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                format!("cronlease __guard: internal error at {location}: {message}\n").as_bytes(),
            );
        }
    }));
}

fn panic_report(info: &std::panic::PanicHookInfo<'_>) -> (String, String) {
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
    (location, message)
}

/// Makes a panic anywhere in the daemon end the process with a clear exit
/// (70, EX_SOFTWARE), not leave it half alive with a dead task (a signal
/// handler, the scheduler). The guard process then kills the jobs, and systemd
/// restarts the unit. The report goes to the log (as JSON in JSON logs, to
/// the journal under journald), which never panics itself; in text also as
/// a plain line, which says it even if the subscriber could not.
pub fn exit_on_panic() {
    std::panic::set_hook(Box::new(|info| {
        let (location, message) = panic_report(info);
        tracing::error!(%location, "internal error, exiting: {message}");
        if sink() == Sink::Text {
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                format!("cronlease: internal error at {location}: {message}; exiting\n").as_bytes(),
            );
        }
        std::process::exit(i32::from(crate::app::EXIT_INTERNAL));
    }));
}

/// A fatal error of the daemon's start, the last thing it says: a plain
/// `cronlease: ...` line on stderr in text, an ERROR event of the sink
/// otherwise (one more JSON line, a journal entry).
pub fn fatal(message: &str) {
    match sink() {
        Sink::Text => eprintln!("cronlease: {message}"),
        Sink::Json | Sink::Journald => tracing::error!("{message}"),
    }
}

/// Logging for commands that run before (or without) a config.
pub fn init_default() {
    init(
        &LogConfig {
            format: LogFormat::Text,
            level: "warn".into(),
        },
        None,
    );
}
