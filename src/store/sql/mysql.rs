//! MySQL 8 and MariaDB 10.11. The claim locks the job's row with
//! `SELECT ... FOR UPDATE` under READ COMMITTED, so the first claim of a new
//! job (row seeded by `INSERT IGNORE`) takes no gap lock and two nodes racing
//! to create it cannot deadlock. The clock is `UTC_TIMESTAMP(6)`, which does
//! not depend on the session's time zone.

use super::Dialect;
use crate::config::{StoreUrl, TlsFiles};

pub static DIALECT: Dialect = Dialect {
    name: "mysql",
    now_ms: "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)",
    begin: "BEGIN",
    lock_row: " FOR UPDATE",
    insert_ignore: "INSERT IGNORE INTO",
    ignore_conflict: "",
    upsert_lock: " ON DUPLICATE KEY UPDATE owner = VALUES(owner), fence = VALUES(fence), expires_at = VALUES(expires_at), last_occurrence = VALUES(last_occurrence), modified_at = VALUES(modified_at), running = VALUES(running), trigger_id = VALUES(trigger_id), last_trigger = VALUES(last_trigger)",
    upsert_node: " ON DUPLICATE KEY UPDATE node = VALUES(node), version = VALUES(version), started_at = VALUES(started_at), last_seen = VALUES(last_seen), expires_at = VALUES(expires_at), clock_offset_ms = VALUES(clock_offset_ms), jobs_held = VALUES(jobs_held), definitions = VALUES(definitions), running_runs = VALUES(running_runs), tags = VALUES(tags), claimed_through = VALUES(claimed_through), releases = VALUES(releases)",
    numbered_params: false,
    json_lock_rows: None,
    json_names: None,
    notify: None,
    migrations: &[
        (1, include_str!("../../../migrations/mysql/0001_init.sql")),
        (
            2,
            include_str!("../../../migrations/mysql/0002_history_once.sql"),
        ),
        (4, include_str!("../../../migrations/mysql/0004_nodes.sql")),
        (
            5,
            include_str!("../../../migrations/mysql/0005_running.sql"),
        ),
        (6, include_str!("../../../migrations/mysql/0006_paused.sql")),
        (7, include_str!("../../../migrations/mysql/0007_output.sql")),
        (
            8,
            include_str!("../../../migrations/mysql/0008_trigger.sql"),
        ),
        (
            9,
            include_str!("../../../migrations/mysql/0009_definitions.sql"),
        ),
        (10, include_str!("../../../migrations/mysql/0010_usage.sql")),
        (
            11,
            include_str!("../../../migrations/mysql/0011_outbox.sql"),
        ),
        (
            12,
            include_str!("../../../migrations/mysql/0012_running_runs.sql"),
        ),
        (13, include_str!("../../../migrations/mysql/0013_audit.sql")),
        (14, include_str!("../../../migrations/mysql/0014_tags.sql")),
        (
            15,
            include_str!("../../../migrations/mysql/0015_progress.sql"),
        ),
    ],
};

/// TLS as the driver's URL parameters.
const TLS_PARAMS: super::TlsParamNames = super::TlsParamNames {
    mode: "ssl-mode",
    verify: "VERIFY_IDENTITY",
    require: "REQUIRED",
    ca: "ssl-ca",
    cert: "ssl-cert",
    key: "ssl-key",
};

pub(super) fn parts(
    url: &StoreUrl,
    op_ms: i64,
    tls: Option<&TlsFiles>,
) -> (&'static Dialect, String, Vec<String>) {
    let lock_wait_s = (op_ms + 999) / 1000;
    // Whole seconds: MariaDB's idle timeout has no finer unit.
    let idle_s = (super::idle_limit_ms(op_ms) + 999) / 1000;
    let setup = vec![
        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED".into(),
        format!(
            "SET SESSION innodb_lock_wait_timeout = {}",
            lock_wait_s.max(1)
        ),
        // MariaDB ends a transaction left idle this long (a node frozen or
        // partitioned inside a claim batch would otherwise keep every row of
        // the batch locked, and no peer could claim those jobs until it came
        // back). MySQL has no such setting: skipped there.
        format!(
            "{}SET SESSION idle_transaction_timeout = {}",
            super::OPTIONAL,
            idle_s.max(1)
        ),
    ];
    let params = super::tls_params(tls, &TLS_PARAMS);
    (&DIALECT, super::with_params(url.expose(), &params), setup)
}
