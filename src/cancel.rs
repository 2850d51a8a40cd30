//! Cancelling a run (docs/protocol.md, "Cancel"): `cronlease cancel` leaves
//! a request for the node running it in the store's outbox, as a parcel
//! whose id names that node's owner ([`prefix_for`]); the node, which looks
//! for its parcels while it has runs going, stops the run (`kill_grace` as
//! for a timeout) and records it `cancelled` with who asked and why. A
//! parcel is taken once, so a request is acted on once, by the node it
//! names; the one who asked takes back a request nobody took.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::JobName;
use crate::store::{Owner, Parcel};

/// The longest reason kept (bytes, cut at a character boundary).
pub const MAX_REASON: usize = 500;

/// A request to stop one run: the job, the run's fence, who asked (a token's
/// name, or `user@host` for the CLI) and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelRequest {
    pub job: String,
    pub fence: u64,
    pub by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When it was asked (the asker's clock).
    #[serde(with = "chrono::serde::ts_milliseconds")]
    pub at: chrono::DateTime<chrono::Utc>,
}

impl CancelRequest {
    /// A request from `by` to stop `job`'s run at `fence`, the reason made
    /// one line and cut to [`MAX_REASON`].
    pub fn new(job: &JobName, fence: u64, by: &str, reason: Option<&str>) -> CancelRequest {
        CancelRequest {
            job: job.to_string(),
            fence,
            by: one_line(by, 200),
            reason: reason
                .map(|r| one_line(r, MAX_REASON))
                .filter(|r| !r.is_empty()),
            at: chrono::Utc::now(),
        }
    }

    /// The parcel that leaves it for `owner`, the daemon running the run:
    /// its id ends with `~`, so no request's id is the prefix of another's
    /// (`JOB~4~` of `JOB~41~`).
    pub fn parcel(&self, owner: &str) -> Parcel {
        Parcel {
            id: format!("{}{}~{}~", prefix_for(owner), self.job, self.fence),
            // A struct of strings and numbers always serializes.
            body: serde_json::to_string(self).unwrap_or_default(),
        }
    }

    /// A parcel's request; `None` for one that is not (a hand edit, a
    /// newer version's shape, a job name no job has). Whoever wrote it, its
    /// `by` and reason come back on one line and within their limits, as
    /// [`CancelRequest::new`] makes them: they go into log lines and the
    /// run's record.
    pub fn of(parcel: &Parcel) -> Option<CancelRequest> {
        let read: CancelRequest = serde_json::from_str(&parcel.body).ok()?;
        let job = JobName::parse(&read.job).ok()?;
        Some(CancelRequest {
            at: read.at,
            ..CancelRequest::new(&job, read.fence, &read.by, read.reason.as_deref())
        })
    }

    /// What the run's record says after its output: who stopped it, why.
    pub fn said(&self) -> String {
        match &self.reason {
            Some(reason) => format!("cronlease: cancelled by {}: {reason}\n", self.by),
            None => format!("cronlease: cancelled by {}\n", self.by),
        }
    }
}

/// The outbox prefix of the requests for `owner`: `~cancel~`, then 16 hex
/// digits of its SHA-256 (an owner's name may hold characters a parcel id
/// cannot), then `~`. It starts with `~`, which no webhook's name (whose
/// deliveries are parcels `NAME~...`) can: a webhook named `cancel` takes
/// none of them.
pub fn prefix_for(owner: &str) -> String {
    let digest = Sha256::digest(owner.as_bytes());
    let hex = crate::config::hex(&digest[..8]);
    format!("~cancel~{hex}~")
}

/// The node's own prefix.
pub fn prefix_of(owner: &Owner) -> String {
    prefix_for(owner.as_str())
}

/// Who runs this command: `user@host` (the uid when it has no name).
pub fn who_am_i() -> String {
    let uid = nix::unistd::getuid();
    let user = nix::unistd::User::from_uid(uid)
        .ok()
        .flatten()
        .map_or_else(|| format!("uid {uid}"), |u| u.name);
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "?".into());
    format!("{user}@{host}")
}

/// `text` on one line (control characters as spaces), at most `max` bytes.
pub(crate) fn one_line(text: &str, max: usize) -> String {
    let mut out: String = text
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if out.len() > max {
        let mut end = max;
        while !out.is_char_boundary(end) {
            end -= 1;
        }
        out.truncate(end);
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_request_round_trips_through_its_parcel_with_a_valid_id() {
        let job = JobName::parse("nightly.backup-2").unwrap();
        let asked = CancelRequest::new(&job, 41, "alice@web-1", Some("  wrong\ninput  "));
        let parcel = asked.parcel("web-2#9f3a11c0");
        assert!(Parcel::id_is_valid(&parcel.id), "{}", parcel.id);
        assert!(parcel.id.starts_with(&prefix_for("web-2#9f3a11c0")));
        assert!(
            parcel.id.ends_with("~nightly.backup-2~41~"),
            "{}",
            parcel.id
        );
        assert!(parcel.id.starts_with("~cancel~"), "{}", parcel.id);
        assert_ne!(prefix_for("web-2#9f3a11c0"), prefix_for("web-2#9f3a11c1"));
        let read = CancelRequest::of(&parcel).unwrap();
        assert_eq!(read.reason.as_deref(), Some("wrong input"));
        assert_eq!(
            (read.job.as_str(), read.fence, read.by.as_str()),
            ("nightly.backup-2", 41, "alice@web-1")
        );
        assert_eq!(
            read.said(),
            "cronlease: cancelled by alice@web-1: wrong input\n"
        );
        // The longest job name and fence still make a valid id.
        let long = JobName::parse(&"j".repeat(128)).unwrap();
        let parcel = CancelRequest::new(&long, u64::MAX, "x", None).parcel("o");
        assert!(Parcel::id_is_valid(&parcel.id), "{}", parcel.id.len());
        assert!(
            CancelRequest::of(&Parcel {
                id: "x".into(),
                body: "{".into()
            })
            .is_none()
        );
        // Another writer's body is made one line and cut as ours is; a job
        // name no job has is no request.
        let raw = r#"{"job":"j","fence":2,"by":"a\nb","reason":"x\u001b[2Jy","at":0}"#;
        let read = CancelRequest::of(&Parcel {
            id: "x".into(),
            body: raw.into(),
        })
        .unwrap();
        assert_eq!(
            (read.by.as_str(), read.reason.as_deref()),
            ("a b", Some("x [2Jy"))
        );
        let bad = r#"{"job":"a b","fence":2,"by":"x","at":0}"#;
        let none = CancelRequest::of(&Parcel {
            id: "x".into(),
            body: bad.into(),
        });
        assert!(none.is_none());
    }

    #[test]
    fn a_reason_is_cut_at_a_character_boundary() {
        let job = JobName::parse("j").unwrap();
        let asked = CancelRequest::new(&job, 1, "b", Some(&"é".repeat(400)));
        let reason = asked.reason.unwrap();
        assert!(reason.len() <= MAX_REASON && reason.chars().all(|c| c == 'é'));
        assert_eq!(CancelRequest::new(&job, 1, "b", Some("  ")).reason, None);
    }
}
