//! A store that is down at start or goes away mid-run: the daemon keeps
//! running, claims nothing, logs once per state change and recovers by itself.
//! The tests run their own Redis server so they can stop it.

use std::time::Duration;

use crate::cluster::{Cluster, Line};
use crate::support::{Backend, RedisServer};

/// Runs two nodes through a store down at start, up, down (SIGKILL) for 3 s,
/// and up again; returns the cluster and the number of runs before the outage.
fn through_outages(redis: &mut RedisServer) -> (Cluster, usize) {
    let mut c = Cluster::with_url(Backend::Redis, Some(&redis.url()), None, "");
    c.start("n1");
    c.start("n2");
    std::thread::sleep(Duration::from_secs(3));
    assert!(c.lines().is_empty(), "nothing runs without a store");
    assert!(
        c.is_running("n1") && c.is_running("n2"),
        "an unreachable store is not fatal"
    );
    redis.start();
    c.wait_for("runs once the store is up", Duration::from_secs(15), |l| {
        l.len() >= 3
    });
    redis.stop();
    let before = c.lines().len();
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        c.lines().len() <= before + 1,
        "no claims while the store is down\n{}",
        c.report()
    );
    redis.start();
    c.wait_for(
        "runs after the store came back",
        Duration::from_secs(15),
        |l| l.len() >= before + 3,
    );
    c.stop_all();
    for node in ["n1", "n2"] {
        let log = c.log(node);
        assert_eq!(
            log.matches("store unavailable").count(),
            2,
            "{node}: one warning per outage, not one per tick\n{log}"
        );
        assert_eq!(
            log.matches("store reachable again").count(),
            2,
            "{node}: one line each time it comes back\n{log}"
        );
    }
    (c, before)
}

fn sorted(c: &Cluster) -> Vec<Line> {
    let mut lines = c.lines();
    lines.sort_by_key(|l| l.occurrence);
    lines
}

#[test]
fn persistent_redis_down_at_start_and_mid_run() {
    let mut redis = RedisServer::new(true);
    let (c, _) = through_outages(&mut redis);
    let report = c.report();
    let lines = sorted(&c);
    for w in lines.windows(2) {
        assert_ne!(w[0].occurrence, w[1].occurrence, "ran twice\n{report}");
        assert!(
            w[0].fence < w[1].fence,
            "fence not increasing: {:?} {:?}\n{report}",
            w[0],
            w[1]
        );
    }
    // The occurrence due when the store came back was caught up (run_once):
    // at most the 3 s of outage minus one catch-up are missing.
    let gaps: i64 = lines
        .windows(2)
        .map(|w| (w[1].occurrence - w[0].occurrence).num_seconds() - 1)
        .sum();
    assert!(
        gaps <= 3,
        "{gaps} occurrences missing around a 3 s outage\n{report}"
    );
    assert!(
        !c.log("n1").contains("persistence"),
        "no warning for an AOF-always Redis"
    );
}

#[test]
fn redis_that_loses_its_data() {
    let mut redis = RedisServer::new(false);
    let (c, _) = through_outages(&mut redis);
    let report = c.report();
    let lines = sorted(&c);
    for w in lines.windows(2) {
        assert_ne!(w[0].occurrence, w[1].occurrence, "ran twice\n{report}");
    }
    // The store forgot its fences; each node's fence floor still keeps its
    // own fences increasing (docs/protocol.md: across nodes that needs a store
    // that keeps what it acknowledged, and cronlease says so, once).
    for node in ["n1", "n2"] {
        let fences: Vec<u64> = lines
            .iter()
            .filter(|l| l.node == node)
            .map(|l| l.fence)
            .collect();
        assert!(
            fences.windows(2).all(|w| w[0] < w[1]),
            "{node}: {fences:?}\n{report}"
        );
        let warnings = c.log(node).matches("has no AOF persistence").count();
        assert_eq!(
            warnings, 1,
            "{node}: warned once about persistence\n{report}"
        );
    }
}

