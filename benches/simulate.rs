//! Scale beyond the machine, by simulation (issue 35, item 6): N `Node`s in
//! one process on the in-memory store and tokio's paused clock, J jobs per
//! minute, each job's command a no-op that takes no time. What it measures
//! per (N, J, how the schedules fall):
//!
//! - store calls per instant and per node per instant (a batch is one
//!   call), and claim requests per occurrence (how many nodes claim each
//!   one: the quantity that decides whether the store's load grows with
//!   J or with N × J);
//! - decision CPU per job per node: the process's CPU time over the
//!   measured minute (every node's scheduling, claims, runs and records,
//!   and the in-memory store's own decisions) over N × J;
//! - memory per job per node: the resident set grown from before the nodes
//!   started to the end of the measured minute, over N × J; and its peak
//!   within the measured minute (the kernel's high-water mark, reset as
//!   the minute starts), over N × J. Each twice: the whole resident set,
//!   and its anonymous part (`RssAnon`: the heap, what the jobs cost). The
//!   whole set also counts the pages of this program's code that running
//!   the nodes touched for the first time, about 3 MiB whatever J (at
//!   3 × 1,000 that alone is 1 KiB "per job"). The anonymous peak is the
//!   high-water mark less the file-backed pages mapped when it was reset
//!   (those only grow, so this is never below the true anonymous peak).
//!
//! The process allocates as the daemon does: mimalloc, purging freed
//! pages at once (`tune_allocator` in src/main.rs; here
//! `MIMALLOC_PURGE_DELAY=0`, set for each row's process). Measured on
//! glibc's malloc, which keeps what it freed, the figures were those of
//! another program.
//!
//! `cargo bench --all-features --bench simulate -- [--nodes 3,10,50]
//! [--jobs 1000,10000] [--at spread,zero] [--notices off,on]`: `spread`
//! puts the jobs' seconds evenly over the minute, `zero` every job at :00
//! (the worst case); `on` has the store announce requests, as Redis,
//! PostgreSQL, ZooKeeper and etcd do, `off` not, as MariaDB and SQLite. Each
//! row runs three virtual minutes and measures the third.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
mod common;
#[allow(dead_code)]
#[path = "../tests/it/support.rs"]
mod support;

use std::sync::Arc;

use chrono::{DateTime, TimeZone, Utc};
use cronlease::config::{self, Overrides};
use cronlease::exec::{Finished, RunSpec, Runner, StopReason};
use cronlease::guard::Guard;
use cronlease::node::{Node, NodeParts};
use cronlease::store::Outcome;
use cronlease::store::memory::MemoryStore;
use cronlease::wallclock::{TokioClock, WallClock};
use tokio_util::sync::CancellationToken;

/// The daemon's allocator (src/main.rs), so that memory and CPU are the
/// daemon's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A job that takes no time and succeeds; counts its runs.
#[derive(Default)]
struct Instant0(std::sync::atomic::AtomicUsize);

#[async_trait::async_trait]
impl Runner for Instant0 {
    async fn run<'a>(
        &'a self,
        spec: RunSpec<'a>,
        _guard: Option<&'a Guard>,
        _stop: std::pin::Pin<Box<dyn std::future::Future<Output = StopReason> + Send + 'a>>,
    ) -> Finished {
        let now = spec.clock.now();
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Finished {
            outcome: Outcome::Ok,
            exit_code: Some(0),
            started_at: now,
            finished_at: now,
            output: String::new(),
            usage: Default::default(),
        }
    }
}

fn start() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 12, 1, 12, 0, 0).unwrap()
}

/// `jobs` jobs, each once a minute: at second `i % 60` (`spread`) or all
/// at :00.
fn job_file(jobs: usize, spread: bool) -> String {
    (0..jobs)
        .map(|i| {
            let second = if spread { i % 60 } else { 0 };
            format!(
                "[[job]]\nname = \"j{i:06}\"\nschedule = \"{second} * * * * *\"\ncommand = [\"/bin/true\"]\n"
            )
        })
        .collect()
}

/// A `/proc/self/status` figure in KiB: `VmRSS` (resident now) or
/// `VmHWM` (the peak since the last [`reset_peak`]).
fn status_kib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0)
}

fn rss_kib() -> f64 {
    status_kib("VmRSS")
}

/// The file-backed and shared part of the resident set (the program's
/// code and data pages), in KiB.
fn mapped_kib() -> f64 {
    status_kib("RssFile") + status_kib("RssShmem")
}

/// Resets the kernel's peak resident set (`VmHWM`) to the current one
/// (proc(5), `clear_refs`: 5); false where it cannot (the peak column
/// then says `n/a`).
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn cpu_seconds() -> f64 {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).unwrap();
    let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
    t(usage.user_time()) + t(usage.system_time())
}

