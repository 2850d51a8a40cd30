//! End to end: three `cronlease run` processes per store and a job every
//! second. Every occurrence runs exactly once with increasing fences; after
//! `kill -9` of an idle holder's daemon a peer takes over well within the
//! margin (its guard hands over: `handover.rs` has the cases), and after
//! SIGTERM of the holder a peer runs the next occurrence on time. The node
//! registry lists exactly the live nodes throughout, and `status` shows the
//! holder alive with its clock offset.

use std::time::Duration;

use chrono::Utc;
use nix::sys::signal::Signal;

use crate::cluster::{Cluster, at_fraction_of_second, check_exactly_once};
use crate::support::Backend;

const MARGIN: f64 = 1.0;

fn failover(backend: Backend) {
    let mut c = Cluster::new(backend, None, "");
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    c.wait_for("three runs", Duration::from_secs(20), |l| l.len() >= 3);
    c.wait_registry("n1", &["n1", "n2", "n3"], Duration::from_secs(5));
    let status = c.cli_json("n2", &["status"]).unwrap();
    assert_eq!(
        status[0]["holder_alive"], true,
        "status: the holder's node is alive\n{status}"
    );
    assert!(
        status[0]["holder_clock_offset_ms"]
            .as_i64()
            .is_some_and(|o| o.abs() < 500),
        "status: the holder's clock offset, from its registry record\n{status}"
    );

    // kill -9 the holder between two runs, once its last run is recorded
    // (the history write gathers for 250 ms after the run): an idle holder.
    at_fraction_of_second(0.7);
    let holder = c.lines().last().unwrap().node.clone();
    let killed_at = Utc::now();
    let killed = std::time::Instant::now();
    c.signal(&holder, Signal::SIGKILL);
    c.wait_exit(&holder, Duration::from_secs(5))
        .expect("killed node exits");
    // Its record is gone within its life (two beat periods of a second
    // and a third of the margin), its guard deleting it sooner.
    let survivors: Vec<&str> = ["n1", "n2", "n3"]
        .into_iter()
        .filter(|n| *n != holder)
        .collect();
    let gone = c.wait_registry(survivors[0], &survivors, Duration::from_secs(10)) - killed;
    assert!(
        gone <= Duration::from_secs_f64(2.0 * MARGIN.max(1.0) + MARGIN / 3.0),
        "the killed node stayed in the registry for {gone:?}\n{}",
        c.report()
    );
    let after_kill =
        |l: &[crate::cluster::Line]| l.iter().filter(|x| x.occurrence > killed_at).count();
    c.wait_for("five runs after kill -9", Duration::from_secs(20), |l| {
        after_kill(l) >= 5
    });

    // SIGTERM the new holder: it releases, a peer runs the next one on time.
    at_fraction_of_second(0.4);
    let second = c.lines().last().unwrap().node.clone();
    assert_ne!(second, holder);
    let termed_at = Utc::now();
    c.signal(&second, Signal::SIGTERM);
    let status = c
        .wait_exit(&second, Duration::from_secs(10))
        .expect("SIGTERM ends the daemon");
    assert_eq!(status.code(), Some(0), "graceful exit\n{}", c.report());
    // A node shutting down leaves the registry at once.
    let last: Vec<&str> = survivors.iter().copied().filter(|n| *n != second).collect();
    assert_eq!(
        c.registry(last[0]),
        last,
        "left the registry on SIGTERM\n{}",
        c.report()
    );
    let after_term =
        |l: &[crate::cluster::Line]| l.iter().filter(|x| x.occurrence > termed_at).count();
    c.wait_for("three runs after SIGTERM", Duration::from_secs(20), |l| {
        after_term(l) >= 3
    });
    c.stop_all();

    let report = c.report();
    for n in ["n1", "n2", "n3"] {
        assert!(
            !c.log(n).contains("guard process is gone"),
            "a daemon stopping lets its guard go without calling that an error\n{report}"
        );
    }
    let lines = check_exactly_once(&c.lines(), &report);
    let post_kill: Vec<_> = lines.iter().filter(|l| l.occurrence > killed_at).collect();
    assert!(
        post_kill.iter().all(|l| l.node != holder),
        "the killed node ran nothing after its death\n{report}"
    );
    for l in &post_kill {
        assert!(
            l.lateness() <= MARGIN + 0.5,
            "start {:.3}s after its instant after kill -9: {l:?}\n{report}",
            l.lateness()
        );
    }
    // The killed daemon's guard handed over: a peer took the next
    // occurrence at once, not after the margin.
    assert!(
        post_kill[0].lateness() < MARGIN / 2.0,
        "idle holder's daemon killed: the next run started {:.3}s late, as if its lease were waited out\n{report}",
        post_kill[0].lateness()
    );
    let post_term: Vec<_> = lines.iter().filter(|l| l.occurrence > termed_at).collect();
    assert!(
        post_term
            .iter()
            .all(|l| l.node != second && l.node != holder),
        "{report}"
    );
    assert!(
        post_term[0].lateness() <= 0.5,
        "next occurrence after SIGTERM late by {:.3}s\n{report}",
        post_term[0].lateness()
    );
    eprintln!(
        "{backend:?}: {} occurrences; takeover after kill -9: first run {:.3}s late; killed node out of the registry after {gone:?}; after SIGTERM: {:.3}s late",
        lines.len(),
        post_kill[0].lateness(),
        post_term[0].lateness()
    );
}

