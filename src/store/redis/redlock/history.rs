//! Run history, written to every master and read from a majority.

use super::*;

#[async_trait]
impl History for RedlockStore {
    async fn record_runs(&self, runs: &[RunRecord], keep: u32) -> Result<(), StoreError> {
        if runs.is_empty() {
            return Ok(());
        }
        let (keys, args) = record_args(runs, keep, &self.prefix);
        let (k, a) = (&keys, &args);
        let answers = self
            .each(|m| self.eval_on::<i64>(m, &self.record, k, a))
            .await;
        self.quorum(answers).map(|_| ())
    }

    async fn history(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let answers = self.each(|m| self.runs_on(m, job, limit)).await;
        // A run is on a majority at least: the union of a majority's
        // histories has every run, once per (job, fence).
        let mut seen = HashSet::new();
        let mut runs: Vec<RunRecord> = Vec::new();
        let mut answered = self.quorum(answers)?;
        // The most complete history first, so its copy of a run is kept.
        answered.sort_by_key(|(_, r)| Reverse(r.len()));
        for (_, list) in answered {
            for run in list {
                if seen.insert((run.job.clone(), run.fence)) {
                    runs.push(run);
                }
            }
        }
        newest_first(&mut runs, limit);
        Ok(runs)
    }
}

impl RedlockStore {
    pub(super) async fn runs_on(
        &self,
        master: &Master,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let keys = match job {
            Some(job) => vec![self.key(job.as_str(), "runs")],
            None => self.scan_on(master, "runs").await?,
        };
        let mut conn = master.connection(self.op_timeout).await?;
        stream_runs(&mut conn, &self.prefix, &keys, limit)
            .await
            .map_err(|e| store_error(&master.url, &e))
    }
}
