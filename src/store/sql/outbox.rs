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

    /// The oldest `max` rows read, then each deleted on its own: the
    /// parcels whose delete removed a row are this caller's. A failure
    /// after some were taken answers those (they are out of the store).
    async fn take_handed_over(
        &self,
        _taker: &Owner,
        max: usize,
    ) -> Result<Vec<Parcel>, StoreError> {
        let p = &self.prefix;
        let limit = i64::try_from(max).unwrap_or(i64::MAX);
        let rows = self
            .retrying(|| async {
                sqlx::query(self.sql(
                    format!("SELECT id, body FROM {p}outbox ORDER BY id LIMIT ?"),
                    None,
                )?)
                .bind(limit)
                .fetch_all(&self.pool())
                .await
            })
            .await
            .map_err(|e| self.err(e))?;
        let mut taken = Vec::new();
        for row in rows {
            let (Ok(id), Ok(body)) = (row.try_get::<String, _>(0), row.try_get::<String, _>(1))
            else {
                continue;
            };
            let deleted = self
                .retrying(|| async {
                    sqlx::query(self.sql(format!("DELETE FROM {p}outbox WHERE id = ?"), None)?)
                        .bind(id.clone())
                        .execute(&self.pool())
                        .await
                })
                .await;
            match deleted {
                Ok(done) if done.rows_affected() == 1 => taken.push(Parcel { id, body }),
                Ok(_) => {}
                Err(e) if taken.is_empty() => return Err(self.err(e)),
                Err(_) => break,
            }
        }
        Ok(taken)
    }
}
