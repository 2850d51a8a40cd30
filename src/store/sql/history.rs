//! Run history: one row per (job, fence), trimmed to the job's limit.

use super::*;

pub(crate) fn run_from_row(r: &AnyRow) -> Result<RunRecord, sqlx::Error> {
    let outcome: String = r.try_get(7)?;
    Ok(RunRecord {
        job: r.try_get(0)?,
        fence: r.try_get::<i64, _>(1)?.max(0) as u64,
        owner: r.try_get(2)?,
        node: r.try_get(3)?,
        occurrence: from_ms(r.try_get(4)?),
        started_at: from_ms(r.try_get(5)?),
        finished_at: from_ms(r.try_get(6)?),
        outcome: Outcome::parse(&outcome),
        exit_code: r.try_get::<Option<i64>, _>(8)?.map(|c| c as i32),
        takeover: r.try_get::<i64, _>(9)? != 0,
        delay_ms: r.try_get::<i64, _>(10)?.max(0) as u64,
        decision_ms: r.try_get::<i64, _>(11)?.max(0) as u64,
        output: r.try_get::<Option<String>, _>(12)?.unwrap_or_default(),
        trigger: r
            .try_get::<Option<i64>, _>(13)?
            .and_then(TriggerId::from_stored),
        cpu_ms: r
            .try_get::<Option<i64>, _>(14)?
            .and_then(|v| u64::try_from(v).ok()),
        memory_peak: r
            .try_get::<Option<i64>, _>(15)?
            .and_then(|v| u64::try_from(v).ok()),
    })
}

#[async_trait]
impl History for SqlStore {
    async fn record_runs(&self, runs: &[RunRecord], keep: u32) -> Result<(), StoreError> {
        if runs.is_empty() {
            return Ok(());
        }
        // Per job, the runs of the newest `keep` fences stay.
        let mut cutoffs: BTreeMap<&str, i64> = BTreeMap::new();
        for run in runs {
            let cutoff = (run.fence as i64).saturating_sub(i64::from(keep));
            let c = cutoffs.entry(run.job.as_str()).or_insert(cutoff);
            *c = (*c).max(cutoff);
        }
        let cutoffs: Vec<(&str, i64)> = cutoffs.into_iter().filter(|(_, c)| *c > 0).collect();
        let result: Result<(), sqlx::Error> = self
            .retrying(|| async {
                // A connection that failed mid-statement may be in any
                // state: it is closed, never handed out again.
                let mut conn = self.pool().acquire().await?;
                let written = self.write_runs(&mut conn, runs, &cutoffs).await;
                if written.is_err() {
                    conn.close_on_drop();
                }
                written
            })
            .await;
        result.map_err(|e| self.err(e))
    }

    async fn history(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let query = match job {
            Some(job) => {
                sqlx::query(self.queries.history_job.clone()).bind(job.as_str().to_string())
            }
            None => sqlx::query(self.queries.history_all.clone()),
        };
        let rows = query
            .bind(i64::from(limit))
            .fetch_all(&self.pool())
            .await
            .map_err(|e| self.err(e))?;
        rows.iter()
            .map(run_from_row)
            .collect::<Result<_, _>>()
            .map_err(|e| self.err(e))
    }

    /// One query per [`LAST_RUNS_PAGE`](crate::store::LAST_RUNS_PAGE) jobs,
    /// each on the `(job, id)` index.
    async fn last_runs(&self, jobs: &[JobName]) -> Result<Vec<Option<RunRecord>>, StoreError> {
        let mut runs = Vec::new();
        for page in jobs.chunks(crate::store::LAST_RUNS_PAGE) {
            let text = self
                .sql(self.batch().last_runs(page.len()), Some(0))
                .map_err(|e| self.err(e))?;
            let mut query = sqlx::query(text);
            for job in page {
                query = query.bind(job.as_str().to_string());
            }
            let rows = query
                .fetch_all(&self.pool())
                .await
                .map_err(|e| self.err(e))?;
            for row in &rows {
                runs.push(run_from_row(row).map_err(|e| self.err(e))?);
            }
        }
        Ok(crate::store::in_job_order(jobs, runs))
    }
}

impl SqlStore {
    /// Records runs and prunes in one write transaction (one fsync on SQLite).
    pub(super) async fn write_runs(
        &self,
        conn: &mut AnyConnection,
        runs: &[RunRecord],
        cutoffs: &[(&str, i64)],
    ) -> Result<(), sqlx::Error> {
        // No transaction around them: each statement stands alone (an insert
        // that skips what is recorded, a prune), so a retry after any
        // failure repeats them harmlessly, and no transaction is left idle
        // between them while the node is busy starting 1,000 jobs (the
        // server would end it: see `idle_limit_ms`).
        for chunk in crate::store::run_groups(runs, CHUNK, OUTPUT_PER_STATEMENT) {
            let mut query = sqlx::query(self.sql(self.batch().insert_runs(chunk.len()), Some(0))?);
            for run in chunk {
                query = query
                    .bind(run.job.clone())
                    .bind(run.fence as i64)
                    .bind(run.owner.clone())
                    .bind(run.node.clone())
                    .bind(to_ms(run.occurrence))
                    .bind(to_ms(run.started_at))
                    .bind(to_ms(run.finished_at))
                    .bind(run.outcome.as_str().to_string())
                    .bind(run.exit_code.map(i64::from))
                    .bind(i64::from(run.takeover))
                    .bind(run.delay_ms as i64)
                    .bind(run.decision_ms as i64)
                    .bind((!run.output.is_empty()).then(|| run.output.clone()))
                    .bind(run.trigger.map(TriggerId::get))
                    .bind(run.cpu_ms.and_then(|v| i64::try_from(v).ok()))
                    .bind(run.memory_peak.and_then(|v| i64::try_from(v).ok()));
            }
            query.execute(&mut *conn).await?;
        }
        // After the runs are in: a mark ended with its run unrecorded would
        // let a peer in early after a failed write.
        let over: Vec<&RunRecord> = runs
            .iter()
            .filter(|r| crate::store::ends_a_run(r))
            .collect();
        for chunk in over.chunks(CHUNK) {
            let mut query = sqlx::query(self.sql(self.batch().run_over(chunk.len()), Some(0))?);
            for run in chunk {
                query = query.bind(run.job.clone()).bind(run.fence as i64);
            }
            query.execute(&mut *conn).await?;
        }
        for chunk in cutoffs.chunks(CHUNK) {
            let mut query = sqlx::query(self.sql(self.batch().prune(chunk.len()), Some(0))?);
            for (job, cutoff) in chunk {
                query = query.bind(job.to_string()).bind(*cutoff);
            }
            query.execute(&mut *conn).await?;
        }
        Ok(())
    }
}
