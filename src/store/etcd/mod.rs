//! The etcd store (`etcd://host:2379,host:2379`, `etcds://` for TLS; etcd
//! 3.4+): per job, a state key changed by compare-and-set on its revision
//! and a key attached to an etcd lease that says who holds the job.
//!
//! Keys, below `store.key_prefix` (`{p}`):
//! - `{p}lock/<job>`: JSON with the last owner, the fence (a decimal
//!   string), the last occurrence claimed and the modification time,
//!   instants in milliseconds;
//! - `{p}lease/<job>`: JSON with the holder's owner string and the lease's
//!   end (ms), put with an etcd lease. The job is held while this key
//!   exists and its end has not passed: etcd deletes the key when its lease
//!   ends, and lease TTLs are whole seconds: a lease of L is asked for as
//!   `max(ceil(L), 2 s)` ([`lease_ttl_secs`]), and etcd may grant more. The
//!   recorded end keeps a lease to its length below that (a 300 ms lease
//!   ends after 300 ms, not 2 s);
//! - `{p}trigger/<job>~<id>`: a manual run's request pending in the job's
//!   state (put in the same transaction as the request, deleted in the one
//!   of the claim that takes it), so nodes find pending requests with one
//!   keys-only range read;
//! - `{p}runs/<job>/<fence>`: one finished run each (JSON), the fence
//!   zero-padded so keys sort by fence; created only while absent, so a
//!   retried write records nothing twice. Each job keeps its newest
//!   `store.history_limit` runs.
//!
//! A batch of claims reads every job's two keys (transactions of gets, sent
//! together), decides each job with the shared rule ([`super::decide`]),
//! grants one lease per distinct TTL among the wins, and writes each win as
//! a nested transaction conditional on both keys' revisions as read. The
//! outer transactions have no compares of their own, so each job goes
//! through or not on its own: a job changed under the batch (a peer's
//! claim) is read and decided again. Renewals put the lease key again with a
//! fresh lease, on the same condition; releases delete the owner's, compared
//! on its revision. Every transaction stays within etcd's default
//! `--max-txn-ops` (128), counted as etcd counts nested transactions
//! (`MAX_TXN_OPS`).
//!
//! etcd gives clients no clock: the store's now is this host's clock, and a
//! lease's recorded end is on the clock of the node that took it. So a
//! lease ends at the earlier of its etcd lease (timed by the etcd leader)
//! and its recorded end by the reader's clock: nodes must agree on the time
//! to within the margin's half, as the holder's local deadline assumes, and
//! the claim rule's bound on early claims (`cluster.max_clock_offset`) only
//! holds as well as this host's clock agrees with its peers', until nodes
//! compare clocks through the node registry (not built yet).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use etcd_client as etcd;
use etcd_client::{
    Compare, CompareOp, DeleteOptions, EventType, GetOptions, GetResponse, KeyValue, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, TxnResponse, WatchFilterType, WatchOptions,
};
use futures_util::future::try_join_all;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::cas;
use super::records::{JobMarks, Kind, Layout};
use super::registry::{self, BeatData, Heartbeat, NodeRecord, Registry};
use super::{
    ClaimOutcome, ClaimRequest, Claimed, FORMAT_ATTEMPTS, History, LockRow, LockStatus, Locks,
    Owner, RECORD_FORMAT, Renewal, RunData, RunRecord, SchemaNotice, StoreError, TriggerAnswer,
    TriggerId, decide, format_contended, from_ms, lock, newest_first, parse_format,
    pending_from_entries, run_from_json, to_ms, trigger_row,
};
use crate::config::{EtcdTarget, JobName, StoreConfig, StoreKind, StoreUrl, TlsFiles, one_line};

mod audit;
mod clocks;
mod history;
mod lock;
mod nodes;
mod outbox;
mod txn;
use clocks::*;
use lock::*;
use nodes::*;
use txn::*;

