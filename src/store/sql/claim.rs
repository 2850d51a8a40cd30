//! Claims: one short transaction per batch that locks the batch's rows
//! (creating missing ones), decides each request on its row with the
//! database's clock, and writes the changed rows back.

use super::*;

/// What a locking transaction does with the rows of its batch.
#[derive(Clone, Copy)]
pub(super) enum Locked<'a> {
    /// Claims, and the node's heartbeat when it rides along.
    Claim(&'a [ClaimRequest], Option<&'a Heartbeat>),
    Renew(&'a Owner, &'a [Renewal]),
    /// A manual run's request ([`trigger_row`]).
    Trigger(&'a JobName, TriggerId),
}

/// The answer of a locking transaction.
pub(super) enum Answer {
    /// The claims, and the live nodes when a heartbeat rode along.
    Claimed(Claimed, Option<Vec<NodeRecord>>),
    Renewed(Vec<bool>),
    Triggered(TriggerAnswer),
}

/// Test-only: a claim batch that finds the file named by
/// `CRONLEASE_FAILPOINT_STOP_FILE` removes it and stops the whole process
/// (SIGSTOP) inside its transaction, after reading its rows: a node frozen
/// at the worst moment, once, until the test sends SIGCONT.
#[cfg(feature = "failpoints")]
pub(super) fn stop_failpoint() {
    let Some(path) = std::env::var_os("CRONLEASE_FAILPOINT_STOP_FILE") else {
        return;
    };
    if std::fs::remove_file(&path).is_ok() {
        tracing::warn!("failpoint: stopping inside a claim transaction");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
    }
}

/// How long the server lets a transaction of ours sit idle before ending
/// it: half of `op_timeout` (1 s by default), at least 100 ms. A batch's
/// statements follow each other within milliseconds when the node is
/// well, so a node frozen or cut off inside a transaction gets there, and
/// its peers wait that long for the rows it locked. A quarter was too
/// short: while 1,000 jobs start at once, a node's history transaction
/// waited 500 ms for a worker between its two statements, and the server
/// ended it.
#[cfg(any(feature = "mysql", feature = "postgres"))]
pub(super) fn idle_limit_ms(op_ms: i64) -> i64 {
    (op_ms / 2).max(100)
}

impl SqlStore {
    /// One locking transaction for a batch ([`Locked`]), retried while it
    /// fails for a transient reason.
    pub(super) async fn locked(&self, op: Locked<'_>) -> Result<Answer, sqlx::Error> {
        loop {
            if let Ok(answer) = self.retrying(|| self.locked_in_tx(op)).await? {
                return Ok(answer);
            }
            // Rows still missing: a concurrent reset of the table. Again.
        }
    }

    /// One locking transaction, or the jobs whose rows do not exist yet. Those
    /// get theirs first, on the same connection (a fresh one costs ~100 ms on
    /// PostgreSQL) and outside any transaction (concurrent inserts of one new
    /// key inside transactions deadlock on MySQL), then the transaction runs
    /// again.
    ///
    /// The connection goes back to the pool only in a known state: after a
    /// failed commit or rollback (a full disk, a dropped link) it may still
    /// be inside a transaction, and handing it out again would fail every
    /// later claim ("non-zero transaction depth"), so it is closed instead.
    pub(super) async fn locked_in_tx(
        &self,
        op: Locked<'_>,
    ) -> Result<Result<Answer, Vec<String>>, sqlx::Error> {
        let mut conn = self.pool().acquire().await?;
        let (mut result, mut clean) = self.locked_on(&mut conn, op, false).await;
        if clean && let Ok(Err(missing)) = &result {
            if let Err(e) = self.seed_rows(&mut conn, missing).await {
                if !is_transient(&e) {
                    conn.close_on_drop();
                }
                return Err(e);
            }
            (result, clean) = self.locked_on(&mut conn, op, true).await;
        }
        if !clean {
            conn.close_on_drop();
        }
        result
    }

