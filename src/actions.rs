//! The writes an operator makes, one code path for the CLI ([`crate::app`])
//! and the write API ([`crate::http`]): `trigger`, the withdrawal of a
//! pending request, `pause`/`resume` (with the catch-up on resume) and
//! `cancel`'s requests. Each answers what happened as a value, with the
//! sentence people read; the CLI prints it with its exit code, the API
//! answers it as JSON with the HTTP status of the same meaning. Each one
//! made (a trigger or withdrawal accepted, a pause or resume, runs asked to
//! stop; not a refusal) is recorded in the store's audit
//! ([`crate::store::audit`]) with who acted ([`Actor`]) and why.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::cancel::CancelRequest;
use crate::config::{self, Config, JobName};
use crate::store::{self, Act, AuditEntry, Store, StoreError, TriggerAnswer, TriggerId, bounded};

/// Runs a store call within the configured budget.
async fn within<T>(
    config: &Config,
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    bounded(config.store.call_budget(), call).await
}

/// Who acts, and why: kept in the audit with what they did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    /// `user@host` for the CLI, `token NAME` for the API.
    pub by: String,
    /// Why, as they said it.
    pub reason: Option<String>,
}

impl Actor {
    /// The user running this command, on this host
    /// ([`crate::cancel::who_am_i`]).
    pub fn cli(reason: Option<&str>) -> Actor {
        Actor::new(&crate::cancel::who_am_i(), reason)
    }

    /// `by` (made one line and cut, as the audit keeps it) and a reason
    /// (none when blank).
    pub fn new(by: &str, reason: Option<&str>) -> Actor {
        Actor {
            by: crate::cancel::one_line(by, store::audit::MAX_BY),
            reason: reason
                .map(|r| crate::cancel::one_line(r, store::audit::MAX_REASON))
                .filter(|r| !r.is_empty()),
        }
    }
}

/// Records in the audit that `actor` did `act` to `job` (`detail`: what
/// it did), stamped with the store's clock. The action stands whatever
/// this answers: a failed write is logged as a warning (the CLI shows it on
/// standard error) and answered.
pub async fn record(
    config: &Config,
    store: &dyn Store,
    job: &JobName,
    act: Act,
    actor: &Actor,
    detail: &str,
) -> Result<AuditEntry, StoreError> {
    let at = within(config, store.clock())
        .await
        .unwrap_or_else(|_| Utc::now());
    let entry = AuditEntry::new(job, at, act, &actor.by, actor.reason.as_deref(), detail);
    let keep = config.store.history_limit.max(1);
    match within(config, store.record_action(&entry, keep)).await {
        Ok(()) => Ok(entry),
        Err(e) => {
            not_kept(job.as_str(), act, &entry.by, &e);
            Err(e)
        }
    }
}

/// [`record`] of one action on each of many jobs (`pause --all`): the
/// store's clock read once, [`RECORD_AT_ONCE`] writes at a time; a failed
/// write is logged as [`record`] logs it.
async fn record_each(
    config: &Config,
    store: &dyn Store,
    act: Act,
    actor: &Actor,
    done: &[(&JobName, String)],
) {
    let at = within(config, store.clock())
        .await
        .unwrap_or_else(|_| Utc::now());
    let keep = config.store.history_limit.max(1);
    let entries: Vec<AuditEntry> = done
        .iter()
        .map(|(job, detail)| {
            AuditEntry::new(job, at, act, &actor.by, actor.reason.as_deref(), detail)
        })
        .collect();
    for chunk in entries.chunks(RECORD_AT_ONCE) {
        let written = futures_util::future::join_all(
            chunk
                .iter()
                .map(|entry| within(config, store.record_action(entry, keep))),
        )
        .await;
        for (entry, answer) in chunk.iter().zip(written) {
            if let Err(e) = answer {
                not_kept(&entry.job, act, &entry.by, &e);
            }
        }
    }
}

/// Audit writes [`record_each`] has going at once.
const RECORD_AT_ONCE: usize = 16;

/// The WARN of an action done whose audit entry was not written.
fn not_kept(job: &str, act: Act, by: &str, e: &StoreError) {
    tracing::warn!(
        job = %job,
        action = %act,
        by = %by,
        error = %e,
        "the {act} of {job} is done, but it could not be kept in the store's audit"
    );
}

