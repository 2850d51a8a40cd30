//! Scale: 3 real `cronlease run` nodes × J jobs on one store, every job due
//! every ten seconds at the same instants, `/bin/true` as the command.
//!
//! One table row per (store, J): start delay (history's `delay_ms`: instant
//! → just before spawn) p50/p99/max, the claim decision (`decision_ms`:
//! instant → claim answer) p99, duplicate runs, missed occurrences, store
//! round trips per node per instant (the nodes' own call counts; and what
//! the server counted where it can say: MariaDB statements, PostgreSQL
//! transactions, Redis commands sent by clients, a script call counting 1;
//! less the health pings a node serving /healthz sends a quiet store, shown
//! apart),
//! daemon CPU-seconds per instant (the three daemons and their guard
//! processes together, jobs excluded; the jobs' own CPU apart), the largest RSS, store trouble lines
//! in the logs, and the spawn floor measured in the same run: as many
//! processes as nodes ran jobs, each spawning its share of `/bin/true` at one
//! instant (start p99, and the CPU the spawning processes used).
//!
//! cargo bench --bench scale -- [--stores sqlite,mysql,postgres,redis] [--jobs 4,100,1000] [--seconds 50]
//!
//! `cargo bench --bench scale -- --spawn-cost`: what spawning costs from a
//! process holding many descriptors (why the job guard starts the jobs).
//!
//! `cargo bench --bench scale -- --placement spread [--stores …] [--jobs 1000]`:
//! the same cluster with `cluster.placement = "spread"`, through two
//! instants, kill -9 of n2 (its guard hands over), one instant, a restart of
//! n2, two instants: runs per node at each instant, start p99 against the
//! spawn floor of that split, the start p99 of n2's jobs at the instant
//! after the kill (how long they took to move), and duplicates and misses
//! over all five.
//!
//! `cargo bench --bench scale -- --steady spread [--stores …] [--jobs 300]`:
//! the first table's rows with `cluster.placement = "spread"` and nothing
//! killed (`--steady sticky`, the default, is the first table itself), to
//! set spread's start delay against sticky's on the same load.
//!
//! `cargo bench --bench scale -- --per-minute [--stores redis,postgres] [--jobs 10000] [--minutes 2]`:
//! issue 35's real-store run: J jobs each due once a minute (`0 * * * * *`)
//! with `jitter = "1m"`, so every node moves each job by its name's share of
//! the minute and the runs spread over it (about J/60 a second); measured
//! over `--minutes` whole minutes after a warm-up minute: start delay (from
//! the moved instant) p50/p99/max against the spawn floor of one second's
//! share (3 processes, each spawning a third of J/60 at one instant),
//! duplicates, missed occurrences, store calls per second (the nodes'
//! counts and the server's), daemon CPU per run and the largest RSS.
//!
//! `SCALE_RUST_LOG=cronlease=debug SCALE_LOG_DIR=DIR` keeps the node logs,
//! with each instant's timing (when the timer woke, the claim round trip).

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
#[path = "../tests/it/cluster.rs"]
mod cluster;
#[allow(dead_code)]
mod common;
#[allow(dead_code)]
#[path = "../tests/it/support.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use support::Backend;

const NODES: [&str; 3] = ["n1", "n2", "n3"];

