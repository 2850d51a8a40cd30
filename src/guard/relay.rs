//! The small guard (`cronlease-guard`, `src/bin/guard.rs`) and how it
//! passes a dead daemon's work on to the daemon's binary.
//!
//! The guard of an idle daemon only waits; what it maps of a binary is its
//! memory. `cronlease-guard` holds the guard's loop ([`serve_small`]) and
//! not the store clients, the systemd runner or the command line: a
//! fraction of the pages `cronlease __guard` maps (docs/benchmarks.md).
//! When the daemon dies it kills the runs' process trees at once, as
//! always; if a run's systemd unit is to be stopped or the daemon's work
//! handed over, it then executes `cronlease __guard --gone` in its own
//! place ([`resume`]): the same process (its pid, its children, still
//! their subreaper), with what is left ([`Remains`]) as JSON on its
//! standard input. The binary it executes is the daemon's own, opened when
//! the guard starts (`/proc/PID/exe` of its parent, the daemon that made
//! its socket): a package upgraded meanwhile renames a new file over the
//! old one's name, and the dead daemon's version hands over.

use std::io::{Read, Seek, Write};

use nix::sys::signal::{SigSet, SigmaskHow, sigprocmask};

use super::server::{Remains, STOP_SIGNALS, ignore_stop_signals, kill_cgroups};
use super::*;

/// The guard's loop as `cronlease-guard` runs it: [`serve`], passing what
/// is left for the store or the systemd runner to `cronlease __guard
/// --gone`. A daemon of another version than this executable (one of the
/// two replaced without the other) would speak to it in messages it may
/// not know: then the daemon's binary guards, executed in its place as
/// `cronlease __guard`.
pub fn serve_small(daemon_version: &str) -> std::process::ExitCode {
    let daemon_binary = open_daemon_binary();
    if let Err(e) = &daemon_binary {
        tracing::warn!(
            process = "guard",
            "cannot open the daemon's binary ({e}): if the daemon dies, its leases are left to expire"
        );
    }
    let ours = own_version();
    if daemon_version != ours {
        tracing::warn!(
            process = "guard",
            "cronlease-guard {ours} is not of its daemon's version ({daemon_version}): the daemon's own binary guards instead"
        );
        let e = match &daemon_binary {
            Ok(binary) => exec_daemon_binary(binary, &[c"cronlease", c"__guard"]),
            Err(e) => e.clone(),
        };
        tracing::error!(process = "guard", "cannot guard the runs: {e}");
        return std::process::ExitCode::from(70);
    }
    super::server::serve_then(move |remains, died| {
        if !remains.needs_more() {
            kill_cgroups();
            return std::process::ExitCode::SUCCESS;
        }
        let Err(e) = pass_on(daemon_binary, remains, died);
        tracing::error!(
            process = "guard",
            "the daemon died; cannot hand over ({e}): its leases are left to expire"
        );
        // What this executable can still do: the runs' cgroups (their
        // units need the daemon's binary).
        kill_cgroups();
        std::process::ExitCode::from(70)
    })
}

/// The daemon's executable as it runs, opened read-only: `/proc/PID/exe`
/// of the process that made the socket on standard input, which must be
/// this process's parent before and after (one that died meanwhile would
/// have given its number to another).
fn open_daemon_binary() -> Result<OwnedFd, String> {
    use rustix::process::getppid;
    let daemon = rustix::net::sockopt::socket_peercred(std::io::stdin())
        .map_err(|e| format!("the daemon's socket: {e}"))?
        .pid;
    let gone = || "the daemon is not this guard's parent".to_string();
    if getppid() != Some(daemon) {
        return Err(gone());
    }
    let path = format!("/proc/{}/exe", daemon.as_raw_nonzero());
    let file = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    if getppid() != Some(daemon) {
        return Err(gone());
    }
    Ok(file.into())
}

