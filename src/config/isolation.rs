//! What a run may use and see, per job: `[job.limits]` (memory, CPU,
//! tasks, IO and CPU weight, nice, open files), `[job.sandbox]` (an
//! allow-list of systemd's sandbox properties, over a safe default set) and
//! `credentials` (files systemd hands the run, never in the TOML or the
//! environment); and `[jobs] runner`, which picks who starts the runs.
//! Which runner honours which setting is [`Isolation::unenforced`]'s
//! answer, and docs/configuration.md's table.

use super::*;
use raw::RawLimits;

/// `[jobs] runner`: who starts the runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunnerChoice {
    /// `systemd` when PID 1 is systemd, its bus answers and lets this
    /// daemon start units; else `process`.
    #[default]
    Auto,
    /// Each run a transient systemd service ([`crate::units`]).
    Systemd,
    /// Each run a process group of the job guard ([`crate::guard`]).
    Process,
}

/// The runner a daemon uses, once `auto` is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunnerKind {
    Systemd,
    Process,
}

impl RunnerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RunnerKind::Systemd => "systemd",
            RunnerKind::Process => "process",
        }
    }
}

/// `[job.limits]`: resource limits of one run. `None`: not limited.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    /// `memory_max`, bytes (systemd `MemoryMax=`).
    pub memory_max: Option<u64>,
    /// `cpu_quota`, percent of one CPU (`CPUQuota=`).
    pub cpu_quota: Option<u32>,
    /// `tasks_max`: processes and threads (`TasksMax=`).
    pub tasks_max: Option<u64>,
    /// `io_weight`, 1 to 10000 (`IOWeight=`).
    pub io_weight: Option<u64>,
    /// `cpu_weight`, 1 to 10000 (`CPUWeight=`).
    pub cpu_weight: Option<u64>,
    /// `nice`, -20 to 19 (`Nice=`; `setpriority` in process mode).
    pub nice: Option<i32>,
    /// `open_files` (`LimitNOFILE=`; `RLIMIT_NOFILE` in process mode).
    pub open_files: Option<u64>,
}

/// How a sandbox property's value is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxKind {
    /// `true` or `false` (D-Bus `b`).
    Bool,
    /// `true`, `false` or one of these words (D-Bus `s`: `yes`, `no` or
    /// the word).
    Word(&'static [&'static str]),
    /// A list of absolute paths, each may start with `-` (ignored when
    /// missing) (D-Bus `as`).
    Paths,
}

/// The sandbox properties a job may set (systemd's names and meanings,
/// systemd.exec(5)), and how each is written.
pub const SANDBOX_KEYS: &[(&str, SandboxKind)] = &[
    ("ProtectSystem", SandboxKind::Word(&["full", "strict"])),
    ("ProtectHome", SandboxKind::Word(&["read-only", "tmpfs"])),
    ("ReadWritePaths", SandboxKind::Paths),
    ("ReadOnlyPaths", SandboxKind::Paths),
    ("InaccessiblePaths", SandboxKind::Paths),
    ("PrivateTmp", SandboxKind::Bool),
    ("PrivateDevices", SandboxKind::Bool),
    ("PrivateNetwork", SandboxKind::Bool),
    ("NoNewPrivileges", SandboxKind::Bool),
    ("RestrictSUIDSGID", SandboxKind::Bool),
    ("MemoryDenyWriteExecute", SandboxKind::Bool),
    ("LockPersonality", SandboxKind::Bool),
    ("RestrictRealtime", SandboxKind::Bool),
    ("ProtectKernelTunables", SandboxKind::Bool),
    ("ProtectKernelModules", SandboxKind::Bool),
    ("ProtectKernelLogs", SandboxKind::Bool),
    ("ProtectControlGroups", SandboxKind::Bool),
    ("ProtectClock", SandboxKind::Bool),
    ("ProtectHostname", SandboxKind::Bool),
];

/// A sandbox property's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SandboxValue {
    Bool(bool),
    /// `yes`, `no` or one of the property's words.
    Word(String),
    Paths(Vec<String>),
}

