//! Configuration: TOML files in, validated [`Config`] out.
//!
//! Loading has two stages, as in ripgrep: [`raw`] mirrors the files exactly as
//! written (unknown keys refused by serde), then [`load`] turns them into
//! types that cannot hold a bad value ([`JobName`], [`Schedule`], [`StoreUrl`],
//! durations). Every problem becomes a [`ConfigError`] naming the file, line
//! and column, and loading collects all of them instead of stopping at the
//! first, so `cronlease check` can list everything wrong in one pass.

mod access;
mod error;
mod isolation;
mod job;
mod load;
mod notify;
mod present;
pub mod raw;
mod source;
mod store_url;
mod tags;

pub use access::*;
pub use error::*;
pub use isolation::*;
pub use job::*;
pub use load::*;
pub use notify::*;
pub use source::*;
pub use store_url::*;
pub use tags::*;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::schedule::Schedule;
use raw::{RawConfig, RawJob, RawJobFile, RawNode, RawNodeTable};

/// Where the configuration lives when neither `-c` nor `$CRONLEASE_CONFIG` says.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/cronlease/cronlease.toml";
/// Where the daemon writes its pid unless `pid_file` says otherwise.
pub const DEFAULT_PID_FILE: &str = "/run/cronlease/cronlease.pid";
/// Store used when the config names none (the embedded default).
pub const DEFAULT_STORE_URL: &str = "sqlite:///var/lib/cronlease/locks.db";

/// A job's name: `[A-Za-z0-9_.-]`, 1 to 128 characters; or the lock of
/// one node's shard of a broadcast job, `JOB~NODE` ([`JobName::shard`]),
/// which no configured job may be named.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct JobName(String);

/// What separates a broadcast job's name from a node's in its shards'
/// locks (docs/protocol.md, "Broadcast").
pub const SHARD_SEPARATOR: char = '~';

/// The longest name of a job with `placement = "every_node"`: its shards'
/// locks keep the whole name and room for the node's.
pub const MAX_BROADCAST_NAME: usize = 100;

