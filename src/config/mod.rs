//! Configuration: TOML files in, validated [`Config`] out.
//!
//! Loading has two stages, as in ripgrep: [`raw`] mirrors the files exactly as
//! written (unknown keys refused by serde), then [`load`] turns them into
//! types that cannot hold a bad value ([`JobName`], [`Schedule`], [`StoreUrl`],
//! durations). Every problem becomes a [`ConfigError`] naming the file, line
//! and column, and loading collects all of them instead of stopping at the
//! first, so `cronlease check` can list everything wrong in one pass.

pub mod raw;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::schedule::Schedule;
use raw::{RawConfig, RawJob, RawJobFile};

/// Where the configuration lives when neither `-c` nor `$CRONLEASE_CONFIG` says.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/cronlease/cronlease.toml";
/// Where the daemon writes its pid unless `pid_file` says otherwise.
pub const DEFAULT_PID_FILE: &str = "/run/cronlease/cronlease.pid";
/// Store used when the config names none (the embedded default).
pub const DEFAULT_STORE_URL: &str = "sqlite:///var/lib/cronlease/locks.db";

/// One mistake in the configuration, located as precisely as possible.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file (or `$CRONLEASE_STORE_URL`) the mistake is in.
    pub origin: String,
    /// 1-based line and column, when the mistake has a place in a file.
    pub position: Option<(usize, usize)>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.position {
            Some((line, col)) => write!(f, "{}:{line}:{col}: {}", self.origin, self.message),
            None => write!(f, "{}: {}", self.origin, self.message),
        }
    }
}

/// Everything wrong with a configuration, in file order. Never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// A job's name: `[A-Za-z0-9_.-]`, 1 to 128 characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct JobName(String);

impl JobName {
    pub fn parse(s: &str) -> Result<Self, String> {
        let ok_chars = s
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if s.is_empty() || s.len() > 128 || !ok_chars {
            return Err(format!(
                "invalid job name {s:?}: expected 1 to 128 characters from [A-Za-z0-9_.-]"
            ));
        }
        Ok(JobName(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
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

/// Which backend a store URL selects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoreKind {
    /// A database file on this host, resolved against the config file's directory.
    Sqlite {
        path: PathBuf,
    },
    Mysql,
    Postgres,
    Redis,
    /// A Redis master found through Sentinel (`redis+sentinel://`).
    RedisSentinel(SentinelTarget),
    /// Redlock over independent Redis masters (`store.urls`): each a
    /// `redis://` or `rediss://` URL of its own.
    Redlock(#[serde(with = "masters_handover")] Vec<StoreUrl>),
    /// A ZooKeeper ensemble (`zk://`).
    ZooKeeper(ZkTarget),
    /// An etcd cluster (`etcd://`, or `etcds://` for TLS).
    Etcd(EtcdTarget),
}

/// Where an `etcd://` or `etcds://` URL points: the cluster's members.
/// Keys go under `store.key_prefix`; the URL has no path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EtcdTarget {
    /// The members to reach, `(host, port)` (port 2379 when not given).
    pub servers: Vec<(String, u16)>,
    /// `etcds://`: TLS, trusting `store.tls_ca_file` if set, else the
    /// system's roots.
    pub tls: bool,
    /// The user for etcd's authentication, if any (its password is the
    /// URL's or `password_file`'s).
    pub username: Option<String>,
}

/// The port of an etcd member's client URL when the store URL names none.
pub const ETCD_PORT: u16 = 2379;

/// Where a `zk://` URL points: the ensemble's servers and the node under
/// which cronlease keeps its nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZkTarget {
    /// The servers, `(host, port)` (port 2181 when not given).
    pub servers: Vec<(String, u16)>,
    /// The URL's path (`/` when none): cronlease's nodes go below it.
    pub chroot: String,
    /// The user for digest authentication, if any (its password is the
    /// URL's or `password_file`'s).
    pub username: Option<String>,
    /// The session timeout asked for (`?session_timeout=`, default 10 s);
    /// the server clamps it to its `minSessionTimeout`..`maxSessionTimeout`.
    /// A dead holder's jobs are free once its session ends.
    pub session_timeout: Duration,
}

/// The ZooKeeper session timeout asked for when the URL names none.
pub const ZK_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// How many independent masters a Redlock store may have.
pub const REDLOCK_MASTERS: [usize; 2] = [3, 5];

/// Where a `redis+sentinel://` URL points: the sentinels to ask, the master's
/// name, and how many replicas must acknowledge each write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentinelTarget {
    /// The sentinels, `(host, port)`, asked in this order (port 26379 when
    /// not given).
    pub sentinels: Vec<(String, u16)>,
    /// The master's name as the sentinels know it (the URL's path).
    pub master: String,
    /// The user (ACL) for the master and the sentinels, if any.
    pub username: Option<String>,
    /// Replicas that must acknowledge every claim, renewal, release and
    /// history write (`?wait=`, default 1; 0 sends no WAIT).
    pub wait: u32,
    /// How long the WAIT after a write waits for them (`?wait_timeout=`,
    /// default 200 ms).
    pub wait_timeout: Duration,
}

/// The most replicas `?wait=` may ask for: more is a typo, not a topology.
const MAX_WAIT_REPLICAS: u32 = 64;

/// `host[:port],host[:port]` (IPv6 as `[addr]:port`), `default_port` where
/// none is given; `what` names a server in messages.
fn parse_servers(hosts: &str, default_port: u16, what: &str) -> Result<Vec<(String, u16)>, String> {
    let mut servers = Vec::new();
    for h in hosts.split(',') {
        let (host, port) = if let Some(v6) = h.strip_prefix('[') {
            let (host, after) = v6.split_once(']').ok_or_else(|| {
                format!("{what} address {h:?}: an IPv6 address needs its closing ]")
            })?;
            if !after.is_empty() && !after.starts_with(':') {
                return Err(format!(
                    "{what} address {h:?}: expected :port or nothing after the ]"
                ));
            }
            (host, after.strip_prefix(':'))
        } else {
            match h.rsplit_once(':') {
                Some((host, _)) if host.contains(':') => {
                    return Err(format!(
                        "{what} address {h:?}: an IPv6 address goes in brackets ([::1]:2379)"
                    ));
                }
                Some((host, port)) => (host, Some(port)),
                None => (h, None),
            }
        };
        if host.is_empty() {
            return Err(format!(
                "expected a {what} address (host or host:port) before each comma and before the /"
            ));
        }
        let port =
            match port {
                None => default_port,
                Some(p) => p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| {
                    format!("{what} address {h:?}: expected a port from 1 to 65535")
                })?,
            };
        servers.push((host.to_string(), port));
    }
    Ok(servers)
}

/// Splits `[userinfo@]rest` at the last `@` (a password may hold any
/// character, percent-encoded or not). A user part with `/`, `?`, `#` or `,`
/// means the `@` was not in the userinfo: refused, without echoing it (it
/// may hold a password).
fn split_userinfo(rest: &str) -> Result<(Option<&str>, &str), String> {
    match rest.rsplit_once('@') {
        None => Ok((None, rest)),
        Some((u, _)) if u.split(':').next().is_some_and(|user| user.contains(['/', '?', '#', ','])) => {
            Err("an @ after the hosts: percent-encode it (%40), or put the user and password before the hosts (user:password@host)".into())
        }
        Some((u, h)) => Ok((Some(u), h)),
    }
}

/// `user[:password]` of a URL's userinfo, percent-decoded; empty parts are none.
fn parse_userinfo(userinfo: Option<&str>) -> (Option<String>, Option<String>) {
    match userinfo {
        None => (None, None),
        Some(u) => {
            let (user, pass) = u.split_once(':').map_or((u, None), |(a, b)| (a, Some(b)));
            let user = Some(percent_decode(user)).filter(|u| !u.is_empty());
            (user, pass.map(percent_decode).filter(|p| !p.is_empty()))
        }
    }
}

