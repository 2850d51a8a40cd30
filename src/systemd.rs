//! systemd integration through sd_notify (the sd-notify crate): READY=1
//! once the configuration is loaded and the store answered, WATCHDOG=1 from
//! the supervision tick while the scheduler is alive, STATUS= lines,
//! STOPPING=1 at shutdown. Without `$NOTIFY_SOCKET` every call is a no-op.
//!
//! Also the unit's `ExecStopPost=` (`cronlease __wait-guard`): the stop of
//! the unit ends only once the daemon's guard has finished (killed the runs
//! of a crashed daemon, recorded them, handed its leases over) and exited,
//! so a restart never races it, and then kills whatever is left in the
//! unit's cgroup, as systemd's own kill would have ([`wait_for_guard`]).

use std::time::Duration;

use sd_notify::NotifyState;

/// Whether this host was booted with systemd as its init (what
/// `sd_booted()` checks): only then can runs be systemd units.
pub fn booted() -> bool {
    std::path::Path::new("/run/systemd/system").is_dir()
}

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
        if self.enabled
            && let Err(e) = sd_notify::notify(state)
        {
            tracing::debug!("sd_notify failed: {e}");
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

/// How long the sweep after the guard keeps killing what is left: each
/// round kills what the cgroup lists, until it lists nothing but us.
const SWEEP_WITHIN: Duration = Duration::from_secs(5);

/// The unit's `ExecStopPost=`: waits until no guard process (`cronlease
/// __guard`) is left in the unit's cgroup or below it (systemd runs
/// `ExecStopPost=` in the unit's cgroup, or in its `.control` when the
/// cgroup is delegated: [`crate::cgroup`]), at most `within`, then
/// SIGKILLs every process still there: what a job left behind (a daemonized child), or a guard
/// that did not finish in time. The unit's `KillMode=process` keeps
/// systemd from killing the cgroup itself, since that would kill the guard
/// of a crashed daemon before its handover; this sweep is that kill, once
/// the guard is done. Never fails the stop: where the cgroup cannot be
/// read, it says so on stderr (the journal) and returns success.
pub fn wait_for_guard(within: Duration) -> std::process::ExitCode {
    let Some((unit, read)) = crate::cgroup::unit_processes() else {
        eprintln!("cronlease __wait-guard: cannot find this unit's cgroup; not waiting");
        return std::process::ExitCode::SUCCESS;
    };
    let kill_cgroups = || crate::cgroup::kill_below(&unit);
    let outcome = wait_then_sweep(read, is_guard, kill_cgroups, within, SWEEP_WITHIN);
    match outcome {
        Ok(Settled {
            guard_gone,
            killed,
            remaining,
        }) => {
            if !guard_gone {
                eprintln!(
                    "cronlease __wait-guard: the guard was still there after {within:?}; killed it"
                );
            }
            if killed > 0 {
                eprintln!(
                    "cronlease __wait-guard: killed {killed} process(es) left in the unit after its guard"
                );
            }
            if remaining > 0 {
                eprintln!(
                    "cronlease __wait-guard: {remaining} process(es) still in the unit after {SWEEP_WITHIN:?} of killing (not this user's to kill?): left running"
                );
            }
        }
        Err(e) => eprintln!(
            "cronlease __wait-guard: cannot read the processes of {}: {e}; not waiting",
            unit.display()
        ),
    }
    // Runs started as units are outside this unit's cgroup: what the guard
    // left of them goes too.
    if booted() {
        match crate::units::sweep(SWEEP_WITHIN) {
            Ok(0) => {}
            Ok(n) => {
                eprintln!("cronlease __wait-guard: killed {n} run unit(s) left after the guard")
            }
            Err(e) => eprintln!("cronlease __wait-guard: run units: {e}"),
        }
    }
    std::process::ExitCode::SUCCESS
}

/// What [`wait_then_sweep`] did.
#[derive(Debug, PartialEq, Eq)]
struct Settled {
    /// The guard exited within the wait (else it was among the killed).
    guard_gone: bool,
    /// Processes SIGKILLed by the sweep.
    killed: usize,
    /// Processes still there when it gave up (not ours to kill).
    remaining: usize,
}

/// Waits while `read` (the cgroup's processes but us) lists a guard, at most
/// `within`; then, for at most `sweep`, SIGKILLs whatever `read` lists until
/// it lists nothing (a process forked between a read and a kill is caught
/// by the next round).
fn wait_then_sweep(
    mut read: impl FnMut() -> std::io::Result<Vec<u32>>,
    is_guard: impl Fn(u32) -> bool,
    kill_cgroups: impl Fn(),
    within: Duration,
    sweep: Duration,
) -> std::io::Result<Settled> {
    let deadline = std::time::Instant::now() + within;
    let guard_gone = loop {
        if !read()?.into_iter().any(&is_guard) {
            break true;
        }
        if std::time::Instant::now() >= deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let deadline = std::time::Instant::now() + sweep;
    let mut killed = std::collections::BTreeSet::new();
    let remaining = loop {
        let left = read()?;
        if left.is_empty() || std::time::Instant::now() >= deadline {
            break left;
        }
        // The cgroups below the unit's first (whoever's their processes
        // are), then each process.
        kill_cgroups();
        for pid in left {
            // Each one said once (the first 20): what was left, for the
            // journal.
            if killed.insert(pid) && killed.len() <= 20 {
                let cmdline = match std::fs::read(format!("/proc/{pid}/cmdline")) {
                    Ok(c) => String::from_utf8_lossy(&c).replace('\0', " "),
                    Err(e) => format!("its command line unreadable: {e}"),
                };
                eprintln!("cronlease __wait-guard: killing {pid} ({})", cmdline.trim());
            }
            let Ok(raw) = i32::try_from(pid) else {
                continue;
            };
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(raw),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Ok(Settled {
        guard_gone,
        killed: killed.iter().filter(|p| !remaining.contains(p)).count(),
        remaining: remaining.len(),
    })
}

/// Whether process `pid` is a guard: its second argument is `__guard`. One
/// listed in the unit's cgroup whose `/proc` entry this process cannot read
/// counts as one too: the unit's `ProtectProc=invisible` hides a process
/// that is not ptrace-readable from here, and a guard handing over after
/// the system bus went away was seen so (its entry gone from here while it
/// still ran; it was then killed before it could hand over). Waiting for
/// such a process is bounded like any guard's.
fn is_guard(pid: u32) -> bool {
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(c) => c.split(|b| *b == 0).nth(1) == Some(b"__guard".as_slice()),
        Err(_) => true,
    }
}

#[cfg(test)]
mod wait_tests {
    #![allow(clippy::unwrap_used)]
    use super::{Settled, is_guard, wait_then_sweep};
    use std::os::unix::process::ExitStatusExt;
    use std::time::Duration;

    /// A `read` over real children: lists those not yet reaped.
    fn alive(children: &std::cell::RefCell<Vec<std::process::Child>>) -> Vec<u32> {
        children
            .borrow_mut()
            .iter_mut()
            .filter_map(|c| matches!(c.try_wait(), Ok(None)).then(|| c.id()))
            .collect()
    }

    #[test]
    fn what_is_left_after_the_guard_is_killed() {
        // A guard that exits by itself after 200 ms, and a leftover that
        // would sleep for a minute: the wait ends with the guard, then the
        // leftover is SIGKILLed.
        let guard = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let guard_pid = guard.id();
        let leftover = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let children = std::cell::RefCell::new(vec![guard, leftover]);
        let started = std::time::Instant::now();
        let settled = wait_then_sweep(
            || Ok(alive(&children)),
            |p| p == guard_pid,
            || {},
            Duration::from_secs(20),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(
            settled,
            Settled {
                guard_gone: true,
                killed: 1,
                remaining: 0
            }
        );
        assert!(started.elapsed() < Duration::from_secs(20));
        let mut children = children.into_inner();
        assert!(children[0].wait().unwrap().success());
        assert_eq!(children[1].wait().unwrap().signal(), Some(9));
    }

    #[test]
    fn a_guard_past_its_time_is_killed_too() {
        let guard = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let guard_pid = guard.id();
        let children = std::cell::RefCell::new(vec![guard]);
        let settled = wait_then_sweep(
            || Ok(alive(&children)),
            |p| p == guard_pid,
            || {},
            Duration::from_millis(100),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(
            settled,
            Settled {
                guard_gone: false,
                killed: 1,
                remaining: 0
            }
        );
        assert_eq!(children.into_inner()[0].wait().unwrap().signal(), Some(9));
    }

    #[test]
    fn the_cgroups_below_are_killed_in_each_round_and_what_stays_is_counted() {
        // A process the sweep lists but that never goes (a pid of nobody's:
        // its SIGKILL fails): counted as remaining once the sweep gives up,
        // and the cgroups' kill was tried in every round.
        let rounds = std::cell::Cell::new(0);
        let settled = wait_then_sweep(
            || Ok(vec![u32::MAX]),
            |_| false,
            || rounds.set(rounds.get() + 1),
            Duration::from_secs(1),
            Duration::from_millis(100),
        )
        .unwrap();
        assert_eq!(
            settled,
            Settled {
                guard_gone: true,
                killed: 0,
                remaining: 1
            }
        );
        assert!(rounds.get() >= 2, "{}", rounds.get());
    }

    #[test]
    fn an_unreadable_cgroup_is_an_error_not_a_wait() {
        let settled = wait_then_sweep(
            || Err(std::io::Error::other("gone")),
            |_| true,
            || {},
            Duration::from_secs(20),
            Duration::from_secs(5),
        );
        assert!(settled.is_err());
    }

    #[test]
    fn a_guard_is_told_by_its_argument() {
        assert!(!is_guard(std::process::id()));
        // `sh __guard`: argv[1] is `__guard`, as in `cronlease __guard`.
        let dir = tempfile::tempdir().unwrap();
        // Not `sleep` last: dash may exec a script's last command, and the
        // process would then be `sleep 5` (seen: this test failed so once).
        std::fs::write(dir.path().join("__guard"), "sleep 5\nexit 0\n").unwrap();
        // Its `sleep` outlives the kill below: no pipe of the test's with it.
        let mut child = std::process::Command::new("sh")
            .arg("__guard")
            .current_dir(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // The spawn returns once the exec has begun, but the kernel sets the
        // new argument area a moment later: until then `cmdline` is empty
        // (seen under CI load: this assertion failed so). Wait for it.
        let cmdline = format!("/proc/{}/cmdline", child.id());
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::fs::read(&cmdline).unwrap_or_default().is_empty()
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(is_guard(child.id()));
        let _ = child.kill();
        let _ = child.wait();
        // Gone (or hidden, under ProtectProc=invisible): no /proc entry to
        // read, which counts as a guard; whether it is still there is the
        // cgroup listing's to say.
        assert!(is_guard(child.id()));
    }
}