impl JobName {
    pub fn parse(s: &str) -> Result<Self, String> {
        let plain = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        };
        let ok_chars = plain(s);
        let shard = s
            .split_once(SHARD_SEPARATOR)
            .is_some_and(|(job, node)| plain(job) && plain(node));
        if s.is_empty() || s.len() > 128 || !(ok_chars || shard) {
            return Err(format!(
                "invalid job name {s:?}: expected 1 to 128 characters from [A-Za-z0-9_.-]"
            ));
        }
        Ok(JobName(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The lock of `node`'s shard of this broadcast job: `JOB~NODE`, or,
    /// where that is longer than a lock name may be (128), `JOB~`, as much
    /// of the node's name as fits, `.` and 16 hex digits of a hash of the
    /// whole. A broadcast job's name is at most [`MAX_BROADCAST_NAME`]
    /// characters, so at least 10 of the node's fit.
    pub fn shard(&self, node: &str) -> JobName {
        let full = format!("{}{SHARD_SEPARATOR}{node}", self.0);
        if full.len() <= 128 {
            return JobName(full);
        }
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(full.as_bytes());
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        let room = 128usize.saturating_sub(self.0.len() + 1 + 1 + hex.len());
        let cut: String = node.chars().take(room).collect();
        JobName(format!("{}{SHARD_SEPARATOR}{cut}.{hex}", self.0))
    }

    /// For a shard's lock ([`JobName::shard`]): the broadcast job's name.
    /// `None` for a job's own.
    pub fn shard_of(&self) -> Option<&str> {
        self.0.split_once(SHARD_SEPARATOR).map(|(job, _)| job)
    }
}

impl fmt::Display for JobName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// This node's name, as jobs see it in `CRONLEASE_NODE`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeName(String);

impl NodeName {
    pub fn parse(s: &str) -> Result<Self, String> {
        let ok_chars = s
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if s.is_empty() || s.len() > 200 || !ok_chars {
            return Err(format!(
                "invalid node name {s:?}: expected 1 to 200 characters from [A-Za-z0-9_.-]"
            ));
        }
        Ok(NodeName(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How the store is reached and named.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub url: StoreUrl,
    /// SQL: tables are `{prefix}lock_info` and `{prefix}job_runs`.
    pub table_prefix: String,
    /// Redis and etcd: every key starts with it.
    pub key_prefix: String,
    /// A store call slower than this counts as failed.
    pub op_timeout: Duration,
    /// Runs kept in history per job.
    pub history_limit: u32,
    /// Connections per node: the SQL pool's size (SQLite: at most 2, one
    /// file has one writer, and one more for heartbeats). Redis uses one multiplexed connection.
    pub max_connections: u32,
    /// TLS trust and client identity (`rediss://`, `etcds://`, MySQL, PostgreSQL).
    pub tls: Option<TlsFiles>,
}

impl StoreConfig {
    /// Files a job must not read: the TLS client key.
    pub fn secret_files(&self) -> Vec<PathBuf> {
        self.tls
            .iter()
            .filter_map(|t| t.client.as_ref().map(|(_, key)| key.clone()))
            .collect()
    }
}

/// Files for TLS to the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsFiles {
    /// CA certificates (PEM) the server's certificate must chain to.
    pub ca: Option<PathBuf>,
    /// Client certificate and key (PEM), for servers that ask for one.
    pub client: Option<(PathBuf, PathBuf)>,
}

/// A [`StoreConfig`] as the daemon hands it to its job guard through their
/// socket pair, so the guard can record and release for a daemon that died
/// ([`crate::guard`]). It carries the password: it goes through that pipe
/// and nowhere else (no `Debug`, never logged).
#[derive(Clone, Serialize, Deserialize)]
pub struct StoreHandover {
    kind: StoreKind,
    url: String,
    redacted: String,
    secret: Option<String>,
    table_prefix: String,
    key_prefix: String,
    op_timeout: Duration,
    history_limit: u32,
    max_connections: u32,
    tls: Option<TlsFiles>,
}

/// Redlock's masters inside a [`StoreHandover`] ([`StoreUrl`] itself has
/// no serde, so nothing else can write its password out by accident).
mod masters_handover {
    use super::{StoreKind, StoreUrl};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct Master {
        kind: StoreKind,
        url: String,
        redacted: String,
        secret: Option<String>,
    }

    pub fn serialize<S: Serializer>(masters: &[StoreUrl], s: S) -> Result<S::Ok, S::Error> {
        let wire: Vec<Master> = masters
            .iter()
            .map(|m| Master {
                kind: m.kind.clone(),
                url: m.url.clone(),
                redacted: m.redacted.clone(),
                secret: m.secret.clone(),
            })
            .collect();
        wire.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<StoreUrl>, D::Error> {
        let wire = Vec::<Master>::deserialize(d)?;
        Ok(wire
            .into_iter()
            .map(|m| StoreUrl {
                kind: m.kind,
                url: m.url,
                redacted: m.redacted,
                secret: m.secret,
            })
            .collect())
    }
}

impl StoreHandover {
    /// The store config it was made from.
    pub fn into_config(self) -> StoreConfig {
        StoreConfig {
            url: StoreUrl {
                kind: self.kind,
                url: self.url,
                redacted: self.redacted,
                secret: self.secret,
            },
            table_prefix: self.table_prefix,
            key_prefix: self.key_prefix,
            op_timeout: self.op_timeout,
            history_limit: self.history_limit,
            // The guard makes a few calls, once.
            max_connections: self.max_connections.min(2),
            tls: self.tls,
        }
    }
}

impl StoreConfig {
    /// What a command, the dashboard or the drill allows one store call:
    /// `op_timeout`, at least 5 s (a person waits; a daemon's claim does not).
    pub fn call_budget(&self) -> Duration {
        self.op_timeout.max(Duration::from_secs(5))
    }

    /// This config for the job guard ([`StoreHandover`]).
    pub fn handover(&self) -> StoreHandover {
        StoreHandover {
            kind: self.url.kind.clone(),
            url: self.url.url.clone(),
            redacted: self.url.redacted.clone(),
            secret: self.url.secret.clone(),
            table_prefix: self.table_prefix.clone(),
            key_prefix: self.key_prefix.clone(),
            op_timeout: self.op_timeout,
            history_limit: self.history_limit,
            max_connections: self.max_connections,
            tls: self.tls.clone(),
        }
    }

    /// A store config with the defaults, for tests and tools.
    pub fn new(url: StoreUrl) -> Self {
        StoreConfig {
            url,
            table_prefix: String::new(),
            key_prefix: "cronlease:".into(),
            op_timeout: Duration::from_secs(2),
            history_limit: 100,
            max_connections: 8,
            tls: None,
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// What a node taking over does with an occurrence nobody ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Misfire {
    /// Run the most recent missed occurrence once, then carry on.
    #[default]
    RunOnce,
    /// Forget missed occurrences.
    Skip,
}

/// What a job's occurrence gets when its holder dies with its host
/// (`delivery`, docs/protocol.md "At least once").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    /// A claim whose holder died before recording its run is not run
    /// again: never twice, possibly not at all.
    #[default]
    AtMostOnce,
    /// Such a claim is run again at the next occurrence's takeover, before
    /// it, with `CRONLEASE_REDELIVERY=1`: never lost, possibly twice.
    AtLeastOnce,
}

/// Which node runs a job (`cluster.placement`, docs/protocol.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Biased ownership: the holder keeps a job until it dies or steps down.
    #[default]
    Sticky,
    /// Each job's preferred node is the rendezvous hash's pick among the
    /// live nodes of the registry; the others give it a head start and
    /// hand a job back after running it.
    Spread,
}

/// A job's own `placement` (the cluster's, `cluster.placement`, otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobPlacement {
    /// Every live node that may run the job runs each occurrence once.
    EveryNode,
}

/// What happens when an occurrence comes while the previous run still goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Claim the occurrence (keeping the lease) but do not start a second
    /// run: it waits for the previous run up to the next occurrence, and is
    /// skipped if that run is still going then.
    #[default]
    Skip,
    /// Claim the occurrence and stop the previous run (SIGTERM, SIGKILL
    /// after `kill_grace`; recorded `replaced`), then start this one.
    Replace,
}

/// How a job's process is started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Executed directly, no shell.
    Argv(Vec<String>),
    /// Run as `/bin/sh -c STRING`.
    Shell(String),
}

/// Who a job runs as, resolved at load time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
    /// Set when `user` was given: HOME, USER and LOGNAME for the job.
    pub user: Option<(String, PathBuf)>,
}

/// A validated job definition.
#[derive(Debug, Clone)]
pub struct Job {
    pub name: JobName,
    pub schedule: Schedule,
    pub command: Command,
    pub timeout: Option<Duration>,
    pub kill_grace: Duration,
    pub misfire: Misfire,
    /// `starting_deadline`: an occurrence not started within this after
    /// its instant is not run late (at most the gap to the next one, the
    /// default).
    pub starting_deadline: Option<Duration>,
    /// `delivery`: whether a dead host's unrecorded claim runs again.
    pub delivery: Delivery,
    pub overlap: Overlap,
    /// `run_on`: the tags a node must have to claim the job (empty: any
    /// node).
    pub run_on: Tags,
    /// `placement = "every_node"`: each occurrence runs once on every live
    /// node that may run the job, as shards (docs/protocol.md, "Broadcast").
    pub every_node: bool,
    pub env: BTreeMap<String, String>,
    pub working_dir: Option<PathBuf>,
    /// Run as this user and group (the daemon must be root). Boxed, as
    /// `retry` and `isolation` are: most jobs have none, and every node
    /// keeps every job (issue 35, item 6: memory per job).
    pub identity: Option<Box<Identity>>,
    /// `output_tail`: how many of the last bytes of the run's stdout and
    /// stderr history keeps (0: none).
    pub output_tail: usize,
    /// `on_failure`: run on the same node after a run ended `failed`,
    /// `timeout`, `lease_lost` or `not_started`, or an occurrence was
    /// recorded `missed`.
    pub on_failure: Option<Command>,
    /// `on_success`: run on the same node after a run ended `ok`.
    pub on_success: Option<Command>,
    /// `on_recovery`: run on the same node after the first `ok` run that
    /// follows a failed one.
    pub on_recovery: Option<Command>,
    /// `retry`: a failed run tried again, on any node.
    pub retry: Option<Box<Retry>>,
    /// `[job.limits]`, `[job.sandbox]`, `credentials`; `None` where the
    /// job sets none of them ([`Job::isolation`] reads it).
    pub isolation: Option<Box<Isolation>>,
    /// `file:line` of the definition, for log messages.
    pub defined_at: String,
}

impl Job {
    /// Same behaviour, wherever in the files it is written.
    pub fn same_definition(&self, other: &Job) -> bool {
        self.name == other.name
            && self.schedule == other.schedule
            && self.command == other.command
            && self.timeout == other.timeout
            && self.kill_grace == other.kill_grace
            && self.misfire == other.misfire
            && self.starting_deadline == other.starting_deadline
            && self.delivery == other.delivery
            && self.overlap == other.overlap
            && self.run_on == other.run_on
            && self.every_node == other.every_node
            && self.env == other.env
            && self.working_dir == other.working_dir
            && self.identity == other.identity
            && self.output_tail == other.output_tail
            && self.on_failure == other.on_failure
            && self.on_success == other.on_success
            && self.on_recovery == other.on_recovery
            && self.retry == other.retry
            && self.isolation == other.isolation
    }
}

/// A job's `retry` (docs/configuration.md, docs/protocol.md "Retries"): a
/// run of an occurrence that ends in one of `on` is tried again after a
/// backoff, up to `attempts` tries in all, each claimed in the store like
/// an occurrence, never past the next occurrence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retry {
    /// Tries in all, the first run included: 2 to
    /// [`crate::store::MAX_RETRY_ATTEMPTS`].
    pub attempts: u32,
    /// The wait before the second try, doubled before each next one.
    pub backoff: Duration,
    /// The longest wait.
    pub max_backoff: Duration,
    /// The outcomes tried again: of [`RETRY_OUTCOMES`].
    pub on: Vec<crate::store::Outcome>,
}

