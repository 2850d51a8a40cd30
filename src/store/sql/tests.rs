//! Unit tests of the SQL store: its pure parts, SQLite's heartbeat
//! connection on a file of its own, and PostgreSQL's heartbeat statement
//! (on the local server, tables of its own).
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

/// On SQLite a beat goes as one list of statements in one call to sqlx's
/// SQLite thread (the upsert, the live rows, the pending requests), except
/// the once-a-minute beat that deletes long-dead rows: both read the same
/// nodes and the same requests, told apart in the one stream of rows by
/// their columns.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_beats_in_one_call_read_what_the_separate_statements_read() {
    let (_dir, store) = sqlite_store().await;
    assert!(store.one_call_beat(false, true).is_some());
    assert!(store.one_call_beat(false, false).is_some());
    assert!(
        store.one_call_beat(true, true).is_none(),
        "forgetting: apart"
    );
    let beat = |owner: &str, node: &str| test_beat(owner, node, 1);
    let (a, b) = (beat("a~1", "a"), beat("b~1", "b"));
    let mut ids = Vec::new();
    for job in ["j2", "j1"] {
        let id = TriggerId::new();
        let answer = store
            .request_trigger(&JobName::parse(job).unwrap(), id)
            .await
            .unwrap();
        assert_eq!(answer, TriggerAnswer::Accepted);
        ids.push((job.to_string(), id));
    }
    ids.sort();
    let mut held = store.beat_connection().await.unwrap();
    let call = store.one_call_beat(false, false).unwrap();
    let (nodes, pending) = store
        .beat_in_one_call(held.conn().unwrap(), call, &a)
        .await
        .unwrap();
    assert_eq!((nodes.len(), pending), (1, None), "no look asked for");
    let call = store.one_call_beat(false, true).unwrap();
    let (one_call, pending) = store
        .beat_in_one_call(held.conn().unwrap(), call, &b)
        .await
        .unwrap();
    assert_eq!(pending.as_deref(), Some(&ids[..]));
    let apart = store.beat_on(held.conn().unwrap(), &b, true).await.unwrap();
    let apart_pending = store.pending_on(held.conn().unwrap()).await.unwrap();
    assert_eq!(apart_pending, ids);
    let summary =
        |nodes: &[NodeRecord]| -> Vec<(String, String, u32, Option<registry::ClaimProgress>)> {
            nodes
                .iter()
                .map(|n| (n.owner.clone(), n.node.clone(), n.jobs_held, n.progress))
                .collect()
        };
    assert_eq!(summary(&one_call), summary(&apart));
    assert_eq!(
        summary(&one_call)
            .iter()
            .map(|n| n.1.as_str())
            .collect::<Vec<_>>(),
        ["a", "b"]
    );
    // Through the registry's own calls too, beat after beat (the list is
    // prepared once and kept); they take the beat connection themselves.
    held.finish(&Ok::<(), sqlx::Error>(()));
    drop(held);
    for _ in 0..3 {
        let (nodes, pending) = store.heartbeat_looking(&a).await.unwrap();
        assert_eq!(summary(&nodes), summary(&apart));
        assert_eq!(pending.as_deref(), Some(&ids[..]));
        assert_eq!(
            summary(&store.heartbeat(&b).await.unwrap()),
            summary(&apart)
        );
    }
}

