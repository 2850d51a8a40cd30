//! `cronlease drill`: the failover drill operators run by killing the
//! leader, done for them with a verdict (docs/cli.md).
//!
//! On the host whose daemon holds leases: read which jobs that daemon holds
//! (its owner from the node registry; their fence and last occurrence),
//! disturb it through its pid file (SIGKILL, SIGTERM or SIGUSR1 for a
//! step-down; [`pidfile::daemon_pid`] refuses any process that is not
//! `cronlease run` with this config), then watch the store until every one
//! of those jobs is held by another node or the watch ([`watch_for`]) ends.
//! The report gives, per job, the
//! old and new holder, the fence before and after, the takeover's lateness
//! after its scheduled instant, and from history the occurrences in between
//! that no run covered (missed) or that ran twice (doubled).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use nix::sys::signal::Signal;
use serde::Serialize;

use crate::config::{Config, JobName};
use crate::pidfile::{self, PidFileError};
use crate::schedule::Schedule;
use crate::store::{LockStatus, Outcome, Owner, RunRecord, Store, StoreError, bounded};

/// How the drill disturbs the local daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Disturbance {
    /// SIGKILL: a crash (its guard kills its jobs and hands the leases over).
    Kill,
    /// SIGTERM: a clean stop (runs finish within `shutdown_grace`).
    Term,
    /// SIGUSR1: the daemon releases its leases and keeps running.
    StepDown,
}

impl Disturbance {
    fn signal(self) -> Signal {
        match self {
            Disturbance::Kill => Signal::SIGKILL,
            Disturbance::Term => Signal::SIGTERM,
            Disturbance::StepDown => Signal::SIGUSR1,
        }
    }

    /// How the report names the signal.
    pub fn describe(self) -> &'static str {
        match self {
            Disturbance::Kill => "SIGKILL",
            Disturbance::Term => "SIGTERM",
            Disturbance::StepDown => "SIGUSR1 (step-down)",
        }
    }
}

/// Why a drill could not be run (nothing was disturbed), or broke off.
#[derive(Debug, thiserror::Error)]
pub enum DrillError {
    #[error("{0}")]
    PidFile(#[from] PidFileError),
    #[error("no job named {0:?} in the configuration; `cronlease check` lists the jobs")]
    NoSuchJob(String),
    #[error(
        "the daemon of node {node} holds no live lease{of}: nothing to take over; run the drill on the host `cronlease status` shows as holder"
    )]
    NothingHeld { node: String, of: String },
    #[error(
        "{count} live daemons call themselves node {node} in the node registry: the drill cannot tell which one it disturbs; give each host its own `node` (a daemon killed a moment ago leaves its record for up to its life, 2.33 s at the default margin: then retry)"
    )]
    SameNodeName { node: String, count: usize },
    #[error(
        "no other live node is in the node registry: nobody would take over node {node}'s jobs, and the drill would only make them miss occurrences; start another node first, or give --force to drill anyway"
    )]
    NoPeer { node: String },
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("cannot signal cronlease pid {pid}: {source}")]
    Signal { pid: i32, source: nix::errno::Errno },
}

/// One job's part of the report.
#[derive(Debug, Clone, Serialize)]
pub struct JobReport {
    pub job: String,
    /// The node that held the job before the drill.
    pub old_holder: String,
    pub fence_before: u64,
    /// The occurrence the old holder had claimed last.
    pub last_occurrence_before: Option<DateTime<Utc>>,
    /// The node holding it after (None: nobody took over in time).
    pub new_holder: Option<String>,
    pub fence_after: Option<u64>,
    /// The occurrence the new holder claimed.
    pub takeover_occurrence: Option<DateTime<Utc>>,
    /// How late after that occurrence's instant the new holder's run began
    /// (from its history record), or was seen holding the lease.
    pub takeover_delay_ms: Option<u64>,
    /// Scheduled instants between the two holders that no run covered.
    pub missed: Vec<DateTime<Utc>>,
    /// Occurrences that ran more than once.
    pub doubled: Vec<DateTime<Utc>>,
    /// No peer took over, but this node holds the job again with this
    /// fence (restarted, or stepped down and won the next occurrence).
    pub back_on_this_node: Option<u64>,
    /// A store call that failed while watching or reading history.
    pub error: Option<String>,
}