/// The outcomes `retry.on` may name.
pub const RETRY_OUTCOMES: [&str; 4] = ["failed", "timeout", "not_started", "lease_lost"];

impl Retry {
    /// Whether a run that ended `outcome` is tried again (attempts left).
    pub fn retries(&self, outcome: &crate::store::Outcome) -> bool {
        self.on.contains(outcome)
    }

    /// The wait after the `failures`th failed try (1 for the first run).
    pub fn wait(&self, failures: u32) -> Duration {
        crate::backoff::exponential(self.backoff, self.max_backoff, failures)
    }
}

/// A command a job runs on the node that ran it, after the run, for what
/// the run's outcome says: `on_failure`, `on_success`, `on_recovery`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Failure,
    Success,
    Recovery,
}

impl Hook {
    /// The job key, also `CRONLEASE_HOOK` in the hook's environment.
    pub fn key(self) -> &'static str {
        match self {
            Hook::Failure => "on_failure",
            Hook::Success => "on_success",
            Hook::Recovery => "on_recovery",
        }
    }

    /// Its part of a run's name on the host (`JOB-FENCE-on-failure`).
    pub fn label(self) -> &'static str {
        match self {
            Hook::Failure => "on-failure",
            Hook::Success => "on-success",
            Hook::Recovery => "on-recovery",
        }
    }
}

