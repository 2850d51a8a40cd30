//! `cronlease import-crontab`: a crontab in, `[[job]]` tables out.
//!
//! Reads a user's crontab (as `crontab -l` prints it) or a system crontab
//! (`/etc/crontab`, `/etc/cron.d/*`: a user name between the schedule and the
//! command) the way Vixie cron, Debian's `cron`, reads it (crontab(5)), and
//! writes TOML job tables that fire at the same instants and run the same
//! command with the same environment settings. What has no cronlease
//! equivalent (mail, `@reboot`) becomes a comment in the output and a
//! warning, never a silent drop; a line cron would refuse is an error naming
//! `FILE:LINE:COLUMN`. Pure text in, text out: the command reads the file
//! and prints the result.
//!
//! # Schedules
//!
//! Each field is parsed here (numbers, ranges, steps, lists, `jan`-`dec`,
//! `sun`-`sat`, 7 as Sunday) and written back with numbers only, then
//! checked with [`Schedule::parse`]. The day rule needs care: cron ORs
//! day-of-month and day-of-week only when neither field *starts* with `*`,
//! while croner ORs them unless one field *is* `*`. For a field such as
//! `*/2` beside a restricted other field the two disagree, so the
//! translation puts croner's `+` (day-of-week ANDed with day-of-month)
//! before the day of week, and says so in a comment.

use std::collections::HashSet;
use std::fmt::{self, Write as _};
use std::path::Path;

use crate::schedule::{Schedule, ScheduleError, parse_zone};

/// How to read the crontab.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// System crontab format (`/etc/crontab`, `/etc/cron.d/*`): a user name
    /// after the schedule, which becomes the job's `user`.
    pub system: bool,
    /// IANA zone for the jobs no `CRON_TZ` line covers. `None` writes no
    /// `timezone` key, so those jobs run in UTC.
    pub timezone: Option<String>,
}

/// Whether `path` is in system crontab format by its place: `/etc/crontab`
/// or a file under `/etc/cron.d/`.
pub fn is_system_path(path: &Path) -> bool {
    path == Path::new("/etc/crontab")
        || (path.starts_with("/etc/cron.d") && path != Path::new("/etc/cron.d"))
}

/// The translation of one crontab.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Import {
    /// The `[[job]]` tables, with a header and comments; valid TOML.
    pub toml: String,
    /// One entry per translated job line, in file order.
    pub jobs: Vec<ImportedJob>,
    /// Lines translated with a comment because cronlease does something
    /// differently (mail, `@reboot`, `%`, the day rule).
    pub warnings: Vec<Warning>,
}

/// A crontab line that became a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedJob {
    /// 1-based line number in the crontab.
    pub line: usize,
    pub name: String,
    /// The schedule as written to the TOML.
    pub schedule: String,
    /// The `timezone` written to the TOML, if any.
    pub timezone: Option<String>,
}

/// Something the reader should know about a translated line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub origin: String,
    pub line: usize,
    pub message: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.origin, self.line, self.message)
    }
}

/// Why a crontab could not be translated.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    /// A line cron would refuse, or one cronlease cannot express.
    #[error("{origin}:{line}:{column}: {message}")]
    Line {
        origin: String,
        line: usize,
        column: usize,
        message: String,
    },
    /// [`Options::timezone`] is not a zone.
    #[error("default time zone: {0}")]
    Zone(ScheduleError),
}

