//! Keys read by scan: each job's lock for `status`, and the run streams
//! `history` reads, several per pipeline.

use super::*;

/// One server's view of one job's lock, for `status`.
pub(super) struct ServerLock {
    pub(super) job: String,
    pub(super) fence: u64,
    pub(super) last: Option<i64>,
    /// The last claimer (the state hash's owner).
    pub(super) owner: Option<String>,
    /// The live lease's owner and its time left (ms).
    pub(super) holder: Option<String>,
    pub(super) pttl: i64,
    /// The pause mark and the generation it was written with (Redlock
    /// keeps the mark of the highest generation a majority reports).
    pub(super) paused: bool,
    #[cfg_attr(not(feature = "redlock"), allow(dead_code))]
    pub(super) pause_gen: i64,
}

/// Every job's lock on one server: its keys found by SCAN, then read in one
/// pipeline. `err` turns a driver error into the store's.
pub(super) async fn server_locks(
    conn: &mut ConnectionManager,
    prefix: &str,
    url: &StoreUrl,
    err: impl Fn(redis::RedisError) -> StoreError,
) -> Result<Vec<ServerLock>, StoreError> {
    let keys = scan_keys(conn, prefix, "state").await.map_err(&err)?;
    let jobs: Vec<String> = keys
        .iter()
        .filter_map(|k| job_of(prefix, k, "state"))
        .collect();
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for job in &jobs {
        pipe.cmd("HMGET")
            .arg(job_key(prefix, job, "state"))
            .arg("fence")
            .arg("last_occurrence")
            .arg("owner")
            .arg("paused")
            .arg("pause_gen");
        pipe.cmd("GET").arg(job_key(prefix, job, "lease"));
        pipe.cmd("PTTL").arg(job_key(prefix, job, "lease"));
    }
    let replies: Vec<redis::Value> = pipe.query_async(conn).await.map_err(&err)?;
    let mut out = Vec::with_capacity(jobs.len());
    for (job, chunk) in jobs.into_iter().zip(replies.chunks(3)) {
        let [state, holder, pttl] = chunk else {
            continue;
        };
        let malformed = |e: redis::ParsingError| StoreError::Backend {
            store: url.redacted().into(),
            reason: format!("unexpected reply for {job}: {e}"),
        };
        let state: StateFields = redis::from_redis_value(state.clone()).map_err(malformed)?;
        out.push(ServerLock {
            fence: state.0.and_then(|f| f.parse().ok()).unwrap_or(0),
            last: state.1,
            owner: state.2,
            paused: state.3.as_deref() == Some("1"),
            pause_gen: state.4.and_then(|g| g.parse().ok()).unwrap_or(0),
            holder: redis::from_redis_value(holder.clone()).map_err(malformed)?,
            pttl: redis::from_redis_value(pttl.clone()).map_err(malformed)?,
            job,
        });
    }
    Ok(out)
}

/// Every job's key of `kind` under `prefix` (SCAN), sorted.
pub(super) async fn scan_keys(
    conn: &mut ConnectionManager,
    prefix: &str,
    kind: &str,
) -> redis::RedisResult<Vec<String>> {
    let pattern = format!("{}{{*}}:{kind}", glob_escape(prefix));
    let mut cursor: u64 = 0;
    let mut keys = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    keys.sort();
    keys.dedup();
    Ok(keys)
}

/// The job a key of `kind` under `prefix` belongs to.
pub(super) fn job_of(prefix: &str, key: &str, kind: &str) -> Option<String> {
    key.strip_prefix(prefix)?
        .strip_prefix('{')?
        .strip_suffix(&format!("}}:{kind}"))
        .map(str::to_string)
}

/// How many run streams one pipeline reads: `history` over every job costs
/// a SCAN and one round trip per this many jobs, not one per job.
pub(super) const STREAMS_PER_PIPELINE: usize = 200;

/// The newest `limit` runs of each stream in `keys`, read in pipelines of
/// [`STREAMS_PER_PIPELINE`] keys.
pub(super) async fn stream_runs(
    conn: &mut ConnectionManager,
    prefix: &str,
    keys: &[String],
    limit: u32,
) -> redis::RedisResult<Vec<RunRecord>> {
    let mut runs = Vec::new();
    for chunk in keys.chunks(STREAMS_PER_PIPELINE) {
        let mut pipe = redis::pipe();
        for key in chunk {
            pipe.cmd("XREVRANGE")
                .arg(key)
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(limit);
        }
        let replies: Vec<StreamEntries> = pipe.query_async(conn).await?;
        for (key, entries) in chunk.iter().zip(replies) {
            runs.extend(runs_of_stream(prefix, key, entries));
        }
    }
    Ok(runs)
}

