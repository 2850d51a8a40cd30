//! The commands that read a cluster: `status`, `nodes`, `history` and
//! `logs`, as tables or JSON.

use super::*;

pub(super) async fn status(path: PathBuf, json: bool) -> ExitCode {
    let (config, store) = match config_and_store(&path).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    let rows =
        match crate::status::gather(&config, store.as_ref(), config.store.call_budget()).await {
            Ok(rows) => rows,
            Err(e) => return store_failure(&e),
        };
    let sent = Utc::now();
    let clock_offset = match within(&config, store.clock()).await {
        Ok(store_now) => crate::node::clock::offset_ms(store_now, sent, Utc::now()),
        Err(e) => return store_failure(&e),
    };
    let mut out = std::io::stdout().lock();
    if json {
        print_json(&mut out, &rows);
        return ExitCode::SUCCESS;
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let last = r.last_run.as_ref().map_or("-".to_string(), |run| {
                let code = run.exit_code.map(|c| format!(" ({c})")).unwrap_or_default();
                format!("{}{code} on {}", run.outcome, run.node)
            });
            vec![
                match (&r.shard_of, r.configured) {
                    (Some(of), _) => format!("{} (shard of {of})", r.job),
                    (None, true) => r.job.clone(),
                    (None, false) => format!("{} (not configured here)", r.job),
                },
                run_on_cell(r),
                r.holder.clone().unwrap_or_else(|| "-".into()),
                match (r.holder_alive, r.holder_clock_offset_ms) {
                    (Some(true), Some(offset)) => format!("yes ({offset:+} ms)"),
                    (Some(true), None) => "yes".into(),
                    (Some(false), _) => "no heartbeat".into(),
                    (None, _) => "-".into(),
                },
                if r.holder.is_some() {
                    format!("{:.1}s", r.lease_remaining_ms as f64 / 1000.0)
                } else {
                    "-".into()
                },
                r.fence.to_string(),
                if r.paused { "yes" } else { "-" }.into(),
                r.last_occurrence.map_or("-".into(), rfc3339),
                last,
            ]
        })
        .collect();
    print_table(
        &mut out,
        &[
            "JOB",
            "RUN ON",
            "HOLDER",
            "ALIVE",
            "LEASE LEFT",
            "FENCE",
            "PAUSED",
            "LAST OCCURRENCE",
            "LAST RUN",
        ],
        &table,
    );
    for r in &rows {
        for going in &r.running {
            let attempt = match going.attempt {
                1 => String::new(),
                k => format!(", attempt {k}"),
            };
            let trigger = going
                .trigger
                .map(|id| format!(" (trigger {id})"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "RUNNING: {} on {} (fence {}, {} run of {}{attempt}{trigger}) since {}, for {}; `cronlease cancel {}` stops it",
                r.job,
                going.node,
                going.fence,
                going.kind.replace('_', "-"),
                rfc3339(going.occurrence),
                rfc3339(going.started_at),
                humantime::format_duration(Duration::from_secs(going.elapsed_ms / 1000)),
                r.job,
            );
        }
    }
    for r in &rows {
        if let Some(p) = r.pending_trigger.as_ref().filter(|p| p.redelivered) {
            let _ = writeln!(
                out,
                "PENDING REDELIVERY: {} attempt {} (trigger {}): a dead daemon had claimed it and not started it; one node runs it now, within its deadline; `cronlease trigger --cancel {}` withdraws it",
                r.job,
                p.attempt.unwrap_or(1),
                p.id,
                r.job
            );
        } else if let Some(p) = r.pending_trigger.as_ref().filter(|p| p.attempt.is_some()) {
            let _ = writeln!(
                out,
                "PENDING RETRY: {} attempt {} due at {} (trigger {}): one node runs it then; `cronlease trigger --cancel {}` withdraws it",
                r.job,
                p.attempt.unwrap_or_default(),
                p.due_at.map(rfc3339).unwrap_or_default(),
                p.id,
                r.job
            );
        } else if let Some(p) = r.pending_trigger.as_ref().filter(|p| p.resumed) {
            let _ = writeln!(
                out,
                "PENDING CATCH-UP: {} (trigger {}): resumed, and the occurrence it missed while paused is about to be claimed by one node",
                r.job, p.id
            );
        } else if let Some(p) = &r.pending_trigger {
            let age = p.age_ms.map_or(String::new(), |ms| {
                format!(
                    ", requested {} ago",
                    humantime::format_duration(Duration::from_secs(ms / 1000))
                )
            });
            let _ = writeln!(
                out,
                "PENDING TRIGGER: {} (trigger {}{age}): no node has taken it yet; `cronlease trigger --cancel {}` withdraws it",
                r.job, p.id, r.job
            );
        }
    }
    let now = Utc::now();
    for r in &rows {
        // Who paused a paused job, however long ago; otherwise the last
        // action of the day.
        let (label, entry) = match (&r.paused_by, &r.last_action) {
            (Some(p), _) => ("PAUSED", p),
            (None, Some(a)) if now - a.at < chrono::Duration::hours(24) => ("LAST ACTION", a),
            _ => continue,
        };
        let _ = writeln!(out, "{label}: {}", said_action(entry, now));
    }
    for r in rows
        .iter()
        .filter(|r| !r.run_on.is_empty() && r.eligible_nodes.as_ref().is_some_and(Vec::is_empty))
    {
        let _ = writeln!(
            out,
            "NO ELIGIBLE NODE: {} (run_on {}): no live node has every one of these tags, so it is not run; `cronlease nodes` lists each node's tags",
            r.job,
            r.run_on.join(", ")
        );
    }
    for r in rows.iter().filter(|r| !r.defined_otherwise_on.is_empty()) {
        let _ = writeln!(
            out,
            "DEFINED OTHERWISE: {} differs between live nodes ({}): each node runs its own definition at the instants of its own schedule; deploy one definition to every node",
            r.job,
            r.defined_otherwise_on.join(", ")
        );
    }
    let bound = config.max_clock_offset.as_millis();
    let verdict = if crate::node::clock::beyond_bound(clock_offset, config.max_clock_offset) {
        "OUT OF BOUNDS: a daemon on this host claims nothing; fix time sync"
    } else {
        "ok"
    };
    let _ = writeln!(
        out,
        "\nclock offset of this host: {clock_offset:+} ms (store - local; cluster.max_clock_offset {bound} ms): {verdict}"
    );
    ExitCode::SUCCESS
}