/// Translates the crontab `text`; `origin` names it in messages and in the
/// header (a path, or `-` for standard input).
pub fn import(text: &str, origin: &str, options: &Options) -> Result<Import, ImportError> {
    if let Some(zone) = &options.timezone {
        parse_zone(zone).map_err(ImportError::Zone)?;
    }
    let mut state = State {
        origin,
        options,
        env: Vec::new(),
        shell: None,
        zone: options.timezone.clone(),
        out: header(origin, options),
        jobs: Vec::new(),
        warnings: Vec::new(),
        names: HashSet::new(),
    };
    let mut lines: Vec<&str> = text.split('\n').collect();
    let unterminated = !text.is_empty() && !text.ends_with('\n');
    if !unterminated {
        // The empty piece after the last newline (or of an empty text).
        lines.pop();
    }
    let count = lines.len();
    for (index, raw) in lines.into_iter().enumerate() {
        let number = index + 1;
        // A file edited on Windows: the \r is not part of the command.
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        let was_job = state.line(number, line)?;
        if unterminated && number == count && was_job {
            state.warn(
                number,
                "the file does not end with a newline: cron treats such a last line as broken; imported anyway",
            );
        }
    }
    Ok(Import {
        toml: state.out,
        jobs: state.jobs,
        warnings: state.warnings,
    })
}

/// What the lines read so far set up for the lines below them.
struct State<'a> {
    origin: &'a str,
    options: &'a Options,
    /// Environment lines so far, in order, each name once.
    env: Vec<(String, String)>,
    /// `SHELL`, when set to something.
    shell: Option<String>,
    /// `CRON_TZ`, else [`Options::timezone`].
    zone: Option<String>,
    out: String,
    jobs: Vec<ImportedJob>,
    warnings: Vec<Warning>,
    /// Job names taken, lower case (the config compares them so).
    names: HashSet<String>,
}

/// The five fields' readings: what they are called, their range, names.
struct Spec {
    what: &'static str,
    lo: u32,
    hi: u32,
    names: &'static [&'static str],
    /// The value of `names[0]`.
    first_name: u32,
    expected: &'static str,
}

const MONTHS: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];
const DAYS: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

const SPECS: [Spec; 5] = [
    Spec {
        what: "minute",
        lo: 0,
        hi: 59,
        names: &[],
        first_name: 0,
        expected: "a number from 0 to 59",
    },
    Spec {
        what: "hour",
        lo: 0,
        hi: 23,
        names: &[],
        first_name: 0,
        expected: "a number from 0 to 23",
    },
    Spec {
        what: "day of month",
        lo: 1,
        hi: 31,
        names: &[],
        first_name: 0,
        expected: "a number from 1 to 31",
    },
    Spec {
        what: "month",
        lo: 1,
        hi: 12,
        names: &MONTHS,
        first_name: 1,
        expected: "a number from 1 to 12 or a name jan to dec",
    },
    Spec {
        what: "day of week",
        lo: 0,
        hi: 7,
        names: &DAYS,
        first_name: 0,
        expected: "a number from 0 to 7 (0 and 7 are Sunday) or a name sun to sat",
    },
];

/// One field, read: its text for the schedule (numbers only), the values it
/// matches, and whether it starts with `*` (cron's test for the day rule).
struct Field {
    text: String,
    bits: u64,
    star: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Star,
    Range,
    Single,
}

/// A field error: byte offset in the line, message.
type FieldError = (usize, String);

impl Spec {
    fn is_day_of_week(&self) -> bool {
        self.hi == 7
    }

    fn bit(&self, v: u32) -> u64 {
        // 7 is Sunday, as 0 is.
        let v = if self.is_day_of_week() && v == 7 {
            0
        } else {
            v
        };
        1u64 << v
    }

    fn full(&self) -> u64 {
        (self.lo..=self.hi).fold(0, |m, v| m | self.bit(v))
    }

