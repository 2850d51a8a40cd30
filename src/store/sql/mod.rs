//! The SQL store: one implementation of [`crate::store::Store`] for SQLite, MySQL/MariaDB
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

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyConnection, AnyPool, AssertSqlSafe, Connection, Row, SqlSafeStr, SqlStr};

use super::registry::{self, Heartbeat, NodeRecord, Registry};
use super::{
    ClaimOutcome, ClaimRequest, Claimed, History, LockRow, LockStatus, Locks, Outcome, Owner,
    Renewal, RunRecord, StoreError, TriggerAnswer, TriggerId, claim_row, duration_ms, from_ms,
    newer_schema, to_ms, trigger_row,
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
    /// The verb of an `INSERT` that skips rows whose key exists.
    pub insert_ignore: &'static str,
    /// Appended to such an `INSERT` (`{key}`: the key's columns).
    pub ignore_conflict: &'static str,
    /// Appended to an `INSERT` of lock rows to update the existing ones.
    pub upsert_lock: &'static str,
    /// Appended to the `INSERT` of a node registry row to update an existing one.
    pub upsert_node: &'static str,
    /// Placeholders are `$1, $2...` instead of `?`.
    pub numbered_params: bool,
    /// A row source reading lock rows (the lock columns, by name) from one
    /// JSON array bound as a single parameter, for databases where a
    /// statement of thousands of bound values is slow to plan (PostgreSQL:
    /// 94-143 ms for 1,000 rows, 2 ms this way); None: multi-row `VALUES`.
    /// Either way the rows are written with [`Dialect::upsert_lock`].
    pub json_lock_rows: Option<&'static str>,
    /// A subquery giving the job names of one JSON array of strings bound as
    /// a single parameter, to lock a batch's rows without binding one value
    /// per job (PostgreSQL, 3 × 1,000 jobs: claim decision p99 15-18 ms over
    /// four runs this way, 23 ms in one run with `IN` over 1,000 values);
    /// None: `IN (?, ?, ...)` in chunks.
    pub json_names: Option<&'static str>,
    /// Migrations, in version order.
    pub migrations: &'static [(i64, &'static str)],
}

/// What a locking transaction does with the rows of its batch.
#[derive(Clone, Copy)]
enum Locked<'a> {
    /// Claims, and the node's heartbeat when it rides along.
    Claim(&'a [ClaimRequest], Option<&'a Heartbeat>),
    Renew(&'a Owner, &'a [Renewal]),
    /// A manual run's request ([`trigger_row`]).
    Trigger(&'a JobName, TriggerId),
}

/// The answer of a locking transaction.
enum Answer {
    /// The claims, and the live nodes when a heartbeat rode along.
    Claimed(Claimed, Option<Vec<NodeRecord>>),
    Renewed(Vec<bool>),
    Triggered(TriggerAnswer),
}

/// The SQL implementation of [`crate::store::Store`].
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
    /// The last migration found a newer schema it may use ([`newer_schema`]).
    schema_notice: std::sync::Mutex<Option<String>>,
}

/// What [`SqlStore::migrate`] found: the newest schema version recorded
/// before it ran, and the newest this binary knows.
struct SchemaVersions {
    found: i64,
    known: i64,
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
    pending_triggers: SqlStr,
    status: SqlStr,
    history_all: SqlStr,
    history_job: SqlStr,
}

const RUN_COLUMNS: &str = "job, fence, owner, node, occurrence, started_at, finished_at, outcome, exit_code, takeover, delay_ms, decision_ms, output, trigger_id";
const LOCK_COLUMNS: &str = "lock_name, owner, fence, expires_at, last_occurrence, modified_at, running, trigger_id, last_trigger";

