//! Redlock: one lock over several independent Redis masters (`store.urls`,
//! 3 or 5), none of which decides a claim alone (docs/protocol.md, "Redlock").
//!
//! A claim is two phases, each one script call per master for the whole
//! batch, sent to every master at once:
//! 1. **Lease** (`redlock_lease.lua`): each master takes the job's lease key
//!    where it is free (`SET NX PX`) and reports the job's state (fence, last
//!    occurrence, owner) as it has it. The node counts: the lease taken or
//!    already ours on a majority is a claim it may decide; another owner's on
//!    a majority is a lost claim (with that owner's remaining lease); neither
//!    is a split vote, whose leases are given back and which is tried again
//!    after a random pause, so concurrent claimers cannot all lose an
//!    occurrence.
//! 2. **Write** (`redlock_write.lua`): the node applies the claim rule
//!    ([`super::super::decide`]) to the highest fence and last occurrence the
//!    masters reported, and writes fence + 1 and the occurrence to every
//!    master where the lease is still its own. Won only when a majority
//!    wrote it and the lease's validity (lease − elapsed − (1% of the lease
//!    \+ 2 ms)) is not used up; otherwise its leases are given back and the
//!    batch answers with an error, which the node retries as an unanswered
//!    claim: the store answers such a win again rather than lose it.
//!
//! A master whose `run_id` changes has restarted and may have lost leases
//! and fences: it stays out of quorums for one lease length of each job
//! (Redis's "delayed restart", done on our side). Every script call is
//! pipelined behind `INFO server` to see it. Renewals and releases are
//! owner-checked on every master; history goes to every master and is read
//! as the union. The clock is the median of the masters' `TIME`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::Script;
use redis::aio::ConnectionManager;
use tokio::time::Instant;

use super::{
    RELEASE, RENEW, ServerLock, add_evalsha, client_for, eval_loading, job_key, manager_config,
    record_args, renew_args, scan_keys, server_locks, store_error, stream_runs, triggers_key,
};
use crate::config::{JobName, StoreConfig, StoreKind, StoreUrl, one_line};
use crate::store::registry::{self, Heartbeat, NodeRecord, Registry};
use crate::store::{
    ClaimOutcome, ClaimRequest, Claimed, Decision, History, LockRow, LockStatus, Locks, Lost,
    Owner, Renewal, RunRecord, StoreError, TriggerAnswer, TriggerId, Won, decide, duration_ms,
    fence_exhausted, from_ms, newest_first, to_ms,
};

static LEASE: &str = include_str!("redlock_lease.lua");
static WRITE: &str = include_str!("redlock_write.lua");
static WITHDRAW: &str = include_str!("withdraw.lua");

/// Once a majority of masters answered, how much longer the others are
/// waited for: a stopped or partitioned master must not hold every claim
/// up to `op_timeout`.
const STRAGGLER_WAIT: Duration = Duration::from_millis(50);
/// Split votes tried again within one claim call, each after a random
/// pause of up to [`SPLIT_PAUSE_MAX_MS`].
const SPLIT_ROUNDS: usize = 8;
const SPLIT_PAUSE_MAX_MS: u64 = 20;

/// The Redlock implementation of [`crate::store::Store`].
pub struct RedlockStore {
    masters: Vec<Master>,
    url: StoreUrl,
    prefix: String,
    op_timeout: Duration,
    lease: Script,
    write: Script,
    renew: Script,
    release: Script,
    record: Script,
    registry: Script,
    pause: Script,
    trigger: Script,
    withdraw: Script,
    /// Keep restarted masters out of quorums; off only through a test's
    /// failpoint, to show what it prevents.
    quarantine: bool,
}

/// One independent master and what this node knows of its life.
struct Master {
    url: StoreUrl,
    client: redis::Client,
    conn: tokio::sync::Mutex<Option<ConnectionManager>>,
    life: std::sync::Mutex<Life>,
}

#[derive(Default)]
struct Life {
    run_id: Option<String>,
    /// When the master started, by its `uptime_in_seconds` (rounded down, so
    /// never earlier than it did): whoever started after it knows too.
    started_at: Option<Instant>,
    /// Since when calls to it fail (logged once when it starts and ends).
    failing_since: Option<Instant>,
}

/// One master's answer to phase 1 for one request: got, holder, pttl,
/// fence, last occurrence, state owner, idle wait, paused, pause
/// generation, pending request, last request taken (`redlock_lease.lua`).
type LeaseEntry = (
    i64,
    Option<String>,
    i64,
    String,
    i64,
    Option<String>,
    i64,
    i64,
    i64,
    Option<String>,
    Option<String>,
);
/// A master's phase-1 answer: its clock and an entry per request.
type LeaseAnswer = Option<Result<(i64, Vec<LeaseEntry>), StoreError>>;
/// Every master's phase-1 answer.
type LeaseAnswers = Vec<LeaseAnswer>;

/// What the masters said of one request in phase 1.
#[derive(Debug, Default)]
struct Tally {
    /// Masters (counted for this lease) where the lease is ours now.
    ours: usize,
    /// Of those, where it was ours before this claim.
    ours_before: usize,
    /// Masters (any) where this call took the lease: given back if the
    /// claim does not go on.
    taken: Vec<usize>,
    /// Other owners' leases on counted masters, with their time left (ms).
    others: Vec<(String, i64)>,
    /// Counted masters that answered.
    counted: usize,
    /// The highest fence any master reported, with the owner and last
    /// occurrence stored beside it, and the latest last occurrence.
    fence: u64,
    fence_owner: Option<String>,
    last: Option<i64>,
    /// Our own lease's time left on the masters where it was ours before.
    ours_pttl: Vec<i64>,
    /// Counted masters where another owner's lease is idle: the rest of
    /// its head start there (ms).
    idle_waits: Vec<i64>,
    /// The pause mark of the highest generation any master reported (a
    /// tie between marks reads as paused).
    pause: PauseMark,
    /// A manual claim: counted masters where its request is pending, and
    /// whether any master says a claim took it already.
    trigger_pending: usize,
    /// A manual claim: counted masters where the lease is ours and the run
    /// of our last claim is not recorded (a run in progress).
    ours_busy: usize,
    trigger_taken: bool,
    errors: Vec<String>,
}

/// A job's pause mark as the masters report it: `(generation, paused)`;
/// the highest generation wins, and of two marks written with the same
/// generation (two operators at once) the paused one.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct PauseMark(i64, bool);

impl PauseMark {
    fn merge(self, other: PauseMark) -> PauseMark {
        if other.0 > self.0 || (other.0 == self.0 && other.1) {
            other
        } else {
            self
        }
    }
}

/// A claim decided won in phase 2, to write: its request's index, fence,
/// last occurrence (none: left as stored, a manual run), the answer, and
/// the masters whose lease phase 1 took.
type Decided = (usize, i64, Option<i64>, Won, Vec<usize>);

/// What phase 1 makes of one request.
#[derive(Debug)]
enum Vote {
    /// The lease is ours on a majority: decide the claim.
    Ours,
    /// Another owner holds it on a majority; `idle_wait` when that lease
    /// is idle on a majority (the rest of its head start there).
    Held {
        holder: String,
        remaining: Duration,
        idle_wait: Option<Duration>,
    },
    /// Nobody holds a majority: try again after a pause.
    Split { holder: Option<String> },
    /// Too few counted masters answered to decide.
    Undecided,
}

