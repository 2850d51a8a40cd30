//! Unit tests of the node: the watchdog's stuck check, the local lease
//! deadline and renewal point (pure arithmetic), the scheduler's queue
//! through reloads and instants, a recheck beside a claim in flight (on
//! the in-memory store), and the size of what each run and claim in flight
//! holds.
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

/// The config `text` as loaded from a file `a.toml` in `dir`.
#[cfg(feature = "memory")]
fn config_in(dir: &std::path::Path, text: &str) -> Config {
    let path = dir.join("a.toml");
    std::fs::write(&path, text).unwrap();
    crate::config::load(&path, &crate::config::Overrides::default()).unwrap()
}

/// The config of node `a` with one job, `j`, on `schedule`, running
/// `/bin/true` (its SQLite URL unused: the tests give the node a store).
#[cfg(feature = "memory")]
fn one_job_config(dir: &std::path::Path, schedule: &str) -> Config {
    config_in(
        dir,
        &format!(
            "node = \"a\"\n[store]\nurl = \"sqlite://{}/unused.db\"\n[[job]]\nname = \"j\"\nschedule = \"{schedule}\"\ncommand = [\"/bin/true\"]\n",
            dir.display()
        ),
    )
}

/// A node of `config` on `store`, its clocks tokio's from `start`, its
/// jobs run as processes.
#[cfg(feature = "memory")]
fn node_in_process(
    config: &Config,
    store: &crate::store::memory::MemoryStore,
    start: DateTime<Utc>,
) -> Arc<Node> {
    Node::with_parts(
        config,
        Arc::new(store.connection()),
        NodeParts::in_process(
            Arc::new(crate::wallclock::TokioClock::starting_at(start)),
            Arc::new(crate::exec::ProcessRunner::with_cgroups()),
        ),
    )
}