/// The lock table dropped under a running daemon (a restore gone wrong, a
/// hand edit): it migrates again and carries on, logging one WARN when the
/// problem starts and one INFO, with how long it lasted, when it ends.
#[test]
fn a_dropped_lock_table_heals_with_one_warning() {
    let mut c = Cluster::new(Backend::Sqlite, None, "");
    c.start("n1");
    c.wait_for("runs", Duration::from_secs(15), |l| l.len() >= 2);
    let config = cronlease::config::load(&c.config("n1"), &Default::default()).unwrap();
    let prefix = config.store.table_prefix.clone();
    let h = crate::support::Harness::for_config(config.store);
    let before = c.lines().len();
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(h.raw_sql(&format!("DROP TABLE {prefix}lock_info")));
    c.wait_for(
        "runs after the table was dropped",
        Duration::from_secs(15),
        |l| l.len() >= before + 4,
    );
    std::thread::sleep(Duration::from_secs(2));
    c.stop_all();
    let log = c.log("n1");
    assert_eq!(log.matches("store unavailable").count(), 1, "{log}");
    assert_eq!(
        log.matches("store reachable again after").count(),
        1,
        "{log}"
    );
}

/// The SQLite file deleted under running nodes (a clean-up script, tmpfiles)
/// while a new node starts on a fresh file: the running nodes notice at
/// their next claim, say so, and move to the file now at the path, so no
/// occurrence runs twice (before, they kept claiming in the unlinked copy).
#[test]
fn a_deleted_sqlite_file_is_noticed_and_nothing_runs_twice() {
    let mut c = Cluster::new(Backend::Sqlite, None, "");
    c.start("n1");
    c.start("n2");
    c.wait_for("runs", Duration::from_secs(15), |l| l.len() >= 3);
    // Between two instants: deleted right after the holder claimed one and
    // before its peer had asked, the new file would let the peer claim that
    // occurrence again (the store lost its data; docs/protocol.md, Limits).
    crate::cluster::at_fraction_of_second(0.5);
    let db = c.dir.path().join("locks.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
    }
    c.start("n3");
    let before = c.lines().len();
    c.wait_for("runs after the deletion", Duration::from_secs(20), |l| {
        l.len() >= before + 6
    });
    c.stop_all();
    let report = c.report();
    let mut lines = c.lines();
    lines.sort_by_key(|l| l.occurrence);
    for w in lines.windows(2) {
        assert_ne!(
            w[0].occurrence, w[1].occurrence,
            "occurrence ran twice: {:?} {:?}\n{report}",
            w[0], w[1]
        );
    }
    assert!(
        ["n1", "n2"]
            .iter()
            .any(|n| c.log(n).contains("was deleted or replaced under this node")),
        "{report}"
    );
}

/// A node stopped while its store is down says once, and truly, what became
/// of its leases: not released, left to expire (before: "could not release
/// leases" and then "leases released; stopped released=0"). Stopped with
/// the store up, it says they were released.
#[test]
fn a_shutdown_while_the_store_is_down_says_once_that_leases_were_not_released() {
    let mut redis = RedisServer::new(false);
    redis.start();
    let mut c = Cluster::with_url(Backend::Redis, Some(&redis.url()), None, "");
    c.start("n1");
    c.start("n2");
    c.wait_for("runs", Duration::from_secs(15), |l| l.len() >= 3);
    c.signal("n2", nix::sys::signal::Signal::SIGTERM);
    c.wait_exit("n2", Duration::from_secs(15));
    redis.stop();
    std::thread::sleep(Duration::from_millis(500));
    c.signal("n1", nix::sys::signal::Signal::SIGTERM);
    let status = c.wait_exit("n1", Duration::from_secs(30));
    assert!(status.is_some(), "n1 stopped\n{}", c.report());
    let down = c.log("n1");
    let lease_lines: Vec<&str> = down
        .lines()
        .filter(|l| l.contains("lease") && (l.contains("release") || l.contains("stopped")))
        .collect();
    assert_eq!(lease_lines.len(), 1, "one line about the leases\n{down}");
    assert!(
        lease_lines[0].contains("stopped without releasing every lease")
            && lease_lines[0].contains("WARN"),
        "{down}"
    );
    assert!(!down.contains("leases released"), "{down}");
    let up = c.log("n2");
    assert!(up.contains("leases released; stopped"), "{up}");
    assert!(!up.contains("without releasing"), "{up}");
}
