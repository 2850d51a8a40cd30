//! The SQL store: one implementation of [`Store`] for SQLite, MySQL/MariaDB
//! and PostgreSQL, over sqlx's `Any` driver.
//!
//! Everything stored is an integer (milliseconds since the Unix epoch, fences)
//! or a string, so the three databases differ only in a handful of SQL
//! fragments: how to read the clock, how to start the claim transaction and
//! lock the row, how to insert a row unless it exists, and the migrations.
//! Those live in one [`Dialect`] per backend file ([`sqlite`], [`mysql`],
//! [`postgres`]), each behind its cargo feature.
//!
//! A claim is one short transaction: lock the job's row (SQLite: `BEGIN
//! IMMEDIATE`; MySQL/PostgreSQL: `SELECT ... FOR UPDATE`), read it together
//! with the database's clock, apply [`decide`], write, commit. The winner is
//! decided from the row itself, never from `rows_affected` (sqlx's MySQL
//! driver sets `CLIENT_FOUND_ROWS`, which makes that number useless here).

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyConnection, AnyPool, AssertSqlSafe, Connection, Row, SqlSafeStr, SqlStr};

use super::{
    ClaimOutcome, ClaimRequest, Claimed, Decision, LockRow, LockStatus, Outcome, Owner, RunRecord,
    Store, StoreError, decide, duration_ms, from_ms, to_ms,
};
use crate::config::{JobName, StoreConfig, StoreKind, StoreUrl, TlsFiles};

/// What differs between SQL databases.
pub struct Dialect {
    pub name: &'static str,
    /// An expression giving the database's clock in ms since the Unix epoch.
    pub now_ms: &'static str,
    /// Starts the claim transaction.
    pub begin: &'static str,
    /// Appended to the row read of a claim.
    pub lock_row: &'static str,
    /// `INSERT` of an empty lock row that does nothing if it exists
    /// (`{p}` is the table prefix, `{now}` the clock, one `?` the job).
    pub seed_row: &'static str,
    /// Placeholders are `$1, $2...` instead of `?`.
    pub numbered_params: bool,
    /// Migrations, in version order.
    pub migrations: &'static [(i64, &'static str)],
}

/// The SQL implementation of [`Store`].
pub struct SqlStore {
    /// Replaced when a SQLite file was deleted or replaced under us.
    pool: std::sync::RwLock<AnyPool>,
    make_pool: Box<dyn Fn() -> Result<AnyPool, sqlx::Error> + Send + Sync>,
    /// SQLite: the database file and the identity it had when opened.
    sqlite_file: Option<SqliteFile>,
    url: StoreUrl,
    connect_url: String,
    dialect: &'static Dialect,
    prefix: String,
    queries: Queries,
    op_timeout: Duration,
    /// SQLite's clock (the file system's); `None`: the database's own.
    file_clock: Option<FileClock>,
}

/// A SQLite database file and its (device, inode) when this store opened it.
struct SqliteFile {
    path: std::path::PathBuf,
    identity: std::sync::Mutex<Option<(u64, u64)>>,
}

/// Reads a clock kept outside the database, in ms since the Unix epoch.
type FileClock = Box<dyn Fn() -> std::io::Result<i64> + Send + Sync>;

struct Queries {
    clock: SqlStr,
    select_lock: SqlStr,
    seed_row: SqlStr,
    write_claim: SqlStr,
    renew: SqlStr,
    release: SqlStr,
    status: SqlStr,
    insert_run: SqlStr,
    prune_cutoff: SqlStr,
    prune: SqlStr,
    history_all: SqlStr,
    history_job: SqlStr,
}

const RUN_COLUMNS: &str = "job, fence, owner, node, occurrence, started_at, finished_at, outcome, exit_code, takeover, delay_ms";

