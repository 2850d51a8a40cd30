//! The scripts' arguments and replies: a claim batch, renewals and runs as
//! the Lua scripts take them, a claim's reply as an outcome, and scripts
//! sent by hash (loaded again where a server forgot them).

use super::*;

/// `{prefix}{job}:kind`: the braces make one job's keys a hash tag.
pub(super) fn job_key(prefix: &str, job: &str, kind: &str) -> String {
    format!("{prefix}{{{job}}}:{kind}")
}

/// The hash of pending manual runs' requests: job -> id.
pub(crate) fn triggers_key(prefix: &str) -> String {
    format!("{prefix}triggers")
}

/// The key of the store's record format version (`format.lua`).
pub(crate) fn format_key(prefix: &str) -> String {
    format!("{prefix}format")
}

/// Runs `build(which)`'s pipeline on `conn`: `lead` commands first (the
/// same every time), then the `EVALSHA`s of the calls `which` names, all
/// `count` of them the first time. The pipeline ignores errors: each reply
/// comes back as it is, an error as a `ServerError` value, so one script's
/// failure leaves the others' replies. If the server has forgotten scripts
/// (restart, `SCRIPT FLUSH`), `scripts` are loaded and only the calls it
/// refused are sent again: a call that ran must not run twice (a claim
/// would read its own win as a peer's).
#[cfg(feature = "redlock")]
pub(super) async fn eval_loading(
    conn: &mut ConnectionManager,
    scripts: &[&Script],
    lead: usize,
    count: usize,
    build: impl Fn(&[usize]) -> redis::Pipeline,
) -> redis::RedisResult<Vec<redis::Value>> {
    let shared = conn.clone();
    let send = |which: &[usize]| {
        let mut pipe = build(which);
        pipe.ignore_errors();
        let mut conn = shared.clone();
        async move { pipe.query_async::<Vec<redis::Value>>(&mut conn).await }
    };
    let all: Vec<usize> = (0..count).collect();
    let mut replies = send(&all).await?;
    let refused: Vec<usize> = all
        .into_iter()
        .filter(|i| replies.get(lead + i).is_some_and(forgotten))
        .collect();
    if refused.is_empty() {
        return Ok(replies);
    }
    for script in scripts {
        script.prepare_invoke().load_async(conn).await?;
    }
    let again = send(&refused).await?;
    for (k, i) in refused.into_iter().enumerate() {
        if let (Some(slot), Some(reply)) = (replies.get_mut(lead + i), again.get(lead + k)) {
            *slot = reply.clone();
        }
    }
    Ok(replies)
}

/// Adds `EVALSHA` of `script` with `keys` and `args` to `pipe`.
pub(super) fn add_evalsha(
    pipe: &mut redis::Pipeline,
    (script, keys, args): (&Script, &[String], &[String]),
) {
    pipe.cmd("EVALSHA")
        .arg(script.get_hash())
        .arg(keys.len())
        .arg(keys)
        .arg(args);
}

/// The reply of a script call the server refused because it has forgotten
/// the script (a restart, `SCRIPT FLUSH`).
pub(super) fn forgotten(reply: &redis::Value) -> bool {
    matches!(reply, redis::Value::ServerError(e)
        if e.kind() == Some(redis::ServerErrorKind::NoScript))
}

/// The keys and arguments of `claim.lua` for `requests`.
pub(super) fn claim_args(prefix: &str, requests: &[ClaimRequest]) -> (Vec<String>, Vec<String>) {
    let mut keys = Vec::with_capacity(2 * requests.len());
    let mut args = Vec::with_capacity(15 * requests.len());
    for r in requests {
        let job = r.job.as_str();
        keys.push(job_key(prefix, job, "lease"));
        keys.push(job_key(prefix, job, "state"));
        args.extend([
            r.owner.as_str().to_string(),
            to_ms(r.occurrence).to_string(),
            r.previous.map(|p| to_ms(p).to_string()).unwrap_or_default(),
            duration_ms(r.lease).max(1).to_string(),
            r.fence_floor.to_string(),
            match r.misfire {
                Misfire::RunOnce => "run_once",
                Misfire::Skip => "skip",
            }
            .to_string(),
            duration_ms(r.max_offset).to_string(),
            if r.after_unanswered { "1" } else { "0" }.to_string(),
            if r.recheck_only { "1" } else { "0" }.to_string(),
            r.head_start
                .map(|h| duration_ms(h).to_string())
                .unwrap_or_default(),
            r.manual.map(|id| id.get().to_string()).unwrap_or_default(),
            job.to_string(),
            r.window_end
                .map(|e| to_ms(e).to_string())
                .unwrap_or_default(),
            if r.redeliver { "1" } else { "0" }.to_string(),
            r.before_previous
                .map(|p| to_ms(p).to_string())
                .unwrap_or_default(),
        ]);
    }
    keys.push(triggers_key(prefix));
    (keys, args)
}

