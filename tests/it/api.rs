//! The http listener's access (docs/api.md): read-only without tokens and
//! saying so; tokens of `tokens_file` with their scopes, reloaded on SIGHUP,
//! never logged, failures rate-limited per address; HTTPS with the
//! configured certificate.

use std::time::Duration;

use nix::sys::signal::Signal;

use crate::cluster::Cluster;
use crate::service::{http_request, status_of};
use crate::support::{Backend, wait_until};

/// `method path` with `token` (if any) as a bearer token: the status code,
/// the response (head and body).
fn call(port: u16, method: &str, path: &str, token: Option<&str>) -> (u16, String) {
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    call_with(port, method, path, &auth)
}

/// `method path` with `headers` (each ending in CRLF).
fn call_with(port: u16, method: &str, path: &str, auth: &str) -> (u16, String) {
    let text = http_request(
        port,
        &format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n"
        ),
    );
    (status_of(&text), text)
}

/// A new token from `cronlease token NAME --scope SCOPE`: its secret and
/// its `[[token]]` table.
pub(crate) fn token(name: &str, scope: &str) -> (String, String) {
    let out = std::process::Command::new(crate::support::binary())
        .args(["token", name, "--scope", scope])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let (secret, table) = text.split_once('\n').unwrap();
    assert!(secret.starts_with("clt_"), "{text}");
    assert!(!table.contains(secret), "the table keeps no secret: {text}");
    (secret.to_string(), table.to_string())
}

/// Writes the cluster's `tokens.toml` (owner-only, as `check` wants it)
/// with `tables`; its path.
pub(crate) fn tokens_file(c: &Cluster, tables: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let tokens = c.dir.path().join("tokens.toml");
    std::fs::write(&tokens, tables).unwrap();
    std::fs::set_permissions(&tokens, std::fs::Permissions::from_mode(0o600)).unwrap();
    tokens
}

/// Waits until the node listens and is healthy (its store answered).
fn wait_listening(c: &Cluster, port: u16) {
    wait_until(
        "the listener, healthy",
        Duration::from_secs(15),
        || c.report(),
        || (call(port, "GET", "/healthz", None).0 == 200).then_some(()),
    );
}

#[test]
fn without_tokens_the_api_is_read_only_and_says_so() {
    let (mut c, port) = Cluster::listening(Backend::Sqlite, "");
    c.start("n1");
    wait_listening(&c, port);
    assert_eq!(call(port, "GET", "/api/status", None).0, 200);
    let (code, whoami) = call(port, "GET", "/api/whoami", None);
    assert_eq!(code, 200, "{whoami}");
    assert!(
        whoami.contains("\"writes\":\"no: this listener has no [http] tokens_file"),
        "{whoami}"
    );
    let (code, write) = call(port, "POST", "/api/status", None);
    assert_eq!(code, 403, "{write}");
    assert!(write.contains("this API is read-only"), "{write}");
    // No tokens to check one against: a presented token, another scheme
    // (a proxy's Basic) or a malformed header is no token, never a 401.
    for auth in [
        "Authorization: Bearer clt_guess\r\n",
        "Authorization: Basic dXNlcjpwYXNz\r\n",
        "Authorization: Bearer\r\n",
        "Authorization: Bearer caf\u{e9}\r\n",
    ] {
        let (code, text) = call_with(port, "GET", "/api/status", auth);
        assert_eq!(code, 200, "{auth:?}: {text}");
    }
    let (code, write) = call(port, "POST", "/api/status", Some("clt_guess"));
    assert_eq!(code, 403, "{write}");
    c.stop_all();
    assert!(
        c.log("n1").contains("read-only: no http.tokens_file"),
        "the start says so\n{}",
        c.log("n1")
    );
}

