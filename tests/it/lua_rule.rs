//! The claim rule twice: `claim.lua` (what Redis and Sentinel run) against
//! `store::claim_row` (what every other store runs). Random lock rows are
//! written into real Redis keys and random requests claimed through the
//! Redis store; the same row and request go through the Rust rule at the
//! script's own clock. Verdict, fence, occurrence, the refusal's reasons and
//! the row left behind must agree, for every case.
//!
//! `CRONLEASE_LUA_CASES` (default 10,000) and `CRONLEASE_LUA_SEED` replay or
//! widen a run; a failure names its seed and case.

use std::collections::HashMap;
use std::time::Duration;

use cronlease::config::{JobName, Misfire};
use cronlease::store::{ClaimOutcome, ClaimRequest, LockRow, Owner, claim_row, from_ms, to_ms};

use crate::support::{Backend, Harness};

/// SplitMix64: small, seedable, good enough to pick cases.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[(self.next() % from.len() as u64) as usize]
    }

    fn chance(&mut self) -> bool {
        self.next().is_multiple_of(2)
    }
}

/// One case: a row as offsets from a base instant, and a request.
struct Case {
    owner: Option<&'static str>,
    /// Lease left at the base instant (ms); 0: expired (no lease key).
    lease_left: i64,
    fence: i64,
    last: Option<i64>,
    running: bool,
    paused: bool,
    /// The request the last manual claim took (`last_trigger`).
    last_trigger: Option<i64>,
    request: ClaimRequest,
}

const FENCES: &[i64] = &[
    0,
    1,
    7,
    999_999_999_999_999,
    1_000_000_000_000_003,
    i64::MAX - 1,
    i64::MAX,
];

fn case(rng: &mut Rng, base: i64, job: &str) -> Case {
    let second = |k: i64| base + k * 1000;
    let occurrence = second(rng.pick(&[-4, -3, -2, -1, 3]));
    let fence = rng.pick(FENCES);
    let floor = match rng.next() % 4 {
        0 => 0,
        1 => fence,
        2 => fence.saturating_add(1),
        _ => 5,
    };
    let request = ClaimRequest {
        job: JobName::parse(job).unwrap(),
        occurrence: from_ms(occurrence),
        previous: rng.chance().then(|| from_ms(occurrence - 1000)),
        before_previous: rng.chance().then(|| from_ms(occurrence - 2000)),
        misfire: if rng.chance() {
            Misfire::RunOnce
        } else {
            Misfire::Skip
        },
        owner: Owner::from_raw(rng.pick(&["me#1", "other#1"])),
        lease: Duration::from_millis(rng.pick(&[2_000, 5_000])),
        fence_floor: floor as u64,
        max_offset: Duration::from_millis(500),
        head_start: rng
            .pick(&[None, Some(2_000), Some(10_000)])
            .map(Duration::from_millis),
        after_unanswered: rng.next().is_multiple_of(4),
        recheck_only: rng.next().is_multiple_of(8),
        window_end: rng
            .pick(&[None, Some(-2), Some(5)])
            .map(|k| from_ms(second(k))),
        manual: None,
        redeliver: rng.chance(),
    };
    let owner = rng.pick(&[None, Some("me#1"), Some("other#1")]);
    let last = rng
        .pick(&[None, Some(-2), Some(-1), Some(0), Some(1)])
        .map(|k| occurrence + k * 1000);
    // A request id's time is its high bits: at, just before or just after
    // the last occurrence, with low bits at both ends (a double in Lua
    // rounds them away).
    let at = last.unwrap_or(occurrence);
    let last_trigger = rng.pick(&[
        None,
        Some((at << 20) | 0xa7e61),
        Some((at << 20) | 0xf_ffff),
        Some(at << 20),
        Some((at + 1) << 20),
        Some(((at - 1) << 20) | 0xf_ffff),
    ]);
    Case {
        owner,
        lease_left: if owner.is_some() {
            rng.pick(&[0, 3_000])
        } else {
            0
        },
        fence,
        last,
        running: rng.chance(),
        paused: rng.next().is_multiple_of(6),
        last_trigger,
        request,
    }
}