/// The isolation of a job that configures none.
static NO_ISOLATION: std::sync::LazyLock<Isolation> = std::sync::LazyLock::new(Isolation::default);

impl Job {
    /// Its limits, sandbox and credentials (the defaults where it sets
    /// none).
    pub fn isolation(&self) -> &Isolation {
        self.isolation.as_deref().unwrap_or(&NO_ISOLATION)
    }

    /// The job's command for `hook`, if it has one.
    pub fn hook(&self, hook: Hook) -> Option<&Command> {
        match hook {
            Hook::Failure => self.on_failure.as_ref(),
            Hook::Success => self.on_success.as_ref(),
            Hook::Recovery => self.on_recovery.as_ref(),
        }
    }
}

/// A job of `schedule` running `command` in a shell, every other setting at
/// its default, for unit tests.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn test_job(name: &str, schedule: &str, command: &str) -> Job {
    Job {
        name: JobName::parse(name).unwrap(),
        schedule: Schedule::parse(schedule, "UTC").unwrap(),
        command: Command::Shell(command.into()),
        timeout: None,
        kill_grace: Duration::from_secs(10),
        misfire: Misfire::default(),
        starting_deadline: None,
        delivery: Delivery::default(),
        overlap: Overlap::default(),
        run_on: Tags::default(),
        every_node: false,
        env: BTreeMap::new(),
        working_dir: None,
        identity: None,
        output_tail: 0,
        on_failure: None,
        on_success: None,
        on_recovery: None,
        retry: None,
        isolation: None,
        defined_at: "test.toml:1".into(),
    }
}

/// Logging settings.
#[derive(Debug, Clone)]
pub struct LogConfig {
    pub format: LogFormat,
    /// An `EnvFilter` directive such as `info` or `cronlease=debug`.
    pub level: String,
}

/// The whole validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub path: PathBuf,
    pub node: NodeName,
    /// `[node] tags`: what this node is, for the jobs' `run_on`.
    pub tags: Tags,
    pub store: StoreConfig,
    pub lease_margin: Duration,
    /// `cluster.max_clock_offset`: beyond it a node claims nothing, and the
    /// store refuses occurrences later than its now plus this.
    pub max_clock_offset: Duration,
    /// `cluster.head_start`: how long after an occurrence's instant (store
    /// clock) an idle holder keeps it to itself before a peer may claim it.
    pub head_start: Duration,
    /// `cluster.trigger_expiry`: a manual run's request no node took within
    /// this is withdrawn by the nodes and recorded as expired.
    pub trigger_expiry: Duration,
    /// `cluster.placement`.
    pub placement: Placement,
    pub shutdown_grace: Duration,
    /// Where `run` writes its pid, for `cronlease step-down`.
    pub pid_file: PathBuf,
    pub http_listen: Option<SocketAddr>,
    /// `http.public_url`: where people reach the dashboard, for links in
    /// webhooks.
    pub public_url: Option<url::Url>,
    /// `[http]` tokens, `require_token_for_read` and TLS.
    pub http_access: HttpAccess,
    /// `state_dir`: where the daemon keeps what must survive a restart
    /// (undelivered webhooks). `None`: `$STATE_DIRECTORY`, else the pid
    /// file's directory ([`Config::state_dir`]).
    pub state_dir: Option<PathBuf>,
    /// `[[notify]]`, in file order.
    pub webhooks: Vec<Webhook>,
    pub log: LogConfig,
    /// `jobs.runner`.
    pub runner: RunnerChoice,
    /// Sorted by name; names are unique.
    pub jobs: Vec<Job>,
    /// Files the jobs came from (the config file first).
    pub job_files: Vec<PathBuf>,
    /// Things that are allowed but unwise (a password readable by others).
    pub warnings: Vec<String>,
}