/// `own`, a broadcast job's records, with its shards' (every lock named
/// `JOB~...` the store has), newest first, at most `limit`.
async fn shard_history(
    config: &Config,
    store: &dyn store::Store,
    job: &JobName,
    mut own: Vec<store::RunRecord>,
    limit: u32,
) -> Result<Vec<store::RunRecord>, store::StoreError> {
    let locks = within(config, store.status()).await?;
    for lock in locks {
        let Ok(name) = JobName::parse(&lock.job) else {
            continue;
        };
        if name.shard_of() == Some(job.as_str()) {
            own.extend(within(config, store.history(Some(&name), limit)).await?);
        }
    }
    own.sort_by(|a, b| (b.started_at, &b.job, b.fence).cmp(&(a.started_at, &a.job, a.fence)));
    own.truncate(limit as usize);
    Ok(own)
}

/// A job's RUN ON cell: `any` (no `run_on`), or its tags and the live
/// nodes that have them all.
fn run_on_cell(r: &crate::status::JobStatus) -> String {
    match (&r.eligible_nodes, r.run_on.is_empty()) {
        (_, true) if r.configured => "any".into(),
        (_, true) => "-".into(),
        (Some(nodes), false) if nodes.is_empty() => {
            format!("{}: NO LIVE NODE", r.run_on.join(","))
        }
        (Some(nodes), false) => format!("{}: {}", r.run_on.join(","), nodes.join(" ")),
        (None, false) => r.run_on.join(","),
    }
}

