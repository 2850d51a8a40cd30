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

/// CPU time of a process: utime + stime, in clock ticks.
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
        let before: u64 = tree.iter().map(|p| cpu_ticks(*p)).sum();
        std::thread::sleep(Duration::from_secs(seconds));
        let after: u64 = tree.iter().map(|p| cpu_ticks(*p)).sum();
        let cpu_per_hour = (after - before) as f64 / hz * 3600.0 / seconds as f64;
        let (rss_d, rss_g) = (rss(daemon), rss(guard));
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
