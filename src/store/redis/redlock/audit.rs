//! The audit on every master ([`crate::store::audit`]): an entry is
//! recorded once a majority of masters keep it (`audit.lua` on each), and
//! read from a majority: the union of their entries, each once, has every
//! entry recorded.

use super::*;
use crate::store::redis::{audit_args, audit_key, read_audit};
use crate::store::{Audit, AuditEntry, audit};

#[async_trait]
impl Audit for RedlockStore {
    async fn record_action(&self, entry: &AuditEntry, keep: u32) -> Result<(), StoreError> {
        let (keys, args) = audit_args(&self.prefix, entry, keep);
        let (k, a) = (&keys, &args);
        let answers = self
            .each(|m| self.eval_on::<i64>(m, &self.audit, k, a))
            .await;
        self.quorum(answers).map(|_| ())
    }

    async fn actions(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let answers = self
            .each(|m| async move {
                let keys = match job {
                    Some(job) => vec![audit_key(&self.prefix, job.as_str())],
                    None => self.scan_on(m, "audit").await?,
                };
                let mut conn = m.connection(self.op_timeout).await?;
                read_audit(&mut conn, &self.prefix, &keys, limit)
                    .await
                    .map_err(|e| store_error(&m.url, &e))
            })
            .await;
        let mut entries: Vec<AuditEntry> = self
            .quorum(answers)?
            .into_iter()
            .flat_map(|(_, list)| list)
            .collect();
        audit::newest_first(&mut entries, limit);
        Ok(entries)
    }
}