impl RedlockStore {
    /// Builds a client per master; connections are made on first use.
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        let StoreKind::Redlock(urls) = config.url.kind() else {
            return Err(StoreError::Backend {
                store: config.url.redacted().into(),
                reason: "not a Redlock store URL".into(),
            });
        };
        let masters = urls
            .iter()
            .map(|url| {
                let client =
                    client_for(url, config.tls.as_ref()).map_err(|e| StoreError::Backend {
                        store: url.redacted().into(),
                        reason: url.scrub(&e),
                    })?;
                Ok(Master {
                    url: url.clone(),
                    client,
                    conn: tokio::sync::Mutex::new(None),
                    life: std::sync::Mutex::new(Life::default()),
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(RedlockStore {
            masters,
            url: config.url.clone(),
            prefix: config.key_prefix.clone(),
            op_timeout: config.op_timeout,
            lease: Script::new(LEASE),
            write: Script::new(WRITE),
            renew: Script::new(RENEW),
            release: Script::new(RELEASE),
            record: Script::new(super::RECORD),
            registry: Script::new(super::REGISTRY),
            pause: Script::new(super::PAUSE),
            trigger: Script::new(super::TRIGGER),
            withdraw: Script::new(WITHDRAW),
            quarantine: true,
        })
    }

    /// Test-only: restarted masters count in quorums at once, to show the
    /// double run that keeping them out prevents.
    #[cfg(feature = "failpoints")]
    pub fn without_quarantine(mut self) -> Self {
        self.quarantine = false;
        self
    }

    /// How many masters make a majority.
    fn majority(&self) -> usize {
        self.masters.len() / 2 + 1
    }

    fn scripts(&self) -> [&Script; 9] {
        [
            &self.lease,
            &self.write,
            &self.renew,
            &self.release,
            &self.record,
            &self.registry,
            &self.pause,
            &self.trigger,
            &self.withdraw,
        ]
    }

    fn key(&self, job: &str, kind: &str) -> String {
        job_key(&self.prefix, job, kind)
    }

    /// Whether `master` may count in a quorum for a lease of `lease`: not
    /// while it has been up for less than that (it may have restarted and
    /// lost leases and fences).
    fn counts(&self, master: &Master, lease: Duration) -> bool {
        !self.quarantine
            || master
                .life()
                .started_at
                .is_none_or(|t| t.elapsed() >= lease)
    }

    fn unavailable(&self, reason: String) -> StoreError {
        StoreError::Unavailable {
            store: self.url.redacted().into(),
            reason,
        }
    }

    /// Runs `call` on every master at once. Waits for all answers, but once
    /// a majority answered, no longer than [`STRAGGLER_WAIT`] for the rest,
    /// and never past `op_timeout`; `None` for a master that did not answer
    /// in time.
    async fn each<'a, T, F, Fut>(&'a self, call: F) -> Vec<Option<Result<T, StoreError>>>
    where
        F: Fn(&'a Master) -> Fut,
        Fut: Future<Output = Result<T, StoreError>> + 'a,
    {
        self.each_until(call, |_| true).await
    }

    /// [`RedlockStore::each`], with the wait for stragglers starting only
    /// once a majority answered **and** `settled` says the answers so far
    /// decide everything the call asked (a master whose answer could still
    /// change an outcome is waited for, up to `op_timeout`).
    async fn each_until<'a, T, F, Fut>(
        &'a self,
        call: F,
        settled: impl Fn(&[Option<Result<T, StoreError>>]) -> bool,
    ) -> Vec<Option<Result<T, StoreError>>>
    where
        F: Fn(&'a Master) -> Fut,
        Fut: Future<Output = Result<T, StoreError>> + 'a,
    {
        let mut pending: FuturesUnordered<_> = self
            .masters
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let fut = call(m);
                async move { (i, fut.await) }
            })
            .collect();
        let mut answers: Vec<Option<Result<T, StoreError>>> =
            self.masters.iter().map(|_| None).collect();
        let started = Instant::now();
        let mut deadline = started + self.op_timeout;
        let mut ok = 0;
        let mut straggling = false;
        loop {
            tokio::select! {
                next = pending.next() => {
                    let Some((i, answer)) = next else { break };
                    let master = &self.masters[i];
                    match &answer {
                        Ok(_) => {
                            master.answered();
                            ok += 1;
                        }
                        Err(e) if e.is_unreachable() => master.failed(e),
                        Err(_) => {}
                    }
                    answers[i] = Some(answer);
                    if !straggling && ok >= self.majority() && settled(&answers) {
                        straggling = true;
                        deadline = deadline.min(Instant::now() + STRAGGLER_WAIT);
                    }
                }
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        // A master left behind once the others had decided the call is
        // slow, not failing; one that let the whole op_timeout pass is.
        if !straggling {
            for (master, answer) in self.masters.iter().zip(&answers) {
                if answer.is_none() {
                    master.failed(&StoreError::Timeout(started.elapsed()));
                }
            }
        }
        answers
    }

    /// One script on one master, behind `INFO server` (to see a restart).
    async fn eval_on<T: redis::FromRedisValue>(
        &self,
        master: &Master,
        script: &Script,
        keys: &[String],
        args: &[String],
    ) -> Result<T, StoreError> {
        let [reply] = self
            .evals_on::<1, T>(master, [(script, keys, args)])
            .await?;
        reply
    }

    /// `N` scripts on one master in one pipeline, behind `INFO server` (to
    /// see a restart): each script's reply, decoded, or why not. An error
    /// for the whole call when the master did not answer.
    async fn evals_on<const N: usize, T: redis::FromRedisValue>(
        &self,
        master: &Master,
        calls: [(&Script, &[String], &[String]); N],
    ) -> Result<[Result<T, StoreError>; N], StoreError> {
        let mut conn = master.connection(self.op_timeout).await?;
        let build = |which: &[usize]| {
            let mut pipe = redis::pipe();
            pipe.cmd("INFO").arg("server");
            for &i in which {
                add_evalsha(&mut pipe, calls[i]);
            }
            pipe
        };
        let scripts = self.scripts();
        let replies: Vec<redis::Value> = match eval_loading(&mut conn, &scripts, 1, N, build).await
        {
            // The connection broke (the master restarted): the manager
            // connects again, and every script here may run twice.
            Err(e) if e.is_connection_dropped() || e.is_io_error() => {
                eval_loading(&mut conn, &scripts, 1, N, build).await
            }
            other => other,
        }
        .map_err(|e| store_error(&master.url, &e))?;
        let malformed = |reason: String| StoreError::Backend {
            store: master.url.redacted().into(),
            reason,
        };
        if replies.len() != N + 1 {
            return Err(malformed(format!(
                "{} replies to INFO and {N} scripts",
                replies.len()
            )));
        }
        let mut replies = replies.into_iter();
        let info: String = replies
            .next()
            .map(redis::from_redis_value)
            .transpose()
            .map_err(|e| malformed(format!("unexpected reply to INFO: {e}")))?
            .unwrap_or_default();
        master.observe(&info);
        Ok(std::array::from_fn(|_| match replies.next() {
            Some(redis::Value::ServerError(e)) => {
                Err(store_error(&master.url, &redis::RedisError::from(e)))
            }
            Some(reply) => redis::from_redis_value(reply)
                .map_err(|e| malformed(format!("unexpected reply: {e}"))),
            None => Err(malformed("a script's reply is missing".into())),
        }))
    }

    /// A command without arguments on one master.
    async fn cmd_on<T: redis::FromRedisValue>(
        &self,
        master: &Master,
        name: &'static str,
    ) -> Result<T, StoreError> {
        let mut conn = master.connection(self.op_timeout).await?;
        redis::cmd(name)
            .query_async(&mut conn)
            .await
            .map_err(|e| store_error(&master.url, &e))
    }

    /// The answers of those that answered, or an error when fewer than a
    /// majority did.
    fn quorum<T>(
        &self,
        answers: Vec<Option<Result<T, StoreError>>>,
    ) -> Result<Vec<(usize, T)>, StoreError> {
        let mut ok = Vec::new();
        let mut last_error = None;
        for (i, a) in answers.into_iter().enumerate() {
            match a {
                Some(Ok(v)) => ok.push((i, v)),
                Some(Err(e)) => last_error = Some(e),
                None => {}
            }
        }
        if ok.len() >= self.majority() {
            return Ok(ok);
        }
        let why = last_error.map_or_else(|| "no answer in time".to_string(), |e| e.to_string());
        Err(self.unavailable(format!(
            "{} of {} Redis masters answered; a majority ({}) must ({why})",
            ok.len(),
            self.masters.len(),
            self.majority()
        )))
    }

    /// Phase 1 for `requests[i]`, `i` in `which`: per master, its time and
    /// its entries (in `which` order). With `beat` (`registry.lua`'s
    /// arguments), each master's pipeline carries the heartbeat first, and
    /// the live records come back too if a majority took it.
    async fn take_leases(
        &self,
        requests: &[ClaimRequest],
        which: &[usize],
        beat: Option<&[String]>,
    ) -> (LeaseAnswers, Option<Vec<NodeRecord>>) {
        let mut keys = Vec::with_capacity(2 * which.len());
        let mut args = Vec::with_capacity(5 * which.len());
        for &i in which {
            let r = &requests[i];
            keys.push(self.key(r.job.as_str(), "lease"));
            keys.push(self.key(r.job.as_str(), "state"));
            args.push(r.owner.as_str().to_string());
            args.push(if r.recheck_only {
                "0".to_string()
            } else {
                duration_ms(r.lease).max(1).to_string()
            });
            args.push(to_ms(r.occurrence).to_string());
            args.push(
                r.head_start
                    .map_or(String::new(), |h| duration_ms(h).to_string()),
            );
            args.push(if r.manual.is_some() { "1" } else { "" }.to_string());
        }
        let (keys, args) = (&keys, &args);
        // Settled when each request has a majority for one owner.
        let settled = |answers: &[LeaseAnswer]| {
            which.iter().enumerate().all(|(slot, &i)| {
                let t = self.tally(answers, slot, &requests[i]);
                t.ours >= self.majority()
                    || top_holder(&t.others).is_some_and(|(_, p)| p.len() >= self.majority())
            })
        };
        let Some(beat_args) = beat else {
            let answers = self
                .each_until(|m| self.eval_on(m, &self.lease, keys, args), settled)
                .await;
            return (answers, None);
        };
        let beat_keys = [self.registry_key()];
        let beats: std::sync::Mutex<Vec<Option<Vec<String>>>> =
            std::sync::Mutex::new(self.masters.iter().map(|_| None).collect());
        let (beat_keys, beats_ref) = (&beat_keys, &beats);
        let answers = self
            .each_until(
                |m| async move {
                    let [beaten, leased] = self
                        .evals_on::<2, redis::Value>(
                            m,
                            [
                                (&self.registry, beat_keys, beat_args),
                                (&self.lease, keys, args),
                            ],
                        )
                        .await?;
                    let slot = self.masters.iter().position(|x| std::ptr::eq(x, m));
                    match (beaten.and_then(|v| decoded(m, v)), slot) {
                        (Ok(reply), Some(slot)) => {
                            if let Ok(mut beats) = beats_ref.lock() {
                                beats[slot] = Some(reply);
                            }
                        }
                        (Err(e), _) => {
                            tracing::debug!("the heartbeat in a claim's first phase failed: {e}")
                        }
                        _ => {}
                    }
                    leased.and_then(|v| decoded(m, v))
                },
                settled,
            )
            .await;
        let beats: Vec<Vec<String>> = beats
            .into_inner()
            .unwrap_or_default()
            .into_iter()
            .flatten()
            .collect();
        let nodes = (beats.len() >= self.majority()).then(|| freshest_records(beats));
        (answers, nodes)
    }

    /// Counts the masters' phase-1 answers for request `slot` of the call.
    fn tally(&self, answers: &[LeaseAnswer], slot: usize, req: &ClaimRequest) -> Tally {
        let mut t = Tally::default();
        let mut best: Option<i128> = None;
        for (m, answer) in answers.iter().enumerate() {
            let Some(Ok((_, entries))) = answer else {
                continue;
            };
            let Some((
                got,
                holder,
                pttl,
                fence,
                last,
                state_owner,
                idle_wait,
                paused,
                pause_gen,
                trigger,
                last_trigger,
            )) = entries.get(slot)
            else {
                continue;
            };
            if *got == -2 {
                t.errors.push(holder.clone().unwrap_or_default());
                continue;
            }
            if *got == 1 {
                t.taken.push(m);
            }
            let fence = fence.parse::<u64>().unwrap_or(0);
            if best.is_none_or(|b| i128::from(fence) > b) {
                best = Some(i128::from(fence));
                t.fence = fence;
                t.fence_owner = state_owner.clone();
            } else if best == Some(i128::from(fence)) && t.fence_owner != *state_owner {
                // Two claims with the same fence (one only ever reached a
                // minority): the owner of the last claim is not known.
                t.fence_owner = None;
            }
            if *last >= 0 {
                t.last = Some(t.last.map_or(*last, |l| l.max(*last)));
            }
            t.pause = t.pause.merge(PauseMark(*pause_gen, *paused == 1));
            let names = |stored: &Option<String>| {
                req.manual.is_some()
                    && stored.as_deref().and_then(TriggerId::parse_stored) == req.manual
            };
            t.trigger_taken |= names(last_trigger);
            if !self.counts(&self.masters[m], req.lease) {
                continue;
            }
            t.counted += 1;
            if names(trigger) {
                t.trigger_pending += 1;
            }
            match (got, holder) {
                (1, _) => t.ours += 1,
                (2 | 3, _) => {
                    t.ours += 1;
                    t.ours_before += 1;
                    t.ours_pttl.push(*pttl);
                    t.ours_busy += usize::from(*got == 3);
                }
                (_, Some(h)) => {
                    t.others.push((h.clone(), *pttl));
                    if *idle_wait >= 0 {
                        t.idle_waits.push(*idle_wait);
                    }
                }
                _ => {}
            }
        }
        t
    }

    fn vote(&self, t: &Tally, req: &ClaimRequest) -> Vote {
        let m = self.majority();
        if t.ours >= m {
            return Vote::Ours;
        }
        let top = top_holder(&t.others);
        if let Some((holder, pttls)) = &top {
            if let Some(left) = majority_left(pttls.clone(), m) {
                return Vote::Held {
                    holder: holder.to_string(),
                    remaining: Duration::from_millis(left),
                    idle_wait: majority_past(t.idle_waits.clone(), m),
                };
            }
        }
        match (t.counted >= m, req.recheck_only) {
            // A recheck takes nothing: it reads a majority's state.
            (true, true) => Vote::Ours,
            (true, false) => Vote::Split {
                holder: top.map(|(h, _)| h.to_string()),
            },
            (false, _) => Vote::Undecided,
        }
    }

    /// Gives back the leases this call took (`SET NX`) for claims that do
    /// not go on, each only on the masters where it took it: a lease that
    /// was ours before the call may protect a running job and stays.
    async fn give_back(&self, taken: &[(&ClaimRequest, &[usize])]) {
        let Some((first, _)) = taken.first() else {
            return;
        };
        let owner = [first.owner.as_str().to_string()];
        let per_master: Vec<Vec<String>> = (0..self.masters.len())
            .map(|m| {
                taken
                    .iter()
                    .filter(|(_, on)| on.contains(&m))
                    .map(|(r, _)| self.key(r.job.as_str(), "lease"))
                    .collect()
            })
            .collect();
        let calls = self
            .masters
            .iter()
            .zip(&per_master)
            .filter(|(_, keys)| !keys.is_empty())
            .map(|(m, keys)| self.eval_on::<i64>(m, &self.release, keys, &owner));
        for r in futures_util::future::join_all(calls).await {
            if let Err(e) = r {
                tracing::debug!(store = %self.url, "giving back the leases of a claim that did not go on failed ({e}); they expire");
            }
        }
    }

    /// Phase 1 with its split votes tried again: the requests whose lease
    /// is ours on a majority (with what the masters reported), and the
    /// store's clock; the others' answers go into `outcomes`.
    async fn lease_rounds(
        &self,
        requests: &[ClaimRequest],
        outcomes: &mut [Option<ClaimOutcome>],
        beat: Option<&[String]>,
    ) -> Result<(Vec<(usize, Tally)>, i64, Option<Vec<NodeRecord>>), StoreError> {
        let mut ours: Vec<(usize, Tally)> = Vec::new();
        let mut pending: Vec<usize> = (0..requests.len()).collect();
        let mut store_now = None;
        let mut nodes = None;
        for round in 0..SPLIT_ROUNDS {
            // The heartbeat rides the first round only.
            let (answers, beaten) = self
                .take_leases(requests, &pending, beat.filter(|_| round == 0))
                .await;
            if round == 0 {
                nodes = beaten;
            }
            let clocks = answers
                .iter()
                .filter_map(|a| {
                    a.as_ref()
                        .and_then(|r| r.as_ref().ok())
                        .map(|(now, _)| *now)
                })
                .collect();
            store_now = median(clocks).or(store_now);
            let mut split = Vec::new();
            let mut undecided = Vec::new();
            let mut give_back: Vec<(&ClaimRequest, Vec<usize>)> = Vec::new();
            for (slot, &i) in pending.iter().enumerate() {
                let req = &requests[i];
                let mut t = self.tally(&answers, slot, req);
                if t.errors.len() >= self.majority() {
                    outcomes[i] = Some(ClaimOutcome::Failed(format!(
                        "the claim of job {} failed in the servers: {}",
                        req.job,
                        one_line(&t.errors[0])
                    )));
                    give_back.push((req, std::mem::take(&mut t.taken)));
                    continue;
                }
                let vote = self.vote(&t, req);
                if !matches!(vote, Vote::Ours) {
                    give_back.push((req, std::mem::take(&mut t.taken)));
                }
                match vote {
                    Vote::Ours => ours.push((i, t)),
                    Vote::Held {
                        holder,
                        remaining,
                        idle_wait,
                    } => {
                        outcomes[i] = Some(ClaimOutcome::Lost(Lost {
                            holder: Some(holder),
                            remaining,
                            last_occurrence: t.last.map(from_ms),
                            fence: t.fence,
                            too_early: false,
                            idle_wait: idle_wait.map(|w| w.min(remaining)),
                            paused: t.pause.1,
                            trigger_gone: req.manual.is_some() && t.trigger_taken,
                            stale: false,
                        }));
                    }
                    // Still split after the last round: a short wait, so the
                    // node claims again soon instead of giving up.
                    Vote::Split { holder } if round + 1 == SPLIT_ROUNDS => {
                        outcomes[i] = Some(ClaimOutcome::Lost(Lost {
                            holder: holder.or_else(|| Some("(split vote)".into())),
                            remaining: jitter(),
                            last_occurrence: t.last.map(from_ms),
                            fence: t.fence,
                            too_early: false,
                            idle_wait: None,
                            paused: t.pause.1,
                            trigger_gone: req.manual.is_some() && t.trigger_taken,
                            stale: false,
                        }));
                    }
                    Vote::Split { .. } => split.push(i),
                    Vote::Undecided => undecided.push((i, t.counted)),
                }
            }
            let taken: Vec<(&ClaimRequest, &[usize])> =
                give_back.iter().map(|(r, m)| (*r, m.as_slice())).collect();
            self.give_back(&taken).await;
            let answered = answers.iter().filter(|a| matches!(a, Some(Ok(_)))).count();
            let why = |counted: usize| {
                format!(
                    "{answered} of {} Redis masters answered and {counted} of them count for this lease; a majority ({}) must (a master counts in no quorum until it has been up for one lease length)",
                    self.masters.len(),
                    self.majority()
                )
            };
            if undecided.len() == requests.len() {
                // Nothing could be decided: the store is out of reach.
                return Err(self.unavailable(why(undecided
                    .iter()
                    .map(|u| u.1)
                    .min()
                    .unwrap_or(0))));
            }
            for (i, counted) in undecided {
                outcomes[i] = Some(ClaimOutcome::Failed(format!(
                    "the claim of job {} could not be decided: {}",
                    requests[i].job,
                    why(counted)
                )));
            }
            if split.is_empty() {
                break;
            }
            tokio::time::sleep(jitter()).await;
            pending = split;
        }
        Ok((ours, store_now.unwrap_or_default(), nodes))
    }

    /// A claim of a non-empty batch, with `beat` (`registry.lua`'s
    /// arguments) in each master's first-phase pipeline: the live records
    /// come back when a majority took the heartbeat.
    async fn claim_with(
        &self,
        requests: &[ClaimRequest],
        beat: Option<&[String]>,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        let started = Instant::now();
        let mut outcomes: Vec<Option<ClaimOutcome>> = requests.iter().map(|_| None).collect();
        let (ours, store_now, nodes) = self.lease_rounds(requests, &mut outcomes, beat).await?;
        self.decide_and_write(requests, ours, store_now, started, &mut outcomes)
            .await?;
        let outcomes = outcomes
            .into_iter()
            .zip(requests)
            .map(|(o, r)| {
                o.unwrap_or_else(|| {
                    ClaimOutcome::Failed(format!("the claim of job {} was not decided", r.job))
                })
            })
            .collect();
        let claimed = Claimed {
            store_now: from_ms(store_now),
            outcomes,
        };
        Ok((claimed, nodes))
    }

    /// Phase 2: the claim rule on what the masters reported, then the wins
    /// written to the masters. A win written short of a majority, or past
    /// its lease's validity, makes the call fail: the node retries it as an
    /// unanswered claim, and a win that did land is answered again.
    async fn decide_and_write(
        &self,
        requests: &[ClaimRequest],
        ours: Vec<(usize, Tally)>,
        store_now: i64,
        started: Instant,
        outcomes: &mut [Option<ClaimOutcome>],
    ) -> Result<(), StoreError> {
        let mut to_write: Vec<Decided> = Vec::new();
        let mut refused: Vec<(&ClaimRequest, Vec<usize>)> = Vec::new();
        for (i, t) in ours {
            let req = &requests[i];
            // A manual claim on our own lease whose run is in progress (a
            // majority says so) sees it as such: refused unless it retries
            // an earlier manual win.
            let busy = req.manual.is_some() && t.ours_busy >= self.majority();
            let row = LockRow {
                owner: if busy {
                    Some(req.owner.as_str().to_string())
                } else {
                    t.fence_owner.clone()
                },
                fence: i64::try_from(t.fence).unwrap_or(i64::MAX),
                expires_at: if busy { store_now.saturating_add(1) } else { 0 },
                last_occurrence: t.last,
                // The lease was decided in phase 1 (where an idle holder's
                // head start is judged by each master's running mark and
                // clock): no live lease is left for the claim rule to see,
                // but a manual claim's own busy one (above).
                running: true,
                // The mark of the highest generation among the answers,
                // a majority: a pause written to a majority is among them.
                paused: t.pause.1,
                // A request is pending when a majority has it and no master
                // saw it taken (a taking claim wrote a majority, which every
                // majority read meets).
                trigger: req
                    .manual
                    .filter(|_| t.trigger_pending >= self.majority() && !t.trigger_taken)
                    .map(TriggerId::get),
                last_trigger: req.manual.filter(|_| t.trigger_taken).map(TriggerId::get),
                now: store_now,
            };
            match decide(&row, req) {
                // A recheck answers an earlier win as it stands.
                Decision::Claim { won, .. } if req.recheck_only => {
                    outcomes[i] = Some(ClaimOutcome::Won(won));
                }
                Decision::Claim {
                    fence,
                    last_occurrence,
                    won,
                    ..
                } => to_write.push((i, fence, last_occurrence, won, t.taken)),
                Decision::Refuse(mut lost) => {
                    if t.ours_before >= self.majority()
                        && t.fence_owner.as_deref() == Some(req.owner.as_str())
                    {
                        // Our own lease and our own last claim: say so.
                        lost.holder = Some(req.owner.as_str().to_string());
                        lost.remaining = Duration::from_millis(
                            majority_left(t.ours_pttl, self.majority()).unwrap_or(0),
                        );
                    }
                    outcomes[i] = Some(ClaimOutcome::Lost(lost));
                    refused.push((req, t.taken));
                }
                Decision::FenceExhausted => {
                    outcomes[i] = Some(ClaimOutcome::Failed(fence_exhausted(req.job.as_str())));
                    refused.push((req, t.taken));
                }
            }
        }
        let taken: Vec<(&ClaimRequest, &[usize])> =
            refused.iter().map(|(r, m)| (*r, m.as_slice())).collect();
        self.give_back(&taken).await;
        if to_write.is_empty() {
            return Ok(());
        }
        let valid_before = to_write
            .iter()
            .all(|(i, ..)| validity(requests[*i].lease, started.elapsed()).is_some());
        let written = if valid_before {
            let claims: Vec<(&ClaimRequest, i64, Option<i64>)> = to_write
                .iter()
                .map(|(i, f, l, ..)| (&requests[*i], *f, *l))
                .collect();
            self.write_claims(&claims).await
        } else {
            vec![0; to_write.len()]
        };
        let elapsed = started.elapsed();
        let mut short: Vec<(&ClaimRequest, usize, Vec<usize>)> = Vec::new();
        for ((i, _, _, won, taken), n) in to_write.into_iter().zip(written) {
            let req = &requests[i];
            if n >= self.majority() && validity(req.lease, elapsed).is_some() {
                outcomes[i] = Some(ClaimOutcome::Won(won));
            } else {
                short.push((req, n, taken));
            }
        }
        let Some((first, n, _)) = short.first() else {
            return Ok(());
        };
        let message = format!(
            "the claim of job {} (and {} more) was written on {n} of {} Redis masters within its lease's validity ({elapsed:?} elapsed); a majority ({}) must: the leases it took were given back",
            first.job,
            short.len() - 1,
            self.masters.len(),
            self.majority()
        );
        let taken: Vec<(&ClaimRequest, &[usize])> =
            short.iter().map(|(r, _, m)| (*r, m.as_slice())).collect();
        self.give_back(&taken).await;
        Err(self.unavailable(message))
    }

    /// Phase 2: writes each decided claim; per claim, how many counted
    /// masters wrote it.
    async fn write_claims(&self, claims: &[(&ClaimRequest, i64, Option<i64>)]) -> Vec<usize> {
        let mut keys = Vec::with_capacity(2 * claims.len() + 1);
        let mut args = Vec::with_capacity(6 * claims.len());
        for (r, fence, last) in claims {
            keys.push(self.key(r.job.as_str(), "lease"));
            keys.push(self.key(r.job.as_str(), "state"));
            args.extend([
                r.owner.as_str().to_string(),
                duration_ms(r.lease).max(1).to_string(),
                fence.to_string(),
                last.map(|l| l.to_string()).unwrap_or_default(),
                r.manual.map(|id| id.get().to_string()).unwrap_or_default(),
                r.job.as_str().to_string(),
            ]);
        }
        keys.push(triggers_key(&self.prefix));
        let leases: Vec<Duration> = claims.iter().map(|(r, ..)| r.lease).collect();
        let (done, _) = self.each_request(&self.write, &keys, &args, &leases).await;
        done
    }

    /// Runs a script that answers 1 or 0 per request (of lease `leases[i]`)
    /// on every master, waiting until each request has a majority of 1s or
    /// the masters answered: per request, how many counted masters answered
    /// 1, and every master's answer.
    async fn each_request(
        &self,
        script: &Script,
        keys: &[String],
        args: &[String],
        leases: &[Duration],
    ) -> (Vec<usize>, Vec<Option<Result<Vec<i64>, StoreError>>>) {
        let answers = self
            .each_until(
                |m| self.eval_on::<Vec<i64>>(m, script, keys, args),
                |answers| {
                    self.done_counts(answers, leases)
                        .iter()
                        .all(|n| *n >= self.majority())
                },
            )
            .await;
        (self.done_counts(&answers, leases), answers)
    }

    /// Per request (of lease `leases[i]`), how many counted masters answered
    /// 1 for it.
    fn done_counts(
        &self,
        answers: &[Option<Result<Vec<i64>, StoreError>>],
        leases: &[Duration],
    ) -> Vec<usize> {
        leases
            .iter()
            .enumerate()
            .map(|(i, lease)| {
                answers
                    .iter()
                    .zip(&self.masters)
                    .filter(|(a, m)| {
                        matches!(a, Some(Ok(done)) if done.get(i) == Some(&1))
                            && self.counts(m, *lease)
                    })
                    .count()
            })
            .collect()
    }
}

/// The lease's validity after `elapsed`: lease − elapsed − (1% + 2 ms),
/// if any is left.
fn validity(lease: Duration, elapsed: Duration) -> Option<Duration> {
    lease
        .checked_sub(elapsed + lease / 100 + Duration::from_millis(2))
        .filter(|v| !v.is_zero())
}

/// The owner holding the most leases in `leases` (owner, time left in ms),
/// with those times left.
fn top_holder(leases: &[(String, i64)]) -> Option<(&str, Vec<i64>)> {
    let mut by_owner: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (owner, pttl) in leases {
        by_owner.entry(owner).or_default().push(*pttl);
    }
    by_owner.into_iter().max_by_key(|(_, p)| p.len())
}

/// How long (ms) leases with these times left still make a majority of
/// `majority`: until all but `majority - 1` of them ended. `None` when they
/// are fewer than a majority.
fn majority_left(mut pttls: Vec<i64>, majority: usize) -> Option<u64> {
    let k = pttls.len().checked_sub(majority)?;
    pttls.sort_unstable();
    Some(pttls[k].max(0) as u64)
}

/// How long until `majority` of these waits (ms) are over: the
/// `majority`-th shortest. `None` when they are fewer.
fn majority_past(mut waits: Vec<i64>, majority: usize) -> Option<Duration> {
    waits.sort_unstable();
    let wait = *waits.get(majority.checked_sub(1)?)?;
    Some(Duration::from_millis(wait.max(0) as u64))
}

/// The median of the masters' clocks.
fn median(mut times: Vec<i64>) -> Option<i64> {
    times.sort_unstable();
    times.get(times.len() / 2).copied()
}

fn jitter() -> Duration {
    let mut b = [0u8; 1];
    let r = if getrandom::fill(&mut b).is_ok() {
        u64::from(b[0])
    } else {
        u64::from(Utc::now().timestamp_subsec_micros() % 256)
    };
    Duration::from_millis(1 + r * SPLIT_PAUSE_MAX_MS / 256)
}

impl Master {
    fn life(&self) -> std::sync::MutexGuard<'_, Life> {
        crate::store::lock(&self.life)
    }

    async fn connection(&self, op_timeout: Duration) -> Result<ConnectionManager, StoreError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = ConnectionManager::new_with_config(self.client.clone(), manager_config(op_timeout))
            .await
            .map_err(|e| store_error(&self.url, &e))?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Reads `run_id` and `uptime_in_seconds` from `INFO server`: when the
    /// master started, and whether it restarted since last seen.
    fn observe(&self, info: &str) {
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.trim().strip_prefix(name).map(str::to_string))
        };
        let run_id = field("run_id:");
        let uptime = field("uptime_in_seconds:").and_then(|u| u.parse::<u64>().ok());
        let mut life = self.life();
        if let Some(up) = uptime {
            let now = Instant::now();
            life.started_at = Some(now.checked_sub(Duration::from_secs(up)).unwrap_or(now));
        }
        let Some(run_id) = run_id else {
            return;
        };
        if life.run_id.as_deref().is_some_and(|known| known != run_id) {
            tracing::warn!(
                master = %self.url,
                "Redis master restarted (its run_id changed): it may have lost leases and fences, so it counts in no quorum until it has been up for one lease length of each job"
            );
        }
        life.run_id = Some(run_id);
    }

