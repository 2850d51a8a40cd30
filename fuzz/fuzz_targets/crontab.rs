//! `cronlease import-crontab` on any text: a crontab's bytes as a user or a
//! system crontab.
//!
//! Input: one byte choosing the format (odd: system crontab, with a user
//! field), then the crontab's bytes (invalid UTF-8 is refused before the
//! importer, as the command does). Properties: no panic; an error is one
//! line naming `fuzz:LINE:COLUMN`; a translation is TOML that parses, and
//! every job in it has a schedule and time zone the config loader accepts
//! (`Schedule::parse`, as `check` validates them) and a name unique in the
//! output.

#![no_main]

use std::collections::BTreeSet;

use cronlease::crontab::{self, ImportError, Options};
use cronlease::schedule::Schedule;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&format, text)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    let options = Options {
        system: format % 2 == 1,
        timezone: None,
    };
    match crontab::import(text, "fuzz", &options) {
        Err(e) => {
            let line = e.to_string();
            assert!(!line.contains(['\n', '\r']), "an error on more than one line: {line:?}");
            if let ImportError::Line { .. } = e {
                assert!(line.starts_with("fuzz:"), "an error naming no position: {line:?}");
            }
        }
        Ok(import) => {
            let doc: toml::Table = match toml::from_str(&import.toml) {
                Ok(doc) => doc,
                Err(e) => panic!("the translation is not TOML ({e}):\n{}", import.toml),
            };
            let jobs = doc
                .get("job")
                .and_then(|j| j.as_array())
                .cloned()
                .unwrap_or_default();
            assert_eq!(jobs.len(), import.jobs.len(), "{}", import.toml);
            let mut names = BTreeSet::new();
            for job in &jobs {
                let field = |k: &str| job.get(k).and_then(|v| v.as_str()).map(str::to_string);
                let name = field("name").unwrap_or_default();
                assert!(names.insert(name.clone()), "job {name:?} twice:\n{}", import.toml);
                let schedule = field("schedule").unwrap_or_default();
                let zone = field("timezone").unwrap_or_else(|| "UTC".into());
                if let Err(e) = Schedule::parse(&schedule, &zone) {
                    panic!("job {name:?}: {e}:\n{}", import.toml);
                }
                assert!(job.get("command").is_some(), "job {name:?} has no command");
            }
        }
    }
});