/// Why a manual run's request was refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "refused", rename_all = "snake_case")]
pub enum Refused {
    /// A run of the job is in progress (on this node, when known).
    Running { node: Option<String> },
    /// A claim a dead daemon never started is handed back, pending.
    Redelivery { trigger: TriggerId },
    /// The catch-up after a resume is pending.
    CatchUp { trigger: TriggerId },
    /// A failed run's next attempt is pending.
    Retry {
        trigger: TriggerId,
        attempt: u32,
        due_at: DateTime<Utc>,
    },
    /// Another manual run's request is pending.
    Pending { trigger: TriggerId },
}

impl Refused {
    /// What the refusal tells people (the CLI prints it after
    /// `cronlease: refused: `).
    pub fn message(&self, job: &JobName) -> String {
        match self {
            Refused::Running { node } => format!(
                "a run of {job} is in progress{} (overlap); trigger it again once it has ended (`cronlease status` shows it; `cronlease cancel {job}` stops it)",
                node.as_ref().map_or(String::new(), |n| format!(" on {n}"))
            ),
            Refused::Redelivery { trigger } => format!(
                "a run of {job} that a dead daemon had claimed and not started is pending (trigger {trigger}); one node runs it now, and `cronlease trigger --cancel {job}` withdraws it"
            ),
            Refused::CatchUp { trigger } => format!(
                "{job} was just resumed, and the catch-up of the occurrence it missed while paused is pending (trigger {trigger}); a node takes it within a second: trigger it again then"
            ),
            Refused::Retry {
                trigger,
                attempt,
                due_at,
            } => format!(
                "attempt {attempt} of a failed run of {job} is pending (trigger {trigger}, due at {}); one node runs it then, and `cronlease trigger --cancel {job}` withdraws it (ending the attempts)",
                due_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ),
            Refused::Pending { trigger } => format!(
                "a manual run of {job} was requested already (trigger {trigger}{}) and has not started yet; it runs once a node takes it, expires after cluster.trigger_expiry, and `cronlease trigger --cancel {job}` withdraws it",
                request_age(*trigger).map_or(String::new(), |age| format!(", {age} ago"))
            ),
        }
    }
}

/// How long ago request `id` was made, for people (`None` for an id that
/// carries no time, or a retry's, whose time is when it is due).
pub fn request_age(id: TriggerId) -> Option<String> {
    if id.daemons_attempt().is_some() {
        return None;
    }
    let age = id.age(Utc::now())?;
    Some(humantime::format_duration(Duration::from_secs(age.as_secs())).to_string())
}

/// A request the store's answer did not come back for: it may have been
/// recorded.
#[derive(Debug)]
pub struct Unanswered {
    pub trigger: TriggerId,
    pub error: StoreError,
}

/// How far back history is read for a client's request id asked again.
pub const REQUEST_ID_MEMORY: Duration = Duration::from_secs(24 * 3600);