/// A live holder stopped (SIGSTOP) for 300 ms around an instant, while idle,
/// loses that occurrence to a peer after the head start; when it wakes, it
/// is refused the occurrence (claimed already) and runs nothing twice.
fn delayed_idle_holder(backend: Backend) {
    let mut c = Cluster::new(backend, None, "");
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    c.wait_for("three runs", Duration::from_secs(20), |l| l.len() >= 3);
    // 150 ms before an instant, its last run long recorded.
    at_fraction_of_second(0.85);
    let holder = c.lines().last().unwrap().node.clone();
    let instant = Utc::now().timestamp() + 1;
    let tree = c.freeze(&holder);
    std::thread::sleep(Duration::from_millis(300));
    c.thaw(&tree);
    c.wait_for("three more runs", Duration::from_secs(20), |l| {
        l.iter()
            .filter(|x| x.occurrence.timestamp() > instant + 1)
            .count()
            >= 3
    });
    c.stop_all();
    let report = c.report();
    let lines = check_exactly_once(&c.lines(), &report);
    let at = lines
        .iter()
        .find(|l| l.occurrence.timestamp() == instant)
        .unwrap_or_else(|| panic!("no run of the stopped instant\n{report}"));
    assert_ne!(
        at.node, holder,
        "a holder stopped past its head start keeps nothing\n{report}"
    );
    assert!(
        at.lateness() < MARGIN / 2.0,
        "taken after the head start, not the margin: {:.3}s\n{report}",
        at.lateness()
    );
    eprintln!(
        "{backend:?}: the stopped holder's instant ran on {} {:.3}s late",
        at.node,
        at.lateness()
    );
}

crate::per_store!(all; failover);
// Store-independent but for the head start the store's rule grants (and
// Redis's Lua copy of it): one smoke case in the default tier, every store
// in the long tier. Twin on paused time:
// `inprocess::a_cut_off_idle_holder_is_taken_over_after_the_head_start`.
mod idle_holder {
    use super::delayed_idle_holder;
    crate::per_store!(
        [redis] long [sqlite, mysql, postgres, sentinel, redlock, zookeeper, etcd];
        delayed_idle_holder
    );
}

