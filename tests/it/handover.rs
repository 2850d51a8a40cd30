//! A crashed daemon hands over at once (docs/protocol.md): kill -9 of the
//! daemon while its guard lives, with its job running and between runs. The
//! guard kills the jobs, records them `killed` and releases the owner's
//! leases, so the next occurrence runs on a peer at normal lateness. Kill -9
//! of daemon and guard together (a dead host): an idle holder's job moves
//! after the head start, a busy holder's after its lease, as before.
//!
//! One cluster per store goes through the four cases in turn, the killed
//! node restarted after each; judged from what the job wrote and from
//! history: each occurrence at most once, fences in order, no overlap by
//! wall clock.

use std::time::{Duration, Instant};

use chrono::Utc;
use nix::sys::signal::Signal;

use crate::cluster::{
    Cluster, Run, assert_no_overlap, at_fraction_of_second, fraction_of_second, timed_job,
};
use crate::support::Backend;

const MARGIN: f64 = 1.0;
/// `cluster.head_start` here: long enough that a takeover after it is told
/// apart from one at normal lateness.
const HEAD_START: f64 = 0.5;
/// The job runs this long every second.
const JOB_SECS: f64 = 0.3;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Death {
    /// kill -9 of the daemon: its guard hands over.
    Daemon,
    /// kill -9 of daemon and guard together (its job, if running, ends by
    /// itself): nobody hands over.
    Host,
}

/// What one kill showed.
struct Case {
    death: Death,
    busy: bool,
    holder: String,
    /// The holder's run of the killed-at second.
    killed_run: Run,
    /// The first run after the kill (on a peer).
    first: Run,
    /// From the kill to the holder's leaving the registry.
    left_registry: Duration,
    /// What the guard said it did (its line in the node's log).
    guard_said: Option<String>,
}

/// Waits until the job wrote `start` to the output file.
fn wait_for_start(c: &Cluster) {
    crate::support::wait_until(
        "the job to start",
        Duration::from_secs(15),
        || c.report(),
        || {
            std::fs::read_to_string(&c.out)
                .unwrap_or_default()
                .contains("start")
                .then_some(())
        },
    );
}

fn now_f64() -> f64 {
    Utc::now().timestamp_micros() as f64 / 1e6
}

