//! One read → decide → compare-and-set loop, for the stores that decide in
//! the client and write the result back on condition that nothing changed
//! since the read: etcd (a transaction comparing revisions) and ZooKeeper (a
//! multi comparing versions). Each store keeps only its transport, the
//! [`Cas`] trait: how it writes a batch of conditional writes and how it
//! reads jobs again. The loop is here, once: decide every job on what was
//! read, write, and decide again, on a fresh read, only the jobs whose writes
//! did not go through, until none is left or the operation's time is up.
//!
//! A write that went through is never decided again: its job now holds what
//! this loop wrote (a claim won by this very call), and deciding it again
//! would answer our own win as someone else's.

use std::time::Duration;

use tokio::time::Instant;

use super::rule::Decision;
use super::{ClaimOutcome, ClaimRequest, RunRecord, StoreError, TriggerId, fence_exhausted};

/// A store's half of the loop.
pub(crate) trait Cas {
    /// One job as read.
    type View;
    /// One job's write, conditional on its job being as read.
    type Write;

    /// Applies `writes` (the job's index in the batch, its write). Answers
    /// the indexes of the writes that were not applied: their job changed
    /// since it was read, or they went in the same all-or-nothing unit as
    /// one whose job did. Every other write was applied.
    async fn write(&self, writes: Vec<(usize, Self::Write)>) -> Result<Vec<usize>, StoreError>;

    /// These jobs read again, in that order.
    async fn reread(&self, jobs: &[&str]) -> Result<Vec<Self::View>, StoreError>;

    /// The store, as errors name it (its URL without secrets).
    fn store(&self) -> String;
}

/// Decides each job of `views` (read for `jobs`, in that order) with
/// `decide_one(index, view)`, which
/// answers the write it wants, if any, and the job's answer; writes; and
/// decides again, on a fresh read, each job whose write was not applied,
/// until every wanted write went through. Past `deadline` with writes still
/// pending, the operation timed out (`op_timeout`).
pub(crate) async fn decide_and_write<C: Cas, A>(
    cas: &C,
    jobs: &[&str],
    views: &[C::View],
    deadline: Instant,
    op_timeout: Duration,
    mut decide_one: impl FnMut(usize, &C::View) -> (Option<C::Write>, A),
) -> Result<Vec<A>, StoreError> {
    let mut answers = Vec::with_capacity(views.len());
    let mut writes = Vec::new();
    for (i, view) in views.iter().enumerate() {
        let (write, answer) = decide_one(i, view);
        answers.push(answer);
        if let Some(w) = write {
            writes.push((i, w));
        }
    }
    loop {
        if writes.is_empty() {
            return Ok(answers);
        }
        let pending = cas.write(writes).await?;
        if pending.is_empty() {
            return Ok(answers);
        }
        if Instant::now() >= deadline {
            return Err(StoreError::Timeout(op_timeout));
        }
        let names: Vec<&str> = pending
            .iter()
            .filter_map(|&i| jobs.get(i).copied())
            .collect();
        let fresh = cas.reread(&names).await?;
        if fresh.len() != pending.len() {
            return Err(StoreError::Backend {
                store: cas.store(),
                reason: format!(
                    "{} jobs read again answered {} records",
                    pending.len(),
                    fresh.len()
                ),
            });
        }
        writes = Vec::new();
        for (i, view) in pending.into_iter().zip(&fresh) {
            let (write, answer) = decide_one(i, view);
            if let Some(slot) = answers.get_mut(i) {
                *slot = answer;
            }
            if let Some(w) = write {
                writes.push((i, w));
            }
        }
    }
}

/// What a won claim writes, as [`Decision::Claim`] gives it.
pub(crate) struct Grant {
    pub fence: i64,
    pub expires_at: i64,
    pub last_occurrence: Option<i64>,
    /// The manual request taken, if the claim was one.
    pub manual: Option<TriggerId>,
}