/// Parses the part of `zk://[user[:password]@]host[:port],host[:port][/chroot][?session_timeout=D]`
/// after the scheme; returns the target and the password.
fn parse_zk(rest: &str) -> Result<(ZkTarget, Option<String>), String> {
    let (userinfo, rest) = split_userinfo(rest)?;
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (hosts, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let mut session_timeout = ZK_SESSION_TIMEOUT;
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        match &*k {
            "session_timeout" => {
                session_timeout = humantime::parse_duration(&v)
                    .ok()
                    .filter(|d| *d >= Duration::from_millis(100) && *d <= Duration::from_secs(600))
                    .ok_or_else(|| {
                        format!(
                            "session_timeout={v}: expected a duration from 100ms to 10m such as \"4s\""
                        )
                    })?;
            }
            other => {
                return Err(format!(
                    "unknown parameter {other:?}: expected session_timeout"
                ));
            }
        }
    }
    let (username, password) = parse_userinfo(userinfo);
    let servers = parse_servers(hosts, 2181, "ZooKeeper server")?;
    let chroot = percent_decode(path.trim_end_matches('/'));
    if chroot
        .split('/')
        .skip(1)
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(format!(
            "invalid ZooKeeper path {chroot:?}: expected /name/name (no empty, . or .. parts)"
        ));
    }
    let chroot = if chroot.is_empty() {
        "/".to_string()
    } else {
        chroot
    };
    Ok((
        ZkTarget {
            servers,
            chroot,
            username,
            session_timeout,
        },
        password,
    ))
}

/// Parses the part of `etcd://[user[:password]@]host[:port],host[:port][/]`
/// (or `etcds://`) after the scheme; returns the target and the password.
/// Neither a path nor a query is valid, so the userinfo ends at the last `@`
/// wherever it stands (a password may hold a `/` or a `?`).
fn parse_etcd(rest: &str, tls: bool) -> Result<(EtcdTarget, Option<String>), String> {
    let (userinfo, after) = split_userinfo(rest)?;
    let (hosts, tail) = after.split_at(after.find(['/', '?', '#']).unwrap_or(after.len()));
    if tail.contains('?') {
        return Err(
            "etcd URLs take no query parameters: keys go under store.key_prefix, a password in the URL's userinfo or in store.password_file"
                .into(),
        );
    }
    if !tail.is_empty() && tail != "/" {
        return Err(
            "etcd URLs take no path: they name the cluster's members only (etcd://host:2379,host:2379), keys go under store.key_prefix"
                .into(),
        );
    }
    let (username, password) = parse_userinfo(userinfo);
    let servers = parse_servers(hosts, ETCD_PORT, "server")?;
    Ok((
        EtcdTarget {
            servers,
            tls,
            username,
        },
        password,
    ))
}

/// Parses the part of `redis+sentinel://[user[:password]@]host[:port],host[:port]/MASTER[?wait=N&wait_timeout=D]`
/// after the scheme; returns the target and the password.
fn parse_sentinel(rest: &str) -> Result<(SentinelTarget, Option<String>), String> {
    let (authority, tail) = rest
        .split_once('/')
        .ok_or("expected /MASTER_NAME after the sentinels' addresses")?;
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let (username, password) = parse_userinfo(userinfo);
    let sentinels = parse_servers(hosts, 26379, "sentinel")?;
    let (master, query) = tail.split_once('?').unwrap_or((tail, ""));
    let master = percent_decode(master);
    if master.is_empty() || master.contains('/') {
        return Err(
            "expected the master's name as the path (redis+sentinel://host:26379/mymaster)".into(),
        );
    }
    let mut target = SentinelTarget {
        sentinels,
        master,
        username,
        wait: 1,
        wait_timeout: Duration::from_millis(200),
    };
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        match &*k {
            "wait" => {
                target.wait = v
                    .parse::<u32>()
                    .ok()
                    .filter(|n| *n <= MAX_WAIT_REPLICAS)
                    .ok_or_else(|| {
                        format!(
                            "wait={v}: expected a number of replicas from 0 to {MAX_WAIT_REPLICAS}"
                        )
                    })?;
            }
            "wait_timeout" => {
                target.wait_timeout = humantime::parse_duration(&v)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| {
                        format!(
                            "wait_timeout={v}: expected a duration above zero such as \"200ms\""
                        )
                    })?;
            }
            "password" => {
                return Err("a password goes in the userinfo (redis+sentinel://:PASSWORD@host/...) or in store.password_file, not in the query".into());
            }
            other => {
                return Err(format!(
                    "unknown parameter {other:?}: expected wait or wait_timeout"
                ));
            }
        }
    }
    Ok((target, password))
}

/// A store URL. It may carry a password, so `Display` and `Debug` redact it;
/// only [`StoreUrl::expose`] gives the real thing, to the store driver.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreUrl {
    kind: StoreKind,
    url: String,
    redacted: String,
    secret: Option<String>,
}

