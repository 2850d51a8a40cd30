//! Exponential backoff with jitter, for what is tried again: webhook
//! deliveries ([`crate::webhook`]) and a job's retries (`retry`,
//! [`crate::config::Retry`]).

use std::time::Duration;

/// The wait after `failures` failed tries (1 for the first): `first`
/// doubling each time, at most `max`, then spread by ±20 % so that many
/// nodes' tries do not come at one instant; never above `max`.
pub fn exponential(first: Duration, max: Duration, failures: u32) -> Duration {
    let base = first
        .saturating_mul(1u32 << failures.saturating_sub(1).min(20))
        .min(max);
    let mut r = [0u8; 2];
    let unit = if getrandom::fill(&mut r).is_ok() {
        f64::from(u16::from_le_bytes(r)) / f64::from(u16::MAX)
    } else {
        0.5
    };
    base.mul_f64(0.8 + 0.4 * unit).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_the_first_wait_to_the_cap_with_jitter() {
        let (first, max) = (Duration::from_secs(1), Duration::from_secs(300));
        for (failures, base) in [
            (1, 1.0),
            (2, 2.0),
            (3, 4.0),
            (9, 256.0),
            (10, 300.0),
            (60, 300.0),
        ] {
            for _ in 0..20 {
                let d = exponential(first, max, failures).as_secs_f64();
                assert!(
                    d >= base * 0.8 - 1e-9 && d <= (base * 1.2).min(300.0) + 1e-9,
                    "failure {failures}: {d}"
                );
            }
        }
    }
}
