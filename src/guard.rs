//! Makes sure a job never outlives its daemon, even one killed by SIGKILL.
//!
//! The daemon starts one small helper, `cronlease __guard`, with a pipe on its
//! stdin, and tells it the process group of every job it starts (`+PGID`) and
//! finishes (`-PGID`). When the daemon dies, however it dies, the kernel
//! closes the pipe; the guard reads end-of-file and SIGKILLs every group still
//! listed, then exits. This covers a job's whole process tree (its process
//! group), which a parent-death signal on the direct child would not, and
//! needs no `unsafe` `pre_exec` hook. Under systemd the unit's control group
//! is the second line of defence.

use std::collections::BTreeSet;
use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// The daemon's handle on its guard process.
pub struct Guard {
    pipe: Mutex<Option<ChildStdin>>,
    child: Mutex<Child>,
}

impl Guard {
    /// Starts the guard: this same executable, in `__guard` mode.
    pub fn spawn() -> std::io::Result<Guard> {
        let exe = std::env::current_exe().unwrap_or_else(|_| "/proc/self/exe".into());
        let mut child = Command::new(exe)
            .arg("__guard")
            // The guard needs nothing from the daemon's environment, least of
            // all its secrets.
            .env_remove("CRONLEASE_STORE_URL")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()?;
        let pipe = child.stdin.take();
        Ok(Guard {
            pipe: Mutex::new(pipe),
            child: Mutex::new(child),
        })
    }

    /// Lists a job's process group for killing if the daemon dies.
    pub fn watch(&self, pgid: u32) {
        self.send(&format!("+{pgid}\n"));
    }

    /// Takes a finished job's process group off the list.
    pub fn forget(&self, pgid: u32) {
        self.send(&format!("-{pgid}\n"));
    }

    fn send(&self, line: &str) {
        let Ok(mut pipe) = self.pipe.lock() else {
            return;
        };
        if let Some(p) = pipe.as_mut() {
            if let Err(e) = p.write_all(line.as_bytes()).and_then(|()| p.flush()) {
                tracing::error!(
                    "the job guard process is gone ({e}); jobs would now outlive a daemon killed by SIGKILL"
                );
                *pipe = None;
            }
        }
    }

    /// Whether the guard process is still running.
    pub fn alive(&self) -> bool {
        self.child
            .lock()
            .map(|mut c| matches!(c.try_wait(), Ok(None)))
            .unwrap_or(false)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        // Closing the pipe lets the guard exit; reap it so no zombie is left.
        if let Ok(mut pipe) = self.pipe.lock() {
            pipe.take();
        }
        if let Ok(mut child) = self.child.lock() {
            let _ = child.wait();
        }
    }
}

/// The guard process itself: reads `+PGID`/`-PGID` lines until end-of-file,
/// then kills what is left. Signals that would stop a daemon (INT from a
/// terminal, TERM from `pkill`) are ignored: the guard must outlive the daemon
/// by a moment, and ends exactly when the daemon's end closes the pipe.
pub fn serve() -> std::process::ExitCode {
    let ignored = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
        signal_hook::consts::SIGUSR1,
        signal_hook::consts::SIGQUIT,
    ] {
        let _ = signal_hook::flag::register(sig, ignored.clone());
    }
    let mut groups = BTreeSet::new();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let (op, pgid) = line.split_at(line.len().min(1));
        match (op, pgid.trim().parse::<i32>()) {
            ("+", Ok(pgid)) if pgid > 1 => {
                groups.insert(pgid);
            }
            ("-", Ok(pgid)) => {
                groups.remove(&pgid);
            }
            _ => {}
        }
    }
    for pgid in groups {
        let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
    }
    std::process::ExitCode::SUCCESS
}
