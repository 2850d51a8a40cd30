//! Command-line definitions (clap). docs/cli.md describes the interface.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::{DEFAULT_CONFIG_PATH, JobName};

/// High-availability cron: every host runs the same jobs, a shared lock store
/// makes each occurrence run exactly once.
///
/// Every job name on the command line is parsed here, by one parser: a
/// malformed one is a usage error (exit 2) for every command.
#[derive(Debug, Parser)]
#[command(name = "cronlease", version, long_version = long_version(), about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Commands,
}

/// `--version`: the version, then the stores built in (`-V`: the version).
fn long_version() -> &'static str {
    static LONG: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "{}\nstores: {}",
            env!("CARGO_PKG_VERSION"),
            crate::store::built_in().join(", ")
        )
    });
    LONG.as_str()
}

/// Where the configuration is.
#[derive(Debug, Args, Clone)]
pub struct ConfigArg {
    /// Configuration file [default: $CRONLEASE_CONFIG, else /etc/cronlease/cronlease.toml]
    #[arg(short, long, env = "CRONLEASE_CONFIG", default_value = DEFAULT_CONFIG_PATH, hide_default_value = true, hide_env = true)]
    pub config: PathBuf,
}

/// What `reload` validates and whom it signals.
#[derive(Debug, Args, Clone)]
pub struct ReloadArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Signal this process instead of the pid file's, unchecked: the unit
    /// passes $MAINPID (its sandbox hides the daemon's /proc entry from
    /// ExecReload, so the pid file's process cannot be verified there)
    #[arg(long, value_name = "PID", value_parser = clap::value_parser!(i32).range(2..))]
    pub pid: Option<i32>,
}

