//! The outbox ([`crate::store::outbox`]): a key per parcel under
//! `{key_prefix}outbox/`, named by its id; a parcel is taken by the
//! delete of its key that answers its previous value (of two deletes, one
//! finds the key).

use super::*;
use crate::store::{Outbox, Parcel, outbox};

/// Bytes of parcels per hand-over transaction: under etcd's default
/// request limit (1.5 MiB).
const HAND_OVER_BYTES: usize = 1024 * 1024;

#[async_trait]
impl Outbox for EtcdStore {
    async fn hand_over(&self, parcels: &[Parcel]) -> Result<(), StoreError> {
        outbox::checked(self.url.redacted(), parcels)?;
        let client = self.client().await?;
        let mut kv = client.kv_client();
        // Transactions of at most MAX_TXN_OPS puts and HAND_OVER_BYTES
        // (etcd refuses a request of more than 1.5 MiB by default).
        let mut chunk: Vec<TxnOp> = Vec::new();
        let mut bytes = 0;
        for p in parcels {
            let size = p.id.len() + p.body.len();
            if !chunk.is_empty() && (chunk.len() >= MAX_TXN_OPS || bytes + size > HAND_OVER_BYTES) {
                self.timed(kv.txn(Txn::new().and_then(std::mem::take(&mut chunk))))
                    .await?;
                bytes = 0;
            }
            chunk.push(TxnOp::put(
                self.keys.of(Kind::Outbox, &p.id),
                p.body.as_bytes().to_vec(),
                None,
            ));
            bytes += size;
        }
        if !chunk.is_empty() {
            self.timed(kv.txn(Txn::new().and_then(chunk))).await?;
        }
        Ok(())
    }

    /// The keys of the prefix read without their values (a hundred
    /// bodies can pass etcd's reply limit), then each deleted with its
    /// previous value: the delete that answers the value took it.
    async fn take_handed_over(
        &self,
        _taker: &Owner,
        prefix: &str,
        max: usize,
    ) -> Result<Vec<Parcel>, StoreError> {
        let until = tokio::time::Instant::now() + self.op_timeout / 2;
        let client = self.client().await?;
        let root = self.keys.of(Kind::Outbox, "");
        let options = GetOptions::new()
            .with_prefix()
            .with_keys_only()
            .with_limit(i64::try_from(max).unwrap_or(i64::MAX));
        let mut kv = client.kv_client();
        let found = self
            .timed(kv.get(format!("{root}{prefix}"), Some(options)))
            .await?;
        let keys: Vec<String> = found
            .kvs()
            .iter()
            .filter_map(|item| String::from_utf8(item.key().to_vec()).ok())
            .collect();
        let (client, root) = (&client, &root);
        outbox::one_by_one(keys, until, |key| async move {
            let mut kv = client.kv_client();
            let options = DeleteOptions::new().with_prev_key();
            let deleted = self.timed(kv.delete(key.as_str(), Some(options))).await?;
            Ok(deleted.prev_kvs().first().map(|item| Parcel {
                id: key.strip_prefix(root.as_str()).unwrap_or(&key).to_string(),
                body: String::from_utf8_lossy(item.value()).into_owned(),
            }))
        })
        .await
    }
}
