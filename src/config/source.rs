//! The files a configuration is read from: their text, to turn a byte
//! span into a line and column ([`Source`]), TOML parsed with serde's
//! errors placed, and the durations every section uses.

use super::*;

/// The text of one file, to turn byte spans into lines and columns.
pub(super) struct Source {
    pub(super) origin: String,
    pub(super) text: String,
    /// Where each line starts (byte offsets): a position is found in
    /// O(log lines), not by counting from the file's start, which made
    /// loading a file of n jobs O(n²) (every job's location is kept).
    pub(super) line_starts: Vec<usize>,
}

impl Source {
    pub(super) fn new(origin: String, text: String) -> Source {
        let line_starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Source {
            origin,
            text,
            line_starts,
        }
    }

    /// Line and column (from 1; the column in characters) of `offset`.
    pub(super) fn line_col(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let line = self.line_starts.partition_point(|start| *start <= offset);
        let start = self
            .line_starts
            .get(line.wrapping_sub(1))
            .copied()
            .unwrap_or(0);
        let col = self
            .text
            .get(start..offset)
            .map_or(0, |l| l.chars().count())
            + 1;
        (line.max(1), col)
    }

    pub(super) fn error_at(
        &self,
        span: Option<Range<usize>>,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError {
            origin: self.origin.clone(),
            position: span.map(|s| self.line_col(s.start)),
            // A message may quote a value: never a password in a URL.
            message: redact_urls_in(&one_line(&message.into())),
        }
    }
    pub(super) fn at<T>(&self, v: &Spanned<T>, message: impl Into<String>) -> ConfigError {
        self.error_at(Some(v.span()), message)
    }
}

/// `s` on one line: every run of white space (newlines too) becomes one space.
pub fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

pub(super) fn read_source(path: &Path, errors: &mut Vec<ConfigError>) -> Option<Source> {
    match std::fs::read_to_string(path) {
        Ok(text) => Some(Source::new(path.display().to_string(), text)),
        Err(e) => {
            errors.push(ConfigError {
                origin: path.display().to_string(),
                position: None,
                message: format!("cannot read: {e}"),
            });
            None
        }
    }
}

/// Parses a whole file into `T`, reporting every mistake it can find rather
/// than the first: all syntax errors (the parser recovers), then, if the
/// file as a whole does not fit `T`, each top-level key on its own and each
/// `[[job]]` table on its own, so an unknown key in `[store]`, a bad type in
/// `[lease]` and a broken job are all listed in one pass.
pub(super) fn parse_toml<T: serde::de::DeserializeOwned>(
    src: &Source,
    errors: &mut Vec<ConfigError>,
) -> Option<T> {
    use serde::de::IntoDeserializer;
    use toml::de::{DeTable, DeValue};
    let (table, syntax) = DeTable::parse_recoverable(&src.text);
    if !syntax.is_empty() {
        for e in syntax {
            errors.push(src.error_at(e.span(), e.message()));
        }
        return None;
    }
    let whole = T::deserialize(table.clone().into_deserializer());
    let first = match whole {
        Ok(v) => return Some(v),
        Err(e) => e,
    };
    let before = errors.len();
    let span = table.span();
    for (key, value) in table.get_ref().iter() {
        if let (DeValue::Array(jobs), "job") = (value.get_ref(), key.get_ref().as_ref()) {
            for job in jobs {
                if let Err(e) = raw::RawJob::deserialize(job.clone().into_deserializer()) {
                    errors.push(src.error_at(e.span(), e.message()));
                }
            }
            continue;
        }
        let mut one = DeTable::new();
        one.insert(key.clone(), value.clone());
        let one = toml::Spanned::new(span.clone(), one);
        if let Err(e) = T::deserialize(one.into_deserializer()) {
            errors.push(src.error_at(e.span(), e.message()));
        }
    }
    if errors.len() == before {
        errors.push(src.error_at(first.span(), first.message()));
    }
    None
}

/// Checks that a string setting holds no NUL byte (no path, argument or
/// name can carry one: every run would fail).
pub(super) fn refuse_nul(
    src: &Source,
    v: &Spanned<String>,
    what: &str,
    errors: &mut Vec<ConfigError>,
) -> bool {
    if v.get_ref().contains('\0') {
        errors.push(src.at(v, format!("{what} contains a NUL byte")));
        return false;
    }
    true
}

/// The longest duration any setting takes: a year. Longer ones are typos
/// (or `u64::MAX` seconds), and every deadline computed from a bounded value
/// stays far from overflowing.
pub const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

pub(super) fn duration(
    src: &Source,
    v: &Spanned<String>,
    what: &str,
    errors: &mut Vec<ConfigError>,
) -> Option<Duration> {
    bounded_duration(src, v, what, MAX_DURATION, errors)
}

pub(super) fn bounded_duration(
    src: &Source,
    v: &Spanned<String>,
    what: &str,
    max: Duration,
    errors: &mut Vec<ConfigError>,
) -> Option<Duration> {
    match humantime::parse_duration(v.get_ref()) {
        Ok(d) if d > max => {
            errors.push(src.at(
                v,
                format!(
                    "{what} {:?} is too long: at most {}",
                    v.get_ref(),
                    humantime::format_duration(max)
                ),
            ));
            None
        }
        Ok(d) if d > Duration::ZERO => Some(d),
        Ok(_) => {
            errors.push(src.at(v, format!("{what} must be longer than zero")));
            None
        }
        Err(e) => {
            errors.push(src.at(
                v,
                format!("invalid duration {:?} for {what}: {e} (expected e.g. \"500ms\", \"2s\", \"1h 30m\")", v.get_ref()),
            ));
            None
        }
    }
}

/// A duration from `min` to `max`: below `min` is "too short", naming it.
pub(super) fn duration_within(
    src: &Source,
    v: &Spanned<String>,
    what: &str,
    min: Duration,
    max: Duration,
    errors: &mut Vec<ConfigError>,
) -> Option<Duration> {
    let d = bounded_duration(src, v, what, max, errors)?;
    if d < min {
        errors.push(src.at(
            v,
            format!(
                "{what} {:?} is too short: at least {}",
                v.get_ref(),
                humantime::format_duration(min)
            ),
        ));
        return None;
    }
    Some(d)
}

/// `cluster.trigger_expiry` unless set.
pub const DEFAULT_TRIGGER_EXPIRY: Duration = Duration::from_secs(3600);

/// `cluster.head_start` unless set (or half the margin, if that is less).
pub const DEFAULT_HEAD_START: Duration = Duration::from_millis(50);

pub(super) fn bounded_duration_or(
    src: &Source,
    v: &Option<Spanned<String>>,
    what: &str,
    default: Duration,
    max: Duration,
    errors: &mut Vec<ConfigError>,
) -> Duration {
    v.as_ref()
        .and_then(|v| bounded_duration(src, v, what, max, errors))
        .unwrap_or(default)
}

pub(super) fn duration_or(
    src: &Source,
    v: &Option<Spanned<String>>,
    what: &str,
    default: Duration,
    errors: &mut Vec<ConfigError>,
) -> Duration {
    v.as_ref()
        .and_then(|v| duration(src, v, what, errors))
        .unwrap_or(default)
}
