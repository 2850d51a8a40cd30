//! Redlock over five masters of the test's own, which it stops, freezes and
//! restarts empty (no persistence):
//! - two of five stopped, claims go on; three stopped, nothing is claimed
//!   or run; back, they count again once a lease length has passed;
//! - a master that came back empty counts in no quorum for one lease length:
//!   without that, a claimer that reaches only the restarted masters and one
//!   other wins an occurrence already won, with the same fence again;
//! - masters restarted empty one after another during a cluster's run: every
//!   occurrence runs once, fences in order;
//! - a split vote among the answering masters, two others frozen: decided
//!   within `op_timeout`, the job's last owner winning it.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use cronlease::config::{JobName, Misfire, StoreConfig};
use cronlease::store::redis::redlock::RedlockStore;
use cronlease::store::{ClaimOutcome, ClaimRequest, Locks, Owner};

use crate::cluster::{Cluster, Line, check_exactly_once, check_once_in_order};
use crate::support::{Backend, RedisServer, store_url, unique, wait_for_uptime};

/// Five masters, up long enough to count for a lease of `lease_secs`.
pub fn five_masters(lease_secs: u64) -> Vec<RedisServer> {
    let masters: Vec<RedisServer> = (0..5)
        .map(|_| {
            let mut m = RedisServer::new(false);
            m.start();
            m
        })
        .collect();
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    wait_for_uptime(&urls, lease_secs + 1);
    masters
}

fn urls(masters: &[RedisServer]) -> String {
    masters
        .iter()
        .map(RedisServer::url)
        .collect::<Vec<_>>()
        .join(",")
}

/// Kills the master and starts it again on its port, empty.
fn restart_empty(m: &mut RedisServer) {
    m.stop();
    m.start();
}

#[test]
fn a_majority_of_masters_claims_and_a_minority_claims_nothing() {
    // Leases of 2 s: a job every second, margin 1 s.
    let mut masters = five_masters(2);
    let mut c = Cluster::with_url(Backend::Redlock, Some(&urls(&masters)), None, "");
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    c.wait_for("three runs", Duration::from_secs(20), |l| l.len() >= 3);

    // Two of five stopped: the other three are a majority.
    masters[3].stop();
    masters[4].stop();
    let two_down = Utc::now();
    c.wait_for(
        "four runs with two masters stopped",
        Duration::from_secs(20),
        |l| l.iter().filter(|x| x.occurrence > two_down).count() >= 4,
    );

    // Three stopped: no majority, nothing is claimed or run.
    masters[2].stop();
    let three_down = Utc::now();
    std::thread::sleep(Duration::from_secs(4));
    let during: Vec<Line> = c
        .lines()
        .into_iter()
        .filter(|l| l.occurrence > three_down)
        .collect();
    let report = c.report();
    assert!(
        during.is_empty(),
        "ran with three of five masters stopped: {during:?}\n{report}"
    );

    // Back, empty: they count again a lease length (2 s) after the nodes
    // saw them come back.
    for m in &mut masters[2..] {
        m.start();
    }
    let back = Utc::now();
    c.wait_for(
        "three runs with the masters back",
        Duration::from_secs(20),
        |l| l.iter().filter(|x| x.occurrence > back).count() >= 3,
    );
    c.stop_all();
    let report = c.report();
    check_once_in_order(&c.lines(), &report);
    let logs: String = ["n1", "n2", "n3"].iter().map(|n| c.log(n)).collect();
    assert!(
        logs.contains("Redis master does not answer"),
        "a stopped master is logged\n{report}"
    );
}

/// The lease of the store-level claims below.
pub const LEASE_SECS: u64 = 6;

