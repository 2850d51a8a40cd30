//! The node in-process on paused time: the in-memory store, a wall clock
//! that follows tokio's, and a runner whose jobs take virtual time (a real
//! process cannot: tokio's paused clock jumps ahead while it runs). These
//! tests time the node's own logic exactly: one claim call per instant,
//! takeover, catch-up, renewal at a third left, the local-deadline kill,
//! step-down, a lost claim reply. Real processes and real stores are the
//! end-to-end tests' and drills' part.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use cronlease::config::{self, Config, Overrides};
use cronlease::exec::{Finished, RunSpec, Runner, StopReason};
use cronlease::guard::Guard;
use cronlease::node::{Node, NodeParts};
use cronlease::store::memory::MemoryStore;
use cronlease::store::{Outcome, Owner};
use cronlease::wallclock::TokioClock;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The first instant of every test: 12:00:00, half a second after start.
fn t(secs: f64) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 23, 12, 0, 0).unwrap()
        + chrono::TimeDelta::milliseconds((secs * 1000.0).round() as i64)
}

/// One run as the runner saw it.
#[derive(Debug, Clone)]
struct Run {
    node: String,
    job: String,
    fence: u64,
    occurrence: DateTime<Utc>,
    started: DateTime<Utc>,
    /// How it ended and when (None while running).
    ended: Option<(Outcome, DateTime<Utc>)>,
    /// Which try of its occurrence (`CRONLEASE_ATTEMPT`).
    attempt: u32,
    /// One of the job's hooks, not the job.
    hook: Option<config::Hook>,
    /// A broadcast job's shard: its index and the count.
    shard: Option<(u32, u32)>,
}

/// Jobs that take virtual time: `durations` per job (default: none).
#[derive(Default)]
struct VirtualRunner {
    durations: BTreeMap<String, Duration>,
    /// Runs of a job end `failed (1)` while their attempt is below this.
    fail_below: BTreeMap<String, u32>,
    runs: Mutex<Vec<Run>>,
}

impl VirtualRunner {
    /// Runs of `job` take `d`; every other job's take no time.
    fn lasting(job: &str, d: Duration) -> VirtualRunner {
        VirtualRunner {
            durations: [(job.to_string(), d)].into(),
            ..Default::default()
        }
    }
}

#[async_trait::async_trait]
impl Runner for VirtualRunner {
    async fn run<'a>(
        &'a self,
        spec: RunSpec<'a>,
        _guard: Option<&'a Guard>,
        stop: std::pin::Pin<Box<dyn std::future::Future<Output = StopReason> + Send + 'a>>,
    ) -> Finished {
        let started_at = spec.clock.now();
        let name = spec.job.name.to_string();
        let i = {
            let mut runs = self.runs.lock().unwrap();
            runs.push(Run {
                node: spec.node.to_string(),
                job: name.clone(),
                fence: spec.fence,
                occurrence: spec.occurrence,
                started: started_at,
                ended: None,
                attempt: cronlease::store::TriggerId::attempt(spec.trigger),
                hook: spec.hook,
                shard: spec
                    .trigger
                    .and_then(cronlease::store::TriggerId::shard_of)
                    .map(|(_, i, n)| (i, n)),
            });
            runs.len() - 1
        };
        let took = self.durations.get(&name).copied().unwrap_or_default();
        let fails = spec.hook.is_none()
            && self
                .fail_below
                .get(&name)
                .is_some_and(|&k| cronlease::store::TriggerId::attempt(spec.trigger) < k);
        let outcome = tokio::select! {
            () = tokio::time::sleep(took) => if fails { Outcome::Failed } else { Outcome::Ok },
            reason = stop => match reason {
                StopReason::LeaseLost { .. } => Outcome::LeaseLost,
                StopReason::Shutdown => Outcome::Killed,
                StopReason::Cancelled => Outcome::Cancelled,
                StopReason::Replaced => Outcome::Replaced,
            },
        };
        let finished_at = spec.clock.now();
        self.runs.lock().unwrap()[i].ended = Some((outcome.clone(), finished_at));
        Finished {
            exit_code: match outcome {
                Outcome::Ok => Some(0),
                Outcome::Failed => Some(1),
                _ => None,
            },
            outcome,
            started_at,
            finished_at,
            output: String::new(),
            usage: Default::default(),
        }
    }
}

impl VirtualRunner {
    fn runs(&self) -> Vec<Run> {
        self.runs.lock().unwrap().clone()
    }

    /// Runs of `job` fail while their attempt is below `k`.
    fn failing(job: &str, k: u32) -> VirtualRunner {
        VirtualRunner {
            fail_below: [(job.to_string(), k)].into(),
            ..Default::default()
        }
    }
}

