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

use super::registry::{self, BeatData, Heartbeat, NodeRecord, Registry};
use super::{
    ClaimOutcome, ClaimRequest, Claimed, History, LockStatus, Locks, Lost, Outcome, Owner,
    RECORD_FORMAT, Renewal, RunRecord, SchemaNotice, StoreError, TriggerAnswer, TriggerId, Won,
    duration_ms, from_ms, newest_first, parse_format, to_ms,
};
use crate::config::{JobName, Misfire, StoreConfig, StoreUrl, TlsFiles, one_line};

mod args;
mod audit;
mod nodes;
mod outbox;
mod scan;
use args::*;
pub(crate) use args::{format_key, triggers_key};
#[cfg(feature = "redlock")]
pub(crate) use audit::{audit_args, audit_key, read_audit};
#[cfg(any(feature = "redlock", feature = "fuzzing"))]
pub(crate) use nodes::nodes_from_reply;
#[cfg(feature = "redlock")]
pub(crate) use nodes::registry_args;
#[cfg(feature = "redlock")]
pub(crate) use outbox::{outbox_keys, parcels_from_reply, put_args};
#[cfg(feature = "fuzzing")]
pub(crate) use scan::runs_of_stream;
use scan::*;

static CLAIM: &str = include_str!("redis/claim.lua");
static RENEW: &str = include_str!("redis/renew.lua");
static RELEASE: &str = include_str!("redis/release.lua");
static RECORD: &str = include_str!("redis/record.lua");
static REGISTRY: &str = include_str!("redis/registry.lua");
pub(crate) static PAUSE: &str = include_str!("redis/pause.lua");
pub(crate) static TRIGGER: &str = include_str!("redis/trigger.lua");
pub(crate) static WITHDRAW: &str = include_str!("redis/withdraw.lua");
pub(crate) static FORMAT: &str = include_str!("redis/format.lua");
pub(crate) static OUTBOX: &str = include_str!("redis/outbox.lua");
pub(crate) static AUDIT: &str = include_str!("redis/audit.lua");

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
    outbox: Script,
    audit: Script,
    warned_persistence: AtomicBool,
    schema_notice: SchemaNotice,
}

/// Subscribes on `client` to `channel` and sends a notice once subscribed
/// and one per message, until the subscription ends (`Ok`) or fails.
pub(crate) async fn subscribe_notices(
    client: &Client,
    channel: &str,
    url: &StoreUrl,
    tx: &tokio::sync::mpsc::Sender<()>,
) -> Result<(), String> {
    use futures_util::StreamExt;
    let why = |e: redis::RedisError| url.scrub(&e.to_string());
    let mut pubsub = client.get_async_pubsub().await.map_err(why)?;
    pubsub.subscribe(channel).await.map_err(why)?;
    if !super::notices::notify(tx) {
        return Ok(());
    }
    let mut messages = pubsub.on_message();
    while messages.next().await.is_some() {
        if !super::notices::notify(tx) {
            return Ok(());
        }
    }
    Ok(())
}

/// One server's connection: made on first use, and made anew after
/// [`Connection::forget`]. A call that timed out leaves its request in the
/// connection's TCP stream, and every later call waits behind it: after a
/// partition heals, TCP sends it again only when its backoff ends (up to as
/// long again as the partition lasted), while a new connection goes through
/// at once. So a connection that let a call time out is forgotten (plain
/// Redis: the driver's timeout; Redlock: a master that left a call without
/// a majority unanswered).
pub(crate) struct Connection {
    client: Client,
    current: std::sync::Mutex<Option<ConnectionManager>>,
    /// One connection made at a time.
    connecting: tokio::sync::Mutex<()>,
}

