//! The daemon's HTTP listener (`[http] listen`, docs/operations.md): axum
//! routes on hyper's HTTP/1.1 server.
//!
//! - `/metrics` (OpenMetrics text) and `/healthz` (200, or 503 with why);
//! - `/` the dashboard: an HTML page, its script and its style,
//!   all compiled into the binary; a Content-Security-Policy lets the page
//!   talk to this listener only, so it works offline and sends nothing
//!   elsewhere;
//! - `/api/status` (what `status --json` prints), `/api/nodes` (`nodes
//!   --json`), `/api/history?job=J&limit=N` (`history --json`), all without
//!   the runs' output tails: job output stays with `cronlease logs`, which
//!   needs the store's credentials; `/api/actions?job=J&limit=N` (`history
//!   --actions --json`: the audit); `/api/whoami`: the caller's token and
//!   whether this listener takes writes;
//! - the write API and a job's page under `/api/jobs/` and
//!   `/api/openapi.json` ([`write`]).
//!
//! Every request passes [`auth`]'s tokens and scopes first; with
//! `tls_cert_file` the listener speaks HTTPS only (rustls).
//!
//! Bounded: request heads of at most 16 KiB read within 5 s, at most 64
//! connections at once, each ended (gracefully) after
//! 60 s. Beyond those 64, 16 more are kept for the probes: one request
//! each, within 2 s, to `/healthz` or `/metrics` only, so idle browser tabs
//! or a scanner holding every connection cannot fail a health check. The
//! store is asked by one request at a time, and `/api/status` answers from a snapshot at most a second old, so however many pages are
//! open the daemon's own claims never queue behind them for its store
//! connections; every store call within the command budget (`op_timeout`,
//! at least 5 s).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Mutex, Semaphore, watch};
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;

mod auth;
mod write;

pub use auth::{Caller, MAX_FAILURES, Need, Peer, WINDOW, need};
pub use write::{ENDPOINTS, Endpoint, openapi};

use crate::config::{Config, JobName};
use crate::metrics::Metrics;
use crate::store::{Store, StoreError, bounded};

/// Answers `/healthz`: `None` when healthy, else the reason.
pub type HealthCheck = Arc<dyn Fn() -> Option<String> + Send + Sync>;

const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_HEAD: usize = 16 * 1024;
const MAX_CONNECTIONS: usize = 64;
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Connections beyond [`MAX_CONNECTIONS`] kept for `/healthz` and
/// `/metrics`: one request each, answered within [`PROBE_LIFETIME`] or
/// dropped.
const PROBE_CONNECTIONS: usize = 16;
const PROBE_LIFETIME: Duration = Duration::from_secs(2);
/// `/api/history`'s default and largest `limit`.
const HISTORY_DEFAULT: u32 = 200;
const HISTORY_MAX: u32 = 2000;
/// How old a `/api/status` snapshot may be when served again.
const SNAPSHOT_AGE: Duration = Duration::from_secs(1);

const PAGE: &str = include_str!("../dashboard/index.html");
const SCRIPT: &str = include_str!("../dashboard/dashboard.js");
const STYLE: &str = include_str!("../dashboard/dashboard.css");
/// The page may load its own script and style and ask this listener, and
/// nothing else.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// What the routes read: the metrics, the health check, the store and the
/// current configuration (replaced on reload).
pub struct Api {
    metrics: Arc<Metrics>,
    healthy: HealthCheck,
    store: Arc<dyn Store>,
    config: watch::Receiver<Arc<Config>>,
    /// One store-reading request at a time, and the last `/api/status`.
    reading: Mutex<Option<(tokio::time::Instant, serde_json::Value)>>,
    /// Failed token attempts per client address.
    failures: auth::Failures,
}

impl Api {
    pub fn new(
        metrics: Arc<Metrics>,
        healthy: HealthCheck,
        store: Arc<dyn Store>,
        config: watch::Receiver<Arc<Config>>,
    ) -> Api {
        Api {
            metrics,
            healthy,
            store,
            config,
            reading: Mutex::new(None),
            failures: auth::Failures::default(),
        }
    }
}

