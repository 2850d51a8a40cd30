//! The spool: every undelivered webhook event as one file in
//! `STATE_DIR/notify-NODE/`, written (to a temporary name, synced, renamed)
//! before it is first sent and removed once it is delivered or given up,
//! so a daemon that stops or dies with deliveries pending sends them when
//! it starts again. Blocking file I/O: called off the runtime.

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::body::Event;

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
    /// Its file's name: oldest first in name order; unique per webhook
    /// and event (job names and webhook names are `[A-Za-z0-9_.-]`).
    pub fn file_name(&self) -> String {
        format!(
            "{:013}-{}-{}.json",
            self.created_ms.max(0),
            self.target,
            self.event.delivery
        )
    }
}

/// The spool directory.
#[derive(Debug, Clone)]
pub struct Spool {
    dir: PathBuf,
}

impl Spool {
    /// Opens `dir`, making it (mode 0700: events carry output) if needed.
    pub fn open(dir: &Path) -> std::io::Result<Spool> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        // One made before (by hand, by another umask) is closed too.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        Ok(Spool {
            dir: dir.to_path_buf(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every spooled delivery, oldest first, and a line for each file that
    /// could not be read back (renamed `*.bad`, kept for the operator).
    pub fn load(&self) -> (Vec<Pending>, Vec<String>) {
        let mut found = Vec::new();
        let mut problems = Vec::new();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) => {
                problems.push(format!("cannot list {}: {e}", self.dir.display()));
                return (found, problems);
            }
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().to_string();
            if name.starts_with('.') && name.ends_with(".tmp") {
                // A write that did not finish: its event was never sent.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if !name.ends_with(".json") {
                continue;
            }
            match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Pending>(&b).map_err(|e| e.to_string()))
            {
                Ok(p) if p.file_name() == name => found.push(p),
                read => {
                    let why = match read {
                        Err(e) => format!("is unreadable ({e})"),
                        Ok(_) => "does not match its name".to_string(),
                    };
                    let bad = path.with_extension("json.bad");
                    let _ = std::fs::rename(&path, &bad);
                    problems.push(format!(
                        "{} {why}; kept as {}",
                        path.display(),
                        bad.display()
                    ));
                }
            }
        }
        found.sort_by_key(|p| (p.created_ms, p.file_name()));
        (found, problems)
    }

    /// Writes `p` (new, or its next attempt) durably.
    pub fn write(&self, p: &Pending) -> std::io::Result<()> {
        let name = p.file_name();
        let tmp = self.dir.join(format!(".{name}.tmp"));
        let bytes = serde_json::to_vec(p).map_err(std::io::Error::other)?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, self.dir.join(&name))?;
        Ok(())
    }

    /// Removes `p`'s file (delivered or given up); a file already gone is
    /// no error.
    pub fn remove(&self, p: &Pending) -> std::io::Result<()> {
        match std::fs::remove_file(self.dir.join(p.file_name())) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn pending(created_ms: i64, fence: u64) -> Pending {
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
        let (found, problems) = spool.load();
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(found, vec![b.clone(), a2.clone()]);
        spool.remove(&b).unwrap();
        spool.remove(&b).unwrap();
        assert_eq!(spool.load().0, vec![a2]);
    }

    #[test]
    fn an_unreadable_file_is_set_aside_and_a_torn_write_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool::open(dir.path()).unwrap();
        std::fs::write(
            dir.path().join("0000000001000-ops-x-1-failed.json"),
            b"{not json",
        )
        .unwrap();
        std::fs::write(
            dir.path().join(".0000000001000-ops-x-2-failed.json.tmp"),
            b"{",
        )
        .unwrap();
        let (found, problems) = spool.load();
        assert!(found.is_empty());
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("unreadable"), "{problems:?}");
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        names.sort();
        assert_eq!(names, vec!["0000000001000-ops-x-1-failed.json.bad"]);
    }
}
