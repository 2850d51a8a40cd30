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
    Connection, RELEASE, RENEW, ServerLock, add_evalsha, client_for, eval_loading, format_key,
    job_key, manager_config, record_args, renew_args, scan_keys, server_locks, store_error,
    stream_runs, triggers_key,
};
use crate::config::{JobName, StoreConfig, StoreKind, StoreUrl, one_line};

mod audit;
mod claim;
mod history;
mod masters;
mod nodes;
mod outbox;
use crate::store::registry::{self, Heartbeat, NodeRecord, Registry};
use crate::store::{
    ClaimOutcome, ClaimRequest, Claimed, Decision, History, LockRow, LockStatus, Locks, Lost,
    Owner, RECORD_FORMAT, Renewal, RunRecord, SchemaNotice, StoreError, TriggerAnswer, TriggerId,
    Won, decide, duration_ms, fence_exhausted, from_ms, newest_first, parse_format, to_ms,
};
use claim::*;
use masters::*;
use nodes::*;

static LEASE: &str = include_str!("../redlock_lease.lua");
static WRITE: &str = include_str!("../redlock_write.lua");
static WITHDRAW: &str = include_str!("../withdraw.lua");

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
    outbox: Script,
    audit: Script,
    /// Keep restarted masters out of quorums; off only through a test's
    /// failpoint, to show what it prevents.
    quarantine: bool,
    schema_notice: SchemaNotice,
}

/// One master's answer to phase 1 for one request: got, holder, pttl,
/// fence, last occurrence, state owner, idle wait, paused, pause
/// generation, pending request, last request taken, running mark
/// (`redlock_lease.lua`).
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
    i64,
);
/// A master's phase-1 answer: its clock and an entry per request.
type LeaseAnswer = Option<Result<(i64, Vec<LeaseEntry>), StoreError>>;
/// Every master's phase-1 answer.
type LeaseAnswers = Vec<LeaseAnswer>;

/// A claim decided won in phase 2, to write: its request's index, fence,
/// last occurrence (none: left as stored, a manual run), the answer, and
/// the masters whose lease phase 1 took.
type Decided = (usize, i64, Option<i64>, Won, Vec<usize>);

impl RedlockStore {
    /// Builds a client per master; connections are made on first use.
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        let StoreKind::Redlock(urls) = config.url.kind() else {
            return Err(StoreError::not_a(config, "a Redlock store URL"));
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
                    conn: Connection::new(client),
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
            outbox: Script::new(super::OUTBOX),
            audit: Script::new(super::AUDIT),
            quarantine: true,
            schema_notice: SchemaNotice::default(),
        })
    }

    /// Test-only: restarted masters count in quorums at once, to show the
    /// double run that keeping them out prevents.
    #[cfg(feature = "failpoints")]
    pub fn without_quarantine(mut self) -> Self {
        self.quarantine = false;
        self
    }

    fn scripts(&self) -> [&Script; 11] {
        [
            &self.audit,
            &self.outbox,
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
}

/// The median of the masters' clocks.
fn median(mut times: Vec<i64>) -> Option<i64> {
    times.sort_unstable();
    times.get(times.len() / 2).copied()
}

/// A random byte.
fn random_byte() -> u8 {
    let mut b = [0u8; 1];
    if getrandom::fill(&mut b).is_ok() {
        b[0]
    } else {
        (Utc::now().timestamp_subsec_micros() % 256) as u8
    }
}

fn jitter() -> Duration {
    Duration::from_millis(1 + u64::from(random_byte()) * SPLIT_PAUSE_MAX_MS / 256)
}

/// A random time between half of `d` and `d`: claimers standing back at
/// once come back apart.
fn spread(d: Duration) -> Duration {
    d / 2 + (d / 2).mul_f64(f64::from(random_byte()) / 255.0)
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
                let key = format_key(&self.prefix);
                let record: Option<String> = Script::new(super::FORMAT)
                    .key(&key)
                    .arg(RECORD_FORMAT)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| store_error(&m.url, &e))?;
                record
                    .map(|text| parse_format(m.url.redacted(), &key, &text))
                    .transpose()
                    .map(Option::unwrap_or_default)
            })
            .await;
        // A master restarted empty answers 0: the newest any majority
        // member recorded is the store's version.
        let found = self.quorum(answers)?.into_iter().map(|(_, v)| v).max();
        self.schema_notice.settle(
            self.url.redacted(),
            found.unwrap_or_default(),
            RECORD_FORMAT,
        )
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
        Ok(self.pending_of(answered.into_iter().map(|(_, pairs)| pairs)))
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

    fn schema_notice(&self) -> Option<String> {
        self.schema_notice.get()
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
}

#[cfg(test)]
mod tests;