/// Binds the listener (done at start, so a taken port fails fast).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves the routes on `listener` until `stop`.
pub async fn serve(listener: TcpListener, api: Arc<Api>, stop: CancellationToken) {
    let probe_router = probe_routes(api.clone());
    let router = routes(api.clone());
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let probe_slots = Arc::new(Semaphore::new(PROBE_CONNECTIONS));
    loop {
        let (stream, peer) = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("http listener: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // Beyond the limit a connection gets a probe's slot, and beyond
        // those it is closed at once, not queued.
        // A probe's connection: one request, its head and its answer
        // within PROBE_LIFETIME.
        let (slot, service, probe, head_within, lifetime) =
            if let Ok(slot) = slots.clone().try_acquire_owned() {
                let service = TowerToHyperService::new(router.clone().layer(Extension(Peer(peer))));
                (slot, service, false, HEADER_TIMEOUT, CONNECTION_LIFETIME)
            } else if let Ok(slot) = probe_slots.clone().try_acquire_owned() {
                let service =
                    TowerToHyperService::new(probe_router.clone().layer(Extension(Peer(peer))));
                (slot, service, true, PROBE_LIFETIME, PROBE_LIFETIME)
            } else {
                continue;
            };
        // The TLS settings a reload installed, for this connection.
        let tls = api
            .config
            .borrow()
            .http_access
            .tls
            .as_ref()
            .map(|t| tokio_rustls::TlsAcceptor::from(t.server.clone()));
        let stop = stop.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let io = match tls {
                None => Either::Left(stream),
                // The handshake within the time a request head gets.
                Some(tls) => match tokio::time::timeout(head_within, tls.accept(stream)).await {
                    Ok(Ok(stream)) => Either::Right(stream),
                    Ok(Err(e)) => {
                        tracing::debug!(client = %peer, "http listener: TLS handshake failed: {e}");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(client = %peer, "http listener: TLS handshake timed out");
                        return;
                    }
                },
            };
            serve_connection(
                TokioIo::new(io),
                service,
                probe,
                head_within,
                lifetime,
                stop,
            )
            .await;
        });
    }
}

/// Serves one connection's requests until it ends, its `lifetime` is over
/// or `stop`; a probe's connection ends there, another finishes the
/// response under way first.
async fn serve_connection<I, S>(
    io: I,
    service: S,
    probe: bool,
    head_within: Duration,
    lifetime: Duration,
    stop: CancellationToken,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::HttpService<hyper::body::Incoming> + Send + 'static,
    S::Future: Send + 'static,
    S::ResBody: Send + 'static,
    <S::ResBody as hyper::body::Body>::Data: Send,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(head_within)
        .keep_alive(!probe)
        .max_buf_size(MAX_HEAD)
        .serve_connection(io, service);
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        () = tokio::time::sleep(lifetime) => {}
        () = stop.cancelled() => {}
    }
    if probe {
        // A probe's slot is not held past its time.
        return;
    }
    // Past its time: finish the response under way, then close.
    connection.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(HEADER_TIMEOUT, connection).await;
}

fn routes(api: Arc<Api>) -> Router {
    let router = Router::new()
        .route("/", get(page))
        .route("/assets/dashboard.js", get(script))
        .route("/assets/dashboard.css", get(style))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/api/status", get(status))
        .route("/api/nodes", get(nodes))
        .route("/api/history", get(history))
        .route("/api/actions", get(actions))
        .route("/api/whoami", get(whoami))
        .route("/api/openapi.json", get(write::openapi_json))
        .route("/api/jobs/{job}", get(write::job_page))
        .route(
            "/api/jobs/{job}/trigger",
            post(write::trigger).delete(write::withdraw),
        )
        .route(
            "/api/jobs/{job}/triggers/{id}",
            get(write::trigger_progress),
        )
        .route("/api/jobs/{job}/pause", post(write::pause))
        .route("/api/jobs/{job}/resume", post(write::resume))
        .route("/api/jobs/{job}/cancel", post(write::cancel))
        .fallback(not_found);
    guarded(router, api)
}

/// `router` behind [`auth::authorize`], with `api` as its state.
fn guarded(router: Router<Arc<Api>>, api: Arc<Api>) -> Router {
    router
        .layer(axum::middleware::from_fn_with_state(
            api.clone(),
            auth::authorize,
        ))
        .with_state(api)
}

/// What a connection beyond [`MAX_CONNECTIONS`] is served: the probes.
fn probe_routes(api: Arc<Api>) -> Router {
    let router = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .fallback(busy);
    guarded(router, api)
}

/// `/api/whoami`: the token the request presented (none, or its name and
/// scope) and whether this listener takes writes.
async fn whoami(State(api): State<Arc<Api>>, caller: Option<axum::Extension<Caller>>) -> Response {
    let access = api.config.borrow().http_access.clone();
    let token = caller.and_then(|c| c.0.token);
    let writes = if access.tokens.is_none() {
        "no: this listener has no [http] tokens_file; writes need the cronlease CLI"
    } else if token
        .as_ref()
        .is_some_and(|(_, s)| *s == crate::config::Scope::Operate)
    {
        "yes"
    } else {
        "with a token of scope operate"
    };
    let body = serde_json::json!({
        "token": token.as_ref().map(|(name, _)| name),
        "scope": token.as_ref().map(|(_, scope)| scope.as_str()),
        "writes": writes,
        "read_requires_token": access.read_requires_token,
        "tls": access.tls.is_some(),
    });
    ([(header::CACHE_CONTROL, "no-store")], axum::Json(body)).into_response()
}

async fn busy() -> Response {
    text(
        StatusCode::SERVICE_UNAVAILABLE,
        "text/plain; charset=utf-8",
        format!(
            "busy: {MAX_CONNECTIONS} connections are open; only /healthz and /metrics answer beyond them\n"
        ),
    )
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, content_type)], body).into_response()
}

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::CACHE_CONTROL, "no-store"),
        ],
        PAGE,
    )
        .into_response()
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