impl StoreUrl {
    /// Parses a URL; `base` resolves relative SQLite paths.
    pub fn parse(raw: &str, base: &Path) -> Result<Self, String> {
        if raw.contains('\0') {
            return Err("invalid store URL: it contains a NUL byte".into());
        }
        let redacted_input = redact_url(raw);
        let scheme = raw.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
        let scheme = scheme.ok_or_else(|| {
            format!("invalid store URL {redacted_input:?}: expected scheme://..., such as sqlite:///var/lib/cronlease/locks.db")
        })?;
        if scheme == "sqlite" {
            let rest = raw["sqlite:".len()..].trim_start_matches("//");
            let path = rest.split('?').next().unwrap_or_default();
            if rest.contains('?') {
                return Err(format!(
                    "invalid store URL {redacted_input:?}: sqlite URLs take no query parameters (cronlease sets WAL and the busy timeout itself)"
                ));
            }
            if path.is_empty() || path == ":memory:" {
                return Err(format!(
                    "invalid store URL {redacted_input:?}: expected a database file path (an in-memory database cannot be shared between nodes)"
                ));
            }
            let path = base.join(path);
            return Ok(StoreUrl {
                kind: StoreKind::Sqlite { path },
                url: raw.to_string(),
                redacted: raw.to_string(),
                secret: None,
            });
        }
        if scheme == "redis+sentinel" {
            let rest = raw["redis+sentinel:".len()..]
                .strip_prefix("//")
                .ok_or_else(|| format!("invalid store URL {redacted_input:?}: expected redis+sentinel://host:port,host:port/MASTER_NAME"))?;
            let (target, secret) = parse_sentinel(rest)
                .map_err(|m| format!("invalid store URL {redacted_input:?}: {m}"))?;
            return Ok(StoreUrl {
                kind: StoreKind::RedisSentinel(target),
                url: raw.to_string(),
                redacted: redacted_input,
                secret,
            });
        }
        if scheme == "zk" {
            let rest = raw["zk:".len()..].strip_prefix("//").ok_or_else(|| {
                format!(
                    "invalid store URL {redacted_input:?}: expected zk://host:2181,host:2181/path"
                )
            })?;
            let (target, secret) =
                parse_zk(rest).map_err(|m| format!("invalid store URL {redacted_input:?}: {m}"))?;
            if secret.is_some() && target.username.is_none() {
                return Err(format!(
                    "invalid store URL {redacted_input:?}: a password needs a user (zk://user:password@host/...)"
                ));
            }
            return Ok(StoreUrl {
                kind: StoreKind::ZooKeeper(target),
                url: raw.to_string(),
                redacted: redacted_input,
                secret,
            });
        }
        if scheme == "etcd" || scheme == "etcds" {
            let rest = raw[scheme.len() + 1..].strip_prefix("//").ok_or_else(|| {
                format!(
                    "invalid store URL {redacted_input:?}: expected {scheme}://host:2379,host:2379"
                )
            })?;
            let (target, secret) = parse_etcd(rest, scheme == "etcds")
                .map_err(|m| format!("invalid store URL {redacted_input:?}: {m}"))?;
            if secret.is_some() && target.username.is_none() {
                return Err(format!(
                    "invalid store URL {redacted_input:?}: a password needs a user ({scheme}://user:password@host)"
                ));
            }
            return Ok(StoreUrl {
                kind: StoreKind::Etcd(target),
                url: raw.to_string(),
                redacted: redacted_input,
                secret,
            });
        }
        let kind = match scheme.as_str() {
            "mysql" | "mariadb" => StoreKind::Mysql,
            "postgres" | "postgresql" => StoreKind::Postgres,
            "redis" | "rediss" => StoreKind::Redis,
            other => {
                return Err(format!(
                    "unsupported store URL scheme {other:?}: expected sqlite://, mysql://, mariadb://, postgres://, redis://, redis+sentinel://, zk://, etcd:// or etcds://"
                ));
            }
        };
        let parsed = url::Url::parse(raw)
            .map_err(|e| format!("invalid store URL {redacted_input:?}: {e}"))?;
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(format!(
                "invalid store URL {redacted_input:?}: expected a host"
            ));
        }
        let secret = parsed
            .password()
            .filter(|p| !p.is_empty())
            .map(percent_decode)
            .or_else(|| query_password(&parsed));
        // sqlx wants mysql://; mariadb:// is accepted as a friendlier alias.
        let url = if scheme == "mariadb" {
            format!("mysql{}", &raw["mariadb".len()..])
        } else {
            raw.to_string()
        };
        Ok(StoreUrl {
            kind,
            url,
            redacted: redacted_input,
            secret,
        })
    }

    /// A Redlock store over the masters `raw` names (`store.urls`): 3 or 5
    /// distinct `redis://` or `rediss://` URLs. On error, the index of the
    /// URL at fault (if one is) and the message.
    pub fn redlock(raw: &[&str]) -> Result<Self, (Option<usize>, String)> {
        if !REDLOCK_MASTERS.contains(&raw.len()) {
            return Err((
                None,
                format!(
                    "store.urls names {} Redis masters: Redlock needs 3 or 5 independent masters (a majority of them must agree on every claim)",
                    raw.len()
                ),
            ));
        }
        let mut masters: Vec<StoreUrl> = Vec::with_capacity(raw.len());
        for (i, u) in raw.iter().enumerate() {
            let url = StoreUrl::parse(u, Path::new("/")).map_err(|m| (Some(i), m))?;
            if url.kind != StoreKind::Redis {
                return Err((
                    Some(i),
                    format!(
                        "store.urls: {} is not a redis:// or rediss:// URL (each Redlock master is one Redis server)",
                        url.redacted
                    ),
                ));
            }
            if masters.iter().any(|m| m.host_port() == url.host_port()) {
                return Err((
                    Some(i),
                    format!(
                        "store.urls names {} twice: Redlock's masters must be independent servers",
                        url.redacted
                    ),
                ));
            }
            masters.push(url);
        }
        let join = |f: fn(&StoreUrl) -> &str| masters.iter().map(f).collect::<Vec<_>>().join(",");
        Ok(StoreUrl {
            url: join(StoreUrl::expose),
            redacted: format!("redlock[{}]", join(StoreUrl::redacted)),
            secret: masters.iter().find_map(|m| m.secret.clone()),
            kind: StoreKind::Redlock(masters),
        })
    }

    /// `host:port` of a network URL, to tell servers apart.
    fn host_port(&self) -> Option<(String, u16)> {
        let u = url::Url::parse(&self.url).ok()?;
        Some((u.host_str()?.to_ascii_lowercase(), u.port().unwrap_or(6379)))
    }

    /// Sets the password (from `password_file`), replacing any in the URL.
    pub fn with_password(mut self, password: &str) -> Result<Self, String> {
        if matches!(self.kind, StoreKind::Sqlite { .. }) {
            return Err("password_file is set but a sqlite:// store takes no password".into());
        }
        if let StoreKind::Redlock(masters) = &self.kind {
            // One password for every master, as operators run them.
            let masters = masters
                .iter()
                .map(|m| m.clone().with_password(password))
                .collect::<Result<Vec<_>, _>>()?;
            self.url = masters
                .iter()
                .map(StoreUrl::expose)
                .collect::<Vec<_>>()
                .join(",");
            self.kind = StoreKind::Redlock(masters);
            self.secret = Some(password.to_string());
            return Ok(self);
        }
        if let StoreKind::ZooKeeper(t) = &self.kind {
            if t.username.is_none() {
                return Err(
                    "password_file is set but the zk:// URL names no user (zk://user@host/...)"
                        .into(),
                );
            }
            self.secret = Some(password.to_string());
            return Ok(self);
        }
        if let StoreKind::Etcd(t) = &self.kind {
            if t.username.is_none() {
                return Err(
                    "password_file is set but the etcd:// URL names no user (etcd://user@host)"
                        .into(),
                );
            }
            // Not a URL the url crate reads (several hosts): the store
            // takes the password from here.
            self.secret = Some(password.to_string());
            return Ok(self);
        }
        if matches!(self.kind, StoreKind::RedisSentinel(_)) {
            // Not a URL the url crate reads (several hosts): the store takes
            // the password from here, not from the URL.
            self.secret = Some(password.to_string());
            return Ok(self);
        }
        let mut parsed = url::Url::parse(&self.url).map_err(|e| e.to_string())?;
        if parsed.username().is_empty() && self.kind != StoreKind::Redis {
            return Err("password_file is set but the store URL names no user".into());
        }
        parsed
            .set_password(Some(password))
            .map_err(|()| "the store URL cannot carry a password".to_string())?;
        self.url = parsed.to_string();
        self.secret = Some(password.to_string());
        Ok(self)
    }

    pub fn kind(&self) -> &StoreKind {
        &self.kind
    }

    /// The URL with its password, for the driver only. Never log this.
    pub fn expose(&self) -> &str {
        &self.url
    }

    /// The password, from the URL or `password_file`, for the driver only
    /// (a driver that does not take it inside the URL). Never log this.
    pub fn password(&self) -> Option<&str> {
        self.secret.as_deref()
    }

    /// The URL with any password replaced by `***`, safe for logs.
    pub fn redacted(&self) -> &str {
        &self.redacted
    }

    /// Removes the password from `text` (a driver's error message, say):
    /// every master's, for a Redlock store.
    pub fn scrub(&self, text: &str) -> String {
        let text = match &self.kind {
            StoreKind::Redlock(masters) => {
                masters.iter().fold(text.to_string(), |t, m| m.scrub(&t))
            }
            _ => text.to_string(),
        };
        let mut text = redact_urls_in(&text);
        for form in self.own_secret_forms() {
            text = text.replace(&form, "***");
        }
        text
    }

    /// Every form in which [`scrub`](Self::scrub) finds a password: as
    /// written and URL-encoded, every master's for a Redlock store. For
    /// cutting a text where no password is split. Never log these.
    pub fn secret_forms(&self) -> Vec<String> {
        let mut forms = match &self.kind {
            StoreKind::Redlock(masters) => {
                masters.iter().flat_map(StoreUrl::secret_forms).collect()
            }
            _ => Vec::new(),
        };
        forms.extend(self.own_secret_forms());
        forms
    }

    /// This URL's own password, as written and URL-encoded.
    fn own_secret_forms(&self) -> Vec<String> {
        match &self.secret {
            Some(secret) if !secret.is_empty() => {
                let encoded: String =
                    url::form_urlencoded::byte_serialize(secret.as_bytes()).collect();
                let mut forms = vec![secret.clone()];
                if encoded.len() > 2 && encoded != *secret {
                    forms.push(encoded);
                }
                forms
            }
            _ => Vec::new(),
        }
    }
}

impl fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted)
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted)
    }
}

