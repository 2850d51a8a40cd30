//! Clock skew, made with libfaketime (Debian package `faketime`): a node whose
//! clock runs ahead must never run a job early, and a node that ran far ahead
//! for a moment must leave nothing behind that makes correct nodes miss. On
//! etcd, which has no clock, a node is measured against the median of the
//! live nodes' clocks.

use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::cluster::{Cluster, Line, check_exactly_once};
use crate::support::{Backend, free_port};

const FAKETIME_LIBS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
];

/// The environment that makes a process's clock run `offset` ahead
/// (e.g. "+5s"); fails the test, saying what to install, without faketime.
fn faked(offset: &str) -> Vec<(&'static str, String)> {
    let lib = FAKETIME_LIBS
        .iter()
        .find(|l| Path::new(l).exists())
        .unwrap_or_else(|| {
            panic!("libfaketime is not installed; these tests need it: apt-get install faketime")
        });
    vec![
        ("LD_PRELOAD", lib.to_string()),
        ("FAKETIME", offset.to_string()),
        ("FAKETIME_DONT_RESET", "1".to_string()),
        // File times stay real: SQLite's store clock is a file's mtime.
        ("NO_FAKE_STAT", "1".to_string()),
    ]
}

/// Each second, the job writes what it is and when it started by the real
/// clock (libfaketime removed from its environment).
const REAL_TIME_TICK: &str = "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = [\"/bin/sh\", \"-c\", \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(env -u LD_PRELOAD -u FAKETIME date +%s.%N)\\\" >> '{out}'\"]\n";

fn start_faked(c: &mut Cluster, node: &str, offset: &str) {
    let env = faked(offset);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    c.start_with_env(node, &env);
}

