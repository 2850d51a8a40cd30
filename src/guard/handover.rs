//! What the guard does for a daemon that died (docs/protocol.md,
//! "Redelivery" and "Hooks and events a daemon could not give"): once the
//! runs' processes are gone, it records the runs that were going `killed`
//! and the claims the daemon never started `not_started`, hands those back
//! as redelivery requests, releases the leases, looks for claims the daemon
//! won and never heard of, and keeps the `on_failure` and events of the
//! final ones for the node's next daemon ([`super::owed`]).

use super::server::wait_gone;
use super::*;

/// Whether the guard hands back the claims a dead daemon never started:
/// always, but in a test build (`failpoints`) with
/// `CRONLEASE_FAILPOINT_NO_HANDBACK` set, as before redelivery (the
/// kill-anywhere drill's figures without it).
pub(super) fn hands_back() -> bool {
    #[cfg(feature = "failpoints")]
    if std::env::var_os("CRONLEASE_FAILPOINT_NO_HANDBACK").is_some() {
        return false;
    }
    true
}

/// In a test build (`failpoints`) with
/// `CRONLEASE_FAILPOINT_GUARD_RECORD_ANSWER_LOST` set, the first write of
/// the records commits and then fails as a timeout would (a disk stall past
/// `op_timeout`, seen in CI). Never otherwise.
fn answer_lost(_try: u32) -> Result<(), String> {
    #[cfg(feature = "failpoints")]
    if _try == 1 && std::env::var_os("CRONLEASE_FAILPOINT_GUARD_RECORD_ANSWER_LOST").is_some() {
        return Err("recording its runs: the answer lost after the commit (failpoint)".into());
    }
    Ok(())
}

/// What a dead daemon left: the runs that were going (killed now), and the
/// claims it won and never started.
pub(super) struct Left {
    pub(super) runs: Vec<RunNote>,
    pub(super) unstarted: Vec<RunNote>,
    /// Per job, the highest fence the daemon told of (claimed, started or
    /// settled): a claim above it the daemon never heard of. `None`: not
    /// looked for.
    pub(super) known: Option<HashMap<String, u64>>,
}

/// The request that hands `claim` back (docs/protocol.md, "Redelivery"):
/// a scheduled occurrence's first attempt, a retry's attempt, or a
/// redelivery once more (a new generation, at most [`MAX_REDELIVERIES`]);
/// `None` for an operator's manual run, which is not asked for again.
pub(super) fn redelivery_for(claim: &RunNote) -> Option<TriggerId> {
    match claim.trigger.and_then(TriggerId::from_stored) {
        None => TriggerId::redelivery(claim.occurrence, 1, 1),
        Some(id) => match (id.retry_of(), id.redelivery_of()) {
            (Some((attempt, due)), _) => TriggerId::redelivery(due, attempt, 1),
            (_, Some(r)) => TriggerId::redelivery(r.due, r.attempt, r.generation + 1),
            _ => None,
        },
    }
}

/// The record of a claim handed back, and its request (if any).
fn unstarted_record(
    claim: RunNote,
    owner: &str,
    node: &str,
    at: chrono::DateTime<chrono::Utc>,
) -> (RunRecord, Option<TriggerId>) {
    let again = redelivery_for(&claim);
    let what = match (again, claim.trigger.and_then(TriggerId::from_stored)) {
        (Some(id), _) => format!("handed back: one node runs it again (trigger {id})"),
        (None, Some(id)) if id.is_operators() => format!(
            "a manual run (trigger {id}) is not asked for again: `cronlease trigger {}` asks for another",
            claim.job
        ),
        (None, _) => format!("handed back {MAX_REDELIVERIES} times already: not again"),
    };
    let record = RunRecord {
        delay_ms: 0,
        job: claim.job,
        fence: claim.fence,
        owner: owner.to_string(),
        node: node.to_string(),
        occurrence: claim.occurrence,
        started_at: at,
        finished_at: at,
        outcome: Outcome::NotStarted,
        exit_code: None,
        takeover: claim.takeover,
        decision_ms: claim.decision_ms,
        output: format!(
            "cronlease: not_started: the daemon died after winning this claim and before starting its run; {what}"
        ),
        trigger: claim.trigger.and_then(TriggerId::from_stored),
        cpu_ms: None,
        memory_peak: None,
    };
    (record, again)
}

