//! Unit tests of the SQL store: its pure parts, and SQLite's heartbeat
//! connection on a file of its own.
#![allow(clippy::unwrap_used)]
use super::schema::split_statements;
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

#[cfg(feature = "sqlite")]
#[test]
fn binds_the_file_clock_first_and_numbers_the_rest() {
    let text = "INSERT INTO n (a, b, c) VALUES (?, {now}, {now} + ?) -- {x}";
    assert_eq!(
        bound_now(&sqlite::DIALECT, text),
        "INSERT INTO n (a, b, c) VALUES (?2, ?1, ?1 + ?3) -- {x}"
    );
}

/// On SQLite the heartbeat's statements bind the store's clock as `?1`
/// and the beat's values after it ([`bound_now`]): what a beat wrote is
/// what it reads back, its record alive for its ttl from the file-system
/// clock's instant, at beat after beat. (Their text is the same at every
/// beat, so a connection prepares them once; sqlx's `Any` connection does
/// not count its SQLite statements, so the saving is measured by the idle
/// bench, docs/benchmarks.md.)
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_beats_bind_the_clock_and_read_back_what_they_wrote() {
    let (_dir, store) = sqlite_store().await;
    let beat = Heartbeat {
        owner: Owner::from_raw("n1~1"),
        node: "n1".into(),
        tags: vec!["db".into()],
        version: "test".into(),
        started_at: Utc::now(),
        clock_offset_ms: Some(3),
        jobs_held: 2,
        ttl: Duration::from_secs(7),
        definitions: None,
        running: Vec::new(),
        progress: None,
    };
    for _ in 0..5 {
        // A later instant on the file-system clock at every beat.
        tokio::time::sleep(Duration::from_millis(3)).await;
        let mut held = store.beat_connection().await.unwrap();
        let nodes = store
            .beat_on(held.conn().unwrap(), &beat, true)
            .await
            .unwrap();
        assert_eq!(nodes.len(), 1);
        let n = &nodes[0];
        assert_eq!(
            (n.node.as_str(), n.tags.as_slice()),
            ("n1", &["db".to_string()][..])
        );
        assert_eq!((n.jobs_held, n.clock_offset_ms), (2, Some(3)));
        assert!(
            (6_900..=7_000).contains(&n.expires_in_ms),
            "{}",
            n.expires_in_ms
        );
    }
}

/// SQLite's heartbeats go on a connection of their own that commits
/// without an fsync (`synchronous = NORMAL`), while the pool's connections,
/// which carry the claims, keep `FULL`; a reopened file (deleted or
/// replaced under the node) and a beat left unfinished get a new beat
/// connection.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_beats_commit_without_an_fsync_and_claims_with_one() {
    let (_dir, store) = sqlite_store().await;
    let done = Ok::<(), sqlx::Error>(());
    let mut held = store.beat_connection().await.unwrap();
    assert_eq!(pragma(held.conn().unwrap(), "synchronous").await, 1);
    pragma(held.conn().unwrap(), "cache_size = -123").await;
    held.finish(&done);
    drop(held);
    let mut pooled = store.pool().acquire().await.unwrap();
    assert_eq!(pragma(&mut pooled, "synchronous").await, 2);
    drop(pooled);
    // The same connection at the next beat...
    let mut held = store.beat_connection().await.unwrap();
    assert_eq!(pragma(held.conn().unwrap(), "cache_size").await, -123);
    held.finish(&done);
    drop(held);
    // ...a new one once the file is reopened...
    store.reopen();
    let mut held = store.beat_connection().await.unwrap();
    assert_ne!(pragma(held.conn().unwrap(), "cache_size").await, -123);
    assert_eq!(pragma(held.conn().unwrap(), "synchronous").await, 1);
    pragma(held.conn().unwrap(), "cache_size = -321").await;
    // ...and after a beat left unfinished (its future dropped by a
    // timeout: the connection may still be busy with it).
    drop(held);
    let mut held = store.beat_connection().await.unwrap();
    assert_ne!(pragma(held.conn().unwrap(), "cache_size").await, -321);
}

/// `PRAGMA {pragma}` on `conn`: the value it reads (0 for a setting made).
#[cfg(feature = "sqlite")]
async fn pragma(conn: &mut AnyConnection, pragma: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!("PRAGMA {pragma}")))
        .fetch_optional(conn)
        .await
        .unwrap()
        .unwrap_or(0)
}

/// A SQLite store on a file of its own, prepared.
#[cfg(feature = "sqlite")]
async fn sqlite_store() -> (tempfile::TempDir, SqlStore) {
    let dir = tempfile::tempdir().unwrap();
    let url = StoreUrl::parse(
        &format!("sqlite://{}/x.db", dir.path().display()),
        dir.path(),
    )
    .unwrap();
    let store = SqlStore::open(&StoreConfig {
        url,
        table_prefix: String::new(),
        key_prefix: String::new(),
        op_timeout: Duration::from_secs(5),
        history_limit: 10,
        max_connections: 2,
        tls: None,
    })
    .unwrap();
    store.prepare().await.unwrap();
    (dir, store)
}