/// `%XX` decoding as in a URL's userinfo (a `+` stays a `+`).
fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// The password a URL carries in its query (`?password=...`, which the
/// PostgreSQL driver accepts), if any.
fn query_password(u: &url::Url) -> Option<String> {
    u.query_pairs()
        .find(|(k, _)| k.eq_ignore_ascii_case("password"))
        .map(|(_, v)| v.into_owned())
        .filter(|v| !v.is_empty())
}

/// Replaces every URL-looking word of `text` (it holds `://`) with its
/// redacted form: error messages that quote a value (serde's "invalid type:
/// string ...") must not quote a password.
pub fn redact_urls_in(text: &str) -> String {
    if !text.contains("://") {
        return text.to_string();
    }
    let delimiter = |c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '`' | ',' | '(' | ')');
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word.contains("://") {
            out.push_str(&redact_url(word));
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in text.chars() {
        if delimiter(c) {
            flush(&mut word, &mut out);
            out.push(c);
        } else {
            word.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// `scheme://user:secret@host` → `scheme://user:***@host`. A URL that does
/// not read as one with a host (a typo such as `mysql:/user:pw@host` or
/// `mysql:user:pw@host`) has everything that could be a credential hidden:
/// all before the last `@`, or a non-numeric "port" where no `@` stands.
pub fn redact_url(raw: &str) -> String {
    if let Some(shown) = redact_sentinel_url(raw) {
        return shown;
    }
    if let Ok(mut u) = url::Url::parse(raw) {
        let in_query = query_password(&u).is_some();
        if in_query {
            let pairs: Vec<(String, String)> = u
                .query_pairs()
                .map(|(k, v)| {
                    let v = if k.eq_ignore_ascii_case("password") {
                        "***".to_string()
                    } else {
                        v.into_owned()
                    };
                    (k.into_owned(), v)
                })
                .collect();
            u.query_pairs_mut().clear().extend_pairs(pairs);
        }
        if u.password().is_some() {
            let _ = u.set_password(Some("***"));
            return u.to_string();
        }
        // An `@` past the host means the URL did not read the way it was
        // meant (an unencoded `/` in a password): hide it all.
        let misread = u.path().contains('@')
            || u.query().is_some_and(|q| q.contains('@'))
            || u.fragment().is_some_and(|f| f.contains('@'));
        if u.host_str().is_some_and(|h| !h.is_empty()) && !misread {
            return if in_query {
                u.to_string()
            } else {
                raw.to_string()
            };
        }
    }
    redact_unparsed(raw)
}

/// A `redis+sentinel://`, `zk://`, `etcd://` or `etcds://` URL (several
/// hosts: not one the url crate reads) with its password hidden and its
/// hosts kept; `None` for any other.
fn redact_sentinel_url(raw: &str) -> Option<String> {
    let scheme = ["redis+sentinel://", "zk://", "etcd://", "etcds://"]
        .into_iter()
        .find_map(|s| {
            raw.get(..s.len())
                .filter(|head| head.eq_ignore_ascii_case(s))
        })?;
    let rest = &raw[scheme.len()..];
    let etcd = scheme
        .get(..4)
        .is_some_and(|s| s.eq_ignore_ascii_case("etcd"));
    let authority_end = if etcd {
        // No path or query is valid in an etcd URL: the userinfo ends at the
        // last `@`, so a password holding a `/` or a `?` is hidden too.
        let from = rest.rfind('@').unwrap_or(0);
        rest[from..]
            .find(['/', '?', '#'])
            .map_or(rest.len(), |i| from + i)
    } else {
        rest.find('/').unwrap_or(rest.len())
    };
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{user}:***@{hosts}"),
            None => format!("{userinfo}@{hosts}"),
        },
        None => authority.to_string(),
    };
    // A password in the query is refused, but the message quotes the URL.
    let tail = match tail.split_once('?') {
        Some((path, q)) if q.to_ascii_lowercase().contains("password") => format!("{path}?***"),
        _ => tail.to_string(),
    };
    Some(format!("{scheme}{authority}{tail}"))
}

fn redact_unparsed(raw: &str) -> String {
    let scheme_end = raw.find(':').filter(|&i| {
        i > 0
            && raw[..i]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '.' | '-'))
    });
    let (head, rest) = match scheme_end {
        Some(i) => {
            let after = &raw[i + 1..];
            let slashes = after.len() - after.trim_start_matches('/').len();
            raw.split_at(i + 1 + slashes)
        }
        None => ("", raw),
    };
    if let Some(at) = rest.rfind('@') {
        return format!("{head}***{}", &rest[at..]);
    }
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].split_once(':') {
        Some((host, port)) if !port.chars().all(|c| c.is_ascii_digit()) => {
            format!("{head}{host}:***{}", &rest[authority_end..])
        }
        _ => raw.to_string(),
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
    /// file has one writer). Redis uses one multiplexed connection.
    pub max_connections: u32,
    /// TLS trust and client identity (`rediss://`, `etcds://`, MySQL, PostgreSQL).
    pub tls: Option<TlsFiles>,
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

/// What happens when an occurrence comes while the previous run still goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Claim the occurrence (keeping the lease) but do not start a second
    /// run: it waits for the previous run up to the next occurrence, and is
    /// skipped if that run is still going then.
    #[default]
    Skip,
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
    pub overlap: Overlap,
    pub env: BTreeMap<String, String>,
    pub working_dir: Option<PathBuf>,
    /// Run as this user and group (the daemon must be root).
    pub identity: Option<Identity>,
    /// `output_tail`: how many of the last bytes of the run's stdout and
    /// stderr history keeps (0: none).
    pub output_tail: usize,
    /// `on_failure`: run on the same node after a run ended `failed`,
    /// `timeout` or `lease_lost`.
    pub on_failure: Option<Command>,
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
            && self.overlap == other.overlap
            && self.env == other.env
            && self.working_dir == other.working_dir
            && self.identity == other.identity
            && self.output_tail == other.output_tail
            && self.on_failure == other.on_failure
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
    pub log: LogConfig,
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
            store,
            lease_margin,
            max_clock_offset,
            head_start,
            trigger_expiry,
            placement,
            shutdown_grace,
            pid_file,
            http_listen,
            log,
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
        note(*format != self.log.format, "log.format", false);
        note(*level != self.log.level, "log.level", true);
        c
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

/// The text of one file, to turn byte spans into lines and columns.
struct Source {
    origin: String,
    text: String,
    /// Where each line starts (byte offsets): a position is found in
    /// O(log lines), not by counting from the file's start, which made
    /// loading a file of n jobs O(n²) (every job's location is kept).
    line_starts: Vec<usize>,
}

impl Source {
    fn new(origin: String, text: String) -> Source {
        let line_starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Source {
            origin,
            text,
            line_starts,
        }
    }

    /// Line and column (from 1; the column in characters) of `offset`.
    fn line_col(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let line = self.line_starts.partition_point(|start| *start <= offset);
        let start = self
            .line_starts
            .get(line.wrapping_sub(1))
            .copied()
            .unwrap_or(0);
        let col = self
            .text
            .get(start..offset)
            .map_or(0, |l| l.chars().count())
            + 1;
        (line.max(1), col)
    }

    fn error_at(&self, span: Option<Range<usize>>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            origin: self.origin.clone(),
            position: span.map(|s| self.line_col(s.start)),
            // A message may quote a value: never a password in a URL.
            message: redact_urls_in(&one_line(&message.into())),
        }
    }
    fn at<T>(&self, v: &Spanned<T>, message: impl Into<String>) -> ConfigError {
        self.error_at(Some(v.span()), message)
    }
}

/// `s` on one line: every run of white space (newlines too) becomes one space.
pub fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn read_source(path: &Path, errors: &mut Vec<ConfigError>) -> Option<Source> {
    match std::fs::read_to_string(path) {
        Ok(text) => Some(Source::new(path.display().to_string(), text)),
        Err(e) => {
            errors.push(ConfigError {
                origin: path.display().to_string(),
                position: None,
                message: format!("cannot read: {e}"),
            });
            None
        }
    }
}

