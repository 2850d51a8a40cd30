//! systemd integration through sd_notify (the sd-notify crate): READY=1
//! once the configuration is loaded and the store answered, WATCHDOG=1 from
//! the supervision tick while the scheduler is alive, STATUS= lines,
//! STOPPING=1 at shutdown. Without `$NOTIFY_SOCKET` every call is a no-op.
//!
//! Also the unit's `ExecStopPost=` (`cronlease __wait-guard`): the stop of
//! the unit ends only once the daemon's guard has finished (killed the runs
//! of a crashed daemon, recorded them, handed its leases over) and exited,
//! so a restart never races it ([`wait_for_guard`]).

use std::time::Duration;

use sd_notify::NotifyState;

/// The daemon's line to systemd.
pub struct Notifier {
    enabled: bool,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// Reads `$NOTIFY_SOCKET` and `$WATCHDOG_USEC` (they stay set: jobs never
    /// see them, the runner withholds them).
    pub fn from_env() -> Self {
        Notifier {
            enabled: std::env::var_os("NOTIFY_SOCKET").is_some(),
            watchdog: sd_notify::watchdog_enabled(),
        }
    }

    /// A notifier that sends nothing (a node run in-process, in tests).
    pub fn disabled() -> Self {
        Notifier {
            enabled: false,
            watchdog: None,
        }
    }

    /// The watchdog interval systemd expects pings within, if any.
    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog.filter(|_| self.enabled)
    }

    fn send(&self, state: &[NotifyState<'_>]) {
        if self.enabled {
            if let Err(e) = sd_notify::notify(state) {
                tracing::debug!("sd_notify failed: {e}");
            }
        }
    }

    pub fn ready(&self, status: &str) {
        self.send(&[NotifyState::Ready, NotifyState::Status(status)]);
    }

    pub fn ping(&self) {
        self.send(&[NotifyState::Watchdog]);
    }

    pub fn status(&self, status: &str) {
        self.send(&[NotifyState::Status(status)]);
    }

    pub fn stopping(&self) {
        self.send(&[
            NotifyState::Stopping,
            NotifyState::Status("stopping: finishing runs, releasing leases"),
        ]);
    }
}

/// How long `__wait-guard` waits at most: the guard hands a crashed
/// daemon's leases over within milliseconds, and its wait for the runs it
/// killed is bounded well below this; the unit's `TimeoutStopSec=` bounds
/// it again.
pub const GUARD_WITHIN: Duration = Duration::from_secs(20);

/// Waits until no guard process (`cronlease __guard`) is left in this
/// process's cgroup (the unit's, where systemd runs `ExecStopPost=`), at
/// most `within`. Other processes (what a job left behind on purpose) are
/// not waited for. Never fails the stop: after `within`, or where the
/// cgroup cannot be read, it says so on stderr (the journal) and returns
/// success.
pub fn wait_for_guard(within: Duration) -> std::process::ExitCode {
    let deadline = std::time::Instant::now() + within;
    let me = std::process::id();
    let Some(procs) = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_procs_file(&c, |p| std::path::Path::new(p).exists()))
    else {
        eprintln!("cronlease __wait-guard: cannot find this unit's cgroup; not waiting");
        return std::process::ExitCode::SUCCESS;
    };
    loop {
        let guards = match std::fs::read_to_string(&procs) {
            Ok(list) => list
                .lines()
                .filter_map(|l| l.trim().parse::<u32>().ok())
                .filter(|p| *p != me && is_guard(*p))
                .count(),
            Err(e) => {
                eprintln!("cronlease __wait-guard: cannot read {procs}: {e}; not waiting");
                return std::process::ExitCode::SUCCESS;
            }
        };
        if guards == 0 {
            return std::process::ExitCode::SUCCESS;
        }
        if std::time::Instant::now() >= deadline {
            eprintln!(
                "cronlease __wait-guard: the guard is still there after {within:?}; the stop goes on"
            );
            return std::process::ExitCode::SUCCESS;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether process `pid` is a guard: its second argument is `__guard`.
fn is_guard(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.split(|b| *b == 0).nth(1) == Some(b"__guard".as_slice()))
}

/// The `cgroup.procs` file of the cgroup `/proc/self/cgroup` (`content`)
/// names: the unified hierarchy's (`0::PATH`, mounted on /sys/fs/cgroup or,
/// on a hybrid host, /sys/fs/cgroup/unified), else the `name=systemd`
/// hierarchy's, the first of them that `exists`.
fn cgroup_procs_file(content: &str, exists: impl Fn(&str) -> bool) -> Option<String> {
    let mut candidates = Vec::new();
    for line in content.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let path = path.trim_end_matches('/');
        match controllers {
            "" => {
                candidates.insert(0, format!("/sys/fs/cgroup/unified{path}/cgroup.procs"));
                candidates.insert(0, format!("/sys/fs/cgroup{path}/cgroup.procs"));
            }
            "name=systemd" => candidates.push(format!("/sys/fs/cgroup/systemd{path}/cgroup.procs")),
            _ => {}
        }
    }
    candidates.into_iter().find(|c| exists(c))
}

#[cfg(test)]
mod wait_tests {
    #![allow(clippy::unwrap_used)]
    use super::{cgroup_procs_file, is_guard};

    #[test]
    fn a_guard_is_told_by_its_argument() {
        assert!(!is_guard(std::process::id()));
        // `sh __guard`: argv[1] is `__guard`, as in `cronlease __guard`.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("__guard"), "sleep 5\n").unwrap();
        let mut child = std::process::Command::new("sh")
            .arg("__guard")
            .current_dir(dir.path())
            .spawn()
            .unwrap();
        assert!(is_guard(child.id()));
        let _ = child.kill();
        let _ = child.wait();
        assert!(!is_guard(child.id()));
    }

    #[test]
    fn the_unified_hierarchy_comes_first_then_the_systemd_one() {
        let v2 = "0::/system.slice/cronlease.service\n";
        assert_eq!(
            cgroup_procs_file(v2, |_| true).as_deref(),
            Some("/sys/fs/cgroup/system.slice/cronlease.service/cgroup.procs")
        );
        let hybrid = "9:name=systemd:/system.slice/cronlease.service\n4:memory:/\n0::/system.slice/cronlease.service\n";
        assert_eq!(
            cgroup_procs_file(hybrid, |p| p.starts_with("/sys/fs/cgroup/unified/")).as_deref(),
            Some("/sys/fs/cgroup/unified/system.slice/cronlease.service/cgroup.procs")
        );
        let v1 = "9:name=systemd:/system.slice/cronlease.service\n4:memory:/x\n";
        assert_eq!(
            cgroup_procs_file(v1, |p| p.starts_with("/sys/fs/cgroup/systemd/")).as_deref(),
            Some("/sys/fs/cgroup/systemd/system.slice/cronlease.service/cgroup.procs")
        );
        assert_eq!(cgroup_procs_file("garbage", |_| true), None);
        assert_eq!(cgroup_procs_file(v2, |_| false), None);
    }
}