    /// One value: a number, or a name where the field has names.
    fn value(&self, s: &str, at: usize, range_end: bool) -> Result<u32, FieldError> {
        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            return s
                .parse::<u32>()
                .ok()
                .filter(|v| (self.lo..=self.hi).contains(v))
                .ok_or_else(|| {
                    (
                        at,
                        format!(
                            "{} {s} is out of range: expected {}",
                            self.what, self.expected
                        ),
                    )
                });
        }
        if !self.names.is_empty() && !s.is_empty() && s.chars().all(|c| c.is_ascii_alphabetic()) {
            return match self.names.iter().position(|n| n.eq_ignore_ascii_case(s)) {
                // `fri-sun`: Sunday closing a range is the 7, so the
                // weekend reads as it was meant.
                Some(0) if self.is_day_of_week() && range_end => Ok(7),
                Some(i) => Ok(self.first_name + i as u32),
                None => Err((
                    at,
                    format!(
                        "unknown {} name {s:?}: expected {}",
                        self.what, self.expected
                    ),
                )),
            };
        }
        Err((
            at,
            format!(
                "expected {} for the {}, found {s:?}",
                self.expected, self.what
            ),
        ))
    }

    /// A whole field starting at byte `at` of its line.
    fn parse(&self, s: &str, at: usize) -> Result<Field, FieldError> {
        let items: Vec<&str> = s.split(',').collect();
        let mut out = Vec::with_capacity(items.len());
        let mut bits = 0u64;
        let mut offset = at;
        for item in &items {
            let item_at = offset;
            offset += item.len() + 1;
            if item.is_empty() {
                return Err((
                    item_at,
                    format!(
                        "expected a {} value, range or * on each side of every comma",
                        self.what
                    ),
                ));
            }
            let (range, step) = match item.split_once('/') {
                Some((r, st)) => (r, Some((st, item_at + r.len() + 1))),
                None => (*item, None),
            };
            let (a, b, kind) = if range == "*" {
                (self.lo, self.hi, Kind::Star)
            } else if let Some((x, y)) = range.split_once('-') {
                let a = self.value(x, item_at, false)?;
                let b = self.value(y, item_at + x.len() + 1, true)?;
                if a > b {
                    return Err((
                        item_at,
                        format!(
                            "{} range {range} runs backwards: expected the smaller value first",
                            self.what
                        ),
                    ));
                }
                (a, b, Kind::Range)
            } else {
                let v = self.value(range, item_at, false)?;
                (v, v, Kind::Single)
            };
            let step = match step {
                None => 1,
                Some((st, st_at)) => {
                    if kind == Kind::Single {
                        // Vixie cron ignores such a step, cronie reads it as
                        // a range to the maximum: no reading is safe.
                        return Err((
                            item_at,
                            format!(
                                "{item}: a step needs a range or *: write {range}-{}/{st} or */{st}",
                                self.hi
                            ),
                        ));
                    }
                    let max = self.hi - self.lo + 1;
                    match st.parse::<u32>() {
                        Ok(v)
                            if st.bytes().all(|b| b.is_ascii_digit()) && (1..=max).contains(&v) =>
                        {
                            v
                        }
                        _ => {
                            return Err((
                                st_at,
                                format!(
                                    "expected a step from 1 to {max} after the /, found {st:?}"
                                ),
                            ));
                        }
                    }
                }
            };
            let mut v = a;
            while v <= b {
                bits |= self.bit(v);
                v += step;
            }
            out.push(match (kind, step) {
                (Kind::Star, 1) if items.len() == 1 => "*".to_string(),
                // croner takes `*` only as a whole field.
                (Kind::Star, 1) => format!("{}-{}", self.lo, self.hi),
                (Kind::Star, s) => format!("*/{s}"),
                (Kind::Range, 1) => format!("{a}-{b}"),
                (Kind::Range, s) => format!("{a}-{b}/{s}"),
                (Kind::Single, _) => a.to_string(),
            });
        }
        Ok(Field {
            text: out.join(","),
            bits,
            star: s.starts_with('*'),
        })
    }
}

/// An environment line as Vixie cron's `load_env` reads it: the name and
/// the value (quotes removed), and where the value starts.
#[derive(Debug, PartialEq, Eq)]
struct EnvLine {
    name: String,
    value: String,
    value_at: usize,
}