/// Parses a whole file into `T`, reporting every mistake it can find rather
/// than the first: all syntax errors (the parser recovers), then, if the
/// file as a whole does not fit `T`, each top-level key on its own and each
/// `[[job]]` table on its own, so an unknown key in `[store]`, a bad type in
/// `[lease]` and a broken job are all listed in one pass.
fn parse_toml<T: serde::de::DeserializeOwned>(
    src: &Source,
    errors: &mut Vec<ConfigError>,
) -> Option<T> {
    use serde::de::IntoDeserializer;
    use toml::de::{DeTable, DeValue};
    let (table, syntax) = DeTable::parse_recoverable(&src.text);
    if !syntax.is_empty() {
        for e in syntax {
            errors.push(src.error_at(e.span(), e.message()));
        }
        return None;
    }
    let whole = T::deserialize(table.clone().into_deserializer());
    let first = match whole {
        Ok(v) => return Some(v),
        Err(e) => e,
    };
    let before = errors.len();
    let span = table.span();
    for (key, value) in table.get_ref().iter() {
        if let (DeValue::Array(jobs), "job") = (value.get_ref(), key.get_ref().as_ref()) {
            for job in jobs {
                if let Err(e) = raw::RawJob::deserialize(job.clone().into_deserializer()) {
                    errors.push(src.error_at(e.span(), e.message()));
                }
            }
            continue;
        }
        let mut one = DeTable::new();
        one.insert(key.clone(), value.clone());
        let one = toml::Spanned::new(span.clone(), one);
        if let Err(e) = T::deserialize(one.into_deserializer()) {
            errors.push(src.error_at(e.span(), e.message()));
        }
    }
    if errors.len() == before {
        errors.push(src.error_at(first.span(), first.message()));
    }
    None
}

/// Checks that a string setting holds no NUL byte (no path, argument or
/// name can carry one: every run would fail).
fn refuse_nul(
    src: &Source,
    v: &Spanned<String>,
    what: &str,
    errors: &mut Vec<ConfigError>,
) -> bool {
    if v.get_ref().contains('\0') {
        errors.push(src.at(v, format!("{what} contains a NUL byte")));
        return false;
    }
    true
}

/// The longest duration any setting takes: a year. Longer ones are typos
/// (or `u64::MAX` seconds), and every deadline computed from a bounded value
/// stays far from overflowing.
pub const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

fn duration(
    src: &Source,
    v: &Spanned<String>,
    what: &str,
    errors: &mut Vec<ConfigError>,
) -> Option<Duration> {
    bounded_duration(src, v, what, MAX_DURATION, errors)
}

fn bounded_duration(
    src: &Source,
    v: &Spanned<String>,
    what: &str,
    max: Duration,
    errors: &mut Vec<ConfigError>,
) -> Option<Duration> {
    match humantime::parse_duration(v.get_ref()) {
        Ok(d) if d > max => {
            errors.push(src.at(
                v,
                format!(
                    "{what} {:?} is too long: at most {}",
                    v.get_ref(),
                    humantime::format_duration(max)
                ),
            ));
            None
        }
        Ok(d) if d > Duration::ZERO => Some(d),
        Ok(_) => {
            errors.push(src.at(v, format!("{what} must be longer than zero")));
            None
        }
        Err(e) => {
            errors.push(src.at(
                v,
                format!("invalid duration {:?} for {what}: {e} (expected e.g. \"500ms\", \"2s\", \"1h 30m\")", v.get_ref()),
            ));
            None
        }
    }
}

/// `cluster.trigger_expiry` unless set.
pub const DEFAULT_TRIGGER_EXPIRY: Duration = Duration::from_secs(3600);

/// `cluster.head_start` unless set (or half the margin, if that is less).
pub const DEFAULT_HEAD_START: Duration = Duration::from_millis(50);

fn bounded_duration_or(
    src: &Source,
    v: &Option<Spanned<String>>,
    what: &str,
    default: Duration,
    max: Duration,
    errors: &mut Vec<ConfigError>,
) -> Duration {
    v.as_ref()
        .and_then(|v| bounded_duration(src, v, what, max, errors))
        .unwrap_or(default)
}

fn duration_or(
    src: &Source,
    v: &Option<Spanned<String>>,
    what: &str,
    default: Duration,
    errors: &mut Vec<ConfigError>,
) -> Duration {
    v.as_ref()
        .and_then(|v| duration(src, v, what, errors))
        .unwrap_or(default)
}