async fn metrics(State(api): State<Arc<Api>>) -> Response {
    let config = api.config.borrow().clone();
    api.metrics.refresh_jobs(
        config.jobs.iter().map(|j| (j.name.as_str(), &j.schedule)),
        chrono::Utc::now(),
    );
    text(
        StatusCode::OK,
        "application/openmetrics-text; version=1.0.0; charset=utf-8",
        api.metrics.encode(),
    )
}

async fn healthz(State(api): State<Arc<Api>>) -> Response {
    match (api.healthy)() {
        None => text(StatusCode::OK, "text/plain; charset=utf-8", "ok\n".into()),
        Some(reason) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain; charset=utf-8",
            format!("{reason}\n"),
        ),
    }
}

async fn not_found() -> Response {
    text(
        StatusCode::NOT_FOUND,
        "text/plain; charset=utf-8",
        "not found: try /, /metrics, /healthz, /api/status, /api/nodes, /api/history, /api/jobs/JOB, /api/whoami or /api/openapi.json\n".into(),
    )
}

/// A JSON answer, or 503 with the store's one-line error.
fn json<T: serde::Serialize>(result: Result<T, StoreError>) -> Response {
    match result {
        Ok(value) => ([(header::CACHE_CONTROL, "no-store")], axum::Json(value)).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({
                "error": crate::config::one_line(&e.to_string())
            })),
        )
            .into_response(),
    }
}

async fn status(State(api): State<Arc<Api>>) -> Response {
    json(status_rows(&api).await)
}

/// `/api/status`'s rows: the snapshot if it is under [`SNAPSHOT_AGE`],
/// else read again (one reader at a time).
async fn status_rows(api: &Api) -> Result<serde_json::Value, StoreError> {
    let mut reading = api.reading.lock().await;
    if let Some((at, rows)) = reading.as_ref()
        && at.elapsed() < SNAPSHOT_AGE
    {
        return Ok(rows.clone());
    }
    let config = api.config.borrow().clone();
    let rows = crate::status::gather(&config, api.store.as_ref(), config.store.call_budget())
        .await
        .map(|mut rows| {
            for run in rows.iter_mut().filter_map(|r| r.last_run.as_mut()) {
                run.output.clear();
            }
            serde_json::to_value(rows).unwrap_or_default()
        });
    if let Ok(rows) = &rows {
        *reading = Some((tokio::time::Instant::now(), rows.clone()));
    }
    rows
}

async fn nodes(State(api): State<Arc<Api>>) -> Response {
    let _reading = api.reading.lock().await;
    let config = api.config.borrow().clone();
    json(bounded(config.store.call_budget(), api.store.nodes()).await)
}

#[derive(Debug, serde::Deserialize)]
struct HistoryQuery {
    job: Option<String>,
    limit: Option<u32>,
}

/// A `?job=NAME&limit=N` query of `path` read: the job, and the limit
/// within 1 ..= [`HISTORY_MAX`]; or the 400's text, which says what was
/// expected.
fn job_and_limit(
    path: &str,
    query: Result<Query<HistoryQuery>, QueryRejection>,
) -> Result<(Option<JobName>, u32), String> {
    let Ok(Query(query)) = query else {
        return Err(format!(
            "expected {path}?job=NAME&limit=N (both optional)\n"
        ));
    };
    let job = query
        .job
        .as_deref()
        .map(JobName::parse)
        .transpose()
        .map_err(|e| format!("job: {}\n", crate::config::one_line(&e)))?;
    let limit = query.limit.unwrap_or(HISTORY_DEFAULT).clamp(1, HISTORY_MAX);
    Ok((job, limit))
}

/// A bad query's answer.
fn bad_query(text_of: String) -> Response {
    text(
        StatusCode::BAD_REQUEST,
        "text/plain; charset=utf-8",
        text_of,
    )
}

/// The audit (docs/api.md): who paused, resumed, triggered or cancelled a
/// job, and why, newest first.
async fn actions(
    State(api): State<Arc<Api>>,
    query: Result<Query<HistoryQuery>, QueryRejection>,
) -> Response {
    let (job, limit) = match job_and_limit("/api/actions", query) {
        Ok(both) => both,
        Err(why) => return bad_query(why),
    };
    let _reading = api.reading.lock().await;
    let config = api.config.borrow().clone();
    json(
        bounded(
            config.store.call_budget(),
            api.store.actions(job.as_ref(), limit),
        )
        .await,
    )
}

async fn history(
    State(api): State<Arc<Api>>,
    query: Result<Query<HistoryQuery>, QueryRejection>,
) -> Response {
    let (job, limit) = match job_and_limit("/api/history", query) {
        Ok(both) => both,
        Err(why) => return bad_query(why),
    };
    let _reading = api.reading.lock().await;
    let config = api.config.borrow().clone();
    let runs = bounded(
        config.store.call_budget(),
        api.store.history(job.as_ref(), limit),
    )
    .await
    .map(|runs| {
        runs.into_iter()
            .map(|mut run| {
                run.output.clear();
                crate::store::ShownRecord::from(run)
            })
            .collect::<Vec<_>>()
    });
    json(runs)
}
