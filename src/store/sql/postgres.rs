//! PostgreSQL. The claim locks the job's row with `SELECT ... FOR UPDATE`;
//! a new job's row is seeded with `ON CONFLICT DO NOTHING`. The clock is
//! `clock_timestamp()` (the real time, not the transaction's start).

use super::Dialect;
use crate::config::{StoreUrl, TlsFiles};

pub static DIALECT: Dialect = Dialect {
    name: "postgres",
    now_ms: "(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT)",
    begin: "BEGIN",
    lock_row: " FOR UPDATE",
    insert_ignore: "INSERT INTO",
    ignore_conflict: " ON CONFLICT ({key}) DO NOTHING",
    upsert_lock: " ON CONFLICT (lock_name) DO UPDATE SET owner = excluded.owner, fence = excluded.fence, expires_at = excluded.expires_at, last_occurrence = excluded.last_occurrence, modified_at = excluded.modified_at, running = excluded.running, trigger_id = excluded.trigger_id, last_trigger = excluded.last_trigger",
    upsert_node: " ON CONFLICT (owner) DO UPDATE SET node = excluded.node, version = excluded.version, started_at = excluded.started_at, last_seen = excluded.last_seen, expires_at = excluded.expires_at, clock_offset_ms = excluded.clock_offset_ms, jobs_held = excluded.jobs_held, definitions = excluded.definitions, running_runs = excluded.running_runs, tags = excluded.tags, claimed_through = excluded.claimed_through, releases = excluded.releases",
    numbered_params: true,
    json_lock_rows: Some(
        "json_to_recordset(?::json) AS r(lock_name TEXT, owner TEXT, fence BIGINT, expires_at BIGINT, last_occurrence BIGINT, modified_at BIGINT, running BIGINT, trigger_id BIGINT, last_trigger BIGINT)",
    ),
    json_names: Some("SELECT json_array_elements_text(?::json)"),
    notify: Some("SELECT pg_notify(?, ?)"),
    migrations: &[
        (
            1,
            include_str!("../../../migrations/postgres/0001_init.sql"),
        ),
        (
            2,
            include_str!("../../../migrations/postgres/0002_history_once.sql"),
        ),
        (
            3,
            include_str!("../../../migrations/postgres/0003_lock_fillfactor.sql"),
        ),
        (
            4,
            include_str!("../../../migrations/postgres/0004_nodes.sql"),
        ),
        (
            5,
            include_str!("../../../migrations/postgres/0005_running.sql"),
        ),
        (
            6,
            include_str!("../../../migrations/postgres/0006_paused.sql"),
        ),
        (
            7,
            include_str!("../../../migrations/postgres/0007_output.sql"),
        ),
        (
            8,
            include_str!("../../../migrations/postgres/0008_trigger.sql"),
        ),
        (
            9,
            include_str!("../../../migrations/postgres/0009_definitions.sql"),
        ),
        (
            10,
            include_str!("../../../migrations/postgres/0010_usage.sql"),
        ),
        (
            11,
            include_str!("../../../migrations/postgres/0011_outbox.sql"),
        ),
        (
            12,
            include_str!("../../../migrations/postgres/0012_running_runs.sql"),
        ),
        (
            13,
            include_str!("../../../migrations/postgres/0013_audit.sql"),
        ),
        (
            14,
            include_str!("../../../migrations/postgres/0014_tags.sql"),
        ),
        (
            15,
            include_str!("../../../migrations/postgres/0015_progress.sql"),
        ),
    ],
};

/// TLS as the driver's URL parameters.
const TLS_PARAMS: super::TlsParamNames = super::TlsParamNames {
    mode: "sslmode",
    verify: "verify-full",
    require: "require",
    ca: "sslrootcert",
    cert: "sslcert",
    key: "sslkey",
};

/// No NOTICE ("relation ... already exists, skipping" at every start) sent
/// to be logged: the server's warnings and errors still are. Set on every
/// pooled connection and on the migration's own.
pub(super) const QUIET_NOTICES: &str = "SET client_min_messages = warning";

pub(super) fn parts(
    url: &StoreUrl,
    op_ms: i64,
    tls: Option<&TlsFiles>,
) -> (&'static Dialect, String, Vec<String>) {
    let setup = vec![
        QUIET_NOTICES.to_string(),
        format!("SET lock_timeout = {}", op_ms.max(1)),
        // A transaction left idle this long is ended by the server: a node
        // frozen or partitioned inside a claim batch would otherwise keep
        // every row of the batch locked until it came back.
        format!(
            "SET idle_in_transaction_session_timeout = {}",
            super::idle_limit_ms(op_ms)
        ),
    ];
    let params = super::tls_params(tls, &TLS_PARAMS);
    (&DIALECT, super::with_params(url.expose(), &params), setup)
}
