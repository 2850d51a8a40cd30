//! Each run of the process runner in a cgroup of its own, when systemd
//! delegated the daemon's cgroup to it (`Delegate=yes`, the shipped unit):
//! the whole process tree of a run is then known exactly, killed at once
//! (`cgroup.kill`), however it forked or whatever session it left, its CPU
//! time (and peak memory, with the memory controller) is read back, and
//! its limits (`[job.limits]`) are the cgroup's where the host gives the
//! controller.
//!
//! The layout under the daemon's cgroup (`BASE`, the unit's):
//!
//! - `BASE/daemon`: the daemon, and so its guard (a cgroup with processes
//!   may not give controllers to its children: the daemon moves itself out
//!   of `BASE` first, as systemd's `DelegateSubgroup=` would);
//! - `BASE/run-JOB-FENCE` (`-on-failure` etc. for a hook): one run. Its
//!   first process moves itself in before it executes the command
//!   (`cronlease __run-as --cgroup`), so nothing it starts is ever outside.
//!
//! When a run's command exits, what it left behind in its cgroup is killed
//! (as systemd does for a service: `KillMode=control-group`), then its
//! usage is read and the cgroup removed. When the daemon dies, its guard
//! kills every run cgroup ([`kill_runs`]) before it hands over. Without a
//! delegated cgroup (no systemd, a container, the unit's `Delegate=` off)
//! the process runner works as before: process groups and the guard's
//! walk.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::Limits;

/// The daemon's own leaf below the delegated cgroup.
const DAEMON_LEAF: &str = "daemon";

/// Prefix of a run's cgroup.
const RUN_PREFIX: &str = "run-";

/// The controllers runs' limits use, as cgroup v2 names them.
pub const CONTROLLERS: [&str; 4] = ["memory", "pids", "cpu", "io"];

/// How long a run's cgroup may take to empty once killed: what is left is
/// stuck in the kernel, and the cgroup is left for the next sweep.
pub const EMPTY_WITHIN: Duration = Duration::from_secs(5);

/// Why the delegated cgroup cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// There is none to use (why).
    #[error("{0}")]
    NotDelegated(&'static str),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.to_path_buf();
    move |source| CgroupError::Io { what, path, source }
}

/// The delegated cgroup runs are started in.
#[derive(Debug)]
pub struct Runs {
    base: PathBuf,
    /// Controllers given to the runs' cgroups.
    enabled: Vec<&'static str>,
}

impl Runs {
    /// The daemon's delegated cgroup, set up for runs: the daemon moved to
    /// its leaf, runs a previous daemon left killed and removed, the
    /// controllers the host gives enabled for the runs.
    /// [`CgroupError::NotDelegated`]: there is no delegated cgroup.
    pub fn set_up() -> Result<Runs, CgroupError> {
        let base = delegated_base().map_err(CgroupError::NotDelegated)?;
        let leaf = base.join(DAEMON_LEAF);
        match std::fs::create_dir(&leaf) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("creating", &leaf)(e)),
        }
        write(&leaf.join("cgroup.procs"), "0")?;
        let swept = sweep(&base, EMPTY_WITHIN);
        if swept > 0 {
            tracing::warn!(
                "killed {swept} run cgroup(s) a previous daemon left in {}",
                base.display()
            );
        }
        let offered = read(&base.join("cgroup.controllers"))?;
        let wanted: Vec<&'static str> = CONTROLLERS
            .into_iter()
            .filter(|c| offered.split_whitespace().any(|o| o == *c))
            .collect();
        let mut enabled = Vec::new();
        for c in wanted {
            // One at a time: a controller the kernel refuses (a process
            // left in BASE by something else) leaves the others.
            match write(&base.join("cgroup.subtree_control"), &format!("+{c}")) {
                Ok(()) => enabled.push(c),
                Err(e) => tracing::warn!("cannot give the {c} controller to runs: {e}"),
            }
        }
        Ok(Runs { base, enabled })
    }

    /// Where runs' cgroups are made.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// Of the controllers runs' limits use, those runs do not get.
    pub fn lacking(&self) -> Vec<&'static str> {
        CONTROLLERS
            .into_iter()
            .filter(|c| !self.enabled.contains(c))
            .collect()
    }

    /// Makes the cgroup of the run `label` (`JOB-FENCE`, `-on-failure`
    /// for that command: [`crate::exec::run_label`]) with `limits` on it,
    /// for those it has the controller of. One left by an earlier attempt
    /// with the same name is killed and made again.
    pub fn create(&self, label: &str, limits: &Limits) -> Result<RunCgroup, CgroupError> {
        let path = self.base.join(format!("{RUN_PREFIX}{label}"));
        if let Err(e) = std::fs::create_dir(&path) {
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(io("creating", &path)(e));
            }
            remove(&path, EMPTY_WITHIN).map_err(io("removing a stale", &path))?;
            std::fs::create_dir(&path).map_err(io("creating", &path))?;
        }
        let cgroup = RunCgroup { path };
        for e in cgroup.limit(limits, &self.enabled) {
            // The run still goes, as with a limit the host has no
            // controller for.
            tracing::warn!(run = label, "a limit is not enforced for this run: {e}");
        }
        Ok(cgroup)
    }
}