/// Reads `s` (leading blanks already skipped) as `NAME=value`, `NAME =
/// value`, with either part optionally in matching single or double quotes;
/// `None` when it is not one (then it is a job line). An unquoted value
/// loses its trailing white space; quotes keep leading and trailing blanks.
fn parse_env(s: &str) -> Option<EnvLine> {
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum St {
        NameStart,
        Name,
        Eq1,
        Eq2,
        ValueStart,
        Value,
        Done,
    }
    let mut st = St::NameStart;
    let mut quote: Option<char> = None;
    let mut name = String::new();
    let mut value = String::new();
    let mut value_at = s.len();
    let mut chars = s.char_indices().peekable();
    while let Some(&(i, c)) = chars.peek() {
        match st {
            St::NameStart | St::ValueStart => {
                quote = None;
                let mut at = i;
                if c == '\'' || c == '"' {
                    quote = Some(c);
                    chars.next();
                    at = i + c.len_utf8();
                }
                if st == St::NameStart {
                    st = St::Name;
                } else {
                    st = St::Value;
                    value_at = at;
                }
            }
            St::Name | St::Value => {
                if let Some(q) = quote {
                    if c == q {
                        chars.next();
                        st = if st == St::Name { St::Eq1 } else { St::Done };
                        continue;
                    }
                    if st == St::Name && c == '=' {
                        return None;
                    }
                } else if st == St::Name {
                    if c.is_whitespace() {
                        chars.next();
                        st = St::Eq1;
                        continue;
                    }
                    if c == '=' {
                        st = St::Eq1;
                        continue;
                    }
                }
                if st == St::Name {
                    name.push(c);
                } else {
                    value.push(c);
                }
                chars.next();
            }
            St::Eq1 => {
                if c == '=' {
                    st = St::Eq2;
                } else if !c.is_whitespace() {
                    return None;
                }
                chars.next();
            }
            St::Eq2 => {
                if c.is_whitespace() {
                    chars.next();
                } else {
                    st = St::ValueStart;
                }
            }
            St::Done => {
                if c.is_whitespace() {
                    chars.next();
                } else {
                    return None;
                }
            }
        }
    }
    match st {
        St::Done => {}
        St::Value if quote.is_none() => {
            let trimmed = value.trim_end().len();
            value.truncate(trimmed);
        }
        // `NAME=` with nothing after it: Vixie cron wants quotes for an
        // empty value, cronie does not; the meaning is plain either way.
        St::Eq2 | St::ValueStart => value_at = s.len(),
        _ => return None,
    }
    Some(EnvLine {
        name,
        value,
        value_at,
    })
}

/// Variables about mail, which cronlease does not send.
const MAIL_VARIABLES: [&str; 4] = [
    "MAILTO",
    "MAILFROM",
    "CONTENT_TYPE",
    "CONTENT_TRANSFER_ENCODING",
];

