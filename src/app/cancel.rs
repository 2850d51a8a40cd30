//! `cronlease cancel`: stops the job's runs going now, on whichever node
//! runs each (a request per run that its node takes from the store's
//! outbox: [`crate::cancel`]), and waits for their records; withdraws the
//! job's pending request instead when no run is going.

use std::collections::BTreeMap;

use super::*;
use crate::cancel::CancelRequest;
use crate::store::Parcel;

/// How often the records of the runs asked for are looked for.
const LOOK_EVERY: Duration = Duration::from_millis(250);

/// How long past the job's `kill_grace` a run's record may take to come:
/// the node's look for requests (500 ms), the batch that writes the record.
const RECORD_WAIT: Duration = Duration::from_secs(10);

pub(super) async fn cancel(path: PathBuf, job: JobName, reason: Option<String>) -> ExitCode {
    let (config, store) = match config_and_store(&path).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    let nodes = match within(&config, store.nodes()).await {
        Ok(nodes) => nodes,
        Err(e) => return store_failure(&e),
    };
    let by = crate::cancel::who_am_i();
    // Per fence: the owner running it, its node, the request.
    let asked: BTreeMap<u64, (String, String, CancelRequest)> = nodes
        .iter()
        .flat_map(|n| {
            n.running.iter().filter(|r| r.job == job.as_str()).map(|r| {
                let request = CancelRequest::new(&job, r.fence, &by, reason.as_deref());
                (r.fence, (n.owner.clone(), n.node.clone(), request))
            })
        })
        .collect();
    if asked.is_empty() {
        let pending = match within(&config, store.pending_triggers()).await {
            Ok(pending) => pending,
            Err(e) => return store_failure(&e),
        };
        if pending.iter().any(|(j, _)| j == job.as_str()) {
            return cancel_trigger(path, job).await;
        }
        eprintln!(
            "cronlease: no run of {job} is going (as the live nodes' last beats say) and no request of it is pending: nothing to cancel"
        );
        return ExitCode::FAILURE;
    }
    let parcels: Vec<Parcel> = asked
        .values()
        .map(|(owner, _, request)| request.parcel(owner))
        .collect();
    if let Err(e) = within(&config, store.hand_over(&parcels)).await {
        return store_failure_with(&e, "the cancel may or may not have been asked for");
    }
    for (fence, (_, node, _)) in &asked {
        println!("{job}: cancel of its run on {node} (fence {fence}) asked by {by}");
    }
    let grace = config
        .job(job.as_str())
        .map_or(Duration::ZERO, |j| j.kill_grace);
    let deadline = tokio::time::Instant::now() + grace + RECORD_WAIT;
    let mut left = asked;
    let mut all_cancelled = true;
    while !left.is_empty() {
        if tokio::time::Instant::now() >= deadline {
            return not_recorded(&config, store.as_ref(), &job, &left).await;
        }
        tokio::time::sleep(LOOK_EVERY).await;
        let keep = config.store.history_limit.max(1);
        let Ok(runs) = within(&config, store.history(Some(&job), keep)).await else {
            continue;
        };
        for run in runs {
            if left.remove(&run.fence).is_none() {
                continue;
            }
            let exit = run
                .exit_code
                .map_or(String::new(), |c| format!(" (exit code {c})"));
            if run.outcome == store::Outcome::Cancelled {
                println!(
                    "{job}: its run on {} (fence {}) cancelled{exit}",
                    run.node, run.fence
                );
            } else {
                all_cancelled = false;
                println!(
                    "{job}: its run on {} (fence {}) ended {}{exit} before the cancel reached it",
                    run.node, run.fence, run.outcome
                );
            }
        }
    }
    if all_cancelled {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Takes back the requests of the runs with no record yet (a node that
/// died, or stopped without recording them), so none is acted on later,
/// and says so.
async fn not_recorded(
    config: &Config,
    store: &dyn store::Store,
    job: &JobName,
    left: &BTreeMap<u64, (String, String, CancelRequest)>,
) -> ExitCode {
    let taker = store::Owner::from_raw(format!("cancel#{}", std::process::id()));
    for (fence, (owner, node, request)) in left {
        let id = request.parcel(owner).id;
        let taken_back = matches!(
            within(config, store.take_handed_over(&taker, &id, 1)).await,
            Ok(back) if !back.is_empty()
        );
        let what = if taken_back {
            "nobody took the request (taken back)"
        } else {
            "its node took the request"
        };
        eprintln!(
            "cronlease: no record of {job}'s run on {node} (fence {fence}) yet: {what}; `cronlease status` shows whether it is still going"
        );
    }
    ExitCode::FAILURE
}