/// Kills the current holder as `death` says, `busy` (while its job runs)
/// or idle (its run over and recorded), and restarts it once a peer ran
/// three occurrences.
fn kill_holder(c: &mut Cluster, death: Death, busy: bool) -> Case {
    // Idle: a crashed daemon's run is over (its record may still be on
    // the way), and its guard has 0.4 s to hand over before the next
    // instant; a dead host's run is recorded too (the record gathers for
    // 250 ms after the run), so its lease counts as idle.
    let at = match (death, busy) {
        (_, true) => 0.1,
        (Death::Daemon, false) => 0.6,
        (Death::Host, false) => 0.85,
    };
    // The run of this second, seen going (busy) or over (idle) by `at`
    // plus 0.1 s; else the next second is tried (a run started late under
    // load would make the previous second's run the one "killed").
    let killed_run = (0..5)
        .find_map(|_| {
            at_fraction_of_second(at);
            let second = Utc::now().timestamp();
            loop {
                let run = c.runs().last().cloned()?;
                if run.occurrence.timestamp() == second && run.end.is_none() == busy {
                    return Some(run);
                }
                let now = Utc::now();
                if now.timestamp() != second || fraction_of_second(now) > at + 0.1 {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
        .unwrap_or_else(|| {
            panic!(
                "no run of its second was {} at {at} s into it in 5 tries\n{}",
                if busy { "going" } else { "over" },
                c.report()
            )
        });
    let holder = killed_run.node.clone();
    c.guard_pid(&holder);
    let logged = c.log(&holder).len();
    let killed_at = now_f64();
    let killed = Instant::now();
    match death {
        Death::Daemon => c.signal(&holder, Signal::SIGKILL),
        Death::Host => c.kill_with_guard(&holder),
    }
    c.wait_exit(&holder, Duration::from_secs(5))
        .expect("the killed daemon exits");
    let peers: Vec<&str> = ["n1", "n2", "n3"]
        .into_iter()
        .filter(|n| *n != holder)
        .collect();
    let left_registry = c.wait_registry(peers[0], &peers, Duration::from_secs(10)) - killed;
    let after = crate::support::wait_until(
        "three runs on peers after the kill",
        Duration::from_secs(20),
        || c.report(),
        || {
            let r = c.runs();
            (r.iter().filter(|x| x.start > killed_at).count() >= 3).then_some(r)
        },
    );
    let first = after.iter().find(|x| x.start > killed_at).unwrap().clone();
    let guard_said = c.log(&holder)[logged..]
        .lines()
        .rev()
        .find(|l| crate::cluster::guard_on_death(l))
        .map(str::to_string);
    c.start(&holder);
    c.wait_registry(peers[0], &["n1", "n2", "n3"], Duration::from_secs(10));
    Case {
        death,
        busy,
        holder,
        killed_run,
        first,
        left_registry,
        guard_said,
    }
}

fn crashed_daemon_hands_over(backend: Backend) {
    let mut c = Cluster::new(
        backend,
        Some(&timed_job("* * * * * *", JOB_SECS)),
        &format!("[cluster]\nhead_start = \"{}ms\"\n", HEAD_START * 1000.0),
    );
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    crate::support::wait_until(
        "three runs",
        Duration::from_secs(20),
        || c.report(),
        || (c.runs().len() >= 3).then_some(()),
    );
    c.wait_registry("n1", &["n1", "n2", "n3"], Duration::from_secs(5));
    let cases: Vec<Case> = [
        (Death::Daemon, true),
        (Death::Daemon, false),
        (Death::Host, false),
        (Death::Host, true),
    ]
    .into_iter()
    .map(|(death, busy)| kill_holder(&mut c, death, busy))
    .collect();
    c.stop_all();
    let report = c.report();
    let runs = c.runs();
    let history: Vec<serde_json::Value> = c
        .cli_json("n1", &["history", "--limit", "1000"])
        .unwrap()
        .as_array()
        .cloned()
        .unwrap();
    let outcome = |fence: u64| {
        history
            .iter()
            .find(|h| h["fence"] == fence)
            .map(|h| h["outcome"].as_str().unwrap_or_default().to_string())
    };
    let finished = |fence: u64| {
        history
            .iter()
            .find(|h| h["fence"] == fence)
            .and_then(|h| chrono::DateTime::parse_from_rfc3339(h["finished_at"].as_str()?).ok())
            .map(|t| t.timestamp_micros() as f64 / 1e6)
    };

    // Every run once (one line set per fence), in order, none overlapping:
    // a killed run counts until its record's end.
    let mut judged = runs.clone();
    for r in &mut judged {
        if r.end.is_none() {
            r.end = finished(r.fence);
        }
    }
    assert_no_overlap(&judged, &report);
    let mut summary = Vec::new();
    for case in &cases {
        let Case {
            death,
            busy,
            holder,
            killed_run,
            first,
            left_registry,
            guard_said,
        } = case;
        let what = format!("{death:?} killed, holder {holder} busy: {busy}");
        let late = first.start - first.occurrence.timestamp_micros() as f64 / 1e6;
        let decided = history
            .iter()
            .find(|h| h["fence"] == first.fence)
            .map_or(serde_json::Value::Null, |h| h["decision_ms"].clone());
        summary.push(format!(
            "{what}: first run on {} {late:.3}s late (claim answered after {decided} ms), out of the registry after {left_registry:?}; {}",
            first.node,
            guard_said.as_deref().unwrap_or("the guard said nothing")
        ));
        assert_ne!(&first.node, holder, "{what}\n{report}");
        if *busy && *death == Death::Daemon {
            assert!(
                killed_run.end.is_none(),
                "{what}: the run was still going when its daemon was killed: {killed_run:?}\n{report}"
            );
        }
        if *death == Death::Host {
            // Nobody deletes a dead host's record: it expires on the store's
            // clock its life after its last beat (two beat periods of a
            // second and a third of the margin), and `nodes` must have
            // dropped it within that and half a second of the kill.
            assert!(
                *left_registry < Duration::from_secs_f64(2.0 + MARGIN / 3.0 + 0.5),
                "{what}: a dead host left the registry after {left_registry:?}\n{report}"
            );
        }
        match (death, busy) {
            (Death::Daemon, _) => {
                // Without the guard's handover: the head start (0.5 s) when
                // idle, the lease (about a margin) when busy.
                assert!(
                    late < 0.3,
                    "{what}: the next run started {late:.3}s late, not at normal lateness\n{report}"
                );
                assert_eq!(
                    first.occurrence.timestamp() - killed_run.occurrence.timestamp(),
                    1,
                    "{what}: the next occurrence ran on a peer\n{report}"
                );
                // The guard took the owner out of the registry too, well
                // before its record would have expired (a margin and more).
                // 900 ms: its record would expire its life (2.33 s) after
                // its last beat, 1.3 s after the kill at the soonest (a CI
                // run under load saw 729 ms).
                assert!(
                    *left_registry < Duration::from_millis(900),
                    "{what}: left the registry after {left_registry:?}\n{report}"
                );
                assert!(
                    guard_said
                        .as_deref()
                        .is_some_and(|l| l.contains("leases released")),
                    "{what}: the guard says what it handed over: {guard_said:?}\n{report}"
                );
                if *busy {
                    assert_eq!(
                        outcome(killed_run.fence).as_deref(),
                        Some("killed"),
                        "{what}: the interrupted run is in history as killed\n{report}"
                    );
                }
            }
            // An idle holder whose run's record reached the store: its
            // lease is idle there. (A host that died with the record still
            // gathering, as a CI run saw under load, left the store a
            // running mark: its lease is waited out, the arm below.)
            (Death::Host, false) if outcome(killed_run.fence).is_some() => {
                // Head start + normal lateness (the bound the daemon case
                // above holds normal lateness to), well short of the margin.
                assert!(
                    (HEAD_START - 0.05..HEAD_START + 0.3).contains(&late),
                    "{what}: an idle holder's job moves after the head start: {late:.3}s late\n{report}"
                );
            }
            (Death::Host, _) => {
                // A busy holder's lease (or one whose run is unrecorded) is
                // waited out: it ran a margin past the next occurrence.
                let lease_end = killed_run.occurrence.timestamp() as f64 + 1.0 + MARGIN;
                assert!(
                    first.start >= lease_end - 0.05,
                    "{what}: a busy holder's lease is waited out; the peer started at {:.3}, the lease ran to {lease_end:.3}\n{report}",
                    first.start
                );
                // The lease's end plus normal lateness (the 0.3 s the
                // daemon case holds to): a CI run saw 1.104 s with the claim
                // at +67 ms and the job's shell starting 36 ms later.
                assert!(late <= MARGIN + 0.3, "{what}: {late:.3}s late\n{report}");
            }
        }
    }
    eprintln!("{backend:?}:\n  {}", summary.join("\n  "));
}

crate::per_store!(all; crashed_daemon_hands_over);

/// A guard that cannot reach the store (its server stopped: connections
/// accepted, never answered) still kills the dead daemon's jobs at once,
/// gives up handing over after the operation timeout and exits. Nothing
/// is released: the lease is left to expire, as without a guard.
#[test]
fn a_guard_that_cannot_reach_the_store_kills_the_jobs_and_exits() {
    use nix::sys::signal::kill;
    use nix::unistd::Pid;
    let mut server = crate::support::RedisServer::new(false);
    server.start();
    let marker = format!("cronlease-unreachable-{}", std::process::id());
    let jobs = format!(
        "[[job]]\nname = \"long\"\nschedule = \"* * * * * *\"\ncommand = \"echo start >> '{{out}}'; : {marker}; sleep 30 & sleep 31\"\n"
    );
    let mut c = Cluster::with_url(Backend::Redis, Some(&server.url()), Some(&jobs), "");
    // A lease that outlasts the guard's attempts by far.
    c.edit_configs("margin = \"1s\"", "margin = \"20s\"");
    c.start("n1");
    let guard = c.guard_pid("n1");
    wait_for_start(&c);
    std::thread::sleep(Duration::from_millis(300));
    let job_pids: Vec<i32> = crate::support::all_pids()
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmd| String::from_utf8_lossy(&cmd).contains(&marker))
        })
        .collect();
    let tree: Vec<i32> = c
        .tree("n1")
        .into_iter()
        .filter(|p| *p != c.pid("n1") && *p != guard)
        .collect();
    assert!(
        !job_pids.is_empty() && tree.len() >= 3,
        "the job runs: {tree:?}"
    );
    let alive = |pid: &i32| {
        crate::support::proc_stat(*pid)
            .first()
            .is_some_and(|s| s != "Z")
    };
    let logged = c.log("n1").len();
    let redis = Pid::from_raw(server.pid().unwrap());
    kill(redis, Signal::SIGSTOP).unwrap();
    let killed = Instant::now();
    c.signal("n1", Signal::SIGKILL);
    c.wait_exit("n1", Duration::from_secs(5)).unwrap();
    let jobs_gone = crate::support::wait_until(
        "the job's processes to be killed",
        Duration::from_secs(2),
        || {
            format!(
                "{:?} alive\n{}",
                tree.iter().filter(|p| alive(p)).collect::<Vec<_>>(),
                c.report()
            )
        },
        || (!tree.iter().any(alive)).then(|| killed.elapsed()),
    );
    let guard_gone = crate::support::wait_until(
        "the guard to give up and exit",
        Duration::from_secs(15),
        || c.report(),
        || (!alive(&guard)).then(|| killed.elapsed()),
    );
    kill(redis, Signal::SIGCONT).unwrap();
    let said = c.log("n1")[logged..]
        .lines()
        .find(|l| crate::cluster::guard_on_death(l))
        .map(str::to_string);
    assert!(
        said.as_deref()
            .is_some_and(|l| l.contains("handing over failed") && l.contains("expire")),
        "the guard says it could not hand over: {said:?}\n{}",
        c.report()
    );
    // Not released: the lease still names the dead daemon's owner.
    let status = c.cli_json("n1", &["status"]).unwrap();
    let job = &status.as_array().unwrap()[0];
    assert!(
        job["holder_node"] == "n1" && job["lease_remaining_ms"].as_u64().is_some_and(|ms| ms > 0),
        "{job}"
    );
    eprintln!(
        "store unreachable: jobs killed {jobs_gone:?} after the daemon's SIGKILL, the guard gave up after {guard_gone:?}: {}",
        said.unwrap_or_default()
    );
}

/// An idle guard sleeps: with no job running its main thread waits for
/// the daemon's next message, not once a second for the scan of the
/// jobs' descendants (which has nothing to scan then). Counted from the
/// kernel's voluntary context switches of that thread (the guard's pid),
/// over four seconds with nothing due: each wake of a thread that sleeps
/// is one.
#[test]
fn an_idle_guard_does_not_wake() {
    let jobs = "[[job]]\nname = \"yearly\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"true\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    let guard = c.guard_pid("n1");
    let switches = || {
        std::fs::read_to_string(format!("/proc/{guard}/task/{guard}/status"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .map(|n| n.trim().parse::<u64>().unwrap())
            .unwrap()
    };
    // Past the start's messages (the store's address, the node's name).
    std::thread::sleep(Duration::from_secs(2));
    let before = switches();
    std::thread::sleep(Duration::from_secs(4));
    let woke = switches() - before;
    assert!(
        woke <= 1,
        "the idle guard's main thread woke {woke} times in 4 s\n{}",
        c.report()
    );
    c.stop_all();
}

/// Which guard a daemon gets.
#[derive(Clone, Copy, PartialEq)]
enum GuardKind {
    /// `cronlease-guard` beside `cronlease`.
    Small,
    /// `cronlease` alone: its own `cronlease __guard`.
    Alone,
    /// `cronlease-guard` beside it, of another version (a failpoint says
    /// so): it gives way to `cronlease __guard`, executed in its place.
    OtherVersion,
}

/// A crashed daemon's guard is `cronlease-guard` when that small
/// executable is beside the daemon's, and hands over through the daemon's
/// binary as it was when the guard started, also once that file's name is
/// gone (a package upgrade replaced it); with `cronlease` alone, or beside
/// a `cronlease-guard` of another version, the daemon's own `cronlease
/// __guard` guards and hands over. Judged from the guard's executable, its
/// lines in the log and history: the run that was going is recorded
/// `killed` and the lease released.
fn crash_hands_over_with(kind: GuardKind) {
    let jobs = "[[job]]\nname = \"long\"\nschedule = \"* * * * * *\"\ncommand = \"echo start >> '{out}'; sleep 30\"\n";
    let mut c = Cluster::new(Backend::Redis, Some(jobs), "");
    // A lease that outlasts the test: only a handover frees it.
    c.edit_configs("margin = \"1s\"", "margin = \"60s\"");
    let bin = c.dir.path().join("cronlease");
    std::fs::copy(&c.bin, &bin).unwrap();
    if kind != GuardKind::Alone {
        let guard = c.bin.with_file_name("cronlease-guard");
        std::fs::copy(&guard, c.dir.path().join("cronlease-guard")).unwrap();
    }
    c.bin = bin.clone();
    match kind {
        GuardKind::OtherVersion => c.start_with_env(
            "n1",
            &[("CRONLEASE_FAILPOINT_GUARD_VERSION", "0.0.1-other")],
        ),
        _ => c.start("n1"),
    }
    let guard = c.guard_pid("n1");
    let expected = match kind {
        GuardKind::Small => "cronlease-guard",
        _ => "cronlease",
    };
    // The guard of another version gives way at once: its executable is
    // the daemon's once it did.
    let exe = crate::support::wait_until(
        "the guard's executable",
        Duration::from_secs(5),
        || c.report(),
        || {
            let exe = std::fs::read_link(format!("/proc/{guard}/exe")).ok()?;
            (exe.file_name().and_then(|n| n.to_str()) == Some(expected)).then_some(exe)
        },
    );
    wait_for_start(&c);
    let still = std::fs::read_link(format!("/proc/{guard}/exe")).unwrap();
    assert_eq!(
        still,
        exe,
        "the guard's executable while the job runs\n{}",
        c.report()
    );
    let gave_way = c
        .log("n1")
        .lines()
        .any(|l| l.contains("is not of its daemon's version") && l.contains("process=\"guard\""));
    assert_eq!(
        gave_way,
        kind == GuardKind::OtherVersion,
        "the guard says it gave way to the daemon's binary\n{}",
        c.report()
    );
    // The daemon's binary is renamed away: only what the guard opened at
    // its start is left to hand over with.
    let moved = c.dir.path().join("cronlease.moved");
    std::fs::rename(&bin, &moved).unwrap();
    let logged = c.log("n1").len();
    c.signal("n1", Signal::SIGKILL);
    c.wait_exit("n1", Duration::from_secs(5)).unwrap();
    let said = crate::support::wait_until(
        "the guard to say what it handed over",
        Duration::from_secs(15),
        || c.report(),
        || {
            c.log("n1")[logged..]
                .lines()
                .find(|l| crate::cluster::guard_on_death(l))
                .map(str::to_string)
        },
    );
    std::fs::rename(&moved, &bin).unwrap();
    assert!(
        said.contains("leases released"),
        "the guard handed over: {said}\n{}",
        c.report()
    );
    let history = c.cli_json("n1", &["history", "--limit", "10"]).unwrap();
    assert!(
        history
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["outcome"] == "killed"),
        "the run that was going is recorded killed: {history}\n{}",
        c.report()
    );
    let status = c.cli_json("n1", &["status"]).unwrap();
    let job = &status.as_array().unwrap()[0];
    assert!(
        job["lease_remaining_ms"].as_u64().is_none_or(|ms| ms == 0),
        "the lease is released: {job}\n{}",
        c.report()
    );
}

#[test]
fn a_small_guard_hands_over_through_the_daemons_binary_as_it_started() {
    crash_hands_over_with(GuardKind::Small);
}

#[test]
fn without_the_small_guard_the_daemons_own_binary_guards_and_hands_over() {
    crash_hands_over_with(GuardKind::Alone);
}

#[test]
fn a_small_guard_of_another_version_gives_way_to_the_daemons_binary() {
    crash_hands_over_with(GuardKind::OtherVersion);
}
