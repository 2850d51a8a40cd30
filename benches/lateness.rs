//! Start lateness: how long after its scheduled instant a job starts.
//!
//! One `cronlease run` (release build) per store with `--jobs` jobs firing
//! every second for `--seconds`; prints, per store, the lateness seen by the
//! job itself (its first action is `date`) and by the daemon (history's
//! `delay_ms`: from the instant to just before spawn, the claim included).
//!
//! cargo bench --bench lateness -- [--stores sqlite,mysql,postgres,redis] [--jobs 4] [--seconds 80]

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
#[path = "../tests/it/cluster.rs"]
mod cluster;
#[allow(dead_code)]
mod common;
#[allow(dead_code)]
#[path = "../tests/it/support.rs"]
mod support;

use std::process::Command;
use std::time::Duration;

fn main() {
    let jobs: usize = common::arg("--jobs", "4").parse().expect("--jobs N");
    let seconds: u64 = common::arg("--seconds", "80").parse().expect("--seconds N");
    println!(
        "| store | occurrences | job-observed p50 | p99 | max | daemon (claim+spawn) p50 | p99 | max |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for backend in common::stores() {
        let job_file: String = (0..jobs)
            .map(|i| {
                format!(
                    "[[job]]\nname = \"tick{i}\"\nschedule = \"* * * * * *\"\ncommand = [\"/bin/sh\", \"-c\", \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N)\\\" >> '{{out}}'\"]\n"
                )
            })
            .collect();
        let mut c = cluster::Cluster::new(backend, Some(&job_file), "");
        c.start("n1");
        std::thread::sleep(Duration::from_secs(seconds));
        c.stop_all();
        let observed: Vec<f64> = c.lines().iter().map(|l| l.lateness() * 1000.0).collect();
        let history = Command::new(support::binary())
            .args(["history", "--json", "--limit", "1000000", "-c"])
            .arg(c.config("n1"))
            .output()
            .expect("cronlease history");
        let runs: serde_json::Value =
            serde_json::from_slice(&history.stdout).expect("history JSON");
        let daemon: Vec<f64> = runs
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["delay_ms"].as_f64())
            .collect();
        let (o50, o99, omax) = common::percentiles(observed.clone());
        let (d50, d99, dmax) = common::percentiles(daemon);
        println!(
            "| {backend:?} | {} | {o50:.1} ms | {o99:.1} ms | {omax:.1} ms | {d50:.0} ms | {d99:.0} ms | {dmax:.0} ms |",
            observed.len()
        );
    }
}