/// What every run started as a systemd unit gets unless its job's
/// `[job.sandbox]` says otherwise: nothing an ordinary job needs (it may
/// write anywhere its user may but /usr, /boot and /etc, read home
/// directories, run a JIT), much that it does not. Not the kernel's
/// protections (`ProtectKernelTunables`, `...Modules`, `...Logs`,
/// `ProtectControlGroups`): a job may set them, but by default they would
/// nearly double what a unit's start costs in PID 1 (100 units at one
/// instant: 1.47 s with these, 2.72 s with those too; docs/benchmarks.md).
pub const SANDBOX_DEFAULTS: &[(&str, SandboxDefault)] = &[
    ("ProtectSystem", SandboxDefault::Word("full")),
    ("PrivateTmp", SandboxDefault::Bool(true)),
    ("NoNewPrivileges", SandboxDefault::Bool(true)),
    ("RestrictSUIDSGID", SandboxDefault::Bool(true)),
    ("LockPersonality", SandboxDefault::Bool(true)),
];

/// A value of [`SANDBOX_DEFAULTS`].
#[derive(Debug, Clone, Copy)]
pub enum SandboxDefault {
    Bool(bool),
    Word(&'static str),
}

/// One job's limits, sandbox and credentials, as configured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Isolation {
    pub limits: Limits,
    /// The job's own `[job.sandbox]` settings, by property name (the
    /// defaults are not in it: [`Isolation::sandbox`]).
    pub sandbox: BTreeMap<&'static str, SandboxValue>,
    /// `credentials`: name → the file systemd loads it from.
    pub credentials: BTreeMap<String, PathBuf>,
}

impl Isolation {
    /// The sandbox a unit gets: [`SANDBOX_DEFAULTS`] with the job's own
    /// settings over them.
    pub fn sandbox(&self) -> BTreeMap<&'static str, SandboxValue> {
        let mut all: BTreeMap<&'static str, SandboxValue> = SANDBOX_DEFAULTS
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    SandboxDefault::Bool(b) => SandboxValue::Bool(*b),
                    SandboxDefault::Word(w) => SandboxValue::Word((*w).to_string()),
                };
                (*k, v)
            })
            .collect();
        all.extend(self.sandbox.iter().map(|(k, v)| (*k, v.clone())));
        all
    }

    /// The settings `runner` cannot enforce, one phrase each, for the
    /// one-line WARN at load; `lacking`: the cgroup controllers the
    /// runner's runs do not get (systemd units on a host without them, or
    /// processes: all of them without a cgroup per run, [`crate::cgroup`]).
    pub fn unenforced(&self, runner: RunnerKind, lacking: &[&str]) -> Vec<String> {
        let l = &self.limits;
        let cgroup_limits = [
            ("memory_max", "memory", l.memory_max.is_some()),
            ("cpu_quota", "cpu", l.cpu_quota.is_some()),
            ("tasks_max", "pids", l.tasks_max.is_some()),
            ("io_weight", "io", l.io_weight.is_some()),
            ("cpu_weight", "cpu", l.cpu_weight.is_some()),
        ];
        let mut out: Vec<String> = cgroup_limits
            .into_iter()
            .filter(|(_, controller, set)| *set && lacking.contains(controller))
            .map(|(k, _, _)| format!("limits.{k}"))
            .collect();
        if runner == RunnerKind::Systemd {
            return out;
        }
        out.extend(self.sandbox.keys().map(|k| format!("sandbox.{k}")));
        out.extend(self.credentials.keys().map(|k| format!("credentials.{k}")));
        out
    }
}

/// `[job.limits]`, `[job.sandbox]` and `credentials` of `rj`.
pub(super) fn isolation(
    src: &Source,
    rj: &RawJob,
    base: &Path,
    errors: &mut Vec<ConfigError>,
) -> Isolation {
    Isolation {
        limits: rj
            .limits
            .as_ref()
            .map(|l| limits(src, l, errors))
            .unwrap_or_default(),
        sandbox: rj
            .sandbox
            .iter()
            .flatten()
            .filter_map(|(k, v)| sandbox_entry(src, k, v, errors))
            .collect(),
        credentials: rj
            .credentials
            .iter()
            .flatten()
            .filter_map(|(k, v)| credential(src, k, v, base, errors))
            .collect(),
    }
}

