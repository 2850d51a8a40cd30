//! What a store answers a claim or a heartbeat, as the node decodes it.
//!
//! Input: one byte for the reply, then its bytes:
//! - `c` N RESP: `claim.lua`'s reply to N claims (N: the byte, mod 16);
//! - `g` RESP: `registry.lua`'s reply (the live nodes), then shown as
//!   `cronlease nodes` shows them;
//! - `d` BYTES: a lock row as any store keeps it (every field as read,
//!   even nonsense) and a claim a validated config can make, given to the
//!   claim rule (`store::decide`) the SQL, ZooKeeper, etcd and Redlock
//!   stores share. The bytes fill the fields in order: two flag bytes,
//!   then 8-byte little-endian integers (missing bytes read as 0).
//!   `fuzz/seed` says which bit of the flags sets what.
//!
//! Property: no panic; a reply of the wrong shape is an error; a won claim
//! gets a fence above every fence seen (the row's and the claimer's floor),
//! a paused row is won only by a retry finding its earlier win, and a
//! redelivery only when asked for, of the lock's last occurrence.

#![no_main]

use std::time::Duration;

use chrono::SecondsFormat;
use cronlease::config::{JobName, Misfire};
use cronlease::fuzzing;
use cronlease::store::{ClaimRequest, Decision, LockRow, Owner, TriggerId, decide, from_ms, to_ms};
use libfuzzer_sys::fuzz_target;

/// Reads the fields of a `d` input in order.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn byte(&mut self) -> u8 {
        let (first, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        first
    }
    fn int(&mut self) -> i64 {
        let mut bytes = [0u8; 8];
        for b in &mut bytes {
            *b = self.byte();
        }
        i64::from_le_bytes(bytes)
    }
    /// A duration of at most `max_ms`, as config validation bounds it.
    fn ms(&mut self, max_ms: u64) -> Duration {
        Duration::from_millis(self.int().unsigned_abs() % (max_ms + 1))
    }
    /// An instant the node can name (a schedule's occurrence).
    fn instant(&mut self) -> chrono::DateTime<chrono::Utc> {
        from_ms(self.int())
    }
}

fn claim_rule(bytes: &[u8]) {
    let mut f = Fields(bytes);
    let (flags, more) = (f.byte(), f.byte());
    let ours = Owner::from_raw("n1#00000001");
    let Ok(job) = JobName::parse("job") else {
        return;
    };
    let row = LockRow {
        owner: match (flags & 1 != 0, flags & 2 != 0) {
            (false, _) => None,
            (true, true) => Some(ours.as_str().to_string()),
            (true, false) => Some("n2#00000002".to_string()),
        },
        fence: f.int(),
        expires_at: f.int(),
        last_occurrence: (flags & 4 != 0).then(|| f.int()),
        running: flags & 8 != 0,
        paused: more & 2 != 0,
        trigger: (more & 8 != 0).then(|| f.int()),
        last_trigger: (more & 16 != 0).then(|| f.int()),
        now: f.int(),
    };
    let req = ClaimRequest {
        job,
        occurrence: f.instant(),
        previous: (flags & 16 != 0).then(|| f.instant()),
        before_previous: (more & 64 != 0).then(|| f.instant()),
        misfire: if flags & 32 != 0 {
            Misfire::Skip
        } else {
            Misfire::RunOnce
        },
        owner: ours,
        // A lease is a job's period plus the margin: a year and more at most.
        lease: f.ms(400 * 24 * 3600 * 1000),
        fence_floor: f.int() as u64,
        max_offset: f.ms(60_000),
        head_start: (flags & 64 != 0).then(|| f.ms(366 * 24 * 3600 * 1000)),
        after_unanswered: flags & 128 != 0,
        recheck_only: more & 1 != 0,
        window_end: None,
        manual: (more & 4 != 0)
            .then(|| TriggerId::from_stored(f.int()))
            .flatten(),
        redeliver: more & 32 != 0,
    };
    let floor = i64::try_from(req.fence_floor).unwrap_or(i64::MAX);
    match decide(&row, &req) {
        Decision::Claim {
            fence,
            won,
            last_occurrence,
            manual,
            ..
        } => {
            assert!(
                fence > floor && fence >= row.fence,
                "fence {fence} after row fence {} and floor {floor}",
                row.fence
            );
            assert_eq!(won.fence, fence as u64);
            // A paused job is claimed by nobody: only a win from before the
            // pause, whose answer was lost, is answered again.
            assert!(
                !row.paused || req.after_unanswered || req.manual.is_some(),
                "a paused job's claim won without being a retry"
            );
            // A manual run takes only its own pending request and never
            // moves the schedule.
            if let Some(id) = req.manual {
                assert_eq!(manual, Some(id));
                assert_eq!(last_occurrence, row.last_occurrence);
                assert!(
                    row.trigger == Some(id.get()) || row.last_trigger == Some(id.get()),
                    "a manual claim won a request that was not pending"
                );
            }
            // A redelivery (at_least_once): only asked for, only of the
            // previous occurrence, which was the lock's last and stays so.
            if won.redelivered {
                assert!(
                    req.redeliver && won.catch_up,
                    "a redelivery nobody asked for"
                );
                assert_eq!(req.previous.map(to_ms), Some(to_ms(won.occurrence)));
                assert_eq!(last_occurrence, row.last_occurrence);
            }
            // Occurrences nobody claimed: after the lock's last one, and the
            // fence below the win's is kept for them.
            // (Compared as stored: a row's nonsense millisecond reads back
            // as some other instant.)
            if let Some(after) = won.unclaimed_after {
                assert_eq!(Some(after), row.last_occurrence.map(from_ms));
                assert!(row.last_occurrence < Some(to_ms(won.occurrence)), "{won:?}");
                assert!(
                    fence - 1 > floor && fence - 1 > row.fence,
                    "no fence kept: {won:?}"
                );
            }
        }
        Decision::Refuse(_) => {}
        Decision::FenceExhausted => assert_eq!(row.fence.max(floor), i64::MAX),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    match kind {
        b'c' => {
            let Some((&n, resp)) = rest.split_first() else {
                return;
            };
            let requests = usize::from(n % 16);
            if let Some(Ok(claimed)) = fuzzing::redis_claim_reply(resp, requests) {
                assert_eq!(claimed.outcomes.len(), requests, "an answer per claim");
            }
        }
        b'g' => {
            if let Some(Ok(nodes)) = fuzzing::redis_registry_reply(rest) {
                let _ = serde_json::to_string_pretty(&nodes);
                for n in &nodes {
                    let _ = n.started_at.to_rfc3339_opts(SecondsFormat::Secs, true);
                    let _ = n.last_seen.to_rfc3339_opts(SecondsFormat::Secs, true);
                }
            }
        }
        b'd' => claim_rule(rest),
        _ => {}
    }
});
