//! The audit (docs/protocol.md, "Audit"): who paused, resumed, triggered
//! or cancelled a job, and why, kept with the job's records in the store
//! (the newest `store.history_limit` per job, as its runs are), so
//! `status`, `history`, the API and the dashboard of any node show it.
//!
//! Each entry is an [`AuditEntry`] with an id unique across the cluster
//! that sorts by time (the store's clock in milliseconds, then random hex),
//! written once (a write asked again replaces it, same id) and read newest
//! first. How each store keeps it:
//! - SQL: a row per entry in `{prefix}audit` (schema 13);
//! - Redis, Sentinel: a sorted set per job (`…:audit`) of members
//!   `ID JSON` scored by the time, added to and trimmed by one script;
//! - Redlock: that set on every master, read from a majority (the union,
//!   each entry once);
//! - ZooKeeper: a znode per entry under `audit/<job>/`;
//! - etcd: a key per entry under `audit/<job>/`;
//! - memory: a list per job.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::StoreError;
use crate::config::JobName;

/// The longest `by` kept (bytes).
pub const MAX_BY: usize = 200;
/// The longest reason kept (bytes), as a cancel's.
pub const MAX_REASON: usize = crate::cancel::MAX_REASON;
/// The longest detail kept (bytes).
pub const MAX_DETAIL: usize = 300;

/// What an operator did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Act {
    Pause,
    Resume,
    /// A manual run requested (`trigger`, POST …/trigger).
    Trigger,
    /// A pending request withdrawn (`trigger --cancel`, DELETE …/trigger,
    /// or `cancel` with no run going).
    Withdraw,
    /// A running run asked to stop.
    Cancel,
    /// An entry of a newer version's kind: shown, never an error.
    #[serde(other)]
    Other,
}

impl Act {
    /// The stored and shown form.
    pub fn as_str(self) -> &'static str {
        match self {
            Act::Pause => "pause",
            Act::Resume => "resume",
            Act::Trigger => "trigger",
            Act::Withdraw => "withdraw",
            Act::Cancel => "cancel",
            Act::Other => "other",
        }
    }
}

impl std::fmt::Display for Act {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One operator action on one job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// Unique, in time order: `at` in milliseconds (13 digits), `-`, 8
    /// random hex digits. A valid znode name and key part on every store.
    pub id: String,
    pub job: String,
    /// When (the store's clock, as the one who acted read it; RFC 3339).
    pub at: DateTime<Utc>,
    pub action: Act,
    /// Who: `token NAME` for the API, `user@host` for the CLI.
    pub by: String,
    /// Why, as they said it (empty: no reason given).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// What it did: the request's id, the fences asked to stop, what a
    /// resume caught up, or that it changed nothing.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

impl AuditEntry {
    /// An entry with a fresh id; `by`, `reason` and `detail` made one line
    /// and cut to their limits (they go into tables and log lines).
    pub fn new(
        job: &JobName,
        at: DateTime<Utc>,
        action: Act,
        by: &str,
        reason: Option<&str>,
        detail: &str,
    ) -> AuditEntry {
        let mut random = [0u8; 4];
        if getrandom::fill(&mut random).is_err() {
            // No randomness: the process and the clock's nanoseconds keep
            // two entries of one millisecond apart.
            let n = std::process::id()
                ^ std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.subsec_nanos());
            random = n.to_be_bytes();
        }
        let ms = at.timestamp_millis().clamp(0, 9_999_999_999_999);
        AuditEntry {
            id: format!("{ms:013}-{}", crate::config::hex(&random)),
            job: job.to_string(),
            at,
            action,
            by: crate::cancel::one_line(by, MAX_BY),
            reason: reason.map_or_else(String::new, |r| crate::cancel::one_line(r, MAX_REASON)),
            detail: crate::cancel::one_line(detail, MAX_DETAIL),
        }
    }

