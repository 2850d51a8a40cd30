//! What a run is owed that its daemon could not give it: its `on_failure`
//! and, for the guard's records, its webhook events (docs/protocol.md,
//! "Hooks and events a daemon could not give"). One [`Owed`] per run, one
//! file each in `STATE_DIR/owed-NODE/` ([`crate::spool`]), written by the
//! guard after it handed a dead daemon's work over ([`super::handover`]), or
//! by a stopping daemon for a run killed at the end of `shutdown_grace`;
//! given by the node's next daemon when it starts
//! ([`crate::node::owed`]).

use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::spool::{Spool, Spooled};
use crate::store::{RunRecord, TriggerId};

/// Where `node`'s daemons keep what their runs are owed.
pub fn owed_dir(state_dir: &Path, node: &str) -> PathBuf {
    state_dir.join(format!("owed-{node}"))
}

/// One run's hook and events, owed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owed {
    pub job: String,
    pub fence: u64,
    pub occurrence: DateTime<Utc>,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    /// The run's outcome, as history keeps it.
    pub outcome: String,
    pub exit_code: Option<i32>,
    pub takeover: bool,
    pub decision_ms: u64,
    /// A manual run's or a retry's request id, as stored.
    pub trigger: Option<i64>,
    /// The run's output tail, as history keeps it.
    pub output: String,
    /// Its webhook events are owed too (false: they were spooled when the
    /// run was recorded).
    pub events: bool,
    /// When it was written, Unix milliseconds.
    pub at_ms: i64,
}

impl Spooled for Owed {
    /// One per run (a job's fences are unique): a run owed again replaces
    /// what it was owed before.
    fn file_name(&self) -> String {
        format!("{}-{}.json", self.job, self.fence)
    }
}

impl Owed {
    /// The hook and events of a run the guard recorded (`record`).
    pub fn of_record(record: &RunRecord, at: DateTime<Utc>) -> Owed {
        Owed {
            job: record.job.clone(),
            fence: record.fence,
            occurrence: record.occurrence,
            started_at: record.started_at,
            finished_at: record.finished_at,
            outcome: record.outcome.as_str().to_string(),
            exit_code: record.exit_code,
            takeover: record.takeover,
            decision_ms: record.decision_ms,
            trigger: record.trigger.map(TriggerId::get),
            output: record.output.clone(),
            events: true,
            at_ms: at.timestamp_millis(),
        }
    }
}

/// Writes `owed` to `dir` (made if needed), each durably; answers a line
/// per one that could not be written. Blocking.
pub fn write_owed(dir: &Path, owed: &[Owed]) -> Vec<String> {
    if owed.is_empty() {
        return Vec::new();
    }
    let spool = match Spool::open(dir) {
        Ok(s) => s,
        Err(e) => return vec![format!("cannot open {}: {e}", dir.display())],
    };
    owed.iter()
        .filter_map(|o| {
            spool
                .write(o)
                .err()
                .map(|e| format!("{} of {} (fence {}): {e}", o.outcome, o.job, o.fence))
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;
    use crate::store::Outcome;

    /// A record as the guard writes it.
    pub(crate) fn record(job: &str, fence: u64, outcome: Outcome) -> RunRecord {
        let t = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().to_utc();
        RunRecord {
            job: job.into(),
            fence,
            owner: "n1-1".into(),
            node: "n1".into(),
            occurrence: t("2026-12-02T10:00:00Z"),
            started_at: t("2026-12-02T10:00:00.020Z"),
            finished_at: t("2026-12-02T10:00:07.500Z"),
            outcome,
            exit_code: Some(137),
            takeover: true,
            delay_ms: 20,
            decision_ms: 12,
            output: "cronlease: killed\n".into(),
            trigger: TriggerId::from_stored(0x1234_5678_9abc),
            cpu_ms: None,
            memory_peak: None,
        }
    }

    #[test]
    fn what_is_owed_is_written_privately_and_read_back_once_per_run() {
        let dir = tempfile::tempdir().unwrap();
        let owed_here = owed_dir(dir.path(), "n1");
        let at = Utc::now();
        let killed = Owed::of_record(&record("backup", 7, Outcome::Killed), at);
        let unstarted = Owed::of_record(&record("report", 9, Outcome::NotStarted), at);
        assert!(write_owed(&owed_here, &[unstarted.clone(), killed.clone()]).is_empty());
        // Owed again (a later write of the same run): one entry, the last.
        let mut later = unstarted.clone();
        later.at_ms += 1000;
        assert!(write_owed(&owed_here, &[later.clone()]).is_empty());
        let (found, problems) = Spool::at(&owed_here).load::<Owed>();
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(found, vec![killed.clone(), later]);
        assert!(killed.events);
        assert_eq!(killed.outcome, "killed");
        // The directory is private: the entries carry output.
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&owed_here).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
    }

    #[test]
    fn a_missing_directory_owes_nothing_and_writing_nothing_makes_none() {
        let dir = tempfile::tempdir().unwrap();
        let owed_here = owed_dir(dir.path(), "n2");
        assert!(write_owed(&owed_here, &[]).is_empty());
        assert!(!owed_here.exists());
        let (found, problems) = Spool::at(&owed_here).load::<Owed>();
        assert!(found.is_empty() && problems.is_empty(), "{problems:?}");
    }
}
