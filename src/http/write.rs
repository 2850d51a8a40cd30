//! The write API and a job's page (docs/api.md): trigger, withdraw,
//! pause, resume and cancel through the same code as the CLI
//! ([`crate::actions`]), answered as JSON with the HTTP status of the CLI's
//! exit meaning; `GET /api/jobs/{job}` and a manual run's progress; the
//! OpenAPI document built from [`ENDPOINTS`], the table of the API's
//! routes. Writes need a token of scope `operate` ([`super::auth`]).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Api, Caller};
use crate::actions::{self, Cancel, Withdrawal};
use crate::config::{Config, JobName, Scope};
use crate::store::{ShownRecord, TriggerId, bounded};

/// Runs shown on a job's page, and at most asked for.
const JOB_RUNS: u32 = 20;

/// How long a request may be neither pending, running nor recorded and
/// still be answered `taken`: from its claim to the beat that shows its run.
const TAKEN_UNSEEN: std::time::Duration = std::time::Duration::from_secs(10);

/// One endpoint of the API: method, path, who may call it, what it does.
pub struct Endpoint {
    pub method: &'static str,
    pub path: &'static str,
    /// `none`, `read` (a token when `require_token_for_read`) or `operate`.
    pub scope: &'static str,
    pub summary: &'static str,
    /// The statuses it answers, and what each means.
    pub answers: &'static [(u16, &'static str)],
}

const STORE_DOWN: (u16, &str) = (503, "the store did not answer: {\"error\"}");
const NO_JOB: (u16, &str) = (404, "no such job in this node's configuration: {\"error\"}");
const BAD: (u16, &str) = (400, "a malformed job name, id or body: {\"error\"}");

/// Every endpoint of the JSON API (the listener also serves `/`,
/// `/assets/*`, `/metrics` and `/healthz`, in docs/api.md): what
/// `/api/openapi.json` says; the test of the document calls each entry.
pub const ENDPOINTS: &[Endpoint] = &[
    Endpoint {
        method: "get",
        path: "/api/whoami",
        scope: "none",
        summary: "The token presented (name and scope) and whether this listener takes writes",
        answers: &[(200, "{token, scope, writes, read_requires_token, tls}")],
    },
    Endpoint {
        method: "get",
        path: "/api/status",
        scope: "read",
        summary: "What `cronlease status --json` prints, without output tails",
        answers: &[(200, "an array of job rows"), STORE_DOWN],
    },
    Endpoint {
        method: "get",
        path: "/api/nodes",
        scope: "read",
        summary: "What `cronlease nodes --json` prints",
        answers: &[(200, "an array of live node records"), STORE_DOWN],
    },
    Endpoint {
        method: "get",
        path: "/api/history",
        scope: "read",
        summary: "What `cronlease history --json` prints, without output tails (query: job, limit)",
        answers: &[(200, "an array of run records"), BAD, STORE_DOWN],
    },
    Endpoint {
        method: "get",
        path: "/api/actions",
        scope: "read",
        summary: "What `cronlease history --actions --json` prints: the audit, who paused, resumed, triggered or cancelled a job and why, newest first (query: job, limit)",
        answers: &[(200, "an array of audit entries"), BAD, STORE_DOWN],
    },
    Endpoint {
        method: "get",
        path: "/api/jobs/{job}",
        scope: "read",
        summary: "One job: its status row (holder, running runs, pending request, pause, last action), its definition digest, its last 20 runs with durations and accounting (output tails for a token of scope operate) and its last 20 audit entries",
        answers: &[
            (200, "{job, definition_digest, status, runs, actions}"),
            BAD,
            NO_JOB,
            STORE_DOWN,
        ],
    },
    Endpoint {
        method: "post",
        path: "/api/jobs/{job}/trigger",
        scope: "operate",
        summary: "Run the job once now on one node (`cronlease trigger`); body {\"reason\", \"request_id\"}: a request id makes asking again answer the same request",
        answers: &[
            (
                202,
                "{job, trigger, poll}: requested; poll the run at `poll`",
            ),
            (
                409,
                "{error, refused, ...}: refused (a run in progress, a request pending)",
            ),
            BAD,
            NO_JOB,
            (503, "{error, trigger, may_be_recorded: true}"),
        ],
    },
    Endpoint {
        method: "get",
        path: "/api/jobs/{job}/triggers/{id}",
        scope: "read",
        summary: "A manual run's progress (`trigger --wait`): pending, taken (running), or ended with its record",
        answers: &[(200, "{trigger, state, run}"), BAD, STORE_DOWN],
    },
    Endpoint {
        method: "delete",
        path: "/api/jobs/{job}/trigger",
        scope: "operate",
        summary: "Withdraw the job's pending request (`cronlease trigger --cancel`); body {\"reason\"}",
        answers: &[
            (200, "{withdrawn, message}"),
            (409, "{error}: none pending, or taken meanwhile"),
            BAD,
            STORE_DOWN,
        ],
    },
    Endpoint {
        method: "post",
        path: "/api/jobs/{job}/pause",
        scope: "operate",
        summary: "Pause the job cluster-wide (`cronlease pause`); body {\"reason\"}",
        answers: &[(200, "{job, paused: true}"), BAD, NO_JOB, STORE_DOWN],
    },
    Endpoint {
        method: "post",
        path: "/api/jobs/{job}/resume",
        scope: "operate",
        summary: "Resume the job (`cronlease resume`), catching up the occurrence it missed while paused; body {\"reason\"}",
        answers: &[
            (200, "{job, paused: false, catch_up}"),
            BAD,
            NO_JOB,
            STORE_DOWN,
        ],
    },
    Endpoint {
        method: "post",
        path: "/api/jobs/{job}/cancel",
        scope: "operate",
        summary: "Stop the job's running runs on whichever node runs each (`cronlease cancel`), or withdraw its pending request; body {\"reason\"}",
        answers: &[
            (
                202,
                "{job, asked: [{node, owner, fence}]}: each node stops its run within a second",
            ),
            (
                200,
                "{job, withdrawn, message}: no run going; the pending request withdrawn",
            ),
            (409, "{error}: nothing to cancel"),
            BAD,
            STORE_DOWN,
        ],
    },
    Endpoint {
        method: "get",
        path: "/api/openapi.json",
        scope: "none",
        summary: "This document",
        answers: &[(200, "OpenAPI 3.0")],
    },
];