/// Two live daemons under one node name (a copied config): each warns once
/// about the other, and `nodes` says so.
#[test]
fn two_daemons_with_one_node_name_are_warned_about() {
    let mut c = Cluster::new(Backend::Sqlite, None, "");
    let n2 = c.config("n2");
    let text = std::fs::read_to_string(&n2).unwrap();
    std::fs::write(&n2, text.replace("node = \"n2\"", "node = \"n1\"")).unwrap();
    c.start("n1");
    c.start("n2");
    let warning = "another live daemon uses this node's name";
    crate::support::wait_until(
        "both daemons warned",
        Duration::from_secs(30),
        || c.report(),
        || (c.log("n1").contains(warning) && c.log("n2").contains(warning)).then_some(()),
    );
    let listed = c.cli("n1", &["nodes"]);
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(
        text.contains("WARNING: 2 live daemons use the node name n1"),
        "{text}\n{}",
        c.report()
    );
    // Once, not at every heartbeat.
    std::thread::sleep(Duration::from_secs(2));
    for node in ["n1", "n2"] {
        assert_eq!(c.log(node).matches(warning).count(), 1, "{}", c.report());
    }
    c.stop_all();
}

/// One job name, two definitions (a config rollout half done): each node
/// warns once naming the job and the other node, `status` names the job,
/// `nodes` says the sets differ, `/metrics` counts it; once the
/// definitions agree again (a reload) `status` and the metric clear, and a
/// job both define alike is never named.
#[test]
fn one_job_defined_two_ways_is_warned_about_until_the_definitions_agree() {
    let mut c = Cluster::new(Backend::Sqlite, None, "");
    let port = crate::support::free_port();
    let job = |every: u32| {
        format!("[[job]]\nname = \"x\"\nschedule = \"*/{every} * * * * *\"\ncommand = \"true\"\n")
    };
    for (node, every, extra) in [
        (
            "n1",
            4,
            format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"),
        ),
        ("n2", 6, String::new()),
    ] {
        let path = c.config(node);
        let mut cfg = std::fs::read_to_string(&path).unwrap();
        cfg.push_str(&extra);
        cfg.push_str(&job(every));
        std::fs::write(&path, cfg).unwrap();
    }
    c.start("n1");
    c.start("n2");
    let warning = "job defined otherwise on another live node";
    crate::support::wait_until(
        "both daemons warned",
        Duration::from_secs(30),
        || c.report(),
        || (c.log("n1").contains(warning) && c.log("n2").contains(warning)).then_some(()),
    );
    let defined_otherwise = |c: &Cluster| -> Vec<(String, Vec<String>)> {
        let rows = c.cli_json("n1", &["status"]).unwrap();
        let mut out: Vec<(String, Vec<String>)> = rows
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let mut on: Vec<String> = r["defined_otherwise_on"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|n| n.as_str().unwrap().to_string())
                    .collect();
                on.sort();
                (r["job"].as_str().unwrap().to_string(), on)
            })
            .collect();
        out.sort();
        out
    };
    let metric = || -> Option<f64> {
        let (_, metrics) = crate::service::http_get(port, "/metrics");
        metrics
            .lines()
            .find(|l| l.starts_with("cronlease_jobs_defined_otherwise "))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    // A beat or two after the warnings, both records list the job.
    crate::support::wait_until(
        "status names x on both nodes",
        Duration::from_secs(10),
        || c.report(),
        || {
            (defined_otherwise(&c)
                == vec![
                    ("tick".to_string(), vec![]),
                    ("x".to_string(), vec!["n1".to_string(), "n2".to_string()]),
                ])
            .then_some(())
        },
    );
    assert_eq!(metric(), Some(1.0), "{}", c.report());
    let nodes = c.cli("n1", &["nodes"]);
    let text = String::from_utf8_lossy(&nodes.stdout);
    assert!(
        text.contains("WARNING: the live nodes run 2 different sets of job definitions")
            && text.contains("(1 differ)"),
        "{text}"
    );
    for node in ["n1", "n2"] {
        let log = c.log(node);
        let warned: Vec<&str> = log.lines().filter(|l| l.contains(warning)).collect();
        assert_eq!(warned.len(), 1, "{}", c.report());
        let other = if node == "n1" { "n2" } else { "n1" };
        assert!(
            warned[0].contains("job=x") && warned[0].contains(&format!("other_node={other}")),
            "{}",
            warned[0]
        );
    }
    // n2 gets n1's definition: the difference ends.
    let path = c.config("n2");
    let cfg = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, cfg.replace("*/6 * * * * *", "*/4 * * * * *")).unwrap();
    c.signal("n2", Signal::SIGHUP);
    crate::support::wait_until(
        "the difference cleared",
        Duration::from_secs(15),
        || c.report(),
        || {
            (defined_otherwise(&c).iter().all(|(_, on)| on.is_empty()) && metric() == Some(0.0))
                .then_some(())
        },
    );
    let nodes = c.cli("n1", &["nodes"]);
    let text = String::from_utf8_lossy(&nodes.stdout);
    assert!(!text.contains("different sets"), "{text}");
    c.stop_all();
}

