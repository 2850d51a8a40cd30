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
//!
//! # Names
//!
//! A job is named after the program its command runs (`name_stem`), not
//! after its line: a name is the job's lock in the store, so it must not
//! move when a line is added above. Jobs running the same program are told
//! apart by a counter in file order (`distinct_names`), given once every
//! line is read.

use std::collections::HashSet;
use std::fmt::{self, Write as _};
use std::path::Path;

use crate::schedule::{Schedule, ScheduleError, parse_zone};

use crate::schedule::fields::SPECS;

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
    /// The job's `name`: the program its command runs, `-2`, `-3`... for
    /// the later jobs running the same one.
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
        stems: Vec::new(),
        name_at: Vec::new(),
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
    // Every stem known: each job's name, into its record and its table.
    let names = distinct_names(&state.stems);
    let mut toml = String::with_capacity(state.out.len() + 64 * names.len());
    let mut copied = 0;
    for ((job, name), &at) in state.jobs.iter_mut().zip(names).zip(&state.name_at) {
        toml.push_str(&state.out[copied..at]);
        toml.push_str(&toml_str(&name));
        copied = at;
        job.name = name;
    }
    toml.push_str(&state.out[copied..]);
    Ok(Import {
        toml,
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
    /// The TOML so far, without the jobs' names (see `name_at`).
    out: String,
    /// The jobs so far, named once all are read.
    jobs: Vec<ImportedJob>,
    warnings: Vec<Warning>,
    /// Each job's [`name_stem`], in the order of `jobs`.
    stems: Vec<String>,
    /// Where in `out` each job's name value goes (after its `name = `), in
    /// the order of `jobs`: a job's name can depend on lines below it.
    name_at: Vec<usize>,
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
            message: escaped_controls(message.into()),
        }
    }

    fn warn(&mut self, number: usize, message: impl Into<String>) {
        self.warnings.push(Warning {
            origin: self.origin.to_string(),
            line: number,
            message: escaped_controls(message.into()),
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
            // Given by `import` once every line is read.
            name: String::new(),
            schedule,
            timezone: zone,
        };
        self.write_job(&job, &notes, &command_toml, user.as_deref());
        self.stems.push(name_stem(&command));
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

    /// Writes `job` as a `[[job]]` table, after its `notes`; its name is
    /// left for `import` to insert at the place recorded in `name_at`.
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
        self.out.push_str("name = ");
        self.name_at.push(self.out.len());
        self.out.push('\n');
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
         #   (misfire = \"run_once\"); cron skips it: add misfire = \"skip\" for that.\n\
         # - Each job is named after the program its command runs, in lower case\n\
         #   (`cd /srv && ./backup.sh --full` is backup); later jobs running the\n\
         #   same program are backup-2, backup-3, in file order. To rename a job,\n\
         #   edit its name = \"...\" line, best before a daemon first loads it: the\n\
         #   name is the job's lock in the store, so a job renamed later is a new\n\
         #   lock (a new fence sequence, no catch-up of an occurrence it missed),\n\
         #   and its past runs stay in `cronlease history` under the old name.\n",
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

/// Script extensions a job's name leaves off: `backup.sh` is `backup`.
const SCRIPT_EXTENSIONS: [&str; 6] = [".sh", ".bash", ".py", ".pl", ".rb", ".php"];

/// Shells and interpreters whose script, when one follows as the next word,
/// names the job: `php /srv/cron.php` is `cron`.
const INTERPRETERS: [&str; 12] = [
    "sh", "bash", "dash", "zsh", "ksh", "python", "python2", "python3", "perl", "ruby", "php",
    "node",
];

/// Commands that only prepare or guard the one a job is named after:
/// `cd /srv && ./backup.sh`, `[ -x /usr/bin/vnstat ] && /usr/bin/vnstat -u`.
const PREAMBLES: [&str; 4] = ["cd", "test", "[", "[["];

/// The longest stem: room is left for a counter in a 128-character name.
const MAX_STEM: usize = 60;

/// What a job is named after, before [`distinct_names`] tells equal ones
/// apart: the base name of the word [`program_word`] finds, without quotes,
/// in lower case, without a script extension ([`SCRIPT_EXTENSIONS`]), each
/// run of characters outside `[a-z0-9_.-]` made one `-`, `-` and `.` cut
/// from both ends, at most [`MAX_STEM`] characters; `job` if nothing is
/// left. It reads the command alone, never the line number, so a line added
/// above does not change it.
fn name_stem(command: &str) -> String {
    let word = program_word(command).trim_matches(|c: char| c == '"' || c == '\'');
    let lower = word.rsplit('/').next().unwrap_or("").to_ascii_lowercase();
    let base = SCRIPT_EXTENSIONS
        .iter()
        .find_map(|ext| lower.strip_suffix(*ext).filter(|rest| !rest.is_empty()))
        .unwrap_or(lower.as_str());
    let mut clean = String::with_capacity(base.len());
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
        .trim_matches(['-', '.'])
        .chars()
        .take(MAX_STEM)
        .collect();
    let stem = cut.trim_end_matches(['-', '.']);
    if stem.is_empty() {
        "job".to_string()
    } else {
        stem.to_string()
    }
}

/// The word naming the program a command runs, as far as its words tell
/// (this is no shell parser): the first word of the first simple command
/// that is not a [`PREAMBLES`] one, after any `NAME=value` words and
/// without the `(` or `{` of a group or a `!`; the script instead where
/// that word is one of the [`INTERPRETERS`] and the next word is not an
/// option. Simple commands end at `&&`, `||`, `;`, `|` or `&` standing as a
/// word, or at a word ending in `;`. A command of preambles only is named
/// by its first word (`cd`, `test`); one of no word at all by none.
fn program_word(command: &str) -> &str {
    let is_separator = |w: &str| matches!(w, "&&" | "||" | ";" | "|" | "&");
    let mut words = command.split_whitespace();
    let mut first_preamble: Option<&str> = None;
    // Whether the next word may start a simple command.
    let mut starting = true;
    while let Some(raw) = words.next() {
        if is_separator(raw) {
            starting = true;
            continue;
        }
        if starting {
            let word = raw
                .trim_start_matches(['(', '{', '!'])
                .trim_end_matches([';', ')', '}']);
            if PREAMBLES.contains(&word) {
                first_preamble = first_preamble.or(Some(word));
                starting = false;
            } else if !word.is_empty() && !is_assignment(word) {
                let program = word.rsplit('/').next().unwrap_or(word);
                if INTERPRETERS.contains(&program) && !raw.ends_with(';') {
                    let script = words
                        .next()
                        .filter(|w| !w.starts_with('-') && !is_separator(w))
                        .map(|w| w.trim_end_matches([';', ')', '}']))
                        .filter(|w| !w.is_empty());
                    if let Some(script) = script {
                        return script;
                    }
                }
                return word;
            }
        }
        if raw.ends_with(';') {
            starting = true;
        }
    }
    first_preamble.unwrap_or("")
}

/// `NAME=value` before a command: an environment setting for it.
fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// The jobs' names from their stems, in file order: the first job with a
/// stem is named by it, each later one by the stem, `-` and the lowest
/// number from 2 up that is neither a name given already nor any job's
/// stem, so a program called `backup-2` keeps its plain name whatever runs
/// before it. A function of the stems alone, so the same crontab always
/// gives the same names, and a line added or removed changes no job's name
/// but numbered ones: after it, of its own program, or the one whose number
/// its program's name takes. Stems are lower
/// case, so the names differ in more than case too, as the configuration
/// requires.
fn distinct_names(stems: &[String]) -> Vec<String> {
    let plain: HashSet<&str> = stems.iter().map(String::as_str).collect();
    let mut taken: HashSet<String> = HashSet::with_capacity(stems.len());
    let mut names = Vec::with_capacity(stems.len());
    for stem in stems {
        let mut name = stem.clone();
        let mut n = 1u64;
        while taken.contains(&name) || (n > 1 && plain.contains(name.as_str())) {
            n += 1;
            name = format!("{stem}-{n}");
        }
        taken.insert(name.clone());
        names.push(name);
    }
    names
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

/// A message quoting the crontab, on one line: its control characters but
/// tab (a lone `\r` inside a field, say) written as escapes (`\r`), as the
/// text log writes them.
fn escaped_controls(message: String) -> String {
    crate::output::escape_controls(&message).into_owned()
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
