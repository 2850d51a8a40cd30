//! systemd integration through sd_notify (the sd-notify crate): READY=1
//! once the configuration is loaded and the store answered, WATCHDOG=1 from
//! the supervision tick while the scheduler is alive, STATUS= lines,
//! STOPPING=1 at shutdown. Without `$NOTIFY_SOCKET` every call is a no-op.

use std::time::Duration;

use sd_notify::NotifyState;

/// The daemon's line to systemd.
pub struct Notifier {
    enabled: bool,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// Reads `$NOTIFY_SOCKET` and `$WATCHDOG_USEC` (they stay set: jobs never
    /// see them, the runner withholds them).
    pub fn from_env() -> Self {
        Notifier {
            enabled: std::env::var_os("NOTIFY_SOCKET").is_some(),
            watchdog: sd_notify::watchdog_enabled(),
        }
    }

    /// A notifier that sends nothing (a node run in-process, in tests).
    pub fn disabled() -> Self {
        Notifier {
            enabled: false,
            watchdog: None,
        }
    }

    /// The watchdog interval systemd expects pings within, if any.
    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog.filter(|_| self.enabled)
    }

    fn send(&self, state: &[NotifyState<'_>]) {
        if self.enabled {
            if let Err(e) = sd_notify::notify(state) {
                tracing::debug!("sd_notify failed: {e}");
            }
        }
    }

    pub fn ready(&self, status: &str) {
        self.send(&[NotifyState::Ready, NotifyState::Status(status)]);
    }

    pub fn ping(&self) {
        self.send(&[NotifyState::Watchdog]);
    }

    pub fn status(&self, status: &str) {
        self.send(&[NotifyState::Status(status)]);
    }

    pub fn stopping(&self) {
        self.send(&[
            NotifyState::Stopping,
            NotifyState::Status("stopping: finishing runs, releasing leases"),
        ]);
    }
}
