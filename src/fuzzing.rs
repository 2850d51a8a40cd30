//! Doorways for the fuzz targets in `fuzz/` (feature `fuzzing`, test-only
//! like `failpoints`; docs/fuzzing.md): the decoders a backend runs on what
//! its store answers, reachable from outside the crate without making them
//! part of the API.
//!
//! Each takes a reply as it comes off the wire (RESP for Redis, the stored
//! JSON for ZooKeeper and etcd) or the typed values a SQL driver hands over,
//! and runs the backend's own code on it, so a panic found here is one the
//! daemon or `cronlease history`/`nodes` would meet on a corrupt or
//! hand-edited store. Config loading, schedules and the claim rule need no
//! doorway: [`crate::config::load`], [`crate::schedule::Schedule`] and
//! [`crate::store::decide`] are public.

#[cfg(feature = "redis")]
pub use self::redis_replies::{redis_claim_reply, redis_history_reply, redis_registry_reply};
#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
pub use self::sql_rows::{SqlValue, sql_history_row};

/// A finished run as ZooKeeper and etcd keep it (the JSON of one history
/// entry named `name`, the zero-padded fence, modified at `mtime` ms), read
/// back as `history` reads it.
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
pub fn kv_history_entry(name: &str, data: &[u8], mtime: i64) -> crate::store::RunRecord {
    crate::store::run_from_json("job", name, data, mtime)
}

#[cfg(feature = "redis")]
mod redis_replies {
    use std::path::Path;
    use std::sync::OnceLock;
    use std::time::Duration;

    use crate::config::{JobName, Misfire, StoreConfig, StoreUrl};
    use crate::store::redis::{ClaimReply, RedisStore, StreamEntries, nodes_from_reply};
    use crate::store::{ClaimRequest, Claimed, NodeRecord, Owner, RunRecord, StoreError, from_ms};

    /// A store to decode with: opening one connects to nothing.
    fn store() -> &'static RedisStore {
        static STORE: OnceLock<RedisStore> = OnceLock::new();
        STORE.get_or_init(|| {
            let opened =
                StoreUrl::parse("redis://127.0.0.1:6379", Path::new(".")).and_then(|url| {
                    RedisStore::open(&StoreConfig::new(url)).map_err(|e| e.to_string())
                });
            match opened {
                Ok(store) => store,
                // A fixed URL: only a broken harness gets here.
                Err(e) => panic!("cannot open a Redis store to decode with: {e}"),
            }
        })
    }

    /// One RESP reply; `None` when the bytes are not one (the driver's
    /// protocol error, not a reply any backend code sees).
    fn value(resp: &[u8]) -> Option<::redis::Value> {
        ::redis::parse_redis_value(resp).ok()
    }

    /// The answer to `requests` claims (jobs `j0`, `j1`, …) from the RESP
    /// reply of `claim.lua`, decoded as `claim` decodes it.
    pub fn redis_claim_reply(resp: &[u8], requests: usize) -> Option<Result<Claimed, StoreError>> {
        let reply = value(resp)?;
        let store = store();
        let requests: Vec<ClaimRequest> = (0..requests)
            .filter_map(|i| JobName::parse(&format!("j{i}")).ok())
            .map(|job| ClaimRequest {
                job,
                occurrence: from_ms(1_780_000_000_000),
                previous: None,
                misfire: Misfire::RunOnce,
                owner: Owner::from_raw("fuzz#00000000"),
                lease: Duration::from_secs(61),
                fence_floor: 0,
                max_offset: Duration::from_millis(500),
                head_start: Some(Duration::from_millis(50)),
                after_unanswered: false,
                recheck_only: false,
                window_end: None,
                manual: None,
                redeliver: false,
                before_previous: None,
            })
            .collect();
        Some(
            store
                .decode::<Vec<ClaimReply>>(reply)
                .and_then(|replies| store.claimed(&requests, replies)),
        )
    }

    /// The live nodes in the RESP reply of `registry.lua`, decoded as
    /// `heartbeat` and `nodes` decode it.
    pub fn redis_registry_reply(resp: &[u8]) -> Option<Result<Vec<NodeRecord>, StoreError>> {
        let reply = value(resp)?;
        let store = store();
        Some(
            store
                .decode::<Vec<String>>(reply)
                .map(|reply| nodes_from_reply(&reply)),
        )
    }

    /// The runs in the RESP reply of one run stream's `XREVRANGE`, read as
    /// `history` reads them (a reply of another shape fails the pipeline).
    pub fn redis_history_reply(resp: &[u8]) -> Option<Result<Vec<RunRecord>, String>> {
        let reply = value(resp)?;
        Some(
            ::redis::from_redis_value::<StreamEntries>(reply)
                .map(|entries| {
                    crate::store::redis::runs_of_stream(
                        "cronlease:",
                        "cronlease:{job}:runs",
                        entries,
                    )
                })
                .map_err(|e| e.to_string()),
        )
    }
}