/// The scheduler reads its due jobs and next instant from the job table's
/// queue alone: after every kind of reload (a job added, changed, moved
/// off this node by `run_on` and back, removed, added again) and every
/// instant taken, the queue holds each job once, at its next occurrence.
/// One left behind would fire at a stale instant; one missing, never.
#[cfg(feature = "memory")]
#[tokio::test(start_paused = true)]
async fn the_scheduler_queue_follows_every_reload_and_instant() {
    use crate::store::memory::MemoryStore;
    let at = |s: i64| chrono::TimeZone::timestamp_opt(&Utc, 1_800_000_000 + s, 0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let write = |jobs: &str| {
        config_in(
            dir.path(),
            &format!(
                "[node]\nname = \"a\"\ntags = [\"x\"]\n[store]\nurl = \"sqlite://{}/unused.db\"\n{jobs}",
                dir.path().display()
            ),
        )
    };
    let job = |name: &str, schedule: &str, run_on: &str| {
        let run_on = if run_on.is_empty() {
            String::new()
        } else {
            format!("run_on = [{run_on}]\n")
        };
        format!(
            "[[job]]\nname = \"{name}\"\nschedule = \"{schedule}\"\ncommand = [\"/bin/true\"]\n{run_on}"
        )
    };
    let config = write(
        &[
            job("a", "*/10 * * * * *", ""),
            job("b", "0 * * * * *", ""),
            job("c", "30 * * * * *", ""),
        ]
        .concat(),
    );
    let node = node_in_process(&config, &MemoryStore::starting_at(at(0)), at(0));
    let in_step = |node: &Node| {
        let jobs = node.jobs.lock().unwrap();
        assert!(jobs.in_step(), "queue out of step");
        jobs.iter()
            .map(|(n, e)| (n.as_str().to_string(), e.next()))
            .collect::<Vec<_>>()
    };
    node.apply_jobs(config.jobs);
    assert_eq!(node.next_instant(), Some(at(10)));
    in_step(&node);
    // Instants: at 10 only `a` is due; at 31 `a` (its latest, 30), `c`
    // (30), not `b` (60).
    let due: Vec<String> = node
        .take_due(at(10))
        .iter()
        .map(|d| d.state.job().name.to_string())
        .collect();
    assert_eq!(due, ["a"]);
    in_step(&node);
    let due: Vec<String> = node
        .take_due(at(31))
        .iter()
        .map(|d| d.state.job().name.to_string())
        .collect();
    assert_eq!(due, ["a", "c"]);
    let nexts = in_step(&node);
    assert_eq!(
        nexts,
        [
            ("a".into(), Some(at(40))),
            ("b".into(), Some(at(60))),
            ("c".into(), Some(at(90)))
        ]
    );
    // `a` changed, `b` needs a tag this node lacks, `c` removed, `d` new.
    node.apply_jobs(
        write(
            &[
                job("a", "*/15 * * * * *", ""),
                job("b", "0 * * * * *", "\"y\""),
                job("d", "50 * * * * *", ""),
            ]
            .concat(),
        )
        .jobs,
    );
    let nexts = in_step(&node);
    assert_eq!(nexts[0].0, "a");
    assert_eq!(nexts[1], ("b".into(), None));
    assert_eq!(nexts[2].0, "d");
    assert_eq!(nexts.len(), 3);
    // `b` claimable here again, `c` back.
    node.apply_jobs(
        write(
            &[
                job("a", "*/15 * * * * *", ""),
                job("b", "0 * * * * *", "\"x\""),
                job("c", "30 * * * * *", ""),
                job("d", "50 * * * * *", ""),
            ]
            .concat(),
        )
        .jobs,
    );
    let nexts = in_step(&node);
    assert!(nexts.iter().all(|(_, next)| next.is_some()), "{nexts:?}");
    assert_eq!(
        node.next_instant(),
        nexts.iter().filter_map(|(_, n)| *n).min()
    );
    let due = node.take_due(at(3600));
    assert_eq!(due.len(), 4);
    in_step(&node);
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
    let config = one_job_config(dir.path(), "0 0 0 1 1 *");
    let node = node_in_process(&config, &store, at(0));
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

/// What every run and every claim in flight holds: at an instant where a
/// thousand jobs are due together, a thousand claim handlers wait for the
/// instant's batch, then a thousand runs' tasks wait for their records'
/// batch (issue 35, item 6: memory per job at the `:00` peak). Their large,
/// short-lived steps (what follows a record, a broadcast's dispatch, a
/// skipped occurrence's record, a late recheck, the run's events) are
/// boxed, so each task holds only the state of the step it is in. Without
/// the boxes a debug build's run task was 3,928 bytes and a claim handler
/// 2,088, with them 1,992 and 1,560 (rustc 1.95; the limits below are for
/// debug builds, which the tests are, and may need a look with another
/// compiler). And every node keeps every job's definition, its rarely set
/// parts apart (640 bytes before, 400 after).
#[cfg(feature = "memory")]
#[tokio::test(start_paused = true)]
async fn runs_and_claims_in_flight_hold_small_tasks() {
    use crate::store::memory::MemoryStore;
    let at = |s: i64| chrono::TimeZone::timestamp_opt(&Utc, 1_800_000_000 + s, 0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = one_job_config(dir.path(), "*/10 * * * * *");
    let node = node_in_process(&config, &MemoryStore::starting_at(at(0)), at(0));
    node.apply_jobs(config.jobs);
    let due = node.take_due(at(10)).pop().unwrap();
    let ticket = run::RunTicket {
        fence: 1,
        occurrence: due.occurrence,
        takeover: false,
        decision_ms: 0,
        trigger: None,
    };
    let run = node.clone().run_task(due.state.clone(), ticket, false);
    let handler = node.clone().handle_occurrence(due, None, None);
    let (run, handler) = (std::mem::size_of_val(&run), std::mem::size_of_val(&handler));
    println!("a run's task: {run} bytes, a claim handler: {handler} bytes");
    const RUN_TASK_MAX: usize = 2304;
    const HANDLER_MAX: usize = 1792;
    assert!(run <= RUN_TASK_MAX, "a run's task is {run} bytes");
    assert!(handler <= HANDLER_MAX, "a claim handler is {handler} bytes");
    let job = std::mem::size_of::<crate::config::Job>();
    assert!(job <= 400, "a job's definition is {job} bytes");
}