/// A request that hands a claim back: the job, the request, the claim's
/// fence.
type Again = (JobName, TriggerId, u64);

/// The records of claims the daemon never started, and the requests that
/// hand them back ([`unstarted_record`]).
fn back(
    claims: Vec<RunNote>,
    owner: &str,
    node: &str,
    at: chrono::DateTime<chrono::Utc>,
) -> (Vec<RunRecord>, Vec<Again>) {
    let mut records = Vec::with_capacity(claims.len());
    let mut again = Vec::new();
    for claim in claims {
        let (record, id) = unstarted_record(claim, owner, node, at);
        if let (Some(id), Ok(job)) = (id, JobName::parse(&record.job)) {
            again.push((job, id, record.fence));
        }
        records.push(record);
    }
    (records, again)
}

/// Writes the requests that hand claims back, all at once; answers the
/// claims (job, fence) the store took them for, and says why of each it
/// did not.
async fn ask_again(
    store: &dyn crate::store::Store,
    again: &[Again],
    within: std::time::Duration,
) -> Vec<(String, u64)> {
    let asked = futures_util::future::join_all(
        again
            .iter()
            .map(|(job, id, _)| bounded(within, store.request_trigger(job, *id))),
    )
    .await;
    let mut taken = Vec::new();
    for ((job, id, fence), answer) in again.iter().zip(asked) {
        match answer {
            Ok(crate::store::TriggerAnswer::Accepted) => taken.push((job.to_string(), *fence)),
            Ok(refused) => tracing::error!(
                process = "guard",
                "the claim of {job} the daemon never started is not handed back (trigger {id}): the store refused the request ({refused:?})"
            ),
            Err(e) => tracing::error!(
                process = "guard",
                "the claim of {job} the daemon never started is not handed back (trigger {id}): {e}"
            ),
        }
    }
    taken
}

/// The claims of `jobs` the store says `owner` won last, at a fence above
/// any the daemon told its guard of (`known`): won with the answer on its
/// way when the daemon died, so never started. Their occurrence is the
/// lock's last one (a manual claim's, which leaves it, is then an older
/// occurrence: its redelivery is ended `missed`, never run).
pub(super) fn unheard_claims(
    locks: Vec<crate::store::LockStatus>,
    known: &HashMap<String, u64>,
    owner: &Owner,
    jobs: &[JobName],
) -> Vec<RunNote> {
    let ours: BTreeSet<&str> = jobs.iter().map(JobName::as_str).collect();
    let now = chrono::Utc::now();
    locks
        .into_iter()
        .filter(|l| {
            ours.contains(l.job.as_str())
                && l.last_owner.as_deref() == Some(owner.as_str())
                && l.fence > known.get(&l.job).copied().unwrap_or(0)
        })
        .filter_map(|l| {
            Some(RunNote {
                occurrence: l.last_occurrence?,
                job: l.job,
                fence: l.fence,
                takeover: false,
                decision_ms: 0,
                started_at: now,
                trigger: None,
            })
        })
        .collect()
}