/// Operations in one transaction: etcd's default `--max-txn-ops`. etcd
/// counts a transaction as its longest list (compares, success or failure
/// operations), and lets each transaction nested in it have only what the
/// parent left: a parent of N operations holds nested transactions of at
/// most 128 − N each (`checkTxnRequest` in etcd's `api/v3rpc/key.go`).
const MAX_TXN_OPS: usize = 128;
/// Stored run records per history write, in bytes (`History::record_runs`).
const OUTPUT_PER_WRITE: usize = 512 * 1024;
/// Runs per read of history: a record is at most 384 KiB (a 64 KiB tail of
/// control bytes, each escaped in six), so an answer stays below the
/// client's 4 MiB message limit.
const RUNS_PER_READ: usize = 8;
/// The shortest lease TTL asked for: etcd's minimum with its default timing
/// (1.5 election timeouts, rounded up); it would raise a shorter one anyway.
const MIN_TTL_SECS: i64 = 2;
/// The longest lease TTL etcd grants (`MaxLeaseTTL`).
const MAX_TTL_SECS: i64 = 9_000_000_000;
/// HTTP/2 pings while a call is going: etcd refuses pings more often than
/// every 5 s (`--grpc-keepalive-min-time`), and any on an idle connection.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Surplus runs deleted per job and trim: their keys are read first.
const TRIM_PAGE: i64 = 10_000;
/// Keys per page when listing runs: a page of keys stays far below gRPC's
/// 4 MiB message limit.
const KEYS_PAGE: i64 = 10_000;

/// gRPC status codes (tonic's `Code` as numbers; etcd-client does not
/// re-export the type).
const CANCELLED: i32 = 1;
const DEADLINE_EXCEEDED: i32 = 4;
const PERMISSION_DENIED: i32 = 7;
const RESOURCE_EXHAUSTED: i32 = 8;
const UNAVAILABLE: i32 = 14;
const UNAUTHENTICATED: i32 = 16;

/// The etcd implementation of [`crate::store::Store`].
pub struct EtcdStore {
    target: EtcdTarget,
    url: StoreUrl,
    tls: Option<TlsFiles>,
    /// Every key starts with `store.key_prefix` ([`Layout::etcd`]).
    keys: Layout,
    op_timeout: Duration,
    client: tokio::sync::Mutex<Option<etcd::Client>>,
    /// The member the client talks to, as an index into the URL's list: one
    /// at a time, the next one after a call that timed out or broke the
    /// connection. A member cut off by a partition lets calls hang rather
    /// than refusing them, and a channel balanced over all members went on
    /// sending it a share of them (measured: claims stalled on the nodes for
    /// the whole partition, partition::etcd_leader_cut_off_…).
    endpoint: std::sync::atomic::AtomicUsize,
    /// When the client last moved to the next member.
    moved_at: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// Claimers waiting for a lease key to go, and the watch that wakes them.
    releases: Arc<Releases>,
    /// The live nodes' clocks against this one's (etcd has no clock).
    clocks: Arc<PeerClocks>,
    /// The etcd lease this node's registry record is put with, and until
    /// when a heartbeat may still use it ([`BEAT_LEASE_SPARE`]): claims
    /// carry the heartbeat in their first transaction with it.
    beat_lease: std::sync::Mutex<Option<(i64, tokio::time::Instant)>>,
    /// A beat with the look in its transaction was refused (a user who may
    /// not read the requests' keys): the look goes beside the beat since.
    look_apart: std::sync::atomic::AtomicBool,
    schema_notice: SchemaNotice,
}

/// A heartbeat's etcd lease lives this much longer than the record's time
/// to live, so the heartbeats inside claims can reuse it for this long
/// (one grant a minute, not one per beat). Liveness is read from the
/// record itself (`last_seen` and its time to live); the lease only
/// removes a dead node's key, at most this much later.
const BEAT_LEASE_SPARE: Duration = Duration::from_secs(60);

/// Claimers waiting for lease keys to be deleted (by key), woken by one
/// watch per store on every lease key, deletions only.
#[derive(Default)]
struct Releases {
    waiters: std::sync::Mutex<HashMap<String, Arc<Notify>>>,
    watch: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        if let Some(w) = lock(&self.releases.watch).take() {
            w.abort();
        }
        if let Some(w) = lock(&self.clocks.watch).take() {
            w.abort();
        }
    }
}

