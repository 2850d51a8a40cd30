//! Unit tests of the SQL store: its pure parts, SQLite's heartbeat
//! connection on a file of its own, PostgreSQL's heartbeat statement and
//! the heartbeats' own connection on PostgreSQL and MariaDB (on the local
//! servers, tables of their own).
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

/// On SQLite a beat other than the once-a-minute one that forgets dead
/// rows runs on the calling thread ([`sqlite::beat`]): it reads what the
/// statements sent through sqlx read (its own row as written, the others,
/// the pending requests), and it is answered at its first poll: it never
/// waits for sqlx's SQLite thread (through which every beat waited before).
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_beats_run_on_the_calling_thread_and_read_what_sqlx_reads() {
    let (_dir, store) = sqlite_store().await;
    let mut a = test_beat("a~1", "a", 1);
    a.tags = vec!["db".into(), "eu".into()];
    a.clock_offset_ms = Some(-4);
    let b = test_beat("b~1", "b", 3);
    let id = TriggerId::new();
    let job = JobName::parse("j1").unwrap();
    store.request_trigger(&job, id).await.unwrap();
    // The first beat of a handle forgets dead rows: through sqlx.
    store.heartbeat(&b).await.unwrap();
    let (inline, pending) = store.beat_inline(&a, true).unwrap().unwrap();
    assert_eq!(pending, Some(vec![("j1".to_string(), id)]));
    let (_, none) = store.beat_inline(&a, false).unwrap().unwrap();
    assert_eq!(none, None, "no look asked for");
    let mut held = store.beat_connection().await.unwrap();
    let apart = store
        .beat_on(held.conn().unwrap(), &a, false)
        .await
        .unwrap();
    held.finish(&Ok::<(), sqlx::Error>(()));
    drop(held);
    let seen = |nodes: &[NodeRecord]| -> Vec<String> {
        nodes
            .iter()
            .map(|n| {
                format!(
                    "{} {} {} {:?} {:?} {:?} {}",
                    n.owner,
                    n.node,
                    n.jobs_held,
                    n.tags,
                    n.clock_offset_ms,
                    n.progress,
                    (6_900..=7_000).contains(&n.expires_in_ms)
                )
            })
            .collect()
    };
    assert_eq!(seen(&inline), seen(&apart));
    assert_eq!(
        seen(&inline),
        [
            "a~1 a 1 [\"db\", \"eu\"] Some(-4) Some(ClaimProgress { through: 5, released: 2 }) true",
            "b~1 b 3 [] None Some(ClaimProgress { through: 5, released: 2 }) true"
        ]
    );
    for _ in 0..20 {
        let beating = std::pin::pin!(store.heartbeat_looking(&a));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let first_poll = std::future::Future::poll(beating, &mut cx);
        let std::task::Poll::Ready(looked) = first_poll else {
            panic!("a beat waited: not on the calling thread");
        };
        let (nodes, pending) = looked.unwrap();
        assert_eq!((nodes.len(), pending.map(|p| p.len())), (2, Some(1)));
    }
}

/// A busy database (another connection holding the write lock) holds a
/// beat on the calling thread back without blocking the thread: the beat
/// answers busy at once and the store sends it again, on tokio's clock,
/// until the lock is let go.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_beats_wait_out_a_busy_database_on_tokios_clock() {
    let (_dir, store) = sqlite_store().await;
    let beat = test_beat("a~1", "a", 1);
    store.heartbeat(&beat).await.unwrap();
    let mut writer = store.pool().acquire().await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *writer)
        .await
        .unwrap();
    let busy = store.beat_inline(&beat, true).unwrap();
    assert!(
        busy.as_ref().is_err_and(is_transient),
        "{:?}",
        busy.map(|_| ())
    );
    let ((sent, beat_done), committed) = tokio::join!(
        async {
            let sent = store.heartbeat_looking(&beat).await;
            (sent, tokio::time::Instant::now())
        },
        async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let committing = tokio::time::Instant::now();
            sqlx::raw_sql("COMMIT").execute(&mut *writer).await.unwrap();
            committing
        }
    );
    assert_eq!(sent.unwrap().0.len(), 1);
    assert!(beat_done >= committed, "the beat went through the lock");
}

/// On a SQLite file not in WAL mode (every commit syncs there) a beat
/// does not run on the calling thread: the store sends it through sqlx
/// (whose connections switch the file to WAL where they can). And the beat
/// on the calling thread never creates the file.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_beats_run_on_the_calling_thread_only_in_wal_mode() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.db");
    let url = StoreUrl::parse(&format!("sqlite://{}", path.display()), dir.path()).unwrap();
    let store = open_store(url, String::new());
    let beat = test_beat("a~1", "a", 1);
    let missing = store.beat_inline(&beat, true).unwrap();
    assert!(missing.is_err());
    assert!(!path.exists(), "the beat created the file");
    let conn = rusqlite::Connection::open(&path).unwrap();
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "delete");
    drop(conn);
    assert!(store.beat_inline(&beat, true).is_none());
}

