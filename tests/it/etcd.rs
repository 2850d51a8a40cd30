//! etcd with real processes:
//! - a lease is rounded up to whole seconds (at least 2) for its etcd lease;
//! - a 3-member cluster of the test's own on loopback ports: with one
//!   member killed (SIGKILL, the leader when it can be told), claims go on
//!   on the other two, every occurrence once, fences in order.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use chrono::Utc;

use crate::cluster::{Cluster, Line, check_once_in_order};
use crate::support::{Backend, Harness, free_port, wait_until};

/// One member of a cluster of the test's own.
pub(crate) struct Member {
    name: String,
    /// The uid it runs as (root unless a partition test asks).
    pub(crate) uid: Option<u32>,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

/// Three members on free loopback ports, in one temporary directory.
pub(crate) struct EtcdCluster {
    dir: tempfile::TempDir,
    pub(crate) members: Vec<Member>,
}

impl EtcdCluster {
    pub(crate) fn start() -> EtcdCluster {
        EtcdCluster::start_as(None)
    }

    /// Starts the members as the given uids (one each), so a firewall can
    /// tell their packets apart.
    pub(crate) fn start_as(uids: Option<[u32; 3]>) -> EtcdCluster {
        assert!(
            std::path::Path::new("/usr/bin/etcd").exists(),
            "etcd is not installed: bash .ci/services installs it (Debian package etcd-server)"
        );
        let dir = tempfile::tempdir().unwrap();
        if uids.is_some() {
            std::fs::set_permissions(
                dir.path(),
                std::os::unix::fs::PermissionsExt::from_mode(0o777),
            )
            .unwrap();
        }
        let members: Vec<Member> = (1..=3)
            .map(|i| Member {
                name: format!("m{i}"),
                uid: uids.map(|u| u[i - 1]),
                client: free_port(),
                peer: free_port(),
                child: None,
            })
            .collect();
        let mut c = EtcdCluster { dir, members };
        for i in 0..3 {
            c.spawn(i);
        }
        let url = c.url();
        wait_until(
            "the etcd cluster healthy",
            Duration::from_secs(60),
            || url.clone(),
            || c.healthy().then_some(()),
        );
        c
    }

    fn initial_cluster(&self) -> String {
        let peers: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect();
        peers.join(",")
    }

    fn spawn(&mut self, i: usize) {
        let initial = self.initial_cluster();
        let m = &self.members[i];
        let data = self.dir.path().join(&m.name);
        let log = std::fs::File::create(self.dir.path().join(format!("{}.log", m.name))).unwrap();
        let mut command = Command::new("etcd");
        command.current_dir(self.dir.path());
        if let Some(uid) = m.uid {
            std::os::unix::process::CommandExt::uid(&mut command, uid);
            std::os::unix::process::CommandExt::gid(&mut command, uid);
        }
        let child = command
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(&data)
            .args([
                "--listen-client-urls",
                &format!("http://127.0.0.1:{}", m.client),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{}", m.client),
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{}", m.peer),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{}", m.peer),
                "--initial-cluster",
                &initial,
                "--initial-cluster-state",
                "new",
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
                "--logger",
                "zap",
                "--log-outputs",
                "stderr",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd starts");
        self.members[i].child = Some(child);
    }

    pub(crate) fn url(&self) -> String {
        self.url_from(0)
    }

    /// The URL listing the members from `first` on (a client talks to the
    /// first one it can).
    pub(crate) fn url_from(&self, first: usize) -> String {
        let n = self.members.len();
        let hosts: Vec<String> = (0..n)
            .map(|i| format!("127.0.0.1:{}", self.members[(first + i) % n].client))
            .collect();
        format!("etcd://{}", hosts.join(","))
    }

    fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .filter(|m| m.child.is_some())
            .map(|m| format!("http://127.0.0.1:{}", m.client))
            .collect()
    }

