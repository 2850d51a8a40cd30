//! When a job fires: a cron expression evaluated in an IANA time zone.
//!
//! Parsing and next-fire computation come from croner; timing the wait is the
//! node's business (tokio's clock), never a polling loop. Occurrences are
//! absolute instants (UTC, whole seconds), so two nodes with the same job file
//! always agree on them, whatever their local time zone.
//!
//! # Daylight saving time
//!
//! The rule is Vixie cron's, which is what crontab users expect:
//! - **Spring forward** (a wall-clock hour is skipped): a job scheduled at a
//!   fixed time inside the gap (`30 2 * * *` in Europe/Berlin on the last
//!   Sunday of March) runs once, at the first instant after the gap (03:00
//!   CEST). A job whose hour field is a wildcard or a step (`*/15 * * * *`)
//!   simply has no occurrences inside the gap: 01:45 CET is followed by 03:00
//!   CEST. Nothing fires twice and no day loses its fixed-time run.
//! - **Fall back** (a wall-clock hour repeats): a fixed-time job inside the
//!   repeated hour runs once, at its first (summer-time) instant. A job with a
//!   wildcard or stepped hour fires on both passes, because real time goes on:
//!   `*/30 * * * *` gives 02:00 CEST, 02:30 CEST, 02:00 CET, 02:30 CET.
//!
//! # Jitter
//!
//! A job's `jitter` moves each of its occurrences later by a delay derived
//! from the job's name alone (as Jenkins' `H`), so every node agrees on the
//! moved instant without talking, and jobs of one pattern spread out. The
//! name gives a point `p` in [0, 1) (SHA-256, [`jitter_point`]); an
//! occurrence `t` whose next scheduled one is `t + gap` moves to
//! `t + floor(p × min(jitter, gap))` in whole seconds, so it stays before
//! the next one and the order of occurrences never changes.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds};

pub(crate) mod fields;

/// Why a schedule or time zone was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScheduleError {
    #[error(
        "invalid schedule {expr:?}: expected 5 fields (crontab), 6 fields (seconds first) or one of @yearly, @annually, @monthly, @weekly, @daily, @midnight, @hourly; found {found} field(s)"
    )]
    FieldCount { expr: String, found: usize },
    #[error(
        "invalid schedule {expr:?}: unknown macro (expected @yearly, @annually, @monthly, @weekly, @daily, @midnight or @hourly)"
    )]
    UnknownMacro { expr: String },
    #[error(
        "invalid schedule {expr:?}: @reboot is not supported (cronlease schedules occurrences in time, not boots)"
    )]
    Reboot { expr: String },
    #[error("invalid schedule {expr:?}: {reason}")]
    Syntax { expr: String, reason: String },
    #[error("schedule {expr:?} never fires (no matching date in the next years)")]
    NeverFires { expr: String },
    #[error(
        "unknown time zone {zone:?}: expected an IANA name such as \"UTC\" or \"Europe/Berlin\""
    )]
    UnknownZone { zone: String },
}

/// A validated cron schedule in a time zone, with its jitter if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Shared by every schedule of the same pattern ([`shared_cron`]).
    cron: Arc<Cron>,
    zone: Tz,
    expr: String,
    jitter: Option<Jitter>,
}

/// A job's jitter: the longest delay, and the job's point in [0, 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Jitter {
    /// Whole seconds, at least 1.
    max_secs: i64,
    /// The point as a fraction of 2^64 ([`jitter_point`]).
    point: u64,
}

impl Jitter {
    /// The delay of an occurrence whose next one is `gap` seconds later
    /// (`None`: it has no next one): less than both `max_secs` and `gap`.
    fn delay(&self, gap: Option<i64>) -> TimeDelta {
        let bound = gap.map_or(self.max_secs, |g| g.min(self.max_secs)).max(0);
        // p × bound, floored: below bound, since p < 1.
        let secs = (u128::from(self.point) * bound as u128) >> 64;
        TimeDelta::seconds(secs as i64)
    }
}

