//! The lock record etcd and ZooKeeper keep for each job, as JSON: what
//! outlives a lease. The fence, the last occurrence, the running and pause
//! marks and a manual run's request are [`JobMarks`], the same in both;
//! each store flattens them into its own record beside what only it keeps
//! (etcd the last owner, its lease being a key of its own; ZooKeeper the
//! owner, the lease's end and the session it was taken in). The JSON is
//! what each store wrote before the two shared this type: the same field
//! names, so records written by either version read alike.

use serde::{Deserialize, Serialize};

use super::{LockRow, TriggerId};

/// What a job's lock record keeps beyond its lease, in both stores.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct JobMarks {
    /// Decimal: a JSON number would not keep 64 bits everywhere.
    pub fence: String,
    #[serde(default)]
    pub last_occurrence: Option<i64>,
    pub modified_at: i64,
    /// The run of the last claim is not recorded yet; records written by
    /// earlier versions count as running (their holders never clear it).
    #[serde(default = "unknown_is_running")]
    pub running: bool,
    /// Paused by `cronlease pause`: claims are refused. Only pause and
    /// resume change it; every other write keeps it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// A manual run's request, pending until a node claims it (`trigger`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<i64>,
    /// The request the last manual claim took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_trigger: Option<i64>,
}

fn unknown_is_running() -> bool {
    true
}

impl JobMarks {
    /// The marks of a job never claimed, made at `now` (ms).
    pub fn free(now: i64) -> Self {
        JobMarks {
            fence: "0".into(),
            last_occurrence: None,
            modified_at: now,
            running: false,
            paused: false,
            trigger: None,
            last_trigger: None,
        }
    }

    /// The fence as a number, when it is one from 0 to 2^63 − 1.
    pub fn fence(&self) -> Option<i64> {
        self.fence.parse::<i64>().ok().filter(|f| *f >= 0)
    }

    /// The marks after a claim won at `now` with `fence` for
    /// `last_occurrence`, on the marks `kept` (none: a job never claimed).
    /// The pause mark stays as it is (a claim wins only while not paused,
    /// or is a manual run, or an earlier win answered again); a manual
    /// claim takes its request, a scheduled one leaves a pending request.
    pub fn claimed(
        kept: Option<&JobMarks>,
        fence: i64,
        last_occurrence: Option<i64>,
        manual: Option<TriggerId>,
        now: i64,
    ) -> JobMarks {
        JobMarks {
            fence: fence.to_string(),
            last_occurrence,
            modified_at: now,
            running: true,
            paused: kept.is_some_and(|k| k.paused),
            trigger: match manual {
                Some(_) => None,
                None => kept.and_then(|k| k.trigger),
            },
            last_trigger: manual
                .map(TriggerId::get)
                .or_else(|| kept.and_then(|k| k.last_trigger)),
        }
    }

    /// `kept` with its pause mark set to `paused`, or, for a job never
    /// claimed, free marks made at `now` with it; `None` when the mark is
    /// that already (nothing to write).
    pub fn paused(kept: Option<&JobMarks>, paused: bool, now: i64) -> Option<JobMarks> {
        match kept {
            Some(k) if k.paused == paused => None,
            Some(k) => Some(JobMarks {
                paused,
                ..k.clone()
            }),
            None => Some(JobMarks {
                paused,
                ..JobMarks::free(now)
            }),
        }
    }

    /// `kept` (or, for a job never claimed, free marks made at `now`) with
    /// the pending request `trigger`.
    pub fn requested(kept: Option<&JobMarks>, trigger: Option<i64>, now: i64) -> JobMarks {
        JobMarks {
            trigger,
            ..kept.cloned().unwrap_or_else(|| JobMarks::free(now))
        }
    }

    /// `kept` without its pending request, when that request is `id`.
    pub fn withdrawn(kept: &JobMarks, id: TriggerId) -> Option<JobMarks> {
        (kept.trigger == Some(id.get())).then(|| JobMarks {
            trigger: None,
            ..kept.clone()
        })
    }

