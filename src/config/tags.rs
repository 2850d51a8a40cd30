//! Node tags and a job's `run_on` (docs/configuration.md, "Node tags"): a
//! node says what it is (`[node] tags = ["db", "eu-west"]`), a job says
//! what a node must be to run it (`run_on = ["db"]`), and a node claims the
//! job only if it has every tag the job asks for.

use std::fmt;

use serde::Serialize;
use toml::Spanned;

use super::{ConfigError, Source};

/// The longest tag.
pub const MAX_TAG: usize = 64;

/// The most tags a node or a job names: a beat carries them every second.
pub const MAX_TAGS: usize = 32;

/// A set of tags, sorted, each named once: a node's `tags` or a job's
/// `run_on`. Empty: a node without tags; a job any node may run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Tags(Vec<String>);

impl Tags {
    /// Tags from a list already checked (a registry record's, a test's):
    /// sorted and made unique, invalid ones dropped.
    pub fn from_checked<I: IntoIterator<Item = S>, S: Into<String>>(tags: I) -> Tags {
        let mut v: Vec<String> = tags
            .into_iter()
            .map(Into::into)
            .filter(|t| check_tag(t).is_ok())
            .collect();
        v.sort();
        v.dedup();
        Tags(v)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn as_slice(&self) -> &[String] {
        &self.0
    }

    /// Whether a node with `node_tags` may run a job whose `run_on` is
    /// `self`: it has every one of them.
    pub fn allow<S: AsRef<str>>(&self, node_tags: &[S]) -> bool {
        self.0
            .iter()
            .all(|t| node_tags.iter().any(|n| n.as_ref() == t))
    }
}

impl fmt::Display for Tags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(", "))
    }
}

/// Why `tag` is not a tag, if it is not: 1 to [`MAX_TAG`] ASCII letters,
/// digits, `-`, `_`, `.` and `:`, starting with a letter or a digit.
pub fn check_tag(tag: &str) -> Result<(), String> {
    if tag.is_empty() {
        return Err("a tag cannot be empty".into());
    }
    if !tag.starts_with(|c: char| c.is_ascii_alphanumeric())
        || !tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
    {
        return Err(format!(
            "invalid tag {tag:?}: use letters, digits, '-', '_', '.' and ':', starting with a letter or a digit"
        ));
    }
    // ASCII only by now: bytes are characters.
    if tag.len() > MAX_TAG {
        return Err(format!("tag {tag:?} is longer than {MAX_TAG} characters"));
    }
    Ok(())
}

/// `what` (`node.tags`, `run_on`) read from its TOML list: every tag valid
/// and named once, at most [`MAX_TAGS`]; each mistake is an error at its
/// place.
pub(super) fn tags(
    src: &Source,
    list: &Spanned<Vec<Spanned<String>>>,
    what: &str,
    errors: &mut Vec<ConfigError>,
) -> Option<Tags> {
    let before = errors.len();
    if list.get_ref().len() > MAX_TAGS {
        errors.push(src.at(
            list,
            format!(
                "{what} names {} tags; at most {MAX_TAGS}",
                list.get_ref().len()
            ),
        ));
    }
    let mut seen: Vec<&str> = Vec::new();
    for t in list.get_ref() {
        let tag = t.get_ref().as_str();
        if let Err(m) = check_tag(tag) {
            errors.push(src.at(t, format!("{what}: {m}")));
        } else if seen.contains(&tag) {
            errors.push(src.at(t, format!("{what} names tag {tag:?} twice")));
        } else {
            seen.push(tag);
        }
    }
    (errors.len() == before).then(|| Tags::from_checked(seen))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_runs_where_every_tag_it_asks_for_is() {
        let run_on = Tags::from_checked(["db", "eu-west"]);
        assert!(run_on.allow(&["eu-west", "db", "ssd"]));
        assert!(!run_on.allow(&["db"]));
        assert!(!run_on.allow::<&str>(&[]));
        assert!(Tags::default().allow::<&str>(&[]), "no run_on: any node");
        assert_eq!(
            Tags::from_checked(["b", "a", "b", "no space"]).as_slice(),
            ["a", "b"]
        );
        for bad in ["", "-db", "db west", "é", &"x".repeat(65)] {
            assert!(check_tag(bad).is_err(), "{bad:?}");
        }
        for good in ["db", "eu-west", "rack:3", "a.b_c", &"x".repeat(64)] {
            assert!(check_tag(good).is_ok(), "{good:?}");
        }
    }
}
