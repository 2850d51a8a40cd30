//! Run history: a node per run under `runs/<job>/`, trimmed to the job's
//! limit, read newest first; recording a run clears its running mark.

use super::*;

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
            let path = self.paths.run(&run.job, run.fence);
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
            self.trim_children(client, &self.paths.of(Kind::Runs, job), keep)
                .await?;
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
                self.timed(client.list_children(&self.paths.dir(Kind::Runs)))
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

impl ZkStore {
    /// Deletes the children of `dir` before its newest `keep` (by name:
    /// runs by fence, audit entries by id), each delete idempotent.
    pub(super) async fn trim_children(
        &self,
        client: &zk::Client,
        dir: &str,
        keep: u32,
    ) -> Result<(), StoreError> {
        let mut names = self.timed(client.list_children(dir)).await?;
        let keep = keep.max(1) as usize;
        if names.len() <= keep {
            return Ok(());
        }
        names.sort_unstable();
        let surplus = names.len() - keep;
        let deleted = futures_util::future::join_all(names[..surplus].iter().map(|n| {
            let path = format!("{dir}/{n}");
            async move {
                self.idempotent(client.delete(&path, None), zk::Error::NoNode)
                    .await
            }
        }))
        .await;
        deleted.into_iter().collect::<Result<Vec<()>, _>>()?;
        Ok(())
    }

    pub(super) async fn ensure_run_dir(
        &self,
        client: &zk::Client,
        job: &str,
    ) -> Result<(), StoreError> {
        let path = self.paths.of(Kind::Runs, job);
        if self.known_dir(&path) {
            return Ok(());
        }
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        self.timed(client.mkdir(&path, &persistent)).await?;
        lock(&self.run_dirs).insert(path);
        Ok(())
    }

    pub(super) fn known_dir(&self, path: &str) -> bool {
        lock(&self.run_dirs).contains(path)
    }

    pub(super) async fn job_runs(
        &self,
        client: &zk::Client,
        job: &str,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let mut names = match self
            .timed(client.list_children(&self.paths.of(Kind::Runs, job)))
            .await
        {
            Ok(n) => n,
            Err(StoreError::NotMigrated { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        names.sort_unstable_by(|a, b| b.cmp(a));
        names.truncate(limit as usize);
        // A few runs per multi read, the reads sent together: an answer
        // stays far below ZooKeeper's 1 MiB packet limit (`jute.maxbuffer`)
        // with the largest output tails.
        let dir = self.paths.of(Kind::Runs, job);
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
        Ok(futures_util::future::try_join_all(reads)
            .await?
            .into_iter()
            .flatten()
            .collect())
    }

    /// Clears the running mark of each lock whose last claim's run is among
    /// `runs` (recorded already), each at the version read
    /// ([`cas::ended_runs`]).
    pub(super) async fn end_running_marks(
        &self,
        client: &zk::Client,
        runs: &[RunRecord],
    ) -> Result<(), StoreError> {
        let session = Self::session_tag(client);
        let (jobs, ended) = cas::ended_runs(runs);
        if jobs.is_empty() {
            return Ok(());
        }
        let nodes = self.read_locks(client, &jobs).await?;
        // The clock is not read: clearing a mark decides on the node alone.
        self.decide_and_write(client, &jobs, &nodes, 0, &session, &mut |i, node, _, _| {
            let Node::Present(d, _) = node else {
                return (None, ());
            };
            let ends = d.marks.running
                && d.marks
                    .fence()
                    .is_some_and(|f| crate::store::clears_running(ended[i], f));
            if !ends {
                return (None, ());
            }
            let mut d = d.clone();
            d.marks.running = false;
            (Some(d), ())
        })
        .await
        .map(|_| ())
    }
}
