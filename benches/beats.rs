//! Heartbeat traffic: store calls per second of one daemon whose jobs fire
//! every second, by lease margin, read from its own `/metrics`
//! (`cronlease_store_call_seconds_count` per op) over `--seconds` after a
//! warm-up. A claim batch carries the heartbeat when one is due, so
//! `heartbeat` counts only the beats sent on their own; `CRONLEASE_BENCH_BIN`
//! runs another build of the binary (e.g. one from before that change) for a
//! before/after table.
//!
//! cargo bench --all-features --bench beats -- [--stores redis] [--jobs 1]
//! [--margins 1s,3s] [--seconds 30]

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

fn main() {
    let jobs: usize = common::arg("--jobs", "1").parse().expect("--jobs N");
    let seconds: u64 = common::arg("--seconds", "30").parse().expect("--seconds N");
    let margins = common::arg("--margins", "1s,3s");
    let stores = if std::env::args().any(|a| a == "--stores") {
        common::stores()
    } else {
        vec![support::Backend::Redis]
    };
    println!(
        "binary: {}",
        std::env::var("CRONLEASE_BENCH_BIN").unwrap_or_else(|_| "this build".into())
    );
    println!(
        "| store | jobs (every second) | margin | claim calls/s | heartbeats on their own /s | all store calls/s | measured over |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for backend in stores {
        for margin in margins.split(',') {
            let job_file: String = (0..jobs)
                .map(|i| {
                    format!(
                        "[[job]]\nname = \"tick{i}\"\nschedule = \"* * * * * *\"\ncommand = \"true\"\n"
                    )
                })
                .collect();
            let port = support::free_port();
            let c = cluster::Cluster::new(
                backend,
                Some(&job_file),
                &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"),
            );
            c.edit_configs("margin = \"1s\"", &format!("margin = \"{margin}\""));
            let mut c = c;
            c.start("n1");
            std::thread::sleep(Duration::from_secs(5));
            let before = common::calls(port);
            let started = Instant::now();
            std::thread::sleep(Duration::from_secs(seconds));
            let after = common::calls(port);
            let took = started.elapsed().as_secs_f64();
            c.stop_all();
            let rate = |op: &str| {
                (after.get(op).copied().unwrap_or(0.0) - before.get(op).copied().unwrap_or(0.0))
                    / took
            };
            let all: f64 = after.keys().map(|op| rate(op)).sum();
            println!(
                "| {backend:?} | {jobs} | {margin} | {:.2} | {:.2} | {all:.2} | {seconds} s |",
                rate("claim"),
                rate("heartbeat"),
            );
        }
    }
}