/// `decide`'s verdict on `req` as one job's step of [`decide_and_write`]:
/// a claim wants the store's write, which `write` builds from the
/// [`Grant`] (its error fails the claim, nothing written); a recheck
/// answers an earlier win as it stands and writes nothing; a refusal or an
/// exhausted fence writes nothing either.
pub(crate) fn verdict<W>(
    decision: Decision,
    req: &ClaimRequest,
    write: impl FnOnce(Grant) -> Result<W, String>,
) -> (Option<W>, ClaimOutcome) {
    match decision {
        Decision::Claim { won, .. } if req.recheck_only => (None, ClaimOutcome::Won(won)),
        Decision::Claim {
            fence,
            expires_at,
            last_occurrence,
            manual,
            won,
        } => match write(Grant {
            fence,
            expires_at,
            last_occurrence,
            manual,
        }) {
            Ok(w) => (Some(w), ClaimOutcome::Won(won)),
            Err(why) => (None, ClaimOutcome::Failed(why)),
        },
        Decision::Refuse(lost) => (None, ClaimOutcome::Lost(lost)),
        Decision::FenceExhausted => (
            None,
            ClaimOutcome::Failed(fence_exhausted(req.job.as_str())),
        ),
    }
}

/// The jobs whose running mark `runs` (recorded already) may end, each
/// once with the newest of its runs that ends a run: the mark is its last
/// claim's, and only the run of that claim (its fence) clears it. The two
/// lists go together, job by job, into [`decide_and_write`], whose re-read
/// after a failed write finds a lock claimed again meanwhile with a new
/// mark of its own, which stays.
pub(crate) fn ended_runs(runs: &[RunRecord]) -> (Vec<&str>, Vec<&RunRecord>) {
    let mut newest: std::collections::BTreeMap<&str, &RunRecord> =
        std::collections::BTreeMap::new();
    for run in runs.iter().filter(|r| super::ends_a_run(r)) {
        let slot = newest.entry(run.job.as_str()).or_insert(run);
        if run.fence > slot.fence {
            *slot = run;
        }
    }
    newest.into_iter().unzip()
}

#[cfg(test)]
mod tests {
    //! The loop on a store in a `Vec`: each job is a counter, a write is
    //! "set it to n if it is still m", applied in units of `unit` writes,
    //! all or nothing, with other writers bumping counters in between.
    #![allow(clippy::unwrap_used)]

    use std::sync::Mutex;

    use super::*;

    struct Counters {
        values: Mutex<Vec<u64>>,
        /// Writes per all-or-nothing unit (ZooKeeper's multi).
        unit: usize,
        /// Before the n-th write call, another writer bumps these jobs.
        interference: Mutex<Vec<Vec<usize>>>,
        writes: Mutex<usize>,
    }

    impl Counters {
        fn new(jobs: usize, unit: usize, interference: Vec<Vec<usize>>) -> Self {
            Counters {
                values: Mutex::new(vec![0; jobs]),
                unit,
                interference: Mutex::new(interference),
                writes: Mutex::new(0),
            }
        }
    }

    impl Cas for Counters {
        /// The value read.
        type View = u64;
        /// (expected, new).
        type Write = (u64, u64);

        async fn write(&self, writes: Vec<(usize, (u64, u64))>) -> Result<Vec<usize>, StoreError> {
            *self.writes.lock().unwrap() += 1;
            let mut values = self.values.lock().unwrap();
            let bump = {
                let mut all = self.interference.lock().unwrap();
                if all.is_empty() {
                    Vec::new()
                } else {
                    all.remove(0)
                }
            };
            for j in bump {
                values[j] += 1;
            }
            let mut pending = Vec::new();
            for unit in writes.chunks(self.unit) {
                if !pending.is_empty() {
                    pending.extend(unit.iter().map(|(i, _)| *i));
                    continue;
                }
                if unit
                    .iter()
                    .all(|(i, (expected, _))| values[*i] == *expected)
                {
                    for (i, (_, new)) in unit {
                        values[*i] = *new;
                    }
                } else {
                    pending.extend(unit.iter().map(|(i, _)| *i));
                }
            }
            Ok(pending)
        }

