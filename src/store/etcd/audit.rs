//! The audit ([`crate::store::audit`]): a key per entry under
//! `{key_prefix}audit/<job>/`, named by its id (ids sort by time), trimmed
//! to the job's newest `keep`.

use super::*;
use crate::store::{Audit, AuditEntry, audit};

#[async_trait]
impl Audit for EtcdStore {
    /// Put (a write asked again puts the same value), then the job's
    /// oldest keys past `keep` deleted, [`MAX_TXN_OPS`] per transaction
    /// (a failure there is a WARN: the entry is kept, the next write
    /// trims).
    async fn record_action(&self, entry: &AuditEntry, keep: u32) -> Result<(), StoreError> {
        let client = self.client().await?;
        let mut kv = client.kv_client();
        self.timed(kv.put(
            self.keys.audit(&entry.job, &entry.id),
            entry.to_json().into_bytes(),
            None,
        ))
        .await?;
        if let Err(e) = self.trim_audit(&client, &entry.job, keep).await {
            audit::trim_failed(self.url.redacted(), &entry.job, &e);
        }
        Ok(())
    }

    /// The keys read without their values, the newest `limit` of them
    /// chosen, then only those read.
    async fn actions(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let client = self.client().await?;
        let root = self.keys.of(Kind::Audit, "");
        let under = match job {
            Some(j) => format!("{}/", self.keys.of(Kind::Audit, j.as_str())),
            None => root.clone(),
        };
        let keys = self.keys_under(&client, &under).await?;
        let ids: Vec<(&str, &str)> = keys
            .iter()
            .filter_map(|key| {
                key.strip_prefix(root.as_str())?
                    .split_once('/')
                    .filter(|(_, id)| AuditEntry::id_is_valid(id))
            })
            .collect();
        // Ids sort by time across jobs: only the newest `limit` are read.
        let wanted = audit::newest_ids(ids, limit);
        let entry_keys: Vec<String> = wanted
            .iter()
            .map(|(job, id)| self.keys.audit(job, id))
            .collect();
        let values = self.read_keys(&client, &entry_keys).await?;
        let mut entries: Vec<AuditEntry> = wanted
            .iter()
            .zip(values)
            .filter_map(|((job, id), e)| e.map(|e| AuditEntry::from_stored(job, id, &e.value)))
            .collect();
        audit::newest_first(&mut entries, limit);
        Ok(entries)
    }
}

impl EtcdStore {
    /// Deletes `job`'s keys older than its newest `keep`.
    async fn trim_audit(
        &self,
        client: &etcd::Client,
        job: &str,
        keep: u32,
    ) -> Result<(), StoreError> {
        let prefix = format!("{}/", self.keys.of(Kind::Audit, job));
        let keys = self.keys_under(client, &prefix).await?;
        let surplus = keys.len().saturating_sub(keep.max(1) as usize);
        let mut kv = client.kv_client();
        for chunk in keys[..surplus].chunks(MAX_TXN_OPS) {
            let deletes: Vec<TxnOp> = chunk
                .iter()
                .map(|k| TxnOp::delete(k.as_str(), None))
                .collect();
            self.timed(kv.txn(Txn::new().and_then(deletes))).await?;
        }
        Ok(())
    }
}