#[test]
fn tokens_scopes_reload_and_rate_limit() {
    let (reader, reader_table) = token("dashboard", "read");
    let (operator, operator_table) = token("deploy-bot", "operate");
    let (later, later_table) = token("later", "read");
    let (mut c, port) = Cluster::listening(
        Backend::Sqlite,
        "tokens_file = \"tokens.toml\"\nrequire_token_for_read = true",
    );
    let tokens = tokens_file(&c, &format!("{reader_table}\n{operator_table}"));
    c.start("n1");
    wait_listening(&c, port);

    // Open without a token: the probe, the page and whoami.
    assert_eq!(call(port, "GET", "/healthz", None).0, 200);
    assert_eq!(call(port, "GET", "/", None).0, 200);
    let (code, anonymous) = call(port, "GET", "/api/whoami", None);
    assert_eq!(code, 200, "{anonymous}");
    assert!(anonymous.contains("\"token\":null"), "{anonymous}");
    // Reading needs a token of either scope.
    for path in ["/api/status", "/api/nodes", "/api/history", "/metrics"] {
        let (code, text) = call(port, "GET", path, None);
        assert_eq!(code, 401, "{path}: {text}");
        assert!(
            text.contains("WWW-Authenticate: Bearer") || text.contains("www-authenticate: Bearer"),
            "{text}"
        );
        assert_eq!(call(port, "GET", path, Some(&reader)).0, 200, "{path}");
        assert_eq!(call(port, "GET", path, Some(&operator)).0, 200, "{path}");
    }
    let (_, me) = call(port, "GET", "/api/whoami", Some(&reader));
    assert!(
        me.contains("\"token\":\"dashboard\"") && me.contains("\"scope\":\"read\""),
        "{me}"
    );
    // Writing needs operate: a read token is refused before any route.
    let (code, text) = call(port, "POST", "/api/status", Some(&reader));
    assert_eq!(code, 403, "{text}");
    assert!(text.contains("scope is read"), "{text}");
    let (code, text) = call(port, "POST", "/api/status", None);
    assert_eq!(code, 401, "{text}");
    // Another scheme is no token: refused where one is needed, not counted.
    let (code, text) = call_with(
        port,
        "GET",
        "/api/status",
        "Authorization: Basic dXNlcjpwYXNz\r\n",
    );
    assert_eq!(code, 401, "{text}");
    assert_eq!(call(port, "HEAD", "/api/status", None).0, 401);
    // An operate token passes; there is no write on this path (405).
    assert_eq!(call(port, "POST", "/api/status", Some(&operator)).0, 405);

    // A reload replaces the tokens: the new one reads, the removed one not.
    std::fs::write(&tokens, format!("{later_table}\n{operator_table}")).unwrap();
    c.signal("n1", Signal::SIGHUP);
    wait_until(
        "the reload",
        Duration::from_secs(10),
        || c.report(),
        || c.log("n1").contains("configuration reloaded").then_some(()),
    );
    assert_eq!(call(port, "GET", "/api/status", Some(&later)).0, 200);
    assert_eq!(call(port, "GET", "/api/status", Some(&reader)).0, 401);

    // Failures from one address: MAX_FAILURES answered 401, then 429 for
    // unknown tokens for the rest of the minute; a good token still reads.
    let mut codes = Vec::new();
    for _ in 0..12 {
        codes.push(call(port, "GET", "/api/status", Some("clt_wrong")).0);
    }
    let refused = codes.iter().filter(|c| **c == 401).count();
    assert!(
        (8..=10).contains(&refused) && codes.ends_with(&[429, 429]),
        "{codes:?}"
    );
    let (code, text) = call(port, "GET", "/api/status", Some("clt_wrong"));
    assert_eq!(code, 429, "{text}");
    assert!(text.to_lowercase().contains("retry-after:"), "{text}");
    assert_eq!(call(port, "GET", "/api/status", Some(&later)).0, 200);
    // Without a token nothing is counted or refused that way.
    assert_eq!(call(port, "GET", "/healthz", None).0, 200);

    c.stop_all();
    let log = c.log("n1");
    for secret in [&reader, &operator, &later, &"clt_wrong".to_string()] {
        assert!(!log.contains(secret.as_str()), "a token in the log:\n{log}");
    }
    assert_eq!(
        log.matches("a request with a token that matches none")
            .count(),
        1,
        "one line per address and minute\n{log}"
    );
}

