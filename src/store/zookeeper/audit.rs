//! The audit ([`crate::store::audit`]): a persistent znode per entry under
//! `{base}/audit/<job>/`, named by its id (ids sort by time), trimmed to
//! the job's newest `keep`.

use super::*;
use crate::store::{Audit, AuditEntry, audit};

/// Entries read per multi read.
const ENTRIES_PER_READ: usize = 200;

#[async_trait]
impl Audit for ZkStore {
    /// Created once (a write asked again finds it there), then the job's
    /// oldest entries past `keep` deleted (a failure there is a WARN: the
    /// entry is kept, the next write trims).
    async fn record_action(&self, entry: &AuditEntry, keep: u32) -> Result<(), StoreError> {
        let client = self.client().await?;
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        let dir = self.paths.of(Kind::Audit, &entry.job);
        if !self.known_dir(&dir) {
            self.timed(client.mkdir(&dir, &persistent)).await?;
            lock(&self.run_dirs).insert(dir.clone());
        }
        self.idempotent(
            client.create(
                &self.paths.audit(&entry.job, &entry.id),
                entry.to_json().as_bytes(),
                &persistent,
            ),
            zk::Error::NodeExists,
        )
        .await?;
        if let Err(e) = self.trim_children(&client, &dir, keep).await {
            audit::trim_failed(self.url.redacted(), &entry.job, &e);
        }
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
        let client = self.client().await?;
        let jobs = match job {
            Some(j) => vec![j.as_str().to_string()],
            None => match self
                .timed(client.list_children(&self.paths.dir(Kind::Audit)))
                .await
            {
                Ok(jobs) => jobs,
                // No action recorded yet (or a store of an earlier version).
                Err(StoreError::NotMigrated { .. }) => return Ok(Vec::new()),
                Err(e) => return Err(e),
            },
        };
        // Each job's ids listed (the listings sent together), then only
        // the newest `limit` of them all read: ids sort by time across jobs.
        let listed = futures_util::future::join_all(jobs.iter().map(|j| {
            let client = &client;
            async move {
                let dir = self.paths.of(Kind::Audit, j);
                match self.timed(client.list_children(&dir)).await {
                    Ok(names) => Ok((j.as_str(), names)),
                    Err(StoreError::NotMigrated { .. }) => Ok((j.as_str(), Vec::new())),
                    Err(e) => Err(e),
                }
            }
        }))
        .await
        .into_iter()
        .collect::<Result<Vec<_>, StoreError>>()?;
        let ids: Vec<(&str, &str)> = listed
            .iter()
            .flat_map(|(j, names)| {
                names
                    .iter()
                    .filter(|n| AuditEntry::id_is_valid(n))
                    .map(move |n| (*j, n.as_str()))
            })
            .collect();
        let wanted = audit::newest_ids(ids, limit);
        let mut entries = Vec::with_capacity(wanted.len());
        // Entries are small (at most about 1.2 KiB): a few hundred per
        // multi read stay far below ZooKeeper's 1 MiB packet limit.
        for chunk in wanted.chunks(ENTRIES_PER_READ) {
            let mut reader = client.new_multi_reader();
            for (j, id) in chunk {
                reader
                    .add_get_data(&self.paths.audit(j, id))
                    .map_err(|e| self.err(e))?;
            }
            let results = self.timed(reader.commit()).await?;
            for ((j, id), r) in chunk.iter().zip(results) {
                match r {
                    zk::MultiReadResult::Data { data, .. } => {
                        entries.push(AuditEntry::from_stored(j, id, &data));
                    }
                    // Trimmed between the listing and the read.
                    zk::MultiReadResult::Error {
                        err: zk::Error::NoNode,
                    } => {}
                    zk::MultiReadResult::Error { err } => return Err(self.err(err)),
                    _ => {}
                }
            }
        }
        audit::newest_first(&mut entries, limit);
        Ok(entries)
    }
}
