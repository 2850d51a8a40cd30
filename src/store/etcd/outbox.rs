//! The outbox ([`crate::store::outbox`]): a key per parcel under
//! `{key_prefix}outbox/`, named by its id; a parcel is taken by a
//! transaction deleting its key at the revision read, which one taker
//! alone can commit.

use super::*;
use crate::store::{Outbox, Parcel, outbox};

#[async_trait]
impl Outbox for EtcdStore {
    async fn hand_over(&self, parcels: &[Parcel]) -> Result<(), StoreError> {
        outbox::checked(self.url.redacted(), parcels)?;
        let client = self.client().await?;
        let mut kv = client.kv_client();
        for chunk in parcels.chunks(MAX_TXN_OPS) {
            let puts: Vec<TxnOp> = chunk
                .iter()
                .map(|p| {
                    TxnOp::put(
                        self.keys.of(Kind::Outbox, &p.id),
                        p.body.as_bytes().to_vec(),
                        None,
                    )
                })
                .collect();
            self.timed(kv.txn(Txn::new().and_then(puts))).await?;
        }
        Ok(())
    }

    async fn take_handed_over(
        &self,
        _taker: &Owner,
        max: usize,
    ) -> Result<Vec<Parcel>, StoreError> {
        let client = self.client().await?;
        let mut kv = client.kv_client();
        let prefix = self.keys.of(Kind::Outbox, "");
        let options = GetOptions::new()
            .with_prefix()
            .with_limit(i64::try_from(max).unwrap_or(i64::MAX));
        let found = self.timed(kv.get(prefix.as_str(), Some(options))).await?;
        let mut taken = Vec::new();
        for item in found.kvs() {
            let Ok(key) = std::str::from_utf8(item.key()) else {
                continue;
            };
            let Some(id) = key.strip_prefix(&prefix) else {
                continue;
            };
            let take = Txn::new()
                .when([Compare::mod_revision(
                    key,
                    CompareOp::Equal,
                    item.mod_revision(),
                )])
                .and_then([TxnOp::delete(key, None)]);
            match self.timed(kv.txn(take)).await {
                Ok(done) if done.succeeded() => taken.push(Parcel {
                    id: id.to_string(),
                    body: String::from_utf8_lossy(item.value()).into_owned(),
                }),
                Ok(_) => {}
                Err(e) if taken.is_empty() => return Err(e),
                Err(_) => break,
            }
        }
        Ok(taken)
    }
}
