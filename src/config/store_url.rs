//! The store's URL: each backend's scheme and its parsing (servers,
//! user, password, chroot, TLS), and the redaction that keeps a password
//! out of every message ([`StoreUrl`]).

use super::*;

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

/// `host:port` of a server as a client connects to it, an IPv6 address in
/// brackets (`[::1]:2379`).
pub fn host_port((host, port): &(String, u16)) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

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
pub(super) const MAX_WAIT_REPLICAS: u32 = 64;

/// `host[:port],host[:port]` (IPv6 as `[addr]:port`), `default_port` where
/// none is given; `what` names a server in messages.
pub(super) fn parse_servers(
    hosts: &str,
    default_port: u16,
    what: &str,
) -> Result<Vec<(String, u16)>, String> {
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
pub(super) fn split_userinfo(rest: &str) -> Result<(Option<&str>, &str), String> {
    match rest.rsplit_once('@') {
        None => Ok((None, rest)),
        Some((u, _)) if u.split(':').next().is_some_and(|user| user.contains(['/', '?', '#', ','])) => {
            Err("an @ after the hosts: percent-encode it (%40), or put the user and password before the hosts (user:password@host)".into())
        }
        Some((u, h)) => Ok((Some(u), h)),
    }
}

/// `user[:password]` of a URL's userinfo, percent-decoded; empty parts are none.
pub(super) fn parse_userinfo(userinfo: Option<&str>) -> (Option<String>, Option<String>) {
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
pub(super) fn parse_zk(rest: &str) -> Result<(ZkTarget, Option<String>), String> {
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
pub(super) fn parse_etcd(rest: &str, tls: bool) -> Result<(EtcdTarget, Option<String>), String> {
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
pub(super) fn parse_sentinel(rest: &str) -> Result<(SentinelTarget, Option<String>), String> {
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
    pub(super) kind: StoreKind,
    pub(super) url: String,
    pub(super) redacted: String,
    pub(super) secret: Option<String>,
}

/// Every scheme [`StoreUrl::parse`] accepts, in the order the docs list
/// them (docs/configuration.md, "Store URLs"). Redlock's masters are
/// `redis://` or `rediss://` URLs under `store.urls`.
pub const SCHEMES: [&str; 11] = [
    "sqlite",
    "mysql",
    "mariadb",
    "postgres",
    "postgresql",
    "redis",
    "rediss",
    "redis+sentinel",
    "zk",
    "etcd",
    "etcds",
];

/// [`SCHEMES`] as an error message lists them: `sqlite://, …, or etcds://`.
fn scheme_list() -> String {
    let all: Vec<String> = SCHEMES.iter().map(|s| format!("{s}://")).collect();
    match all.split_last() {
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
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
                    "unsupported store URL scheme {other:?}: expected {}",
                    scheme_list()
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
    pub(super) fn host_port(&self) -> Option<(String, u16)> {
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
    pub(super) fn own_secret_forms(&self) -> Vec<String> {
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
pub(super) fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// The password a URL carries in its query (`?password=...`, which the
/// PostgreSQL driver accepts), if any.
pub(super) fn query_password(u: &url::Url) -> Option<String> {
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
pub(super) fn redact_sentinel_url(raw: &str) -> Option<String> {
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

pub(super) fn redact_unparsed(raw: &str) -> String {
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