impl EtcdStore {
    /// Connections are made on first use.
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        let StoreKind::Etcd(target) = config.url.kind() else {
            return Err(StoreError::not_a(config, "an etcd:// or etcds:// URL"));
        };
        Ok(EtcdStore {
            target: target.clone(),
            url: config.url.clone(),
            tls: config.tls.clone(),
            keys: Layout::etcd(&config.key_prefix),
            op_timeout: config.op_timeout,
            client: tokio::sync::Mutex::new(None),
            endpoint: std::sync::atomic::AtomicUsize::new(0),
            moved_at: std::sync::Mutex::new(None),
            releases: Arc::new(Releases::default()),
            clocks: Arc::new(PeerClocks::default()),
            beat_lease: std::sync::Mutex::new(None),
            look_apart: std::sync::atomic::AtomicBool::new(false),
            schema_notice: SchemaNotice::default(),
        })
    }

    /// The record format version the `format` key held (0: none), after
    /// putting this binary's there when it held none or an older one, on
    /// condition that it did not change since the read.
    async fn settle_format(&self, client: &etcd::Client) -> Result<i64, StoreError> {
        let key = self.keys.under("format");
        let ours = RECORD_FORMAT.to_string();
        let mut kv = client.kv_client();
        for _ in 0..FORMAT_ATTEMPTS {
            let read = self.timed(kv.get(key.as_str(), None)).await?;
            let (found, unchanged) = match read.kvs().first() {
                None => (
                    0,
                    Compare::create_revision(key.as_str(), CompareOp::Equal, 0),
                ),
                Some(record) => (
                    parse_format(
                        self.url.redacted(),
                        &key,
                        &String::from_utf8_lossy(record.value()),
                    )?,
                    Compare::mod_revision(key.as_str(), CompareOp::Equal, record.mod_revision()),
                ),
            };
            if found >= RECORD_FORMAT {
                return Ok(found);
            }
            let raise = Txn::new().when(vec![unchanged]).and_then(vec![TxnOp::put(
                key.as_str(),
                ours.as_str(),
                None,
            )]);
            if self.timed(kv.txn(raise)).await?.succeeded() {
                return Ok(found);
            }
        }
        Err(format_contended(self.url.redacted(), &key))
    }

    fn backend(&self, reason: impl Into<String>) -> StoreError {
        StoreError::Backend {
            store: self.url.redacted().into(),
            reason: reason.into(),
        }
    }

    fn err(&self, e: &etcd::Error) -> StoreError {
        let store = self.url.redacted().to_string();
        let reason = one_line(&self.url.scrub(&error_text(e)));
        if is_transient(e) {
            StoreError::Unavailable { store, reason }
        } else if matches!(status_code(e), Some(UNAUTHENTICATED | PERMISSION_DENIED)) {
            StoreError::Refused { store, reason }
        } else {
            StoreError::Backend { store, reason }
        }
    }

    /// The error for `e`, forgetting the client when its connection broke,
    /// so the next call connects afresh.
    async fn failed(&self, e: etcd::Error) -> StoreError {
        let err = self.err(&e);
        let broken = breaks_connection(&e);
        drop(e);
        if broken {
            self.forget_client().await;
        }
        err
    }

    /// Drops the client, so the next call connects afresh, to the next
    /// member.
    async fn forget_client(&self) {
        self.client.lock().await.take();
        self.next_endpoint();
    }

    /// Moves to the next member, at most once per `op_timeout`: calls sent
    /// together to a silent member fail together, and a call that failed on
    /// it late must not move the client off the member the first failure
    /// moved it to.
    fn next_endpoint(&self) {
        let now = tokio::time::Instant::now();
        let mut last = self
            .moved_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.is_some_and(|at| now.duration_since(at) < self.op_timeout) {
            return;
        }
        *last = Some(now);
        self.endpoint
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// `fut` within `op_timeout`.
    async fn timed<T>(
        &self,
        fut: impl Future<Output = Result<T, etcd::Error>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.op_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.failed(e).await),
            Err(_) => {
                self.forget_client().await;
                Err(StoreError::Timeout(self.op_timeout))
            }
        }
    }

    /// The client, connecting when there is none (first use, or after its
    /// connection broke).
    async fn client(&self) -> Result<etcd::Client, StoreError> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let options = self.connect_options()?;
        let all = endpoints(&self.target);
        let at = self.endpoint.load(std::sync::atomic::Ordering::Relaxed) % all.len().max(1);
        let connect = etcd::Client::connect(
            all.get(at).into_iter().cloned().collect::<Vec<_>>(),
            Some(options),
        );
        let client = match tokio::time::timeout(self.op_timeout, connect).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                self.next_endpoint();
                return Err(self.err(&e));
            }
            Err(_) => {
                self.next_endpoint();
                return Err(StoreError::Timeout(self.op_timeout));
            }
        };
        *slot = Some(client.clone());
        Ok(client)
    }

    fn connect_options(&self) -> Result<etcd::ConnectOptions, StoreError> {
        let mut options = etcd::ConnectOptions::new()
            .with_timeout(self.op_timeout)
            .with_connect_timeout(self.op_timeout)
            .with_keep_alive(
                KEEP_ALIVE_INTERVAL,
                self.op_timeout.max(Duration::from_secs(1)),
            )
            // etcd answers pings on an idle connection with GOAWAY.
            .with_keep_alive_while_idle(false)
            // A member cut off from its leader answers at once instead of
            // letting the call hang.
            .with_require_leader(true);
        if let Some(user) = &self.target.username {
            options = options
                .with_user(user.as_str(), self.url.password().unwrap_or_default())
                // etcd's tokens expire (after 5 idle minutes by default).
                .with_auto_token_refresh(true);
        }
        if self.target.tls {
            options = options.with_tls(self.tls_options()?);
        }
        Ok(options)
    }

    /// TLS for `etcds://`: the server's certificate must chain to
    /// `store.tls_ca_file` when set, else to the system's roots; the client
    /// pair (`store.tls_cert_file`, `store.tls_key_file`) when set.
    fn tls_options(&self) -> Result<etcd::TlsOptions, StoreError> {
        let read = |path: &Path| {
            std::fs::read(path)
                .map_err(|e| self.backend(format!("cannot read {}: {e}", path.display())))
        };
        let files = self.tls.as_ref();
        let mut tls = etcd::TlsOptions::new();
        tls = match files.and_then(|f| f.ca.as_deref()) {
            Some(ca) => tls.ca_certificate(etcd::Certificate::from_pem(read(ca)?)),
            None => tls.with_native_roots(),
        };
        if let Some((cert, key)) = files.and_then(|f| f.client.as_ref()) {
            tls = tls.identity(etcd::Identity::from_pem(
                read(cert.as_path())?,
                read(key.as_path())?,
            ));
        }
        Ok(tls)
    }

    /// Starts the watch on every lease key unless it runs: deletions wake
    /// the claimers waiting on those keys.
    async fn watch_releases(&self) {
        if lock(&self.releases.watch)
            .as_ref()
            .is_some_and(|w| !w.is_finished())
        {
            return;
        }
        // Only with the connection claims made: a claimer never waits to
        // connect here (claims and renewals would queue behind it).
        let Some(client) = self
            .client
            .try_lock()
            .ok()
            .and_then(|slot| slot.as_ref().cloned())
        else {
            return;
        };
        let mut slot = lock(&self.releases.watch);
        if slot.as_ref().is_some_and(|w| !w.is_finished()) {
            return;
        }
        *slot = Some(tokio::spawn(wake_on_deletions(
            Arc::downgrade(&self.releases),
            client,
            self.keys.of(Kind::Lease, ""),
            self.url.clone(),
        )));
    }
}

