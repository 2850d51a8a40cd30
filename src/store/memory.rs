//! An in-memory store, for tests: the node in-process on paused time, and a
//! reference the conformance suite holds to the same cases as every real
//! backend (cargo feature `memory`; never in a release build).
//!
//! Every handle made by [`MemoryStore::handle`] shares one state, as nodes
//! share a database. Its clock follows tokio's (`base + elapsed`), so a test
//! on paused time moves the store's clock with `tokio::time::advance`. Claims
//! are decided by the same pure rule as SQL ([`decide`]).
//!
//! Test hooks: [`MemoryStore::calls`] and [`MemoryStore::call_log`] count
//! store calls (one batch is one call), [`MemoryStore::lose_claim_replies`]
//! makes the next claims take effect and then fail as if the answer was lost
//! on the way, [`MemoryStore::set_reachable`] cuts one handle off (a
//! partitioned node), [`MemoryStore::announce_requests`] makes it announce
//! requests as the stores with notifications do, and [`MemoryStore::set_fence`] /
//! [`MemoryStore::set_expiry_in`] tamper with a lock as an operator might.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use tokio::time::Instant;

use super::registry::{BeatData, FORGET_AFTER, Heartbeat, NodeRecord, Registry, sorted};
use super::{
    Audit, AuditEntry, ClaimOutcome, ClaimRequest, Claimed, History, LockRow, LockStatus, Locks,
    Outbox, Owner, Parcel, RECORD_FORMAT, Renewal, RunRecord, SchemaNotice, Store, StoreError,
    TriggerAnswer, TriggerId, claim_rows, clears_running, duration_ms, from_ms, to_ms, trigger_row,
};
use crate::config::JobName;

#[derive(Debug, Default, Clone)]
struct Lock {
    owner: Option<String>,
    fence: i64,
    expires_at: i64,
    last_occurrence: Option<i64>,
    /// The last claim's run has not been recorded yet.
    running: bool,
    /// `cronlease pause`: claims are refused.
    paused: bool,
    /// A manual run's pending request, and the last one claimed.
    trigger: Option<i64>,
    last_trigger: Option<i64>,
}

impl Lock {
    fn row(&self, now: i64) -> LockRow {
        LockRow {
            owner: self.owner.clone(),
            fence: self.fence,
            expires_at: self.expires_at,
            last_occurrence: self.last_occurrence,
            running: self.running,
            paused: self.paused,
            trigger: self.trigger,
            last_trigger: self.last_trigger,
            now,
        }
    }

    fn from_row(row: LockRow) -> Self {
        Lock {
            owner: row.owner,
            fence: row.fence,
            expires_at: row.expires_at,
            last_occurrence: row.last_occurrence,
            running: row.running,
            paused: row.paused,
            trigger: row.trigger,
            last_trigger: row.last_trigger,
        }
    }
}

#[derive(Default)]
struct State {
    locks: BTreeMap<String, Lock>,
    /// The jobs whose lock holds a pending request, as the SQL stores'
    /// index on `trigger_id` (migrations, `0008_trigger.sql`): a look for
    /// manual runs reads those, not every lock.
    pending: BTreeSet<String>,
    /// Per job: (insertion id, run), oldest first.
    runs: BTreeMap<String, Vec<(u64, RunRecord)>>,
    next_id: u64,
    /// Store calls by operation.
    calls: BTreeMap<&'static str, usize>,
    /// Every call in order: operation, requests, store clock (ms).
    log: Vec<Call>,
    /// The next this many claim calls take effect, then fail as unanswered.
    lose_replies: usize,
    /// Requests are announced ([`MemoryStore::announce_requests`]) to these
    /// subscriptions, each with its handle's reachability.
    announce: bool,
    listeners: Vec<(Arc<AtomicBool>, tokio::sync::mpsc::Sender<()>)>,
    /// The node registry by owner: the record, last seen and end (ms).
    nodes: BTreeMap<String, (BeatData, i64, i64)>,
    /// The record format version (0: none yet), as the key-value stores
    /// keep it.
    format: i64,
    /// The outbox: parcels by id.
    outbox: BTreeMap<String, String>,
    /// The audit: per job, its entries by id (oldest first).
    audit: BTreeMap<String, BTreeMap<String, AuditEntry>>,
}

/// One store call, as [`MemoryStore::call_log`] lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    pub op: &'static str,
    /// How many requests (jobs) it carried.
    pub requests: usize,
    /// The store's clock when it came.
    pub at: DateTime<Utc>,
    /// A claim call that carried the node's heartbeat.
    pub beat: bool,
}

