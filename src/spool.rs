//! A spool: a directory of small JSON files, each one thing that must
//! survive a restart of the daemon (a webhook delivery not made yet,
//! [`crate::webhook::spool`]; the hooks and events a dead daemon's runs
//! are owed, [`crate::guard::owed`]). Each is written to a temporary name,
//! synced and renamed, so a reader sees it whole or not at all; it is
//! removed once it is done with. Blocking file I/O: called off the runtime
//! (or from the guard, which has no runtime of its own).

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// A temporary file older than this is a write that did not finish.
const TORN_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// What a spool keeps: serialized as JSON under its own file name.
pub trait Spooled: Serialize + DeserializeOwned {
    /// Its file's name, ending `.json`, unique among what the spool keeps;
    /// oldest first in name order.
    fn file_name(&self) -> String;
}

/// A spool's lock, held while this value lives ([`Spool::try_lock`]).
#[derive(Debug)]
pub struct SpoolLock {
    _locked: nix::fcntl::Flock<std::fs::File>,
}

/// The spool directory.
#[derive(Debug, Clone)]
pub struct Spool {
    dir: PathBuf,
}

impl Spool {
    /// Opens `dir`, making it (mode 0700: what it keeps carries output) if
    /// needed.
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

    /// `dir` as a spool, without making or opening it: for reading one that
    /// may not exist ([`Spool::load`] of a missing directory finds nothing).
    pub fn at(dir: &Path) -> Spool {
        Spool {
            dir: dir.to_path_buf(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Everything spooled, oldest first (name order), and a line for each
    /// file that could not be read back (renamed `*.bad`, kept for the
    /// operator). A directory that does not exist holds nothing.
    pub fn load<T: Spooled>(&self) -> (Vec<T>, Vec<String>) {
        let mut found: Vec<(String, T)> = Vec::new();
        let mut problems = Vec::new();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return (Vec::new(), problems),
            Err(e) => {
                problems.push(format!("cannot list {}: {e}", self.dir.display()));
                return (Vec::new(), problems);
            }
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().to_string();
            if name.starts_with('.') && name.ends_with(".tmp") {
                // A write that did not finish (what it held was never acted
                // on), unless it is recent: another process (the guard) may
                // be writing it now.
                let stale = entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_none_or(|age| age >= TORN_AFTER);
                if stale {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            if !name.ends_with(".json") {
                continue;
            }
            match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<T>(&b).map_err(|e| e.to_string()))
            {
                Ok(p) if p.file_name() == name => found.push((name, p)),
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
        found.sort_by(|a, b| a.0.cmp(&b.0));
        (found.into_iter().map(|(_, p)| p).collect(), problems)
    }

    /// Writes `p` (new, or a new state of it) durably.
    pub fn write<T: Spooled>(&self, p: &T) -> std::io::Result<()> {
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

    /// Takes the spool's lock (`flock` on its `.lock` file) if nobody
    /// holds it: `None` when another process does. The daemon whose
    /// deliveries a spool keeps holds it while it sends them; a dead
    /// daemon's guard takes it to hand them over, so the two never act on
    /// one file at once. Released when the [`SpoolLock`] drops (or its
    /// process ends).
    pub fn try_lock(&self) -> std::io::Result<Option<SpoolLock>> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(self.dir.join(".lock"))?;
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Some(SpoolLock { _locked: lock })),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(e.into()),
        }
    }

    /// Removes `p`'s file (done with); a file already gone is no error.
    pub fn remove<T: Spooled>(&self, p: &T) -> std::io::Result<()> {
        match std::fs::remove_file(self.dir.join(p.file_name())) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}