/// The runs in the reply of the run stream `key`; an entry this version
/// cannot read is kept as a malformed one, never an error.
pub(crate) fn runs_of_stream(prefix: &str, key: &str, entries: StreamEntries) -> Vec<RunRecord> {
    let job = job_of(prefix, key, "runs").unwrap_or_default();
    entries
        .into_iter()
        .map(|(id, fields)| {
            run_from_fields(&fields).unwrap_or_else(|| malformed_run(&job, &id, &fields))
        })
        .collect()
}

pub(super) fn run_from_fields(f: &HashMap<String, String>) -> Option<RunRecord> {
    let int = |k: &str| f.get(k).and_then(|v| v.parse::<i64>().ok());
    Some(RunRecord {
        job: f.get("job")?.clone(),
        fence: int("fence")?.max(0) as u64,
        owner: f.get("owner")?.clone(),
        node: f.get("node")?.clone(),
        occurrence: from_ms(int("occurrence")?),
        started_at: from_ms(int("started_at")?),
        finished_at: from_ms(int("finished_at")?),
        outcome: Outcome::parse(f.get("outcome")?),
        exit_code: f.get("exit_code").and_then(|c| c.parse().ok()),
        takeover: int("takeover")? != 0,
        delay_ms: int("delay_ms")?.max(0) as u64,
        decision_ms: int("decision_ms").unwrap_or(0).max(0) as u64,
        output: f.get("output").cloned().unwrap_or_default(),
        trigger: int("trigger").and_then(TriggerId::from_stored),
        cpu_ms: f.get("cpu_ms").and_then(|v| v.parse().ok()),
        memory_peak: f.get("memory_peak").and_then(|v| v.parse().ok()),
    })
}

/// A history entry this version cannot read (a hand edit, a newer
/// version's fields): shown as `unknown(malformed entry ID)` rather than
/// failing the whole listing. Its time is the stream id's.
pub(super) fn malformed_run(job: &str, id: &str, f: &HashMap<String, String>) -> RunRecord {
    let at = from_ms(
        id.split('-')
            .next()
            .and_then(|ms| ms.parse().ok())
            .unwrap_or_default(),
    );
    let text = |k: &str| f.get(k).cloned().unwrap_or_default();
    RunRecord {
        job: job.to_string(),
        fence: f.get("fence").and_then(|v| v.parse().ok()).unwrap_or(0),
        owner: text("owner"),
        node: text("node"),
        occurrence: at,
        started_at: at,
        finished_at: at,
        outcome: Outcome::Unknown(format!("malformed entry {id}")),
        exit_code: None,
        takeover: false,
        delay_ms: 0,
        decision_ms: 0,
        output: String::new(),
        trigger: None,
        cpu_ms: None,
        memory_peak: None,
    }
}

#[async_trait]
impl History for RedisStore {
    async fn record_runs(&self, runs: &[RunRecord], keep: u32) -> Result<(), StoreError> {
        if runs.is_empty() {
            return Ok(());
        }
        let (keys, args) = record_args(runs, keep, &self.prefix);
        let _added: i64 = self.eval(&self.record, &keys, &args).await?;
        Ok(())
    }

    async fn history(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let keys = match job {
            Some(job) => vec![self.key(job.as_str(), "runs")],
            None => self.scan("runs").await?,
        };
        let mut runs = self.read_runs(&keys, limit).await?;
        newest_first(&mut runs, limit);
        Ok(runs)
    }

    /// Each job's run stream read for its newest entry, pipelined.
    async fn last_runs(&self, jobs: &[JobName]) -> Result<Vec<Option<RunRecord>>, StoreError> {
        let keys: Vec<String> = jobs.iter().map(|j| self.key(j.as_str(), "runs")).collect();
        let runs = self.read_runs(&keys, 1).await?;
        Ok(crate::store::in_job_order(jobs, runs))
    }
}

impl RedisStore {
    pub(super) async fn scan(&self, kind: &str) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn().await?;
        scan_keys(&mut conn, &self.prefix, kind)
            .await
            .map_err(|e| self.err(e))
    }

    pub(super) async fn read_runs(
        &self,
        keys: &[String],
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let mut conn = self.conn().await?;
        stream_runs(&mut conn, &self.prefix, keys, limit)
            .await
            .map_err(|e| self.err(e))
    }
}