    fn answered(&self) {
        if let Some(since) = self.life().failing_since.take() {
            tracing::info!(master = %self.url, "Redis master answers again after {:?}", since.elapsed());
        }
    }

    fn failed(&self, e: &StoreError) {
        let mut life = self.life();
        if life.failing_since.is_none() {
            life.failing_since = Some(Instant::now());
            tracing::warn!(master = %self.url, "Redis master does not answer ({e}): claims go on while a majority does");
        }
    }
}

#[async_trait]
impl Locks for RedlockStore {
    async fn prepare(&self) -> Result<(), StoreError> {
        let answers = self
            .each(|m| async move {
                let mut conn = m.connection(self.op_timeout).await?;
                for script in self.scripts() {
                    script
                        .prepare_invoke()
                        .load_async(&mut conn)
                        .await
                        .map_err(|e| store_error(&m.url, &e))?;
                }
                let info: String = redis::cmd("INFO")
                    .arg("server")
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| store_error(&m.url, &e))?;
                m.observe(&info);
                Ok(())
            })
            .await;
        self.quorum(answers).map(|_| ())
    }

    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Claimed, StoreError> {
        if requests.is_empty() {
            return self.clock().await.map(|store_now| Claimed {
                store_now,
                outcomes: Vec::new(),
            });
        }
        self.claim_with(requests, None)
            .await
            .map(|(claimed, _)| claimed)
    }

    async fn clock(&self) -> Result<DateTime<Utc>, StoreError> {
        let answers = self.each(|m| self.cmd_on::<(i64, i64)>(m, "TIME")).await;
        let times = self
            .quorum(answers)?
            .into_iter()
            .map(|(_, (s, us))| s.saturating_mul(1000).saturating_add(us / 1000))
            .collect();
        Ok(from_ms(median(times).unwrap_or_default()))
    }

    async fn renew_many(
        &self,
        owner: &Owner,
        renewals: &[Renewal],
    ) -> Result<Vec<bool>, StoreError> {
        if renewals.is_empty() {
            return Ok(Vec::new());
        }
        let started = Instant::now();
        let (keys, args) = renew_args(&self.prefix, owner, renewals);
        let leases: Vec<Duration> = renewals.iter().map(|r| r.lease).collect();
        let (extended, answers) = self.each_request(&self.renew, &keys, &args, &leases).await;
        self.quorum(answers)?;
        let elapsed = started.elapsed();
        Ok(renewals
            .iter()
            .zip(extended)
            .map(|(r, n)| n >= self.majority() && validity(r.lease, elapsed).is_some())
            .collect())
    }

    async fn release(&self, jobs: &[JobName], owner: &Owner) -> Result<usize, StoreError> {
        if jobs.is_empty() {
            return Ok(0);
        }
        let keys: Vec<String> = jobs.iter().map(|j| self.key(j.as_str(), "lease")).collect();
        let args = [owner.as_str().to_string()];
        let (k, a) = (&keys, &args);
        let answers = self
            .each(|m| self.eval_on::<i64>(m, &self.release, k, a))
            .await;
        let released = self.quorum(answers)?;
        Ok(released
            .into_iter()
            .map(|(_, n)| n.max(0) as usize)
            .max()
            .unwrap_or(0))
    }

    /// Two rounds, like a claim's fence: the highest pause generation a
    /// majority reports, then the mark with the generation above it written
    /// to the masters, done when a majority took it. A master that missed
    /// it holds a lower generation, which every later read outranks.
    async fn set_paused(&self, jobs: &[JobName], paused: bool) -> Result<(), StoreError> {
        if jobs.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = jobs.iter().map(|j| self.key(j.as_str(), "state")).collect();
        let k = &keys;
        let answers = self.each(|m| self.pause_gens_on(m, k)).await;
        let read = self.quorum(answers)?;
        let highest = read.iter().flat_map(|(_, gens)| gens).copied().max();
        let generation = highest.unwrap_or(0).saturating_add(1);
        let args = [
            if paused { "1" } else { "0" }.to_string(),
            generation.to_string(),
        ];
        let a = &args;
        let answers = self
            .each(|m| self.eval_on::<i64>(m, &self.pause, k, a))
            .await;
        self.quorum(answers).map(|_| ())
    }

    /// `trigger.lua` on every master: accepted when a majority took the
    /// request (a claim then finds it on a majority, and takes it on one);
    /// otherwise it is withdrawn where it was taken, and the answer is the
    /// run in progress or the pending request the masters named.
    async fn request_trigger(
        &self,
        job: &JobName,
        id: TriggerId,
    ) -> Result<TriggerAnswer, StoreError> {
        let name = job.as_str();
        let keys = [
            self.key(name, "lease"),
            self.key(name, "state"),
            triggers_key(&self.prefix),
        ];
        let args = [id.get().to_string(), name.to_string()];
        let (k, a) = (&keys, &args);
        let accepted = |answers: &[Option<Result<(i64, String, Option<String>), StoreError>>]| {
            answers
                .iter()
                .filter(|a| matches!(a, Some(Ok((0, _, _)))))
                .count()
        };
        let answers = self
            .each_until(
                |m| self.eval_on::<(i64, String, Option<String>)>(m, &self.trigger, k, a),
                |answers| accepted(answers) >= self.majority(),
            )
            .await;
        if accepted(&answers) >= self.majority() {
            return Ok(TriggerAnswer::Accepted);
        }
        let took: Vec<usize> = answers
            .iter()
            .enumerate()
            .filter(|(_, a)| !matches!(a, Some(Ok((1 | 2, _, _)))))
            .map(|(m, _)| m)
            .collect();
        let withdraw_keys = [self.key(name, "state"), triggers_key(&self.prefix)];
        let (wk, took) = (&withdraw_keys, &took);
        let masters: Vec<&Master> = took.iter().map(|&m| &self.masters[m]).collect();
        let calls = masters
            .iter()
            .map(|m| self.eval_on::<i64>(m, &self.withdraw, wk, a));
        for r in futures_util::future::join_all(calls).await {
            if let Err(e) = r {
                tracing::debug!(store = %self.url, "withdrawing a request a majority did not take failed ({e})");
            }
        }
        let refusals: Vec<(i64, String, Option<String>)> = answers
            .into_iter()
            .filter_map(|a| match a {
                Some(Ok(r)) if r.0 != 0 => Some(r),
                _ => None,
            })
            .collect();
        if let Some((_, _, holder)) = refusals.iter().find(|r| r.0 == 1) {
            return Ok(TriggerAnswer::Running {
                holder: holder.clone(),
            });
        }
        if let Some(pending) = refusals.iter().find_map(|r| TriggerId::parse_stored(&r.1)) {
            return Ok(TriggerAnswer::Pending(pending));
        }
        Err(self.unavailable(format!(
            "the request was taken by fewer than a majority ({}) of {} Redis masters and withdrawn",
            self.majority(),
            self.masters.len()
        )))
    }

    /// `withdraw.lua` on every master: withdrawn only when a majority still
    /// had it pending (a claim that won it took it on a majority, so then
    /// none did).
    async fn withdraw_trigger(&self, job: &JobName, id: TriggerId) -> Result<bool, StoreError> {
        let keys = [self.key(job.as_str(), "state"), triggers_key(&self.prefix)];
        let args = [id.get().to_string(), job.as_str().to_string()];
        let (k, a) = (&keys, &args);
        let answers = self
            .each(|m| self.eval_on::<i64>(m, &self.withdraw, k, a))
            .await;
        let answered = self.quorum(answers)?;
        Ok(answered.iter().filter(|(_, w)| *w == 1).count() >= self.majority())
    }

    /// The requests a majority of masters hold.
    async fn pending_triggers(&self) -> Result<Vec<(String, TriggerId)>, StoreError> {
        let key = triggers_key(&self.prefix);
        let k = &key;
        let answers = self
            .each(|m| async move {
                let mut conn = m.connection(self.op_timeout).await?;
                redis::cmd("HGETALL")
                    .arg(k)
                    .query_async::<Vec<(String, String)>>(&mut conn)
                    .await
                    .map_err(|e| store_error(&m.url, &e))
            })
            .await;
        let answered = self.quorum(answers)?;
        let mut seen: BTreeMap<(String, TriggerId), usize> = BTreeMap::new();
        for (_, pairs) in answered {
            for (job, id) in pairs {
                if let Some(id) = TriggerId::parse_stored(&id) {
                    *seen.entry((job, id)).or_default() += 1;
                }
            }
        }
        Ok(seen
            .into_iter()
            .filter(|(_, n)| *n >= self.majority())
            .map(|(key, _)| key)
            .collect())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let answers = self.each(|m| self.cmd_on::<String>(m, "PING")).await;
        self.quorum(answers).map(|_| ())
    }

    async fn status(&self) -> Result<Vec<LockStatus>, StoreError> {
        let answers = self.each(|m| self.status_of(m)).await;
        let answered = self.quorum(answers)?;
        let mut jobs: BTreeMap<String, Vec<ServerLock>> = BTreeMap::new();
        for (_, locks) in answered {
            for l in locks {
                jobs.entry(l.job.clone()).or_default().push(l);
            }
        }
        let m = self.majority();
        Ok(jobs
            .into_iter()
            .map(|(job, locks)| {
                let top = locks.iter().max_by_key(|l| l.fence);
                let leases: Vec<(String, i64)> = locks
                    .iter()
                    .filter_map(|l| l.holder.clone().map(|h| (h, l.pttl)))
                    .collect();
                let live = top_holder(&leases)
                    .and_then(|(h, p)| majority_left(p, m).map(|left| (h.to_string(), left)));
                LockStatus {
                    job,
                    holder: live.as_ref().map(|(h, _)| h.clone()),
                    lease_remaining_ms: live.map_or(0, |(_, left)| left),
                    fence: top.map_or(0, |l| l.fence),
                    last_occurrence: locks.iter().filter_map(|l| l.last).max().map(from_ms),
                    last_owner: top.and_then(|l| l.owner.clone()),
                    paused: locks
                        .iter()
                        .fold(PauseMark::default(), |m, l| {
                            m.merge(PauseMark(l.pause_gen, l.paused))
                        })
                        .1,
                }
            })
            .collect())
    }

    fn describe(&self) -> &str {
        self.url.redacted()
    }
}