/// The daemon died without releasing: once its jobs' processes are gone,
/// records the runs they were `killed` and the claims it never started
/// `not_started`, asks for each of those to run again (a redelivery's
/// request, [`redelivery_for`]), releases the owner's leases
/// (owner-checked) and takes the owner out of the node registry, so peers
/// claim the next occurrences, and the handed-back ones, at once; then keeps
/// the `on_failure` and events of the records that are final for the
/// node's next daemon ([`owe`]). A store that cannot be reached is said
/// once; the leases then expire as they would without a guard, the claims
/// never started are not run again, and every record is owed.
pub(super) fn hand_over(
    handover: Handover,
    jobs: &BTreeSet<String>,
    left: Left,
    doomed: &BTreeMap<i32, u64>,
    died: std::time::Instant,
) {
    let Left {
        runs,
        unstarted,
        known,
    } = left;
    if !wait_gone(doomed, GONE_WITHIN) {
        tracing::warn!(
            process = "guard",
            "the daemon died and processes of its jobs are still there after {GONE_WITHIN:?}: its leases are left to expire"
        );
        return;
    }
    let finished_at = chrono::Utc::now();
    let Handover {
        store,
        owner,
        node,
        keep,
        owed_dir,
        notify_dir,
        ..
    } = handover;
    let mut records: Vec<RunRecord> = runs
        .into_iter()
        .map(|r| RunRecord {
            delay_ms: (r.started_at - r.occurrence).num_milliseconds().max(0) as u64,
            job: r.job,
            fence: r.fence,
            owner: owner.clone(),
            node: node.clone(),
            occurrence: r.occurrence,
            started_at: r.started_at,
            finished_at,
            outcome: Outcome::Killed,
            exit_code: Some(128 + Signal::SIGKILL as i32),
            takeover: r.takeover,
            decision_ms: r.decision_ms,
            output: String::new(),
            trigger: r.trigger.and_then(crate::store::TriggerId::from_stored),
            cpu_ms: None,
            memory_peak: None,
        })
        .collect();
    let killed = records.len();
    let (unstarted_records, again) = back(unstarted, &owner, &node, finished_at);
    let unstarted = unstarted_records.len();
    records.extend(unstarted_records);
    let jobs: Vec<JobName> = jobs.iter().filter_map(|j| JobName::parse(j).ok()).collect();
    let owner = Owner::from_raw(owner);
    let config = store.into_config();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!(process = "guard", "the daemon died; cannot hand over: {e}");
            owe(owed_dir.as_deref(), &records, &[]);
            return;
        }
    };
    // The claims handed back to run again; whether what `records` are owed
    // is kept yet.
    let mut taken: Vec<(String, u64)> = Vec::new();
    let mut owed = false;
    let handed = runtime.block_on(async {
        let within = config.op_timeout;
        // Bounded like every call: a store that accepts the connection and
        // never answers must not keep the guard (and the host's view of
        // the daemon) alive.
        let store = bounded(within, crate::store::connect(&config))
            .await
            .map_err(|e| format!("connecting: {e}"))?;
        let call = |what: &'static str| move |e: StoreError| format!("{what}: {e}");
        let tries = std::cell::Cell::new(0u32);
        let record = || async {
            tries.set(tries.get() + 1);
            match records.is_empty() {
                true => Ok(()),
                false => bounded(within, store.record_runs(&records, keep))
                    .await
                    .map_err(call("recording its runs"))
                    .and_then(|()| answer_lost(tries.get())),
            }
        };
        let mut recorded = record().await;
        // After the records (which end the claims' running marks, so the
        // store takes a request) and before the release (so no peer claims
        // the next occurrence in between and then sees the request).
        taken.extend(ask_again(store.as_ref(), &again, within).await);
        // Released whether or not the history write went through: the
        // jobs are gone, nothing runs on these leases any more.
        let released = bounded(within, store.release(&jobs, &owner))
            .await
            .map_err(call("releasing its leases"));
        // What the final records are owed, kept now: after the peers'
        // takeover (which waits for no disk), before the look below, so a
        // next daemon started meanwhile finds it sooner.
        owe(owed_dir.as_deref(), &records, &taken);
        owed = true;
        let released = released?;
        // A write that timed out may have committed (as one 1.4 s disk
        // stall in CI did): the store then took every hand-back request,
        // which it takes only once the records ended the claims' running
        // marks. So written once more (idempotent: one record per job and
        // fence) when the store answered the release and took them all; a
        // refused request means the records are not there, and written now
        // they would say the claim was handed back, which it was not.
        if recorded.is_err() && taken.len() == again.len() {
            recorded = record().await;
        }
        // Claims the daemon won and never heard of (killed with the answer
        // on its way): the store names this owner the job's last one, at a
        // fence the daemon never told. After the release, so the peers'
        // takeover does not wait for this read.
        let unheard = match known.as_ref() {
            None => Ok(Vec::new()),
            Some(known) => bounded(within, store.status())
                .await
                .map(|locks| unheard_claims(locks, known, &owner, &jobs)),
        };
        let unheard = match unheard {
            Ok(unheard) => unheard,
            Err(e) => {
                tracing::error!(process = "guard", "claims the daemon may have won and never heard of are not looked for: {e}"
                );
                Vec::new()
            }
        };
        let heard_of_none = unheard.len();
        let mut handed_back_unheard = 0;
        if !unheard.is_empty() {
            let names: Vec<JobName> = unheard
                .iter()
                .filter_map(|c| JobName::parse(&c.job).ok())
                .collect();
            let (records, again) = back(unheard, owner.as_str(), &node, chrono::Utc::now());
            if let Err(e) = bounded(within, store.record_runs(&records, keep)).await {
                tracing::error!(process = "guard", "the claims the daemon won and never heard of are not recorded: {e}"
                );
            }
            let unheard_taken = ask_again(store.as_ref(), &again, within).await;
            owe(owed_dir.as_deref(), &records, &unheard_taken);
            handed_back_unheard = unheard_taken.len();
            // A claim the store decided after the release above holds a
            // live lease still.
            let _ = bounded(within, store.release(&names, &owner)).await;
        }
        let _ = bounded(within, store.leave(&owner)).await;
        // Last: peers' takeover and the records come first.
        if let Some(dir) = notify_dir.as_deref() {
            match crate::webhook::hand_over_spool(store.as_ref(), dir, within).await {
                Ok(0) => {}
                Ok(n) => tracing::warn!(process = "guard", "{n} webhook deliveries the daemon had not made handed over: a node with webhooks sends them"
                ),
                Err(e) => tracing::error!(process = "guard", "webhook deliveries not handed over ({e}): the node's next daemon sends them"
                ),
            }
        }
        Ok::<_, String>((
            released,
            taken.len() + handed_back_unheard,
            heard_of_none,
            recorded,
        ))
    });
    let took = died.elapsed().as_millis();
    if !owed {
        // The store could not be reached: no record was written and nothing
        // handed back, but the runs ended all the same.
        owe(owed_dir.as_deref(), &records, &taken);
    }
    match handed {
        Ok((released, handed_back, unheard, Ok(()))) => tracing::warn!(
            process = "guard",
            "the daemon died: {killed} interrupted runs recorded killed, {} claims it never started recorded not_started ({unheard} of them it never heard of; {handed_back} handed back to run again), {released} leases released, {took} ms after its death",
            unstarted + unheard
        ),
        // Handed over, but the history lacks the records: said apart, so
        // the line does not claim a record the history does not have, nor
        // an expiry that a release made needless.
        Ok((released, handed_back, unheard, Err(e))) => tracing::error!(
            process = "guard",
            "the daemon died: {killed} interrupted runs and {unstarted} claims it never started are not in the history ({e}; their on_failure and events are kept for the node's next daemon); {handed_back} claims handed back to run again ({unheard} of them never heard of), {released} leases released, {took} ms after its death"
        ),
        Err(e) => tracing::error!(
            process = "guard",
            "the daemon died; handing over failed after {took} ms ({e}): its leases expire as they would without a guard"
        ),
    }
}