        async fn reread(&self, jobs: &[&str]) -> Result<Vec<u64>, StoreError> {
            let values = self.values.lock().unwrap();
            Ok(jobs
                .iter()
                .map(|j| values[j.parse::<usize>().unwrap()])
                .collect())
        }

        fn store(&self) -> String {
            "counters".into()
        }
    }

    /// Job i is named "i".
    fn names(n: usize) -> Vec<&'static str> {
        ["0", "1", "2", "3", "4", "5", "6", "7"][..n].to_vec()
    }

    /// "Claim" every counter as read in `views`: write 100 + its value
    /// unless it is already 100 or more (held). Answers what each job
    /// ended as.
    async fn claim_all(store: &Counters, views: Vec<u64>) -> Vec<Result<u64, u64>> {
        let deadline = Instant::now() + Duration::from_secs(5);
        decide_and_write(
            store,
            &names(views.len()),
            &views,
            deadline,
            Duration::from_secs(5),
            |_, &v| {
                if v >= 100 {
                    (None, Err(v))
                } else {
                    (Some((v, 100 + v)), Ok(100 + v))
                }
            },
        )
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn an_applied_write_is_not_decided_again_when_a_later_unit_fails() {
        // Units of 2: jobs 0-1 go through, job 2 was bumped before the
        // write, so the unit 2-3 and everything after it is pending.
        let store = Counters::new(6, 2, vec![vec![2]]);
        let views = store.values.lock().unwrap().clone();
        let answers = claim_all(&store, views).await;
        // Every job is won by this call, once: none answered as held (by
        // the write this call made itself).
        assert_eq!(
            answers,
            vec![Ok(100), Ok(100), Ok(101), Ok(100), Ok(100), Ok(100)]
        );
        assert_eq!(
            *store.values.lock().unwrap(),
            [100, 100, 101, 100, 100, 100]
        );
        assert_eq!(*store.writes.lock().unwrap(), 2);
    }

    #[tokio::test]
    async fn a_job_changed_to_held_between_read_and_write_is_answered_held() {
        // Another writer takes job 1 (to 150) between our read and write.
        let store = Counters::new(3, 10, Vec::new());
        let views = vec![0, 0, 0];
        store.values.lock().unwrap()[1] = 150;
        let answers = claim_all(&store, views).await;
        assert_eq!(answers, vec![Ok(100), Err(150), Ok(100)]);
        assert_eq!(*store.values.lock().unwrap(), [100, 150, 100]);
    }

    #[tokio::test]
    async fn writes_that_keep_failing_time_out() {
        // Every write call finds job 0 bumped again.
        let store = Counters::new(1, 1, vec![vec![0]; 1000]);
        let views = vec![0];
        let deadline = Instant::now();
        let got = decide_and_write(
            &store,
            &names(views.len()),
            &views,
            deadline,
            Duration::from_millis(1),
            |_, &v| (Some((v, v + 100)), ()),
        )
        .await;
        assert!(matches!(got, Err(StoreError::Timeout(_))), "{got:?}");
    }

    #[tokio::test]
    async fn nothing_to_write_writes_nothing() {
        let store = Counters::new(3, 1, Vec::new());
        let views = vec![0, 0, 0];
        let deadline = Instant::now() + Duration::from_secs(1);
        let answers = decide_and_write(
            &store,
            &names(views.len()),
            &views,
            deadline,
            Duration::from_secs(1),
            |i, _| (None::<(u64, u64)>, i),
        )
        .await
        .unwrap();
        assert_eq!(answers, [0, 1, 2]);
        assert_eq!(*store.writes.lock().unwrap(), 0);
    }
}
