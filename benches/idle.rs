//! Idle footprint: memory, CPU and store traffic of one daemon holding
//! `--jobs` jobs that do not fire while it is measured (yearly schedules),
//! on the embedded SQLite store unless `--stores` says. Prints RSS and PSS
//! (shared pages split among the processes that map them: libc, and the
//! binary where the guard is the daemon's own) of the daemon and its guard
//! (`cronlease-guard` where it is beside the binary, else `cronlease
//! __guard`), CPU seconds per hour
//! and as a share of one core (the scheduler's exact run time of their
//! threads; clock ticks where the kernel has no schedstat), and store
//! calls per second by op (the
//! daemon's own `/metrics`, `cronlease_store_call_seconds_count`), measured
//! over `--seconds` after a warm-up; then, for `--fsync-seconds`, the
//! daemon's and guard's `fsync`/`fdatasync` calls per second counted by
//! `strace -c` (on SQLite each is a committed write; `0` skips it).
//! `CRONLEASE_BENCH_BIN` runs another build of the binary, for a
//! before/after table (its guard is the `cronlease-guard` beside it, if
//! any). The daemon runs at the shipped `store.op_timeout`
//! (2 s), not the test clusters' 1 s, unless `--op-timeout` says: on
//! ZooKeeper it is the connection timeout, and the client pings when
//! nothing was sent for five eighths of it, so at 1 s it pings between
//! every two beats.
//!
//! cargo bench --all-features --bench idle -- [--jobs 100] [--seconds 120]
//! [--fsync-seconds 20] [--stores sqlite,redis] [--op-timeout 2s]

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
#[path = "../tests/it/cluster.rs"]
mod cluster;
#[allow(dead_code)]
mod common;
#[allow(dead_code)]
#[path = "../tests/it/support.rs"]
mod support;

use std::time::{Duration, Instant};

/// `fsync` and `fdatasync` calls of `pids` (threads included) over
/// `seconds`, per second, counted by `strace -c`; None without strace.
fn syncs_per_second(pids: &[i32], seconds: u64) -> Option<f64> {
    let mut cmd = std::process::Command::new("strace");
    cmd.args(["-f", "-c", "-e", "trace=fsync,fdatasync"]);
    for pid in pids {
        cmd.arg("-p").arg(pid.to_string());
    }
    let child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_secs(seconds));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .ok()?;
    let out = child.wait_with_output().ok()?;
    let text = String::from_utf8_lossy(&out.stderr);
    // The summary's rows: % time, seconds, usecs/call, calls, [errors,] name.
    let n: u64 = text
        .lines()
        .filter(|l| l.ends_with("fsync") || l.ends_with("fdatasync"))
        .filter_map(|l| l.split_whitespace().nth(3)?.parse::<u64>().ok())
        .sum();
    Some(n as f64 / seconds as f64)
}

/// CPU time of a process in nanoseconds, exact: the sum of its threads'
/// run time as the scheduler counts it at each switch
/// (`/proc/PID/task/*/schedstat`, first field). An idle daemon keeps its
/// threads, so none that ended is missing from the sum. `None` where the
/// kernel has no schedstat.
fn cpu_ns(pid: i32) -> Option<u64> {
    let mut sum = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let path = task.ok()?.path().join("schedstat");
        let text = std::fs::read_to_string(path).ok()?;
        sum += text.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(sum)
}