/// Test-only: a claim batch that finds the file named by
/// `CRONLEASE_FAILPOINT_STOP_FILE` removes it and stops the whole process
/// (SIGSTOP) inside its transaction, after reading its rows: a node frozen
/// at the worst moment, once, until the test sends SIGCONT.
#[cfg(feature = "failpoints")]
fn stop_failpoint() {
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
fn idle_limit_ms(op_ms: i64) -> i64 {
    (op_ms / 2).max(100)
}

/// Marks a per-connection setup statement whose failure is ignored.
pub(crate) const OPTIONAL: &str = "/* optional */ ";

/// Rows per multi-row statement: far below every database's bind limit
/// (SQLite 32766, MySQL and PostgreSQL 65535) at 13 columns.
const CHUNK: usize = 500;
/// Output tails per history insert, in bytes: a statement stays below
/// MySQL's and MariaDB's `max_allowed_packet` (64 MiB and 16 MiB by
/// default), also on a server set as low as 4 MiB.
const OUTPUT_PER_STATEMENT: usize = 2 * 1024 * 1024;

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
            pending_triggers: q(format!(
                "SELECT lock_name, trigger_id FROM {p}lock_info WHERE trigger_id IS NOT NULL ORDER BY lock_name"
            )),
            status: q(format!(
                "SELECT lock_name, owner, fence, expires_at, last_occurrence, {now} AS now_ms, paused FROM {p}lock_info ORDER BY lock_name"
            )),
            history_all: q(format!(
                "SELECT {RUN_COLUMNS} FROM {p}job_runs ORDER BY id DESC LIMIT ?"
            )),
            history_job: q(format!(
                "SELECT {RUN_COLUMNS} FROM {p}job_runs WHERE job = ? ORDER BY id DESC LIMIT ?"
            )),
        }
    }
}

/// `(?, ?, ...)` with `n` placeholders.
fn tuple(n: usize) -> String {
    let mut out = String::with_capacity(2 + 3 * n);
    out.push('(');
    for i in 0..n {
        if i > 0 {
            out.push_str(", ");
        }
        out.push('?');
    }
    out.push(')');
    out
}

/// `rows` tuples of `cols` placeholders, comma-separated.
fn tuples(rows: usize, cols: usize) -> String {
    vec![tuple(cols); rows].join(", ")
}

/// The multi-row statements of a batch, for `n` rows (placeholders `?`,
/// the clock as `{now}`).
struct BatchSql<'a> {
    d: &'a Dialect,
    p: &'a str,
}

