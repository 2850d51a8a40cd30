//! The ZooKeeper store (`zk://host:2181,host:2181/path`, ZooKeeper 3.5+):
//! one persistent node per job, changed only by compare-and-set on its
//! version (docs/protocol.md, "ZooKeeper").
//!
//! Nodes, below the URL's path and a node named after `store.key_prefix`:
//! - `locks/<job>`: JSON with owner, fence (a decimal string), lease end,
//!   last occurrence and modification time, all instants in milliseconds
//!   of the store's clock;
//! - `clock`: written at the start of every claim, renewal and release
//!   batch; its `mtime` (the leader's clock when it committed the write) is
//!   the store's now;
//! - `runs/<job>/<fence>`: one finished run each, the fence zero-padded so
//!   names sort by fence; created once, so a retried write records nothing
//!   twice.
//!
//! - `live/<owner>~<session>`: an ephemeral node per owner and session. A
//!   lock node names the session its lease was taken or renewed in; while
//!   that session's live node is gone, the lease counts as ended, so a
//!   dead holder's jobs are free once the server ends its session (its
//!   session timeout after the last word from it), not only when the lease
//!   runs out.
//!
//! - `triggers/<job>~<id>`: a manual run's request pending on `locks/<job>`
//!   (created in the same multi as the request's write there, deleted once
//!   a claim took it or found it gone), so nodes find pending requests by
//!   listing one directory;
//!
//! - `nodes/<owner>`: the node registry, one persistent node per daemon
//!   incarnation holding its heartbeat (JSON); live while its `mtime` plus
//!   the heartbeat's ttl is ahead of the store's now.
//!
//! A batch of claims is one read of every job's node (`multi` read) beside
//! the clock write, then one `multi` write of every won claim, each
//! conditional on the version read. The claim rule is the shared one
//! ([`super::decide`]). A multi is all or nothing: when one job's node
//! changed under it (a peer's claim), that job is read and decided again and
//! the others are written again, so each request is still decided on its
//! own.
//!
//! The holder's side of the session: a lease is only as good as the session
//! it names. The store confirms its session with a request every quarter of
//! the session timeout and answers [`Locks::run_bound`] from the send time
//! of the newest confirmed one: a run stops two thirds of a session timeout
//! after it and is gone before the server could end the session, so no peer
//! takes a job over while its run still goes. A lease taken in an earlier
//! session is over for the holder too.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use zookeeper_client as zk;

use super::cas;
use super::records::JobMarks;
use super::registry::{self, BeatData, FORGET_AFTER, Heartbeat, NodeRecord, Registry};
use super::{
    ClaimOutcome, ClaimRequest, Claimed, Decision, History, LockRow, LockStatus, Locks, Owner,
    Renewal, RunBound, RunData, RunRecord, StoreError, TriggerAnswer, TriggerId, decide,
    duration_ms, fence_exhausted, from_ms, lock, newest_first, pending_from_entries, run_from_json,
    trigger_entry, trigger_row,
};
use crate::config::{JobName, StoreConfig, StoreKind, StoreUrl, ZkTarget, one_line};
/// Operations per multi request: well inside ZooKeeper's 1 MiB request limit
/// (`jute.maxbuffer`) with job nodes of a few hundred bytes.
const MULTI_OPS: usize = 500;
/// Runs per multi read of history: a record is at most 384 KiB (a 64 KiB
/// tail of control bytes, each escaped in six by JSON), so an answer stays
/// below ZooKeeper's 1 MiB packet limit.
const RUNS_PER_READ: usize = 2;

/// The ZooKeeper implementation of [`crate::store::Store`].
pub struct ZkStore {
    target: ZkTarget,
    url: StoreUrl,
    /// Where cronlease's nodes are: the URL's path plus the key prefix.
    base: String,
    op_timeout: Duration,
    client: tokio::sync::Mutex<Option<zk::Client>>,
    /// The current session, as far as this process can prove it alive.
    session: Arc<Mutex<Option<Session>>>,
    /// Run directories known to exist.
    run_dirs: Mutex<HashSet<String>>,
}

/// A session of this store, for [`Locks::run_bound`].
struct Session {
    id: zk::SessionId,
    /// The negotiated session timeout.
    timeout: Duration,
    /// The last confirmation of the session it replaced, if any. A lease
    /// taken in that session was sent no later (the claim's own reads
    /// confirmed it), so a lease sent by then may be that session's, whose
    /// live node is gone; one sent after is this session's.
    earlier: Option<Instant>,
    /// Send time of the newest request the session got an answer to: the
    /// server heard from it no earlier, so it cannot end the session before
    /// this plus the timeout.
    confirmed: Instant,
    /// Owners whose live node this session made.
    live: HashSet<String>,
}

impl Session {
    fn confirm(&mut self, id: zk::SessionId, sent: Instant) {
        if self.id == id && sent > self.confirmed {
            self.confirmed = sent;
        }
    }
}

/// The live node's name of `owner` in session `id`.
fn live_name(owner: &str, id: zk::SessionId) -> String {
    format!("{owner}~{:016x}", id.0 as u64)
}

/// A job's lock node, as stored: who holds the job, until when, in which
/// session, and the marks etcd keeps too ([`JobMarks`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LockData {
    owner: Option<String>,
    expires_at: i64,
    /// The session the lease was taken or renewed in (hex); none in nodes
    /// written by earlier versions, whose leases end with their time alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    session: Option<String>,
    #[serde(flatten)]
    marks: JobMarks,
    /// Not stored: the `triggers/<job>~<id>` node to create in the same
    /// multi as this write (a request just accepted), so nodes find it.
    #[serde(skip)]
    announce: Option<String>,
}

impl LockData {
    /// The lock node of a job never claimed, made at `now`.
    fn free(now: i64) -> Self {
        LockData {
            owner: None,
            expires_at: 0,
            session: None,
            marks: JobMarks::free(now),
            announce: None,
        }
    }
}