    /// Inserts empty lock rows for `names`, skipping those that exist.
    pub(super) async fn seed_rows(
        &self,
        conn: &mut AnyConnection,
        names: &[String],
    ) -> Result<(), sqlx::Error> {
        for chunk in names.chunks(CHUNK) {
            let q = self.sql(self.batch().seed_rows(chunk.len()), None)?;
            let mut query = sqlx::query(q);
            for name in chunk {
                query = query.bind(name.clone());
            }
            query.execute(&mut *conn).await?;
        }
        Ok(())
    }

    /// [`Self::locked_in_tx`] on one connection; also says whether the
    /// connection is known to be outside any transaction.
    pub(super) async fn locked_on(
        &self,
        conn: &mut AnyConnection,
        op: Locked<'_>,
        seeded: bool,
    ) -> (Result<Result<Answer, Vec<String>>, sqlx::Error>, bool) {
        let t0 = std::time::Instant::now();
        let mut tx = match conn.begin_with(self.dialect.begin).await {
            Ok(tx) => tx,
            // A busy database refuses BEGIN before anything started.
            Err(e) => {
                let clean = is_transient(&e);
                return (Err(e), clean);
            }
        };
        let t1 = std::time::Instant::now();
        let decided = self.decide_in_tx(&mut tx, op, seeded).await;
        let t2 = std::time::Instant::now();
        let ended = match &decided {
            Ok(Ok(_)) => tx.commit().await,
            _ => tx.rollback().await,
        };
        tracing::debug!(
            begin_ms = (t1 - t0).as_secs_f64() * 1e3,
            decide_ms = (t2 - t1).as_secs_f64() * 1e3,
            end_ms = t2.elapsed().as_secs_f64() * 1e3,
            "store transaction"
        );
        let clean = ended.is_ok()
            && !conn.is_in_transaction()
            && decided.as_ref().err().is_none_or(is_transient);
        match (decided, ended) {
            (Err(e), _) | (Ok(_), Err(e)) => (Err(e), clean),
            (Ok(decided), Ok(())) => (Ok(decided), clean),
        }
    }

    /// Reads and locks the rows of `names` (sorted), chunk by chunk in name
    /// order, so two batches can never deadlock. A row that cannot be read
    /// is reported by name, to fail only its own request.
    pub(super) async fn lock_rows(
        &self,
        tx: &mut AnyConnection,
        names: &[&str],
        file_now: Option<i64>,
    ) -> Result<BTreeMap<String, Result<LockRow, String>>, sqlx::Error> {
        let mut rows = BTreeMap::new();
        let queries: Vec<sqlx::query::Query<'_, sqlx::Any, _>> =
            match self.batch().lock_rows_from_json() {
                Some(text) => {
                    let json = serde_json::to_string(names)
                        .map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
                    vec![sqlx::query(self.sql(text, file_now)?).bind(json)]
                }
                None => names
                    .chunks(CHUNK)
                    .map(|chunk| {
                        let q = self.sql(self.batch().lock_rows(chunk.len()), file_now)?;
                        let mut query = sqlx::query(q);
                        for name in chunk {
                            query = query.bind(name.to_string());
                        }
                        Ok(query)
                    })
                    .collect::<Result<_, sqlx::Error>>()?,
            };
        for query in queries {
            for r in query.fetch_all(&mut *tx).await? {
                let name: String = r.try_get(0)?;
                let row = (|| -> Result<LockRow, sqlx::Error> {
                    Ok(LockRow {
                        owner: r.try_get(1)?,
                        fence: r.try_get(2)?,
                        expires_at: r.try_get(3)?,
                        last_occurrence: r.try_get(4)?,
                        running: r.try_get::<i64, _>(5)? != 0,
                        now: r.try_get(6)?,
                        paused: r.try_get::<i64, _>(7)? != 0,
                        trigger: r.try_get(8)?,
                        last_trigger: r.try_get(9)?,
                    })
                })()
                .map_err(|e| format!("the lock row of job {name} cannot be read: {e}"));
                rows.insert(name, row);
            }
        }
        // MySQL's default collation ignores case: a job renamed only by
        // case (`Backup` → `backup`) reads the row stored under the old
        // spelling, and writes it back under the same key.
        for name in names {
            if !rows.contains_key(*name) {
                let other = rows
                    .keys()
                    .find(|k| k.eq_ignore_ascii_case(name) && !names.contains(&k.as_str()))
                    .cloned();
                if let Some(row) = other.and_then(|k| rows.get(&k).cloned()) {
                    rows.insert(name.to_string(), row);
                }
            }
        }
        Ok(rows)
    }

