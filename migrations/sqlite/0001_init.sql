-- cronlease schema v1 for SQLite. `{prefix}` is store.table_prefix.
-- Instants are milliseconds since the Unix epoch (UTC): expires_at and
-- modified_at on the store's clock, last_occurrence the scheduled instant.
CREATE TABLE IF NOT EXISTS {prefix}lock_info (
    lock_name       TEXT    NOT NULL PRIMARY KEY,
    owner           TEXT,
    fence           INTEGER NOT NULL DEFAULT 0,
    expires_at      INTEGER NOT NULL DEFAULT 0,
    last_occurrence INTEGER,
    modified_at     INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS {prefix}job_runs (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    job         TEXT    NOT NULL,
    fence       INTEGER NOT NULL,
    owner       TEXT    NOT NULL,
    node        TEXT    NOT NULL,
    occurrence  INTEGER NOT NULL,
    started_at  INTEGER NOT NULL,
    finished_at INTEGER NOT NULL,
    outcome     TEXT    NOT NULL,
    exit_code   INTEGER,
    takeover    INTEGER NOT NULL DEFAULT 0,
    delay_ms    INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS {prefix}job_runs_job ON {prefix}job_runs (job, id);
