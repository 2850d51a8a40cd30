//! The daemon's pid file, and finding the daemon it names.
//!
//! `run` opens the file without following a symlink, takes an exclusive
//! `flock` on it and only then writes its pid; it holds the lock for its
//! whole life and removes the file on exit. A second `run` with the same
//! config finds the lock taken and leaves the file alone (it neither
//! overwrites nor deletes the first daemon's). `cronlease step-down` signals
//! the pid only when the file is still locked (a daemon holds it) and
//! `/proc` shows that process is `cronlease run` with the same configuration
//! file; a stale file is an error, never a signal to an unrelated process.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg, OFlag};

use crate::config::DEFAULT_CONFIG_PATH;

/// Why the pid file could not be taken or its daemon not be found.
#[derive(Debug, thiserror::Error)]
pub enum PidFileError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is held by another running daemon (pid {pid}); leaving it alone")]
    Taken { path: PathBuf, pid: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "no daemon holds {path} (stale pid file): is `cronlease run` running with this config?"
    )]
    Stale { path: PathBuf },
    #[error("{path} does not hold a pid")]
    NoPid { path: PathBuf },
    #[error(
        "process {pid} from {path} is not `cronlease run` with {config} ({why}); not signalling it"
    )]
    NotOurDaemon {
        pid: i32,
        path: PathBuf,
        config: String,
        why: String,
    },
}

fn open(path: &Path, create: bool) -> Result<File, PidFileError> {
    OpenOptions::new()
        .read(true)
        .write(create)
        .create(create)
        .truncate(false)
        .mode(0o644)
        // Never through a symlink: a planted link must not redirect the write.
        .custom_flags(OFlag::O_NOFOLLOW.bits() | OFlag::O_CLOEXEC.bits())
        .open(path)
        .map_err(|source| PidFileError::Open {
            path: path.to_path_buf(),
            source,
        })
}

/// A pid file this process holds, removed when dropped.
#[derive(Debug)]
pub struct PidFile {
    path: PathBuf,
    lock: Flock<File>,
}

impl PidFile {
    /// Locks `path` and writes this process's pid into it.
    pub fn create(path: &Path) -> Result<PidFile, PidFileError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            let _ = std::fs::create_dir_all(dir);
        }
        // A lock is on an inode, not a name: a file unlinked (or replaced)
        // between our open and our lock is not the pid file any more.
        let mut attempt = 0;
        let mut lock = loop {
            let file = open(path, true)?;
            let lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => lock,
                Err((mut file, _)) => {
                    let mut pid = String::new();
                    let _ = file.read_to_string(&mut pid);
                    return Err(PidFileError::Taken {
                        path: path.to_path_buf(),
                        pid: pid.trim().chars().take(20).collect(),
                    });
                }
            };
            attempt += 1;
            if is_at(&lock, path) || attempt >= 3 {
                break lock;
            }
        };
        let write = |f: &mut File| -> std::io::Result<()> {
            f.set_len(0)?;
            f.rewind()?;
            f.write_all(format!("{}\n", std::process::id()).as_bytes())?;
            f.sync_all()
        };
        write(&mut lock).map_err(|source| PidFileError::Write {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(PidFile {
            path: path.to_path_buf(),
            lock,
        })
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        // Only the file we hold: if ours was deleted and another daemon
        // made a new one at the path, that one stays.
        if is_at(&self.lock, &self.path) {
            let _ = self.lock.set_len(0);
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Whether `file` is the file now at `path` (same device and inode).
fn is_at(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// The pid of the daemon that holds `pid_file` and runs with `config`.
pub fn daemon_pid(pid_file: &Path, config: &Path) -> Result<i32, PidFileError> {
    let mut file = open(pid_file, false)?;
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    // A file nobody holds locked is stale, whatever pid it names.
    match Flock::lock(file, FlockArg::LockSharedNonblock) {
        Ok(_unlocked_on_drop) => {
            return Err(PidFileError::Stale {
                path: pid_file.to_path_buf(),
            });
        }
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {}
        Err(_) => {
            return Err(PidFileError::Stale {
                path: pid_file.to_path_buf(),
            });
        }
    }
    let pid = match text.trim().parse::<i32>() {
        Ok(pid) if pid > 1 => pid,
        _ => {
            return Err(PidFileError::NoPid {
                path: pid_file.to_path_buf(),
            });
        }
    };
    let not_ours = |why: String| PidFileError::NotOurDaemon {
        pid,
        path: pid_file.to_path_buf(),
        config: config.display().to_string(),
        why,
    };
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map_err(|e| not_ours(format!("cannot read its command line: {e}")))?;
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap_or_default();
    let theirs = run_config(&cmdline, &environ, &cwd).ok_or_else(|| {
        not_ours(format!(
            "its command line is {:?}",
            String::from_utf8_lossy(&cmdline)
                .replace('\0', " ")
                .trim()
                .chars()
                .take(120)
                .collect::<String>()
        ))
    })?;
    let same = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    if same(&theirs) != same(config) {
        return Err(not_ours(format!("it runs {}", theirs.display())));
    }
    Ok(pid)
}

/// The configuration a `cronlease run` command line uses, from its argv
/// (NUL-separated), environment and working directory; `None` when the
/// command line is not `cronlease run`.
pub fn run_config(cmdline: &[u8], environ: &[u8], cwd: &Path) -> Option<PathBuf> {
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let program = Path::new(args.first()?).file_name()?.to_string_lossy();
    if !program.starts_with("cronlease") || args.get(1).map(String::as_str) != Some("run") {
        return None;
    }
    let mut config = None;
    let mut rest = args[2..].iter();
    while let Some(a) = rest.next() {
        if a == "-c" || a == "--config" {
            config = rest.next().cloned();
        } else if let Some(v) = a.strip_prefix("--config=") {
            config = Some(v.to_string());
        } else if let Some(v) = a.strip_prefix("-c").filter(|v| !v.is_empty()) {
            config = Some(v.to_string());
        }
    }
    let config = config
        .or_else(|| {
            environ
                .split(|b| *b == 0)
                .filter_map(|kv| {
                    String::from_utf8_lossy(kv)
                        .strip_prefix("CRONLEASE_CONFIG=")
                        .map(str::to_string)
                })
                .next_back()
        })
        .unwrap_or_else(|| DEFAULT_CONFIG_PATH.to_string());
    Some(cwd.join(config))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn finds_the_config_of_a_run_command_line() {
        let cwd = Path::new("/srv");
        let cfg = |argv: &str, env: &str| {
            run_config(argv.replace(' ', "\0").as_bytes(), env.as_bytes(), cwd)
        };
        assert_eq!(
            cfg("/usr/bin/cronlease run -c /etc/x.toml", ""),
            Some("/etc/x.toml".into())
        );
        assert_eq!(
            cfg("cronlease run --config=a.toml", ""),
            Some("/srv/a.toml".into())
        );
        assert_eq!(
            cfg("cronlease run -ca.toml", ""),
            Some("/srv/a.toml".into())
        );
        assert_eq!(
            cfg("cronlease run", "PATH=/bin\0CRONLEASE_CONFIG=/e.toml\0"),
            Some("/e.toml".into())
        );
        assert_eq!(cfg("cronlease run", ""), Some(DEFAULT_CONFIG_PATH.into()));
        // An operator's `tail -f cronlease.log` is not a daemon.
        assert_eq!(cfg("tail -f /var/log/cronlease.log", ""), None);
        assert_eq!(cfg("/usr/bin/cronlease status -c /etc/x.toml", ""), None);
    }
}
