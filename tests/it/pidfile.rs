//! The pid file: `step-down` and `reload` signal only this config's `cronlease run`, a
//! second daemon never takes over or deletes the first one's file, and the
//! file is never written through a symlink.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::cluster::Cluster;
use crate::support::{Backend, binary, wait_until};

fn step_down(c: &Cluster, node: &str) -> std::process::Output {
    c.cli(node, &["step-down"])
}

/// `cronlease run` with `node`'s config, outside the cluster's bookkeeping.
fn spawn_second(c: &Cluster, node: &str, stderr: Stdio) -> std::process::Child {
    Command::new(binary())
        .args(["run", "-c"])
        .arg(c.config(node))
        .env_remove("CRONLEASE_STORE_URL")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap()
}

/// The pid written in `file`, or "" when there is none.
fn pid_in(file: &std::path::Path) -> String {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn alive(child: &mut std::process::Child) -> bool {
    matches!(child.try_wait(), Ok(None))
}

#[test]
fn step_down_never_signals_a_process_that_is_not_this_configs_daemon() {
    let c = Cluster::new(Backend::Sqlite, None, "");
    let pid_file = c.dir.path().join("n1.pid");
    let log = c.dir.path().join("cronlease.log");
    std::fs::write(&log, "").unwrap();
    // A stale file naming an operator's `tail -f cronlease.log`.
    let mut tail = Command::new("tail")
        .arg("-f")
        .arg(&log)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::fs::write(&pid_file, format!("{}\n", tail.id())).unwrap();
    let out = step_down(&c, "n1");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("stale") && err.lines().count() == 1, "{err}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(alive(&mut tail), "step-down signalled the operator's tail");

    // A locked file whose process is not `cronlease run` with this config.
    let mut locker = Command::new("flock")
        .arg(&pid_file)
        .args(["tail", "-f"])
        .arg(&log)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    crate::support::wait_until(
        "flock to hold the pid file",
        Duration::from_secs(10),
        String::new,
        || {
            let free = Command::new("flock")
                .arg("-n")
                .arg(&pid_file)
                .arg("true")
                .status()
                .is_ok_and(|s| s.success());
            (!free).then_some(())
        },
    );
    std::fs::write(&pid_file, format!("{}\n", locker.id())).unwrap();
    let out = step_down(&c, "n1");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("is not `cronlease run`") && err.lines().count() == 1,
        "{err}"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(alive(&mut locker), "step-down signalled flock");
    // flock's own child (tail) goes with its process group.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(locker.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    for p in [&mut tail, &mut locker] {
        let _ = p.kill();
        let _ = p.wait();
    }
}

#[test]
fn a_second_daemon_leaves_the_first_ones_pid_file_alone() {
    let mut c = Cluster::new(Backend::Sqlite, None, "");
    let pid_file = c.dir.path().join("n1.pid");
    c.start("n1");
    let first = c.pid("n1").to_string();
    let read = || pid_in(&pid_file);
    wait_until(
        "the pid file",
        Duration::from_secs(10),
        || c.report(),
        || (read() == first).then_some(()),
    );
    let second = spawn_second(&c, "n1", Stdio::piped());
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(read(), first, "the second daemon overwrote the pid file");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(second.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let out = second.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("held by another running daemon"), "{err}");
    assert_eq!(
        read(),
        first,
        "the second daemon deleted the first one's pid file"
    );
    let out = step_down(&c, "n1");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.stop_all();
    assert!(
        !pid_file.exists(),
        "the daemon removes its pid file on exit"
    );
}

#[test]
fn the_pid_file_is_never_written_through_a_symlink() {
    let mut c = Cluster::new(Backend::Sqlite, None, "");
    let victim = c.dir.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    std::os::unix::fs::symlink(&victim, c.dir.path().join("n1.pid")).unwrap();
    c.start("n1");
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        c.is_running("n1"),
        "a bad pid file is not fatal\n{}",
        c.report()
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    c.stop_all();
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    assert!(c.log("n1").contains("pid file"), "{}", c.report());
}

