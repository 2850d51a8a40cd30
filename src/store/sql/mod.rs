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
    Renewal, RunRecord, SchemaNotice, StoreError, TriggerAnswer, TriggerId, claim_row, duration_ms,
    from_ms, to_ms, trigger_row,
};
use crate::config::{JobName, StoreConfig, StoreKind, StoreUrl, TlsFiles};

mod audit;
mod batch;
mod claim;
mod history;
mod nodes;
mod outbox;
mod schema;
use batch::*;
use claim::*;
#[cfg(feature = "fuzzing")]
pub(crate) use history::run_from_row;
#[cfg(feature = "failpoints")]
pub use schema::be_the_upgrade_drills_next_release;

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
    /// A statement that tells listeners a request was written (channel,
    /// job), sent once the request committed: PostgreSQL's `pg_notify`.
    pub notify: Option<&'static str>,
    /// Migrations, in version order.
    pub migrations: &'static [(i64, &'static str)],
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
    /// What the last migration found: a newer schema it may use ([`super::newer_schema`]).
    schema_notice: SchemaNotice,
    /// When this handle's heartbeat last deleted long-dead registry rows:
    /// once a minute is enough (they are a minute dead already), and each
    /// time is a statement more per beat (on SQLite a write).
    forgot_at: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// The last verdict of [`nothing_listens`] on the server, and when:
    /// asked again at most once a [`PROBE_EVERY`].
    refused: std::sync::Mutex<Option<(std::time::Instant, bool)>>,
    /// Each connection's setup statements.
    setup: std::sync::Arc<[String]>,
    /// The heartbeats' own connection ([`SqlStore::beat_connection`]).
    beat_conn: tokio::sync::Mutex<Option<OwnBeat>>,
    /// SQLite: the beats sent on the calling thread ([`sqlite::beat`]).
    #[cfg(feature = "sqlite")]
    inline_beat: Option<sqlite::beat::InlineBeat>,
    /// Bumped by each [`SqlStore::reopen`].
    generation: std::sync::atomic::AtomicU64,
}

/// The heartbeats' connection.
pub(super) struct OwnBeat {
    conn: AnyConnection,
    /// The [`SqlStore::reopen`] generation it was opened in.
    generation: u64,
    /// A beat on it began and did not finish (its future was dropped, by
    /// a timeout): the connection may still be busy with it, so the next
    /// beat opens another.
    unfinished: bool,
}

/// The heartbeats' connection, held for one beat.
pub(super) struct BeatConn<'a>(tokio::sync::MutexGuard<'a, Option<OwnBeat>>);

impl BeatConn<'_> {
    pub(super) fn conn(&mut self) -> Result<&mut AnyConnection, sqlx::Error> {
        self.0
            .as_mut()
            .map(|own| &mut own.conn)
            .ok_or_else(|| sqlx::Error::Protocol("the heartbeat connection is closed".into()))
    }

    /// A beat's statements are over with `done`: after an error other than
    /// a busy database the connection is not used again.
    pub(super) fn finish<T>(&mut self, done: &Result<T, sqlx::Error>) {
        if done.as_ref().err().is_none_or(is_transient) {
            if let Some(own) = self.0.as_mut() {
                own.unfinished = false;
            }
        } else {
            *self.0 = None;
        }
    }
}

/// Runs `setup` on a fresh connection; a statement marked [`OPTIONAL`]
/// may fail (a setting only some servers know: MariaDB's
/// idle_transaction_timeout on MySQL).
async fn set_up(conn: &mut AnyConnection, setup: &[String]) -> Result<(), sqlx::Error> {
    for stmt in setup {
        let done = sqlx::raw_sql(AssertSqlSafe(stmt.clone()))
            .execute(&mut *conn)
            .await;
        if done.is_err() && !stmt.starts_with(OPTIONAL) {
            done?;
        }
    }
    Ok(())
}

/// A SQLite database file and its (device, inode) when this store opened it.
struct SqliteFile {
    path: std::path::PathBuf,
    identity: std::sync::Mutex<Option<(u64, u64)>>,
}

/// Reads a clock kept outside the database, in ms since the Unix epoch.
type FileClock = Box<dyn Fn() -> std::io::Result<i64> + Send + Sync>;

