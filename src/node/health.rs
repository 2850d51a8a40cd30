//! The store's health as this node sees it, logged once per change of state
//! (not once per failed call), so an outage is two log lines, not thousands.

use std::sync::Mutex;
use std::time::Instant;

use crate::store::StoreError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Unknown,
    Up,
    Down,
}

/// Tracks whether the store answers.
pub struct StoreHealth {
    store: String,
    state: Mutex<(State, Option<Instant>)>,
}

impl StoreHealth {
    pub fn new(store: &str) -> Self {
        StoreHealth {
            store: store.to_string(),
            state: Mutex::new((State::Unknown, None)),
        }
    }

    /// A store call answered.
    pub fn ok(&self) {
        let Ok(mut s) = self.state.lock() else { return };
        match s.0 {
            State::Down => {
                tracing::info!(store = %self.store, "store reachable again; claiming resumes")
            }
            State::Unknown => tracing::info!(store = %self.store, "store reachable"),
            State::Up => {}
        }
        *s = (State::Up, Some(Instant::now()));
    }

    /// A store call failed or timed out.
    pub fn failed(&self, error: &StoreError) {
        let Ok(mut s) = self.state.lock() else { return };
        if s.0 != State::Down {
            tracing::warn!(store = %self.store, "store unavailable, claiming nothing until it answers again: {error}");
            s.0 = State::Down;
        } else {
            tracing::debug!(store = %self.store, "store still unavailable: {error}");
        }
    }

    /// When the store last answered.
    pub fn last_ok(&self) -> Option<Instant> {
        self.state.lock().ok().and_then(|s| s.1)
    }

    /// Whether the last call answered.
    pub fn is_up(&self) -> bool {
        self.state.lock().is_ok_and(|s| s.0 == State::Up)
    }
}
