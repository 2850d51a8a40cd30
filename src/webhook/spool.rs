//! The webhook spool: every undelivered webhook event as one file in
//! `STATE_DIR/notify-NODE/` ([`crate::spool`]), written before it is first
//! sent and removed once it is delivered or given up, so a daemon that
//! stops or dies with deliveries pending sends them when it starts again.
//! Blocking file I/O: called off the runtime.

use serde::{Deserialize, Serialize};

use super::body::Event;
pub use crate::spool::Spool;

/// One delivery of one event to one webhook, as spooled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pending {
    /// The webhook's name (its URL may hold a token: never written here).
    pub target: String,
    pub event: Event,
    /// Sends tried so far.
    pub attempts: u32,
    /// When the event was spooled, Unix milliseconds.
    pub created_ms: i64,
    /// When the next send is due, Unix milliseconds.
    pub next_ms: i64,
}

impl Pending {
    /// How long ago its event was spooled, at `now` (Unix milliseconds).
    pub fn age(&self, now: i64) -> std::time::Duration {
        std::time::Duration::from_millis(
            u64::try_from(now.saturating_sub(self.created_ms)).unwrap_or(0),
        )
    }
}

impl crate::spool::Spooled for Pending {
    /// Oldest first in name order; unique per webhook and event (job names
    /// and webhook names are `[A-Za-z0-9_.-]`).
    fn file_name(&self) -> String {
        format!(
            "{:013}-{}-{}.json",
            self.created_ms.max(0),
            self.target,
            self.event.delivery
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(super) mod tests {
    use super::*;

    pub(in crate::webhook) fn pending(created_ms: i64, fence: u64) -> Pending {
        Pending {
            target: "ops".into(),
            event: Event {
                delivery: format!("backup-{fence}-failed"),
                event: "failed".into(),
                job: "backup".into(),
                occurrence: "2026-11-29T02:00:00Z".into(),
                outcome: "failed".into(),
                exit_code: Some(3),
                node: "n1".into(),
                fence,
                started_at: "2026-11-29T02:00:00.010Z".into(),
                finished_at: "2026-11-29T02:00:01Z".into(),
                duration_ms: 990,
                trigger: None,
                attempt: 1,
                output_tail: "line\n".into(),
                dashboard: None,
            },
            attempts: 0,
            created_ms,
            next_ms: created_ms,
        }
    }

    #[test]
    fn what_is_written_is_read_back_oldest_first_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool::open(&dir.path().join("notify-n1")).unwrap();
        let (a, b) = (pending(2_000, 7), pending(1_000, 8));
        spool.write(&a).unwrap();
        spool.write(&b).unwrap();
        let mut a2 = a.clone();
        a2.attempts = 3;
        spool.write(&a2).unwrap();
        let (found, problems) = spool.load::<Pending>();
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(found, vec![b.clone(), a2.clone()]);
        spool.remove(&b).unwrap();
        spool.remove(&b).unwrap();
        assert_eq!(spool.load::<Pending>().0, vec![a2]);
    }

    #[test]
    fn an_unreadable_file_is_set_aside_and_an_old_torn_write_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool::open(dir.path()).unwrap();
        std::fs::write(
            dir.path().join("0000000001000-ops-x-1-failed.json"),
            b"{not json",
        )
        .unwrap();
        // A torn write from before (old), and one another process may be
        // making now (fresh).
        let torn = dir.path().join(".0000000001000-ops-x-2-failed.json.tmp");
        std::fs::write(&torn, b"{").unwrap();
        let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&torn)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
        std::fs::write(
            dir.path().join(".0000000001000-ops-x-3-failed.json.tmp"),
            b"{",
        )
        .unwrap();
        let (found, problems) = spool.load::<Pending>();
        assert!(found.is_empty());
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("unreadable"), "{problems:?}");
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        names.sort();
        assert_eq!(
            names,
            vec![
                ".0000000001000-ops-x-3-failed.json.tmp",
                "0000000001000-ops-x-1-failed.json.bad"
            ]
        );
    }
}