    /// Writes whole lock rows (locked by this transaction), many per statement.
    pub(super) async fn write_rows(
        &self,
        tx: &mut AnyConnection,
        rows: &[(&str, &LockRow)],
    ) -> Result<(), sqlx::Error> {
        if rows.is_empty() {
            return Ok(());
        }
        if let Some(text) = self.batch().write_rows_from_json() {
            let json: Vec<serde_json::Value> = rows
                .iter()
                .map(|(name, row)| {
                    serde_json::json!({
                        "lock_name": name,
                        "owner": row.owner,
                        "fence": row.fence,
                        "expires_at": row.expires_at,
                        "last_occurrence": row.last_occurrence,
                        "modified_at": row.now,
                        "running": i64::from(row.running),
                        "trigger_id": row.trigger,
                        "last_trigger": row.last_trigger,
                    })
                })
                .collect();
            let q = self.sql(text, Some(0))?;
            sqlx::query(q)
                .bind(serde_json::Value::Array(json).to_string())
                .execute(&mut *tx)
                .await?;
            return Ok(());
        }
        for chunk in rows.chunks(CHUNK) {
            let q = self.sql(self.batch().write_rows(chunk.len()), Some(0))?;
            let mut query = sqlx::query(q);
            for (name, row) in chunk {
                query = query
                    .bind(name.to_string())
                    .bind(row.owner.clone())
                    .bind(row.fence)
                    .bind(row.expires_at)
                    .bind(row.last_occurrence)
                    .bind(row.now)
                    .bind(i64::from(row.running))
                    .bind(row.trigger)
                    .bind(row.last_trigger);
            }
            query.execute(&mut *tx).await?;
        }
        Ok(())
    }

    /// The body of a locking transaction: lock every row of the batch at
    /// once, decide each request on its own row with the pure rule, write
    /// the changed rows in multi-row statements.
    pub(super) async fn decide_in_tx(
        &self,
        tx: &mut AnyConnection,
        op: Locked<'_>,
        seeded: bool,
    ) -> Result<Result<Answer, Vec<String>>, sqlx::Error> {
        self.check_sqlite_file()?;
        let mut names: Vec<&str> = match op {
            Locked::Claim(requests, _) => requests.iter().map(|r| r.job.as_str()).collect(),
            Locked::Renew(_, renewals) => renewals.iter().map(|r| r.job.as_str()).collect(),
            Locked::Trigger(job, _) => vec![job.as_str()],
        };
        names.sort_unstable();
        names.dedup();
        // SQLite's transaction takes no lock before its first write (which
        // fails as busy, and the whole transaction is tried again, if another
        // node wrote since these rows were read), so its clock is read after
        // the rows: later than every decision they show.
        let placeholder = self.file_clock.as_ref().map(|_| 0);
        let locking = std::time::Instant::now();
        let mut rows = self.lock_rows(tx, &names, placeholder).await?;
        tracing::debug!(
            rows = names.len(),
            lock_ms = locking.elapsed().as_secs_f64() * 1e3,
            "store rows locked"
        );
        #[cfg(feature = "failpoints")]
        if matches!(op, Locked::Claim(..)) {
            stop_failpoint();
        }
        let file_now = self.file_clock_now()?;
        if let Some(now) = file_now {
            for row in rows.values_mut().flatten() {
                row.now = now;
            }
        }
        let mut changed: BTreeMap<&str, ()> = BTreeMap::new();
        let answer = match op {
            Locked::Claim(requests, _) => {
                let missing: Vec<String> = names
                    .iter()
                    .filter(|n| !rows.contains_key(**n))
                    .map(|n| n.to_string())
                    .collect();
                // Rows still missing after seeding them (a table emptied
                // meanwhile) fail their own requests below, never loop.
                if !missing.is_empty() && !seeded {
                    return Ok(Err(missing));
                }
                let outcomes = claim_locked(&mut rows, requests, &mut changed);
                let read_now = rows.values().flatten().map(|r| r.now).next();
                let store_now = match (file_now, read_now) {
                    (Some(now), _) | (None, Some(now)) => now,
                    // No row could be read: ask the database, never report
                    // a clock of 1970 (the node would think itself skewed).
                    (None, None) => {
                        sqlx::query_scalar(self.queries.clock.clone())
                            .fetch_one(&mut *tx)
                            .await?
                    }
                };
                Answer::Claimed(
                    Claimed {
                        store_now: from_ms(store_now),
                        outcomes,
                    },
                    None,
                )
            }
            Locked::Renew(owner, renewals) => {
                Answer::Renewed(renew_locked(&mut rows, owner, renewals, &mut changed))
            }
            Locked::Trigger(job, id) => match rows.get_mut(job.as_str()) {
                Some(Ok(row)) => {
                    let answer = trigger_row(row, id);
                    if answer == TriggerAnswer::Accepted {
                        changed.insert(job.as_str(), ());
                    }
                    Answer::Triggered(answer)
                }
                Some(Err(bad)) => return Err(sqlx::Error::Protocol(bad.clone())),
                None if !seeded => return Ok(Err(vec![job.to_string()])),
                None => return Err(sqlx::Error::RowNotFound),
            },
        };
        let writes: Vec<(&str, &LockRow)> = changed
            .keys()
            .filter_map(|name| match rows.get(*name) {
                Some(Ok(row)) => Some((*name, row)),
                _ => None,
            })
            .collect();
        self.write_rows(tx, &writes).await?;
        let answer = match (answer, op) {
            // The beat commits with the claims; the rows of the batch are
            // locked first, so the registry row comes last in every
            // transaction's lock order. Long-dead records are left to the
            // heartbeat on its own (a scan here could deadlock two batches).
            (Answer::Claimed(claimed, _), Locked::Claim(_, Some(beat))) => {
                Answer::Claimed(claimed, Some(self.beat_on(tx, beat, false).await?))
            }
            (answer, _) => answer,
        };
        Ok(Ok(answer))
    }
}