/// The point in [0, 1), as a fraction of 2^64, where a job named `job`
/// falls within its jitter: the first 8 bytes of SHA-256 over a fixed tag
/// and the name. The same on every host, version and platform; it is part
/// of the protocol (docs/protocol.md, "Jitter").
pub fn jitter_point(job: &str) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"cronlease jitter v1\0");
    h.update(job.as_bytes());
    let sum = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&sum[..8]);
    u64::from_be_bytes(first)
}

/// `pattern` as croner reads it: 5 fields, or 6 with seconds first.
fn parse_pattern(pattern: &str) -> Result<Cron, croner::errors::CronError> {
    CronParser::builder()
        .seconds(Seconds::Optional)
        .build()
        .parse(pattern)
}

/// The parsed `pattern`, shared with every schedule already holding it:
/// croner keeps a table of 5,001 years per pattern (a `Cron` is about
/// 5.2 KB), so 20,000 jobs of one pattern held 100 MB of identical tables,
/// again for each copy of the job set a reload makes. Patterns no schedule
/// holds any more are dropped from the index as it grows.
fn shared_cron(pattern: &str) -> Result<Arc<Cron>, croner::errors::CronError> {
    static SHARED: OnceLock<Mutex<HashMap<String, Weak<Cron>>>> = OnceLock::new();
    let shared = SHARED.get_or_init(Mutex::default);
    let held = shared
        .lock()
        .ok()
        .and_then(|index| index.get(pattern).and_then(Weak::upgrade));
    if let Some(cron) = held {
        return Ok(cron);
    }
    let cron = Arc::new(parse_pattern(pattern)?);
    if let Ok(mut index) = shared.lock() {
        if index.len() >= 1024 && index.len().is_power_of_two() {
            index.retain(|_, cron| cron.strong_count() > 0);
        }
        index.insert(pattern.to_string(), Arc::downgrade(&cron));
    }
    Ok(cron)
}

/// Why croner refused `pattern`, in the words `import-crontab` uses: the
/// first field croner refuses with every other field `*`, named, with its
/// range ("hour 61 is out of range: expected a number from 0 to 23"), or
/// croner's reason for that field. `None` when no field alone is at fault
/// (a macro, or fields that only clash together).
fn explain(pattern: &str) -> Option<String> {
    let parts: Vec<&str> = pattern.split_whitespace().collect();
    let count = parts.len();
    if count != 5 && count != 6 {
        return None;
    }
    parts.iter().enumerate().find_map(|(i, part)| {
        let alone: Vec<&str> = (0..count)
            .map(|j| if j == i { *part } else { "*" })
            .collect();
        let refused = parse_pattern(&alone.join(" ")).err()?;
        Some(fields::field_mistake(i, count, part).unwrap_or_else(|| {
            format!(
                "{} {part:?}: {}",
                fields::field_name(i, count),
                refused.to_string().trim_end_matches('.')
            )
        }))
    })
}

