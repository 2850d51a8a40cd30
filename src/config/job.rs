//! One job's definition checked and turned into a [`Job`]: its command
//! (and whether it fits the OS's argument limits), identity, output tail,
//! and the store's TLS files.

use super::*;
use raw::RawRetry;

pub(super) fn validate_job(
    src: &Source,
    rj: &RawJob,
    base: &Path,
    seen: &mut HashMap<String, String>,
    defaults: &JobDefaults,
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<String>,
) -> Option<Job> {
    let before = errors.len();
    let name = if rj.name.get_ref().contains(SHARD_SEPARATOR) {
        errors.push(src.at(
            &rj.name,
            format!(
                "invalid job name {:?}: '{SHARD_SEPARATOR}' is kept for the locks of broadcast jobs' shards",
                rj.name.get_ref()
            ),
        ));
        None
    } else {
        JobName::parse(rj.name.get_ref())
            .map_err(|m| errors.push(src.at(&rj.name, m)))
            .ok()
    };
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
    let mut zone = rj.timezone.as_ref().map_or("UTC", |z| z.get_ref().as_str());
    if let Some(z) = &rj.timezone
        && let Err(e) = crate::schedule::parse_zone(z.get_ref())
    {
        errors.push(src.at(z, e.to_string()));
        // The schedule is still checked, in UTC: its own mistakes are
        // reported now, not after the zone is fixed.
        zone = "UTC";
    }
    let jitter = match &rj.jitter {
        Some(v) => jitter(src, v, "jitter", errors),
        None => Some(defaults.jitter),
    };
    let schedule = match Schedule::parse(rj.schedule.get_ref(), zone) {
        Ok(s) => match (&name, jitter) {
            (Some(name), Some(jitter)) => Some(s.with_jitter(name.as_str(), jitter)),
            _ => None,
        },
        Err(crate::schedule::ScheduleError::UnknownZone { .. }) => None,
        Err(e) => {
            errors.push(src.at(&rj.schedule, e.to_string()));
            None
        }
    };
    let command = command_of(src, &rj.command, "command", errors);
    let every_node = rj.placement.as_ref().is_some_and(|p| {
        let every = *p.get_ref() == JobPlacement::EveryNode;
        if every && rj.name.get_ref().len() > MAX_BROADCAST_NAME {
            errors.push(src.at(
                &rj.name,
                format!(
                    "a job with placement = \"every_node\" has a name of at most {MAX_BROADCAST_NAME} characters (its shards' locks add the node's)"
                ),
            ));
        }
        if every && rj.overlap == Some(Overlap::Replace) {
            errors.push(src.at(
                p,
                "placement = \"every_node\" cannot be combined with overlap = \"replace\" (yet): a shard whose run still goes is skipped",
            ));
        }
        // Not yet: a retry's and a redelivery's requests carry no shard.
        if every && rj.retry.is_some() {
            errors.push(src.at(
                p,
                "placement = \"every_node\" cannot be combined with retry (yet): a shard's run is not tried again",
            ));
        }
        if every && rj.delivery == Some(Delivery::AtLeastOnce) {
            errors.push(src.at(
                p,
                "placement = \"every_node\" cannot be combined with delivery = \"at_least_once\" (yet)",
            ));
        }
        every
    });
    let run_on = match &rj.run_on {
        Some(list) => tags(src, list, "run_on", errors),
        None => Some(Tags::default()),
    };
    let [on_failure, on_success, on_recovery] = [
        (&rj.on_failure, Hook::Failure),
        (&rj.on_success, Hook::Success),
        (&rj.on_recovery, Hook::Recovery),
    ]
    .map(|(v, hook)| {
        v.as_ref()
            .and_then(|v| command_of(src, v, hook.key(), errors))
    });
    let timeout = rj
        .timeout
        .as_ref()
        .and_then(|t| duration(src, t, "timeout", errors));
    // Shorter, a claim's answer would often come after it, and every
    // occurrence would be recorded missed.
    let starting_deadline = rj.starting_deadline.as_ref().and_then(|t| {
        duration_within(
            src,
            t,
            "starting_deadline",
            MIN_STARTING_DEADLINE,
            MAX_DURATION,
            errors,
        )
    });
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
    let mut nul_free = true;
    for (v, what) in [
        (&rj.working_dir, "working_dir"),
        (&rj.user, "user"),
        (&rj.group, "group"),
    ] {
        if let Some(v) = v {
            nul_free &= refuse_nul(src, v, what, errors);
        }
    }
    let output_tail = match &rj.output_tail {
        Some(v) => byte_size(src, v, "output_tail", MAX_OUTPUT_TAIL, errors),
        None => Some(DEFAULT_OUTPUT_TAIL),
    };
    // Checked whatever else is wrong: `check` reports every mistake.
    let retry = rj.retry.as_ref().and_then(|r| retry(src, r, errors));
    let working_dir = rj.working_dir.as_ref().map(|w| base.join(w.get_ref()));
    // A name with a NUL is no user to look up: said once, above.
    let identity = if nul_free {
        identity(src, rj, defaults.runner, errors)
    } else {
        None
    };
    let isolation = isolation(src, rj, base, errors);
    if errors.len() > before {
        return None;
    }
    if let Some(command) = &command {
        super::present::check_present(src, rj, command, working_dir.as_deref(), &env, warnings);
    }
    Some(Job {
        name: name?,
        schedule: schedule?,
        command: command?,
        timeout,
        kill_grace,
        misfire: rj.misfire.unwrap_or_default(),
        starting_deadline,
        delivery: rj.delivery.unwrap_or_default(),
        overlap: rj.overlap.unwrap_or_default(),
        run_on: run_on?,
        every_node,
        env,
        working_dir,
        identity: identity.map(Box::new),
        output_tail: output_tail?,
        on_failure,
        on_success,
        on_recovery,
        retry: retry.map(Box::new),
        isolation: (isolation != Isolation::default()).then(|| Box::new(isolation)),
        defined_at: here,
    })
}