impl JobReport {
    /// Taken over, with no occurrence missed or doubled.
    pub fn passed(&self) -> bool {
        self.new_holder.is_some()
            && self.missed.is_empty()
            && self.doubled.is_empty()
            && self.error.is_none()
    }
}

/// The whole report (`drill --json` prints it).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub disturbance: Disturbance,
    pub pid: i32,
    pub node: String,
    pub disturbed_at: DateTime<Utc>,
    /// How long the drill watched, at most twice the longest lease.
    pub watched_ms: u64,
    pub jobs: Vec<JobReport>,
    pub passed: bool,
}

/// How often the store is asked while watching.
const POLL: Duration = Duration::from_millis(100);
/// How long, after the takeovers, the drill waits for their runs' history.
const HISTORY_WAIT: Duration = Duration::from_secs(3);
/// The most missed instants listed per job (a job that fires every second
/// and was never taken over would list the whole watch).
const MISSED_LISTED: usize = 100;
/// The most history read per job to judge misses and doubles.
const HISTORY_READ: u32 = 1000;

/// What was held before the drill.
struct Held {
    job: JobName,
    owner: String,
    fence: u64,
    last_occurrence: Option<DateTime<Utc>>,
}

/// What the watch saw of a takeover.
struct Taken {
    owner: String,
    fence: u64,
    occurrence: Option<DateTime<Utc>>,
    seen: DateTime<Utc>,
}

/// What a drill is asked to do.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub how: Disturbance,
    /// Only these of the jobs the daemon holds (empty: all).
    pub only: &'a [JobName],
    /// Drill even with no other live node in the registry to take over.
    pub force: bool,
}

/// Runs the drill `ask`; `call` bounds each store call.
pub async fn run(
    config: &Config,
    store: &dyn Store,
    ask: Ask<'_>,
    call: Duration,
) -> Result<Report, DrillError> {
    let Ask { how, only, force } = ask;
    let mut wanted = Vec::new();
    for name in only {
        match config.job(name.as_str()) {
            Some(j) => wanted.push(j.name.clone()),
            None => return Err(DrillError::NoSuchJob(name.as_str().to_string())),
        }
    }
    let pid = pidfile::daemon_pid(&config.pid_file, &config.path)?;
    let node = config.node.as_str().to_string();
    let own = own_owner(store, &node, force, call).await?;
    let locks = bounded(call, store.status()).await?;
    let held = held_jobs(config, &locks, &wanted, own.as_deref(), &node);
    if held.is_empty() {
        let of = if wanted.is_empty() {
            String::new()
        } else {
            let names: Vec<&str> = wanted.iter().map(JobName::as_str).collect();
            format!(" of {}", names.join(", "))
        };
        return Err(DrillError::NothingHeld { node, of });
    }
    let disturbed_at = Utc::now();
    let mut watch = held
        .iter()
        .filter_map(|h| config.job(h.job.as_str()))
        .map(|j| watch_for(&j.schedule, disturbed_at, config.lease_margin))
        .max()
        .unwrap_or(config.lease_margin);
    if how == Disturbance::Term {
        // A clean stop lets running jobs finish, on their leases.
        watch += config.shutdown_grace;
    }
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), how.signal())
        .map_err(|source| DrillError::Signal { pid, source })?;
    let started = tokio::time::Instant::now();
    let seen = watch_takeovers(store, &held, started + watch, call).await;
    let watched = started.elapsed();
    let histories = read_histories(store, &held, &seen.taken, call).await;

    let now = Utc::now();
    let reports: Vec<JobReport> = held
        .iter()
        .map(|h| {
            let (runs, history_error) = match histories.get(&h.job) {
                Some(Ok(runs)) => (runs.as_slice(), None),
                Some(Err(e)) => (&[][..], Some(e.clone())),
                None => (&[][..], None),
            };
            let schedule = config.job(h.job.as_str()).map(|j| &j.schedule);
            let mut report = judge(
                h,
                seen.taken.get(&h.job),
                runs,
                schedule,
                now,
                config.lease_margin,
            );
            if report.new_holder.is_none() {
                report.back_on_this_node = seen.back.get(&h.job).copied();
                report.error = seen.store_error.clone();
            }
            if history_error.is_some() {
                report.error = history_error;
            }
            report
        })
        .collect();
    Ok(Report {
        disturbance: how,
        pid,
        node,
        disturbed_at,
        watched_ms: u64::try_from(watched.as_millis()).unwrap_or(u64::MAX),
        passed: reports.iter().all(JobReport::passed),
        jobs: reports,
    })
}