impl State<'_> {
    fn err(&self, number: usize, line: &str, at: usize, message: impl Into<String>) -> ImportError {
        ImportError::Line {
            origin: self.origin.to_string(),
            line: number,
            column: column(line, at),
            message: message.into(),
        }
    }

    fn warn(&mut self, number: usize, message: impl Into<String>) {
        self.warnings.push(Warning {
            origin: self.origin.to_string(),
            line: number,
            message: message.into(),
        });
    }

    /// Separates what follows from what came before by one blank line.
    fn paragraph(&mut self) {
        if !self.out.ends_with("\n\n") {
            self.out.push('\n');
        }
    }

    /// One line of the crontab; true when it was a job line.
    fn line(&mut self, number: usize, line: &str) -> Result<bool, ImportError> {
        if let Some(at) = line.find('\0') {
            return Err(self.err(number, line, at, "NUL byte in the line"));
        }
        let body = line.trim_start_matches(is_blank);
        let start = line.len() - body.len();
        if body.is_empty() {
            self.paragraph();
            return Ok(false);
        }
        if body.starts_with('#') {
            self.out.push_str(&comment_text(body));
            self.out.push('\n');
            return Ok(false);
        }
        if let Some(env) = parse_env(body) {
            self.env_line(number, line, start, env)?;
            return Ok(false);
        }
        self.job_line(number, line, start)?;
        Ok(true)
    }

    fn env_line(
        &mut self,
        number: usize,
        line: &str,
        start: usize,
        env: EnvLine,
    ) -> Result<(), ImportError> {
        let EnvLine {
            name,
            value,
            value_at,
        } = env;
        let _ = writeln!(
            self.out,
            "# {}",
            comment_text(line.trim_start_matches(is_blank))
        );
        if MAIL_VARIABLES.contains(&name.as_str()) {
            if !value.is_empty() {
                self.out.push_str(
                    "# cronlease sends no mail: a job's output goes to the daemon's log\n\
                     # (target cronlease::job) and each run's outcome to `cronlease history`.\n",
                );
                self.warn(
                    number,
                    format!(
                        "{name} is not translated: cronlease sends no mail; job output goes to the daemon's log and outcomes to `cronlease history`"
                    ),
                );
            }
            return Ok(());
        }
        if name == "CRON_TZ" {
            if value.is_empty() {
                self.zone = self.options.timezone.clone();
            } else {
                parse_zone(&value)
                    .map_err(|e| self.err(number, line, start + value_at, e.to_string()))?;
                self.zone = Some(value);
            }
            return Ok(());
        }
        // The rules `cronlease check` applies to env names.
        if name.is_empty() || name.contains('=') || name.starts_with(char::is_numeric) {
            return Err(self.err(
                number,
                line,
                start,
                format!("invalid environment variable name {name:?}"),
            ));
        }
        if name.starts_with("CRONLEASE_") {
            return Err(self.err(
                number,
                line,
                start,
                format!(
                    "environment variable {name:?} is reserved: cronlease sets CRONLEASE_* itself"
                ),
            ));
        }
        if name == "SHELL" {
            self.shell = Some(value.clone()).filter(|v| !v.is_empty());
        }
        match self.env.iter().position(|(k, _)| *k == name) {
            Some(i) => self.env[i].1 = value,
            None => self.env.push((name, value)),
        }
        Ok(())
    }

    fn job_line(&mut self, number: usize, line: &str, start: usize) -> Result<(), ImportError> {
        let mut pos = start;
        let Some((s0, e0)) = token(line, &mut pos) else {
            return Err(self.err(number, line, start, "expected a job line"));
        };
        let first = &line[s0..e0];
        let mut notes: Vec<&str> = Vec::new();
        let schedule = match first.strip_prefix('@') {
            Some(name) => self.nickname(number, line, s0, name)?,
            None => Some(self.time_fields(number, line, (s0, e0), &mut pos, &mut notes)?),
        };
        let user = if self.options.system {
            match token(line, &mut pos) {
                Some((a, b)) => Some(line[a..b].to_string()),
                None => {
                    return Err(self.err(
                        number,
                        line,
                        line.len(),
                        "expected a user name, then the command (system crontab format)",
                    ));
                }
            }
        } else {
            None
        };
        let rest = line[pos..].trim_start_matches(is_blank);
        let rest_at = line.len() - rest.len();
        if rest.is_empty() {
            return Err(self.err(
                number,
                line,
                line.len(),
                format!(
                    "expected a command after the {}",
                    if user.is_some() {
                        "user name"
                    } else {
                        "schedule"
                    }
                ),
            ));
        }

        self.paragraph();
        let _ = writeln!(
            self.out,
            "# line {number}: {}",
            comment_text(line.trim_start_matches(is_blank))
        );
        let Some(schedule) = schedule else {
            self.out.push_str(
                "# Not imported: @reboot runs at boot, and cronlease schedules occurrences\n\
                 # in time, not boots. Start it from a systemd unit (Type=oneshot,\n\
                 # WantedBy=multi-user.target) on the hosts that need it.\n",
            );
            self.warn(
                number,
                "@reboot is not translated: cronlease schedules occurrences in time, not boots; use a systemd unit",
            );
            return Ok(());
        };

        let zone = self.zone.clone();
        Schedule::parse(&schedule, zone.as_deref().unwrap_or("UTC"))
            .map_err(|e| self.err(number, line, s0, e.to_string()))?;
        let (command, command_toml) = self.command(number, line, (rest, rest_at), &mut notes)?;
        let job = ImportedJob {
            line: number,
            name: job_name(&command, number, &mut self.names),
            schedule,
            timezone: zone,
        };
        self.write_job(&job, &notes, &command_toml, user.as_deref());
        self.jobs.push(job);
        Ok(())
    }

    /// The schedule of a `@name` line (`name` without the `@`): none for
    /// `@reboot`, which is not translated.
    fn nickname(
        &self,
        number: usize,
        line: &str,
        at: usize,
        name: &str,
    ) -> Result<Option<String>, ImportError> {
        let lower = name.to_ascii_lowercase();
        match lower.as_str() {
            "reboot" => Ok(None),
            "yearly" | "annually" | "monthly" | "weekly" | "daily" | "midnight" | "hourly" => {
                Ok(Some(format!("@{lower}")))
            }
            _ => Err(self.err(
                number,
                line,
                at,
                format!(
                    "unknown schedule {:?}: expected 5 time fields or one of @yearly, @annually, @monthly, @weekly, @daily, @midnight, @hourly, @reboot",
                    format!("@{name}")
                ),
            )),
        }
    }

    /// The five time fields starting with `first` (its span), read field by
    /// field from `pos` on, as one croner expression; a day field rule that
    /// differs between cron and croner adds its note to `notes`.
    fn time_fields(
        &mut self,
        number: usize,
        line: &str,
        first: (usize, usize),
        pos: &mut usize,
        notes: &mut Vec<&'static str>,
    ) -> Result<String, ImportError> {
        let (s0, e0) = first;
        // Field by field, as cron reads them: a junk line is reported
        // at its first wrong field, not for being short.
        let mut spans = Vec::with_capacity(5);
        let mut fields = Vec::with_capacity(5);
        for spec in &SPECS {
            let (a, b) = if spans.is_empty() {
                (s0, e0)
            } else {
                match token(line, pos) {
                    Some(t) => t,
                    None => {
                        return Err(self.err(
                            number,
                            line,
                            line.len(),
                            format!(
                                "expected 5 time fields (minute, hour, day of month, month, day of week), then {}the command; the line ends after {} field(s)",
                                if self.options.system { "the user name, then " } else { "" },
                                spans.len()
                            ),
                        ));
                    }
                }
            };
            match spec.parse(&line[a..b], a) {
                Ok(f) => fields.push(f),
                Err((at, mut message)) => {
                    if a == s0 && line.contains('=') {
                        message.push_str(" (nor is the line an environment setting NAME=value)");
                    }
                    return Err(self.err(number, line, at, message));
                }
            }
            spans.push((a, b));
        }
        let (dom, dow) = (&fields[2], &fields[4]);
        let mut dom_text = dom.text.clone();
        let mut dow_text = dow.text.clone();
        // A `*`-led field matching every day is croner's `*`: then both
        // agree the other field alone decides.
        if dom.star && dom.bits == SPECS[2].full() {
            dom_text = "*".into();
        }
        if dow.star && dow.bits == SPECS[4].full() {
            dow_text = "*".into();
        }
        if (dom.star || dow.star) && dom_text != "*" && dow_text != "*" {
            dow_text = format!("+{dow_text}");
            notes.push(
                "# A day field starting with * makes cron require both day fields to\n\
                 # match; the + before the day of week asks cronlease for the same.",
            );
            self.warn(
                number,
                format!(
                    "day of month {:?} and day of week {:?}: cron requires both to match because one starts with *; translated with croner's + (both must match)",
                    &line[spans[2].0..spans[2].1],
                    &line[spans[4].0..spans[4].1]
                ),
            );
        }
        Ok(format!(
            "{} {} {} {} {}",
            fields[0].text, fields[1].text, dom_text, fields[3].text, dow_text
        ))
    }

    /// The command (`rest`, at byte `rest_at`) as cronlease runs it: its
    /// text before any `%`, and that as TOML, through the crontab's shell,
    /// with the text after the `%` fed on standard input.
    fn command(
        &mut self,
        number: usize,
        line: &str,
        (rest, rest_at): (&str, usize),
        notes: &mut Vec<&'static str>,
    ) -> Result<(String, String), ImportError> {
        let (command, stdin) = split_percent(rest);
        if command.trim().is_empty() {
            return Err(self.err(
                number,
                line,
                rest_at,
                "expected a command before the % (the text after the first % is the command's standard input)",
            ));
        }
        let shell = self.shell.as_deref().filter(|s| *s != "/bin/sh");
        let command_toml = match (shell, &stdin) {
            (None, None) => toml_str(&command),
            // The subshell on lines of its own keeps `;`, `&&` and a
            // trailing `# comment` of the command inside it.
            (None, Some(input)) => toml_str(&format!(
                "printf '%s' {} | (\n{command}\n)",
                sh_quote(input)
            )),
            (Some(sh), None) => toml_array(&[sh, "-c", command.as_str()]),
            // /bin/sh feeds the text; the crontab's shell runs the command
            // ($0 and $1), whatever its own syntax.
            (Some(sh), Some(input)) => {
                let feed = format!("printf '%s' {} | \"$0\" -c \"$1\"", sh_quote(input));
                toml_array(&["/bin/sh", "-c", feed.as_str(), sh, command.as_str()])
            }
        };
        if stdin.is_some() {
            notes.push(
                "# The text after the first unescaped % is the command's standard input\n\
                 # (each further % a newline, \\% a percent sign), fed by printf.",
            );
            self.warn(
                number,
                "% in the command: the text after it is fed to the command's standard input by printf",
            );
        }
        Ok((command, command_toml))
    }

    /// Writes `job` as a `[[job]]` table, after its `notes`.
    fn write_job(
        &mut self,
        job: &ImportedJob,
        notes: &[&str],
        command_toml: &str,
        user: Option<&str>,
    ) {
        for note in notes {
            self.out.push_str(note);
            self.out.push('\n');
        }
        let _ = writeln!(self.out, "[[job]]");
        let _ = writeln!(self.out, "name = {}", toml_str(&job.name));
        let _ = writeln!(self.out, "schedule = {}", toml_str(&job.schedule));
        if let Some(z) = &job.timezone {
            let _ = writeln!(self.out, "timezone = {}", toml_str(z));
        }
        let _ = writeln!(self.out, "command = {command_toml}");
        if let Some(u) = user {
            let _ = writeln!(self.out, "user = {}", toml_str(u));
        }
        if !self.env.is_empty() {
            // An inline table as the toml crate writes one: keys quoted as
            // keys must be (never as multi-line strings), in name order.
            let env: toml::Table = self
                .env
                .iter()
                .map(|(k, v)| (k.clone(), toml::Value::String(v.clone())))
                .collect();
            let _ = writeln!(self.out, "env = {}", toml::Value::Table(env));
        }
    }
}