/// Marks a per-connection setup statement whose failure is ignored.
pub(crate) const OPTIONAL: &str = "/* optional */ ";

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
                _ => return Err(StoreError::not_a(config, "an SQL URL")),
            };
        let file_clock = match url.kind() {
            StoreKind::Sqlite { path } => sqlite_clock(path),
            _ => None,
        };
        let setup: std::sync::Arc<[String]> = setup.into();
        let pool_setup = setup.clone();
        let op_timeout = config.op_timeout;
        let max_connections = config.max_connections.max(1);
        let pool_url = connect_url.clone();
        let make_pool = move || -> Result<AnyPool, sqlx::Error> {
            let setup = pool_setup.clone();
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
                    Box::pin(async move { set_up(conn, &setup).await })
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
        #[cfg(feature = "sqlite")]
        let inline_beat = match url.kind() {
            StoreKind::Sqlite { path } => Some(sqlite::beat::InlineBeat::at(path)),
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
            schema_notice: SchemaNotice::default(),
            forgot_at: std::sync::Mutex::new(None),
            refused: std::sync::Mutex::new(None),
            beat_conn: tokio::sync::Mutex::new(None),
            #[cfg(feature = "sqlite")]
            inline_beat,
            setup,
            generation: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The connection a heartbeat sent on its own goes on (the caller
    /// [`BeatConn::finish`]es it): one of its own, beside the pool, opened
    /// again after an error, a beat left unfinished, or a
    /// [`SqlStore::reopen`]. A beat taken from the pool cost two round
    /// trips more than its statements (sqlx pings a connection as it hands
    /// it out and again, in a task of its own, as it takes it back), and
    /// waited behind claims that held every pooled connection.
    ///
    /// SQLite: in WAL mode it carries only the once-a-minute beat that
    /// deletes long-dead rows (the others run on the calling thread,
    /// [`sqlite::beat`]), and checkpoints the log as a commit there finds
    /// it long; with `synchronous = NORMAL` when the file is in WAL mode:
    /// a beat commits without an fsync of the write-ahead log, which the
    /// next `FULL` commit (a claim won, a renewal, a release, a history
    /// write) or checkpoint syncs with it. A power cut may lose the beats
    /// since then, which no write depends on: what a reader does on a beat
    /// (leave an occurrence to its holder, list a node) writes nothing, a
    /// write made after it is `FULL` and syncs the log with the beat, and
    /// every reader is on this host, down with it. That fsync was a fifth
    /// of an idle node's CPU (docs/benchmarks.md, "Idle cost"). Beats sent
    /// inside claim batches stay on the pool's `FULL` connections.
    pub(super) async fn beat_connection(&self) -> Result<BeatConn<'_>, sqlx::Error> {
        let mut own = self.beat_conn.lock().await;
        let generation = self.generation.load(std::sync::atomic::Ordering::SeqCst);
        if own
            .as_ref()
            .is_none_or(|o| o.generation != generation || o.unfinished)
        {
            *own = None;
            let mut conn = AnyConnection::connect(&self.connect_url).await?;
            set_up(&mut conn, &self.setup).await?;
            if self.dialect.name == "sqlite" {
                // In a rollback journal `NORMAL` could corrupt the file on
                // a power cut: only in WAL mode (the setup asks for it, and
                // a failure to switch is tolerated there).
                let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
                    .fetch_one(&mut conn)
                    .await?;
                if mode.eq_ignore_ascii_case("wal") {
                    sqlx::raw_sql("PRAGMA synchronous = NORMAL")
                        .execute(&mut conn)
                        .await?;
                }
            }
            *own = Some(OwnBeat {
                conn,
                generation,
                unfinished: false,
            });
        }
        if let Some(own) = own.as_mut() {
            own.unfinished = true;
        }
        Ok(BeatConn(own))
    }

    /// Whether this beat should delete long-dead registry rows (once a
    /// minute per handle), noting that it does.
    pub(super) fn forget_due(&self) -> bool {
        let mut at = crate::store::lock(&self.forgot_at);
        let due = at.is_none_or(|t| t.elapsed() >= Duration::from_secs(60));
        if due {
            *at = Some(tokio::time::Instant::now());
        }
        due
    }

    /// Tells the listeners (PostgreSQL's `LISTEN`) that `job`'s request was
    /// written, after its transaction committed: best effort, as a notice
    /// lost costs latency only (a full notification queue must not fail
    /// the request, as it would inside its transaction).
    async fn announce(&self, job: &JobName) {
        let Some(notify) = self.dialect.notify else {
            return;
        };
        let sent = async {
            sqlx::query(self.sql(notify.to_string(), None)?)
                .bind(self.notice_channel())
                .bind(job.as_str().to_string())
                .execute(&self.pool())
                .await
        };
        if let Err(e) = sent.await {
            tracing::debug!(job = %job, "could not announce a request: {}", self.err(e));
        }
    }

    /// The channel accepted requests are announced on (PostgreSQL).
    pub(super) fn notice_channel(&self) -> String {
        format!("{}triggers", self.prefix)
    }

    #[cfg(feature = "postgres")]
    fn listen(
        &self,
        stop: tokio_util::sync::CancellationToken,
    ) -> Option<tokio::sync::mpsc::Receiver<()>> {
        let (connect_url, url, channel) = (
            self.connect_url.clone(),
            self.url.clone(),
            self.notice_channel(),
        );
        Some(super::notices::follow(
            self.url.redacted().to_string(),
            stop,
            move |tx| {
                let (connect_url, url, channel) =
                    (connect_url.clone(), url.clone(), channel.clone());
                async move {
                    let why = |e: sqlx::Error| url.scrub(&e.to_string());
                    let mut listener = sqlx::postgres::PgListener::connect(&connect_url)
                        .await
                        .map_err(why)?;
                    listener.listen(&channel).await.map_err(why)?;
                    if !super::notices::notify(&tx) {
                        return Ok(());
                    }
                    loop {
                        // `None`: the connection was lost and is made again
                        // by the next call; a notice covers what it missed.
                        let _notice = listener.try_recv().await.map_err(why)?;
                        if !super::notices::notify(&tx) {
                            return Ok(());
                        }
                    }
                }
            },
        ))
    }

    #[cfg(not(feature = "postgres"))]
    fn listen(
        &self,
        _: tokio_util::sync::CancellationToken,
    ) -> Option<tokio::sync::mpsc::Receiver<()>> {
        None
    }

    fn err(&self, e: sqlx::Error) -> StoreError {
        let store = self.url.redacted().to_string();
        let reason = self.url.scrub(&self.reason(&e));
        match &e {
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => StoreError::Unavailable { store, reason },
            sqlx::Error::Tls(_) => StoreError::Refused { store, reason },
            sqlx::Error::Database(db) => {
                let code = db.code().unwrap_or_default();
                let missing_table =
                    code == "42S02" || code == "42P01" || db.message().contains("no such table");
                if missing_table {
                    StoreError::NotMigrated { store }
                } else if refuses(&code, db.message()) {
                    StoreError::Refused { store, reason }
                } else {
                    StoreError::Backend { store, reason }
                }
            }
            _ => StoreError::Backend { store, reason },
        }
    }

    /// `e` in an operator's words: the pool's "timed out while waiting
    /// for an open connection" says what the connections met (a refused
    /// port), a server's error its message without PostgreSQL's source
    /// line ("... does not exist at line 948").
    fn reason(&self, e: &sqlx::Error) -> String {
        match e {
            sqlx::Error::PoolTimedOut => match self.server() {
                Some((_, Some(addr))) if self.refused(addr) => format!(
                    "connection refused by {addr}: no server is listening there (is it running, and on that port?)"
                ),
                Some((server, _)) => format!(
                    "no connection to {server} within {} (store.op_timeout): the server did not answer in time, or all store.max_connections connections were busy",
                    humantime::format_duration(self.op_timeout)
                ),
                None => e.to_string(),
            },
            sqlx::Error::Database(db) => db.message().to_string(),
            sqlx::Error::Io(io) => match self.server() {
                Some((server, _)) => format!("cannot reach the server at {server}: {io}"),
                None => e.to_string(),
            },
            other => other.to_string(),
        }
    }

    /// [`nothing_listens`] at `addr`, asked at most once a [`PROBE_EVERY`]
    /// (it runs on a failed call's error path, in async code: a blocked
    /// thread delays every timer of its tasks).
    fn refused(&self, addr: std::net::SocketAddr) -> bool {
        let mut last = crate::store::lock(&self.refused);
        match *last {
            Some((at, verdict)) if at.elapsed() < PROBE_EVERY => verdict,
            _ => {
                let verdict = nothing_listens(addr);
                *last = Some((std::time::Instant::now(), verdict));
                verdict
            }
        }
    }

    /// The server as the URL names it (`HOST:PORT`), and its address when
    /// that is an IP or `localhost` (never a lookup: this is an error
    /// path, and it must not block); `None` for SQLite.
    fn server(&self) -> Option<(String, Option<std::net::SocketAddr>)> {
        let default_port = match self.dialect.name {
            "mysql" => 3306,
            "postgres" => 5432,
            _ => return None,
        };
        let url = url::Url::parse(self.url.expose()).ok()?;
        let port = url.port().unwrap_or(default_port);
        let host = url.host()?;
        let ip: Option<std::net::IpAddr> = match &host {
            url::Host::Ipv4(ip) => Some((*ip).into()),
            url::Host::Ipv6(ip) => Some((*ip).into()),
            url::Host::Domain("localhost") => Some(std::net::Ipv4Addr::LOCALHOST.into()),
            // `mysql://` and `postgres://` are not schemes the url crate
            // knows: their hosts come as names, an IP's too.
            url::Host::Domain(name) => name.parse().ok(),
        };
        let name = match &host {
            url::Host::Ipv6(ip) => format!("[{ip}]:{port}"),
            other => format!("{other}:{port}"),
        };
        Some((name, ip.map(|ip| std::net::SocketAddr::new(ip, port))))
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
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
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

#[async_trait]
impl Locks for SqlStore {
    async fn prepare(&self) -> Result<(), StoreError> {
        let versions = self.migrate().await.map_err(|e| self.err(e))?;
        self.schema_notice
            .settle(self.url.redacted(), versions.found, versions.known)?;
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
            Ok(Answer::Triggered(answer)) => {
                if answer == TriggerAnswer::Accepted {
                    self.announce(job).await;
                }
                Ok(answer)
            }
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

    /// PostgreSQL: `LISTEN` on the channel each accepted request is
    /// announced on (`pg_notify` in its transaction), on a connection of its
    /// own; MySQL/MariaDB and SQLite have no such thing (the beats look).
    fn notices(
        self: std::sync::Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) -> Option<tokio::sync::mpsc::Receiver<()>> {
        self.dialect.notify?;
        self.listen(stop)
    }

    async fn pending_triggers(&self) -> Result<Vec<(String, TriggerId)>, StoreError> {
        let mut conn = self.pool().acquire().await.map_err(|e| self.err(e))?;
        self.pending_on(&mut conn).await.map_err(|e| self.err(e))
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
        self.schema_notice.get()
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

/// How often [`SqlStore::refused`] asks again.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Whether a connection to `addr`, on this host, is refused: the kernel
/// answers a loopback connect at once (a non-blocking one only says "in
/// progress", so this one blocks, for no longer than the refusal takes,
/// and 10 ms at most: packets to it may be dropped, by a firewall rule).
/// `false` for any other address: finding out would mean waiting.
fn nothing_listens(addr: std::net::SocketAddr) -> bool {
    addr.ip().is_loopback()
        && std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(10))
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
}

#[cfg(test)]
mod tests;

/// A database error that refuses this node for good: credentials rejected
/// (SQLSTATE 28000, PostgreSQL's 28P01), no such database (PostgreSQL's
/// 3D000, MariaDB's "Unknown database", whose SQLSTATE 42000 is shared with
/// syntax errors).
fn refuses(code: &str, message: &str) -> bool {
    matches!(code, "28000" | "28P01" | "3D000")
        || (code == "42000" && message.starts_with("Unknown database"))
}

#[cfg(test)]
mod refusal_tests {
    use super::refuses;

    #[test]
    fn credentials_and_missing_databases_refuse_syntax_errors_do_not() {
        assert!(refuses(
            "28P01",
            "password authentication failed for user \"u\""
        ));
        assert!(refuses(
            "28000",
            "Access denied for user 'root'@'localhost'"
        ));
        assert!(refuses("3D000", "database \"x\" does not exist"));
        assert!(refuses("42000", "Unknown database 'x'"));
        assert!(!refuses("42000", "You have an error in your SQL syntax"));
        assert!(!refuses("40001", "serialization failure"));
        assert!(!refuses("", "database is locked"));
    }
}