/// The daemon's own owner, from the registry: a second daemon calling
/// itself the same node (a copied config) holds leases the signal would
/// not move. Without a readable registry (`force`), none: any owner of this
/// node counts. With no other live node nobody would take over: refused
/// unless forced (the registry does not say which jobs a node has, so any
/// other live node counts).
async fn own_owner(
    store: &dyn Store,
    node: &str,
    force: bool,
    call: Duration,
) -> Result<Option<String>, DrillError> {
    match bounded(call, store.nodes()).await {
        Ok(records) => {
            if !force && records.iter().all(|r| r.node == node) {
                return Err(DrillError::NoPeer {
                    node: node.to_string(),
                });
            }
            let mine: Vec<String> = records
                .into_iter()
                .filter(|r| r.node == node)
                .map(|r| r.owner)
                .collect();
            if mine.len() > 1 {
                return Err(DrillError::SameNodeName {
                    node: node.to_string(),
                    count: mine.len(),
                });
            }
            Ok(mine.into_iter().next())
        }
        Err(e) if !force => Err(DrillError::Store(e)),
        Err(_) => Ok(None),
    }
}

/// The locks of `locks` this daemon holds (owner `own`, else any owner of
/// `node`) of configured jobs, only those `wanted` when it names any.
fn held_jobs(
    config: &Config,
    locks: &[LockStatus],
    wanted: &[JobName],
    own: Option<&str>,
    node: &str,
) -> Vec<Held> {
    locks
        .iter()
        .filter_map(|l| {
            let owner = l.holder.as_deref()?;
            let job = JobName::parse(&l.job).ok()?;
            let configured = config.job(job.as_str()).is_some();
            let asked = wanted.is_empty() || wanted.contains(&job);
            let ours = match own {
                Some(own) => owner == own,
                None => Owner::node_of(owner) == node,
            };
            (ours && configured && asked).then(|| Held {
                job,
                owner: owner.to_string(),
                fence: l.fence,
                last_occurrence: l.last_occurrence,
            })
        })
        .collect()
}

/// What the watch saw by its deadline.
#[derive(Default)]
struct Seen {
    /// The jobs a peer took, and how.
    taken: BTreeMap<JobName, Taken>,
    /// The jobs claimed again by this node (a restarted daemon), at this fence.
    back: BTreeMap<JobName, u64>,
    /// The last poll the store did not answer, if any.
    store_error: Option<String>,
}