/// Watches every lease key under `prefix` for deletions (a release, an
/// etcd lease's end) and wakes the claimers waiting on each; watches again
/// when the watch breaks (after 1 s, doubling to 30 s while it keeps
/// failing; logged once when that starts and once when it ends), for as
/// long as the store lasts.
async fn wake_on_deletions(
    releases: Weak<Releases>,
    client: etcd::Client,
    prefix: String,
    url: StoreUrl,
) {
    let options = WatchOptions::new()
        .with_range(prefix_end(prefix.as_bytes()))
        .with_filters([WatchFilterType::NoPut]);
    let mut pause = Duration::from_secs(1);
    let mut failing = false;
    loop {
        let mut watch = client.watch_client();
        match watch.watch(prefix.as_str(), Some(options.clone())).await {
            Err(e) => {
                if !failing {
                    tracing::warn!(store = %url.redacted(), "cannot watch lease keys (a peer's release is then noticed when its lease would have ended): {}", one_line(&url.scrub(&e.to_string())));
                    failing = true;
                }
                pause = (pause * 2).min(Duration::from_secs(30));
            }
            Ok(mut stream) => {
                if failing {
                    tracing::info!(store = %url.redacted(), "watching lease keys again");
                    failing = false;
                }
                pause = Duration::from_secs(1);
                while let Ok(Some(answer)) = stream.message().await {
                    let Some(releases) = releases.upgrade() else {
                        return;
                    };
                    if answer.canceled() {
                        break;
                    }
                    let waiters = lock(&releases.waiters);
                    for event in answer.events() {
                        if !matches!(event.event_type(), EventType::Delete) {
                            continue;
                        }
                        let key = event
                            .kv()
                            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned());
                        if let Some(n) = key.and_then(|k| waiters.get(&k)) {
                            n.notify_waiters();
                        }
                    }
                }
            }
        }
        if releases.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(pause).await;
    }
}

