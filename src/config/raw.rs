//! The configuration exactly as written: a serde mirror of the TOML files.
//!
//! Every table denies unknown keys and every value that can be wrong keeps its
//! span, so validation in [`super`] can point at the file, line and column of
//! the mistake. Nothing here is trusted; [`super::Config`] is built from it.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

/// The main configuration file (`cronlease.toml`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// A name (`node = "web-1"`) or a `[node]` table.
    pub node: Option<Spanned<RawNode>>,
    pub shutdown_grace: Option<Spanned<String>>,
    pub pid_file: Option<Spanned<String>>,
    pub state_dir: Option<Spanned<String>>,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub lease: RawLease,
    #[serde(default)]
    pub cluster: RawCluster,
    #[serde(default)]
    pub jobs: RawJobs,
    pub http: Option<RawHttp>,
    /// The old name of `[http]`, kept as an alias.
    pub metrics: Option<RawHttp>,
    #[serde(default)]
    pub log: RawLog,
    #[serde(default)]
    pub notify: Vec<RawNotify>,
    #[serde(default)]
    pub job: Vec<RawJob>,
}

/// `node`: the node's name alone (`node = "web-1"`, as CONTRACT has it), or
/// a `[node]` table with its `name` and `tags`.
#[derive(Debug)]
pub enum RawNode {
    Name(String),
    Table(RawNodeTable),
}

/// The `[node]` table.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawNodeTable {
    pub name: Option<Spanned<String>>,
    pub tags: Option<Spanned<Vec<Spanned<String>>>>,
}

impl<'de> Deserialize<'de> for RawNode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Either;
        impl<'de> serde::de::Visitor<'de> for Either {
            type Value = RawNode;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a node name, or a [node] table with `name` and `tags`")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawNode, E> {
                Ok(RawNode::Name(v.to_string()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<RawNode, A::Error> {
                RawNodeTable::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(RawNode::Table)
            }
        }
        d.deserialize_any(Either)
    }
}

/// One `[[notify]]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawNotify {
    pub name: Option<Spanned<String>>,
    pub url: Spanned<String>,
    pub events: Option<Spanned<Vec<Spanned<String>>>>,
    pub jobs: Option<Spanned<Vec<Spanned<String>>>>,
    pub secret_file: Option<Spanned<String>>,
    pub format: Option<super::WebhookFormat>,
    pub timeout: Option<Spanned<String>>,
    pub output_tail: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    pub url: Option<Spanned<String>>,
    /// Redlock: the independent Redis masters, instead of `url`.
    pub urls: Option<Spanned<Vec<Spanned<String>>>>,
    pub password_file: Option<Spanned<String>>,
    pub table_prefix: Option<Spanned<String>>,
    pub key_prefix: Option<Spanned<String>>,
    pub op_timeout: Option<Spanned<String>>,
    pub history_limit: Option<Spanned<i64>>,
    pub max_connections: Option<Spanned<i64>>,
    pub tls_ca_file: Option<Spanned<String>>,
    pub tls_cert_file: Option<Spanned<String>>,
    pub tls_key_file: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLease {
    pub margin: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCluster {
    pub max_clock_offset: Option<Spanned<String>>,
    pub head_start: Option<Spanned<String>>,
    pub trigger_expiry: Option<Spanned<String>>,
    pub placement: Option<super::Placement>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJobs {
    pub dir: Option<Spanned<String>>,
    pub runner: Option<super::RunnerChoice>,
    pub default_jitter: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHttp {
    pub listen: Spanned<String>,
    pub public_url: Option<Spanned<String>>,
    pub tokens_file: Option<Spanned<String>>,
    pub require_token_for_read: Option<Spanned<bool>>,
    pub tls_cert_file: Option<Spanned<String>>,
    pub tls_key_file: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    pub format: Option<super::LogFormat>,
    pub level: Option<Spanned<String>>,
}

/// A file of `jobs.dir`: nothing but `[[job]]` tables.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJobFile {
    #[serde(default)]
    pub job: Vec<RawJob>,
}

/// One `[[job]]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJob {
    pub name: Spanned<String>,
    pub schedule: Spanned<String>,
    pub timezone: Option<Spanned<String>>,
    pub jitter: Option<Spanned<String>>,
    /// A string (`/bin/sh -c`) or an array (argv); checked in validation.
    pub command: Spanned<toml::Value>,
    pub timeout: Option<Spanned<String>>,
    pub kill_grace: Option<Spanned<String>>,
    pub misfire: Option<super::Misfire>,
    pub starting_deadline: Option<Spanned<String>>,
    pub delivery: Option<super::Delivery>,
    pub overlap: Option<super::Overlap>,
    pub run_on: Option<Spanned<Vec<Spanned<String>>>>,
    pub placement: Option<Spanned<super::JobPlacement>>,
    pub env: Option<BTreeMap<Spanned<String>, Spanned<String>>>,
    pub working_dir: Option<Spanned<String>>,
    pub user: Option<Spanned<String>>,
    pub group: Option<Spanned<String>>,
    pub output_tail: Option<Spanned<String>>,
    /// Like `command`; checked in validation.
    pub on_failure: Option<Spanned<toml::Value>>,
    /// Like `command`; checked in validation.
    pub on_success: Option<Spanned<toml::Value>>,
    /// Like `command`; checked in validation.
    pub on_recovery: Option<Spanned<toml::Value>>,
    pub limits: Option<RawLimits>,
    pub retry: Option<Spanned<RawRetry>>,
    /// Property name → value; both checked in validation.
    pub sandbox: Option<BTreeMap<Spanned<String>, Spanned<toml::Value>>>,
    pub credentials: Option<BTreeMap<Spanned<String>, Spanned<String>>>,
}

/// A job's `retry = { attempts = 3, backoff = "30s", ... }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRetry {
    pub attempts: Spanned<i64>,
    pub backoff: Option<Spanned<String>>,
    pub max_backoff: Option<Spanned<String>>,
    pub on: Option<Vec<Spanned<String>>>,
}

/// `[job.limits]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    pub memory_max: Option<Spanned<String>>,
    pub cpu_quota: Option<Spanned<String>>,
    pub tasks_max: Option<Spanned<i64>>,
    pub io_weight: Option<Spanned<i64>>,
    pub cpu_weight: Option<Spanned<i64>>,
    pub nice: Option<Spanned<i64>>,
    pub open_files: Option<Spanned<i64>>,
}