/// Polls the locks until every `held` job moved or `deadline`. An
/// unanswered poll is tried again until the deadline (the store may be
/// busy with the takeover itself), and said in the report.
async fn watch_takeovers(
    store: &dyn Store,
    held: &[Held],
    deadline: tokio::time::Instant,
    call: Duration,
) -> Seen {
    let mut seen = Seen::default();
    while seen.taken.len() < held.len() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(POLL).await;
        let locks = match bounded(call, store.status()).await {
            Ok(locks) => locks,
            Err(e) => {
                seen.store_error = Some(crate::config::one_line(&e.to_string()));
                continue;
            }
        };
        for h in held {
            if seen.taken.contains_key(&h.job) {
                continue;
            }
            match taken_over(h, &locks) {
                Some(Change::Peer(t)) => {
                    seen.taken.insert(h.job.clone(), t);
                }
                Some(Change::Back(fence)) => {
                    seen.back.insert(h.job.clone(), fence);
                }
                None => {}
            }
        }
    }
    seen
}

/// Each held job's history. The takeover runs' own records give their
/// lateness; they are written when each run ends, so this waits a little
/// for them. A history that cannot be read is said in the report (the
/// daemon is disturbed by now).
async fn read_histories(
    store: &dyn Store,
    held: &[Held],
    taken: &BTreeMap<JobName, Taken>,
    call: Duration,
) -> BTreeMap<JobName, Result<Vec<RunRecord>, String>> {
    let mut histories = BTreeMap::new();
    let history_by = tokio::time::Instant::now() + HISTORY_WAIT;
    for h in held {
        let fence_after = taken.get(&h.job).map(|t| t.fence);
        let runs = loop {
            let read = bounded(call, store.history(Some(&h.job), HISTORY_READ)).await;
            let done = match &read {
                Ok(runs) => fence_after.is_none_or(|f| runs.iter().any(|r| r.fence == f)),
                Err(_) => false,
            };
            if done || tokio::time::Instant::now() >= history_by {
                break read.map_err(|e| crate::config::one_line(&e.to_string()));
            }
            tokio::time::sleep(POLL).await;
        };
        histories.insert(h.job.clone(), runs);
    }
    histories
}

/// How long to watch a job: twice its longest lease (the gap between its
/// next two occurrences, plus the margin), and at least until its next
/// occurrence plus two margins (an irregular schedule's next gap may be
/// short while its next instant is far).
fn watch_for(schedule: &Schedule, now: DateTime<Utc>, margin: Duration) -> Duration {
    let next = schedule.next_after(now);
    let after = next.and_then(|n| schedule.next_after(n));
    let gap = next
        .zip(after)
        .and_then(|(a, b)| (b - a).to_std().ok())
        .unwrap_or(Duration::from_secs(60));
    let until_next = next
        .and_then(|n| (n - now).to_std().ok())
        .unwrap_or_default();
    (2 * (gap + margin)).max(until_next + 2 * margin)
}

/// What a poll saw of a job the drilled daemon held.
enum Change {
    /// Held by another node, with a higher fence: taken over.
    Peer(Taken),
    /// Held by this node again (the daemon restarted, or stepped down and
    /// won the next occurrence), with this fence: not a takeover.
    Back(u64),
}

/// A live lease of the job with a higher fence than the drilled daemon's,
/// and whose node holds it.
fn taken_over(h: &Held, locks: &[LockStatus]) -> Option<Change> {
    let lock = locks.iter().find(|l| l.job == h.job.as_str())?;
    let owner = lock.holder.as_deref()?;
    if lock.fence <= h.fence {
        return None;
    }
    if Owner::node_of(owner) == Owner::node_of(&h.owner) {
        return Some(Change::Back(lock.fence));
    }
    Some(Change::Peer(Taken {
        owner: owner.to_string(),
        fence: lock.fence,
        occurrence: lock.last_occurrence,
        seen: Utc::now(),
    }))
}

/// A record of a run that happened (its command started, or it was
/// skipped as configured because the previous run still went): what
/// covers an occurrence. `lease_lost` and `not_started` never ran.
fn ran(run: &RunRecord) -> bool {
    matches!(
        run.outcome,
        Outcome::Ok | Outcome::Failed | Outcome::Timeout | Outcome::Killed | Outcome::Replaced
    )
}

