//! Webhooks (`[[notify]]`) received by a small HTTP server in the test:
//! signed, once per event across the cluster, retried while the receiver
//! answers 503, and handed over by a node that stops or dies to a peer
//! that sends them.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{KeyInit, Mac};
use nix::sys::signal::Signal;

use crate::cluster::{Cluster, history};
use crate::support::{Backend, wait_until};

/// One request the receiver answered.
#[derive(Debug, Clone)]
struct Received {
    path: String,
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
    /// The status it was answered with.
    status: u16,
}

/// An HTTP/1.1 receiver on loopback: answers 503 while `down`, else 200,
/// and keeps every request.
struct Receiver {
    port: u16,
    down: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let down = Arc::new(AtomicBool::new(true));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (d, s) = (down.clone(), seen.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let (d, s) = (d.clone(), s.clone());
                std::thread::spawn(move || serve(conn, &d, &s));
            }
        });
        Receiver { port, down, seen }
    }

    fn seen(&self) -> Vec<Received> {
        self.seen.lock().unwrap().clone()
    }
}

/// Serves the requests of one connection (keep-alive) until it closes.
fn serve(conn: std::net::TcpStream, down: &AtomicBool, seen: &Mutex<Vec<Received>>) {
    let mut out = conn.try_clone().unwrap();
    let mut reader = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        let mut headers = BTreeMap::new();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
            }
        }
        let len: usize = headers
            .get("content-length")
            .and_then(|l| l.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let status = if down.load(Ordering::SeqCst) {
            503
        } else {
            200
        };
        seen.lock().unwrap().push(Received {
            path,
            headers,
            body,
            status,
        });
        let reason = if status == 200 {
            "OK"
        } else {
            "Service Unavailable"
        };
        if out
            .write_all(
                format!("HTTP/1.1 {status} {reason}\r\ncontent-length: 0\r\n\r\n").as_bytes(),
            )
            .is_err()
        {
            return;
        }
    }
}

/// Whether `r` carries a valid `x-cronlease-signature` under `secret`.
fn signed(r: &Received, secret: &[u8]) -> bool {
    let Some(sig) = r.headers.get("x-cronlease-signature") else {
        return false;
    };
    let Some((t, v1)) = sig
        .strip_prefix("t=")
        .and_then(|rest| rest.split_once(",v1="))
    else {
        return false;
    };
    let mut mac = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(secret).unwrap();
    mac.update(t.as_bytes());
    mac.update(b".");
    mac.update(&r.body);
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    hex == v1
}