/// `trigger`: records a manual run's request of `job` (a configured job)
/// in the store, stamped with the store's time; a node claims and runs it.
/// With a client's request id (`request`), asking again is answered as the
/// first asking was: the request pending, its run going, or its run among
/// the job's kept history (`store.history_limit` runs) within
/// [`REQUEST_ID_MEMORY`], is the same request, not another run. An answer
/// that did not come (a timeout, a failover) is asked again with the same
/// id, twice.
pub async fn trigger(
    config: &Config,
    store: &dyn Store,
    job: &JobName,
    request: Option<&str>,
    actor: &Actor,
) -> Result<Result<TriggerId, Refused>, Unanswered> {
    let made = within(config, store.clock())
        .await
        .unwrap_or_else(|_| Utc::now());
    let id = match request {
        Some(key) => TriggerId::for_request(made, key),
        None => TriggerId::made_at(made),
    };
    if let Some(key) = request {
        // Its run among the job's kept history: a read that fails is an
        // answer that did not come, never a second run.
        let keep = config.store.history_limit.max(1);
        let runs = within(config, store.history(Some(job), keep))
            .await
            .map_err(|error| Unanswered { trigger: id, error })?;
        if let Some(ran) = runs
            .iter()
            .filter_map(|r| r.trigger)
            .find(|t| t.of_request(key) && t.age(made).is_some_and(|age| age < REQUEST_ID_MEMORY))
        {
            return Ok(Ok(ran));
        }
    }
    let mut answer = within(config, store.request_trigger(job, id)).await;
    for _ in 0..2 {
        match &answer {
            Err(e) if e.is_unreachable() => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                answer = within(config, store.request_trigger(job, id)).await;
            }
            _ => break,
        }
    }
    let refused = match answer {
        Ok(TriggerAnswer::Accepted) => {
            let _ = record(
                config,
                store,
                job,
                Act::Trigger,
                actor,
                &format!("trigger {id}"),
            )
            .await;
            return Ok(Ok(id));
        }
        Ok(TriggerAnswer::Pending(pending))
            if pending == id || request.is_some_and(|key| pending.of_request(key)) =>
        {
            // Our own request, recorded by an asking whose answer was lost:
            // accepted now, so kept in the audit (asked again with a request
            // id, it was kept when first accepted).
            if pending == id {
                let detail = format!("trigger {id}");
                let _ = record(config, store, job, Act::Trigger, actor, &detail).await;
            }
            return Ok(Ok(pending));
        }
        Ok(TriggerAnswer::Running { holder }) => {
            // Asked again while its first asking's run goes: that run, as
            // the live nodes' beats show it.
            if let Some(key) = request
                && let Ok(nodes) = within(config, store.nodes()).await
                && let Some(going) = nodes
                    .iter()
                    .flat_map(|n| &n.running)
                    .filter(|r| r.job == job.as_str())
                    .find_map(|r| r.trigger.filter(|t| t.of_request(key)))
            {
                return Ok(Ok(going));
            }
            Refused::Running {
                node: holder.map(|h| store::Owner::node_of(&config::one_line(&h)).to_string()),
            }
        }
        Ok(TriggerAnswer::Pending(pending)) if pending.redelivery_of().is_some() => {
            Refused::Redelivery { trigger: pending }
        }
        Ok(TriggerAnswer::Pending(pending)) if pending.resumed_at().is_some() => {
            Refused::CatchUp { trigger: pending }
        }
        Ok(TriggerAnswer::Pending(pending)) => match pending.retry_of() {
            Some((attempt, due_at)) => Refused::Retry {
                trigger: pending,
                attempt,
                due_at,
            },
            None => Refused::Pending { trigger: pending },
        },
        Err(error) => return Err(Unanswered { trigger: id, error }),
    };
    Ok(Err(refused))
}

/// A pending request withdrawn (`trigger --cancel`, or `cancel` with no
/// run going).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Withdrawal {
    /// None of the job is pending.
    NonePending,
    /// Withdrawn: not run for it.
    Withdrawn(TriggerId),
    /// A node took it between the look and the withdrawal.
    TakenMeanwhile(TriggerId),
}

impl Withdrawal {
    /// What it tells people.
    pub fn message(&self, job: &JobName) -> String {
        match self {
            Withdrawal::NonePending => format!("no manual run of {job} is pending"),
            Withdrawal::Withdrawn(id) => match id.daemons_attempt() {
                Some(_) if id.redelivery_of().is_some() => format!(
                    "trigger {id}: withdrawn; the run of {job} a dead daemon had claimed and not started will not run (its claim is recorded not_started)"
                ),
                None if id.resumed_at().is_some() => format!(
                    "trigger {id}: withdrawn; the occurrence {job} missed while it was paused is not caught up now (the next one runs as usual)"
                ),
                Some((attempt, _)) => format!(
                    "trigger {id}: withdrawn; attempt {attempt} of {job}'s failed run will not run, and its attempts end (nothing more is recorded or announced for that occurrence)"
                ),
                None => format!(
                    "trigger {id}: withdrawn{}; {job} was not run for it",
                    request_age(*id).map_or(String::new(), |age| format!(" (requested {age} ago)"))
                ),
            },
            Withdrawal::TakenMeanwhile(id) => format!(
                "trigger {id} of {job} was taken by a node meanwhile: `cronlease history {job}` shows its run"
            ),
        }
    }
}