#[cfg(any(feature = "sqlite", feature = "mysql", feature = "postgres"))]
mod sql_rows {
    use std::sync::Arc;

    use sqlx::any::{AnyArguments, AnyRow, AnyValue};
    use sqlx::{Any, Arguments, Database, Value};

    /// sqlx's `AnyColumn`, which it names only as `Any`'s column type.
    type AnyColumn = <Any as Database>::Column;

    use crate::store::RunRecord;

    /// A column's value as sqlx's `Any` driver hands it over.
    #[derive(Debug, Clone)]
    pub enum SqlValue {
        /// NULL in an integer column.
        Null,
        /// NULL in a text column.
        NullText,
        Bool(bool),
        SmallInt(i16),
        Integer(i32),
        BigInt(i64),
        Real(f32),
        Double(f64),
        Text(String),
        Blob(Vec<u8>),
    }

    /// The columns `history` selects, in order.
    const COLUMNS: [&str; 13] = [
        "job",
        "fence",
        "owner",
        "node",
        "occurrence",
        "started_at",
        "finished_at",
        "outcome",
        "exit_code",
        "takeover",
        "delay_ms",
        "decision_ms",
        "output",
    ];

    /// A history row of these columns (in `history`'s order), read as
    /// `history` reads it.
    pub fn sql_history_row(values: Vec<SqlValue>) -> Result<RunRecord, String> {
        // The driver's own encoders make the values, as a query's arguments.
        let mut args = AnyArguments::default();
        for v in values {
            match v {
                SqlValue::Null => args.add(None::<i64>),
                SqlValue::NullText => args.add(None::<String>),
                SqlValue::Bool(b) => args.add(b),
                SqlValue::SmallInt(i) => args.add(i),
                SqlValue::Integer(i) => args.add(i),
                SqlValue::BigInt(i) => args.add(i),
                SqlValue::Real(f) => args.add(f),
                SqlValue::Double(f) => args.add(f),
                SqlValue::Text(s) => args.add(s),
                SqlValue::Blob(b) => args.add(b),
            }
            .map_err(|e| e.to_string())?;
        }
        let values: Vec<AnyValue> = args
            .values
            .0
            .into_iter()
            .map(|kind| AnyValue { kind })
            .collect();
        // Each column typed as its value, as the driver describes a result.
        let columns = values
            .iter()
            .enumerate()
            .map(|(ordinal, v)| AnyColumn {
                ordinal,
                name: COLUMNS
                    .get(ordinal)
                    .map_or_else(|| format!("extra{ordinal}"), |c| c.to_string())
                    .into(),
                type_info: v.type_info().into_owned(),
            })
            .collect();
        let row = AnyRow {
            column_names: Arc::default(),
            columns,
            values,
        };
        crate::store::sql::run_from_row(&row).map_err(|e| e.to_string())
    }
}
