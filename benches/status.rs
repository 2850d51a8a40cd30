//! What `status` and the dashboard's `/api/status` cost the store per
//! refresh: each job's last run read as one history read per job (how
//! `status::gather` read them before `History::last_runs`) against
//! `last_runs` (one query per 500 jobs on SQL, one pipeline on Redis), with
//! the lock table's read (`status()`) as the floor every refresh pays
//! anyway. Each job holds a lock and has two runs recorded. Reads, not
//! the writes that set them up, are timed.
//!
//! cargo bench --all-features --bench status -- [--stores sqlite,redis]
//! [--jobs 20000]

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
mod common;
#[allow(dead_code)]
#[path = "../tests/it/support.rs"]
mod support;

use std::time::{Duration, Instant};

use chrono::{TimeZone, Utc};
use cronlease::config::{JobName, Misfire};
use cronlease::store::{ClaimRequest, Outcome, Owner, RunRecord};

fn run(job: &str, fence: u64) -> RunRecord {
    let t = Utc
        .timestamp_millis_opt(1_700_000_000_000 + fence as i64 * 1000)
        .unwrap();
    RunRecord {
        job: job.into(),
        fence,
        owner: "bench#1".into(),
        node: "bench".into(),
        occurrence: t,
        started_at: t,
        finished_at: t,
        outcome: Outcome::Ok,
        exit_code: Some(0),
        takeover: false,
        delay_ms: 0,
        decision_ms: 0,
        output: String::new(),
        trigger: None,
        cpu_ms: None,
        memory_peak: None,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1e3)
}

#[tokio::main]
async fn main() {
    let jobs: usize = common::arg("--jobs", "20000").parse().expect("--jobs N");
    let stores = if std::env::args().any(|a| a == "--stores") {
        common::stores()
    } else {
        vec![support::Backend::Sqlite, support::Backend::Redis]
    };
    println!(
        "| store | jobs | one history read per job (before) ms | last_runs (now) ms | before / now | status() floor ms | now / floor |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for backend in stores {
        let h = support::Harness::new(backend).await;
        let store = h.store().await;
        let names: Vec<JobName> = (0..jobs)
            .map(|i| JobName::parse(&format!("job{i}")).unwrap())
            .collect();
        let runs: Vec<RunRecord> = names
            .iter()
            .enumerate()
            .flat_map(|(i, n)| {
                [
                    run(n.as_str(), 2 * i as u64 + 1),
                    run(n.as_str(), 2 * i as u64 + 2),
                ]
            })
            .collect();
        for chunk in runs.chunks(2000) {
            store.record_runs(chunk, 10).await.unwrap();
        }
        // Every job held, as in a running cluster: the lock read (the
        // floor) lists them all.
        let claims: Vec<ClaimRequest> = names
            .iter()
            .map(|job| ClaimRequest {
                job: job.clone(),
                occurrence: Utc::now() - chrono::TimeDelta::seconds(1),
                previous: None,
                misfire: Misfire::Skip,
                owner: Owner::from_raw("bench#1"),
                lease: Duration::from_secs(600),
                fence_floor: 0,
                max_offset: Duration::from_secs(5),
                head_start: None,
                after_unanswered: false,
                recheck_only: false,
                window_end: None,
                manual: None,
                redeliver: false,
                before_previous: None,
            })
            .collect();
        for chunk in claims.chunks(1000) {
            store.claim(chunk).await.unwrap();
        }
        let started = Instant::now();
        let floor_rows = store.status().await.unwrap().len();
        let floor = started.elapsed();
        assert_eq!(floor_rows, jobs, "every job holds a lock");
        let started = Instant::now();
        let mut before = 0;
        for name in &names {
            before += store.history(Some(name), 1).await.unwrap().len();
        }
        let per_job = started.elapsed();
        let started = Instant::now();
        let now = store.last_runs(&names).await.unwrap();
        let batched = started.elapsed();
        assert_eq!(before, jobs);
        assert_eq!(now.iter().flatten().count(), jobs);
        println!(
            "| {backend:?} | {jobs} | {} | {} | {:.1} | {} | {:.1} |",
            ms(per_job),
            ms(batched),
            per_job.as_secs_f64() / batched.as_secs_f64(),
            ms(floor),
            batched.as_secs_f64() / floor.as_secs_f64().max(1e-6),
        );
    }
}