/// PostgreSQL's heartbeat is one statement (the upsert in a `WITH`, the
/// live rows read beside it), and reads what the separate statements read:
/// its own row as just written (the statement's main query reads the
/// snapshot from before the upsert), the others from the table, no row
/// twice; and, when it looks, the pending requests in the same statement.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_beats_in_one_statement_read_what_the_separate_statements_read() {
    let store = server_store(POSTGRES).await;
    let call = store.one_call_beat(false, false).unwrap();
    assert!(!call.look, "a beat that does not look");
    let looking = store.one_call_beat(false, true).unwrap();
    assert!(looking.look, "the requests in the same statement");
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
    // And with the look: the same nodes, and the request.
    let (with_look, pending) = store
        .beat_in_one_call(&mut conn, looking, &beat("a~1", "a", 3))
        .await
        .unwrap();
    assert_eq!(summary(&with_look), summary(&apart));
    assert_eq!(pending, Some(vec![("j1".to_string(), id)]));
    assert_eq!(
        Some(store.pending_on(&mut conn).await.unwrap()),
        pending,
        "what the look apart reads"
    );
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
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
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

/// What a test compares of a node's record.
#[cfg(any(feature = "postgres", feature = "mysql"))]
type Summary = (String, String, u32, Vec<String>, Option<i64>);

#[cfg(any(feature = "postgres", feature = "mysql"))]
fn summary(nodes: &[NodeRecord]) -> Vec<Summary> {
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
}

/// MariaDB's beat with the look is the upsert, then one statement for the
/// live rows and the requests (their rows after the nodes'), and reads
/// what the separate statements read.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_reads_the_live_rows_and_the_requests_in_one_statement() {
    let store = server_store(MARIADB).await;
    assert!(store.one_call_beat(false, true).is_none());
    let mut conn = store.pool().acquire().await.unwrap();
    let (nodes, pending) = store
        .beat_then_look(&mut conn, &test_beat("a~1", "a", 1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        summary(&nodes),
        [("a~1".into(), "a".into(), 1, vec![], None)]
    );
    assert_eq!(pending, Some(vec![]), "no request yet");
    let ids = [TriggerId::new(), TriggerId::new()];
    for (job, id) in ["j2", "j1"].iter().zip(ids) {
        let answer = store
            .request_trigger(&JobName::parse(job).unwrap(), id)
            .await
            .unwrap();
        assert_eq!(answer, TriggerAnswer::Accepted);
    }
    store
        .beat_on(&mut conn, &test_beat("b~1", "b", 2), false)
        .await
        .unwrap();
    let (nodes, pending) = store
        .beat_then_look(&mut conn, &test_beat("a~1", "a", 3))
        .await
        .unwrap()
        .unwrap();
    let apart = store.live_nodes(&mut conn, None).await.unwrap();
    assert_eq!(summary(&nodes), summary(&apart));
    assert_eq!(
        nodes.iter().map(|n| n.jobs_held).collect::<Vec<_>>(),
        [3, 2]
    );
    assert_eq!(
        pending,
        Some(vec![("j1".to_string(), ids[1]), ("j2".to_string(), ids[0])])
    );
    assert_eq!(Some(store.pending_on(&mut conn).await.unwrap()), pending);
    drop(conn);
    let (_, looked) = store
        .heartbeat_looking(&test_beat("b~1", "b", 4))
        .await
        .unwrap();
    assert_eq!(looked, pending, "the registry's own beat");
}

/// A database server the tests reach: the variable naming its URL, the
/// URL without it, and how to start it.
#[cfg(any(feature = "postgres", feature = "mysql"))]
type Server = (&'static str, &'static str, &'static str);

#[cfg(feature = "postgres")]
const POSTGRES: Server = (
    "CRONLEASE_TEST_POSTGRES_URL",
    "postgres://postgres@127.0.0.1:5432/test",
    "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
);

#[cfg(feature = "mysql")]
const MARIADB: Server = (
    "CRONLEASE_TEST_MYSQL_URL",
    "mysql://root@127.0.0.1:3306/test",
    "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
);

/// A store on `server` with tables of its own (a prefix no other test
/// uses), prepared; a pool of 2 connections.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn server_store((var, default, start): Server) -> SqlStore {
    let url = std::env::var(var).unwrap_or_else(|_| default.into());
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
        panic!("the database at {url}: {e}; start it with `{start}`");
    }
    store
}

/// A heartbeat goes on the connection of its own, not one of the pool's:
/// it goes through while claims hold every pooled connection (before, it
/// waited for one until the operation timeout and failed), and beat after
/// beat on the same connection.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn beats_beside_a_busy_pool(server: Server) {
    let store = server_store(server).await;
    let pool = store.pool();
    let held = [pool.acquire().await.unwrap(), pool.acquire().await.unwrap()];
    assert_eq!(pool.num_idle(), 0, "the test holds the whole pool");
    for _ in 0..3 {
        let (nodes, pending) = tokio::time::timeout(
            Duration::from_secs(3),
            store.heartbeat_looking(&test_beat("n1~1", "n1", 0)),
        )
        .await
        .unwrap_or_else(|_| panic!("a beat waited for the pool"))
        .unwrap();
        let owners: Vec<&str> = nodes.iter().map(|n| n.owner.as_str()).collect();
        assert_eq!(owners, ["n1~1"]);
        assert!(pending.is_some(), "the look went with the beat");
        let nodes = store.heartbeat(&test_beat("n1~1", "n1", 0)).await.unwrap();
        assert_eq!(nodes.len(), 1);
    }
    drop(held);
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_beats_on_a_connection_of_their_own() {
    beats_beside_a_busy_pool(POSTGRES).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_beats_on_a_connection_of_their_own() {
    beats_beside_a_busy_pool(MARIADB).await;
}

/// A store at `url` with its tables under `prefix`, not prepared.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
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