/// Withdraws `job`'s pending request, if there is one (the job need not be
/// configured: it may have been removed).
pub async fn withdraw(
    config: &Config,
    store: &dyn Store,
    job: &JobName,
    actor: &Actor,
) -> Result<Withdrawal, StoreError> {
    let pending = within(config, store.pending_triggers()).await?;
    let Some((_, id)) = pending.into_iter().find(|(j, _)| j == job.as_str()) else {
        return Ok(Withdrawal::NonePending);
    };
    if !within(config, store.withdraw_trigger(job, id)).await? {
        return Ok(Withdrawal::TakenMeanwhile(id));
    }
    let _ = record(
        config,
        store,
        job,
        Act::Withdraw,
        actor,
        &format!("trigger {id}"),
    )
    .await;
    Ok(Withdrawal::Withdrawn(id))
}

/// What a resume did about a job's occurrence missed while it was paused
/// (docs/protocol.md, "Catch-up on resume").
#[derive(Debug, Serialize)]
pub struct CatchUp {
    pub job: String,
    /// What it tells people.
    pub message: String,
    /// The request could not be left (the job stays resumed).
    #[serde(skip)]
    pub failed: Option<StoreError>,
}

/// `pause` / `resume` of `jobs`: the mark kept with each job's lock, which
/// every claim reads atomically; a resume then catches up the occurrence
/// each job missed while paused, where it may still start.
pub async fn set_paused(
    config: &Config,
    store: &dyn Store,
    jobs: &[JobName],
    paused: bool,
    actor: &Actor,
) -> Result<Vec<CatchUp>, StoreError> {
    // Which of them were paused, and their last claimed occurrences, before
    // the resume: only those catch up.
    let before = match paused {
        true => Vec::new(),
        false => within(config, store.status()).await?,
    };
    within(config, store.set_paused(jobs, paused)).await?;
    let said = match paused {
        true => Vec::new(),
        false => catch_up_after_resume(config, store, jobs, &before).await,
    };
    let act = if paused { Act::Pause } else { Act::Resume };
    // A pause of a paused job is recorded too: who meant it to be paused,
    // and why, is what people look for.
    let done: Vec<(&JobName, String)> = jobs
        .iter()
        .map(|job| {
            let was = before.iter().find(|r| r.job == job.as_str());
            let detail = match (paused, was) {
                (false, Some(r)) if !r.paused => "it was not paused".to_string(),
                (false, None) => "it was not paused".to_string(),
                _ => said
                    .iter()
                    .find(|c| c.job == job.as_str() && c.failed.is_none())
                    .map(|c| c.message.clone())
                    .unwrap_or_default(),
            };
            (job, detail)
        })
        .collect();
    record_each(config, store, act, actor, &done).await;
    Ok(said)
}