/// `cronlease nodes`: the live records of the node registry.
pub(super) async fn nodes(path: PathBuf, json: bool) -> ExitCode {
    let (config, store) = match config_and_store(&path).await {
        Ok(both) => both,
        Err(code) => return code,
    };
    let nodes = match within(&config, store.nodes()).await {
        Ok(n) => n,
        Err(e) => return store_failure(&e),
    };
    let mut out = std::io::stdout().lock();
    if json {
        print_json(&mut out, &nodes);
        return ExitCode::SUCCESS;
    }
    let bound = config.max_clock_offset;
    let table: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            let offset = n.clock_offset_ms.map_or("-".to_string(), |ms| {
                let flag = if crate::node::clock::beyond_bound(ms, bound) {
                    " OUT OF BOUNDS"
                } else {
                    ""
                };
                format!("{ms:+} ms{flag}")
            });
            vec![
                n.node.clone(),
                n.owner.clone(),
                if n.tags.is_empty() {
                    "-".to_string()
                } else {
                    n.tags.join(",")
                },
                n.version.clone(),
                rfc3339(n.started_at),
                rfc3339(n.last_seen),
                offset,
                n.jobs_held.to_string(),
                n.definitions.as_ref().map_or("-".to_string(), |d| {
                    if d.differ_count == 0 {
                        d.digest.clone()
                    } else {
                        format!("{} ({} differ)", d.digest, d.differ_count)
                    }
                }),
            ]
        })
        .collect();
    print_table(
        &mut out,
        &[
            "NODE",
            "OWNER",
            "TAGS",
            "VERSION",
            "STARTED",
            "LAST SEEN",
            "CLOCK OFFSET",
            "JOBS HELD",
            "DEFINITIONS",
        ],
        &table,
    );
    let _ = writeln!(
        out,
        "\n{} live node{} (clock offset: store - node; cluster.max_clock_offset {} ms)",
        nodes.len(),
        if nodes.len() == 1 { "" } else { "s" },
        bound.as_millis()
    );
    let sets: std::collections::BTreeSet<&str> = nodes
        .iter()
        .filter_map(|n| n.definitions.as_ref().map(|d| d.digest.as_str()))
        .collect();
    if sets.len() > 1 {
        let _ = writeln!(
            out,
            "WARNING: the live nodes run {} different sets of job definitions (DEFINITIONS: the digest of a node's set, and how many of its jobs another live node defines otherwise); `cronlease status` names the jobs",
            sets.len()
        );
    }
    for (name, owners) in name_twins(&nodes) {
        let _ = writeln!(
            out,
            "WARNING: {} live daemons use the node name {name} ({}): give each host its own `node`",
            owners.len(),
            owners.join(", ")
        );
    }
    ExitCode::SUCCESS
}

/// Node names more than one live daemon uses, with their owners.
pub(super) fn name_twins(nodes: &[store::NodeRecord]) -> Vec<(&str, Vec<&str>)> {
    let mut by_name: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for n in nodes {
        by_name
            .entry(n.node.as_str())
            .or_default()
            .push(n.owner.as_str());
    }
    by_name.into_iter().filter(|(_, o)| o.len() > 1).collect()
}

