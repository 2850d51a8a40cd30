//! The Redis store: a lease key with a TTL, a state hash that never expires
//! (fence, last occurrence, last owner), and a capped stream of runs, per job.
//!
//! Keys are `{key_prefix}{job}:lease`, `:state`, `:runs` and `:fences` (the
//! fences recorded in `:runs`); the braces make
//! them a hash tag, so one job's keys share a cluster slot. Every claim,
//! renewal and release is one Lua script (`redis/*.lua`), atomic on the
//! server, and the server's clock is the only clock (TTL, `PTTL`, `TIME`).
//! A batch of claims, renewals, releases or history writes is one script
//! call: one round trip, however many jobs it names.
//!
//! The guarantee holds while Redis keeps what it acknowledged: AOF with
//! `appendfsync always`. [`Locks::prepare`] warns once when the server has no
//! such persistence.
//!
//! `redis+sentinel://` (feature `sentinel`) is the same store on a master
//! found through Sentinel ([`sentinel`]), found again after a failover, with
//! every write script followed on the same connection by `WAIT`: a write
//! fewer than `wait` replicas acknowledged counts as failed, so a claim the
//! master acknowledged and a failover lost was never acted on.

#[cfg(feature = "redlock")]
pub mod redlock;
#[cfg(feature = "sentinel")]
mod sentinel;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script};
use tokio::sync::OnceCell;

use super::registry::{self, BeatData, Heartbeat, NodeRecord, Registry};
use super::{
    ClaimOutcome, ClaimRequest, Claimed, History, LockStatus, Locks, Lost, Outcome, Owner, Renewal,
    RunRecord, StoreError, TriggerAnswer, TriggerId, Won, duration_ms, from_ms, newest_first,
    to_ms,
};
use crate::config::{JobName, Misfire, StoreConfig, StoreUrl, TlsFiles, one_line};

static CLAIM: &str = include_str!("redis/claim.lua");
static RENEW: &str = include_str!("redis/renew.lua");
static RELEASE: &str = include_str!("redis/release.lua");
static RECORD: &str = include_str!("redis/record.lua");
static REGISTRY: &str = include_str!("redis/registry.lua");
pub(crate) static PAUSE: &str = include_str!("redis/pause.lua");
pub(crate) static TRIGGER: &str = include_str!("redis/trigger.lua");
pub(crate) static WITHDRAW: &str = include_str!("redis/withdraw.lua");

/// The Redis implementation of [`crate::store::Store`].
pub struct RedisStore {
    link: Link,
    /// Replicas that must acknowledge each write script, and how long to
    /// wait for them (ms): `redis+sentinel://…?wait=N`.
    wait: Option<(u32, u64)>,
    url: StoreUrl,
    prefix: String,
    op_timeout: Duration,
    claim: Script,
    renew: Script,
    release: Script,
    record: Script,
    registry: Script,
    pause: Script,
    trigger: Script,
    withdraw: Script,
    warned_persistence: AtomicBool,
}

/// How the store reaches its master.
enum Link {
    /// One server at a fixed address (`redis://`, `rediss://`).
    Direct {
        client: Client,
        manager: OnceCell<ConnectionManager>,
    },
    /// The master the sentinels name (`redis+sentinel://`).
    #[cfg(feature = "sentinel")]
    Sentinel(sentinel::Master),
}

/// One claim's answer from `claim.lua`, in its order: `{won, fence,
/// occurrence, catch_up, holder/previous owner (or the error when won is
/// -2), remaining, last, now, too_early, repaired, idle_wait, paused}`
/// (too_early 1 when the occurrence is ahead of the server's clock, 2 when
/// the claim is stale: the occurrence's window ended; idle_wait -1 unless an idle holder's head start kept the claim out;
/// paused 1 when the job's pause mark refused it). The fence comes as a
/// decimal string: Lua numbers are doubles.
pub(crate) type ClaimReply = (
    i64,
    String,
    i64,
    i64,
    Option<String>,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
);