/// The row the Rust rule sees: as written, at the script's clock.
fn row_of(c: &Case, base: i64, now: i64) -> LockRow {
    LockRow {
        owner: c.owner.map(str::to_string),
        fence: c.fence,
        expires_at: if c.lease_left > 0 {
            base + c.lease_left
        } else {
            // Expired a while ago (no lease key in Redis).
            now - 10_000
        },
        last_occurrence: c.last,
        running: c.running,
        paused: c.paused,
        trigger: None,
        last_trigger: c.last_trigger,
        now,
    }
}

/// Within `ms` of each other (times read on two clocks a few ms apart).
fn near(a: Duration, b: Duration, ms: u64) -> bool {
    a.as_millis().abs_diff(b.as_millis()) <= u128::from(ms)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_lua_decides_as_the_rust_rule() {
    let h = Harness::new(Backend::Redis).await;
    let store = h.store().await;
    let client = h.redis_client().await;
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let prefix = h.config.key_prefix.clone();
    let cases: usize = std::env::var("CRONLEASE_LUA_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let seed: u64 = std::env::var("CRONLEASE_LUA_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| u64::from(std::process::id()) ^ 0x5EED);
    let mut rng = Rng(seed);
    let mut checked = 0;
    let mut won = 0;
    let mut redelivered = 0;
    let batch = 250;
    let mut round = 0;
    while checked < cases {
        round += 1;
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
        let base = secs * 1000 + micros / 1000;
        let names: Vec<String> = (0..batch).map(|i| format!("d{round}x{i}")).collect();
        let batch_cases: Vec<Case> = names.iter().map(|n| case(&mut rng, base, n)).collect();
        let mut pipe = redis::pipe();
        for (name, c) in names.iter().zip(&batch_cases) {
            let state = format!("{prefix}{{{name}}}:state");
            let lease = format!("{prefix}{{{name}}}:lease");
            let mut fields: Vec<(&str, String)> = vec![
                ("fence", c.fence.to_string()),
                ("running", if c.running { "1" } else { "0" }.into()),
            ];
            if let Some(o) = c.owner {
                fields.push(("owner", o.into()));
            }
            if let Some(l) = c.last {
                fields.push(("last_occurrence", l.to_string()));
            }
            if c.paused {
                fields.push(("paused", "1".into()));
            }
            if let Some(id) = c.last_trigger {
                fields.push(("last_trigger", id.to_string()));
            }
            pipe.hset_multiple(&state, &fields).ignore();
            if let (Some(o), true) = (c.owner, c.lease_left > 0) {
                pipe.cmd("SET")
                    .arg(&lease)
                    .arg(o)
                    .arg("PX")
                    .arg(c.lease_left)
                    .ignore();
            }
        }
        let () = pipe.query_async(&mut conn).await.unwrap();
        let requests: Vec<ClaimRequest> = batch_cases.iter().map(|c| c.request.clone()).collect();
        let claimed = store.claim(&requests).await.unwrap();
        let now = to_ms(claimed.store_now);
        assert!(
            now - base < 700,
            "setting up took {} ms: cases would sit on a boundary",
            now - base
        );
        // Every row left behind, read in one round trip right after the
        // claim (key by key, the leases would run down while being read).
        let mut read = redis::pipe();
        for name in &names {
            read.hgetall(format!("{prefix}{{{name}}}:state"))
                .pttl(format!("{prefix}{{{name}}}:lease"));
        }
        let (after, read_at): (Vec<redis::Value>, i64) = {
            let v: Vec<redis::Value> = read.query_async(&mut conn).await.unwrap();
            let (secs, micros): (i64, i64) =
                redis::cmd("TIME").query_async(&mut conn).await.unwrap();
            (v, secs * 1000 + micros / 1000)
        };
        for (i, (c, lua)) in batch_cases.iter().zip(claimed.outcomes).enumerate() {
            let mut row = row_of(c, base, now);
            let rust = claim_row(&mut row, &c.request);
            let at = format!(
                "seed {seed}, round {round}, case {i}: row owner {:?} lease {} fence {} last {:?} running {} paused {} last_trigger {:?}; request {:?}",
                c.owner,
                c.lease_left,
                c.fence,
                c.last.map(|l| l - base),
                c.running,
                c.paused,
                c.last_trigger,
                c.request
            );
            match (&rust, &lua) {
                (ClaimOutcome::Won(r), ClaimOutcome::Won(l)) => {
                    won += 1;
                    redelivered += usize::from(r.redelivered);
                    assert_eq!(
                        (
                            r.fence,
                            r.occurrence,
                            r.catch_up,
                            r.redelivered,
                            r.unclaimed_after,
                            &r.previous_owner
                        ),
                        (
                            l.fence,
                            l.occurrence,
                            l.catch_up,
                            l.redelivered,
                            l.unclaimed_after,
                            &l.previous_owner
                        ),
                        "won differently\nrust {rust:?}\nlua  {lua:?}\n{at}"
                    );
                }
                (ClaimOutcome::Lost(r), ClaimOutcome::Lost(l)) => {
                    assert_eq!(
                        (
                            &r.holder,
                            r.last_occurrence,
                            r.fence,
                            r.too_early,
                            r.stale,
                            r.paused
                        ),
                        (
                            &l.holder,
                            l.last_occurrence,
                            l.fence,
                            l.too_early,
                            l.stale,
                            l.paused
                        ),
                        "refused differently\nrust {rust:?}\nlua  {lua:?}\n{at}"
                    );
                    // The lease left matters only to a claimer it keeps out
                    // (claim.lua reads it only then).
                    if r.holder.as_deref() != Some(c.request.owner.as_str()) {
                        assert!(
                            near(r.remaining, l.remaining, 500),
                            "remaining\nrust {rust:?}\nlua  {lua:?}\n{at}"
                        );
                    }
                    assert_eq!(
                        r.idle_wait.is_some(),
                        l.idle_wait.is_some(),
                        "idle wait\nrust {rust:?}\nlua  {lua:?}\n{at}"
                    );
                    if let (Some(a), Some(b)) = (r.idle_wait, l.idle_wait) {
                        assert!(
                            near(a, b, 500),
                            "idle wait\nrust {rust:?}\nlua  {lua:?}\n{at}"
                        );
                    }
                }
                (ClaimOutcome::Failed(_), ClaimOutcome::Failed(_)) => {}
                _ => panic!("different verdicts\nrust {rust:?}\nlua  {lua:?}\n{at}"),
            }
            // The row left behind.
            let h: HashMap<String, String> =
                redis::FromRedisValue::from_redis_value(after[2 * i].clone()).unwrap();
            let fence: i64 = h.get("fence").and_then(|f| f.parse().ok()).unwrap_or(0);
            let last: Option<i64> = h.get("last_occurrence").and_then(|l| l.parse().ok());
            let running = h.get("running").is_none_or(|r| r != "0");
            assert_eq!(
                (fence, last, running, h.get("owner").map(String::as_str)),
                (
                    row.fence,
                    row.last_occurrence,
                    row.running,
                    row.owner.as_deref()
                ),
                "the row left behind differs\nrust {rust:?}\nlua  {lua:?}\n{at}"
            );
            let ttl: i64 =
                redis::FromRedisValue::from_redis_value(after[2 * i + 1].clone()).unwrap();
            // What the Rust row has left when the keys were read.
            let rust_left = row.expires_at - read_at;
            if row.expires_at > now {
                assert!(
                    ttl > 0 && (ttl - rust_left).abs() <= 300,
                    "lease left: lua {ttl} ms, rust {rust_left} ms\nrust {rust:?}\nlua  {lua:?}\n{at}"
                );
            } else {
                assert!(ttl < 0, "lease left: lua {ttl} ms, rust none\n{at}");
            }
            checked += 1;
        }
    }
    eprintln!(
        "claim.lua and claim_row agreed on {checked} cases ({won} won, {redelivered} of them redelivered), seed {seed}"
    );
    // At the default size about 1 case in 60 is a redelivery.
    assert!(
        cases < 2_000 || redelivered > 0,
        "no case was a redelivery: the cases do not cover at_least_once (seed {seed})"
    );
}
