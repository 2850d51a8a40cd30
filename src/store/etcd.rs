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
use super::records::JobMarks;
use super::registry::{self, BeatData, Heartbeat, NodeRecord, Registry};
use super::{
    ClaimOutcome, ClaimRequest, Claimed, Decision, History, LockRow, LockStatus, Locks, Owner,
    Renewal, RunData, RunRecord, StoreError, TriggerAnswer, TriggerId, decide, fence_exhausted,
    from_ms, lock, newest_first, pending_from_entries, run_from_json, to_ms, trigger_entry,
    trigger_row,
};
use crate::config::{EtcdTarget, JobName, StoreConfig, StoreKind, StoreUrl, TlsFiles, one_line};

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
const RESOURCE_EXHAUSTED: i32 = 8;
const UNAVAILABLE: i32 = 14;

/// The etcd implementation of [`crate::store::Store`].
pub struct EtcdStore {
    target: EtcdTarget,
    url: StoreUrl,
    tls: Option<TlsFiles>,
    /// `store.key_prefix`: every key starts with it.
    prefix: String,
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
}

/// A heartbeat's etcd lease lives this much longer than the record's time
/// to live, so the heartbeats inside claims can reuse it for this long
/// (one grant a minute, not one per beat). Liveness is read from the
/// record itself (`last_seen` and its time to live); the lease only
/// removes a dead node's key, at most this much later.
const BEAT_LEASE_SPARE: Duration = Duration::from_secs(60);

/// The other live nodes' clocks against this host's, from their heartbeats
/// as a watch on the registry delivers them: etcd has no clock of its own,
/// so the clock a node is measured against is the median of the live
/// nodes' clocks (docs/protocol.md, "Clock offset").
///
/// A heartbeat carries its sender's clock when it was sent; the watch
/// event comes one path later (sender to etcd to this node). That path is
/// taken to be as long as this node's own heartbeat's (its send to its own
/// event), so a peer's clock − ours ≈ its sent − our received + our path.
#[derive(Default)]
struct PeerClocks {
    /// This node's owner, from its heartbeats (none: a CLI, no median).
    me: std::sync::Mutex<Option<String>>,
    /// This node's own heartbeat from its send to its watch event, in ms.
    own_path_ms: std::sync::Mutex<Option<i64>>,
    /// Per peer owner: its clock − ours in ms, and until when (our clock)
    /// the reading counts: its record's time to live.
    peers: std::sync::Mutex<HashMap<String, (i64, i64)>>,
    /// Owners with a record at this node's last heartbeat, and until when
    /// (our clock) their first readings are waited for: a record's life
    /// after the watch started, since a live node beats within it.
    expected: std::sync::Mutex<(HashSet<String>, Option<i64>)>,
    watch: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl PeerClocks {
    /// The median of the live nodes' clocks (this one's included) − this
    /// node's clock, in ms. 0 with fewer than [`MEDIAN_OF_AT_LEAST`]
    /// clocks: two clocks that disagree give no majority to tell which is
    /// off (the mean would put both out of bounds).
    fn median_ms(&self, now: i64) -> i64 {
        let mut offsets = vec![0];
        offsets.extend(
            lock(&self.peers)
                .values()
                .filter(|(_, until)| *until > now)
                .map(|(offset, _)| *offset),
        );
        if offsets.len() < MEDIAN_OF_AT_LEAST {
            return 0;
        }
        median(&mut offsets)
    }

    /// A heartbeat of `owner` sent at `sent` (its clock) seen at
    /// `received` (ours), living `ttl_ms`.
    fn observe(&self, owner: &str, sent: i64, received: i64, ttl_ms: i64) {
        if lock(&self.me).as_deref() == Some(owner) {
            *lock(&self.own_path_ms) = Some((received - sent).max(0));
            return;
        }
        let path = lock(&self.own_path_ms).unwrap_or(0);
        lock(&self.peers).insert(
            owner.to_string(),
            (sent - received + path, received.saturating_add(ttl_ms)),
        );
    }

    fn forget(&self, owner: &str) {
        lock(&self.peers).remove(owner);
        lock(&self.expected).0.remove(owner);
    }

    /// Notes the owners whose records a heartbeat read (this node's own
    /// left out); the first heartbeat starts the wait for their readings.
    fn expect(&self, owners: HashSet<String>, now: i64, ttl_ms: i64) {
        let mut expected = lock(&self.expected);
        expected.1.get_or_insert(now.saturating_add(ttl_ms));
        expected.0 = owners;
    }

    /// This node has heartbeats and not yet a reading of every node that
    /// had a record then: its median may still be its own clock alone.
    /// Never before its first heartbeat (a CLI, a test without a node).
    fn unsettled(&self, now: i64) -> bool {
        let expected = lock(&self.expected);
        let Some(until) = expected.1 else {
            return false;
        };
        if now >= until {
            return false;
        }
        let peers = lock(&self.peers);
        expected.0.iter().any(|o| !peers.contains_key(o))
    }
}

/// Clocks (this node's included) needed for a median.
const MEDIAN_OF_AT_LEAST: usize = 3;

/// The median of `values` (the mean of the middle two for an even count);
/// 0 for none.
fn median(values: &mut [i64]) -> i64 {
    values.sort_unstable();
    let n = values.len();
    match n {
        0 => 0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]).div_euclid(2),
    }
}

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

/// A job's state key, as stored. Who holds the job now is the lease key's
/// business; this keeps what outlives a lease: the last owner, and the
/// marks ZooKeeper keeps too ([`JobMarks`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LockState {
    /// The last owner (live or not).
    owner: String,
    #[serde(flatten)]
    marks: JobMarks,
}

impl LockState {
    /// The state of a job never claimed, made at `now`.
    fn free(now: i64) -> Self {
        LockState {
            owner: String::new(),
            marks: JobMarks::free(now),
        }
    }
}

/// A lease key's value: who holds the job, until when (ms, the clock of
/// the node that took or renewed it).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LeaseValue {
    owner: String,
    expires_at: i64,
}

/// A lease key's value as read. One that is not ours (written by hand)
/// names its whole value as holder for a second at a time: its etcd
/// lease still ends it.
fn read_lease(entry: &Entry, now: i64) -> LeaseValue {
    serde_json::from_slice(&entry.value).unwrap_or_else(|_| LeaseValue {
        owner: String::from_utf8_lossy(&entry.value).into_owned(),
        expires_at: now.saturating_add(1_000),
    })
}

/// A key as read: its value, the revision it last changed at, its lease.
#[derive(Debug, Clone)]
struct Entry {
    value: Vec<u8>,
    mod_revision: i64,
    lease: i64,
}

impl Entry {
    fn of(kv: &KeyValue) -> Self {
        Entry {
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
            lease: kv.lease(),
        }
    }
}

/// A job's two keys as read (`None`: absent, or not read).
#[derive(Debug, Clone, Default)]
struct JobKeys {
    lock: Option<Entry>,
    lease: Option<Entry>,
}

/// A job as a batch sees it.
#[derive(Debug, Clone)]
struct JobView {
    keys: JobKeys,
    /// This host's clock (ms) once the keys were read.
    now: i64,
}

/// What a batch reads of each job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// Both keys: claims.
    LockAndLease,
    /// The lease key only: renewals and releases.
    Lease,
}

