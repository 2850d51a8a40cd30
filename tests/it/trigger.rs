//! `cronlease trigger` against a real 3-node cluster per store: twenty
//! requests at once, each accepted one run exactly once on one node with a
//! fence of its own, each refused one (a run in progress, or a request
//! still pending) run nowhere; `--wait` says how the run ended; a trigger
//! next to a scheduled occurrence neither suppresses nor duplicates it.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::cluster::{Cluster, at_fraction_of_second, check_exactly_once};
use crate::support::{Backend, binary, wait_until};

/// `manual` runs only when triggered (its schedule is yearly) and takes
/// 0.6 s; `fails` exits 3; `tick` runs every second and writes its
/// scheduled runs to `{out}` and its manual ones to `{out}.tickman`.
const JOBS: &str = r#"
[[job]]
name = "manual"
schedule = "0 0 0 1 1 *"
command = "echo \"$CRONLEASE_TRIGGER $CRONLEASE_FENCE $CRONLEASE_NODE start $(date +%s.%N)\" >> '{out}.manual'; sleep 0.6; echo \"$CRONLEASE_TRIGGER $CRONLEASE_FENCE $CRONLEASE_NODE end $(date +%s.%N)\" >> '{out}.manual'"

[[job]]
name = "fails"
schedule = "0 0 0 1 1 *"
command = "exit 3"

[[job]]
name = "tick"
schedule = "* * * * * *"
command = "if [ -n \"$CRONLEASE_TRIGGER\" ]; then echo \"$CRONLEASE_TRIGGER $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N)\" >> '{out}.tickman'; else echo \"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N)\" >> '{out}'; fi"
"#;

/// A manual run as its job wrote it.
#[derive(Debug, Clone)]
struct ManualRun {
    fence: u64,
    node: String,
    start: f64,
    end: Option<f64>,
}

/// The `manual` job's runs by request id (hex), each id's lines checked to
/// be one run.
fn manual_runs(c: &Cluster) -> BTreeMap<String, ManualRun> {
    let path = format!("{}.manual", c.out.display());
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut runs: BTreeMap<String, ManualRun> = BTreeMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [id, fence, node, phase, t] = f[..] else {
            panic!("a malformed line {line:?}\n{}", c.report());
        };
        let (fence, t): (u64, f64) = (fence.parse().unwrap(), t.parse().unwrap());
        match phase {
            "start" => {
                let again = runs.insert(
                    id.to_string(),
                    ManualRun {
                        fence,
                        node: node.to_string(),
                        start: t,
                        end: None,
                    },
                );
                assert!(
                    again.is_none(),
                    "request {id} ran twice: {again:?} and fence {fence} on {node}\n{}",
                    c.report()
                );
            }
            _ => {
                let run = runs.get_mut(id).unwrap();
                assert_eq!((run.fence, run.node.as_str()), (fence, node), "{line}");
                run.end = Some(t);
            }
        }
    }
    runs
}

/// The id `trigger` printed when it accepted the request.
fn accepted_id(out: &Output) -> Option<String> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let id = stdout.strip_prefix("trigger ")?.split(':').next()?;
    (out.status.code() == Some(0)).then(|| id.to_string())
}

