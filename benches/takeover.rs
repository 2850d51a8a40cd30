//! Takeover delay: how late the first occurrence after the holder goes away
//! starts on a peer, for `kill -9` of the holder and for a step-down.
//!
//! Three `cronlease run` nodes (release build, lease margin 1 s) per store,
//! a job every second; `--rounds` times: at mid-second, SIGKILL the holder
//! (then restart it) or send it SIGUSR1; measure the lateness of the first
//! occurrence after the event. At the end the whole record is checked:
//! every occurrence exactly once, fences increasing.
//!
//! cargo bench --bench takeover -- [--stores ...] [--rounds 10] [--mode kill,step-down]

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

use chrono::Utc;
use nix::sys::signal::Signal;

fn main() {
    let rounds: usize = common::arg("--rounds", "10").parse().expect("--rounds N");
    let modes = common::arg("--mode", "kill,step-down");
    println!("| store | event | rounds | takeover p50 | p99 | max | ran twice | missed |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for backend in common::stores() {
        for mode in modes.split(',') {
            let mut c = cluster::Cluster::new(backend, None, "");
            for n in ["n1", "n2", "n3"] {
                c.start(n);
            }
            c.wait_for("steady state", Duration::from_secs(20), |l| l.len() >= 3);
            let mut delays = Vec::new();
            for _ in 0..rounds {
                cluster::at_fraction_of_second(0.4);
                let holder = c.lines().last().expect("a run").node.clone();
                let at = Utc::now();
                match mode {
                    "kill" => {
                        c.signal(&holder, Signal::SIGKILL);
                        c.wait_exit(&holder, Duration::from_secs(5));
                    }
                    _ => c.signal(&holder, Signal::SIGUSR1),
                }
                let lines = c.wait_for("the takeover", Duration::from_secs(20), |l| {
                    l.iter().filter(|x| x.occurrence > at).count() >= 3
                });
                let first = lines
                    .iter()
                    .filter(|x| x.occurrence > at)
                    .min_by_key(|x| x.occurrence)
                    .expect("a run after");
                assert_ne!(first.node, holder, "a peer took over");
                delays.push(first.lateness() * 1000.0);
                if mode == "kill" {
                    c.start(&holder);
                    std::thread::sleep(Duration::from_secs(2));
                }
            }
            c.stop_all();
            let mut sorted = c.lines();
            sorted.sort_by_key(|l| l.occurrence);
            let twice = sorted
                .windows(2)
                .filter(|w| w[0].occurrence == w[1].occurrence)
                .count();
            let missed: i64 = sorted
                .windows(2)
                .map(|w| ((w[1].occurrence - w[0].occurrence).num_seconds() - 1).max(0))
                .sum();
            if missed > 0 {
                for w in sorted.windows(2) {
                    if (w[1].occurrence - w[0].occurrence).num_seconds() > 1 {
                        eprintln!("gap between {:?} and {:?}", w[0], w[1]);
                    }
                }
                // TAKEOVER_LOG_DIR keeps the node logs of a run with a gap.
                if let Ok(dir) = std::env::var("TAKEOVER_LOG_DIR") {
                    std::fs::create_dir_all(&dir).unwrap();
                    for n in ["n1", "n2", "n3"] {
                        std::fs::write(format!("{dir}/{backend:?}-{mode}-{n}.log"), c.log(n))
                            .unwrap();
                    }
                }
            }
            let (p50, p99, max) = common::percentiles(delays);
            println!(
                "| {backend:?} | {mode} | {rounds} | {p50:.0} ms | {p99:.0} ms | {max:.0} ms | {twice} | {missed} |"
            );
        }
    }
}