/// Decides each claim of `requests` on its locked row, in job-name order (a
/// job named twice sees its first request's write), writing each winner
/// into its row and naming it in `changed`.
fn claim_locked<'r>(
    rows: &mut BTreeMap<String, Result<LockRow, String>>,
    requests: &'r [ClaimRequest],
    changed: &mut BTreeMap<&'r str, ()>,
) -> Vec<ClaimOutcome> {
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by(|&a, &b| requests[a].job.cmp(&requests[b].job));
    let mut outcomes: Vec<Option<ClaimOutcome>> = vec![None; requests.len()];
    for i in order {
        let req = &requests[i];
        let job = req.job.as_str();
        let outcome = match rows.get_mut(job) {
            Some(Ok(row)) => {
                let outcome = claim_row(row, req);
                if matches!(outcome, ClaimOutcome::Won(_)) {
                    changed.insert(job, ());
                }
                outcome
            }
            Some(Err(bad)) => ClaimOutcome::Failed(bad.clone()),
            None => ClaimOutcome::Failed(format!("no lock row for job {job}")),
        };
        outcomes[i] = Some(outcome);
    }
    outcomes.into_iter().flatten().collect()
}

/// Extends each lease of `renewals` that `owner` still holds on its locked
/// row, naming it in `changed`; answers, in order, which were.
fn renew_locked<'r>(
    rows: &mut BTreeMap<String, Result<LockRow, String>>,
    owner: &Owner,
    renewals: &'r [Renewal],
    changed: &mut BTreeMap<&'r str, ()>,
) -> Vec<bool> {
    renewals
        .iter()
        .map(|renewal| {
            let job = renewal.job.as_str();
            match rows.get_mut(job) {
                Some(Ok(row))
                    if row.owner.as_deref() == Some(owner.as_str()) && row.expires_at > row.now =>
                {
                    row.expires_at = row.now.saturating_add(duration_ms(renewal.lease));
                    changed.insert(job, ());
                    true
                }
                _ => false,
            }
        })
        .collect()
}
