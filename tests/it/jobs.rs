//! Running a job (docs/protocol.md), through a real daemon on SQLite: argv and
//! shell commands, the environment, timeout, overlap, outcomes in history,
//! output in the log, and no job outliving its daemon.

use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::cluster::{Cluster, history};
use crate::support::{Backend, binary, wait_until};

fn wait_history(
    c: &Cluster,
    job: &str,
    pred: impl Fn(&[serde_json::Value]) -> bool,
) -> Vec<serde_json::Value> {
    wait_until(
        &format!("history of {job}"),
        Duration::from_secs(20),
        || c.report(),
        || {
            let h = history(c, job);
            pred(&h).then_some(h)
        },
    )
}

#[test]
fn environment_argv_shell_and_outcomes() {
    let jobs = r#"
[[job]]
name = "env"
schedule = "* * * * * *"
command = ["/bin/sh", "-c", "env > \"{out}.env.$CRONLEASE_FENCE\"; pwd >> \"{out}.env.$CRONLEASE_FENCE\""]
env = { GREETING = "hello world" }
working_dir = "/tmp"

[[job]]
name = "fails"
schedule = "* * * * * *"
command = "echo to-stdout-$CRONLEASE_FENCE; echo to-stderr >&2; exit 3"

[[job]]
name = "missing"
schedule = "* * * * * *"
command = ["/nonexistent/program"]

[[job]]
name = "bare-missing"
schedule = "* * * * * *"
command = ["no-such-program-of-cronlease"]

[[job]]
name = "bare"
schedule = "* * * * * *"
command = ["sh", "-c", "echo \"$0\" > '{out}.bare'"]
"#;
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    // The same store, named by the environment: the job must not see it.
    let url = format!("sqlite://{}", c.dir.path().join("locks.db").display());
    c.start_with_env("n1", &[("CRONLEASE_STORE_URL", url.as_str())]);
    let fails = wait_history(&c, "fails", |h| !h.is_empty());
    assert_eq!(
        (fails[0]["outcome"].as_str(), fails[0]["exit_code"].as_i64()),
        (Some("failed"), Some(3))
    );
    let missing = wait_history(&c, "missing", |h| !h.is_empty());
    assert_eq!(
        (
            missing[0]["outcome"].as_str(),
            missing[0]["exit_code"].as_i64()
        ),
        (Some("not_started"), None)
    );
    // A program named without a path is looked up in PATH before the
    // spawn: found, it runs (argv[0] as written); not found, every run is
    // not_started and the next one comes (no start hangs).
    let bare_missing = wait_history(&c, "bare-missing", |h| h.len() >= 3);
    assert!(
        bare_missing.iter().all(|r| r["outcome"] == "not_started"),
        "{bare_missing:?}"
    );
    let bare = wait_history(&c, "bare", |h| !h.is_empty());
    assert_eq!(bare[0]["outcome"], "ok", "{bare:?}");
    let argv0 = std::fs::read_to_string(format!("{}.bare", c.out.display())).unwrap();
    assert_eq!(argv0.trim(), "sh");
    let env_runs = wait_history(&c, "env", |h| !h.is_empty());
    c.stop_all();

    // status: per job the holder (released at shutdown), fence, last
    // occurrence, and the last run's outcome and node.
    let status = c.cli_json("n1", &["status"]).unwrap();
    let fails_status = status
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["job"] == "fails")
        .unwrap();
    assert_eq!(
        fails_status["holder"],
        serde_json::Value::Null,
        "released on shutdown: {fails_status}"
    );
    assert!(
        fails_status["fence"].as_u64().unwrap() >= 1 && fails_status["last_occurrence"].is_string(),
        "{fails_status}"
    );
    assert_eq!(
        fails_status["last_run"]["outcome"], "failed",
        "{fails_status}"
    );
    assert_eq!(fails_status["last_run"]["exit_code"], 3, "{fails_status}");
    assert_eq!(fails_status["last_run"]["node"], "n1", "{fails_status}");
    let table = Command::new(binary())
        .args(["status", "-c"])
        .arg(c.config("n1"))
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("fails ") && l.contains("failed (3) on n1")),
        "{table}"
    );
    let fence = env_runs[0]["fence"].as_u64().unwrap();
    let env = std::fs::read_to_string(format!("{}.env.{fence}", c.out.display())).unwrap();
    let occurrence = env_runs[0]["occurrence"]
        .as_str()
        .unwrap()
        .replace(".000", "");
    for want in [
        "CRONLEASE_JOB=env".to_string(),
        format!("CRONLEASE_FENCE={fence}"),
        format!("CRONLEASE_OCCURRENCE={occurrence}"),
        "CRONLEASE_NODE=n1".to_string(),
        "GREETING=hello world".to_string(),
    ] {
        assert!(
            env.lines().any(|l| l == want),
            "{want} missing from the job's environment:\n{env}"
        );
    }
    assert!(env.lines().last() == Some("/tmp"), "working_dir: {env}");
    assert!(
        !env.contains("CRONLEASE_STORE_URL="),
        "the store URL is not passed on"
    );

    // Output lines are in the daemon's log, tagged with job and fence.
    let log = c.log("n1");
    let line = log
        .lines()
        .find(|l| l.contains("to-stdout-"))
        .expect("stdout line logged");
    assert!(
        line.contains("job=fails") || line.contains("job\":\"fails"),
        "{line}"
    );
    assert!(line.contains("fence="), "{line}");
    assert!(
        log.lines()
            .any(|l| l.contains("to-stderr") && l.contains("stderr")),
        "stderr logged"
    );
}

#[test]
fn timeout_sends_sigterm_then_sigkill() {
    let jobs = r#"
[[job]]
name = "stubborn"
schedule = "* * * * * *"
command = "trap '' TERM; echo started >> '{out}.stubborn'; sleep 20; echo survived >> '{out}.stubborn'"
timeout = "1s"
kill_grace = "1s"

[[job]]
name = "polite"
schedule = "* * * * * *"
command = "trap 'echo terminated >> {out}.polite; exit 0' TERM; sleep 20 & wait"
timeout = "1s"
"#;
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    // Occurrences due while a run goes are recorded `skipped`: look past them.
    let ran = |h: &[serde_json::Value]| h.iter().any(|r| r["outcome"] != "skipped");
    let runs_only = |h: Vec<serde_json::Value>| -> Vec<serde_json::Value> {
        h.into_iter()
            .filter(|r| r["outcome"] != "skipped")
            .collect()
    };
    let stubborn = runs_only(wait_history(&c, "stubborn", ran));
    let polite = runs_only(wait_history(&c, "polite", ran));
    c.stop_all();
    assert_eq!(stubborn[0]["outcome"], "timeout");
    assert_eq!(stubborn[0]["exit_code"], 137, "SIGKILL after kill_grace");
    let took = |r: &serde_json::Value| {
        let t = |k: &str| chrono::DateTime::parse_from_rfc3339(r[k].as_str().unwrap()).unwrap();
        (t("finished_at") - t("started_at")).num_milliseconds()
    };
    assert!(
        (1900..4000).contains(&took(&stubborn[0])),
        "timeout 1 s + kill_grace 1 s: {}",
        took(&stubborn[0])
    );
    assert_eq!(polite[0]["outcome"], "timeout");
    assert!(
        (900..1900).contains(&took(&polite[0])),
        "ended by SIGTERM: {}",
        took(&polite[0])
    );
    let polite_out = std::fs::read_to_string(format!("{}.polite", c.out.display())).unwrap();
    assert!(polite_out.contains("terminated"));
    let stubborn_out = std::fs::read_to_string(format!("{}.stubborn", c.out.display())).unwrap();
    assert!(!stubborn_out.contains("survived"));
}

#[test]
fn overlap_skip_never_runs_a_job_twice_at_once() {
    let jobs = r#"
[[job]]
name = "slow"
schedule = "* * * * * *"
command = "echo start $(date +%s.%N) >> '{out}.slow'; sleep 2.5; echo end $(date +%s.%N) >> '{out}.slow'"
"#;
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    let file = format!("{}.slow", c.out.display());
    wait_for_starts(&c, &file, 2, Duration::from_secs(30));
    c.stop_all();
    let text = std::fs::read_to_string(&file).unwrap();
    let events: Vec<(&str, f64)> = text
        .lines()
        .map(|l| {
            let (kind, t) = l.split_once(' ').unwrap();
            (kind, t.parse().unwrap())
        })
        .collect();
    assert!(events.len() >= 4, "{text}");
    for pair in events.chunks(2) {
        assert_eq!(
            pair[0].0, "start",
            "runs alternate start/end, never two at once: {text}"
        );
        if pair.len() == 2 {
            assert_eq!(pair[1].0, "end", "{text}");
        }
    }
    assert!(
        c.log("n1")
            .contains("previous run still going: skipping this occurrence")
    );
}