/// A job's lock node as read: absent, readable (with its version), or not.
enum Node {
    Absent,
    Present(LockData, i32),
    Unreadable(String),
}

/// ZooKeeper's half of the compare-and-set loop ([`cas::Cas`]): one
/// batch's jobs, read and written on one client.
struct ZkCas<'a> {
    store: &'a ZkStore,
    client: &'a zk::Client,
    jobs: &'a [&'a str],
}

impl cas::Cas for ZkCas<'_> {
    type View = Node;
    /// The new data, and the version it replaces (none: the node is made).
    type Write = (LockData, Option<i32>);

    /// The writes go in multis of [`MULTI_OPS`], one after the other: the
    /// multi that found a node changed was not applied, nor any after it;
    /// the ones before it were.
    async fn write(&self, writes: Vec<(usize, Self::Write)>) -> Result<Vec<usize>, StoreError> {
        let mut sent = Vec::with_capacity(writes.len());
        for (i, (data, version)) in &writes {
            if let Some(job) = self.jobs.get(*i) {
                sent.push((*job, data, *version));
            }
        }
        match self.store.write_locks(self.client, &sent).await? {
            None => Ok(Vec::new()),
            Some(failed) => {
                let first = failed - failed % MULTI_OPS;
                Ok(writes.iter().skip(first).map(|(i, _)| *i).collect())
            }
        }
    }

    async fn reread(&self, jobs: &[&str]) -> Result<Vec<Node>, StoreError> {
        self.store.read_locks(self.client, jobs).await
    }

    fn store(&self) -> String {
        self.store.url.redacted().into()
    }
}

