//! Takeover delay: how late the first occurrence after the holder goes away
//! starts on a peer.
//!
//! Three `cronlease run` nodes (release build, lease margin 1 s, head start
//! 50 ms) per store, a job every second that runs 0.3 s. `--rounds` times
//! per event:
//! - `kill`: SIGKILL of the holder's daemon between runs (its guard lives
//!   and hands over); `kill-busy`: the same while its job runs;
//! - `host`: SIGKILL of daemon and guard together between runs (a dead
//!   host: the head start applies); `host-busy`: the same while its job
//!   runs (the lease is waited out);
//! - `step-down`: SIGUSR1.
//!
//! The killed node is restarted after each round. `normal` is the lateness
//! of every run that followed no event: the floor a takeover is held to.
//! At the end the record is checked: no occurrence twice, fences rising,
//! and how many occurrences were missed.
//!
//! cargo bench --bench takeover -- [--stores ...] [--rounds 20]
//!     [--mode kill,kill-busy,host,host-busy,step-down]

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
    let rounds: usize = common::arg("--rounds", "20").parse().expect("--rounds N");
    let modes = common::arg("--mode", "kill,kill-busy,host,host-busy,step-down");
    println!(
        "| store | event | rounds | takeover p50 | p99 | max | normal p50 / p99 | ran twice | missed |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for backend in common::stores() {
        for mode in modes.split(',') {
            let mut c =
                cluster::Cluster::new(backend, Some(&cluster::timed_job("* * * * * *", 0.3)), "");
            for n in ["n1", "n2", "n3"] {
                c.start(n);
            }
            support::wait_until(
                "steady state",
                Duration::from_secs(20),
                || c.report(),
                || (c.runs().len() >= 3).then_some(()),
            );
            let busy = mode.ends_with("busy");
            let mut delays = Vec::new();
            let mut events = Vec::new();
            for _ in 0..rounds {
                // Busy: while the job runs. Idle: its run over and recorded
                // (the history write gathers for 250 ms after the run).
                cluster::at_fraction_of_second(if busy { 0.1 } else { 0.8 });
                let holder = c.runs().last().expect("a run").node.clone();
                if mode != "step-down" {
                    c.guard_pid(&holder);
                }
                let at = Utc::now();
                match mode {
                    "kill" | "kill-busy" => c.signal(&holder, Signal::SIGKILL),
                    "host" | "host-busy" => c.kill_with_guard(&holder),
                    _ => c.signal(&holder, Signal::SIGUSR1),
                }
                let runs = support::wait_until(
                    "the takeover",
                    Duration::from_secs(20),
                    || c.report(),
                    || {
                        let r = c.runs();
                        r.iter().any(|x| x.occurrence > at).then_some(r)
                    },
                );
                let first = runs
                    .iter()
                    .filter(|x| x.occurrence > at)
                    .min_by_key(|x| x.occurrence)
                    .expect("a run after");
                assert_ne!(first.node, holder, "a peer took over");
                delays.push(lateness(first) * 1000.0);
                eprintln!(
                    "{backend:?} {mode}: {holder} killed at {at}; first run after: {} fence {} on {}, {:.0} ms late",
                    first.occurrence,
                    first.fence,
                    first.node,
                    lateness(first) * 1000.0
                );
                events.push(at);
                if mode != "step-down" {
                    c.wait_exit(&holder, Duration::from_secs(5));
                    c.start(&holder);
                }
                // Steady again (a run on time, not a catch-up) before the
                // next round: a dead busy holder's takeover is a catch-up
                // whose lease runs from its late claim.
                support::wait_until(
                    "a run on time after the takeover",
                    Duration::from_secs(20),
                    || c.report(),
                    || {
                        c.runs()
                            .iter()
                            .any(|x| {
                                x.occurrence > at + chrono::TimeDelta::seconds(2)
                                    && lateness(x) < 0.5
                            })
                            .then_some(())
                    },
                );
            }
            c.stop_all();
            let mut sorted = c.runs();
            sorted.sort_by_key(|r| r.occurrence);
            // Runs of the 3 s after an event are its, not normal ones.
            let normal: Vec<f64> = sorted
                .iter()
                .filter(|r| {
                    !events.iter().any(|at| {
                        (r.occurrence - *at).num_milliseconds() / 1000 < 3 && r.occurrence > *at
                    })
                })
                .map(|r| lateness(r) * 1000.0)
                .collect();
            let twice = sorted
                .windows(2)
                .filter(|w| w[0].occurrence == w[1].occurrence || w[0].fence >= w[1].fence)
                .count();
            let missed: i64 = sorted
                .windows(2)
                .map(|w| ((w[1].occurrence - w[0].occurrence).num_seconds() - 1).max(0))
                .sum();
            let (p50, p99, max) = common::percentiles(delays);
            let (n50, n99, _) = common::percentiles(normal);
            println!(
                "| {backend:?} | {mode} | {rounds} | {p50:.0} ms | {p99:.0} ms | {max:.0} ms | {n50:.0} / {n99:.0} ms | {twice} | {missed} |"
            );
        }
    }
}

/// From a run's scheduled instant to its start.
fn lateness(run: &cluster::Run) -> f64 {
    run.start - run.occurrence.timestamp_micros() as f64 / 1e6
}