/// The in-memory store (see the module documentation).
#[derive(Clone)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
    base_ms: i64,
    base: Instant,
    name: String,
    /// Cleared: this handle's calls fail as if the store were unreachable
    /// (a partitioned or frozen node).
    reachable: Arc<AtomicBool>,
    schema_notice: Arc<SchemaNotice>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store whose clock starts at the wall clock's now.
    pub fn new() -> Self {
        Self::starting_at(Utc::now())
    }

    /// An empty store whose clock reads `at` now and runs with tokio's.
    pub fn starting_at(at: DateTime<Utc>) -> Self {
        MemoryStore {
            state: Arc::new(Mutex::new(State::default())),
            base_ms: to_ms(at),
            base: Instant::now(),
            name: "memory://".into(),
            reachable: Arc::new(AtomicBool::new(true)),
            schema_notice: Arc::default(),
        }
    }

    /// Another handle on the same state (as another node's connection).
    pub fn handle(&self) -> Arc<dyn Store> {
        Arc::new(self.connection())
    }

    /// A handle of its own on the same state, with its own reachability.
    pub fn connection(&self) -> MemoryStore {
        MemoryStore {
            reachable: Arc::new(AtomicBool::new(true)),
            schema_notice: Arc::default(),
            ..self.clone()
        }
    }

    /// Cuts this handle off the store (`false`) or reconnects it; a
    /// reconnected handle's subscriptions get a notice, as one made again
    /// does ([`Locks::notices`]).
    pub fn set_reachable(&self, reachable: bool) {
        let was = self.reachable.swap(reachable, Ordering::SeqCst);
        if reachable && !was {
            notify(&mut self.state(), |handle| {
                Arc::ptr_eq(handle, &self.reachable)
            });
        }
    }

    fn reach(&self) -> Result<(), StoreError> {
        if self.reachable.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(StoreError::Unavailable {
                store: self.name.clone(),
                reason: "cut off (test)".into(),
            })
        }
    }

    fn now_ms(&self) -> i64 {
        self.base_ms.saturating_add(duration_ms(
            Instant::now().saturating_duration_since(self.base),
        ))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Counts a call of `op` carrying `n` requests; `Err` if this handle
    /// is cut off (then nothing happens).
    fn count(&self, op: &'static str, n: usize) -> Result<MutexGuard<'_, State>, StoreError> {
        self.reach()?;
        let at = from_ms(self.now_ms());
        let mut state = self.state();
        *state.calls.entry(op).or_default() += 1;
        state.log.push(Call {
            op,
            requests: n,
            at,
            beat: false,
        });
        Ok(state)
    }

    /// How many calls of `op` (`claim`, `renew`, `release`, `record`, ...)
    /// the store answered or took, all handles together.
    pub fn calls(&self, op: &str) -> usize {
        self.state().calls.get(op).copied().unwrap_or(0)
    }

    /// Every call so far, in order.
    pub fn call_log(&self) -> Vec<Call> {
        self.state().log.clone()
    }

    /// The next `n` claim calls take effect, then answer with a timeout, as
    /// if the reply was lost on the way.
    pub fn lose_claim_replies(&self, n: usize) {
        self.state().lose_replies = n;
    }

    /// From now on, [`Locks::notices`] subscriptions are made and each
    /// request written is announced to them, as Redis, PostgreSQL,
    /// ZooKeeper and etcd do (off by default: nodes look on their own, as
    /// on MariaDB and SQLite). A handle cut off misses what is announced
    /// meanwhile.
    pub fn announce_requests(&self) {
        self.state().announce = true;
    }

    /// How many runs the history holds, all jobs together.
    pub fn history_len(&self) -> usize {
        self.state().runs.values().map(Vec::len).sum()
    }

    /// A job's recorded outcomes, in fence order.
    pub fn history_outcomes(&self, job: &str) -> Vec<String> {
        let s = self.state();
        let mut runs: Vec<&RunRecord> = s
            .runs
            .get(job)
            .into_iter()
            .flatten()
            .map(|(_, r)| r)
            .collect();
        runs.sort_by_key(|r| r.fence);
        runs.iter().map(|r| r.outcome.to_string()).collect()
    }

    /// Sets a job's fence, as a hand edit would.
    pub fn set_fence(&self, job: &str, fence: i64) {
        self.state().locks.entry(job.into()).or_default().fence = fence;
    }

    /// Makes a job's lease end `ms` from now (negative: in the past).
    pub fn set_expiry_in(&self, job: &str, ms: i64) {
        let at = self.now_ms().saturating_add(ms);
        self.state().locks.entry(job.into()).or_default().expires_at = at;
    }

    /// Appends a history record as is, bypassing the (job, fence) check.
    pub fn insert_raw_run(&self, run: RunRecord) {
        let mut s = self.state();
        s.next_id += 1;
        let id = s.next_id;
        s.runs.entry(run.job.clone()).or_default().push((id, run));
    }

    /// Sets the record format version as a newer binary would.
    pub fn set_format(&self, version: i64) {
        self.state().format = version;
    }
}

#[async_trait]
impl Locks for MemoryStore {
    async fn prepare(&self) -> Result<(), StoreError> {
        let found = {
            let mut s = self.count("prepare", 0)?;
            let found = s.format;
            s.format = found.max(RECORD_FORMAT);
            found
        };
        self.schema_notice.settle(&self.name, found, RECORD_FORMAT)
    }

    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Claimed, StoreError> {
        let now = self.now_ms();
        let mut s = self.count("claim", requests.len())?;
        let outcomes = claim_in(&mut s, requests, now);
        answer_claims(&mut s, now, outcomes)
    }

    async fn clock(&self) -> Result<DateTime<Utc>, StoreError> {
        drop(self.count("clock", 0)?);
        Ok(from_ms(self.now_ms()))
    }

    async fn renew_many(
        &self,
        owner: &Owner,
        renewals: &[Renewal],
    ) -> Result<Vec<bool>, StoreError> {
        let now = self.now_ms();
        let mut s = self.count("renew", renewals.len())?;
        let done = renewals
            .iter()
            .map(|r| match s.locks.get_mut(r.job.as_str()) {
                Some(lock)
                    if lock.owner.as_deref() == Some(owner.as_str()) && lock.expires_at > now =>
                {
                    lock.expires_at = now.saturating_add(duration_ms(r.lease));
                    true
                }
                _ => false,
            })
            .collect();
        Ok(done)
    }

    async fn release(&self, jobs: &[JobName], owner: &Owner) -> Result<usize, StoreError> {
        let now = self.now_ms();
        let mut s = self.count("release", jobs.len())?;
        let mut n = 0;
        for job in jobs {
            if let Some(lock) = s.locks.get_mut(job.as_str())
                && lock.owner.as_deref() == Some(owner.as_str())
                && lock.expires_at > now
            {
                lock.expires_at = now;
                n += 1;
            }
        }
        Ok(n)
    }

    async fn set_paused(&self, jobs: &[JobName], paused: bool) -> Result<(), StoreError> {
        let mut s = self.count("set_paused", jobs.len())?;
        for job in jobs {
            s.locks.entry(job.to_string()).or_default().paused = paused;
        }
        Ok(())
    }

    async fn request_trigger(
        &self,
        job: &JobName,
        id: TriggerId,
    ) -> Result<TriggerAnswer, StoreError> {
        let now = self.now_ms();
        let mut s = self.count("request_trigger", 1)?;
        let lock = s.locks.entry(job.to_string()).or_default();
        let mut row = lock.row(now);
        let answer = trigger_row(&mut row, id);
        let pending = row.trigger.is_some();
        *lock = Lock::from_row(row);
        index_pending(&mut s, job.as_str(), pending);
        if answer == TriggerAnswer::Accepted {
            notify(&mut s, |reachable| reachable.load(Ordering::SeqCst));
        }
        Ok(answer)
    }

    fn notices(
        self: Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) -> Option<tokio::sync::mpsc::Receiver<()>> {
        // The receiver ends the subscription when dropped.
        let _ = stop;
        let mut s = self.state();
        if !s.announce {
            return None;
        }
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        // One at once, as a subscription made again sends one.
        let _ = tx.try_send(());
        s.listeners.push((self.reachable.clone(), tx));
        Some(rx)
    }

    async fn withdraw_trigger(&self, job: &JobName, id: TriggerId) -> Result<bool, StoreError> {
        let mut s = self.count("withdraw_trigger", 1)?;
        let withdrawn = match s.locks.get_mut(job.as_str()) {
            Some(l) if l.trigger == Some(id.get()) => {
                l.trigger = None;
                true
            }
            _ => false,
        };
        if withdrawn {
            index_pending(&mut s, job.as_str(), false);
        }
        Ok(withdrawn)
    }

    async fn pending_triggers(&self) -> Result<Vec<(String, TriggerId)>, StoreError> {
        let s = self.count("pending_triggers", 0)?;
        Ok(pending_in(&s))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        drop(self.count("ping", 0)?);
        Ok(())
    }

    async fn status(&self) -> Result<Vec<LockStatus>, StoreError> {
        let now = self.now_ms();
        let s = self.count("status", 0)?;
        Ok(s.locks
            .iter()
            .map(|(job, l)| {
                let live = l.owner.is_some() && l.expires_at > now;
                LockStatus {
                    job: job.clone(),
                    holder: if live { l.owner.clone() } else { None },
                    lease_remaining_ms: if live { (l.expires_at - now) as u64 } else { 0 },
                    fence: l.fence.max(0) as u64,
                    last_occurrence: l.last_occurrence.map(from_ms),
                    last_owner: l.owner.clone(),
                    paused: l.paused,
                }
            })
            .collect())
    }

    fn describe(&self) -> &str {
        &self.name
    }

    fn schema_notice(&self) -> Option<String> {
        self.schema_notice.get()
    }
}

#[async_trait]
impl History for MemoryStore {
    async fn record_runs(&self, runs: &[RunRecord], keep: u32) -> Result<(), StoreError> {
        let mut s = self.count("record", runs.len())?;
        for run in runs {
            let seen = s
                .runs
                .get(&run.job)
                .is_some_and(|rs| rs.iter().any(|(_, r)| r.fence == run.fence));
            if seen {
                continue;
            }
            if let Some(lock) = s.locks.get_mut(&run.job)
                && clears_running(run, lock.fence)
            {
                lock.running = false;
            }
            s.next_id += 1;
            let id = s.next_id;
            let kept = s.runs.entry(run.job.clone()).or_default();
            kept.push((id, run.clone()));
            // The runs of the newest `keep` fences stay.
            let cutoff = run.fence.saturating_sub(u64::from(keep));
            kept.retain(|(_, r)| r.fence > cutoff);
        }
        Ok(())
    }

    async fn history(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let s = self.count("history", 0)?;
        let mut runs: Vec<&(u64, RunRecord)> = match job {
            Some(job) => s.runs.get(job.as_str()).into_iter().flatten().collect(),
            None => s.runs.values().flatten().collect(),
        };
        runs.sort_by_key(|r| std::cmp::Reverse(r.0));
        Ok(runs
            .into_iter()
            .take(limit as usize)
            .map(|(_, r)| r.clone())
            .collect())
    }
}

#[async_trait]
impl Audit for MemoryStore {
    async fn record_action(&self, entry: &AuditEntry, keep: u32) -> Result<(), StoreError> {
        let mut s = self.count("record_action", 1)?;
        let kept = s.audit.entry(entry.job.clone()).or_default();
        kept.insert(entry.id.clone(), entry.clone());
        while kept.len() > keep.max(1) as usize {
            kept.pop_first();
        }
        Ok(())
    }

    async fn actions(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let s = self.count("actions", 0)?;
        let mut entries: Vec<AuditEntry> = match job {
            Some(job) => s
                .audit
                .get(job.as_str())
                .into_iter()
                .flat_map(|kept| kept.values().cloned())
                .collect(),
            None => s.audit.values().flat_map(|k| k.values().cloned()).collect(),
        };
        super::audit::newest_first(&mut entries, limit);
        Ok(entries)
    }
}

#[async_trait]
impl Outbox for MemoryStore {
    async fn hand_over(&self, parcels: &[Parcel]) -> Result<(), StoreError> {
        super::outbox::checked(&self.name, parcels)?;
        let mut s = self.count("hand_over", parcels.len())?;
        for p in parcels {
            s.outbox.insert(p.id.clone(), p.body.clone());
        }
        Ok(())
    }

    async fn take_handed_over(
        &self,
        _taker: &Owner,
        prefix: &str,
        max: usize,
    ) -> Result<Vec<Parcel>, StoreError> {
        let mut s = self.count("take_handed_over", 0)?;
        let ids: Vec<String> = s
            .outbox
            .range(prefix.to_string()..)
            .take_while(|(id, _)| id.starts_with(prefix))
            .take(max)
            .map(|(id, _)| id.clone())
            .collect();
        Ok(ids
            .into_iter()
            .filter_map(|id| {
                let body = s.outbox.remove(&id)?;
                Some(Parcel { id, body })
            })
            .collect())
    }
}

#[async_trait]
impl Registry for MemoryStore {
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        let now = self.now_ms();
        let mut s = self.count("heartbeat", 1)?;
        beat_in(&mut s, beat, now);
        Ok(live_nodes(&s, now))
    }

    /// Under the one lock, as one `heartbeat` call.
    async fn heartbeat_looking(
        &self,
        beat: &Heartbeat,
    ) -> Result<super::registry::Looked, StoreError> {
        let now = self.now_ms();
        let mut s = self.count("heartbeat", 1)?;
        beat_in(&mut s, beat, now);
        Ok((live_nodes(&s, now), Some(pending_in(&s))))
    }

    /// Under the one lock, as one `claim` call (`beat` set in the log).
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        let now = self.now_ms();
        let mut s = self.count("claim", requests.len())?;
        if let Some(call) = s.log.last_mut() {
            call.beat = true;
        }
        let outcomes = claim_in(&mut s, requests, now);
        beat_in(&mut s, beat, now);
        let nodes = live_nodes(&s, now);
        answer_claims(&mut s, now, outcomes).map(|c| (c, Some(nodes)))
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let now = self.now_ms();
        let s = self.count("nodes", 0)?;
        Ok(live_nodes(&s, now))
    }

    async fn leave(&self, owner: &Owner) -> Result<(), StoreError> {
        let mut s = self.count("leave", 1)?;
        s.nodes.remove(owner.as_str());
        Ok(())
    }
}

