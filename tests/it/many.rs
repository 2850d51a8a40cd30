//! Many jobs: three real `cronlease run` nodes share 300 jobs due at the
//! same instants, on every store. Judged from what the jobs wrote: every
//! occurrence of every job exactly once, fences increasing per job, and the
//! history holds one record per run. One store at a time (a static lock),
//! so the 900 processes per instant do not crowd out the other tests.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::cluster::Cluster;
use crate::support::{Backend, binary};

const JOBS: usize = 300;
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

/// The next instant a `*/5` job is due after `t`.
fn next_instant(t: DateTime<Utc>) -> DateTime<Utc> {
    let s = t.timestamp();
    DateTime::from_timestamp((s / 5 + 1) * 5, 0).unwrap()
}

fn three_hundred_jobs_each_once(backend: Backend) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut c = Cluster::new(backend, Some(&job_file()), "");
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    // Judge three instants, all nodes up well before the first.
    let first = next_instant(Utc::now() + TimeDelta::seconds(3));
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
    let out = std::process::Command::new(binary())
        .args(["history", "--json", "--limit", "1000000", "-c"])
        .arg(c.config("n1"))
        .output()
        .unwrap();
    let history: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
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

#[test]
fn three_hundred_jobs_each_once_sqlite() {
    three_hundred_jobs_each_once(Backend::Sqlite);
}

#[test]
fn three_hundred_jobs_each_once_mysql() {
    three_hundred_jobs_each_once(Backend::Mysql);
}

#[test]
fn three_hundred_jobs_each_once_postgres() {
    three_hundred_jobs_each_once(Backend::Postgres);
}

#[test]
fn three_hundred_jobs_each_once_redis() {
    three_hundred_jobs_each_once(Backend::Redis);
}
