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
use super::records::{JobMarks, Kind, Layout};
use super::registry::{self, BeatData, FORGET_AFTER, Heartbeat, NodeRecord, Registry};
use super::{
    ClaimOutcome, ClaimRequest, Claimed, FORMAT_ATTEMPTS, History, LockRow, LockStatus, Locks,
    Owner, RECORD_FORMAT, Renewal, RunBound, RunData, RunRecord, SchemaNotice, StoreError,
    TriggerAnswer, TriggerId, decide, duration_ms, format_contended, from_ms, lock, newest_first,
    parse_format, pending_from_entries, run_from_json, trigger_entry, trigger_row,
};
use crate::config::{JobName, StoreConfig, StoreKind, StoreUrl, ZkTarget, one_line};

mod audit;
mod history;
mod lock;
mod nodes;
mod outbox;
mod session;
use lock::*;
use session::*;
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
    /// Where cronlease's znodes are, under the URL's path plus the key
    /// prefix ([`Layout::zookeeper`]).
    paths: Layout,
    op_timeout: Duration,
    client: tokio::sync::Mutex<Option<zk::Client>>,
    /// The current session, as far as this process can prove it alive.
    session: Arc<Mutex<Option<Session>>>,
    /// Run directories known to exist.
    run_dirs: Mutex<HashSet<String>>,
    /// The owners the registry listed at the last read: a heartbeat reads
    /// their records with the list, in the same multi read.
    listed: Mutex<Vec<String>>,
    schema_notice: SchemaNotice,
}

impl ZkStore {
    /// Connections are made on first use.
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        let StoreKind::ZooKeeper(target) = config.url.kind() else {
            return Err(StoreError::not_a(config, "a zk:// URL"));
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
            paths: Layout::zookeeper(&base),
            op_timeout: config.op_timeout,
            client: tokio::sync::Mutex::new(None),
            session: Arc::new(Mutex::new(None)),
            run_dirs: Mutex::new(HashSet::new()),
            listed: Mutex::new(Vec::new()),
            schema_notice: SchemaNotice::default(),
        })
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
            zk::Error::AuthFailed | zk::Error::NoAuth => StoreError::Refused { store, reason },
            _ => StoreError::Backend { store, reason },
        }
    }

    /// `fut` within `op_timeout`.
    async fn timed<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, zk::Error>>,
    ) -> Result<T, StoreError> {
        self.within(fut).await?.map_err(|e| self.err(e))
    }

    /// A call within `op_timeout`, its ZooKeeper error left to the caller.
    async fn within<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, zk::Error>>,
    ) -> Result<Result<T, zk::Error>, StoreError> {
        tokio::time::timeout(self.op_timeout, fut)
            .await
            .map_err(|_| StoreError::Timeout(self.op_timeout))
    }

    /// The record format version the `format` znode held (0: none), after
    /// writing this binary's there when it held none or an older one, on
    /// condition that it did not change since the read.
    async fn settle_format(&self, client: &zk::Client) -> Result<i64, StoreError> {
        let path = self.paths.under("format");
        let ours = RECORD_FORMAT.to_string();
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        for _ in 0..FORMAT_ATTEMPTS {
            match self
                .within(client.create(&path, ours.as_bytes(), &persistent))
                .await?
            {
                Ok(_) => return Ok(0),
                Err(zk::Error::NodeExists) => {}
                Err(e) => return Err(self.err(e)),
            }
            let (data, stat) = match self.within(client.get_data(&path)).await? {
                Ok(read) => read,
                Err(zk::Error::NoNode) => continue,
                Err(e) => return Err(self.err(e)),
            };
            let found = parse_format(self.url.redacted(), &path, &String::from_utf8_lossy(&data))?;
            if found >= RECORD_FORMAT {
                return Ok(found);
            }
            match self
                .within(client.set_data(&path, ours.as_bytes(), Some(stat.version)))
                .await?
            {
                Ok(_) => return Ok(found),
                Err(zk::Error::BadVersion | zk::Error::NoNode) => {}
                Err(e) => return Err(self.err(e)),
            }
        }
        Err(format_contended(self.url.redacted(), &path))
    }

    /// A create or delete within `op_timeout` whose `done` error (the node
    /// exists already, or is gone already) means it was done before.
    async fn idempotent<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, zk::Error>>,
        done: zk::Error,
    ) -> Result<(), StoreError> {
        match self.within(fut).await? {
            Ok(_) => Ok(()),
            Err(e) if e == done => Ok(()),
            Err(e) => Err(self.err(e)),
        }
    }

    /// The session's client, connecting (again) when there is none or its
    /// session ended.
    async fn client(&self) -> Result<zk::Client, StoreError> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref()
            && !c.state().is_terminated()
        {
            return Ok(c.clone());
        }
        let servers: Vec<String> = self
            .target
            .servers
            .iter()
            .map(crate::config::host_port)
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
}