impl Queries {
    fn new(d: &Dialect, p: &str) -> Self {
        let now = d.now_ms;
        let q = |sql: String| -> SqlStr {
            let sql = if d.numbered_params {
                number_params(&sql)
            } else {
                sql
            };
            AssertSqlSafe(sql).into_sql_str()
        };
        Queries {
            clock: q(format!("SELECT {now}")),
            select_lock: q(format!(
                "SELECT owner, fence, expires_at, last_occurrence, {now} AS now_ms FROM {p}lock_info WHERE lock_name = ?{}",
                d.lock_row
            )),
            seed_row: q(d.seed_row.replace("{p}", p).replace("{now}", now)),
            write_claim: q(format!(
                "UPDATE {p}lock_info SET owner = ?, fence = ?, expires_at = ?, last_occurrence = ?, modified_at = ? WHERE lock_name = ?"
            )),
            renew: q(format!(
                "UPDATE {p}lock_info SET expires_at = {now} + ?, modified_at = {now} WHERE lock_name = ? AND owner = ? AND expires_at > {now}"
            )),
            release: q(format!(
                "UPDATE {p}lock_info SET expires_at = {now}, modified_at = {now} WHERE lock_name = ? AND owner = ? AND expires_at > {now}"
            )),
            status: q(format!(
                "SELECT lock_name, owner, fence, expires_at, last_occurrence, {now} AS now_ms FROM {p}lock_info ORDER BY lock_name"
            )),
            insert_run: q(format!(
                "INSERT INTO {p}job_runs ({RUN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            )),
            prune_cutoff: q(format!(
                "SELECT id FROM {p}job_runs WHERE job = ? ORDER BY id DESC LIMIT 1 OFFSET ?"
            )),
            prune: q(format!("DELETE FROM {p}job_runs WHERE job = ? AND id <= ?")),
            history_all: q(format!(
                "SELECT {RUN_COLUMNS} FROM {p}job_runs ORDER BY id DESC LIMIT ?"
            )),
            history_job: q(format!(
                "SELECT {RUN_COLUMNS} FROM {p}job_runs WHERE job = ? ORDER BY id DESC LIMIT ?"
            )),
        }
    }
}

/// `url` with TLS query parameters added: `(name, value)` pairs.
#[cfg(any(feature = "mysql", feature = "postgres"))]
pub(crate) fn with_params(url: &str, params: &[(&str, String)]) -> String {
    let mut out = url.to_string();
    for (i, (name, value)) in params.iter().enumerate() {
        let sep = if i == 0 && !url.contains('?') {
            '?'
        } else {
            '&'
        };
        let value: String = url::form_urlencoded::byte_serialize(value.as_bytes()).collect();
        out.push_str(&format!("{sep}{name}={value}"));
    }
    out
}

/// A driver's URL parameters for TLS: the mode parameter with its values
/// for "verify against the CA" and "encrypt only", and the file parameters.
#[cfg(any(feature = "mysql", feature = "postgres"))]
pub(crate) struct TlsParamNames {
    pub mode: &'static str,
    pub verify: &'static str,
    pub require: &'static str,
    pub ca: &'static str,
    pub cert: &'static str,
    pub key: &'static str,
}

/// The URL parameters that turn `tls` on, named for one driver.
#[cfg(any(feature = "mysql", feature = "postgres"))]
pub(crate) fn tls_params(
    tls: Option<&TlsFiles>,
    names: &TlsParamNames,
) -> Vec<(&'static str, String)> {
    let Some(tls) = tls else {
        return Vec::new();
    };
    let mode = if tls.ca.is_some() {
        names.verify
    } else {
        names.require
    };
    let mut params = vec![(names.mode, mode.to_string())];
    if let Some(ca) = &tls.ca {
        params.push((names.ca, ca.display().to_string()));
    }
    if let Some((cert, key)) = &tls.client {
        params.push((names.cert, cert.display().to_string()));
        params.push((names.key, key.display().to_string()));
    }
    params
}

/// `?` → `$1, $2, ...` (none of our statements has a `?` inside a literal).
fn number_params(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut n = 0;
    for c in sql.chars() {
        if c == '?' {
            n += 1;
            out.push('$');
            out.push_str(&n.to_string());
        } else {
            out.push(c);
        }
    }
    out
}

impl SqlStore {
    /// Builds the store and its (lazy) connection pool; nothing is contacted yet.
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        sqlx::any::install_default_drivers();
        let url = config.url.clone();
        let op_ms = duration_ms(config.op_timeout).max(1);
        let (dialect, connect_url, setup): (&'static Dialect, String, Vec<String>) =
            match url.kind() {
                StoreKind::Sqlite { path } => sqlite_parts(path)?,
                StoreKind::Mysql => mysql_parts(&url, op_ms, config.tls.as_ref())?,
                StoreKind::Postgres => postgres_parts(&url, op_ms, config.tls.as_ref())?,
                StoreKind::Redis => {
                    return Err(StoreError::Backend {
                        store: url.redacted().into(),
                        reason: "not an SQL URL".into(),
                    });
                }
            };
        let file_clock = match url.kind() {
            StoreKind::Sqlite { path } => sqlite_clock(path),
            _ => None,
        };
        let setup: std::sync::Arc<[String]> = setup.into();
        let op_timeout = config.op_timeout;
        let pool_url = connect_url.clone();
        let make_pool = move || -> Result<AnyPool, sqlx::Error> {
            let setup = setup.clone();
            AnyPoolOptions::new()
                .max_connections(if dialect.name == "sqlite" { 2 } else { 4 })
                .min_connections(0)
                .acquire_timeout(op_timeout)
                .idle_timeout(Some(Duration::from_secs(300)))
                .after_connect(move |conn, _meta| {
                    let setup = setup.clone();
                    Box::pin(async move {
                        for stmt in setup.iter() {
                            sqlx::raw_sql(AssertSqlSafe(stmt.clone()))
                                .execute(&mut *conn)
                                .await?;
                        }
                        Ok(())
                    })
                })
                .connect_lazy(&pool_url)
        };
        let pool = make_pool().map_err(|e| StoreError::Backend {
            store: url.redacted().into(),
            reason: url.scrub(&e.to_string()),
        })?;
        let sqlite_file = match url.kind() {
            StoreKind::Sqlite { path } => Some(SqliteFile {
                path: path.clone(),
                identity: std::sync::Mutex::new(None),
            }),
            _ => None,
        };
        Ok(SqlStore {
            pool: std::sync::RwLock::new(pool),
            make_pool: Box::new(make_pool),
            sqlite_file,
            queries: Queries::new(dialect, &config.table_prefix),
            prefix: config.table_prefix.clone(),
            url,
            connect_url,
            dialect,
            op_timeout: config.op_timeout,
            file_clock,
        })
    }

    fn err(&self, e: sqlx::Error) -> StoreError {
        let store = self.url.redacted().to_string();
        let reason = self.url.scrub(&e.to_string());
        match &e {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => StoreError::Unavailable { store, reason },
            sqlx::Error::Database(db) => {
                let code = db.code().unwrap_or_default();
                let missing_table =
                    code == "42S02" || code == "42P01" || db.message().contains("no such table");
                if missing_table {
                    StoreError::NotMigrated { store }
                } else {
                    StoreError::Backend { store, reason }
                }
            }
            _ => StoreError::Backend { store, reason },
        }
    }

    /// The connection pool in use.
    fn pool(&self) -> AnyPool {
        match self.pool.read() {
            Ok(p) => p.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// SQLite: checks, inside a claim transaction, that the database file
    /// at the configured path is still the one this store's connections
    /// have open. A file deleted or replaced under a running node (a clean-up
    /// script, tmpfiles) would otherwise leave this node claiming in an
    /// unlinked copy while others claim in a new file: both would run every
    /// occurrence. Then the claim fails, and the pool is reopened on the
    /// file now at the path.
    fn check_sqlite_file(&self) -> Result<(), sqlx::Error> {
        use std::os::unix::fs::MetadataExt;
        let Some(file) = &self.sqlite_file else {
            return Ok(());
        };
        let now = std::fs::metadata(&file.path)
            .map(|m| (m.dev(), m.ino()))
            .ok();
        let Ok(mut known) = file.identity.lock() else {
            return Ok(());
        };
        match (*known, now) {
            (None, Some(id)) => {
                *known = Some(id);
                Ok(())
            }
            (Some(was), Some(is)) if was == is => Ok(()),
            (_, None) | (Some(_), Some(_)) => {
                *known = None;
                drop(known);
                self.reopen();
                Err(sqlx::Error::Protocol(format!(
                    "the SQLite database {} was deleted or replaced under this node: claiming nothing from the old file; reopening the one at that path (SQLite is for processes on one host sharing one file that stays in place)",
                    file.path.display()
                )))
            }
        }
    }

    /// After a deleted or replaced SQLite file: fresh connections, to the
    /// file now at the path.
    fn reopen(&self) {
        match (self.make_pool)() {
            Ok(fresh) => {
                if let Ok(mut pool) = self.pool.write() {
                    let old = std::mem::replace(&mut *pool, fresh);
                    tokio::spawn(async move { old.close().await });
                }
            }
            Err(e) => tracing::error!(store = %self.url, "cannot reopen the database: {e}"),
        }
    }

    /// The store's clock for a statement about to run: `Some` for SQLite
    /// (the file-system clock), `None` where the database reads its own.
    fn file_clock_now(&self) -> Result<Option<i64>, sqlx::Error> {
        self.file_clock
            .as_ref()
            .map(|c| c().map_err(sqlx::Error::Io))
            .transpose()
    }

    /// `q` ready to run: with SQLite's `{now}` replaced by the file-system
    /// clock (read now, or `now` when given).
    fn stmt(&self, q: &SqlStr, now: Option<i64>) -> Result<SqlStr, sqlx::Error> {
        let now = match now {
            Some(now) => Some(now),
            None => self.file_clock_now()?,
        };
        Ok(match now {
            Some(now) => {
                AssertSqlSafe(q.as_str().replace("{now}", &now.to_string())).into_sql_str()
            }
            None => q.clone(),
        })
    }

    async fn read_lock(
        &self,
        conn: &mut AnyConnection,
        job: &str,
        now: Option<i64>,
    ) -> Result<Option<LockRow>, sqlx::Error> {
        let row = sqlx::query(self.stmt(&self.queries.select_lock, now)?)
            .bind(job.to_string())
            .fetch_optional(&mut *conn)
            .await?;
        row.map(|r| {
            Ok(LockRow {
                owner: r.try_get(0)?,
                fence: r.try_get(1)?,
                expires_at: r.try_get(2)?,
                last_occurrence: r.try_get(3)?,
                now: r.try_get(4)?,
            })
        })
        .transpose()
    }

    /// Runs `op` again while it fails for a transient reason (SQLite busy,
    /// a deadlock or serialization failure: the transaction was rolled back),
    /// with a short jittered pause, until `op_timeout` has passed. SQLite's
    /// own busy handler sleeps in steps of up to 100 ms; this polls finely,
    /// which keeps claims of many nodes at one instant on time.
    async fn retrying<T, F, Fut>(&self, mut op: F) -> Result<T, sqlx::Error>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
    {
        let deadline = tokio::time::Instant::now() + self.op_timeout;
        let mut attempt: u32 = 0;
        loop {
            match op().await {
                Err(e) if is_transient(&e) && tokio::time::Instant::now() < deadline => {
                    attempt += 1;
                    let mut r = [0u8; 2];
                    let _ = getrandom::fill(&mut r);
                    let spread = 500 * u64::from(attempt.min(5));
                    let pause = 500 + u64::from(u16::from_le_bytes(r)) % spread;
                    tokio::time::sleep(Duration::from_micros(pause)).await;
                }
                other => return other,
            }
        }
    }

    /// One claim transaction; a job without a row yet gets it inserted
    /// outside the transaction first (concurrent inserts of one new key inside
    /// transactions deadlock on MySQL), then the transaction starts over.
    async fn claim_rows(&self, requests: &[ClaimRequest]) -> Result<Claimed, sqlx::Error> {
        loop {
            match self.retrying(|| self.claim_in_tx(requests)).await? {
                Ok(claimed) => return Ok(claimed),
                Err(missing) => {
                    self.retrying(|| async {
                        sqlx::query(self.stmt(&self.queries.seed_row, None)?)
                            .bind(missing.clone())
                            .execute(&self.pool())
                            .await
                    })
                    .await?;
                }
            }
        }
    }

    /// Claims in one transaction, or names a job whose row does not exist.
    ///
    /// The connection goes back to the pool only in a known state: after a
    /// failed commit or rollback (a full disk, a dropped link) it may still
    /// be inside a transaction, and handing it out again would fail every
    /// later claim ("non-zero transaction depth"), so it is closed instead.
    async fn claim_in_tx(
        &self,
        requests: &[ClaimRequest],
    ) -> Result<Result<Claimed, String>, sqlx::Error> {
        let mut conn = self.pool().acquire().await?;
        let (result, clean) = self.claim_on(&mut conn, requests).await;
        if !clean {
            conn.close_on_drop();
        }
        result
    }

    /// [`Self::claim_in_tx`] on one connection; also says whether the
    /// connection is known to be outside any transaction.
    async fn claim_on(
        &self,
        conn: &mut AnyConnection,
        requests: &[ClaimRequest],
    ) -> (Result<Result<Claimed, String>, sqlx::Error>, bool) {
        let mut tx = match conn.begin_with(self.dialect.begin).await {
            Ok(tx) => tx,
            // A busy database refuses BEGIN before anything started.
            Err(e) => {
                let clean = is_transient(&e);
                return (Err(e), clean);
            }
        };
        let decided = self.decide_in_tx(&mut tx, requests).await;
        let ended = match &decided {
            Ok(Ok(_)) => tx.commit().await,
            _ => tx.rollback().await,
        };
        let clean = ended.is_ok()
            && !conn.is_in_transaction()
            && decided.as_ref().err().is_none_or(is_transient);
        match (decided, ended) {
            (Err(e), _) | (Ok(_), Err(e)) => (Err(e), clean),
            (Ok(decided), Ok(())) => (Ok(decided), clean),
        }
    }

    /// The body of a claim transaction: lock, decide and write each row.
    async fn decide_in_tx(
        &self,
        tx: &mut AnyConnection,
        requests: &[ClaimRequest],
    ) -> Result<Result<Claimed, String>, sqlx::Error> {
        // Read after BEGIN: the write lock is held, so this instant is later
        // than every decision committed before ours.
        let file_now = self.file_clock_now()?;
        self.check_sqlite_file()?;
        // Rows are locked in name order so two batches can never deadlock.
        let mut order: Vec<usize> = (0..requests.len()).collect();
        order.sort_by(|&a, &b| requests[a].job.cmp(&requests[b].job));
        let mut answers: Vec<Option<ClaimOutcome>> = vec![None; requests.len()];
        let mut store_now = file_now;
        for i in order {
            let req = &requests[i];
            let job = req.job.as_str();
            let Some(row) = self.read_lock(tx, job, file_now).await? else {
                return Ok(Err(job.to_string()));
            };
            store_now.get_or_insert(row.now);
            answers[i] = Some(match decide(&row, req) {
                Decision::Claim {
                    fence,
                    expires_at,
                    last_occurrence,
                    won,
                } => {
                    sqlx::query(self.queries.write_claim.clone())
                        .bind(req.owner.as_str().to_string())
                        .bind(fence)
                        .bind(expires_at)
                        .bind(last_occurrence)
                        .bind(row.now)
                        .bind(job.to_string())
                        .execute(&mut *tx)
                        .await?;
                    ClaimOutcome::Won(won)
                }
                Decision::Refuse(lost) => ClaimOutcome::Lost(lost),
                Decision::FenceExhausted => {
                    return Err(sqlx::Error::Protocol(super::fence_exhausted(job)));
                }
            });
        }
        Ok(Ok(Claimed {
            store_now: from_ms(store_now.unwrap_or_default()),
            outcomes: answers.into_iter().flatten().collect(),
        }))
    }

    /// Applies pending migrations on a connection of its own, under the
    /// database's migration lock, so nodes starting together do not collide.
    async fn migrate(&self) -> Result<(), sqlx::Error> {
        let mut conn = AnyConnection::connect(&self.connect_url).await?;
        let p = &self.prefix;
        let lock_key = format!("cronlease_migrate_{p}");
        let (lock, unlock): (String, String) = match self.dialect.name {
            "sqlite" => ("BEGIN IMMEDIATE".into(), "COMMIT".into()),
            "mysql" => (
                format!("SELECT GET_LOCK('{lock_key}', 30)"),
                format!("SELECT RELEASE_LOCK('{lock_key}')"),
            ),
            _ => (
                format!("BEGIN; SELECT pg_advisory_xact_lock(hashtext('{lock_key}'))"),
                "COMMIT".into(),
            ),
        };
        if self.dialect.name == "sqlite" {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "PRAGMA busy_timeout = {}",
                duration_ms(self.op_timeout).max(1000)
            )))
            .execute(&mut conn)
            .await?;
            sqlx::raw_sql("PRAGMA journal_mode = WAL")
                .execute(&mut conn)
                .await?;
        }
        sqlx::raw_sql(AssertSqlSafe(lock))
            .execute(&mut conn)
            .await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {p}cronlease_schema (version BIGINT NOT NULL PRIMARY KEY, applied_at BIGINT NOT NULL)"
        )))
        .execute(&mut conn)
        .await?;
        let applied: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT version FROM {p}cronlease_schema"
        )))
        .fetch_all(&mut conn)
        .await?;
        // Tables dropped behind our back (a restore, a hand edit) while the
        // schema table still lists their version: apply the scripts again
        // (they create only what is missing) instead of failing every call.
        let mut tables_present = true;
        for table in ["lock_info", "job_runs"] {
            let present = if self.dialect.name == "postgres" {
                // A failed statement would abort the migration's transaction.
                let probe = format!(
                    "SELECT COUNT(*) FROM (SELECT to_regclass('{p}{table}') AS t) x WHERE t IS NOT NULL"
                );
                sqlx::query_scalar::<_, i64>(AssertSqlSafe(probe))
                    .fetch_one(&mut conn)
                    .await?
                    > 0
            } else {
                let probe = format!("SELECT 1 FROM {p}{table} WHERE 1 = 0");
                sqlx::raw_sql(AssertSqlSafe(probe))
                    .execute(&mut conn)
                    .await
                    .is_ok()
            };
            tables_present &= present;
        }
        for (version, script) in self.dialect.migrations {
            if applied.contains(version) && tables_present {
                continue;
            }
            let script = script.replace("{prefix}", p);
            for stmt in split_statements(&script) {
                sqlx::raw_sql(AssertSqlSafe(stmt))
                    .execute(&mut conn)
                    .await?;
            }
            if applied.contains(version) {
                continue;
            }
            let now = match self.file_clock_now()? {
                Some(now) => now.to_string(),
                None => self.dialect.now_ms.to_string(),
            };
            let record = format!(
                "INSERT INTO {p}cronlease_schema (version, applied_at) VALUES ({version}, {now})"
            );
            sqlx::raw_sql(AssertSqlSafe(record))
                .execute(&mut conn)
                .await?;
        }
        sqlx::raw_sql(AssertSqlSafe(unlock))
            .execute(&mut conn)
            .await?;
        conn.close().await
    }
}