/// The job's runs, oldest first: `(fence, outcome, node)`.
fn runs(c: &Cluster, job: &str) -> Vec<(u64, String, String)> {
    let mut runs: Vec<(u64, String, String)> = history(c, job)
        .iter()
        .map(|r| {
            (
                r["fence"].as_u64().unwrap(),
                r["outcome"].as_str().unwrap().to_string(),
                r["node"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    runs.sort();
    runs
}

/// What should have been delivered for `runs`: `(webhook, delivery id)` of
/// every `failed` run (both webhooks) and of every `ok` run whose previous
/// run failed (`recovered`, "ops" only).
fn expected(runs: &[(u64, String, String)]) -> BTreeSet<(String, String)> {
    let failure = |o: &str| {
        matches!(
            o,
            "failed" | "timeout" | "lease_lost" | "killed" | "not_started"
        )
    };
    let mut want = BTreeSet::new();
    let mut previous_failed = false;
    for (fence, outcome, _) in runs {
        match outcome.as_str() {
            "failed" => {
                want.insert(("ops".to_string(), format!("flaky-{fence}-failed")));
                want.insert(("chat".to_string(), format!("flaky-{fence}-failed")));
            }
            "ok" if previous_failed => {
                want.insert(("ops".to_string(), format!("flaky-{fence}-recovered")));
            }
            _ => {}
        }
        if outcome == "ok" || failure(outcome) {
            previous_failed = failure(outcome);
        }
    }
    want
}

#[test]
fn webhooks_are_signed_sent_once_across_nodes_retried_and_kept_over_a_restart() {
    let rx = Receiver::start();
    let secret_dir = tempfile::tempdir().unwrap();
    let secret_file = secret_dir.path().join("secret");
    std::fs::write(&secret_file, "s3cr3t-hmac-key\n").unwrap();
    let secret = b"s3cr3t-hmac-key";
    let url = format!("http://127.0.0.1:{}", rx.port);
    // Runs alternate: fail, ok (recovered), fail, ok, ...
    let jobs = "[[job]]\nname = \"flaky\"\nschedule = \"* * * * * *\"\ncommand = \"n=$(cat '{out}.n' 2>/dev/null || echo 0); echo $((n + 1)) > '{out}.n'; echo run$n; [ $((n % 2)) -ne 0 ]\"\n";
    let extra = format!(
        "[[notify]]\nname = \"ops\"\nurl = \"{url}/ops/token-in-path\"\nevents = [\"failed\", \"recovered\"]\nsecret_file = \"{}\"\ntimeout = \"2s\"\n\n[[notify]]\nname = \"chat\"\nurl = \"{url}/chat\"\nevents = [\"failed\"]\njobs = [\"flaky\"]\nformat = \"slack\"\n\n[http]\nlisten = \"127.0.0.1:0\"\npublic_url = \"https://cron.example.com/\"\n",
        secret_file.display()
    );
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), &extra);
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    // The receiver is down: each failed run's event is tried and refused.
    wait_until(
        "refused deliveries while the receiver is down",
        Duration::from_secs(30),
        || c.report(),
        || (rx.seen().iter().filter(|r| r.status == 503).count() >= 3).then_some(()),
    );
    // Kill the holder while its deliveries wait for the receiver: they are
    // in its spool, which its guard hands over (or, if the store does not
    // take them, it sends when it starts again).
    let holder = runs(&c, "flaky").last().unwrap().2.clone();
    // Mid-second, between runs: a daemon killed in the 250 ms after a run
    // ended, while its record waits for its batch, loses the record (not
    // the webhook's event), and the test judges from history.
    let ms = chrono::Utc::now().timestamp_subsec_millis();
    std::thread::sleep(Duration::from_millis(u64::from((1600 - ms) % 1000)));
    c.signal(&holder, Signal::SIGKILL);
    c.wait_exit(&holder, Duration::from_secs(10)).unwrap();
    rx.down.store(false, Ordering::SeqCst);
    // Peers go on; the receiver is up.
    let runs_before = runs(&c, "flaky").len();
    wait_until(
        "runs by the peers",
        Duration::from_secs(30),
        || c.report(),
        || (runs(&c, "flaky").len() >= runs_before + 4).then_some(()),
    );
    c.start(&holder);
    let delivered = || -> BTreeSet<(String, String)> {
        rx.seen()
            .iter()
            .filter(|r| r.status == 200)
            .map(|r| {
                let hook = if r.path.starts_with("/ops") {
                    "ops"
                } else {
                    "chat"
                };
                (hook.to_string(), r.headers["x-cronlease-delivery"].clone())
            })
            .collect()
    };
    wait_until(
        "every event delivered",
        Duration::from_secs(40),
        || {
            let want = expected(&runs(&c, "flaky"));
            format!(
                "missing {:?}\n{}",
                want.difference(&delivered()).collect::<Vec<_>>(),
                c.report()
            )
        },
        || {
            expected(&runs(&c, "flaky"))
                .is_subset(&delivered())
                .then_some(())
        },
    );
    c.stop_all();
    let all = runs(&c, "flaky");
    let want = expected(&all);
    let seen = rx.seen();
    let ok: Vec<&Received> = seen.iter().filter(|r| r.status == 200).collect();
    // Exactly the expected events, each delivered once.
    let mut count: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in &ok {
        let hook = if r.path.starts_with("/ops") {
            "ops"
        } else {
            "chat"
        };
        *count
            .entry((hook.to_string(), r.headers["x-cronlease-delivery"].clone()))
            .or_default() += 1;
    }
    assert!(
        count.values().all(|&n| n == 1),
        "delivered twice: {count:?}"
    );
    let got: BTreeSet<_> = count.keys().cloned().collect();
    assert_eq!(got, want, "runs: {all:?}");
    assert!(want.len() >= 6, "{want:?}");
    // The deliveries came from more than one node, and some were refused
    // first (retried), among them some of the killed daemon's, sent after
    // its death.
    let nodes: BTreeSet<String> = ok
        .iter()
        .filter(|r| r.path.starts_with("/ops"))
        .map(|r| {
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            v["node"].as_str().unwrap().to_string()
        })
        .collect();
    assert!(nodes.len() >= 2, "{nodes:?}");
    let refused: BTreeSet<&String> = seen
        .iter()
        .filter(|r| r.status == 503)
        .map(|r| &r.headers["x-cronlease-delivery"])
        .collect();
    assert!(
        ok.iter()
            .any(|r| refused.contains(&r.headers["x-cronlease-delivery"])),
        "no delivery was retried after a 503"
    );
    let by_holder = ok.iter().any(|r| {
        r.path.starts_with("/ops")
            && refused.contains(&r.headers["x-cronlease-delivery"])
            && serde_json::from_slice::<serde_json::Value>(&r.body).unwrap()["node"]
                == holder.as_str()
    });
    assert!(
        by_holder,
        "the killed daemon's spooled deliveries were not delivered"
    );
    // "ops" is signed and JSON; "chat" is unsigned Slack text.
    for r in &seen {
        if r.path.starts_with("/ops") {
            assert!(signed(r, secret), "bad signature: {r:?}");
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(v["job"], "flaky");
            assert_eq!(v["delivery"], r.headers["x-cronlease-delivery"].as_str());
            assert_eq!(v["event"], r.headers["x-cronlease-event"].as_str());
            assert_eq!(v["dashboard"], "https://cron.example.com/");
            assert!(v["output_tail"].as_str().unwrap().starts_with("run"), "{v}");
            if v["event"] == "failed" {
                assert_eq!(v["exit_code"], 1, "{v}");
            }
        } else {
            assert!(!r.headers.contains_key("x-cronlease-signature"));
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            let text = v["text"].as_str().unwrap();
            assert!(text.contains("job `flaky` ended failed"), "{text}");
            assert!(
                text.contains("<https://cron.example.com/|dashboard>"),
                "{text}"
            );
        }
    }
    // No log line names the URL's path (a chat webhook's token).
    for n in ["n1", "n2", "n3"] {
        let log = std::fs::read_to_string(c.dir.path().join(format!("{n}.log"))).unwrap();
        assert!(log.contains("webhook configured"), "{log}");
        assert!(!log.contains("token-in-path"), "{log}");
    }
}

/// `{out}.EXT`, a file the jobs write beside the output file.
fn side(out: &std::path::Path, ext: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("{}.{ext}", out.display()))
}

/// The `on_failure` lines of the job "slow" (`fence outcome exit_code node`).
fn failures(out: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(side(out, "failures"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// The fences of the job's runs recorded `killed`, oldest first.
fn killed(c: &Cluster, job: &str) -> Vec<u64> {
    runs(c, job)
        .into_iter()
        .filter(|(_, outcome, _)| outcome == "killed")
        .map(|(fence, _, _)| fence)
        .collect()
}

/// How many times `rx` took (200) the delivery `id`.
fn delivered_as(rx: &Receiver, id: &str) -> usize {
    rx.seen()
        .iter()
        .filter(|r| r.status == 200 && r.headers["x-cronlease-delivery"] == id)
        .count()
}

/// How many entries the spool directory `dir` holds.
fn json_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| {
        d.filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".json"))
        })
        .count()
    })
}