#[async_trait]
impl Locks for ZkStore {
    async fn prepare(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        let dirs = [
            self.paths.dir(Kind::Lock),
            self.paths.dir(Kind::Runs),
            self.paths.under("live"),
            self.paths.dir(Kind::Node),
            self.paths.dir(Kind::Trigger),
            self.paths.dir(Kind::Outbox),
            self.paths.dir(Kind::Audit),
        ];
        for dir in dirs {
            self.timed(client.mkdir(&dir, &persistent)).await?;
        }
        self.idempotent(
            client.create(&self.paths.under("clock"), b"", &persistent),
            zk::Error::NodeExists,
        )
        .await?;
        let found = self.settle_format(&client).await?;
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
        let jobs: Vec<&str> = renewals.iter().map(|r| r.job.as_str()).collect();
        // A lease taken in an ended session (read as ended) is not renewed:
        // a peer may have seen that session end.
        let done = self
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
        let names: Vec<&str> = jobs.iter().map(JobName::as_str).collect();
        let done = self
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
        // A store prepared by a version without manual runs has no directory
        // for their announcements yet.
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        let client = self.client().await?;
        self.timed(client.mkdir(&self.paths.dir(Kind::Trigger), &persistent))
            .await?;
        let answers = self
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
        let answers = self
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
            let path = self.paths.trigger(job.as_str(), id);
            let _ = self
                .idempotent(client.delete(&path, None), zk::Error::NoNode)
                .await;
        }
        Ok(withdrawn)
    }

    /// A child watch on the requests' directory, armed again after each
    /// change (a ZooKeeper watch fires once), on the store's session.
    fn notices(
        self: Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) -> Option<tokio::sync::mpsc::Receiver<()>> {
        let dir = self.paths.dir(Kind::Trigger);
        let store = self.clone();
        Some(super::notices::follow(
            self.url.redacted().to_string(),
            stop,
            move |tx| {
                let (store, dir) = (store.clone(), dir.clone());
                async move {
                    let client = store.client().await.map_err(|e| e.to_string())?;
                    loop {
                        let (_, watcher) = store
                            .timed(client.list_and_watch_children(&dir))
                            .await
                            .map_err(|e| e.to_string())?;
                        // Armed: a request written before it is looked for now.
                        if !super::notices::notify(&tx) {
                            return Ok(());
                        }
                        let event = watcher.changed().await;
                        if event.event_type == zk::EventType::Session {
                            return Err(format!("session {:?}", event.session_state));
                        }
                    }
                }
            },
        ))
    }

    async fn pending_triggers(&self) -> Result<Vec<(String, TriggerId)>, StoreError> {
        let client = self.client().await?;
        let names = match self
            .timed(client.list_children(&self.paths.dir(Kind::Trigger)))
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
            .timed(client.list_children(&self.paths.dir(Kind::Lock)))
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

    fn schema_notice(&self) -> Option<String> {
        self.schema_notice.get()
    }
}