/// The jobs `pause` and `resume` act on.
#[derive(Debug, Args, Clone)]
pub struct PauseArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// The jobs, by name
    #[arg(
        required_unless_present = "all",
        conflicts_with = "all",
        value_name = "JOB",
        value_parser = JobName::parse
    )]
    pub jobs: Vec<JobName>,
    /// Every job of the configuration
    #[arg(long)]
    pub all: bool,
    /// Why, kept in the store's audit with who did it (one line, at most
    /// 500 bytes)
    #[arg(long, value_name = "TEXT")]
    pub reason: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum Commands {
    /// Run the daemon in the foreground (systemd runs this)
    Run(ConfigArg),
    /// Validate config and jobs and print their next fire times; needs no store
    Check {
        #[command(flatten)]
        config: ConfigArg,
        /// How many fire times to print per job
        #[arg(long, default_value_t = 5, value_name = "N")]
        next: usize,
        /// Treat every warning as an error (exit 78): a job's program or
        /// working directory not found, a password file others may read
        #[arg(long)]
        strict: bool,
    },
    /// Show each job's lock: holder, lease left, fence, last occurrence and result
    Status {
        #[command(flatten)]
        config: ConfigArg,
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
    },
    /// List the live nodes of the store's node registry, with version and clock offset
    Nodes {
        #[command(flatten)]
        config: ConfigArg,
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
    },
    /// List recorded runs, newest first, then who paused, resumed,
    /// triggered or cancelled the jobs, and why (the audit)
    History {
        #[command(flatten)]
        config: ConfigArg,
        /// Only this job's runs
        #[arg(value_parser = JobName::parse)]
        job: Option<JobName>,
        /// At most this many runs (and audit entries)
        #[arg(long, default_value_t = 20, value_name = "N")]
        limit: u32,
        /// Print JSON instead of a table (the runs; with --actions, the audit)
        #[arg(long)]
        json: bool,
        /// Only the audit: who paused, resumed, triggered or cancelled, and why
        #[arg(long)]
        actions: bool,
    },
    /// Print the output tail a run left in history (the job's newest run by default)
    Logs {
        #[command(flatten)]
        config: ConfigArg,
        /// The job
        #[arg(value_parser = JobName::parse)]
        job: JobName,
        /// That run of the job (its fence) instead of the newest
        #[arg(long, value_name = "N")]
        fence: Option<u64>,
    },
    /// Run a job once now, on exactly one node of the cluster
    Trigger {
        #[command(flatten)]
        config: ConfigArg,
        /// The job
        #[arg(value_parser = JobName::parse)]
        job: JobName,
        /// Wait for the run's outcome: exit 0 when it ended ok, 1 otherwise
        #[arg(long)]
        wait: bool,
        /// Withdraw the job's pending request instead (one no node has taken)
        #[arg(long, conflicts_with = "wait")]
        cancel: bool,
        /// Why, kept in the store's audit with who asked (one line, at
        /// most 500 bytes)
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
    },
    /// Stop the job's running run, on whichever node runs it (kill_grace as
    /// for a timeout), recorded `cancelled` with who and why; without one,
    /// withdraw its pending manual run. Exit 0 once every run asked for was
    /// cancelled
    Cancel {
        #[command(flatten)]
        config: ConfigArg,
        /// The job
        #[arg(value_parser = JobName::parse)]
        job: JobName,
        /// Why, kept in the run's record and the store's audit (one line,
        /// at most 500 bytes)
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
    },
    /// Pause jobs cluster-wide: no node claims an occurrence until resume
    Pause(PauseArgs),
    /// Resume paused jobs
    Resume(PauseArgs),
    /// Print [[job]] TOML for each line of a crontab (no configuration, no store)
    ImportCrontab {
        /// The crontab to read; `-` or none: standard input
        #[arg(value_name = "FILE|-")]
        file: Option<PathBuf>,
        /// Read it as a system crontab (a user field after the five time
        /// fields); the default for /etc/crontab and /etc/cron.d/*
        #[arg(long, conflicts_with = "user")]
        system: bool,
        /// Read it as a user crontab (no user field); the default otherwise
        #[arg(long)]
        user: bool,
        /// The time zone the crontab's times mean (cron uses the host's);
        /// without it and without CRON_TZ, UTC
        #[arg(long, value_name = "ZONE")]
        timezone: Option<String>,
    },
    /// Make an API token for the http listener: print its secret (once) and
    /// the [[token]] table to add to [http] tokens_file (no configuration,
    /// no store)
    Token {
        /// Its name: who uses it (shown in the audit and the logs)
        name: String,
        /// What it may do: read, or operate (also write)
        #[arg(long, value_enum, default_value = "read")]
        scope: TokenScope,
    },
    /// Create or upgrade the store's tables (run also applies them)
    Migrate(ConfigArg),
    /// Ask the local daemon to release its leases and pause claiming for one margin
    StepDown(ConfigArg),
    /// Validate config and jobs as `check` does, then ask the local daemon to
    /// reload them (SIGHUP); an invalid configuration is refused (exit 78)
    Reload(ReloadArgs),
    /// Failover drill: disturb this host's daemon and report who took over its jobs
    Drill {
        #[command(flatten)]
        config: ConfigArg,
        /// SIGKILL the daemon (the default): a crash
        #[arg(long, group = "how")]
        kill: bool,
        /// SIGTERM the daemon: a clean stop
        #[arg(long, group = "how")]
        term: bool,
        /// Ask the daemon to step down (SIGUSR1); it keeps running
        #[arg(long, group = "how")]
        step_down: bool,
        /// Only these of the jobs the daemon holds
        #[arg(long, num_args = 1.., value_name = "J", value_parser = JobName::parse)]
        jobs: Vec<JobName>,
        /// Drill even when no other live node is in the node registry to
        /// take over (the jobs then miss occurrences until this daemon is back)
        #[arg(long)]
        force: bool,
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
    },
    /// Internal: the process that kills jobs if their daemon dies
    #[command(name = "__guard", hide = true)]
    Guard,
    /// Internal (the unit's `ExecStopPost=`): wait until the daemon's guard
    /// has finished and exited
    #[command(name = "__wait-guard", hide = true)]
    WaitGuard,
    /// Internal: a run's unit's main process: runs the job's command and
    /// copies its output to the journal and to the daemon
    #[command(name = "__unit-run", hide = true)]
    UnitRun {
        /// The journal's SYSLOG_IDENTIFIER for its lines
        #[arg(long)]
        identifier: String,
        /// argv[0] of the command (its program as the job wrote it)
        #[arg(long)]
        arg0: Option<String>,
        /// The program (a path) and its arguments
        #[arg(last = true, required = true)]
        command: Vec<std::ffi::OsString>,
    },
    /// Internal: enter a run's cgroup, set a job's priority and open files
    /// limit, become its user (with its supplementary groups), then execute
    /// its command
    #[command(name = "__run-as", hide = true)]
    RunAs {
        /// The run's cgroup (a directory), entered first
        #[arg(long)]
        cgroup: Option<std::path::PathBuf>,
        /// UID:GID:NAME (NAME, for the supplementary groups, may be empty)
        #[arg(long)]
        user: Option<String>,
        #[arg(long, allow_hyphen_values = true)]
        nice: Option<i32>,
        #[arg(long)]
        open_files: Option<u64>,
        /// The program and its arguments
        #[arg(last = true, required = true)]
        command: Vec<std::ffi::OsString>,
    },
}

/// `cronlease token --scope`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TokenScope {
    Read,
    Operate,
}