pub(super) async fn history(
    path: PathBuf,
    job: Option<JobName>,
    limit: u32,
    json: bool,
    only_actions: bool,
) -> ExitCode {
    let config = match load_config(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    telemetry::init_default();
    let store = match store::connect(&config.store).await {
        Ok(s) => s,
        Err(e) => return store_failure(&e),
    };
    let runs = match only_actions {
        true => Vec::new(),
        false => match within(&config, store.history(job.as_ref(), limit)).await {
            Ok(r) => r,
            Err(e) => return store_failure(&e),
        },
    };
    // A broadcast job's runs are in its shards' locks (`JOB~NODE`): theirs
    // with its own, newest first.
    let runs = match job.as_ref().and_then(|j| config.job(j.as_str())) {
        Some(j) if j.every_node && !only_actions => {
            match shard_history(&config, store.as_ref(), &j.name, runs, limit).await {
                Ok(runs) => runs,
                Err(e) => return store_failure(&e),
            }
        }
        _ => runs,
    };
    // The audit is not needed for the runs' JSON; below the runs' table,
    // one that cannot be read is a warning, not a failure.
    let actions = match (only_actions, json) {
        (false, true) => Vec::new(),
        _ => match within(&config, store.actions(job.as_ref(), limit)).await {
            Ok(a) => a,
            Err(e) if only_actions => return store_failure(&e),
            Err(e) => {
                eprintln!("cronlease: warning: the audit cannot be read: {e}");
                Vec::new()
            }
        },
    };
    if let Some(job) = &job {
        // A job removed from the configuration still has its history.
        if runs.is_empty() && actions.is_empty() && config.job(job.as_str()).is_none() {
            eprintln!(
                "cronlease: no such job {job:?}: not in {} and no history in the store (`cronlease check` lists the jobs)",
                path.display()
            );
            return ExitCode::from(EXIT_NO_SUCH_JOB);
        }
    }
    let mut out = std::io::stdout().lock();
    if only_actions {
        match json {
            true => print_json(&mut out, &actions),
            false => print_actions(&mut out, &actions),
        }
        return ExitCode::SUCCESS;
    }
    if json {
        let shown: Vec<store::ShownRecord> = runs.into_iter().map(Into::into).collect();
        print_json(&mut out, &shown);
        return ExitCode::SUCCESS;
    }
    let table: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                r.job.clone(),
                r.fence.to_string(),
                r.node.clone(),
                rfc3339(r.occurrence),
                format!("{:.3}s", r.delay_ms as f64 / 1000.0),
                format!(
                    "{:.3}s",
                    (r.finished_at - r.started_at).num_milliseconds() as f64 / 1000.0
                ),
                r.cpu_ms
                    .map_or_else(|| "-".into(), |ms| format!("{:.3}s", ms as f64 / 1000.0)),
                r.memory_peak.map_or_else(|| "-".into(), mebibytes),
                match r.exit_code {
                    Some(c) => format!("{} ({c})", r.outcome),
                    None => r.outcome.to_string(),
                },
                if r.takeover {
                    "yes".into()
                } else {
                    "no".into()
                },
                match r.trigger.map(|id| (id, id.daemons_attempt())) {
                    None => "-".into(),
                    Some((id, None)) => id.to_string(),
                    // `attempt 2/3`: of the attempts the job has now;
                    // `redelivered 1/3` for a claim handed back.
                    Some((id, Some((k, _)))) => {
                        let what = match id.redelivery_of() {
                            Some(_) => "redelivered",
                            None => "attempt",
                        };
                        match config.job(&r.job).and_then(|j| j.retry.as_ref()) {
                            Some(retry) => format!("{what} {k}/{}", retry.attempts),
                            None if what == "attempt" => format!("attempt {k}"),
                            None => what.to_string(),
                        }
                    }
                },
                crate::output::excerpt(&r.output),
            ]
        })
        .collect();
    print_table(
        &mut out,
        &[
            "JOB",
            "FENCE",
            "NODE",
            "OCCURRENCE",
            "LATE",
            "TOOK",
            "CPU",
            "PEAK",
            "OUTCOME",
            "TAKEOVER",
            "TRIGGER",
            "OUTPUT",
        ],
        &table,
    );
    if !actions.is_empty() {
        let _ = writeln!(out, "\nACTIONS (the audit; `--actions` lists only these):");
        print_actions(&mut out, &actions);
    }
    ExitCode::SUCCESS
}