impl Connection {
    pub(crate) fn new(client: Client) -> Self {
        Connection {
            client,
            current: std::sync::Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    fn cached(&self) -> Option<ConnectionManager> {
        super::lock(&self.current).clone()
    }

    /// The connection, made now if there is none.
    pub(crate) async fn get(
        &self,
        config: ConnectionManagerConfig,
    ) -> redis::RedisResult<ConnectionManager> {
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let _connecting = self.connecting.lock().await;
        // Another call may have made it while this one waited.
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let c = ConnectionManager::new_with_config(self.client.clone(), config).await?;
        *super::lock(&self.current) = Some(c.clone());
        Ok(c)
    }

    /// Drops the connection: the next call makes a new one. Calls in flight
    /// on it go on until they end.
    pub(crate) fn forget(&self) {
        *super::lock(&self.current) = None;
    }
}

/// How the store reaches its master.
enum Link {
    /// One server at a fixed address (`redis://`, `rediss://`).
    Direct(Connection),
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
        Ok(Self::with_link(
            Link::Direct(Connection::new(client)),
            None,
            config,
        ))
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
            outbox: Script::new(OUTBOX),
            audit: Script::new(AUDIT),
            warned_persistence: AtomicBool::new(false),
            schema_notice: SchemaNotice::default(),
        }
    }

    fn scripts(&self) -> [&Script; 10] {
        [
            &self.audit,
            &self.outbox,
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

    fn key(&self, job: &str, kind: &str) -> String {
        job_key(&self.prefix, job, kind)
    }

    fn err(&self, e: redis::RedisError) -> StoreError {
        if let Link::Direct(conn) = &self.link
            && e.is_timeout()
        {
            // Stuck behind the call that timed out (see `Connection`).
            conn.forget();
        }
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
            Link::Direct(conn) => conn.get(config).await.map_err(|e| self.err(e)),
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
        if let Some(problem) = problem
            && !self.warned_persistence.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                store = %self.url,
                "Redis {problem}: a restart or failover can lose acknowledged claims, and an occurrence may then run twice; use `appendonly yes` with `appendfsync always` (docs/protocol.md)"
            );
        }
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

/// One run stream's `XREVRANGE` reply: (entry id, fields), newest first.
pub(crate) type StreamEntries = Vec<(String, HashMap<String, String>)>;

/// How a connection to one server behaves: a call slower than nine tenths
/// of `op_timeout` fails (before the node, which gives the call
/// `op_timeout`, gives up on it: so the store sees the timeout and makes a
/// new connection, see [`Connection`]), and a lost connection is made again
/// in the background.
fn manager_config(op_timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(op_timeout))
        .set_response_timeout(Some(op_timeout - op_timeout / 10))
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
    } else if refuses(e) {
        StoreError::Refused { store, reason }
    } else {
        StoreError::Backend { store, reason }
    }
}

/// An error that refuses this node for good: a password or user rejected
/// (`WRONGPASS`, `NOAUTH`, a password sent to a server without one), a
/// client configuration the server cannot take (TLS).
fn refuses(e: &redis::RedisError) -> bool {
    matches!(
        e.kind(),
        redis::ErrorKind::AuthenticationFailed | redis::ErrorKind::InvalidClientConfig
    ) || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"))
        || e.to_string().contains("without any password configured")
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
        let key = format_key(&self.prefix);
        let record: Option<String> = Script::new(FORMAT)
            .key(&key)
            .arg(RECORD_FORMAT)
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        let found = record
            .map(|text| parse_format(self.url.redacted(), &key, &text))
            .transpose()?
            .unwrap_or(0);
        self.schema_notice
            .settle(self.url.redacted(), found, RECORD_FORMAT)
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

    /// A subscription to the channel `trigger.lua` publishes each accepted
    /// request on (named as the requests' hash, `{prefix}triggers`), on a
    /// connection of its own; through Sentinel on the master the sentinels
    /// name when it is made (a failover that drops it makes it again).
    fn notices(
        self: std::sync::Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) -> Option<tokio::sync::mpsc::Receiver<()>> {
        let store = self.clone();
        Some(super::notices::follow(
            self.url.redacted().to_string(),
            stop,
            move |tx| {
                let store = store.clone();
                async move {
                    let client = match &store.link {
                        Link::Direct(conn) => conn.client().clone(),
                        #[cfg(feature = "sentinel")]
                        Link::Sentinel(master) => master
                            .client()
                            .await
                            .map_err(|e| store.url.scrub(&e.to_string()))?,
                    };
                    let channel = triggers_key(&store.prefix);
                    subscribe_notices(&client, &channel, &store.url, &tx).await
                }
            },
        ))
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

    fn schema_notice(&self) -> Option<String> {
        self.schema_notice.get()
    }
}