/// Loads and validates the configuration at `path` and every job file it names.
pub fn load(path: &Path, overrides: &Overrides) -> Result<Config, ConfigErrors> {
    let mut errors = Vec::new();
    let Some(src) = read_source(path, &mut errors) else {
        return Err(ConfigErrors(errors));
    };
    let raw: RawConfig = match parse_toml(&src, &mut errors) {
        Some(raw) => raw,
        None => return Err(ConfigErrors(errors)),
    };
    let base = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();

    let node = match &raw.node {
        Some(n) => NodeName::parse(n.get_ref())
            .map_err(|m| errors.push(src.at(n, m)))
            .ok(),
        None => match host_name() {
            Some(h) => NodeName::parse(&h)
                .map_err(|m| {
                    errors.push(ConfigError {
                        origin: src.origin.clone(),
                        position: None,
                        message: format!(
                            "the host name cannot serve as node name ({m}); set `node = \"...\"`"
                        ),
                    })
                })
                .ok(),
            None => {
                errors.push(ConfigError {
                    origin: src.origin.clone(),
                    position: None,
                    message: "cannot read the host name; set `node = \"...\"`".into(),
                });
                None
            }
        },
    };

    for (v, what) in [
        (&raw.pid_file, "pid_file"),
        (&raw.jobs.dir, "jobs.dir"),
        (&raw.store.url, "store.url"),
        (&raw.store.password_file, "store.password_file"),
        (&raw.store.key_prefix, "store.key_prefix"),
        (&raw.store.tls_ca_file, "store.tls_ca_file"),
        (&raw.store.tls_cert_file, "store.tls_cert_file"),
        (&raw.store.tls_key_file, "store.tls_key_file"),
    ] {
        if let Some(v) = v {
            refuse_nul(&src, v, what, &mut errors);
        }
    }
    for u in raw.store.urls.iter().flat_map(|l| l.get_ref()) {
        refuse_nul(&src, u, "store.urls", &mut errors);
    }
    let mut warnings = Vec::new();
    let store = load_store(&src, &raw, &base, overrides, &mut errors, &mut warnings);
    let lease_margin = duration_or(
        &src,
        &raw.lease.margin,
        "lease.margin",
        Duration::from_secs(1),
        &mut errors,
    );
    let max_clock_offset = bounded_duration_or(
        &src,
        &raw.cluster.max_clock_offset,
        "cluster.max_clock_offset",
        Duration::from_millis(500),
        Duration::from_secs(60),
        &mut errors,
    );
    // At most half the margin: a peer's takeover from an idle holder must
    // come well before the lease would have let it in anyway.
    let head_start = bounded_duration_or(
        &src,
        &raw.cluster.head_start,
        "cluster.head_start",
        DEFAULT_HEAD_START.min(lease_margin / 2),
        lease_margin / 2,
        &mut errors,
    );
    let trigger_expiry = duration_or(
        &src,
        &raw.cluster.trigger_expiry,
        "cluster.trigger_expiry",
        DEFAULT_TRIGGER_EXPIRY,
        &mut errors,
    );
    let shutdown_grace = duration_or(
        &src,
        &raw.shutdown_grace,
        "shutdown_grace",
        Duration::from_secs(30),
        &mut errors,
    );
    // `[metrics]` is the old name of `[http]`: either, not both.
    const BOTH: &str = "both [http] and [metrics] are set: keep [http] ([metrics] is its old name)";
    let http_table = match (&raw.http, &raw.metrics) {
        (Some(h), Some(_)) => {
            errors.push(src.at(&h.listen, BOTH.to_string()));
            None
        }
        (Some(h), None) => Some((h, "http.listen")),
        (None, Some(m)) => Some((m, "metrics.listen")),
        (None, None) => None,
    };
    let http_listen = http_table.and_then(|(h, key)| {
        h.listen
            .get_ref()
            .parse::<SocketAddr>()
            .map_err(|_| {
                errors.push(src.at(
                    &h.listen,
                    format!(
                        "invalid {key} {:?}: expected IP:PORT such as \"127.0.0.1:9187\"",
                        h.listen.get_ref()
                    ),
                ))
            })
            .ok()
    });
    let log = LogConfig {
        format: raw.log.format.unwrap_or_default(),
        level: match &raw.log.level {
            Some(l) => match tracing_subscriber::EnvFilter::try_new(l.get_ref()) {
                Ok(_) => l.get_ref().clone(),
                Err(e) => {
                    errors.push(src.at(l, format!("invalid log.level {:?}: {e} (expected e.g. \"info\" or \"cronlease=debug\")", l.get_ref())));
                    "info".into()
                }
            },
            None => "info".into(),
        },
    };

    // Jobs: those in the config file, then every *.toml of jobs.dir.
    let mut jobs = Vec::new();
    let mut seen: HashMap<String, String> = HashMap::new();
    let mut job_files = vec![path.to_path_buf()];
    for rj in &raw.job {
        if let Some(job) = validate_job(&src, rj, &base, &mut seen, &mut errors) {
            jobs.push(job);
        }
    }
    let (dir, explicit) = match &raw.jobs.dir {
        Some(d) => (base.join(d.get_ref()), Some(d)),
        None => (base.join("jobs.d"), None),
    };
    match std::fs::read_dir(&dir) {
        Ok(entries) => {
            let mut files: Vec<PathBuf> = Vec::new();
            for path in entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            {
                // A *.toml that cannot be read as a file is a mistake to
                // report, never a job file to skip silently.
                match std::fs::metadata(&path) {
                    Ok(meta) if meta.is_file() => files.push(path),
                    Ok(_) => errors.push(ConfigError {
                        origin: path.display().to_string(),
                        position: None,
                        message: "not a regular file (jobs.dir takes *.toml files)".into(),
                    }),
                    Err(e) => errors.push(ConfigError {
                        origin: path.display().to_string(),
                        position: None,
                        message: match std::fs::symlink_metadata(&path) {
                            Ok(m) if m.file_type().is_symlink() => {
                                format!("dangling or looping symlink: {e}")
                            }
                            _ => format!("cannot read: {e}"),
                        },
                    }),
                }
            }
            files.sort();
            for file in files {
                let Some(jsrc) = read_source(&file, &mut errors) else {
                    continue;
                };
                if let Some(jf) = parse_toml::<RawJobFile>(&jsrc, &mut errors) {
                    for rj in &jf.job {
                        if let Some(job) = validate_job(&jsrc, rj, &base, &mut seen, &mut errors) {
                            jobs.push(job);
                        }
                    }
                }
                job_files.push(file);
            }
        }
        Err(e) => {
            if let Some(d) = explicit {
                errors.push(src.at(d, format!("cannot read jobs.dir {}: {e}", dir.display())));
            } else if e.kind() != std::io::ErrorKind::NotFound {
                errors.push(ConfigError {
                    origin: dir.display().to_string(),
                    position: None,
                    message: format!("cannot read the jobs directory: {e}"),
                });
            }
        }
    }

    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    jobs.sort_by(|a, b| a.name.cmp(&b.name));
    match (node, store) {
        (Some(node), Some(store)) => Ok(Config {
            path: path.to_path_buf(),
            node,
            store,
            lease_margin,
            max_clock_offset,
            head_start,
            trigger_expiry,
            placement: raw.cluster.placement.unwrap_or_default(),
            shutdown_grace,
            pid_file: raw.pid_file.as_ref().map_or_else(
                || PathBuf::from(DEFAULT_PID_FILE),
                |p| base.join(p.get_ref()),
            ),
            http_listen,
            log,
            jobs,
            job_files,
            warnings,
        }),
        // Each None above pushed an error, so this arm is not reached.
        _ => Err(ConfigErrors(vec![ConfigError {
            origin: src.origin,
            position: None,
            message: "invalid configuration".into(),
        }])),
    }
}

fn load_store(
    src: &Source,
    raw: &RawConfig,
    base: &Path,
    overrides: &Overrides,
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<String>,
) -> Option<StoreConfig> {
    let s = &raw.store;
    let url = match (&overrides.store_url, &s.url) {
        (None, Some(_)) if s.urls.is_some() => {
            if let Some(list) = &s.urls {
                errors.push(src.at(
                    list,
                    "store.url and store.urls are both set: url names one store, urls the masters of a Redlock store; keep one",
                ));
            }
            None
        }
        (None, None) if s.urls.is_some() => s.urls.as_ref().and_then(|list| {
            let raw: Vec<&str> = list
                .get_ref()
                .iter()
                .map(|u| u.get_ref().as_str())
                .collect();
            match StoreUrl::redlock(&raw) {
                Ok(url) => {
                    if url.secret.is_some() {
                        warn_if_world_readable(
                            Path::new(&src.origin),
                            "holds a store password",
                            warnings,
                        );
                    }
                    Some(url)
                }
                Err((at, m)) => {
                    errors.push(match at.and_then(|i| list.get_ref().get(i)) {
                        Some(u) => src.at(u, m),
                        None => src.at(list, m),
                    });
                    None
                }
            }
        }),
        (Some(env), _) => StoreUrl::parse(env, base)
            .map_err(|m| {
                errors.push(ConfigError {
                    origin: "$CRONLEASE_STORE_URL".into(),
                    position: None,
                    message: m,
                })
            })
            .ok(),
        (None, Some(u)) => {
            let url = StoreUrl::parse(u.get_ref(), base)
                .map_err(|m| errors.push(src.at(u, m)))
                .ok();
            if url.as_ref().is_some_and(|u| u.secret.is_some()) {
                warn_if_world_readable(
                    Path::new(&src.origin),
                    "holds the store password",
                    warnings,
                );
            }
            url
        }
        (None, None) => StoreUrl::parse(DEFAULT_STORE_URL, base).ok(),
    };
    let url = match (url, &s.password_file) {
        (Some(url), Some(pf)) => {
            let file = base.join(pf.get_ref());
            warn_if_world_readable(&file, "is the store password file", warnings);
            match std::fs::read_to_string(&file) {
                Ok(pw) => {
                    let pw = pw.trim_end_matches(['\n', '\r']);
                    if pw.is_empty() {
                        errors
                            .push(src.at(pf, format!("password_file {} is empty", file.display())));
                        None
                    } else {
                        url.with_password(pw)
                            .map_err(|m| errors.push(src.at(pf, m)))
                            .ok()
                    }
                }
                Err(e) => {
                    errors.push(src.at(
                        pf,
                        format!("cannot read password_file {}: {e}", file.display()),
                    ));
                    None
                }
            }
        }
        (url, _) => url,
    };
    let table_prefix = match &s.table_prefix {
        Some(p) => {
            let v = p.get_ref();
            if v.len() <= 32 && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                v.clone()
            } else {
                errors.push(src.at(p, format!("invalid store.table_prefix {v:?}: expected at most 32 characters from [A-Za-z0-9_]")));
                String::new()
            }
        }
        None => String::new(),
    };
    let key_prefix = match &s.key_prefix {
        Some(p) if p.get_ref().chars().any(char::is_whitespace) => {
            errors.push(src.at(p, "invalid store.key_prefix: whitespace is not allowed"));
            String::new()
        }
        Some(p) => p.get_ref().clone(),
        None => "cronlease:".into(),
    };
    let op_timeout = duration_or(
        src,
        &s.op_timeout,
        "store.op_timeout",
        Duration::from_secs(2),
        errors,
    );
    let history_limit = match &s.history_limit {
        Some(h) if (1..=1_000_000).contains(h.get_ref()) => *h.get_ref() as u32,
        Some(h) => {
            errors.push(src.at(h, "store.history_limit must be between 1 and 1000000"));
            100
        }
        None => 100,
    };
    let max_connections = match &s.max_connections {
        Some(m) if (1..=1_000).contains(m.get_ref()) => *m.get_ref() as u32,
        Some(m) => {
            errors.push(src.at(m, "store.max_connections must be between 1 and 1000"));
            8
        }
        None => 8,
    };
    let tls = tls_files(src, s, base, url.as_ref(), errors);
    Some(StoreConfig {
        tls,
        url: url?,
        table_prefix,
        key_prefix,
        op_timeout,
        history_limit,
        max_connections,
    })
}

