//! Unit tests of the node's pure arithmetic: the watchdog's stuck check and
//! the local lease deadline and renewal point.
#![allow(clippy::unwrap_used)]

use super::service::scheduler_stuck;
use super::*;

#[test]
fn a_silent_scheduler_withholds_the_watchdog_ping() {
    // The scheduler wakes at least every MAX_SLEEP (15 s): fresh beats are fine.
    assert!(!scheduler_stuck(100_000, 130_000));
    assert!(!scheduler_stuck(100_000, 135_000));
    // Silent for more than 35 s: stuck.
    assert!(scheduler_stuck(100_000, 135_001));
    assert!(scheduler_stuck(0, 200_000));
}

#[test]
fn local_lease_deadline_is_the_contracts() {
    let sent = Instant::now();
    let clock = LeaseClock {
        sent,
        lease: Duration::from_secs(2),
    };
    // sent + lease - margin/2 - 0.1% of the lease
    assert_eq!(
        clock.deadline(Duration::from_secs(1)),
        sent + Duration::from_millis(1498)
    );
    assert_eq!(clock.expiry(), sent + Duration::from_millis(1998));
}

#[test]
fn renewal_leaves_a_third_of_the_provable_time() {
    let sent = Instant::now();
    let margin = Duration::from_secs(1);
    for lease_ms in [1_500, 2_000, 5_000, 61_000, 3_601_000] {
        let clock = LeaseClock {
            sent,
            lease: Duration::from_millis(lease_ms),
        };
        let deadline = clock.deadline(margin);
        let window = deadline - sent;
        let left = deadline - clock.renew_at(margin);
        assert!(
            left >= window / 3,
            "lease {lease_ms} ms: {left:?} of {window:?} left"
        );
        assert!(clock.renew_at(margin) > sent);
    }
}
