//! SQLite: the embedded default. One database file shared by every node
//! process on this host, in WAL mode with a busy timeout, `synchronous = FULL`
//! so an acknowledged claim survives a power cut (heartbeats sent on their
//! own go on a connection of their own without an fsync, `beat_connection`
//! in the SQL store). A claim batch reads its rows
//! without any lock (WAL readers never wait) and takes the write lock only
//! with its first write, so a node whose claims all lose never holds it, and
//! a node stopped (SIGSTOP) between instants blocks nobody. A write that finds
//! the database busy, or changed since the read, fails the transaction, which
//! `SqlStore` runs again after a short jittered pause rather than SQLite's
//! coarse busy handler.
//!
//! The store's clock is the file system's, not the calling process's: SQLite
//! has no server, and `julianday('now')` would read each node's own clock, so
//! a node whose clock runs ahead would judge its own claims by it. Before
//! each decision the store writes one byte to `<db>-clock` beside the
//! database and reads back the modification time the kernel stamped on it:
//! one clock for every process on the host, whatever a process believes the
//! time is (the same idea as ZooKeeper's `mtime` of a write). Queries carry
//! `{now}`, replaced by that instant when they run.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use super::Dialect;
use crate::store::StoreError;

pub(super) mod beat;

pub static DIALECT: Dialect = Dialect {
    name: "sqlite",
    // Filled in from the file-system clock when a statement runs.
    now_ms: "{now}",
    begin: "BEGIN",
    lock_row: "",
    insert_ignore: "INSERT OR IGNORE INTO",
    ignore_conflict: "",
    upsert_lock: " ON CONFLICT (lock_name) DO UPDATE SET owner = excluded.owner, fence = excluded.fence, expires_at = excluded.expires_at, last_occurrence = excluded.last_occurrence, modified_at = excluded.modified_at, running = excluded.running, trigger_id = excluded.trigger_id, last_trigger = excluded.last_trigger",
    upsert_node: " ON CONFLICT (owner) DO UPDATE SET node = excluded.node, version = excluded.version, started_at = excluded.started_at, last_seen = excluded.last_seen, expires_at = excluded.expires_at, clock_offset_ms = excluded.clock_offset_ms, jobs_held = excluded.jobs_held, definitions = excluded.definitions, running_runs = excluded.running_runs, tags = excluded.tags, claimed_through = excluded.claimed_through, releases = excluded.releases",
    numbered_params: false,
    json_lock_rows: None,
    json_names: None,
    notify: None,
    migrations: &[
        (1, include_str!("../../../migrations/sqlite/0001_init.sql")),
        (
            2,
            include_str!("../../../migrations/sqlite/0002_history_once.sql"),
        ),
        (4, include_str!("../../../migrations/sqlite/0004_nodes.sql")),
        (
            5,
            include_str!("../../../migrations/sqlite/0005_running.sql"),
        ),
        (
            6,
            include_str!("../../../migrations/sqlite/0006_paused.sql"),
        ),
        (
            7,
            include_str!("../../../migrations/sqlite/0007_output.sql"),
        ),
        (
            8,
            include_str!("../../../migrations/sqlite/0008_trigger.sql"),
        ),
        (
            9,
            include_str!("../../../migrations/sqlite/0009_definitions.sql"),
        ),
        (
            10,
            include_str!("../../../migrations/sqlite/0010_usage.sql"),
        ),
        (
            11,
            include_str!("../../../migrations/sqlite/0011_outbox.sql"),
        ),
        (
            12,
            include_str!("../../../migrations/sqlite/0012_running_runs.sql"),
        ),
        (
            13,
            include_str!("../../../migrations/sqlite/0013_audit.sql"),
        ),
        (14, include_str!("../../../migrations/sqlite/0014_tags.sql")),
        (
            15,
            include_str!("../../../migrations/sqlite/0015_progress.sql"),
        ),
    ],
};

/// How long a new connection's setup, and a migration, wait for the
/// database's lock: another daemon's first migration holds it for as long as
/// its scripts take (MySQL's migration lock waits 30 s too).
pub(super) const SETUP_BUSY: std::time::Duration = std::time::Duration::from_secs(30);