/// A node 5 s ahead holds back: it runs nothing, says so once, fails
/// `/healthz` with the reason; the correct node runs every occurrence on time.
fn five_seconds_ahead_never_runs_early(backend: Backend) {
    let mut c = Cluster::new(backend, Some(REAL_TIME_TICK), "");
    let port = free_port();
    let n1 = c.config("n1");
    let mut cfg = std::fs::read_to_string(&n1).unwrap();
    cfg.push_str(&format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"));
    std::fs::write(&n1, cfg).unwrap();
    start_faked(&mut c, "n1", "+5s");
    std::thread::sleep(Duration::from_secs(3));
    c.start("n2");
    let lines = c.wait_for(
        "four runs on the correct node",
        Duration::from_secs(20),
        |l| l.iter().filter(|l| l.node == "n2").count() >= 4,
    );
    std::thread::sleep(Duration::from_secs(2));
    let (code, body) = crate::service::http_get(port, "/healthz");
    let report = c.report();
    assert_eq!(code, 503, "{body}\n{report}");
    assert!(body.contains("clock offset"), "{body}");
    // The offset is exported: store - local, about -5 s.
    let (_, metrics) = crate::service::http_get(port, "/metrics");
    let offset = metrics
        .lines()
        .find(|l| l.starts_with("cronlease_clock_offset_seconds"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok());
    assert!(
        offset.is_some_and(|o| (-6.0..-4.0).contains(&o)),
        "cronlease_clock_offset_seconds {offset:?}"
    );
    // `status` on that host says its clock is out of bounds.
    let env = faked("+5s");
    let out = std::process::Command::new(crate::support::binary())
        .args(["status", "-c"])
        .arg(c.config("n1"))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("clock offset of this host") && text.contains("OUT OF BOUNDS"),
        "{text}"
    );
    let lines = {
        let mut all = c.lines();
        all.retain(|l| lines.first().is_none_or(|f| l.occurrence >= f.occurrence));
        all
    };
    let early: Vec<&Line> = lines.iter().filter(|l| l.lateness() < 0.0).collect();
    assert!(
        early.is_empty(),
        "runs started before their instant: {early:?}\n{report}"
    );
    assert!(
        lines.iter().all(|l| l.node == "n2"),
        "the node whose clock runs ahead ran a job\n{report}"
    );
    check_exactly_once(&lines, &report);
    let log = c.log("n1");
    assert_eq!(
        log.matches("more than cluster.max_clock_offset").count(),
        1,
        "one error for the whole episode\n{report}"
    );
    c.stop_all();
}

/// A node 30 s ahead, alive for 3 s, then killed: a correct node started
/// after it misses nothing.
fn thirty_seconds_ahead_for_three_seconds_leaves_no_trace(backend: Backend) {
    let mut c = Cluster::new(backend, Some(REAL_TIME_TICK), "");
    start_faked(&mut c, "n1", "+30s");
    std::thread::sleep(Duration::from_secs(3));
    c.signal("n1", Signal::SIGKILL);
    c.wait_exit("n1", Duration::from_secs(5));
    let started = chrono::Utc::now();
    c.start("n2");
    let lines = c.wait_for(
        "six runs on the correct node",
        Duration::from_secs(15),
        |l| l.iter().filter(|l| l.node == "n2").count() >= 6,
    );
    let report = c.report();
    assert!(
        lines.iter().all(|l| l.node == "n2"),
        "the node whose clock ran ahead ran a job\n{report}"
    );
    let sorted = check_exactly_once(&lines, &report);
    let first = &sorted[0];
    assert!(
        (first.occurrence - started).num_milliseconds() < 5_000,
        "the correct node's first run came late: {first:?} after a start at {started}\n{report}"
    );
    c.stop_all();
}

crate::per_store!(
    [sqlite, mysql, postgres, redis];
    five_seconds_ahead_never_runs_early,
    thirty_seconds_ahead_for_three_seconds_leaves_no_trace
);

/// etcd has no clock: each node is measured against the median of the live
/// nodes' clocks, read from their heartbeats. Of three nodes the one 5 s
/// ahead is out of bounds and runs nothing; `nodes` shows its offset (about
/// -5 s) and the others' (about 0); the two correct nodes run every
/// occurrence once, none early.
#[test]
fn etcd_measures_each_node_against_the_median_of_the_live_clocks() {
    let mut c = Cluster::new(Backend::Etcd, Some(REAL_TIME_TICK), "");
    c.start("n2");
    c.start("n3");
    c.wait_registry("n2", &["n2", "n3"], Duration::from_secs(10));
    start_faked(&mut c, "n1", "+5s");
    let offsets = crate::support::wait_until(
        "the registry to show n1 about 5 s off the median",
        Duration::from_secs(15),
        || c.report(),
        || {
            let nodes = c.cli_json("n2", &["nodes"]).ok()?;
            let offsets: std::collections::BTreeMap<String, i64> = nodes
                .as_array()?
                .iter()
                .filter_map(|n| {
                    Some((
                        n["node"].as_str()?.to_string(),
                        n["clock_offset_ms"].as_i64()?,
                    ))
                })
                .collect();
            let near =
                |node: &str, want: i64| offsets.get(node).is_some_and(|o| (o - want).abs() < 500);
            (near("n1", -5000) && near("n2", 0) && near("n3", 0)).then_some(offsets)
        },
    );
    let since = chrono::Utc::now().timestamp_micros() as f64 / 1e6;
    std::thread::sleep(Duration::from_secs(4));
    c.stop_all();
    let report = format!("offsets {offsets:?}\n{}", c.report());
    let lines: Vec<Line> = c
        .lines()
        .into_iter()
        .filter(|l| l.started >= since)
        .collect();
    assert!(lines.len() >= 3, "the correct nodes ran on\n{report}");
    // Not even before it knew its peers' clocks: it took its peers'
    // records for expired by its own clock and ran its first occurrence
    // 5 s early (about one run in five before the fix).
    assert!(
        c.lines().iter().all(|l| l.node != "n1"),
        "the node 5 s ahead ran a job\n{report}"
    );
    assert!(
        lines.iter().all(|l| l.node != "n1" && l.lateness() >= 0.0),
        "the node 5 s off the median ran a job, or a job ran early\n{report}"
    );
    crate::cluster::check_once_in_order(&lines, &report);
    assert!(
        c.log("n1").contains("more than cluster.max_clock_offset"),
        "the node off the median says so\n{report}"
    );
}