/// One run's cgroup.
#[derive(Debug)]
pub struct RunCgroup {
    path: PathBuf,
}

/// What a run's cgroup accounted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Accounted {
    pub cpu_ms: Option<u64>,
    pub memory_peak: Option<u64>,
}

impl RunCgroup {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `l` for the controllers in `enabled`; what could not be
    /// written (a kernel without `io.weight`, say).
    fn limit(&self, l: &Limits, enabled: &[&str]) -> Vec<CgroupError> {
        let on = |c: &str| enabled.contains(&c);
        let mut settings: Vec<(&str, String)> = Vec::new();
        if let (Some(m), true) = (l.memory_max, on("memory")) {
            settings.push(("memory.max", m.to_string()));
            if self.path.join("memory.swap.max").exists() {
                settings.push(("memory.swap.max", "0".into()));
            }
        }
        if let (Some(t), true) = (l.tasks_max, on("pids")) {
            settings.push(("pids.max", t.to_string()));
        }
        if let (Some(q), true) = (l.cpu_quota, on("cpu")) {
            // Percent of one CPU over a 100 ms period, as systemd writes it.
            settings.push(("cpu.max", format!("{} 100000", u64::from(q) * 1000)));
        }
        if let (Some(w), true) = (l.cpu_weight, on("cpu")) {
            settings.push(("cpu.weight", w.to_string()));
        }
        if let (Some(w), true) = (l.io_weight, on("io")) {
            settings.push(("io.weight", format!("default {w}")));
        }
        settings
            .into_iter()
            .filter_map(|(file, value)| write(&self.path.join(file), &value).err())
            .collect()
    }

    /// SIGKILLs every process in it.
    pub fn kill(&self) {
        kill(&self.path);
    }

    /// SIGTERMs every process in it (those that left the run's process
    /// group too), as systemd stops a unit.
    pub fn terminate(&self) {
        signal_each(&self.path, nix::sys::signal::Signal::SIGTERM);
    }