pub fn request(owner: &str, occurrence: DateTime<Utc>) -> ClaimRequest {
    ClaimRequest {
        job: JobName::parse("j").unwrap(),
        occurrence,
        previous: None,
        misfire: Misfire::RunOnce,
        owner: Owner::from_raw(owner),
        lease: Duration::from_secs(LEASE_SECS),
        fence_floor: 0,
        max_offset: Duration::from_millis(500),
        head_start: None,
        after_unanswered: false,
        recheck_only: false,
        window_end: None,
        manual: None,
        redeliver: false,
        before_previous: None,
    }
}

/// The current second, as an occurrence.
pub fn this_second() -> DateTime<Utc> {
    cronlease::store::from_ms(Utc::now().timestamp_millis() / 1000 * 1000)
}

/// `owner`'s claim of occurrence `t` of job `j`, which must be answered.
async fn claim_one(store: &Arc<dyn Locks>, owner: &str, t: DateTime<Utc>) -> ClaimOutcome {
    store
        .claim(&[request(owner, t)])
        .await
        .unwrap()
        .outcomes
        .remove(0)
}

/// Stops the masters' processes (SIGSTOP): they take no call and answer
/// none until [`thaw`].
fn freeze(masters: &[RedisServer]) -> Vec<Pid> {
    let frozen: Vec<Pid> = masters
        .iter()
        .map(|m| Pid::from_raw(m.pid().unwrap()))
        .collect();
    for p in &frozen {
        kill(*p, Signal::SIGSTOP).unwrap();
    }
    frozen
}

fn thaw(frozen: &[Pid]) {
    for p in frozen {
        kill(*p, Signal::SIGCONT).unwrap();
    }
}

/// Two nodes' stores over the same five masters; `quarantine` false turns
/// the restarted masters' quarantine off (test-only).
async fn two_stores(
    masters: &[RedisServer],
    quarantine: bool,
    op_timeout: Duration,
) -> [Arc<dyn Locks>; 2] {
    let mut config = StoreConfig::new(store_url(
        Backend::Redlock,
        &urls(masters),
        std::path::Path::new("/"),
    ));
    config.key_prefix = format!("cl:{}", unique("rl"));
    config.op_timeout = op_timeout;
    let open = || -> Arc<dyn Locks> {
        let store = RedlockStore::open(&config).unwrap();
        if quarantine {
            Arc::new(store)
        } else {
            Arc::new(store.without_quarantine())
        }
    };
    let stores = [open(), open()];
    for s in &stores {
        // Each learns every master's run_id.
        s.prepare().await.unwrap();
    }
    stores
}

