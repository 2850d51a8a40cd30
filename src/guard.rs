//! Makes sure a job never outlives its daemon, even one killed by SIGKILL.
//!
//! The daemon starts one small helper, `cronlease __guard`, with a pipe on its
//! stdin, and tells it the process group of every job it starts (`+PGID`) and
//! finishes (`-PGID`). When the daemon dies, however it dies, the kernel
//! closes the pipe; the guard reads end-of-file and SIGKILLs every group still
//! listed, then exits. This covers a job's whole process tree (its process
//! group), which a parent-death signal on the direct child would not, and
//! needs no `unsafe` `pre_exec` hook. Processes that left the job's group or
//! session are found by walking parent links from the group's members (see
//! [`serve`]). Under systemd the unit's control group is the second line of
//! defence.

use std::collections::{BTreeMap, BTreeSet};
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
///
/// "What is left" is each listed group and every process below its members,
/// also those that left the group or the session (`setsid cmd &`): they
/// still hang below the job's process by their parent links. While jobs run,
/// the guard also notes their descendants every second, so a process whose
/// parent has already exited (reparented away from the tree) is still known.
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
    let (lines, incoming) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let Ok(line) = line else { break };
            if lines.send(line).is_err() {
                break;
            }
        }
        // Dropping the sender tells the main loop the daemon is gone.
    });
    let mut groups = BTreeSet::new();
    // Per running job (process group): the processes noted below it, with
    // their start times. Forgotten with the job, so a daemon a finished job
    // left behind on purpose (`ssh -fN`, `tmux new -d`) is never killed later.
    let mut known: BTreeMap<i32, BTreeMap<i32, u64>> = BTreeMap::new();
    // The process table is read once a second while jobs run, never once
    // per message: a thousand jobs starting at one instant are two thousand
    // messages, and a scan reads every /proc/PID/stat of the host.
    let every = std::time::Duration::from_secs(1);
    let mut last_scan = std::time::Instant::now();
    loop {
        let wait = every.saturating_sub(last_scan.elapsed());
        match incoming.recv_timeout(wait) {
            Ok(line) => {
                let (op, pgid) = line.split_at(line.len().min(1));
                match (op, pgid.trim().parse::<i32>()) {
                    ("+", Ok(pgid)) if pgid > 1 => {
                        groups.insert(pgid);
                    }
                    ("-", Ok(pgid)) => {
                        groups.remove(&pgid);
                        known.remove(&pgid);
                    }
                    _ => {}
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if last_scan.elapsed() < every {
            continue;
        }
        last_scan = std::time::Instant::now();
        if !groups.is_empty() {
            let table = process_table();
            for pgid in &groups {
                let noted = known.entry(*pgid).or_default();
                noted.retain(|pid, start| table.get(pid).is_some_and(|p| p.start == *start));
                for pid in tree_of(&BTreeSet::from([*pgid]), &table) {
                    if let Some(p) = table.get(&pid) {
                        noted.insert(pid, p.start);
                    }
                }
            }
        }
    }
    let known: BTreeMap<i32, u64> = known.into_values().flatten().collect();
    kill_trees(&groups, &known);
    std::process::ExitCode::SUCCESS
}

/// One process as `/proc/PID/stat` tells it.
#[derive(Debug, Clone, Copy)]
struct ProcInfo {
    ppid: i32,
    pgrp: i32,
    /// Start time (clock ticks since boot): tells a reused pid apart.
    start: u64,
}

fn process_table() -> BTreeMap<i32, ProcInfo> {
    let mut table = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return table;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command name, which may itself hold spaces.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let (Some(ppid), Some(pgrp), Some(start)) = (
            f.get(1).and_then(|v| v.parse().ok()),
            f.get(2).and_then(|v| v.parse().ok()),
            f.get(19).and_then(|v| v.parse().ok()),
        ) else {
            continue;
        };
        if f.first() == Some(&"Z") {
            continue;
        }
        table.insert(pid, ProcInfo { ppid, pgrp, start });
    }
    table
}

/// Members of `groups` and every process below them, the guard excluded.
fn tree_of(groups: &BTreeSet<i32>, table: &BTreeMap<i32, ProcInfo>) -> BTreeSet<i32> {
    let members = table
        .iter()
        .filter(|(_, p)| groups.contains(&p.pgrp))
        .map(|(pid, _)| *pid)
        .collect();
    with_descendants(members, table)
}

/// `roots` and every process below them by parent links, the guard excluded.
fn with_descendants(mut tree: BTreeSet<i32>, table: &BTreeMap<i32, ProcInfo>) -> BTreeSet<i32> {
    let me = std::process::id() as i32;
    tree.remove(&me);
    loop {
        let below: Vec<i32> = table
            .iter()
            .filter(|(pid, p)| tree.contains(&p.ppid) && !tree.contains(pid) && **pid != me)
            .map(|(pid, _)| *pid)
            .collect();
        if below.is_empty() {
            return tree;
        }
        tree.extend(below);
    }
}

/// Stops every process of the job trees (so none can fork away while the
/// trees are walked), then kills them all.
fn kill_trees(groups: &BTreeSet<i32>, known: &BTreeMap<i32, u64>) {
    let signal = |pid: i32, sig: Signal| {
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), sig);
    };
    let mut doomed: BTreeSet<i32> = BTreeSet::new();
    for _ in 0..20 {
        let table = process_table();
        let mut roots = tree_of(groups, &table);
        // Noted earlier, still the same process (not a reused pid), and
        // anything those have forked since.
        roots.extend(
            known
                .iter()
                .filter(|(pid, start)| table.get(pid).is_some_and(|p| p.start == **start))
                .map(|(pid, _)| *pid),
        );
        let tree = with_descendants(roots, &table);
        let new: Vec<i32> = tree.difference(&doomed).copied().collect();
        if new.is_empty() {
            break;
        }
        for pid in &new {
            signal(*pid, Signal::SIGSTOP);
        }
        doomed.extend(new);
    }
    for pgid in groups {
        let _ = killpg(Pid::from_raw(*pgid), Signal::SIGKILL);
    }
    for pid in doomed {
        signal(pid, Signal::SIGKILL);
    }
}