/// A node running in this process.
struct Running {
    node: Arc<Node>,
    store: MemoryStore,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

/// A cluster in one process, on one in-memory store.
struct World {
    store: MemoryStore,
    wall: Arc<TokioClock>,
    runner: Arc<VirtualRunner>,
    dir: tempfile::TempDir,
}

impl World {
    /// Starts half a second before 12:00:00.
    fn new(runner: VirtualRunner) -> World {
        World {
            store: MemoryStore::starting_at(t(-0.5)),
            wall: Arc::new(TokioClock::starting_at(t(-0.5))),
            runner: Arc::new(runner),
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn config(&self, node: &str, margin: &str, jobs: &str) -> Config {
        self.config_tagged(node, &[], margin, jobs)
    }

    /// The config of node `node` with `[node] tags` (none: `node = "..."`).
    fn config_tagged(&self, node: &str, tags: &[&str], margin: &str, jobs: &str) -> Config {
        let path = self.dir.path().join(format!("{node}.toml"));
        let header = if tags.is_empty() {
            format!("node = \"{node}\"\n")
        } else {
            format!("[node]\nname = \"{node}\"\ntags = {tags:?}\n")
        };
        let text = format!(
            "{header}[store]\nurl = \"sqlite://{}/unused.db\"\n[lease]\nmargin = \"{margin}\"\n{jobs}",
            self.dir.path().display()
        );
        std::fs::write(&path, text).unwrap();
        config::load(&path, &Overrides::default()).unwrap()
    }

    /// A node with the default test margin of 1 s.
    fn start(&self, name: &str, jobs: &str) -> Running {
        self.start_with_margin(name, "1s", jobs)
    }

    fn start_with_margin(&self, name: &str, margin: &str, jobs: &str) -> Running {
        self.start_config(self.config(name, margin, jobs))
    }

    /// A node with `[node] tags`.
    fn start_tagged(&self, name: &str, tags: &[&str], jobs: &str) -> Running {
        self.start_config(self.config_tagged(name, tags, "1s", jobs))
    }

    fn start_config(&self, config: Config) -> Running {
        let store = self.store.connection();
        let node = Node::with_parts(
            &config,
            Arc::new(store.clone()),
            NodeParts::in_process(self.wall.clone(), self.runner.clone()),
        );
        let shutdown = CancellationToken::new();
        let task = {
            let (node, shutdown) = (node.clone(), shutdown.clone());
            let jobs = config.jobs.clone();
            tokio::spawn(async move { node.run(jobs, shutdown).await })
        };
        Running {
            node,
            store,
            shutdown,
            task,
        }
    }

    /// Sleeps (virtual time) until the wall clock shows `at`.
    async fn until(&self, at: DateTime<Utc>) {
        use cronlease::wallclock::WallClock;
        if let Ok(left) = (at - self.wall.now()).to_std() {
            tokio::time::sleep(left).await;
        }
    }
}

impl Running {
    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap();
    }
}

/// A node long gone claimed job j0000's 11:59:30 (a lease of 100 ms), so
/// 11:59:40 and 11:59:50 are missed when the test's nodes start.
async fn ghost_claimed_11_59_30(w: &World) {
    ghost_claimed(w, "j0000", t(-30.0)).await;
}

/// A node long gone claimed `job`'s occurrence `at`; its lease is over.
async fn ghost_claimed(w: &World, job: &str, at: DateTime<Utc>) {
    use cronlease::store::{ClaimOutcome, ClaimRequest, Locks};
    let claimed = w
        .store
        .connection()
        .claim(&[ClaimRequest {
            job: cronlease::config::JobName::parse(job).unwrap(),
            occurrence: at,
            previous: None,
            misfire: cronlease::config::Misfire::RunOnce,
            owner: Owner::from_raw("ghost#1"),
            lease: Duration::from_millis(100),
            fence_floor: 0,
            max_offset: Duration::from_secs(3600),
            head_start: None,
            after_unanswered: false,
            recheck_only: false,
            window_end: None,
            manual: None,
            redeliver: false,
            before_previous: None,
        }])
        .await
        .unwrap();
    assert!(matches!(claimed.outcomes[0], ClaimOutcome::Won(_)));
}

/// `n` jobs every ten seconds.
fn jobs(n: usize) -> String {
    (0..n)
        .map(|i| format!("[[job]]\nname = \"j{i:04}\"\nschedule = \"*/10 * * * * *\"\ncommand = [\"/bin/true\"]\n"))
        .collect()
}

/// Every run of an occurrence from `from` on: (job, occurrence, start),
/// both in ms from 12:00:00.
fn job_runs(w: &World, from: DateTime<Utc>) -> Vec<(String, i64, i64)> {
    w.runner
        .runs()
        .iter()
        .filter(|r| r.occurrence >= from)
        .map(|r| {
            (
                r.job.clone(),
                ms(r.occurrence - t(0.0)),
                ms(r.started - t(0.0)),
            )
        })
        .collect()
}

/// `job`'s (occurrence, start) in `runs` ([`job_runs`]).
fn runs_of(runs: &[(String, i64, i64)], job: &str) -> Vec<(i64, i64)> {
    runs.iter()
        .filter(|r| r.0 == job)
        .map(|r| (r.1, r.2))
        .collect()
}

fn ms(d: chrono::TimeDelta) -> i64 {
    d.num_milliseconds()
}

/// 300 jobs due at one instant are one claim call carrying 300 requests,
/// each instant; the runs' history goes in a few calls, not 300.
#[tokio::test(start_paused = true)]
async fn jobs_due_at_one_instant_are_one_claim_call() {
    let w = World::new(VirtualRunner::default());
    let a = w.start("a", &jobs(300));
    w.until(t(25.0)).await;
    let log = w.store.call_log();
    let claims: Vec<_> = log.iter().filter(|c| c.op == "claim").collect();
    assert_eq!(
        claims
            .iter()
            .map(|c| (c.requests, c.at))
            .collect::<Vec<_>>(),
        vec![(300, t(0.0)), (300, t(10.0)), (300, t(20.0))],
        "one claim call per instant"
    );
    let records: usize = log.iter().filter(|c| c.op == "record").count();
    assert!(records <= 6, "history written in {records} calls");
    let runs = w.runner.runs();
    assert_eq!(runs.len(), 900);
    let distinct: std::collections::BTreeSet<(String, DateTime<Utc>)> =
        runs.iter().map(|r| (r.job.clone(), r.occurrence)).collect();
    assert_eq!(distinct.len(), 900, "every occurrence once");
    assert!(
        runs.iter().all(|r| r.started == r.occurrence),
        "started late"
    );
    let history = w.store.history_len();
    assert_eq!(history, 900);
    a.stop().await;
}

/// A node whose claim batches come more often than its heartbeat period
/// (every second; a 5 s margin beats every 1.875 s) beats only inside them
/// once they run, and its record never lapses.
#[tokio::test(start_paused = true)]
async fn claim_batches_carry_the_heartbeat() {
    let w = World::new(VirtualRunner::default());
    let every_second =
        "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = [\"/bin/true\"]\n";
    let a = w.start_with_margin("a", "5s", every_second);
    for s in 1..=20 {
        w.until(t(f64::from(s) - 0.5)).await;
        let nodes = cronlease::store::Registry::nodes(&w.store).await.unwrap();
        assert_eq!(nodes.len(), 1, "at {s} s: {nodes:?}");
    }
    let log = w.store.call_log();
    let claims: Vec<_> = log.iter().filter(|c| c.op == "claim").collect();
    assert_eq!(claims.len(), 20, "{claims:?}");
    // The first beat goes on its own (at the start, -0.5 s; the batch at
    // 0 s came less than half a period after it); from then on every batch
    // carries it.
    assert!(
        claims.iter().filter(|c| c.at >= t(1.0)).all(|c| c.beat),
        "{claims:?}"
    );
    let alone: Vec<i64> = log
        .iter()
        .filter(|c| c.op == "heartbeat")
        .map(|c| ms(c.at - t(0.0)))
        .collect();
    assert_eq!(alone, [-500], "beats on their own");
    a.stop().await;
}

/// A node with nothing due beats on its own, once per period (5 s margin:
/// every 1.875 s), and its record never lapses.
#[tokio::test(start_paused = true)]
async fn a_node_with_no_batches_beats_on_its_own() {
    let w = World::new(VirtualRunner::default());
    let yearly =
        "[[job]]\nname = \"yearly\"\nschedule = \"0 0 0 1 1 *\"\ncommand = [\"/bin/true\"]\n";
    let a = w.start_with_margin("a", "5s", yearly);
    for s in 1..=20 {
        w.until(t(f64::from(s))).await;
        let nodes = cronlease::store::Registry::nodes(&w.store).await.unwrap();
        assert_eq!(nodes.len(), 1, "at {s} s: {nodes:?}");
    }
    let log = w.store.call_log();
    assert!(log.iter().all(|c| c.op != "claim"), "{log:?}");
    let alone: Vec<i64> = log
        .iter()
        .filter(|c| c.op == "heartbeat")
        .map(|c| ms(c.at - t(-0.5)))
        .collect();
    // From the start at -0.5 s to 20 s: 1 + 20.5 s / 1.875 s.
    assert_eq!(alone.len(), 11, "{alone:?}");
    assert!(
        alone
            .windows(2)
            .all(|p| (1_874..=1_876).contains(&(p[1] - p[0]))),
        "{alone:?}"
    );
    a.stop().await;
}

/// The holder's claims reach the store first: a node that last saw another
/// node hold the jobs sends its claims 5 ms after the instant (at its first
/// instant, knowing nothing yet, it sent at once and lost), and the holder
/// keeps running every occurrence on time.
#[tokio::test(start_paused = true)]
async fn a_follower_claims_after_the_holders_lead() {
    let w = World::new(VirtualRunner::default());
    let a = w.start("a", &jobs(3));
    w.until(t(1.0)).await;
    let b = w.start("b", &jobs(3));
    w.until(t(35.0)).await;
    let claims: Vec<(usize, i64)> = w
        .store
        .call_log()
        .iter()
        .filter(|c| c.op == "claim" && c.at >= t(15.0))
        .map(|c| (c.requests, ms(c.at - t(0.0))))
        .collect();
    assert_eq!(
        claims,
        vec![(3, 20_000), (3, 20_005), (3, 30_000), (3, 30_005)]
    );
    let runs = w.runner.runs();
    assert_eq!(runs.len(), 12);
    assert!(
        runs.iter()
            .all(|r| r.node == "a" && r.started == r.occurrence),
        "{runs:?}"
    );
    // The cost of the lead: a lease released by a step-down is taken by
    // the follower 5 ms after the instant.
    w.until(t(39.5)).await;
    a.node.step_down().await;
    w.until(t(45.0)).await;
    let at_forty: Vec<(String, i64)> = w
        .runner
        .runs()
        .iter()
        .filter(|r| r.occurrence == t(40.0))
        .map(|r| (r.node.clone(), ms(r.started - r.occurrence)))
        .collect();
    assert_eq!(
        at_forty,
        vec![("b".into(), 5), ("b".into(), 5), ("b".into(), 5)]
    );
    a.stop().await;
    b.stop().await;
}

/// The runs of the occurrence at `at` (seconds after 12:00:00): node, and
/// how late it started (ms).
fn runs_at(w: &World, at: f64) -> Vec<(String, i64)> {
    w.runner
        .runs()
        .iter()
        .filter(|r| r.occurrence == t(at))
        .map(|r| (r.node.clone(), ms(r.started - r.occurrence)))
        .collect()
}

/// What the store took from `from` to `to`, as its call log counts it:
/// (requests in claim calls, `nodes` reads).
fn claims_and_reads(w: &World, from: DateTime<Utc>, to: DateTime<Utc>) -> (usize, usize) {
    let log = w.store.call_log();
    let within = log.iter().filter(|c| c.at >= from && c.at < to);
    let claims = within
        .clone()
        .filter(|c| c.op == "claim")
        .map(|c| c.requests)
        .sum();
    let reads = within.filter(|c| c.op == "nodes").count();
    (claims, reads)
}

/// A follower with many jobs of one live holder due at an instant leaves
/// them to it (docs/protocol.md, "Followers leave held jobs to their
/// holder"): the store takes the holder's 20 claims an instant, not 40,
/// and two registry reads from the follower. It claims them again, on
/// time, when the holder steps down (its releases count moves), when the
/// holder is cut off from the store (after the idle holder's head start,
/// as before), and when it stops (its record gone).
#[tokio::test(start_paused = true)]
async fn a_follower_leaves_a_live_holders_jobs_to_it_and_takes_them_when_it_goes() {
    let w = World::new(VirtualRunner::default());
    let a = w.start("a", &jobs(20));
    w.until(t(1.0)).await;
    let b = w.start("b", &jobs(20));
    // 12:00:10: b claims as it has not seen a hold them; then it leaves
    // them to a at 12:00:20 and 12:00:30, waiting for its reads in one task
    // for the 20 (not a task each).
    w.until(t(19.9)).await;
    let before = b.node.handlers_in_flight();
    w.until(t(20.002)).await;
    assert_eq!(b.node.handlers_in_flight(), before + 1, "{before} before");
    w.until(t(35.0)).await;
    let (claims, reads) = claims_and_reads(&w, t(9.9), t(10.9));
    assert!(claims >= 40 && reads == 0, "{claims} {reads}");
    assert_eq!(claims_and_reads(&w, t(19.9), t(20.9)), (20, 2));
    assert_eq!(claims_and_reads(&w, t(29.9), t(30.9)), (20, 2));
    let runs = w.runner.runs();
    assert_eq!(runs.len(), 80, "each of 4 occurrences of 20 jobs once");
    assert!(
        runs.iter()
            .all(|r| r.node == "a" && r.started == r.occurrence),
        "{runs:?}"
    );
    // A step-down: a gives its leases up; b sees a's count of releases
    // move at its first read, 5 ms after the instant, and claims then.
    w.until(t(39.5)).await;
    a.node.step_down().await;
    w.until(t(45.0)).await;
    let at_forty: BTreeSet<(String, i64)> = runs_at(&w, 40.0).into_iter().collect();
    assert_eq!(at_forty.len(), 1, "{at_forty:?}");
    let (node, late) = at_forty.first().unwrap().clone();
    assert_eq!(node, "b");
    assert!((5..=20).contains(&late), "b ran 12:00:40 {late} ms late");
    assert_eq!(
        claims_and_reads(&w, t(39.9), t(40.9)).1,
        1,
        "b left them, and claimed at its first read"
    );
    assert_eq!(runs_at(&w, 40.0).len(), 20);
    // From 12:00:50 on a, stepped down, leaves them to b.
    w.until(t(65.0)).await;
    assert_eq!(claims_and_reads(&w, t(49.9), t(50.9)), (20, 2));
    assert_eq!(claims_and_reads(&w, t(59.9), t(60.9)), (20, 2));
    assert_eq!(runs_at(&w, 60.0), vec![("b".to_string(), 0); 20]);
    // b cut off from the store a second before 12:01:10: its record lives
    // on (two beat periods and a third of the margin), but at
    // the second read, after b's head start, b has said nothing of
    // 12:01:10, and a claims them then (b's idle lease protects nothing
    // past its head start).
    w.until(t(69.0)).await;
    b.store.set_reachable(false);
    w.until(t(71.0)).await;
    assert_eq!(claims_and_reads(&w, t(69.9), t(70.9)).1, 2);
    let at_seventy = runs_at(&w, 70.0);
    assert_eq!(at_seventy.len(), 20, "{at_seventy:?}");
    assert!(
        at_seventy
            .iter()
            .all(|(n, late)| n == "a" && (50..=100).contains(late)),
        "{at_seventy:?}"
    );
    b.store.set_reachable(true);
    b.stop().await;
    // c joins, claims at 12:01:20, finds a holding them, and leaves them
    // to a at 12:01:30. a stops 50 ms before 12:01:40: c's view of its last
    // beat still has a, but its first read, 5 ms after the instant, does
    // not (a stopping deletes its record), and c claims then (one read).
    w.until(t(72.0)).await;
    let c = w.start("c", &jobs(20));
    w.until(t(99.95)).await;
    assert_eq!(claims_and_reads(&w, t(89.9), t(90.9)), (20, 2));
    a.stop().await;
    w.until(t(105.0)).await;
    let at_hundred = runs_at(&w, 100.0);
    assert_eq!(at_hundred.len(), 20, "{at_hundred:?}");
    assert!(
        at_hundred
            .iter()
            .all(|(n, late)| n == "c" && (5..=20).contains(late)),
        "{at_hundred:?}"
    );
    assert_eq!(claims_and_reads(&w, t(99.9), t(100.9)), (20, 1));
    // Every occurrence from 12:00:00 to 12:01:40 once.
    let mut seen: BTreeMap<(String, i64), usize> = BTreeMap::new();
    for r in w.runner.runs() {
        *seen
            .entry((r.job.clone(), ms(r.occurrence - t(0.0))))
            .or_default() += 1;
    }
    assert_eq!(seen.len(), 20 * 11, "{seen:?}");
    assert!(seen.values().all(|&n| n == 1), "{seen:?}");
    c.stop().await;
}

/// A holder that lets its jobs go while alive (here a reload removes them
/// on it alone, 8 s before the next instant: long before the follower's
/// next beat) moves its count of leases given up; the follower compares it
/// with the count it saw when it last claimed the jobs, not with the one of
/// its latest beat, and claims them at its first read. Compared with the
/// latest beat's, the jobs would be left to a node that no longer has them,
/// and never run again.
#[tokio::test(start_paused = true)]
async fn a_follower_claims_what_its_holder_let_go_long_before_the_instant() {
    let w = World::new(VirtualRunner::default());
    let a = w.start("a", &jobs(20));
    w.until(t(1.0)).await;
    let b = w.start("b", &jobs(20));
    w.until(t(21.0)).await;
    assert_eq!(claims_and_reads(&w, t(19.9), t(20.9)), (20, 2));
    w.until(t(22.0)).await;
    a.node.apply_jobs(w.config("a", "1s", "").jobs);
    w.until(t(35.0)).await;
    let at_thirty = runs_at(&w, 30.0);
    assert_eq!(at_thirty.len(), 20, "{at_thirty:?}");
    assert!(
        at_thirty
            .iter()
            .all(|(n, late)| n == "b" && (5..=20).contains(late)),
        "{at_thirty:?}"
    );
    assert_eq!(claims_and_reads(&w, t(29.9), t(30.9)), (20, 1));
    a.stop().await;
    b.stop().await;
}

/// An idle node (default 1 s margin) asks the store once a second: its
/// heartbeat, which reads the pending manual runs in the same call. A run
/// requested meanwhile starts within that second, found by the next beat
/// without a call of its own; a retry waits for its time, not for a beat.
#[tokio::test(start_paused = true)]
async fn an_idle_node_makes_one_store_call_a_second_and_still_finds_a_manual_run() {
    use cronlease::store::{Locks, TriggerId};
    let w = World::new(VirtualRunner::default());
    let yearly =
        "[[job]]\nname = \"yearly\"\nschedule = \"0 0 0 1 1 *\"\ncommand = [\"/bin/true\"]\n";
    let a = w.start("a", yearly);
    w.until(t(5.0)).await;
    let from = w.store.call_log().len();
    w.until(t(65.0)).await;
    let ops = |calls: &[cronlease::store::memory::Call]| {
        let mut ops: BTreeMap<&str, usize> = BTreeMap::new();
        for c in calls {
            *ops.entry(c.op).or_default() += 1;
        }
        ops
    };
    let idle = ops(&w.store.call_log()[from..]);
    assert_eq!(idle, BTreeMap::from([("heartbeat", 60)]), "60 s idle");

    let from = w.store.call_log().len();
    let job = cronlease::config::JobName::parse("yearly").unwrap();
    w.until(t(65.3)).await;
    let answer = w
        .store
        .connection()
        .request_trigger(&job, TriggerId::made_at(t(65.3)))
        .await
        .unwrap();
    assert_eq!(answer, cronlease::store::TriggerAnswer::Accepted);
    w.until(t(70.0)).await;
    let runs = w.runner.runs();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let waited = ms(runs[0].started - t(65.3));
    assert!(
        (0..=1_010).contains(&waited),
        "started {waited} ms after the request"
    );
    let after = ops(&w.store.call_log()[from..]);
    assert_eq!(after.get("pending_triggers"), None, "{after:?}");
    assert_eq!(after.get("claim"), Some(&1), "{after:?}");
    a.stop().await;
}

/// A node busy with a job every second, on a store that announces requests
/// or not: how many looks for requests it makes from 12:00:02 to 12:00:12,
/// and how long after it a request made at 12:00:12.3 starts.
async fn busy_looks(announce: bool) -> (usize, i64) {
    use cronlease::store::{Locks, TriggerId};
    let w = World::new(VirtualRunner::default());
    if announce {
        w.store.announce_requests();
    }
    let jobs = "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = [\"/bin/true\"]\n\
                [[job]]\nname = \"yearly\"\nschedule = \"0 0 0 1 1 *\"\ncommand = [\"/bin/true\"]\n";
    let a = w.start("a", jobs);
    w.until(t(2.0)).await;
    let from = w.store.call_log().len();
    w.until(t(12.0)).await;
    let looks = w.store.call_log()[from..]
        .iter()
        .filter(|c| c.op == "pending_triggers")
        .count();
    w.until(t(12.3)).await;
    let job = cronlease::config::JobName::parse("yearly").unwrap();
    w.store
        .connection()
        .request_trigger(&job, TriggerId::made_at(t(12.3)))
        .await
        .unwrap();
    w.until(t(14.0)).await;
    let started = w
        .runner
        .runs()
        .iter()
        .find(|r| r.job == "yearly")
        .map(|r| ms(r.started - t(12.3)))
        .unwrap();
    a.stop().await;
    (looks, started)
}

/// With a job due every second a node looks for requests on its own four
/// times a second where the store announces none (a guard's hand-back must
/// start within the second). Where it announces them, the request comes
/// with its notice and starts at once, and the node's own look, there for a
/// notice lost, comes twice a second: half the calls.
#[tokio::test(start_paused = true)]
async fn a_busy_node_looks_half_as_often_where_the_store_announces_requests() {
    let (polled, _) = busy_looks(false).await;
    let (announced, waited) = busy_looks(true).await;
    // Not 40 and 20 calls: a beat on its own reads the requests too, and a
    // notice makes a look; 33-36 and 13-17 seen.
    assert!(
        (30..=42).contains(&polled),
        "{polled} looks in 10 s without notices"
    );
    assert!(
        (8..=20).contains(&announced) && announced * 5 <= polled * 3,
        "{announced} looks in 10 s with notices, {polled} without"
    );
    assert!(
        (0..=20).contains(&waited),
        "announced, the run started {waited} ms after its request"
    );
}

/// The delay jitter gives the job `name` within `bound` seconds, worked
/// out here from docs/protocol.md ("Jitter"), not by the crate.
fn jitter_delay_ms(name: &str, bound: u64) -> i64 {
    use sha2::{Digest, Sha256};
    let sum = Sha256::digest([b"cronlease jitter v1\0".as_slice(), name.as_bytes()].concat());
    let point = u64::from_be_bytes(sum[..8].try_into().unwrap());
    (((u128::from(point) * u128::from(bound)) >> 64) as i64) * 1000
}

/// `jitter` moves each job's occurrences by its own delay, the same on
/// every node: 20 jobs of one pattern run spread over the gap, each
/// occurrence once, started at its moved instant, also across a step-down;
/// `jitter = "0s"` keeps a job on the pattern under `[jobs] default_jitter`.
#[tokio::test(start_paused = true)]
async fn jittered_occurrences_run_once_each_at_the_moved_instant_on_any_node() {
    let w = World::new(VirtualRunner::default());
    let mut jobs = String::from("[jobs]\ndefault_jitter = \"1m\"\n");
    jobs.push_str(&self::jobs(20));
    jobs.push_str(
        "[[job]]\nname = \"plain\"\nschedule = \"*/10 * * * * *\"\njitter = \"0s\"\ncommand = [\"/bin/true\"]\n",
    );
    let a = w.start("a", &jobs);
    let b = w.start("b", &jobs);
    w.until(t(24.0)).await;
    a.node.step_down().await;
    w.until(t(59.0)).await;
    let runs = job_runs(&w, t(0.0));
    let mut delays = std::collections::BTreeSet::new();
    for i in 0..20 {
        let name = format!("j{i:04}");
        // The gap (10 s) bounds the minute.
        let delay = jitter_delay_ms(&name, 10);
        delays.insert(delay);
        let expected: Vec<i64> = (0..5).map(|k| k * 10_000 + delay).collect();
        let mut got = runs_of(&runs, &name);
        got.sort();
        got.retain(|(at, _)| *at < 50_000);
        let occurrences: Vec<i64> = got.iter().map(|r| r.0).collect();
        assert_eq!(occurrences, expected, "{name}: occurrences in ms");
        // On time; a follower's first claim after the step-down 5 ms late.
        assert!(
            got.iter()
                .all(|(at, start)| (0..=5).contains(&(start - at))),
            "{name}: {got:?}"
        );
    }
    assert!(
        delays.len() >= 6,
        "20 jobs spread over {} delays",
        delays.len()
    );
    let mut plain = runs_of(&runs, "plain");
    plain.sort();
    plain.retain(|(at, _)| *at < 50_000);
    let on_pattern: Vec<(i64, i64)> = (0..5).map(|k| (k * 10_000, k * 10_000)).collect();
    // After the step-down b takes over 5 ms into an instant it did not hold.
    assert_eq!(plain.len(), 5, "{plain:?}");
    assert!(
        plain
            .iter()
            .zip(&on_pattern)
            .all(|(g, e)| g.0 == e.0 && g.1 - e.1 <= 5),
        "{plain:?}"
    );
    a.stop().await;
    b.stop().await;
}

/// `[node] tags` and `run_on` (docs/configuration.md, "Node tags"): a
/// node claims a job only if it has every tag of its `run_on`, even where
/// holding on (it started first) would otherwise keep the job; a manual
/// run and a retry's attempt wait for a node that may run the job (the
/// one that may is cut off while they are due, the other is not); a
/// `run_on` no live node satisfies is counted in
/// `cronlease_jobs_without_eligible_node`; a reload that gives a node a
/// tag makes it claim that tag's job and one that takes a tag away lets
/// the job go to a peer; a node leaving strands the jobs only it could
/// run.
#[tokio::test(start_paused = true)]
async fn each_job_runs_only_on_nodes_with_every_tag_of_its_run_on() {
    use cronlease::store::{Locks, Registry, TriggerId};
    let w = World::new(VirtualRunner::failing("flaky", 2));
    let job = |name: &str, more: &str| {
        format!(
            "[[job]]\nname = \"{name}\"\nschedule = \"*/10 * * * * *\"\n{more}command = [\"/bin/true\"]\n"
        )
    };
    let jobs = [
        job("any", ""),
        job("db", "run_on = [\"db\"]\n"),
        job("web", "run_on = [\"web\"]\n"),
        job("dbeu", "run_on = [\"eu\", \"db\"]\n"),
        job("gpu", "run_on = [\"gpu\"]\n"),
        job(
            "flaky",
            "run_on = [\"web\"]\nretry = { attempts = 2, backoff = \"2s\" }\n",
        ),
    ]
    .concat();
    // a starts first: by biased ownership it would win every job and keep
    // them.
    let a = w.start_tagged("a", &["db"], &jobs);
    w.until(t(1.0)).await;
    let b = w.start_tagged("b", &["web", "db", "eu"], &jobs);
    // b runs flaky at 10 s (attempt 1 fails: attempt 2 is due 1.6-2.4 s
    // later) and is then cut off until 14 s; a manual run of dbeu is asked
    // for at 11 s. a sees both and may run neither.
    w.until(t(10.5)).await;
    b.store.set_reachable(false);
    w.until(t(11.0)).await;
    let dbeu = config::JobName::parse("dbeu").unwrap();
    w.store
        .connection()
        .request_trigger(&dbeu, TriggerId::made_at(t(11.0)))
        .await
        .unwrap();
    w.until(t(14.0)).await;
    b.store.set_reachable(true);
    w.until(t(25.0)).await;
    let stranded = |n: &Running| n.node.metrics().jobs_without_eligible_node.get();
    assert_eq!((stranded(&a), stranded(&b)), (1, 1), "gpu: nobody has it");
    let listed: Vec<(String, Vec<String>)> = w
        .store
        .connection()
        .nodes()
        .await
        .unwrap()
        .into_iter()
        .map(|n| (n.node, n.tags))
        .collect();
    assert_eq!(
        listed,
        [
            ("a".to_string(), vec!["db".to_string()]),
            (
                "b".to_string(),
                vec!["db".into(), "eu".into(), "web".into()]
            )
        ]
    );
    // A reload gives a the gpu tag and takes db away.
    w.until(t(31.0)).await;
    let reloaded = w.config_tagged("a", &["gpu"], "1s", &jobs);
    a.node.apply_settings(&reloaded);
    a.node.apply_jobs(reloaded.jobs.clone());
    w.until(t(45.0)).await;
    assert_eq!((stranded(&a), stranded(&b)), (0, 0), "a has gpu, b db");
    // b leaves: db, web, dbeu and flaky have no node left.
    w.until(t(51.0)).await;
    b.stop().await;
    w.until(t(65.0)).await;
    assert_eq!(stranded(&a), 4, "db, web, dbeu and flaky are stranded");
    let runs = w.runner.runs();
    let of = |job: &str| -> (Vec<&str>, Vec<i64>) {
        let mine: Vec<&Run> = runs.iter().filter(|r| r.job == job).collect();
        let mut nodes: Vec<&str> = mine.iter().map(|r| r.node.as_str()).collect();
        nodes.dedup();
        (
            nodes,
            mine.iter().map(|r| ms(r.occurrence - t(0.0))).collect(),
        )
    };
    let every = |from: i64, to: i64| -> Vec<i64> { (from..=to).step_by(10_000).collect() };
    assert_eq!(of("any"), (vec!["a"], every(0, 60_000)));
    assert_eq!(of("db"), (vec!["a", "b"], every(0, 50_000)));
    assert_eq!(of("web"), (vec!["b"], every(10_000, 50_000)));
    // The manual run on b once it was back (its occurrence: the claim's
    // time), beside the scheduled ones.
    let (nodes, mut at) = of("dbeu");
    assert_eq!(nodes, ["b"], "{runs:?}");
    let manual = at.remove(1);
    assert!((14_000..=15_100).contains(&manual), "{runs:?}");
    assert_eq!(at, every(10_000, 50_000));
    // Each occurrence's attempt 1 fails and attempt 2 follows, all on b:
    // 10 s's attempt 2 once b was back.
    let flaky: Vec<(&str, u32, i64)> = runs
        .iter()
        .filter(|r| r.job == "flaky")
        .map(|r| (r.node.as_str(), r.attempt, ms(r.started - t(0.0))))
        .collect();
    assert!(
        flaky.len() >= 9 && flaky.iter().all(|r| r.0 == "b"),
        "{flaky:?}"
    );
    assert!(
        flaky[1].1 == 2 && (14_000..=15_100).contains(&flaky[1].2),
        "{flaky:?}"
    );
    assert_eq!(of("gpu"), (vec!["a"], every(40_000, 60_000)));
    a.stop().await;
}

/// `overlap = "replace"`: a run still going when the next occurrence is
/// due is stopped (recorded `replaced`) and that occurrence starts as soon
/// as its process is over, on the holder, once across the cluster: a job
/// that takes 15 s every 10 s runs every occurrence, each ended by the
/// next; with `skip` the same job runs every other occurrence. A manual
/// run going at an occurrence is replaced too.
#[tokio::test(start_paused = true)]
async fn replace_stops_the_running_run_and_starts_the_due_one_once() {
    use cronlease::store::{Locks, TriggerId};
    /// How a run ended and when (ms after 12:00:00).
    type End = Option<(Outcome, i64)>;
    type Seen = (String, u64, i64, i64, End);
    let seen = |w: &World| -> Vec<Seen> {
        w.runner
            .runs()
            .iter()
            .map(|r| {
                (
                    r.node.clone(),
                    r.fence,
                    ms(r.occurrence - t(0.0)),
                    ms(r.started - t(0.0)),
                    r.ended
                        .as_ref()
                        .map(|(o, at)| (o.clone(), ms(*at - t(0.0)))),
                )
            })
            .collect()
    };
    // With `spread` too, the other node joining 5 s in (so the first holds
    // the job though one of the two orders makes the other preferred): a
    // replaced run's end hands nothing back while the run that replaced it
    // goes.
    for (overlap, placement, first) in [
        ("replace", "sticky", "a"),
        ("skip", "sticky", "a"),
        ("replace", "spread", "a"),
        ("replace", "spread", "b"),
    ] {
        let w = World::new(VirtualRunner::lasting("slow", Duration::from_secs(15)));
        let jobs = format!(
            "[cluster]\nplacement = \"{placement}\"\n[[job]]\nname = \"slow\"\nschedule = \"*/10 * * * * *\"\noverlap = \"{overlap}\"\ncommand = [\"/bin/true\"]\n"
        );
        let second = if first == "a" { "b" } else { "a" };
        let a = w.start(first, &jobs);
        w.until(t(5.0)).await;
        let b = w.start(second, &jobs);
        w.until(t(59.0)).await;
        let runs = seen(&w);
        let nodes: std::collections::BTreeSet<&str> = runs.iter().map(|r| r.0.as_str()).collect();
        assert_eq!(nodes.len(), 1, "{overlap}: one node ran them all: {runs:?}");
        assert!(
            runs.windows(2).all(|p| p[0].1 < p[1].1),
            "{overlap}: fences in order: {runs:?}"
        );
        // Never two runs at once: each starts once the one before ended.
        for pair in runs.windows(2) {
            let ended = pair[0].4.as_ref().map(|e| e.1);
            assert!(
                ended.is_some_and(|e| e <= pair[1].3),
                "{overlap}: overlap {pair:?}"
            );
        }
        // With `spread` a holder that is not the job's preferred node
        // claims after the head start and 10 ms: 60 ms after each instant.
        let lag = if placement == "spread" && first == "a" {
            60
        } else {
            0
        };
        let got: Vec<(i64, i64, End)> = runs.iter().map(|r| (r.2, r.3, r.4.clone())).collect();
        let want: Vec<(i64, i64, End)> = if overlap == "replace" {
            let mut want: Vec<_> = (0..5)
                .map(|k| {
                    let at = k * 10_000;
                    let start = if k == 0 { 0 } else { at + lag };
                    (at, start, Some((Outcome::Replaced, at + 10_000 + lag)))
                })
                .collect();
            want.push((50_000, 50_000 + lag, None));
            want
        } else {
            vec![
                (0, 0, Some((Outcome::Ok, 15_000))),
                (20_000, 20_000, Some((Outcome::Ok, 35_000))),
                (40_000, 40_000, Some((Outcome::Ok, 55_000))),
            ]
        };
        assert_eq!(got, want, "{overlap}: {runs:?}");
        a.stop().await;
        b.stop().await;
    }

    // A manual run (50 s long) asked for at 52 s, when the run of 0 s is
    // over, is replaced by the occurrence of 60 s.
    let w = World::new(VirtualRunner::lasting("slow", Duration::from_secs(50)));
    let jobs = "[[job]]\nname = \"slow\"\nschedule = \"0 * * * * *\"\noverlap = \"replace\"\ncommand = [\"/bin/true\"]\n";
    let a = w.start("a", jobs);
    w.until(t(52.0)).await;
    let slow = config::JobName::parse("slow").unwrap();
    w.store
        .connection()
        .request_trigger(&slow, TriggerId::made_at(t(52.0)))
        .await
        .unwrap();
    w.until(t(65.0)).await;
    let runs = seen(&w);
    assert_eq!(runs.len(), 3, "{runs:?}");
    assert_eq!(runs[0].4, Some((Outcome::Ok, 50_000)), "{runs:?}");
    let manual = &runs[1];
    assert!(
        (52_000..=53_100).contains(&manual.3) && manual.4 == Some((Outcome::Replaced, 60_000)),
        "{runs:?}"
    );
    assert_eq!(
        (runs[2].2, runs[2].3, runs[2].4.clone()),
        (60_000, 60_000, None)
    );
    a.stop().await;
}

/// `placement = "every_node"` (docs/protocol.md, "Broadcast"): each
/// occurrence runs once on every live node, as shard i of n by the sorted
/// names, each in its own lock with its own fences; the occurrence itself
/// is recorded `dispatched`. A node cut off just before an instant is still
/// in the dispatcher's view: its shard is taken by a peer once its node
/// has not taken it (its record gone, or two beats and a margin), and run
/// once; the next instant has two shards.
#[tokio::test(start_paused = true)]
async fn every_node_runs_each_occurrence_once_per_node_and_a_lost_nodes_shard_on_a_peer() {
    use cronlease::store::History;
    let w = World::new(VirtualRunner::default());
    let jobs = "[[job]]\nname = \"bc\"\nschedule = \"*/10 * * * * *\"\nplacement = \"every_node\"\ncommand = [\"/bin/true\"]\n";
    let nodes = [w.start("a", jobs), w.start("b", jobs), w.start("c", jobs)];
    w.until(t(19.9)).await;
    nodes[2].store.set_reachable(false);
    // A manual run of the job at 41.3 s: dispatched to the two nodes left.
    w.until(t(41.3)).await;
    let bc = config::JobName::parse("bc").unwrap();
    {
        use cronlease::store::Locks;
        w.store
            .connection()
            .request_trigger(&bc, cronlease::store::TriggerId::made_at(t(41.3)))
            .await
            .unwrap();
    }
    w.until(t(45.0)).await;
    let all = w.runner.runs();
    let (manual, runs): (Vec<Run>, Vec<Run>) = all
        .into_iter()
        .partition(|r| ms(r.occurrence - t(0.0)) % 10_000 != 0);
    let mut got: Vec<(String, Option<(u32, u32)>)> =
        manual.iter().map(|r| (r.node.clone(), r.shard)).collect();
    got.sort();
    assert_eq!(
        got,
        [
            ("a".to_string(), Some((0, 2))),
            ("b".to_string(), Some((1, 2)))
        ],
        "{manual:?}"
    );
    let runs: Vec<Run> = runs
        .into_iter()
        .filter(|r| r.occurrence < t(40.0))
        .collect();
    /// A shard's run: its node, its lock, its start in ms after the
    /// occurrence.
    type ShardRun = (String, String, i64);
    // (occurrence, shard index, count) → its runs.
    let mut seen: BTreeMap<(i64, u32, u32), Vec<ShardRun>> = BTreeMap::new();
    for r in &runs {
        let (i, n) = r.shard.expect("every run is a shard's");
        seen.entry((ms(r.occurrence - t(0.0)), i, n))
            .or_default()
            .push((r.node.clone(), r.job.clone(), ms(r.started - r.occurrence)));
    }
    let keys: Vec<(i64, u32, u32)> = seen.keys().copied().collect();
    assert_eq!(
        keys,
        [
            (0, 0, 3),
            (0, 1, 3),
            (0, 2, 3),
            (10_000, 0, 3),
            (10_000, 1, 3),
            (10_000, 2, 3),
            (20_000, 0, 3),
            (20_000, 1, 3),
            (20_000, 2, 3),
            (30_000, 0, 2),
            (30_000, 1, 2)
        ],
        "{runs:?}"
    );
    for ((at, i, n), ran) in &seen {
        assert_eq!(ran.len(), 1, "shard {i}/{n} of {at} ran once: {ran:?}");
        let (node, lock, late) = &ran[0];
        if (*at, *i) == (20_000, 2) {
            // c's shard, on a peer, in its lock, within the window.
            assert!(node != "c" && lock == "bc~c", "{ran:?}");
            assert!((2_000..=5_000).contains(late), "{ran:?}");
        } else {
            let by_name = ["a", "b", "c"][*i as usize];
            assert_eq!(
                (node.as_str(), lock.clone()),
                (by_name, format!("bc~{by_name}"))
            );
            assert!(*late <= 300, "{ran:?}");
        }
    }
    // The job's own lock records each occurrence dispatched, naming the
    // shards.
    let own = w.store.connection().history(Some(&bc), 10).await.unwrap();
    let outcomes: Vec<String> = own.iter().map(|r| r.outcome.to_string()).collect();
    // 0, 10, 20, 30 and 40 s, and the manual run.
    assert_eq!(outcomes, ["dispatched"; 6], "{own:?}");
    assert!(
        own.iter()
            .any(|r| r.output.contains("a (shard 0), b (shard 1), c (shard 2)")),
        "{own:?}"
    );
    nodes[2].store.set_reachable(true);
    for n in nodes {
        n.stop().await;
    }
}

/// A broadcast job's missed occurrence is not caught up at the next one's
/// claim (its shards would meet that one's): recorded `missed` under the
/// job's lock; the occurrence itself is dispatched and runs.
#[tokio::test(start_paused = true)]
async fn a_broadcast_jobs_missed_occurrence_is_recorded_missed_not_caught_up() {
    use cronlease::store::History;
    let w = World::new(VirtualRunner::default());
    ghost_claimed(&w, "bc", t(-30.0)).await;
    let jobs = "[[job]]\nname = \"bc\"\nschedule = \"*/10 * * * * *\"\nplacement = \"every_node\"\ncommand = [\"/bin/true\"]\n";
    let a = w.start("a", jobs);
    w.until(t(5.0)).await;
    let runs: Vec<(i64, Option<(u32, u32)>)> = w
        .runner
        .runs()
        .iter()
        .map(|r| (ms(r.occurrence - t(0.0)), r.shard))
        .collect();
    assert_eq!(runs, [(0, Some((0, 1)))]);
    let bc = config::JobName::parse("bc").unwrap();
    let own = w.store.connection().history(Some(&bc), 10).await.unwrap();
    let seen: Vec<(i64, String)> = own
        .iter()
        .map(|r| (ms(r.occurrence - t(0.0)), r.outcome.to_string()))
        .collect();
    assert!(seen.contains(&(0, "dispatched".into())), "{own:?}");
    assert!(
        own.iter()
            .any(|r| r.outcome.to_string() == "missed" && r.output.contains("not caught up")),
        "{own:?}"
    );
    a.stop().await;

    // Nor by a node coming back within the first half of the gap (which
    // runs a plain job's missed occurrence at once).
    let w = World::new(VirtualRunner::default());
    ghost_claimed(&w, "bc", t(-10.0)).await;
    w.until(t(2.0)).await;
    let a = w.start("a", jobs);
    w.until(t(12.0)).await;
    let runs: Vec<i64> = w
        .runner
        .runs()
        .iter()
        .map(|r| ms(r.occurrence - t(0.0)))
        .collect();
    assert_eq!(runs, [10_000], "12:00:00 not caught up at 12:00:02");
    a.stop().await;
}

/// With `spread`, a job's preferred node is picked among the nodes that
/// may run it: a job only c may run starts on c on time, never deferred
/// to a preferred node that will not claim it.
#[tokio::test(start_paused = true)]
async fn spread_prefers_a_node_among_those_a_job_may_run_on() {
    let w = World::new(VirtualRunner::default());
    let mut jobs = String::from("[cluster]\nplacement = \"spread\"\n");
    for i in 0..30 {
        jobs.push_str(&format!(
            "[[job]]\nname = \"x{i:02}\"\nschedule = \"*/10 * * * * *\"\nrun_on = [\"x\"]\ncommand = [\"/bin/true\"]\n"
        ));
    }
    let nodes = [
        w.start_tagged("a", &["y"], &jobs),
        w.start_tagged("b", &[], &jobs),
        w.start_tagged("c", &["x", "y"], &jobs),
    ];
    w.until(t(39.0)).await;
    let runs = w.runner.runs();
    assert_eq!(runs.len(), 30 * 4, "each job at 0, 10, 20 and 30 s");
    let late: Vec<(String, String, i64)> = runs
        .iter()
        .filter(|r| r.node != "c" || r.started != r.occurrence)
        .map(|r| (r.job.clone(), r.node.clone(), ms(r.started - r.occurrence)))
        .collect();
    assert_eq!(late, vec![], "every run on c, at its instant");
    for n in nodes {
        n.stop().await;
    }
}

/// A holder cut off the store (a dead host) between runs is replaced by a
/// peer at the next occurrence after the head start (50 ms), not when the
/// lease it took ends: its last run was recorded, so it was idle.
#[tokio::test(start_paused = true)]
async fn a_cut_off_idle_holder_is_taken_over_after_the_head_start() {
    let w = World::new(VirtualRunner::default());
    let a = w.start("a", &jobs(1));
    w.until(t(1.0)).await;
    let b = w.start("b", &jobs(1));
    w.until(t(5.0)).await;
    a.store.set_reachable(false);
    w.until(t(25.0)).await;
    let runs = w.runner.runs();
    let summary: Vec<(String, u64, i64, i64)> = runs
        .iter()
        .map(|r| {
            (
                r.node.clone(),
                r.fence,
                ms(r.occurrence - t(0.0)),
                ms(r.started - r.occurrence),
            )
        })
        .collect();
    // a ran 12:00:00 and recorded it; its lease (10 s + 1 s margin) lasts
    // to 12:00:11, but b, told at 12:00:10.005 that the idle holder's head
    // start has 45 ms left, claimed again then (+1 ms slack).
    assert_eq!(summary[0], ("a".into(), 1, 0, 0));
    assert_eq!(
        (summary[1].0.as_str(), summary[1].1, summary[1].2),
        ("b", 2, 10_000)
    );
    assert!(
        (50..=60).contains(&summary[1].3),
        "takeover {} ms after the instant",
        summary[1].3
    );
    // b now holds it and runs 12:00:20 on time.
    assert_eq!(summary[2], ("b".into(), 3, 20_000, 0));
    assert_eq!(summary.len(), 3, "{summary:?}");
    b.stop().await;
    a.store.set_reachable(true);
    a.stop().await;
}

/// An occurrence nobody ran, found when more than half its gap is gone, is
/// caught up once by the next claim (misfire run_once), before the
/// occurrence itself, both at the instant.
#[tokio::test(start_paused = true)]
async fn a_missed_occurrence_is_caught_up_first() {
    use cronlease::store::History;
    let w = World::new(VirtualRunner::default());
    // A node long gone claimed 11:59:30 and nobody ran 11:59:40 or :50.
    ghost_claimed_11_59_30(&w).await;
    let a = w.start("a", &jobs(1));
    w.until(t(5.0)).await;
    let runs: Vec<(u64, i64, i64)> = w
        .runner
        .runs()
        .iter()
        .map(|r| (r.fence, ms(r.occurrence - t(0.0)), ms(r.started - t(0.0))))
        .collect();
    // Fence 2 is kept for 11:59:40, which nobody claimed: recorded
    // `missed`, under it.
    assert_eq!(runs, vec![(3, -10_000, 0), (4, 0, 0)]);
    let history = w.store.connection().history(None, 10).await.unwrap();
    let unclaimed = history.iter().find(|r| r.fence == 2).unwrap();
    assert_eq!(
        (
            unclaimed.outcome.to_string(),
            ms(unclaimed.occurrence - t(0.0))
        ),
        ("missed".into(), -20_000),
        "{history:?}"
    );
    assert!(
        unclaimed.output.contains("no node claimed it ("),
        "{}",
        unclaimed.output
    );
    a.stop().await;
}

/// A node that comes back (here: starts) in the first half of the gap after
/// an occurrence nobody claimed runs it at once (misfire run_once), not at
/// the next occurrence; the older missed one (11:58:59) is not run, and
/// recorded `missed` under the fence below.
#[tokio::test(start_paused = true)]
async fn a_returning_node_runs_the_latest_missed_occurrence_at_once() {
    use cronlease::store::History;
    let w = World::new(VirtualRunner::default());
    let every_minute =
        "[[job]]\nname = \"j0000\"\nschedule = \"59 * * * * *\"\ncommand = [\"/bin/true\"]\n";
    // A node long gone claimed 11:57:59; nobody ran 11:58:59 or 11:59:59.
    ghost_claimed(&w, "j0000", t(-121.0)).await;
    let a = w.start("a", every_minute);
    w.until(t(60.0)).await;
    let runs: Vec<(u64, i64, i64)> = w
        .runner
        .runs()
        .iter()
        .map(|r| (r.fence, ms(r.occurrence - t(0.0)), ms(r.started - t(0.0))))
        .collect();
    // Run when the node could first claim (its store prepared), before
    // 12:00:00; then 12:00:59 on time.
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!((runs[0].0, runs[0].1), (3, -1_000), "{runs:?}");
    assert!((-500..-300).contains(&runs[0].2), "{runs:?}");
    assert_eq!(runs[1], (4, 59_000, 59_000), "{runs:?}");
    let history = w.store.connection().history(None, 10).await.unwrap();
    assert!(
        history
            .iter()
            .any(|r| r.fence == 2 && r.outcome.to_string() == "missed" && r.occurrence == t(-61.0)),
        "{history:?}"
    );
    a.stop().await;
}

/// Catch-up on resume: jobs paused over their 12:00:20 occurrence and
/// resumed at 12:00:21.5 (the store unpaused, the resume's request left as
/// `cronlease resume` does): "p" runs 12:00:20 at once, as its occurrence
/// (not at 12:00:30, where the store would hand it out, nor as a manual
/// run); "q", with a 1 s starting deadline, does not run it, and the claim
/// of 12:00:30 records it `missed`. Both requests are gone.
#[tokio::test(start_paused = true)]
async fn a_resumed_job_runs_the_occurrence_it_missed_while_paused_at_once() {
    use cronlease::store::{History, Locks, TriggerId};
    let w = World::new(VirtualRunner::default());
    let jobs = "[[job]]\nname = \"p\"\nschedule = \"*/10 * * * * *\"\ncommand = [\"/bin/true\"]\n\
        [[job]]\nname = \"q\"\nschedule = \"*/10 * * * * *\"\nstarting_deadline = \"1s\"\ncommand = [\"/bin/true\"]\n";
    let a = w.start("a", jobs);
    w.until(t(15.0)).await;
    let names = [
        cronlease::config::JobName::parse("p").unwrap(),
        cronlease::config::JobName::parse("q").unwrap(),
    ];
    let store = w.store.connection();
    store.set_paused(&names, true).await.unwrap();
    w.until(t(21.5)).await;
    store.set_paused(&names, false).await.unwrap();
    for name in &names {
        let answer = store
            .request_trigger(name, TriggerId::resumed(t(21.5)))
            .await
            .unwrap();
        assert_eq!(answer, cronlease::store::TriggerAnswer::Accepted);
    }
    w.until(t(31.0)).await;
    let runs = job_runs(&w, t(10.0));
    let of = |job: &str| runs_of(&runs, job);
    let p = of("p");
    assert_eq!(p.len(), 3, "{runs:?}");
    assert_eq!(p[0], (10_000, 10_000), "{runs:?}");
    // 12:00:20, within a second of the resume (the next beat's look, a claim).
    assert_eq!(p[1].0, 20_000, "{runs:?}");
    assert!((21_500..22_500).contains(&p[1].1), "{runs:?}");
    assert_eq!(p[2], (30_000, 30_000), "{runs:?}");
    assert_eq!(
        of("q"),
        vec![(10_000, 10_000), (30_000, 30_000)],
        "{runs:?}"
    );
    let history = store.history(Some(&names[1]), 10).await.unwrap();
    let missed: Vec<i64> = history
        .iter()
        .filter(|r| r.outcome == cronlease::store::Outcome::Missed)
        .map(|r| ms(r.occurrence - t(0.0)))
        .collect();
    assert_eq!(missed, vec![20_000], "{history:?}");
    assert_eq!(store.pending_triggers().await.unwrap(), vec![]);
    a.stop().await;
}

/// With `starting_deadline`, an occurrence is claimed only within it: a
/// node back 9.5 s after a missed occurrence with a 3 s deadline does not
/// run it; the next occurrence's claim, which the store answers with that
/// missed occurrence first, records it `missed` (saying why) and runs the
/// occurrence itself on time. A job every minute with a 1 s deadline,
/// missed 0.6 s before the node could claim, is run at once; one never
/// claimed before is not.
#[tokio::test(start_paused = true)]
async fn an_occurrence_past_its_starting_deadline_is_recorded_missed_not_run() {
    use cronlease::store::History;
    let w = World::new(VirtualRunner::default());
    ghost_claimed(&w, "late", t(-30.0)).await;
    let jobs = "[[job]]\nname = \"late\"\nschedule = \"*/10 * * * * *\"\nstarting_deadline = \"3s\"\ncommand = [\"/bin/true\"]\n\
        [[job]]\nname = \"fresh\"\nschedule = \"59 * * * * *\"\nstarting_deadline = \"1s\"\ncommand = [\"/bin/true\"]\n\
        [[job]]\nname = \"minute\"\nschedule = \"59 * * * * *\"\nstarting_deadline = \"1s\"\ncommand = [\"/bin/true\"]\n";
    ghost_claimed(&w, "minute", t(-61.0)).await;
    let a = w.start("a", jobs);
    w.until(t(1.5)).await;
    let runs = job_runs(&w, t(-3600.0));
    let of = |job: &str| runs_of(&runs, job);
    // 11:59:50 is not run (9.5 s late at the start, past 3 s).
    assert_eq!(of("late"), vec![(0, 0)], "{runs:?}");
    // 11:59:59 is run at once (0.6 s late, within 1 s).
    let minute = of("minute");
    assert_eq!(minute.len(), 1, "{runs:?}");
    assert!(
        minute[0].0 == -1_000 && (-500..-300).contains(&minute[0].1),
        "{runs:?}"
    );
    // A job no node ever claimed has nothing to catch up.
    assert_eq!(of("fresh"), vec![], "{runs:?}");
    let history = w
        .store
        .connection()
        .history(
            Some(&cronlease::config::JobName::parse("late").unwrap()),
            10,
        )
        .await
        .unwrap();
    // In fence order (the record of what nobody claimed is counted off
    // the claim's path, and may be written after the others).
    let mut outcomes: Vec<(u64, String, i64)> = history
        .iter()
        .map(|r| (r.fence, r.outcome.to_string(), ms(r.occurrence - t(0.0))))
        .collect();
    outcomes.sort();
    assert_eq!(
        outcomes,
        vec![
            (2, "missed".into(), -20_000),
            (3, "missed".into(), -10_000),
            (4, "ok".into(), 0)
        ],
        "{history:?}"
    );
    let missed = history.iter().find(|r| r.fence == 3).unwrap();
    assert!(
        missed.output.contains("past starting_deadline (3s"),
        "{}",
        missed.output
    );
    a.stop().await;
}

/// A claim whose reply is lost after the store applied it is retried and
/// recognised as won (same fence): the missed run it caught up still runs,
/// then the occurrence itself; nothing runs twice.
#[tokio::test(start_paused = true)]
async fn a_lost_claim_reply_loses_no_occurrence() {
    let w = World::new(VirtualRunner::default());
    ghost_claimed_11_59_30(&w).await;
    w.store.lose_claim_replies(1);
    let a = w.start("a", &jobs(1));
    w.until(t(15.0)).await;
    let runs: Vec<(u64, i64)> = w
        .runner
        .runs()
        .iter()
        .map(|r| (r.fence, ms(r.occurrence - t(0.0))))
        .collect();
    // Fence 3 went to the catch-up of 11:59:50 whose reply was lost (2 was
    // kept for 11:59:40: the win answered again does not say so, and
    // nothing is recorded under it).
    assert_eq!(runs, vec![(3, -10_000), (4, 0), (5, 10_000)]);
    a.stop().await;
}

/// A claim whose reply was lost, and then no answer until the occurrence's
/// window closed: the store had granted it, so peers left it alone. The
/// node asks once more (a recheck that takes nothing) and records the
/// occurrence as `lease_lost` instead of losing it silently; the next
/// occurrence runs as usual.
#[tokio::test(start_paused = true)]
async fn an_unanswered_win_found_too_late_is_recorded() {
    let w = World::new(VirtualRunner::default());
    w.store.lose_claim_replies(1);
    let a = w.start("a", &jobs(1));
    w.until(t(0.05)).await;
    a.store.set_reachable(false);
    // Back 0.4 s before 12:00:10: the retries (every second by then) have
    // not come again, the recheck 0.25 s before the next occurrence has.
    w.until(t(9.6)).await;
    a.store.set_reachable(true);
    w.until(t(15.0)).await;
    let runs: Vec<i64> = w
        .runner
        .runs()
        .iter()
        .map(|r| ms(r.occurrence - t(0.0)))
        .collect();
    assert_eq!(runs, vec![10_000], "12:00:00 was never run");
    assert_eq!(
        w.store.history_outcomes("j0000"),
        vec!["lease_lost".to_string(), "ok".to_string()]
    );
    a.stop().await;
}

/// A takeover whose lease wait ends in the last stretch before the next
/// occurrence is left to that occurrence's claim, which catches it up and
/// then runs in order. Started 50 ms before the next instant, the late run
/// would still be going when that instant is claimed, and the next
/// occurrence would be skipped (overlap = "skip"): seen in the takeover
/// benchmark as a gap after a kill -9.
#[tokio::test(start_paused = true)]
async fn a_takeover_at_the_end_of_its_window_is_caught_up_in_order() {
    let w = World::new(VirtualRunner::lasting("j0000", Duration::from_millis(100)));
    let every_second =
        "[[job]]\nname = \"j0000\"\nschedule = \"* * * * * *\"\ncommand = [\"/bin/true\"]\n";
    let a = w.start("a", every_second);
    // a is cut off after running 12:00:00, before that run's history write
    // (gathered for 250 ms) could clear its running mark: a busy holder,
    // whose lease is waited out. It ends at 12:00:01.950, 50 ms before
    // 12:00:02.
    w.until(t(0.2)).await;
    a.store.set_reachable(false);
    w.store.set_expiry_in("j0000", 1750);
    w.until(t(0.5)).await;
    let b = w.start("b", every_second);
    w.until(t(4.0)).await;
    let runs: Vec<(String, i64, i64)> = w
        .runner
        .runs()
        .iter()
        .map(|r| {
            (
                r.node.clone(),
                ms(r.occurrence - t(0.0)),
                ms(r.started - t(0.0)),
            )
        })
        .collect();
    assert_eq!(
        runs,
        vec![
            ("a".into(), 0, 0),
            ("b".into(), 1_000, 2_005),
            ("b".into(), 2_000, 2_105),
            ("b".into(), 3_000, 3_000)
        ]
    );
    assert!(
        !w.store
            .history_outcomes("j0000")
            .contains(&"skipped".to_string()),
        "{:?}",
        w.store.history_outcomes("j0000")
    );
    a.stop().await;
    b.stop().await;
}

/// A step-down that comes while a run is going releases the lease when
/// *that* run ends. Here the catch-up of 11:59:50 ends at 12:00:00.3 and the
/// run of 12:00:00 starts at once; the step-down comes 2 ms later, while the
/// catch-up's task is still writing its history. The catch-up's task must
/// leave the release to the run still going (it used to take it and end the
/// lease under that run, letting a peer start the next occurrence while it
/// still ran: found by the randomized drill with load jobs).
#[tokio::test(start_paused = true)]
async fn a_step_down_during_a_run_waits_for_that_run() {
    let w = World::new(VirtualRunner::lasting("j0000", Duration::from_millis(300)));
    ghost_claimed_11_59_30(&w).await;
    let a = w.start("a", &jobs(1));
    w.until(t(0.302)).await;
    a.node.step_down().await;
    w.until(t(2.0)).await;
    // (occurrence, started, (outcome, ended)), in ms from 12:00:00.
    type Timed = (i64, i64, Option<(Outcome, i64)>);
    let runs: Vec<Timed> = w
        .runner
        .runs()
        .iter()
        .map(|r| {
            (
                ms(r.occurrence - t(0.0)),
                ms(r.started - t(0.0)),
                r.ended.clone().map(|(o, at)| (o, ms(at - t(0.0)))),
            )
        })
        .collect();
    assert_eq!(
        runs,
        vec![
            (-10_000, 0, Some((Outcome::Ok, 300))),
            (0, 300, Some((Outcome::Ok, 600)))
        ]
    );
    // The lease was released once, when the run of 12:00:00 was over (plus
    // the history write's 5 ms batching), never under it.
    let releases: Vec<i64> = w
        .store
        .call_log()
        .iter()
        .filter(|c| c.op == "release")
        .map(|c| ms(c.at - t(0.0)))
        .collect();
    assert_eq!(releases.len(), 1, "{releases:?}");
    assert!(releases[0] >= 600, "released under the run: {releases:?}");
    a.stop().await;
}

/// A running job's lease is renewed once a third of the provable time is
/// left; the run outlasts its interval (later occurrences are skipped) and
/// ends ok.
#[tokio::test(start_paused = true)]
async fn a_long_run_is_renewed_at_a_third_left() {
    let w = World::new(VirtualRunner::lasting("j0000", Duration::from_secs(25)));
    let a = w.start("a", &jobs(1));
    w.until(t(30.0)).await;
    let renewals: Vec<i64> = w
        .store
        .call_log()
        .iter()
        .filter(|c| c.op == "renew")
        .map(|c| ms(c.at - t(0.0)))
        .collect();
    // Lease 11 s, margin 1 s: the local deadline is 11 s − 0.5 s − 11 ms =
    // 10.489 s after the claim; renewal at two thirds of it (6.993 s), plus
    // up to 5 ms of batching window. The claim of 12:00:10 (won: the lease
    // is this node's; skipped: the run goes on) extends the lease too, so
    // the next renewal comes two thirds after it.
    assert!(renewals.len() >= 2, "{renewals:?}");
    assert!(
        (6_992..=7_000).contains(&renewals[0]),
        "first renewal at {renewals:?}"
    );
    assert!(
        (16_992..=17_000).contains(&renewals[1]),
        "second renewal at {renewals:?}"
    );
    let runs = w.runner.runs();
    assert_eq!(
        runs[0].ended.as_ref().map(|e| e.0.clone()),
        Some(Outcome::Ok)
    );
    assert_eq!(
        runs[0].ended.as_ref().map(|e| ms(e.1 - t(0.0))),
        Some(25_000)
    );
    let history = w.store.history_outcomes("j0000");
    assert_eq!(history, ["ok", "skipped", "skipped"], "in fence order");
    a.stop().await;
}

/// A holder that cannot renew kills its run at the local deadline (sent +
/// lease − margin/2 − 0.1% of the lease), before the store could let a peer
/// in, and records lease_lost.
#[tokio::test(start_paused = true)]
async fn an_unrenewable_run_is_killed_at_the_local_deadline() {
    let w = World::new(VirtualRunner::lasting("j0000", Duration::from_secs(60)));
    let a = w.start("a", &jobs(1));
    w.until(t(2.0)).await;
    a.store.set_reachable(false);
    w.until(t(10.7)).await;
    a.store.set_reachable(true);
    w.until(t(13.0)).await;
    let runs = w.runner.runs();
    let (outcome, at) = runs[0].ended.clone().expect("the run was stopped");
    assert_eq!(outcome, Outcome::LeaseLost);
    assert_eq!(ms(at - t(0.0)), 10_489);
    assert_eq!(w.store.history_outcomes("j0000")[0], "lease_lost");
    a.stop().await;
}

/// Step-down releases the lease and claims nothing for one margin: a peer
/// runs the next occurrence on time, not a margin late.
#[tokio::test(start_paused = true)]
async fn step_down_hands_the_next_occurrence_over_on_time() {
    let w = World::new(VirtualRunner::default());
    let a = w.start("a", &jobs(3));
    w.until(t(1.0)).await;
    let b = w.start("b", &jobs(3));
    w.until(t(9.5)).await;
    a.node.step_down().await;
    w.until(t(15.0)).await;
    let at_ten: Vec<(String, i64)> = w
        .runner
        .runs()
        .iter()
        .filter(|r| r.occurrence == t(10.0))
        .map(|r| (r.node.clone(), ms(r.started - r.occurrence)))
        .collect();
    assert_eq!(
        at_ten,
        vec![("b".into(), 0), ("b".into(), 0), ("b".into(), 0)]
    );
    let released: usize = w
        .store
        .call_log()
        .iter()
        .filter(|c| c.op == "release")
        .map(|c| c.requests)
        .sum();
    assert_eq!(released, 3, "one release call for the three leases");
    a.stop().await;
    b.stop().await;
}

/// A step-down drains its node of the jobs it gave up (issue 36: the node
/// won them back at their next instant once its pause was over, so
/// `drill --step-down` failed 2 times in 3): it claims each only after its
/// head start until another node holds it. With no peer to take them it
/// still runs them, a head start late, and then on time again.
#[tokio::test(start_paused = true)]
async fn a_stepped_down_node_stays_out_of_the_race_until_a_peer_holds_its_jobs() {
    let w = World::new(VirtualRunner::default());
    let a = w.start("a", &jobs(3));
    w.until(t(1.0)).await;
    let b = w.start("b", &jobs(3));
    w.until(t(15.0)).await;
    assert!(runs_at(&w, 10.0).iter().all(|(n, _)| n == "a"));
    // The pause (one margin, 1 s) is over long before the next instant.
    a.node.step_down().await;
    w.until(t(35.0)).await;
    assert_eq!(
        runs_at(&w, 20.0),
        vec![("b".into(), 5), ("b".into(), 5), ("b".into(), 5)],
        "b took them over; a did not win them back"
    );
    assert_eq!(
        runs_at(&w, 30.0),
        vec![("b".into(), 0), ("b".into(), 0), ("b".into(), 0)]
    );
    // Held elsewhere, they are a's to take over again as any follower's.
    b.stop().await;
    w.until(t(45.0)).await;
    let forty = runs_at(&w, 40.0);
    assert!(
        forty.len() == 3 && forty.iter().all(|(n, late)| n == "a" && *late < 100),
        "{forty:?}"
    );
    a.stop().await;

    // Alone, a stepped-down node still runs what it gave up.
    let w = World::new(VirtualRunner::default());
    let a = w.start("a", &jobs(1));
    w.until(t(15.0)).await;
    a.node.step_down().await;
    w.until(t(35.0)).await;
    let twenty = runs_at(&w, 20.0);
    assert!(
        twenty.len() == 1 && twenty[0].0 == "a" && (50..200).contains(&twenty[0].1),
        "after its head start: {twenty:?}"
    );
    assert_eq!(runs_at(&w, 30.0), vec![("a".into(), 0)], "then on time");
    a.stop().await;
}

/// A graceful stop releases the leases of idle jobs at once, not after its
/// running jobs finish: here j0000 runs 30 s from 12:00:00, and node a is
/// told to stop at 12:00:05 (its grace, 30 s, lets that run go on). Its
/// idle j0001 goes to b at 12:00:10 on time. a used to hold j0001's lease
/// (10 s + the 1 s margin) through its grace: b then ran it only after the
/// idle holder's head start (51 ms late here), and a full margin late where
/// the store still marked the holder's last run as going (the randomized
/// drill on SQLite: 1,065 ms late, then an occurrence missed).
#[tokio::test(start_paused = true)]
async fn a_graceful_stop_releases_idle_leases_before_its_runs_end() {
    let w = World::new(VirtualRunner::lasting("j0000", Duration::from_secs(30)));
    let a = w.start("a", &jobs(2));
    w.until(t(1.0)).await;
    let b = w.start("b", &jobs(2));
    w.until(t(5.0)).await;
    a.shutdown.cancel();
    w.until(t(12.0)).await;
    let at_ten: Vec<(String, String, i64)> = w
        .runner
        .runs()
        .iter()
        .filter(|r| r.occurrence == t(10.0))
        .map(|r| (r.job.clone(), r.node.clone(), ms(r.started - r.occurrence)))
        .collect();
    assert_eq!(at_ten, vec![("j0001".into(), "b".into(), 0)]);
    // a's run of j0000 went on through the stop.
    let long_run = w
        .runner
        .runs()
        .into_iter()
        .find(|r| r.job == "j0000" && r.occurrence == t(0.0))
        .expect("j0000 ran at 12:00:00");
    assert_eq!(
        (long_run.node.as_str(), long_run.ended.is_none()),
        ("a", true),
        "j0000's run goes on at 12:00:12"
    );
    a.task.await.unwrap();
    b.stop().await;
}

/// `cronlease pause` as the nodes see it: every claim of the paused job is
/// refused at once (one refused claim per node per instant, counted in
/// `cronlease_claims_total{result="paused"}`, no waiting for a lease), and
/// nothing runs; after resume the latest occurrence refused meanwhile is
/// caught up first (`misfire = "run_once"`), then the instants go on.
#[tokio::test(start_paused = true)]
async fn a_paused_job_runs_nowhere_until_resumed() {
    use cronlease::store::Locks;
    let w = World::new(VirtualRunner::default());
    let (a, b) = (w.start("a", &jobs(1)), w.start("b", &jobs(1)));
    w.until(t(1.0)).await;
    let job = cronlease::config::JobName::parse("j0000").unwrap();
    w.store
        .connection()
        .set_paused(std::slice::from_ref(&job), true)
        .await
        .unwrap();
    w.until(t(35.0)).await;
    let runs = |w: &World| -> Vec<(u64, i64, i64)> {
        w.runner
            .runs()
            .iter()
            .map(|r| (r.fence, ms(r.occurrence - t(0.0)), ms(r.started - t(0.0))))
            .collect()
    };
    assert_eq!(runs(&w), vec![(1, 0, 0)], "nothing runs while paused");
    let paused = |n: &Running| -> u64 {
        n.node
            .metrics()
            .encode()
            .lines()
            .filter(|l| l.starts_with("cronlease_claims_total{") && l.contains("result=\"paused\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    assert_eq!(
        (paused(&a), paused(&b)),
        (3, 3),
        "10, 20 and 30 refused once on each node"
    );
    w.store
        .connection()
        .set_paused(std::slice::from_ref(&job), false)
        .await
        .unwrap();
    w.until(t(41.0)).await;
    assert_eq!(
        runs(&w),
        vec![(1, 0, 0), (3, 30_000, 40_000), (4, 40_000, 40_000)],
        "30 caught up at 40 (2 kept for 10 and 20: nobody claimed them), then 40"
    );
    a.stop().await;
    b.stop().await;
}

/// A pause that lands while a peer waits out a busy holder's lease (the
/// holder cut off from the store mid-run, so its run is never recorded and
/// its lease must run out): the peer's claim at the lease's end is refused as
/// paused and nothing is claimed until resume; then the latest refused
/// occurrence is caught up once and the schedule goes on.
#[tokio::test(start_paused = true)]
async fn a_pause_during_a_takeover_wait_stops_the_takeover() {
    let w = World::new(VirtualRunner::lasting("j0000", Duration::from_secs(4)));
    let a = w.start("a", &jobs(1));
    w.until(t(1.0)).await;
    let b = w.start("b", &jobs(1));
    w.until(t(2.0)).await;
    a.store.set_reachable(false);
    // b is refused at 12:00:10 (a's lease lasts to :11, its run unrecorded)
    // and waits; the pause comes inside that wait.
    w.until(t(10.5)).await;
    let job = cronlease::config::JobName::parse("j0000").unwrap();
    use cronlease::store::Locks;
    w.store
        .connection()
        .set_paused(std::slice::from_ref(&job), true)
        .await
        .unwrap();
    w.until(t(35.0)).await;
    let claimed_after_pause: Vec<i64> = w
        .store
        .call_log()
        .iter()
        .filter(|c| c.op == "claim" && c.at > t(10.5))
        .map(|c| ms(c.at - t(0.0)))
        .collect();
    assert!(
        claimed_after_pause
            .first()
            .is_some_and(|at| (11_000..11_100).contains(at)),
        "b asked again when the lease ended: {claimed_after_pause:?}"
    );
    let runs = |w: &World| -> Vec<(String, u64, i64, i64)> {
        w.runner
            .runs()
            .iter()
            .map(|r| {
                (
                    r.node.clone(),
                    r.fence,
                    ms(r.occurrence - t(0.0)),
                    ms(r.started - t(0.0)),
                )
            })
            .collect()
    };
    assert_eq!(
        runs(&w),
        vec![("a".into(), 1, 0, 0)],
        "no takeover while paused"
    );
    w.store
        .connection()
        .set_paused(std::slice::from_ref(&job), false)
        .await
        .unwrap();
    w.until(t(51.0)).await;
    // The catch-up of 30 starts at 40 (after the history write's 5 ms
    // batching window), 40 itself once it is over (4 s later: the claims of
    // one instant run in order), and 50 on time.
    assert_eq!(
        runs(&w),
        vec![
            ("a".into(), 1, 0, 0),
            ("b".into(), 3, 30_000, 40_005),
            ("b".into(), 4, 40_000, 44_005),
            ("b".into(), 5, 50_000, 50_000)
        ],
    );
    b.stop().await;
    a.store.set_reachable(true);
    a.stop().await;
}

/// `spread` takes over a dead preferred node's idle job exactly as fast as
/// `sticky` takes over a dead holder's: the preferred node holds it, so
/// the others claim it like followers and the store's head start decides
/// (not a local wait of the head start plus a lag). The holder is cut off
/// 0.1 s before 12:00:30, so its registry record is still live then.
#[tokio::test(start_paused = true)]
async fn spread_takes_over_a_cut_off_preferred_node_as_fast_as_sticky() {
    let mut takeovers = Vec::new();
    for placement in ["sticky", "spread"] {
        let w = World::new(VirtualRunner::default());
        let jobs = format!("[cluster]\nplacement = \"{placement}\"\n{}", jobs(1));
        let mut nodes = BTreeMap::from([("a", w.start("a", &jobs))]);
        w.until(t(1.0)).await;
        nodes.insert("b", w.start("b", &jobs));
        // Three periods: with `spread` the job has settled on its
        // preferred node, which holds it between runs.
        w.until(t(29.9)).await;
        let runs = w.runner.runs();
        let holder = runs
            .iter()
            .find(|r| r.occurrence == t(20.0))
            .map(|r| r.node.clone())
            .unwrap();
        nodes[holder.as_str()].store.set_reachable(false);
        w.until(t(35.0)).await;
        let runs = w.runner.runs();
        let at_30: Vec<&Run> = runs.iter().filter(|r| r.occurrence == t(30.0)).collect();
        assert_eq!(at_30.len(), 1, "{placement}: {runs:?}");
        assert_ne!(at_30[0].node, holder, "{placement}");
        takeovers.push((placement, ms(at_30[0].started - at_30[0].occurrence)));
        for (name, node) in nodes {
            if name == holder {
                node.store.set_reachable(true);
            }
            node.stop().await;
        }
    }
    // The head start is 50 ms; the store says how much of it is left and
    // the follower asks again 1 ms after it.
    for (placement, late) in &takeovers {
        assert!((50..=55).contains(late), "{placement}: {late} ms late");
    }
    assert!(takeovers[1].1 <= takeovers[0].1, "{takeovers:?}");
}

/// `placement = "spread"` on the node logic alone, the in-process form of
/// `many::<store>::spread_over_three_nodes` (which runs it on real stores,
/// four in the default tier and all eight in the long tier): three nodes
/// share 300 jobs due every 10 s; two periods after the start each runs
/// 100 ± 15 of them per instant. One is killed (cut off, its task gone,
/// no guard): its jobs go to the other two at the next instant, within
/// the margin. It starts again: within two periods it has its share back.
/// Every occurrence of every job runs exactly once throughout, with
/// increasing fences.
#[tokio::test(start_paused = true)]
async fn spread_balances_three_nodes_moves_a_dead_ones_share_and_gives_it_back() {
    const JOBS: usize = 300;
    let w = World::new(VirtualRunner::default());
    let jobs = format!("[cluster]\nplacement = \"spread\"\n{}", jobs(JOBS));
    let mut nodes: BTreeMap<&str, Running> = ["n1", "n2", "n3"]
        .into_iter()
        .map(|n| (n, w.start(n, &jobs)))
        .collect();
    let instant = |k: i64| t(10.0 * k as f64);
    w.until(instant(2) + chrono::TimeDelta::milliseconds(2_500))
        .await;
    let dead = nodes.remove("n2").unwrap();
    dead.store.set_reachable(false);
    dead.task.abort();
    w.until(instant(3) + chrono::TimeDelta::milliseconds(2_500))
        .await;
    nodes.insert("n2", w.start("n2", &jobs));
    w.until(instant(6) + chrono::TimeDelta::milliseconds(2_500))
        .await;
    let runs = w.runner.runs();
    for (_, node) in nodes {
        node.stop().await;
    }
    // (job, instant) → the runs of it: (fence, node, lateness ms).
    type Seen = BTreeMap<(String, i64), Vec<(u64, String, i64)>>;
    let mut seen = Seen::new();
    for r in &runs {
        let k = (r.occurrence - t(0.0)).num_seconds() / 10;
        seen.entry((r.job.clone(), k)).or_default().push((
            r.fence,
            r.node.clone(),
            ms(r.started - r.occurrence),
        ));
    }
    let mut shares: BTreeMap<i64, BTreeMap<String, usize>> = BTreeMap::new();
    let mut worst_at_kill = 0;
    for i in 0..JOBS {
        let job = format!("j{i:04}");
        let mut last_fence = 0;
        for k in 0..=6 {
            match seen.get(&(job.clone(), k)).map(Vec::as_slice) {
                Some([(fence, node, late)]) => {
                    assert!(*fence > last_fence, "{job}: fences out of order");
                    last_fence = *fence;
                    *shares
                        .entry(k)
                        .or_default()
                        .entry(node.clone())
                        .or_default() += 1;
                    if k == 3 {
                        worst_at_kill = worst_at_kill.max(*late);
                    }
                }
                other => panic!("{job} at instant {k}: {other:?}"),
            }
        }
    }
    let balanced = |k: i64| {
        ["n1", "n2", "n3"]
            .iter()
            .all(|n| shares[&k].get(*n).copied().unwrap_or(0).abs_diff(JOBS / 3) <= 15)
    };
    assert!(balanced(2), "two periods after the start: {shares:?}");
    assert!(
        !shares[&3].contains_key("n2"),
        "the dead node ran: {shares:?}"
    );
    assert!(
        balanced(5) && balanced(6),
        "two periods after the restart: {shares:?}"
    );
    assert!(
        worst_at_kill <= 1_000,
        "the dead node's jobs moved {worst_at_kill} ms late"
    );
}

/// A reload (SIGHUP's [`Node::apply_jobs`]) as `drills::reload` checks it
/// on every store: a job removed mid-run finishes that run (not killed) and
/// is claimed no more, its lease released when the run ends; a job added
/// runs from its next instant; a job kept runs on.
#[tokio::test(start_paused = true)]
async fn a_reload_lets_a_removed_jobs_run_finish_and_starts_an_added_one() {
    use cronlease::store::Locks;
    let w = World::new(VirtualRunner::lasting("j0000", Duration::from_secs(15)));
    let world_jobs = |names: &[&str]| -> Vec<cronlease::config::Job> {
        let text: String = names
            .iter()
            .map(|n| format!("[[job]]\nname = \"{n}\"\nschedule = \"*/10 * * * * *\"\ncommand = [\"/bin/true\"]\n"))
            .collect();
        w.config("a", "1s", &text).jobs
    };
    let a = w.start("a", &jobs(2));
    // j0000's run of 12:00:00 lasts to 12:00:15; the reload at 12:00:05
    // removes it and adds j0005.
    w.until(t(5.0)).await;
    a.node.apply_jobs(world_jobs(&["j0001", "j0005"]));
    // Renewed while it ran, the lease would last past 12:00:20: released
    // as the run ended, it is free at once.
    w.until(t(15.5)).await;
    let held = w.store.connection().status().await.unwrap();
    let j0000 = held.iter().find(|l| l.job == "j0000").unwrap();
    assert_eq!(
        j0000.holder, None,
        "the removed job's lease was released after its run: {j0000:?}"
    );
    w.until(t(32.0)).await;
    /// Job, occurrence (ms after 12:00:00), and how and when it ended.
    type Seen = (String, i64, Option<(Outcome, i64)>);
    let runs: Vec<Seen> = w
        .runner
        .runs()
        .iter()
        .map(|r| {
            (
                r.job.clone(),
                ms(r.occurrence - t(0.0)),
                r.ended
                    .as_ref()
                    .map(|(o, at)| (o.clone(), ms(*at - t(0.0)))),
            )
        })
        .collect();
    let of = |job: &str| -> Vec<_> { runs.iter().filter(|r| r.0 == job).cloned().collect() };
    assert_eq!(
        of("j0000"),
        [("j0000".to_string(), 0, Some((Outcome::Ok, 15_000)))],
        "the removed job's run finished, and it ran no more: {runs:?}"
    );
    let occurrences = |job: &str| -> Vec<i64> { of(job).iter().map(|r| r.1).collect() };
    assert_eq!(occurrences("j0001"), [0, 10_000, 20_000, 30_000]);
    assert_eq!(occurrences("j0005"), [10_000, 20_000, 30_000]);
    a.stop().await;
}

/// `retry`: attempts 1 and 2 of 12:00:00 fail, 3 succeeds. The node that
/// ran attempt 1 is killed (cut off, its task gone) a second later, with
/// attempt 2 in the store: the other node runs attempts 2 and 3, each
/// once, when due (2 s, then 4 s, ±20 %), as 12:00:00's, with fences above
/// the first; `on_failure` never runs (no failure was final), history
/// names each attempt, and 12:01:00 runs (and fails) as attempt 1.
#[tokio::test(start_paused = true)]
async fn a_failed_run_is_tried_again_once_per_attempt_by_a_peer_after_its_holder_dies() {
    use cronlease::store::{History, TriggerId};
    let w = World::new(VirtualRunner::failing("flaky", 3));
    let jobs = "[[job]]\nname = \"flaky\"\nschedule = \"0 * * * * *\"\ncommand = [\"/bin/false\"]\n\
        on_failure = [\"/bin/true\"]\nretry = { attempts = 4, backoff = \"2s\" }\n";
    let mut nodes: BTreeMap<String, Running> = ["a", "b"]
        .into_iter()
        .map(|n| (n.to_string(), w.start(n, jobs)))
        .collect();
    w.until(t(1.0)).await;
    let first = w.runner.runs();
    assert_eq!(first.len(), 1, "{first:?}");
    let holder = first[0].node.clone();
    let dead = nodes.remove(&holder).unwrap();
    dead.store.set_reachable(false);
    dead.task.abort();
    w.until(t(60.5)).await;
    let runs = w.runner.runs();
    for (_, node) in nodes {
        node.stop().await;
    }
    let of_noon: Vec<&Run> = runs.iter().filter(|r| r.occurrence == t(0.0)).collect();
    let seen: Vec<(u32, &str, Option<Outcome>)> = of_noon
        .iter()
        .map(|r| {
            (
                r.attempt,
                r.node.as_str(),
                r.ended.as_ref().map(|e| e.0.clone()),
            )
        })
        .collect();
    let peer = if holder == "a" { "b" } else { "a" };
    assert_eq!(
        seen,
        vec![
            (1, holder.as_str(), Some(Outcome::Failed)),
            (2, peer, Some(Outcome::Failed)),
            (3, peer, Some(Outcome::Ok)),
        ],
        "{runs:?}"
    );
    assert!(of_noon.iter().all(|r| r.hook.is_none()), "{runs:?}");
    // Fences rise; each attempt starts at its due time, 2 s ± 20 % after
    // the failure, then 4 s ± 20 %: the node, idle between them, looks for
    // the request when it is due (a claim's 5 ms later), not at its next
    // beat (up to 1.25 s later).
    assert!(of_noon[0].fence < of_noon[1].fence && of_noon[1].fence < of_noon[2].fence);
    let gap = |a: &Run, b: &Run| ms(b.started - a.ended.as_ref().unwrap().1);
    assert!(
        (1_600..2_450).contains(&gap(of_noon[0], of_noon[1])),
        "{runs:?}"
    );
    assert!(
        (3_200..4_850).contains(&gap(of_noon[1], of_noon[2])),
        "{runs:?}"
    );
    // The next occurrence is a first attempt again, on time.
    let next: Vec<(u32, i64)> = runs
        .iter()
        .filter(|r| r.occurrence == t(60.0))
        .map(|r| (r.attempt, ms(r.started - r.occurrence)))
        .collect();
    assert_eq!(next, vec![(1, 0)], "{runs:?}");
    let history = w
        .store
        .connection()
        .history(Some(&config::JobName::parse("flaky").unwrap()), 10)
        .await
        .unwrap();
    let mut records: Vec<(u64, String, i64, u32)> = history
        .iter()
        .map(|r| {
            (
                r.fence,
                r.outcome.to_string(),
                ms(r.occurrence - t(0.0)),
                TriggerId::attempt(r.trigger),
            )
        })
        .collect();
    records.sort();
    let shape: Vec<(&str, i64, u32)> = records
        .iter()
        .map(|(_, o, at, k)| (o.as_str(), *at, *k))
        .collect();
    assert_eq!(
        shape,
        vec![
            ("failed", 0, 1),
            ("failed", 0, 2),
            ("ok", 0, 3),
            ("failed", 60_000, 1)
        ],
        "{records:?}"
    );
}

/// The last attempt's failure is final: `on_failure` runs once, after it,
/// and no attempt follows. An attempt still pending when its occurrence's
/// next is due (the only node cut off from the store until then) is not
/// run: the node records it `missed`, saying why, and `on_failure` follows.
#[tokio::test(start_paused = true)]
async fn on_failure_follows_only_the_final_attempt_and_an_attempt_overtaken_by_the_next_occurrence_is_missed()
 {
    use cronlease::store::History;
    let w = World::new(VirtualRunner {
        fail_below: [("always".to_string(), 99), ("cut".to_string(), 99)].into(),
        ..Default::default()
    });
    let jobs = "[[job]]\nname = \"always\"\nschedule = \"25 * * * * *\"\ncommand = [\"/bin/false\"]\n\
        on_failure = [\"/bin/true\"]\nretry = { attempts = 2, backoff = \"1s\" }\n\
        [[job]]\nname = \"cut\"\nschedule = \"*/20 * * * * *\"\ncommand = [\"/bin/false\"]\n\
        on_failure = [\"/bin/true\"]\nretry = { attempts = 3, backoff = \"5s\", max_backoff = \"5s\" }\n";
    let a = w.start("a", jobs);
    // `cut` fails at 12:00:00; its attempt 2 is due at 12:00:04–05, but
    // the node cannot reach the store from 12:00:01 to 12:00:21.
    w.until(t(1.0)).await;
    a.store.set_reachable(false);
    w.until(t(21.0)).await;
    a.store.set_reachable(true);
    w.until(t(30.0)).await;
    let runs = w.runner.runs();
    a.stop().await;
    let of = |job: &str, at: f64| -> Vec<(u32, Option<config::Hook>)> {
        runs.iter()
            .filter(|r| r.job == job && r.occurrence == t(at))
            .map(|r| (r.attempt, r.hook))
            .collect()
    };
    // 12:00:25: two attempts, then `on_failure` once.
    assert_eq!(
        of("always", 25.0),
        vec![(1, None), (2, None), (2, Some(config::Hook::Failure))],
        "{runs:?}"
    );
    // `cut`: attempt 1, never attempt 2; `on_failure` once, for the
    // missed attempt 2 (`CRONLEASE_ATTEMPT=2`).
    assert_eq!(
        of("cut", 0.0),
        vec![(1, None), (2, Some(config::Hook::Failure))],
        "{runs:?}"
    );
    // 12:00:20 (run late, at 12:00:21, once the store answered) fails and
    // gets its own attempt 2, whatever was left of 12:00:00's.
    assert_eq!(of("cut", 20.0)[..2], [(1, None), (2, None)], "{runs:?}");
    let history = w
        .store
        .connection()
        .history(Some(&config::JobName::parse("cut").unwrap()), 10)
        .await
        .unwrap();
    let noon: Vec<(String, String)> = history
        .iter()
        .filter(|r| r.occurrence == t(0.0))
        .map(|r| (r.outcome.to_string(), r.output.clone()))
        .collect();
    assert_eq!(noon.len(), 2, "{noon:?}");
    assert!(noon.iter().any(|(o, _)| o == "failed"), "{noon:?}");
    assert!(
        noon.iter().any(|(o, out)| o == "missed"
            && out.contains("attempt 2/3")
            && out.contains("the next occurrence")),
        "{noon:?}"
    );
}
