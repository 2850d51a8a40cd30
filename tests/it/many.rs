//! Many jobs: three real `cronlease run` nodes share 300 jobs due at the
//! same instants, on every store. Judged from what the jobs wrote: every
//! occurrence of every job exactly once, fences increasing per job, and the
//! history holds one record per run; and with `cluster.placement =
//! "spread"`, the jobs spread over the nodes, move off a killed node and
//! back to it when it returns. One store at a time (a static lock), so the
//! hundreds of processes per instant do not crowd out the other tests.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::cluster::Cluster;
use crate::support::Backend;

const JOBS: usize = 300;
/// One of these tests at a time: under `cargo test` (threads) this lock,
/// under `cargo nextest` (a process per test) the `many` test group of
/// `.config/nextest.toml`.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A job and one of its instants; the runs seen are (fence, node).
type Occurrence = (String, DateTime<Utc>);

fn job_file() -> String {
    (0..JOBS)
        .map(|i| {
            format!(
                "[[job]]\nname = \"m{i:03}\"\nschedule = \"*/5 * * * * *\"\ncommand = [\"/bin/sh\", \"-c\", \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $CRONLEASE_JOB\\\" >> '{{out}}'\"]\n"
            )
        })
        .collect()
}

/// Every run the jobs wrote, by (job, occurrence): (fence, node) each.
fn runs_written(c: &Cluster) -> BTreeMap<Occurrence, Vec<(u64, String)>> {
    let text = std::fs::read_to_string(&c.out).unwrap();
    let mut runs: BTreeMap<Occurrence, Vec<(u64, String)>> = BTreeMap::new();
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        let [occ, fence, node, job] = f[..] else {
            panic!("malformed line {l:?}");
        };
        let occ = DateTime::parse_from_rfc3339(occ)
            .unwrap()
            .with_timezone(&Utc);
        runs.entry((job.to_string(), occ))
            .or_default()
            .push((fence.parse().unwrap(), node.to_string()));
    }
    runs
}

/// The next instant a `*/5` job is due after `t`.
fn next_instant(t: DateTime<Utc>) -> DateTime<Utc> {
    let s = t.timestamp();
    DateTime::from_timestamp((s / 5 + 1) * 5, 0).unwrap()
}

/// The first `*/5` instant judged, at least 2 s after every node is up
/// (registered, so past its migrations and claiming): a node started after
/// it would start its jobs at their next occurrence, not catch that one
/// up. (`nodes` fails until the first node has created the tables.)
fn first_judged_instant(c: &Cluster) -> DateTime<Utc> {
    crate::support::wait_until(
        "all three nodes in the registry",
        Duration::from_secs(30),
        || c.report(),
        || {
            let listed = c.cli_json("n1", &["nodes"]).ok()?;
            (listed.as_array()?.len() == 3).then_some(())
        },
    );
    next_instant(Utc::now() + TimeDelta::seconds(2))
}

fn three_hundred_jobs_each_once(backend: Backend) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut c = Cluster::new(backend, Some(&job_file()), "");
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    // Judge three instants, all nodes up well before the first.
    let first = first_judged_instant(&c);
    let last = first + TimeDelta::seconds(10);
    let window = [first, first + TimeDelta::seconds(5), last];
    crate::support::wait_until(
        "the third judged instant's runs",
        Duration::from_secs(40),
        || c.report(),
        || {
            let text = std::fs::read_to_string(&c.out).unwrap_or_default();
            let done = text
                .lines()
                .filter(|l| l.starts_with(&last.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)))
                .count();
            (done >= JOBS && Utc::now() > last + TimeDelta::seconds(2)).then_some(())
        },
    );
    c.stop_all();
    let report = c.report();
    let runs = runs_written(&c);
    let mut missing = Vec::new();
    for i in 0..JOBS {
        let job = format!("m{i:03}");
        let mut last_fence = 0;
        for at in window {
            match runs.get(&(job.clone(), at)).map(Vec::as_slice) {
                None => missing.push(format!("{job} {at}")),
                Some([(fence, _)]) => {
                    assert!(*fence > last_fence, "{job}: fences out of order\n{report}");
                    last_fence = *fence;
                }
                Some(more) => panic!("{job} {at} ran {} times: {more:?}\n{report}", more.len()),
            }
        }
    }
    assert!(missing.is_empty(), "never ran: {missing:?}");
    assert!(
        runs.values().all(|r| r.len() == 1),
        "an occurrence ran twice\n{report}"
    );
    // One history record per run.
    let history = c.all_history("n1", None);
    let mut recorded: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in history.as_array().unwrap() {
        let key = (
            r["job"].as_str().unwrap().to_string(),
            r["occurrence"].as_str().unwrap().to_string(),
        );
        *recorded.entry(key).or_default() += 1;
    }
    assert!(recorded.values().all(|n| *n == 1), "a run recorded twice");
    assert!(recorded.len() >= JOBS * window.len());
}

// Every store in the long tier; the default tier keeps Redis (the spread
// test below runs 300 jobs exactly once on four stores as well).
mod three_hundred {
    use super::three_hundred_jobs_each_once;
    crate::per_store!([redis] long [sqlite, mysql, postgres]; three_hundred_jobs_each_once);
}

