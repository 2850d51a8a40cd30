//! `cronlease __unit-run`: the main process of a run's unit. It starts the
//! job's command with its stdout and stderr on pipes and copies each line
//! to two places: the journal, as a stream of the unit's own (so
//! `journalctl -u cronlease-<job>-<fence>.service` and `-t cronlease-<job>`
//! show it, stdout at priority info, stderr at warning), and its own stdout
//! and stderr, which are the daemon's pipes (the output tail, the
//! scrubbing, the daemon's log). It exits as the command did: its exit
//! code, or killed by the same signal, so systemd records the command's
//! end. Signals to the unit reach every process of it (`KillUnit` "all");
//! this one only notes them and waits for the command. Its stdin is a pipe
//! from the daemon: one byte written there once the command started tells
//! a run that failed from a unit systemd could not set up (`not_started`).

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

/// journald's socket for streams (what `sd_journal_stream_fd` connects to).
const JOURNAL_STDOUT: &str = "/run/systemd/journal/stdout";

/// How long the copies may go on once the command ended (what it left
/// behind may hold the pipes; systemd kills that once this exits).
const DRAIN: Duration = Duration::from_secs(2);

/// A stream into the journal as `identifier` at `priority` (syslog:
/// 6 info, 4 warning); none when journald does not answer.
fn journal_stream(identifier: &str, priority: u8) -> Option<UnixStream> {
    let mut s = UnixStream::connect(JOURNAL_STDOUT).ok()?;
    let _ = s.shutdown(std::net::Shutdown::Read);
    // identifier, unit id, priority, level prefix, forward to syslog,
    // kmsg, console.
    let header = format!("{identifier}\n\n{priority}\n0\n0\n0\n0\n");
    s.write_all(header.as_bytes()).ok()?;
    Some(s)
}

/// Copies `from` to `to` and to `journal`, until `from` ends.
fn copy(mut from: impl Read, mut to: impl Write, mut journal: Option<UnixStream>) {
    let mut buf = vec![0u8; 8192];
    loop {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let _ = to.write_all(&buf[..n]);
                if let Some(j) = &mut journal
                    && j.write_all(&buf[..n]).is_err()
                {
                    journal = None;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

/// `cronlease __unit-run --identifier ID [--arg0 NAME] -- PROGRAM ARGS...`.
pub fn unit_run(identifier: &str, arg0: Option<&str>, command: &[OsString]) -> ExitCode {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        eprintln!("cronlease: cannot run the job: {what}: {e}");
        ExitCode::from(127)
    };
    // Noted, not obeyed: the command gets the same signal and decides.
    for sig in [
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGHUP,
    ] {
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        if let Err(e) = signal_hook::flag::register(sig, flag) {
            return fail("installing the signal handlers", &e);
        }
    }
    let Some((program, args)) = command.split_first() else {
        return fail("command", &"empty");
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(arg0) = arg0 {
        std::os::unix::process::CommandExt::arg0(&mut cmd, arg0);
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return fail(&format!("{}", program.to_string_lossy()), &e),
    };
    // The command runs: one byte on stdin, a pipe from the daemon (the
    // command's own stdin is /dev/null), says so.
    let _ = nix::unistd::write(std::io::stdin(), b"s");
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let mut copies = 0;
    if let Some(out) = child.stdout.take() {
        let done = done_tx.clone();
        let journal = journal_stream(identifier, 6);
        std::thread::spawn(move || {
            copy(out, std::io::stdout().lock(), journal);
            let _ = done.send(());
        });
        copies += 1;
    }
    if let Some(err) = child.stderr.take() {
        let done = done_tx.clone();
        let journal = journal_stream(identifier, 4);
        std::thread::spawn(move || {
            copy(err, std::io::stderr().lock(), journal);
            let _ = done.send(());
        });
        copies += 1;
    }
    let status = loop {
        match child.wait() {
            Ok(s) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return fail("waiting for the command", &e),
        }
    };
    let until = std::time::Instant::now() + DRAIN;
    for _ in 0..copies {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = status.signal() {
        // Ends this process by the same signal, as the command ended.
        let _ = signal_hook::low_level::emulate_default_handler(sig);
        return ExitCode::from(u8::try_from(128 + sig).unwrap_or(255));
    }
    ExitCode::from(
        status
            .code()
            .and_then(|c| u8::try_from(c).ok())
            .unwrap_or(1),
    )
}