impl RedisStore {
    /// Builds the client; the first connection is made on first use.
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        let url = config.url.clone();
        let failed = |reason: String| StoreError::Backend {
            store: url.redacted().into(),
            reason: url.scrub(&reason),
        };
        #[cfg(feature = "sentinel")]
        if let crate::config::StoreKind::RedisSentinel(target) = url.kind() {
            let master =
                sentinel::Master::new(target, url.password()).map_err(|e| failed(e.to_string()))?;
            let wait = (target.wait > 0).then(|| {
                (
                    target.wait,
                    u64::try_from(target.wait_timeout.as_millis()).unwrap_or(u64::MAX),
                )
            });
            return Ok(Self::with_link(Link::Sentinel(master), wait, config));
        }
        let client = client_for(&url, config.tls.as_ref()).map_err(failed)?;
        let link = Link::Direct {
            client,
            manager: OnceCell::new(),
        };
        Ok(Self::with_link(link, None, config))
    }

    fn with_link(link: Link, wait: Option<(u32, u64)>, config: &StoreConfig) -> Self {
        RedisStore {
            link,
            wait,
            prefix: config.key_prefix.clone(),
            op_timeout: config.op_timeout,
            url: config.url.clone(),
            claim: Script::new(CLAIM),
            renew: Script::new(RENEW),
            release: Script::new(RELEASE),
            record: Script::new(RECORD),
            registry: Script::new(REGISTRY),
            pause: Script::new(PAUSE),
            trigger: Script::new(TRIGGER),
            withdraw: Script::new(WITHDRAW),
            warned_persistence: AtomicBool::new(false),
        }
    }

    fn scripts(&self) -> [&Script; 8] {
        [
            &self.claim,
            &self.renew,
            &self.release,
            &self.record,
            &self.registry,
            &self.pause,
            &self.trigger,
            &self.withdraw,
        ]
    }

    /// Runs one script (`EVALSHA`): [`Self::eval_all`] of one.
    async fn eval<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        keys: &[String],
        args: &[String],
    ) -> Result<T, StoreError> {
        let reply = self
            .eval_all(&[(script, keys, args)])
            .await?
            .pop()
            .ok_or_else(|| self.malformed("empty reply to a script".into()))?;
        self.decode(reply)
    }

    /// A script's reply read as `T`; an error reply is the script's error.
    pub(crate) fn decode<T: redis::FromRedisValue>(
        &self,
        reply: redis::Value,
    ) -> Result<T, StoreError> {
        match reply {
            redis::Value::ServerError(e) => Err(self.err(e.into())),
            reply => redis::from_redis_value(reply)
                .map_err(|e| self.malformed(format!("unexpected reply: {e}"))),
        }
    }

    fn malformed(&self, reason: String) -> StoreError {
        StoreError::Backend {
            store: self.url.redacted().into(),
            reason,
        }
    }

    /// Runs scripts (`EVALSHA`) in one pipeline, one reply each (an error
    /// reply stays in its place), loading the scripts first if the server
    /// has forgotten them. Through Sentinel with `wait`, they are followed
    /// on the same connection by `WAIT`, and fewer replicas than asked make
    /// the call fail: the master may lose what it did in a failover, so
    /// nothing may act on it.
    async fn eval_all(
        &self,
        calls: &[(&Script, &[String], &[String])],
    ) -> Result<Vec<redis::Value>, StoreError> {
        let build = |which: &[usize]| {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for &i in which {
                add_evalsha(&mut pipe, calls[i]);
            }
            if let Some((replicas, timeout_ms)) = self.wait {
                pipe.cmd("WAIT").arg(replicas).arg(timeout_ms);
            }
            pipe
        };
        let all: Vec<usize> = (0..calls.len()).collect();
        let waits = usize::from(self.wait.is_some());
        let count = |replies: &[redis::Value], sent: usize| {
            if replies.len() == sent + waits {
                Ok(())
            } else {
                Err(self.malformed(format!(
                    "{} replies to {sent} scripts{}",
                    replies.len(),
                    if waits == 1 { " and WAIT" } else { "" }
                )))
            }
        };
        let mut conn = self.conn().await?;
        let mut replies: Vec<redis::Value> = build(&all)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        count(&replies, calls.len())?;
        let mut wait_reply = if waits == 1 { replies.pop() } else { None };
        let refused: Vec<usize> = all
            .iter()
            .copied()
            .filter(|&i| replies.get(i).is_some_and(forgotten))
            .collect();
        if !refused.is_empty() {
            // The server restarted or flushed its scripts. Only the calls it
            // refused are sent again: one that ran before the flush (or after
            // another client loaded the scripts again, between two calls of
            // this pipeline) must not run twice, as a claim sent again reads
            // its own win as a peer's.
            for script in self.scripts() {
                script
                    .prepare_invoke()
                    .load_async(&mut conn)
                    .await
                    .map_err(|e| self.err(e))?;
            }
            let mut again: Vec<redis::Value> = build(&refused)
                .query_async(&mut conn)
                .await
                .map_err(|e| self.err(e))?;
            count(&again, refused.len())?;
            // Both WAITs must have been met: the connection may have been
            // made again between the two pipelines, so the second one need
            // not count the first one's writes.
            let second_wait = if waits == 1 { again.pop() } else { None };
            wait_reply = match (wait_reply, second_wait) {
                (Some(first), Some(second)) => {
                    let acked = |v: &redis::Value| redis::from_redis_value::<i64>(v.clone()).ok();
                    match (acked(&first), acked(&second)) {
                        (Some(x), Some(y)) if y < x => Some(second),
                        (Some(_), Some(_)) => Some(first),
                        (None, _) => Some(first),
                        (_, None) => Some(second),
                    }
                }
                (first, second) => first.or(second),
            };
            for (&i, reply) in refused.iter().zip(again) {
                if let Some(slot) = replies.get_mut(i) {
                    *slot = reply;
                }
            }
        }
        // A master demoted to a replica (a failover this node has not heard
        // of) refuses the writes and WAIT: ask the sentinels again.
        let demoted = replies.iter().chain(wait_reply.as_ref()).any(|r| {
            matches!(r, redis::Value::ServerError(e)
                if e.kind() == Some(redis::ServerErrorKind::ReadOnly))
        }) || matches!(wait_reply, Some(redis::Value::ServerError(_)));
        if let Some((replicas, timeout_ms)) = self.wait {
            let acked = match &wait_reply {
                Some(redis::Value::ServerError(e)) if !demoted => {
                    return Err(
                        self.malformed(format!("WAIT refused: {}", one_line(&e.to_string())))
                    );
                }
                Some(redis::Value::ServerError(_)) => 0,
                Some(v) => redis::from_redis_value::<i64>(v.clone())
                    .map_err(|e| self.malformed(format!("unexpected reply to WAIT: {e}")))?,
                None => 0,
            };
            if demoted || acked < i64::from(replicas) {
                // A master whose replicas went elsewhere (a failover this
                // node has not heard of) stays one: ask the sentinels again.
                #[cfg(feature = "sentinel")]
                if let Link::Sentinel(master) = &self.link {
                    master.forget();
                }
                return Err(StoreError::Unavailable {
                    store: self.url.redacted().into(),
                    reason: if demoted {
                        "the master refused the write as a replica (a failover): counted as failed"
                            .to_string()
                    } else {
                        format!(
                            "{acked} of the {replicas} replicas asked for (wait={replicas}) acknowledged the write within {timeout_ms} ms: counted as failed"
                        )
                    },
                });
            }
        }
        Ok(replies)
    }

    /// The answer to `requests` from `claim.lua`'s replies.
    pub(crate) fn claimed(
        &self,
        requests: &[ClaimRequest],
        replies: Vec<ClaimReply>,
    ) -> Result<Claimed, StoreError> {
        if replies.len() != requests.len() {
            return Err(self.malformed(format!(
                "{} answers to {} claims",
                replies.len(),
                requests.len()
            )));
        }
        for (r, req) in replies.iter().zip(requests) {
            if r.9 == 1 {
                tracing::warn!(
                    store = %self.url,
                    job = %req.job,
                    holder = r.4.as_deref().unwrap_or(""),
                    "the job's lease key had no expiry (set by hand, or PERSIST): gave it one lease ({} ms) so it cannot block the job forever",
                    duration_ms(req.lease)
                );
            }
        }
        let store_now = from_ms(replies.first().map_or(0, |r| r.7));
        Ok(Claimed {
            store_now,
            outcomes: replies
                .into_iter()
                .zip(requests)
                .map(|(r, req)| outcome_from_reply(r, req))
                .collect(),
        })
    }

    /// The node registry's hash.
    fn registry_key(&self) -> String {
        format!("{}nodes", self.prefix)
    }

    fn key(&self, job: &str, kind: &str) -> String {
        job_key(&self.prefix, job, kind)
    }

    fn err(&self, e: redis::RedisError) -> StoreError {
        #[cfg(feature = "sentinel")]
        if let Link::Sentinel(master) = &self.link {
            // Gone, or demoted by a failover: ask the sentinels again.
            if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
                || e.is_unrecoverable_error()
                || e.is_io_error()
                || e.is_connection_refusal()
                || e.is_timeout()
                || e.is_connection_dropped()
            {
                master.forget();
            }
        }
        store_error(&self.url, &e)
    }

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        let config = manager_config(self.op_timeout);
        match &self.link {
            Link::Direct { client, manager } => manager
                .get_or_try_init(|| ConnectionManager::new_with_config(client.clone(), config))
                .await
                .cloned()
                .map_err(|e| self.err(e)),
            #[cfg(feature = "sentinel")]
            Link::Sentinel(master) => master.connection(config).await.map_err(|e| self.err(e)),
        }
    }

    async fn warn_without_persistence(&self, conn: &mut ConnectionManager) {
        if self.warned_persistence.load(Ordering::Relaxed) {
            return;
        }
        #[cfg(feature = "sentinel")]
        if let Link::Sentinel(_) = self.link {
            // Replicas acknowledging each write are the guarantee here.
            if self.wait.is_none() && !self.warned_persistence.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    store = %self.url,
                    "wait=0: claims are not confirmed on a replica, so a failover right after one can lose it and the occurrence may then run twice; use wait=1 (docs/protocol.md)"
                );
            }
            return;
        }
        let info: String = match redis::cmd("INFO")
            .arg("persistence")
            .query_async(conn)
            .await
        {
            Ok(info) => info,
            Err(_) => return,
        };
        let aof = info.lines().any(|l| l.trim() == "aof_enabled:1");
        // CONFIG may be disabled on managed servers; then only AOF is known.
        let fsync: Option<Vec<String>> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("appendfsync")
            .query_async(conn)
            .await
            .ok();
        let fsync = fsync.and_then(|v| v.get(1).cloned());
        let problem = if !aof {
            Some("has no AOF persistence (appendonly no)".to_string())
        } else {
            fsync
                .filter(|f| f != "always")
                .map(|f| format!("uses appendfsync {f}, not always"))
        };
        if let Some(problem) = problem {
            if !self.warned_persistence.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    store = %self.url,
                    "Redis {problem}: a restart or failover can lose acknowledged claims, and an occurrence may then run twice; use `appendonly yes` with `appendfsync always` (docs/protocol.md)"
                );
            }
        }
    }

    async fn scan(&self, kind: &str) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn().await?;
        scan_keys(&mut conn, &self.prefix, kind)
            .await
            .map_err(|e| self.err(e))
    }

    async fn read_runs(&self, keys: &[String], limit: u32) -> Result<Vec<RunRecord>, StoreError> {
        let mut conn = self.conn().await?;
        stream_runs(&mut conn, &self.prefix, keys, limit)
            .await
            .map_err(|e| self.err(e))
    }
}

