//! The claim rule (docs/protocol.md, "The claim rule") as pure functions
//! over one lock row: [`decide`] for a scheduled or manual claim,
//! [`claim_row`] and [`claim_rows`] to apply it, [`trigger_row`] for a manual
//! run's request. Every store but Redis runs these; Redis runs the same rule
//! in `redis/claim.lua`, and `tests/it/lua_rule.rs` holds the two together.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{
    ClaimOutcome, ClaimRequest, Lost, Outcome, RunRecord, TRIGGER_RANDOM_BITS, TriggerAnswer,
    TriggerId, Won, duration_ms, fence_exhausted, from_ms, to_ms,
};
use crate::config::Misfire;

/// The claim rule of docs/protocol.md as a pure function, for stores that read the
/// lock row and decide in a transaction (SQL). Redis runs the same rule in Lua
/// (`redis/claim.lua`); the conformance suite holds both to it, and
/// `tests/it/lua_rule.rs` compares the two on 10,000 random rows and
/// requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockRow {
    pub owner: Option<String>,
    pub fence: i64,
    pub expires_at: i64,
    pub last_occurrence: Option<i64>,
    /// The holder's last claimed run has not finished: set by every claim,
    /// cleared by the history write of that claim's run. `true` where a
    /// store cannot tell (the holder keeps its whole lease).
    pub running: bool,
    /// Paused by `cronlease pause`: every claim is refused (a running run
    /// goes on; its renewals are not claims).
    pub paused: bool,
    /// A manual run's request, pending until a node claims it.
    pub trigger: Option<i64>,
    /// The request the last manual claim took (so a retry after a lost
    /// answer is answered with the same win; with `at_least_once`, its
    /// time tells whether a request's claim set the running mark:
    /// [`redelivers`]).
    pub last_trigger: Option<i64>,
    /// The store's clock when the row was read.
    pub now: i64,
}

impl LockRow {
    /// A lock nobody ever claimed (fence 0), read at `now`.
    pub fn free(now: i64) -> Self {
        LockRow {
            owner: None,
            fence: 0,
            expires_at: 0,
            last_occurrence: None,
            running: false,
            paused: false,
            trigger: None,
            last_trigger: None,
            now,
        }
    }

    /// A live lease whose run is not recorded yet: a run is in progress.
    pub fn run_in_progress(&self) -> bool {
        self.running && self.owner.is_some() && self.expires_at > self.now
    }
}

/// Decides a manual run's request on the job's lock row and, when it is
/// accepted, writes it there: refused while a run is in progress (a live
/// lease whose run is not recorded) or another request is pending. The
/// pause mark does not matter: an operator asked.
pub fn trigger_row(row: &mut LockRow, id: TriggerId) -> TriggerAnswer {
    if let Some(pending) = row.trigger.and_then(TriggerId::from_stored) {
        return TriggerAnswer::Pending(pending);
    }
    if row.run_in_progress() {
        return TriggerAnswer::Running {
            holder: row.owner.clone(),
        };
    }
    row.trigger = Some(id.get());
    TriggerAnswer::Accepted
}

/// What [`decide`] wants written, with the answer to give.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Write these values, answer `Won`. With `manual`, the request is
    /// taken: the pending mark is cleared and the id kept as the last one.
    Claim {
        fence: i64,
        expires_at: i64,
        last_occurrence: Option<i64>,
        manual: Option<TriggerId>,
        won: Won,
    },
    /// Leave the row alone, answer `Lost`.
    Refuse(Lost),
    /// The fence is at its maximum: leave the row alone and fail the claim.
    FenceExhausted,
}

/// Decides a batch of claims on the rows they name, each request on its own,
/// in the order given (a job named twice sees its first request's write),
/// and writes each winner into its row: the batch step of every store, here
/// over rows in memory. The memory store claims through it, and the protocol
/// model (`tests/it/model.rs`) checks it, with [`decide`] inside; SQL,
/// ZooKeeper, etcd and Redlock take the same step over their own rows (SQL
/// in job-name order, so concurrent batches lock rows in one order). A job
/// with no row starts free at fence 0. `now` is the store's clock.
pub fn claim_rows(
    rows: &mut std::collections::BTreeMap<String, LockRow>,
    requests: &[ClaimRequest],
    now: i64,
) -> Vec<ClaimOutcome> {
    requests
        .iter()
        .map(|req| {
            let row = rows
                .entry(req.job.as_str().to_string())
                .or_insert_with(|| LockRow::free(now));
            row.now = now;
            claim_row(row, req)
        })
        .collect()
}

