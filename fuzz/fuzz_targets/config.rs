//! Config loading as the daemon does it: `config::load` on a main file and a
//! job file in its `jobs.d`, then, for a config that loads, what `cronlease
//! check` prints (each job's next occurrences in its zone).
//!
//! Input: the main file's bytes, then optionally a NUL byte and the job
//! file's bytes (TOML has no place for a raw NUL). Property: no panic, and
//! every error is one line naming its file.

#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use chrono::Utc;
use cronlease::config::{self, Overrides};
use libfuzzer_sys::fuzz_target;

/// This process's directory for the two files, under `fuzz/target/`
/// (`fuzz/run` clears them).
fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("target/scratch")
            .join(format!("config-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir_all(dir.join("jobs.d")) {
            panic!("cannot create {}: {e}", dir.display());
        }
        dir
    })
}

/// `password_file` names a file the loader reads whole (`jobs.dir` takes
/// regular files only; TLS files are only looked up): an endless device
/// (`/dev/zero`) or a blocking one (`/proc/kmsg`) would stall the fuzzer,
/// not show a config bug.
fn names_a_device(data: &[u8]) -> bool {
    data.windows(4).any(|w| w == b"/dev") || data.windows(5).any(|w| w == b"/proc")
}

fuzz_target!(|data: &[u8]| {
    if names_a_device(data) {
        return;
    }
    let (main, jobs) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], Some(&data[at + 1..])),
        None => (data, None),
    };
    let dir = scratch();
    let main_file = dir.join("cronlease.toml");
    let job_file = dir.join("jobs.d").join("fuzz.toml");
    if let Err(e) = std::fs::write(&main_file, main) {
        panic!("cannot write {}: {e}", main_file.display());
    }
    let written = match jobs {
        Some(jobs) => std::fs::write(&job_file, jobs),
        None => std::fs::remove_file(&job_file).or_else(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Ok(()),
            _ => Err(e),
        }),
    };
    if let Err(e) = written {
        panic!("cannot prepare {}: {e}", job_file.display());
    }

    match config::load(&main_file, &Overrides::default()) {
        Err(errors) => {
            assert!(!errors.0.is_empty(), "an error without a message");
            for e in &errors.0 {
                let line = e.to_string();
                assert!(
                    !line.contains(['\n', '\r']),
                    "a config error on more than one line: {line:?}"
                );
                assert!(
                    !e.origin.is_empty(),
                    "a config error naming no file: {line:?}"
                );
            }
        }
        Ok(config) => {
            // What `check` does with it.
            let now = Utc::now();
            for job in &config.jobs {
                let zone = job.schedule.zone();
                let mut last = now;
                for t in job.schedule.upcoming(now, 5) {
                    assert!(
                        t > last,
                        "{:?}: {t} does not follow {last}",
                        job.schedule.expr()
                    );
                    last = t;
                    let _ = t
                        .with_timezone(&zone)
                        .format("%Y-%m-%d %H:%M:%S %Z")
                        .to_string();
                }
            }
        }
    }
});