/// A job's state hash as HMGET reads it: fence, last occurrence, last owner,
/// paused, pause generation.
type StateFields = (
    Option<String>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// One server's view of one job's lock, for `status`.
struct ServerLock {
    job: String,
    fence: u64,
    last: Option<i64>,
    /// The last claimer (the state hash's owner).
    owner: Option<String>,
    /// The live lease's owner and its time left (ms).
    holder: Option<String>,
    pttl: i64,
    /// The pause mark and the generation it was written with (Redlock
    /// keeps the mark of the highest generation a majority reports).
    paused: bool,
    #[cfg_attr(not(feature = "redlock"), allow(dead_code))]
    pause_gen: i64,
}

/// Every job's lock on one server: its keys found by SCAN, then read in one
/// pipeline. `err` turns a driver error into the store's.
async fn server_locks(
    conn: &mut ConnectionManager,
    prefix: &str,
    url: &StoreUrl,
    err: impl Fn(redis::RedisError) -> StoreError,
) -> Result<Vec<ServerLock>, StoreError> {
    let keys = scan_keys(conn, prefix, "state").await.map_err(&err)?;
    let jobs: Vec<String> = keys
        .iter()
        .filter_map(|k| job_of(prefix, k, "state"))
        .collect();
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for job in &jobs {
        pipe.cmd("HMGET")
            .arg(job_key(prefix, job, "state"))
            .arg("fence")
            .arg("last_occurrence")
            .arg("owner")
            .arg("paused")
            .arg("pause_gen");
        pipe.cmd("GET").arg(job_key(prefix, job, "lease"));
        pipe.cmd("PTTL").arg(job_key(prefix, job, "lease"));
    }
    let replies: Vec<redis::Value> = pipe.query_async(conn).await.map_err(&err)?;
    let mut out = Vec::with_capacity(jobs.len());
    for (job, chunk) in jobs.into_iter().zip(replies.chunks(3)) {
        let [state, holder, pttl] = chunk else {
            continue;
        };
        let malformed = |e: redis::ParsingError| StoreError::Backend {
            store: url.redacted().into(),
            reason: format!("unexpected reply for {job}: {e}"),
        };
        let state: StateFields = redis::from_redis_value(state.clone()).map_err(malformed)?;
        out.push(ServerLock {
            fence: state.0.and_then(|f| f.parse().ok()).unwrap_or(0),
            last: state.1,
            owner: state.2,
            paused: state.3.as_deref() == Some("1"),
            pause_gen: state.4.and_then(|g| g.parse().ok()).unwrap_or(0),
            holder: redis::from_redis_value(holder.clone()).map_err(malformed)?,
            pttl: redis::from_redis_value(pttl.clone()).map_err(malformed)?,
            job,
        });
    }
    Ok(out)
}

/// Every job's key of `kind` under `prefix` (SCAN), sorted.
async fn scan_keys(
    conn: &mut ConnectionManager,
    prefix: &str,
    kind: &str,
) -> redis::RedisResult<Vec<String>> {
    let pattern = format!("{}{{*}}:{kind}", glob_escape(prefix));
    let mut cursor: u64 = 0;
    let mut keys = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    keys.sort();
    keys.dedup();
    Ok(keys)
}

/// The job a key of `kind` under `prefix` belongs to.
fn job_of(prefix: &str, key: &str, kind: &str) -> Option<String> {
    key.strip_prefix(prefix)?
        .strip_prefix('{')?
        .strip_suffix(&format!("}}:{kind}"))
        .map(str::to_string)
}

/// How many run streams one pipeline reads: `history` over every job costs
/// a SCAN and one round trip per this many jobs, not one per job.
const STREAMS_PER_PIPELINE: usize = 200;

/// The newest `limit` runs of each stream in `keys`, read in pipelines of
/// [`STREAMS_PER_PIPELINE`] keys.
async fn stream_runs(
    conn: &mut ConnectionManager,
    prefix: &str,
    keys: &[String],
    limit: u32,
) -> redis::RedisResult<Vec<RunRecord>> {
    let mut runs = Vec::new();
    for chunk in keys.chunks(STREAMS_PER_PIPELINE) {
        let mut pipe = redis::pipe();
        for key in chunk {
            pipe.cmd("XREVRANGE")
                .arg(key)
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(limit);
        }
        let replies: Vec<StreamEntries> = pipe.query_async(conn).await?;
        for (key, entries) in chunk.iter().zip(replies) {
            runs.extend(runs_of_stream(prefix, key, entries));
        }
    }
    Ok(runs)
}

/// One run stream's `XREVRANGE` reply: (entry id, fields), newest first.
pub(crate) type StreamEntries = Vec<(String, HashMap<String, String>)>;

/// The runs in the reply of the run stream `key`; an entry this version
/// cannot read is kept as a malformed one, never an error.
pub(crate) fn runs_of_stream(prefix: &str, key: &str, entries: StreamEntries) -> Vec<RunRecord> {
    let job = job_of(prefix, key, "runs").unwrap_or_default();
    entries
        .into_iter()
        .map(|(id, fields)| {
            run_from_fields(&fields).unwrap_or_else(|| malformed_run(&job, &id, &fields))
        })
        .collect()
}

/// How a connection to one server behaves: a call slower than `op_timeout`
/// fails, and a lost connection is made again in the background.
fn manager_config(op_timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(op_timeout))
        .set_response_timeout(Some(op_timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_secs(1))
}

/// A client for one Redis server, with the TLS files when there are some.
/// The error is the driver's message, not yet scrubbed.
fn client_for(url: &StoreUrl, tls: Option<&TlsFiles>) -> Result<Client, String> {
    let Some(tls) = tls else {
        return Client::open(url.expose()).map_err(|e| e.to_string());
    };
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()))
    };
    let root_cert = tls.ca.as_deref().map(read).transpose()?;
    let client_tls = match &tls.client {
        Some((cert, key)) => Some(redis::ClientTlsConfig {
            client_cert: read(cert)?,
            client_key: read(key)?,
        }),
        None => None,
    };
    Client::build_with_tls(
        url.expose(),
        redis::TlsCertificates {
            client_tls,
            root_cert,
        },
    )
    .map_err(|e| e.to_string())
}

