//! Redis through Sentinel: a failover right after a claim the master
//! acknowledged and no replica had. With `wait=1` the claim counted as failed
//! (no replica acknowledged it), so the occurrence runs once; with `wait=0`
//! the claim was acted on, the failover lost it, and the occurrence runs
//! twice: the hazard `wait` exists for.
//!
//! A failover the sentinels announce (`+switch-master`) moves a store to the
//! new master before its next call.
//!
//! Each test runs its own master, two replicas and three sentinels on free
//! ports, so it can stop and kill them.

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use chrono::{DateTime, Utc};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use cronlease::config::{JobName, Misfire, StoreConfig, StoreUrl};
use cronlease::store::{self, ClaimOutcome, ClaimRequest, Owner};

use crate::cluster::Cluster;
use crate::support::{Backend, free_port, unique, wait_until};

/// A master, two replicas and three sentinels watching it as `m`.
pub(crate) struct SentinelSet {
    _dir: tempfile::TempDir,
    master: Child,
    pub(crate) master_port: u16,
    replicas: Vec<Child>,
    sentinels: Vec<(u16, Child)>,
}

fn wait_port(port: u16) {
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    for _ in 0..200 {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("nothing answers on port {port}");
}

fn redis_server(dir: &Path, port: u16, master: Option<u16>) -> Child {
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .args(["--dbfilename", &format!("dump-{port}.rdb")]);
    if let Some(m) = master {
        cmd.args(["--replicaof", "127.0.0.1", &m.to_string()]);
    }
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server must be installed (Debian package redis-server)");
    wait_port(port);
    child
}

fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli must be installed (Debian package redis-tools)");
    String::from_utf8_lossy(&out.stdout).to_string()
}

impl SentinelSet {
    pub(crate) fn start() -> SentinelSet {
        let dir = tempfile::tempdir().unwrap();
        let mport = free_port();
        let master = redis_server(dir.path(), mport, None);
        let replicas: Vec<Child> = (0..2)
            .map(|_| redis_server(dir.path(), free_port(), Some(mport)))
            .collect();
        let sentinels = (0..3)
            .map(|i| {
                let port = free_port();
                let conf = dir.path().join(format!("sentinel-{i}.conf"));
                std::fs::write(
                    &conf,
                    format!(
                        "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor m 127.0.0.1 {mport} 2\nsentinel down-after-milliseconds m 500\nsentinel failover-timeout m 2000\n",
                        dir.path().display()
                    ),
                )
                .unwrap();
                let child = Command::new("redis-sentinel")
                    .arg(&conf)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("redis-sentinel must be installed (Debian package redis-sentinel)");
                wait_port(port);
                (port, child)
            })
            .collect();
        let set = SentinelSet {
            _dir: dir,
            master,
            master_port: mport,
            replicas,
            sentinels,
        };
        wait_until(
            "both replicas connected to the master",
            Duration::from_secs(20),
            || redis_cli(mport, &["info", "replication"]),
            || {
                redis_cli(mport, &["info", "replication"])
                    .contains("connected_slaves:2")
                    .then_some(())
            },
        );
        set
    }

    pub(crate) fn url(&self, wait: u32) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|(p, _)| format!("127.0.0.1:{p}"))
            .collect();
        format!(
            "redis+sentinel://{}/m?wait={wait}&wait_timeout=200ms",
            hosts.join(",")
        )
    }

    /// The master's port as the first sentinel names it now.
    pub(crate) fn named_master(&self) -> Option<u16> {
        let out = redis_cli(
            self.sentinels[0].0,
            &["sentinel", "get-master-addr-by-name", "m"],
        );
        out.lines().nth(1)?.trim().parse().ok()
    }

    fn replicas(&self, sig: Signal) {
        for r in &self.replicas {
            kill(Pid::from_raw(r.id() as i32), sig).unwrap();
        }
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        let _ = self.master.kill();
        for c in self.replicas.iter_mut() {
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGCONT);
            let _ = c.kill();
        }
        for (_, c) in self.sentinels.iter_mut() {
            let _ = c.kill();
        }
    }
}