/// One job's conditional write, before the leases it needs are granted.
struct Plan {
    when: Vec<Compare>,
    ops: Vec<PlanOp>,
}

enum PlanOp {
    Put(String, Vec<u8>),
    /// A put attached to a fresh lease of this many seconds.
    PutLeased(String, Vec<u8>, i64),
    Delete(String),
}

impl PlanOp {
    fn key(&self) -> &str {
        match self {
            PlanOp::Put(key, _) | PlanOp::PutLeased(key, _, _) | PlanOp::Delete(key) => key,
        }
    }
}

impl Plan {
    /// Its longest list, as etcd counts a transaction's operations.
    fn width(&self) -> usize {
        self.when.len().max(self.ops.len())
    }

    /// The key that names it: the first it writes.
    fn ident(&self) -> &str {
        self.ops.first().map_or("", PlanOp::key)
    }

    /// The TTLs of the leases it puts keys with.
    fn ttls(&self) -> impl Iterator<Item = i64> + '_ {
        self.ops.iter().filter_map(|op| match op {
            PlanOp::PutLeased(_, _, ttl) => Some(*ttl),
            _ => None,
        })
    }

    /// The nested transaction, with `leases` (TTL → granted lease id).
    fn into_txn(self, leases: &HashMap<i64, i64>) -> Result<Txn, String> {
        let ops = self
            .ops
            .into_iter()
            .map(|op| match op {
                PlanOp::Put(key, value) => Ok(TxnOp::put(key, value, None)),
                PlanOp::PutLeased(key, value, ttl) => match leases.get(&ttl) {
                    Some(id) => Ok(TxnOp::put(
                        key,
                        value,
                        Some(PutOptions::new().with_lease(*id)),
                    )),
                    None => Err(format!("no lease of {ttl} s was granted for {key}")),
                },
                PlanOp::Delete(key) => Ok(TxnOp::delete(key, None)),
            })
            .collect::<Result<Vec<TxnOp>, String>>()?;
        Ok(Txn::new().when(self.when).and_then(ops))
    }
}

/// etcd's half of the compare-and-set loop ([`cas::Cas`]): one batch's
/// jobs, read and written on one client.
struct EtcdCas<'a> {
    store: &'a EtcdStore,
    client: &'a etcd::Client,
    want: Want,
}

impl cas::Cas for EtcdCas<'_> {
    type View = JobView;
    type Write = Plan;

    /// Each plan is a nested transaction of its own: the ones whose
    /// compares failed are the ones not applied.
    async fn write(&self, writes: Vec<(usize, Plan)>) -> Result<Vec<usize>, StoreError> {
        self.store.write(self.client, writes).await
    }

    async fn reread(&self, jobs: &[&str]) -> Result<Vec<JobView>, StoreError> {
        self.store.view(self.client, jobs, self.want).await
    }

    fn store(&self) -> String {
        self.store.url.redacted().into()
    }
}