/// Node a wins an occurrence while two masters are down, so its claim is on
/// a bare majority (m0, m1, m2). m2 restarts empty and the two come back
/// empty; m0 and m1 stop answering node b (frozen). Node b now reaches
/// three masters, all empty: a quorum by count.
async fn claim_after_restarts(
    quarantine: bool,
) -> (
    ClaimOutcome,
    Result<ClaimOutcome, String>,
    Result<ClaimOutcome, String>,
) {
    let mut masters = five_masters(LEASE_SECS);
    let [a, b] = two_stores(&masters, quarantine, Duration::from_millis(500)).await;
    masters[3].stop();
    masters[4].stop();
    let t = this_second();
    let first = claim_one(&a, "a#1", t).await;
    restart_empty(&mut masters[2]);
    masters[3].start();
    masters[4].start();
    let frozen = freeze(&masters[..2]);
    // As a node would, b tries again after an error (its first call to a
    // restarted master may find the old connection broken).
    let mut second = Err(String::new());
    for _ in 0..4 {
        second = b
            .claim(&[request("b#1", t)])
            .await
            .map(|mut c| c.outcomes.remove(0))
            .map_err(|e| e.to_string());
        if second.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A node started after the restarts never saw the old run_ids.
    let [late, _] = two_stores(&masters, quarantine, Duration::from_millis(500)).await;
    let third = late
        .claim(&[request("c#1", t)])
        .await
        .map(|mut c| c.outcomes.remove(0))
        .map_err(|e| e.to_string());
    thaw(&frozen);
    (first, second, third)
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_back_empty_counts_in_no_quorum_for_a_lease_length() {
    let (first, second, third) = claim_after_restarts(true).await;
    assert!(
        matches!(&first, ClaimOutcome::Won(w) if w.fence == 1),
        "{first:?}"
    );
    // b reached the three restarted masters, and none counted; nor for a
    // node that started after the restarts.
    for (who, claim) in [("b", &second), ("a node started later", &third)] {
        assert!(
            matches!(claim, Err(e) if e.contains("3 of 5 Redis masters answered and 0 of them count")),
            "{who}: the occurrence a won was won again through masters that came back empty, or they were not reached: {claim:?}"
        );
    }

    // Without the quarantine the same steps win the occurrence twice, with
    // the same fence: what keeping restarted masters out prevents.
    let (first, second, _) = claim_after_restarts(false).await;
    assert!(
        matches!(&first, ClaimOutcome::Won(w) if w.fence == 1),
        "{first:?}"
    );
    assert!(
        matches!(&second, Ok(ClaimOutcome::Won(w)) if w.fence == 1),
        "without the quarantine the hazard should show: {second:?}"
    );
}

#[test]
fn masters_restarted_empty_one_after_another_run_nothing_twice() {
    let mut masters = five_masters(2);
    let mut c = Cluster::with_url(Backend::Redlock, Some(&urls(&masters)), None, "");
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    c.wait_for("three runs", Duration::from_secs(20), |l| l.len() >= 3);
    // One restart every 1.3 s: at most two masters are kept out at once (a
    // lease is 2 s), so three still count and nothing is missed.
    let started = Utc::now();
    for i in [0, 1, 2, 3, 4, 0, 1] {
        restart_empty(&mut masters[i]);
        std::thread::sleep(Duration::from_millis(1_300));
    }
    c.wait_for(
        "three runs after the restarts",
        Duration::from_secs(20),
        |l| {
            l.iter()
                .filter(|x| x.occurrence > Utc::now() - chrono::TimeDelta::seconds(3))
                .count()
                >= 3
        },
    );
    c.stop_all();
    let report = c.report();
    let lines = check_exactly_once(&c.lines(), &report);
    assert!(
        lines.iter().filter(|l| l.occurrence > started).count() >= 8,
        "runs went on through the restarts\n{report}"
    );
    let logs: String = ["n1", "n2", "n3"].iter().map(|n| c.log(n)).collect();
    assert!(
        logs.contains("run_id changed"),
        "a restart is seen and logged\n{report}"
    );
}

/// An idle node's beat with its look for manual runs is one pipeline per
/// master, the registry script and `HGETALL` of the requests, without the
/// `INFO server` the other calls carry (a restart matters to the claims,
/// which read it in their own pipelines before they count an answer).
/// Counted by each master's own command statistics over ten beats; the
/// requests a majority holds are what it reads.
#[tokio::test]
async fn a_beat_that_looks_is_one_pipeline_per_master_without_info() {
    use cronlease::store::TriggerId;
    use cronlease::store::registry::{Heartbeat, Registry};
    let masters: Vec<RedisServer> = (0..3)
        .map(|_| {
            let mut m = RedisServer::new(false);
            m.start();
            m
        })
        .collect();
    let mut config = StoreConfig::new(store_url(
        Backend::Redlock,
        &urls(&masters),
        std::path::Path::new("/"),
    ));
    config.key_prefix = format!("cl:{}", unique("rl"));
    let store = RedlockStore::open(&config).unwrap();
    store.prepare().await.unwrap();
    let id = TriggerId::new();
    let job = JobName::parse("looked-for").unwrap();
    store.request_trigger(&job, id).await.unwrap();
    let beat = Heartbeat {
        owner: Owner::from_raw("n1~1"),
        node: "n1".into(),
        tags: Vec::new(),
        version: "test".into(),
        started_at: Utc::now(),
        clock_offset_ms: None,
        jobs_held: 0,
        ttl: Duration::from_secs(5),
        definitions: None,
        running: Vec::new(),
        progress: None,
    };
    let mut conns = Vec::new();
    for m in &masters {
        let client = redis::Client::open(m.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut conn)
            .await
            .unwrap();
        conns.push(conn);
    }
    for _ in 0..10 {
        let (nodes, pending) = store.heartbeat_looking(&beat).await.unwrap();
        assert_eq!(nodes.len(), 1, "{nodes:?}");
        assert_eq!(pending, Some(vec![("looked-for".to_string(), id)]));
    }
    for (m, conn) in masters.iter().zip(&mut conns) {
        let stats: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(conn)
            .await
            .unwrap();
        let calls = |name: &str| -> u64 {
            stats
                .lines()
                .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")))
                .and_then(|rest| rest.split(',').next())
                .map_or(0, |n| n.parse().unwrap())
        };
        // `hgetall`: the registry script reads the records with one
        // (commands a script calls count too), the look the requests.
        assert_eq!(
            (calls("info"), calls("evalsha"), calls("hgetall")),
            (0, 10, 20),
            "{}: {stats}",
            m.url()
        );
    }
}

/// A split vote among the masters that answer, while the two others never
/// do (frozen: as masters whose replies are lost): a, the job's last owner,
/// holds it on m2 (and the frozen m3, m4); its leases on m0 and m1 ended
/// (as on masters cut off for longer than a lease), and b takes them
/// first. Their answers could still be decided by the frozen masters.
///
/// b's claim is decided within the node's budget for it (`op_timeout`): it
/// stands back behind the last owner (an eighth to a quarter of
/// `op_timeout`, a's lease being longer), gives m0 and m1 back, and a's
/// claim then wins. Before, the call waited the whole `op_timeout` for the
/// frozen masters, round after round: the node gave up on every claim, and
/// nothing ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_vote_with_a_minority_silent_is_decided_within_op_timeout() {
    let masters = five_masters(LEASE_SECS);
    // The node's budget for a claim (2 s: room for a loaded machine).
    let budget = Duration::from_secs(2);
    let [a, b] = two_stores(&masters, true, budget).await;
    // Seconds past, so no claim is early by the masters' clocks.
    let t = this_second() - chrono::Duration::seconds(2);
    let first = claim_one(&a, "a#1", t).await;
    assert!(
        matches!(&first, ClaimOutcome::Won(w) if w.fence == 1),
        "{first:?}"
    );
    for m in &masters[..2] {
        let client = redis::Client::open(m.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*{j}:lease")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(keys.len(), 1, "{keys:?}");
        let _: () = redis::cmd("DEL")
            .arg(&keys)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let frozen = freeze(&masters[3..]);
    let next = t + chrono::Duration::seconds(1);
    let second = tokio::time::timeout(budget, b.claim(&[request("b#1", next)])).await;
    let third = tokio::time::timeout(budget, a.claim(&[request("a#1", next)])).await;
    thaw(&frozen);
    let second = second
        .expect("b's claim was not decided within op_timeout")
        .unwrap()
        .outcomes
        .remove(0);
    match &second {
        ClaimOutcome::Lost(lost) => {
            assert_eq!(lost.holder.as_deref(), Some("a#1"), "{second:?}");
            // Standing back (an eighth to a quarter of op_timeout: a's lease
            // is 6 s), not a short wait (≤ 21 ms) to split it again.
            assert!(
                lost.remaining >= budget / 8 && lost.remaining <= budget / 4,
                "{second:?}"
            );
        }
        other => panic!("b won with a's lease live on m2: {other:?}"),
    }
    let third = third
        .expect("a's claim was not decided within op_timeout")
        .unwrap()
        .outcomes
        .remove(0);
    assert!(
        matches!(&third, ClaimOutcome::Won(w) if w.fence == 2),
        "{third:?}"
    );
}