/// The OpenAPI 3.0 document of [`ENDPOINTS`].
pub fn openapi() -> Value {
    let mut paths = serde_json::Map::new();
    for e in ENDPOINTS {
        let params: Vec<Value> = ["job", "id"]
            .iter()
            .filter(|p| e.path.contains(&format!("{{{p}}}")))
            .map(|p| json!({"name": p, "in": "path", "required": true, "schema": {"type": "string"}}))
            .collect();
        let responses: serde_json::Map<String, Value> = e
            .answers
            .iter()
            .map(|(code, what)| (code.to_string(), json!({"description": what})))
            .collect();
        let mut operation = json!({
            "summary": e.summary,
            "parameters": params,
            "responses": responses,
            "x-cronlease-scope": e.scope,
        });
        if e.scope != "none" {
            operation["security"] = json!([{"bearer": []}]);
        }
        if e.method == "post" {
            operation["requestBody"] = json!({
                "required": false,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/WriteBody"}}}
            });
        }
        let entry = paths.entry(e.path.to_string()).or_insert_with(|| json!({}));
        entry[e.method] = operation;
    }
    json!({
        "openapi": "3.0.3",
        "info": {"title": "cronlease", "version": env!("CARGO_PKG_VERSION")},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"WriteBody": {
                "type": "object",
                "properties": {
                    "reason": {"type": "string", "description": "why: kept in the job's audit with the token's name (and in a cancelled run's record); one line, at most 500 bytes"},
                    "request_id": {"type": "string", "description": "the client's id of this request: asking again with it is answered as the first asking was (trigger)"}
                }
            }}
        }
    })
}

pub(super) async fn openapi_json() -> Response {
    axum::Json(openapi()).into_response()
}

/// A write's optional body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct WriteBody {
    reason: Option<String>,
    request_id: Option<String>,
}

fn answer(status: StatusCode, body: Value) -> Response {
    (
        status,
        [(header::CACHE_CONTROL, "no-store")],
        axum::Json(body),
    )
        .into_response()
}