impl RedlockStore {
    async fn scan_on(&self, master: &Master, kind: &str) -> Result<Vec<String>, StoreError> {
        let mut conn = master.connection(self.op_timeout).await?;
        scan_keys(&mut conn, &self.prefix, kind)
            .await
            .map_err(|e| store_error(&master.url, &e))
    }

    /// The pause generation of each of `keys` (state hashes) on `master`.
    async fn pause_gens_on(
        &self,
        master: &Master,
        keys: &[String],
    ) -> Result<Vec<i64>, StoreError> {
        let mut conn = master.connection(self.op_timeout).await?;
        let mut pipe = redis::pipe();
        for key in keys {
            pipe.cmd("HGET").arg(key).arg("pause_gen");
        }
        let gens: Vec<Option<String>> = pipe
            .query_async(&mut conn)
            .await
            .map_err(|e| store_error(&master.url, &e))?;
        Ok(gens
            .into_iter()
            .map(|g| g.and_then(|g| g.parse().ok()).unwrap_or(0))
            .collect())
    }

    async fn status_of(&self, master: &Master) -> Result<Vec<ServerLock>, StoreError> {
        let mut conn = master.connection(self.op_timeout).await?;
        server_locks(&mut conn, &self.prefix, &master.url, |e| {
            store_error(&master.url, &e)
        })
        .await
    }