fn main() {
    // A child of the floor measurement: spawn N /bin/true at START_MS.
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--floor-child") {
        let n: usize = args[i + 1].parse().unwrap();
        let start_ms: i64 = args[i + 2].parse().unwrap();
        floor_child(n, start_ms);
        return;
    }
    if args.iter().any(|a| a == "--spawn-cost") {
        spawn_cost();
        return;
    }
    let jobs: Vec<usize> = common::arg("--jobs", "4,100,1000")
        .split(',')
        .map(|j| j.trim().parse().expect("--jobs N,M"))
        .collect();
    let seconds: i64 = common::arg("--seconds", "50").parse().expect("--seconds N");
    if args.iter().any(|a| a == "--per-minute") {
        let minutes: i64 = common::arg("--minutes", "2").parse().expect("--minutes N");
        println!(
            "| store | jobs a minute | runs | delay p50 | p99 | max | floor p99 (3 × J/180 at once) | p99 / floor | decision p99 | dup | missed | node calls/s (3 nodes) | server count/s | daemon+guard CPU ms/run | max RSS |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for backend in common::stores() {
            for &j in &jobs {
                println!("{}", measure_per_minute(backend, j, minutes));
            }
        }
        return;
    }
    if common::arg("--placement", "sticky") == "spread" {
        println!(
            "| store | jobs | runs per node (n1/n2/n3), instants 1 and 2 | start p99 | floor p99 | ratio | after kill -9 of n2: runs per node | n2's jobs' start p99 / max | after its restart: instants 1 and 2 | dup | missed |"
        );
        println!("|---|---:|---|---:|---:|---:|---|---:|---|---:|---:|");
        for backend in common::stores() {
            for &j in &jobs {
                println!("{}", measure_spread(backend, j));
            }
        }
        return;
    }
    println!(
        "| store | jobs | runs | delay p50 | p99 | max | target p99 | decision p99 | floor p99 | floor p99, 3 equal shares (p99 / it) | dup | missed | node calls/node/instant | server count/node/instant | health pings/node/instant | daemon+guard CPU s/instant (3 nodes) | floor spawner CPU s | jobs' CPU s/instant | max RSS | trouble lines |"
    );
    println!(
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for backend in common::stores() {
        for &j in &jobs {
            let row = measure(backend, j, seconds);
            println!("{row}");
        }
    }
}