/// A daemon starting while another process writes to a fresh SQLite file
/// (still in rollback mode, its lock held 1.5 s: another daemon's first
/// migration, or any writer) waits for the lock: no ERROR and no "database
/// is locked" in its log, and it runs its job once the lock is free. Its
/// pool's background connection used to fail at once (no busy handler while
/// switching the file to WAL) and sqlx logged `error returned from
/// after_connect … database is locked` at ERROR; the migration gave up
/// after a second and the node logged the store unavailable.
#[test]
fn a_daemon_starting_beside_a_writer_on_a_fresh_sqlite_file_waits_without_an_error() {
    use sqlx::Connection;
    let mut c = Cluster::new(Backend::Sqlite, None, "");
    let db = c.dir.path().join("locks.db");
    let rt = tokio::runtime::Runtime::new().unwrap();
    sqlx::any::install_default_drivers();
    let mut writer = rt
        .block_on(sqlx::AnyConnection::connect(&format!(
            "sqlite://{}?mode=rwc",
            db.display()
        )))
        .unwrap();
    rt.block_on(
        sqlx::raw_sql(
            "CREATE TABLE other_app (x INTEGER); BEGIN EXCLUSIVE; INSERT INTO other_app VALUES (1)",
        )
        .execute(&mut writer),
    )
    .unwrap();
    c.start("n1");
    std::thread::sleep(Duration::from_millis(1500));
    rt.block_on(sqlx::raw_sql("COMMIT").execute(&mut writer))
        .unwrap();
    c.wait_for("two runs", Duration::from_secs(20), |l| l.len() >= 2);
    c.stop_all();
    let log = c.log("n1");
    for bad in [" ERROR ", "database is locked", "store unavailable"] {
        assert!(!log.contains(bad), "{bad:?} in the log:\n{log}");
    }
}

/// What a test's current thread logs, as text.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A new pooled connection waits for the database's lock while it sets the
/// file up (busy handler, WAL), instead of failing at once: sqlx then
/// logged `error returned from after_connect … database is locked` at
/// ERROR and tried again. That is what a daemon starting beside others on
/// one file met when another process held the lock (its WAL switch or
/// recovery) just as its pool opened a connection.
#[test]
fn a_new_sqlite_connection_waits_for_the_lock_without_an_error() {
    use cronlease::config::{StoreConfig, StoreUrl};
    use sqlx::Connection;
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _local = tracing::subscriber::set_default(subscriber);
    // One thread: every task logs through this thread's subscriber.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("locks.db");
    let config = StoreConfig::new(
        StoreUrl::parse(&format!("sqlite://{}", db.display()), dir.path()).unwrap(),
    );
    rt.block_on(async {
        // Another process writes to the file (fresh, so still in rollback
        // mode) for half a second.
        sqlx::any::install_default_drivers();
        let mut other =
            sqlx::AnyConnection::connect(&format!("sqlite://{}?mode=rwc", db.display()))
                .await
                .unwrap();
        sqlx::raw_sql(
            "CREATE TABLE other_app (x INTEGER); BEGIN EXCLUSIVE; INSERT INTO other_app VALUES (1)",
        )
        .execute(&mut other)
        .await
        .unwrap();
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            sqlx::raw_sql("COMMIT").execute(&mut other).await.unwrap();
            other.close().await.unwrap();
        });
        // A daemon starting now: its first connection meets the lock.
        let starting = cronlease::store::connect(&config).await.unwrap();
        let answered = starting.ping().await;
        release.await.unwrap();
        assert!(answered.is_ok(), "{answered:?}");
    });
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        !text.contains("after_connect") && !text.contains("ERROR"),
        "{text}"
    );
}