/// A lease TTL for etcd, which counts leases in whole seconds: the lease
/// rounded up, and at least 2 s (etcd's own minimum with its default
/// timing; it would raise a shorter one anyway). Never shorter than asked, so
/// a lease ends no earlier on etcd than its holder counts it.
pub fn lease_ttl_secs(lease: Duration) -> i64 {
    let secs = i64::try_from(lease.as_millis().div_ceil(1000)).unwrap_or(MAX_TTL_SECS);
    secs.clamp(MIN_TTL_SECS, MAX_TTL_SECS)
}

/// This host's clock, in milliseconds: etcd has none to offer.
fn now_ms() -> i64 {
    to_ms(Utc::now())
}

/// The client URLs of the cluster's members.
fn endpoints(target: &EtcdTarget) -> Vec<String> {
    let scheme = if target.tls { "https" } else { "http" };
    target
        .servers
        .iter()
        .map(|server| format!("{scheme}://{}", crate::config::host_port(server)))
        .collect()
}

/// etcd 3.4 or later (nested transactions came with 3.3); a version this
/// cannot read is let through.
fn is_supported_version(version: &str) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split('.')
        .map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => (major, minor) >= (3, 4),
        _ => true,
    }
}

fn status_code(e: &etcd::Error) -> Option<i32> {
    match e {
        etcd::Error::GRpcStatus(status) => Some(i32::from(status.code())),
        _ => None,
    }
}

/// Unreachable, too slow or between leaders, as opposed to a refused request.
fn is_transient(e: &etcd::Error) -> bool {
    matches!(e, etcd::Error::TransportError(_) | etcd::Error::IoError(_))
        || matches!(
            status_code(e),
            Some(CANCELLED | DEADLINE_EXCEEDED | RESOURCE_EXHAUSTED | UNAVAILABLE)
        )
}

/// The connection itself failed, not the request.
fn breaks_connection(e: &etcd::Error) -> bool {
    matches!(e, etcd::Error::TransportError(_) | etcd::Error::IoError(_))
        || matches!(
            status_code(e),
            Some(CANCELLED | DEADLINE_EXCEEDED | UNAVAILABLE)
        )
}

/// `e` with its causes: tonic's transport errors say little on their own.
fn error_text(e: &etcd::Error) -> String {
    match e {
        etcd::Error::GRpcStatus(status) => {
            let mut text = format!("{:?}: {}", status.code(), status.message());
            if let Some(cause) = std::error::Error::source(status) {
                text.push_str(": ");
                text.push_str(&with_causes(cause));
            }
            text
        }
        etcd::Error::TransportError(t) => with_causes(t),
        etcd::Error::IoError(io) => with_causes(io),
        other => other.to_string(),
    }
}

fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

#[async_trait]
impl Locks for EtcdStore {
    /// Checks that the cluster answers and is recent enough, and settles
    /// the record format version (the `format` key).
    async fn prepare(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        let mut maintenance = client.maintenance_client();
        let status = self.timed(maintenance.status()).await?;
        if !is_supported_version(status.version()) {
            return Err(self.backend(format!(
                "etcd {} is too old: cronlease needs etcd 3.4 or later",
                status.version()
            )));
        }
        let found = self.settle_format(&client).await?;
        self.schema_notice
            .settle(self.url.redacted(), found, RECORD_FORMAT)
    }

    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Claimed, StoreError> {
        if requests.is_empty() {
            return Ok(Claimed {
                store_now: from_ms(self.median_now_ms()),
                outcomes: Vec::new(),
            });
        }
        self.claim_with(requests, None)
            .await
            .map(|(claimed, _)| claimed)
    }

