//! Schedules and time zones as a job file gives them: `Schedule::parse` on
//! a `schedule` and a `timezone` string, then the next occurrences and the
//! previous one, as the node and `cronlease check` ask for them.
//!
//! Input (UTF-8): the expression on the first line, the zone on the second
//! (none: UTC, as when a job sets no `timezone`), and on the third an
//! optional instant in Unix seconds (1970 to 2100) to ask from besides now.
//! Property: no panic; an error is one line; occurrences after an instant
//! strictly follow it and each other, and the one before it precedes it.

#![no_main]

use chrono::{DateTime, Utc};
use cronlease::schedule::Schedule;
use libfuzzer_sys::fuzz_target;

/// 2100-01-01T00:00:00Z: later instants are beyond any job's lifetime.
const LAST_START: i64 = 4_102_444_800;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines = text.splitn(3, '\n');
    let expr = lines.next().unwrap_or_default();
    let zone = lines.next().unwrap_or("UTC");
    let start = lines
        .next()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .filter(|s| (0..=LAST_START).contains(s))
        .and_then(|s| DateTime::<Utc>::from_timestamp(s, 0));

    let schedule = match Schedule::parse(expr, zone) {
        Ok(s) => s,
        Err(e) => {
            let line = e.to_string();
            assert!(
                !line.contains(['\n', '\r']),
                "a schedule error on more than one line: {line:?}"
            );
            return;
        }
    };
    for from in [Some(Utc::now()), start].into_iter().flatten() {
        let mut last = from;
        for t in schedule.upcoming(from, 5) {
            assert!(t > last, "{expr:?} in {zone:?}: {t} does not follow {last}");
            last = t;
        }
        if let Some(before) = schedule.previous_before(from) {
            assert!(
                before < from,
                "{expr:?} in {zone:?}: {before} is not before {from}"
            );
        }
    }
});