/// The dialect, the sqlx URL and the per-connection setup for a database file.
pub(super) fn parts(path: &Path) -> Result<(&'static Dialect, String, Vec<String>), StoreError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // A missing directory would otherwise surface as an opaque "unable to open".
        std::fs::create_dir_all(dir).map_err(|e| StoreError::Backend {
            store: format!("sqlite://{}", path.display()),
            reason: format!("cannot create directory {}: {e}", dir.display()),
        })?;
    }
    let file = path.to_string_lossy();
    let mut encoded = String::with_capacity(file.len());
    for c in file.chars() {
        match c {
            '%' | '?' | '#' | ' ' => encoded.push_str(&format!("%{:02X}", c as u32)),
            c => encoded.push(c),
        }
    }
    let url = format!("sqlite://{encoded}?mode=rwc");
    let setup = vec![
        // Setting WAL needs the database's lock while the file is still in
        // rollback mode (a fresh file another daemon is migrating): wait for
        // it. Without a wait the pool's background connection failed, and
        // sqlx logged "error returned from after_connect … database is
        // locked" at ERROR before trying again (2-3 daemons starting at
        // once on a new file).
        format!("PRAGMA busy_timeout = {}", SETUP_BUSY.as_millis()),
        // And when two connections switch at once, SQLite answers one of
        // them "locked" without waiting (it would deadlock): the other one
        // makes the file WAL for both (the mode is kept in the file), and
        // the migration, which every daemon runs first, sets it as well.
        format!("{}PRAGMA journal_mode = WAL", super::OPTIONAL),
        "PRAGMA synchronous = FULL".into(),
        // Then no busy handler: SqlStore retries a busy database itself, finely.
        "PRAGMA busy_timeout = 0".into(),
    ];
    Ok((&DIALECT, url, setup))
}

/// Sets up the migration's connection: it waits for the database's lock
/// ([`SETUP_BUSY`]), and switches the file to WAL. Two daemons switching a
/// new file at once: SQLite answers one of them "locked" without waiting (a
/// wait could deadlock), so that one tries again.
pub(super) async fn prepare_for_migration(
    conn: &mut sqlx::AnyConnection,
) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "PRAGMA busy_timeout = {}",
        SETUP_BUSY.as_millis()
    )))
    .execute(&mut *conn)
    .await?;
    let deadline = tokio::time::Instant::now() + SETUP_BUSY;
    loop {
        match sqlx::raw_sql("PRAGMA journal_mode = WAL")
            .execute(&mut *conn)
            .await
        {
            Ok(_) => return Ok(()),
            Err(e) if super::is_transient(&e) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The host's clock as the kernel stamps it on a write to `<db>-clock`.
pub struct FileClock {
    db: PathBuf,
    path: PathBuf,
    file: Mutex<Option<File>>,
}

impl FileClock {
    /// The clock for the database at `db` (nothing is opened yet).
    pub fn beside(db: &Path) -> Self {
        let mut name = db.as_os_str().to_owned();
        name.push("-clock");
        FileClock {
            db: db.to_path_buf(),
            path: PathBuf::from(name),
            file: Mutex::new(None),
        }
    }

    /// Milliseconds since the Unix epoch by the file system's clock.
    pub fn now_ms(&self) -> std::io::Result<i64> {
        let mut slot = self
            .file
            .lock()
            .map_err(|_| std::io::Error::other("clock file lock poisoned"))?;
        if slot.is_none() {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&self.path)?;
            // Created by root (`sudo cronlease status`)? Give it to the
            // database's owner, as SQLite does with its -wal and -shm files,
            // or the daemon's own user could not write it.
            if nix::unistd::geteuid().is_root() {
                use std::os::unix::fs::MetadataExt;
                if let (Ok(db), Ok(own)) = (std::fs::metadata(&self.db), file.metadata())
                    && (db.uid(), db.gid()) != (own.uid(), own.gid())
                {
                    let _ = std::os::unix::fs::fchown(&file, Some(db.uid()), Some(db.gid()));
                }
            }
            *slot = Some(file);
        }
        let Some(file) = slot.as_ref() else {
            return Err(std::io::Error::other("clock file not open"));
        };
        let stamped = file.write_at(b"c", 0).and_then(|_| file.metadata());
        let modified = match stamped {
            Ok(meta) => meta.modified()?,
            Err(e) => {
                // Reopen next time: the file may have been removed or replaced.
                *slot = None;
                return Err(e);
            }
        };
        let ms = modified
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_err(|_| std::io::Error::other("file-system clock before 1970"))?
            .as_millis();
        i64::try_from(ms).map_err(|_| std::io::Error::other("file-system clock out of range"))
    }
}