fn error(status: StatusCode, message: impl std::fmt::Display) -> Response {
    answer(
        status,
        json!({"error": crate::config::one_line(&message.to_string())}),
    )
}

/// A request refused before the store is asked: its status and why.
struct Refusal(StatusCode, String);

impl Refusal {
    fn answer(self) -> Response {
        error(self.0, self.1)
    }
}

/// The job named in the path, and the configuration to act with; or why
/// it is refused (400 malformed, 404 not configured here when
/// `configured`).
fn job_of(api: &Api, name: &str, configured: bool) -> Result<(JobName, Arc<Config>), Refusal> {
    let job = JobName::parse(name).map_err(|e| Refusal(StatusCode::BAD_REQUEST, e))?;
    let config = api.config.borrow().clone();
    if configured && config.job(job.as_str()).is_none() {
        return Err(Refusal(
            StatusCode::NOT_FOUND,
            format!("no job named {job} in this node's configuration"),
        ));
    }
    Ok((job, config))
}

/// A write's job, configuration and body ([`job_of`], [`body_of`]).
fn write_of(
    api: &Api,
    name: &str,
    configured: bool,
    body: &Bytes,
) -> Result<(JobName, Arc<Config>, WriteBody), Refusal> {
    let (job, config) = job_of(api, name, configured)?;
    Ok((job, config, body_of(body)?))
}

fn body_of(bytes: &Bytes) -> Result<WriteBody, Refusal> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(WriteBody::default());
    }
    serde_json::from_slice(bytes).map_err(|e| {
        Refusal(
            StatusCode::BAD_REQUEST,
            format!("expected a JSON body {{\"reason\", \"request_id\"}} (both optional): {e}"),
        )
    })
}

/// A write's reason as logged: one line, at most
/// [`crate::cancel::MAX_REASON`] bytes.
fn reason_of(body: &WriteBody) -> String {
    let mut reason = crate::config::one_line(body.reason.as_deref().unwrap_or_default());
    if reason.len() > crate::cancel::MAX_REASON {
        let mut end = crate::cancel::MAX_REASON;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
    }
    reason
}

/// Who made a write: the token's name.
fn who(caller: &Option<axum::Extension<Caller>>) -> String {
    match caller.as_ref().and_then(|c| c.0.token.as_ref()) {
        Some((name, _)) => format!("token {name}"),
        None => "token ?".into(),
    }
}

/// Who made a write and why, as the audit keeps it.
fn actor(caller: &Option<axum::Extension<Caller>>, body: &WriteBody) -> actions::Actor {
    actions::Actor::new(&who(caller), body.reason.as_deref())
}

fn store_down(e: &crate::store::StoreError) -> Response {
    error(StatusCode::SERVICE_UNAVAILABLE, e)
}

pub(super) async fn trigger(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    caller: Option<axum::Extension<Caller>>,
    body: Bytes,
) -> Response {
    let (job, config, body) = match write_of(&api, &name, true, &body) {
        Ok(all) => all,
        Err(refused) => return refused.answer(),
    };
    let request = body.request_id.as_deref().filter(|r| !r.is_empty());
    match actions::trigger(
        &config,
        api.store.as_ref(),
        &job,
        request,
        &actor(&caller, &body),
    )
    .await
    {
        Ok(Ok(id)) => {
            tracing::info!(job = %job, trigger = %id, by = %who(&caller), reason = %reason_of(&body), "manual run requested through the API");
            answer(
                StatusCode::ACCEPTED,
                json!({"job": job, "trigger": id, "poll": format!("/api/jobs/{job}/triggers/{id}")}),
            )
        }
        Ok(Err(refused)) => {
            let mut body = serde_json::to_value(&refused).unwrap_or_else(|_| json!({}));
            body["error"] = json!(refused.message(&job));
            answer(StatusCode::CONFLICT, body)
        }
        Err(actions::Unanswered { trigger, error: e }) => answer(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"error": crate::config::one_line(&e.to_string()), "trigger": trigger, "may_be_recorded": true}),
        ),
    }
}