impl Schedule {
    /// Parses `expr` (5 or 6 fields, or an @macro) evaluated in `zone`.
    ///
    /// A schedule that can never fire (`0 0 0 30 2 *`) is refused here, so a
    /// running node never meets one.
    pub fn parse(expr: &str, zone: &str) -> Result<Self, ScheduleError> {
        let zone = parse_zone(zone)?;
        let trimmed = expr.trim();
        let pattern = if let Some(name) = trimmed.strip_prefix('@') {
            match name.to_ascii_lowercase().as_str() {
                "yearly" | "annually" | "monthly" | "weekly" | "daily" | "hourly" => {
                    trimmed.to_ascii_lowercase()
                }
                "midnight" => "@daily".to_string(),
                "reboot" => return Err(ScheduleError::Reboot { expr: expr.into() }),
                _ => return Err(ScheduleError::UnknownMacro { expr: expr.into() }),
            }
        } else {
            let found = trimmed.split_whitespace().count();
            if found != 5 && found != 6 {
                return Err(ScheduleError::FieldCount {
                    expr: expr.into(),
                    found,
                });
            }
            // croner skips empty list items, so a field of commas alone
            // matches nothing, and its search for a first occurrence would
            // step through a year second by second (40 s) to say so.
            if let Some(field) = trimmed
                .split_whitespace()
                .position(|f| f.split(',').all(|item| item.trim().is_empty()))
            {
                return Err(ScheduleError::Syntax {
                    expr: expr.into(),
                    reason: format!(
                        "the {} field lists no value",
                        fields::field_name(field, found)
                    ),
                });
            }
            trimmed.to_string()
        };
        let cron = shared_cron(&pattern).map_err(|e| ScheduleError::Syntax {
            expr: expr.into(),
            reason: explain(&pattern)
                .unwrap_or_else(|| e.to_string().trim_end_matches('.').to_string()),
        })?;
        let schedule = Schedule {
            cron,
            zone,
            expr: trimmed.to_string(),
            jitter: None,
        };
        // croner gives up after a bounded search: the pattern names a date
        // that does not exist (Feb 30, Apr 31).
        if schedule.next_after(Utc::now()).is_none() {
            return Err(ScheduleError::NeverFires { expr: expr.into() });
        }
        Ok(schedule)
    }

    /// Whether `self` and `other` share one parsed pattern.
    pub fn shares_pattern_with(&self, other: &Schedule) -> bool {
        Arc::ptr_eq(&self.cron, &other.cron)
    }

    /// The expression as written (trimmed).
    pub fn expr(&self) -> &str {
        &self.expr
    }

    /// The time zone it is evaluated in.
    pub fn zone(&self) -> Tz {
        self.zone
    }

    /// The same schedule with each occurrence moved by the jitter of a job
    /// named `job` of at most `max` (whole seconds; under a second is none).
    pub fn with_jitter(mut self, job: &str, max: Duration) -> Self {
        let max_secs = i64::try_from(max.as_secs()).unwrap_or(i64::MAX);
        self.jitter = (max_secs > 0).then(|| Jitter {
            max_secs,
            point: jitter_point(job),
        });
        self
    }

    /// The longest delay jitter adds, if any.
    pub fn jitter(&self) -> Option<Duration> {
        self.jitter
            .map(|j| Duration::from_secs(j.max_secs.unsigned_abs()))
    }

    /// The first occurrence strictly after `t`.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let Some(jitter) = self.jitter else {
            return self.cron_after(t);
        };
        // Occurrences before the last scheduled instant at or before `t`
        // moved to before it; that one may have moved past `t`.
        let moved = |at: DateTime<Utc>, next: Option<DateTime<Utc>>| {
            at + jitter.delay(next.map(|n| (n - at).num_seconds()))
        };
        if let Some(last) = self.cron_before(t, true) {
            let next = self.cron_after(last);
            let at = moved(last, next);
            if at > t {
                return Some(at);
            }
            let first = next?;
            return Some(moved(first, self.cron_after(first)));
        }
        let first = self.cron_after(t)?;
        Some(moved(first, self.cron_after(first)))
    }

    /// The last occurrence strictly before `t`.
    pub fn previous_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let Some(jitter) = self.jitter else {
            return self.cron_before(t, false);
        };
        // Moved occurrences keep their order and stay before the next
        // scheduled instant: the last one before `t` comes from the last
        // scheduled instant before `t`, or the one before that.
        let last = self.cron_before(t, false)?;
        let gap =
            |at: DateTime<Utc>, next: Option<DateTime<Utc>>| next.map(|n| (n - at).num_seconds());
        let at = last + jitter.delay(gap(last, self.cron_after(last)));
        if at < t {
            return Some(at);
        }
        let before = self.cron_before(last, false)?;
        Some(before + jitter.delay(gap(before, Some(last))))
    }

    /// The scheduled instant `occurrence` was moved from by the jitter
    /// (itself without jitter).
    pub fn unjittered(&self, occurrence: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self.jitter {
            None => Some(occurrence),
            Some(_) => self.cron_before(occurrence, true),
        }
    }

    /// The first scheduled instant (jitter aside) strictly after `t`.
    fn cron_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let start = whole_second(t).with_timezone(&self.zone);
        self.cron
            .find_next_occurrence(&start, false)
            .ok()
            .map(|d| d.with_timezone(&Utc))
    }

    /// The last scheduled instant (jitter aside) before `t`, or at `t` if
    /// `inclusive`.
    fn cron_before(&self, t: DateTime<Utc>, inclusive: bool) -> Option<DateTime<Utc>> {
        // An instant with a fraction lies after its whole second, which may
        // itself be an occurrence.
        let floor = whole_second(t);
        let inclusive = inclusive || floor < t;
        self.cron
            .find_previous_occurrence(&floor.with_timezone(&self.zone), inclusive)
            .ok()
            .map(|d| d.with_timezone(&Utc))
    }

    /// The next `n` occurrences after `t`.
    pub fn upcoming(&self, t: DateTime<Utc>, n: usize) -> Vec<DateTime<Utc>> {
        let mut out = Vec::with_capacity(n);
        let mut cursor = t;
        while out.len() < n {
            match self.next_after(cursor) {
                Some(next) => {
                    out.push(next);
                    cursor = next;
                }
                None => break,
            }
        }
        out
    }
}