/// The shortest `retry.backoff`.
pub const MIN_RETRY_BACKOFF: Duration = Duration::from_secs(1);
/// The longest `retry.backoff` and `max_backoff`.
pub const MAX_RETRY_BACKOFF: Duration = Duration::from_secs(24 * 3600);
/// `retry.backoff` unless set.
pub const DEFAULT_RETRY_BACKOFF: Duration = Duration::from_secs(30);
/// `retry.max_backoff` unless set (or `backoff`, if that is longer).
pub const DEFAULT_RETRY_MAX_BACKOFF: Duration = Duration::from_secs(600);

/// A job's `retry` table checked: every mistake in it reported.
fn retry(src: &Source, r: &Spanned<RawRetry>, errors: &mut Vec<ConfigError>) -> Option<Retry> {
    let before = errors.len();
    let raw = r.get_ref();
    let max = crate::store::MAX_RETRY_ATTEMPTS;
    let attempts = match u32::try_from(*raw.attempts.get_ref()) {
        Ok(n) if (2..=max).contains(&n) => Some(n),
        _ => {
            errors.push(src.at(
                &raw.attempts,
                format!(
                    "retry.attempts {} is out of range: 2 to {max} (it counts the first run: 2 is one retry)",
                    raw.attempts.get_ref()
                ),
            ));
            None
        }
    };
    let backoff = match &raw.backoff {
        Some(v) => duration_within(
            src,
            v,
            "retry.backoff",
            MIN_RETRY_BACKOFF,
            MAX_RETRY_BACKOFF,
            errors,
        ),
        None => Some(DEFAULT_RETRY_BACKOFF),
    };
    let max_backoff = match &raw.max_backoff {
        Some(v) => bounded_duration(src, v, "retry.max_backoff", MAX_RETRY_BACKOFF, errors)
            .and_then(|d| match backoff {
                Some(b) if d < b => {
                    errors.push(src.at(
                        v,
                        format!(
                            "retry.max_backoff {:?} is shorter than retry.backoff ({})",
                            v.get_ref(),
                            humantime::format_duration(b)
                        ),
                    ));
                    None
                }
                _ => Some(d),
            }),
        None => backoff.map(|b| b.max(DEFAULT_RETRY_MAX_BACKOFF)),
    };
    let mut on: Vec<crate::store::Outcome> = Vec::new();
    match &raw.on {
        None => on.extend(
            RETRY_OUTCOMES
                .iter()
                .map(|o| crate::store::Outcome::parse(o)),
        ),
        Some(list) if list.is_empty() => {
            errors.push(src.at(
                r,
                format!(
                    "retry.on is empty: name the outcomes to try again ({}), or drop `retry`",
                    RETRY_OUTCOMES.join(", ")
                ),
            ));
        }
        Some(list) => {
            for o in list {
                if !RETRY_OUTCOMES.contains(&o.get_ref().as_str()) {
                    errors.push(src.at(
                        o,
                        format!(
                            "retry.on: unknown outcome {:?}: expected one of {}",
                            o.get_ref(),
                            RETRY_OUTCOMES.join(", ")
                        ),
                    ));
                } else {
                    let outcome = crate::store::Outcome::parse(o.get_ref());
                    if !on.contains(&outcome) {
                        on.push(outcome);
                    }
                }
            }
        }
    }
    if errors.len() > before {
        return None;
    }
    // One order, whatever the file's: the definition's digest compares it.
    on.sort_by_key(|o| RETRY_OUTCOMES.iter().position(|x| *x == o.as_str()));
    Some(Retry {
        attempts: attempts?,
        backoff: backoff?,
        max_backoff: max_backoff?,
        on,
    })
}