fn validate_job(
    src: &Source,
    rj: &RawJob,
    base: &Path,
    seen: &mut HashMap<String, String>,
    errors: &mut Vec<ConfigError>,
) -> Option<Job> {
    let before = errors.len();
    let name = JobName::parse(rj.name.get_ref())
        .map_err(|m| errors.push(src.at(&rj.name, m)))
        .ok();
    let (line, col) = src.line_col(rj.name.span().start);
    let here = format!("{}:{line}:{col}", src.origin);
    if let Some(n) = &name {
        // Keyed ignoring case: MySQL's default collation compares lock
        // names that way, so `Backup` and `backup` would share one lock.
        if let Some(first) = seen.get(&n.as_str().to_ascii_lowercase()) {
            errors.push(src.at(
                &rj.name,
                format!(
                    "duplicate job name {:?} (first defined at {first}); names must differ in more than upper/lower case",
                    n.as_str()
                ),
            ));
        } else {
            seen.insert(n.as_str().to_ascii_lowercase(), here.clone());
        }
    }
    let zone = rj.timezone.as_ref().map_or("UTC", |z| z.get_ref().as_str());
    if let Some(z) = &rj.timezone {
        if let Err(e) = crate::schedule::parse_zone(z.get_ref()) {
            errors.push(src.at(z, e.to_string()));
        }
    }
    let schedule = match Schedule::parse(rj.schedule.get_ref(), zone) {
        Ok(s) => Some(s),
        Err(crate::schedule::ScheduleError::UnknownZone { .. }) => None,
        Err(e) => {
            errors.push(src.at(&rj.schedule, e.to_string()));
            None
        }
    };
    let command = command_of(src, &rj.command, "command", errors);
    let on_failure = rj
        .on_failure
        .as_ref()
        .and_then(|v| command_of(src, v, "on_failure", errors));
    let timeout = rj
        .timeout
        .as_ref()
        .and_then(|t| duration(src, t, "timeout", errors));
    let kill_grace = duration_or(
        src,
        &rj.kill_grace,
        "kill_grace",
        Duration::from_secs(10),
        errors,
    );
    let mut env = BTreeMap::new();
    for (k, v) in rj.env.iter().flatten() {
        let key = k.get_ref();
        if key.is_empty() || key.contains(['=', '\0']) || key.starts_with(char::is_numeric) {
            errors.push(src.at(k, format!("invalid environment variable name {key:?}")));
        } else if key.starts_with("CRONLEASE_") {
            errors.push(src.at(
                k,
                format!(
                    "environment variable {key:?} is reserved: cronlease sets CRONLEASE_* itself"
                ),
            ));
        } else if v.get_ref().contains('\0') {
            errors.push(src.at(v, "environment values cannot contain NUL"));
        } else {
            env.insert(key.clone(), v.get_ref().clone());
        }
    }
    if let Some(command) = &command {
        exec_space(src, rj, command, errors);
    }
    for (v, what) in [
        (&rj.working_dir, "working_dir"),
        (&rj.user, "user"),
        (&rj.group, "group"),
    ] {
        if let Some(v) = v {
            refuse_nul(src, v, what, errors);
        }
    }
    if errors.len() > before {
        return None;
    }
    let output_tail = match &rj.output_tail {
        Some(v) => byte_size(src, v, "output_tail", MAX_OUTPUT_TAIL, errors),
        None => Some(DEFAULT_OUTPUT_TAIL),
    };
    let working_dir = rj.working_dir.as_ref().map(|w| base.join(w.get_ref()));
    let identity = identity(src, rj, errors);
    if errors.len() > before {
        return None;
    }
    Some(Job {
        name: name?,
        schedule: schedule?,
        command: command?,
        timeout,
        kill_grace,
        misfire: rj.misfire.unwrap_or_default(),
        overlap: rj.overlap.unwrap_or_default(),
        env,
        working_dir,
        identity,
        output_tail: output_tail?,
        on_failure,
        defined_at: here,
    })
}

/// A command (`command`, `on_failure`): a string runs as `/bin/sh -c`, an
/// array is an argv.
/// The longest single argument or `NAME=value` string the kernel's exec
/// takes (Linux's MAX_ARG_STRLEN: 32 pages).
const MAX_ARG_STRLEN: usize = 32 * 4096;
/// Room kept, within the OS argument limit, for what a run's environment
/// gets beside `env` (CRONLEASE_*, what the daemon passes on: PATH, HOME).
const ENV_RESERVE: usize = 32 * 1024;

/// The OS argument limit (ARG_MAX: argv and environment together), as
/// this process sees it; 2 MiB, Linux's usual value, if it cannot tell.
/// Asked once: every job of every load checks against it.
fn arg_max() -> usize {
    static ARG_MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ARG_MAX.get_or_init(|| {
        nix::unistd::sysconf(nix::unistd::SysconfVar::ARG_MAX)
            .ok()
            .flatten()
            .and_then(|v| usize::try_from(v).ok())
            .unwrap_or(2 * 1024 * 1024)
    })
}

/// Refuses a job whose command and `env` could never be executed: one
/// string over MAX_ARG_STRLEN, or all of them over ARG_MAX (less
/// [`ENV_RESERVE`]); every run of it would be `not_started`.
fn exec_space(src: &Source, rj: &RawJob, command: &Command, errors: &mut Vec<ConfigError>) {
    // Each string takes its bytes, a NUL and a pointer.
    let cost = |len: usize| len + 1 + std::mem::size_of::<usize>();
    let argv: Vec<usize> = match command {
        Command::Argv(args) => args.iter().map(String::len).collect(),
        Command::Shell(s) => vec!["/bin/sh".len(), "-c".len(), s.len()],
    };
    let mut total: usize = argv.iter().map(|l| cost(*l)).sum();
    if let Some(longest) = argv.iter().max().filter(|l| **l + 1 > MAX_ARG_STRLEN) {
        errors.push(src.at(
            &rj.command,
            format!(
                "an argument of the command is {longest} bytes, over the OS limit of {MAX_ARG_STRLEN} bytes for one (MAX_ARG_STRLEN): it could never be started"
            ),
        ));
    }
    let mut largest: Option<&Spanned<String>> = None;
    for (k, v) in rj.env.iter().flatten() {
        let len = k.get_ref().len() + 1 + v.get_ref().len();
        total += cost(len);
        if len + 1 > MAX_ARG_STRLEN {
            errors.push(src.at(
                v,
                format!(
                    "environment variable {:?} is {len} bytes as NAME=value, over the OS limit of {MAX_ARG_STRLEN} bytes for one (MAX_ARG_STRLEN): the job could never be started",
                    k.get_ref()
                ),
            ));
        }
        if largest.is_none_or(|l| l.get_ref().len() < v.get_ref().len()) {
            largest = Some(v);
        }
    }
    let arg_max = arg_max();
    if total > arg_max.saturating_sub(ENV_RESERVE) {
        let message = format!(
            "the command and env take {total} bytes, over the OS argument limit of {arg_max} bytes (ARG_MAX, less {ENV_RESERVE} kept for the variables cronlease adds): the job could never be started"
        );
        errors.push(match largest {
            Some(v) => src.at(v, message),
            None => src.at(&rj.command, message),
        });
    }
}

