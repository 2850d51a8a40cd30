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
/// than the first: all syntax errors (the parser recovers); then each
/// `[[job]]` table read on its own, and the file as a whole, each until it
/// fits: a mistake is reported and the entry it points at set aside, so an
/// unknown key in `[store]`, a bad type in `[lease]` and every broken key of
/// every job are all listed in one pass. What is left is returned, for the
/// checks of meaning to run on it too (an invalid schedule is reported
/// beside a misspelt key, not in a second round); `None` only when even
/// that does not fit (a required key missing).
pub(super) fn parse_toml<T: serde::de::DeserializeOwned>(
    src: &Source,
    errors: &mut Vec<ConfigError>,
) -> Option<T> {
    use toml::de::{DeArray, DeTable, DeValue};
    let (mut table, syntax) = DeTable::parse_recoverable(&src.text);
    if !syntax.is_empty() {
        for e in syntax {
            errors.push(src.error_at(e.span(), e.message()));
        }
        return None;
    }
    // A job at a time first: a file of many jobs is not read whole again
    // for each mistake in one of them.
    if let Some(jobs) = table.get_mut().get_mut("job")
        && let DeValue::Array(list) = jobs.get_mut()
    {
        let mut fitting = DeArray::new();
        for job in list.iter() {
            if let DeValue::Table(t) = job.get_ref() {
                let one = toml::Spanned::new(job.span(), t.clone());
                let (fits, left) = fit::<raw::RawJob>(src, one, errors);
                if fits.is_some() {
                    fitting.push(toml::Spanned::new(
                        job.span(),
                        DeValue::Table(left.into_inner()),
                    ));
                }
            } else {
                fitting.push(job.clone());
            }
        }
        *list = fitting;
    }
    fit::<T>(src, table, errors).0
}

/// The most mistakes one table is read again for: past it, the rest of the
/// table is not checked (a file that far off is not worth reading whole
/// again for each).
const MAX_MISTAKES: usize = 100;

/// `table` read as `T`; while it does not fit, the mistake is reported and
/// the entry it points at is set aside, and the rest is read again. `T`
/// (if what is left fits) and what is left.
fn fit<'i, T: serde::de::DeserializeOwned>(
    src: &Source,
    mut table: toml::Spanned<toml::de::DeTable<'i>>,
    errors: &mut Vec<ConfigError>,
) -> (Option<T>, toml::Spanned<toml::de::DeTable<'i>>) {
    use serde::de::IntoDeserializer;
    // The paths of the keys set aside: their "missing field" is no news.
    let mut set_aside: Vec<Vec<Step>> = Vec::new();
    for _ in 0..MAX_MISTAKES {
        let e = match T::deserialize(table.clone().into_deserializer()) {
            Ok(v) => return (Some(v), table),
            Err(e) => e,
        };
        let span = e.span();
        let path = span.as_ref().and_then(|span| locate(table.get_ref(), span));
        let missing = e
            .message()
            .strip_prefix("missing field `")
            .and_then(|m| m.strip_suffix('`'));
        // A missing field is reported at its table: the root (no path) or
        // the table `path` ends at.
        let known = missing.is_some_and(|key| {
            let mut full = path.clone().unwrap_or_default();
            full.push(Step::Key(key.to_string()));
            set_aside.contains(&full)
        });
        if !known {
            errors.push(src.error_at(span, did_you_mean(e.message())));
        }
        match path {
            Some(path) if remove_path(table.get_mut(), &path).is_some() => set_aside.push(path),
            _ => return (None, table),
        }
    }
    (None, table)
}

/// One step down a TOML document: a key of a table, an element of an array.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Key(String),
    Element(usize),
}