    /// The shared claim rule's view of a job with these marks (none: never
    /// claimed), held by `owner` until `expires_at`, at `now` (all ms). A
    /// fence that is not a number reads as the largest, which no claim can
    /// pass.
    pub fn row(
        marks: Option<&JobMarks>,
        owner: Option<String>,
        expires_at: i64,
        now: i64,
    ) -> LockRow {
        LockRow {
            owner,
            fence: marks.map_or(0, |m| m.fence().unwrap_or(i64::MAX)),
            expires_at,
            last_occurrence: marks.and_then(|m| m.last_occurrence),
            running: marks.is_some_and(|m| m.running),
            paused: marks.is_some_and(|m| m.paused),
            trigger: marks.and_then(|m| m.trigger),
            last_trigger: marks.and_then(|m| m.last_trigger),
            now,
        }
    }
}

/// The kinds of record etcd and ZooKeeper keep, each under a directory of
/// the store's root ([`Layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Lock,
    /// etcd only: a lease is a key of its own.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    Lease,
    Node,
    Trigger,
    Runs,
    /// Parcels handed over ([`crate::store::outbox`]).
    Outbox,
    /// Operators' actions ([`crate::store::audit`]): `{audit dir}/<job>/<id>`.
    Audit,
}

/// Where a store keeps each kind of record: `{root}{dir}/{name}`, one place
/// that names them. etcd's root is `key_prefix` (`cronlease:lock/backup`);
/// ZooKeeper's is its base znode (`/cronlease/locks/backup`). The names are
/// what each store wrote before the two shared this type.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    root: String,
    /// Per [`Kind`], in its order.
    dirs: [&'static str; 7],
}