    /// A deletion of the job's lease key (a release, an etcd lease's end)
    /// comes through the store's watch on lease keys. One between the
    /// claim's read and this wait is not seen: the claimer then waits the
    /// lease out as elsewhere.
    async fn lease_freed(&self, job: &JobName) {
        let key = self.keys.of(Kind::Lease, job.as_str());
        let notify = lock(&self.releases.waiters).entry(key).or_default().clone();
        let freed = notify.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        self.watch_releases().await;
        freed.await;
    }

    /// etcd has no clock for clients: the median of the live nodes'
    /// clocks, as this node reads them from their heartbeats (its own
    /// before it has read any).
    async fn clock(&self) -> Result<DateTime<Utc>, StoreError> {
        Ok(from_ms(self.median_now_ms()))
    }

    async fn renew_many(
        &self,
        owner: &Owner,
        renewals: &[Renewal],
    ) -> Result<Vec<bool>, StoreError> {
        if renewals.is_empty() {
            return Ok(Vec::new());
        }
        let client = self.client().await?;
        let jobs: Vec<&str> = renewals.iter().map(|r| r.job.as_str()).collect();
        let (_, done) = self
            .read_decide_write(&client, &jobs, Want::Lease, |i, view| {
                let Some(e) = view.keys.lease.as_ref() else {
                    return (None, false);
                };
                let lease = read_lease(e, view.now);
                // Gone (expired, released) or another owner's: refused.
                if lease.owner != owner.as_str() || lease.expires_at <= view.now {
                    return (None, false);
                }
                let renewed = LeaseValue {
                    owner: lease.owner,
                    expires_at: view
                        .now
                        .saturating_add(super::duration_ms(renewals[i].lease)),
                };
                let Ok(value) = serde_json::to_vec(&renewed) else {
                    return (None, false);
                };
                let key = self.keys.of(Kind::Lease, jobs[i]);
                let plan = Plan {
                    when: vec![unchanged(&key, Some(e))],
                    ops: vec![PlanOp::PutLeased(
                        key,
                        value,
                        lease_ttl_secs(renewals[i].lease),
                    )],
                };
                (Some(plan), true)
            })
            .await?;
        Ok(done)
    }

    async fn release(&self, jobs: &[JobName], owner: &Owner) -> Result<usize, StoreError> {
        if jobs.is_empty() {
            return Ok(0);
        }
        let client = self.client().await?;
        let names: Vec<&str> = jobs.iter().map(JobName::as_str).collect();
        let (_, done) = self
            .read_decide_write(&client, &names, Want::Lease, |i, view| {
                match &view.keys.lease {
                    Some(e) => {
                        let lease = read_lease(e, view.now);
                        if lease.owner != owner.as_str() {
                            return (None, false);
                        }
                        // Past its end the key is deleted too (peers whose
                        // clocks lag see it end now, and the watch tells
                        // them), but only a live lease counts as ended.
                        let key = self.keys.of(Kind::Lease, names[i]);
                        let plan = Plan {
                            when: vec![unchanged(&key, Some(e))],
                            ops: vec![PlanOp::Delete(key)],
                        };
                        (Some(plan), lease.expires_at > view.now)
                    }
                    None => (None, false),
                }
            })
            .await?;
        Ok(done.into_iter().filter(|d| *d).count())
    }