/// Waits until the job "slow" has started `n` runs (its start lines).
fn started(c: &Cluster, n: usize) {
    let out = c.out.clone();
    wait_until(
        &format!("{n} runs of slow started"),
        Duration::from_secs(20),
        || c.report(),
        || {
            let lines = std::fs::read_to_string(side(&out, "started")).unwrap_or_default();
            (lines.lines().count() >= n).then_some(())
        },
    );
}

#[test]
fn runs_a_daemon_could_not_follow_get_on_failure_and_events_at_its_next_start() {
    let rx = Receiver::start();
    rx.down.store(false, Ordering::SeqCst);
    let url = format!("http://127.0.0.1:{}", rx.port);
    // A run that outlives its daemon: killed by the guard (SIGKILL of the
    // daemon), then at the end of shutdown_grace (SIGTERM).
    let jobs = "[[job]]\nname = \"slow\"\nschedule = \"* * * * * *\"\ncommand = \"echo $CRONLEASE_FENCE >> '{out}.started'; sleep 60\"\non_failure = \"echo \\\"$CRONLEASE_FENCE $CRONLEASE_OUTCOME $CRONLEASE_EXIT_CODE $CRONLEASE_NODE\\\" >> '{out}.failures'\"\n\n[[job]]\nname = \"once\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"true\"\non_failure = \"echo \\\"once $CRONLEASE_FENCE $CRONLEASE_OUTCOME $CRONLEASE_NODE\\\" >> '{out}.failures'\"\n";
    let extra = format!(
        "shutdown_grace = \"1s\"\n[[notify]]\nname = \"ops\"\nurl = \"{url}/ops\"\nevents = [\"killed\", \"not_started\"]\ntimeout = \"2s\"\n"
    );
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), &extra);
    let out = c.out.clone();
    c.start("n1");
    started(&c, 1);
    c.signal("n1", Signal::SIGKILL);
    c.wait_exit("n1", Duration::from_secs(10)).unwrap();
    let first = wait_until(
        "the guard's killed record",
        Duration::from_secs(10),
        || c.report(),
        || killed(&c, "slow").first().copied(),
    );
    // No daemon is left to give them: the guard keeps them for the next.
    let owed = c.dir.path().join("owed-n1");
    wait_until(
        "what the killed run is owed, on disk",
        Duration::from_secs(10),
        || c.report(),
        || (json_files(&owed) >= 1).then_some(()),
    );
    assert!(failures(&out).is_empty(), "{:?}", failures(&out));
    assert!(rx.seen().is_empty());
    c.start("n1");
    let want_first = format!("{first} killed 137 n1");
    wait_until(
        "on_failure of the run the guard killed",
        Duration::from_secs(20),
        || format!("{:?}\n{}", failures(&out), c.report()),
        || failures(&out).contains(&want_first).then_some(()),
    );
    let delivered = |fence: u64| delivered_as(&rx, &format!("slow-{fence}-killed"));
    wait_until(
        "the killed event of the run the guard killed",
        Duration::from_secs(20),
        || c.report(),
        || (delivered(first) == 1).then_some(()),
    );
    // Given once: the file is gone.
    assert_eq!(json_files(&owed), 0);
    // A run killed at the end of shutdown_grace: no hook starts while the
    // daemon stops; the next start runs it.
    // (The restarted daemon's first run; one already going is enough.)
    started(&c, 2);
    c.signal("n1", Signal::SIGTERM);
    c.wait_exit("n1", Duration::from_secs(15)).unwrap();
    let second = *killed(&c, "slow").last().unwrap();
    assert!(second > first, "{:?}", runs(&c, "slow"));
    assert!(
        !failures(&out)
            .iter()
            .any(|l| l.starts_with(&format!("{second} "))),
        "{:?}",
        failures(&out)
    );
    c.start("n1");
    wait_until(
        "on_failure of the run killed at the end of shutdown_grace",
        Duration::from_secs(20),
        || format!("{:?}\n{}", failures(&out), c.report()),
        || {
            failures(&out)
                .iter()
                .any(|l| l.starts_with(&format!("{second} killed ")))
                .then_some(())
        },
    );
    wait_until(
        "the killed event of the run killed at the end of shutdown_grace",
        Duration::from_secs(20),
        || c.report(),
        || (delivered(second) == 1).then_some(()),
    );
    // A manual run whose daemon died after winning it and before starting
    // it (a test-only failpoint): not asked for again, so its not_started
    // is final and owed.
    c.signal("n1", Signal::SIGTERM);
    c.wait_exit("n1", Duration::from_secs(15)).unwrap();
    c.start_with_env("n1", &[("CRONLEASE_FAILPOINT_DIE_BEFORE_START", "once")]);
    let asked = c.cli("n1", &["trigger", "once"]);
    assert!(asked.status.success(), "{asked:?}");
    c.wait_exit("n1", Duration::from_secs(20)).unwrap();
    let unstarted = wait_until(
        "the guard's not_started record of the manual run",
        Duration::from_secs(10),
        || c.report(),
        || {
            runs(&c, "once")
                .into_iter()
                .find(|(_, outcome, _)| outcome == "not_started")
                .map(|(fence, _, _)| fence)
        },
    );
    assert!(
        !failures(&out).contains(&format!("once {unstarted} not_started n1")),
        "{:?}",
        failures(&out)
    );
    c.start("n1");
    wait_until(
        "on_failure of the manual run its daemon never started",
        Duration::from_secs(20),
        || format!("{:?}\n{}", failures(&out), c.report()),
        || {
            failures(&out)
                .contains(&format!("once {unstarted} not_started n1"))
                .then_some(())
        },
    );
    let unstarted_event = || delivered_as(&rx, &format!("once-{unstarted}-not_started"));
    wait_until(
        "the not_started event of the manual run",
        Duration::from_secs(20),
        || c.report(),
        || (unstarted_event() == 1).then_some(()),
    );
    c.stop_all();
    assert_eq!(unstarted_event(), 1);
    // Each once: one hook line and one delivery per killed run.
    let lines = failures(&out);
    for fence in [first, second] {
        let n = lines
            .iter()
            .filter(|l| l.starts_with(&format!("{fence} ")))
            .count();
        assert_eq!(n, 1, "{lines:?}");
        assert_eq!(delivered(fence), 1);
    }
    let log = c.log("n1");
    assert!(log.contains("its on_failure follows now"), "{log}");
}