fn covered(run: &RunRecord) -> bool {
    ran(run) || matches!(run.outcome, Outcome::Skipped | Outcome::Dispatched)
}

/// One job's verdict from what the watch saw and the job's history.
fn judge(
    h: &Held,
    taken: Option<&Taken>,
    runs: &[RunRecord],
    schedule: Option<&Schedule>,
    now: DateTime<Utc>,
    margin: Duration,
) -> JobReport {
    let takeover_run = taken.and_then(|t| runs.iter().find(|r| r.fence == t.fence));
    let takeover_delay_ms = match (takeover_run, taken) {
        (Some(run), _) => Some(run.delay_ms),
        (None, Some(t)) => t
            .occurrence
            .and_then(|o| (t.seen - o).to_std().ok())
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        (None, None) => None,
    };
    // From the old holder's last occurrence to the takeover's (or, with no
    // takeover, to the last instant a peer should have claimed by now).
    let from = h.last_occurrence;
    let to = match taken.and_then(|t| t.occurrence) {
        Some(o) => o,
        None => now - chrono::Duration::from_std(margin).unwrap_or_default(),
    };
    let mut missed = Vec::new();
    if let (Some(schedule), Some(from)) = (schedule, from) {
        let mut t = schedule.next_after(from);
        while let Some(instant) = t.filter(|i| *i < to) {
            if !runs.iter().any(|r| r.occurrence == instant && covered(r)) {
                missed.push(instant);
            }
            t = schedule.next_after(instant);
            if missed.len() >= MISSED_LISTED {
                break;
            }
        }
    }
    let mut per_occurrence: BTreeMap<DateTime<Utc>, usize> = BTreeMap::new();
    for r in runs
        .iter()
        .filter(|r| ran(r) && from.is_none_or(|f| r.occurrence >= f))
    {
        *per_occurrence.entry(r.occurrence).or_default() += 1;
    }
    let doubled = per_occurrence
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(o, _)| o)
        .collect();
    JobReport {
        job: h.job.to_string(),
        old_holder: Owner::node_of(&h.owner).to_string(),
        fence_before: h.fence,
        last_occurrence_before: h.last_occurrence,
        new_holder: taken.map(|t| Owner::node_of(&t.owner).to_string()),
        fence_after: taken.map(|t| t.fence),
        takeover_occurrence: taken.and_then(|t| t.occurrence),
        takeover_delay_ms,
        missed,
        doubled,
        back_on_this_node: None,
        error: None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use chrono::TimeZone;

    fn at(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + s, 0).unwrap()
    }

    fn run(occ: i64, fence: u64, outcome: Outcome) -> RunRecord {
        RunRecord {
            job: "tick".into(),
            fence,
            owner: format!("n{fence}#1"),
            node: format!("n{fence}"),
            occurrence: at(occ),
            started_at: at(occ),
            finished_at: at(occ),
            outcome,
            exit_code: None,
            takeover: false,
            delay_ms: 40,
            decision_ms: 0,
            output: String::new(),
            trigger: None,
            cpu_ms: None,
            memory_peak: None,
        }
    }

    fn job() -> Schedule {
        Schedule::parse("* * * * * *", "UTC").unwrap()
    }

    fn held() -> Held {
        Held {
            job: JobName::parse("tick").unwrap(),
            owner: "n1#a".into(),
            fence: 10,
            last_occurrence: Some(at(0)),
        }
    }

    fn taken(fence: u64, occ: i64) -> Taken {
        Taken {
            owner: "n2#b".into(),
            fence,
            occurrence: Some(at(occ)),
            seen: at(occ) + chrono::Duration::milliseconds(300),
        }
    }

    #[test]
    fn a_takeover_at_the_next_instant_passes() {
        let runs = [run(0, 10, Outcome::Killed), run(1, 11, Outcome::Ok)];
        let j = job();
        let r = judge(
            &held(),
            Some(&taken(11, 1)),
            &runs,
            Some(&j),
            at(5),
            Duration::from_secs(1),
        );
        assert!(r.passed(), "{r:?}");
        assert_eq!(r.takeover_delay_ms, Some(40));
        assert_eq!(r.new_holder.as_deref(), Some("n2"));
    }

    #[test]
    fn instants_no_run_covered_are_missed_and_a_second_run_is_doubled() {
        // Instants 1 and 2 have no run (2 only a lease_lost); 0 ran twice.
        let runs = [
            run(0, 10, Outcome::Ok),
            run(0, 11, Outcome::Failed),
            run(2, 12, Outcome::LeaseLost),
            run(3, 13, Outcome::Ok),
        ];
        let j = job();
        let r = judge(
            &held(),
            Some(&taken(13, 3)),
            &runs,
            Some(&j),
            at(5),
            Duration::from_secs(1),
        );
        assert_eq!(r.missed, vec![at(1), at(2)]);
        assert_eq!(r.doubled, vec![at(0)]);
        assert!(!r.passed());
    }

    #[test]
    fn no_takeover_fails_and_counts_what_a_peer_should_have_run() {
        let runs = [run(0, 10, Outcome::Killed)];
        let j = job();
        let r = judge(
            &held(),
            None,
            &runs,
            Some(&j),
            at(4),
            Duration::from_secs(1),
        );
        assert!(!r.passed());
        assert_eq!(r.missed, vec![at(1), at(2)]);
        assert_eq!(r.takeover_delay_ms, None);
    }

    fn lock(holder: &str, fence: u64) -> LockStatus {
        LockStatus {
            job: "tick".into(),
            holder: Some(holder.into()),
            lease_remaining_ms: 1000,
            fence,
            last_occurrence: Some(at(1)),
            last_owner: Some(holder.into()),
            paused: false,
        }
    }

    #[test]
    fn only_another_node_with_a_higher_fence_has_taken_over() {
        let h = held();
        // The same lease still, or the same node restarted: no takeover.
        assert!(taken_over(&h, &[lock("n1#a", 10)]).is_none());
        assert!(matches!(
            taken_over(&h, &[lock("n1#c", 11)]),
            Some(Change::Back(11))
        ));
        assert!(matches!(
            taken_over(&h, &[lock("n1#a", 11)]),
            Some(Change::Back(11))
        ));
        // Another node, but the fence did not move: not yet.
        assert!(taken_over(&h, &[lock("n2#b", 10)]).is_none());
        match taken_over(&h, &[lock("n2#b", 11)]) {
            Some(Change::Peer(t)) => assert_eq!((t.owner.as_str(), t.fence), ("n2#b", 11)),
            _ => panic!("n2 with fence 11 took over"),
        }
    }

    #[test]
    fn the_watch_covers_an_irregular_schedules_far_next_instant() {
        // At 10:30, `0 0 9,10 * * *` fires next at 09:00 the day after, then
        // at 10:00: the gap (1 h) is short, the next instant 22.5 h away.
        let s = Schedule::parse("0 0 9,10 * * *", "UTC").unwrap();
        let now = Utc.with_ymd_and_hms(2026, 11, 26, 10, 30, 0).unwrap();
        let w = watch_for(&s, now, Duration::from_secs(1));
        assert!(w >= Duration::from_secs(22 * 3600 + 1800), "{w:?}");
        let every = Schedule::parse("* * * * * *", "UTC").unwrap();
        let w = watch_for(&every, now, Duration::from_secs(1));
        assert_eq!(w, Duration::from_secs(4));
    }

    #[test]
    fn without_its_record_the_delay_is_when_the_lease_was_seen() {
        let j = job();
        let r = judge(
            &held(),
            Some(&taken(11, 1)),
            &[],
            Some(&j),
            at(5),
            Duration::from_secs(1),
        );
        assert_eq!(r.takeover_delay_ms, Some(300));
    }
}