    async fn runs_on(
        &self,
        master: &Master,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let keys = match job {
            Some(job) => vec![self.key(job.as_str(), "runs")],
            None => self.scan_on(master, "runs").await?,
        };
        let mut conn = master.connection(self.op_timeout).await?;
        stream_runs(&mut conn, &self.prefix, &keys, limit)
            .await
            .map_err(|e| store_error(&master.url, &e))
    }
}

#[async_trait]
impl History for RedlockStore {
    async fn record_runs(&self, runs: &[RunRecord], keep: u32) -> Result<(), StoreError> {
        if runs.is_empty() {
            return Ok(());
        }
        let (keys, args) = record_args(runs, keep, &self.prefix);
        let (k, a) = (&keys, &args);
        let answers = self
            .each(|m| self.eval_on::<i64>(m, &self.record, k, a))
            .await;
        self.quorum(answers).map(|_| ())
    }

    async fn history(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let answers = self.each(|m| self.runs_on(m, job, limit)).await;
        // A run is on a majority at least: the union of a majority's
        // histories has every run, once per (job, fence).
        let mut seen = HashSet::new();
        let mut runs: Vec<RunRecord> = Vec::new();
        let mut answered = self.quorum(answers)?;
        // The most complete history first, so its copy of a run is kept.
        answered.sort_by_key(|(_, r)| Reverse(r.len()));
        for (_, list) in answered {
            for run in list {
                if seen.insert((run.job.clone(), run.fence)) {
                    runs.push(run);
                }
            }
        }
        newest_first(&mut runs, limit);
        Ok(runs)
    }
}