/// Runs one node on a job due every five seconds, freezes both replicas just
/// before an occurrence, kills the master 400 ms after it, lets the
/// replicas go on and the sentinels fail over, then starts a second node.
/// Returns how many times each occurrence ran.
fn claim_lost_in_failover(wait: u32) -> (BTreeMap<DateTime<Utc>, usize>, DateTime<Utc>, String) {
    let mut set = SentinelSet::start();
    let old_master = set.named_master();
    let jobs = "[[job]]\nname = \"five\"\nschedule = \"*/5 * * * * *\"\ncommand = [\"/bin/sh\", \"-c\", \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N)\\\" >> '{out}'\"]\n";
    let mut c = Cluster::with_url(Backend::Sentinel, Some(&set.url(wait)), Some(jobs), "");
    c.start("n1");
    c.wait_for("a first run", Duration::from_secs(20), |l| !l.is_empty());
    // The next occurrence, with at least 1.5 s to go.
    let now = Utc::now().timestamp_millis();
    let mut next = (now / 5_000 + 1) * 5_000;
    if next - now < 1_500 {
        next += 5_000;
    }
    let at = |ms: i64| {
        let d = ms - Utc::now().timestamp_millis();
        if d > 0 {
            std::thread::sleep(Duration::from_millis(d as u64));
        }
    };
    // Frozen replicas still receive what the master sends (the kernel
    // buffers it): the master also drops their links, and frozen they
    // cannot reconnect, so what it acknowledges from now on is its alone.
    at(next - 300);
    set.replicas(Signal::SIGSTOP);
    let killed = redis_cli(set.master_port, &["client", "kill", "type", "replica"]);
    assert_eq!(
        killed.trim(),
        "2",
        "the master had two replica links: {killed}"
    );
    at(next + 400);
    set.master.kill().unwrap();
    let _ = set.master.wait();
    set.replicas(Signal::SIGCONT);
    wait_until(
        "the sentinels promote a replica",
        Duration::from_secs(20),
        || format!("master port now {:?}", set.named_master()),
        || set.named_master().filter(|p| Some(*p) != old_master),
    );
    c.start("n2");
    let target = DateTime::<Utc>::from_timestamp_millis(next).unwrap();
    c.wait_for(
        "two occurrences after the failover",
        Duration::from_secs(30),
        |l| l.iter().filter(|x| x.occurrence > target).count() >= 2,
    );
    c.stop_all();
    let mut ran = BTreeMap::new();
    for l in c.lines() {
        *ran.entry(l.occurrence).or_insert(0) += 1;
    }
    (ran, target, c.report())
}

#[test]
fn a_claim_no_replica_acknowledged_is_not_acted_on() {
    let (ran, target, report) = claim_lost_in_failover(1);
    assert!(
        ran.values().all(|n| *n == 1),
        "every occurrence once with wait=1: {ran:?}\n{report}"
    );
    assert_eq!(
        ran.get(&target),
        Some(&1),
        "the occurrence of the failover ran (late, once)\n{report}"
    );
}

#[test]
fn without_wait_a_failover_can_run_an_occurrence_twice() {
    let (ran, target, report) = claim_lost_in_failover(0);
    assert_eq!(
        ran.get(&target),
        Some(&2),
        "with wait=0 the claim the failover lost was run, and the occurrence ran again: the hazard wait=1 prevents\n{report}"
    );
}

/// After `SENTINEL FAILOVER` the old master is a replica: a store still
/// writing to it would get `READONLY` and fail one call. The store heard the
/// sentinels' `+switch-master` and its first call after goes to the new
/// master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_master_announcement_moves_the_store_before_its_next_call() {
    let set = tokio::task::spawn_blocking(SentinelSet::start)
        .await
        .unwrap();
    // wait=0: right after a failover the new master's replicas are still
    // syncing, and this test is about finding the master, not WAIT.
    let url = StoreUrl::parse(&set.url(0), Path::new("/")).unwrap();
    let mut config = StoreConfig::new(url);
    config.key_prefix = format!("cl:{}", unique("sw"));
    let store = store::connect(&config).await.unwrap();
    store.prepare().await.unwrap();
    let request = |second: i64| ClaimRequest {
        job: JobName::parse("moved").unwrap(),
        occurrence: chrono::Utc::now() - chrono::TimeDelta::seconds(60 - second),
        previous: None,
        misfire: Misfire::Skip,
        owner: Owner::from_raw("n1#00000001"),
        lease: Duration::from_secs(30),
        fence_floor: 0,
        max_offset: Duration::from_millis(500),
        head_start: None,
        after_unanswered: false,
        recheck_only: false,
        window_end: None,
        manual: None,
        redeliver: false,
        before_previous: None,
    };
    let first = store.claim(&[request(0)]).await.unwrap();
    assert!(
        matches!(first.outcomes[..], [ClaimOutcome::Won(_)]),
        "{first:?}"
    );

    let old = set.named_master();
    let said = redis_cli(set.sentinels[0].0, &["sentinel", "failover", "m"]);
    assert!(said.contains("OK"), "SENTINEL FAILOVER: {said}");
    let set = tokio::task::spawn_blocking(move || {
        wait_until(
            "the sentinels name a new master",
            Duration::from_secs(20),
            || format!("master port now {:?}", set.named_master()),
            || set.named_master().filter(|p| Some(*p) != old),
        );
        // The old master turns replica once the new one is named.
        wait_until(
            "the old master is a replica",
            Duration::from_secs(20),
            || redis_cli(old.unwrap(), &["role"]),
            || {
                redis_cli(old.unwrap(), &["role"])
                    .starts_with("slave")
                    .then_some(())
            },
        );
        set
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = store.claim(&[request(1)]).await;
    assert!(
        matches!(&after, Ok(c) if matches!(c.outcomes[..], [ClaimOutcome::Won(_)])),
        "the first claim after the failover goes to the new master: {after:?}"
    );
    drop(set);
}
