//! cronlease: timers on tokio's clock, in place of async-io's `Timer`
//! (whose timers fire on async-io's reactor thread, a wake of that thread
//! and then of a tokio worker each). Only what this crate uses.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// A timer that fires once, at an instant or never, yielding the instant
/// it fired at.
pub struct Timer(Option<Pin<Box<tokio::time::Sleep>>>);

impl Timer {
    /// Fires `duration` from now.
    pub fn after(duration: Duration) -> Self {
        Self(Some(Box::pin(tokio::time::sleep(duration))))
    }

    /// Fires at `deadline`.
    pub fn at(deadline: Instant) -> Self {
        Self(Some(Box::pin(tokio::time::sleep_until(deadline.into()))))
    }

    /// Never fires.
    pub fn never() -> Self {
        Self(None)
    }

    /// Fires at `deadline` instead (also when it already fired).
    pub fn reset(&mut self, deadline: Instant) {
        match self.0.as_mut() {
            Some(sleep) if sleep.deadline() == deadline.into() && !sleep.is_elapsed() => {}
            Some(sleep) => sleep.as_mut().reset(deadline.into()),
            None => *self = Self::at(deadline),
        }
    }
}

impl Future for Timer {
    type Output = Instant;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Instant> {
        match self.get_mut().0.as_mut() {
            None => Poll::Pending,
            Some(sleep) => sleep.as_mut().poll(cx).map(|()| Instant::now()),
        }
    }
}