/// `[node] tags` and `run_on` with real daemons: the job tagged `a` runs
/// only on n1 (the one node with that tag) although n2 started first and
/// would otherwise hold it; `nodes` lists each node's tags, `status` each
/// job's eligible live nodes, and a job no live node may run is named in
/// `status` and warned about in the daemons' logs, never run.
#[test]
fn a_job_runs_only_on_the_node_with_its_tags_and_an_unrunnable_one_is_named() {
    let jobs = format!(
        "{}run_on = [\"a\"]\n[[job]]\nname = \"gpu\"\nschedule = \"* * * * * *\"\nrun_on = [\"gpu\"]\ncommand = [\"/bin/sh\", \"-c\", \"touch '{{out}}.gpu'\"]\n",
        crate::cluster::tick_job(std::path::Path::new("{out}"))
    );
    let mut c = Cluster::new(Backend::Sqlite, Some(&jobs), "");
    for (node, tags) in [("n1", "[\"a\", \"ssd\"]"), ("n2", "[\"b\"]")] {
        let path = c.config(node);
        let text = std::fs::read_to_string(&path).unwrap();
        let text = text.replace(&format!("node = \"{node}\"\n"), "");
        std::fs::write(
            &path,
            format!("{text}[node]\nname = \"{node}\"\ntags = {tags}\n"),
        )
        .unwrap();
    }
    c.start("n2");
    std::thread::sleep(Duration::from_secs(2));
    c.start("n1");
    c.wait_for("three runs of tick", Duration::from_secs(30), |l| {
        l.len() >= 3
    });
    let warning = "no live node has every tag these jobs' run_on asks for";
    crate::support::wait_until(
        "both daemons warned about gpu",
        Duration::from_secs(10),
        || c.report(),
        || (c.log("n1").contains(warning) && c.log("n2").contains(warning)).then_some(()),
    );
    let nodes = c.cli_json("n1", &["nodes"]).unwrap();
    let tags: Vec<(String, String)> = nodes
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["node"].to_string(), n["tags"].to_string()))
        .collect();
    assert_eq!(
        tags,
        [
            ("\"n1\"".to_string(), "[\"a\",\"ssd\"]".to_string()),
            ("\"n2\"".to_string(), "[\"b\"]".to_string())
        ]
    );
    let table = String::from_utf8_lossy(&c.cli("n1", &["nodes"]).stdout).into_owned();
    assert!(
        table.starts_with("NODE") && table.contains("TAGS") && table.contains("a,ssd"),
        "{table}"
    );
    let status = c.cli_json("n2", &["status"]).unwrap();
    let rows: Vec<(String, String, String)> = status
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["job"].to_string(),
                r["run_on"].to_string(),
                r["eligible_nodes"].to_string(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("\"gpu\"".into(), "[\"gpu\"]".into(), "[]".into()),
            ("\"tick\"".into(), "[\"a\"]".into(), "[\"n1\"]".into())
        ]
    );
    let text = String::from_utf8_lossy(&c.cli("n2", &["status"]).stdout).into_owned();
    assert!(
        text.contains("a: n1")
            && text.contains("gpu: NO LIVE NODE")
            && text.contains("NO ELIGIBLE NODE: gpu (run_on gpu)"),
        "{text}"
    );
    let asked = c.cli("n2", &["trigger", "gpu"]);
    let said = String::from_utf8_lossy(&asked.stderr);
    assert!(
        asked.status.success()
            && said.contains("warning: no live node has every tag of gpu's run_on (gpu)"),
        "{said}"
    );
    c.stop_all();
    let lines = c.lines();
    assert!(
        lines.iter().all(|l| l.node == "n1"),
        "tick ran only on n1: {lines:?}"
    );
    crate::cluster::check_exactly_once(&lines, &c.report());
    assert!(
        !std::path::Path::new(&format!("{}.gpu", c.out.display())).exists(),
        "gpu ran somewhere"
    );
}