impl RedlockStore {
    /// `registry.lua` on every master; the union of a majority's live
    /// records (a heartbeat that counted reached a majority, and a dead
    /// node's record ends on every master by its own clock), per owner the
    /// freshest copy.
    async fn registry_call(&self, args: Vec<String>) -> Result<Vec<NodeRecord>, StoreError> {
        let keys = [self.registry_key()];
        let (k, a) = (&keys, &args);
        let answers = self
            .each(|m| self.eval_on::<Vec<String>>(m, &self.registry, k, a))
            .await;
        let replies = self.quorum(answers)?.into_iter().map(|(_, reply)| reply);
        Ok(freshest_records(replies))
    }

    /// The key of the node registry's hash.
    fn registry_key(&self) -> String {
        format!("{}nodes", self.prefix)
    }
}

#[async_trait]
impl Registry for RedlockStore {
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        self.registry_call(super::registry_args(
            "beat",
            beat.owner.as_str(),
            Some(beat),
        ))
        .await
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.registry_call(super::registry_args("list", "", None))
            .await
    }

    async fn leave(&self, owner: &Owner) -> Result<(), StoreError> {
        self.registry_call(super::registry_args("leave", owner.as_str(), None))
            .await
            .map(|_| ())
    }

    /// The heartbeat's script goes first in each master's first-phase
    /// pipeline (with `INFO` and the lease script: one round trip); a beat
    /// that fails leaves the claims standing, and the node beats again on
    /// its own.
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        if requests.is_empty() {
            return registry::claim_alongside(self, requests, beat).await;
        }
        let args = super::registry_args("beat", beat.owner.as_str(), Some(beat));
        self.claim_with(requests, Some(&args)).await
    }
}