/// overlap = "skip" skips the occurrence due while a run is still going (and
/// records it `skipped`), and never delays the ones after it: a 3 s job every
/// 2 s runs at 0, 4, 8, ..., not the occurrences 2, 4, ... at 3, 6, ...
/// late. Judged by what ran, not by how late: a run's instant is never
/// before its previous run ended (a delay starts the one due meanwhile at
/// that end); a machine stall may make a run late, and then the next
/// instant falls during it and is skipped (CI: a 1.4 s disk stall made one
/// start 1.18 s late, which a lateness bound of 0.8 s called a delay).
#[test]
fn overlap_skip_skips_and_never_delays() {
    let jobs = r#"
[[job]]
name = "slow"
schedule = "*/2 * * * * *"
command = "echo \"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N)\" >> '{out}'; sleep 3"
"#;
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    let lines = c.wait_for("four runs", Duration::from_secs(25), |l| l.len() >= 4);
    let history = wait_history(&c, "slow", |h| {
        h.iter().filter(|r| r["outcome"] == "skipped").count() >= 2
    });
    c.stop_all();
    let report = c.report();
    let mut by_start = lines.clone();
    by_start.sort_by(|a, b| a.started.total_cmp(&b.started));
    for pair in by_start.windows(2) {
        // The previous run ends 3 s after its line (written as it starts);
        // a claim decided just after that end may run an instant a little
        // before it, a delay runs one a whole second or more before it.
        let ended = pair[0].started + 3.0;
        let instant = pair[1].occurrence.timestamp_millis() as f64 / 1000.0;
        assert!(
            instant > ended - 0.5,
            "a run of an instant due while the previous run went, started late instead of skipped: {:?} after {:?}\n{report}",
            pair[1],
            pair[0]
        );
        assert!(pair[1].occurrence > pair[0].occurrence, "{report}");
    }
    let skipped: Vec<&str> = history
        .iter()
        .filter(|r| r["outcome"] == "skipped")
        .filter_map(|r| r["occurrence"].as_str())
        .collect();
    for occurrence in &skipped {
        assert!(
            !lines.iter().any(|l| l
                .occurrence
                .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                == *occurrence),
            "{occurrence} both ran and was skipped\n{report}"
        );
    }
}