#[test]
fn https_with_the_configured_certificate_and_a_bad_key_refused_at_check() {
    let certs = tempfile::tempdir().unwrap();
    crate::support::make_certs(certs.path());
    let d = certs.path().display();
    let (mut c, port) = Cluster::listening(
        Backend::Sqlite,
        &format!("tls_cert_file = \"{d}/server.pem\"\ntls_key_file = \"{d}/server.key\""),
    );
    c.start("n1");
    let curl = |args: &[&str]| {
        std::process::Command::new("curl")
            .args(["-sS", "--max-time", "5"])
            .args(args)
            .output()
            .expect("curl")
    };
    let url = format!("https://127.0.0.1:{port}/healthz");
    let ca = format!("{d}/ca.pem");
    // `ok` once the store answered (before that, 503 `store not
    // answering`, which curl without -f takes for a success too).
    let ok = wait_until(
        "an HTTPS answer",
        Duration::from_secs(15),
        || c.report(),
        || {
            let out = curl(&["--cacert", &ca, &url]);
            (out.status.success() && out.stdout == b"ok\n").then_some(out)
        },
    );
    assert_eq!(String::from_utf8_lossy(&ok.stdout), "ok\n");
    let other = curl(&["--cacert", &format!("{d}/other.pem"), &url]);
    assert!(
        !other.status.success(),
        "a client trusting another CA refuses it"
    );
    // Plain HTTP reaches the listener and gets no HTTP answer.
    {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("listening");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        assert!(
            !String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"),
            "no plain HTTP on an HTTPS listener: {}",
            String::from_utf8_lossy(&answer)
        );
    }
    c.stop_all();

    // A key that is not one: `check` names the file and the line (exit 78).
    std::fs::write(certs.path().join("bad.key"), "not a key\n").unwrap();
    c.edit_configs("server.key", "bad.key");
    let out = c.cli("n1", &["check"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("n1.toml:") && stderr.contains("no PEM private key"),
        "{stderr}"
    );
}

/// `method path` with `token` and a JSON `body`: the status code and the
/// answer's JSON (`null` when it is none).
fn call_json(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, serde_json::Value) {
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let text = http_request(
        port,
        &format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    );
    let json = text
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or(serde_json::Value::Null);
    (status_of(&text), json)
}

/// The write API (docs/api.md) does what the CLI does, by the same code:
/// a trigger (202 with the run to poll; asked again with its request id,
/// the same request, also once it ran), a refusal while a run goes (409),
/// cancel (202; the run recorded `cancelled` by the token's name with the
/// reason), pause and resume (as `status` shows), withdrawal; a read token
/// cannot write (403), an unknown job is 404, a bad body 400; the job's
/// page shows the output tail to `operate` tokens only; the OpenAPI
/// document lists every endpoint, and each answers.
#[test]
fn the_write_api_triggers_cancels_pauses_and_resumes_as_the_cli_does() {
    let (reader, reader_table) = token("dashboard", "read");
    let (operator, operator_table) = token("deploy-bot", "operate");
    let port = crate::support::free_port();
    let jobs = r#"
[[job]]
name = "short"
schedule = "0 0 0 1 1 *"
command = "echo short-output"

[[job]]
name = "long"
schedule = "0 0 0 1 1 *"
kill_grace = "2s"
command = "echo long-output; sleep 30"
"#;
    let mut c = Cluster::new(
        Backend::Sqlite,
        Some(jobs),
        &format!("[http]\nlisten = \"127.0.0.1:{port}\"\ntokens_file = \"tokens.toml\"\n"),
    );
    tokens_file(&c, &format!("{reader_table}\n{operator_table}"));
    assert!(c.cli("n1", &["migrate"]).status.success());
    c.start("n1");
    wait_listening(&c, port);
    let op = Some(operator.as_str());

    // Who may write, and what is refused before the store is asked.
    let (code, _) = call_json(port, "POST", "/api/jobs/short/trigger", Some(&reader), "");
    assert_eq!(code, 403);
    let (code, body) = call_json(port, "POST", "/api/jobs/nope/trigger", op, "");
    assert_eq!(code, 404, "{body}");
    let (code, body) = call_json(port, "POST", "/api/jobs/short/trigger", op, "{\"when\":1}");
    assert_eq!(code, 400, "{body}");

    // A trigger with a request id, asked again: the same request.
    let ask = r#"{"request_id": "deploy-7"}"#;
    let (code, first) = call_json(port, "POST", "/api/jobs/short/trigger", op, ask);
    assert_eq!(code, 202, "{first}");
    let id = first["trigger"].as_str().unwrap().to_string();
    assert_eq!(first["poll"], format!("/api/jobs/short/triggers/{id}"));
    let (code, again) = call_json(port, "POST", "/api/jobs/short/trigger", op, ask);
    assert_eq!(
        (code, again["trigger"].as_str()),
        (202, Some(id.as_str())),
        "{again}"
    );
    let ended = wait_until(
        "the manual run's record through the API",
        Duration::from_secs(15),
        || c.report(),
        || {
            let (_, p) = call_json(
                port,
                "GET",
                &format!("/api/jobs/short/triggers/{id}"),
                op,
                "",
            );
            (p["state"] == "ended").then_some(p)
        },
    );
    assert_eq!(ended["run"]["outcome"], "ok", "{ended}");
    // An id that is neither pending, running nor recorded: 404, never
    // `taken` forever.
    let old =
        cronlease::store::TriggerId::made_at(chrono::Utc::now() - chrono::TimeDelta::hours(1));
    let (code, unknown) = call_json(
        port,
        "GET",
        &format!("/api/jobs/short/triggers/{old}"),
        op,
        "",
    );
    assert_eq!(code, 404, "{unknown}");
    let (code, after) = call_json(port, "POST", "/api/jobs/short/trigger", op, ask);
    assert_eq!(
        (code, after["trigger"].as_str()),
        (202, Some(id.as_str())),
        "ran once: {after}"
    );
    let runs = crate::cluster::history(&c, "short");
    assert_eq!(runs.len(), 1, "one run for one request id: {runs:?}");

    // A long run: refused while it goes, then cancelled by the token.
    let (code, long) = call_json(port, "POST", "/api/jobs/long/trigger", op, "");
    assert_eq!(code, 202, "{long}");
    let long_id = long["trigger"].as_str().unwrap().to_string();
    wait_until(
        "the job's page to show the run going",
        Duration::from_secs(15),
        || c.report(),
        || {
            let (_, page) = call_json(port, "GET", "/api/jobs/long", Some(&reader), "");
            (!page["status"]["running"].as_array()?.is_empty()).then_some(())
        },
    );
    let (code, refused) = call_json(port, "POST", "/api/jobs/long/trigger", op, "");
    assert_eq!(
        (code, refused["refused"].as_str()),
        (409, Some("running")),
        "{refused}"
    );
    let (code, asked) = call_json(
        port,
        "POST",
        "/api/jobs/long/cancel",
        op,
        r#"{"reason": "api test"}"#,
    );
    assert_eq!(code, 202, "{asked}");
    assert_eq!(asked["asked"][0]["node"], "n1", "{asked}");
    let cancelled = wait_until(
        "the cancelled record",
        Duration::from_secs(15),
        || c.report(),
        || {
            let (_, p) = call_json(
                port,
                "GET",
                &format!("/api/jobs/long/triggers/{long_id}"),
                op,
                "",
            );
            (p["state"] == "ended").then_some(p)
        },
    );
    assert_eq!(cancelled["run"]["outcome"], "cancelled", "{cancelled}");
    let output = cancelled["run"]["output"].as_str().unwrap_or_default();
    assert!(
        output.contains("long-output")
            && output.ends_with("cancelled by token deploy-bot: api test\n"),
        "{output:?}"
    );
    // The job's page: output tails to operate tokens only; durations.
    let (_, seen_op) = call_json(port, "GET", "/api/jobs/long", op, "");
    let (_, seen_read) = call_json(port, "GET", "/api/jobs/long", Some(&reader), "");
    assert!(
        seen_op["runs"][0]["output"]
            .as_str()
            .unwrap()
            .contains("long-output"),
        "{seen_op}"
    );
    assert_eq!(seen_read["runs"][0]["output"], "", "{seen_read}");
    assert!(
        seen_read["runs"][0]["duration_ms"].as_i64().is_some(),
        "{seen_read}"
    );
    assert_eq!(
        seen_read["definition_digest"].as_str().map(str::len),
        Some(16),
        "{seen_read}"
    );
    // Once the node's beat says it is over: nothing to cancel.
    wait_until(
        "the run to leave the job's page",
        Duration::from_secs(5),
        || c.report(),
        || {
            let (_, page) = call_json(port, "GET", "/api/jobs/long", Some(&reader), "");
            page["status"]["running"]
                .as_array()?
                .is_empty()
                .then_some(())
        },
    );
    let (code, nothing) = call_json(port, "POST", "/api/jobs/long/cancel", op, "");
    assert_eq!(code, 409, "{nothing}");

    // Pause and resume, as status shows.
    let paused = |want: bool| {
        let rows = c.cli_json("n1", &["status"]).unwrap();
        rows.as_array()
            .unwrap()
            .iter()
            .any(|r| r["job"] == "short" && r["paused"] == want)
    };
    let (code, body) = call_json(
        port,
        "POST",
        "/api/jobs/short/pause",
        op,
        r#"{"reason": "maintenance"}"#,
    );
    assert_eq!(
        (code, body["paused"].as_bool()),
        (200, Some(true)),
        "{body}"
    );
    assert!(paused(true));
    let (code, body) = call_json(port, "POST", "/api/jobs/short/resume", op, "");
    assert_eq!(
        (code, body["paused"].as_bool()),
        (200, Some(false)),
        "{body}"
    );
    assert!(paused(false));
    // Each write is in the audit with the token's name and the reason:
    // `/api/actions`, the job's page and `history --actions` alike.
    let (code, audit) = call_json(port, "GET", "/api/actions?job=short", Some(&reader), "");
    assert_eq!(code, 200, "{audit}");
    let said: Vec<(&str, &str, &str)> = audit
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["action"].as_str().unwrap(),
                a["by"].as_str().unwrap(),
                a["reason"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        said,
        [
            ("resume", "token deploy-bot", ""),
            ("pause", "token deploy-bot", "maintenance"),
            ("trigger", "token deploy-bot", ""),
        ],
        "one trigger for one request id, asked three times: {audit}"
    );
    assert_eq!(audit[2]["detail"], format!("trigger {id}"), "{audit}");
    let (_, page) = call_json(port, "GET", "/api/jobs/short", Some(&reader), "");
    assert_eq!(page["actions"], audit, "{page}");
    let (_, long_audit) = call_json(port, "GET", "/api/actions?job=long", Some(&reader), "");
    assert_eq!(long_audit[0]["action"], "cancel", "{long_audit}");
    assert_eq!(long_audit[0]["reason"], "api test", "{long_audit}");
    let cli = c.cli_json("n1", &["history", "--actions"]).unwrap();
    assert_eq!(cli.as_array().map(Vec::len), Some(5), "{cli}");

    // Withdrawal (the CLI's code, tested with `trigger --cancel`): none
    // pending here.
    let (code, none) = call_json(port, "DELETE", "/api/jobs/short/trigger", op, "");
    assert_eq!(code, 409, "{none}");
    assert!(
        none["error"]
            .as_str()
            .unwrap()
            .contains("no manual run of short is pending"),
        "{none}"
    );

    // The OpenAPI document lists every endpoint; each is routed.
    let (code, doc) = call_json(port, "GET", "/api/openapi.json", None, "");
    assert_eq!(code, 200, "{doc}");
    for e in cronlease::http::ENDPOINTS {
        assert!(
            doc["paths"][e.path][e.method].is_object(),
            "{} {}",
            e.method,
            e.path
        );
        let path = e.path.replace("{job}", "short").replace("{id}", &id);
        let (code, body) = call_json(port, &e.method.to_uppercase(), &path, op, "");
        assert_ne!(code, 404, "{} {path}: {body}", e.method);
        assert_ne!(code, 405, "{} {path}: {body}", e.method);
    }
    c.stop_all();
    let log = c.log("n1");
    assert!(
        log.contains("paused through the API") && log.contains("by=token deploy-bot"),
        "{log}"
    );
    assert!(
        !log.contains(&operator) && !log.contains(&reader),
        "a token in the log"
    );
}
