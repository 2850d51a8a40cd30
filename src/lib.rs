//! cronlease: high-availability cron. Every host runs the same jobs; for each
//! scheduled occurrence the hosts race to claim it in a shared lock store, and
//! exactly one runs it.
//!
//! The map, in the order a job travels through it:
//!
//! - [`config`]: TOML files → validated [`config::Config`] (errors with
//!   file:line:col).
//! - [`schedule`]: cron expression + IANA zone → occurrences (croner; Vixie
//!   cron's DST rule).
//! - [`store`]: the lock store trait and its backends (SQLite, MySQL/MariaDB,
//!   PostgreSQL, Redis, Redis with Sentinel, Redlock, ZooKeeper, etcd), chosen by
//!   URL scheme; the claim rule of docs/protocol.md.
//! - [`node`]: the daemon: a loop per job, a task per occurrence, the claim
//!   and takeover protocol, the lease watchdog, step-down, reload, shutdown.
//! - [`exec`] and [`guard`]: running a job's process group, and killing it if
//!   the daemon dies; [`cgroup`]: a cgroup per run where systemd delegated
//!   the daemon's; [`units`]: runs as transient systemd units.
//! - [`app`]: the commands (`run`, `check`, `status`, `nodes`, `history`,
//!   `trigger`, `cancel`, `pause`, `resume`, `migrate`, `step-down`, `logs`, `drill`,
//!   `import-crontab`) behind the thin `main`; [`cli`]: their clap definitions.
//! - [`drill`]: the failover drill as a command, with its verdict;
//!   [`cancel`]: a request to stop a run, left in the store for its node.
//! - [`crontab`]: `import-crontab`, a crontab's lines as `[[job]]` TOML.
//! - [`pidfile`]: the locked pid file and finding the daemon it names.
//! - [`telemetry`] sets up logging; [`metrics`] counts; [`http`] serves the
//!   dashboard, `/api/*`, `/metrics` and `/healthz`; [`status`] gathers what
//!   `status --json` and `/api/status` show; [`systemd`] speaks sd_notify.
//! - [`webhook`] sends the runs' events; [`spool`] keeps on disk what must
//!   survive a restart (undelivered webhooks, what a dead daemon's runs are
//!   owed: [`guard::owed`]).
//! - `fuzzing` (feature `fuzzing`, hidden): the store decoders, reachable by
//!   the fuzz targets in `fuzz/` (docs/fuzzing.md).

#![forbid(unsafe_code)]

pub mod actions;
pub mod app;
pub mod backoff;
pub mod cancel;
pub mod cgroup;
pub mod cli;
pub mod config;
pub mod crontab;
pub mod drill;
pub mod exec;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod guard;
pub mod hints;
pub mod http;
pub mod launch;
pub mod metrics;
pub mod node;
pub mod output;
pub mod pidfile;
pub mod schedule;
pub mod spool;
pub mod status;
pub mod store;
pub mod systemd;
pub mod telemetry;
pub mod units;
pub mod wallclock;
pub mod webhook;
