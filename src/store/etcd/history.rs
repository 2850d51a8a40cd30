//! Run history: one key per run under `runs/<job>/`, trimmed to the
//! job's limit, read newest first.

use super::*;

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
            let key = self.keys.run(&run.job, run.fence);
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
        let root = self.keys.of(Kind::Runs, "");
        let under = match job {
            Some(j) => self.keys.runs_prefix(j.as_str()),
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

    /// Each job's newest run key (its prefix sorted down, one key), a few
    /// jobs per transaction as in [`History::history`], the transactions
    /// sent together.
    async fn last_runs(&self, jobs: &[JobName]) -> Result<Vec<Option<RunRecord>>, StoreError> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let client = self.client().await?;
        let root = self.keys.of(Kind::Runs, "");
        let newest = || {
            GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Key, SortOrder::Descend)
                .with_limit(1)
        };
        let reads = jobs.chunks(RUNS_PER_READ).map(|chunk| {
            let ops = chunk
                .iter()
                .map(|job| TxnOp::get(self.keys.runs_prefix(job.as_str()), Some(newest())))
                .collect();
            self.batch(&client, ops)
        });
        let answers: Vec<TxnOpResponse> =
            try_join_all(reads).await?.into_iter().flatten().collect();
        if answers.len() != jobs.len() {
            return Err(self.backend(format!(
                "{} newest-run reads answered {}",
                jobs.len(),
                answers.len()
            )));
        }
        Ok(jobs
            .iter()
            .zip(&answers)
            .map(|(job, answer)| {
                let TxnOpResponse::Get(got) = answer else {
                    return None;
                };
                let kv = got.kvs().first()?;
                let name = kv
                    .key()
                    .strip_prefix(root.as_bytes())
                    .and_then(|rest| rest.strip_prefix(job.as_str().as_bytes()))
                    .and_then(|rest| rest.strip_prefix(b"/"))
                    .map(|n| String::from_utf8_lossy(n).into_owned())?;
                Some(run_from_json(job.as_str(), &name, kv.value(), 0))
            })
            .collect())
    }
}

impl EtcdStore {
    /// Deletes each job's oldest runs beyond `keep`: a count of each job's
    /// runs, then the keys of the surplus only (oldest first, at most
    /// [`TRIM_PAGE`] per job and call, so an answer stays small whatever
    /// `keep` is; a larger surplus, after `history_limit` was lowered, goes
    /// over the next writes), then one range delete per job up to its newest
    /// surplus key.
    pub(super) async fn trim(
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
                TxnOp::get(self.keys.runs_prefix(job), Some(options))
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
                TxnOp::get(self.keys.runs_prefix(job), Some(options))
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
                deletes.push(TxnOp::delete(self.keys.runs_prefix(job), Some(below)));
            }
        }
        if !deletes.is_empty() {
            self.batch(client, deletes).await?;
        }
        Ok(())
    }
}