impl ZkStore {
    /// Connections are made on first use.
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        let StoreKind::ZooKeeper(target) = config.url.kind() else {
            return Err(StoreError::Backend {
                store: config.url.redacted().into(),
                reason: "not a zk:// URL".into(),
            });
        };
        let node = config.key_prefix.trim_end_matches(':').replace('/', "_");
        let node = if node.is_empty() {
            "cronlease".into()
        } else {
            node
        };
        let base = format!("{}/{node}", target.chroot.trim_end_matches('/'));
        Ok(ZkStore {
            target: target.clone(),
            url: config.url.clone(),
            base,
            op_timeout: config.op_timeout,
            client: tokio::sync::Mutex::new(None),
            session: Arc::new(Mutex::new(None)),
            run_dirs: Mutex::new(HashSet::new()),
        })
    }

    /// The negotiated session timeout (the one asked for before a session).
    fn session_timeout(&self) -> Duration {
        lock(&self.session)
            .as_ref()
            .map_or(self.target.session_timeout, |s| s.timeout)
    }

    fn lock_path(&self, job: &str) -> String {
        format!("{}/locks/{job}", self.base)
    }

    /// `name` is `<job>~<id>` ([`trigger_entry`]).
    fn trigger_path(&self, name: &str) -> String {
        format!("{}/triggers/{name}", self.base)
    }

    fn runs_path(&self, job: &str) -> String {
        format!("{}/runs/{job}", self.base)
    }

    fn err(&self, e: zk::Error) -> StoreError {
        let store = self.url.redacted().to_string();
        let reason = one_line(&self.url.scrub(&e.to_string()));
        match e {
            zk::Error::NoHosts
            | zk::Error::Timeout
            | zk::Error::ConnectionLoss
            | zk::Error::SessionExpired
            | zk::Error::SessionMoved
            | zk::Error::ClientClosed => StoreError::Unavailable { store, reason },
            zk::Error::NoNode => StoreError::NotMigrated { store },
            _ => StoreError::Backend { store, reason },
        }
    }

    /// `fut` within `op_timeout`.
    async fn timed<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, zk::Error>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.op_timeout, fut).await {
            Ok(r) => r.map_err(|e| self.err(e)),
            Err(_) => Err(StoreError::Timeout(self.op_timeout)),
        }
    }

    /// A create or delete within `op_timeout` whose `done` error (the node
    /// exists already, or is gone already) means it was done before.
    async fn idempotent<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, zk::Error>>,
        done: zk::Error,
    ) -> Result<(), StoreError> {
        match tokio::time::timeout(self.op_timeout, fut).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) if e == done => Ok(()),
            Ok(Err(e)) => Err(self.err(e)),
            Err(_) => Err(StoreError::Timeout(self.op_timeout)),
        }
    }

    /// The session's client, connecting (again) when there is none or its
    /// session ended.
    async fn client(&self) -> Result<zk::Client, StoreError> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.state().is_terminated() {
                return Ok(c.clone());
            }
        }
        let servers: Vec<String> = self
            .target
            .servers
            .iter()
            .map(|(h, p)| {
                if h.contains(':') {
                    format!("[{h}]:{p}")
                } else {
                    format!("{h}:{p}")
                }
            })
            .collect();
        let mut connector = zk::Client::connector()
            .with_session_timeout(self.target.session_timeout)
            .with_connection_timeout(self.op_timeout)
            .with_fail_eagerly();
        if let Some(user) = &self.target.username {
            let secret = format!("{user}:{}", self.url.password().unwrap_or_default());
            connector = connector.with_auth("digest", secret.as_bytes());
        }
        let started = Instant::now();
        let client = self.timed(connector.connect(&servers.join(","))).await?;
        let mut session = lock(&self.session);
        let earlier = session.as_ref().map(|s| s.confirmed);
        *session = Some(Session {
            id: client.session_id(),
            timeout: client.session_timeout(),
            earlier,
            confirmed: started,
            live: HashSet::new(),
        });
        drop(session);
        tokio::spawn(keep_confirming(
            Arc::downgrade(&self.session),
            client.clone(),
        ));
        *slot = Some(client.clone());
        Ok(client)
    }

    /// Makes the live node of each of `owners` in the client's session, once
    /// per session, before any lock node names that session.
    async fn ensure_live(&self, client: &zk::Client, owners: &[&str]) -> Result<(), StoreError> {
        let id = client.session_id();
        let missing: Vec<&str> = {
            let guard = lock(&self.session);
            owners
                .iter()
                .copied()
                .filter(|o| {
                    guard
                        .as_ref()
                        .is_none_or(|s| s.id != id || !s.live.contains(*o))
                })
                .collect()
        };
        if missing.is_empty() {
            return Ok(());
        }
        let ephemeral = zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all());
        for owner in missing {
            let path = format!("{}/live/{}", self.base, live_name(owner, id));
            self.idempotent(client.create(&path, b"", &ephemeral), zk::Error::NodeExists)
                .await?;
            if let Some(s) = lock(&self.session).as_mut().filter(|s| s.id == id) {
                s.live.insert(owner.to_string());
            }
        }
        Ok(())
    }

    /// Writes the clock node; its `mtime` is the store's now (ms).
    async fn tick(&self, client: &zk::Client) -> Result<i64, StoreError> {
        let sent = Instant::now();
        let stat = self
            .timed(client.set_data(&format!("{}/clock", self.base), b"", None))
            .await?;
        self.confirmed(client, sent);
        Ok(stat.mtime)
    }

    /// [`ZkStore::tick`] with `beat` written in the same multi: the clock
    /// write every claim makes anyway carries the heartbeat. A beat whose
    /// write fails (a record not made yet: a node's first beat) fails the
    /// multi: then the clock is ticked and the record written as a
    /// heartbeat of its own does.
    async fn tick_beating(
        &self,
        client: &zk::Client,
        beat: Option<&Heartbeat>,
    ) -> Result<(i64, Beaten), StoreError> {
        let Some(beat) = beat else {
            return Ok((self.tick(client).await?, Beaten::No));
        };
        let data = BeatData::from(beat).to_json();
        let mut writer = client.new_multi_writer();
        writer
            .add_set_data(&format!("{}/clock", self.base), b"", None)
            .map_err(|e| self.err(e))?;
        writer
            .add_set_data(&self.node_path(beat.owner.as_str()), data.as_bytes(), None)
            .map_err(|e| self.err(e))?;
        let sent = Instant::now();
        match tokio::time::timeout(self.op_timeout, writer.commit()).await {
            Err(_) => Err(StoreError::Timeout(self.op_timeout)),
            Ok(Ok(results)) => match results.first() {
                Some(zk::MultiWriteResult::SetData { stat }) => {
                    self.confirmed(client, sent);
                    Ok((stat.mtime, Beaten::Written))
                }
                _ => Err(self.short_answer(results.len(), 2)),
            },
            // The beat's write failed (its record not made yet, or gone):
            // nothing of the multi was applied.
            Ok(Err(zk::MultiWriteError::OperationFailed { index: 1, .. })) => {
                let (now, listed) = tokio::join!(self.tick(client), self.heartbeat(beat));
                if let Err(e) = &listed {
                    tracing::debug!("a claim's first heartbeat failed: {e}");
                }
                Ok((now?, Beaten::Listed(listed.ok())))
            }
            Ok(Err(e)) => Err(self.err(e.into())),
        }
    }

    /// A node's record in the registry.
    fn node_path(&self, owner: &str) -> String {
        format!("{}/nodes/{owner}", self.base)
    }

    /// Every job's lock node, in one multi read per [`MULTI_OPS`] jobs, and
    /// the live nodes, read in each multi after its lock nodes: a lease
    /// whose session's live node is gone is read as ended. (A live node is
    /// made before any lock node names its session, so a list read with or
    /// after a lock node has the live node of that lock's session.)
    async fn read_locks(
        &self,
        client: &zk::Client,
        jobs: &[&str],
    ) -> Result<Vec<Node>, StoreError> {
        let mut nodes = Vec::with_capacity(jobs.len());
        for chunk in jobs.chunks(MULTI_OPS) {
            let mut reader = client.new_multi_reader();
            for job in chunk {
                reader
                    .add_get_data(&self.lock_path(job))
                    .map_err(|e| self.err(e))?;
            }
            reader
                .add_get_children(&format!("{}/live", self.base))
                .map_err(|e| self.err(e))?;
            let sent = Instant::now();
            let mut results = self.timed(reader.commit()).await?;
            self.confirmed(client, sent);
            if results.len() != chunk.len() + 1 {
                return Err(self.short_answer(results.len(), chunk.len() + 1));
            }
            let live = match results.pop() {
                Some(zk::MultiReadResult::Children { children }) => {
                    Some(children.into_iter().collect::<HashSet<String>>())
                }
                Some(zk::MultiReadResult::Error { err }) => return Err(self.err(err)),
                _ => return Err(self.short_answer(0, chunk.len() + 1)),
            };
            for (job, r) in chunk.iter().zip(results) {
                nodes.push(match r {
                    zk::MultiReadResult::Data { data, stat } => {
                        match serde_json::from_slice::<LockData>(&data) {
                            Ok(mut d) => {
                                if !session_alive(&d, live.as_ref()) {
                                    // The holder's session ended: so did
                                    // its lease.
                                    d.expires_at = d.expires_at.min(stat.mtime);
                                }
                                Node::Present(d, stat.version)
                            }
                            Err(e) => Node::Unreadable(format!(
                                "the lock node of job {job} is unreadable ({e}); delete {} to start the job afresh",
                                self.lock_path(job)
                            )),
                        }
                    }
                    zk::MultiReadResult::Error {
                        err: zk::Error::NoNode,
                    } => Node::Absent,
                    zk::MultiReadResult::Error { err } => return Err(self.err(err)),
                    _ => Node::Unreadable(format!(
                        "unexpected answer reading the lock node of job {job}"
                    )),
                });
            }
        }
        Ok(nodes)
    }

    fn short_answer(&self, got: usize, sent: usize) -> StoreError {
        StoreError::Backend {
            store: self.url.redacted().into(),
            reason: format!("{got} answers to {sent} reads"),
        }
    }

    /// A request sent at `sent` in the client's session was answered.
    fn confirmed(&self, client: &zk::Client, sent: Instant) {
        if let Some(s) = lock(&self.session).as_mut() {
            s.confirm(client.session_id(), sent);
        }
    }

    /// The session the client is in, as a lock node names it.
    fn session_tag(client: &zk::Client) -> String {
        format!("{:016x}", client.session_id().0 as u64)
    }

    /// Writes `writes` (job, new data, version read or none when absent) as
    /// one multi per chunk. `Ok(None)` when all went through, `Ok(Some(i))`
    /// when write `i` found its node changed (nothing of its chunk was
    /// applied, earlier chunks were).
    async fn write_locks(
        &self,
        client: &zk::Client,
        writes: &[(&str, &LockData, Option<i32>)],
    ) -> Result<Option<usize>, StoreError> {
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        for (c, chunk) in writes.chunks(MULTI_OPS).enumerate() {
            let mut writer = client.new_multi_writer();
            // The write each operation belongs to (an announcement is one
            // more operation of its write).
            let mut of_write = Vec::with_capacity(chunk.len());
            for (w, (job, data, version)) in chunk.iter().enumerate() {
                let json = serde_json::to_vec(data).map_err(|e| StoreError::Backend {
                    store: self.url.redacted().into(),
                    reason: e.to_string(),
                })?;
                let path = self.lock_path(job);
                match version {
                    Some(v) => writer.add_set_data(&path, &json, Some(*v)),
                    None => writer.add_create(&path, &json, &persistent),
                }
                .map_err(|e| self.err(e))?;
                of_write.push(w);
                if let Some(name) = &data.announce {
                    writer
                        .add_create(&self.trigger_path(name), b"", &persistent)
                        .map_err(|e| self.err(e))?;
                    of_write.push(w);
                }
            }
            match tokio::time::timeout(self.op_timeout, writer.commit()).await {
                Err(_) => return Err(StoreError::Timeout(self.op_timeout)),
                Ok(Ok(_)) => {}
                Ok(Err(zk::MultiWriteError::OperationFailed {
                    index,
                    source: zk::Error::BadVersion | zk::Error::NodeExists | zk::Error::NoNode,
                })) => {
                    let w = of_write.get(index).copied().unwrap_or(0);
                    return Ok(Some(c * MULTI_OPS + w));
                }
                Ok(Err(e)) => return Err(self.err(e.into())),
            }
        }
        Ok(None)
    }

    /// Reads, decides with `decide_one` and writes by compare-and-set until
    /// every job's write went through or none is left to write: a job whose
    /// node changed between read and write is read and decided again.
    /// `decide_one(i, node, now, session)` answers `(new data to write, or
    /// none)`; `session` is this client's, for the data to name. The live
    /// nodes of `owners` are made first.
    async fn read_decide_write<A>(
        &self,
        jobs: &[&str],
        owners: &[&str],
        decide_one: impl FnMut(usize, &Node, i64, &str) -> (Option<LockData>, A),
    ) -> Result<(i64, Vec<A>), StoreError> {
        self.read_decide_write_beating(jobs, owners, None, decide_one)
            .await
            .map(|(now, answers, _)| (now, answers))
    }

    /// [`ZkStore::read_decide_write`] with `beat` in its clock write
    /// ([`ZkStore::tick_beating`]); once that went through, the live nodes
    /// are read while the claims are decided and written, and come back
    /// with the answers.
    async fn read_decide_write_beating<A>(
        &self,
        jobs: &[&str],
        owners: &[&str],
        beat: Option<&Heartbeat>,
        mut decide_one: impl FnMut(usize, &Node, i64, &str) -> (Option<LockData>, A),
    ) -> Result<(i64, Vec<A>, Option<Vec<NodeRecord>>), StoreError> {
        let client = self.client().await?;
        self.ensure_live(&client, owners).await?;
        let session = Self::session_tag(&client);
        let (ticked, nodes) = tokio::join!(
            self.tick_beating(&client, beat),
            self.read_locks(&client, jobs)
        );
        let ((now, beaten), nodes) = (ticked?, nodes?);
        let listing = async {
            match beaten {
                Beaten::No => None,
                Beaten::Listed(live) => live,
                Beaten::Written => match self.live_nodes(&client, now, true).await {
                    Ok(live) => Some(live),
                    Err(e) => {
                        tracing::debug!(
                            "reading the registry after a claim's heartbeat failed: {e}"
                        );
                        None
                    }
                },
            }
        };
        let (live, answers) = tokio::join!(
            listing,
            self.decide_and_write(&client, jobs, &nodes, now, &session, &mut decide_one)
        );
        Ok((now, answers?, live))
    }

    /// The decide-and-write loop of [`ZkStore::read_decide_write`] on the
    /// nodes read at `now`: [`cas::decide_and_write`]'s, with this store's
    /// multis ([`ZkCas`]).
    async fn decide_and_write<A>(
        &self,
        client: &zk::Client,
        jobs: &[&str],
        nodes: &[Node],
        now: i64,
        session: &str,
        decide_one: &mut impl FnMut(usize, &Node, i64, &str) -> (Option<LockData>, A),
    ) -> Result<Vec<A>, StoreError> {
        let deadline = tokio::time::Instant::now() + self.op_timeout;
        let transport = ZkCas {
            store: self,
            client,
            jobs,
        };
        cas::decide_and_write(
            &transport,
            jobs,
            nodes,
            deadline,
            self.op_timeout,
            |i, node| {
                let (data, answer) = decide_one(i, node, now, session);
                let version = match node {
                    Node::Present(_, v) => Some(*v),
                    _ => None,
                };
                (data.map(|d| (d, version)), answer)
            },
        )
        .await
    }

    /// A claim of a non-empty batch, with `beat` in its clock write
    /// ([`ZkStore::read_decide_write_beating`]).
    async fn claim_with(
        &self,
        requests: &[ClaimRequest],
        beat: Option<&Heartbeat>,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        let jobs: Vec<&str> = requests.iter().map(|r| r.job.as_str()).collect();
        let mut owners: Vec<&str> = requests.iter().map(|r| r.owner.as_str()).collect();
        owners.sort_unstable();
        owners.dedup();
        let (now, outcomes, live) = self
            .read_decide_write_beating(&jobs, &owners, beat, |i, node, now, session| {
                let req = &requests[i];
                if let Node::Unreadable(why) = node {
                    return (None, ClaimOutcome::Failed(why.clone()));
                }
                match decide(&row_of(node, now), req) {
                    // A recheck answers an earlier win as it stands.
                    Decision::Claim { won, .. } if req.recheck_only => {
                        (None, ClaimOutcome::Won(won))
                    }
                    Decision::Claim {
                        fence,
                        expires_at,
                        last_occurrence,
                        manual,
                        won,
                    } => {
                        let kept = match node {
                            Node::Present(d, _) => Some(&d.marks),
                            _ => None,
                        };
                        (
                            Some(LockData {
                                owner: Some(req.owner.as_str().to_string()),
                                expires_at,
                                session: Some(session.to_string()),
                                marks: JobMarks::claimed(kept, fence, last_occurrence, manual, now),
                                announce: None,
                            }),
                            ClaimOutcome::Won(won),
                        )
                    }
                    Decision::Refuse(lost) => (None, ClaimOutcome::Lost(lost)),
                    Decision::FenceExhausted => (
                        None,
                        ClaimOutcome::Failed(fence_exhausted(req.job.as_str())),
                    ),
                }
            })
            .await?;
        // A request taken, or found gone: its announcement goes (best
        // effort; one left behind is found gone, and deleted, next time).
        let done: Vec<String> = requests
            .iter()
            .zip(&outcomes)
            .filter_map(|(req, outcome)| {
                let id = req.manual?;
                let over = match outcome {
                    ClaimOutcome::Won(_) => true,
                    ClaimOutcome::Lost(lost) => lost.trigger_gone,
                    ClaimOutcome::Failed(_) => false,
                };
                over.then(|| self.trigger_path(&trigger_entry(req.job.as_str(), id)))
            })
            .collect();
        if !done.is_empty() {
            if let Ok(client) = self.client().await {
                for path in done {
                    let _ = self
                        .idempotent(client.delete(&path, None), zk::Error::NoNode)
                        .await;
                }
            }
        }
        let claimed = Claimed {
            store_now: from_ms(now),
            outcomes,
        };
        Ok((claimed, live))
    }

    async fn ensure_run_dir(&self, client: &zk::Client, job: &str) -> Result<(), StoreError> {
        let path = self.runs_path(job);
        if self.known_dir(&path) {
            return Ok(());
        }
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        self.timed(client.mkdir(&path, &persistent)).await?;
        lock(&self.run_dirs).insert(path);
        Ok(())
    }

    fn known_dir(&self, path: &str) -> bool {
        lock(&self.run_dirs).contains(path)
    }

    async fn job_runs(
        &self,
        client: &zk::Client,
        job: &str,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let mut names = match self.timed(client.list_children(&self.runs_path(job))).await {
            Ok(n) => n,
            Err(StoreError::NotMigrated { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        names.sort_unstable_by(|a, b| b.cmp(a));
        names.truncate(limit as usize);
        // A few runs per multi read, the reads sent together: an answer
        // stays far below ZooKeeper's 1 MiB packet limit (`jute.maxbuffer`)
        // with the largest output tails.
        let dir = self.runs_path(job);
        let reads = names.chunks(RUNS_PER_READ).map(|chunk| {
            let dir = &dir;
            async move {
                let mut reader = client.new_multi_reader();
                for name in chunk {
                    reader
                        .add_get_data(&format!("{dir}/{name}"))
                        .map_err(|e| self.err(e))?;
                }
                let results = self.timed(reader.commit()).await?;
                let mut runs = Vec::with_capacity(chunk.len());
                for (name, r) in chunk.iter().zip(results) {
                    match r {
                        zk::MultiReadResult::Data { data, stat } => {
                            runs.push(run_from_json(job, name, &data, stat.mtime));
                        }
                        zk::MultiReadResult::Error {
                            err: zk::Error::NoNode,
                        } => {}
                        zk::MultiReadResult::Error { err } => return Err(self.err(err)),
                        _ => {}
                    }
                }
                Ok::<_, StoreError>(runs)
            }
        });
        let runs: Vec<RunRecord> = futures_util::future::try_join_all(reads)
            .await?
            .into_iter()
            .flatten()
            .collect();
        Ok(runs)
    }
}

/// The session a lock node names is alive: its live node is in `live`
/// (the children of `live/`). A node naming no session counts by its lease
/// alone.
fn session_alive(d: &LockData, live: Option<&HashSet<String>>) -> bool {
    match (&d.session, &d.owner, live) {
        (Some(session), Some(owner), Some(live)) => live.contains(&format!("{owner}~{session}")),
        _ => true,
    }
}

/// Confirms the client's session every quarter of its timeout, for as long
/// as the store and the session last.
async fn keep_confirming(session: Weak<Mutex<Option<Session>>>, client: zk::Client) {
    let id = client.session_id();
    let every = (client.session_timeout() / 4).max(Duration::from_millis(10));
    loop {
        tokio::time::sleep(every).await;
        if client.state().is_terminated() {
            return;
        }
        let sent = Instant::now();
        let answered = matches!(
            tokio::time::timeout(every, client.check_stat("/")).await,
            Ok(Ok(_))
        );
        let Some(slot) = session.upgrade() else {
            return;
        };
        let mut guard = lock(&slot);
        match guard.as_mut() {
            Some(s) if s.id == id => {
                if answered {
                    s.confirm(id, sent);
                }
            }
            // The store moved on to another session.
            _ => return,
        }
    }
}

/// The shared claim rule's view of a lock node.
fn row_of(node: &Node, now: i64) -> LockRow {
    match node {
        Node::Present(d, _) => JobMarks::row(Some(&d.marks), d.owner.clone(), d.expires_at, now),
        _ => LockRow::free(now),
    }
}

/// What became of the heartbeat a claim carried ([`ZkStore::tick_beating`]).
enum Beaten {
    /// None was carried.
    No,
    /// Written with the clock: the live nodes are still to be read.
    Written,
    /// Written on its own (the record was new), with the live nodes read,
    /// or not (it failed).
    Listed(Option<Vec<NodeRecord>>),
}

#[async_trait]
impl Locks for ZkStore {
    async fn prepare(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        for dir in ["locks", "runs", "live", "nodes", "triggers"] {
            self.timed(client.mkdir(&format!("{}/{dir}", self.base), &persistent))
                .await?;
        }
        self.idempotent(
            client.create(&format!("{}/clock", self.base), b"", &persistent),
            zk::Error::NodeExists,
        )
        .await
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
        let client = self.client().await?;
        self.tick(&client).await.map(from_ms)
    }

    async fn renew_many(
        &self,
        owner: &Owner,
        renewals: &[Renewal],
    ) -> Result<Vec<bool>, StoreError> {
        if renewals.is_empty() {
            return Ok(Vec::new());
        }
        let jobs: Vec<&str> = renewals.iter().map(|r| r.job.as_str()).collect();
        // A lease taken in an ended session (read as ended) is not renewed:
        // a peer may have seen that session end.
        let (_, done) = self
            .read_decide_write(
                &jobs,
                &[owner.as_str()],
                |i, node, now, session| match node {
                    Node::Present(d, _)
                        if d.owner.as_deref() == Some(owner.as_str()) && d.expires_at > now =>
                    {
                        let mut d = d.clone();
                        d.expires_at = now.saturating_add(duration_ms(renewals[i].lease));
                        d.marks.modified_at = now;
                        d.session = Some(session.to_string());
                        (Some(d), true)
                    }
                    _ => (None, false),
                },
            )
            .await?;
        Ok(done)
    }

    async fn release(&self, jobs: &[JobName], owner: &Owner) -> Result<usize, StoreError> {
        if jobs.is_empty() {
            return Ok(0);
        }
        let names: Vec<&str> = jobs.iter().map(JobName::as_str).collect();
        let (_, done) = self
            .read_decide_write(&names, &[], |_, node, now, _| match node {
                Node::Present(d, _)
                    if d.owner.as_deref() == Some(owner.as_str()) && d.expires_at > now =>
                {
                    let mut d = d.clone();
                    d.expires_at = now;
                    d.marks.modified_at = now;
                    (Some(d), true)
                }
                _ => (None, false),
            })
            .await?;
        Ok(done.into_iter().filter(|d| *d).count())
    }

    async fn set_paused(&self, jobs: &[JobName], paused: bool) -> Result<(), StoreError> {
        if jobs.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = jobs.iter().map(JobName::as_str).collect();
        self.read_decide_write(&names, &[], |_, node, now, _| match node {
            Node::Present(d, _) => (
                JobMarks::paused(Some(&d.marks), paused, now)
                    .map(|marks| LockData { marks, ..d.clone() }),
                (),
            ),
            // A job never claimed: its lock node, free, with the mark.
            Node::Absent => (
                JobMarks::paused(None, paused, now).map(|marks| LockData {
                    marks,
                    ..LockData::free(now)
                }),
                (),
            ),
            // Left for its claims to report; pausing does not repair it.
            Node::Unreadable(_) => (None, ()),
        })
        .await?;
        Ok(())
    }

    async fn request_trigger(
        &self,
        job: &JobName,
        id: TriggerId,
    ) -> Result<TriggerAnswer, StoreError> {
        let client = self.client().await?;
        // A store prepared by a version without manual runs has no directory
        // for their announcements yet.
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        self.timed(client.mkdir(&format!("{}/triggers", self.base), &persistent))
            .await?;
        let (_, answers) = self
            .read_decide_write(&[job.as_str()], &[], |_, node, now, _| {
                if let Node::Unreadable(why) = node {
                    return (None, Err(why.clone()));
                }
                let mut row = row_of(node, now);
                let answer = trigger_row(&mut row, id);
                if answer != TriggerAnswer::Accepted {
                    return (None, Ok(answer));
                }
                let announce = Some(trigger_entry(job.as_str(), id));
                // A job never claimed: its lock node, free, with the request.
                let kept = match node {
                    Node::Present(d, _) => d.clone(),
                    _ => LockData::free(now),
                };
                let data = LockData {
                    marks: JobMarks::requested(Some(&kept.marks), row.trigger, now),
                    announce,
                    ..kept
                };
                (Some(data), Ok(answer))
            })
            .await?;
        let answer = answers
            .into_iter()
            .next()
            .unwrap_or_else(|| Err("no answer".into()));
        answer.map_err(|why| StoreError::Backend {
            store: self.url.redacted().into(),
            reason: why,
        })
    }

    async fn withdraw_trigger(&self, job: &JobName, id: TriggerId) -> Result<bool, StoreError> {
        let (_, answers) = self
            .read_decide_write(&[job.as_str()], &[], |_, node, _, _| match node {
                Node::Present(d, _) => match JobMarks::withdrawn(&d.marks, id) {
                    Some(marks) => (
                        Some(LockData {
                            marks,
                            announce: None,
                            ..d.clone()
                        }),
                        true,
                    ),
                    None => (None, false),
                },
                _ => (None, false),
            })
            .await?;
        let withdrawn = answers.into_iter().next().unwrap_or(false);
        // Its announcement goes too (best effort: one left behind is found
        // gone, and deleted, at the next look).
        if let Ok(client) = self.client().await {
            let path = self.trigger_path(&trigger_entry(job.as_str(), id));
            let _ = self
                .idempotent(client.delete(&path, None), zk::Error::NoNode)
                .await;
        }
        Ok(withdrawn)
    }

    async fn pending_triggers(&self) -> Result<Vec<(String, TriggerId)>, StoreError> {
        let client = self.client().await?;
        let names = match self
            .timed(client.list_children(&format!("{}/triggers", self.base)))
            .await
        {
            Ok(names) => names,
            Err(StoreError::NotMigrated { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        Ok(pending_from_entries(names.iter().map(String::as_str)))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        let sent = Instant::now();
        self.timed(client.check_stat("/")).await?;
        self.confirmed(&client, sent);
        Ok(())
    }

    /// A peer's live lease ends early when its session does: asked about
    /// again within half a session timeout, its jobs move soon after.
    fn recheck_within(&self) -> Option<Duration> {
        Some(self.session_timeout() / 2)
    }

    fn run_bound(&self, sent: Instant) -> Option<RunBound> {
        let guard = lock(&self.session);
        Some(match guard.as_ref() {
            // Claimed in this session: until the server could end it.
            Some(s) if s.earlier.is_none_or(|e| sent > e) => {
                let allowance = s.timeout / 1000 + Duration::from_millis(1);
                RunBound {
                    stop_by: s.confirmed + s.timeout * 2 / 3,
                    kill_by: (s.confirmed + s.timeout)
                        .checked_sub(allowance)
                        .unwrap_or(s.confirmed),
                }
            }
            // Claimed in an earlier session, or none yet: nothing proves it.
            _ => RunBound {
                stop_by: sent,
                kill_by: sent,
            },
        })
    }

    async fn status(&self) -> Result<Vec<LockStatus>, StoreError> {
        let client = self.client().await?;
        let mut jobs = self
            .timed(client.list_children(&format!("{}/locks", self.base)))
            .await?;
        jobs.sort();
        let names: Vec<&str> = jobs.iter().map(String::as_str).collect();
        let now = self.tick(&client).await?;
        let nodes = self.read_locks(&client, &names).await?;
        Ok(jobs
            .into_iter()
            .zip(nodes)
            .filter_map(|(job, node)| match node {
                Node::Present(d, _) => {
                    let live = d.owner.is_some() && d.expires_at > now;
                    Some(LockStatus {
                        job,
                        holder: if live { d.owner.clone() } else { None },
                        lease_remaining_ms: if live {
                            d.expires_at.saturating_sub(now).max(0) as u64
                        } else {
                            0
                        },
                        fence: d.marks.fence().unwrap_or(0) as u64,
                        last_occurrence: d.marks.last_occurrence.map(from_ms),
                        last_owner: d.owner,
                        paused: d.marks.paused,
                    })
                }
                _ => None,
            })
            .collect())
    }

    fn describe(&self) -> &str {
        self.url.redacted()
    }
}

impl ZkStore {
    /// The registry's records live at the store's `now` (ms), read in
    /// multis of [`MULTI_OPS`]; with `forget`, records dead for
    /// [`FORGET_AFTER`] are deleted (each only at the version read).
    async fn live_nodes(
        &self,
        client: &zk::Client,
        now: i64,
        forget: bool,
    ) -> Result<Vec<NodeRecord>, StoreError> {
        let dir = format!("{}/nodes", self.base);
        let owners = match tokio::time::timeout(self.op_timeout, client.list_children(&dir)).await {
            Ok(Ok(owners)) => owners,
            // Never prepared by a version with a registry: nobody in it.
            Ok(Err(zk::Error::NoNode)) => return Ok(Vec::new()),
            Ok(Err(e)) => return Err(self.err(e)),
            Err(_) => return Err(StoreError::Timeout(self.op_timeout)),
        };
        let forget_before = now.saturating_sub(duration_ms(FORGET_AFTER));
        let mut nodes = Vec::new();
        let mut dead = Vec::new();
        for chunk in owners.chunks(MULTI_OPS) {
            let mut reader = client.new_multi_reader();
            for owner in chunk {
                reader
                    .add_get_data(&format!("{dir}/{owner}"))
                    .map_err(|e| self.err(e))?;
            }
            let results = self.timed(reader.commit()).await?;
            for (owner, r) in chunk.iter().zip(results) {
                // Gone since the list (a node left): not listed.
                let zk::MultiReadResult::Data { data, stat } = r else {
                    continue;
                };
                let Some(d) = BeatData::parse(&data) else {
                    continue;
                };
                let ends = stat.mtime.saturating_add(d.ttl_ms);
                if ends > now {
                    nodes.push(d.record(owner, stat.mtime, ends, now));
                } else if ends < forget_before {
                    dead.push((owner.clone(), stat.version));
                }
            }
        }
        if forget {
            for (owner, version) in dead {
                // Best effort: a node that beat again since keeps its record.
                let _ = tokio::time::timeout(
                    self.op_timeout,
                    client.delete(&format!("{dir}/{owner}"), Some(version)),
                )
                .await;
            }
        }
        Ok(registry::sorted(nodes))
    }
}

#[async_trait]
impl Registry for ZkStore {
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        let client = self.client().await?;
        let path = self.node_path(beat.owner.as_str());
        let data = BeatData::from(beat).to_json();
        let sent = Instant::now();
        let written = tokio::time::timeout(
            self.op_timeout,
            client.set_data(&path, data.as_bytes(), None),
        )
        .await;
        let stat = match written {
            Ok(Ok(stat)) => stat,
            Ok(Err(zk::Error::NoNode)) => {
                let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                match tokio::time::timeout(
                    self.op_timeout,
                    client.create(&path, data.as_bytes(), &persistent),
                )
                .await
                {
                    Ok(Ok((stat, _))) => stat,
                    // Made meanwhile by a retry of this very beat.
                    Ok(Err(zk::Error::NodeExists)) => {
                        self.timed(client.set_data(&path, data.as_bytes(), None))
                            .await?
                    }
                    Ok(Err(e)) => return Err(self.err(e)),
                    Err(_) => return Err(StoreError::Timeout(self.op_timeout)),
                }
            }
            Ok(Err(e)) => return Err(self.err(e)),
            Err(_) => return Err(StoreError::Timeout(self.op_timeout)),
        };
        self.confirmed(&client, sent);
        self.live_nodes(&client, stat.mtime, true).await
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let client = self.client().await?;
        let now = self.tick(&client).await?;
        self.live_nodes(&client, now, false).await
    }

    async fn leave(&self, owner: &Owner) -> Result<(), StoreError> {
        let client = self.client().await?;
        let path = format!("{}/nodes/{owner}", self.base);
        self.idempotent(client.delete(&path, None), zk::Error::NoNode)
            .await
    }

    /// The heartbeat is written in the claim's clock multi (the write to
    /// `/clock` every claim makes), and the live nodes are read while the
    /// claims are decided and written; a beat that fails leaves the claims
    /// standing, and the node beats again on its own.
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        if requests.is_empty() {
            return registry::claim_alongside(self, requests, beat).await;
        }
        self.claim_with(requests, Some(beat)).await
    }
}

impl ZkStore {
    /// Clears the running mark of each lock whose last claim's run is among
    /// `runs` (recorded already), each at the version read: a lock claimed
    /// again meanwhile has a new mark of its own.
    async fn end_running_marks(
        &self,
        client: &zk::Client,
        runs: &[RunRecord],
    ) -> Result<(), StoreError> {
        let ended: Vec<&RunRecord> = runs.iter().filter(|r| super::ends_a_run(r)).collect();
        let mut clears = Vec::new();
        for chunk in ended.chunks(MULTI_OPS) {
            let mut reader = client.new_multi_reader();
            for run in chunk {
                reader
                    .add_get_data(&self.lock_path(&run.job))
                    .map_err(|e| self.err(e))?;
            }
            let results = self.timed(reader.commit()).await?;
            for (run, r) in chunk.iter().zip(results) {
                let zk::MultiReadResult::Data { data, stat } = r else {
                    continue;
                };
                let Ok(mut d) = serde_json::from_slice::<LockData>(&data) else {
                    continue;
                };
                if d.marks.running
                    && d.marks
                        .fence()
                        .is_some_and(|f| super::clears_running(run, f))
                {
                    d.marks.running = false;
                    if let Ok(json) = serde_json::to_vec(&d) {
                        clears.push((self.lock_path(&run.job), json, stat.version));
                    }
                }
            }
        }
        let cleared = futures_util::future::join_all(clears.iter().map(|(path, json, version)| {
            // Changed since the read (a new claim): its mark is its own.
            self.idempotent(
                client.set_data(path, json, Some(*version)),
                zk::Error::BadVersion,
            )
        }))
        .await;
        cleared.into_iter().collect::<Result<Vec<()>, _>>()?;
        Ok(())
    }
}

#[async_trait]
impl History for ZkStore {
    async fn record_runs(&self, runs: &[RunRecord], keep: u32) -> Result<(), StoreError> {
        if runs.is_empty() {
            return Ok(());
        }
        let client = &self.client().await?;
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        let mut jobs: Vec<&str> = runs.iter().map(|r| r.job.as_str()).collect();
        jobs.sort_unstable();
        jobs.dedup();
        for job in &jobs {
            self.ensure_run_dir(client, job).await?;
        }
        let mut writes = Vec::with_capacity(runs.len());
        for run in runs {
            let data =
                serde_json::to_vec(&RunData::from(run)).map_err(|e| StoreError::Backend {
                    store: self.url.redacted().into(),
                    reason: e.to_string(),
                })?;
            let path = format!("{}/{:020}", self.runs_path(&run.job), run.fence);
            writes.push((path, data));
        }
        // One request each, sent together; a fence recorded already is
        // left as it is.
        let created = futures_util::future::join_all(writes.iter().map(|(path, data)| {
            self.idempotent(
                client.create(path, data, &persistent),
                zk::Error::NodeExists,
            )
        }))
        .await;
        created.into_iter().collect::<Result<Vec<()>, _>>()?;
        self.end_running_marks(client, runs).await?;
        for job in jobs {
            let mut names = self
                .timed(client.list_children(&self.runs_path(job)))
                .await?;
            if names.len() <= keep.max(1) as usize {
                continue;
            }
            names.sort_unstable();
            let surplus = names.len() - keep.max(1) as usize;
            let deleted = futures_util::future::join_all(names[..surplus].iter().map(|n| {
                let path = format!("{}/{n}", self.runs_path(job));
                async move {
                    self.idempotent(client.delete(&path, None), zk::Error::NoNode)
                        .await
                }
            }))
            .await;
            deleted.into_iter().collect::<Result<Vec<()>, _>>()?;
        }
        Ok(())
    }

    async fn history(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let client = self.client().await?;
        let jobs = match job {
            Some(j) => vec![j.as_str().to_string()],
            None => {
                self.timed(client.list_children(&format!("{}/runs", self.base)))
                    .await?
            }
        };
        let mut runs = Vec::new();
        for j in &jobs {
            runs.extend(self.job_runs(&client, j, limit).await?);
        }
        newest_first(&mut runs, limit);
        Ok(runs)
    }
}
