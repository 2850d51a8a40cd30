//! Idle footprint: memory and CPU of one daemon holding `--jobs` jobs that do
//! not fire while it is measured (yearly schedules), on the embedded SQLite
//! store. Prints RSS and PSS (shared pages split among the processes that
//! map them: the guard is the daemon's own binary) of the daemon and its
//! guard, and CPU seconds per hour, measured over `--seconds` after a warm-up.
//!
//! cargo bench --bench idle -- [--jobs 100] [--seconds 120] [--stores sqlite]

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
#[path = "../tests/it/cluster.rs"]
mod cluster;
#[allow(dead_code)]
mod common;
#[allow(dead_code)]
#[path = "../tests/it/support.rs"]
mod support;

use std::time::Duration;

/// (utime + stime in ticks, RSS in KiB) of a process.
fn usage(pid: i32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = fields
        .get(11)
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        + fields
            .get(12)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (ticks, rss)
}

/// Proportional set size in KiB (`/proc/PID/smaps_rollup`), 0 if unreadable.
fn pss(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let jobs: usize = common::arg("--jobs", "100").parse().expect("--jobs N");
    let seconds: u64 = common::arg("--seconds", "120")
        .parse()
        .expect("--seconds N");
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
        "| store | jobs | daemon RSS | daemon PSS | guard RSS | guard PSS | CPU (daemon + guard) | measured over |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for backend in stores {
        let job_file: String = (0..jobs)
            .map(|i| {
                format!(
                    "[[job]]\nname = \"idle{i}\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"true\"\n"
                )
            })
            .collect();
        let mut c = cluster::Cluster::new(backend, Some(&job_file), "");
        c.start("n1");
        std::thread::sleep(Duration::from_secs(5));
        let tree = c.tree("n1");
        let (daemon, guard) = (tree[0], tree.get(1).copied().unwrap_or(tree[0]));
        let before: u64 = tree.iter().map(|p| usage(*p).0).sum();
        std::thread::sleep(Duration::from_secs(seconds));
        let after: u64 = tree.iter().map(|p| usage(*p).0).sum();
        let cpu_per_hour = (after - before) as f64 / hz * 3600.0 / seconds as f64;
        let (rss_d, rss_g) = (usage(daemon).1, usage(guard).1);
        let (pss_d, pss_g) = (pss(daemon), pss(guard));
        c.stop_all();
        let mib = |kib: u64| kib as f64 / 1024.0;
        println!(
            "| {backend:?} | {jobs} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.1} MiB | {cpu_per_hour:.2} s/hour | {seconds} s |",
            mib(rss_d),
            mib(pss_d),
            mib(rss_g),
            mib(pss_g)
        );
    }
}
