//! A store that stalls (SIGSTOP, then SIGCONT) while two nodes claim a job
//! every second: the claims queued behind the stall are answered all at once
//! when it ends. None of them may run late, none may catch up an old
//! occurrence, and the first occurrence due after the stall runs on time
//! (docs/protocol.md, "Claims answered late").

use std::time::Duration;

use chrono::Utc;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::cluster::{Cluster, check_once_in_order};
use crate::support::{Backend, MariaDbServer, RedisServer};

/// How long the store stays frozen.
const STALL: Duration = Duration::from_secs(6);

/// A job each second with `misfire`, writing `occurrence fence node start`.
fn every_second(misfire: &str) -> String {
    format!(
        "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\nmisfire = \"{misfire}\"\ncommand = [\"/bin/sh\", \"-c\", \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N)\\\" >> '{{out}}'; sleep 0.3\"]\n"
    )
}

/// Runs the drill on a cluster of two nodes on a store whose server is
/// process `pid`, and judges it from what the job wrote.
pub fn stale_claims_do_not_run(backend: Backend, url: &str, pid: i32, misfire: &str) {
    let mut c = Cluster::with_url(backend, Some(url), Some(&every_second(misfire)), "");
    c.start("n1");
    c.start("n2");
    c.wait_for("runs before the stall", Duration::from_secs(30), |l| {
        l.len() >= 3
    });
    // Mid-second: the stall starts with a claim of the last instant answered.
    crate::cluster::at_fraction_of_second(0.5);
    let stopped = Utc::now();
    kill(Pid::from_raw(pid), Signal::SIGSTOP).unwrap();
    std::thread::sleep(STALL);
    kill(Pid::from_raw(pid), Signal::SIGCONT).unwrap();
    let resumed = Utc::now();
    std::thread::sleep(Duration::from_secs(7));
    let report = c.report();
    let ended = Utc::now();
    c.stop_all();
    let lines = check_once_in_order(&c.lines(), &report);
    if std::env::var_os("STALL_REPORT").is_some() {
        eprintln!("stall {stopped} .. {resumed}\n{report}");
    }
    let resumed_s = resumed.timestamp_millis() as f64 / 1000.0;
    for l in &lines {
        // skip: a run starts within its window (before the next occurrence).
        // run_once: the one catch-up after the stall is of the latest missed
        // occurrence, started by the claim of the one after it.
        let bound = if misfire == "skip" { 1.0 } else { 2.0 };
        assert!(
            l.lateness() < bound,
            "{} (fence {}) ran {:.3}s late on {}: a claim answered after its window still ran\n{report}",
            l.occurrence,
            l.fence,
            l.lateness(),
            l.node
        );
    }
    let late_after_stall: Vec<_> = lines
        .iter()
        .filter(|l| l.started >= resumed_s && l.lateness() >= 1.0)
        .collect();
    assert!(
        late_after_stall.len() <= 1,
        "more than one occurrence caught up after the stall: {late_after_stall:?}\n{report}"
    );
    // Every fence the store gave out is a run or a history record: no claim
    // was won in the store and then dropped unrun and unrecorded.
    let history = c.all_history("n1", Some("tick"));
    let recorded: std::collections::BTreeSet<u64> = history
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["fence"].as_u64())
        .chain(lines.iter().map(|l| l.fence))
        .collect();
    let (Some(first), Some(last)) = (recorded.first(), recorded.last()) else {
        panic!("no runs\n{report}");
    };
    let silent: Vec<u64> = (*first..=*last).filter(|f| !recorded.contains(f)).collect();
    assert!(
        silent.is_empty(),
        "fences {silent:?} were won in the store but neither ran nor were recorded\n{history:#}\n{report}"
    );
    // From two seconds after the stall on (three with run_once: the claim
    // after the stall catches the latest missed occurrence up first, as
    // documented, and the occurrence after it may find that run still
    // going), every occurrence ran, on time.
    let from = resumed.timestamp() + if misfire == "skip" { 2 } else { 3 };
    let until = ended.timestamp() - 1;
    for second in from..until {
        let line = lines.iter().find(|l| l.occurrence.timestamp() == second);
        assert!(
            line.is_some_and(|l| l.lateness() < 0.5),
            "the occurrence at {second} (stall {}..{}) did not run on time: {line:?}\n{report}",
            stopped.timestamp(),
            resumed.timestamp()
        );
    }
}

#[test]
fn redis_claims_queued_behind_a_stall_do_not_run_late_skip() {
    Backend::Redis.require();
    let mut server = RedisServer::new(false);
    server.start();
    let pid = server.pid().unwrap();
    stale_claims_do_not_run(Backend::Redis, &server.url(), pid, "skip");
}

#[test]
fn redis_claims_queued_behind_a_stall_catch_up_only_the_latest_run_once() {
    Backend::Redis.require();
    let mut server = RedisServer::new(false);
    server.start();
    let pid = server.pid().unwrap();
    stale_claims_do_not_run(Backend::Redis, &server.url(), pid, "run_once");
}

#[test]
fn mariadb_claims_queued_behind_a_stall_do_not_run_late() {
    let mut server = MariaDbServer::new();
    server.start();
    let pid = server.pid().unwrap();
    stale_claims_do_not_run(Backend::Mysql, &server.url(), pid, "skip");
}