fn header(origin: &str, options: &Options) -> String {
    let format = if options.system {
        "system crontab: a user name after the schedule"
    } else {
        "user crontab"
    };
    let zone = match &options.timezone {
        Some(z) => format!("#   {z} unless a CRON_TZ line said otherwise; cron used the host's\n#   local time zone.\n"),
        None => "#   UTC unless a CRON_TZ line said otherwise; cron used the host's local\n#   time zone: add timezone = \"...\" where that differs.\n".to_string(),
    };
    format!(
        "# Jobs imported from {} ({format}) by `cronlease import-crontab`.\n\
         # Check them with `cronlease check`, then put this file in jobs.dir.\n\
         # - Schedules are read in\n\
         {zone}\
         # - cron's own environment (SHELL=/bin/sh, PATH=/usr/bin:/bin, HOME, LOGNAME)\n\
         #   is not added: a job gets the daemon's environment, its env table, and\n\
         #   HOME, USER and LOGNAME when it has a user.\n\
         # - An occurrence no node ran (all down) runs once when one is back\n\
         #   (misfire = \"run_once\"); cron skips it: add misfire = \"skip\" for that.\n",
        comment_text(origin)
    )
}

fn is_blank(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// The next blank-separated token at or after `*pos`, as a byte range;
/// moves `*pos` past it.
fn token(line: &str, pos: &mut usize) -> Option<(usize, usize)> {
    let rest = line.get(*pos..)?;
    let skipped = rest.len() - rest.trim_start_matches(is_blank).len();
    let start = *pos + skipped;
    let len = line[start..].find(is_blank).unwrap_or(line.len() - start);
    *pos = start + len;
    (len > 0).then_some((start, start + len))
}

/// 1-based column of byte `at` in `line`, counting characters.
fn column(line: &str, at: usize) -> usize {
    line.get(..at)
        .map_or(line.chars().count(), |s| s.chars().count())
        + 1
}

/// Splits a command at its first unescaped `%` as cron does: before it,
/// `\%` is `%`; after it (the standard input), each `%` is a newline and
/// `\%` is `%`. Every other backslash stays.
fn split_percent(cmd: &str) -> (String, Option<String>) {
    let mut command = String::with_capacity(cmd.len());
    let mut input = None;
    let mut escaped = false;
    for (i, c) in cmd.char_indices() {
        if escaped {
            if c == '%' {
                command.pop();
            }
            command.push(c);
            escaped = false;
            continue;
        }
        if c == '\\' {
            escaped = true;
        }
        if c == '%' {
            input = Some(&cmd[i + 1..]);
            break;
        }
        command.push(c);
    }
    let input = input.map(|rest| {
        // Vixie cron's do_command.c, character for character.
        let mut out = String::with_capacity(rest.len());
        let mut escaped = false;
        for c in rest.chars() {
            let mut c = c;
            if escaped {
                if c != '%' {
                    out.push('\\');
                }
            } else if c == '%' {
                c = '\n';
            }
            escaped = c == '\\';
            if !escaped {
                out.push(c);
            }
        }
        if escaped {
            out.push('\\');
        }
        out
    });
    (command, input)
}

/// `s` as one single-quoted sh word.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The job name: the program's base name (after any `NAME=value` words),
/// cut to `[A-Za-z0-9_.-]` and 60 characters, then `-` and the line number;
/// a further `-N` if that is somehow taken.
fn job_name(command: &str, number: usize, taken: &mut HashSet<String>) -> String {
    let is_assignment = |w: &str| {
        w.split_once('=').is_some_and(|(n, _)| {
            !n.is_empty()
                && !n.starts_with(|c: char| c.is_ascii_digit())
                && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
    };
    let word = command
        .split_whitespace()
        .find(|&w| !is_assignment(w))
        .unwrap_or("")
        .trim_matches(|c: char| c == '"' || c == '\'');
    let base = word.rsplit('/').next().unwrap_or("");
    let mut clean = String::new();
    for c in base.chars() {
        let c = if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
            c
        } else {
            '-'
        };
        if !(c == '-' && clean.ends_with('-')) {
            clean.push(c);
        }
    }
    let cut: String = clean
        .trim_matches(|c: char| c == '-' || c == '.')
        .chars()
        .take(60)
        .collect();
    let mut stem = cut.trim_end_matches(['-', '.']).to_string();
    if stem.is_empty() {
        stem = "job".into();
    }
    let mut name = format!("{stem}-{number}");
    let mut n = 2;
    while !taken.insert(name.to_ascii_lowercase()) {
        name = format!("{stem}-{number}-{n}");
        n += 1;
    }
    name
}

/// A TOML string value, as the toml crate writes one (basic or literal,
/// escaped as needed).
fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

fn toml_array(items: &[&str]) -> String {
    toml::Value::Array(
        items
            .iter()
            .map(|s| toml::Value::String((*s).to_string()))
            .collect(),
    )
    .to_string()
}

/// `s` fit for a TOML comment: no control characters but tab.
fn comment_text(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() && c != '\t' {
                '\u{FFFD}'
            } else {
                c
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
