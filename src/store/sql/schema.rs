//! The schema: tables made and migrated in blocks, the version recorded,
//! and a schema newer than this binary noticed.

use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

/// What [`SqlStore::migrate`] found: the newest schema version recorded
/// before it ran, and the newest this binary knows.
pub(super) struct SchemaVersions {
    pub(super) found: i64,
    pub(super) known: i64,
}

/// MySQL has no `IF NOT EXISTS` for indexes and columns, SQLite none for
/// columns: when scripts are applied again, what exists is fine.
pub(super) fn already_there(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("duplicate key name") || m.contains("duplicate column name")
}

/// Splits a migration script into statements, dropping `--` comments.
pub(super) fn split_statements(script: &str) -> Vec<String> {
    let without_comments: String = script
        .lines()
        .map(|l| l.split("--").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    without_comments
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// The upgrade drill's "next release" (tests/it/hosts.rs `upgrade`,
/// `examples/upgrade_next.rs`, packaged by `.ci/deb next`) turns this on
/// before it runs: the binary then knows one PostgreSQL migration more (a
/// column added) than this release. Only a test build (`failpoints`) has
/// the switch; in a release build this stays false.
static UPGRADE_DRILL: AtomicBool = AtomicBool::new(false);

/// Makes this process the upgrade drill's next release (see
/// [`UPGRADE_DRILL`]); for `examples/upgrade_next.rs` only.
#[cfg(feature = "failpoints")]
pub fn be_the_upgrade_drills_next_release() {
    UPGRADE_DRILL.store(true, Ordering::Relaxed);
}

/// The drill's migration, numbered after this release's last.
const UPGRADE_DRILL_SCRIPT: &str = include_str!("../../../tests/upgrade/postgres_next.sql");

/// The migrations this binary applies, in order: the dialect's, and the
/// upgrade drill's on PostgreSQL in the drill's next release.
fn migrations(dialect: &Dialect) -> Vec<(i64, &'static str)> {
    let mut all = dialect.migrations.to_vec();
    if UPGRADE_DRILL.load(Ordering::Relaxed) && dialect.name == "postgres" {
        let next = all.iter().map(|(v, _)| *v).max().unwrap_or(0) + 1;
        all.push((next, UPGRADE_DRILL_SCRIPT));
    }
    all
}

impl SqlStore {
    /// Applies pending migrations on a connection of its own, under the
    /// database's migration lock, so nodes starting together do not collide.
    pub(super) async fn migrate(&self) -> Result<SchemaVersions, sqlx::Error> {
        let mut conn = AnyConnection::connect(&self.connect_url).await?;
        #[cfg(feature = "postgres")]
        if self.dialect.name == "postgres" {
            // `CREATE ... IF NOT EXISTS` of what exists is a NOTICE, which
            // every start would log ([`super::postgres::QUIET_NOTICES`]).
            sqlx::raw_sql(super::postgres::QUIET_NOTICES)
                .execute(&mut conn)
                .await?;
        }
        let p = &self.prefix;
        let lock_key = format!("cronlease_migrate_{p}");
        let (lock, unlock): (String, String) = match self.dialect.name {
            "sqlite" => ("BEGIN IMMEDIATE".into(), "COMMIT".into()),
            "mysql" => (
                format!("SELECT GET_LOCK('{lock_key}', 30)"),
                format!("SELECT RELEASE_LOCK('{lock_key}')"),
            ),
            _ => (
                format!("BEGIN; SELECT pg_advisory_xact_lock(hashtext('{lock_key}'))"),
                "COMMIT".into(),
            ),
        };
        #[cfg(feature = "sqlite")]
        if self.dialect.name == "sqlite" {
            super::sqlite::prepare_for_migration(&mut conn).await?;
        }
        sqlx::raw_sql(AssertSqlSafe(lock))
            .execute(&mut conn)
            .await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {p}cronlease_schema (version BIGINT NOT NULL PRIMARY KEY, applied_at BIGINT NOT NULL)"
        )))
        .execute(&mut conn)
        .await?;
        let applied: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT version FROM {p}cronlease_schema"
        )))
        .fetch_all(&mut conn)
        .await?;
        let migrations = migrations(self.dialect);
        let versions = SchemaVersions {
            found: applied.iter().copied().max().unwrap_or(0),
            known: migrations.iter().map(|(v, _)| *v).max().unwrap_or(0),
        };
        if versions.found > versions.known {
            // A newer binary migrated it: apply nothing of ours.
            sqlx::raw_sql(AssertSqlSafe(unlock))
                .execute(&mut conn)
                .await?;
            conn.close().await?;
            return Ok(versions);
        }
        // Tables dropped behind our back (a restore, a hand edit) while the
        // schema table still lists their version: apply the scripts again
        // (they create only what is missing) instead of failing every call.
        let mut tables_present = true;
        for table in ["lock_info", "job_runs", "nodes", "outbox", "audit"] {
            let present = if self.dialect.name == "postgres" {
                // A failed statement would abort the migration's transaction.
                let probe = format!(
                    "SELECT COUNT(*) FROM (SELECT to_regclass('{p}{table}') AS t) x WHERE t IS NOT NULL"
                );
                sqlx::query_scalar::<_, i64>(AssertSqlSafe(probe))
                    .fetch_one(&mut conn)
                    .await?
                    > 0
            } else {
                let probe = format!("SELECT 1 FROM {p}{table} WHERE 1 = 0");
                sqlx::raw_sql(AssertSqlSafe(probe))
                    .execute(&mut conn)
                    .await
                    .is_ok()
            };
            tables_present &= present;
        }
        for (version, script) in &migrations {
            if applied.contains(version) && tables_present {
                continue;
            }
            let script = script.replace("{prefix}", p);
            for stmt in split_statements(&script) {
                match sqlx::raw_sql(AssertSqlSafe(stmt)).execute(&mut conn).await {
                    Err(sqlx::Error::Database(db)) if already_there(db.message()) => {}
                    other => {
                        other?;
                    }
                }
            }
            if applied.contains(version) {
                continue;
            }
            let now = match self.file_clock_now()? {
                Some(now) => now.to_string(),
                None => self.dialect.now_ms.to_string(),
            };
            let record = format!(
                "INSERT INTO {p}cronlease_schema (version, applied_at) VALUES ({version}, {now})"
            );
            sqlx::raw_sql(AssertSqlSafe(record))
                .execute(&mut conn)
                .await?;
        }
        sqlx::raw_sql(AssertSqlSafe(unlock))
            .execute(&mut conn)
            .await?;
        conn.close().await?;
        Ok(versions)
    }
}
