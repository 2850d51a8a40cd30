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
//! standard input. The binary it executes is the `cronlease` beside it,
//! opened when the guard starts: a package upgraded meanwhile replaces the
//! file's name, not what was opened, so the daemon's own version hands
//! over.

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
            return;
        }
        let Err(e) = pass_on(daemon_binary, remains, died);
        tracing::error!(
            process = "guard",
            "the daemon died; cannot hand over ({e}): its leases are left to expire"
        );
    })
}

/// `cronlease` beside this executable, opened read-only.
fn open_daemon_binary() -> Result<OwnedFd, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
    let path = exe.with_file_name("cronlease");
    std::fs::File::open(&path)
        .map(OwnedFd::from)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Executes `cronlease __guard --gone` in this process with `remains` on
/// its standard input; returns only if it cannot.
fn pass_on(
    daemon_binary: Result<OwnedFd, String>,
    mut remains: Remains,
    died: std::time::Instant,
) -> Result<std::convert::Infallible, String> {
    let binary = daemon_binary?;
    remains.died_us_ago = u64::try_from(died.elapsed().as_micros()).unwrap_or(u64::MAX);
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
    let mut set = SigSet::empty();
    for sig in STOP_SIGNALS {
        if let Ok(sig) = nix::sys::signal::Signal::try_from(sig) {
            set.add(sig);
        }
    }
    set
}

/// `cronlease __guard --gone`: what `cronlease-guard` passed on
/// ([`pass_on`]), done: the runs' units and cgroups killed, then the
/// handover. Exits 70 if what it was given cannot be read.
pub fn resume() -> std::process::ExitCode {
    ignore_stop_signals();
    let _ = sigprocmask(SigmaskHow::SIG_UNBLOCK, Some(&stop_set()), None);
    let mut json = Vec::new();
    let read = std::io::stdin().lock().read_to_end(&mut json);
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
            return std::process::ExitCode::from(70);
        }
    };
    let since = std::time::Duration::from_micros(remains.died_us_ago);
    let now = std::time::Instant::now();
    remains.finish(now.checked_sub(since).unwrap_or(now));
    std::process::ExitCode::SUCCESS
}
