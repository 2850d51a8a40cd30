//! Claim round trip per store: one node's `claim` call, batches of 1 and of
//! 1,000 jobs, each request won (the same owner claims each job's next
//! occurrence, as a holder does every instant). Prints p50/p99/max per
//! (store, batch): what a claim costs the store, apart from everything a
//! node does around it.
//!
//! cargo bench --bench claims -- [--stores sqlite,mysql,postgres,redis,sentinel,redlock,zookeeper,etcd] [--batches 1,1000] [--rounds 200]
//!
//! The 1,000-job batch runs `rounds / 10` times (at least 10).

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
mod common;
#[allow(dead_code)]
#[path = "../tests/it/support.rs"]
mod support;

use std::time::{Duration, Instant};

use cronlease::config::{JobName, Misfire};
use cronlease::store::{ClaimOutcome, ClaimRequest, Owner, from_ms};

fn main() {
    let batches: Vec<usize> = common::arg("--batches", "1,1000")
        .split(',')
        .map(|b| b.trim().parse().expect("--batches N,M"))
        .collect();
    let rounds: usize = common::arg("--rounds", "200").parse().expect("--rounds N");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("| store | batch | rounds | p50 | p99 | max | per job (p50) |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for backend in common::stores() {
        for &batch in &batches {
            let n = if batch >= 100 {
                (rounds / 10).max(10)
            } else {
                rounds
            };
            let times = rt.block_on(measure(backend, batch, n));
            let (p50, p99, max) = common::percentiles(times);
            println!(
                "| {backend:?} | {batch} | {n} | {p50:.2} ms | {p99:.2} ms | {max:.2} ms | {:.3} ms |",
                p50 / batch as f64
            );
        }
    }
}

/// Round trips (ms) of `rounds` claim batches of `batch` jobs.
async fn measure(backend: support::Backend, batch: usize, rounds: usize) -> Vec<f64> {
    let h = support::Harness::new(backend).await;
    let store = h.store().await;
    let owner = Owner::from_raw("bench#00000001");
    let jobs: Vec<JobName> = (0..batch)
        .map(|i| JobName::parse(&format!("job{i:05}")).unwrap())
        .collect();
    // Occurrences one second apart, ending now: every one is in the past
    // of the store's clock and later than the one before.
    let start = chrono::Utc::now().timestamp_millis() - 1000 * (rounds as i64 + 1);
    let mut times = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let at = from_ms(start + 1000 * round as i64);
        let requests: Vec<ClaimRequest> = jobs
            .iter()
            .map(|job| ClaimRequest {
                job: job.clone(),
                occurrence: at,
                previous: None,
                misfire: Misfire::Skip,
                owner: owner.clone(),
                lease: Duration::from_secs(10),
                fence_floor: 0,
                max_offset: Duration::from_millis(500),
                head_start: None,
                after_unanswered: false,
                recheck_only: false,
                window_end: None,
                manual: None,
                redeliver: false,
                before_previous: None,
            })
            .collect();
        let t = Instant::now();
        let claimed = store.claim(&requests).await.expect("claim");
        times.push(t.elapsed().as_secs_f64() * 1000.0);
        let won = claimed
            .outcomes
            .iter()
            .filter(|o| matches!(o, ClaimOutcome::Won(_)))
            .count();
        assert_eq!(won, batch, "every claim of the round is won: {claimed:?}");
    }
    times
}
