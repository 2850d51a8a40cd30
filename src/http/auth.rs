//! Who may do what on the listener (docs/api.md, "Authentication"): every
//! request passes [`authorize`], which checks the bearer token it presents
//! (if any) against `[http] tokens_file`, and what the route needs:
//!
//! - nothing: `/healthz`, the dashboard's page and assets, `/api/whoami`,
//!   `/api/openapi.json`;
//! - `read`: `/metrics` and `/api/*` with `require_token_for_read`, else
//!   nothing;
//! - `operate`: any write (a method other than GET and HEAD). Without
//!   tokens the listener takes no write at all and says so.
//!
//! A presented token that matches none is refused (401) and counted
//! against the client's address: after [`MAX_FAILURES`] within [`WINDOW`]
//! its unknown tokens are refused (429) until the window ends; a valid
//! token is still served. No token is ever logged. Without `tokens_file` a
//! presented token is ignored, as is any scheme other than `Bearer`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::time::Instant;

use super::Api;
use crate::config::Scope;

/// Failed attempts a client address may make within [`WINDOW`].
pub const MAX_FAILURES: u32 = 10;
pub const WINDOW: Duration = Duration::from_secs(60);
/// Client addresses whose failures are remembered at once: beyond, the
/// oldest windows are forgotten first.
const MAX_TRACKED: usize = 10_000;

/// The client's address, put on each request by the connection's task.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub std::net::SocketAddr);

/// Who made a request, for the handlers: the verified token's name and
/// scope, if one was presented.
#[derive(Debug, Clone, Default)]
pub struct Caller {
    pub token: Option<(String, Scope)>,
}

/// What a request needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Nothing,
    Read,
    Operate,
}

/// What `method` on `path` needs, `read_requires_token` or not.
pub fn need(method: &Method, path: &str, read_requires_token: bool) -> Need {
    if method != Method::GET && method != Method::HEAD {
        return Need::Operate;
    }
    let open = path == "/healthz"
        || path == "/"
        || path.starts_with("/assets/")
        || path == "/api/whoami"
        || path == "/api/openapi.json";
    if open || !read_requires_token {
        Need::Nothing
    } else {
        Need::Read
    }
}

/// Failed attempts per client address, in fixed windows.
#[derive(Default)]
pub struct Failures(Mutex<HashMap<IpAddr, (Instant, u32)>>);

impl Failures {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, (Instant, u32)>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How long `ip` is still refused, if it has used up its attempts.
    pub fn blocked(&self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let map = self.lock();
        let (since, n) = map.get(&ip)?;
        let left = (*since + WINDOW).checked_duration_since(now)?;
        (*n >= MAX_FAILURES && !left.is_zero()).then_some(left)
    }

    /// Counts a failure of `ip`; true for the first of its window (logged).
    pub fn failed(&self, ip: IpAddr, now: Instant) -> bool {
        let mut map = self.lock();
        if map.len() >= MAX_TRACKED && !map.contains_key(&ip) {
            map.retain(|_, (since, _)| now.duration_since(*since) < WINDOW);
            if map.len() >= MAX_TRACKED
                && let Some(oldest) = map.iter().min_by_key(|(_, (s, _))| *s).map(|(ip, _)| *ip)
            {
                map.remove(&oldest);
            }
        }
        let entry = map.entry(ip).or_insert((now, 0));
        if now.duration_since(entry.0) >= WINDOW {
            *entry = (now, 0);
        }
        entry.1 += 1;
        entry.1 == 1
    }
}

fn refuse(status: StatusCode, message: &str) -> Response {
    let mut response = (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        format!("{message}\n"),
    )
        .into_response();
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"cronlease\""),
        );
    }
    response
}