/// One reply of a pipeline, decoded.
fn decoded<T: redis::FromRedisValue>(master: &Master, v: redis::Value) -> Result<T, StoreError> {
    redis::from_redis_value(v).map_err(|e| StoreError::Backend {
        store: master.url.redacted().into(),
        reason: format!("unexpected reply: {e}"),
    })
}

/// The union of the masters' `registry.lua` replies, per owner the
/// freshest copy (a heartbeat that counted reached a majority, and a dead
/// node's record ends on every master by its own clock).
fn freshest_records(replies: impl IntoIterator<Item = Vec<String>>) -> Vec<NodeRecord> {
    let mut freshest: BTreeMap<String, NodeRecord> = BTreeMap::new();
    for reply in replies {
        for record in super::nodes_from_reply(&reply) {
            match freshest.get(&record.owner) {
                Some(kept) if kept.expires_in_ms >= record.expires_in_ms => {}
                _ => {
                    freshest.insert(record.owner.clone(), record);
                }
            }
        }
    }
    registry::sorted(freshest.into_values().collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn validity_leaves_one_percent_and_two_ms() {
        let lease = Duration::from_millis(2_000);
        assert_eq!(
            validity(lease, Duration::from_millis(1_000)),
            Some(Duration::from_millis(978))
        );
        assert_eq!(
            validity(lease, Duration::from_millis(1_977)),
            Some(Duration::from_millis(1))
        );
        // Used up exactly is gone.
        assert_eq!(validity(lease, Duration::from_millis(1_978)), None);
        assert_eq!(validity(lease, Duration::from_millis(1_979)), None);
    }

    #[test]
    fn a_majority_holds_until_all_but_majority_minus_one_leases_end() {
        assert_eq!(majority_left(vec![900, 300, 600], 2), Some(600));
        assert_eq!(majority_left(vec![900, 300], 2), Some(300));
        assert_eq!(majority_left(vec![900], 2), None);
        assert_eq!(majority_left(vec![5, 1, 4, 2, 3], 3), Some(3));
        let leases = [
            ("b".to_string(), 100),
            ("a".to_string(), 400),
            ("b".to_string(), 200),
        ];
        assert_eq!(top_holder(&leases), Some(("b", vec![100, 200])));
        assert_eq!(top_holder(&[]), None);
    }

    fn store() -> RedlockStore {
        let url = StoreUrl::redlock(&["redis://h1:1", "redis://h2:1", "redis://h3:1"]).unwrap();
        RedlockStore::open(&StoreConfig::new(url)).unwrap()
    }

    fn request(recheck_only: bool) -> ClaimRequest {
        ClaimRequest {
            job: JobName::parse("j").unwrap(),
            occurrence: from_ms(1_000),
            previous: None,
            misfire: crate::config::Misfire::RunOnce,
            owner: Owner::from_raw("me#1"),
            lease: Duration::from_secs(2),
            fence_floor: 0,
            max_offset: Duration::from_millis(500),
            head_start: None,
            after_unanswered: recheck_only,
            recheck_only,
            window_end: None,
            manual: None,
        }
    }

    fn tally(ours: usize, others: &[(&str, i64)], counted: usize) -> Tally {
        Tally {
            ours,
            counted,
            others: others.iter().map(|(o, p)| (o.to_string(), *p)).collect(),
            ..Tally::default()
        }
    }

    #[test]
    fn an_idle_lease_is_over_when_a_majority_of_its_head_starts_are() {
        let ms = Duration::from_millis;
        assert_eq!(majority_past(vec![30, 10, 20, 50, 40], 3), Some(ms(30)));
        assert_eq!(majority_past(vec![-5, 10, 20], 3), Some(ms(20)));
        assert_eq!(majority_past(vec![-5, -1, 0], 3), Some(ms(0)));
        // Idle on two masters of five: the lease is not idle.
        assert_eq!(majority_past(vec![10, 20], 3), None);
        let mut idle = tally(1, &[("b", 900), ("b", 400)], 3);
        idle.idle_waits = vec![25, 15];
        assert!(matches!(
            store().vote(&idle, &request(false)),
            Vote::Held { idle_wait: Some(w), .. } if w == ms(25)
        ));
    }

    #[test]
    fn votes_need_a_majority_for_one_owner() {
        let s = store();
        let claim = request(false);
        assert!(matches!(
            s.vote(&tally(2, &[("b", 900)], 3), &claim),
            Vote::Ours
        ));
        assert!(matches!(
            s.vote(&tally(1, &[("b", 900), ("b", 400)], 3), &claim),
            Vote::Held { ref holder, remaining, idle_wait: None } if holder == "b" && remaining == Duration::from_millis(400)
        ));
        // One each: nobody may give up, nobody has won.
        assert!(matches!(
            s.vote(&tally(1, &[("b", 900), ("c", 900)], 3), &claim),
            Vote::Split { .. }
        ));
        // Two masters counted of three: not enough to tell.
        assert!(matches!(
            s.vote(&tally(1, &[("b", 900)], 2), &claim),
            Vote::Split { .. }
        ));
        assert!(matches!(s.vote(&tally(1, &[], 1), &claim), Vote::Undecided));
        // A recheck takes nothing and reads a majority, unless another
        // holds the lease.
        let recheck = request(true);
        assert!(matches!(
            s.vote(&tally(0, &[("b", 900)], 3), &recheck),
            Vote::Ours
        ));
        assert!(matches!(
            s.vote(&tally(0, &[("b", 900), ("b", 900)], 3), &recheck),
            Vote::Held { .. }
        ));
    }

    #[test]
    fn the_pause_mark_of_the_highest_generation_counts() {
        let s = store();
        let entry = |paused: i64, generation: i64| -> LeaseAnswer {
            Some(Ok((
                0,
                vec![(
                    1,
                    Some("me#1".into()),
                    900,
                    "3".into(),
                    5,
                    None,
                    -1,
                    paused,
                    generation,
                    None,
                    None,
                )],
            )))
        };
        let pause = |answers: &[LeaseAnswer]| s.tally(answers, 0, &request(false)).pause;
        // A master that missed the resume (generation 2) keeps nothing paused.
        assert_eq!(
            pause(&[entry(1, 1), entry(0, 2), entry(0, 2)]),
            PauseMark(2, false)
        );
        // Paused on one master of a majority, by the newest generation.
        assert_eq!(pause(&[entry(0, 1), entry(1, 2), None]), PauseMark(2, true));
        // Two marks of one generation (two operators at once): paused.
        assert_eq!(pause(&[entry(0, 3), entry(1, 3)]), PauseMark(3, true));
        assert_eq!(pause(&[entry(1, 3), entry(0, 3)]), PauseMark(3, true));
    }

    #[test]
    fn ties_at_the_highest_fence_leave_the_last_owner_unknown() {
        let s = store();
        let entry = |fence: &str, owner: &str| -> LeaseAnswer {
            Some(Ok((
                0,
                vec![(
                    2,
                    Some("me#1".into()),
                    900,
                    fence.into(),
                    5,
                    Some(owner.into()),
                    -1,
                    0,
                    0,
                    None,
                    None,
                )],
            )))
        };
        let answers = [entry("7", "me#1"), entry("7", "b#1"), entry("6", "me#1")];
        let t = s.tally(&answers, 0, &request(false));
        assert_eq!((t.fence, t.fence_owner.as_deref()), (7, None));
        let answers = [entry("7", "me#1"), entry("7", "me#1"), entry("6", "b#1")];
        let t = s.tally(&answers, 0, &request(false));
        assert_eq!((t.fence, t.fence_owner.as_deref()), (7, Some("me#1")));
        assert_eq!((t.ours, t.ours_before, t.counted), (3, 3, 3));
    }

    #[test]
    fn the_clock_is_the_median_master() {
        assert_eq!(median(vec![5, 1, 9]), Some(5));
        assert_eq!(median(vec![7, 1, 9, 3, 100]), Some(7));
        assert_eq!(median(Vec::new()), None);
    }
}