impl Layout {
    /// etcd's keys under `prefix`.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub fn etcd(prefix: &str) -> Self {
        Layout {
            root: prefix.to_string(),
            dirs: [
                "lock", "lease", "node", "trigger", "runs", "outbox", "audit",
            ],
        }
    }

    /// ZooKeeper's znodes under `base`.
    #[cfg_attr(not(feature = "zookeeper"), allow(dead_code))]
    pub fn zookeeper(base: &str) -> Self {
        Layout {
            root: format!("{base}/"),
            dirs: [
                "locks", "leases", "nodes", "triggers", "runs", "outbox", "audit",
            ],
        }
    }

    /// `{root}{name}`: a record of the store's own beside the kinds
    /// (ZooKeeper's `clock` and `live`).
    pub fn under(&self, name: &str) -> String {
        format!("{}{name}", self.root)
    }

    /// The directory of a kind: `{root}{dir}` (a ZooKeeper parent znode).
    pub fn dir(&self, kind: Kind) -> String {
        self.under(self.dirs[kind as usize])
    }

    /// The record `name` of a kind; with `""`, the prefix every record of
    /// the kind starts with (an etcd range).
    pub fn of(&self, kind: Kind, name: &str) -> String {
        format!("{}/{name}", self.dir(kind))
    }

    /// A pending manual run's request: `{trigger dir}/<job>~<id>`.
    pub fn trigger(&self, job: &str, id: TriggerId) -> String {
        self.of(Kind::Trigger, &super::trigger_entry(job, id))
    }

    /// The prefix of a job's runs (an etcd range): `{runs dir}/<job>/`.
    pub fn runs_prefix(&self, job: &str) -> String {
        format!("{}/", self.of(Kind::Runs, job))
    }

    /// An audit entry: `{audit dir}/<job>/<id>` (ids sort by time).
    pub fn audit(&self, job: &str, id: &str) -> String {
        format!("{}/{id}", self.of(Kind::Audit, job))
    }

    /// A run's record: the fence zero-padded to 20 digits, so a job's runs
    /// sort by fence.
    pub fn run(&self, job: &str, fence: u64) -> String {
        format!("{}{fence:020}", self.runs_prefix(job))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The names each store wrote before the two shared [`Layout`].
    #[test]
    fn each_store_keeps_its_records_where_it_always_did() {
        let etcd = Layout::etcd("cronlease:");
        assert_eq!(etcd.of(Kind::Lock, "backup"), "cronlease:lock/backup");
        assert_eq!(etcd.of(Kind::Lease, "backup"), "cronlease:lease/backup");
        assert_eq!(etcd.of(Kind::Node, ""), "cronlease:node/");
        assert_eq!(etcd.of(Kind::Trigger, ""), "cronlease:trigger/");
        assert_eq!(etcd.runs_prefix("backup"), "cronlease:runs/backup/");
        assert_eq!(etcd.run("j", 42), "cronlease:runs/j/00000000000000000042");
        let id = TriggerId::from_stored(5).unwrap();
        assert_eq!(
            etcd.trigger("j", id),
            format!("cronlease:trigger/{}", super::super::trigger_entry("j", id))
        );
        let zk = Layout::zookeeper("/ch/cronlease");
        assert_eq!(zk.of(Kind::Lock, "backup"), "/ch/cronlease/locks/backup");
        assert_eq!(zk.dir(Kind::Trigger), "/ch/cronlease/triggers");
        assert_eq!(zk.dir(Kind::Node), "/ch/cronlease/nodes");
        assert_eq!(zk.of(Kind::Runs, "j"), "/ch/cronlease/runs/j");
        assert_eq!(zk.under("clock"), "/ch/cronlease/clock");
        assert_eq!(zk.audit("j", "1-a"), "/ch/cronlease/audit/j/1-a");
        assert_eq!(etcd.audit("j", "1-a"), "cronlease:audit/j/1-a");
        assert_eq!(zk.run("j", 7), "/ch/cronlease/runs/j/00000000000000000007");
    }

    /// Both stores' records as they were written before they shared this
    /// type read the same, and write the same fields back.
    #[test]
    fn records_of_either_store_read_and_write_the_same_fields() {
        #[derive(Serialize, Deserialize)]
        struct Etcd {
            owner: String,
            #[serde(flatten)]
            marks: JobMarks,
        }
        let old = r#"{"owner":"a#1","fence":"9223372036854775807","last_occurrence":1700000000000,"modified_at":5,"running":false,"paused":true,"trigger":7}"#;
        let read: Etcd = serde_json::from_str(old).unwrap();
        assert_eq!(read.marks.fence(), Some(i64::MAX));
        assert!(read.marks.paused && !read.marks.running);
        let again: serde_json::Value = serde_json::to_value(&read).unwrap();
        let old: serde_json::Value = serde_json::from_str(old).unwrap();
        assert_eq!(again, old);
        // A record of an earlier version, with no running mark: running.
        let older: Etcd =
            serde_json::from_str(r#"{"owner":"","fence":"3","modified_at":1}"#).unwrap();
        assert!(older.marks.running);
        assert_eq!(older.marks.last_occurrence, None);
    }

    #[test]
    fn a_claim_keeps_the_pause_mark_and_takes_only_its_own_request() {
        let kept = JobMarks {
            paused: true,
            trigger: Some(5),
            last_trigger: Some(2),
            ..JobMarks::free(0)
        };
        let scheduled = JobMarks::claimed(Some(&kept), 4, Some(10), None, 1);
        assert!(scheduled.paused && scheduled.running);
        assert_eq!(
            (scheduled.trigger, scheduled.last_trigger),
            (Some(5), Some(2))
        );
        let id = TriggerId::from_stored(5).unwrap();
        let manual = JobMarks::claimed(Some(&kept), 5, Some(10), Some(id), 1);
        assert_eq!((manual.trigger, manual.last_trigger), (None, Some(5)));
        assert_eq!(JobMarks::withdrawn(&kept, id).unwrap().trigger, None);
        assert!(JobMarks::withdrawn(&kept, TriggerId::from_stored(6).unwrap()).is_none());
        assert!(JobMarks::paused(Some(&kept), true, 1).is_none());
        assert!(!JobMarks::paused(Some(&kept), false, 1).unwrap().paused);
        assert!(JobMarks::paused(None, true, 1).unwrap().paused);
    }
}
