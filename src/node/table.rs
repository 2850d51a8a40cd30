//! The node's job table: the configured jobs by name, and the scheduler's
//! queue of their next occurrences, earliest first, so that an instant
//! costs what is due then, not a walk over every job (issue 35, item 6).
//! A job's next occurrence is private to this module: it changes only
//! through the table, which keeps map and queue in step.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use super::JobState;
use crate::config::JobName;

pub(super) struct JobEntry {
    pub(super) state: Arc<JobState>,
    /// The next occurrence the scheduler will claim (set through the
    /// table only).
    next: Option<DateTime<Utc>>,
    /// Stops the job's in-flight occurrence handlers (removal).
    pub(super) handlers_stop: CancellationToken,
    /// This node has every tag of the job's `run_on`: it claims the job.
    /// Otherwise the job is known here (status, definitions) but never
    /// claimed: `next` stays `None` and manual runs are left to others.
    pub(super) allowed: bool,
}

impl JobEntry {
    pub(super) fn new(
        state: Arc<JobState>,
        next: Option<DateTime<Utc>>,
        handlers_stop: CancellationToken,
        allowed: bool,
    ) -> Self {
        JobEntry {
            state,
            next,
            handlers_stop,
            allowed,
        }
    }

    /// The next occurrence the scheduler will claim.
    pub(super) fn next(&self) -> Option<DateTime<Utc>> {
        self.next
    }
}

/// The configured jobs by name, and the scheduler's queue: every job's
/// next occurrence, earliest first. Reads go through `Deref` to the map.
#[derive(Default)]
pub(super) struct JobTable {
    by_name: BTreeMap<JobName, JobEntry>,
    queue: BTreeSet<(DateTime<Utc>, JobName)>,
}

impl std::ops::Deref for JobTable {
    type Target = BTreeMap<JobName, JobEntry>;

    fn deref(&self) -> &Self::Target {
        &self.by_name
    }
}

impl JobTable {
    /// Adds `name` (or replaces it, its queued instant with it).
    pub(super) fn insert(&mut self, name: JobName, entry: JobEntry) {
        self.remove(&name);
        if let Some(at) = entry.next {
            self.queue.insert((at, name.clone()));
        }
        self.by_name.insert(name, entry);
    }

    pub(super) fn remove(&mut self, name: &JobName) -> Option<JobEntry> {
        let entry = self.by_name.remove(name)?;
        if let Some(at) = entry.next {
            self.queue.remove(&(at, name.clone()));
        }
        Some(entry)
    }

    /// The entry of `name`, to change anything but its next occurrence.
    pub(super) fn get_mut(&mut self, name: &JobName) -> Option<&mut JobEntry> {
        self.by_name.get_mut(name)
    }

    /// Sets the next occurrence `name`'s scheduler claims.
    pub(super) fn set_next(&mut self, name: &JobName, next: Option<DateTime<Utc>>) {
        let Some(entry) = self.by_name.get_mut(name) else {
            return;
        };
        if entry.next == next {
            return;
        }
        if let Some(at) = entry.next {
            self.queue.remove(&(at, name.clone()));
        }
        if let Some(at) = next {
            self.queue.insert((at, name.clone()));
        }
        entry.next = next;
    }

    /// The earliest next occurrence of any job.
    pub(super) fn next_instant(&self) -> Option<DateTime<Utc>> {
        self.queue.first().map(|(at, _)| *at)
    }

    /// Takes the jobs whose next occurrence is at or before `now` off the
    /// queue, with that occurrence, in name order. Each must go back with
    /// [`JobTable::requeue`] before the lock is let go.
    pub(super) fn take_due(&mut self, now: DateTime<Utc>) -> Vec<(JobName, DateTime<Utc>)> {
        let mut due = Vec::new();
        while self.queue.first().is_some_and(|(at, _)| *at <= now) {
            if let Some((at, name)) = self.queue.pop_first() {
                due.push((name, at));
            }
        }
        due.sort();
        due
    }

    /// Puts `name`, taken off by [`JobTable::take_due`], back with
    /// its next occurrence (only such a name: it is not in the queue).
    pub(super) fn requeue(&mut self, name: JobName, next: Option<DateTime<Utc>>) {
        let Some(entry) = self.by_name.get_mut(&name) else {
            return;
        };
        entry.next = next;
        if let Some(at) = next {
            self.queue.insert((at, name));
        }
    }

    /// Whether the queue holds exactly each job's next occurrence (tests).
    #[cfg(test)]
    pub(super) fn in_step(&self) -> bool {
        let queued: Vec<&(DateTime<Utc>, JobName)> = self.queue.iter().collect();
        let mut expected: Vec<(DateTime<Utc>, JobName)> = self
            .by_name
            .iter()
            .filter_map(|(n, e)| Some((e.next?, n.clone())))
            .collect();
        expected.sort();
        queued.len() == expected.len() && queued.iter().zip(&expected).all(|(a, b)| *a == b)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Every operation of the table keeps the queue at each job's next
    /// occurrence; due names come off in name order until put back.
    #[test]
    fn every_operation_keeps_the_queue_at_each_next() {
        let at = |s: i64| chrono::TimeZone::timestamp_opt(&Utc, 1_800_000_000 + s, 0).unwrap();
        let name = |n: &str| JobName::parse(n).unwrap();
        let entry = |n: &str, next: Option<DateTime<Utc>>| {
            JobEntry::new(
                Arc::new(JobState::new(crate::config::test_job(
                    n,
                    "* * * * * *",
                    "/bin/true",
                ))),
                next,
                CancellationToken::new(),
                true,
            )
        };
        let mut t = JobTable::default();
        t.insert(name("c"), entry("c", Some(at(3))));
        t.insert(name("b"), entry("b", Some(at(1))));
        t.insert(name("a"), entry("a", Some(at(1))));
        t.insert(name("idle"), entry("idle", None));
        assert!(t.in_step());
        assert_eq!(t.next_instant(), Some(at(1)));
        // Replaced: the old instant leaves the queue.
        t.insert(name("c"), entry("c", Some(at(5))));
        assert!(t.in_step());
        t.set_next(&name("idle"), Some(at(2)));
        t.set_next(&name("b"), None);
        assert!(t.in_step());
        let due = t.take_due(at(2));
        assert_eq!(due, vec![(name("a"), at(1)), (name("idle"), at(2))]);
        assert_eq!(t.next_instant(), Some(at(5)));
        t.requeue(name("a"), Some(at(4)));
        t.requeue(name("idle"), None);
        assert!(t.in_step());
        assert_eq!(t.next_instant(), Some(at(4)));
        assert!(t.take_due(at(3)).is_empty());
        assert!(t.remove(&name("a")).is_some());
        assert!(t.in_step());
        assert_eq!(t.next_instant(), Some(at(5)));
        assert!(t.remove(&name("a")).is_none());
    }
}
