//! The audit on one Redis master ([`crate::store::audit`]): a sorted set
//! per job (`{prefix}{JOB}:audit`) of members `ID JSON` scored by the
//! entry's time, written and trimmed by `audit.lua`. Redlock writes it on
//! every master (`redlock/audit.rs`).

use super::*;
use crate::store::{Audit, AuditEntry, audit};

/// The job's audit key.
pub(crate) fn audit_key(prefix: &str, job: &str) -> String {
    job_key(prefix, job, "audit")
}

/// `audit.lua`'s keys and arguments for `entry`.
pub(crate) fn audit_args(
    prefix: &str,
    entry: &AuditEntry,
    keep: u32,
) -> ([String; 1], [String; 3]) {
    (
        [audit_key(prefix, &entry.job)],
        [
            keep.max(1).to_string(),
            entry.at.timestamp_millis().to_string(),
            format!("{} {}", entry.id, entry.to_json()),
        ],
    )
}

/// The entries of the audit keys `keys`, the newest `limit` of each, read
/// in pipelines of [`STREAMS_PER_PIPELINE`] keys.
pub(crate) async fn read_audit(
    conn: &mut ConnectionManager,
    prefix: &str,
    keys: &[String],
    limit: u32,
) -> redis::RedisResult<Vec<AuditEntry>> {
    let mut entries = Vec::new();
    if limit == 0 {
        return Ok(entries);
    }
    for chunk in keys.chunks(STREAMS_PER_PIPELINE) {
        let mut pipe = redis::pipe();
        for key in chunk {
            pipe.cmd("ZREVRANGE").arg(key).arg(0).arg(limit - 1);
        }
        let replies: Vec<Vec<String>> = pipe.query_async(conn).await?;
        for (key, members) in chunk.iter().zip(replies) {
            let Some(job) = job_of(prefix, key, "audit") else {
                continue;
            };
            entries.extend(members.iter().map(|m| entry_of_member(&job, m)));
        }
    }
    Ok(entries)
}

/// A member read back; one this version cannot read is shown, not hidden.
fn entry_of_member(job: &str, member: &str) -> AuditEntry {
    let (id, json) = member.split_once(' ').unwrap_or((member, ""));
    AuditEntry::from_stored(job, id, json.as_bytes())
}

#[async_trait]
impl Audit for RedisStore {
    /// Through Sentinel with `wait`, a write fewer replicas acknowledged
    /// fails.
    async fn record_action(&self, entry: &AuditEntry, keep: u32) -> Result<(), StoreError> {
        let (keys, args) = audit_args(&self.prefix, entry, keep);
        let _kept: i64 = self.eval(&self.audit, &keys, &args).await?;
        Ok(())
    }

    async fn actions(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let keys = match job {
            Some(job) => vec![audit_key(&self.prefix, job.as_str())],
            None => self.scan("audit").await?,
        };
        let mut conn = self.conn().await?;
        let mut entries = read_audit(&mut conn, &self.prefix, &keys, limit)
            .await
            .map_err(|e| self.err(e))?;
        audit::newest_first(&mut entries, limit);
        Ok(entries)
    }
}