/// The path to the innermost entry of `table` that `span` points at: a key,
/// a value, or a table of an array (by its header); `None` if none.
fn locate(table: &toml::de::DeTable<'_>, span: &Range<usize>) -> Option<Vec<Step>> {
    use toml::de::DeValue;
    let holds = |outer: Range<usize>| outer.start <= span.start && span.end <= outer.end;
    for (k, v) in table.iter() {
        let here = || vec![Step::Key(k.get_ref().to_string())];
        if holds(k.span()) {
            return Some(here());
        }
        // What is within first: an array of tables has its first table's
        // header for its span, a `[table]` its header.
        match v.get_ref() {
            DeValue::Table(inner) => {
                if let Some(rest) = locate(inner, span) {
                    return Some(here().into_iter().chain(rest).collect());
                }
            }
            DeValue::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    let at = || here().into_iter().chain([Step::Element(i)]);
                    if item.span() == *span {
                        return Some(at().collect());
                    }
                    if let DeValue::Table(inner) = item.get_ref() {
                        if let Some(rest) = locate(inner, span) {
                            return Some(at().chain(rest).collect());
                        }
                    } else if holds(item.span()) {
                        return Some(at().collect());
                    }
                }
            }
            _ => {}
        }
        // The value itself, or a string or number holding the span.
        let leaf = !matches!(v.get_ref(), DeValue::Table(_) | DeValue::Array(_));
        if v.span() == *span || (leaf && holds(v.span())) {
            return Some(here());
        }
    }
    None
}

/// Removes the entry at the end of `path` ([`locate`]), and returns the
/// key it was or was under; `None` if there is none.
fn remove_path(table: &mut toml::de::DeTable<'_>, path: &[Step]) -> Option<String> {
    use toml::de::{DeArray, DeValue};
    let (Step::Key(key), rest) = path.split_first()? else {
        return None;
    };
    if rest.is_empty() {
        table.remove(key.as_str());
        return Some(key.clone());
    }
    let value = table.get_mut(key.as_str())?;
    match (value.get_mut(), rest.split_first()) {
        (DeValue::Table(inner), Some((Step::Key(_), _))) => remove_path(inner, rest),
        (DeValue::Array(items), Some((Step::Element(i), []))) => {
            let mut kept = DeArray::new();
            for (j, item) in items.iter().enumerate() {
                if j != *i {
                    kept.push(item.clone());
                }
            }
            *items = kept;
            Some(key.clone())
        }
        (DeValue::Array(items), Some((Step::Element(i), more))) => {
            match items.get_mut(*i).map(|item| item.get_mut()) {
                Some(DeValue::Table(inner)) => remove_path(inner, more),
                _ => None,
            }
        }
        _ => None,
    }
}

/// A serde message about an unknown key or value, with the closest one it
/// expected when that is a likely typo: "unknown field `history_limt`,
/// expected one of … (did you mean `history_limit`?)".
pub(super) fn did_you_mean(message: &str) -> String {
    let unknown = ["unknown field `", "unknown variant `"]
        .iter()
        .find_map(|p| message.strip_prefix(p))
        .and_then(|rest| rest.split_once('`'));
    let Some((given, rest)) = unknown else {
        return message.to_string();
    };
    let candidates = rest.split('`').skip(1).step_by(2);
    match closest(given, candidates) {
        Some(best) => format!("{message} (did you mean `{best}`?)"),
        None => message.to_string(),
    }
}

/// The candidate nearest `given` by edit distance, if it is near enough to
/// be a typo (at most a third of the word's letters, at least one).
fn closest<'a>(given: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (given.chars().count() / 3).max(1);
    let given = given.to_ascii_lowercase();
    candidates
        .map(|c| (edit_distance(&given, c), c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Levenshtein distance (insertions, deletions, substitutions), with an
/// adjacent swap counted as one edit.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // Three rows: two back for the swap.
    let mut before: Vec<usize> = Vec::new();
    let mut last: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut row = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut d = (last[j] + 1).min(row[j - 1] + 1).min(last[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d = d.min(before[j - 2] + 1);
            }
            row[j] = d;
        }
        before = std::mem::replace(&mut last, row);
    }
    last[b.len()]
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