/// PostgreSQL's heartbeat is one statement (the upsert in a `WITH`, the
/// live rows read beside it), and reads what the separate statements read:
/// its own row as just written (the statement's main query reads the
/// snapshot from before the upsert), the others from the table, no row
/// twice; the requests are read after it.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_beats_in_one_statement_read_what_the_separate_statements_read() {
    let url = std::env::var("CRONLEASE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let prefix = format!(
        "unit_beat_{}_{}_",
        std::process::id(),
        Utc::now().timestamp_micros()
    );
    let store = open_store(
        StoreUrl::parse(&url, std::path::Path::new("/")).unwrap(),
        prefix,
    );
    if let Err(e) = store.prepare().await {
        panic!(
            "PostgreSQL at {url}: {e}; start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`"
        );
    }
    let call = store.one_call_beat(false, false).unwrap();
    assert!(!call.look, "the requests are read apart");
    assert!(!store.one_call_beat(false, true).unwrap().look);
    assert!(
        store.one_call_beat(true, true).is_none(),
        "forgetting: apart"
    );
    let beat = |owner: &str, node: &str, held: u32| Heartbeat {
        tags: vec!["db".into()],
        clock_offset_ms: Some(-4),
        ..test_beat(owner, node, held)
    };
    let id = TriggerId::new();
    let answer = store
        .request_trigger(&JobName::parse("j1").unwrap(), id)
        .await
        .unwrap();
    assert_eq!(answer, TriggerAnswer::Accepted);
    type Summary = (String, String, u32, Vec<String>, Option<i64>);
    let summary = |nodes: &[NodeRecord]| -> Vec<Summary> {
        nodes
            .iter()
            .map(|n| {
                (
                    n.owner.clone(),
                    n.node.clone(),
                    n.jobs_held,
                    n.tags.clone(),
                    n.clock_offset_ms,
                )
            })
            .collect()
    };
    let mut conn = store.pool().acquire().await.unwrap();
    let (first, pending) = store
        .beat_in_one_call(&mut conn, call, &beat("a~1", "a", 1))
        .await
        .unwrap();
    assert_eq!(pending, None);
    assert_eq!(
        summary(&first),
        [("a~1".into(), "a".into(), 1, vec!["db".into()], Some(-4))]
    );
    store
        .beat_on(&mut conn, &beat("b~1", "b", 2), false)
        .await
        .unwrap();
    // a beats again with another count: read as written now, once.
    let (one_call, _) = store
        .beat_in_one_call(&mut conn, call, &beat("a~1", "a", 3))
        .await
        .unwrap();
    let apart = store.live_nodes(&mut conn, None).await.unwrap();
    assert_eq!(summary(&one_call), summary(&apart));
    assert_eq!(
        summary(&one_call)
            .iter()
            .map(|n| (n.1.as_str(), n.2))
            .collect::<Vec<_>>(),
        [("a", 3), ("b", 2)]
    );
    assert!(
        one_call.iter().all(|n| n.expires_in_ms > 5_000),
        "{one_call:?}"
    );
    drop(conn);
    let (nodes, pending) = store.heartbeat_looking(&beat("b~1", "b", 4)).await.unwrap();
    assert_eq!(
        nodes.iter().map(|n| n.jobs_held).collect::<Vec<_>>(),
        [3, 4]
    );
    assert_eq!(pending, Some(vec![("j1".to_string(), id)]));
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
    let store = open_store(url, String::new());
    store.prepare().await.unwrap();
    (dir, store)
}

/// A heartbeat of `owner` on `node` holding `held` jobs, living 7 s.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn test_beat(owner: &str, node: &str, held: u32) -> Heartbeat {
    Heartbeat {
        owner: Owner::from_raw(owner),
        node: node.into(),
        tags: Vec::new(),
        version: "test".into(),
        started_at: Utc::now(),
        clock_offset_ms: None,
        jobs_held: held,
        ttl: Duration::from_secs(7),
        definitions: None,
        running: Vec::new(),
        progress: Some(registry::ClaimProgress {
            through: 5,
            released: 2,
        }),
    }
}

/// A store at `url` with its tables under `prefix`, not prepared.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn open_store(url: StoreUrl, prefix: String) -> SqlStore {
    SqlStore::open(&StoreConfig {
        url,
        table_prefix: prefix,
        key_prefix: String::new(),
        op_timeout: Duration::from_secs(5),
        history_limit: 10,
        max_connections: 2,
        tls: None,
    })
    .unwrap()
}
