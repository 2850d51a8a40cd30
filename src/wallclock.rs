//! What time it is: the wall clock a node schedules by ([`WallClock`]), the
//! system's for a daemon and one that follows tokio's paused clock for
//! in-process tests. A floor-1 room: the node, its runs ([`crate::exec`])
//! and the tests read it; it reads nothing of theirs.

use chrono::{DateTime, Utc};

/// The wall clock the node schedules by (occurrences are wall-clock
/// instants). Waits are on tokio's clock; this says what time it is.
pub trait WallClock: Send + Sync {
    fn now(&self) -> DateTime<Utc>;
}

/// The system's wall clock: what a running daemon uses.
pub struct SystemClock;

impl WallClock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A wall clock that follows tokio's clock from a starting instant, so a
/// test on paused time (`start_paused`, `tokio::time::advance`) moves it.
pub struct TokioClock {
    start: DateTime<Utc>,
    base: tokio::time::Instant,
}

impl TokioClock {
    /// Reads `start` now, then runs with tokio's clock.
    pub fn starting_at(start: DateTime<Utc>) -> Self {
        TokioClock {
            start,
            base: tokio::time::Instant::now(),
        }
    }
}

impl WallClock for TokioClock {
    fn now(&self) -> DateTime<Utc> {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.base);
        self.start + chrono::TimeDelta::from_std(elapsed).unwrap_or_default()
    }
}