pub(super) async fn trigger_progress(
    State(api): State<Arc<Api>>,
    Path((name, id)): Path<(String, String)>,
    caller: Option<axum::Extension<Caller>>,
) -> Response {
    let (job, config) = match job_of(&api, &name, false) {
        Ok(both) => both,
        Err(refused) => return refused.answer(),
    };
    let Some(id) = TriggerId::parse(&id) else {
        return error(StatusCode::BAD_REQUEST, "a trigger id is 16 hex digits");
    };
    let budget = config.store.call_budget();
    let store = api.store.as_ref();
    let _reading = api.reading.lock().await;
    let runs = match bounded(
        budget,
        store.history(Some(&job), config.store.history_limit.max(1)),
    )
    .await
    {
        Ok(runs) => runs,
        Err(e) => return store_down(&e),
    };
    if let Some(run) = runs.into_iter().find(|r| r.trigger == Some(id)) {
        let run = shown(run, operates(&caller));
        return answer(
            StatusCode::OK,
            json!({"trigger": id, "state": "ended", "run": run}),
        );
    }
    let pending = match bounded(budget, store.pending_triggers()).await {
        Ok(p) => p,
        Err(e) => return store_down(&e),
    };
    if pending.iter().any(|(j, p)| j == job.as_str() && *p == id) {
        return answer(
            StatusCode::OK,
            json!({"trigger": id, "state": "pending", "run": null}),
        );
    }
    // Taken: its run goes on a node (as its beats say), or it was claimed
    // moments ago (a beat within a second shows it). Otherwise the id is
    // none this API can follow: withdrawn, expired, its record trimmed from
    // history, or never made.
    let going = match bounded(budget, store.nodes()).await {
        Ok(nodes) => nodes
            .iter()
            .flat_map(|n| &n.running)
            .any(|r| r.job == job.as_str() && r.trigger == Some(id)),
        Err(e) => return store_down(&e),
    };
    // Made by the store's clock: a little in this host's future is fresh too.
    let fresh = id.requested_at().is_some_and(|at| {
        chrono::Utc::now() - at < chrono::TimeDelta::from_std(TAKEN_UNSEEN).unwrap_or_default()
    });
    if going || fresh {
        return answer(
            StatusCode::OK,
            json!({"trigger": id, "state": "taken", "run": null}),
        );
    }
    error(
        StatusCode::NOT_FOUND,
        format!(
            "trigger {id} of {job} is neither pending, nor running, nor in its history: withdrawn, expired, trimmed from history or never made"
        ),
    )
}

pub(super) async fn withdraw(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    caller: Option<axum::Extension<Caller>>,
    body: Bytes,
) -> Response {
    let (job, config, body) = match write_of(&api, &name, false, &body) {
        Ok(all) => all,
        Err(refused) => return refused.answer(),
    };
    let done = actions::withdraw(&config, api.store.as_ref(), &job, &actor(&caller, &body)).await;
    withdrawal(&job, done, &caller)
}

fn withdrawal(
    job: &JobName,
    done: Result<Withdrawal, crate::store::StoreError>,
    caller: &Option<axum::Extension<Caller>>,
) -> Response {
    match done {
        Ok(w @ Withdrawal::Withdrawn(id)) => {
            tracing::warn!(job = %job, trigger = %id, by = %who(caller), "pending request withdrawn through the API");
            answer(
                StatusCode::OK,
                json!({"job": job, "withdrawn": id, "message": w.message(job)}),
            )
        }
        Ok(w) => error(StatusCode::CONFLICT, w.message(job)),
        Err(e) => store_down(&e),
    }
}

pub(super) async fn pause(
    state: State<Arc<Api>>,
    path: Path<String>,
    caller: Option<axum::Extension<Caller>>,
    body: Bytes,
) -> Response {
    set_paused(state, path, caller, body, true).await
}

pub(super) async fn resume(
    state: State<Arc<Api>>,
    path: Path<String>,
    caller: Option<axum::Extension<Caller>>,
    body: Bytes,
) -> Response {
    set_paused(state, path, caller, body, false).await
}

