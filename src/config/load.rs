//! Loading: the main file, its `[store]` section and every job file it
//! names, into a validated [`Config`]; every problem found, not the first.

use super::*;

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

    let node = node_name(&src, &raw, &mut errors);
    let node_tags = match raw.node.as_ref().map(|n| n.get_ref()) {
        Some(RawNode::Table(RawNodeTable {
            tags: Some(list), ..
        })) => tags(&src, list, "node.tags", &mut errors),
        _ => Some(Tags::default()),
    };

    refuse_nuls(&src, &raw, &mut errors);
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
    let http_listen = http_listen(&src, &raw, &mut errors);
    let public_url = public_url(&src, &raw, &mut errors);
    let http_access = access::http_access(&src, &raw, &base, &mut errors, &mut warnings);
    let log = log_config(&src, &raw, &mut errors);

    let (mut jobs, job_files) = load_jobs(&src, &raw, path, &base, &mut errors, &mut warnings);
    let job_names: Vec<&str> = jobs.iter().map(|j| j.name.as_str()).collect();
    let webhooks = notify::webhooks(
        &src,
        &raw.notify,
        &base,
        &job_names,
        &mut errors,
        &mut warnings,
    );

    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    jobs.sort_by(|a, b| a.name.cmp(&b.name));
    match (node, node_tags, store) {
        (Some(node), Some(tags), Some(store)) => Ok(Config {
            path: path.to_path_buf(),
            node,
            tags,
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
            public_url,
            http_access,
            state_dir: raw.state_dir.as_ref().map(|d| base.join(d.get_ref())),
            webhooks,
            log,
            runner: raw.jobs.runner.unwrap_or_default(),
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

/// The node's name: `node` (or `[node] name`), or this host's name.
fn node_name(src: &Source, raw: &RawConfig, errors: &mut Vec<ConfigError>) -> Option<NodeName> {
    let written = match raw.node.as_ref() {
        Some(n) => match n.get_ref() {
            RawNode::Name(name) => Some(Spanned::new(n.span(), name.clone())),
            RawNode::Table(t) => t.name.clone(),
        },
        None => None,
    };
    match &written {
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
    }
}

/// Every path, URL and prefix without a NUL byte (the OS cannot take one).
fn refuse_nuls(src: &Source, raw: &RawConfig, errors: &mut Vec<ConfigError>) {
    for (v, what) in [
        (&raw.pid_file, "pid_file"),
        (&raw.state_dir, "state_dir"),
        (&raw.jobs.dir, "jobs.dir"),
        (&raw.store.url, "store.url"),
        (&raw.store.password_file, "store.password_file"),
        (&raw.store.key_prefix, "store.key_prefix"),
        (&raw.store.tls_ca_file, "store.tls_ca_file"),
        (&raw.store.tls_cert_file, "store.tls_cert_file"),
        (&raw.store.tls_key_file, "store.tls_key_file"),
    ] {
        if let Some(v) = v {
            refuse_nul(src, v, what, errors);
        }
    }
    for u in raw.store.urls.iter().flat_map(|l| l.get_ref()) {
        refuse_nul(src, u, "store.urls", errors);
    }
    for n in &raw.notify {
        if let Some(f) = &n.secret_file {
            refuse_nul(src, f, "notify secret_file", errors);
        }
    }
    for h in raw.http.iter().chain(raw.metrics.iter()) {
        for (v, what) in [
            (&h.tokens_file, "http.tokens_file"),
            (&h.tls_cert_file, "http.tls_cert_file"),
            (&h.tls_key_file, "http.tls_key_file"),
        ] {
            if let Some(v) = v {
                refuse_nul(src, v, what, errors);
            }
        }
    }
}

/// `[http] public_url`: an http(s) URL, for links to the dashboard.
fn public_url(src: &Source, raw: &RawConfig, errors: &mut Vec<ConfigError>) -> Option<url::Url> {
    let v = raw.http.as_ref().and_then(|h| h.public_url.as_ref())?;
    match url::Url::parse(v.get_ref()) {
        Ok(u) if matches!(u.scheme(), "http" | "https") => Some(u),
        _ => {
            errors.push(src.at(
                v,
                format!(
                    "invalid http.public_url {:?}: expected an http:// or https:// URL such as \"https://cron.example.com/\"",
                    v.get_ref()
                ),
            ));
            None
        }
    }
}

/// `[http] listen` (or its old name, `[metrics] listen`).
fn http_listen(src: &Source, raw: &RawConfig, errors: &mut Vec<ConfigError>) -> Option<SocketAddr> {
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
    http_table.and_then(|(h, key)| {
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
    })
}

/// `[log]`: the format, and a level tracing accepts.
fn log_config(src: &Source, raw: &RawConfig, errors: &mut Vec<ConfigError>) -> LogConfig {
    LogConfig {
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
    }
}

/// The jobs: those of the main file, then those of every `*.toml` of
/// `jobs.dir` (default `jobs.d` beside it), in file order; and the files
/// read.
fn load_jobs(
    src: &Source,
    raw: &RawConfig,
    path: &Path,
    base: &Path,
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<String>,
) -> (Vec<Job>, Vec<PathBuf>) {
    let defaults = JobDefaults {
        runner: raw.jobs.runner.unwrap_or_default(),
        jitter: raw
            .jobs
            .default_jitter
            .as_ref()
            .and_then(|v| jitter(src, v, "jobs.default_jitter", errors))
            .unwrap_or(Duration::ZERO),
    };
    let mut jobs = Vec::new();
    let mut seen: HashMap<String, String> = HashMap::new();
    let mut job_files = vec![path.to_path_buf()];
    for rj in &raw.job {
        if let Some(job) = validate_job(src, rj, base, &mut seen, &defaults, errors, warnings) {
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
                let Some(jsrc) = read_source(&file, errors) else {
                    continue;
                };
                if let Some(jf) = parse_toml::<RawJobFile>(&jsrc, errors) {
                    for rj in &jf.job {
                        if let Some(job) =
                            validate_job(&jsrc, rj, base, &mut seen, &defaults, errors, warnings)
                        {
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
    (jobs, job_files)
}

pub(super) fn load_store(
    src: &Source,
    raw: &RawConfig,
    base: &Path,
    overrides: &Overrides,
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<String>,
) -> Option<StoreConfig> {
    let s = &raw.store;
    let url = store_url(src, raw, base, overrides, errors, warnings);
    let url = with_password_file(src, s, base, url, errors, warnings);
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

/// The store's URL: `$CRONLEASE_STORE_URL`, else `store.url` or
/// `store.urls` (Redlock's masters; not both), else the embedded SQLite
/// default. A file that holds a password is warned about when others may
/// read it.
fn store_url(
    src: &Source,
    raw: &RawConfig,
    base: &Path,
    overrides: &Overrides,
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<String>,
) -> Option<StoreUrl> {
    let s = &raw.store;
    match (&overrides.store_url, &s.url) {
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
    }
}

/// `url` with the password of `store.password_file`, when one is set: the
/// file's text less its final line break, never empty.
fn with_password_file(
    src: &Source,
    s: &raw::RawStore,
    base: &Path,
    url: Option<StoreUrl>,
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<String>,
) -> Option<StoreUrl> {
    match (url, &s.password_file) {
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
    }
}