/// What a reloaded configuration changes, besides its jobs: settings the
/// running daemon applies at once, and settings that need a restart.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    pub live: Vec<&'static str>,
    pub restart: Vec<&'static str>,
}

impl Config {
    /// The job of that name, found in the sorted `jobs` (a binary search:
    /// `status` and the dashboard ask once per job).
    pub fn job(&self, name: &str) -> Option<&Job> {
        self.jobs
            .binary_search_by(|j| j.name.as_str().cmp(name))
            .ok()
            .and_then(|i| self.jobs.get(i))
    }

    /// Compares every setting of `self` (the running configuration) with
    /// `new`. Both are taken apart in full, so a setting added later does not
    /// compile until it is classified here as live or restart-only.
    pub fn changes(&self, new: &Config) -> Changes {
        let Config {
            path: _,
            node,
            tags,
            store,
            lease_margin,
            max_clock_offset,
            head_start,
            trigger_expiry,
            placement,
            shutdown_grace,
            pid_file,
            http_listen,
            public_url,
            http_access,
            state_dir,
            webhooks,
            log,
            runner,
            // Jobs are applied by the node; where they came from is not a setting.
            jobs: _,
            job_files: _,
            warnings: _,
        } = new;
        let StoreConfig {
            url,
            table_prefix,
            key_prefix,
            op_timeout,
            history_limit,
            max_connections,
            tls,
        } = store;
        let LogConfig { format, level } = log;
        let mut c = Changes::default();
        let mut note = |changed: bool, name: &'static str, live: bool| {
            if changed {
                if live {
                    c.live.push(name);
                } else {
                    c.restart.push(name);
                }
            }
        };
        note(*node != self.node, "node", false);
        note(*tags != self.tags, "node.tags", true);
        note(*runner != self.runner, "jobs.runner", false);
        note(*url != self.store.url, "store.url (or its password)", false);
        note(
            *table_prefix != self.store.table_prefix,
            "store.table_prefix",
            false,
        );
        note(
            *key_prefix != self.store.key_prefix,
            "store.key_prefix",
            false,
        );
        note(
            *op_timeout != self.store.op_timeout,
            "store.op_timeout",
            false,
        );
        note(*tls != self.store.tls, "store TLS files", false);
        note(
            *max_connections != self.store.max_connections,
            "store.max_connections",
            false,
        );
        note(
            *history_limit != self.store.history_limit,
            "store.history_limit",
            true,
        );
        note(*lease_margin != self.lease_margin, "lease.margin", false);
        note(
            *max_clock_offset != self.max_clock_offset,
            "cluster.max_clock_offset",
            true,
        );
        note(*head_start != self.head_start, "cluster.head_start", false);
        note(
            *trigger_expiry != self.trigger_expiry,
            "cluster.trigger_expiry",
            false,
        );
        note(*placement != self.placement, "cluster.placement", false);
        note(
            *shutdown_grace != self.shutdown_grace,
            "shutdown_grace",
            true,
        );
        note(*pid_file != self.pid_file, "pid_file", false);
        note(*http_listen != self.http_listen, "http.listen", false);
        note(*public_url != self.public_url, "http.public_url", false);
        note(
            http_access.tokens != self.http_access.tokens,
            "http.tokens_file",
            true,
        );
        note(
            http_access.read_requires_token != self.http_access.read_requires_token,
            "http.require_token_for_read",
            true,
        );
        note(
            http_access.tls != self.http_access.tls,
            "http.tls_cert_file/tls_key_file",
            true,
        );
        note(*state_dir != self.state_dir, "state_dir", false);
        note(*webhooks != self.webhooks, "notify", false);
        note(*format != self.log.format, "log.format", false);
        note(*level != self.log.level, "log.level", true);
        c
    }
}

impl Config {
    /// Where the daemon keeps what must survive a restart: `state_dir`,
    /// else systemd's `$STATE_DIRECTORY` (its first entry), else the pid
    /// file's directory.
    pub fn state_dir(&self) -> PathBuf {
        if let Some(dir) = &self.state_dir {
            return dir.clone();
        }
        if let Some(dirs) = std::env::var_os("STATE_DIRECTORY")
            && let Some(first) = dirs.to_string_lossy().split(':').find(|d| !d.is_empty())
        {
            return PathBuf::from(first);
        }
        self.pid_file
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf()
    }
}

/// Values from the environment that override the files.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `$CRONLEASE_STORE_URL`.
    pub store_url: Option<String>,
}

impl Overrides {
    pub fn from_env() -> Self {
        Overrides {
            store_url: std::env::var("CRONLEASE_STORE_URL")
                .ok()
                .filter(|s| !s.trim().is_empty()),
        }
    }
}