/// Executes `cronlease __guard --gone` in this process with `remains` on
/// its standard input; returns only if it cannot.
fn pass_on(
    daemon_binary: Result<OwnedFd, String>,
    mut remains: Remains,
    died: std::time::Instant,
) -> Result<std::convert::Infallible, String> {
    let binary = daemon_binary?;
    remains.died_at_ns = Some(monotonic_ns().saturating_sub(nanos(died.elapsed())));
    let json = serde_json::to_vec(&remains).map_err(|e| format!("what is left: {e}"))?;
    let state = memfd().map_err(|e| format!("memfd_create: {e}"))?;
    let mut file = std::fs::File::from(state);
    file.write_all(&json)
        .and_then(|()| file.rewind())
        .map_err(|e| format!("writing what is left: {e}"))?;
    nix::unistd::dup2_stdin(&file).map_err(|e| format!("dup2: {e}"))?;
    // A signal the guard ignores, sent while the new image has no handler
    // yet, waits (blocked, which `execve` keeps) until [`resume`] ignores
    // it again.
    let stops = stop_set();
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&stops), None).map_err(|e| format!("{e}"))?;
    let e = exec_daemon_binary(&binary, &[c"cronlease", c"__guard", c"--gone"]);
    let _ = sigprocmask(SigmaskHow::SIG_UNBLOCK, Some(&stops), None);
    Err(e)
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock `Instant` reads, and the
/// same in both images of the process.
fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let secs = u64::try_from(t.tv_sec).unwrap_or(0);
    let nsec = u64::try_from(t.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nsec)
}

fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// This executable's version, as the daemon's is compared with it; in a
/// test build (`failpoints`) `CRONLEASE_FAILPOINT_GUARD_VERSION` if set.
fn own_version() -> String {
    #[cfg(feature = "failpoints")]
    if let Ok(v) = std::env::var("CRONLEASE_FAILPOINT_GUARD_VERSION") {
        return v;
    }
    env!("CARGO_PKG_VERSION").to_string()
}

/// Executes `binary` in this process with `args` and this environment;
/// returns only if it cannot, saying why.
fn exec_daemon_binary(binary: &OwnedFd, args: &[&std::ffi::CStr]) -> String {
    let env: Vec<std::ffi::CString> = std::env::vars_os()
        .filter_map(|(k, v)| {
            let mut pair = k.into_encoded_bytes();
            pair.push(b'=');
            pair.extend(v.into_encoded_bytes());
            std::ffi::CString::new(pair).ok()
        })
        .collect();
    let Err(e) = nix::unistd::fexecve(binary, args, &env);
    format!("executing the daemon's binary: {e}")
}

/// A file in memory for what is left, never executable: sealed so where
/// the kernel knows how (Linux 6.3), plain before.
fn memfd() -> rustix::io::Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, memfd_create};
    let sealed = MemfdFlags::CLOEXEC | MemfdFlags::NOEXEC_SEAL;
    memfd_create("cronlease-guard", sealed).or_else(|e| match e {
        rustix::io::Errno::INVAL => memfd_create("cronlease-guard", MemfdFlags::CLOEXEC),
        e => Err(e),
    })
}

/// [`STOP_SIGNALS`] as a set.
fn stop_set() -> SigSet {
    STOP_SIGNALS.into_iter().collect()
}

/// `cronlease __guard --gone`: what `cronlease-guard` passed on
/// ([`pass_on`]), done: the runs' units and cgroups killed, then the
/// handover. Exits 70 if what it was given cannot be read (the runs'
/// cgroups are still killed).
pub fn resume() -> std::process::ExitCode {
    ignore_stop_signals();
    let _ = sigprocmask(SigmaskHow::SIG_UNBLOCK, Some(&stop_set()), None);
    // Executed from a descriptor, the process would be named by its
    // number before Linux 6.14.
    let _ = nix::sys::prctl::set_name(c"cronlease");
    let mut json = Vec::new();
    let read = std::io::stdin().lock().read_to_end(&mut json);
    // What was read holds the store's address: not kept open past here.
    if let Ok(null) = std::fs::File::open("/dev/null") {
        let _ = nix::unistd::dup2_stdin(&null);
    }
    // serde_json's message may quote what it read (the store's address):
    // only where it stopped is said.
    let remains = read.map_err(|e| e.to_string()).and_then(|_| {
        serde_json::from_slice::<Remains>(&json)
            .map_err(|e| format!("not what the guard passes, at column {}", e.column()))
    });
    let remains = match remains {
        Ok(remains) => remains,
        Err(e) => {
            tracing::error!(
                process = "guard",
                "the daemon died; cannot read what its guard left ({e}): its leases are left to expire"
            );
            kill_cgroups();
            return std::process::ExitCode::from(70);
        }
    };
    let now = std::time::Instant::now();
    let since = remains
        .died_at_ns
        .map(|at| std::time::Duration::from_nanos(monotonic_ns().saturating_sub(at)));
    let died = since.and_then(|s| now.checked_sub(s)).unwrap_or(now);
    remains.finish(died);
    std::process::ExitCode::SUCCESS
}
