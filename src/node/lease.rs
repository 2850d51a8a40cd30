//! The watchdog's lease arithmetic (docs/protocol.md, "The watchdog") as
//! pure functions of durations, counted from the send time of the last
//! successful claim or renewal: the node's lease clock uses them, and so
//! does the protocol model (tests/it/model.rs), so design and code are
//! checked together.

use std::time::Duration;

/// The clock-rate allowance of a lease: a node's monotonic clock may run
/// this much slower than the store's over the lease (0.1 %).
pub fn rate_allowance(lease: Duration) -> Duration {
    lease / 1000
}

/// The local deadline: a run on the lease is stopped (SIGTERM) this long
/// after the send, lease − margin/2 − the rate allowance.
pub fn stop_after(lease: Duration, margin: Duration) -> Duration {
    lease.saturating_sub(margin / 2 + rate_allowance(lease))
}

/// When the watchdog renews: once a third of the time up to the local
/// deadline is left. Counting from the deadline rather than the raw lease
/// matters for short leases: a 2 s lease with a 1 s margin renewed at 2/3
/// of the lease would leave the renewal only 165 ms before the deadline.
pub fn renew_after(lease: Duration, margin: Duration) -> Duration {
    stop_after(lease, margin) * 2 / 3
}

/// The earliest moment the store may see the lease expired, lease − the
/// rate allowance: a run must be gone (SIGKILL) by then.
pub fn kill_after(lease: Duration) -> Duration {
    lease.saturating_sub(rate_allowance(lease))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_eleven_second_lease_with_a_one_second_margin() {
        let (lease, margin) = (Duration::from_secs(11), Duration::from_secs(1));
        assert_eq!(stop_after(lease, margin), Duration::from_millis(10_489));
        assert_eq!(kill_after(lease), Duration::from_millis(10_989));
        assert_eq!(
            renew_after(lease, margin),
            Duration::from_millis(10_489) * 2 / 3
        );
        assert_eq!(
            stop_after(Duration::from_millis(100), margin),
            Duration::ZERO
        );
    }
}