/// The bearer token of `request`, if it presents one: another scheme
/// (`Basic` from a proxy), an empty or non-UTF-8 value is no token.
fn bearer(request: &Request) -> Option<&str> {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The address failures are counted under: an IPv4 address, or the /64 of
/// an IPv6 one (a host has a whole /64 to rotate through).
pub fn limited(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_none() => {
            let s = v6.segments();
            IpAddr::from([s[0], s[1], s[2], s[3], 0, 0, 0, 0])
        }
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The middleware: checks the token and the scope, then passes the request
/// on with its [`Caller`]. Without `tokens_file` a presented token is
/// ignored (nothing to check it against; writes are refused anyway).
pub async fn authorize(State(api): State<Arc<Api>>, mut request: Request, next: Next) -> Response {
    // What this request needs of the current configuration (a reload
    // replaces it): the tokens (shared) and one flag, no copy of the rest.
    let (tokens, read_requires_token) = {
        let config = api.config.borrow();
        let access = &config.http_access;
        (access.tokens.clone(), access.read_requires_token)
    };
    let ip = request
        .extensions()
        .get::<Peer>()
        .map_or(IpAddr::from([0, 0, 0, 0]), |p| limited(p.0.ip()));
    let now = Instant::now();
    let mut caller = Caller::default();
    if let (Some(presented), Some(tokens)) = (bearer(&request), &tokens) {
        // A valid token is served even from an address that is refused:
        // others' guesses from the same address (a NAT, a proxy, a local
        // user) must not lock out a scraper or an operator.
        match tokens.verify(presented) {
            Some(token) => caller.token = Some((token.name.clone(), token.scope)),
            None => {
                if let Some(left) = api.failures.blocked(ip, now) {
                    let secs = left.as_secs() + 1;
                    let mut response = refuse(
                        StatusCode::TOO_MANY_REQUESTS,
                        &format!("too many failed attempts from {ip}: try again in {secs} s"),
                    );
                    if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                        response.headers_mut().insert(header::RETRY_AFTER, v);
                    }
                    return response;
                }
                if api.failures.failed(ip, now) {
                    tracing::warn!(client = %ip, path = request.uri().path(), "http: a request with a token that matches none refused (401); more from this address within a minute are not logged");
                }
                return refuse(
                    StatusCode::UNAUTHORIZED,
                    "unknown token: Authorization: Bearer <token> with a token of [http] tokens_file",
                );
            }
        }
    }
    let scope = caller.token.as_ref().map(|(_, s)| *s);
    match need(request.method(), request.uri().path(), read_requires_token) {
        Need::Nothing => {}
        Need::Read if scope.is_some() => {}
        Need::Read => {
            return refuse(
                StatusCode::UNAUTHORIZED,
                "a token is needed to read (http.require_token_for_read): Authorization: Bearer <token>",
            );
        }
        Need::Operate if tokens.is_none() => {
            return refuse(
                StatusCode::FORBIDDEN,
                "this API is read-only: it takes writes only with [http] tokens_file and a token of scope operate; use the cronlease CLI",
            );
        }
        Need::Operate if scope == Some(Scope::Operate) => {}
        Need::Operate if scope.is_some() => {
            return refuse(
                StatusCode::FORBIDDEN,
                "this token's scope is read: writes need a token of scope operate",
            );
        }
        Need::Operate => {
            return refuse(
                StatusCode::UNAUTHORIZED,
                "a token of scope operate is needed: Authorization: Bearer <token>",
            );
        }
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn what_each_route_needs() {
        let get = Method::GET;
        for open in ["/healthz", "/", "/assets/dashboard.js", "/api/whoami"] {
            assert_eq!(need(&get, open, true), Need::Nothing, "{open}");
        }
        for read in ["/metrics", "/api/status", "/api/history", "/nope"] {
            assert_eq!(need(&get, read, true), Need::Read, "{read}");
            assert_eq!(need(&get, read, false), Need::Nothing, "{read}");
        }
        assert_eq!(need(&Method::HEAD, "/api/status", true), Need::Read);
        for method in [Method::POST, Method::PUT, Method::DELETE, Method::PATCH] {
            assert_eq!(need(&method, "/api/status", false), Need::Operate);
            assert_eq!(need(&method, "/healthz", false), Need::Operate);
        }
    }

    #[test]
    fn failures_block_an_address_for_the_rest_of_its_window_only() {
        let f = Failures::default();
        let (a, b) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        let t0 = Instant::now();
        assert!(f.failed(a, t0), "the first failure of a window is logged");
        for _ in 1..MAX_FAILURES - 1 {
            assert!(!f.failed(a, t0));
        }
        assert_eq!(
            f.blocked(a, t0),
            None,
            "{} failures are allowed",
            MAX_FAILURES - 1
        );
        f.failed(a, t0);
        assert_eq!(
            f.blocked(a, t0 + Duration::from_secs(10)),
            Some(WINDOW - Duration::from_secs(10))
        );
        assert_eq!(f.blocked(b, t0), None, "another address is not blocked");
        assert_eq!(f.blocked(a, t0 + WINDOW), None, "a new window");
        assert!(f.failed(a, t0 + WINDOW), "counted afresh");
    }

    #[test]
    fn ipv6_failures_count_per_64() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(limited(a), limited(b));
        assert_ne!(limited(a), limited(other));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(limited(mapped), IpAddr::from([10, 0, 0, 1]));
    }
}