/// Decides one claim on its row and, when it wins, writes the winner into
/// the row (owner, fence, lease end, last occurrence, running mark): the
/// step of [`claim_rows`] and of the SQL batch.
pub fn claim_row(row: &mut LockRow, req: &ClaimRequest) -> ClaimOutcome {
    match decide(row, req) {
        Decision::Claim {
            fence,
            expires_at,
            last_occurrence,
            manual,
            won,
        } => {
            row.owner = Some(req.owner.as_str().to_string());
            row.fence = fence;
            row.expires_at = expires_at;
            row.last_occurrence = last_occurrence;
            row.running = true;
            if let Some(id) = manual {
                row.trigger = None;
                row.last_trigger = Some(id.get());
            }
            ClaimOutcome::Won(won)
        }
        Decision::Refuse(lost) => ClaimOutcome::Lost(lost),
        Decision::FenceExhausted => ClaimOutcome::Failed(fence_exhausted(req.job.as_str())),
    }
}

/// The occurrence a retried claim had already won, if the row shows it: the
/// owner is the claimer, its fence is one the claimer never saw answered, and
/// the last occurrence is the requested one or (with `run_once`) the missed
/// one it would have caught up.
fn unanswered_win(row: &LockRow, req: &ClaimRequest, floor: i64) -> Option<i64> {
    if !req.after_unanswered
        || row.owner.as_deref() != Some(req.owner.as_str())
        || row.fence <= floor
    {
        return None;
    }
    let last = row.last_occurrence?;
    let caught_up =
        (req.misfire == Misfire::RunOnce || req.redeliver) && req.previous.map(to_ms) == Some(last);
    (last == to_ms(req.occurrence) || caught_up).then_some(last)
}

/// Whether recording `run` ends the running mark of a lock whose fence is
/// `lock_fence`: the run of the lock's last claim is over. A skipped
/// occurrence ran nothing (the run before it may still go), and the run of
/// an older claim says nothing about the newest one.
pub fn clears_running(run: &RunRecord, lock_fence: i64) -> bool {
    ends_a_run(run) && i64::try_from(run.fence).is_ok_and(|f| f == lock_fence)
}

/// `run` is the end of a run its claim started (a skipped occurrence
/// started none), so it may end its claim's running mark.
pub fn ends_a_run(run: &RunRecord) -> bool {
    run.outcome != Outcome::Skipped
}

/// What is left of a row's lease by its store clock (zero when not live).
fn remaining(row: &LockRow, live: bool) -> Duration {
    if live {
        // Saturating: the row is whatever the store holds.
        Duration::from_millis(row.expires_at.saturating_sub(row.now).max(0) as u64)
    } else {
        Duration::ZERO
    }
}

/// A refusal on `row` (`live`: its lease is): who holds it, for how long,
/// its fence and last occurrence, no reason given.
fn refusal(row: &LockRow, live: bool) -> Lost {
    Lost {
        holder: if live { row.owner.clone() } else { None },
        remaining: remaining(row, live),
        last_occurrence: row.last_occurrence.map(from_ms),
        fence: row.fence.max(0) as u64,
        too_early: false,
        idle_wait: None,
        paused: false,
        trigger_gone: false,
        stale: false,
    }
}

/// Applies the claim rule to one lock row.
pub fn decide(row: &LockRow, req: &ClaimRequest) -> Decision {
    let floor = i64::try_from(req.fence_floor).unwrap_or(i64::MAX);
    if let Some(id) = req.manual {
        return decide_manual(row, req, id, floor);
    }
    if let Some(last) = unanswered_win(row, req, floor) {
        return same_win(
            row,
            req,
            Some(last),
            None,
            from_ms(last),
            last != to_ms(req.occurrence),
        );
    }
    let live = row.owner.is_some() && row.expires_at > row.now;
    if row.paused {
        return Decision::Refuse(Lost {
            paused: true,
            ..refusal(row, live)
        });
    }
    if req
        .window_end
        .is_some_and(|end| row.now >= to_ms(end) && !req.recheck_only)
    {
        return Decision::Refuse(Lost {
            stale: true,
            ..refusal(row, live)
        });
    }
    let occurrence = to_ms(req.occurrence);
    let already_claimed = row.last_occurrence.is_some_and(|last| last >= occurrence);
    // An idle holder keeps an occurrence only for its head start: its lease
    // protects no running job (docs/protocol.md, "Fast takeover").
    let idle_wait = match req.head_start {
        Some(head_start) if live && !row.running && !already_claimed => Some(
            occurrence
                .saturating_add(duration_ms(head_start))
                .saturating_sub(row.now),
        ),
        _ => None,
    };
    let head_start_over = idle_wait.is_some_and(|w| w <= 0);
    let held_by_other =
        live && row.owner.as_deref() != Some(req.owner.as_str()) && !head_start_over;
    let too_early = occurrence > row.now.saturating_add(duration_ms(req.max_offset));
    if held_by_other || already_claimed || too_early || req.recheck_only {
        return Decision::Refuse(Lost {
            holder: if live { row.owner.clone() } else { None },
            remaining: remaining(row, live),
            last_occurrence: row.last_occurrence.map(from_ms),
            fence: row.fence.max(0) as u64,
            // A recheck is refused for what it is, whatever the clock says
            // (claim.lua answers it the same way).
            too_early: too_early && !held_by_other && !already_claimed && !req.recheck_only,
            idle_wait: idle_wait
                .filter(|_| held_by_other)
                .map(|w| Duration::from_millis(w.max(0) as u64)),
            paused: false,
            trigger_gone: false,
            stale: false,
        });
    }
    let missed = match (req.misfire, req.previous, row.last_occurrence) {
        (Misfire::RunOnce, Some(prev), Some(last)) if last < to_ms(prev) => Some(prev),
        _ => None,
    };
    let redelivered = missed.is_none() && redelivers(row, req, live);
    let caught_up = missed.or(req.previous.filter(|_| redelivered));
    let unclaimed_after = unclaimed(req, row.last_occurrence, missed.is_some(), redelivered);
    // The fence below the claim's is kept for the record of what nobody
    // claimed.
    let step = if unclaimed_after.is_some() { 2 } else { 1 };
    let Some(fence) = row.fence.max(floor).checked_add(step) else {
        // Never wrap, never repeat: the job cannot be claimed any more.
        return Decision::FenceExhausted;
    };
    let claimed = caught_up.unwrap_or(req.occurrence);
    Decision::Claim {
        fence,
        expires_at: row.now.saturating_add(duration_ms(req.lease)),
        last_occurrence: Some(to_ms(claimed)),
        manual: None,
        won: Won {
            fence: fence as u64,
            occurrence: claimed,
            catch_up: caught_up.is_some(),
            redelivered,
            unclaimed_after: unclaimed_after.map(from_ms),
            previous_owner: row.owner.clone(),
        },
    }
}