/// Errors after which the whole operation can simply run again.
fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            // SQLite BUSY/LOCKED (and their extended codes), SQLSTATE
            // serialization failure (MySQL deadlock 1213 too) and PostgreSQL deadlock.
            matches!(
                code.as_ref(),
                "5" | "6" | "261" | "262" | "517" | "40001" | "40P01"
            ) || db.message().contains("database is locked")
        }
        _ => false,
    }
}

/// Splits a migration script into statements, dropping `--` comments.
fn split_statements(script: &str) -> Vec<String> {
    let without_comments: String = script
        .lines()
        .map(|l| l.split("--").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    without_comments
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn run_from_row(r: &AnyRow) -> Result<RunRecord, sqlx::Error> {
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
    })
}

#[async_trait]
impl Store for SqlStore {
    async fn prepare(&self) -> Result<(), StoreError> {
        self.migrate().await.map_err(|e| self.err(e))
    }

    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Claimed, StoreError> {
        if requests.is_empty() {
            return self.clock().await.map(|store_now| Claimed {
                store_now,
                outcomes: Vec::new(),
            });
        }
        self.claim_rows(requests).await.map_err(|e| self.err(e))
    }

    async fn clock(&self) -> Result<DateTime<Utc>, StoreError> {
        if let Some(now) = self.file_clock_now().map_err(|e| self.err(e))? {
            return Ok(from_ms(now));
        }
        let now: i64 = sqlx::query_scalar(self.queries.clock.clone())
            .fetch_one(&self.pool())
            .await
            .map_err(|e| self.err(e))?;
        Ok(from_ms(now))
    }