/// Catch-up on resume (docs/protocol.md, "Catch-up on resume"): for each
/// job that was paused (`before`: the lock rows read before the resume),
/// has `misfire = "run_once"`, and whose latest occurrence was not claimed
/// (missed while paused) but may still start (its start window, the first
/// half of its gap), a resume's request ([`TriggerId::resumed`], stamped
/// with the store's clock, as nodes judge it) tells the nodes to claim that
/// occurrence at once, by its own claim rule: once across the cluster. A
/// job never claimed has nothing to catch up; older missed occurrences are
/// not run.
async fn catch_up_after_resume(
    config: &Config,
    store: &dyn Store,
    jobs: &[JobName],
    before: &[store::LockStatus],
) -> Vec<CatchUp> {
    let now = within(config, store.clock())
        .await
        .unwrap_or_else(|_| Utc::now());
    let mut said = Vec::new();
    let rfc3339 = |t: DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    for name in jobs {
        let Some(job) = config.job(name.as_str()) else {
            continue;
        };
        if job.misfire != config::Misfire::RunOnce {
            continue;
        }
        let Some(next) = job.schedule.next_after(now) else {
            continue;
        };
        let Some(latest) = job.schedule.previous_before(next) else {
            continue;
        };
        let was = before.iter().find(|r| r.job == name.as_str());
        let missed = was.is_some_and(|r| r.paused && r.last_occurrence.is_some_and(|c| c < latest));
        if !missed {
            continue;
        }
        let when = rfc3339(latest);
        let mut say = |message: String, failed: Option<StoreError>| {
            said.push(CatchUp {
                job: name.to_string(),
                message,
                failed,
            })
        };
        if !crate::node::catch_up_open(job, latest, Some(next), now) {
            say(
                format!(
                    "{name}: its {when} occurrence was missed while it was paused and is past its start window (or the first half of its gap): not run; the next runs at {}",
                    rfc3339(next)
                ),
                None,
            );
            continue;
        }
        let id = TriggerId::resumed(now);
        match within(config, store.request_trigger(name, id)).await {
            Ok(TriggerAnswer::Accepted) => say(
                format!(
                    "{name}: its {when} occurrence, missed while it was paused, runs now on one node"
                ),
                None,
            ),
            Ok(TriggerAnswer::Pending(_)) => say(
                format!(
                    "{name}: its {when} occurrence was missed while it was paused; another request of {name} is pending (`cronlease status`), so it is not caught up now"
                ),
                None,
            ),
            Ok(TriggerAnswer::Running { .. }) => say(
                format!(
                    "{name}: its {when} occurrence was missed while it was paused; a run of {name} is in progress, so it is not caught up"
                ),
                None,
            ),
            Err(e) => say(
                format!(
                    "{name} is resumed, but the catch-up of its {when} occurrence could not be requested; the next occurrence runs as usual"
                ),
                Some(e),
            ),
        }
    }
    said
}

/// A run asked to stop ([`cancel`]).
#[derive(Debug, Clone, Serialize)]
pub struct CancelAsked {
    pub node: String,
    pub owner: String,
    pub fence: u64,
    #[serde(skip)]
    pub request: CancelRequest,
}

/// What `cancel` did.
#[derive(Debug)]
pub enum Cancel {
    /// The runs going were asked to stop.
    Asked(Vec<CancelAsked>),
    /// No run was going: the pending request was withdrawn instead (or
    /// not, as this says).
    Withdrawal(Withdrawal),
}

/// `cancel`: asks every run of `job` going now (as the live nodes' last
/// beats say) to stop, by a request for its node in the store's outbox
/// ([`crate::cancel`]); with none going, withdraws the job's pending
/// request instead.
pub async fn cancel(
    config: &Config,
    store: &dyn Store,
    job: &JobName,
    actor: &Actor,
) -> Result<Cancel, StoreError> {
    let nodes = within(config, store.nodes()).await?;
    let asked: Vec<CancelAsked> = nodes
        .iter()
        .flat_map(|n| {
            n.running
                .iter()
                .filter(|r| r.job == job.as_str())
                .map(|r| CancelAsked {
                    node: n.node.clone(),
                    owner: n.owner.clone(),
                    fence: r.fence,
                    request: CancelRequest::new(job, r.fence, &actor.by, actor.reason.as_deref()),
                })
        })
        .collect();
    if asked.is_empty() {
        return withdraw(config, store, job, actor)
            .await
            .map(Cancel::Withdrawal);
    }
    let parcels: Vec<store::Parcel> = asked.iter().map(|a| a.request.parcel(&a.owner)).collect();
    within(config, store.hand_over(&parcels)).await?;
    let runs: Vec<String> = asked
        .iter()
        .map(|a| format!("fence {} on {}", a.fence, a.node))
        .collect();
    let detail = format!("asked to stop: {}", runs.join(", "));
    let _ = record(config, store, job, Act::Cancel, actor, &detail).await;
    Ok(Cancel::Asked(asked))
}

/// Takes back the request of a run asked to stop that nobody took (its
/// node died, or the run ended before the node looked): true when it was
/// still there.
pub async fn take_back(
    config: &Config,
    store: &dyn Store,
    asked: &CancelAsked,
) -> Result<bool, StoreError> {
    let taker = store::Owner::from_raw(format!("cancel#{}", std::process::id()));
    let id = asked.request.parcel(&asked.owner).id;
    let back = within(config, store.take_handed_over(&taker, &id, 1)).await?;
    Ok(!back.is_empty())
}
