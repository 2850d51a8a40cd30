//! Logging: `tracing` to stderr, as text (console, journald) or JSON (log
//! shippers). `RUST_LOG`, when set, overrides `log.level`. Text is coloured
//! only on a terminal.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, LogFormat};

/// Installs the global subscriber; a second call is a no-op.
pub fn init(log: &LogConfig) {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new(&log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal; never into journald or files.
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .with_target(false);
    let _ = match log.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
    };
}

/// Logging for commands that run before (or without) a config.
pub fn init_default() {
    init(&LogConfig {
        format: LogFormat::Text,
        level: "warn".into(),
    });
}
