//! How many leases this node's jobs hold, kept as the leases change: each
//! beat says it (`jobs_held`, `cronlease nodes`), and a walk over every
//! job's state per beat was O(jobs) at each beat (issue 35, item 6).
//!
//! It counts the lease clock of every job state that has one, also a
//! removed job's until its step-down ends it (at once when idle, at the
//! end of its run otherwise): the leases this node holds in the store. The
//! walk it replaced counted only the jobs configured now. Shard locks
//! ([`super::broadcast`]) are not counted, as before.

use std::collections::BTreeMap;

use tokio::time::Instant;

/// The end (the earliest moment the store may see it expired) of every
/// lease a job of this node holds, as a multiset; a lease counts as held
/// until its end, as `LeaseClock::expiry` says.
#[derive(Debug, Default)]
pub(super) struct LeaseBook {
    ends: BTreeMap<Instant, usize>,
    total: usize,
    /// Every end up to here was dropped by a count at this instant: one
    /// that comes or goes at or before it is no longer in `ends`.
    counted_at: Option<Instant>,
}

impl LeaseBook {
    /// One job's lease went from ending at `old` to ending at `new` (none:
    /// not held).
    pub(super) fn change(&mut self, old: Option<Instant>, new: Option<Instant>) {
        if old == new {
            return;
        }
        if let Some(old) = old.filter(|at| self.kept(*at))
            && let Some(n) = self.ends.get_mut(&old)
        {
            *n -= 1;
            self.total -= 1;
            if *n == 0 {
                self.ends.remove(&old);
            }
        }
        if let Some(new) = new.filter(|at| self.kept(*at)) {
            *self.ends.entry(new).or_default() += 1;
            self.total += 1;
        }
    }

    /// How many leases are held at `now` (not earlier than the last count).
    pub(super) fn held_at(&mut self, now: Instant) -> usize {
        while let Some((&end, &n)) = self.ends.first_key_value()
            && end <= now
        {
            self.ends.remove(&end);
            self.total -= n;
        }
        self.counted_at = self.counted_at.max(Some(now));
        self.total
    }

    fn kept(&self, end: Instant) -> bool {
        self.counted_at.is_none_or(|at| end > at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Four jobs' lease ends, changed in the book and kept beside it.
    fn set(
        book: &mut LeaseBook,
        ends: &mut [Option<Instant>; 4],
        job: usize,
        end: Option<Instant>,
    ) {
        book.change(ends[job], end);
        ends[job] = end;
    }

    /// The book's count at `now` is the walk's it replaces: the leases
    /// whose end is later.
    fn check(book: &mut LeaseBook, ends: &[Option<Instant>; 4], now: Instant) {
        let walk = ends.iter().filter(|e| e.is_some_and(|e| e > now)).count();
        assert_eq!(book.held_at(now), walk, "{ends:?} at {now:?}");
    }

    #[test]
    fn counts_what_a_walk_over_every_lease_would() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let (mut book, mut ends) = (LeaseBook::default(), [None; 4]);
        set(&mut book, &mut ends, 0, Some(at(100)));
        set(&mut book, &mut ends, 1, Some(at(100)));
        set(&mut book, &mut ends, 2, Some(at(50)));
        check(&mut book, &ends, at(0));
        // Job 2's lease ended; counted after that, then renewed.
        check(&mut book, &ends, at(60));
        set(&mut book, &mut ends, 2, Some(at(160)));
        check(&mut book, &ends, at(60));
        // Job 0 renewed, job 1 released.
        set(&mut book, &mut ends, 0, Some(at(200)));
        set(&mut book, &mut ends, 1, None);
        check(&mut book, &ends, at(60));
        // An end already past when it comes is never counted, and taking
        // it away later takes nothing.
        set(&mut book, &mut ends, 3, Some(at(10)));
        check(&mut book, &ends, at(60));
        set(&mut book, &mut ends, 3, None);
        check(&mut book, &ends, at(60));
        // Job 2's end passes and its lease ends after it: nothing is taken
        // twice.
        check(&mut book, &ends, at(170));
        set(&mut book, &mut ends, 2, None);
        check(&mut book, &ends, at(170));
        check(&mut book, &ends, at(200));
        set(&mut book, &mut ends, 0, Some(at(300)));
        check(&mut book, &ends, at(200));
        assert_eq!(book.held_at(at(300)), 0);
    }
}