    async fn set_paused(&self, jobs: &[JobName], paused: bool) -> Result<(), StoreError> {
        if jobs.is_empty() {
            return Ok(());
        }
        let client = self.client().await?;
        let names: Vec<&str> = jobs.iter().map(JobName::as_str).collect();
        let mut failed = None;
        self.read_decide_write(&client, &names, Want::LockAndLease, |i, view| {
            let state = match read_state(view.keys.lock.as_ref()) {
                // A job never claimed: its state, free, with the mark.
                Ok(state) => {
                    let kept = state.map(|(s, _)| s).unwrap_or_else(|| LockState::free(view.now));
                    let Some(marks) = JobMarks::paused(Some(&kept.marks), paused, view.now) else {
                        return (None, ());
                    };
                    LockState { marks, ..kept }
                }
                Err(why) => {
                    failed = Some(format!(
                        "the lock key {} of job {} is unreadable ({why}); delete it (etcdctl del) to start the job afresh",
                        self.keys.of(Kind::Lock, names[i]),
                        names[i]
                    ));
                    return (None, ());
                }
            };
            match serde_json::to_vec(&state) {
                Ok(json) => {
                    let key = self.keys.of(Kind::Lock, names[i]);
                    let plan = Plan {
                        when: vec![unchanged(&key, view.keys.lock.as_ref())],
                        ops: vec![PlanOp::Put(key, json)],
                    };
                    (Some(plan), ())
                }
                Err(e) => {
                    failed = Some(e.to_string());
                    (None, ())
                }
            }
        })
        .await?;
        match failed {
            Some(why) => Err(self.backend(&why)),
            None => Ok(()),
        }
    }

    async fn request_trigger(
        &self,
        job: &JobName,
        id: TriggerId,
    ) -> Result<TriggerAnswer, StoreError> {
        let client = self.client().await?;
        let name = job.as_str();
        let (_, answers) = self
            .read_decide_write(&client, &[name], Want::LockAndLease, |_, view| {
                let state = match read_state(view.keys.lock.as_ref()) {
                    Ok(state) => state,
                    Err(why) => {
                        return (
                            None,
                            Err(format!(
                                "the lock key {} of job {name} is unreadable ({why}); delete it (etcdctl del) to start the job afresh",
                                self.keys.of(Kind::Lock, name)
                            )),
                        );
                    }
                };
                let mut row = row_of(state.as_ref(), view);
                let answer = trigger_row(&mut row, id);
                if answer != TriggerAnswer::Accepted {
                    return (None, Ok(answer));
                }
                // A job never claimed: its state, free, with the request.
                let kept = state.map(|(s, _)| s).unwrap_or_else(|| LockState::free(view.now));
                let state = LockState {
                    marks: JobMarks::requested(Some(&kept.marks), row.trigger, view.now),
                    ..kept
                };
                match serde_json::to_vec(&state) {
                    Ok(json) => {
                        let (lock, lease) = (self.keys.of(Kind::Lock, name), self.keys.of(Kind::Lease, name));
                        let plan = Plan {
                            when: vec![
                                unchanged(&lock, view.keys.lock.as_ref()),
                                unchanged(&lease, view.keys.lease.as_ref()),
                            ],
                            ops: vec![
                                PlanOp::Put(lock, json),
                                PlanOp::Put(self.keys.trigger(name, id), Vec::new()),
                            ],
                        };
                        (Some(plan), Ok(answer))
                    }
                    Err(e) => (None, Err(e.to_string())),
                }
            })
            .await?;
        match answers.into_iter().next() {
            Some(Ok(answer)) => Ok(answer),
            Some(Err(why)) => Err(self.backend(&why)),
            None => Err(self.backend("no answer to a trigger")),
        }
    }