    async fn renew(
        &self,
        job: &JobName,
        owner: &Owner,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        // rows_affected counts matched rows under CLIENT_FOUND_ROWS, which is
        // what is wanted: the WHERE clause is the owner check.
        let done = self
            .retrying(|| async {
                sqlx::query(self.stmt(&self.queries.renew, None)?)
                    .bind(duration_ms(lease))
                    .bind(job.as_str().to_string())
                    .bind(owner.as_str().to_string())
                    .execute(&self.pool())
                    .await
            })
            .await
            .map_err(|e| self.err(e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, jobs: &[JobName], owner: &Owner) -> Result<usize, StoreError> {
        let mut released = 0;
        for job in jobs {
            let done = self
                .retrying(|| async {
                    sqlx::query(self.stmt(&self.queries.release, None)?)
                        .bind(job.as_str().to_string())
                        .bind(owner.as_str().to_string())
                        .execute(&self.pool())
                        .await
                })
                .await
                .map_err(|e| self.err(e))?;
            released += done.rows_affected() as usize;
        }
        Ok(released)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1")
            .execute(&self.pool())
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn status(&self) -> Result<Vec<LockStatus>, StoreError> {
        let rows = sqlx::query(
            self.stmt(&self.queries.status, None)
                .map_err(|e| self.err(e))?,
        )
        .fetch_all(&self.pool())
        .await
        .map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| -> Result<LockStatus, sqlx::Error> {
                let owner: Option<String> = r.try_get(1)?;
                let expires_at: i64 = r.try_get(3)?;
                let now: i64 = r.try_get(5)?;
                let live = owner.is_some() && expires_at > now;
                Ok(LockStatus {
                    job: r.try_get(0)?,
                    holder: if live { owner.clone() } else { None },
                    lease_remaining_ms: if live { (expires_at - now) as u64 } else { 0 },
                    fence: r.try_get::<i64, _>(2)?.max(0) as u64,
                    last_occurrence: r.try_get::<Option<i64>, _>(4)?.map(from_ms),
                    last_owner: owner,
                })
            })
            .collect::<Result<_, _>>()
            .map_err(|e| self.err(e))
    }

    async fn record_run(&self, run: &RunRecord, keep: u32) -> Result<(), StoreError> {
        let result: Result<(), sqlx::Error> = self
            .retrying(|| async {
                sqlx::query(self.queries.insert_run.clone())
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
                    .execute(&self.pool())
                    .await?;
                let cutoff: Option<i64> = sqlx::query_scalar(self.queries.prune_cutoff.clone())
                    .bind(run.job.clone())
                    .bind(i64::from(keep))
                    .fetch_optional(&self.pool())
                    .await?;
                if let Some(cutoff) = cutoff {
                    sqlx::query(self.queries.prune.clone())
                        .bind(run.job.clone())
                        .bind(cutoff)
                        .execute(&self.pool())
                        .await?;
                }
                Ok(())
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

    fn describe(&self) -> &str {
        self.url.redacted()
    }
}

#[cfg(feature = "sqlite")]
fn sqlite_clock(path: &std::path::Path) -> Option<FileClock> {
    let clock = sqlite::FileClock::beside(path);
    Some(Box::new(move || clock.now_ms()))
}
#[cfg(not(feature = "sqlite"))]
fn sqlite_clock(_: &std::path::Path) -> Option<FileClock> {
    None
}
#[cfg(feature = "sqlite")]
fn sqlite_parts(
    path: &std::path::Path,
) -> Result<(&'static Dialect, String, Vec<String>), StoreError> {
    sqlite::parts(path)
}
#[cfg(not(feature = "sqlite"))]
fn sqlite_parts(
    _: &std::path::Path,
) -> Result<(&'static Dialect, String, Vec<String>), StoreError> {
    Err(StoreError::NotBuiltIn(
        "sqlite:// support is not built into this binary (build with feature `sqlite`)".into(),
    ))
}
#[cfg(feature = "mysql")]
fn mysql_parts(
    url: &StoreUrl,
    op_ms: i64,
    tls: Option<&TlsFiles>,
) -> Result<(&'static Dialect, String, Vec<String>), StoreError> {
    Ok(mysql::parts(url, op_ms, tls))
}
#[cfg(not(feature = "mysql"))]
fn mysql_parts(
    _: &StoreUrl,
    _: i64,
    _: Option<&TlsFiles>,
) -> Result<(&'static Dialect, String, Vec<String>), StoreError> {
    Err(StoreError::NotBuiltIn(
        "mysql:// support is not built into this binary (build with feature `mysql`)".into(),
    ))
}
#[cfg(feature = "postgres")]
fn postgres_parts(
    url: &StoreUrl,
    op_ms: i64,
    tls: Option<&TlsFiles>,
) -> Result<(&'static Dialect, String, Vec<String>), StoreError> {
    Ok(postgres::parts(url, op_ms, tls))
}
#[cfg(not(feature = "postgres"))]
fn postgres_parts(
    _: &StoreUrl,
    _: i64,
    _: Option<&TlsFiles>,
) -> Result<(&'static Dialect, String, Vec<String>), StoreError> {
    Err(StoreError::NotBuiltIn(
        "postgres:// support is not built into this binary (build with feature `postgres`)".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_placeholders() {
        assert_eq!(number_params("a = ? AND b = ?"), "a = $1 AND b = $2");
    }

    #[test]
    fn splits_scripts() {
        let s = "-- head; comment\nCREATE TABLE a (x INT); -- tail\n\nCREATE INDEX i ON a (x);\n";
        assert_eq!(
            split_statements(s),
            ["CREATE TABLE a (x INT)", "CREATE INDEX i ON a (x)"]
        );
    }
}