#[test]
fn a_job_never_outlives_a_daemon_killed_by_sigkill() {
    let marker = format!("cronlease-orphan-{}", std::process::id());
    let jobs = format!(
        "[[job]]\nname = \"tree\"\nschedule = \"* * * * * *\"\ncommand = \"echo running >> '{{out}}.tree'; : {marker}; sleep 30 & sleep 31 & sleep 32; true\"\n"
    );
    let mut c = Cluster::new(Backend::Sqlite, Some(&jobs), "");
    c.start("n1");
    let tree_file = format!("{}.tree", c.out.display());
    wait_until(
        "the job to start",
        Duration::from_secs(15),
        || c.report(),
        || std::path::Path::new(&tree_file).exists().then_some(()),
    );
    std::thread::sleep(Duration::from_millis(300));
    let pgids = job_groups(&marker);
    assert!(!pgids.is_empty(), "the job is running");
    let members_before = processes_in(&pgids);
    assert!(
        members_before >= 3,
        "the job's tree: {members_before} processes"
    );
    c.signal("n1", Signal::SIGKILL);
    c.wait_exit("n1", Duration::from_secs(5)).unwrap();
    let gone = Instant::now() + Duration::from_secs(1);
    while processes_in(&pgids) > 0 {
        assert!(
            Instant::now() < gone,
            "job processes still alive 1 s after the daemon's SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A job's process that left its process group and session (`setsid`) dies
/// with the job when the daemon is SIGKILLed, outside systemd too.
#[test]
fn a_setsid_grandchild_never_outlives_a_daemon_killed_by_sigkill() {
    let jobs = "[[job]]\nname = \"escape\"\nschedule = \"* * * * * *\"\ncommand = \"setsid sh -c 'echo $$ > {out}.gc; exec sleep 300' & sleep 300\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    let gc_file = format!("{}.gc", c.out.display());
    let pid: i32 = wait_until(
        "the escaping grandchild",
        Duration::from_secs(15),
        || c.report(),
        || std::fs::read_to_string(&gc_file).ok()?.trim().parse().ok(),
    );
    std::thread::sleep(Duration::from_millis(200));
    let alive = |pid: i32| {
        let f = crate::support::proc_stat(pid);
        !f.is_empty() && f[0] != "Z"
    };
    assert!(alive(pid), "the grandchild runs");
    let own_session = nix::unistd::getsid(Some(nix::unistd::Pid::from_raw(pid))).unwrap();
    assert_eq!(
        own_session.as_raw(),
        pid,
        "test premise: it left the job's session"
    );
    c.signal("n1", Signal::SIGKILL);
    c.wait_exit("n1", Duration::from_secs(5)).unwrap();
    let gone = Instant::now() + Duration::from_secs(2);
    while alive(pid) {
        if Instant::now() > gone {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
            panic!("the setsid grandchild outlived the daemon's SIGKILL by 2 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A job's process orphaned at once (a double fork out of the job's group
/// and session, so no parent link and no group reach it) is adopted by the
/// guard, the jobs' child subreaper, not by init, and dies with the job
/// when the daemon is SIGKILLed.
#[test]
fn a_double_forked_orphan_never_outlives_a_daemon_killed_by_sigkill() {
    let jobs = "[[job]]\nname = \"orphan\"\nschedule = \"* * * * * *\"\ncommand = \"(setsid sh -c 'echo $$ > {out}.gc; exec sleep 300' &); sleep 300\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    let guard = c.guard_pid("n1");
    let gc_file = format!("{}.gc", c.out.display());
    let pid: i32 = wait_until(
        "the orphaned grandchild",
        Duration::from_secs(15),
        || c.report(),
        || std::fs::read_to_string(&gc_file).ok()?.trim().parse().ok(),
    );
    let parent = |pid: i32| crate::support::proc_stat(pid).get(1)?.parse::<i32>().ok();
    // Its parent, the subshell, exits at once; without a subreaper the
    // orphan would go to init (pid 1).
    wait_until(
        "the guard to adopt the orphan (its subreaper)",
        Duration::from_secs(5),
        || format!("its parent is {:?}\n{}", parent(pid), c.report()),
        || parent(pid).filter(|p| *p == guard),
    );
    c.signal("n1", Signal::SIGKILL);
    c.wait_exit("n1", Duration::from_secs(5)).unwrap();
    let alive = |pid: i32| {
        let f = crate::support::proc_stat(pid);
        !f.is_empty() && f[0] != "Z"
    };
    let gone = Instant::now() + Duration::from_secs(2);
    while alive(pid) {
        if Instant::now() > gone {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
            panic!("the orphan outlived the daemon's SIGKILL by 2 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A process a job left behind on purpose (`setsid -f`, as `ssh -fN` or
/// `tmux new -d` do) and that outlived the job is the guard's adopted child
/// but belongs to no running job: a SIGKILLed daemon's guard leaves it.
#[test]
fn a_process_a_finished_job_left_behind_survives_the_daemons_sigkill() {
    let jobs = "[[job]]\nname = \"leaver\"\nschedule = \"* * * * * *\"\ncommand = \"[ -e {out}.bg ] || setsid -f sh -c 'echo $$ > {out}.bg; exec sleep 300'\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    let guard = c.guard_pid("n1");
    let bg_file = format!("{}.bg", c.out.display());
    let pid: i32 = wait_until(
        "the process left behind",
        Duration::from_secs(15),
        || c.report(),
        || std::fs::read_to_string(&bg_file).ok()?.trim().parse().ok(),
    );
    let parent = |pid: i32| crate::support::proc_stat(pid).get(1)?.parse::<i32>().ok();
    wait_until(
        "the guard to adopt it",
        Duration::from_secs(5),
        || format!("its parent is {:?}\n{}", parent(pid), c.report()),
        || parent(pid).filter(|p| *p == guard),
    );
    // A few more runs of the job come and go.
    std::thread::sleep(Duration::from_millis(2_500));
    c.signal("n1", Signal::SIGKILL);
    c.wait_exit("n1", Duration::from_secs(5)).unwrap();
    let guard_gone = Instant::now() + Duration::from_secs(10);
    while crate::support::proc_stat(guard)
        .first()
        .is_some_and(|s| s != "Z")
    {
        assert!(
            Instant::now() < guard_gone,
            "the guard is still there 10 s after the daemon"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let f = crate::support::proc_stat(pid);
    let survived = !f.is_empty() && f[0] != "Z";
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
    assert!(
        survived,
        "the guard killed a process a finished job left behind"
    );
}

/// `on_failure` runs on the same node after a run ended `failed`,
/// `timeout` or `not_started`, never after `ok`, with the run's variables plus
/// `CRONLEASE_OUTCOME` and `CRONLEASE_EXIT_CODE`, bounded by the job's
/// `timeout`; it is not claimed and not in history.
#[test]
fn on_failure_follows_a_failed_or_timed_out_run_on_the_same_node() {
    let jobs = r#"
[[job]]
name = "fails"
schedule = "* * * * * *"
command = "exit 3"
on_failure = ["/bin/sh", "-c", "echo $CRONLEASE_JOB $CRONLEASE_FENCE $CRONLEASE_OUTCOME $CRONLEASE_EXIT_CODE $CRONLEASE_NODE >> '{out}.hook'"]

[[job]]
name = "slow"
schedule = "*/10 * * * * *"
timeout = "1s"
kill_grace = "500ms"
command = "sleep 30"
on_failure = "echo $CRONLEASE_JOB $CRONLEASE_FENCE $CRONLEASE_OUTCOME $CRONLEASE_EXIT_CODE >> '{out}.hook'; sleep 3; echo not-bounded >> '{out}.hook'"

[[job]]
name = "fine"
schedule = "* * * * * *"
command = "true"
on_failure = "echo fine $CRONLEASE_OUTCOME >> '{out}.hook'"

[[job]]
name = "nostart"
schedule = "* * * * * *"
command = ["/nonexistent/cronlease-program"]
on_failure = "echo $CRONLEASE_JOB $CRONLEASE_FENCE $CRONLEASE_OUTCOME x$CRONLEASE_EXIT_CODE >> '{out}.hook'"
"#;
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    let hook_file = format!("{}.hook", c.out.display());
    let read = || std::fs::read_to_string(&hook_file).unwrap_or_default();
    wait_until(
        "on_failure after a timeout",
        Duration::from_secs(25),
        || format!("{}\n{}", read(), c.report()),
        || read().lines().any(|l| l.starts_with("slow ")).then_some(()),
    );
    // Long enough for an unbounded hook to write its last line. History is
    // read once the daemon stopped: each recorded failed run's hook began
    // after its record, and hooks end with the daemon.
    std::thread::sleep(Duration::from_secs(4));
    c.stop_all();
    let fails = history(&c, "fails");
    let fine = history(&c, "fine");
    let slow = history(&c, "slow");
    let lines = read();
    assert!(!lines.contains("not-bounded"), "{lines}");
    assert!(!lines.contains("fine"), "on_failure after ok\n{lines}");
    assert!(fine.iter().all(|r| r["outcome"] == "ok") && !fine.is_empty());
    let timeout_line = lines.lines().find(|l| l.starts_with("slow ")).unwrap();
    let fence = slow
        .iter()
        .find(|r| r["outcome"] == "timeout")
        .map(|r| r["fence"].to_string())
        .unwrap();
    assert_eq!(timeout_line, format!("slow {fence} timeout 143"), "{lines}");
    // Each failed run recorded once, each followed by its hook (the last
    // one's may still be going), and the hooks are no runs of their own.
    let hooked: Vec<&str> = lines.lines().filter(|l| l.starts_with("fails ")).collect();
    assert!(fails.len() >= 3, "{fails:?}");
    assert!(
        fails
            .iter()
            .all(|r| r["outcome"] == "failed" && r["exit_code"] == 3)
    );
    let mut fences: Vec<u64> = fails.iter().map(|r| r["fence"].as_u64().unwrap()).collect();
    fences.dedup();
    assert_eq!(fences.len(), fails.len(), "{fails:?}");
    for f in fences.iter().skip(1) {
        assert!(
            hooked.contains(&format!("fails {f} failed 3 n1").as_str()),
            "no on_failure for fence {f}\n{lines}"
        );
    }
    assert!(hooked.len() <= fails.len(), "{lines}");
    // A command that could not start is a failure too (no exit code).
    let nostart = history(&c, "nostart");
    let first = nostart
        .iter()
        .filter(|r| r["outcome"] == "not_started")
        .map(|r| r["fence"].as_u64().unwrap())
        .min()
        .unwrap();
    assert!(
        lines.contains(&format!("nostart {first} not_started x\n")),
        "on_failure after not_started\n{lines}"
    );
}

/// `on_success` follows every `ok` run and `on_recovery` the first `ok` run
/// after a failed one (judged from history), both on the node that ran it;
/// `on_failure` follows the failures; each hook gets `CRONLEASE_HOOK`, the
/// outcome, exit code and duration, and the run's output tail.
#[test]
fn hooks_follow_success_recovery_and_failure() {
    let hook = r#"'''printf '%s %s %s x%s [%s]\n' "$CRONLEASE_HOOK" "$CRONLEASE_FENCE" "$CRONLEASE_OUTCOME" "$CRONLEASE_EXIT_CODE" "$(echo $CRONLEASE_OUTPUT_TAIL)" >> '{out}.hook'; [ "$CRONLEASE_DURATION_MS" -ge 0 ] || echo bad-duration >> '{out}.hook' '''"#;
    // Runs 0, 3, 6, ... fail; the others succeed: fail, ok (recovered),
    // ok, fail, ok (recovered), ok, ...
    let jobs = format!(
        r#"
[[job]]
name = "flaky"
schedule = "* * * * * *"
command = "n=$(cat '{{out}}.n' 2>/dev/null || echo 0); echo $((n + 1)) > '{{out}}.n'; echo run$n; [ $((n % 3)) -ne 0 ]"
on_failure = {hook}
on_success = {hook}
on_recovery = {hook}
"#
    );
    let mut c = Cluster::new(Backend::Sqlite, Some(&jobs), "");
    c.start("n1");
    let hook_file = format!("{}.hook", c.out.display());
    let read = || std::fs::read_to_string(&hook_file).unwrap_or_default();
    wait_until(
        "two recoveries",
        Duration::from_secs(30),
        || format!("{}\n{}", read(), c.report()),
        || (read().matches("on_recovery ").count() >= 2).then_some(()),
    );
    std::thread::sleep(Duration::from_millis(500));
    c.stop_all();
    let lines = read();
    let mut runs = history(&c, "flaky");
    runs.sort_by_key(|r| r["fence"].as_u64());
    assert!(!lines.contains("bad-duration"), "{lines}");
    let mut previous_failed = None;
    let mut seen = (0, 0, 0);
    for r in &runs {
        let fence = r["fence"].as_u64().unwrap();
        let tail = r["output"].as_str().unwrap_or_default().trim().to_string();
        let has = |what: &str| lines.lines().any(|l| l == what);
        match r["outcome"].as_str().unwrap() {
            "ok" => {
                let success = format!("on_success {fence} ok x0 [{tail}]");
                let recovery = format!("on_recovery {fence} ok x0 [{tail}]");
                assert!(has(&success), "no {success}\n{lines}");
                seen.0 += 1;
                if previous_failed == Some(true) {
                    assert!(has(&recovery), "no {recovery}\n{lines}");
                    seen.1 += 1;
                } else {
                    assert!(!lines.contains(&format!("on_recovery {fence} ")), "{lines}");
                }
                assert!(!lines.contains(&format!("on_failure {fence} ")), "{lines}");
                previous_failed = Some(false);
            }
            "failed" => {
                let failure = format!("on_failure {fence} failed x1 [{tail}]");
                assert!(tail.starts_with("run"), "{r}");
                assert!(has(&failure), "no {failure}\n{lines}");
                assert!(!lines.contains(&format!("on_success {fence} ")), "{lines}");
                seen.2 += 1;
                previous_failed = Some(true);
            }
            other => panic!("unexpected outcome {other}: {runs:?}"),
        }
    }
    assert!(
        seen.0 >= 3 && seen.1 >= 2 && seen.2 >= 2,
        "{seen:?} {runs:?}"
    );
    // Nothing fired for a run that is not in history.
    assert_eq!(lines.lines().count(), seen.0 + seen.1 + seen.2, "{lines}");
}

/// The only node is away through an occurrence T+6 and back at T+7.3. A
/// job without `starting_deadline` (its window: the 6 s gap; caught up in
/// its first half) runs T+6 as soon as the node can claim, not at T+12; a
/// job with a 1 s deadline does not run it late: the claim of T+12 records
/// it `missed` (saying why), `on_failure` follows with
/// `CRONLEASE_OUTCOME=missed`, and T+12 runs on time.
#[test]
fn a_node_back_late_catches_up_at_once_within_the_window_and_records_missed_past_the_deadline() {
    let jobs = r#"
[[job]]
name = "back"
schedule = "*/6 * * * * *"
command = "echo back $CRONLEASE_OCCURRENCE $(date +%s.%N) >> '{out}'"

[[job]]
name = "strict"
schedule = "*/6 * * * * *"
starting_deadline = "1s"
command = "echo strict $CRONLEASE_OCCURRENCE $(date +%s.%N) >> '{out}'"
on_failure = "echo $CRONLEASE_JOB $CRONLEASE_FENCE $CRONLEASE_OUTCOME >> '{out}.hook'"
"#;
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    let read = |c: &Cluster| std::fs::read_to_string(&c.out).unwrap_or_default();
    let t = first_run_of_both(&c, "back", "strict");
    c.signal("n1", Signal::SIGTERM);
    c.wait_exit("n1", Duration::from_secs(10))
        .expect("n1 stops");
    let at = |secs: f64| t + chrono::TimeDelta::milliseconds((secs * 1000.0) as i64);
    assert!(
        chrono::Utc::now() < at(3.0),
        "n1 took too long to stop: {}",
        c.report()
    );
    sleep_until(at(7.3));
    let back_at = chrono::Utc::now();
    c.start("n1");
    sleep_until(at(13.5));
    c.stop_all();
    let text = read(&c);
    let started = |job: &str, occ: chrono::DateTime<chrono::Utc>| -> Option<f64> {
        let occ = occ.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        text.lines()
            .find(|l| l.starts_with(&format!("{job} {occ} ")))
            .and_then(|l| l.split(' ').nth(2))
            .and_then(|s| s.parse().ok())
    };
    let unix = |d: chrono::DateTime<chrono::Utc>| d.timestamp_millis() as f64 / 1000.0;
    // "back" ran T+6 after the node came back and before T+12, then T+12.
    let caught = started("back", at(6.0)).unwrap_or_else(|| panic!("T+6 not run\n{text}"));
    assert!(
        caught >= unix(back_at) && caught < unix(at(12.0)),
        "T+6 ran at {caught}, back at {back_at}\n{text}"
    );
    assert!(started("back", at(12.0)).is_some(), "{text}");
    // "strict" did not run T+6; it is recorded missed, with on_failure.
    assert!(started("strict", at(6.0)).is_none(), "{text}");
    assert!(started("strict", at(12.0)).is_some(), "{text}");
    let runs = history(&c, "strict");
    let occ6 = at(6.0).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let missed = runs
        .iter()
        .find(|r| r["outcome"] == "missed")
        .unwrap_or_else(|| panic!("no missed record: {runs:?}"));
    assert!(
        missed["occurrence"]
            .as_str()
            .unwrap_or_default()
            .starts_with(&occ6[..19]),
        "{missed}"
    );
    assert!(
        missed["output"]
            .as_str()
            .unwrap_or_default()
            .contains("past starting_deadline (1s"),
        "{missed}"
    );
    let hooks = std::fs::read_to_string(format!("{}.hook", c.out.display())).unwrap_or_default();
    assert!(
        hooks.contains(&format!("strict {} missed", missed["fence"])),
        "{hooks}"
    );
}

/// The only node is away through T+4 and T+8 (every 4 s) and back at T+9.
/// Occurrences nobody claimed are recorded `missed`, one record per gap
/// under the fence below the win that found them, with `on_failure`:
/// "once" (`run_once`) catches T+8 up at once and records T+4 ("no node
/// claimed it"); "skip" runs T+12 and records T+4 to T+8 ("2 occurrences
/// from ... to ... were claimed by no node").
#[test]
fn occurrences_nobody_claimed_are_recorded_missed_with_on_failure() {
    let jobs = r#"
[[job]]
name = "once"
schedule = "*/4 * * * * *"
command = "echo once $CRONLEASE_OCCURRENCE $(date +%s.%N) >> '{out}'"
on_failure = "echo $CRONLEASE_JOB $CRONLEASE_FENCE $CRONLEASE_OUTCOME $CRONLEASE_OCCURRENCE >> '{out}.hook'"

[[job]]
name = "skip"
schedule = "*/4 * * * * *"
misfire = "skip"
command = "echo skip $CRONLEASE_OCCURRENCE $(date +%s.%N) >> '{out}'"
on_failure = "echo $CRONLEASE_JOB $CRONLEASE_FENCE $CRONLEASE_OUTCOME $CRONLEASE_OCCURRENCE >> '{out}.hook'"
"#;
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    let t = first_run_of_both(&c, "once", "skip");
    c.signal("n1", Signal::SIGTERM);
    c.wait_exit("n1", Duration::from_secs(10))
        .expect("n1 stops");
    let at = |secs: i64| t + chrono::TimeDelta::seconds(secs);
    assert!(
        chrono::Utc::now() < at(3),
        "n1 took too long to stop: {}",
        c.report()
    );
    sleep_until(at(9));
    c.start("n1");
    sleep_until(at(13) + chrono::TimeDelta::milliseconds(500));
    c.stop_all();
    let text = std::fs::read_to_string(&c.out).unwrap_or_default();
    let ran = |job: &str, secs: i64| {
        let occ = at(secs).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        text.lines()
            .filter(|l| l.starts_with(&format!("{job} {occ} ")))
            .count()
    };
    assert_eq!(
        [ran("once", 4), ran("once", 8), ran("once", 12)],
        [0, 1, 1],
        "{text}"
    );
    assert_eq!(
        [ran("skip", 4), ran("skip", 8), ran("skip", 12)],
        [0, 0, 1],
        "{text}"
    );
    let hooks = std::fs::read_to_string(format!("{}.hook", c.out.display())).unwrap_or_default();
    // One missed record per job, below the fence of the win that found it.
    for (job, occ, found_at, says) in [
        (
            "once",
            4,
            8,
            "no node claimed it (no node with the job was running".to_string(),
        ),
        (
            "skip",
            8,
            12,
            format!(
                "2 occurrences from {} to {} were claimed by no node",
                at(4).to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                at(8).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ),
        ),
    ] {
        let runs = history(&c, job);
        let occurrence = |secs: i64| at(secs).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let missed: Vec<&serde_json::Value> =
            runs.iter().filter(|r| r["outcome"] == "missed").collect();
        assert_eq!(missed.len(), 1, "{job}: {runs:?}");
        let missed = missed[0];
        assert_eq!(missed["occurrence"], occurrence(occ).as_str(), "{missed}");
        assert!(
            missed["output"]
                .as_str()
                .unwrap_or_default()
                .contains(&says),
            "{job}: {missed}"
        );
        let found = runs
            .iter()
            .find(|r| r["occurrence"] == occurrence(found_at).as_str())
            .unwrap_or_else(|| panic!("{job}: no run of T+{found_at}: {runs:?}"));
        assert_eq!(
            missed["fence"].as_u64().unwrap() + 1,
            found["fence"].as_u64().unwrap(),
            "{job}: {runs:?}"
        );
        assert!(
            hooks.contains(&format!(
                "{job} {} missed {}",
                missed["fence"],
                occurrence(occ)
            )),
            "{job}: {hooks}"
        );
    }
}

/// The occurrence both jobs `a` and `b` first ran, each writing
/// `JOB OCCURRENCE ...` lines to the cluster's out file.
fn first_run_of_both(c: &Cluster, a: &str, b: &str) -> chrono::DateTime<chrono::Utc> {
    let first = wait_until(
        "both jobs' first run",
        Duration::from_secs(30),
        || c.report(),
        || {
            let text = std::fs::read_to_string(&c.out).unwrap_or_default();
            let occ = |job: &str| {
                text.lines()
                    .find(|l| l.starts_with(&format!("{job} ")))
                    .and_then(|l| l.split(' ').nth(1))
                    .map(str::to_string)
            };
            match (occ(a), occ(b)) {
                (Some(x), Some(y)) if x == y => Some(x),
                _ => None,
            }
        },
    );
    chrono::DateTime::parse_from_rfc3339(&first)
        .unwrap()
        .with_timezone(&chrono::Utc)
}

/// Sleeps until `when` by the wall clock (at once if it is past).
fn sleep_until(when: chrono::DateTime<chrono::Utc>) {
    if let Ok(d) = (when - chrono::Utc::now()).to_std() {
        std::thread::sleep(d);
    }
}

/// Process groups of processes whose command line names `marker`.
fn job_groups(marker: &str) -> Vec<i32> {
    let mut groups = Vec::new();
    for pid in crate::support::all_pids() {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(marker)
            && let Ok(pgid) = nix::unistd::getpgid(Some(nix::unistd::Pid::from_raw(pid)))
        {
            groups.push(pgid.as_raw());
        }
    }
    groups
}

/// Live (not zombie) processes in any of `groups`.
fn processes_in(groups: &[i32]) -> usize {
    crate::support::all_pids()
        .into_iter()
        .map(crate::support::proc_stat)
        .filter(|f| {
            f.len() > 2 && f[0] != "Z" && f[2].parse::<i32>().is_ok_and(|g| groups.contains(&g))
        })
        .count()
}

/// Waits until the job wrote `start` to `file`.
fn wait_for_start(c: &Cluster, file: &str) {
    wait_for_starts(c, file, 1, Duration::from_secs(15));
}

/// Waits until the job's runs wrote `start` to `file` `n` times.
fn wait_for_starts(c: &Cluster, file: &str, n: usize, limit: Duration) {
    wait_until(
        &format!("{n} run(s) to start"),
        limit,
        || c.report(),
        || {
            let text = std::fs::read_to_string(file).unwrap_or_default();
            (text.matches("start").count() >= n).then_some(())
        },
    );
}

#[test]
fn sigterm_lets_a_run_finish_within_the_grace() {
    let jobs = "[[job]]\nname = \"finish\"\nschedule = \"* * * * * *\"\ncommand = \"echo start >> '{out}.finish'; sleep 2; echo end >> '{out}.finish'\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "shutdown_grace = \"10s\"");
    c.start("n1");
    let file = format!("{}.finish", c.out.display());
    wait_for_start(&c, &file);
    c.signal("n1", Signal::SIGTERM);
    let status = c.wait_exit("n1", Duration::from_secs(10)).expect("exits");
    assert_eq!(status.code(), Some(0));
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "start\nend\n",
        "the run finished, and nothing new started"
    );
    // An instant passing while the run went is recorded `skipped`
    // (overlap), which a run started late under load allows.
    let runs: Vec<_> = history(&c, "finish")
        .into_iter()
        .filter(|r| r["outcome"] != "skipped")
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0]["outcome"], "ok");
}

#[test]
fn sigterm_kills_runs_still_going_after_the_grace() {
    let jobs = "[[job]]\nname = \"long\"\nschedule = \"* * * * * *\"\nkill_grace = \"1s\"\ncommand = \"echo start >> '{out}.long'; sleep 30; echo end >> '{out}.long'\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "shutdown_grace = \"1s\"");
    c.start("n1");
    let file = format!("{}.long", c.out.display());
    wait_for_start(&c, &file);
    let asked = Instant::now();
    c.signal("n1", Signal::SIGTERM);
    let status = c.wait_exit("n1", Duration::from_secs(10)).expect("exits");
    assert_eq!(status.code(), Some(0));
    let took = asked.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "grace 1 s then SIGTERM: {took:?}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "start\n");
    let runs = history(&c, "long");
    assert_eq!(runs[0]["outcome"], "killed", "{runs:#?}");
}

/// With its log pipe closed (a log reader that died, `run 2>&1 | head -c1`),
/// the daemon still stops on SIGTERM and SIGINT, and its jobs with it.
#[test]
fn a_closed_log_pipe_never_stops_signal_handling() {
    for sig in [
        nix::sys::signal::Signal::SIGTERM,
        nix::sys::signal::Signal::SIGINT,
    ] {
        let jobs = "[[job]]\nname = \"chatty\"\nschedule = \"* * * * * *\"\ncommand = \"echo line one; echo line two >&2; sleep 0.5\"\n";
        let c = Cluster::new(Backend::Sqlite, Some(jobs), "");
        let mut child = std::process::Command::new(crate::support::binary())
            .args(["run", "-c"])
            .arg(c.config("n1"))
            .env_remove("CRONLEASE_STORE_URL")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The reader goes away: every later log write fails with EPIPE.
        drop(child.stdout.take());
        drop(child.stderr.take());
        std::thread::sleep(Duration::from_secs(3));
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), sig).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if std::time::Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(0),
            "{sig:?} with a closed log pipe: the daemon did not stop cleanly"
        );
    }
}

/// SIGHUP applies what can change live (log level, history limit, clock
/// bound) and names, in one WARN, each changed setting that needs a restart.
#[test]
fn sighup_applies_live_settings_and_names_the_rest() {
    let mut c = Cluster::new(Backend::Sqlite, None, "");
    c.start("n1");
    c.wait_for("runs", Duration::from_secs(15), |l| l.len() >= 2);
    let config = c.config("n1");
    let text = std::fs::read_to_string(&config).unwrap();
    let changed = text
        .replace("op_timeout = \"1s\"", "op_timeout = \"3s\"")
        .replace("history_limit = 100000", "history_limit = 3")
        .replace("level = \"info\"", "level = \"warn\"")
        .replace("node = \"n1\"", "node = \"n1-renamed\"");
    assert_ne!(changed, text);
    std::fs::write(
        &config,
        format!("{changed}[cluster]\nmax_clock_offset = \"400ms\"\n"),
    )
    .unwrap();
    c.signal("n1", nix::sys::signal::Signal::SIGHUP);
    wait_until(
        "the reload",
        Duration::from_secs(10),
        || c.report(),
        || {
            c.log("n1")
                .contains("SIGHUP: configuration reloaded")
                .then_some(())
        },
    );
    // A run that started just before the level changed may still log.
    std::thread::sleep(Duration::from_millis(300));
    let marker = c.log("n1").len();
    let before = c.lines().len();
    c.wait_for("runs after the reload", Duration::from_secs(15), |l| {
        l.len() >= before + 4
    });
    let runs = history(&c, "tick");
    c.stop_all();
    let log = c.log("n1");
    let warn: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("take effect only after a restart"))
        .collect();
    assert_eq!(warn.len(), 1, "{log}");
    assert!(
        warn[0].contains("node") && warn[0].contains("store.op_timeout"),
        "{}",
        warn[0]
    );
    assert!(
        !warn[0].contains("log.level") && !warn[0].contains("history_limit"),
        "{}",
        warn[0]
    );
    assert!(
        log.contains("applied now: store.history_limit, cluster.max_clock_offset, log.level"),
        "{log}"
    );
    // log.level = "warn" took effect: no more INFO lines about runs.
    assert!(
        !log[marker..].contains("run starting"),
        "{}",
        &log[marker..]
    );
    // history_limit = 3 took effect: older runs were pruned.
    assert!(runs.len() <= 3, "{} runs kept", runs.len());
}

/// A task of the daemon that dies (a panic) takes the daemon down with a
/// clear exit (70, reason logged), never leaves it half alive; its jobs go
/// with it. Uses the test-only failpoint of the `failpoints` feature.
#[test]
fn a_dying_task_takes_the_daemon_down_with_a_clear_exit() {
    let mut c = Cluster::new(Backend::Sqlite, None, "");
    c.start_with_env("n1", &[("CRONLEASE_FAILPOINT_PANIC_IN_TASK", "1")]);
    let status = c.wait_exit("n1", Duration::from_secs(15));
    assert_eq!(status.and_then(|s| s.code()), Some(70), "{}", c.report());
    assert!(c.log("n1").contains("internal error"), "{}", c.report());
}

/// The guard starts the jobs (their parent is the guard, not the daemon);
/// once the guard is gone the daemon starts them itself and says so once.
#[test]
fn jobs_are_started_by_the_guard_then_by_the_daemon_once_it_is_gone() {
    let jobs = "[[job]]\nname = \"parent\"\nschedule = \"* * * * * *\"\ncommand = \"echo $PPID >> '{out}.ppid'\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    let daemon = c.pid("n1");
    let ppids_file = format!("{}.ppid", c.out.display());
    let ppids = || -> Vec<i32> {
        std::fs::read_to_string(&ppids_file)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    };
    let first = wait_until(
        "a first run",
        Duration::from_secs(15),
        || c.report(),
        || ppids().first().copied(),
    );
    let guard = c.guard_pid("n1");
    assert_eq!(first, guard, "the first run's parent\n{}", c.report());
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(guard), Signal::SIGKILL).unwrap();
    wait_until(
        "a run started by the daemon",
        Duration::from_secs(15),
        || c.report(),
        || ppids().contains(&daemon).then_some(()),
    );
    let log = c.log("n1");
    assert_eq!(
        log.matches("the job guard process is gone").count(),
        1,
        "{log}"
    );
    c.stop_all();
}

/// How many yearly jobs stand beside `tick` in the large reload test: the
/// debug build loads them in about 7 s (2 cores), and with the load on the
/// runtime 5 occurrences in a row were missed. Should loading get fast,
/// raise it so that a load still takes seconds.
const RELOAD_FILLER_JOBS: usize = 8_000;

/// A reload parses the configuration off the runtime (issue 29): with
/// thousands of jobs in one file the load takes seconds, and the job due
/// every second misses no occurrence meanwhile, on either side of the
/// reload; the reload then applies.
#[test]
fn a_reload_of_a_large_configuration_misses_no_occurrence() {
    let mut jobs = "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = [\"/bin/sh\", \"-c\", \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N)\\\" >> '{out}'\"]\n".to_string();
    for i in 0..RELOAD_FILLER_JOBS {
        jobs.push_str(&format!(
            "[[job]]\nname = \"filler{i:05}\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"true\"\n"
        ));
    }
    let mut c = Cluster::new(Backend::Sqlite, Some(&jobs), "");
    c.start("n1");
    c.wait_for("ticks", Duration::from_secs(120), |l| l.len() >= 3);
    let started = Instant::now();
    c.signal("n1", Signal::SIGHUP);
    wait_until(
        "the reload",
        Duration::from_secs(120),
        || c.report(),
        || {
            c.log("n1")
                .contains("SIGHUP: configuration reloaded")
                .then_some(())
        },
    );
    let took = started.elapsed();
    let before = c.lines().len();
    c.wait_for("ticks after the reload", Duration::from_secs(15), |l| {
        l.len() >= before + 3
    });
    c.stop_all();
    let report = format!("the reload took {took:?}\n{}", c.report());
    eprintln!("the reload took {took:?}");
    crate::cluster::check_exactly_once(&c.lines(), &report);
}

/// Process mode (`jobs.runner = "process"`): `limits.nice` and
/// `limits.open_files` reach the run (through `__run-as`); a limit only a
/// systemd unit can enforce is a one-line WARN naming the job and the
/// limit, never ignored silently; the run still goes.
#[test]
fn process_mode_applies_nice_and_open_files_and_warns_of_the_rest() {
    let jobs = r#"
[[job]]
name = "limited"
schedule = "* * * * * *"
command = "echo nice=$(nice) nofile=$(ulimit -n)"
[job.limits]
nice = 7
open_files = 123
memory_max = "64M"
tasks_max = 32
"#;
    let mut c = Cluster::new(
        Backend::Sqlite,
        Some(jobs),
        "[jobs]\nrunner = \"process\"\n",
    );
    c.start("n1");
    let h = wait_history(&c, "limited", |h| h.iter().any(|r| r["outcome"] == "ok"));
    let log = c.log("n1");
    c.stop_all();
    let run = h.iter().find(|r| r["outcome"] == "ok").unwrap();
    let output = run["output"].as_str().unwrap_or_default();
    assert!(output.contains("nice=7 nofile=123"), "{output}");
    let warns: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("not enforced for this job"))
        .collect();
    assert_eq!(warns.len(), 1, "one line for the job: {log}");
    assert!(
        warns[0].contains("limits.memory_max, limits.tasks_max") && warns[0].contains("limited"),
        "{}",
        warns[0]
    );
}

/// `retry` across nodes: attempts 1 and 2 of an occurrence fail, 3
/// succeeds. Once attempt 2 is in the store, the node that ran attempt 1
/// is killed with its guard (kill -9, a dead host): the two others run
/// attempts 2 and 3 of that occurrence, each exactly once, in order, with
/// rising fences, `CRONLEASE_OCCURRENCE` the occurrence's and
/// `CRONLEASE_ATTEMPT` the attempt; `on_failure` never runs; history says
/// `attempt 2/3` and `3/3`.
fn retried_once_per_attempt_after_the_holder_dies(backend: Backend) {
    let jobs = r#"
[[job]]
name = "flaky"
schedule = "*/20 * * * * *"
command = "echo $CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N) $CRONLEASE_ATTEMPT >> '{out}'; [ $CRONLEASE_ATTEMPT -ge 3 ]"
on_failure = "echo $CRONLEASE_FENCE >> '{out}.hook'"
retry = { attempts = 3, backoff = "5s", max_backoff = "5s" }
"#;
    let mut c = Cluster::new(backend, Some(jobs), "");
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    let first = c.wait_for("attempt 1", Duration::from_secs(30), |l| !l.is_empty());
    let (occurrence, holder) = (first[0].occurrence, first[0].node.clone());
    // Attempt 2 in the store (due 4 to 5 s after attempt 1 ended: time
    // to kill the holder before it could claim it).
    let peer = if holder == "n1" { "n2" } else { "n1" };
    wait_until(
        "attempt 2 pending",
        Duration::from_secs(2),
        || c.report(),
        || {
            let status = c.cli_json(peer, &["status"]).ok()?;
            status
                .as_array()?
                .iter()
                .any(|r| r["pending_trigger"]["attempt"] == 2)
                .then_some(())
        },
    );
    c.kill_with_guard(&holder);
    let text = || std::fs::read_to_string(&c.out).unwrap_or_default();
    wait_until(
        "attempt 3",
        Duration::from_secs(20),
        || c.report(),
        || text().lines().any(|l| l.ends_with(" 3")).then_some(()),
    );
    let attempts: Vec<(String, u64, String, u32)> = text()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.to_string(),
                f.get(1)?.parse().ok()?,
                f.get(2)?.to_string(),
                f.get(4)?.parse().ok()?,
            ))
        })
        .filter(|a| a.0 == occurrence.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .collect();
    let report = c.report();
    let mut up: Vec<&str> = ["n1", "n2", "n3"]
        .into_iter()
        .filter(|n| *n != holder)
        .collect();
    up.sort();
    for n in &up {
        c.signal(n, Signal::SIGTERM);
        c.wait_exit(n, Duration::from_secs(10));
    }
    assert_eq!(
        attempts.iter().map(|a| a.3).collect::<Vec<_>>(),
        vec![1, 2, 3],
        "{attempts:?}\n{report}"
    );
    assert!(
        attempts[0].1 < attempts[1].1 && attempts[1].1 < attempts[2].1,
        "{attempts:?}"
    );
    assert!(
        attempts[1..].iter().all(|a| a.2 != holder),
        "{attempts:?}\n{report}"
    );
    assert_eq!(
        std::fs::read_to_string(format!("{}.hook", c.out.display())).unwrap_or_default(),
        "",
        "on_failure ran for an attempt that was not the last"
    );
    let runs = history(&c, "flaky");
    let mut seen: Vec<(u64, String, u64)> = runs
        .iter()
        .filter(|r| {
            r["occurrence"] == occurrence.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        })
        .map(|r| {
            (
                r["fence"].as_u64().unwrap(),
                r["outcome"].as_str().unwrap().to_string(),
                r["attempt"].as_u64().unwrap(),
            )
        })
        .collect();
    seen.sort();
    let shape: Vec<(&str, u64)> = seen.iter().map(|s| (s.1.as_str(), s.2)).collect();
    assert_eq!(
        shape,
        vec![("failed", 1), ("failed", 2), ("ok", 3)],
        "{runs:?}"
    );
    let table = c.cli(up[0], &["history", "flaky"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("attempt 2/3") && table.contains("attempt 3/3"),
        "{table}"
    );
}

/// A daemon that dies after winning a claim and before starting its run
/// (a test-only failpoint SIGKILLs it right there, its guard alive) loses
/// no occurrence: its guard records the claim `not_started` and hands it
/// back, and a peer, started only once the daemon is dead, runs that
/// occurrence once, within its window, with a fence above the lost claim,
/// `CRONLEASE_REDELIVERY=1` and attempt 1; history shows both records and
/// `redelivered`; the next occurrence runs once, as any.
fn a_claim_its_daemon_died_holding_unstarted_is_run_once_by_a_peer(backend: Backend) {
    handed_back_after_death(backend, "CRONLEASE_FAILPOINT_DIE_BEFORE_START", 0, &[]);
}

/// As above, with the guard's first write of the records answered as a
/// timeout after it committed (a failpoint; in CI a 1.4 s disk stall did it
/// to PostgreSQL): the guard writes them once more when the store has
/// answered the release, so the history holds one `not_started` record,
/// the claim is handed back, and the guard's line says it all went through
/// (it said "handing over failed" and that the leases would expire).
#[test]
fn a_guard_record_write_whose_answer_was_lost_is_made_once_more() {
    handed_back_after_death(
        Backend::Sqlite,
        "CRONLEASE_FAILPOINT_DIE_BEFORE_START",
        0,
        &[("CRONLEASE_FAILPOINT_GUARD_RECORD_ANSWER_LOST", "1")],
    );
}

/// As above, with the daemon killed as the store's answer to its claim
/// came, before it (or its guard) heard of the win: the guard finds the
/// claim in the store (the dead daemon its last owner, at a fence it never
/// told) and hands it back the same way.
fn a_claim_its_daemon_never_heard_it_won_is_run_once_by_a_peer(backend: Backend) {
    handed_back_after_death(backend, "CRONLEASE_FAILPOINT_DIE_BEFORE_ANSWER", 1, &[]);
}

/// n1 dies at `failpoint`; its guard hands the claim back (`unheard` of
/// them found in the store); n2 runs it.
fn handed_back_after_death(
    backend: Backend,
    failpoint: &str,
    unheard: usize,
    env: &[(&str, &str)],
) {
    use std::os::unix::process::ExitStatusExt;
    let jobs = r#"
[[job]]
name = "handed"
schedule = "*/10 * * * * *"
command = "echo $CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE ${CRONLEASE_REDELIVERY:-0} $CRONLEASE_ATTEMPT $(date +%s.%N) >> '{out}'"
"#;
    let mut c = Cluster::new(backend, Some(jobs), "");
    let mut with = vec![(failpoint, "handed")];
    with.extend_from_slice(env);
    c.start_with_env("n1", &with);
    let died = c.wait_exit("n1", Duration::from_secs(25));
    assert_eq!(
        died.and_then(|s| s.signal()),
        Some(Signal::SIGKILL as i32),
        "{}",
        c.report()
    );
    // The guard's record of the claim it hands back.
    let lost = wait_until(
        "the guard's not_started record",
        Duration::from_secs(10),
        || c.report(),
        || {
            history(&c, "handed")
                .into_iter()
                .find(|r| r["outcome"] == "not_started")
        },
    );
    c.start("n2");
    let out = c.out.clone();
    let text = || std::fs::read_to_string(&out).unwrap_or_default();
    // The handed-back occurrence, then the next one.
    wait_until(
        "two runs",
        Duration::from_secs(25),
        || c.report(),
        || (text().lines().count() >= 2).then_some(()),
    );
    let report = c.report();
    c.stop_all();
    let runs: Vec<Vec<String>> = text()
        .lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect();
    let occurrence = lost["occurrence"].as_str().unwrap().to_string();
    let lost_fence = lost["fence"].as_u64().unwrap();
    assert!(
        lost["output"].as_str().unwrap().contains(
            "the daemon died after winning this claim and before starting its run; handed back"
        ),
        "{lost}"
    );
    assert_eq!(lost["node"], "n1", "{lost}");
    let of_lost: Vec<&Vec<String>> = runs.iter().filter(|r| r[0] == occurrence).collect();
    assert_eq!(of_lost.len(), 1, "{runs:?}\n{report}");
    let run = of_lost[0];
    assert_eq!(run[2], "n2", "{runs:?}");
    assert_eq!(run[3], "1", "CRONLEASE_REDELIVERY: {runs:?}");
    assert_eq!(run[4], "1", "CRONLEASE_ATTEMPT: {runs:?}");
    assert!(run[1].parse::<u64>().unwrap() > lost_fence, "{runs:?}");
    // Within the occurrence's window (its gap, 10 s).
    let at = chrono::DateTime::parse_from_rfc3339(&occurrence)
        .unwrap()
        .timestamp() as f64;
    let started: f64 = run[5].parse().unwrap();
    assert!(started > at && started < at + 10.0, "{runs:?}");
    // The next occurrence: once, as usual, no redelivery.
    let later: Vec<&Vec<String>> = runs.iter().filter(|r| r[0] != occurrence).collect();
    assert!(
        !later.is_empty() && later.iter().all(|r| r[3] == "0"),
        "{runs:?}"
    );
    let mut occurrences: Vec<&String> = runs.iter().map(|r| &r[0]).collect();
    occurrences.sort();
    occurrences.dedup();
    assert_eq!(
        occurrences.len(),
        runs.len(),
        "an occurrence ran twice: {runs:?}"
    );
    let shown = history(&c, "handed");
    let redelivered: Vec<&serde_json::Value> = shown
        .iter()
        .filter(|r| r["occurrence"] == occurrence.as_str())
        .collect();
    assert_eq!(redelivered.len(), 2, "{shown:?}");
    assert!(
        redelivered
            .iter()
            .any(|r| r["outcome"] == "ok" && r["redelivered"] == true && r["node"] == "n2"),
        "{shown:?}"
    );
    let said = format!(
        "1 claims it never started recorded not_started ({unheard} of them it never heard of; 1 handed back to run again)"
    );
    assert!(c.log("n1").contains(&said), "{said}\n{}", c.log("n1"));
}

/// `delivery = "at_least_once"` against a dead host: two nodes, two jobs
/// every 5 s, each run 2 s long, one with `at_least_once` and one with the
/// default. The node running both at some occurrence L is killed with its
/// guard mid-run (kill -9 of both: a dead host). The survivor takes over at
/// the next occurrence N when the dead lease ends and, for the
/// `at_least_once` job, runs L again first (`CRONLEASE_REDELIVERY=1`, a
/// fence above the dead claim's, `redelivered` in history), then N; the
/// default job runs N only (L stays lost: at most once). Every other
/// occurrence runs once.
fn a_dead_hosts_unrecorded_run_is_run_again_with_at_least_once(backend: Backend) {
    let jobs = r#"
[[job]]
name = "again"
schedule = "*/5 * * * * *"
delivery = "at_least_once"
command = "echo again $CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE ${CRONLEASE_REDELIVERY:-0} $(date +%s.%N) >> '{out}'; sleep 2"

[[job]]
name = "once"
schedule = "*/5 * * * * *"
command = "echo once $CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE ${CRONLEASE_REDELIVERY:-0} $(date +%s.%N) >> '{out}'; sleep 2"
"#;
    let mut c = Cluster::new(backend, Some(jobs), "");
    c.start("n1");
    c.start("n2");
    let out = c.out.clone();
    let runs = || -> Vec<Vec<String>> {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .map(|l| l.split_whitespace().map(str::to_string).collect())
            .filter(|f: &Vec<String>| f.len() == 6)
            .collect()
    };
    // An occurrence whose runs of both jobs one node started: kill that
    // node's host in the middle of them.
    let (occurrence, holder) = wait_until(
        "one node running both jobs",
        Duration::from_secs(30),
        || c.report(),
        || {
            let runs = runs();
            runs.iter().rev().find_map(|r| {
                runs.iter()
                    .any(|o| o[0] != r[0] && o[1] == r[1] && o[3] == r[3])
                    .then(|| (r[1].clone(), r[3].clone()))
            })
        },
    );
    c.kill_with_guard(&holder);
    let survivor = if holder == "n1" { "n2" } else { "n1" };
    let next = (chrono::DateTime::parse_from_rfc3339(&occurrence).unwrap()
        + chrono::TimeDelta::seconds(5))
    .to_utc()
    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    // The redelivery, N of both, and the occurrence after N.
    wait_until(
        "the survivor's runs",
        Duration::from_secs(25),
        || c.report(),
        || {
            let runs = runs();
            let at = |job: &str, occ: &str| runs.iter().any(|r| r[0] == job && r[1] == occ);
            (at("again", &next)
                && at("once", &next)
                && runs.iter().filter(|r| r[1] > next).count() >= 2)
                .then_some(())
        },
    );
    let report = c.report();
    c.stop_all();
    let runs = runs();
    let of = |job: &str, occ: &str| -> Vec<&Vec<String>> {
        runs.iter().filter(|r| r[0] == job && r[1] == occ).collect()
    };
    // at_least_once: L twice (the dead host's start, the survivor's
    // redelivery with a higher fence), before N.
    let l = of("again", &occurrence);
    assert_eq!(l.len(), 2, "{runs:?}\n{report}");
    assert_eq!(
        (l[0][3].as_str(), l[0][4].as_str()),
        (holder.as_str(), "0"),
        "{runs:?}"
    );
    assert_eq!(
        (l[1][3].as_str(), l[1][4].as_str()),
        (survivor, "1"),
        "{runs:?}"
    );
    let fence = |r: &Vec<String>| r[2].parse::<u64>().unwrap();
    assert!(fence(l[1]) > fence(l[0]), "{runs:?}");
    let n = of("again", &next);
    assert_eq!(n.len(), 1, "{runs:?}\n{report}");
    assert!(fence(n[0]) > fence(l[1]), "{runs:?}");
    let secs = |r: &Vec<String>| r[5].parse::<f64>().unwrap();
    assert!(
        secs(n[0]) >= secs(l[1]) + 2.0,
        "N overlapped the redelivery: {runs:?}"
    );
    // N right after the redelivery, within its own window (before N + 5 s:
    // not caught up at the next claim).
    let n_at = chrono::DateTime::parse_from_rfc3339(&next)
        .unwrap()
        .timestamp() as f64;
    assert!(
        secs(n[0]) < n_at + 5.0,
        "N ran after its window: {runs:?}\n{report}"
    );
    assert_eq!(n[0][4], "0", "{runs:?}");
    // At most once: L by the dead host only; N once.
    assert_eq!(of("once", &occurrence).len(), 1, "{runs:?}");
    assert_eq!(of("once", &next).len(), 1, "{runs:?}");
    // Every other occurrence once per job.
    let mut seen: Vec<(&str, &str)> = runs
        .iter()
        .filter(|r| !(r[0] == "again" && r[1] == occurrence))
        .map(|r| (r[0].as_str(), r[1].as_str()))
        .collect();
    seen.sort();
    let all = seen.len();
    seen.dedup();
    assert_eq!(seen.len(), all, "an occurrence ran twice: {runs:?}");
    // History: the redelivered run, recorded by the survivor.
    let shown = history(&c, "again");
    let recorded: Vec<&serde_json::Value> = shown
        .iter()
        .filter(|r| r["occurrence"] == occurrence.as_str())
        .collect();
    assert_eq!(recorded.len(), 1, "{shown:?}");
    assert_eq!(
        (
            &recorded[0]["outcome"],
            &recorded[0]["redelivered"],
            &recorded[0]["node"]
        ),
        (
            &serde_json::json!("ok"),
            &serde_json::json!(true),
            &serde_json::json!(survivor)
        ),
        "{shown:?}"
    );
    assert!(
        history(&c, "once")
            .iter()
            .all(|r| r["occurrence"] != occurrence.as_str()),
        "the default delivery recorded the dead host's occurrence"
    );
}

// Every store in the long tier: an attempt and a redelivery are manual
// runs' requests, whose path the conformance suite checks on each.
crate::per_store!(
    [redis, postgres] long [sqlite, mysql, sentinel, redlock, zookeeper, etcd];
    retried_once_per_attempt_after_the_holder_dies,
    a_claim_its_daemon_died_holding_unstarted_is_run_once_by_a_peer
);
/// At least once, on a store of each rule: PostgreSQL (the shared rule in
/// a transaction) and Redlock (its masters' running marks) by default;
/// `claim.lua` and the rest in the long tier (the conformance suite has
/// the rule on every store).
mod at_least_once {
    use super::a_dead_hosts_unrecorded_run_is_run_again_with_at_least_once;
    crate::per_store!(
        [postgres, redlock] long [sqlite, mysql, redis, sentinel, zookeeper, etcd];
        a_dead_hosts_unrecorded_run_is_run_again_with_at_least_once
    );
}

/// The daemon's never-heard-of win, on its own store split (one
/// `per_store!` per module).
mod unheard {
    use super::a_claim_its_daemon_never_heard_it_won_is_run_once_by_a_peer;
    crate::per_store!(
        [mysql] long [sqlite, postgres, redis, sentinel, redlock, zookeeper, etcd];
        a_claim_its_daemon_never_heard_it_won_is_run_once_by_a_peer
    );
}

/// Catch-up on resume (docs/protocol.md): two nodes; both jobs paused over
/// their T+6 occurrence and resumed with `cronlease resume` at T+7.3. "back"
/// runs T+6 once across the cluster, at once (before T+12, where the store
/// would hand it out), as its occurrence; "strict", with a 1 s deadline, is
/// told it is past its start window, does not run T+6, and the claim of
/// T+12 records it `missed`. Both run T+12.
fn a_resumed_job_runs_the_occurrence_it_missed_while_paused_at_once(backend: Backend) {
    let jobs = r#"
[[job]]
name = "back"
schedule = "*/6 * * * * *"
command = "echo back $CRONLEASE_OCCURRENCE $CRONLEASE_NODE $(date +%s.%N) >> '{out}'"

[[job]]
name = "strict"
schedule = "*/6 * * * * *"
starting_deadline = "1s"
command = "echo strict $CRONLEASE_OCCURRENCE $CRONLEASE_NODE $(date +%s.%N) >> '{out}'"
"#;
    let mut c = Cluster::new(backend, Some(jobs), "");
    c.start("n1");
    c.start("n2");
    let read = |c: &Cluster| std::fs::read_to_string(&c.out).unwrap_or_default();
    let t = first_run_of_both(&c, "back", "strict");
    let out = c.cli("n1", &["pause", "back", "strict"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let at = |secs: f64| t + chrono::TimeDelta::milliseconds((secs * 1000.0) as i64);
    assert!(
        chrono::Utc::now() < at(5.0),
        "pausing took too long: {}",
        c.report()
    );
    sleep_until(at(7.3));
    let resumed_at = chrono::Utc::now();
    let out = c.cli("n2", &["resume", "back", "strict"]);
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let occ6 = at(6.0).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    assert!(
        said.contains(&format!(
            "back: its {occ6} occurrence, missed while it was paused, runs now on one node"
        )),
        "{said}"
    );
    assert!(
        said.contains(&format!("strict: its {occ6} occurrence was missed while it was paused and is past its start window")),
        "{said}"
    );
    sleep_until(at(13.5));
    c.stop_all();
    let text = read(&c);
    let runs = |job: &str, occ: chrono::DateTime<chrono::Utc>| -> Vec<f64> {
        let occ = occ.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        text.lines()
            .filter(|l| l.starts_with(&format!("{job} {occ} ")))
            .filter_map(|l| l.split(' ').nth(3)?.parse().ok())
            .collect()
    };
    let unix = |d: chrono::DateTime<chrono::Utc>| d.timestamp_millis() as f64 / 1000.0;
    let report = c.report();
    // "back": T+6 once, after the resume and before T+12; then T+12.
    let caught = runs("back", at(6.0));
    assert_eq!(caught.len(), 1, "T+6 of back: {caught:?}\n{text}\n{report}");
    assert!(
        caught[0] >= unix(resumed_at) && caught[0] < unix(at(12.0)),
        "T+6 ran at {}, resumed at {resumed_at}\n{text}",
        caught[0]
    );
    assert_eq!(runs("back", at(12.0)).len(), 1, "{text}");
    // "strict": T+6 not run, recorded missed by T+12's claim; T+12 runs.
    assert!(runs("strict", at(6.0)).is_empty(), "{text}");
    assert_eq!(runs("strict", at(12.0)).len(), 1, "{text}");
    let recorded = history(&c, "strict");
    let missed: Vec<&serde_json::Value> = recorded
        .iter()
        .filter(|r| r["outcome"] == "missed")
        .collect();
    assert_eq!(missed.len(), 1, "{recorded:?}");
    assert!(
        missed[0]["occurrence"]
            .as_str()
            .unwrap_or_default()
            .starts_with(&occ6[..19]),
        "{:?}",
        missed[0]
    );
    // Nothing ran as a manual run, and no request is left.
    let back = history(&c, "back");
    assert!(back.iter().all(|r| r["trigger"].is_null()), "{back:?}");
    let status = c.cli_json("n1", &["status"]).unwrap();
    assert!(
        !status.to_string().contains("pending_trigger\":{"),
        "{status}"
    );
}

/// Catch-up on resume, on its own store split: a resume's request and its
/// withdrawal are manual runs' requests (their path is in the conformance
/// suite); the occurrence's claim is the occurrence's own rule.
mod resumed {
    use super::a_resumed_job_runs_the_occurrence_it_missed_while_paused_at_once;
    crate::per_store!(
        [redis] long [sqlite, mysql, postgres, sentinel, redlock, zookeeper, etcd];
        a_resumed_job_runs_the_occurrence_it_missed_while_paused_at_once
    );
}