/// A Redis error as a [`StoreError`] of the server `url` names: unreachable
/// (down, too slow, not speaking Redis) or a failed request.
fn store_error(url: &StoreUrl, e: &redis::RedisError) -> StoreError {
    let store = url.redacted().to_string();
    let reason = one_line(&url.scrub(&e.to_string()));
    if matches!(
        e.kind(),
        redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType
    ) {
        // Something answers on the port, but not in Redis's protocol
        // (a database, a web server): the store is not reachable there.
        StoreError::Unavailable {
            store,
            reason: format!("the server does not answer in the Redis protocol ({reason})"),
        }
    } else if e.is_io_error()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_connection_dropped()
    {
        StoreError::Unavailable { store, reason }
    } else {
        StoreError::Backend { store, reason }
    }
}

/// `{prefix}{job}:kind`: the braces make one job's keys a hash tag.
fn job_key(prefix: &str, job: &str, kind: &str) -> String {
    format!("{prefix}{{{job}}}:{kind}")
}

/// The hash of pending manual runs' requests: job -> id.
pub(crate) fn triggers_key(prefix: &str) -> String {
    format!("{prefix}triggers")
}

/// Runs `build(which)`'s pipeline on `conn`: `lead` commands first (the
/// same every time), then the `EVALSHA`s of the calls `which` names, all
/// `count` of them the first time. The pipeline ignores errors: each reply
/// comes back as it is, an error as a `ServerError` value, so one script's
/// failure leaves the others' replies. If the server has forgotten scripts
/// (restart, `SCRIPT FLUSH`), `scripts` are loaded and only the calls it
/// refused are sent again: a call that ran must not run twice (a claim
/// would read its own win as a peer's).
#[cfg(feature = "redlock")]
async fn eval_loading(
    conn: &mut ConnectionManager,
    scripts: &[&Script],
    lead: usize,
    count: usize,
    build: impl Fn(&[usize]) -> redis::Pipeline,
) -> redis::RedisResult<Vec<redis::Value>> {
    let shared = conn.clone();
    let send = |which: &[usize]| {
        let mut pipe = build(which);
        pipe.ignore_errors();
        let mut conn = shared.clone();
        async move { pipe.query_async::<Vec<redis::Value>>(&mut conn).await }
    };
    let all: Vec<usize> = (0..count).collect();
    let mut replies = send(&all).await?;
    let refused: Vec<usize> = all
        .into_iter()
        .filter(|i| replies.get(lead + i).is_some_and(forgotten))
        .collect();
    if refused.is_empty() {
        return Ok(replies);
    }
    for script in scripts {
        script.prepare_invoke().load_async(conn).await?;
    }
    let again = send(&refused).await?;
    for (k, i) in refused.into_iter().enumerate() {
        if let (Some(slot), Some(reply)) = (replies.get_mut(lead + i), again.get(lead + k)) {
            *slot = reply.clone();
        }
    }
    Ok(replies)
}