fn limits(src: &Source, l: &RawLimits, errors: &mut Vec<ConfigError>) -> Limits {
    let int = |v: &Option<Spanned<i64>>,
               what: &str,
               range: std::ops::RangeInclusive<i64>,
               errors: &mut Vec<ConfigError>| {
        let v = v.as_ref()?;
        if range.contains(v.get_ref()) {
            Some(*v.get_ref())
        } else {
            errors.push(src.at(
                v,
                format!(
                    "limits.{what} {} is out of range: {} to {}",
                    v.get_ref(),
                    range.start(),
                    range.end()
                ),
            ));
            None
        }
    };
    let unsigned = |v: Option<i64>| v.and_then(|v| u64::try_from(v).ok());
    Limits {
        memory_max: l.memory_max.as_ref().and_then(|v| memory(src, v, errors)),
        cpu_quota: l.cpu_quota.as_ref().and_then(|v| percent(src, v, errors)),
        tasks_max: unsigned(int(&l.tasks_max, "tasks_max", 1..=4_194_304, errors)),
        io_weight: unsigned(int(&l.io_weight, "io_weight", 1..=10_000, errors)),
        cpu_weight: unsigned(int(&l.cpu_weight, "cpu_weight", 1..=10_000, errors)),
        nice: int(&l.nice, "nice", -20..=19, errors).and_then(|v| i32::try_from(v).ok()),
        open_files: unsigned(int(&l.open_files, "open_files", 1..=1 << 30, errors)),
    }
}

/// `memory_max`: bytes, or with `K`, `M`, `G`, `T` (powers of 1024, as
/// systemd reads them; `KiB`, `MiB`... too), at least 1 MiB.
fn memory(src: &Source, v: &Spanned<String>, errors: &mut Vec<ConfigError>) -> Option<u64> {
    let text = v.get_ref().trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let shift = match unit.trim() {
        "" | "B" => Some(0),
        "K" | "KiB" => Some(10),
        "M" | "MiB" => Some(20),
        "G" | "GiB" => Some(30),
        "T" | "TiB" => Some(40),
        _ => None,
    };
    let bytes = digits
        .parse::<u64>()
        .ok()
        .zip(shift)
        .and_then(|(n, s)| n.checked_mul(1 << s));
    match bytes {
        Some(n) if n >= 1 << 20 => Some(n),
        Some(_) => {
            errors.push(src.at(
                v,
                format!(
                    "limits.memory_max {text:?} is too small: at least 1M (a run could not start)"
                ),
            ));
            None
        }
        None => {
            errors.push(src.at(
                v,
                format!("invalid limits.memory_max {text:?}: expected bytes, e.g. \"512M\", \"2G\" or \"1073741824\""),
            ));
            None
        }
    }
}

/// `cpu_quota`: `"50%"` (half a CPU), `"200%"` (two), 1% to 100000%.
fn percent(src: &Source, v: &Spanned<String>, errors: &mut Vec<ConfigError>) -> Option<u32> {
    let text = v.get_ref().trim();
    match text
        .strip_suffix('%')
        .and_then(|n| n.trim().parse::<u32>().ok())
    {
        Some(n) if (1..=100_000).contains(&n) => Some(n),
        _ => {
            errors.push(src.at(
                v,
                format!("invalid limits.cpu_quota {text:?}: expected a percentage of one CPU, e.g. \"50%\" or \"200%\""),
            ));
            None
        }
    }
}

fn sandbox_entry(
    src: &Source,
    k: &Spanned<String>,
    v: &Spanned<toml::Value>,
    errors: &mut Vec<ConfigError>,
) -> Option<(&'static str, SandboxValue)> {
    let Some((name, kind)) = SANDBOX_KEYS.iter().find(|(n, _)| *n == k.get_ref()) else {
        let names: Vec<&str> = SANDBOX_KEYS.iter().map(|(n, _)| *n).collect();
        errors.push(src.at(
            k,
            format!(
                "unknown sandbox property {:?}: the allowed ones are {}",
                k.get_ref(),
                names.join(", ")
            ),
        ));
        return None;
    };
    let value = match (kind, v.get_ref()) {
        (SandboxKind::Bool, toml::Value::Boolean(b)) => Some(SandboxValue::Bool(*b)),
        (SandboxKind::Word(_), toml::Value::Boolean(b)) => {
            Some(SandboxValue::Word(if *b { "yes" } else { "no" }.into()))
        }
        (SandboxKind::Word(words), toml::Value::String(s)) if words.contains(&s.as_str()) => {
            Some(SandboxValue::Word(s.clone()))
        }
        (SandboxKind::Paths, toml::Value::Array(items)) => {
            let paths: Option<Vec<String>> = items
                .iter()
                .map(|p| {
                    p.as_str()
                        .filter(|p| p.trim_start_matches('-').starts_with('/') && !p.contains('\0'))
                        .map(str::to_string)
                })
                .collect();
            paths.map(SandboxValue::Paths)
        }
        _ => None,
    };
    if value.is_none() {
        let expected = match kind {
            SandboxKind::Bool => "true or false".to_string(),
            SandboxKind::Word(words) => format!("true, false or one of {words:?}"),
            SandboxKind::Paths => {
                "an array of absolute paths (\"-/path\": ignored when missing)".to_string()
            }
        };
        errors.push(src.at(v, format!("invalid sandbox.{name}: expected {expected}")));
    }
    value.map(|v| (*name, v))
}