/// Keeps, for the node's next daemon, the `on_failure` and events of the
/// runs the guard recorded (`records`) but those handed back to run again
/// (`taken`: job and fence), whose run on a peer has its own
/// ([`super::owed`]). After the hand-over: it waits for no disk.
fn owe(dir: Option<&std::path::Path>, records: &[RunRecord], taken: &[(String, u64)]) {
    let Some(dir) = dir else {
        return;
    };
    let at = chrono::Utc::now();
    let owed: Vec<super::owed::Owed> = final_records(records, taken)
        .map(|r| super::owed::Owed::of_record(r, at))
        .collect();
    for problem in super::owed::write_owed(dir, &owed) {
        tracing::error!(
            process = "guard",
            "the on_failure and events of a run it recorded are lost: {problem}"
        );
    }
}

/// The records whose outcome is their occurrence's last: all but the
/// claims handed back to run again (`taken`).
fn final_records<'a>(
    records: &'a [RunRecord],
    taken: &'a [(String, u64)],
) -> impl Iterator<Item = &'a RunRecord> {
    let taken: std::collections::HashSet<(&str, u64)> = taken
        .iter()
        .map(|(job, fence)| (job.as_str(), *fence))
        .collect();
    records
        .iter()
        .filter(move |r| !taken.contains(&(r.job.as_str(), r.fence)))
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    pub(in crate::guard) fn claim(job: &str, fence: u64, trigger: Option<TriggerId>) -> RunNote {
        let at = chrono::DateTime::from_timestamp(1_790_000_000, 0).unwrap();
        RunNote {
            job: job.into(),
            fence,
            occurrence: at,
            takeover: false,
            decision_ms: 3,
            started_at: at,
            trigger: trigger.map(TriggerId::get),
        }
    }

    #[test]
    fn a_claim_the_store_gave_the_dead_owner_above_every_fence_it_told_is_one_it_never_heard_of() {
        let at = chrono::DateTime::from_timestamp(1_790_000_000, 0).unwrap();
        let owner = Owner::from_raw("n1#dead");
        let lock = |job: &str, fence: u64, last_owner: &str| crate::store::LockStatus {
            job: job.into(),
            holder: None,
            lease_remaining_ms: 0,
            fence,
            last_occurrence: Some(at),
            last_owner: Some(last_owner.into()),
            paused: false,
        };
        let locks = vec![
            lock("told", 5, "n1#dead"),
            lock("unheard", 9, "n1#dead"),
            lock("never-told", 1, "n1#dead"),
            lock("peers", 12, "n2#live"),
            lock("not-ours", 3, "n1#dead"),
        ];
        let known = HashMap::from([("told".to_string(), 5), ("unheard".to_string(), 8)]);
        let jobs: Vec<JobName> = ["told", "unheard", "never-told", "peers"]
            .iter()
            .map(|j| JobName::parse(j).unwrap())
            .collect();
        let found: Vec<(String, u64)> = unheard_claims(locks, &known, &owner, &jobs)
            .into_iter()
            .map(|c| (c.job, c.fence))
            .collect();
        assert_eq!(
            found,
            vec![("unheard".to_string(), 9), ("never-told".to_string(), 1)]
        );
    }

    #[test]
    fn a_claim_is_handed_back_as_its_attempt_up_to_the_last_generation_and_a_manual_run_is_not() {
        let at = chrono::DateTime::from_timestamp(1_790_000_000, 0).unwrap();
        let first = redelivery_for(&claim("j", 1, None)).unwrap();
        assert_eq!(
            first.redelivery_of(),
            Some(crate::store::Redelivery {
                attempt: 1,
                due: at,
                generation: 1
            })
        );
        let retry = TriggerId::retry(at + chrono::Duration::seconds(30), 3);
        let of_retry = redelivery_for(&claim("j", 2, Some(retry))).unwrap();
        assert_eq!(
            of_retry.redelivery_of().map(|r| (r.attempt, r.generation)),
            Some((3, 1))
        );
        let mut id = first;
        for generation in 2..=MAX_REDELIVERIES {
            id = redelivery_for(&claim("j", 3, Some(id))).unwrap();
            assert_eq!(id.redelivery_of().map(|r| r.generation), Some(generation));
        }
        assert_eq!(redelivery_for(&claim("j", 4, Some(id))), None);
        assert_eq!(
            redelivery_for(&claim("j", 5, Some(TriggerId::made_at(at)))),
            None
        );
        let (record, again) =
            unstarted_record(claim("j", 5, Some(TriggerId::made_at(at))), "o", "n", at);
        assert_eq!((record.outcome, again), (Outcome::NotStarted, None));
        assert!(
            record
                .output
                .contains("`cronlease trigger j` asks for another"),
            "{}",
            record.output
        );
    }

    #[test]
    fn the_guard_owes_on_failure_for_every_record_but_the_claims_handed_back() {
        let at = chrono::DateTime::from_timestamp(1_790_000_000, 0).unwrap();
        // Two claims never started: one is asked for again, one (an
        // operator's manual run) is not.
        let (records, again) = back(
            vec![
                claim("a", 4, None),
                claim("b", 6, Some(TriggerId::made_at(at))),
            ],
            "o",
            "n",
            at,
        );
        assert_eq!(again.len(), 1);
        let taken: Vec<(String, u64)> = again
            .iter()
            .map(|(job, _, fence)| (job.to_string(), *fence))
            .collect();
        let finals: Vec<(&str, u64)> = final_records(&records, &taken)
            .map(|r| (r.job.as_str(), r.fence))
            .collect();
        assert_eq!(finals, vec![("b", 6)]);
        // A request the store refused hands nothing back: both are owed.
        assert_eq!(final_records(&records, &[]).count(), 2);
        let dir = tempfile::tempdir().unwrap();
        let owed_here = dir.path().join("owed-n");
        owe(Some(&owed_here), &records, &taken);
        let (found, problems) =
            crate::spool::Spool::at(&owed_here).load::<super::super::owed::Owed>();
        assert!(problems.is_empty(), "{problems:?}");
        let found: Vec<(&str, u64, &str, bool)> = found
            .iter()
            .map(|o| (o.job.as_str(), o.fence, o.outcome.as_str(), o.events))
            .collect();
        assert_eq!(found, vec![("b", 6, "not_started", true)]);
    }
}