/// The pending requests in `s`, sorted by job.
fn pending_in(s: &State) -> Vec<(String, TriggerId)> {
    s.pending
        .iter()
        .filter_map(|job| {
            let id = s.locks.get(job)?.trigger?;
            Some((job.clone(), TriggerId::from_stored(id)?))
        })
        .collect()
}

/// Keeps [`State::pending`] in step with whether `job`'s lock holds a
/// pending request.
fn index_pending(s: &mut State, job: &str, pending: bool) {
    if pending {
        if !s.pending.contains(job) {
            s.pending.insert(job.to_string());
        }
    } else {
        s.pending.remove(job);
    }
}

/// Sends a notice to the live subscriptions whose handle `to` picks (by its
/// reachability flag), forgetting the ended ones; one already waiting
/// stands for it (notices coalesce).
fn notify(s: &mut State, to: impl Fn(&Arc<AtomicBool>) -> bool) {
    s.listeners.retain(|(_, tx)| !tx.is_closed());
    for (handle, tx) in &s.listeners {
        if to(handle) {
            let _ = tx.try_send(());
        }
    }
}

/// Decides `requests` on the locks of `s`, at `now`, with the shared batch
/// step ([`claim_rows`]) over copies of the rows they name.
fn claim_in(s: &mut State, requests: &[ClaimRequest], now: i64) -> Vec<ClaimOutcome> {
    let mut rows: BTreeMap<String, LockRow> = requests
        .iter()
        .filter_map(|req| {
            let lock = s.locks.get(req.job.as_str())?;
            Some((req.job.as_str().to_string(), lock.row(now)))
        })
        .collect();
    let outcomes = claim_rows(&mut rows, requests, now);
    for (job, row) in rows {
        index_pending(s, &job, row.trigger.is_some());
        s.locks.insert(job, Lock::from_row(row));
    }
    outcomes
}

/// The answer to a claim call, or the lost reply a test asked for.
fn answer_claims(
    s: &mut State,
    now: i64,
    outcomes: Vec<ClaimOutcome>,
) -> Result<Claimed, StoreError> {
    if s.lose_replies > 0 {
        s.lose_replies -= 1;
        return Err(StoreError::Timeout(Duration::from_secs(2)));
    }
    Ok(Claimed {
        store_now: from_ms(now),
        outcomes,
    })
}

/// Writes `beat`'s record at `now`, forgetting long-dead ones.
fn beat_in(s: &mut State, beat: &Heartbeat, now: i64) {
    let forget_before = now.saturating_sub(duration_ms(FORGET_AFTER));
    s.nodes.retain(|_, (_, _, end)| *end >= forget_before);
    let end = now.saturating_add(duration_ms(beat.ttl));
    s.nodes
        .insert(beat.owner.to_string(), (BeatData::from(beat), now, end));
}

fn live_nodes(s: &State, now: i64) -> Vec<NodeRecord> {
    sorted(
        s.nodes
            .iter()
            .filter(|(_, (_, _, end))| *end > now)
            .map(|(owner, (data, seen, end))| data.clone().record(owner, *seen, *end, now))
            .collect(),
    )
}
