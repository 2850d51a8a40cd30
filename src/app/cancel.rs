//! `cronlease cancel`: asks the job's runs going now to stop, on whichever
//! node runs each ([`crate::actions::cancel`]), and waits for their
//! records; withdraws the job's pending request instead when no run is
//! going.

use std::collections::BTreeMap;

use super::*;
use crate::actions::{Cancel, CancelAsked};

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
    let actor = crate::actions::Actor::cli(reason.as_deref());
    let asked = match crate::actions::cancel(&config, store.as_ref(), &job, &actor).await {
        Ok(Cancel::Asked(asked)) => asked,
        Ok(Cancel::Withdrawal(crate::actions::Withdrawal::NonePending)) => {
            eprintln!(
                "cronlease: no run of {job} is going (as the live nodes' last beats say) and no request of it is pending: nothing to cancel"
            );
            return ExitCode::FAILURE;
        }
        Ok(Cancel::Withdrawal(w @ crate::actions::Withdrawal::Withdrawn(_))) => {
            println!("{}", w.message(&job));
            return ExitCode::SUCCESS;
        }
        Ok(Cancel::Withdrawal(w)) => {
            eprintln!("cronlease: {}", w.message(&job));
            return ExitCode::FAILURE;
        }
        Err(e) => return store_failure(&e),
    };
    for a in &asked {
        println!(
            "{job}: cancel of its run on {} (fence {}) asked by {}",
            a.node, a.fence, actor.by
        );
    }
    let grace = config
        .job(job.as_str())
        .map_or(Duration::ZERO, |j| j.kill_grace);
    let deadline = tokio::time::Instant::now() + grace + RECORD_WAIT;
    let mut left: BTreeMap<u64, CancelAsked> = asked.into_iter().map(|a| (a.fence, a)).collect();
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
            let Some(asked) = left.remove(&run.fence) else {
                continue;
            };
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
                // Not left in the store for that node's next look.
                let _ = crate::actions::take_back(&config, store.as_ref(), &asked).await;
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
    left: &BTreeMap<u64, CancelAsked>,
) -> ExitCode {
    for (fence, asked) in left {
        let what = match crate::actions::take_back(config, store, asked).await {
            Ok(true) => "nobody took the request (taken back)".to_string(),
            Ok(false) => "its node took the request".to_string(),
            Err(e) => format!("the request could not be taken back ({e})"),
        };
        eprintln!(
            "cronlease: no record of {job}'s run on {} (fence {fence}) yet: {what}; `cronlease status` shows whether it is still going",
            asked.node
        );
    }
    ExitCode::FAILURE
}