/// A credential: a name a file may have (`[A-Za-z0-9_.-]`, 1 to 64, not
/// starting with a dot) and the file, absolute or relative to the
/// configuration's directory.
fn credential(
    src: &Source,
    k: &Spanned<String>,
    v: &Spanned<String>,
    base: &Path,
    errors: &mut Vec<ConfigError>,
) -> Option<(String, PathBuf)> {
    let name = k.get_ref();
    let ok = (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if !ok {
        errors.push(src.at(
            k,
            format!("invalid credential name {name:?}: 1 to 64 of A-Z a-z 0-9 _ . -, not starting with a dot"),
        ));
        return None;
    }
    if v.get_ref().is_empty() || v.get_ref().contains('\0') {
        errors.push(src.at(
            v,
            format!("invalid credentials.{name}: expected the path of the file to load it from"),
        ));
        return None;
    }
    Some((name.clone(), base.join(v.get_ref())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jobs_sandbox_goes_over_the_defaults() {
        let iso = Isolation {
            sandbox: BTreeMap::from([
                ("NoNewPrivileges", SandboxValue::Bool(false)),
                ("ProtectSystem", SandboxValue::Word("strict".into())),
                ("ReadWritePaths", SandboxValue::Paths(vec!["/srv/x".into()])),
            ]),
            ..Isolation::default()
        };
        let all = iso.sandbox();
        assert_eq!(all["NoNewPrivileges"], SandboxValue::Bool(false));
        assert_eq!(all["ProtectSystem"], SandboxValue::Word("strict".into()));
        assert_eq!(
            all["PrivateTmp"],
            SandboxValue::Bool(true),
            "a default kept"
        );
        assert_eq!(
            all["ReadWritePaths"],
            SandboxValue::Paths(vec!["/srv/x".into()])
        );
        assert_eq!(all.len(), SANDBOX_DEFAULTS.len() + 1);
        assert!(
            SANDBOX_DEFAULTS
                .iter()
                .all(|(k, _)| SANDBOX_KEYS.iter().any(|(n, _)| n == k)),
            "every default is on the allow-list"
        );
    }

    #[test]
    fn what_each_runner_cannot_enforce() {
        let iso = Isolation {
            limits: Limits {
                memory_max: Some(1 << 30),
                tasks_max: Some(8),
                nice: Some(5),
                open_files: Some(100),
                ..Limits::default()
            },
            sandbox: BTreeMap::from([("PrivateTmp", SandboxValue::Bool(false))]),
            credentials: BTreeMap::from([("db".to_string(), PathBuf::from("/etc/x"))]),
        };
        let every = ["memory", "pids", "cpu", "io"];
        assert_eq!(
            iso.unenforced(RunnerKind::Process, &every),
            [
                "limits.memory_max",
                "limits.tasks_max",
                "sandbox.PrivateTmp",
                "credentials.db"
            ]
        );
        // Processes in cgroups of their own with the pids controller: the
        // tasks limit holds, the sandbox and credentials still need units.
        assert_eq!(
            iso.unenforced(RunnerKind::Process, &["memory", "cpu", "io"]),
            ["limits.memory_max", "sandbox.PrivateTmp", "credentials.db"]
        );
        assert!(iso.unenforced(RunnerKind::Systemd, &[]).is_empty());
        assert_eq!(
            iso.unenforced(RunnerKind::Systemd, &["memory", "cpu"]),
            ["limits.memory_max"]
        );
    }
}
