//! The outbox ([`crate::store::outbox`]): a row per parcel in
//! `{prefix}outbox`; a parcel is taken by the `DELETE` of its id that
//! removed the row, so of two nodes taking at once each parcel goes to one.

use super::*;
use crate::store::{Outbox, Parcel, outbox};

#[async_trait]
impl Outbox for SqlStore {
    /// Each parcel's row replaced, all in one transaction.
    async fn hand_over(&self, parcels: &[Parcel]) -> Result<(), StoreError> {
        outbox::checked(self.url.redacted(), parcels)?;
        if parcels.is_empty() {
            return Ok(());
        }
        let p = &self.prefix;
        self.retrying(|| async {
            let mut tx = self.pool().begin().await?;
            for parcel in parcels {
                sqlx::query(self.sql(format!("DELETE FROM {p}outbox WHERE id = ?"), None)?)
                    .bind(parcel.id.clone())
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(self.sql(
                    format!("INSERT INTO {p}outbox (id, body, handed_at) VALUES (?, ?, {{now}})"),
                    None,
                )?)
                .bind(parcel.id.clone())
                .bind(parcel.body.clone())
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await
        })
        .await
        .map_err(|e| self.err(e))
    }

    /// The oldest `max` rows of the prefix read, then each deleted on its
    /// own until half of `op_timeout` has passed ([`outbox::one_by_one`]):
    /// the parcels whose delete removed a row
    /// are this caller's. The prefix is compared with `substr` (binary on
    /// every dialect: `LIKE` is not, on SQLite).
    async fn take_handed_over(
        &self,
        _taker: &Owner,
        prefix: &str,
        max: usize,
    ) -> Result<Vec<Parcel>, StoreError> {
        let until = tokio::time::Instant::now() + self.op_timeout / 2;
        let p = &self.prefix;
        let limit = i64::try_from(max).unwrap_or(i64::MAX);
        let rows = self
            .retrying(|| async {
                sqlx::query(self.sql(
                    format!(
                        "SELECT id, body FROM {p}outbox WHERE substr(id, 1, {}) = ? ORDER BY id LIMIT ?",
                        prefix.len()
                    ),
                    None,
                )?)
                .bind(prefix.to_string())
                .bind(limit)
                .fetch_all(&self.pool())
                .await
            })
            .await
            .map_err(|e| self.err(e))?;
        let mut candidates = Vec::with_capacity(rows.len());
        for row in rows {
            match (row.try_get::<String, _>(0), row.try_get::<String, _>(1)) {
                (Ok(id), Ok(body)) if id.starts_with(prefix) => {
                    candidates.push(Parcel { id, body })
                }
                (Ok(_), Ok(_)) => {}
                (id, _) => tracing::warn!(
                    store = %self.url.redacted(),
                    parcel = %id.unwrap_or_default(),
                    "a handed-over parcel's row cannot be read; left in the outbox"
                ),
            }
        }
        outbox::one_by_one(candidates, until, |parcel| async move {
            let done = self
                .retrying(|| async {
                    sqlx::query(self.sql(format!("DELETE FROM {p}outbox WHERE id = ?"), None)?)
                        .bind(parcel.id.clone())
                        .execute(&self.pool())
                        .await
                })
                .await
                .map_err(|e| self.err(e))?;
            Ok((done.rows_affected() == 1).then_some(parcel))
        })
        .await
    }
}