/// The lock's last occurrence `last` when a claim of `req` that wins
/// leaves occurrences after it nobody claimed (docs/protocol.md,
/// "Occurrences nobody claimed"): older than the occurrence before the
/// one it runs (`before_previous` for a catch-up of `previous`, else
/// `previous`). A redelivery follows its own claim: nothing is between.
/// `claim.lua` keeps the same rule, and the Redis store reads it back from
/// the script's reply with this function.
pub fn unclaimed(
    req: &ClaimRequest,
    last: Option<i64>,
    catch_up: bool,
    redelivered: bool,
) -> Option<i64> {
    let last = last?;
    let before = if catch_up {
        req.before_previous
    } else {
        req.previous
    };
    (!redelivered && before.is_some_and(|b| last < to_ms(b))).then_some(last)
}

/// `delivery = "at_least_once"` (docs/protocol.md, "At least once"): the
/// lock's last occurrence is the one before the requested occurrence, its
/// claim's run was never recorded (the running mark), its lease is over
/// (`live`: it is not) and it was not the claimer's: that holder died
/// during or before the run, with its guard, and the occurrence runs
/// again. The mark must have been set by a scheduled claim: a request's
/// claim (a manual run, a retry) sets it without moving the last
/// occurrence, and the last request a claim took (`last_trigger`) then
/// carries a time after that occurrence (a manual run's: when it was asked
/// for; a retry's: when it was due), so its holder's death re-runs nothing.
/// A redelivery's request carries the occurrence's own time: it is
/// redelivered again.
fn redelivers(row: &LockRow, req: &ClaimRequest, live: bool) -> bool {
    let Some(last) = row.last_occurrence else {
        return false;
    };
    let request_after = row
        .last_trigger
        .is_some_and(|id| (id >> TRIGGER_RANDOM_BITS) > last);
    req.redeliver
        && req.previous.map(to_ms) == Some(last)
        && row.running
        && !live
        && row.owner.as_deref() != Some(req.owner.as_str())
        && !request_after
}

/// Our own claim whose answer was lost, answered again: the same win with
/// the same fence (`occurrence` and `catch_up` as it won them); the lease
/// counts again from now, except for a recheck, which takes nothing.
fn same_win(
    row: &LockRow,
    req: &ClaimRequest,
    last_occurrence: Option<i64>,
    manual: Option<TriggerId>,
    occurrence: DateTime<Utc>,
    catch_up: bool,
) -> Decision {
    Decision::Claim {
        fence: row.fence,
        expires_at: if req.recheck_only {
            row.expires_at
        } else {
            row.now.saturating_add(duration_ms(req.lease))
        },
        last_occurrence,
        manual,
        won: Won {
            fence: row.fence.max(0) as u64,
            occurrence,
            catch_up,
            // Which kind of catch-up it was is not kept: with
            // `at_least_once` the run is told it may be a re-run.
            redelivered: catch_up && req.redeliver,
            unclaimed_after: None,
            previous_owner: None,
        },
    }
}