    /// Every running member answers and a leader is elected.
    pub(crate) fn healthy(&self) -> bool {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            for e in self.endpoints() {
                let Ok(Ok(mut c)) = tokio::time::timeout(
                    Duration::from_secs(1),
                    etcd_client::Client::connect([e], None),
                )
                .await
                else {
                    return false;
                };
                match tokio::time::timeout(Duration::from_secs(1), c.status()).await {
                    Ok(Ok(s)) if s.leader() != 0 => {}
                    _ => return false,
                }
            }
            true
        })
    }

    /// The index of the leader, as the first running member sees it.
    pub(crate) fn leader(&self) -> Option<usize> {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            for (i, m) in self.members.iter().enumerate() {
                let e = format!("http://127.0.0.1:{}", m.client);
                let Ok(mut c) = etcd_client::Client::connect([e], None).await else {
                    continue;
                };
                let Ok(s) = c.status().await else { continue };
                if s.leader() == s.header().map_or(0, |h| h.member_id()) {
                    return Some(i);
                }
            }
            None
        })
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

#[test]
fn a_stopped_member_keeps_claims_working() {
    let mut etcd = EtcdCluster::start();
    let mut c = Cluster::with_url(Backend::Etcd, Some(&etcd.url()), None, "");
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    c.wait_for("three runs", Duration::from_secs(30), |l| l.len() >= 3);
    let victim = etcd.leader().unwrap_or(0);
    etcd.kill(victim);
    let stopped = Utc::now();
    c.wait_for(
        "five runs after a member stopped",
        Duration::from_secs(30),
        |l| l.iter().filter(|x| x.occurrence > stopped).count() >= 5,
    );
    c.stop_all();
    let report = c.report();
    let lines: Vec<Line> = check_once_in_order(&c.lines(), &report);
    let after: Vec<i64> = lines
        .iter()
        .filter(|l| l.occurrence > stopped + chrono::TimeDelta::seconds(2))
        .map(|l| l.occurrence.timestamp())
        .collect();
    assert!(
        after.windows(2).all(|w| w[1] == w[0] + 1),
        "an occurrence was missed with two members of three: {after:?}\n{report}"
    );
    eprintln!(
        "etcd: member {} (leader: {}) killed; {} runs after, none missed",
        etcd.members[victim].name,
        etcd.leader().is_none(),
        after.len()
    );
}

