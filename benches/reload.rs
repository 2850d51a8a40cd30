//! Memory across reloads (issue 29: "≤ 5 KB of RSS per job, and RSS after
//! ten reloads within 10 % of after the first"): one daemon on SQLite with
//! `--jobs` filler jobs (yearly) in one file plus a job every second; its
//! RSS (`/proc/PID/status` VmRSS) once it runs the tick, then after each of
//! `--reloads` SIGHUPs (each waited for until its "configuration reloaded"
//! line). The floor is the same daemon with no filler job. Uses the binary
//! the tests use (a debug build unless `CRONLEASE_BENCH_BIN` names another).
//!
//! cargo bench --all-features --bench reload -- [--jobs 20000] [--reloads 10] [--settle-ms 3000]
//!
//! `--settle-ms`: how long after each reload (and after the first ticks) the
//! RSS is read.

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

use nix::sys::signal::Signal;

/// The daemon's resident memory, in KiB.
fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// Waits for the `n`-th "configuration reloaded" line of `node`'s log.
fn wait_reloads(c: &cluster::Cluster, n: usize) -> Duration {
    let started = Instant::now();
    while c
        .log("n1")
        .matches("SIGHUP: configuration reloaded")
        .count()
        < n
    {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "no reload {n}\n{}",
            c.report()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    started.elapsed()
}

/// Starts a daemon with `filler` jobs; answers its RSS once it ticks, and
/// after each of `reloads` SIGHUPs with how long the reload took.
fn measure(filler: usize, reloads: usize, settle: Duration) -> (u64, Vec<(u64, Duration)>) {
    let mut jobs =
        "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = \"true\"\n".to_string();
    for i in 0..filler {
        jobs.push_str(&format!(
            "[[job]]\nname = \"filler{i:05}\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"true\"\n"
        ));
    }
    let mut c = cluster::Cluster::new(support::Backend::Sqlite, Some(&jobs), "");
    c.start("n1");
    let pid = c.pid("n1");
    let started = Instant::now();
    while c
        .all_history("n1", Some("tick"))
        .as_array()
        .is_none_or(|a| a.len() < 2)
    {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "{}",
            c.report()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(settle);
    let at_start = rss_kib(pid);
    let mut after = Vec::new();
    for n in 1..=reloads {
        c.signal("n1", Signal::SIGHUP);
        let took = wait_reloads(&c, n);
        // The old job set is dropped as the new one applies; the allocator
        // hands freed pages back after its purge delay (mimalloc: 1 s).
        std::thread::sleep(settle);
        after.push((rss_kib(pid), took));
    }
    c.stop_all();
    (at_start, after)
}

fn main() {
    let jobs: usize = common::arg("--jobs", "20000").parse().expect("--jobs N");
    let reloads: usize = common::arg("--reloads", "10").parse().expect("--reloads N");
    let settle = Duration::from_millis(
        common::arg("--settle-ms", "3000")
            .parse()
            .expect("--settle-ms N"),
    );
    println!(
        "binary: {}",
        std::env::var("CRONLEASE_BENCH_BIN")
            .unwrap_or_else(|_| "this build (tests' binary)".into())
    );
    let (floor, _) = measure(0, 1, settle);
    let (start, after) = measure(jobs, reloads, settle);
    let mib = |k: u64| k as f64 / 1024.0;
    let per_job = |k: u64| k.saturating_sub(floor) as f64 / jobs as f64;
    println!(
        "| when | RSS MiB | KiB per job over the floor | vs after reload 1 | reload took ms |"
    );
    println!("|---|---:|---:|---:|---:|");
    println!(
        "| floor: no filler job, running | {:.1} | | | |",
        mib(floor)
    );
    println!(
        "| {jobs} jobs, running | {:.1} | {:.2} | | |",
        mib(start),
        per_job(start)
    );
    let first = after.first().map_or(start, |(k, _)| *k);
    for (i, (k, took)) in after.iter().enumerate() {
        println!(
            "| after reload {} | {:.1} | {:.2} | {:+.1} % | {} |",
            i + 1,
            mib(*k),
            per_job(*k),
            (*k as f64 / first as f64 - 1.0) * 100.0,
            took.as_millis()
        );
    }
}