impl BatchSql<'_> {
    /// Reads and locks `n` lock rows, in name order.
    fn lock_rows(&self, n: usize) -> String {
        self.lock_rows_in(&tuple(n))
    }

    /// [`Self::lock_rows`] for the names of the JSON array bound as the one
    /// parameter, where the dialect can.
    fn lock_rows_from_json(&self) -> Option<String> {
        self.d
            .json_names
            .map(|names| self.lock_rows_in(&format!("({names})")))
    }

    /// Reads and locks the lock rows whose names are `IN names`.
    fn lock_rows_in(&self, names: &str) -> String {
        format!(
            "SELECT lock_name, owner, fence, expires_at, last_occurrence, running, {{now}} AS now_ms, paused, trigger_id, last_trigger FROM {p}lock_info WHERE lock_name IN {names} ORDER BY lock_name{lock}",
            p = self.p,
            lock = self.d.lock_row
        )
    }

    /// Creates the missing of `n` lock rows (name bound; empty lease).
    fn seed_rows(&self, n: usize) -> String {
        let rows = vec!["(?, NULL, 0, 0, NULL, {now}, 0, NULL, NULL)"; n].join(", ");
        format!(
            "{} {p}lock_info ({LOCK_COLUMNS}) VALUES {rows}{}",
            self.d.insert_ignore,
            self.d.ignore_conflict.replace("{key}", "lock_name"),
            p = self.p
        )
    }

    /// Writes `n` whole lock rows that exist (and are locked).
    fn write_rows(&self, n: usize) -> String {
        format!(
            "INSERT INTO {p}lock_info ({LOCK_COLUMNS}) VALUES {rows}{upsert}",
            p = self.p,
            rows = tuples(n, 9),
            upsert = self.d.upsert_lock
        )
    }

    /// Writes whole lock rows that exist (and are locked) from the JSON
    /// array bound as the one parameter, where the dialect can.
    fn write_rows_from_json(&self) -> Option<String> {
        self.d.json_lock_rows.map(|source| {
            format!(
                "INSERT INTO {p}lock_info ({LOCK_COLUMNS}) SELECT {LOCK_COLUMNS} FROM {source}{upsert}",
                p = self.p,
                upsert = self.d.upsert_lock
            )
        })
    }

    /// Ends one owner's live leases on `n` jobs.
    fn release(&self, n: usize) -> String {
        format!(
            "UPDATE {p}lock_info SET expires_at = {{now}}, modified_at = {{now}} WHERE owner = ? AND expires_at > {{now}} AND lock_name IN {names}",
            p = self.p,
            names = tuple(n)
        )
    }

    /// Records `n` runs, skipping a (job, fence) recorded already.
    fn insert_runs(&self, n: usize) -> String {
        format!(
            "{} {p}job_runs ({RUN_COLUMNS}) VALUES {rows}{}",
            self.d.insert_ignore,
            self.d.ignore_conflict.replace("{key}", "job, fence"),
            p = self.p,
            rows = tuples(n, 14)
        )
    }

    /// Sets or clears the pause mark of `n` locks (the mark bound first).
    fn set_paused(&self, n: usize) -> String {
        format!(
            "UPDATE {p}lock_info SET paused = ? WHERE lock_name IN {names}",
            p = self.p,
            names = tuple(n)
        )
    }

    /// Ends the running mark of `n` locks, each only at the fence its run
    /// was claimed with.
    fn run_over(&self, n: usize) -> String {
        let cond = vec!["(lock_name = ? AND fence = ?)"; n].join(" OR ");
        format!(
            "UPDATE {p}lock_info SET running = 0 WHERE running <> 0 AND ({cond})",
            p = self.p
        )
    }

    /// Deletes, for `n` jobs, the runs at or below a fence each.
    fn prune(&self, n: usize) -> String {
        let cond = vec!["(job = ? AND fence <= ?)"; n].join(" OR ");
        format!("DELETE FROM {p}job_runs WHERE {cond}", p = self.p)
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
                _ => {
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
        let max_connections = config.max_connections.max(1);
        let pool_url = connect_url.clone();
        let make_pool = move || -> Result<AnyPool, sqlx::Error> {
            let setup = setup.clone();
            AnyPoolOptions::new()
                .max_connections(if dialect.name == "sqlite" {
                    max_connections.min(2)
                } else {
                    max_connections
                })
                .min_connections(1)
                .acquire_timeout(op_timeout)
                .idle_timeout(Some(Duration::from_secs(300)))
                .after_connect(move |conn, _meta| {
                    let setup = setup.clone();
                    Box::pin(async move {
                        for stmt in setup.iter() {
                            let done = sqlx::raw_sql(AssertSqlSafe(stmt.clone()))
                                .execute(&mut *conn)
                                .await;
                            // A setting only some servers know (MariaDB's
                            // idle_transaction_timeout on MySQL) is skipped.
                            if done.is_err() && !stmt.starts_with(OPTIONAL) {
                                done?;
                            }
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
            schema_notice: std::sync::Mutex::new(None),
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

    /// The multi-row statements, for this store's dialect and prefix.
    fn batch(&self) -> BatchSql<'_> {
        BatchSql {
            d: self.dialect,
            p: &self.prefix,
        }
    }

    /// A generated statement ready to run: `{now}` is the store's clock
    /// (SQLite: `now` if given, else the file-system clock read now), and
    /// placeholders are numbered where the dialect wants it.
    fn sql(&self, text: String, now: Option<i64>) -> Result<SqlStr, sqlx::Error> {
        let now = match now {
            Some(now) => Some(now),
            None => self.file_clock_now()?,
        };
        let text = match now {
            Some(now) => text.replace("{now}", &now.to_string()),
            None => text.replace("{now}", self.dialect.now_ms),
        };
        let text = if self.dialect.numbered_params {
            number_params(&text)
        } else {
            text
        };
        Ok(AssertSqlSafe(text).into_sql_str())
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

    /// One locking transaction for a batch ([`Locked`]), retried while it
    /// fails for a transient reason.
    async fn locked(&self, op: Locked<'_>) -> Result<Answer, sqlx::Error> {
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
    async fn locked_in_tx(
        &self,
        op: Locked<'_>,
    ) -> Result<Result<Answer, Vec<String>>, sqlx::Error> {
        let mut conn = self.pool().acquire().await?;
        let (mut result, mut clean) = self.locked_on(&mut conn, op, false).await;
        if clean {
            if let Ok(Err(missing)) = &result {
                if let Err(e) = self.seed_rows(&mut conn, missing).await {
                    if !is_transient(&e) {
                        conn.close_on_drop();
                    }
                    return Err(e);
                }
                (result, clean) = self.locked_on(&mut conn, op, true).await;
            }
        }
        if !clean {
            conn.close_on_drop();
        }
        result
    }

    /// Inserts empty lock rows for `names`, skipping those that exist.
    async fn seed_rows(
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
    async fn locked_on(
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
    async fn lock_rows(
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
    async fn write_rows(
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
    async fn decide_in_tx(
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
                // Decided in name order; a job named twice sees its first
                // request's write.
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
                        outcomes: outcomes.into_iter().flatten().collect(),
                    },
                    None,
                )
            }
            Locked::Renew(owner, renewals) => {
                let mut done = Vec::with_capacity(renewals.len());
                for renewal in renewals {
                    let job = renewal.job.as_str();
                    let ok = match rows.get_mut(job) {
                        Some(Ok(row))
                            if row.owner.as_deref() == Some(owner.as_str())
                                && row.expires_at > row.now =>
                        {
                            row.expires_at = row.now.saturating_add(duration_ms(renewal.lease));
                            changed.insert(job, ());
                            true
                        }
                        _ => false,
                    };
                    done.push(ok);
                }
                Answer::Renewed(done)
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

    /// Records runs and prunes in one write transaction (one fsync on SQLite).
    async fn write_runs(
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
        for chunk in super::run_groups(runs, CHUNK, OUTPUT_PER_STATEMENT) {
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
                    .bind(run.trigger.map(TriggerId::get));
            }
            query.execute(&mut *conn).await?;
        }
        // After the runs are in: a mark ended with its run unrecorded would
        // let a peer in early after a failed write.
        let over: Vec<&RunRecord> = runs.iter().filter(|r| super::ends_a_run(r)).collect();
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

    /// Applies pending migrations on a connection of its own, under the
    /// database's migration lock, so nodes starting together do not collide.
    async fn migrate(&self) -> Result<SchemaVersions, sqlx::Error> {
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
        let versions = SchemaVersions {
            found: applied.iter().copied().max().unwrap_or(0),
            known: self
                .dialect
                .migrations
                .iter()
                .map(|(v, _)| *v)
                .max()
                .unwrap_or(0),
        };
        if versions.found > versions.known {
            // A newer binary migrated it: apply nothing of ours.
            sqlx::raw_sql(AssertSqlSafe(unlock))
                .execute(&mut conn)
                .await?;
            conn.close().await?;
            return Ok(versions);
        }
        // Tables dropped behind our back (a restore, a hand edit) while the
        // schema table still lists their version: apply the scripts again
        // (they create only what is missing) instead of failing every call.
        let mut tables_present = true;
        for table in ["lock_info", "job_runs", "nodes"] {
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
                match sqlx::raw_sql(AssertSqlSafe(stmt)).execute(&mut conn).await {
                    Err(sqlx::Error::Database(db)) if already_there(db.message()) => {}
                    other => {
                        other?;
                    }
                }
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
        conn.close().await?;
        Ok(versions)
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

/// MySQL has no `IF NOT EXISTS` for indexes and columns, SQLite none for
/// columns: when scripts are applied again, what exists is fine.
fn already_there(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("duplicate key name") || m.contains("duplicate column name")
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
    })
}

#[async_trait]
impl Locks for SqlStore {
    async fn prepare(&self) -> Result<(), StoreError> {
        let versions = self.migrate().await.map_err(|e| self.err(e))?;
        let newer = newer_schema(self.url.redacted(), versions.found, versions.known);
        let notice = match newer {
            Some(Err(e)) => return Err(e),
            Some(Ok(note)) => {
                tracing::warn!(store = %self.url.redacted(), "{note}");
                Some(note)
            }
            None => None,
        };
        if let Ok(mut n) = self.schema_notice.lock() {
            *n = notice;
        }
        // Open a pooled connection now (one is kept from then on): the
        // first instant's claims should not pay for connecting (about
        // 100 ms to PostgreSQL here).
        self.ping().await
    }

    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Claimed, StoreError> {
        if requests.is_empty() {
            return self.clock().await.map(|store_now| Claimed {
                store_now,
                outcomes: Vec::new(),
            });
        }
        match self.locked(Locked::Claim(requests, None)).await {
            Ok(Answer::Claimed(claimed, _)) => Ok(claimed),
            Ok(_) => Err(self.err(sqlx::Error::Protocol(
                "a claim answered as something else".into(),
            ))),
            Err(e) => Err(self.err(e)),
        }
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

    async fn renew_many(
        &self,
        owner: &Owner,
        renewals: &[Renewal],
    ) -> Result<Vec<bool>, StoreError> {
        if renewals.is_empty() {
            return Ok(Vec::new());
        }
        match self.locked(Locked::Renew(owner, renewals)).await {
            Ok(Answer::Renewed(done)) => Ok(done),
            Ok(_) => Err(self.err(sqlx::Error::Protocol(
                "a renewal answered as something else".into(),
            ))),
            Err(e) => Err(self.err(e)),
        }
    }

    async fn release(&self, jobs: &[JobName], owner: &Owner) -> Result<usize, StoreError> {
        let mut released = 0;
        for chunk in jobs.chunks(CHUNK) {
            // rows_affected counts matched rows under MySQL's
            // CLIENT_FOUND_ROWS, which is what is wanted: the WHERE clause
            // is the owner check.
            let done = self
                .retrying(|| async {
                    let mut query = sqlx::query(self.sql(self.batch().release(chunk.len()), None)?)
                        .bind(owner.as_str().to_string());
                    for job in chunk {
                        query = query.bind(job.as_str().to_string());
                    }
                    query.execute(&self.pool()).await
                })
                .await
                .map_err(|e| self.err(e))?;
            released += done.rows_affected() as usize;
        }
        Ok(released)
    }

    async fn set_paused(&self, jobs: &[JobName], paused: bool) -> Result<(), StoreError> {
        let names: Vec<String> = jobs.iter().map(|j| j.as_str().to_string()).collect();
        for chunk in names.chunks(CHUNK) {
            self.retrying(|| async {
                let mut conn = self.pool().acquire().await?;
                // A job never claimed gets its lock row first, so its first
                // claim sees the mark.
                self.seed_rows(&mut conn, chunk).await?;
                let mut query = sqlx::query(self.sql(self.batch().set_paused(chunk.len()), None)?)
                    .bind(i64::from(paused));
                for job in chunk {
                    query = query.bind(job.clone());
                }
                query.execute(&mut *conn).await
            })
            .await
            .map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    async fn request_trigger(
        &self,
        job: &JobName,
        id: TriggerId,
    ) -> Result<TriggerAnswer, StoreError> {
        match self.locked(Locked::Trigger(job, id)).await {
            Ok(Answer::Triggered(answer)) => Ok(answer),
            Ok(_) => Err(self.err(sqlx::Error::Protocol(
                "a trigger answered as something else".into(),
            ))),
            Err(e) => Err(self.err(e)),
        }
    }

    async fn withdraw_trigger(&self, job: &JobName, id: TriggerId) -> Result<bool, StoreError> {
        let text = format!(
            "UPDATE {}lock_info SET trigger_id = NULL WHERE lock_name = ? AND trigger_id = ?",
            self.prefix
        );
        let done = self
            .retrying(|| async {
                sqlx::query(self.sql(text.clone(), None)?)
                    .bind(job.as_str().to_string())
                    .bind(id.get())
                    .execute(&self.pool())
                    .await
            })
            .await
            .map_err(|e| self.err(e))?;
        Ok(done.rows_affected() > 0)
    }

    async fn pending_triggers(&self) -> Result<Vec<(String, TriggerId)>, StoreError> {
        let rows = sqlx::query(self.queries.pending_triggers.clone())
            .fetch_all(&self.pool())
            .await
            .map_err(|e| self.err(e))?;
        Ok(rows
            .iter()
            .filter_map(|r| {
                let job: String = r.try_get(0).ok()?;
                let id: i64 = r.try_get(1).ok()?;
                Some((job, TriggerId::from_stored(id)?))
            })
            .collect())
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
            self.sql(self.queries.status.as_str().to_string(), None)
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
                    lease_remaining_ms: if live {
                        expires_at.saturating_sub(now) as u64
                    } else {
                        0
                    },
                    fence: r.try_get::<i64, _>(2)?.max(0) as u64,
                    last_occurrence: r.try_get::<Option<i64>, _>(4)?.map(from_ms),
                    last_owner: owner,
                    paused: r.try_get::<i64, _>(6)? != 0,
                })
            })
            .collect::<Result<_, _>>()
            .map_err(|e| self.err(e))
    }

    fn describe(&self) -> &str {
        self.url.redacted()
    }

    fn schema_notice(&self) -> Option<String> {
        self.schema_notice.lock().ok().and_then(|n| n.clone())
    }
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
}

/// The columns of a node registry row, as `nodes` reads them.
const NODE_COLUMNS: &str =
    "owner, node, version, started_at, last_seen, expires_at, clock_offset_ms, jobs_held";

impl SqlStore {
    /// The live registry rows, read on `conn` at the store's `now`.
    async fn live_nodes(
        &self,
        conn: &mut AnyConnection,
        now: Option<i64>,
    ) -> Result<Vec<NodeRecord>, sqlx::Error> {
        let p = &self.prefix;
        let rows = sqlx::query(self.sql(
            format!(
                "SELECT {NODE_COLUMNS}, {{now}} AS now_ms FROM {p}nodes WHERE expires_at > {{now}}"
            ),
            now,
        )?)
        .fetch_all(&mut *conn)
        .await?;
        let nodes = rows
            .iter()
            .map(|r| -> Result<NodeRecord, sqlx::Error> {
                let expires_at: i64 = r.try_get(5)?;
                let now: i64 = r.try_get(8)?;
                Ok(NodeRecord {
                    owner: r.try_get(0)?,
                    node: r.try_get(1)?,
                    version: r.try_get(2)?,
                    started_at: from_ms(r.try_get(3)?),
                    last_seen: from_ms(r.try_get(4)?),
                    expires_in_ms: expires_at.saturating_sub(now).max(0) as u64,
                    clock_offset_ms: r.try_get(6)?,
                    jobs_held: u32::try_from(r.try_get::<i64, _>(7)?).unwrap_or(0),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(registry::sorted(nodes))
    }

    /// Writes a heartbeat's row, forgets long-dead ones when `forget`,
    /// reads the live ones.
    async fn beat_on(
        &self,
        conn: &mut AnyConnection,
        beat: &Heartbeat,
        forget: bool,
    ) -> Result<Vec<NodeRecord>, sqlx::Error> {
        let p = &self.prefix;
        // One reading of SQLite's clock for the three statements.
        let now = self.file_clock_now()?;
        sqlx::query(self.sql(
            format!(
                "INSERT INTO {p}nodes ({NODE_COLUMNS}) VALUES (?, ?, ?, ?, {{now}}, {{now}} + ?, ?, ?){}",
                self.dialect.upsert_node
            ),
            now,
        )?)
        .bind(beat.owner.as_str().to_string())
        .bind(beat.node.clone())
        .bind(beat.version.clone())
        .bind(to_ms(beat.started_at))
        .bind(duration_ms(beat.ttl))
        .bind(beat.clock_offset_ms)
        .bind(i64::from(beat.jobs_held))
        .execute(&mut *conn)
        .await?;
        if forget {
            sqlx::query(self.sql(
                format!("DELETE FROM {p}nodes WHERE expires_at < {{now}} - ?"),
                now,
            )?)
            .bind(duration_ms(registry::FORGET_AFTER))
            .execute(&mut *conn)
            .await?;
        }
        self.live_nodes(conn, now).await
    }
}

#[async_trait]
impl Registry for SqlStore {
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        self.retrying(|| async {
            let mut conn = self.pool().acquire().await?;
            let nodes = self.beat_on(&mut conn, beat, true).await;
            if nodes.is_err() {
                conn.close_on_drop();
            }
            nodes
        })
        .await
        .map_err(|e| self.err(e))
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.retrying(|| async {
            let mut conn = self.pool().acquire().await?;
            self.live_nodes(&mut conn, None).await
        })
        .await
        .map_err(|e| self.err(e))
    }

    async fn leave(&self, owner: &Owner) -> Result<(), StoreError> {
        let p = &self.prefix;
        self.retrying(|| async {
            sqlx::query(self.sql(format!("DELETE FROM {p}nodes WHERE owner = ?"), None)?)
                .bind(owner.as_str().to_string())
                .execute(&self.pool())
                .await
        })
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// The beat is written inside the claim transaction, after the lock
    /// rows, and commits (or not) with the claims.
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        if requests.is_empty() {
            return registry::claim_alongside(self, requests, beat).await;
        }
        match self.locked(Locked::Claim(requests, Some(beat))).await {
            Ok(Answer::Claimed(claimed, nodes)) => Ok((claimed, nodes)),
            Ok(_) => Err(self.err(sqlx::Error::Protocol(
                "a claim answered as something else".into(),
            ))),
            Err(e) => Err(self.err(e)),
        }
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