    /// The stored form (JSON).
    pub fn to_json(&self) -> String {
        // A struct of strings, a number and a unit enum always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A stored entry read back, whoever wrote it: its text fields made one
    /// line and cut as [`AuditEntry::new`] makes them, its job and id the
    /// place it was found under. One that cannot be read is shown as an
    /// `other` entry saying so (never an error, never hidden).
    pub fn from_stored(job: &str, id: &str, data: &[u8]) -> AuditEntry {
        let at = id
            .split('-')
            .next()
            .and_then(|ms| ms.parse::<i64>().ok())
            .map_or_else(|| super::from_ms(0), super::from_ms);
        match serde_json::from_slice::<AuditEntry>(data) {
            Ok(read) => AuditEntry {
                id: id.to_string(),
                job: job.to_string(),
                at: read.at,
                action: read.action,
                by: crate::cancel::one_line(&read.by, MAX_BY),
                reason: crate::cancel::one_line(&read.reason, MAX_REASON),
                detail: crate::cancel::one_line(&read.detail, MAX_DETAIL),
            },
            Err(_) => AuditEntry {
                id: id.to_string(),
                job: job.to_string(),
                at,
                action: Act::Other,
                by: "?".into(),
                reason: String::new(),
                detail: format!(
                    "malformed entry {}",
                    crate::cancel::one_line(id, MAX_DETAIL / 2)
                ),
            },
        }
    }

    /// Whether `id` is one [`AuditEntry::new`] makes (a stored name not one
    /// is someone else's and skipped).
    pub fn id_is_valid(id: &str) -> bool {
        let b = id.as_bytes();
        b.len() == 22
            && b[13] == b'-'
            && b[..13].iter().all(u8::is_ascii_digit)
            && b[14..]
                .iter()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    }
}

/// The newest `limit` of `(job, id)` pairs (by id, each once): which
/// entries a store reads the bodies of, having listed every job's ids.
pub fn newest_ids<'a>(mut ids: Vec<(&'a str, &'a str)>, limit: u32) -> Vec<(&'a str, &'a str)> {
    ids.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    ids.dedup();
    ids.truncate(limit as usize);
    ids
}

/// `entries` newest first (by id), each id once, at most `limit`.
pub fn newest_first(entries: &mut Vec<AuditEntry>, limit: u32) {
    entries.sort_by(|a, b| b.id.cmp(&a.id).then_with(|| a.job.cmp(&b.job)));
    entries.dedup_by(|a, b| a.id == b.id && a.job == b.job);
    entries.truncate(limit as usize);
}

/// The WARN of a write whose entry was kept but whose job's oldest
/// entries could not be deleted (the next write of the job trims).
#[cfg(any(
    feature = "sqlite",
    feature = "mysql",
    feature = "postgres",
    feature = "zookeeper",
    feature = "etcd"
))]
pub(crate) fn trim_failed(store: &str, job: &str, error: &dyn std::fmt::Display) {
    tracing::warn!(
        store = %store,
        job = %job,
        error = %error,
        "the audit's oldest entries of a job could not be deleted; the next entry's write tries again"
    );
}

/// The audit half of a store.
#[async_trait]
pub trait Audit: Send + Sync + 'static {
    /// Keeps `entry` with its job's records; the job keeps its newest
    /// `keep` entries. Idempotent: written again (same id), it is there
    /// once.
    async fn record_action(&self, entry: &AuditEntry, keep: u32) -> Result<(), StoreError>;

    /// The newest `limit` entries of `job` (of every job with `None`),
    /// newest first.
    async fn actions(
        &self,
        job: Option<&JobName>,
        limit: u32,
    ) -> Result<Vec<AuditEntry>, StoreError>;
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_round_trips_and_its_id_sorts_by_time() {
        let job = JobName::parse("backup").unwrap();
        let at = super::super::from_ms(1_764_000_000_123);
        let e = AuditEntry::new(
            &job,
            at,
            Act::Pause,
            "alice@web-1",
            Some(" disk\nfull "),
            "",
        );
        assert!(AuditEntry::id_is_valid(&e.id), "{}", e.id);
        assert!(e.id.starts_with("1764000000123-"), "{}", e.id);
        assert_eq!(e.reason, "disk full");
        let back = AuditEntry::from_stored("backup", &e.id, e.to_json().as_bytes());
        assert_eq!(back, e);
        let later = AuditEntry::new(
            &job,
            at + chrono::Duration::milliseconds(1),
            Act::Resume,
            "b",
            None,
            "",
        );
        let mut all = vec![e.clone(), later.clone(), e.clone()];
        newest_first(&mut all, 10);
        assert_eq!(all, vec![later, e]);
    }

    #[test]
    fn a_malformed_or_foreign_entry_is_shown_on_one_line_not_an_error() {
        let bad = AuditEntry::from_stored("j", "1764000000000-0000abcd", b"{");
        assert_eq!(bad.action, Act::Other);
        assert!(bad.detail.contains("malformed"), "{}", bad.detail);
        assert_eq!(bad.at, super::super::from_ms(1_764_000_000_000));
        let raw = br#"{"id":"x","job":"y","at":"2026-12-04T00:00:00Z","action":"rename","by":"a\nb","reason":"x\u001b[2Jy"}"#;
        let read = AuditEntry::from_stored("j", "1764000000000-0000abcd", raw);
        assert_eq!(
            (
                read.action,
                read.by.as_str(),
                read.reason.as_str(),
                read.job.as_str()
            ),
            (Act::Other, "a b", "x [2Jy", "j")
        );
        assert!(!AuditEntry::id_is_valid("176400000000-0000abcd"));
        assert!(!AuditEntry::id_is_valid("1764000000000-0000abcG"));
        assert!(!AuditEntry::id_is_valid("../../x"));
    }
}
