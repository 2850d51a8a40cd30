//! Manual-run latency: from `cronlease trigger` being started to the job's
//! process starting on some node.
//!
//! Three `cronlease run` nodes (release build) per store and one job that
//! only runs when triggered (its schedule is yearly). `--rounds` times, at
//! a random point of the second, `cronlease trigger JOB` is run through one
//! of the three nodes' configs and the job writes its request id and the
//! time it started. Reported per store: request to start (p50, p99, max),
//! how long the `trigger` command itself took (its process and its store
//! write: part of the latency), and the floor: starting a shell that reads
//! the clock, from here. Every request must run exactly once.
//!
//! cargo bench --bench trigger -- [--stores ...] [--rounds 20]

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
#[path = "../tests/it/cluster.rs"]
mod cluster;
#[allow(dead_code)]
mod common;
#[allow(dead_code)]
#[path = "../tests/it/support.rs"]
mod support;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const JOB: &str = r#"
[[job]]
name = "manual"
schedule = "0 0 0 1 1 *"
command = "echo \"$CRONLEASE_TRIGGER $CRONLEASE_NODE $(date +%s.%N)\" >> '{out}'"
"#;

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Request id → (node, start) as the job wrote them.
fn started(c: &cluster::Cluster) -> BTreeMap<String, Vec<(String, f64)>> {
    let text = std::fs::read_to_string(&c.out).unwrap_or_default();
    let mut runs: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if let [id, node, t] = f[..] {
            runs.entry(id.to_string())
                .or_default()
                .push((node.to_string(), t.parse().unwrap()));
        }
    }
    runs
}

fn main() {
    let rounds: usize = common::arg("--rounds", "20").parse().expect("--rounds N");
    println!(
        "| store | rounds | request → start p50 | p99 | max | `trigger` command p50 | floor (spawn a shell) p50 | p50 / floor | nodes used | ran twice |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|");
    for backend in common::stores() {
        let mut c = cluster::Cluster::new(backend, Some(JOB), "");
        for n in ["n1", "n2", "n3"] {
            c.start(n);
        }
        support::wait_until(
            "three live nodes",
            Duration::from_secs(60),
            || c.report(),
            || {
                c.cli_json("n1", &["nodes"])
                    .ok()
                    .filter(|v| v.as_array().is_some_and(|a| a.len() == 3))
            },
        );
        let (mut latency, mut command, mut floor) = (Vec::new(), Vec::new(), Vec::new());
        let mut asked: BTreeMap<String, f64> = BTreeMap::new();
        for round in 0..rounds {
            // A random point of the second, against the nodes' 250 ms look.
            let mut r = [0u8; 2];
            getrandom::fill(&mut r).unwrap();
            std::thread::sleep(Duration::from_millis(
                u64::from(u16::from_le_bytes(r)) % 1000,
            ));
            let t0 = unix_now();
            let out = c.cli(&format!("n{}", round % 3 + 1), &["trigger", "manual"]);
            command.push(unix_now() - t0);
            let stdout = String::from_utf8_lossy(&out.stdout);
            let Some(id) = stdout
                .strip_prefix("trigger ")
                .and_then(|s| s.split(':').next())
            else {
                panic!(
                    "trigger failed: {stdout}{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            };
            let id = id.to_string();
            asked.insert(id.clone(), t0);
            let start = support::wait_until(
                "the manual run",
                Duration::from_secs(30),
                || c.report(),
                || started(&c).get(&id).map(|runs| runs[0].1),
            );
            latency.push(start - t0);
            // Recorded (the lock's running mark ends) before the next one.
            std::thread::sleep(Duration::from_millis(400));
            let f0 = unix_now();
            let shell = Command::new("/bin/sh")
                .args(["-c", "date +%s.%N"])
                .output()
                .unwrap();
            let t: f64 = String::from_utf8_lossy(&shell.stdout)
                .trim()
                .parse()
                .unwrap();
            floor.push(t - f0);
        }
        std::thread::sleep(Duration::from_secs(1));
        c.stop_all();
        let runs = started(&c);
        let twice = runs.values().filter(|r| r.len() > 1).count();
        let nodes: std::collections::BTreeSet<&str> = runs
            .values()
            .flat_map(|r| r.iter().map(|(n, _)| n.as_str()))
            .collect();
        assert_eq!(runs.len(), asked.len(), "every request ran\n{}", c.report());
        let ms = |v: f64| format!("{:.0} ms", v * 1000.0);
        let (p50, p99, max) = common::percentiles(latency);
        let (cmd, _, _) = common::percentiles(command);
        let (fl, _, _) = common::percentiles(floor);
        println!(
            "| {backend:?} | {rounds} | {} | {} | {} | {} | {} | {:.0}× | {} | {twice} |",
            ms(p50),
            ms(p99),
            ms(max),
            ms(cmd),
            ms(fl),
            p50 / fl,
            nodes.into_iter().collect::<Vec<_>>().join(", ")
        );
    }
}
