//! SQLite's heartbeat on the calling thread. sqlx runs each SQLite
//! connection's statements on a thread of its own: a beat sent there wakes
//! that thread, and each answer it sends back wakes the runtime, which was
//! most of an idle node's CPU (docs/benchmarks.md, "Idle cost"). A beat is
//! three short statements on a file in WAL mode without an fsync
//! (`synchronous = NORMAL`): tens of microseconds, so it runs where the
//! beat's task runs, on a connection of its own (rusqlite, over the SQLite
//! library sqlx links), and never waits there for a lock or a sync (the
//! kernel may still hold it on a page read or a write-back, as it may any
//! thread):
//! - no busy handler: a busy database answers at once, and the store's
//!   `retrying` pauses on tokio's clock and sends the beat again;
//! - no checkpoint (`wal_autocheckpoint = 0`): a checkpoint syncs the files.
//!   The pool's connections and the once-a-minute beat that also forgets
//!   long-dead rows (still sent through sqlx) checkpoint as before, so the
//!   log stays bounded;
//! - only in WAL mode: in a rollback journal every commit syncs the file,
//!   so there the store sends its beats through sqlx as before (and looks
//!   again a minute later);
//! - never creating the file: a missing one is an error, as the store's
//!   own connections judge it (they create it, and migrate it first).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rusqlite::types::ToSqlOutput;
use rusqlite::{Connection, OpenFlags, ToSql};

use super::super::nodes::{BeatValue, Columns, beat_values, node_record, pending_entry};
use super::super::{Queries, is_transient};
use crate::store::registry::{self, Heartbeat, Looked};

/// How long a file found not in WAL mode sends its beats through sqlx
/// before it is looked at again.
const NOT_WAL_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// The beat's connection on the calling thread, opened on first use.
pub(in crate::store::sql) struct InlineBeat {
    path: PathBuf,
    state: Mutex<Option<Opened>>,
}

/// What opening found, for the store's generation it was opened in (a
/// replaced file opens again).
struct Opened {
    generation: u64,
    /// `None`: the file is not in WAL mode, beats go through sqlx.
    conn: Option<Connection>,
    /// When it was opened.
    at: std::time::Instant,
}

impl Opened {
    /// Still the one to use in `generation`: a file found not in WAL mode
    /// is looked at again after [`NOT_WAL_FOR`].
    fn holds(&self, generation: u64) -> bool {
        self.generation == generation && (self.conn.is_some() || self.at.elapsed() < NOT_WAL_FOR)
    }
}

impl InlineBeat {
    /// For the database file at `path`; nothing is opened yet.
    pub(in crate::store::sql) fn at(path: &Path) -> Self {
        InlineBeat {
            path: path.to_path_buf(),
            state: Mutex::new(None),
        }
    }

    /// Sends `beat` at the store's `now`, with the look for pending
    /// requests when `look`: `None` when the file is not in WAL mode (the
    /// caller sends it through sqlx). After an error other than a busy
    /// database the connection is opened again for the next beat.
    pub(in crate::store::sql) fn send(
        &self,
        generation: u64,
        queries: &Queries,
        now: i64,
        beat: &Heartbeat,
        look: bool,
    ) -> Option<Result<Looked, sqlx::Error>> {
        let mut state = match self.state.lock() {
            Ok(state) => state,
            // A beat panicked while holding it: its connection is suspect.
            Err(poisoned) => {
                let mut state = poisoned.into_inner();
                *state = None;
                state
            }
        };
        if !state.as_ref().is_some_and(|o| o.holds(generation)) {
            *state = None;
            let conn = match open(&self.path) {
                Ok(conn) => conn,
                Err(e) => return Some(Err(to_sqlx(e))),
            };
            *state = Some(Opened {
                generation,
                conn,
                at: std::time::Instant::now(),
            });
        }
        let conn = state.as_ref()?.conn.as_ref()?;
        let sent = send(conn, queries, now, beat, look).map_err(to_sqlx);
        if sent.as_ref().is_err_and(|e| !is_transient(e)) {
            *state = None;
        }
        Some(sent)
    }
}

/// A connection to `path` for beats: `None` when the file is not in WAL
/// mode.
fn open(path: &Path) -> rusqlite::Result<Option<Connection>> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(std::time::Duration::ZERO)?;
    let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Ok(None);
    }
    conn.execute_batch("PRAGMA synchronous = NORMAL; PRAGMA wal_autocheckpoint = 0")?;
    Ok(Some(conn))
}

/// The upsert, the live rows, and the pending requests when `look`.
fn send(
    conn: &Connection,
    queries: &Queries,
    now: i64,
    beat: &Heartbeat,
    look: bool,
) -> rusqlite::Result<Looked> {
    let mut upsert = conn.prepare_cached(queries.beat.as_str())?;
    let mut params: Vec<&dyn ToSql> = Vec::with_capacity(13);
    let values = beat_values(beat);
    params.push(&now);
    params.extend(values.iter().map(|v| v as &dyn ToSql));
    upsert.execute(params.as_slice())?;
    let mut live = conn.prepare_cached(queries.live_nodes.as_str())?;
    let nodes = live
        .query_map([now], |r| node_record(r))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let pending = if look {
        let mut read = conn.prepare_cached(queries.pending_triggers.as_str())?;
        let mut pending = Vec::new();
        for row in read.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))? {
            let (job, id) = row?;
            pending.extend(pending_entry(job, id));
        }
        Some(pending)
    } else {
        None
    };
    Ok((registry::sorted(nodes), pending))
}

impl ToSql for BeatValue {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        match self {
            BeatValue::Text(v) => v.to_sql(),
            BeatValue::Int(v) => v.to_sql(),
            BeatValue::MaybeText(v) => v.to_sql(),
            BeatValue::MaybeInt(v) => v.to_sql(),
        }
    }
}

impl Columns for rusqlite::Row<'_> {
    type Error = rusqlite::Error;
    fn int(&self, i: usize) -> rusqlite::Result<i64> {
        self.get(i)
    }
    fn maybe_int(&self, i: usize) -> rusqlite::Result<Option<i64>> {
        self.get(i)
    }
    fn text(&self, i: usize) -> rusqlite::Result<String> {
        self.get(i)
    }
    fn maybe_text(&self, i: usize) -> rusqlite::Result<Option<String>> {
        self.get(i)
    }
}

/// SQLite's error as sqlx's SQLite driver gives it (the extended result
/// code as the code), so the store judges both alike: busy is transient,
/// "no such table" is a store not migrated.
fn to_sqlx(e: rusqlite::Error) -> sqlx::Error {
    match e {
        rusqlite::Error::SqliteFailure(failure, message) => {
            sqlx::Error::Database(Box::new(SqliteFailure {
                code: failure.extended_code,
                message: message.unwrap_or_else(|| failure.to_string()),
            }))
        }
        other => sqlx::Error::Protocol(other.to_string()),
    }
}

/// A SQLite failure: its extended result code and message.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
struct SqliteFailure {
    code: std::ffi::c_int,
    message: String,
}

impl sqlx::error::DatabaseError for SqliteFailure {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        Some(self.code.to_string().into())
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        sqlx::error::ErrorKind::Other
    }
}