/// Adds `EVALSHA` of `script` with `keys` and `args` to `pipe`.
fn add_evalsha(pipe: &mut redis::Pipeline, (script, keys, args): (&Script, &[String], &[String])) {
    pipe.cmd("EVALSHA")
        .arg(script.get_hash())
        .arg(keys.len())
        .arg(keys)
        .arg(args);
}

/// The reply of a script call the server refused because it has forgotten
/// the script (a restart, `SCRIPT FLUSH`).
fn forgotten(reply: &redis::Value) -> bool {
    matches!(reply, redis::Value::ServerError(e)
        if e.kind() == Some(redis::ServerErrorKind::NoScript))
}

/// The keys and arguments of `claim.lua` for `requests`.
fn claim_args(prefix: &str, requests: &[ClaimRequest]) -> (Vec<String>, Vec<String>) {
    let mut keys = Vec::with_capacity(2 * requests.len());
    let mut args = Vec::with_capacity(13 * requests.len());
    for r in requests {
        let job = r.job.as_str();
        keys.push(job_key(prefix, job, "lease"));
        keys.push(job_key(prefix, job, "state"));
        args.extend([
            r.owner.as_str().to_string(),
            to_ms(r.occurrence).to_string(),
            r.previous.map(|p| to_ms(p).to_string()).unwrap_or_default(),
            duration_ms(r.lease).max(1).to_string(),
            r.fence_floor.to_string(),
            match r.misfire {
                Misfire::RunOnce => "run_once",
                Misfire::Skip => "skip",
            }
            .to_string(),
            duration_ms(r.max_offset).to_string(),
            if r.after_unanswered { "1" } else { "0" }.to_string(),
            if r.recheck_only { "1" } else { "0" }.to_string(),
            r.head_start
                .map(|h| duration_ms(h).to_string())
                .unwrap_or_default(),
            r.manual.map(|id| id.get().to_string()).unwrap_or_default(),
            job.to_string(),
            r.window_end
                .map(|e| to_ms(e).to_string())
                .unwrap_or_default(),
        ]);
    }
    keys.push(triggers_key(prefix));
    (keys, args)
}