impl EtcdStore {
    /// Connections are made on first use.
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        let StoreKind::Etcd(target) = config.url.kind() else {
            return Err(StoreError::Backend {
                store: config.url.redacted().into(),
                reason: "not an etcd:// or etcds:// URL".into(),
            });
        };
        Ok(EtcdStore {
            target: target.clone(),
            url: config.url.clone(),
            tls: config.tls.clone(),
            prefix: config.key_prefix.clone(),
            op_timeout: config.op_timeout,
            client: tokio::sync::Mutex::new(None),
            endpoint: std::sync::atomic::AtomicUsize::new(0),
            moved_at: std::sync::Mutex::new(None),
            releases: Arc::new(Releases::default()),
            clocks: Arc::new(PeerClocks::default()),
            beat_lease: std::sync::Mutex::new(None),
        })
    }

    fn lock_key(&self, job: &str) -> String {
        format!("{}lock/{job}", self.prefix)
    }

    fn lease_key(&self, job: &str) -> String {
        format!("{}lease/{job}", self.prefix)
    }

    /// The registry's key of `owner` (`""`: the registry's prefix).
    fn node_key(&self, owner: &str) -> String {
        format!("{}node/{owner}", self.prefix)
    }

    fn triggers_root(&self) -> String {
        format!("{}trigger/", self.prefix)
    }

    /// A pending request's key: `{p}trigger/<job>~<id>`.
    fn trigger_key(&self, job: &str, id: TriggerId) -> String {
        format!("{}{}", self.triggers_root(), trigger_entry(job, id))
    }

    fn runs_root(&self) -> String {
        format!("{}runs/", self.prefix)
    }

    fn runs_prefix(&self, job: &str) -> String {
        format!("{}{job}/", self.runs_root())
    }

    /// A run's key: the fence zero-padded to 20 digits, so keys sort by fence.
    fn run_key(&self, job: &str, fence: u64) -> String {
        format!("{}{fence:020}", self.runs_prefix(job))
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

    /// Each chunk as one transaction without compares, all sent together:
    /// every operation's answer, in order.
    async fn send(
        &self,
        client: &etcd::Client,
        chunks: Vec<Vec<TxnOp>>,
    ) -> Result<Vec<TxnOpResponse>, StoreError> {
        let expected: usize = chunks.iter().map(Vec::len).sum();
        let sends = chunks.into_iter().map(|ops| {
            let mut kv = client.kv_client();
            async move { self.timed(kv.txn(Txn::new().and_then(ops))).await }
        });
        let answers: Vec<TxnResponse> = try_join_all(sends).await?;
        let responses: Vec<TxnOpResponse> =
            answers.iter().flat_map(TxnResponse::op_responses).collect();
        if responses.len() != expected {
            return Err(self.backend(format!(
                "{} answers to {expected} operations",
                responses.len()
            )));
        }
        Ok(responses)
    }

    /// `ops` as transactions of at most [`MAX_TXN_OPS`], sent together.
    async fn batch(
        &self,
        client: &etcd::Client,
        ops: Vec<TxnOp>,
    ) -> Result<Vec<TxnOpResponse>, StoreError> {
        self.send(client, chunked(ops, MAX_TXN_OPS)).await
    }

    /// `keys` as they are now, one get each (keys of one job stay in one
    /// transaction when a job has one or two: 128 is even).
    async fn read_keys(
        &self,
        client: &etcd::Client,
        keys: &[String],
    ) -> Result<Vec<Option<Entry>>, StoreError> {
        self.read_keys_with(client, keys, Vec::new())
            .await
            .map(|(entries, _)| entries)
    }

    /// [`EtcdStore::read_keys`] with `extra` operations after the reads, in
    /// the last transaction; their answers come back apart.
    async fn read_keys_with(
        &self,
        client: &etcd::Client,
        keys: &[String],
        extra: Vec<TxnOp>,
    ) -> Result<(Vec<Option<Entry>>, Vec<TxnOpResponse>), StoreError> {
        let extras = extra.len();
        let ops = keys
            .iter()
            .map(|k| TxnOp::get(k.as_str(), None))
            .chain(extra)
            .collect();
        let mut answers = self.batch(client, ops).await?;
        let extra = answers.split_off(answers.len().saturating_sub(extras));
        let entries = answers
            .iter()
            .map(|answer| match answer {
                TxnOpResponse::Get(got) => Ok(got.kvs().first().map(Entry::of)),
                _ => Err(self.backend("a read answered with something other than its key")),
            })
            .collect::<Result<_, _>>()?;
        Ok((entries, extra))
    }

    /// Every key under `prefix` (keys only, in key order), page by page.
    async fn keys_under(
        &self,
        client: &etcd::Client,
        prefix: &str,
    ) -> Result<Vec<String>, StoreError> {
        let end = prefix_end(prefix.as_bytes());
        let mut from = prefix.as_bytes().to_vec();
        let mut keys = Vec::new();
        let mut kv = client.kv_client();
        loop {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_keys_only()
                .with_limit(KEYS_PAGE);
            let page = self.timed(kv.get(from.clone(), Some(options))).await?;
            let mut last = None;
            for item in page.kvs() {
                last = Some(item.key().to_vec());
                if let Ok(key) = String::from_utf8(item.key().to_vec()) {
                    keys.push(key);
                }
            }
            match last {
                Some(mut next) if page.more() => {
                    next.push(0);
                    from = next;
                }
                _ => return Ok(keys),
            }
        }
    }

    /// One fresh lease per distinct TTL of `ttls`: TTL → lease id. A lease
    /// left unused (its claim lost) just expires.
    async fn grant(
        &self,
        client: &etcd::Client,
        mut ttls: Vec<i64>,
    ) -> Result<HashMap<i64, i64>, StoreError> {
        ttls.sort_unstable();
        ttls.dedup();
        let grants = ttls.into_iter().map(|ttl| {
            let mut leases = client.lease_client();
            async move {
                let granted = self.timed(leases.grant(ttl, None)).await?;
                if !granted.error().is_empty() {
                    return Err(self.backend(format!(
                        "etcd refused a lease of {ttl} s: {}",
                        granted.error()
                    )));
                }
                Ok::<(i64, i64), StoreError>((ttl, granted.id()))
            }
        });
        Ok(try_join_all(grants).await?.into_iter().collect())
    }

    /// Every job's keys (and, for claims, the time left on its lease).
    async fn view(
        &self,
        client: &etcd::Client,
        jobs: &[&str],
        want: Want,
    ) -> Result<Vec<JobView>, StoreError> {
        self.view_with(client, jobs, want, Vec::new())
            .await
            .map(|(views, _)| views)
    }

    /// [`EtcdStore::view`] with `extra` operations in its last transaction
    /// ([`EtcdStore::read_keys_with`]).
    async fn view_with(
        &self,
        client: &etcd::Client,
        jobs: &[&str],
        want: Want,
        extra: Vec<TxnOp>,
    ) -> Result<(Vec<JobView>, Vec<TxnOpResponse>), StoreError> {
        let mut keys = Vec::with_capacity(jobs.len() * 2);
        for job in jobs {
            if want == Want::LockAndLease {
                keys.push(self.lock_key(job));
            }
            keys.push(self.lease_key(job));
        }
        let (entries, extra) = self.read_keys_with(client, &keys, extra).await?;
        let mut entries = entries.into_iter();
        let mut read = Vec::with_capacity(jobs.len());
        for _ in jobs {
            let lock = if want == Want::LockAndLease {
                entries.next().flatten()
            } else {
                None
            };
            let lease = entries.next().flatten();
            read.push(JobKeys { lock, lease });
        }
        let now = now_ms();
        let views = read.into_iter().map(|keys| JobView { keys, now }).collect();
        Ok((views, extra))
    }

    /// Applies each plan as a nested transaction, after granting the leases
    /// they put keys with. Nested transactions go in transactions with no
    /// compares of their own, as many as [`MAX_TXN_OPS`] allows, sent
    /// together; two plans for the same key go in different ones (etcd
    /// refuses a transaction that writes a key twice). Answers the indexes
    /// of the plans whose compares failed: their keys changed since read.
    async fn write(
        &self,
        client: &etcd::Client,
        plans: Vec<(usize, Plan)>,
    ) -> Result<Vec<usize>, StoreError> {
        if plans.is_empty() {
            return Ok(Vec::new());
        }
        let ttls = plans.iter().flat_map(|(_, p)| p.ttls()).collect();
        let leases = self.grant(client, ttls).await?;
        let widest = plans.iter().map(|(_, p)| p.width()).max().unwrap_or(1);
        // Wave k holds the k-th plan of each key.
        let mut waves: Vec<Vec<(usize, TxnOp)>> = Vec::new();
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, plan) in plans {
            let count = seen.entry(plan.ident().to_string()).or_insert(0);
            let wave = *count;
            *count += 1;
            let item = (
                i,
                TxnOp::txn(plan.into_txn(&leases).map_err(|m| self.backend(m))?),
            );
            match waves.get_mut(wave) {
                Some(w) => w.push(item),
                None => waves.push(vec![item]),
            }
        }
        let mut order = Vec::new();
        let mut chunks = Vec::new();
        for wave in waves {
            for chunk in chunked(wave, nested_per_txn(widest)) {
                let (idx, ops): (Vec<usize>, Vec<TxnOp>) = chunk.into_iter().unzip();
                order.extend(idx);
                chunks.push(ops);
            }
        }
        let answers = self.send(client, chunks).await?;
        let mut changed = Vec::new();
        for (i, answer) in order.into_iter().zip(answers) {
            match answer {
                TxnOpResponse::Txn(t) if t.succeeded() => {}
                TxnOpResponse::Txn(_) => changed.push(i),
                _ => {
                    return Err(self.backend(
                        "a nested transaction answered with something other than a transaction",
                    ));
                }
            }
        }
        Ok(changed)
    }

    /// Reads, decides with `decide_one` and writes until every job's write
    /// went through or none is left to write: a job whose keys changed
    /// between read and write is read and decided again, within
    /// `op_timeout`. `decide_one(i, view)` answers the write wanted, if any,
    /// and the answer. Returns this host's clock at the first read.
    async fn read_decide_write<A>(
        &self,
        client: &etcd::Client,
        jobs: &[&str],
        want: Want,
        decide_one: impl FnMut(usize, &JobView) -> (Option<Plan>, A),
    ) -> Result<(i64, Vec<A>), StoreError> {
        self.read_decide_write_with(client, jobs, want, Vec::new(), decide_one)
            .await
            .map(|(now, answers, _)| (now, answers))
    }

    /// [`EtcdStore::read_decide_write`] with `extra` operations in the
    /// first read's last transaction; their answers come back too. The loop
    /// is [`cas::decide_and_write`]'s; this store brings its reads and
    /// transactions ([`EtcdCas`]).
    async fn read_decide_write_with<A>(
        &self,
        client: &etcd::Client,
        jobs: &[&str],
        want: Want,
        extra: Vec<TxnOp>,
        decide_one: impl FnMut(usize, &JobView) -> (Option<Plan>, A),
    ) -> Result<(i64, Vec<A>, Vec<TxnOpResponse>), StoreError> {
        let deadline = tokio::time::Instant::now() + self.op_timeout;
        let (views, extra) = self.view_with(client, jobs, want, extra).await?;
        let now = views.first().map_or_else(now_ms, |v| v.now);
        let transport = EtcdCas {
            store: self,
            client,
            want,
        };
        let answers = cas::decide_and_write(
            &transport,
            jobs,
            &views,
            deadline,
            self.op_timeout,
            decide_one,
        )
        .await?;
        Ok((now, answers, extra))
    }

    /// One claim decided on its job's keys: the write it wants, if any.
    fn decide_claim(&self, req: &ClaimRequest, view: &JobView) -> (Option<Plan>, ClaimOutcome) {
        let job = req.job.as_str();
        let state = match read_state(view.keys.lock.as_ref()) {
            Ok(state) => state,
            Err(why) => {
                return (
                    None,
                    ClaimOutcome::Failed(format!(
                        "the lock key {} of job {job} is unreadable ({why}); delete it (etcdctl del) to start the job afresh",
                        self.lock_key(job)
                    )),
                );
            }
        };
        if view.keys.lease.as_ref().is_some_and(|e| e.lease == 0) {
            return (
                None,
                ClaimOutcome::Failed(format!(
                    "the lease key {} of job {job} has no etcd lease, so it never ends (written by hand?); delete it (etcdctl del) to free the job",
                    self.lease_key(job)
                )),
            );
        }
        let row = row_of(state.as_ref(), view);
        // etcd decides on this node's clock; whether the occurrence is due
        // is judged on the median of the live nodes' clocks, and not before
        // that median is known (docs/protocol.md, "Clock offset").
        let now = now_ms();
        let due_by = self
            .median_now_ms()
            .saturating_add(super::duration_ms(req.max_offset));
        let scheduled = req.manual.is_none();
        if scheduled
            && !req.recheck_only
            && (to_ms(req.occurrence) > due_by || self.clocks.unsettled(now))
        {
            return (
                None,
                ClaimOutcome::Lost(super::Lost {
                    holder: None,
                    remaining: Duration::ZERO,
                    last_occurrence: row.last_occurrence.map(from_ms),
                    fence: row.fence.max(0) as u64,
                    too_early: true,
                    idle_wait: None,
                    paused: false,
                    trigger_gone: false,
                    stale: false,
                }),
            );
        }
        match decide(&row, req) {
            // A recheck answers an earlier win as it stands.
            Decision::Claim { won, .. } if req.recheck_only => (None, ClaimOutcome::Won(won)),
            Decision::Claim {
                fence,
                expires_at,
                last_occurrence,
                manual,
                won,
            } => {
                let state = LockState {
                    owner: req.owner.as_str().to_string(),
                    marks: JobMarks::claimed(
                        state.as_ref().map(|(s, _)| &s.marks),
                        fence,
                        last_occurrence,
                        manual,
                        view.now,
                    ),
                };
                let lease = LeaseValue {
                    owner: req.owner.as_str().to_string(),
                    expires_at,
                };
                match serde_json::to_vec(&state).and_then(|s| Ok((s, serde_json::to_vec(&lease)?)))
                {
                    Ok((json, lease_json)) => {
                        let (lock, lease) = (self.lock_key(job), self.lease_key(job));
                        let mut plan = Plan {
                            when: vec![
                                unchanged(&lock, view.keys.lock.as_ref()),
                                unchanged(&lease, view.keys.lease.as_ref()),
                            ],
                            ops: vec![
                                PlanOp::Put(lock, json),
                                PlanOp::PutLeased(lease, lease_json, lease_ttl_secs(req.lease)),
                            ],
                        };
                        if let Some(id) = manual {
                            plan.ops.push(PlanOp::Delete(self.trigger_key(job, id)));
                        }
                        (Some(plan), ClaimOutcome::Won(won))
                    }
                    Err(e) => (None, ClaimOutcome::Failed(e.to_string())),
                }
            }
            Decision::Refuse(lost) => (None, ClaimOutcome::Lost(lost)),
            Decision::FenceExhausted => (None, ClaimOutcome::Failed(fence_exhausted(job))),
        }
    }

    /// Deletes each job's oldest runs beyond `keep`: a count of each job's
    /// runs, then the keys of the surplus only (oldest first, at most
    /// [`TRIM_PAGE`] per job and call, so an answer stays small whatever
    /// `keep` is; a larger surplus, after `history_limit` was lowered, goes
    /// over the next writes), then one range delete per job up to its newest
    /// surplus key.
    async fn trim(
        &self,
        client: &etcd::Client,
        jobs: &[&str],
        keep: u32,
    ) -> Result<(), StoreError> {
        let keep = i64::from(keep.max(1));
        let counts = jobs
            .iter()
            .map(|job| {
                let options = GetOptions::new().with_prefix().with_count_only();
                TxnOp::get(self.runs_prefix(job), Some(options))
            })
            .collect();
        let answers = self.batch(client, counts).await?;
        let mut over = Vec::new();
        for (job, answer) in jobs.iter().zip(&answers) {
            let TxnOpResponse::Get(got) = answer else {
                return Err(self.backend("a count answered with something other than a count"));
            };
            if got.count() > keep {
                over.push((*job, (got.count() - keep).min(TRIM_PAGE)));
            }
        }
        if over.is_empty() {
            return Ok(());
        }
        let oldest = over
            .iter()
            .map(|(job, surplus)| {
                let options = GetOptions::new()
                    .with_prefix()
                    .with_keys_only()
                    .with_sort(SortTarget::Key, SortOrder::Ascend)
                    .with_limit(*surplus);
                TxnOp::get(self.runs_prefix(job), Some(options))
            })
            .collect();
        let answers = self.batch(client, oldest).await?;
        let mut deletes = Vec::new();
        for ((job, _), answer) in over.iter().zip(&answers) {
            let TxnOpResponse::Get(got) = answer else {
                return Err(self.backend("a read answered with something other than its keys"));
            };
            if let Some(newest_surplus) = got.kvs().last() {
                // The range ends just after that key.
                let mut end = newest_surplus.key().to_vec();
                end.push(0);
                let below = DeleteOptions::new().with_range(end);
                deletes.push(TxnOp::delete(self.runs_prefix(job), Some(below)));
            }
        }
        if !deletes.is_empty() {
            self.batch(client, deletes).await?;
        }
        Ok(())
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
            self.lease_key(""),
            self.url.clone(),
        )));
    }

    /// Starts the watch on the registry unless it runs: every heartbeat
    /// it delivers is a reading of its sender's clock ([`PeerClocks`]).
    fn watch_clocks(&self, client: &etcd::Client) {
        let mut slot = lock(&self.clocks.watch);
        if slot.as_ref().is_some_and(|w| !w.is_finished()) {
            return;
        }
        *slot = Some(tokio::spawn(read_clocks(
            Arc::downgrade(&self.clocks),
            client.clone(),
            self.node_key(""),
            self.url.clone(),
        )));
    }

    /// The clock this node is measured against: the live nodes' median.
    fn median_now_ms(&self) -> i64 {
        let now = now_ms();
        now.saturating_add(self.clocks.median_ms(now))
    }
}