/// The audit as a table, newest first.
fn print_actions(out: &mut impl Write, actions: &[store::AuditEntry]) {
    let table: Vec<Vec<String>> = actions
        .iter()
        .map(|a| {
            vec![
                rfc3339(a.at),
                a.job.clone(),
                a.action.to_string(),
                a.by.clone(),
                if a.reason.is_empty() {
                    "-".into()
                } else {
                    a.reason.clone()
                },
                if a.detail.is_empty() {
                    "-".into()
                } else {
                    a.detail.clone()
                },
            ]
        })
        .collect();
    print_table(
        out,
        &["AT", "JOB", "ACTION", "BY", "REASON", "DETAIL"],
        &table,
    );
}

/// An audit entry on one line: `JOB ACTION by WHO at T (AGO ago): WHY
/// [DETAIL]`.
fn said_action(a: &store::AuditEntry, now: DateTime<Utc>) -> String {
    let ago = (now - a.at).to_std().unwrap_or_default();
    let ago = humantime::format_duration(Duration::from_secs(ago.as_secs()));
    let why = match a.reason.as_str() {
        "" => " (no reason given)".to_string(),
        reason => format!(": {reason}"),
    };
    let detail = match a.detail.as_str() {
        "" => String::new(),
        d => format!(" [{d}]"),
    };
    format!(
        "{} {} by {} at {} ({ago} ago){why}{detail}",
        a.job,
        a.action,
        a.by,
        rfc3339(a.at)
    )
}

/// Bytes as MiB with one decimal (`12.5MiB`).
fn mebibytes(bytes: u64) -> String {
    format!("{:.1}MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// `logs JOB [--fence N]`: the output tail of the job's newest run in
/// history, or of run N; exit 1 when history has no such run.
pub(super) async fn logs(path: PathBuf, job: JobName, fence: Option<u64>) -> ExitCode {
    let config = match load_config(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    telemetry::init_default();
    let store = match store::connect(&config.store).await {
        Ok(s) => s,
        Err(e) => return store_failure(&e),
    };
    // A given run is looked for among every run history keeps of the job.
    let limit = match fence {
        Some(_) => config.store.history_limit.max(1),
        None => 1,
    };
    let runs = match within(&config, store.history(Some(&job), limit)).await {
        Ok(r) => r,
        Err(e) => return store_failure(&e),
    };
    if runs.is_empty() && config.job(job.as_str()).is_none() {
        eprintln!(
            "cronlease: no such job {job:?}: not in {} and no history in the store (`cronlease check` lists the jobs)",
            path.display()
        );
        return ExitCode::from(EXIT_NO_SUCH_JOB);
    }
    let run = match fence {
        Some(n) => runs.iter().find(|r| r.fence == n),
        None => runs.first(),
    };
    let Some(run) = run else {
        match fence {
            Some(n) => eprintln!(
                "cronlease: job {job} has no run with fence {n} in history (it keeps the last {} runs of each job; `cronlease history {job}` lists them)",
                config.store.history_limit
            ),
            None => eprintln!("cronlease: job {job} has no run in history yet"),
        }
        return ExitCode::from(1);
    };
    if run.output.is_empty() {
        eprintln!(
            "cronlease: run {} of {job} ({}) left no output in history (none written, or output_tail = 0)",
            run.fence, run.outcome
        );
        return ExitCode::SUCCESS;
    }
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(run.output.as_bytes());
    if !run.output.ends_with('\n') {
        let _ = out.write_all(b"\n");
    }
    ExitCode::SUCCESS
}

pub(super) fn print_table(out: &mut impl Write, header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let _ = writeln!(out, "{}", line(header.to_vec()));
    for row in rows {
        let _ = writeln!(out, "{}", line(row.iter().map(String::as_str).collect()));
    }
}