/// Why the guard starts the jobs: 1,000 `/bin/true` spawned one after the
/// other by a process holding no open pipes, then by one holding 3,000
/// descriptors (1,000 running jobs' pipes and process handles, as the
/// daemon held them): every new child copies the parent's descriptor table
/// and closes it again at `exec`. Three runs each.
fn spawn_cost() {
    println!("| descriptors held | spawn 1,000 (wall) | children's CPU |");
    println!("|---:|---:|---:|");
    for held in [0usize, 3000, 0, 3000, 0, 3000] {
        let pipes: Vec<_> = (0..held / 2)
            .map(|_| nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap())
            .collect();
        let t = std::time::Instant::now();
        let children: Vec<_> = (0..1000)
            .map(|_| {
                Command::new("/bin/true")
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let wall = t.elapsed();
        let before = children_cpu_seconds(std::process::id() as i32);
        for mut c in children {
            c.wait().unwrap();
        }
        let cpu = children_cpu_seconds(std::process::id() as i32) - before;
        drop(pipes);
        println!(
            "| {held} | {:.0} ms | {cpu:.2} s |",
            wall.as_secs_f64() * 1000.0
        );
    }
}

fn job_file(n: usize) -> String {
    (0..n)
        .map(|i| format!("[[job]]\nname = \"s{i:04}\"\nschedule = \"*/10 * * * * *\"\ncommand = [\"/bin/true\"]\n"))
        .collect()
}

/// `n` jobs due once a minute, each moved by its jitter within the minute.
fn job_file_per_minute(n: usize) -> String {
    (0..n)
        .map(|i| format!("[[job]]\nname = \"m{i:05}\"\nschedule = \"0 * * * * *\"\njitter = \"1m\"\ncommand = [\"/bin/true\"]\n"))
        .collect()
}

/// Issue 35's real-store run (see the module's doc): 3 nodes × `jobs` a
/// minute spread by jitter, over `minutes` whole minutes after a warm-up
/// minute.
fn measure_per_minute(backend: Backend, jobs: usize, minutes: i64) -> String {
    let ports: Vec<u16> = NODES.iter().map(|_| support::free_port()).collect();
    let mut c = cluster::Cluster::new(backend, Some(&job_file_per_minute(jobs)), "");
    for (node, port) in NODES.iter().zip(&ports) {
        let path = c.config(node);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str(&format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"));
        std::fs::write(&path, text).unwrap();
    }
    for node in NODES {
        c.start(node);
    }
    // The minute the nodes start in and the next are the warm-up (lock
    // rows created, first claims decided): measure from the one after.
    let now = Utc::now().timestamp();
    let first = chrono::TimeZone::timestamp_opt(&Utc, (now / 60 + 2) * 60, 0).unwrap();
    let end = first + TimeDelta::seconds(60 * minutes);
    sleep_until(first);
    let cpu0: f64 = NODES.iter().map(|n| daemon_cpu_seconds(c.pid(n))).sum();
    let (calls0, pings0) = sum_calls(&ports);
    let server0 = server_count(backend);
    sleep_until(end);
    let cpu1: f64 = NODES.iter().map(|n| daemon_cpu_seconds(c.pid(n))).sum();
    let (calls1, pings1) = sum_calls(&ports);
    let server1 = server_count(backend);
    let rss = NODES.iter().map(|n| rss_mib(c.pid(n))).fold(0.0, f64::max);
    // The last runs of the window end and are recorded.
    std::thread::sleep(Duration::from_secs(3));
    let history = Command::new(support::binary())
        .args(["history", "--json", "--limit", "10000000", "-c"])
        .arg(c.config("n1"))
        .output()
        .expect("cronlease history");
    c.stop_all();
    let runs: serde_json::Value = serde_json::from_slice(&history.stdout).unwrap_or_else(|e| {
        panic!(
            "history JSON: {e}: {}",
            String::from_utf8_lossy(&history.stderr)
        )
    });
    let mut delays = Vec::new();
    let mut decisions = Vec::new();
    let mut seen: BTreeMap<(String, i64), usize> = BTreeMap::new();
    for r in runs.as_array().cloned().unwrap_or_default() {
        let Some(occ) = r["occurrence"]
            .as_str()
            .and_then(|o| DateTime::parse_from_rfc3339(o).ok())
            .map(|t| t.with_timezone(&Utc))
        else {
            continue;
        };
        if occ < first || occ >= end {
            continue;
        }
        let job = r["job"].as_str().unwrap_or_default().to_string();
        *seen.entry((job, occ.timestamp())).or_default() += 1;
        if r["outcome"] == "ok" {
            delays.push(r["delay_ms"].as_f64().unwrap_or(f64::NAN));
            decisions.push(r["decision_ms"].as_f64().unwrap_or(f64::NAN));
        }
    }
    let duplicates: usize = seen.values().map(|n| n.saturating_sub(1)).sum();
    // Each job is due once in every whole minute, wherever its jitter puts it.
    let missed = (jobs * minutes as usize).saturating_sub(seen.len());
    // One second's share, split evenly over the 3 nodes, spawned at once.
    let per_second = jobs.div_ceil(60);
    let share: Vec<usize> = (0..NODES.len())
        .map(|i| per_second / NODES.len() + usize::from(i < per_second % NODES.len()))
        .collect();
    let (floor, _) = spawn_floor(&share, 5);
    let (d50, d99, dmax) = common::percentiles(delays.clone());
    let (_, c99, _) = common::percentiles(decisions);
    let seconds = (end - first).num_seconds() as f64;
    let server = match (server0, server1) {
        (Some(a), Some(b)) => format!("{:.0}", (b - a - (pings1 - pings0)) / seconds),
        _ => "–".into(),
    };
    format!(
        "| {backend:?} | {jobs} | {} | {d50:.0} ms | {d99:.0} ms | {dmax:.0} ms | {floor:.0} ms ({share:?}) | {:.2} | {c99:.0} ms | {duplicates} | {missed} | {:.1} | {server} | {:.2} | {rss:.1} MiB |",
        delays.len(),
        d99 / floor,
        (calls1 - calls0) / seconds,
        (cpu1 - cpu0) * 1000.0 / delays.len().max(1) as f64,
    )
}

/// utime + stime of a process itself (threads included, children not), in
/// seconds: fields 14 and 15 of /proc/PID/stat (from field 3 on after the
/// command name).
fn cpu_seconds(pid: i32) -> f64 {
    let stat = support::proc_stat(pid);
    let ticks: f64 = stat[11].parse::<f64>().unwrap() + stat[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// The daemon's guard process (the `__guard` child that starts its jobs).
fn guards_of(pid: i32) -> Vec<i32> {
    support::all_pids()
        .into_iter()
        .filter(|p| {
            support::proc_stat(*p)
                .get(1)
                .is_some_and(|ppid| *ppid == pid.to_string())
        })
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("__guard"))
        })
        .collect()
}

/// A daemon's own CPU and its guard process's, in seconds.
fn daemon_cpu_seconds(pid: i32) -> f64 {
    let guards: f64 = guards_of(pid).into_iter().map(cpu_seconds).sum();
    cpu_seconds(pid) + guards
}

/// cutime + cstime of the daemon and its guard: what their reaped
/// children (the jobs; the guard starts and reaps them) used.
fn children_cpu_seconds(pid: i32) -> f64 {
    let reaped = |pid: i32| {
        let stat = support::proc_stat(pid);
        let ticks: f64 = stat[13].parse::<f64>().unwrap() + stat[14].parse::<f64>().unwrap();
        ticks / 100.0
    };
    reaped(pid) + guards_of(pid).into_iter().map(reaped).sum::<f64>()
}

fn rss_mib(pid: i32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

/// `cronlease_store_call_seconds_count` from a node's /metrics: summed over
/// claim, renew, release and record; and the health pings (a node serving
/// /healthz pings a store that was quiet for half a margin).
fn store_calls(port: u16) -> (f64, f64) {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return (f64::NAN, f64::NAN);
    };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n");
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    let count = |ops: &[&str]| -> f64 {
        body.lines()
            .filter(|l| l.starts_with("cronlease_store_call_seconds_count"))
            .filter(|l| ops.iter().any(|op| l.contains(&format!("op=\"{op}\""))))
            .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .sum()
    };
    (
        count(&["claim", "renew", "release", "record"]),
        count(&["ping"]),
    )
}

fn sum_calls(ports: &[u16]) -> (f64, f64) {
    ports
        .iter()
        .map(|p| store_calls(*p))
        .fold((0.0, 0.0), |(a, b), (c, d)| (a + c, b + d))
}

/// What the server itself counted so far: MariaDB statements, PostgreSQL
/// transactions, Redis commands; None for SQLite.
fn server_count(backend: Backend) -> Option<f64> {
    let text = |cmd: &mut Command| -> Option<String> {
        let out = cmd.output().ok()?;
        Some(String::from_utf8_lossy(&out.stdout).to_string())
    };
    match backend {
        Backend::Mysql => text(Command::new("mysql").args(["-uroot", "-h127.0.0.1", "-N", "-e", "SHOW GLOBAL STATUS LIKE 'Questions'"]))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok(),
        Backend::Postgres => text(Command::new("psql").args([
            "-h", "127.0.0.1", "-U", "postgres", "-d", "test", "-At", "-c",
            "SELECT pg_stat_clear_snapshot(); SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = 'test'",
        ]))?
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .next_back(),
        // Commands clients sent (Redis counts the ones scripts run too:
        // only those a client can send on its own are summed).
        Backend::Redis => Some(
            text(Command::new("redis-cli").args(["INFO", "commandstats"]))?
                .lines()
                .filter_map(|l| {
                    let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
                    ["evalsha", "eval", "ping", "time", "script", "info", "config"]
                        .contains(&name)
                        .then_some(())?;
                    rest.strip_prefix("calls=")?.split(',').next()?.parse::<f64>().ok()
                })
                .sum(),
        ),
        _ => None,
    }
}

fn measure(backend: Backend, jobs: usize, seconds: i64) -> String {
    let ports: Vec<u16> = NODES.iter().map(|_| support::free_port()).collect();
    let placement = common::arg("--steady", "sticky");
    let extra = format!("[cluster]\nplacement = \"{placement}\"\n");
    let mut c = cluster::Cluster::new(backend, Some(&job_file(jobs)), &extra);
    for (node, port) in NODES.iter().zip(&ports) {
        let path = c.config(node);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str(&format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"));
        std::fs::write(&path, text).unwrap();
    }
    // SCALE_RUST_LOG=cronlease=debug shows each instant's timing in the
    // node logs, copied to SCALE_LOG_DIR when it is set.
    let log_filter = std::env::var("SCALE_RUST_LOG").unwrap_or_default();
    for node in NODES {
        if log_filter.is_empty() {
            c.start(node);
        } else {
            c.start_with_env(node, &[("RUST_LOG", log_filter.as_str())]);
        }
    }
    // Settle: migrations, connections, and the first instant (which creates
    // the jobs' lock rows, once in a store's life); measure from the next.
    let started = Utc::now();
    let first = next_instant(started + TimeDelta::seconds(2)) + TimeDelta::seconds(10);
    sleep_until(first - TimeDelta::milliseconds(500));
    let cpu0: f64 = NODES.iter().map(|n| daemon_cpu_seconds(c.pid(n))).sum();
    let jobs_cpu0: f64 = NODES.iter().map(|n| children_cpu_seconds(c.pid(n))).sum();
    let (calls0, pings0) = sum_calls(&ports);
    let server0 = server_count(backend);
    let instants = (seconds / 10).max(1);
    let last = first + TimeDelta::seconds(10 * (instants - 1));
    sleep_until(last + TimeDelta::milliseconds(9_500));
    let cpu1: f64 = NODES.iter().map(|n| daemon_cpu_seconds(c.pid(n))).sum();
    let jobs_cpu1: f64 = NODES.iter().map(|n| children_cpu_seconds(c.pid(n))).sum();
    let (calls1, pings1) = sum_calls(&ports);
    std::thread::sleep(Duration::from_millis(600));
    let server1 = server_count(backend);
    let rss = NODES.iter().map(|n| rss_mib(c.pid(n))).fold(0.0, f64::max);
    let history = Command::new(support::binary())
        .args(["history", "--json", "--limit", "10000000", "-c"])
        .arg(c.config("n1"))
        .output()
        .expect("cronlease history");
    let trouble: usize = NODES
        .iter()
        .map(|n| {
            c.log(n)
                .lines()
                .filter(|l| {
                    let l = l.to_ascii_lowercase();
                    l.contains("timed out")
                        || l.contains("unreachable")
                        || l.contains("unavailable")
                })
                .count()
        })
        .sum();
    c.stop_all();
    if let Ok(dir) = std::env::var("SCALE_LOG_DIR") {
        std::fs::create_dir_all(&dir).unwrap();
        for n in NODES {
            let to = format!("{dir}/{backend:?}-{jobs}-{n}.log");
            std::fs::write(to, c.log(n)).unwrap();
        }
    }
    let runs: serde_json::Value = serde_json::from_slice(&history.stdout).unwrap_or_else(|e| {
        panic!(
            "history JSON: {e}: {}",
            String::from_utf8_lossy(&history.stderr)
        )
    });
    let runs = runs.as_array().cloned().unwrap_or_default();
    let mut delays = Vec::new();
    let mut decisions = Vec::new();
    let mut seen: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut per_node: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    let window: BTreeSet<String> = (0..instants)
        .map(|i| {
            (first + TimeDelta::seconds(10 * i)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        })
        .collect();
    for r in &runs {
        let occ = r["occurrence"].as_str().unwrap_or_default();
        let occ = DateTime::parse_from_rfc3339(occ)
            .map(|t| {
                t.with_timezone(&Utc)
                    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            })
            .unwrap_or_default();
        if !window.contains(&occ) {
            continue;
        }
        let job = r["job"].as_str().unwrap_or_default().to_string();
        *seen.entry((job, occ.clone())).or_default() += 1;
        if r["outcome"] == "ok" {
            delays.push(r["delay_ms"].as_f64().unwrap_or(f64::NAN));
            decisions.push(r["decision_ms"].as_f64().unwrap_or(f64::NAN));
        }
        let node = r["node"].as_str().unwrap_or_default().to_string();
        *per_node.entry(occ).or_default().entry(node).or_default() += 1;
    }
    let duplicates: usize = seen.values().map(|n| n.saturating_sub(1)).sum();
    let missed = jobs * window.len() - seen.len();
    // The floor: the same distribution of spawns over processes.
    let shares: Vec<usize> = per_node
        .values()
        .max_by_key(|m| m.values().sum::<usize>())
        .map(|m| m.values().copied().collect())
        .unwrap_or_else(|| vec![jobs]);
    let (floor, floor_cpu) = spawn_floor(&shares, instants as usize);
    // The floor as measured from outside (issue 35): as many processes as
    // nodes, each spawning an equal share, whatever the split the nodes ran.
    let even: Vec<usize> = (0..NODES.len())
        .map(|i| jobs / NODES.len() + usize::from(i < jobs % NODES.len()))
        .collect();
    let (floor_even, _) = spawn_floor(&even, instants as usize);
    let (d50, d99, dmax) = common::percentiles(delays.clone());
    let target = p99_target(backend, jobs, floor);
    let verdict = if d99 <= target { "✓" } else { "✗" };
    let (_, c99, _) = common::percentiles(decisions);
    let per_node_instant = NODES.len() as f64 * instants as f64;
    let node_calls = (calls1 - calls0) / per_node_instant;
    let pings = (pings1 - pings0) / per_node_instant;
    // The server's count less the health pings (one statement, one
    // transaction or one command each).
    let server = match (server0, server1) {
        (Some(a), Some(b)) => format!("{:.1}", (b - a) / per_node_instant - pings),
        _ => "–".into(),
    };
    format!(
        "| {backend:?} | {jobs} | {} | {d50:.0} ms | {d99:.0} ms | {dmax:.0} ms | ≤ {target:.0} ms {verdict} | {c99:.0} ms | {floor:.0} ms ({shares:?}) | {floor_even:.0} ms ({:.2}) | {duplicates} | {missed} | {node_calls:.1} | {server} | {pings:.1} | {:.3} | {floor_cpu:.3} | {:.3} | {rss:.1} MiB | {trouble} |",
        delays.len(),
        d99 / floor_even,
        (cpu1 - cpu0) / instants as f64,
        (jobs_cpu1 - jobs_cpu0) / instants as f64,
    )
}

/// Runs of one instant: by node, and each job's node and start delay.
#[derive(Default)]
struct AtInstant {
    per_node: BTreeMap<String, usize>,
    runs: BTreeMap<String, (String, f64)>,
    /// Runs beyond one per job.
    dup: usize,
}

impl AtInstant {
    fn split(&self) -> String {
        NODES
            .iter()
            .map(|n| self.per_node.get(*n).copied().unwrap_or(0).to_string())
            .collect::<Vec<_>>()
            .join("/")
    }
}

/// History's runs by instant (RFC 3339 to the second).
fn instants_of(c: &cluster::Cluster) -> BTreeMap<String, AtInstant> {
    let history = Command::new(support::binary())
        .args(["history", "--json", "--limit", "10000000", "-c"])
        .arg(c.config("n1"))
        .output()
        .expect("cronlease history");
    let runs: serde_json::Value = serde_json::from_slice(&history.stdout).unwrap_or_else(|e| {
        panic!(
            "history JSON: {e}: {}",
            String::from_utf8_lossy(&history.stderr)
        )
    });
    let mut by_instant: BTreeMap<String, AtInstant> = BTreeMap::new();
    for r in runs.as_array().cloned().unwrap_or_default() {
        if r["outcome"] != "ok" {
            continue;
        }
        let occ = DateTime::parse_from_rfc3339(r["occurrence"].as_str().unwrap_or_default())
            .map(|t| {
                t.with_timezone(&Utc)
                    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            })
            .unwrap_or_default();
        let node = r["node"].as_str().unwrap_or_default().to_string();
        let job = r["job"].as_str().unwrap_or_default().to_string();
        let delay = r["delay_ms"].as_f64().unwrap_or(f64::NAN);
        let at = by_instant.entry(occ).or_default();
        *at.per_node.entry(node.clone()).or_default() += 1;
        if at.runs.insert(job, (node, delay)).is_some() {
            at.dup += 1;
        }
    }
    by_instant
}

/// `cluster.placement = "spread"` at 3 nodes × `jobs`: balance, start
/// p99 against the floor, and how the jobs move after kill -9 of n2 and
/// its restart (see the module's doc).
fn measure_spread(backend: Backend, jobs: usize) -> String {
    let mut c = cluster::Cluster::new(
        backend,
        Some(&job_file(jobs)),
        "[cluster]\nplacement = \"spread\"\n",
    );
    for node in NODES {
        c.start(node);
    }
    // Settle (migrations, connections, the jobs' first claims, the
    // registry), then two instants as they are.
    let first = next_instant(Utc::now() + TimeDelta::seconds(2)) + TimeDelta::seconds(10);
    let at = |i: i64| first + TimeDelta::seconds(10 * i);
    sleep_until(at(1) + TimeDelta::seconds(5));
    c.signal("n2", nix::sys::signal::Signal::SIGKILL);
    c.wait_exit("n2", Duration::from_secs(5));
    sleep_until(at(2) + TimeDelta::seconds(5));
    c.start("n2");
    sleep_until(at(4) + TimeDelta::seconds(9));
    c.stop_all();
    let by_instant = instants_of(&c);
    let key = |i: i64| at(i).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let empty = AtInstant::default();
    let inst: Vec<&AtInstant> = (0..5)
        .map(|i| by_instant.get(&key(i)).unwrap_or(&empty))
        .collect();
    let dup: usize = inst.iter().map(|i| i.dup).sum();
    let missed: usize = inst.iter().map(|i| jobs - i.runs.len()).sum();
    // Balance and start delay before the kill, against the floor of the
    // same split.
    let delays: Vec<f64> = inst[..2]
        .iter()
        .flat_map(|i| i.runs.values().map(|(_, d)| *d))
        .collect();
    let (_, d99, _) = common::percentiles(delays);
    let shares: Vec<usize> = inst[1].per_node.values().copied().collect();
    let (floor, _) = spawn_floor(&shares, 2);
    // The instant after the kill: n2's jobs (as of the instant before) ran
    // elsewhere, how late.
    let moved: Vec<f64> = inst[1]
        .runs
        .iter()
        .filter(|(_, (node, _))| node == "n2")
        .filter_map(|(job, _)| inst[2].runs.get(job).map(|(_, d)| *d))
        .collect();
    let (_, m99, mmax) = common::percentiles(moved);
    format!(
        "| {backend:?} | {jobs} | {}, {} | {d99:.0} ms | {floor:.0} ms | {:.2} | {} | {m99:.0} / {mmax:.0} ms | {}, {} | {dup} | {missed} |",
        inst[0].split(),
        inst[1].split(),
        d99 / floor,
        inst[2].split(),
        inst[3].split(),
        inst[4].split(),
    )
}

/// The start p99 a row aims at (ms): at 1,000 jobs 1.2 × floor + 25 ms
/// (Redis, SQLite) or + 50 ms (MariaDB, PostgreSQL); at 100, floor + 15 or
/// + 30 ms; below that 10 or 15 ms flat.
fn p99_target(backend: Backend, jobs: usize, floor: f64) -> f64 {
    let networked = matches!(backend, Backend::Mysql | Backend::Postgres);
    let (slack, small) = if networked { (2.0, 15.0) } else { (1.0, 10.0) };
    match jobs {
        j if j >= 1000 => 1.2 * floor + 25.0 * slack,
        j if j >= 100 => floor + 15.0 * slack,
        _ => small,
    }
}

/// The next instant a `*/10` job is due after `t`.
fn next_instant(t: DateTime<Utc>) -> DateTime<Utc> {
    let s = t.timestamp();
    chrono::TimeZone::timestamp_opt(&Utc, (s / 10 + 1) * 10, 0).unwrap()
}

fn sleep_until(t: DateTime<Utc>) {
    if let Ok(d) = (t - Utc::now()).to_std() {
        std::thread::sleep(d);
    }
}

/// p99 of process start after a common instant (ms), with one process per
/// share each spawning its share of `/bin/true`, over as many instants as
/// the run had (one instant alone swings by 15 %: the floor is sampled as
/// the delays it is set against), and the CPU those spawning processes
/// used themselves per instant (s, their children not counted).
fn spawn_floor(shares: &[usize], rounds: usize) -> (f64, f64) {
    let mut all = Vec::new();
    let mut cpu = 0.0;
    for _ in 0..rounds.max(1) {
        let (starts, c) = spawn_floor_once(shares);
        all.extend(starts);
        cpu += c;
    }
    (common::percentiles(all).1, cpu / rounds.max(1) as f64)
}

fn spawn_floor_once(shares: &[usize]) -> (Vec<f64>, f64) {
    // Every child waits for the same instant, far enough ahead for all
    // of them to be up.
    let start = Utc::now().timestamp_millis() + 1_000;
    let exe = std::env::current_exe().unwrap();
    let handles: Vec<_> = shares
        .iter()
        .map(|n| {
            let exe = exe.clone();
            let n = *n;
            std::thread::spawn(move || {
                let out = Command::new(exe)
                    .args(["--floor-child", &n.to_string(), &start.to_string()])
                    .output()
                    .unwrap();
                let text = String::from_utf8_lossy(&out.stdout).to_string();
                let cpu = text
                    .split_whitespace()
                    .find_map(|v| v.strip_prefix("cpu=")?.parse::<f64>().ok())
                    .unwrap_or(f64::NAN);
                let starts: Vec<f64> = text
                    .split_whitespace()
                    .filter_map(|v| v.parse::<f64>().ok())
                    .collect();
                (starts, cpu)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut cpu = 0.0;
    for h in handles {
        let (starts, c) = h.join().unwrap();
        all.extend(starts);
        cpu += c;
    }
    (all, cpu)
}

fn floor_child(n: usize, start_ms: i64) {
    let start = chrono::TimeZone::timestamp_millis_opt(&Utc, start_ms).unwrap();
    sleep_until(start);
    let mut offsets = Vec::with_capacity(n);
    let mut children = Vec::with_capacity(n);
    for _ in 0..n {
        let child = Command::new("/bin/true").spawn().unwrap();
        offsets.push((Utc::now() - start).num_microseconds().unwrap_or(0) as f64 / 1000.0);
        children.push(child);
    }
    for mut c in children {
        let _ = c.wait();
    }
    let text: Vec<String> = offsets.iter().map(|o| format!("{o:.2}")).collect();
    let cpu = cpu_seconds(std::process::id() as i32);
    println!("{} cpu={cpu:.3}", text.join(" "));
}