/// What `[jobs]` in the main file gives every job that does not say.
pub(super) struct JobDefaults {
    /// `jobs.runner`.
    pub runner: RunnerChoice,
    /// `jobs.default_jitter` (zero: none).
    pub jitter: Duration,
}

/// A `jitter` (or `jobs.default_jitter`): whole seconds, zero for none, at
/// most [`MAX_DURATION`] (the gap to the next occurrence bounds it anyway).
pub(super) fn jitter(
    src: &Source,
    v: &Spanned<String>,
    what: &str,
    errors: &mut Vec<ConfigError>,
) -> Option<Duration> {
    let text = v.get_ref().trim();
    if text == "0" || humantime::parse_duration(text).is_ok_and(|d| d.is_zero()) {
        return Some(Duration::ZERO);
    }
    let d = bounded_duration(src, v, what, MAX_DURATION, errors)?;
    if d.subsec_nanos() != 0 {
        errors.push(src.at(
            v,
            format!(
                "{what} {:?} is not a whole number of seconds (occurrences fall on whole seconds)",
                v.get_ref()
            ),
        ));
        return None;
    }
    Some(d)
}

/// The shortest `starting_deadline`.
pub const MIN_STARTING_DEADLINE: Duration = Duration::from_secs(1);

/// A command (`command`, a hook): a string runs as `/bin/sh -c`, an
/// array is an argv.
/// The longest single argument or `NAME=value` string the kernel's exec
/// takes (Linux's MAX_ARG_STRLEN: 32 pages).
pub(super) const MAX_ARG_STRLEN: usize = 32 * 4096;
/// Room kept, within the OS argument limit, for what a run's environment
/// gets beside `env` (CRONLEASE_*, what the daemon passes on: PATH, HOME).
pub(super) const ENV_RESERVE: usize = 32 * 1024;

/// The OS argument limit (ARG_MAX: argv and environment together), as
/// this process sees it; 2 MiB, Linux's usual value, if it cannot tell.
/// Asked once: every job of every load checks against it.
pub(super) fn arg_max() -> usize {
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
pub(super) fn exec_space(
    src: &Source,
    rj: &RawJob,
    command: &Command,
    errors: &mut Vec<ConfigError>,
) {
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

pub(super) fn command_of(
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
pub(super) fn byte_size(
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

/// Resolves a job's `user`/`group`. A daemon starting its runs as
/// processes must run as root to switch; systemd switches for a daemon
/// starting them as units (`runner = "systemd"`, or `auto` on a host booted
/// with systemd).
pub(super) fn identity(
    src: &Source,
    rj: &RawJob,
    runner: RunnerChoice,
    errors: &mut Vec<ConfigError>,
) -> Option<Identity> {
    use nix::unistd::{Group, User, geteuid};
    if rj.user.is_none() && rj.group.is_none() {
        return None;
    }
    let first = rj.user.as_ref().or(rj.group.as_ref())?;
    let systemd_may_switch = match runner {
        RunnerChoice::Systemd => true,
        RunnerChoice::Auto => crate::systemd::booted(),
        RunnerChoice::Process => false,
    };
    if !geteuid().is_root() && !systemd_may_switch {
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
pub(super) fn warn_if_world_readable(path: &Path, what: &str, warnings: &mut Vec<String>) {
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
pub(super) fn tls_files(
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
