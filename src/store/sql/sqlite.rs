//! SQLite: the embedded default. One database file shared by every node
//! process on this host, in WAL mode with a busy timeout, `synchronous = FULL`
//! so an acknowledged claim survives a power cut. Claims take the write lock
//! up front (`BEGIN IMMEDIATE`), so concurrent claimers never fail a lock
//! upgrade halfway; a busy database is retried by `SqlStore` with short
//! jittered pauses rather than SQLite's coarse busy handler.

use std::path::Path;

use super::Dialect;
use crate::store::StoreError;

pub static DIALECT: Dialect = Dialect {
    name: "sqlite",
    now_ms: "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    begin: "BEGIN IMMEDIATE",
    lock_row: "",
    seed_row: "INSERT OR IGNORE INTO {p}lock_info (lock_name, owner, fence, expires_at, last_occurrence, modified_at) VALUES (?, NULL, 0, 0, NULL, {now})",
    numbered_params: false,
    migrations: &[(1, include_str!("../../../migrations/sqlite/0001_init.sql"))],
};

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
        // No busy handler: SqlStore retries a busy database itself, finely.
        "PRAGMA busy_timeout = 0".into(),
        "PRAGMA journal_mode = WAL".into(),
        "PRAGMA synchronous = FULL".into(),
    ];
    Ok((&DIALECT, url, setup))
}