    async fn withdraw_trigger(&self, job: &JobName, id: TriggerId) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let name = job.as_str();
        let (_, answers) = self
            .read_decide_write(&client, &[name], Want::LockAndLease, |_, view| {
                let Ok(Some((state, _))) = read_state(view.keys.lock.as_ref()) else {
                    return (None, Ok(false));
                };
                let Some(marks) = JobMarks::withdrawn(&state.marks, id) else {
                    return (None, Ok(false));
                };
                let state = LockState { marks, ..state };
                match serde_json::to_vec(&state) {
                    Ok(json) => {
                        let lock = self.keys.of(Kind::Lock, name);
                        let plan = Plan {
                            when: vec![unchanged(&lock, view.keys.lock.as_ref())],
                            ops: vec![
                                PlanOp::Put(lock, json),
                                PlanOp::Delete(self.keys.trigger(name, id)),
                            ],
                        };
                        (Some(plan), Ok(true))
                    }
                    Err(e) => (None, Err(e.to_string())),
                }
            })
            .await?;
        match answers.into_iter().next() {
            Some(Ok(withdrawn)) => Ok(withdrawn),
            Some(Err(why)) => Err(self.backend(&why)),
            None => Err(self.backend("no answer to a withdrawal")),
        }
    }

    /// A watch on the requests' keys (puts only), on the store's client.
    fn notices(
        self: Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) -> Option<tokio::sync::mpsc::Receiver<()>> {
        let prefix = self.keys.of(Kind::Trigger, "");
        let store = self.clone();
        Some(super::notices::follow(
            self.url.redacted().to_string(),
            stop,
            move |tx| {
                let (store, prefix) = (store.clone(), prefix.clone());
                async move {
                    let client = store.client().await.map_err(|e| e.to_string())?;
                    let options = WatchOptions::new()
                        .with_range(prefix_end(prefix.as_bytes()))
                        .with_filters([WatchFilterType::NoDelete]);
                    let mut watch = client.watch_client();
                    let mut stream = watch
                        .watch(prefix.as_str(), Some(options))
                        .await
                        .map_err(|e| store.url.scrub(&e.to_string()))?;
                    if !super::notices::notify(&tx) {
                        return Ok(());
                    }
                    while let Some(answer) = stream
                        .message()
                        .await
                        .map_err(|e| store.url.scrub(&e.to_string()))?
                    {
                        if answer.canceled() {
                            return Err("the watch was cancelled".into());
                        }
                        if !answer.events().is_empty() && !super::notices::notify(&tx) {
                            return Ok(());
                        }
                    }
                    Ok(())
                }
            },
        ))
    }

    async fn pending_triggers(&self) -> Result<Vec<(String, TriggerId)>, StoreError> {
        let client = self.client().await?;
        let root = self.keys.of(Kind::Trigger, "");
        let keys = self.keys_under(&client, &root).await?;
        Ok(pending_from_entries(
            keys.iter().filter_map(|key| key.strip_prefix(&root)),
        ))
    }

    /// A linearizable read: it needs the cluster's quorum, and this user's
    /// permission on the keys.
    async fn ping(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        let mut kv = client.kv_client();
        let options = GetOptions::new().with_count_only();
        self.timed(kv.get(self.keys.of(Kind::Lock, ""), Some(options)))
            .await
            .map(|_| ())
    }

    async fn status(&self) -> Result<Vec<LockStatus>, StoreError> {
        let client = self.client().await?;
        let (lock_prefix, lease_prefix) =
            (self.keys.of(Kind::Lock, ""), self.keys.of(Kind::Lease, ""));
        // Both ranges at one revision, the locks' first page's.
        let (locks, revision) = self.range_all(&client, &lock_prefix, 0).await?;
        let (leases, _) = self.range_all(&client, &lease_prefix, revision).await?;
        let now = now_ms();
        let holders: HashMap<Vec<u8>, LeaseValue> = leases
            .iter()
            .filter_map(|kv| {
                let job = kv.key().strip_prefix(lease_prefix.as_bytes())?;
                let lease = read_lease(&Entry::of(kv), now);
                (lease.expires_at > now).then(|| (job.to_vec(), lease))
            })
            .collect();
        let mut out = Vec::new();
        for kv in &locks {
            let Some(job) = kv.key().strip_prefix(lock_prefix.as_bytes()) else {
                continue;
            };
            let Ok(state) = serde_json::from_slice::<LockState>(kv.value()) else {
                continue;
            };
            let holder = holders.get(job);
            out.push(LockStatus {
                job: String::from_utf8_lossy(job).into_owned(),
                holder: holder.map(|l| l.owner.clone()),
                lease_remaining_ms: holder.map_or(0, |l| {
                    u64::try_from(l.expires_at.saturating_sub(now)).unwrap_or(0)
                }),
                fence: state.marks.fence().unwrap_or(0) as u64,
                last_occurrence: state.marks.last_occurrence.map(from_ms),
                last_owner: (!state.owner.is_empty()).then_some(state.owner),
                paused: state.marks.paused,
            });
        }
        out.sort_by(|a, b| a.job.cmp(&b.job));
        Ok(out)
    }

    fn describe(&self) -> &str {
        self.url.redacted()
    }

    fn schema_notice(&self) -> Option<String> {
        self.schema_notice.get()
    }
}

#[cfg(test)]
mod tests;