/// The keys and arguments of `renew.lua` for `owner`'s `renewals`.
fn renew_args(prefix: &str, owner: &Owner, renewals: &[Renewal]) -> (Vec<String>, Vec<String>) {
    let keys = renewals
        .iter()
        .map(|r| job_key(prefix, r.job.as_str(), "lease"))
        .collect();
    let mut args = vec![owner.as_str().to_string()];
    args.extend(
        renewals
            .iter()
            .map(|r| duration_ms(r.lease).max(1).to_string()),
    );
    (keys, args)
}

/// The keys and arguments of `record.lua` for `runs`, keeping `keep` per job.
fn record_args(runs: &[RunRecord], keep: u32, prefix: &str) -> (Vec<String>, Vec<String>) {
    let mut keys = Vec::with_capacity(3 * runs.len());
    let mut args = vec![keep.max(1).to_string()];
    for run in runs {
        keys.push(job_key(prefix, &run.job, "runs"));
        keys.push(job_key(prefix, &run.job, "fences"));
        keys.push(job_key(prefix, &run.job, "state"));
        let mut fields: Vec<String> = [
            ("job", run.job.clone()),
            ("fence", run.fence.to_string()),
            ("owner", run.owner.clone()),
            ("node", run.node.clone()),
            ("occurrence", to_ms(run.occurrence).to_string()),
            ("started_at", to_ms(run.started_at).to_string()),
            ("finished_at", to_ms(run.finished_at).to_string()),
            ("outcome", run.outcome.as_str().to_string()),
            ("takeover", i64::from(run.takeover).to_string()),
            ("delay_ms", run.delay_ms.to_string()),
            ("decision_ms", run.decision_ms.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
        if let Some(code) = run.exit_code {
            fields.extend(["exit_code".to_string(), code.to_string()]);
        }
        if !run.output.is_empty() {
            fields.extend(["output".to_string(), run.output.clone()]);
        }
        if let Some(id) = run.trigger {
            fields.extend(["trigger".to_string(), id.get().to_string()]);
        }
        args.push(run.fence.to_string());
        args.push(if super::ends_a_run(run) { "1" } else { "0" }.to_string());
        args.push(fields.len().to_string());
        args.extend(fields);
    }
    (keys, args)
}

fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn run_from_fields(f: &HashMap<String, String>) -> Option<RunRecord> {
    let int = |k: &str| f.get(k).and_then(|v| v.parse::<i64>().ok());
    Some(RunRecord {
        job: f.get("job")?.clone(),
        fence: int("fence")?.max(0) as u64,
        owner: f.get("owner")?.clone(),
        node: f.get("node")?.clone(),
        occurrence: from_ms(int("occurrence")?),
        started_at: from_ms(int("started_at")?),
        finished_at: from_ms(int("finished_at")?),
        outcome: Outcome::parse(f.get("outcome")?),
        exit_code: f.get("exit_code").and_then(|c| c.parse().ok()),
        takeover: int("takeover")? != 0,
        delay_ms: int("delay_ms")?.max(0) as u64,
        decision_ms: int("decision_ms").unwrap_or(0).max(0) as u64,
        output: f.get("output").cloned().unwrap_or_default(),
        trigger: int("trigger").and_then(TriggerId::from_stored),
    })
}

/// A history entry this version cannot read (a hand edit, a newer
/// version's fields): shown as `unknown(malformed entry ID)` rather than
/// failing the whole listing. Its time is the stream id's.
fn malformed_run(job: &str, id: &str, f: &HashMap<String, String>) -> RunRecord {
    let at = from_ms(
        id.split('-')
            .next()
            .and_then(|ms| ms.parse().ok())
            .unwrap_or_default(),
    );
    let text = |k: &str| f.get(k).cloned().unwrap_or_default();
    RunRecord {
        job: job.to_string(),
        fence: f.get("fence").and_then(|v| v.parse().ok()).unwrap_or(0),
        owner: text("owner"),
        node: text("node"),
        occurrence: at,
        started_at: at,
        finished_at: at,
        outcome: Outcome::Unknown(format!("malformed entry {id}")),
        exit_code: None,
        takeover: false,
        delay_ms: 0,
        decision_ms: 0,
        output: String::new(),
        trigger: None,
    }
}

fn outcome_from_reply(r: ClaimReply, req: &ClaimRequest) -> ClaimOutcome {
    let (
        won,
        fence,
        occurrence,
        catch_up,
        who,
        remaining,
        last,
        _now,
        too_early,
        _repaired,
        idle,
        paused,
    ) = r;
    let fence = fence.parse::<u64>().unwrap_or(0);
    if won == -1 {
        ClaimOutcome::Failed(super::fence_exhausted(req.job.as_str()))
    } else if won == -2 {
        ClaimOutcome::Failed(format!(
            "the claim of job {} failed in the server: {}",
            req.job,
            one_line(&who.unwrap_or_default())
        ))
    } else if won == 1 {
        ClaimOutcome::Won(Won {
            fence,
            occurrence: from_ms(occurrence),
            catch_up: catch_up == 1,
            previous_owner: who,
        })
    } else {
        ClaimOutcome::Lost(Lost {
            remaining: if who.is_some() {
                Duration::from_millis(remaining.max(0) as u64)
            } else {
                Duration::ZERO
            },
            holder: who,
            last_occurrence: (last >= 0).then(|| from_ms(last)),
            fence,
            too_early: too_early == 1,
            stale: too_early == 2,
            idle_wait: (idle >= 0).then(|| Duration::from_millis(idle as u64)),
            paused: paused == 1,
            trigger_gone: paused == 2,
        })
    }
}

#[async_trait]
impl Locks for RedisStore {
    async fn prepare(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        for script in self.scripts() {
            script
                .prepare_invoke()
                .load_async(&mut conn)
                .await
                .map_err(|e| self.err(e))?;
        }
        self.warn_without_persistence(&mut conn).await;
        Ok(())
    }

    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Claimed, StoreError> {
        if requests.is_empty() {
            return self.clock().await.map(|store_now| Claimed {
                store_now,
                outcomes: Vec::new(),
            });
        }
        let (keys, args) = claim_args(&self.prefix, requests);
        let replies: Vec<ClaimReply> = self.eval(&self.claim, &keys, &args).await?;
        self.claimed(requests, replies)
    }

    async fn clock(&self) -> Result<DateTime<Utc>, StoreError> {
        let mut conn = self.conn().await?;
        let (secs, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(from_ms(
            secs.saturating_mul(1000).saturating_add(micros / 1000),
        ))
    }

    async fn renew_many(
        &self,
        owner: &Owner,
        renewals: &[Renewal],
    ) -> Result<Vec<bool>, StoreError> {
        if renewals.is_empty() {
            return Ok(Vec::new());
        }
        let (keys, args) = renew_args(&self.prefix, owner, renewals);
        let done: Vec<i64> = self.eval(&self.renew, &keys, &args).await?;
        Ok((0..renewals.len())
            .map(|i| done.get(i) == Some(&1))
            .collect())
    }

    async fn release(&self, jobs: &[JobName], owner: &Owner) -> Result<usize, StoreError> {
        if jobs.is_empty() {
            return Ok(0);
        }
        let keys: Vec<String> = jobs.iter().map(|j| self.key(j.as_str(), "lease")).collect();
        let released: i64 = self
            .eval(&self.release, &keys, &[owner.as_str().to_string()])
            .await?;
        Ok(released.max(0) as usize)
    }

    async fn set_paused(&self, jobs: &[JobName], paused: bool) -> Result<(), StoreError> {
        if jobs.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = jobs.iter().map(|j| self.key(j.as_str(), "state")).collect();
        let args = [if paused { "1" } else { "0" }.to_string(), String::new()];
        let _written: i64 = self.eval(&self.pause, &keys, &args).await?;
        Ok(())
    }

    async fn request_trigger(
        &self,
        job: &JobName,
        id: TriggerId,
    ) -> Result<TriggerAnswer, StoreError> {
        let keys = [
            self.key(job.as_str(), "lease"),
            self.key(job.as_str(), "state"),
            triggers_key(&self.prefix),
        ];
        let args = [id.get().to_string(), job.as_str().to_string()];
        let (code, pending, holder): (i64, String, Option<String>) =
            self.eval(&self.trigger, &keys, &args).await?;
        Ok(match code {
            0 => TriggerAnswer::Accepted,
            1 => TriggerAnswer::Running { holder },
            _ => match TriggerId::parse_stored(&pending) {
                Some(pending) => TriggerAnswer::Pending(pending),
                None => {
                    return Err(self.malformed(format!(
                        "job {job} has a malformed pending request: {}",
                        one_line(&pending)
                    )));
                }
            },
        })
    }

    async fn withdraw_trigger(&self, job: &JobName, id: TriggerId) -> Result<bool, StoreError> {
        let keys = [self.key(job.as_str(), "state"), triggers_key(&self.prefix)];
        let args = [id.get().to_string(), job.as_str().to_string()];
        let withdrawn: i64 = self.eval(&self.withdraw, &keys, &args).await?;
        Ok(withdrawn == 1)
    }

    async fn pending_triggers(&self) -> Result<Vec<(String, TriggerId)>, StoreError> {
        let mut conn = self.conn().await?;
        let all: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(triggers_key(&self.prefix))
            .query_async(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        let mut pending: Vec<(String, TriggerId)> = all
            .into_iter()
            .filter_map(|(job, id)| Some((job, TriggerId::parse_stored(&id)?)))
            .collect();
        pending.sort();
        Ok(pending)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn status(&self) -> Result<Vec<LockStatus>, StoreError> {
        let mut conn = self.conn().await?;
        let locks = server_locks(&mut conn, &self.prefix, &self.url, |e| self.err(e)).await?;
        Ok(locks
            .into_iter()
            .map(|l| LockStatus {
                lease_remaining_ms: if l.holder.is_some() {
                    l.pttl.max(0) as u64
                } else {
                    0
                },
                job: l.job,
                holder: l.holder,
                fence: l.fence,
                last_occurrence: l.last.map(from_ms),
                last_owner: l.owner,
                paused: l.paused,
            })
            .collect())
    }

    fn describe(&self) -> &str {
        self.url.redacted()
    }
}

#[async_trait]
impl History for RedisStore {
    async fn record_runs(&self, runs: &[RunRecord], keep: u32) -> Result<(), StoreError> {
        if runs.is_empty() {
            return Ok(());
        }
        let (keys, args) = record_args(runs, keep, &self.prefix);
        let _added: i64 = self.eval(&self.record, &keys, &args).await?;
        Ok(())
    }

    async fn history(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let keys = match job {
            Some(job) => vec![self.key(job.as_str(), "runs")],
            None => self.scan("runs").await?,
        };
        let mut runs = self.read_runs(&keys, limit).await?;
        newest_first(&mut runs, limit);
        Ok(runs)
    }
}

/// The arguments of `registry.lua` for `op` (`beat`, `list`, `leave`).
pub(crate) fn registry_args(op: &str, owner: &str, beat: Option<&Heartbeat>) -> Vec<String> {
    let (ttl, data) = beat.map_or((0, String::new()), |b| {
        (duration_ms(b.ttl), BeatData::from(b).to_json())
    });
    vec![
        op.to_string(),
        owner.to_string(),
        ttl.to_string(),
        data,
        duration_ms(registry::FORGET_AFTER).to_string(),
    ]
}

/// The live records in a reply of `registry.lua`; a record that does not
/// parse (a hand edit) is left out.
pub(crate) fn nodes_from_reply(reply: &[String]) -> Vec<NodeRecord> {
    let Some((now, records)) = reply.split_first() else {
        return Vec::new();
    };
    let now: i64 = now.parse().unwrap_or(0);
    registry::sorted(
        records
            .chunks_exact(4)
            .filter_map(|r| {
                let seen = r[1].parse().ok()?;
                let ends = r[2].parse().ok()?;
                BeatData::parse(r[3].as_bytes()).map(|d| d.record(&r[0], seen, ends, now))
            })
            .collect(),
    )
}

#[async_trait]
impl Registry for RedisStore {
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        let args = registry_args("beat", beat.owner.as_str(), Some(beat));
        let reply: Vec<String> = self
            .eval(&self.registry, &[self.registry_key()], &args)
            .await?;
        Ok(nodes_from_reply(&reply))
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let args = registry_args("list", "", None);
        let reply: Vec<String> = self
            .eval(&self.registry, &[self.registry_key()], &args)
            .await?;
        Ok(nodes_from_reply(&reply))
    }

    async fn leave(&self, owner: &Owner) -> Result<(), StoreError> {
        let args = registry_args("leave", owner.as_str(), None);
        let _: Vec<String> = self
            .eval(&self.registry, &[self.registry_key()], &args)
            .await?;
        Ok(())
    }

    /// The heartbeat's script goes first in the claim's pipeline (one round
    /// trip, one `WAIT`): after a script flush only the calls refused are
    /// sent again, and a beat that fails leaves the claims standing.
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        if requests.is_empty() {
            return registry::claim_alongside(self, requests, beat).await;
        }
        let (keys, args) = claim_args(&self.prefix, requests);
        let beat_keys = [self.registry_key()];
        let beat_args = registry_args("beat", beat.owner.as_str(), Some(beat));
        let mut replies = self
            .eval_all(&[
                (&self.registry, &beat_keys, &beat_args),
                (&self.claim, &keys, &args),
            ])
            .await?
            .into_iter();
        let (Some(beaten), Some(claimed)) = (replies.next(), replies.next()) else {
            return Err(self.malformed("a claim with a heartbeat lost a reply".into()));
        };
        let claimed = self.claimed(requests, self.decode(claimed)?)?;
        let nodes = match self.decode::<Vec<String>>(beaten) {
            Ok(reply) => Some(nodes_from_reply(&reply)),
            Err(e) => {
                tracing::debug!("the heartbeat in a claim batch failed: {e}");
                None
            }
        };
        Ok((claimed, nodes))
    }
}