/// The keys and arguments of `renew.lua` for `owner`'s `renewals`.
pub(super) fn renew_args(
    prefix: &str,
    owner: &Owner,
    renewals: &[Renewal],
) -> (Vec<String>, Vec<String>) {
    let keys = renewals
        .iter()
        .map(|r| job_key(prefix, r.job.as_str(), "lease"))
        .collect();
    let mut args = vec![owner.as_str().to_string()];
    args.extend(
        renewals
            .iter()
            .map(|r| duration_ms(r.lease).max(1).to_string()),
    );
    (keys, args)
}

/// The keys and arguments of `record.lua` for `runs`, keeping `keep` per job.
pub(super) fn record_args(
    runs: &[RunRecord],
    keep: u32,
    prefix: &str,
) -> (Vec<String>, Vec<String>) {
    let mut keys = Vec::with_capacity(3 * runs.len());
    let mut args = vec![keep.max(1).to_string()];
    for run in runs {
        keys.push(job_key(prefix, &run.job, "runs"));
        keys.push(job_key(prefix, &run.job, "fences"));
        keys.push(job_key(prefix, &run.job, "state"));
        let mut fields: Vec<String> = [
            ("job", run.job.clone()),
            ("fence", run.fence.to_string()),
            ("owner", run.owner.clone()),
            ("node", run.node.clone()),
            ("occurrence", to_ms(run.occurrence).to_string()),
            ("started_at", to_ms(run.started_at).to_string()),
            ("finished_at", to_ms(run.finished_at).to_string()),
            ("outcome", run.outcome.as_str().to_string()),
            ("takeover", i64::from(run.takeover).to_string()),
            ("delay_ms", run.delay_ms.to_string()),
            ("decision_ms", run.decision_ms.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
        if let Some(code) = run.exit_code {
            fields.extend(["exit_code".to_string(), code.to_string()]);
        }
        if !run.output.is_empty() {
            fields.extend(["output".to_string(), run.output.clone()]);
        }
        if let Some(ms) = run.cpu_ms {
            fields.extend(["cpu_ms".to_string(), ms.to_string()]);
        }
        if let Some(bytes) = run.memory_peak {
            fields.extend(["memory_peak".to_string(), bytes.to_string()]);
        }
        if let Some(id) = run.trigger {
            fields.extend(["trigger".to_string(), id.get().to_string()]);
        }
        args.push(run.fence.to_string());
        args.push(
            if crate::store::ends_a_run(run) {
                "1"
            } else {
                "0"
            }
            .to_string(),
        );
        args.push(fields.len().to_string());
        args.extend(fields);
    }
    (keys, args)
}

pub(super) fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

pub(super) fn outcome_from_reply(r: ClaimReply, req: &ClaimRequest) -> ClaimOutcome {
    let (
        won,
        fence,
        occurrence,
        catch_up,
        who,
        remaining,
        last,
        _now,
        too_early,
        _repaired,
        idle,
        paused,
    ) = r;
    let fence = fence.parse::<u64>().unwrap_or(0);
    if won == -1 {
        ClaimOutcome::Failed(crate::store::fence_exhausted(req.job.as_str()))
    } else if won == -2 {
        ClaimOutcome::Failed(format!(
            "the claim of job {} failed in the server: {}",
            req.job,
            one_line(&who.unwrap_or_default())
        ))
    } else if won == 1 {
        ClaimOutcome::Won(Won {
            fence,
            occurrence: from_ms(occurrence),
            catch_up: catch_up >= 1,
            redelivered: catch_up == 2,
            unclaimed_after: crate::store::rule::unclaimed(
                req,
                (last >= 0).then_some(last),
                catch_up == 1,
                catch_up == 2,
            )
            .map(from_ms),
            previous_owner: who,
        })
    } else {
        ClaimOutcome::Lost(Lost {
            remaining: if who.is_some() {
                Duration::from_millis(remaining.max(0) as u64)
            } else {
                Duration::ZERO
            },
            holder: who,
            last_occurrence: (last >= 0).then(|| from_ms(last)),
            fence,
            too_early: too_early == 1,
            stale: too_early == 2,
            idle_wait: (idle >= 0).then(|| Duration::from_millis(idle as u64)),
            paused: paused == 1,
            trigger_gone: paused == 2,
        })
    }
}