/// `cluster.placement = "spread"` (docs/protocol.md, "Placement"): three
/// nodes share 300 jobs `*/5`; from two periods after the start each runs
/// 100 ± 15 of them per instant. One is killed with `kill -9`: its jobs go to
/// the other two at the next instant, within the margin. It is started
/// again: within two periods it has its share back. Every occurrence of
/// every job runs exactly once throughout, with increasing fences. The head
/// start is 500 ms, the most a 1 s margin allows: a preferred node whose
/// claims reach the store later than that would lose those jobs for one
/// instant, which is the head start's purpose, not an imbalance. At 250 ms
/// a CI run on a loaded machine saw one node's 102 jobs of an instant go to
/// another that way.
fn spread_over_three_nodes(backend: Backend) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut c = Cluster::new(
        backend,
        Some(&job_file()),
        "[cluster]\nplacement = \"spread\"\nhead_start = \"500ms\"\n",
    );
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    let first = first_judged_instant(&c);
    let instant = |k: i64| first + TimeDelta::seconds(5 * k);
    let sleep_until = |t: DateTime<Utc>| {
        let wait = (t - Utc::now()).to_std().unwrap_or_default();
        std::thread::sleep(wait);
    };
    sleep_until(instant(2) + TimeDelta::milliseconds(2_500));
    c.signal("n2", nix::sys::signal::Signal::SIGKILL);
    c.wait_exit("n2", Duration::from_secs(5))
        .expect("killed node exits");
    sleep_until(instant(3) + TimeDelta::milliseconds(2_500));
    c.start("n2");
    let last = instant(6);
    crate::support::wait_until(
        "the last judged instant's runs",
        Duration::from_secs(60),
        || c.report(),
        || {
            let text = std::fs::read_to_string(&c.out).unwrap_or_default();
            let stamp = last.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
            let done = text.lines().filter(|l| l.starts_with(&stamp)).count();
            (done >= JOBS && Utc::now() > last + TimeDelta::seconds(2)).then_some(())
        },
    );
    c.stop_all();
    let report = c.report();
    let runs = runs_written(&c);
    let mut shares: BTreeMap<i64, BTreeMap<String, usize>> = BTreeMap::new();
    for i in 0..JOBS {
        let job = format!("m{i:03}");
        let mut last_fence = 0;
        for k in 0..=6 {
            match runs.get(&(job.clone(), instant(k))).map(Vec::as_slice) {
                None => panic!("{job} never ran at {}\n{report}", instant(k)),
                Some([(fence, node)]) => {
                    assert!(*fence > last_fence, "{job}: fences out of order\n{report}");
                    last_fence = *fence;
                    *shares
                        .entry(k)
                        .or_default()
                        .entry(node.clone())
                        .or_default() += 1;
                }
                Some(more) => panic!("{job} ran {} times: {more:?}\n{report}", more.len()),
            }
        }
    }
    let summary: Vec<String> = shares.iter().map(|(k, s)| format!("{k}: {s:?}")).collect();
    eprintln!(
        "{backend:?} runs per node per instant: {}",
        summary.join("; ")
    );
    let balanced = |k: i64| {
        let s = &shares[&k];
        ["n1", "n2", "n3"]
            .iter()
            .all(|n| s.get(*n).copied().unwrap_or(0).abs_diff(JOBS / 3) <= 15)
    };
    // From two periods after the start, and two after the restart, each
    // node runs 100 ± 15 at every instant.
    assert!(
        balanced(2),
        "not 100 ± 15 each two periods after the start: {summary:?}\n{report}"
    );
    assert!(
        !shares[&3].contains_key("n2"),
        "the killed node ran nothing: {:?}\n{report}",
        shares[&3]
    );
    assert!(
        balanced(5) && balanced(6),
        "not 100 ± 15 each from two periods after the restart: {summary:?}\n{report}"
    );
    // The dead node's jobs moved within the margin (history's lateness).
    let history = c.all_history("n1", None);
    let at_kill = instant(3).to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let late: Vec<u64> = history
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| {
            r["occurrence"]
                .as_str()
                .and_then(|o| DateTime::parse_from_rfc3339(o).ok())
                .is_some_and(|o| o.with_timezone(&Utc) == instant(3))
        })
        .filter_map(|r| r["delay_ms"].as_u64())
        .collect();
    assert_eq!(late.len(), JOBS, "history of {at_kill}\n{report}");
    // How late they started is measured, not asserted (a timed assertion
    // fails on a loaded machine: a CI run saw 1,035 ms on etcd); the bench
    // `benches/takeover.rs` and `.ci/host-drills` give the figures. What is
    // asserted is the mechanism: the killed node's guard released its
    // leases, so no peer had to wait them out.
    let worst = late.iter().max().copied().unwrap_or(0);
    eprintln!("{backend:?}: the killed node's jobs started at most {worst} ms late");
    let guard_said = c
        .log("n2")
        .lines()
        .find(|l| crate::cluster::guard_on_death(l))
        .map(str::to_owned);
    let released = guard_said.as_deref().and_then(|l| {
        let before = l.split(" leases released").next()?;
        before.rsplit(' ').next()?.parse::<usize>().ok()
    });
    assert!(
        released.is_some_and(|n| n > 0),
        "the killed node's guard released its leases: {guard_said:?}\n{report}"
    );
}

// The default tier on four stores of four kinds (SQL, Redis, ZooKeeper's
// sessions, etcd's median clock), the long tier on all eight; the balance
// rule itself is tested in-process too (`inprocess::spread_*`).
crate::per_store!(
    [sqlite, redis, zookeeper, etcd] long [mysql, postgres, sentinel, redlock];
    spread_over_three_nodes
);