    /// The run's command exited: kills what it left behind, waits (at most
    /// `within`) until the cgroup is empty, reads what it accounted and
    /// removes it (a cgroup still busy is left, said once, for the next
    /// sweep).
    pub async fn finish(self, within: Duration) -> Accounted {
        let deadline = tokio::time::Instant::now() + within;
        // Each round: without `cgroup.kill` (kernels before 5.14) a
        // process forked during a pass over `cgroup.procs` is caught by
        // the next.
        while populated(&self.path) {
            kill(&self.path);
            if tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let accounted = accounted(&self.path);
        if let Err(e) = std::fs::remove_dir(&self.path) {
            tracing::warn!(cgroup = %self.path.display(), "cannot remove a run's cgroup: {e}");
        }
        accounted
    }
}

/// Reads `cpu.stat`'s `usage_usec` and `memory.peak` (with the memory
/// controller, kernel 5.19 and later).
fn accounted(path: &Path) -> Accounted {
    let cpu_ms = std::fs::read_to_string(path.join("cpu.stat"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .map(|us| us / 1000);
    let memory_peak = std::fs::read_to_string(path.join("memory.peak"))
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    Accounted {
        cpu_ms,
        memory_peak,
    }
}

/// Whether any process is in the cgroup or below it (`cgroup.events`); an
/// unreadable one counts as empty (gone).
fn populated(path: &Path) -> bool {
    std::fs::read_to_string(path.join("cgroup.events"))
        .is_ok_and(|e| e.lines().any(|l| l.trim() == "populated 1"))
}

/// SIGKILLs every process of the cgroup and below: `cgroup.kill` (kernel
/// 5.14), else each process `cgroup.procs` lists.
fn kill(path: &Path) {
    if write(&path.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    signal_each(path, nix::sys::signal::Signal::SIGKILL);
}

/// Sends `sig` to each process `cgroup.procs` lists.
fn signal_each(path: &Path, sig: nix::sys::signal::Signal) {
    let Ok(procs) = std::fs::read_to_string(path.join("cgroup.procs")) else {
        return;
    };
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
    }
}

/// Kills a cgroup's processes, waits (at most `within`) until it is
/// empty, and removes it.
fn remove(path: &Path, within: Duration) -> std::io::Result<()> {
    kill_until_empty(&[path.to_path_buf()], within);
    std::fs::remove_dir(path)
}

/// SIGKILLs what is in each of `cgroups`, again every round (a process
/// forked during a pass without `cgroup.kill` is caught by the next),
/// until all are empty, at most `within`; true if they emptied.
fn kill_until_empty(cgroups: &[PathBuf], within: Duration) -> bool {
    let since = std::time::Instant::now();
    loop {
        let busy: Vec<&PathBuf> = cgroups.iter().filter(|c| populated(c)).collect();
        if busy.is_empty() {
            return true;
        }
        busy.into_iter().for_each(|c| kill(c));
        if since.elapsed() >= within {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The run cgroups below `base`.
fn run_cgroups(base: &Path) -> Vec<PathBuf> {
    let Ok(dir) = std::fs::read_dir(base) else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(RUN_PREFIX))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

/// Kills and removes every run cgroup below `base`; how many there were.
fn sweep(base: &Path, within: Duration) -> usize {
    let runs = run_cgroups(base);
    for run in &runs {
        kill(run);
    }
    for run in &runs {
        let _ = remove(run, within);
    }
    runs.len()
}

/// For the guard of a dead daemon (it is in the daemon's leaf): SIGKILLs
/// every run cgroup of the daemon and waits until each is empty, at most
/// `within`; true if they all emptied (or there are none: no delegated
/// cgroup).
pub fn kill_runs(within: Duration) -> bool {
    let Ok(base) = delegated_base() else {
        return true;
    };
    kill_until_empty(&run_cgroups(&base), within)
}

/// For `__wait-guard`, once the guard is gone: SIGKILLs every process of
/// each cgroup below the unit's `unit` but `.control` (where it runs
/// itself): the daemon's leaf, and runs a daemon and guard that both died
/// left. `cgroup.kill` needs only the cgroup's, not the processes' owner.
pub fn kill_below(unit: &Path) {
    let Ok(dir) = std::fs::read_dir(unit) else {
        return;
    };
    for entry in dir.filter_map(Result::ok) {
        if entry.file_name() != ".control" && entry.file_type().is_ok_and(|t| t.is_dir()) {
            kill(&entry.path());
        }
    }
}

/// Every process in the cgroup of `/proc/self/cgroup` (`.control` taken
/// for its unit's: systemd runs a delegated unit's `ExecStopPost=` there)
/// and below it, but this one: what `__wait-guard` waits for and sweeps.
pub fn unit_processes() -> Option<(PathBuf, impl FnMut() -> std::io::Result<Vec<u32>>)> {
    let own = own_cgroup()?;
    let unit = if own.file_name().is_some_and(|n| n == ".control") {
        own.parent()?.to_path_buf()
    } else {
        own
    };
    let me = std::process::id();
    let root = unit.clone();
    Some((unit, move || procs_below(&root, me)))
}

/// The processes of `dir`'s cgroup and below, but `me`.
fn procs_below(dir: &Path, me: u32) -> std::io::Result<Vec<u32>> {
    let mut pids = Vec::new();
    collect_procs(dir, &mut pids)?;
    pids.retain(|p| *p != me);
    Ok(pids)
}

/// The processes of `dir`'s cgroup and every cgroup below it.
fn collect_procs(dir: &Path, pids: &mut Vec<u32>) -> std::io::Result<()> {
    let procs = std::fs::read_to_string(dir.join("cgroup.procs"))?;
    pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
    for entry in std::fs::read_dir(dir)?.filter_map(Result::ok) {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            // A cgroup removed meanwhile has nothing left to list.
            match collect_procs(&entry.path(), pids) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                other => other?,
            }
        }
    }
    Ok(())
}

/// This process's cgroup as a directory: the unified hierarchy's (where
/// cgroup2 is mounted: /sys/fs/cgroup, or /sys/fs/cgroup/unified on a
/// hybrid host), else the `name=systemd` hierarchy's.
fn own_cgroup() -> Option<PathBuf> {
    let content = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    own_cgroup_in(&content, &cgroup2_mount(), |p| p.is_dir())
}

fn own_cgroup_in(
    content: &str,
    cgroup2: &Option<PathBuf>,
    exists: impl Fn(&Path) -> bool,
) -> Option<PathBuf> {
    let mut candidates = Vec::new();
    for line in content.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let path = path.trim_end_matches('/').trim_start_matches('/');
        match controllers {
            "" => {
                if let Some(m) = cgroup2 {
                    candidates.insert(0, m.join(path));
                }
            }
            "name=systemd" => candidates.push(Path::new("/sys/fs/cgroup/systemd").join(path)),
            _ => {}
        }
    }
    candidates.into_iter().find(|c| exists(c))
}

/// Where cgroup2 is mounted, from `/proc/self/mountinfo`.
fn cgroup2_mount() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    cgroup2_mount_in(&info)
}

fn cgroup2_mount_in(info: &str) -> Option<PathBuf> {
    info.lines().find_map(|line| {
        // ID PARENT MAJ:MIN ROOT MOUNT OPTIONS [OPTIONAL...] - FSTYPE ...
        let (left, right) = line.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let mut fields = left.split_whitespace();
        let root = fields.nth(3)?;
        let mount = fields.next()?;
        (root == "/").then(|| PathBuf::from(unescape_mountinfo(mount)))
    })
}

/// mountinfo writes a space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest.get(i + 1..i + 4);
        match code.and_then(|c| u8::from_str_radix(c, 8).ok()) {
            Some(b) => {
                out.push(b as char);
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The daemon's delegated cgroup: this process's unified cgroup (its
/// parent, from the daemon's leaf), marked delegated by systemd
/// ([`is_delegated`]).
fn delegated_base() -> Result<PathBuf, &'static str> {
    let content =
        std::fs::read_to_string("/proc/self/cgroup").map_err(|_| "no /proc/self/cgroup")?;
    let mount = cgroup2_mount().ok_or("no cgroup2 hierarchy is mounted")?;
    let line = content
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or("no unified cgroup hierarchy")?;
    let rel = line.trim_end_matches('/').trim_start_matches('/');
    if rel.is_empty() {
        return Err("this process is in the root cgroup");
    }
    let own = mount.join(rel);
    let base = match own.file_name() {
        Some(n) if n == DAEMON_LEAF && own.parent().is_some_and(is_delegated) => {
            own.parent().map(Path::to_path_buf).unwrap_or(own)
        }
        _ => own,
    };
    if !base.join("cgroup.procs").exists() {
        return Err("its cgroup is not visible here");
    }
    if !is_delegated(&base) {
        return Err("its cgroup is not delegated to it (Delegate=yes)");
    }
    Ok(base)
}

/// systemd's mark of a delegated cgroup: the `trusted.delegate` (root) or
/// `user.delegate` (systemd 252 and later, readable unprivileged)
/// attribute. Not "writable by us": every cgroup of a user's session is,
/// and daemons sharing one would kill each other's runs.
fn is_delegated(dir: &Path) -> bool {
    ["trusted.delegate", "user.delegate"]
        .into_iter()
        .any(|name| {
            let mut buf = [0u8; 8];
            rustix::fs::getxattr(dir, name, &mut buf)
                .is_ok_and(|n| buf.get(..n) == Some(b"1".as_slice()))
        })
}

fn read(path: &Path) -> Result<String, CgroupError> {
    std::fs::read_to_string(path).map_err(io("reading", path))
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .map_err(io("writing", path))
}

/// `cronlease __run-as --cgroup DIR`: moves this process into the run's
/// cgroup before anything else, so all it starts is inside.
pub fn enter(dir: &Path) -> Result<(), CgroupError> {
    write(&dir.join("cgroup.procs"), "0")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_cgroup2_mount_is_found_in_mountinfo() {
        let info = "22 1 0:21 / /proc rw,nosuid - proc proc rw\n\
                    30 25 0:26 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n\
                    31 25 0:27 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd\n";
        assert_eq!(
            cgroup2_mount_in(info),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        // A bind mount of a subtree is not the hierarchy's root.
        let sub = "40 25 0:26 /some/where /mnt rw - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_mount_in(sub), None);
        assert_eq!(
            cgroup2_mount_in("22 1 0:21 / /proc rw - proc proc rw\n"),
            None
        );
        let spaced = "30 25 0:26 / /mnt/with\\040space rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount_in(spaced),
            Some(PathBuf::from("/mnt/with space"))
        );
    }

    #[test]
    fn the_own_cgroup_prefers_the_unified_hierarchy() {
        let content = "1:name=systemd:/system.slice/cronlease.service\n\
                       0::/system.slice/cronlease.service/daemon\n";
        let mount = Some(PathBuf::from("/sys/fs/cgroup"));
        assert_eq!(
            own_cgroup_in(content, &mount, |_| true),
            Some(PathBuf::from(
                "/sys/fs/cgroup/system.slice/cronlease.service/daemon"
            ))
        );
        // No cgroup2 mounted: the name=systemd hierarchy's.
        assert_eq!(
            own_cgroup_in(content, &None, |_| true),
            Some(PathBuf::from(
                "/sys/fs/cgroup/systemd/system.slice/cronlease.service"
            ))
        );
        assert_eq!(own_cgroup_in(content, &mount, |_| false), None);
    }

    #[test]
    fn accounting_reads_cpu_and_peak_memory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("cpu.stat"),
            "usage_usec 123456\nuser_usec 100000\nsystem_usec 23456\n",
        )
        .unwrap();
        assert_eq!(
            accounted(dir.path()),
            Accounted {
                cpu_ms: Some(123),
                memory_peak: None
            }
        );
        std::fs::write(dir.path().join("memory.peak"), "4096\n").unwrap();
        assert_eq!(accounted(dir.path()).memory_peak, Some(4096));
    }

    #[test]
    fn limits_are_written_only_for_controllers_runs_get() {
        let dir = tempfile::tempdir().unwrap();
        for f in [
            "memory.max",
            "memory.swap.max",
            "pids.max",
            "cpu.max",
            "cpu.weight",
            "io.weight",
        ] {
            std::fs::write(dir.path().join(f), "").unwrap();
        }
        let cgroup = RunCgroup {
            path: dir.path().to_path_buf(),
        };
        let limits = Limits {
            memory_max: Some(64 << 20),
            cpu_quota: Some(150),
            tasks_max: Some(32),
            io_weight: Some(50),
            cpu_weight: Some(200),
            nice: None,
            open_files: None,
        };
        assert!(cgroup.limit(&limits, &["memory", "pids", "cpu"]).is_empty());
        let read = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap();
        assert_eq!(read("memory.max"), (64u64 << 20).to_string());
        assert_eq!(read("memory.swap.max"), "0");
        assert_eq!(read("pids.max"), "32");
        assert_eq!(read("cpu.max"), "150000 100000");
        assert_eq!(read("cpu.weight"), "200");
        // No io controller for runs: not written.
        assert_eq!(read("io.weight"), "");
        let runs = Runs {
            base: dir.path().to_path_buf(),
            enabled: vec!["memory", "pids", "cpu"],
        };
        assert_eq!(runs.lacking(), vec!["io"]);
    }

    #[test]
    fn the_unit_processes_are_listed_below_its_cgroup_but_not_us() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id().to_string();
        std::fs::write(dir.path().join("cgroup.procs"), "").unwrap();
        std::fs::create_dir_all(dir.path().join("daemon")).unwrap();
        std::fs::write(dir.path().join("daemon/cgroup.procs"), "10\n11\n").unwrap();
        std::fs::create_dir_all(dir.path().join("run-a-1")).unwrap();
        std::fs::write(dir.path().join("run-a-1/cgroup.procs"), "20\n").unwrap();
        std::fs::create_dir_all(dir.path().join(".control")).unwrap();
        std::fs::write(dir.path().join(".control/cgroup.procs"), format!("{me}\n")).unwrap();
        let mut pids = procs_below(dir.path(), std::process::id()).unwrap();
        pids.sort();
        assert_eq!(pids, vec![10, 11, 20], "every cgroup below, but us");
        assert_eq!(
            run_cgroups(dir.path()),
            vec![dir.path().join("run-a-1")],
            "only run-* cgroups are runs"
        );
    }
}
