//! Unit tests of the node: the watchdog's stuck check, the local lease
//! deadline and renewal point (pure arithmetic), the scheduler's queue, and
//! a recheck beside a claim in flight (on the in-memory store).
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

/// The job table's queue holds each job once, at its `next`, through every
/// change: the scheduler's due jobs and next instant are read from it
/// alone, so one left behind or missing would fire a job at a stale
/// instant or never.
#[test]
fn the_scheduler_queue_follows_every_next() {
    let at = |s: i64| chrono::TimeZone::timestamp_opt(&Utc, 1_800_000_000 + s, 0).unwrap();
    let name = |n: &str| JobName::parse(n).unwrap();
    let entry = |n: &str, next: Option<DateTime<Utc>>| JobEntry {
        state: Arc::new(JobState::new(crate::config::test_job(
            n,
            "* * * * * *",
            "/bin/true",
        ))),
        next,
        handlers_stop: CancellationToken::new(),
        allowed: true,
    };
    let in_step = |t: &JobTable| {
        let queued: Vec<(DateTime<Utc>, JobName)> = t.queue.iter().cloned().collect();
        let mut expected: Vec<(DateTime<Utc>, JobName)> = t
            .by_name
            .iter()
            .filter_map(|(n, e)| Some((e.next?, n.clone())))
            .collect();
        expected.sort();
        assert_eq!(queued, expected);
    };
    let mut t = JobTable::default();
    t.insert(name("c"), entry("c", Some(at(3))));
    t.insert(name("b"), entry("b", Some(at(1))));
    t.insert(name("a"), entry("a", Some(at(1))));
    t.insert(name("idle"), entry("idle", None));
    in_step(&t);
    assert_eq!(t.next_instant(), Some(at(1)));
    // Replaced: the old instant leaves the queue.
    t.insert(name("c"), entry("c", Some(at(5))));
    in_step(&t);
    t.set_next(&name("idle"), Some(at(2)));
    t.set_next(&name("b"), None);
    in_step(&t);
    // Due at 2: `a` (at 1) and `idle` (at 2), in name order; taken off
    // until put back.
    let due = t.take_due_names(at(2));
    assert_eq!(due, vec![name("a"), name("idle")]);
    assert_eq!(t.next_instant(), Some(at(5)));
    t.requeue(name("a"), Some(at(4)));
    t.requeue(name("idle"), None);
    in_step(&t);
    assert_eq!(t.next_instant(), Some(at(4)));
    assert!(t.take_due_names(at(3)).is_empty());
    assert!(t.remove(&name("a")).is_some());
    in_step(&t);
    assert_eq!(t.next_instant(), Some(at(5)));
    assert!(t.remove(&name("a")).is_none());
}

/// A claim of the job in flight when a recheck of an unanswered claim is
/// due (the next occurrence's retry, say, whose answer is still to come):
/// the recheck waits for it, as every claim of the job waits for the one
/// before. That claim was handed the unanswered win again as its catch-up
/// (fence 1) and runs it; the recheck then asks with the fence floor that
/// win raised and records nothing. Sent beside it, the recheck was answered
/// `Won` for fence 1 too and recorded it `lease_lost`, ending the lease of
/// the run going on: a peer ran the next occurrence beside it
/// (`partition::mysql::flapping`).
#[cfg(feature = "memory")]
#[tokio::test(start_paused = true)]
async fn a_recheck_waits_for_the_claim_in_flight_and_records_nothing_it_won() {
    use crate::store::memory::MemoryStore;
    use crate::store::{ClaimOutcome, ClaimRequest, Locks};
    let at = |s: i64| chrono::TimeZone::timestamp_opt(&Utc, 1_800_000_000 + s, 0).unwrap();
    let store = MemoryStore::starting_at(at(0));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.toml");
    std::fs::write(
        &path,
        format!(
            "node = \"a\"\n[store]\nurl = \"sqlite://{}/unused.db\"\n[[job]]\nname = \"j\"\nschedule = \"0 0 0 1 1 *\"\ncommand = [\"/bin/true\"]\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let config = crate::config::load(&path, &crate::config::Overrides::default()).unwrap();
    let node = Node::with_parts(
        &config,
        Arc::new(store.connection()),
        NodeParts::in_process(
            Arc::new(crate::wallclock::TokioClock::starting_at(at(0))),
            Arc::new(crate::exec::ProcessRunner::with_cgroups()),
        ),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let (node, shutdown) = (node.clone(), shutdown.clone());
        let jobs = config.jobs.clone();
        async move { node.run(jobs, shutdown).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The store granted this node the occurrence at(0) (fence 1); the
    // reply never came.
    let (occurrence, next) = (at(0), at(10));
    let granted = store
        .connection()
        .claim(&[ClaimRequest {
            job: crate::config::JobName::parse("j").unwrap(),
            occurrence,
            previous: None,
            before_previous: None,
            misfire: crate::config::Misfire::RunOnce,
            owner: node.owner().clone(),
            lease: Duration::from_secs(11),
            fence_floor: 0,
            max_offset: Duration::from_secs(1),
            head_start: None,
            after_unanswered: false,
            recheck_only: false,
            window_end: None,
            manual: None,
            redeliver: false,
        }])
        .await
        .unwrap();
    assert!(matches!(&granted.outcomes[..], [ClaimOutcome::Won(w)] if w.fence == 1));
    let state = node.state_of("j").unwrap();
    // A claim of the job is in flight: it holds the job's claim gate.
    let in_flight = state.claim_gate.clone().lock_owned().await;
    let claims = store.calls("claim");
    let recheck = tokio::spawn({
        let (node, state, stop) = (node.clone(), state.clone(), shutdown.clone());
        async move {
            node.recheck_unanswered(&state, &stop, occurrence, None, Some(next), false)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.calls("claim"), claims, "no recheck beside the claim");
    // Its answer: fence 1, the unanswered win as its catch-up, run now
    // (`on_won` raises the floor first).
    state.saw_fence(1);
    drop(in_flight);
    recheck.await.unwrap();
    assert_eq!(store.calls("claim"), claims + 1, "the recheck was sent");
    // Past the history writes' gathering window.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        store.history_len(),
        0,
        "the recheck recorded the fence a run of this node holds: {:?}",
        store.history_outcomes("j")
    );
    shutdown.cancel();
    task.await.unwrap();
}