/// Reads every heartbeat put under `prefix` as a reading of its sender's
/// clock, and drops a leaving node's; watches again when the watch breaks
/// (after 1 s, doubling to 30 s), for as long as the store lasts. Without
/// the watch a node is measured against its own clock, as before it had
/// peers.
async fn read_clocks(
    clocks: Weak<PeerClocks>,
    client: etcd::Client,
    prefix: String,
    url: StoreUrl,
) {
    let options = WatchOptions::new().with_range(prefix_end(prefix.as_bytes()));
    let mut pause = Duration::from_secs(1);
    loop {
        let mut watch = client.watch_client();
        match watch.watch(prefix.as_str(), Some(options.clone())).await {
            Err(e) => {
                tracing::debug!(store = %url.redacted(), "cannot watch the node registry: {}", one_line(&url.scrub(&e.to_string())));
                pause = (pause * 2).min(Duration::from_secs(30));
            }
            Ok(mut stream) => {
                pause = Duration::from_secs(1);
                while let Ok(Some(answer)) = stream.message().await {
                    let received = now_ms();
                    let Some(clocks) = clocks.upgrade() else {
                        return;
                    };
                    if answer.canceled() {
                        break;
                    }
                    for event in answer.events() {
                        let Some(kv) = event.kv() else {
                            continue;
                        };
                        let Some(owner) = owner_of(kv, &prefix) else {
                            continue;
                        };
                        if matches!(event.event_type(), EventType::Delete) {
                            clocks.forget(owner);
                            continue;
                        }
                        if let Some(data) = BeatData::parse(kv.value()) {
                            if let Some(sent) = data.last_seen {
                                clocks.observe(owner, sent, received, data.ttl_ms);
                            }
                        }
                    }
                }
            }
        }
        if clocks.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(pause).await;
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

/// The compare that holds while `key` is as it was read: changed last at
/// the same revision, or still absent.
fn unchanged(key: &str, read: Option<&Entry>) -> Compare {
    match read {
        Some(e) => Compare::mod_revision(key, CompareOp::Equal, e.mod_revision),
        None => Compare::create_revision(key, CompareOp::Equal, 0),
    }
}

/// A job's state (with its fence as a number) when its key exists; `Err`
/// saying why when it cannot be read.
fn read_state(entry: Option<&Entry>) -> Result<Option<(LockState, i64)>, String> {
    let Some(entry) = entry else {
        return Ok(None);
    };
    let state: LockState = serde_json::from_slice(&entry.value).map_err(|e| e.to_string())?;
    let fence = state.marks.fence().ok_or_else(|| {
        format!(
            "its fence {:?} is not a number from 0 to 2^63 - 1",
            state.marks.fence
        )
    })?;
    Ok(Some((state, fence)))
}

/// The shared claim rule's view of a job: held while its lease key exists,
/// until the end it records, by the key's owner; otherwise free, the last
/// owner from the state.
fn row_of(state: Option<&(LockState, i64)>, view: &JobView) -> LockRow {
    let now = view.now;
    let (owner, expires_at) = match &view.keys.lease {
        Some(e) => {
            let lease = read_lease(e, now);
            (Some(lease.owner), lease.expires_at)
        }
        // A state made by `pause` before any claim names no owner.
        None => (
            state
                .map(|(s, _)| s.owner.clone())
                .filter(|o| !o.is_empty()),
            0,
        ),
    };
    JobMarks::row(state.map(|(s, _)| &s.marks), owner, expires_at, now)
}

/// The client URLs of the cluster's members.
fn endpoints(target: &EtcdTarget) -> Vec<String> {
    let scheme = if target.tls { "https" } else { "http" };
    target
        .servers
        .iter()
        .map(|(host, port)| {
            if host.contains(':') {
                format!("{scheme}://[{host}]:{port}")
            } else {
                format!("{scheme}://{host}:{port}")
            }
        })
        .collect()
}

/// `items` in chunks of at most `size` (at least 1), in order.
fn chunked<T>(items: Vec<T>, size: usize) -> Vec<Vec<T>> {
    let size = size.max(1);
    let mut chunks = Vec::with_capacity(items.len().div_ceil(size));
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        chunks.push(items.by_ref().take(size).collect());
    }
    chunks
}

/// Nested transactions per transaction when each is `width` operations
/// wide: the parent's own count plus a child's must stay within
/// [`MAX_TXN_OPS`].
fn nested_per_txn(width: usize) -> usize {
    MAX_TXN_OPS.saturating_sub(width).max(1)
}

/// The first key after every key that starts with `prefix` (etcd's range
/// end for a prefix).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    for (i, byte) in prefix.iter().enumerate().rev() {
        if *byte < 0xff {
            let mut end = prefix[..=i].to_vec();
            end[i] = byte + 1;
            return end;
        }
    }
    // No key follows them all: to the end of the key space.
    vec![0]
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
    /// Nothing to create: checks that the cluster answers, is recent
    /// enough, and lets this user read.
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
        self.ping().await
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
        let key = self.lease_key(job.as_str());
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
                let key = self.lease_key(jobs[i]);
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
                        let key = self.lease_key(names[i]);
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
                        self.lock_key(names[i]),
                        names[i]
                    ));
                    return (None, ());
                }
            };
            match serde_json::to_vec(&state) {
                Ok(json) => {
                    let key = self.lock_key(names[i]);
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
                                self.lock_key(name)
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
                        let (lock, lease) = (self.lock_key(name), self.lease_key(name));
                        let plan = Plan {
                            when: vec![
                                unchanged(&lock, view.keys.lock.as_ref()),
                                unchanged(&lease, view.keys.lease.as_ref()),
                            ],
                            ops: vec![
                                PlanOp::Put(lock, json),
                                PlanOp::Put(self.trigger_key(name, id), Vec::new()),
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
                        let lock = self.lock_key(name);
                        let plan = Plan {
                            when: vec![unchanged(&lock, view.keys.lock.as_ref())],
                            ops: vec![
                                PlanOp::Put(lock, json),
                                PlanOp::Delete(self.trigger_key(name, id)),
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

    async fn pending_triggers(&self) -> Result<Vec<(String, TriggerId)>, StoreError> {
        let client = self.client().await?;
        let root = self.triggers_root();
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
        self.timed(kv.get(self.lock_key(""), Some(options)))
            .await
            .map(|_| ())
    }

    async fn status(&self) -> Result<Vec<LockStatus>, StoreError> {
        let client = self.client().await?;
        let (lock_prefix, lease_prefix) = (self.lock_key(""), self.lease_key(""));
        // Both ranges in one transaction: one revision.
        let reads = vec![
            TxnOp::get(lock_prefix.as_str(), Some(GetOptions::new().with_prefix())),
            TxnOp::get(lease_prefix.as_str(), Some(GetOptions::new().with_prefix())),
        ];
        let answers = self.batch(&client, reads).await?;
        let [TxnOpResponse::Get(locks), TxnOpResponse::Get(leases)] = answers.as_slice() else {
            return Err(self.backend("the status read answered with something other than its keys"));
        };
        let now = now_ms();
        let holders: HashMap<Vec<u8>, LeaseValue> = leases
            .kvs()
            .iter()
            .filter_map(|kv| {
                let job = kv.key().strip_prefix(lease_prefix.as_bytes())?;
                let lease = read_lease(&Entry::of(kv), now);
                (lease.expires_at > now).then(|| (job.to_vec(), lease))
            })
            .collect();
        let mut out = Vec::new();
        for kv in locks.kvs() {
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
}

impl EtcdStore {
    /// Clears the running mark of each lock whose last claim's run is among
    /// `runs` (recorded already), compared on the state's revision as read:
    /// a lock claimed again meanwhile has a new mark of its own.
    async fn end_running_marks(
        &self,
        client: &etcd::Client,
        runs: &[RunRecord],
    ) -> Result<(), StoreError> {
        let ended: Vec<&RunRecord> = runs.iter().filter(|r| super::ends_a_run(r)).collect();
        let keys: Vec<String> = ended.iter().map(|r| self.lock_key(&r.job)).collect();
        let read = self.read_keys(client, &keys).await?;
        let mut plans = Vec::new();
        let mut planned = HashSet::new();
        for (i, ((run, key), entry)) in ended.iter().zip(&keys).zip(&read).enumerate() {
            let Ok(Some((mut state, fence))) = read_state(entry.as_ref()) else {
                continue;
            };
            if !state.marks.running || !super::clears_running(run, fence) || !planned.insert(key) {
                continue;
            }
            state.marks.running = false;
            let Ok(value) = serde_json::to_vec(&state) else {
                continue;
            };
            plans.push((
                i,
                Plan {
                    when: vec![unchanged(key, entry.as_ref())],
                    ops: vec![PlanOp::Put(key.clone(), value)],
                },
            ));
        }
        self.write(client, plans).await.map(|_| ())
    }
}

impl EtcdStore {
    /// A claim of a non-empty batch; with `beat` (and the etcd lease its
    /// record is put with), the heartbeat's put and the registry's read
    /// ride in the claim's first transaction.
    async fn claim_with(
        &self,
        requests: &[ClaimRequest],
        beat: Option<(&Heartbeat, i64)>,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        let client = self.client().await?;
        let jobs: Vec<&str> = requests.iter().map(|r| r.job.as_str()).collect();
        let (extra, sent) = match beat {
            Some((beat, lease)) => {
                let (ops, sent) = self.beat_ops(&client, beat, lease);
                (ops, Some((beat, sent)))
            }
            None => (Vec::new(), None),
        };
        let (now, outcomes, extra) = self
            .read_decide_write_with(&client, &jobs, Want::LockAndLease, extra, |i, view| {
                self.decide_claim(&requests[i], view)
            })
            .await?;
        let nodes = match (sent, extra.as_slice()) {
            (Some((beat, sent)), [_, TxnOpResponse::Get(read)]) => {
                Some(self.beat_answered(beat, read, sent))
            }
            _ => None,
        };
        // A request found gone (its state no longer names it: a hand edit)
        // leaves its key behind: it goes, best effort.
        let stale: Vec<TxnOp> = requests
            .iter()
            .zip(&outcomes)
            .filter_map(|(req, outcome)| match (req.manual, outcome) {
                (Some(id), ClaimOutcome::Lost(lost)) if lost.trigger_gone => {
                    Some(TxnOp::delete(self.trigger_key(req.job.as_str(), id), None))
                }
                _ => None,
            })
            .collect();
        if !stale.is_empty() {
            let mut kv = client.kv_client();
            let _ = self.timed(kv.txn(Txn::new().and_then(stale))).await;
        }
        // Leases are counted on this host's clock (`now`); the clock it is
        // measured against is the live nodes' median.
        let now = now.saturating_add(self.median_now_ms() - now_ms());
        let claimed = Claimed {
            store_now: from_ms(now),
            outcomes,
        };
        Ok((claimed, nodes))
    }

    /// A heartbeat's operations: its record put with `lease`, and the read
    /// of every record. Returns them with the time it says it was sent.
    fn beat_ops(&self, client: &etcd::Client, beat: &Heartbeat, lease: i64) -> (Vec<TxnOp>, i64) {
        let mut data = BeatData::from(beat);
        let now = now_ms();
        data.last_seen = Some(now);
        let prefix = self.node_key("");
        let ops = vec![
            TxnOp::put(
                self.node_key(beat.owner.as_str()),
                data.to_json(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::get(prefix.as_str(), Some(GetOptions::new().with_prefix())),
        ];
        *lock(&self.clocks.me) = Some(beat.owner.to_string());
        self.watch_clocks(client);
        (ops, now)
    }

    /// The live records a heartbeat sent at `sent` read back; the peers'
    /// clocks are expected from them.
    fn beat_answered(&self, beat: &Heartbeat, read: &GetResponse, sent: i64) -> Vec<NodeRecord> {
        let prefix = self.node_key("");
        let live = live_records(read.kvs(), &prefix, sent);
        // Every other record's clock is waited for, not only those live by
        // this node's clock: a node whose clock ran ahead saw its peers'
        // records as expired, waited for none and judged its first claim
        // on its own clock alone, running it early (a node 5 s ahead, in
        // about one run in five of
        // `clock::etcd_measures_each_node_against_the_median_of_the_live_clocks`).
        // A dead node's key stays until its etcd lease ends, a minute after
        // its last beat; its reading is waited for one record's life at most.
        let others: HashSet<String> = read
            .kvs()
            .iter()
            .filter_map(|kv| {
                let owner = owner_of(kv, &prefix)?;
                (owner != beat.owner.as_str()).then(|| owner.to_string())
            })
            .collect();
        self.clocks
            .expect(others, sent, BeatData::from(beat).ttl_ms);
        live
    }

    /// The heartbeat's etcd lease while a heartbeat may still use it.
    fn usable_beat_lease(&self) -> Option<i64> {
        let lease = *lock(&self.beat_lease);
        lease
            .filter(|(_, until)| tokio::time::Instant::now() < *until)
            .map(|(id, _)| id)
    }
}

/// The live records among a range read of the registry, by this host's
/// clock (etcd has none): a record is live while its key exists (its etcd
/// lease did not run out) and its recorded end is ahead of `now`.
/// The owner a registry key under `prefix` names.
fn owner_of<'a>(kv: &'a KeyValue, prefix: &str) -> Option<&'a str> {
    std::str::from_utf8(kv.key().strip_prefix(prefix.as_bytes())?).ok()
}

fn live_records(kvs: &[KeyValue], prefix: &str, now: i64) -> Vec<NodeRecord> {
    registry::sorted(
        kvs.iter()
            .filter_map(|kv| {
                let owner = owner_of(kv, prefix)?;
                let data = BeatData::parse(kv.value())?;
                let seen = data.last_seen?;
                let ends = seen.saturating_add(data.ttl_ms);
                (ends > now).then(|| data.record(owner, seen, ends, now))
            })
            .collect(),
    )
}

#[async_trait]
impl Registry for EtcdStore {
    /// The record is put with a new etcd lease of its time to live plus
    /// [`BEAT_LEASE_SPARE`] (whole seconds), so a dead node's key goes away
    /// by itself; the heartbeats inside claims reuse that lease for the
    /// spare's length. The read of every record rides in the same
    /// transaction.
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        let client = self.client().await?;
        let id = match self.usable_beat_lease() {
            Some(id) => id,
            None => {
                let ttl = lease_ttl_secs(beat.ttl + BEAT_LEASE_SPARE);
                let granted_at = tokio::time::Instant::now();
                let leases = self.grant(&client, vec![ttl]).await?;
                let id = leases
                    .get(&ttl)
                    .copied()
                    .ok_or_else(|| self.backend("etcd granted no lease for a heartbeat"))?;
                *lock(&self.beat_lease) = Some((id, granted_at + BEAT_LEASE_SPARE));
                id
            }
        };
        let (ops, sent) = self.beat_ops(&client, beat, id);
        let answers = match self.batch(&client, ops).await {
            Ok(answers) => answers,
            Err(e) => {
                // Perhaps etcd no longer has the lease: the next beat
                // grants another.
                *lock(&self.beat_lease) = None;
                return Err(e);
            }
        };
        let [_, TxnOpResponse::Get(read)] = answers.as_slice() else {
            return Err(self.backend("a heartbeat answered with something other than its keys"));
        };
        Ok(self.beat_answered(beat, read, sent))
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let client = self.client().await?;
        let prefix = self.node_key("");
        let mut kv = client.kv_client();
        let read = self
            .timed(kv.get(prefix.as_str(), Some(GetOptions::new().with_prefix())))
            .await?;
        Ok(live_records(read.kvs(), &prefix, now_ms()))
    }

    async fn leave(&self, owner: &Owner) -> Result<(), StoreError> {
        let client = self.client().await?;
        let mut kv = client.kv_client();
        self.timed(kv.delete(self.node_key(owner.as_str()), None))
            .await
            .map(|_| ())
    }

    /// The heartbeat's put and the registry's read ride in the claim's
    /// first transaction, with the etcd lease of an earlier heartbeat. With
    /// none usable (the node's first beat, then once a
    /// [`BEAT_LEASE_SPARE`]), the heartbeat goes alongside the claim
    /// ([`registry::claim_alongside`]) and grants a new one. A claim that
    /// fails with the beat in it drops the lease, in case etcd no longer
    /// has it; one that failed because etcd has not got it (revoked, or a
    /// restore) was refused whole in its first transaction, before any
    /// write, and is sent again with the beat beside it.
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        let usable = self.usable_beat_lease().filter(|_| !requests.is_empty());
        let Some(lease) = usable else {
            return registry::claim_alongside(self, requests, beat).await;
        };
        let claimed = self.claim_with(requests, Some((beat, lease))).await;
        match &claimed {
            Err(e) if e.to_string().contains("lease not found") => {
                *lock(&self.beat_lease) = None;
                registry::claim_alongside(self, requests, beat).await
            }
            Err(_) => {
                *lock(&self.beat_lease) = None;
                claimed
            }
            Ok(_) => claimed,
        }
    }
}

#[async_trait]
impl History for EtcdStore {
    async fn record_runs(&self, runs: &[RunRecord], keep: u32) -> Result<(), StoreError> {
        if runs.is_empty() {
            return Ok(());
        }
        let client = self.client().await?;
        let mut seen = HashSet::new();
        let mut plans = Vec::with_capacity(runs.len());
        let mut sizes = Vec::with_capacity(runs.len());
        for (i, run) in runs.iter().enumerate() {
            let key = self.run_key(&run.job, run.fence);
            // One write per (job, fence): etcd refuses a transaction that
            // writes a key twice.
            if !seen.insert(key.clone()) {
                continue;
            }
            let data =
                serde_json::to_vec(&RunData::from(run)).map_err(|e| self.backend(e.to_string()))?;
            sizes.push(data.len());
            let plan = Plan {
                when: vec![Compare::create_revision(key.as_str(), CompareOp::Equal, 0)],
                ops: vec![PlanOp::Put(key, data)],
            };
            plans.push((i, plan));
        }
        // A fence recorded already fails its compare and stays as it was.
        // Split by size: a transaction stays below etcd's request limit
        // (1.5 MiB by default) whatever the output tails (JSON escapes a
        // control byte in six).
        let mut size = 0;
        let mut group = Vec::new();
        for ((i, plan), len) in plans.into_iter().zip(sizes) {
            if !group.is_empty() && size + len > OUTPUT_PER_WRITE {
                self.write(&client, std::mem::take(&mut group)).await?;
                size = 0;
            }
            size += len;
            group.push((i, plan));
        }
        self.write(&client, group).await?;
        self.end_running_marks(&client, runs).await?;
        let mut jobs: Vec<&str> = runs.iter().map(|r| r.job.as_str()).collect();
        jobs.sort_unstable();
        jobs.dedup();
        self.trim(&client, &jobs, keep.max(1)).await
    }

    /// The newest `limit` runs (by fence) of each job read, then ordered
    /// as every store answers. An entry this version cannot read shows at
    /// the epoch: etcd keeps no time with a key.
    async fn history(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let client = self.client().await?;
        let root = self.runs_root();
        let under = match job {
            Some(j) => self.runs_prefix(j.as_str()),
            None => root.clone(),
        };
        let keys = self.keys_under(&client, &under).await?;
        // Keys come in key order: per job, by fence.
        let mut by_job: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for key in &keys {
            if let Some((job, name)) = key
                .strip_prefix(root.as_str())
                .and_then(|rest| rest.split_once('/'))
            {
                by_job.entry(job).or_default().push(name);
            }
        }
        let mut wanted: Vec<(String, String)> = Vec::new();
        for (job, names) in by_job {
            let skip = names.len().saturating_sub(limit as usize);
            for name in &names[skip..] {
                wanted.push((job.to_string(), (*name).to_string()));
            }
        }
        let run_keys: Vec<String> = wanted
            .iter()
            .map(|(job, name)| format!("{root}{job}/{name}"))
            .collect();
        // A few runs per transaction: an answer of 128 runs with the
        // largest output tails would pass the client's 4 MiB message limit.
        let reads = run_keys
            .chunks(RUNS_PER_READ)
            .map(|keys| self.read_keys(&client, keys));
        let values: Vec<Option<Entry>> = try_join_all(reads).await?.into_iter().flatten().collect();
        let mut runs: Vec<RunRecord> = wanted
            .iter()
            .zip(values)
            .filter_map(|((job, name), entry)| entry.map(|e| run_from_json(job, name, &e.value, 0)))
            .collect();
        newest_first(&mut runs, limit);
        Ok(runs)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn store(url: &str, prefix: &str) -> EtcdStore {
        let mut config = StoreConfig::new(StoreUrl::parse(url, Path::new("/")).unwrap());
        config.key_prefix = prefix.into();
        EtcdStore::open(&config).unwrap()
    }

    #[test]
    fn lease_ttls_are_whole_seconds_rounded_up_and_at_least_two() {
        let ttl = |ms| lease_ttl_secs(Duration::from_millis(ms));
        assert_eq!(ttl(0), 2);
        assert_eq!(ttl(1), 2);
        assert_eq!(ttl(1500), 2);
        assert_eq!(ttl(2000), 2);
        assert_eq!(ttl(2001), 3);
        assert_eq!(ttl(61_000), 61);
        assert_eq!(lease_ttl_secs(Duration::from_secs(61)), 61);
        assert_eq!(lease_ttl_secs(Duration::MAX), MAX_TTL_SECS);
    }

    #[test]
    fn keys_sit_under_the_prefix_and_runs_sort_by_fence() {
        let s = store("etcd://h", "cronlease:");
        assert_eq!(s.lock_key("backup"), "cronlease:lock/backup");
        assert_eq!(s.lease_key("backup"), "cronlease:lease/backup");
        assert_eq!(s.runs_prefix("backup"), "cronlease:runs/backup/");
        assert_eq!(
            s.run_key("backup", 42),
            "cronlease:runs/backup/00000000000000000042"
        );
        assert!(s.run_key("j", 9) < s.run_key("j", 10));
        assert_eq!(
            s.run_key("j", u64::MAX),
            format!("cronlease:runs/j/{}", u64::MAX)
        );
        let bare = store("etcd://h", "");
        assert_eq!(bare.lock_key("j"), "lock/j");
    }

    #[test]
    fn transactions_keep_within_etcds_operation_limit() {
        let items: Vec<u32> = (0..300).collect();
        let chunks = chunked(items.clone(), MAX_TXN_OPS);
        assert_eq!(
            chunks.iter().map(Vec::len).collect::<Vec<_>>(),
            [128, 128, 44]
        );
        assert_eq!(chunks.concat(), items);
        assert!(chunked(Vec::<u8>::new(), MAX_TXN_OPS).is_empty());
        assert_eq!(chunked(vec![1, 2, 3], 0), vec![vec![1], vec![2], vec![3]]);
        // A claim's nested transaction: two compares, two puts; the parent
        // holds 126 of them, 126 + 2 = 128.
        assert_eq!(nested_per_txn(2), 126);
        assert_eq!(nested_per_txn(1), 127);
        assert_eq!(nested_per_txn(500), 1);
        let claim = Plan {
            when: vec![
                unchanged("l", None),
                unchanged(
                    "k",
                    Some(&Entry {
                        value: Vec::new(),
                        mod_revision: 7,
                        lease: 1,
                    }),
                ),
            ],
            ops: vec![
                PlanOp::Put("l".into(), Vec::new()),
                PlanOp::PutLeased("k".into(), Vec::new(), 3),
            ],
        };
        assert_eq!((claim.width(), claim.ident()), (2, "l"));
        assert_eq!(claim.ttls().collect::<Vec<_>>(), [3]);
        assert!(claim.into_txn(&HashMap::new()).is_err());
    }

    #[test]
    fn prefix_ends_are_the_next_key() {
        assert_eq!(prefix_end(b"cronlease:runs/"), b"cronlease:runs0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn endpoints_follow_the_scheme() {
        let plain = store("etcd://a,b:2380", "");
        assert_eq!(endpoints(&plain.target), ["http://a:2379", "http://b:2380"]);
        let tls = store("etcds://a:2379,[::1]:2379", "");
        assert_eq!(
            endpoints(&tls.target),
            ["https://a:2379", "https://[::1]:2379"]
        );
    }

    #[test]
    fn versions_before_3_4_are_refused() {
        assert!(is_supported_version("3.5.17"));
        assert!(is_supported_version("3.4.0"));
        assert!(is_supported_version("4.0.0"));
        assert!(!is_supported_version("3.3.27"));
        assert!(is_supported_version("unknown"));
    }

    #[test]
    fn a_job_is_held_while_its_lease_key_exists_until_its_recorded_end() {
        let state = LockState {
            owner: "a#1".into(),
            marks: JobMarks {
                fence: "7".into(),
                last_occurrence: Some(19_000),
                running: true,
                ..JobMarks::free(19_000)
            },
        };
        let lease = Entry {
            value: br##"{"owner":"b#2","expires_at":20300}"##.to_vec(),
            mod_revision: 9,
            lease: 42,
        };
        // Held until the end the key records, by the key's owner.
        let held = JobView {
            keys: JobKeys {
                lock: None,
                lease: Some(lease.clone()),
            },
            now: 20_000,
        };
        let row = row_of(Some(&(state.clone(), 7)), &held);
        assert_eq!(row.owner.as_deref(), Some("b#2"));
        assert_eq!(row.expires_at, 20_300);
        assert_eq!((row.fence, row.last_occurrence), (7, Some(19_000)));
        // A value written by hand: held for a second at a time.
        let hand = JobView {
            keys: JobKeys {
                lock: None,
                lease: Some(Entry {
                    value: b"ghost".to_vec(),
                    ..lease
                }),
            },
            now: 20_000,
        };
        let row = row_of(None, &hand);
        assert_eq!(
            (row.owner.as_deref(), row.expires_at),
            (Some("ghost"), 21_000)
        );
        let free = JobView {
            keys: JobKeys::default(),
            now: 20_000,
        };
        let row = row_of(Some(&(state, 7)), &free);
        assert_eq!((row.owner.as_deref(), row.expires_at), (Some("a#1"), 0));
        let fresh = row_of(None, &free);
        assert_eq!((fresh.owner, fresh.fence, fresh.expires_at), (None, 0, 0));
    }

    #[test]
    fn a_node_is_measured_against_the_median_of_three_or_more_clocks() {
        assert_eq!(median(&mut [0, 5000, 10]), 10);
        assert_eq!(median(&mut [0, -3, 7, 9]), 3);
        let clocks = PeerClocks::default();
        *lock(&clocks.me) = Some("n1#1".into());
        // Our own heartbeat: sent at 1000, back through the watch at 1004.
        clocks.observe("n1#1", 1000, 1004, 1333);
        // Alone, and with one peer: no majority, our own clock.
        assert_eq!(clocks.median_ms(1004), 0);
        // A peer 5 s ahead (sent at its 6000, seen at our 1006).
        clocks.observe("n2#1", 6000, 1006, 1333);
        assert_eq!(clocks.median_ms(1006), 0);
        // A second peer, 20 ms ahead of us: the median is its clock, and
        // the one 5 s ahead is the one far from it.
        clocks.observe("n3#1", 1024, 1008, 1333);
        assert_eq!(clocks.median_ms(1008), 20);
        // Seen from the node 5 s ahead, the same clocks say about -5 s.
        let ahead = PeerClocks::default();
        *lock(&ahead.me) = Some("n2#1".into());
        ahead.observe("n2#1", 6000, 6004, 1333);
        ahead.observe("n1#1", 1000, 6003, 1333);
        ahead.observe("n3#1", 1024, 6002, 1333);
        assert_eq!(ahead.median_ms(6004), -4974);
        // Readings past their record's time to live, and leavers, drop out.
        assert_eq!(clocks.median_ms(1008 + 1334), 0);
        clocks.observe("n2#1", 6000, 1006, 1333);
        clocks.forget("n3#1");
        assert_eq!(clocks.median_ms(1008), 0);
    }

    #[test]
    fn claims_wait_for_the_readings_of_the_nodes_a_first_heartbeat_saw() {
        let clocks = PeerClocks::default();
        assert!(
            !clocks.unsettled(0),
            "no heartbeat yet: nothing to wait for"
        );
        *lock(&clocks.me) = Some("n1#1".into());
        clocks.expect(HashSet::from(["n2#1".to_string()]), 1000, 1333);
        assert!(clocks.unsettled(1100));
        clocks.observe("n2#1", 1100, 1101, 1333);
        assert!(!clocks.unsettled(1102));
        // A record whose node beats no more is waited for one record's
        // life after the first heartbeat at most.
        clocks.expect(
            HashSet::from(["n2#1".to_string(), "gone#1".to_string()]),
            1200,
            1333,
        );
        assert!(clocks.unsettled(1300));
        assert!(!clocks.unsettled(2334));
    }

    #[test]
    fn unreadable_state_is_named_not_guessed() {
        let entry = |value: &str| Entry {
            value: value.as_bytes().to_vec(),
            mod_revision: 1,
            lease: 0,
        };
        assert!(read_state(None).unwrap().is_none());
        let ok = entry(r#"{"owner":"a#1","fence":"3","last_occurrence":5,"modified_at":6}"#);
        assert_eq!(read_state(Some(&ok)).unwrap().unwrap().1, 3);
        assert!(read_state(Some(&entry("{"))).is_err());
        let bad_fence = entry(r#"{"owner":"a#1","fence":"x","modified_at":6}"#);
        assert!(read_state(Some(&bad_fence)).unwrap_err().contains("fence"));
    }
}
