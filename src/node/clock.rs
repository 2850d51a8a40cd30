//! This node's clock against the store's (see `docs/protocol.md`, "Clock
//! offset").
//!
//! Every claim reply carries the store's clock. The offset is store − local,
//! the local instant taken halfway through the round trip. A node whose
//! offset exceeds `cluster.max_clock_offset` logs one error, fails `/healthz`
//! with the reason and claims nothing until a later reading is back within
//! the bound (it then logs once more). The store refuses early occurrences on
//! its own as well, so even a node that has not noticed cannot run a job early.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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

/// The latest offset reading and whether it is out of bounds.
pub struct ClockWatch {
    /// `cluster.max_clock_offset` in ms (a reload may change it).
    bound_ms: AtomicU64,
    state: Mutex<Reading>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Reading {
    /// store − local, in milliseconds; `None` before the first reading.
    offset_ms: Option<i64>,
    skewed: bool,
}

/// store − local, with the local instant taken halfway between `sent` and
/// `received`.
pub fn offset_ms(store_now: DateTime<Utc>, sent: DateTime<Utc>, received: DateTime<Utc>) -> i64 {
    let half_trip = (received - sent).num_milliseconds().max(0) / 2;
    let local = sent.timestamp_millis().saturating_add(half_trip);
    store_now.timestamp_millis().saturating_sub(local)
}

/// The bound rule: an offset (ms, either sign) beyond `bound`.
pub fn beyond_bound(offset_ms: i64, bound: Duration) -> bool {
    u128::from(offset_ms.unsigned_abs()) > bound.as_millis()
}

impl ClockWatch {
    pub fn new(bound: Duration) -> Self {
        ClockWatch {
            bound_ms: AtomicU64::new(bound.as_millis() as u64),
            state: Mutex::new(Reading::default()),
        }
    }

    /// Takes a reading; returns the offset in milliseconds.
    pub fn observe(
        &self,
        store_now: DateTime<Utc>,
        sent: DateTime<Utc>,
        received: DateTime<Utc>,
    ) -> i64 {
        let offset = offset_ms(store_now, sent, received);
        let skewed = beyond_bound(offset, self.bound());
        let bound = self.bound().as_millis();
        let Ok(mut r) = self.state.lock() else {
            return offset;
        };
        if skewed && !r.skewed {
            tracing::error!(
                offset_ms = offset,
                bound_ms = bound,
                "this node's clock is {} the store's by {} ms, more than cluster.max_clock_offset ({} ms): claiming nothing until it is back within bounds; fix time sync (chrony/ntpd) on this host",
                if offset > 0 { "behind" } else { "ahead of" },
                offset.unsigned_abs(),
                bound
            );
        } else if !skewed && r.skewed {
            tracing::info!(
                offset_ms = offset,
                "clock back within cluster.max_clock_offset: claiming resumes"
            );
        }
        *r = Reading {
            offset_ms: Some(offset),
            skewed,
        };
        offset
    }

    /// The last offset read (store − local, ms), if any.
    pub fn last_offset_ms(&self) -> Option<i64> {
        self.state.lock().ok()?.offset_ms
    }

    /// `cluster.max_clock_offset`.
    pub fn bound(&self) -> Duration {
        Duration::from_millis(self.bound_ms.load(Ordering::SeqCst))
    }

    /// A reload changed `cluster.max_clock_offset`.
    pub fn set_bound(&self, bound: Duration) {
        self.bound_ms
            .store(bound.as_millis() as u64, Ordering::SeqCst);
    }

    /// The last reading was out of bounds.
    pub fn skewed(&self) -> bool {
        self.state.lock().is_ok_and(|r| r.skewed)
    }

    /// Why `/healthz` fails, when the clock is the reason.
    pub fn problem(&self) -> Option<String> {
        let r = *self.state.lock().ok()?;
        let offset = r.offset_ms?;
        r.skewed.then(|| {
            format!(
                "clock offset {offset} ms (store - local) exceeds cluster.max_clock_offset {} ms: claiming nothing",
                self.bound().as_millis()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::store::from_ms;

    #[test]
    fn offset_is_taken_halfway_through_the_round_trip() {
        // sent at 1000, received at 1100: local midpoint 1050.
        assert_eq!(offset_ms(from_ms(1050), from_ms(1000), from_ms(1100)), 0);
        assert_eq!(offset_ms(from_ms(6050), from_ms(1000), from_ms(1100)), 5000);
        assert_eq!(offset_ms(from_ms(50), from_ms(1000), from_ms(1100)), -1000);
    }

    #[test]
    fn out_of_bounds_and_back() {
        let w = ClockWatch::new(Duration::from_millis(500));
        assert!(!w.skewed() && w.problem().is_none());
        w.observe(from_ms(10_400), from_ms(10_000), from_ms(10_000));
        assert!(!w.skewed());
        // A local clock 5 s ahead: the store is 5 s behind it.
        w.observe(from_ms(10_000), from_ms(15_000), from_ms(15_000));
        assert!(w.skewed());
        assert!(w.problem().unwrap().contains("-5000 ms"));
        assert_eq!(
            w.observe(from_ms(20_000), from_ms(20_100), from_ms(20_100)),
            -100
        );
        assert!(!w.skewed());
    }
}