/// The claim rule for a manual run (docs/protocol.md, "Manual runs"): it
/// wins iff its request is still the pending one and no run of the job is in
/// progress; it then takes the lease (from whoever held it idle) with a fence
/// of its own, sets the running mark and clears the request. The last
/// occurrence is left alone, so no scheduled occurrence is refused, skipped
/// or caught up because of it. The occurrence it answers is the store's now.
fn decide_manual(row: &LockRow, req: &ClaimRequest, id: TriggerId, floor: i64) -> Decision {
    let live = row.owner.is_some() && row.expires_at > row.now;
    let ours = row.owner.as_deref() == Some(req.owner.as_str());
    if req.after_unanswered && ours && row.fence > floor && row.last_trigger == Some(id.get()) {
        return same_win(
            row,
            req,
            row.last_occurrence,
            Some(id),
            from_ms(row.now),
            false,
        );
    }
    let gone = row.trigger != Some(id.get());
    if gone || req.recheck_only || row.run_in_progress() {
        return Decision::Refuse(Lost {
            trigger_gone: gone,
            stale: false,
            ..refusal(row, live)
        });
    }
    let Some(fence) = row.fence.max(floor).checked_add(1) else {
        return Decision::FenceExhausted;
    };
    Decision::Claim {
        fence,
        expires_at: row.now.saturating_add(duration_ms(req.lease)),
        last_occurrence: row.last_occurrence,
        manual: Some(id),
        won: Won {
            fence: fence as u64,
            occurrence: from_ms(row.now),
            catch_up: false,
            redelivered: false,
            unclaimed_after: None,
            previous_owner: row.owner.clone(),
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::JobName;
    use crate::store::Owner;

    fn req(owner: &str, occ: i64, prev: Option<i64>, misfire: Misfire, floor: u64) -> ClaimRequest {
        ClaimRequest {
            job: JobName::parse("j").unwrap(),
            occurrence: from_ms(occ),
            previous: prev.map(from_ms),
            misfire,
            owner: Owner::from_raw(owner),
            lease: Duration::from_millis(1500),
            fence_floor: floor,
            max_offset: Duration::from_millis(500),
            head_start: None,
            after_unanswered: false,
            recheck_only: false,
            window_end: None,
            manual: None,
            redeliver: false,
            before_previous: None,
        }
    }

    fn row(owner: Option<&str>, fence: i64, expires_at: i64, last: Option<i64>) -> LockRow {
        LockRow {
            owner: owner.map(str::to_string),
            fence,
            expires_at,
            last_occurrence: last,
            running: true,
            paused: false,
            trigger: None,
            last_trigger: None,
            now: 19_900,
        }
    }

    #[test]
    fn fresh_row_is_won() {
        let d = decide(
            &row(None, 0, 0, None),
            &req("a", 20_000, Some(19_000), Misfire::RunOnce, 0),
        );
        assert!(matches!(
            d,
            Decision::Claim {
                fence: 1,
                expires_at: 21_400,
                last_occurrence: Some(20_000),
                manual: None,
                won: Won {
                    catch_up: false,
                    ..
                }
            }
        ));
    }

    #[test]
    fn live_lease_of_another_is_refused_with_remaining() {
        let d = decide(
            &row(Some("b"), 7, 20_300, Some(19_000)),
            &req("a", 20_000, Some(19_000), Misfire::RunOnce, 0),
        );
        assert_eq!(
            d,
            Decision::Refuse(Lost {
                holder: Some("b".into()),
                remaining: Duration::from_millis(400),
                last_occurrence: Some(from_ms(19_000)),
                fence: 7,
                too_early: false,
                idle_wait: None,
                paused: false,
                trigger_gone: false,
                stale: false,
            })
        );
    }

    #[test]
    fn own_live_lease_is_renewed_by_claim() {
        let d = decide(
            &row(Some("a"), 7, 20_300, Some(19_000)),
            &req("a", 20_000, Some(19_000), Misfire::RunOnce, 0),
        );
        assert!(matches!(d, Decision::Claim { fence: 8, .. }));
    }

    #[test]
    fn claimed_occurrence_is_refused_even_when_expired() {
        let d = decide(
            &row(Some("b"), 7, 19_000, Some(20_000)),
            &req("a", 20_000, None, Misfire::RunOnce, 0),
        );
        assert!(matches!(
            d,
            Decision::Refuse(Lost {
                holder: None,
                remaining: Duration::ZERO,
                ..
            })
        ));
    }

    #[test]
    fn missed_occurrence_is_caught_up_with_run_once_only() {
        let d = decide(
            &row(Some("b"), 7, 19_000, Some(17_000)),
            &req("a", 20_000, Some(19_000), Misfire::RunOnce, 0),
        );
        assert!(matches!(
            d,
            Decision::Claim {
                fence: 8,
                last_occurrence: Some(19_000),
                won: Won { catch_up: true, .. },
                ..
            }
        ));
        let d = decide(
            &row(Some("b"), 7, 19_000, Some(17_000)),
            &req("a", 20_000, Some(19_000), Misfire::Skip, 0),
        );
        assert!(matches!(
            d,
            Decision::Claim {
                last_occurrence: Some(20_000),
                won: Won {
                    catch_up: false,
                    ..
                },
                ..
            }
        ));
    }

    /// A dead holder's claim of 19,000 (running mark set, lease over at
    /// 19,800), seen at the claim of 20,000 by `claimer`.
    fn dead_holders(claimer: &str, redeliver: bool, misfire: Misfire) -> Decision {
        let mut r = req(claimer, 20_000, Some(19_000), misfire, 0);
        r.redeliver = redeliver;
        decide(&row(Some("b"), 7, 19_800, Some(19_000)), &r)
    }

    /// A win of 19,000 again, with fence 8, marked redelivered.
    fn redelivered_with_fence_8(d: &Decision) -> bool {
        matches!(
            d,
            Decision::Claim {
                fence: 8,
                last_occurrence: Some(19_000),
                won: Won {
                    catch_up: true,
                    redelivered: true,
                    ..
                },
                ..
            }
        )
    }

    #[test]
    fn at_least_once_runs_a_dead_holders_unrecorded_claim_again_first() {
        for misfire in [Misfire::RunOnce, Misfire::Skip] {
            let d = dead_holders("a", true, misfire);
            assert!(redelivered_with_fence_8(&d), "{misfire:?}: {d:?}");
        }
        // At most once (the default): the occurrence itself.
        assert!(matches!(
            dead_holders("a", false, Misfire::RunOnce),
            Decision::Claim {
                last_occurrence: Some(20_000),
                won: Won {
                    catch_up: false,
                    redelivered: false,
                    ..
                },
                ..
            }
        ));
    }

    #[test]
    fn at_least_once_leaves_recorded_live_own_and_requested_claims_alone() {
        let with = |row: LockRow, claimer: &str| {
            let mut r = req(claimer, 20_000, Some(19_000), Misfire::Skip, 0);
            r.redeliver = true;
            decide(&row, &r)
        };
        let plain = |d: &Decision| {
            matches!(
                d,
                Decision::Claim {
                    last_occurrence: Some(20_000),
                    won: Won {
                        catch_up: false,
                        redelivered: false,
                        ..
                    },
                    ..
                }
            )
        };
        let dead = row(Some("b"), 7, 19_800, Some(19_000));
        // Its run was recorded.
        let d = with(
            LockRow {
                running: false,
                ..dead.clone()
            },
            "a",
        );
        assert!(plain(&d), "{d:?}");
        // The claimer's own claim (a live daemon knows its runs).
        assert!(plain(&with(dead.clone(), "b")));
        // Not the previous occurrence's claim: an older one (a miss, not a
        // redelivery, and with skip nothing to catch up).
        let d = with(
            LockRow {
                last_occurrence: Some(18_000),
                ..dead.clone()
            },
            "a",
        );
        assert!(plain(&d), "{d:?}");
        // A live lease is waited out.
        let d = with(
            LockRow {
                expires_at: 20_300,
                ..dead.clone()
            },
            "a",
        );
        assert!(matches!(d, Decision::Refuse(_)), "{d:?}");
        // A manual run or a retry set the mark: the last request taken is
        // newer than the last occurrence.
        let d = with(
            LockRow {
                last_trigger: Some(19_001 << TRIGGER_RANDOM_BITS),
                ..dead.clone()
            },
            "a",
        );
        assert!(plain(&d), "{d:?}");
        // A redelivery's request carries the occurrence's own time: its
        // dead holder's claim is redelivered again, as is one after an
        // older request.
        for id in [
            TriggerId::redelivery(from_ms(19_000), 1, 1).unwrap().get(),
            (19_000 << TRIGGER_RANDOM_BITS) | 0xf_ffff,
            18_000 << TRIGGER_RANDOM_BITS,
        ] {
            let d = with(
                LockRow {
                    last_trigger: Some(id),
                    ..dead.clone()
                },
                "a",
            );
            assert!(
                matches!(
                    d,
                    Decision::Claim {
                        won: Won {
                            redelivered: true,
                            ..
                        },
                        ..
                    }
                ),
                "{id:x}: {d:?}"
            );
        }
    }

    #[test]
    fn a_redelivery_whose_answer_was_lost_is_answered_again() {
        let mut r = req("a", 20_000, Some(19_000), Misfire::Skip, 7);
        r.redeliver = true;
        r.after_unanswered = true;
        let d = decide(&row(Some("a"), 8, 50_000, Some(19_000)), &r);
        assert!(redelivered_with_fence_8(&d), "{d:?}");
    }

    #[test]
    fn occurrences_nobody_claimed_keep_the_fence_below_the_win() {
        let dead = |last: i64, fence: i64| row(Some("b"), fence, 19_000, Some(last));
        let unclaimed = |d: &Decision| match d {
            Decision::Claim { fence, won, .. } => (*fence, won.occurrence, won.unclaimed_after),
            other => panic!("{other:?}"),
        };
        // skip: 18,000 and 19,000 between the last claim and the win.
        let skip = req("a", 20_000, Some(19_000), Misfire::Skip, 0);
        assert_eq!(
            unclaimed(&decide(&dead(17_000, 7), &skip)),
            (9, from_ms(20_000), Some(from_ms(17_000)))
        );
        // Nothing between.
        assert_eq!(
            unclaimed(&decide(&dead(19_000, 7), &skip)),
            (8, from_ms(20_000), None)
        );
        // run_once catches 19,000 up: kept only when 18,000 was missed too.
        let mut once = req("a", 20_000, Some(19_000), Misfire::RunOnce, 0);
        once.before_previous = Some(from_ms(18_000));
        assert_eq!(
            unclaimed(&decide(&dead(17_000, 7), &once)),
            (9, from_ms(19_000), Some(from_ms(17_000)))
        );
        assert_eq!(
            unclaimed(&decide(&dead(18_000, 7), &once)),
            (8, from_ms(19_000), None)
        );
        // A fence kept past the maximum is none: the job is exhausted.
        assert_eq!(
            decide(&dead(17_000, i64::MAX - 1), &skip),
            Decision::FenceExhausted
        );
        assert_eq!(
            unclaimed(&decide(&dead(19_000, i64::MAX - 1), &skip)).0,
            i64::MAX
        );
    }

    #[test]
    fn fence_floor_keeps_fences_from_going_back() {
        let d = decide(
            &row(None, 0, 0, None),
            &req("a", 20_000, None, Misfire::RunOnce, 41),
        );
        assert!(matches!(d, Decision::Claim { fence: 42, .. }));
    }

    #[test]
    fn the_fence_never_wraps_or_repeats() {
        let d = decide(
            &row(None, i64::MAX - 1, 0, None),
            &req("a", 19_000, None, Misfire::RunOnce, 0),
        );
        assert!(matches!(
            d,
            Decision::Claim {
                fence: i64::MAX,
                ..
            }
        ));
        let d = decide(
            &row(None, i64::MAX, 0, None),
            &req("a", 19_000, None, Misfire::RunOnce, 0),
        );
        assert_eq!(d, Decision::FenceExhausted);
        let d = decide(
            &row(None, 5, 0, None),
            &req("a", 19_000, None, Misfire::RunOnce, u64::MAX),
        );
        assert_eq!(d, Decision::FenceExhausted);
    }

    #[test]
    fn a_recheck_answers_only_an_earlier_win_and_keeps_its_lease() {
        let committed = row(Some("a"), 8, 21_000, Some(20_000));
        let mut recheck = req("a", 20_000, Some(19_000), Misfire::RunOnce, 7);
        recheck.after_unanswered = true;
        recheck.recheck_only = true;
        assert_eq!(
            decide(&committed, &recheck),
            Decision::Claim {
                fence: 8,
                expires_at: 21_000,
                last_occurrence: Some(20_000),
                manual: None,
                won: Won {
                    fence: 8,
                    occurrence: from_ms(20_000),
                    catch_up: false,
                    previous_owner: None,
                    redelivered: false,
                    unclaimed_after: None,
                },
            }
        );
        // A free row is never taken by a recheck.
        let free = row(None, 7, 0, Some(10_000));
        assert!(matches!(decide(&free, &recheck), Decision::Refuse(_)));
        // Nor is ours with an occurrence the earlier claim did not record.
        let older = row(Some("a"), 8, 21_000, Some(10_000));
        assert!(matches!(decide(&older, &recheck), Decision::Refuse(_)));
    }

    #[test]
    fn a_retry_after_a_lost_reply_gets_the_same_win() {
        // Our catch-up claim of 19_000 committed (fence 8) but its reply was
        // lost; the node last saw fence 7.
        let committed = row(Some("a"), 8, 21_000, Some(19_000));
        let mut retry = req("a", 20_000, Some(19_000), Misfire::RunOnce, 7);
        retry.after_unanswered = true;
        assert_eq!(
            decide(&committed, &retry),
            Decision::Claim {
                fence: 8,
                expires_at: 21_400,
                last_occurrence: Some(19_000),
                manual: None,
                won: Won {
                    fence: 8,
                    occurrence: from_ms(19_000),
                    catch_up: true,
                    previous_owner: None,
                    redelivered: false,
                    unclaimed_after: None,
                },
            }
        );
        // Without knowing a reply was lost, the missed run would be skipped.
        retry.after_unanswered = false;
        assert!(matches!(
            decide(&committed, &retry),
            Decision::Claim {
                fence: 9,
                last_occurrence: Some(20_000),
                won: Won {
                    catch_up: false,
                    ..
                },
                ..
            }
        ));
        // The plain occurrence, won and unanswered: same fence again.
        let committed = row(Some("a"), 8, 21_000, Some(20_000));
        retry.after_unanswered = true;
        assert!(matches!(
            decide(&committed, &retry),
            Decision::Claim {
                fence: 8,
                last_occurrence: Some(20_000),
                won: Won {
                    catch_up: false,
                    ..
                },
                ..
            }
        ));
        // A fence this node saw answered is no lost reply: 19_000 was run.
        let ran = row(Some("a"), 8, 21_000, Some(19_000));
        let mut seen = req("a", 20_000, Some(19_000), Misfire::RunOnce, 8);
        seen.after_unanswered = true;
        assert!(matches!(
            decide(&ran, &seen),
            Decision::Claim {
                fence: 9,
                last_occurrence: Some(20_000),
                ..
            }
        ));
        // Another owner's row is never taken for ours.
        let other = row(Some("b"), 8, 21_000, Some(20_000));
        assert!(matches!(decide(&other, &retry), Decision::Refuse(_)));
    }

    #[test]
    fn an_idle_holder_keeps_an_occurrence_only_for_its_head_start() {
        // a holds a live lease; the occurrence 1_000 is unclaimed.
        let mut idle = row(Some("a#1"), 4, 60_000, Some(900));
        idle.running = false;
        let mut peer = req("b#1", 1_000, Some(900), Misfire::Skip, 0);
        peer.head_start = Some(Duration::from_millis(50));
        let at = |now: i64, r: &LockRow| LockRow { now, ..r.clone() };
        // Within the head start: refused, told how much of it is left.
        match decide(&at(1_020, &idle), &peer) {
            Decision::Refuse(l) => assert_eq!(
                (l.holder.as_deref(), l.idle_wait),
                (Some("a#1"), Some(Duration::from_millis(30)))
            ),
            other => panic!("{other:?}"),
        }
        // From instant + head start: won, with a fence of its own.
        match decide(&at(1_050, &idle), &peer) {
            Decision::Claim { fence, won, .. } => {
                assert_eq!((fence, won.previous_owner.as_deref()), (5, Some("a#1")))
            }
            other => panic!("{other:?}"),
        }
        // A busy holder, a claim without the rule, and an occurrence the
        // holder claimed already: the lease holds.
        let busy = at(1_050, &row(Some("a#1"), 4, 60_000, Some(900)));
        let mut no_rule = peer.clone();
        no_rule.head_start = None;
        let mut claimed = at(1_050, &idle);
        claimed.last_occurrence = Some(1_000);
        for (r, q) in [
            (&busy, &peer),
            (&at(1_050, &idle), &no_rule),
            (&claimed, &peer),
        ] {
            match decide(r, q) {
                Decision::Refuse(l) => {
                    assert_eq!((l.holder.as_deref(), l.idle_wait), (Some("a#1"), None))
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_paused_job_is_refused_whoever_claims_and_a_lost_answer_is_still_answered() {
        // Free, expired, our own, idle past its head start: all refused.
        let mut idle = row(Some("b#1"), 4, 60_000, Some(19_000));
        idle.running = false;
        let mut peer = req("a#1", 20_000, Some(19_000), Misfire::RunOnce, 0);
        peer.head_start = Some(Duration::from_millis(50));
        for (mut r, q) in [
            (row(None, 3, 0, Some(19_000)), peer.clone()),
            (row(Some("b#1"), 3, 10_000, Some(19_000)), peer.clone()),
            (row(Some("a#1"), 3, 60_000, Some(19_000)), peer.clone()),
            (
                LockRow {
                    now: 30_000,
                    ..idle
                },
                peer.clone(),
            ),
        ] {
            r.paused = true;
            match decide(&r, &q) {
                Decision::Refuse(l) => {
                    assert!(l.paused && !l.too_early && l.idle_wait.is_none(), "{l:?}");
                    assert_eq!(l.fence, r.fence as u64);
                }
                other => panic!("{other:?}"),
            }
            r.paused = false;
            assert!(matches!(decide(&r, &q), Decision::Claim { .. }), "{r:?}");
        }
        // A claim that won before the pause and whose answer was lost is
        // answered again: the occurrence was claimed, nothing new runs.
        let mut won = row(Some("a#1"), 5, 60_000, Some(20_000));
        won.paused = true;
        let mut retry = req("a#1", 20_000, Some(19_000), Misfire::RunOnce, 4);
        retry.after_unanswered = true;
        assert!(matches!(
            decide(&won, &retry),
            Decision::Claim { fence: 5, .. }
        ));
    }

    #[test]
    fn a_request_is_refused_while_a_run_is_in_progress_or_another_is_pending() {
        let (t1, t2) = (
            TriggerId::from_stored(11).unwrap(),
            TriggerId::from_stored(12).unwrap(),
        );
        // Free (never claimed, expired, idle): accepted, and written.
        let mut idle = row(Some("b#1"), 4, 60_000, Some(19_000));
        idle.running = false;
        for mut r in [
            row(None, 0, 0, None),
            row(Some("b#1"), 4, 10_000, None),
            idle,
        ] {
            assert_eq!(trigger_row(&mut r, t1), TriggerAnswer::Accepted);
            assert_eq!(r.trigger, Some(11));
            // A second one waits for the first to be taken.
            assert_eq!(trigger_row(&mut r, t2), TriggerAnswer::Pending(t1));
            assert_eq!(r.trigger, Some(11));
        }
        // A live lease whose run is not recorded: a run in progress.
        let mut busy = row(Some("b#1"), 4, 60_000, Some(19_000));
        assert_eq!(
            trigger_row(&mut busy, t1),
            TriggerAnswer::Running {
                holder: Some("b#1".into())
            }
        );
        assert_eq!(busy.trigger, None);
        // Paused: an operator asked, so accepted.
        let mut paused = row(None, 4, 0, Some(19_000));
        paused.paused = true;
        assert_eq!(trigger_row(&mut paused, t1), TriggerAnswer::Accepted);
    }

    #[test]
    fn a_manual_claim_takes_only_its_pending_request_and_keeps_the_schedule() {
        let id = TriggerId::from_stored(7).unwrap();
        let mut manual = req("a#1", 0, None, Misfire::RunOnce, 3);
        manual.manual = Some(id);
        // Pending, held idle by another owner, paused, the occurrence far
        // ahead of the clock: won, fence above the floor, last occurrence
        // kept, the store's now as the occurrence.
        let mut r = row(Some("b#1"), 2, 60_000, Some(19_000));
        (r.running, r.paused, r.trigger) = (false, true, Some(7));
        manual.occurrence = from_ms(90_000_000);
        match decide(&r, &manual) {
            Decision::Claim {
                fence,
                expires_at,
                last_occurrence,
                manual: taken,
                won,
            } => {
                assert_eq!(
                    (fence, expires_at, last_occurrence, taken),
                    (4, 19_900 + 1_500, Some(19_000), Some(id))
                );
                assert_eq!(
                    (won.occurrence, won.catch_up, won.previous_owner.as_deref()),
                    (from_ms(19_900), false, Some("b#1"))
                );
            }
            other => panic!("{other:?}"),
        }
        let mut taken = r.clone();
        assert!(matches!(
            claim_row(&mut taken, &manual),
            ClaimOutcome::Won(_)
        ));
        assert_eq!(
            (taken.trigger, taken.last_trigger, taken.running),
            (None, Some(7), true)
        );
        assert_eq!(taken.last_occurrence, Some(19_000));
        // Taken: a second claim finds it gone; its own retry after a lost
        // answer gets the same win, another owner's does not.
        taken.now = 20_000;
        match decide(&taken, &manual) {
            Decision::Refuse(l) => assert!(l.trigger_gone && l.holder.is_some(), "{l:?}"),
            other => panic!("{other:?}"),
        }
        let mut retry = manual.clone();
        retry.after_unanswered = true;
        assert!(matches!(
            decide(&taken, &retry),
            Decision::Claim { fence: 4, .. }
        ));
        retry.owner = Owner::from_raw("c#1");
        assert!(matches!(decide(&taken, &retry), Decision::Refuse(_)));
        // A run in progress: refused, the request still pending.
        let mut busy = r.clone();
        busy.running = true;
        match decide(&busy, &manual) {
            Decision::Refuse(l) => assert!(!l.trigger_gone && !l.paused, "{l:?}"),
            other => panic!("{other:?}"),
        }
        // Another request pending, or none: gone.
        for pending in [Some(8), None] {
            let mut other = r.clone();
            other.trigger = pending;
            assert!(matches!(
                decide(&other, &manual),
                Decision::Refuse(Lost {
                    trigger_gone: true,
                    stale: false,
                    ..
                })
            ));
        }
        // A recheck takes nothing.
        let mut recheck = manual.clone();
        recheck.recheck_only = true;
        assert!(matches!(decide(&r, &recheck), Decision::Refuse(_)));
    }

    #[test]
    fn a_lease_ending_far_after_a_store_clock_before_1970_is_refused_without_overflow() {
        // Found by fuzz/ (target replies): a hand-edited row, or a store
        // clock gone wrong, made the lease's remaining time overflow.
        let mut far = row(Some("b"), 7, i64::MAX, Some(19_000));
        far.now = -1;
        let d = decide(&far, &req("a", 20_000, Some(19_000), Misfire::RunOnce, 0));
        match d {
            Decision::Refuse(lost) => {
                assert_eq!(lost.remaining, Duration::from_millis(i64::MAX as u64));
                assert_eq!(lost.holder.as_deref(), Some("b"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_occurrence_beyond_the_clock_bound_is_refused() {
        // now 19_900, bound 500: 20_400 is the latest claimable instant.
        let d = decide(
            &row(None, 3, 0, Some(19_000)),
            &req("a", 20_400, Some(19_000), Misfire::RunOnce, 0),
        );
        assert!(matches!(d, Decision::Claim { fence: 4, .. }));
        let d = decide(
            &row(None, 3, 0, Some(19_000)),
            &req("a", 20_401, Some(19_000), Misfire::RunOnce, 0),
        );
        assert_eq!(
            d,
            Decision::Refuse(Lost {
                holder: None,
                remaining: Duration::ZERO,
                last_occurrence: Some(from_ms(19_000)),
                fence: 3,
                too_early: true,
                idle_wait: None,
                paused: false,
                trigger_gone: false,
                stale: false,
            })
        );
    }
}
