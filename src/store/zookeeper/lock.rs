//! A job's lock node ([`LockData`]), read and written in multis of
//! [`MULTI_OPS`], the store's clock (a node's mtime), and claims decided
//! on them through the shared compare-and-set loop ([`ZkCas`]).

use super::*;

/// A job's lock node, as stored: who holds the job, until when, in which
/// session, and the marks etcd keeps too ([`JobMarks`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct LockData {
    pub(super) owner: Option<String>,
    pub(super) expires_at: i64,
    /// The session the lease was taken or renewed in (hex); none in nodes
    /// written by earlier versions, whose leases end with their time alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) session: Option<String>,
    #[serde(flatten)]
    pub(super) marks: JobMarks,
    /// Not stored: the `triggers/<job>~<id>` node to create in the same
    /// multi as this write (a request just accepted), so nodes find it.
    #[serde(skip)]
    pub(super) announce: Option<String>,
}

impl LockData {
    /// The lock node of a job never claimed, made at `now`.
    pub(super) fn free(now: i64) -> Self {
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
pub(super) enum Node {
    Absent,
    Present(LockData, i32),
    Unreadable(String),
}

/// ZooKeeper's half of the compare-and-set loop ([`cas::Cas`]): one
/// batch's jobs, read and written on one client.
pub(super) struct ZkCas<'a> {
    pub(super) store: &'a ZkStore,
    pub(super) client: &'a zk::Client,
    pub(super) jobs: &'a [&'a str],
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

/// The shared claim rule's view of a lock node.
pub(super) fn row_of(node: &Node, now: i64) -> LockRow {
    match node {
        Node::Present(d, _) => JobMarks::row(Some(&d.marks), d.owner.clone(), d.expires_at, now),
        _ => LockRow::free(now),
    }
}

/// What became of the heartbeat a claim carried ([`ZkStore::tick_beating`]).
pub(super) enum Beaten {
    /// None was carried.
    No,
    /// Written with the clock: the live nodes are still to be read.
    Written,
    /// Written on its own (the record was new), with the live nodes read,
    /// or not (it failed).
    Listed(Option<Vec<NodeRecord>>),
}

impl ZkStore {
    /// Writes the clock node; its `mtime` is the store's now (ms).
    pub(super) async fn tick(&self, client: &zk::Client) -> Result<i64, StoreError> {
        let sent = Instant::now();
        let stat = self
            .timed(client.set_data(&self.paths.under("clock"), b"", None))
            .await?;
        self.confirmed(client, sent);
        Ok(stat.mtime)
    }

    /// [`ZkStore::tick`] with `beat` written in the same multi: the clock
    /// write every claim makes anyway carries the heartbeat. A beat whose
    /// write fails (a record not made yet: a node's first beat) fails the
    /// multi: then the clock is ticked and the record written as a
    /// heartbeat of its own does.
    pub(super) async fn tick_beating(
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
            .add_set_data(&self.paths.under("clock"), b"", None)
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

    /// Every job's lock node, in one multi read per [`MULTI_OPS`] jobs, and
    /// the live nodes, read in each multi after its lock nodes: a lease
    /// whose session's live node is gone is read as ended. (A live node is
    /// made before any lock node names its session, so a list read with or
    /// after a lock node has the live node of that lock's session.)
    pub(super) async fn read_locks(
        &self,
        client: &zk::Client,
        jobs: &[&str],
    ) -> Result<Vec<Node>, StoreError> {
        let mut nodes = Vec::with_capacity(jobs.len());
        for chunk in jobs.chunks(MULTI_OPS) {
            let mut reader = client.new_multi_reader();
            for job in chunk {
                reader
                    .add_get_data(&self.paths.of(Kind::Lock, job))
                    .map_err(|e| self.err(e))?;
            }
            reader
                .add_get_children(&self.paths.under("live"))
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
                                self.paths.of(Kind::Lock, job)
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

    pub(super) fn short_answer(&self, got: usize, sent: usize) -> StoreError {
        StoreError::Backend {
            store: self.url.redacted().into(),
            reason: format!("{got} answers to {sent} reads"),
        }
    }

    /// Writes `writes` (job, new data, version read or none when absent) as
    /// one multi per chunk. `Ok(None)` when all went through, `Ok(Some(i))`
    /// when write `i` found its node changed (nothing of its chunk was
    /// applied, earlier chunks were).
    pub(super) async fn write_locks(
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
                let path = self.paths.of(Kind::Lock, job);
                match version {
                    Some(v) => writer.add_set_data(&path, &json, Some(*v)),
                    None => writer.add_create(&path, &json, &persistent),
                }
                .map_err(|e| self.err(e))?;
                of_write.push(w);
                if let Some(name) = &data.announce {
                    writer
                        .add_create(&self.paths.of(Kind::Trigger, name), b"", &persistent)
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
    pub(super) async fn read_decide_write<A>(
        &self,
        jobs: &[&str],
        owners: &[&str],
        decide_one: impl FnMut(usize, &Node, i64, &str) -> (Option<LockData>, A),
    ) -> Result<Vec<A>, StoreError> {
        // Nothing to decide: no call (a node holding nothing releases nothing).
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        self.read_decide_write_beating(jobs, owners, None, decide_one)
            .await
            .map(|(_, answers, _)| answers)
    }

    /// [`ZkStore::read_decide_write`] with `beat` in its clock write
    /// ([`ZkStore::tick_beating`]); once that went through, the live nodes
    /// are read while the claims are decided and written, and come back
    /// with the answers.
    pub(super) async fn read_decide_write_beating<A>(
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
    pub(super) async fn decide_and_write<A>(
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
    pub(super) async fn claim_with(
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
                cas::verdict(decide(&row_of(node, now), req), req, |grant| {
                    let kept = match node {
                        Node::Present(d, _) => Some(&d.marks),
                        _ => None,
                    };
                    Ok(LockData {
                        owner: Some(req.owner.as_str().to_string()),
                        expires_at: grant.expires_at,
                        session: Some(session.to_string()),
                        marks: JobMarks::claimed(
                            kept,
                            grant.fence,
                            grant.last_occurrence,
                            grant.manual,
                            now,
                        ),
                        announce: None,
                    })
                })
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
                over.then(|| self.paths.trigger(req.job.as_str(), id))
            })
            .collect();
        if !done.is_empty()
            && let Ok(client) = self.client().await
        {
            for path in done {
                let _ = self
                    .idempotent(client.delete(&path, None), zk::Error::NoNode)
                    .await;
            }
        }
        let claimed = Claimed {
            store_now: from_ms(now),
            outcomes,
        };
        Ok((claimed, live))
    }
}