fn command_of(
    src: &Source,
    v: &Spanned<toml::Value>,
    what: &str,
    errors: &mut Vec<ConfigError>,
) -> Option<Command> {
    match v.get_ref() {
        toml::Value::String(s) if s.contains('\0') => {
            errors.push(src.at(v, format!("{what} contains a NUL byte")));
            None
        }
        toml::Value::Array(items)
            if items
                .iter()
                .any(|v| v.as_str().is_some_and(|a| a.contains('\0'))) =>
        {
            errors.push(src.at(v, format!("{what}: an argument contains a NUL byte")));
            None
        }
        toml::Value::String(s) if !s.trim().is_empty() => Some(Command::Shell(s.clone())),
        toml::Value::String(_) => {
            errors.push(src.at(
                v,
                format!("empty {what}: expected a shell string or an argv array"),
            ));
            None
        }
        toml::Value::Array(items) => {
            let argv: Option<Vec<String>> = items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect();
            match argv {
                Some(argv) if argv.first().is_some_and(|a| !a.trim().is_empty()) => {
                    Some(Command::Argv(argv))
                }
                Some(_) => {
                    errors.push(src.at(
                        v,
                        format!(
                            "empty {what}: the argv array needs a program as its first element"
                        ),
                    ));
                    None
                }
                None => {
                    errors.push(src.at(
                        v,
                        format!("invalid {what}: every argv element must be a string"),
                    ));
                    None
                }
            }
        }
        other => {
            errors.push(src.at(
                v,
                format!(
                    "invalid {what}: expected a string or an array of strings, found {}",
                    other.type_str()
                ),
            ));
            None
        }
    }
}

/// `output_tail` unless set.
pub const DEFAULT_OUTPUT_TAIL: usize = 8 * 1024;
/// The largest `output_tail`: a history record stays well inside every
/// store's row, value and message limits (history writes are also split
/// by size, [`crate::store::run_groups`]).
pub const MAX_OUTPUT_TAIL: usize = 64 * 1024;

/// A size such as `8KiB`, `1 MiB`, `512B` or `0` (bytes), at most `max`.
fn byte_size(
    src: &Source,
    v: &Spanned<String>,
    what: &str,
    max: usize,
    errors: &mut Vec<ConfigError>,
) -> Option<usize> {
    let text = v.get_ref().trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let scale: Option<usize> = match unit.trim() {
        "" | "B" => Some(1),
        "KiB" => Some(1024),
        "MiB" => Some(1024 * 1024),
        _ => None,
    };
    let bytes = digits
        .parse::<usize>()
        .ok()
        .zip(scale)
        .and_then(|(n, scale)| n.checked_mul(scale));
    match bytes {
        Some(n) if n <= max => Some(n),
        Some(_) => {
            errors.push(src.at(
                v,
                format!("{what} {text:?} is too large: at most {} KiB", max / 1024),
            ));
            None
        }
        None => {
            errors.push(src.at(
                v,
                format!("invalid {what} {text:?}: expected bytes, e.g. \"8KiB\", \"1MiB\", \"512B\" or \"0\""),
            ));
            None
        }
    }
}

/// Resolves a job's `user`/`group`; only a daemon running as root may switch.
fn identity(src: &Source, rj: &RawJob, errors: &mut Vec<ConfigError>) -> Option<Identity> {
    use nix::unistd::{Group, User, geteuid};
    if rj.user.is_none() && rj.group.is_none() {
        return None;
    }
    let first = rj.user.as_ref().or(rj.group.as_ref())?;
    if !geteuid().is_root() {
        errors.push(src.at(
            first,
            format!("user/group needs the daemon to run as root (it runs as uid {}); remove it or run cronlease as root", geteuid()),
        ));
        return None;
    }
    let user = match &rj.user {
        Some(u) => match User::from_name(u.get_ref()) {
            Ok(Some(user)) => Some(user),
            _ => {
                errors.push(src.at(u, format!("unknown user {:?}", u.get_ref())));
                return None;
            }
        },
        None => None,
    };
    let gid = match &rj.group {
        Some(g) => match Group::from_name(g.get_ref()) {
            Ok(Some(group)) => group.gid.as_raw(),
            _ => {
                errors.push(src.at(g, format!("unknown group {:?}", g.get_ref())));
                return None;
            }
        },
        None => user.as_ref().map_or(0, |u| u.gid.as_raw()),
    };
    Some(Identity {
        uid: user.as_ref().map_or(0, |u| u.uid.as_raw()),
        gid,
        user: user.map(|u| (u.name, u.dir)),
    })
}

/// Warns when `path` can be read by users other than its owner and group.
fn warn_if_world_readable(path: &Path, what: &str, warnings: &mut Vec<String>) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o004 != 0 {
            warnings.push(format!(
                "{} {what} and is readable by other users (mode {mode:04o}); run: chmod o-r {}",
                path.display(),
                path.display()
            ));
        }
    }
}

/// `tls_ca_file`, `tls_cert_file`, `tls_key_file`: files that exist, the
/// client pair complete, on a store that speaks TLS.
fn tls_files(
    src: &Source,
    s: &raw::RawStore,
    base: &Path,
    url: Option<&StoreUrl>,
    errors: &mut Vec<ConfigError>,
) -> Option<TlsFiles> {
    let mut file = |v: &Option<Spanned<String>>, what: &str| -> Option<PathBuf> {
        let v = v.as_ref()?;
        let path = base.join(v.get_ref());
        if let Err(e) = std::fs::metadata(&path) {
            errors.push(src.at(v, format!("cannot read {what} {}: {e}", path.display())));
        }
        Some(path)
    };
    let ca = file(&s.tls_ca_file, "store.tls_ca_file");
    let cert = file(&s.tls_cert_file, "store.tls_cert_file");
    let key = file(&s.tls_key_file, "store.tls_key_file");
    let client = match (cert, key) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => {
            let at = s.tls_cert_file.as_ref().or(s.tls_key_file.as_ref());
            errors.push(src.error_at(
                at.map(Spanned::span),
                "store.tls_cert_file and store.tls_key_file go together",
            ));
            None
        }
    };
    if ca.is_none() && client.is_none() {
        return None;
    }
    let first = s
        .tls_ca_file
        .as_ref()
        .or(s.tls_cert_file.as_ref())
        .or(s.tls_key_file.as_ref());
    match url.map(StoreUrl::kind) {
        Some(StoreKind::Sqlite { .. }) => errors.push(src.error_at(
            first.map(Spanned::span),
            "TLS settings given for a sqlite:// store, which has no network connection",
        )),
        Some(StoreKind::Redis) if url.is_some_and(|u| !u.expose().starts_with("rediss://")) => {
            errors.push(src.error_at(
                first.map(Spanned::span),
                "TLS settings need a rediss:// URL",
            ))
        }
        Some(StoreKind::Redlock(masters))
            if masters.iter().any(|m| !m.expose().starts_with("rediss://")) =>
        {
            errors.push(src.error_at(
                first.map(Spanned::span),
                "TLS settings need rediss:// URLs for every master in store.urls",
            ))
        }
        Some(StoreKind::ZooKeeper(_)) => errors.push(src.error_at(
            first.map(Spanned::span),
            "TLS to ZooKeeper is not supported yet: use zk:// on a trusted network",
        )),
        Some(StoreKind::Etcd(t)) if !t.tls => errors.push(src.error_at(
            first.map(Spanned::span),
            "TLS settings need an etcds:// URL",
        )),
        Some(StoreKind::RedisSentinel(_)) => errors.push(src.error_at(
            first.map(Spanned::span),
            "TLS to Redis through Sentinel is not supported yet: use redis+sentinel:// on a trusted network, or rediss:// to one master",
        )),
        _ => {}
    }
    Some(TlsFiles { ca, client })
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