async fn set_paused(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    caller: Option<axum::Extension<Caller>>,
    body: Bytes,
    paused: bool,
) -> Response {
    let (job, config, body) = match write_of(&api, &name, true, &body) {
        Ok(all) => all,
        Err(refused) => return refused.answer(),
    };
    let jobs = [job.clone()];
    match actions::set_paused(
        &config,
        api.store.as_ref(),
        &jobs,
        paused,
        &actor(&caller, &body),
    )
    .await
    {
        Ok(said) => {
            tracing::warn!(job = %job, by = %who(&caller), reason = %reason_of(&body), "{} through the API", if paused { "paused" } else { "resumed" });
            let catch_up: Vec<&str> = said.iter().map(|c| c.message.as_str()).collect();
            // Resumed, but a catch-up could not be asked for: the CLI's
            // store failure, as a 503 that says the job is resumed.
            let status = match said.iter().any(|c| c.failed.is_some()) {
                true => StatusCode::SERVICE_UNAVAILABLE,
                false => StatusCode::OK,
            };
            answer(
                status,
                json!({"job": job, "paused": paused, "catch_up": catch_up}),
            )
        }
        Err(e) => store_down(&e),
    }
}

pub(super) async fn cancel(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    caller: Option<axum::Extension<Caller>>,
    body: Bytes,
) -> Response {
    let (job, config, body) = match write_of(&api, &name, false, &body) {
        Ok(all) => all,
        Err(refused) => return refused.answer(),
    };
    let by = who(&caller);
    match actions::cancel(&config, api.store.as_ref(), &job, &actor(&caller, &body)).await {
        Ok(Cancel::Asked(asked)) => {
            let fences: Vec<u64> = asked.iter().map(|a| a.fence).collect();
            tracing::warn!(job = %job, by = %by, reason = %reason_of(&body), ?fences, "cancel asked through the API");
            answer(StatusCode::ACCEPTED, json!({"job": job, "asked": asked}))
        }
        Ok(Cancel::Withdrawal(Withdrawal::NonePending)) => error(
            StatusCode::CONFLICT,
            format!("no run of {job} is going and no request of it is pending: nothing to cancel"),
        ),
        Ok(Cancel::Withdrawal(w)) => withdrawal(&job, Ok(w), &caller),
        Err(e) => store_down(&e),
    }
}

/// Whether the caller's token has scope `operate`.
fn operates(caller: &Option<axum::Extension<Caller>>) -> bool {
    caller
        .as_ref()
        .and_then(|c| c.0.token.as_ref())
        .is_some_and(|(_, s)| *s == Scope::Operate)
}

/// A run as the API shows it: the output tail only to `operate` tokens.
fn shown(mut run: crate::store::RunRecord, with_output: bool) -> ShownRecord {
    if !with_output {
        run.output.clear();
    }
    ShownRecord::from(run)
}

pub(super) async fn job_page(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    caller: Option<axum::Extension<Caller>>,
) -> Response {
    let (job, config) = match job_of(&api, &name, false) {
        Ok(both) => both,
        Err(refused) => return refused.answer(),
    };
    let budget = config.store.call_budget();
    // The status row from `/api/status`'s snapshot (one store read per
    // second however many pages are open), under its one-reader lock.
    let rows = match super::status_rows(&api).await {
        Ok(rows) => rows,
        Err(e) => return store_down(&e),
    };
    let Some(row) = rows
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["job"] == job.as_str()))
        .cloned()
    else {
        return error(
            StatusCode::NOT_FOUND,
            format!("no job named {job} here nor in the store"),
        );
    };
    let with_output = operates(&caller);
    let _reading = api.reading.lock().await;
    let runs = match bounded(budget, api.store.history(Some(&job), JOB_RUNS)).await {
        Ok(runs) => runs,
        Err(e) => return store_down(&e),
    };
    let runs: Vec<Value> = runs
        .into_iter()
        .map(|r| {
            let took = (r.finished_at - r.started_at).num_milliseconds().max(0);
            let mut run = serde_json::to_value(shown(r, with_output)).unwrap_or_default();
            run["duration_ms"] = json!(took);
            run
        })
        .collect();
    // A store not migrated to the audit yet (a rollout) has none to show.
    let actions = bounded(budget, api.store.actions(Some(&job), JOB_RUNS))
        .await
        .unwrap_or_default();
    let digest = config.job(job.as_str()).map(|j| {
        format!(
            "{:016x}",
            crate::node::definitions::job_digest(j).definition
        )
    });
    answer(
        StatusCode::OK,
        json!({"job": job, "definition_digest": digest, "status": row, "runs": runs, "actions": actions}),
    )
}