pub(crate) fn text(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn twenty_at_once_each_accepted_request_runs_once(backend: Backend) {
    let mut c = Cluster::new(backend, Some(JOBS), "");
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    c.wait_for("the tick job to run", Duration::from_secs(30), |l| {
        l.len() >= 2
    });
    c.wait_registry("n1", &["n1", "n2", "n3"], Duration::from_secs(60));

    // An unknown job: 64, nothing recorded.
    let out = c.cli("n1", &["trigger", "nosuch"]);
    assert_eq!(out.status.code(), Some(64), "{}", text(&out));

    // Twenty requests at once, through the three nodes' configs.
    let calls: Vec<std::process::Child> = (0..20)
        .map(|i| {
            Command::new(binary())
                .args(["trigger", "manual", "-c"])
                .arg(c.config(&format!("n{}", i % 3 + 1)))
                .env_remove("CRONLEASE_CONFIG")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = calls
        .into_iter()
        .map(|child| child.wait_with_output().unwrap())
        .collect();
    let asked_at = Instant::now();
    let mut accepted: BTreeSet<String> = BTreeSet::new();
    let mut refused = 0;
    for out in &outs {
        match out.status.code() {
            Some(0) => {
                assert!(
                    accepted.insert(accepted_id(out).expect("an id")),
                    "{}",
                    text(out)
                );
            }
            Some(1) => {
                let stderr = String::from_utf8_lossy(&out.stderr);
                assert!(
                    stderr.contains("refused: a run of manual is in progress")
                        || stderr.contains("refused: a manual run of manual was requested already"),
                    "{}",
                    text(out)
                );
                refused += 1;
            }
            _ => panic!("trigger exits 0 or 1: {}\n{}", text(out), c.report()),
        }
    }
    assert!(!accepted.is_empty(), "none of 20 accepted\n{}", c.report());
    assert_eq!(accepted.len() + refused, 20);
    let first = wait_until(
        "the accepted requests to run",
        Duration::from_secs(30),
        || c.report(),
        || {
            let runs = manual_runs(&c);
            accepted
                .iter()
                .all(|id| runs.get(id).is_some_and(|r| r.end.is_some()))
                .then_some(runs)
        },
    );
    let started = first
        .values()
        .map(|r| r.start)
        .fold(f64::INFINITY, f64::min);
    eprintln!(
        "{backend:?}: 20 at once: {} accepted, {refused} refused; first run started {:.3} s after the last call returned",
        accepted.len(),
        started - unix_now() + asked_at.elapsed().as_secs_f64()
    );

    // While a run is in progress, a request is refused: wait for a start
    // without its end, then ask.
    // (The last run's end is recorded within a quarter second: refused
    // as in progress until then.)
    let running = wait_until(
        "a request to be accepted",
        Duration::from_secs(30),
        || c.report(),
        || accepted_id(&c.cli("n2", &["trigger", "manual"])),
    );
    accepted.insert(running.clone());
    wait_until(
        "the manual run to start",
        Duration::from_secs(30),
        || c.report(),
        || manual_runs(&c).contains_key(&running).then_some(()),
    );
    let out = c.cli("n3", &["trigger", "manual"]);
    let runs = manual_runs(&c);
    if runs[&running].end.is_none() {
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("in progress"),
            "{}",
            text(&out)
        );
    } else if let Some(id) = accepted_id(&out) {
        // The run ended before the request (a slow command): a new run.
        accepted.insert(id);
    }

    // --wait: the outcome, in the exit code.
    for node in ["n1", "n2", "n3"] {
        let out = wait_until(
            "a request to be accepted",
            Duration::from_secs(30),
            || c.report(),
            || {
                let out = c.cli(node, &["trigger", "manual", "--wait"]);
                (out.status.code() == Some(0) || !text(&out).contains("refused")).then_some(out)
            },
        );
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains(": ok"), "{stdout}");
        accepted.insert(accepted_id(&out).unwrap());
    }
    let out = c.cli("n1", &["trigger", "fails", "--wait"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("failed (exit code 3)"),
        "{}",
        text(&out)
    );

    // Next to scheduled occurrences: just before and just after instants.
    let mut tick_accepted = 0;
    for frac in [0.93, 0.03, 0.97, 0.5, 0.99, 0.01] {
        at_fraction_of_second(frac);
        let out = c.cli("n1", &["trigger", "tick"]);
        match out.status.code() {
            Some(0) => tick_accepted += 1,
            Some(1) => {}
            _ => panic!("{}", text(&out)),
        }
        std::thread::sleep(Duration::from_millis(600));
    }
    let tickman = format!("{}.tickman", c.out.display());
    wait_until(
        "the manual tick runs",
        Duration::from_secs(30),
        || c.report(),
        || {
            let lines = std::fs::read_to_string(&tickman).unwrap_or_default();
            (lines.lines().count() >= tick_accepted).then_some(())
        },
    );
    std::thread::sleep(Duration::from_secs(2));
    c.stop_all();
    let report = c.report();

    // Every accepted request ran once, one node each, nothing else ran.
    let runs = manual_runs(&c);
    let ran: BTreeSet<String> = runs.keys().cloned().collect();
    assert_eq!(ran, accepted, "runs vs accepted requests\n{report}");
    let mut in_order: Vec<&ManualRun> = runs.values().collect();
    in_order.sort_by(|a, b| a.start.total_cmp(&b.start));
    for w in in_order.windows(2) {
        assert!(
            w[0].end.is_some_and(|e| e < w[1].start),
            "manual runs overlap: {:?} {:?}\n{report}",
            w[0],
            w[1]
        );
        assert!(
            w[0].fence < w[1].fence,
            "fences out of order: {:?} {:?}\n{report}",
            w[0],
            w[1]
        );
    }
    // History names each request once, with the fence its run had.
    let history = c.all_history("n1", Some("manual"));
    let recorded: BTreeMap<String, u64> = history
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["trigger"]
                    .as_str()
                    .expect("a trigger in history")
                    .to_string(),
                r["fence"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(recorded.len(), history.as_array().unwrap().len());
    let fences: BTreeMap<String, u64> = runs.iter().map(|(id, r)| (id.clone(), r.fence)).collect();
    assert_eq!(recorded, fences, "history vs runs\n{report}");

    // The tick job: every scheduled second exactly once, fences rising,
    // whatever the manual runs next to them; the manual ones ran besides.
    let scheduled = check_exactly_once(&c.lines(), &report);
    assert!(scheduled.len() >= 8, "{report}");
    let manual_ticks = std::fs::read_to_string(&tickman).unwrap_or_default();
    assert_eq!(
        manual_ticks.lines().count(),
        tick_accepted,
        "{manual_ticks}\n{report}"
    );
    let mut all_fences: Vec<u64> = scheduled.iter().map(|l| l.fence).collect();
    all_fences.extend(
        manual_ticks
            .lines()
            .map(|l| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap()),
    );
    let distinct: BTreeSet<u64> = all_fences.iter().copied().collect();
    assert_eq!(distinct.len(), all_fences.len(), "a fence twice\n{report}");
    let history = c.all_history("n1", Some("tick"));
    let skipped: Vec<&serde_json::Value> = history
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["outcome"] != "ok")
        .collect();
    assert!(
        skipped.is_empty(),
        "no tick run skipped or failed: {skipped:?}\n{report}"
    );
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

crate::per_store!(
    [sqlite, postgres, redis, sentinel, redlock, zookeeper, etcd];
    twenty_at_once_each_accepted_request_runs_once
);

/// A manual run going at a scheduled instant of its job: that occurrence
/// is not skipped as an overlap (nor missed), it starts when the manual
/// run ends.
#[test]
fn a_manual_run_across_an_instant_delays_that_occurrence_without_skipping_it() {
    let jobs = r#"
[[job]]
name = "slow"
schedule = "*/2 * * * * *"
command = "echo \"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE ${CRONLEASE_TRIGGER:-scheduled} $(date +%s.%N)\" >> '{out}'; sleep 0.6"
"#;
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    let lines = |c: &Cluster| -> Vec<Vec<String>> {
        std::fs::read_to_string(&c.out)
            .unwrap_or_default()
            .lines()
            .map(|l| l.split_whitespace().map(str::to_string).collect())
            .collect()
    };
    wait_until(
        "the slow job to run",
        Duration::from_secs(30),
        || c.report(),
        || (lines(&c).len() >= 2).then_some(()),
    );
    let mut spanning = 0;
    for _ in 0..4 {
        // 0.7 s into an odd second: the run (0.6 s) is going at the next
        // even instant.
        at_fraction_of_second(0.7);
        if chrono::Utc::now().timestamp() % 2 == 0 {
            at_fraction_of_second(0.7);
        }
        let out = c.cli(["n1", "n2", "n3"][spanning % 3], &["trigger", "slow"]);
        if out.status.code() == Some(0) {
            spanning += 1;
        }
        std::thread::sleep(Duration::from_millis(1_500));
    }
    std::thread::sleep(Duration::from_secs(3));
    c.stop_all();
    let report = c.report();
    assert!(spanning >= 2, "{report}");
    let history = c.all_history("n1", Some("slow"));
    let records = history.as_array().unwrap();
    let not_ok: Vec<&serde_json::Value> = records.iter().filter(|r| r["outcome"] != "ok").collect();
    assert!(not_ok.is_empty(), "{not_ok:?}\n{report}");
    let manual = records.iter().filter(|r| r["trigger"].is_string()).count();
    assert_eq!(manual, spanning, "{report}");
    // The scheduled occurrences: every even second, each once.
    let mut scheduled: Vec<chrono::DateTime<chrono::Utc>> = lines(&c)
        .iter()
        .filter(|f| f.get(3).map(String::as_str) == Some("scheduled"))
        .map(|f| f[0].parse().unwrap())
        .collect();
    scheduled.sort();
    for w in scheduled.windows(2) {
        assert_eq!(
            (w[1] - w[0]).num_seconds(),
            2,
            "an occurrence missed or run twice between {} and {}\n{report}",
            w[0],
            w[1]
        );
    }
}

/// A manual run that outlasts the windows of the occurrences it covers
/// costs them: each is recorded `skipped`, as an overlap is, and the one
/// whose window is still open when it ends starts then (docs/cli.md
/// `trigger`, protocol.md "Manual runs"; the docs once said both).
#[test]
fn a_manual_run_longer_than_the_window_costs_the_occurrences_it_covers_recorded_skipped() {
    let jobs = r#"
[[job]]
name = "tick"
schedule = "* * * * * *"
command = "if [ -n \"$CRONLEASE_TRIGGER\" ]; then sleep 3.5; else sleep 0.1; fi; echo \"$CRONLEASE_OCCURRENCE\" >> '{out}'"
"#;
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    wait_until(
        "tick to run twice",
        Duration::from_secs(30),
        || c.report(),
        || {
            let runs = std::fs::read_to_string(&c.out).unwrap_or_default();
            (runs.lines().count() >= 2).then_some(())
        },
    );
    // Between runs (each is over and recorded by .6 s); a request that
    // still meets the last run (refused as an overlap) is made again.
    let mut refused = Vec::new();
    loop {
        at_fraction_of_second(0.6);
        let out = c.cli("n1", &["trigger", "tick"]);
        if out.status.code() == Some(0) {
            break;
        }
        refused.push(text(&out));
        assert!(refused.len() < 5, "{refused:?}\n{}", c.report());
    }
    std::thread::sleep(Duration::from_secs(7));
    c.stop_all();
    let report = c.report();
    let history = c.all_history("n1", Some("tick"));
    let records = history.as_array().unwrap();
    let at = |r: &serde_json::Value, field: &str| -> chrono::DateTime<chrono::Utc> {
        r[field].as_str().unwrap().parse().unwrap()
    };
    let manual: Vec<&serde_json::Value> = records
        .iter()
        .filter(|r| r["trigger"].is_string())
        .collect();
    assert_eq!(manual.len(), 1, "{manual:?}\n{report}");
    assert_eq!(manual[0]["outcome"], "ok", "{report}");
    let (began, ended) = (at(manual[0], "started_at"), at(manual[0], "finished_at"));
    let mut scheduled: Vec<(chrono::DateTime<chrono::Utc>, String)> = records
        .iter()
        .filter(|r| r["trigger"].is_null())
        .map(|r| {
            (
                at(r, "occurrence"),
                r["outcome"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    scheduled.sort();
    let skipped: Vec<chrono::DateTime<chrono::Utc>> = scheduled
        .iter()
        .filter(|(_, outcome)| outcome == "skipped")
        .map(|(o, _)| *o)
        .collect();
    // 3.5 s from about x.6: the instants x+1 and x+2 at least have their
    // windows (up to the next instant) end while it runs.
    assert!(skipped.len() >= 2, "{scheduled:?}\n{report}");
    // `began` is when the guard spawned the manual run, which under load
    // can come after the daemon claimed and started it (and an instant
    // falls between): a skipped occurrence's window must end within the
    // run, never before its spawn nor after its end.
    for o in &skipped {
        let window_end = *o + chrono::Duration::seconds(1);
        assert!(
            window_end > began && window_end <= ended,
            "{o} skipped, but its window does not end inside the manual run ({began} to {ended})\n{report}"
        );
    }
    // Every instant once, from before the manual run to after it: run
    // `ok` or recorded `skipped`, none missing.
    let first = skipped[0] - chrono::Duration::seconds(1);
    let last = skipped[skipped.len() - 1] + chrono::Duration::seconds(1);
    let span: Vec<&(chrono::DateTime<chrono::Utc>, String)> = scheduled
        .iter()
        .filter(|(o, _)| *o >= first && *o <= last)
        .collect();
    assert_eq!(
        span.len() as i64,
        (last - first).num_seconds() + 1,
        "an instant missed or recorded twice: {span:?}\n{report}"
    );
    assert_eq!(span[0].1, "ok", "{span:?}\n{report}");
    // The first instant after the skipped ones waited for the manual run
    // and then ran.
    let after = span[span.len() - 1];
    assert_eq!(after.1, "ok", "{span:?}\n{report}");
    assert!(
        after.0 < ended,
        "{} was due before the manual run ended at {ended}\n{report}",
        after.0
    );
}

/// A request for a job no daemon runs (in the operator's configuration
/// only): `status` lists it with its age, a second trigger is refused with
/// the way out, `trigger --cancel` withdraws it once; and a request no node
/// takes within `cluster.trigger_expiry` is withdrawn by a running daemon,
/// which says so.
#[test]
fn a_request_no_node_takes_is_listed_cancelled_and_expires() {
    Backend::Sqlite.require();
    let dir = tempfile::tempdir().unwrap();
    let url = Backend::Sqlite.url(dir.path());
    let prefix = crate::support::unique("tx");
    let write = |name: &str, jobs: &str, extra: &str| {
        let path = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &path,
            format!(
                "node = \"{name}\"\npid_file = \"{name}.pid\"\n[cluster]\n{extra}\n[store]\nurl = \"{url}\"\ntable_prefix = \"{prefix}\"\nop_timeout = \"2s\"\n{jobs}"
            ),
        )
        .unwrap();
        path
    };
    let stuck = "[[job]]\nname = \"stuck\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"true\"\n";
    let other = "[[job]]\nname = \"other\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"true\"\n";
    let operator = write("op", stuck, "");
    let daemon = write("n1", other, "trigger_expiry = \"3s\"");
    let cli = |args: &[&str]| {
        Command::new(binary())
            .args(args)
            .arg("-c")
            .arg(&operator)
            .current_dir(dir.path())
            .env_remove("CRONLEASE_STORE_URL")
            .output()
            .unwrap()
    };
    assert!(cli(&["migrate"]).status.success());
    let first = cli(&["trigger", "stuck"]);
    assert!(first.status.success(), "{}", text(&first));
    let status = cli(&["status"]);
    assert!(
        text(&status).contains("PENDING TRIGGER: stuck")
            && text(&status).contains("trigger --cancel stuck"),
        "{}",
        text(&status)
    );
    let json = cli(&["status", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let row = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["job"] == "stuck")
        .unwrap();
    assert!(row["pending_trigger"]["age_ms"].as_u64().is_some(), "{row}");
    let again = cli(&["trigger", "stuck"]);
    assert_eq!(again.status.code(), Some(1), "{}", text(&again));
    assert!(
        text(&again).contains("trigger --cancel stuck"),
        "{}",
        text(&again)
    );
    let cancel = cli(&["trigger", "--cancel", "stuck"]);
    assert!(cancel.status.success(), "{}", text(&cancel));
    assert!(text(&cancel).contains("withdrawn"), "{}", text(&cancel));
    let twice = cli(&["trigger", "--cancel", "stuck"]);
    assert_eq!(twice.status.code(), Some(1), "{}", text(&twice));
    // `cancel`, with no run going, withdraws a pending request the same way.
    assert!(cli(&["trigger", "stuck"]).status.success());
    let cancel = cli(&["cancel", "stuck"]);
    assert!(cancel.status.success(), "{}", text(&cancel));
    assert!(text(&cancel).contains("withdrawn"), "{}", text(&cancel));
    assert!(!text(&cli(&["status"])).contains("PENDING TRIGGER"));

    // Expiry: a daemon without the job withdraws it after 3 s.
    let log = std::fs::File::create(dir.path().join("n1.log")).unwrap();
    let mut n1 = Command::new(binary())
        .args(["run", "-c"])
        .arg(&daemon)
        .current_dir(dir.path())
        .env_remove("CRONLEASE_STORE_URL")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let requested = cli(&["trigger", "stuck"]);
    assert!(requested.status.success(), "{}", text(&requested));
    let read_log = || std::fs::read_to_string(dir.path().join("n1.log")).unwrap_or_default();
    wait_until(
        "the request to expire",
        Duration::from_secs(20),
        read_log,
        || read_log().contains("request expired").then_some(()),
    );
    let _ = n1.kill();
    let _ = n1.wait();
    assert!(
        !text(&cli(&["status"])).contains("PENDING TRIGGER"),
        "{}",
        read_log()
    );
    // History says so, with the request's id and a fence of its own.
    let history = cli(&["history", "stuck", "--json"]);
    let runs: serde_json::Value = serde_json::from_slice(&history.stdout).unwrap();
    let id = accepted_id(&requested).unwrap();
    let expired = runs
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["trigger"] == id.as_str());
    assert!(
        expired.is_some_and(|r| r["outcome"] == "expired" && r["fence"].as_u64() > Some(0)),
        "{runs:#}\n{}",
        read_log()
    );
    // A fresh request is accepted again.
    assert!(cli(&["trigger", "stuck"]).status.success());
}

/// Running now (docs/protocol.md): a run going on a node is in `status
/// --json` (node, fence, occurrence, start, elapsed, manual or scheduled,
/// attempt, its request) and a `RUNNING:` line of `status`, from the node's
/// beats, while it goes (a minute, so no stall ends it early), and gone
/// once it has ended (cancelled); a scheduled run shows as one. The refusal of a trigger while it runs points at `status`, which
/// now shows it.
#[test]
fn a_running_run_is_shown_by_status_until_it_ends() {
    let jobs = r#"
[[job]]
name = "long"
schedule = "0 0 0 1 1 *"
command = "echo \"$CRONLEASE_FENCE $CRONLEASE_NODE $CRONLEASE_TRIGGER\" > '{out}.long'; sleep 60"

[[job]]
name = "every"
schedule = "*/5 * * * * *"
command = "echo \"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE\" > '{out}.every'; sleep 3"
"#;
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    assert!(c.cli("n1", &["migrate"]).status.success());
    c.start("n1");
    c.start("n2");
    let asked = c.cli("n1", &["trigger", "long"]);
    assert!(asked.status.success(), "{}", text(&asked));
    let id = accepted_id(&asked).expect("the request's id");
    let marker = format!("{}.long", c.out.display());
    let started = wait_until(
        "the manual run to start",
        Duration::from_secs(15),
        || c.report(),
        || {
            let line = std::fs::read_to_string(&marker).ok()?;
            let fields: Vec<String> = line.split_whitespace().map(str::to_string).collect();
            (fields.len() == 3).then_some(fields)
        },
    );
    let going = |job: &str| crate::cancel::running(&c, "n1", job).unwrap_or_default();
    let runs = wait_until(
        "status to show the manual run",
        Duration::from_secs(5),
        || c.report(),
        || Some(going("long")).filter(|r| !r.is_empty()),
    );
    assert_eq!(runs.len(), 1, "{runs:?}");
    let run = &runs[0];
    assert_eq!(run["node"], started[1].as_str(), "{run}");
    assert_eq!(run["fence"].as_u64(), started[0].parse().ok(), "{run}");
    assert_eq!(run["kind"], "manual", "{run}");
    assert_eq!(run["attempt"], 1, "{run}");
    assert_eq!(run["trigger"], id.as_str(), "{run}");
    assert!(
        run["owner"]
            .as_str()
            .unwrap()
            .starts_with(started[1].as_str()),
        "{run}"
    );
    // Read within seconds of the start (the run would go on for a minute).
    assert!(run["elapsed_ms"].as_u64().unwrap() < 10_000, "{run}");
    let at = chrono::DateTime::parse_from_rfc3339(run["started_at"].as_str().unwrap()).unwrap();
    assert!(
        (chrono::Utc::now() - at.to_utc()).num_seconds() < 5,
        "{run}"
    );
    let table = text(&c.cli("n2", &["status"]));
    let said = format!(
        "RUNNING: long on {} (fence {}, manual run of",
        started[1], started[0]
    );
    assert!(table.contains(&said), "{said}\n{table}");
    assert!(table.contains(&format!("(trigger {id})")), "{table}");
    let refused = c.cli("n1", &["trigger", "long"]);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert!(
        text(&refused).contains("`cronlease status` shows it"),
        "{}",
        text(&refused)
    );

    // A scheduled run: its kind, no request.
    let every = format!("{}.every", c.out.display());
    let _ = std::fs::remove_file(&every);
    let scheduled = wait_until(
        "a scheduled run shown going",
        Duration::from_secs(15),
        || c.report(),
        || {
            let line = std::fs::read_to_string(&every).ok()?;
            let fence: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            going("every").into_iter().find(|r| r["fence"] == fence)
        },
    );
    assert_eq!(scheduled["kind"], "scheduled", "{scheduled}");
    assert!(scheduled["trigger"].is_null(), "{scheduled}");

    // Once it has ended (cancelled: it would go on for a minute): gone,
    // by the next beat.
    let cancel = c.cli("n2", &["cancel", "long"]);
    assert!(cancel.status.success(), "{}", text(&cancel));
    wait_until(
        "the manual run to end and leave status",
        Duration::from_secs(10),
        || c.report(),
        || going("long").is_empty().then_some(()),
    );
    wait_until(
        "the manual run's record",
        Duration::from_secs(5),
        || c.report(),
        || {
            crate::cluster::history(&c, "long")
                .iter()
                .any(|r| r["outcome"] == "cancelled")
                .then_some(())
        },
    );
    c.stop_all();
}
