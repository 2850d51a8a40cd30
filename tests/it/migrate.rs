//! Schema migrations on databases an older version left behind: version 2
//! makes history unique per (job, fence), removing the duplicates version 1
//! could write (a history write retried after a timeout that had committed),
//! and adds `decision_ms`.

use chrono::TimeDelta;
use cronlease::config::{JobName, StoreConfig, StoreUrl};
use cronlease::store::{self, Outcome, RunRecord, from_ms};

use crate::support::{Backend, Harness, unique};

fn v1_script(backend: Backend) -> &'static str {
    match backend {
        Backend::Sqlite => include_str!("../../migrations/sqlite/0001_init.sql"),
        Backend::Mysql => include_str!("../../migrations/mysql/0001_init.sql"),
        _ => include_str!("../../migrations/postgres/0001_init.sql"),
    }
}

async fn version_1_duplicates_are_removed(backend: Backend) {
    backend.require();
    let dir = tempfile::tempdir().unwrap();
    let url = StoreUrl::parse(&backend.url(dir.path()), dir.path()).unwrap();
    let mut config = StoreConfig::new(url);
    let p = unique("mg");
    config.table_prefix = p.clone();
    let s = store::connect(&config).await.unwrap();
    s.ping().await.unwrap(); // creates the SQLite file
    let h = Harness::for_config(config.clone());
    // The database as version 1 left it, with a run recorded twice.
    let script: String = v1_script(backend)
        .replace("{prefix}", &p)
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    for stmt in script.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        h.raw_sql(stmt).await;
    }
    h.raw_sql(&format!(
        "CREATE TABLE {p}cronlease_schema (version BIGINT NOT NULL PRIMARY KEY, applied_at BIGINT NOT NULL)"
    ))
    .await;
    h.raw_sql(&format!(
        "INSERT INTO {p}cronlease_schema (version, applied_at) VALUES (1, 0)"
    ))
    .await;
    let insert = format!(
        "INSERT INTO {p}job_runs (job, fence, owner, node, occurrence, started_at, finished_at, outcome, exit_code, takeover, delay_ms) VALUES ('d', 7, 'a#1', 'a', 1790000000000, 1790000000003, 1790000000010, 'ok', 0, 0, 3)"
    );
    h.raw_sql(&insert).await;
    h.raw_sql(&insert).await;
    h.raw_sql(&insert.replace("'d', 7", "'d', 8")).await;

    s.prepare().await.unwrap();
    if backend == Backend::Postgres {
        // Version 3: lock rows are updated in place on half-empty pages.
        h.raw_sql(&format!(
            "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_class WHERE relname = '{p}lock_info' AND reloptions @> ARRAY['fillfactor=50']) THEN RAISE EXCEPTION 'lock_info has no fillfactor 50'; END IF; END $$"
        ))
        .await;
    }
    let job = JobName::parse("d").unwrap();
    let fences: Vec<u64> = s
        .history(Some(&job), 10)
        .await
        .unwrap()
        .iter()
        .map(|r| r.fence)
        .collect();
    assert_eq!(fences, [8, 7], "one record per fence after migrating");
    // From now on a second write of a fence is skipped, and decision_ms kept.
    let t = from_ms(1_790_000_000_000);
    let run = RunRecord {
        job: "d".into(),
        fence: 9,
        owner: "a#1".into(),
        node: "a".into(),
        occurrence: t,
        started_at: t + TimeDelta::milliseconds(3),
        finished_at: t + TimeDelta::milliseconds(9),
        outcome: Outcome::Ok,
        exit_code: Some(0),
        takeover: false,
        delay_ms: 3,
        decision_ms: 2,
        output: String::new(),
        trigger: None,
        cpu_ms: None,
        memory_peak: None,
    };
    s.record_run(&run, 100).await.unwrap();
    s.record_run(&run, 100).await.unwrap();
    let runs = s.history(Some(&job), 10).await.unwrap();
    assert_eq!(runs.iter().map(|r| r.fence).collect::<Vec<_>>(), [9, 8, 7]);
    assert_eq!((runs[0].decision_ms, runs[1].decision_ms), (2, 0));
    // Applying the scripts again (tables dropped behind its back) is fine.
    h.raw_sql(&format!("DROP TABLE {p}lock_info")).await;
    s.prepare().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_1_duplicates_are_removed_sqlite() {
    version_1_duplicates_are_removed(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_1_duplicates_are_removed_mysql() {
    version_1_duplicates_are_removed(Backend::Mysql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_1_duplicates_are_removed_postgres() {
    version_1_duplicates_are_removed(Backend::Postgres).await;
}

/// A schema newer than this binary (a rollback, a mixed-version cluster) is
/// named, never accepted silently: a newer version of this binary's block
/// is used with a WARN and nothing applied; one of a later block (a change
/// older binaries cannot work with) is refused, by `migrate` (exit 1) and by
/// `run`, which claims nothing.
async fn a_newer_schema_is_named_and_an_incompatible_one_refused(backend: Backend) {
    backend.require();
    let dir = tempfile::tempdir().unwrap();
    let url = backend.url(dir.path());
    let p = unique("sv");
    let config_file = dir.path().join("c.toml");
    let out = dir.path().join("out");
    std::fs::write(
        &config_file,
        format!(
            "node = \"n1\"\npid_file = \"n1.pid\"\n[store]\nurl = \"{url}\"\ntable_prefix = \"{p}\"\nop_timeout = \"1s\"\n[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = \"echo run >> '{}'\"\n",
            out.display()
        ),
    )
    .unwrap();
    let cli = |args: &[&str]| {
        std::process::Command::new(crate::support::binary())
            .args(args)
            .arg("-c")
            .arg(&config_file)
            .current_dir(dir.path())
            .env_remove("CRONLEASE_STORE_URL")
            .env_remove("RUST_LOG")
            .output()
            .unwrap()
    };
    let first = cli(&["migrate"]);
    assert!(first.status.success(), "{first:?}");
    assert!(String::from_utf8_lossy(&first.stdout).contains("schema up to date"));
    let mut config = StoreConfig::new(StoreUrl::parse(&url, dir.path()).unwrap());
    config.table_prefix = p.clone();
    let h = Harness::for_config(config.clone());

    // 99: newer, same block. Named by `migrate`; `run` warns and claims.
    h.raw_sql(&format!(
        "INSERT INTO {p}cronlease_schema (version, applied_at) VALUES (99, 0)"
    ))
    .await;
    let newer = cli(&["migrate"]);
    let said = String::from_utf8_lossy(&newer.stdout);
    assert!(newer.status.success(), "{newer:?}");
    assert!(
        said.contains("schema version 99 is newer than this binary knows")
            && said.contains("nothing applied"),
        "{said}"
    );
    let s = store::connect(&config).await.unwrap();
    s.prepare().await.unwrap();
    assert!(s.schema_notice().is_some_and(|n| n.contains("99")));

    // 100: a later block. `migrate` refuses, `run` claims nothing.
    h.raw_sql(&format!(
        "INSERT INTO {p}cronlease_schema (version, applied_at) VALUES (100, 0)"
    ))
    .await;
    let refused = cli(&["migrate"]);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(
        said.contains("schema version 100, newer than this binary knows")
            && said.contains("incompatible"),
        "{said}"
    );
    assert!(matches!(
        s.prepare().await,
        Err(store::StoreError::SchemaTooNew { found: 100, .. })
    ));
    let log = std::fs::File::create(dir.path().join("run.log")).unwrap();
    let mut daemon = std::process::Command::new(crate::support::binary())
        .args(["run", "-c"])
        .arg(&config_file)
        .current_dir(dir.path())
        .env_remove("CRONLEASE_STORE_URL")
        .env_remove("RUST_LOG")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(3));
    let _ = daemon.kill();
    let _ = daemon.wait();
    let log = std::fs::read_to_string(dir.path().join("run.log")).unwrap();
    assert!(log.contains("schema version 100"), "{log}");
    assert!(
        !out.exists(),
        "the job ran on an incompatible schema\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_is_named_and_an_incompatible_one_refused_sqlite() {
    a_newer_schema_is_named_and_an_incompatible_one_refused(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_is_named_and_an_incompatible_one_refused_postgres() {
    a_newer_schema_is_named_and_an_incompatible_one_refused(Backend::Postgres).await;
}
