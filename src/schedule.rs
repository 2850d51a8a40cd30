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

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds};

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

/// A validated cron schedule in a time zone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Shared by every schedule of the same pattern ([`shared_cron`]).
    cron: Arc<Cron>,
    zone: Tz,
    expr: String,
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
    let cron = Arc::new(
        CronParser::builder()
            .seconds(Seconds::Optional)
            .build()
            .parse(pattern)?,
    );
    if let Ok(mut index) = shared.lock() {
        if index.len() >= 1024 && index.len().is_power_of_two() {
            index.retain(|_, cron| cron.strong_count() > 0);
        }
        index.insert(pattern.to_string(), Arc::downgrade(&cron));
    }
    Ok(cron)
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
                    reason: format!("field {} lists no value", field + 1),
                });
            }
            trimmed.to_string()
        };
        let cron = shared_cron(&pattern).map_err(|e| ScheduleError::Syntax {
            expr: expr.into(),
            reason: e.to_string().trim_end_matches('.').to_string(),
        })?;
        let schedule = Schedule {
            cron,
            zone,
            expr: trimmed.to_string(),
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

    /// The first occurrence strictly after `t`.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let start = whole_second(t).with_timezone(&self.zone);
        self.cron
            .find_next_occurrence(&start, false)
            .ok()
            .map(|d| d.with_timezone(&Utc))
    }

    /// The last occurrence strictly before `t`.
    pub fn previous_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        // An instant with a fraction lies after its whole second, which may
        // itself be an occurrence.
        let floor = whole_second(t);
        let inclusive = floor < t;
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
                reason: "field 1 lists no value".into()
            })
        );
        assert!(matches!(
            Schedule::parse("0 0 ,, * * *", "UTC"),
            Err(ScheduleError::Syntax { .. })
        ));
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
