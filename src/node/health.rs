//! The store's health as this node sees it, logged once when a problem
//! starts (WARN) and once when it ends (INFO, with how long it lasted), not
//! once per failed call, so an outage is two log lines, not thousands.
//!
//! A problem is the set of operations (claim, renew, record, ...) whose last
//! call failed. It ends when that set is empty again. A success clears an
//! operation that failed for want of an answer (the store is reachable
//! again), but an operation the store *refused* (a missing table, a
//! read-only database) stays failing until it succeeds itself: a cheap
//! `SELECT 1` answering does not make a read-only database healthy, and the
//! state does not flap between the two.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::store::StoreError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Unknown,
    Up,
    Down,
}

#[derive(Debug)]
struct Inner {
    state: State,
    /// Operations whose last call failed: whether it was for want of an
    /// answer (unreachable, timeout).
    failing: BTreeMap<String, bool>,
    /// When the current problem started.
    since: Option<Instant>,
    last_ok: Option<Instant>,
}

/// Tracks whether the store answers.
pub struct StoreHealth {
    store: String,
    inner: Mutex<Inner>,
}

impl StoreHealth {
    pub fn new(store: &str) -> Self {
        StoreHealth {
            store: store.to_string(),
            inner: Mutex::new(Inner {
                state: State::Unknown,
                failing: BTreeMap::new(),
                since: None,
                last_ok: None,
            }),
        }
    }

    /// A call of `op` answered.
    pub fn ok(&self, op: &str) {
        let Ok(mut s) = self.inner.lock() else { return };
        s.last_ok = Some(Instant::now());
        s.failing.remove(op);
        if matches!(op, "claim" | "record") {
            // The store takes writes again: whatever it refused before (a
            // renewal during a full disk, a release) is over too, even if
            // that operation does not come round again soon.
            s.failing.clear();
        }
        // The store answers: failures for want of an answer are over.
        s.failing.retain(|_, unreachable| !*unreachable);
        if !s.failing.is_empty() {
            return;
        }
        match s.state {
            State::Down => {
                let lasted = s.since.map(|t| t.elapsed()).unwrap_or_default();
                tracing::info!(
                    store = %self.store,
                    lasted_ms = lasted.as_millis() as u64,
                    "store reachable again after {}; claiming resumes",
                    humantime::format_duration(std::time::Duration::from_millis(lasted.as_millis() as u64))
                );
            }
            State::Unknown => tracing::info!(store = %self.store, "store reachable"),
            State::Up => {}
        }
        s.state = State::Up;
        s.since = None;
    }

    /// A call of `op` failed or timed out.
    pub fn failed(&self, op: &str, error: &StoreError) {
        let Ok(mut s) = self.inner.lock() else { return };
        s.failing.insert(op.to_string(), error.is_unreachable());
        if s.state != State::Down {
            tracing::warn!(store = %self.store, op, "store unavailable, claiming nothing until it answers again: {error}");
            s.state = State::Down;
            s.since = Some(Instant::now());
        } else {
            tracing::debug!(store = %self.store, op, "store still unavailable: {error}");
        }
    }

    /// When the store last answered.
    pub fn last_ok(&self) -> Option<Instant> {
        self.inner.lock().ok().and_then(|s| s.last_ok)
    }

    /// Whether no operation is failing now.
    pub fn is_up(&self) -> bool {
        self.inner.lock().is_ok_and(|s| s.state == State::Up)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> StoreError {
        StoreError::Backend {
            store: "s".into(),
            reason: "attempt to write a readonly database".into(),
        }
    }

    #[test]
    fn a_refused_operation_is_not_healed_by_another_answering() {
        let h = StoreHealth::new("s");
        h.ok("claim");
        assert!(h.is_up());
        h.failed("claim", &refused());
        assert!(!h.is_up());
        h.ok("ping");
        assert!(
            !h.is_up(),
            "SELECT 1 answering does not heal a refused claim"
        );
        h.ok("claim");
        assert!(h.is_up());
        // A refused renewal ends with the next write that succeeds.
        h.failed("renew", &refused());
        h.ok("ping");
        assert!(!h.is_up());
        h.ok("record");
        assert!(h.is_up());
    }

    #[test]
    fn any_answer_ends_an_outage() {
        let h = StoreHealth::new("s");
        h.failed(
            "claim",
            &StoreError::Timeout(std::time::Duration::from_secs(1)),
        );
        h.failed(
            "ping",
            &StoreError::Timeout(std::time::Duration::from_secs(1)),
        );
        assert!(!h.is_up());
        h.ok("ping");
        assert!(h.is_up());
    }
}