/// One row: (N, J, spread, the store announces requests).
fn simulate(nodes: usize, jobs: usize, spread: bool, notices: bool) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async move {
        let dir = tempfile::tempdir().unwrap();
        let store = MemoryStore::starting_at(start() - chrono::Duration::milliseconds(500));
        if notices {
            store.announce_requests();
        }
        let wall = Arc::new(TokioClock::starting_at(
            start() - chrono::Duration::milliseconds(500),
        ));
        let counter = Arc::new(Instant0::default());
        let runner: Arc<dyn Runner> = counter.clone();
        let file = job_file(jobs, spread);
        let (rss0, anon0) = (rss_kib(), status_kib("RssAnon"));
        let mut running = Vec::new();
        for n in 0..nodes {
            let path = dir.path().join(format!("n{n}.toml"));
            std::fs::write(
                &path,
                format!(
                    "node = \"n{n:03}\"\n[store]\nurl = \"sqlite://{}/unused.db\"\nhistory_limit = 1\n{file}",
                    dir.path().display()
                ),
            )
            .unwrap();
            let config = config::load(&path, &Overrides::default()).unwrap();
            let node = Node::with_parts(
                &config,
                Arc::new(store.connection()),
                NodeParts::in_process(wall.clone(), runner.clone()),
            );
            let stop = CancellationToken::new();
            let task = {
                let (node, stop) = (node.clone(), stop.clone());
                let jobs = config.jobs.clone();
                tokio::spawn(async move { node.run(jobs, stop).await })
            };
            running.push((stop, task));
        }
        let until = |at: DateTime<Utc>| {
            let wall = wall.clone();
            async move {
                if let Ok(left) = (at - wall.now()).to_std() {
                    tokio::time::sleep(left).await;
                }
            }
        };
        // Two minutes to settle (holders found), the third measured.
        until(start() + chrono::Duration::seconds(119) + chrono::Duration::milliseconds(900))
            .await;
        let from = store.call_log().len();
        let runs0 = counter.0.load(std::sync::atomic::Ordering::Relaxed);
        let cpu0 = cpu_seconds();
        let peak_reset = reset_peak();
        let mapped_at_reset = mapped_kib();
        until(start() + chrono::Duration::seconds(179) + chrono::Duration::milliseconds(900))
            .await;
        let cpu = cpu_seconds() - cpu0;
        let rss = rss_kib() - rss0;
        let anon = status_kib("RssAnon") - anon0;
        let hwm = status_kib("VmHWM");
        let peak = peak_reset.then_some(hwm - rss0);
        let peak_anon = peak_reset.then_some(hwm - mapped_at_reset - anon0);
        let log = store.call_log();
        let calls = &log[from..];
        let instants = if spread { jobs.min(60) } else { 1 } as f64;
        let claim_requests: usize = calls
            .iter()
            .filter(|c| c.op == "claim")
            .map(|c| c.requests)
            .sum();
        let claims = calls.iter().filter(|c| c.op == "claim").count();
        let runs = counter.0.load(std::sync::atomic::Ordering::Relaxed) - runs0;
        for (stop, task) in running {
            stop.cancel();
            let _ = task.await;
        }
        let nj = (nodes * jobs) as f64;
        let beats = calls.iter().filter(|c| c.op.starts_with("heartbeat")).count();
        format!(
            "| {nodes} | {jobs} | {} | {} | {} | {:.1} | {beats} | {:.1} | {:.2} | {:.1} µs | {:.2} KiB | {} | {:.2} KiB | {} | {runs} |",
            if spread { "over the minute" } else { "all at :00" },
            if notices { "on" } else { "off" },
            calls.len(),
            calls.len() as f64 / nodes as f64,
            claims as f64 / instants,
            claim_requests as f64 / jobs as f64,
            cpu * 1e6 / nj,
            rss / nj,
            peak.map_or_else(|| "n/a".to_string(), |p| format!("{:.2} KiB", p / nj)),
            anon / nj,
            peak_anon.map_or_else(|| "n/a".to_string(), |p| format!("{:.2} KiB", p / nj)),
        )
    })
}

fn main() {
    // One row in a process of its own, so its memory is its own.
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--row") {
        let n: usize = args[i + 1].parse().unwrap();
        let j: usize = args[i + 2].parse().unwrap();
        println!(
            "{}",
            simulate(n, j, args[i + 3] != "zero", args[i + 4] == "on")
        );
        return;
    }
    let list = |name: &str, default: &str| -> Vec<usize> {
        common::arg(name, default)
            .split(',')
            .map(|v| v.trim().parse().expect("a number"))
            .collect()
    };
    let nodes = list("--nodes", "3,10,50");
    let jobs = list("--jobs", "1000,10000");
    let at = common::arg("--at", "spread,zero");
    let notices = common::arg("--notices", "off,on");
    println!(
        "| nodes | jobs/min | schedules | notices | store calls/min | per node | of which heartbeats on their own | claim calls/instant | claim requests per occurrence | CPU per job per node | RSS per job per node | peak in the minute | heap (anonymous) per job per node | its peak in the minute | runs in the minute |"
    );
    println!("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &n in &nodes {
        for &j in &jobs {
            for a in at.split(',') {
                for o in notices.split(',') {
                    let mut row = std::process::Command::new(std::env::current_exe().unwrap());
                    // The daemon's default; one set in the environment wins, as there.
                    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
                        row.env("MIMALLOC_PURGE_DELAY", "0");
                    }
                    let out = row
                        .args(["--row", &n.to_string(), &j.to_string(), a.trim(), o.trim()])
                        .output()
                        .unwrap();
                    print!("{}", String::from_utf8_lossy(&out.stdout));
                }
            }
        }
    }
}