/// The delivery ids the receiver took (200), each with how many times.
fn taken_ids(rx: &Receiver) -> BTreeMap<String, usize> {
    let mut count = BTreeMap::new();
    for r in rx.seen().iter().filter(|r| r.status == 200) {
        *count
            .entry(r.headers["x-cronlease-delivery"].clone())
            .or_default() += 1;
    }
    count
}

/// The node that ran the job's last recorded run.
fn last_runner(c: &Cluster, job: &str) -> Option<String> {
    runs(c, job).last().map(|r| r.2.clone())
}

#[test]
fn deliveries_a_stopped_or_dead_node_left_are_handed_over_and_sent_once_by_a_peer() {
    let rx = Receiver::start();
    let url = format!("http://127.0.0.1:{}", rx.port);
    let jobs =
        "[[job]]\nname = \"flaky\"\nschedule = \"* * * * * *\"\ncommand = \"echo run; exit 3\"\n";
    let extra = format!(
        "[[notify]]\nname = \"ops\"\nurl = \"{url}/ops\"\nevents = [\"failed\"]\ntimeout = \"2s\"\n"
    );
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), &extra);
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    // The receiver is down: the holder's deliveries wait in its queue.
    let refused_by = |c: &Cluster, node: &str| {
        let ran: BTreeSet<String> = runs(c, "flaky")
            .into_iter()
            .filter(|(_, outcome, by)| outcome == "failed" && by == node)
            .map(|(fence, _, _)| format!("flaky-{fence}-failed"))
            .collect();
        rx.seen()
            .iter()
            .filter(|r| r.status == 503 && ran.contains(&r.headers["x-cronlease-delivery"]))
            .map(|r| r.headers["x-cronlease-delivery"].clone())
            .collect::<BTreeSet<_>>()
            .len()
    };
    let first = wait_until(
        "a holder with refused deliveries",
        Duration::from_secs(30),
        || c.report(),
        || {
            let holder = last_runner(&c, "flaky")?;
            (refused_by(&c, &holder) >= 2).then_some(holder)
        },
    );
    // It stops: what it could not deliver goes to the store.
    c.signal(&first, Signal::SIGTERM);
    assert!(c.wait_exit(&first, Duration::from_secs(15)).is_some());
    assert!(
        c.log(&first).contains("webhook deliveries handed over"),
        "{}",
        c.log(&first)
    );
    assert_eq!(json_files(&c.dir.path().join(format!("notify-{first}"))), 0);
    // The next holder dies (SIGKILL): its guard hands its spool over.
    let second = wait_until(
        "another holder with refused deliveries",
        Duration::from_secs(30),
        || c.report(),
        || {
            let holder = last_runner(&c, "flaky")?;
            (holder != first && refused_by(&c, &holder) >= 2).then_some(holder)
        },
    );
    c.signal(&second, Signal::SIGKILL);
    assert!(c.wait_exit(&second, Duration::from_secs(10)).is_some());
    wait_until(
        "the guard's hand-over of the dead daemon's spool",
        Duration::from_secs(15),
        || c.report(),
        || {
            c.log(&second)
                .contains("webhook deliveries the daemon had not made handed over")
                .then_some(())
        },
    );
    let third = ["n1", "n2", "n3"]
        .into_iter()
        .find(|n| *n != first && *n != second)
        .unwrap()
        .to_string();
    rx.down.store(false, Ordering::SeqCst);
    // Neither is started again: the one left sends every event, once.
    let want = |c: &Cluster| -> BTreeSet<String> {
        runs(c, "flaky")
            .into_iter()
            .filter(|(_, outcome, _)| outcome == "failed")
            .map(|(fence, _, _)| format!("flaky-{fence}-failed"))
            .collect()
    };
    wait_until(
        "every failed run's event delivered",
        Duration::from_secs(60),
        || {
            let got: BTreeSet<String> = taken_ids(&rx).into_keys().collect();
            format!(
                "missing {:?}\n{}",
                want(&c).difference(&got).collect::<Vec<_>>(),
                c.report()
            )
        },
        || {
            let got: BTreeSet<String> = taken_ids(&rx).into_keys().collect();
            want(&c).is_subset(&got).then_some(())
        },
    );
    c.stop_all();
    let all = want(&c);
    let count = taken_ids(&rx);
    assert!(
        count.values().all(|&n| n == 1),
        "delivered twice: {count:?}"
    );
    assert_eq!(count.keys().cloned().collect::<BTreeSet<_>>(), all);
    // Among them the events of runs on the two that left, refused before.
    let ran_on = |node: &str| -> usize {
        rx.seen()
            .iter()
            .filter(|r| r.status == 200)
            .filter(|r| {
                serde_json::from_slice::<serde_json::Value>(&r.body).unwrap()["node"] == node
            })
            .count()
    };
    assert!(ran_on(&first) >= 2 && ran_on(&second) >= 2, "{count:?}");
    assert!(
        c.log(&third)
            .contains("webhook deliveries handed over by a node that stopped"),
        "{}",
        c.log(&third)
    );
}