/// CPU time of a process: utime + stime, in clock ticks (sampled at each
/// tick: over a minute an idle daemon's is a handful of them).
fn cpu_ticks(pid: i32) -> u64 {
    let fields = support::proc_stat(pid);
    [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
        .sum()
}

/// The `key:` line of a `/proc` file that lists sizes in KiB; 0 if unreadable.
fn kib(file: &str, key: &str) -> u64 {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Resident set size in KiB.
fn rss(pid: i32) -> u64 {
    kib(&format!("/proc/{pid}/status"), "VmRSS:")
}

/// Proportional set size in KiB: shared pages split among their mappers.
fn pss(pid: i32) -> u64 {
    kib(&format!("/proc/{pid}/smaps_rollup"), "Pss:")
}

fn main() {
    let jobs: usize = common::arg("--jobs", "100").parse().expect("--jobs N");
    let seconds: u64 = common::arg("--seconds", "120")
        .parse()
        .expect("--seconds N");
    let fsync_seconds: u64 = common::arg("--fsync-seconds", "20")
        .parse()
        .expect("--fsync-seconds N");
    let op_timeout = common::arg("--op-timeout", "");
    let stores = if std::env::args().any(|a| a == "--stores") {
        common::stores()
    } else {
        vec![support::Backend::Sqlite]
    };
    let hz: f64 = String::from_utf8(
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .trim()
    .parse()
    .unwrap();
    println!(
        "binary: {}, store.op_timeout: {}",
        std::env::var("CRONLEASE_BENCH_BIN").unwrap_or_else(|_| "this build".into()),
        if op_timeout.is_empty() {
            "2s (the default)"
        } else {
            &op_timeout
        }
    );
    println!(
        "| store | jobs | daemon RSS | daemon PSS | guard RSS | guard PSS | CPU (daemon + guard) | CPU share | store calls/s | by op | fsyncs/s | measured over |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|");
    for backend in stores {
        let job_file: String = (0..jobs)
            .map(|i| {
                format!(
                    "[[job]]\nname = \"idle{i}\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"true\"\n"
                )
            })
            .collect();
        let port = support::free_port();
        let mut c = cluster::Cluster::new(
            backend,
            Some(&job_file),
            &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"),
        );
        // The test clusters' 1 s, replaced by the given one or removed (the
        // shipped default).
        let config = c.config("n1");
        let text = std::fs::read_to_string(&config).unwrap();
        let timeout = match op_timeout.as_str() {
            "" => String::new(),
            t => format!("op_timeout = \"{t}\""),
        };
        assert!(
            text.contains("op_timeout = \"1s\""),
            "the cluster's config sets op_timeout"
        );
        std::fs::write(&config, text.replace("op_timeout = \"1s\"", &timeout)).unwrap();
        c.start("n1");
        std::thread::sleep(Duration::from_secs(5));
        let tree = c.tree("n1");
        let (daemon, guard) = (tree[0], tree.get(1).copied().unwrap_or(tree[0]));
        let exact = || -> Option<u64> { tree.iter().map(|p| cpu_ns(*p)).sum() };
        let ticks = || -> u64 { tree.iter().map(|p| cpu_ticks(*p)).sum() };
        let (before, before_ticks) = (exact(), ticks());
        let calls_before = common::calls(port);
        let started = Instant::now();
        std::thread::sleep(Duration::from_secs(seconds));
        let (after, after_ticks) = (exact(), ticks());
        let calls_after = common::calls(port);
        let took = started.elapsed().as_secs_f64();
        let cpu_per_hour = match (before, after) {
            (Some(before), Some(after)) => after.saturating_sub(before) as f64 / 1e9,
            _ => after_ticks.saturating_sub(before_ticks) as f64 / hz,
        } * 3600.0
            / took;
        let (rss_d, rss_g) = (rss(daemon), rss(guard));
        let (pss_d, pss_g) = (pss(daemon), pss(guard));
        let syncs = if fsync_seconds > 0 {
            syncs_per_second(&[daemon, guard], fsync_seconds)
                .map_or_else(|| "no strace".to_string(), |n| format!("{n:.2}"))
        } else {
            "-".to_string()
        };
        c.stop_all();
        let rate = |op: &str| {
            (calls_after.get(op).copied().unwrap_or(0.0)
                - calls_before.get(op).copied().unwrap_or(0.0))
                / took
        };
        let all: f64 = calls_after.keys().map(|op| rate(op)).sum();
        let by_op: Vec<String> = calls_after
            .keys()
            .filter(|op| rate(op) > 0.0)
            .map(|op| format!("{op} {:.2}", rate(op)))
            .collect();
        let mib = |kib: u64| kib as f64 / 1024.0;
        println!(
            "| {backend:?} | {jobs} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.1} MiB | {cpu_per_hour:.2} s/hour | {:.3} % | {all:.2} | {} | {syncs} | {seconds} s |",
            mib(rss_d),
            mib(pss_d),
            mib(rss_g),
            mib(pss_g),
            cpu_per_hour / 3600.0 * 100.0,
            by_op.join(", ")
        );
    }
}