/// The etcd lease a job's lease key is attached to, as etcd granted it.
async fn granted_ttl(h: &Harness, job: &str) -> i64 {
    let mut etcd = h.etcd().await;
    let key = format!("{}lease/{job}", h.config.key_prefix);
    let got = etcd.get(key.as_str(), None).await.unwrap();
    let lease = got.kvs()[0].lease();
    etcd.lease_time_to_live(lease, None)
        .await
        .unwrap()
        .granted_ttl()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_rounded_up_to_whole_seconds_for_its_etcd_lease() {
    use cronlease::store::{ClaimOutcome, ClaimRequest, Owner};
    let h = Harness::new(Backend::Etcd).await;
    let store = h.store().await;
    let now = Utc::now();
    let mut expected = Vec::new();
    for (i, ms) in [100u64, 1_500, 2_000, 2_001, 61_000]
        .into_iter()
        .enumerate()
    {
        let job = format!("r{i}");
        let req = ClaimRequest {
            job: cronlease::config::JobName::parse(&job).unwrap(),
            occurrence: now,
            previous: None,
            misfire: cronlease::config::Misfire::RunOnce,
            owner: Owner::from_raw("a#1"),
            lease: Duration::from_millis(ms),
            fence_floor: 0,
            max_offset: Duration::from_secs(1),
            head_start: None,
            after_unanswered: false,
            recheck_only: false,
            window_end: None,
            manual: None,
            redeliver: false,
            before_previous: None,
        };
        let claimed = store.claim(&[req]).await.unwrap();
        assert!(matches!(claimed.outcomes[0], ClaimOutcome::Won(_)));
        expected.push((ms, granted_ttl(&h, &job).await));
    }
    assert_eq!(
        expected,
        [(100, 2), (1_500, 2), (2_000, 2), (2_001, 3), (61_000, 61)],
        "(lease ms, etcd lease TTL s)"
    );
    // A renewal rounds the same way (r4's lease of 61 s is still live
    // however loaded the machine; r0's 100 ms once was not).
    let renewed = store
        .renew(
            &cronlease::config::JobName::parse("r4").unwrap(),
            &Owner::from_raw("a#1"),
            Duration::from_millis(4_500),
        )
        .await
        .unwrap();
    assert!(renewed);
    assert_eq!(granted_ttl(&h, "r4").await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimer_waiting_out_a_lease_is_woken_when_its_key_is_deleted() {
    use cronlease::config::JobName;
    use cronlease::store::{ClaimOutcome, ClaimRequest, Owner};
    let h = Harness::new(Backend::Etcd).await;
    let (a, b) = (h.store().await, h.store().await);
    let req = |owner: &str| ClaimRequest {
        job: JobName::parse("w").unwrap(),
        occurrence: Utc::now(),
        previous: None,
        misfire: cronlease::config::Misfire::RunOnce,
        owner: Owner::from_raw(owner),
        lease: Duration::from_secs(30),
        fence_floor: 0,
        max_offset: Duration::from_secs(1),
        head_start: None,
        after_unanswered: false,
        recheck_only: false,
        window_end: None,
        manual: None,
        redeliver: false,
        before_previous: None,
    };
    let won = a.claim(&[req("a#1")]).await.unwrap();
    assert!(matches!(won.outcomes[0], ClaimOutcome::Won(_)));
    let lost = b.claim(&[req("b#1")]).await.unwrap();
    let ClaimOutcome::Lost(l) = &lost.outcomes[0] else {
        panic!("{lost:?}");
    };
    assert!(l.remaining > Duration::from_secs(25), "{l:?}");
    let job = JobName::parse("w").unwrap();
    let waiting = {
        let b = b.clone();
        let job = job.clone();
        tokio::spawn(async move { b.lease_freed(&job).await })
    };
    // A renewal (a put) wakes nobody.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        a.renew(&job, &Owner::from_raw("a#1"), Duration::from_secs(30))
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "woken by a renewal");
    // The release deletes the key: the waiter is woken, 29 s early.
    assert_eq!(a.release(&[job], &Owner::from_raw("a#1")).await.unwrap(), 1);
    tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("woken by the release, long before the lease's end")
        .unwrap();
}

/// `status` (what `cronlease status`, `drill` and the dashboard read) of
/// more locks than gRPC's 4 MiB answer holds: 16,000 held jobs with long
/// names are about 6 MB of keys and records, read in pages at one
/// revision. One range read answered "decoded message length too large".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reads_more_locks_than_one_grpc_answer_holds() {
    use cronlease::config::{JobName, Misfire};
    use cronlease::store::{ClaimOutcome, ClaimRequest, Owner};
    let h = Harness::new(Backend::Etcd).await;
    let a = h.store().await;
    const JOBS: usize = 16_000;
    let pad = "x".repeat(120);
    let requests: Vec<ClaimRequest> = (0..JOBS)
        .map(|i| ClaimRequest {
            job: JobName::parse(&format!("{pad}-{i:05}")).unwrap(),
            occurrence: Utc::now(),
            previous: None,
            misfire: Misfire::Skip,
            owner: Owner::from_raw(format!("node-{pad}#1")),
            lease: Duration::from_secs(300),
            fence_floor: 0,
            max_offset: Duration::from_secs(5),
            head_start: None,
            after_unanswered: false,
            recheck_only: false,
            window_end: None,
            manual: None,
            redeliver: false,
            before_previous: None,
        })
        .collect();
    for chunk in requests.chunks(2_000) {
        let claimed = a.claim(chunk).await.unwrap();
        assert!(
            claimed
                .outcomes
                .iter()
                .all(|o| matches!(o, ClaimOutcome::Won(_)))
        );
    }
    let locks = a.status().await.unwrap();
    assert_eq!(locks.len(), JOBS);
    let mut jobs: Vec<&str> = locks.iter().map(|l| l.job.as_str()).collect();
    jobs.dedup();
    assert_eq!(jobs.len(), JOBS, "each lock once, in name order");
    assert!(
        locks
            .iter()
            .all(|l| l.holder.as_deref() == Some(&format!("node-{pad}#1")[..]) && l.fence == 1)
    );
}