fn whole_second(t: DateTime<Utc>) -> DateTime<Utc> {
    t.duration_trunc(TimeDelta::seconds(1)).unwrap_or(t)
}

/// Parses an IANA time zone name.
pub fn parse_zone(zone: &str) -> Result<Tz, ScheduleError> {
    Tz::from_str(zone).map_err(|_| ScheduleError::UnknownZone { zone: zone.into() })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use chrono::TimeZone;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn schedules_of_one_pattern_share_its_parse_and_keep_their_own_zone() {
        let a = Schedule::parse("17 4 * * *", "UTC").unwrap();
        let b = Schedule::parse("17 4 * * *", "Europe/Berlin").unwrap();
        let c = Schedule::parse("18 4 * * *", "UTC").unwrap();
        assert!(a.shares_pattern_with(&b));
        assert!(a.clone().shares_pattern_with(&a));
        assert!(!a.shares_pattern_with(&c));
        let at = utc("2026-03-01T00:00:00Z");
        assert_eq!(a.next_after(at), Some(utc("2026-03-01T04:17:00Z")));
        assert_eq!(b.next_after(at), Some(utc("2026-03-01T03:17:00Z")));
        // Once no schedule holds a pattern, a new parse makes it again.
        drop((a, b));
        let d = Schedule::parse("17 4 * * *", "UTC").unwrap();
        assert_eq!(d.next_after(at), Some(utc("2026-03-01T04:17:00Z")));
    }

    fn fires(expr: &str, zone: &str, from: &str, n: usize) -> Vec<String> {
        Schedule::parse(expr, zone)
            .unwrap()
            .upcoming(utc(from), n)
            .into_iter()
            .map(|d| d.with_timezone(&parse_zone(zone).unwrap()).to_rfc3339())
            .collect()
    }

    #[test]
    fn five_six_fields_and_macros() {
        assert_eq!(
            fires("*/20 * * * * *", "UTC", "2026-01-01T00:00:00Z", 3),
            [
                "2026-01-01T00:00:20+00:00",
                "2026-01-01T00:00:40+00:00",
                "2026-01-01T00:01:00+00:00"
            ]
        );
        assert_eq!(
            fires("30 2 * * *", "UTC", "2026-01-01T00:00:00Z", 1),
            ["2026-01-01T02:30:00+00:00"]
        );
        assert_eq!(
            fires("@hourly", "UTC", "2026-01-01T00:00:00Z", 1),
            ["2026-01-01T01:00:00+00:00"]
        );
        assert_eq!(
            fires("@midnight", "UTC", "2026-01-01T00:00:00Z", 1),
            ["2026-01-02T00:00:00+00:00"]
        );
        assert_eq!(
            fires("@DAILY", "UTC", "2026-01-01T00:00:00Z", 1),
            ["2026-01-02T00:00:00+00:00"]
        );
    }

    #[test]
    fn refuses_bad_input() {
        assert!(matches!(
            Schedule::parse("* * *", "UTC"),
            Err(ScheduleError::FieldCount { found: 3, .. })
        ));
        assert!(matches!(
            Schedule::parse("0 0 1 1 * 2030", "UTC"),
            Err(ScheduleError::Syntax { .. }) | Err(ScheduleError::FieldCount { .. })
        ));
        assert!(matches!(
            Schedule::parse("61 * * * *", "UTC"),
            Err(ScheduleError::Syntax { .. })
        ));
        assert!(matches!(
            Schedule::parse("@reboot", "UTC"),
            Err(ScheduleError::Reboot { .. })
        ));
        assert!(matches!(
            Schedule::parse("@often", "UTC"),
            Err(ScheduleError::UnknownMacro { .. })
        ));
        assert!(matches!(
            Schedule::parse("0 0 0 30 2 *", "UTC"),
            Err(ScheduleError::NeverFires { .. })
        ));
        assert!(matches!(
            Schedule::parse("* * * * *", "Mars/Olympus"),
            Err(ScheduleError::UnknownZone { .. })
        ));
        // Found by fuzz/ (target config): a field of commas alone matches
        // nothing, and croner took 40 s to find no occurrence.
        assert_eq!(
            Schedule::parse(", * * * *", "UTC"),
            Err(ScheduleError::Syntax {
                expr: ", * * * *".into(),
                reason: "the minute field lists no value".into()
            })
        );
        assert!(matches!(
            Schedule::parse("0 0 ,, * * *", "UTC"),
            Err(ScheduleError::Syntax { .. })
        ));
        // croner's "Number out of bounds" named no field and no range; the
        // words are import-crontab's.
        let reason = |expr: &str| match Schedule::parse(expr, "UTC") {
            Err(ScheduleError::Syntax { reason, .. }) => reason,
            other => panic!("{expr}: {other:?}"),
        };
        assert_eq!(
            reason("0 61 * * *"),
            "hour 61 is out of range: expected a number from 0 to 23"
        );
        assert_eq!(
            reason("61 0 * * * *"),
            "second 61 is out of range: expected a number from 0 to 59"
        );
        assert_eq!(
            reason("0 0 * foo *"),
            "unknown month name \"foo\": expected a number from 1 to 12 or a name jan to dec"
        );
        assert_eq!(
            reason("0 0 * * 1-9"),
            "day of week 9 is out of range: expected a number from 0 to 7 (0 and 7 are Sunday) or a name sun to sat"
        );
        assert_eq!(
            Schedule::parse("0 61 * * *", "UTC")
                .unwrap_err()
                .to_string(),
            "invalid schedule \"0 61 * * *\": hour 61 is out of range: expected a number from 0 to 23"
        );
        // Empty items beside values are skipped, as croner does.
        assert!(Schedule::parse("1,,2 * * * *", "UTC").is_ok());
        // Rare but real: Feb 29 fires in leap years only.
        assert!(Schedule::parse("0 0 0 29 2 *", "UTC").is_ok());
    }

    #[test]
    fn berlin_spring_forward_fixed_time_runs_once_after_the_gap() {
        // 2026-03-29 02:00 CET jumps to 03:00 CEST.
        assert_eq!(
            fires("30 2 * * *", "Europe/Berlin", "2026-03-28T00:00:00Z", 3),
            [
                "2026-03-28T02:30:00+01:00",
                "2026-03-29T03:00:00+02:00",
                "2026-03-30T02:30:00+02:00"
            ]
        );
    }

    #[test]
    fn berlin_spring_forward_interval_job_skips_the_gap() {
        assert_eq!(
            fires("*/30 * * * *", "Europe/Berlin", "2026-03-29T00:00:00Z", 4),
            [
                "2026-03-29T01:30:00+01:00",
                "2026-03-29T03:00:00+02:00",
                "2026-03-29T03:30:00+02:00",
                "2026-03-29T04:00:00+02:00"
            ]
        );
    }

    #[test]
    fn berlin_fall_back_fixed_time_runs_once() {
        // 2026-10-25 03:00 CEST goes back to 02:00 CET.
        assert_eq!(
            fires("30 2 * * *", "Europe/Berlin", "2026-10-24T12:00:00Z", 2),
            ["2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"]
        );
    }

    #[test]
    fn berlin_fall_back_interval_job_fires_on_both_passes() {
        assert_eq!(
            fires("*/30 * * * *", "Europe/Berlin", "2026-10-24T23:15:00Z", 5),
            [
                "2026-10-25T01:30:00+02:00",
                "2026-10-25T02:00:00+02:00",
                "2026-10-25T02:30:00+02:00",
                "2026-10-25T02:00:00+01:00",
                "2026-10-25T02:30:00+01:00"
            ]
        );
    }

    #[test]
    fn occurrences_strictly_increase_through_dst() {
        for expr in [
            "*/7 * * * *",
            "0 30 2 * * *",
            "15 * * * *",
            "*/45 * * * * *",
        ] {
            let s = Schedule::parse(expr, "Europe/Berlin").unwrap();
            let all = s.upcoming(utc("2026-03-28T20:00:00Z"), 200);
            assert!(all.windows(2).all(|w| w[0] < w[1]), "{expr}");
            let all = s.upcoming(utc("2026-10-24T20:00:00Z"), 200);
            assert!(all.windows(2).all(|w| w[0] < w[1]), "{expr}");
        }
    }

    /// Every jittered occurrence after `from` and before `from + span`,
    /// worked out apart from `next_after`: each scheduled instant plus
    /// p × min(jitter, gap).
    fn jittered_by_hand(
        expr: &str,
        zone: &str,
        job: &str,
        jitter: i64,
        from: DateTime<Utc>,
        span: TimeDelta,
    ) -> Vec<DateTime<Utc>> {
        let plain = Schedule::parse(expr, zone).unwrap();
        let p = jitter_point(job) as f64 / 2f64.powi(64);
        let mut out = Vec::new();
        // Start a whole jitter early: an earlier instant may move past `from`.
        let mut at = plain.next_after(from - TimeDelta::seconds(jitter + 1));
        while let Some(t) = at.filter(|t| *t < from + span) {
            let next = plain.next_after(t).unwrap();
            let bound = jitter.min((next - t).num_seconds());
            out.push(t + TimeDelta::seconds((p * bound as f64).floor() as i64));
            at = Some(next);
        }
        out.retain(|t| *t > from);
        out
    }

    #[test]
    fn jitter_moves_each_occurrence_by_the_names_point_within_the_gap() {
        for from in [utc("2026-03-28T00:00:00Z"), utc("2026-10-24T00:00:00Z")] {
            for (expr, zone, job, jitter, hours) in [
                ("0 * * * *", "UTC", "hourly-report", 1800, 72),
                ("0 9,10 * * *", "UTC", "twice-a-morning", 7200, 72),
                ("*/10 * * * * *", "UTC", "often", 300, 3),
                ("*/30 * * * *", "Europe/Berlin", "through-dst", 3600, 72),
                ("30 2 * * *", "Europe/Berlin", "fixed-through-dst", 7200, 96),
                ("* * * * * *", "UTC", "every-second", 60, 1),
            ] {
                let s = Schedule::parse(expr, zone)
                    .unwrap()
                    .with_jitter(job, Duration::from_secs(jitter as u64));
                assert_eq!(s.jitter(), Some(Duration::from_secs(jitter as u64)));
                let span = TimeDelta::hours(hours);
                let expected = jittered_by_hand(expr, zone, job, jitter, from, span);
                let got = s.upcoming(from, expected.len());
                assert_eq!(got, expected, "{expr} {job}");
                // Each stays before the next scheduled instant: order kept.
                assert!(got.windows(2).all(|w| w[0] < w[1]), "{expr}");
                for t in &got {
                    let base = s.unjittered(*t).unwrap();
                    assert!(*t - base < TimeDelta::seconds(jitter), "{expr}");
                    let plain = Schedule::parse(expr, zone).unwrap();
                    assert!(plain.next_after(base).unwrap() > *t, "{expr}");
                }
                // next_after and previous_before agree with that list from any
                // instant, fractions included.
                let mut t = from + TimeDelta::seconds(jitter + 1);
                while t < from + span - TimeDelta::seconds(jitter + 1) {
                    let after = got.iter().find(|o| **o > t).copied();
                    let before = got.iter().rev().find(|o| **o < t).copied();
                    if after.is_some() {
                        assert_eq!(s.next_after(t), after, "{expr} after {t}");
                    }
                    if got.first().is_some_and(|f| *f < t) {
                        assert_eq!(s.previous_before(t), before, "{expr} before {t}");
                    }
                    t += span / 97;
                }
            }
        }
        // An every-second job has no room to move.
        let from = utc("2026-03-28T00:00:00Z");
        let s = Schedule::parse("* * * * * *", "UTC")
            .unwrap()
            .with_jitter("x", Duration::from_secs(60));
        assert_eq!(s.next_after(from), Some(from + TimeDelta::seconds(1)));
    }

    #[test]
    fn jitter_is_the_same_everywhere_and_spreads_jobs() {
        // Pinned: nodes of any version must agree on the moved instant.
        assert_eq!(jitter_point("backup"), jitter_point("backup"));
        let s = Schedule::parse("0 * * * *", "UTC")
            .unwrap()
            .with_jitter("backup", Duration::from_secs(3600));
        let first = s.next_after(utc("2026-01-01T00:00:00Z")).unwrap();
        assert_eq!(
            first,
            utc("2026-01-01T00:00:00Z")
                + TimeDelta::seconds(((u128::from(jitter_point("backup")) * 3600) >> 64) as i64)
        );
        // python3: hashlib.sha256(b"cronlease jitter v1\0backup").hexdigest()[:16]
        assert_eq!(
            format!("{:016x}", jitter_point("backup")),
            "7ccfc4e200565f29"
        );
        // 600 hourly jobs over the hour: every 10-minute slice gets some,
        // none gets twice its share.
        let mut slices = [0u32; 6];
        for i in 0..600 {
            let s = Schedule::parse("0 * * * *", "UTC")
                .unwrap()
                .with_jitter(&format!("job-{i}"), Duration::from_secs(3600));
            let at = s.next_after(utc("2026-01-01T00:00:00Z")).unwrap();
            let delay = (at - s.unjittered(at).unwrap()).num_seconds();
            assert!((0..3600).contains(&delay), "{delay}");
            slices[(delay / 600) as usize] += 1;
        }
        assert!(slices.iter().all(|n| (50..200).contains(n)), "{slices:?}");
        // Zero is no jitter.
        let s = Schedule::parse("0 * * * *", "UTC")
            .unwrap()
            .with_jitter("backup", Duration::ZERO);
        assert_eq!(s.jitter(), None);
        assert_eq!(s, Schedule::parse("0 * * * *", "UTC").unwrap());
    }

    #[test]
    fn previous_before_is_strict_and_handles_fractions() {
        let s = Schedule::parse("* * * * * *", "UTC").unwrap();
        let t = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 10).unwrap();
        assert_eq!(s.previous_before(t), Some(t - TimeDelta::seconds(1)));
        assert_eq!(s.previous_before(t + TimeDelta::milliseconds(500)), Some(t));
        assert_eq!(
            s.next_after(t + TimeDelta::milliseconds(500)),
            Some(t + TimeDelta::seconds(1))
        );
        assert_eq!(s.next_after(t), Some(t + TimeDelta::seconds(1)));
    }
}