/// A pid file deleted under a running daemon and made anew by a second one
/// belongs to the second: the first, stopping, leaves it in place.
#[test]
fn a_daemon_never_removes_a_pid_file_it_does_not_hold() {
    let mut c = Cluster::new(Backend::Sqlite, None, "");
    let pid_file = c.dir.path().join("n1.pid");
    c.start("n1");
    let first = c.pid("n1").to_string();
    let read = || pid_in(&pid_file);
    wait_until(
        "the pid file",
        Duration::from_secs(10),
        || c.report(),
        || (read() == first).then_some(()),
    );
    std::fs::remove_file(&pid_file).unwrap();
    let mut second = spawn_second(&c, "n1", Stdio::null());
    let second_pid = second.id().to_string();
    wait_until(
        "the second daemon's pid file",
        Duration::from_secs(10),
        || c.report(),
        || (read() == second_pid).then_some(()),
    );
    c.stop_all();
    assert_eq!(
        read(),
        second_pid,
        "the first daemon removed the second one's pid file"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(second.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let _ = second.wait();
    assert!(
        !pid_file.exists(),
        "the second daemon removes its own pid file"
    );
}

#[test]
fn reload_refuses_a_broken_configuration_and_sends_a_valid_one() {
    let a = "[[job]]\nname = \"a\"\nschedule = \"* * * * * *\"\ncommand = \"echo a >> '{out}'\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(a), "");
    c.start("n1");
    let out = c.out.clone();
    let count = |s: &str| {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == s)
            .count()
    };
    wait_until(
        "a runs",
        Duration::from_secs(15),
        || c.report(),
        || (count("a") >= 1).then_some(()),
    );
    let jobs = c.dir.path().join("jobs.d/jobs.toml");
    std::fs::write(
        &jobs,
        "[[job]]\nname = \"a\"\nschedule = \"* * *\"\ncommand = \"true\"\n",
    )
    .unwrap();
    let refused = c.cli("n1", &["reload"]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(78), "{err}");
    assert!(err.contains("jobs.toml:3:12: invalid schedule"), "{err}");
    assert!(err.contains("reload refused"), "{err}");
    // No SIGHUP reached the daemon: it never logged a reload, and a still runs.
    let before = count("a");
    wait_until(
        "a still runs after a refused reload",
        Duration::from_secs(15),
        || c.report(),
        || (count("a") >= before + 2).then_some(()),
    );
    assert!(!c.log("n1").contains("SIGHUP"), "{}", c.log("n1"));

    let b = format!(
        "[[job]]\nname = \"b\"\nschedule = \"* * * * * *\"\ncommand = \"echo b >> '{}'\"\n",
        out.display()
    );
    std::fs::write(&jobs, b).unwrap();
    let sent = c.cli("n1", &["reload"]);
    let said = String::from_utf8_lossy(&sent.stdout);
    assert_eq!(
        sent.status.code(),
        Some(0),
        "{said}{}",
        String::from_utf8_lossy(&sent.stderr)
    );
    assert!(
        said.starts_with("reload requested from cronlease pid "),
        "{said}"
    );
    wait_until(
        "b runs",
        Duration::from_secs(15),
        || c.report(),
        || (count("b") >= 1).then_some(()),
    );
    assert!(c.log("n1").contains("SIGHUP: configuration reloaded"));

    // `--pid` (the unit's `$MAINPID`): the pid file is not consulted, so a
    // sandbox that hides the daemon's /proc entry does not matter. Here the
    // pid file is moved away: without `--pid` the reload has no daemon.
    let pid_file = c.dir.path().join("n1.pid");
    let aside = c.dir.path().join("n1.pid.aside");
    std::fs::rename(&pid_file, &aside).unwrap();
    let no_file = c.cli("n1", &["reload"]);
    assert_eq!(no_file.status.code(), Some(1));
    let d = format!(
        "[[job]]\nname = \"d\"\nschedule = \"* * * * * *\"\ncommand = \"echo d >> '{}'\"\n",
        out.display()
    );
    std::fs::write(&jobs, d).unwrap();
    let pid = c.pid("n1").to_string();
    let by_pid = c.cli("n1", &["reload", "--pid", &pid]);
    assert_eq!(
        by_pid.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&by_pid.stderr)
    );
    wait_until(
        "d runs after a reload by pid",
        Duration::from_secs(15),
        || c.report(),
        || (count("d") >= 1).then_some(()),
    );
    // Pid 1 is never a daemon of ours: refused as a usage error.
    assert_eq!(
        c.cli("n1", &["reload", "--pid", "1"]).status.code(),
        Some(2)
    );
    std::fs::rename(&aside, &pid_file).unwrap();
    c.stop_all();
}