/// This host's name, used as the node name by default.
pub fn host_name() -> Option<String> {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_shard_lock_keeps_the_job_and_fits_a_lock_name() {
        let job = JobName::parse("backup").unwrap();
        let lock = job.shard("web-1");
        assert_eq!(lock.as_str(), "backup~web-1");
        assert_eq!(lock.shard_of(), Some("backup"));
        assert_eq!(JobName::parse("backup~web-1"), Ok(lock));
        assert_eq!(job.shard_of(), None);
        // A long node name: the whole job, some of the node, a hash.
        let long = JobName::parse(&"j".repeat(MAX_BROADCAST_NAME)).unwrap();
        let node = "n".repeat(200);
        let lock = long.shard(&node);
        assert!(lock.as_str().len() <= 128, "{lock}");
        assert_eq!(lock.shard_of(), Some(long.as_str()));
        assert_ne!(lock, long.shard(&"n".repeat(199)));
        assert!(JobName::parse(lock.as_str()).is_ok());
        for bad in ["a~", "~b", "a~b~c", "a b~c"] {
            assert!(JobName::parse(bad).is_err(), "{bad}");
        }
    }

    /// The list the error names holds only schemes the parser takes, and
    /// the error names each; that it holds every one (`rediss` was left
    /// out once) is what tests/it/config_errors.rs's whole message checks.
    #[test]
    fn every_listed_store_scheme_is_accepted() {
        for scheme in SCHEMES {
            let err = StoreUrl::parse(&format!("{scheme}://host:1/x"), Path::new("/"))
                .err()
                .unwrap_or_default();
            assert!(!err.contains("unsupported"), "{scheme}: {err}");
        }
        let err = StoreUrl::parse("ftp://host/x", Path::new("/")).unwrap_err();
        for scheme in SCHEMES {
            assert!(err.contains(&format!(" {scheme}://")), "{scheme}: {err}");
        }
    }

    #[test]
    fn line_col_counts_from_one() {
        let t = Source::new("t".into(), "a = 1\nbb = 2\né = 3".into());
        assert_eq!(t.line_col(0), (1, 1));
        assert_eq!(t.line_col(5), (1, 6));
        assert_eq!(t.line_col(6), (2, 1));
        assert_eq!(t.line_col(9), (2, 4));
        assert_eq!(t.line_col(13), (3, 1));
        // Columns count characters: "é" is two bytes.
        assert_eq!(t.line_col(16), (3, 3));
        assert_eq!(t.line_col(999), (3, 6));
    }

    #[test]
    fn urls_are_redacted() {
        let u = StoreUrl::parse("mysql://root:hunter2@db:3306/x", Path::new("/")).unwrap();
        assert_eq!(u.redacted(), "mysql://root:***@db:3306/x");
        assert_eq!(
            format!("{u} {u:?}"),
            "mysql://root:***@db:3306/x mysql://root:***@db:3306/x"
        );
        assert_eq!(u.scrub("auth failed for hunter2"), "auth failed for ***");
        assert_eq!(redact_url("redis://:p%40ss@h:1/"), "redis://:***@h:1/");
        assert_eq!(redact_url("weird//user:pw@host"), "***@host");
        // Typos that make the password part of a path.
        assert_eq!(redact_url("mysql:/root:pw@db/x"), "mysql:/***@db/x");
        assert_eq!(redact_url("mysql:root:pw@db/x"), "mysql:***@db/x");
        assert_eq!(redact_url("mysql://root:pw"), "mysql://root:***");
        assert_eq!(
            redact_url("redis://127.0.0.1:6379/"),
            "redis://127.0.0.1:6379/"
        );
        for typo in [
            "mysql:/root:pw@db/x",
            "mysql:root:pw@db",
            "postgres:/u:pw@h/d",
        ] {
            let e = StoreUrl::parse(typo, Path::new("/")).unwrap_err();
            assert!(!e.contains("pw"), "{e}");
        }
        let r = StoreUrl::parse("redis://:s3cret@localhost/", Path::new("/")).unwrap();
        assert_eq!(r.scrub("s3cret"), "***");
    }

    #[test]
    fn sentinel_urls_name_sentinels_master_and_wait() {
        let u = StoreUrl::parse(
            "redis+sentinel://app:s%40cret@10.0.0.1:26380,sentinel-b,[::1]:5000/my-master?wait=2&wait_timeout=1s",
            Path::new("/"),
        )
        .unwrap();
        let StoreKind::RedisSentinel(t) = u.kind() else {
            panic!("{:?}", u.kind());
        };
        assert_eq!(
            t.sentinels,
            vec![
                ("10.0.0.1".to_string(), 26380),
                ("sentinel-b".to_string(), 26379),
                ("::1".to_string(), 5000)
            ]
        );
        assert_eq!(t.master, "my-master");
        assert_eq!(t.username.as_deref(), Some("app"));
        assert_eq!((t.wait, t.wait_timeout), (2, Duration::from_secs(1)));
        assert_eq!(u.password(), Some("s@cret"));
        assert_eq!(
            u.redacted(),
            "redis+sentinel://app:***@10.0.0.1:26380,sentinel-b,[::1]:5000/my-master?wait=2&wait_timeout=1s"
        );
        assert!(!format!("{u:?}").contains("cret"));
        assert_eq!(u.scrub("auth s@cret failed"), "auth *** failed");

        let d = StoreUrl::parse("redis+sentinel://h/m", Path::new("/")).unwrap();
        let StoreKind::RedisSentinel(t) = d.kind() else {
            panic!()
        };
        assert_eq!((t.wait, t.wait_timeout), (1, Duration::from_millis(200)));
        assert_eq!(d.password(), None);

        for (bad, says) in [
            ("redis+sentinel://h:26379", "/MASTER_NAME"),
            ("redis+sentinel://h:26379/", "master's name"),
            ("redis+sentinel://h:0/m", "port"),
            ("redis+sentinel://h:x/m", "port"),
            ("redis+sentinel://h,,g/m", "sentinel address"),
            ("redis+sentinel://h/m?wait=65", "wait=65"),
            ("redis+sentinel://h/m?wait=-1", "wait=-1"),
            ("redis+sentinel://h/m?wait_timeout=0s", "wait_timeout"),
            ("redis+sentinel://h/m?waitt=1", "unknown parameter"),
            ("redis+sentinel://h/m?password=hunter2", "password_file"),
            ("redis+sentinel:h/m", "redis+sentinel://"),
        ] {
            let e = StoreUrl::parse(bad, Path::new("/")).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn a_password_file_sets_the_sentinel_masters_password() {
        let u = StoreUrl::parse("redis+sentinel://h/m", Path::new("/"))
            .unwrap()
            .with_password("from-file")
            .unwrap();
        assert_eq!(u.password(), Some("from-file"));
        assert_eq!(u.scrub("from-file"), "***");
    }

    #[test]
    fn redlock_masters_are_redacted_each_and_share_a_password_file() {
        let u = StoreUrl::redlock(&[
            "redis://:first-secret@a:6379/",
            "redis://b:6379/",
            "rediss://:third-secret@c:6380/",
        ])
        .unwrap();
        let StoreKind::Redlock(masters) = u.kind() else {
            panic!("{u:?}");
        };
        assert_eq!(masters.len(), 3);
        assert_eq!(
            u.to_string(),
            "redlock[redis://:***@a:6379/,redis://b:6379/,rediss://:***@c:6380/]"
        );
        assert_eq!(
            u.scrub("first-secret third-secret"),
            "*** ***",
            "every master's password is scrubbed"
        );
        let u = u.with_password("from-file").unwrap();
        let StoreKind::Redlock(masters) = u.kind() else {
            panic!("{u:?}");
        };
        assert!(masters.iter().all(|m| m.password() == Some("from-file")));
        assert!(!u.to_string().contains("from-file"));
        assert_eq!(u.scrub("from-file"), "***");
        // Five is the other size; four is not a Redlock.
        let five: Vec<String> = (1..=5).map(|i| format!("redis://h{i}:6379")).collect();
        let five: Vec<&str> = five.iter().map(String::as_str).collect();
        assert!(StoreUrl::redlock(&five).is_ok());
        assert!(StoreUrl::redlock(&five[..4]).is_err());
    }

    #[test]
    fn sqlite_paths_resolve_against_the_config_dir() {
        let u = StoreUrl::parse("sqlite://locks.db", Path::new("/etc/cronlease")).unwrap();
        assert_eq!(
            u.kind(),
            &StoreKind::Sqlite {
                path: "/etc/cronlease/locks.db".into()
            }
        );
        let u = StoreUrl::parse("sqlite:///var/lib/x.db", Path::new("/etc/cronlease")).unwrap();
        assert_eq!(
            u.kind(),
            &StoreKind::Sqlite {
                path: "/var/lib/x.db".into()
            }
        );
        assert!(StoreUrl::parse("sqlite://:memory:", Path::new("/")).is_err());
    }

    #[test]
    fn password_file_sets_the_password() {
        let u = StoreUrl::parse("mysql://app@db/x", Path::new("/"))
            .unwrap()
            .with_password("p@ss")
            .unwrap();
        assert!(u.expose().contains("p%40ss"));
        assert_eq!(u.redacted(), "mysql://app@db/x");
        assert_eq!(u.scrub("p@ss"), "***");
    }

    #[test]
    fn a_password_never_shows_in_a_url_error_and_an_at_sign_after_the_hosts_is_refused() {
        // A password holding ? or / is still the userinfo's.
        let u =
            StoreUrl::parse("zk://u:pa?ss/x@h:2181/p?session_timeout=1s", Path::new("/")).unwrap();
        let StoreKind::ZooKeeper(t) = u.kind() else {
            panic!("{u:?}")
        };
        assert_eq!(
            (t.servers[0].0.as_str(), t.session_timeout),
            ("h", Duration::from_secs(1))
        );
        assert_eq!(u.password(), Some("pa?ss/x"));
        for bad in ["etcd://h/?x=a@b", "zk://h/p?x=a@b"] {
            let e = StoreUrl::parse(bad, Path::new("/")).unwrap_err();
            assert!(e.contains("an @ after the hosts"), "{bad}: {e}");
        }
        for bad in ["zk://u:secret@h?bogus=1", "zk://u:sec?ret@h/p?bogus=1"] {
            let e = StoreUrl::parse(bad, Path::new("/")).unwrap_err();
            assert!(
                !e.contains("secret") && !e.contains("sec") && e.contains("bogus"),
                "{bad}: {e}"
            );
        }
        let e = StoreUrl::parse("zk://h/p?session_timeout=1ms", Path::new("/")).unwrap_err();
        assert!(e.contains("session_timeout=1ms"), "{e}");
        for (bad, says) in [
            ("etcd://[::1]x", "after the ]"),
            ("etcd://::1", "in brackets"),
            ("zk://[::1]2181/p", "after the ]"),
        ] {
            let e = StoreUrl::parse(bad, Path::new("/")).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn etcd_urls_name_members_user_and_tls() {
        let u = StoreUrl::parse(
            "etcd://app:s%40cret@10.0.0.1:2380,etcd-b,[::1]:5000",
            Path::new("/"),
        )
        .unwrap();
        let StoreKind::Etcd(t) = u.kind() else {
            panic!("{:?}", u.kind());
        };
        assert_eq!(
            t.servers,
            vec![
                ("10.0.0.1".to_string(), 2380),
                ("etcd-b".to_string(), 2379),
                ("::1".to_string(), 5000)
            ]
        );
        assert!(!t.tls);
        assert_eq!(t.username.as_deref(), Some("app"));
        assert_eq!(u.password(), Some("s@cret"));
        assert_eq!(
            format!("{u} {u:?}"),
            "etcd://app:***@10.0.0.1:2380,etcd-b,[::1]:5000 etcd://app:***@10.0.0.1:2380,etcd-b,[::1]:5000"
        );
        assert_eq!(u.scrub("auth s@cret failed"), "auth *** failed");

        let s = StoreUrl::parse("etcds://etcd-a:2379,etcd-b/", Path::new("/")).unwrap();
        let StoreKind::Etcd(t) = s.kind() else {
            panic!("{:?}", s.kind());
        };
        assert!(t.tls);
        assert_eq!(
            t.servers,
            vec![
                ("etcd-a".to_string(), 2379),
                ("etcd-b".to_string(), ETCD_PORT)
            ]
        );
        assert_eq!((t.username.as_deref(), s.password()), (None, None));
        assert_eq!(s.redacted(), "etcds://etcd-a:2379,etcd-b/");
        let upper = StoreUrl::parse("ETCD://h", Path::new("/")).unwrap();
        assert!(matches!(upper.kind(), StoreKind::Etcd(t) if !t.tls));

        // A password holding a / or a ? is taken whole and hidden whole.
        let odd = StoreUrl::parse("etcd://app:pa/ss?wd@h", Path::new("/")).unwrap();
        assert_eq!(odd.password(), Some("pa/ss?wd"));
        assert_eq!(odd.redacted(), "etcd://app:***@h");

        for (bad, says) in [
            ("etcd://h:2379/cronlease", "no path"),
            ("etcds://h#x", "no path"),
            ("etcd://h?timeout=1s", "no query"),
            ("etcd://h/?password=hunter2", "no query"),
            ("etcd://h:0", "port"),
            ("etcd://h:x", "port"),
            ("etcd://[::1:2379", "closing ]"),
            ("etcd://h,,g", "server address"),
            ("etcd://", "server address"),
            ("etcd://:hunter2@h", "needs a user"),
            ("etcd:h", "etcd://host:2379"),
            ("etcds:/h", "etcds://host:2379"),
        ] {
            let e = StoreUrl::parse(bad, Path::new("/")).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        let e = StoreUrl::parse("consul://h", Path::new("/")).unwrap_err();
        assert!(e.contains("etcd:// or etcds://"), "{e}");
    }

    #[test]
    fn a_password_file_needs_an_etcd_user() {
        let u = StoreUrl::parse("etcd://app@h", Path::new("/"))
            .unwrap()
            .with_password("from-file")
            .unwrap();
        assert_eq!(u.password(), Some("from-file"));
        assert_eq!(u.redacted(), "etcd://app@h");
        assert_eq!(u.scrub("from-file"), "***");
        let e = StoreUrl::parse("etcd://h", Path::new("/"))
            .unwrap()
            .with_password("from-file")
            .unwrap_err();
        assert!(e.contains("names no user"), "{e}");
    }
}
