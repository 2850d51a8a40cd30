//! The audit ([`crate::store::audit`]): a row per entry in
//! `{prefix}audit`, keyed by (job, id), trimmed to the job's newest `keep`.

use super::*;
use crate::store::{Audit, AuditEntry, audit};

#[async_trait]
impl Audit for SqlStore {
    /// The row replaced (a write asked again leaves one), then the job's
    /// rows older than its newest `keep` deleted ([`SqlStore::trim_audit`]).
    async fn record_action(&self, entry: &AuditEntry, keep: u32) -> Result<(), StoreError> {
        let p = &self.prefix;
        self.retrying(|| async {
            let mut tx = self.pool().begin().await?;
            sqlx::query(self.sql(
                format!("DELETE FROM {p}audit WHERE job = ? AND id = ?"),
                Some(0),
            )?)
            .bind(entry.job.clone())
            .bind(entry.id.clone())
            .execute(&mut *tx)
            .await?;
            sqlx::query(self.sql(
                format!("INSERT INTO {p}audit (id, job, body) VALUES (?, ?, ?)"),
                Some(0),
            )?)
            .bind(entry.id.clone())
            .bind(entry.job.clone())
            .bind(entry.to_json())
            .execute(&mut *tx)
            .await?;
            tx.commit().await
        })
        .await
        .map_err(|e| self.err(e))?;
        self.trim_audit(&entry.job, keep).await;
        Ok(())
    }

    async fn actions(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let p = &self.prefix;
        let rows = self
            .retrying(|| async {
                let query = match job {
                    Some(job) => sqlx::query(self.sql(
                        format!(
                            "SELECT job, id, body FROM {p}audit WHERE job = ? ORDER BY id DESC LIMIT ?"
                        ),
                        Some(0),
                    )?)
                    .bind(job.as_str().to_string()),
                    None => sqlx::query(self.sql(
                        format!("SELECT job, id, body FROM {p}audit ORDER BY id DESC LIMIT ?"),
                        Some(0),
                    )?),
                };
                query
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool())
                    .await
            })
            .await
            .map_err(|e| self.err(e))?;
        let mut entries = Vec::with_capacity(rows.len());
        for row in rows {
            match (
                row.try_get::<String, _>(0),
                row.try_get::<String, _>(1),
                row.try_get::<String, _>(2),
            ) {
                (Ok(job), Ok(id), Ok(body)) => {
                    entries.push(AuditEntry::from_stored(&job, &id, body.as_bytes()))
                }
                (job, id, _) => tracing::warn!(
                    store = %self.url.redacted(),
                    job = %crate::config::one_line(&job.unwrap_or_default()),
                    entry = %crate::config::one_line(&id.unwrap_or_default()),
                    "an audit row cannot be read; skipped"
                ),
            }
        }
        audit::newest_first(&mut entries, limit);
        Ok(entries)
    }
}

impl SqlStore {
    /// Deletes `job`'s entries older than its newest `keep`: two statements,
    /// each harmless to repeat. A failure is a WARN, not the write's error
    /// (the entry is kept; the next write trims).
    async fn trim_audit(&self, job: &str, keep: u32) {
        let p = &self.prefix;
        let keep = i64::from(keep.max(1));
        let trimmed = self
            .retrying(|| async {
                // The oldest id kept; those before it go (MySQL cannot
                // delete from a table its own subquery reads).
                let oldest: Option<String> = sqlx::query_scalar(self.sql(
                    format!(
                        "SELECT id FROM {p}audit WHERE job = ? ORDER BY id DESC LIMIT 1 OFFSET {}",
                        keep - 1
                    ),
                    Some(0),
                )?)
                .bind(job.to_string())
                .fetch_optional(&self.pool())
                .await?;
                if let Some(oldest) = oldest {
                    sqlx::query(self.sql(
                        format!("DELETE FROM {p}audit WHERE job = ? AND id < ?"),
                        Some(0),
                    )?)
                    .bind(job.to_string())
                    .bind(oldest)
                    .execute(&self.pool())
                    .await?;
                }
                Ok(())
            })
            .await;
        if let Err(e) = trimmed {
            audit::trim_failed(self.url.redacted(), job, &self.err(e));
        }
    }
}
