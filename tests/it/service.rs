//! Running it like a service (issue 4): sd_notify, metrics and health, TLS
//! to Redis, secrets kept out of every output, per-job identity.

use std::io::{Read, Write};
use std::os::unix::net::UnixDatagram;
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::cluster::Cluster;
use crate::support::{Backend, RedisServer, binary, free_port, wait_until};

/// Datagrams received on a notify socket until `limit` or `until` says stop.
fn collect(sock: &UnixDatagram, limit: Duration, until: impl Fn(&[String]) -> bool) -> Vec<String> {
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline && !until(&got) {
        if let Ok(n) = sock.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    got
}

/// A store that stays down does not hold the unit's start: after 10 s the
/// daemon reports ready anyway, saying what it waits for, and keeps
/// running (claiming once the store answers).
#[test]
fn sd_notify_ready_after_ten_seconds_of_a_store_that_stays_down() {
    let redis = RedisServer::new(false);
    let mut c = Cluster::with_url(Backend::Redis, Some(&redis.url()), None, "");
    let path = c.dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let started = Instant::now();
    c.start_with_env("n1", &[("NOTIFY_SOCKET", path.to_str().unwrap())]);
    let got = collect(&sock, Duration::from_secs(25), |got| {
        got.iter().any(|m| m.contains("READY=1"))
    });
    let waited = started.elapsed();
    let ready = got
        .iter()
        .find(|m| m.contains("READY=1"))
        .unwrap_or_else(|| panic!("no READY=1 within 25 s: {got:?}\n{}", c.report()));
    assert!(
        ready.contains("STATUS=1 jobs, waiting for the store: "),
        "{ready}"
    );
    // Not before the 10 s (no timing bound above: a loaded machine is slow).
    assert!(waited >= Duration::from_secs(9), "{waited:?}: {got:?}");
    assert!(c.is_running("n1"), "{}", c.report());
    assert!(
        c.log("n1")
            .contains("reporting ready to systemd anyway; claiming starts once it answers"),
        "{}",
        c.log("n1")
    );
    c.stop_all();
}

#[test]
fn sd_notify_ready_only_once_the_store_answers_then_watchdog_and_stopping() {
    let mut redis = RedisServer::new(false);
    let mut c = Cluster::with_url(Backend::Redis, Some(&redis.url()), None, "");
    let path = c.dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    c.start_with_env(
        "n1",
        &[
            ("NOTIFY_SOCKET", path.to_str().unwrap()),
            ("WATCHDOG_USEC", "900000"),
        ],
    );

    let before = collect(&sock, Duration::from_secs(3), |_| false);
    assert!(
        !before.iter().any(|m| m.contains("READY=1")),
        "no READY=1 while the store is down: {before:?}"
    );
    assert!(
        before.iter().filter(|m| m.contains("WATCHDOG=1")).count() >= 3,
        "watchdog pings: {before:?}"
    );
    assert!(
        before
            .iter()
            .any(|m| m.contains("STATUS=1 jobs, waiting for the store: ")
                && m.contains("unreachable")),
        "{before:?}"
    );

    redis.start();
    let after = collect(&sock, Duration::from_secs(10), |got| {
        got.iter().any(|m| m.contains("READY=1"))
    });
    assert!(
        after.iter().any(|m| m.contains("READY=1")),
        "READY=1 once the store answered: {after:?}\n{}",
        c.report()
    );
    let running = collect(&sock, Duration::from_secs(3), |_| false);
    assert!(
        running.iter().filter(|m| m.contains("WATCHDOG=1")).count() >= 3,
        "{running:?}"
    );
    assert!(
        running
            .iter()
            .any(|m| m.contains("STATUS=1 jobs, holding 1 leases, store up")),
        "{running:?}"
    );

    c.signal("n1", Signal::SIGTERM);
    let stopping = collect(&sock, Duration::from_secs(10), |got| {
        got.iter().any(|m| m.contains("STOPPING=1"))
    });
    assert!(
        stopping.iter().any(|m| m.contains("STOPPING=1")),
        "{stopping:?}"
    );
    assert!(
        c.wait_exit("n1", Duration::from_secs(10))
            .is_some_and(|s| s.success())
    );
    // Jobs never see the notify socket.
    assert!(!c.log("n1").contains("NOTIFY_SOCKET"));
}

pub(crate) fn http_get(port: u16, path: &str) -> (u16, String) {
    let text = http_request(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"),
    );
    (status_of(&text), text)
}

/// The status code of a response's text (0: no answer).
pub(crate) fn status_of(text: &str) -> u16 {
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// Sets `log.format = "json"` in `nodes`' configs.
fn log_json(c: &Cluster, nodes: &[&str]) {
    for n in nodes {
        let cfg = std::fs::read_to_string(c.config(n))
            .unwrap()
            .replace("[log]\n", "[log]\nformat = \"json\"\n");
        std::fs::write(c.config(n), cfg).unwrap();
    }
}

/// Sends `request` as is and reads until the server closes (at most 10 s);
/// what came back, "" when the server closed without answering or nothing
/// listens.
pub(crate) fn http_request(port: u16, request: &str) -> String {
    // Not listening (yet, or any more): no answer, as a closed connection.
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // A server that refuses a request may close before all of it is sent.
    let _ = s.write_all(request.as_bytes());
    let mut bytes = Vec::new();
    let _ = s.read_to_end(&mut bytes);
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The value of the first sample line starting with `series`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn metrics_and_healthz() {
    let mut redis = RedisServer::new(false);
    redis.start();
    let port = free_port();
    let mut c = Cluster::with_url(
        Backend::Redis,
        Some(&redis.url()),
        None,
        &format!("[metrics]\nlisten = \"127.0.0.1:{port}\""),
    );
    c.start("n1");
    c.wait_for("three runs", Duration::from_secs(15), |l| l.len() >= 3);
    let (code, text) = http_get(port, "/metrics");
    assert_eq!(code, 200, "{text}");
    let claims = sample(
        &text,
        "cronlease_claims_total{cron_job=\"tick\",result=\"won\"}",
    )
    .unwrap_or(0.0);
    let runs = sample(
        &text,
        "cronlease_runs_total{cron_job=\"tick\",outcome=\"ok\"}",
    )
    .unwrap_or(0.0);
    let late_n = sample(
        &text,
        "cronlease_start_lateness_seconds_count{cron_job=\"tick\"}",
    )
    .unwrap_or(0.0);
    let late_sum = sample(
        &text,
        "cronlease_start_lateness_seconds_sum{cron_job=\"tick\"}",
    )
    .unwrap_or(f64::NAN);
    let calls = sample(&text, "cronlease_store_call_seconds_count{op=\"claim\"}").unwrap_or(0.0);
    assert!(
        claims >= 3.0 && runs >= 2.0 && late_n >= 3.0 && calls >= 3.0,
        "{text}"
    );
    assert!(
        late_sum / late_n < 0.2,
        "plausible lateness: mean {:.3}s\n{text}",
        late_sum / late_n
    );
    assert!(
        text.contains("cronlease_run_duration_seconds_bucket{"),
        "{text}"
    );
    assert_eq!(sample(&text, "cronlease_store_up"), Some(1.0), "{text}");
    assert_eq!(sample(&text, "cronlease_leases_held"), Some(1.0), "{text}");
    assert_eq!(sample(&text, "cronlease_jobs_held"), Some(1.0), "{text}");
    assert_eq!(
        sample(&text, "cronlease_nodes_alive"),
        Some(1.0),
        "this node, from its heartbeat\n{text}"
    );
    assert_eq!(
        sample(&text, "cronlease_store_errors_total"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(http_get(port, "/healthz").0, 200);
    assert_eq!(http_get(port, "/nope").0, 404);

    redis.stop();
    wait_until(
        "/healthz to turn 503 with the store gone",
        Duration::from_secs(5),
        || c.report(),
        || (http_get(port, "/healthz").0 == 503).then_some(()),
    );
    let (_, text) = http_get(port, "/metrics");
    assert!(
        sample(&text, "cronlease_store_errors_total").unwrap_or(0.0) >= 1.0,
        "{text}"
    );
    assert_eq!(sample(&text, "cronlease_store_up"), Some(0.0), "{text}");
    redis.start();
    wait_until(
        "/healthz to recover",
        Duration::from_secs(5),
        || c.report(),
        || (http_get(port, "/healthz").0 == 200).then_some(()),
    );
    c.stop_all();
}

/// The per-job series (docs/operations.md): labelled `cron_job`, never
/// `job`; a node's own runs set the last-run, last-success and duration
/// gauges, its claims the paused gauge, the schedule the interval; and a
/// node that never ran the job reads the last success from the store's
/// history at start.
#[test]
fn per_job_series_come_from_runs_claims_schedule_and_history() {
    let port = free_port();
    let jobs = "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = [\"/bin/sh\", \"-c\", \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N)\\\" >> '{out}'\"]\n[[job]]\nname = \"slow\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"sleep 3\"\n";
    let mut c = Cluster::new(
        Backend::Sqlite,
        Some(jobs),
        &format!("[http]\nlisten = \"127.0.0.1:{port}\""),
    );
    c.start("n1");
    c.wait_for("three runs", Duration::from_secs(15), |l| l.len() >= 3);
    // A run going shows in cronlease_job_running, and goes from it.
    let out = c.cli("n1", &["trigger", "slow"]);
    assert!(out.status.success(), "{out:?}");
    let running = |v: f64| {
        move || {
            let (_, text) = http_get(port, "/metrics");
            (sample(&text, "cronlease_job_running{cron_job=\"slow\"}") == Some(v)).then_some(())
        }
    };
    wait_until(
        "slow running",
        Duration::from_secs(10),
        || c.report(),
        running(1.0),
    );
    wait_until(
        "slow over",
        Duration::from_secs(10),
        || c.report(),
        running(0.0),
    );
    let (code, text) = http_get(port, "/metrics");
    assert_eq!(code, 200, "{text}");
    assert!(
        !text.contains("{job=") && !text.contains(",job="),
        "no series labelled job:\n{text}"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let success = sample(
        &text,
        "cronlease_job_last_success_timestamp_seconds{cron_job=\"tick\"}",
    )
    .unwrap_or(0.0);
    let last_run = sample(
        &text,
        "cronlease_job_last_run_timestamp_seconds{cron_job=\"tick\"}",
    )
    .unwrap_or(0.0);
    assert!(
        (now - 30.0..=now).contains(&success) && last_run >= success,
        "now {now}\n{text}"
    );
    let took = sample(
        &text,
        "cronlease_job_last_duration_seconds{cron_job=\"tick\"}",
    );
    assert!(took.is_some_and(|t| (0.0..1.0).contains(&t)), "{text}");
    assert_eq!(
        sample(&text, "cronlease_job_interval_seconds{cron_job=\"tick\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "cronlease_job_paused{cron_job=\"tick\"}"),
        Some(0.0),
        "{text}"
    );

    // Paused, then n1 gone: n2 never runs the job, yet exports n1's last
    // success (from the history) and the pause (from its claims).
    let out = c.cli("n1", &["pause", "tick"]);
    assert!(out.status.success(), "{out:?}");
    let (_, before) = http_get(port, "/metrics");
    let floor = sample(
        &before,
        "cronlease_job_last_success_timestamp_seconds{cron_job=\"tick\"}",
    )
    .unwrap_or(0.0);
    c.signal("n1", Signal::SIGTERM);
    assert!(
        c.wait_exit("n1", Duration::from_secs(10)).is_some(),
        "{}",
        c.report()
    );
    let stopped = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    c.start("n2");
    let text = wait_until(
        "n2 to export the paused job's last success and its pause",
        Duration::from_secs(15),
        || c.report(),
        || {
            let (code, text) = http_get(port, "/metrics");
            (code == 200
                && sample(&text, "cronlease_job_paused{cron_job=\"tick\"}") == Some(1.0)
                && text.contains("cronlease_job_last_success_timestamp_seconds{"))
            .then_some(text)
        },
    );
    let seeded = sample(
        &text,
        "cronlease_job_last_success_timestamp_seconds{cron_job=\"tick\"}",
    )
    .unwrap_or(0.0);
    assert!(
        (floor..=stopped).contains(&seeded),
        "n2's last success {seeded} is n1's last ({floor} .. {stopped})\n{text}"
    );
    assert!(
        c.lines().iter().all(|l| l.node != "n2"),
        "n2 ran the paused job\n{}",
        c.report()
    );
    // A manual run goes while the job is paused, and says nothing of the
    // pause: the gauge stays 1.
    let out = c.cli("n2", &["trigger", "tick", "--wait"]);
    assert!(out.status.success(), "{out:?}");
    assert!(c.lines().iter().any(|l| l.node == "n2"), "{}", c.report());
    let (_, text) = http_get(port, "/metrics");
    assert_eq!(
        sample(&text, "cronlease_job_paused{cron_job=\"tick\"}"),
        Some(1.0),
        "{text}"
    );
    c.stop_all();
}

#[test]
fn redis_over_tls_trusts_only_its_ca() {
    let certs = tempfile::tempdir().unwrap();
    let d = certs.path();
    crate::support::make_certs(d);
    let port = free_port();
    let mut server = Command::new("redis-server")
        .current_dir(d)
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            "server.pem",
            "--tls-key-file",
            "server.key",
            "--tls-ca-cert-file",
            "ca.pem",
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server with TLS");
    std::thread::sleep(Duration::from_millis(500));
    let url = format!("rediss://127.0.0.1:{port}/");
    let store_extra = format!("tls_ca_file = \"{}\"", d.join("ca.pem").display());
    let c =
        only_the_trusting_node_claims(Backend::Redis, &url, &store_extra, Duration::from_secs(15));
    let _ = server.kill();
    let _ = server.wait();
    let n2_log = c.log("n2");
    assert!(
        n2_log.contains("store unavailable")
            || n2_log.contains("store") && n2_log.contains("failed"),
        "{n2_log}"
    );
    assert!(
        n2_log.to_lowercase().contains("certificate") || n2_log.contains("UnknownIssuer"),
        "the reason is named\n{n2_log}"
    );
}

#[test]
fn passwords_never_appear_in_any_output() {
    const SECRET: &str = "Sup3rS3cretPw";
    let cases = [
        format!("redis://:{SECRET}@127.0.0.1:1/"),
        format!("mysql://root:{SECRET}@127.0.0.1:3306/test"),
        format!("postgres://cronlease_nobody:{SECRET}@127.0.0.1:1/test"),
    ];
    for url in cases {
        let jobs = "[[job]]\nname = \"env\"\nschedule = \"* * * * * *\"\ncommand = \"env\"\n";
        let mut c = Cluster::build(Backend::Sqlite, Some(&url), Some(jobs), "", "");
        std::thread::sleep(Duration::from_millis(10));
        c.start("n1");
        c.start_with_env("n2", &[("CRONLEASE_STORE_URL", url.as_str())]);
        std::thread::sleep(Duration::from_secs(3));
        c.stop_all();
        let mut outputs = vec![c.log("n1"), c.log("n2")];
        for args in [
            &["status"][..],
            &["status", "--json"],
            &["nodes"],
            &["nodes", "--json"],
            &["history"],
            &["migrate"],
            &["check"],
            &["step-down"],
        ] {
            let out = c.cli("n1", args);
            outputs.push(String::from_utf8_lossy(&out.stdout).into_owned());
            outputs.push(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        let all = outputs.join("\n");
        assert!(
            !all.contains(SECRET),
            "the password leaked for {}:\n{all}",
            url.replace(SECRET, "<secret>")
        );
        assert!(all.contains("***"), "the redacted URL is shown: {all}");
        // A wrong password is a refusal (the daemon exits 77 at start).
        assert!(
            all.contains("store unavailable")
                || all.contains("unreachable")
                || all.contains("failed")
                || all.contains("refused this node"),
            "{all}"
        );
    }
}

#[test]
fn a_config_holding_a_password_readable_by_others_is_flagged() {
    use std::os::unix::fs::PermissionsExt;
    let c = Cluster::build(
        Backend::Sqlite,
        Some("redis://:pw@127.0.0.1:6379/"),
        None,
        "",
        "",
    );
    let config = c.config("n1");
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new(binary())
        .args(["check", "-c"])
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("holds the store password and is readable by other users (mode 0644)"),
        "{stderr}"
    );
    assert!(!stderr.contains("pw@"), "{stderr}");
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o640)).unwrap();
    let out = Command::new(binary())
        .args(["check", "-c"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stderr).contains("readable by other users"));
}

#[test]
fn a_job_runs_as_its_user_without_root_groups() {
    let jobs = "[[job]]\nname = \"who\"\nschedule = \"* * * * * *\"\nuser = \"nobody\"\ncommand = \"echo who: $(id -u) $(id -G) $HOME $USER\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    c.start("n1");
    wait_until(
        "the job's output",
        Duration::from_secs(15),
        || c.report(),
        || c.log("n1").contains("who: ").then_some(()),
    );
    c.stop_all();
    let log = c.log("n1");
    let line = log.lines().find(|l| l.contains("who: ")).unwrap();
    let nobody = nix::unistd::User::from_name("nobody").unwrap().unwrap();
    let want = format!(
        "who: {} {} {} nobody",
        nobody.uid,
        nobody.gid,
        nobody.dir.display()
    );
    assert!(
        line.contains(&want),
        "{line} (want {want}: no supplementary groups from root)"
    );
}

/// A job's `user` brings the user's supplementary groups (initgroups), as
/// login and cron do. Creates a group and a user in it (needs root).
#[test]
fn a_job_runs_with_its_users_supplementary_groups() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: creating a user and group needs root");
        return;
    }
    let (user, group) = ("cronlease-it-user", "cronlease-it-extra");
    let run = |cmd: &[&str]| {
        std::process::Command::new(cmd[0])
            .args(&cmd[1..])
            .output()
            .unwrap()
    };
    if nix::unistd::Group::from_name(group).unwrap().is_none() {
        let out = run(&["groupadd", "--system", group]);
        assert!(
            out.status.success(),
            "groupadd: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    if nix::unistd::User::from_name(user).unwrap().is_none() {
        let out = run(&[
            "useradd",
            "--system",
            "--no-create-home",
            "--groups",
            group,
            user,
        ]);
        assert!(
            out.status.success(),
            "useradd: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    } else {
        run(&["usermod", "--append", "--groups", group, user]);
    }
    let extra = nix::unistd::Group::from_name(group).unwrap().unwrap().gid;
    let jobs = format!(
        "[[job]]\nname = \"groups\"\nschedule = \"* * * * * *\"\nuser = \"{user}\"\ncommand = \"echo groups: $(id -G) end\"\n"
    );
    let mut c = Cluster::new(Backend::Sqlite, Some(&jobs), "");
    c.start("n1");
    wait_until(
        "the job's output",
        Duration::from_secs(15),
        || c.report(),
        || c.log("n1").contains("groups: ").then_some(()),
    );
    c.stop_all();
    let log = c.log("n1");
    let line = log.lines().find(|l| l.contains("groups: ")).unwrap();
    let groups: Vec<&str> = line
        .split("groups: ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .take_while(|g| *g != "end")
        .collect();
    assert!(
        groups.contains(&extra.to_string().as_str()),
        "{line}: the supplementary group {group} ({extra}) is missing"
    );
    assert!(!groups.contains(&"0"), "{line}: root's group leaked in");
}

#[test]
fn user_needs_a_root_daemon() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = dir.path().join("cronlease.toml");
    std::fs::write(&config, "node = \"n\"\n[store]\nurl = \"sqlite:///tmp/x.db\"\n[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\nuser = \"nobody\"\ncommand = \"true\"\n").unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(binary())
        .args(["check", "-c"])
        .arg(&config)
        .output()
        .expect("setpriv (util-linux)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("cronlease.toml:7:8: user/group needs the daemon to run as root"),
        "{stderr}"
    );
}

#[test]
fn json_logs_and_one_event_per_claim_outcome_change() {
    let jobs = "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = \"echo hello $CRONLEASE_FENCE\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    log_json(&c, &["n1", "n2"]);
    for n in ["n1", "n2"] {
        c.start(n);
    }
    std::thread::sleep(Duration::from_secs(6));
    c.stop_all();
    let mut holder_events = 0;
    let mut follower_events = 0;
    for n in ["n1", "n2"] {
        for line in c.log(n).lines() {
            let v: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            assert!(
                v["timestamp"].is_string() && v["level"].is_string(),
                "{line}"
            );
            match v["message"].as_str().unwrap_or("") {
                m if m.starts_with("hello ") => {
                    assert_eq!(v["job"], "tick", "{line}");
                    assert_eq!(
                        v["fence"].to_string(),
                        m.trim_start_matches("hello "),
                        "output tagged with its fence: {line}"
                    );
                }
                "this node now holds the lease" => holder_events += 1,
                "lease held by another node" => follower_events += 1,
                _ => {}
            }
        }
    }
    // Six seconds of claims each second, but the standing changed once per node.
    assert_eq!(
        (holder_events, follower_events),
        (1, 1),
        "one event per claim outcome change\n{}",
        c.report()
    );
}

/// JSON logs are typed (numbers as numbers, instants RFC 3339, no Debug
/// strings), and every line of the daemon's stderr is JSON: its own, its
/// guard's (after the daemon's SIGKILL) and a panic's report.
#[test]
fn json_logs_are_typed_and_every_line_is_json_the_guards_and_a_panics_too() {
    let jobs = "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = [\"/bin/sh\", \"-c\", \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N)\\\" >> '{out}'\"]\n[[job]]\nname = \"fails\"\nschedule = \"* * * * * *\"\ncommand = \"exit 3\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    log_json(&c, &["n1", "n2"]);
    c.start("n1");
    c.wait_for("three runs", Duration::from_secs(15), |l| l.len() >= 3);
    // The daemon dies; its guard hands over and says so.
    c.signal("n1", Signal::SIGKILL);
    c.wait_exit("n1", Duration::from_secs(5));
    let guard_line = wait_until(
        "the guard's line",
        Duration::from_secs(10),
        || c.report(),
        || {
            c.log("n1")
                .lines()
                .find(|l| l.contains("the daemon died"))
                .map(str::to_string)
        },
    );
    // A panic in a task of another daemon.
    c.start_with_env("n2", &[("CRONLEASE_FAILPOINT_PANIC_IN_TASK", "1")]);
    let status = c.wait_exit("n2", Duration::from_secs(15));
    assert_eq!(status.and_then(|s| s.code()), Some(70), "{}", c.report());

    let parse = |line: &str| -> serde_json::Value {
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
    };
    let n1: Vec<serde_json::Value> = c.log("n1").lines().map(parse).collect();
    let failed = n1
        .iter()
        .find(|v| v["message"] == "run finished: failed" && v["job"] == "fails")
        .unwrap_or_else(|| panic!("no failed run logged\n{}", c.log("n1")));
    assert_eq!(failed["exit_code"], 3, "a number: {failed}");
    assert_eq!(failed["outcome"], "failed", "{failed}");
    assert!(
        failed["fence"].is_u64() && failed["duration_ms"].is_i64(),
        "{failed}"
    );
    let started = n1
        .iter()
        .find(|v| v["message"] == "run starting" && v["job"] == "tick")
        .unwrap_or_else(|| panic!("no run start logged\n{}", c.log("n1")));
    let occurrence = started["occurrence"].as_str().unwrap_or_default();
    assert!(
        chrono::DateTime::parse_from_rfc3339(occurrence).is_ok() && occurrence.ends_with('Z'),
        "RFC 3339 in UTC: {started}"
    );
    for v in &n1 {
        for (key, value) in v.as_object().unwrap() {
            let text = value.as_str().unwrap_or_default();
            assert!(
                !text.starts_with("Some(") && !text.starts_with("None"),
                "{key} is a Debug string: {v}"
            );
        }
    }
    let guard = parse(&guard_line);
    assert_eq!(guard["process"], "guard", "{guard}");
    assert_eq!(guard["level"], "WARN", "{guard}");
    let n2: Vec<serde_json::Value> = c.log("n2").lines().map(parse).collect();
    assert!(
        n2.iter().any(|v| v["level"] == "ERROR"
            && v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("internal error, exiting"))
            && v["location"].is_string()),
        "the panic's report as JSON\n{}",
        c.log("n2")
    );
}

type JournalEntry = std::collections::HashMap<String, String>;

/// A journald stand-in: a thread receiving on `sock` (the kernel queues only
/// a few datagrams: a sender blocks on a full queue) and parsing each entry
/// (the native protocol: `KEY=value` lines, or `KEY`, a 64-bit
/// little-endian length and the value).
fn journal_reader(sock: UnixDatagram) -> std::sync::Arc<std::sync::Mutex<Vec<JournalEntry>>> {
    let entries = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let out = entries.clone();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        // Ends with the test: the socket's file goes with its directory.
        while let Ok(n) = sock.recv(&mut buf) {
            let mut data = &buf[..n];
            let mut entry = JournalEntry::new();
            while !data.is_empty() {
                let end = data.iter().position(|b| *b == b'\n').unwrap_or(data.len());
                let line = &data[..end];
                if let Some(eq) = line.iter().position(|b| *b == b'=') {
                    entry.insert(
                        String::from_utf8_lossy(&line[..eq]).into_owned(),
                        String::from_utf8_lossy(&line[eq + 1..]).into_owned(),
                    );
                    data = &data[(end + 1).min(data.len())..];
                } else {
                    let rest = &data[(end + 1).min(data.len())..];
                    let Some(len) = rest.get(..8) else { break };
                    let len = u64::from_le_bytes(len.try_into().unwrap()) as usize;
                    let value = rest.get(8..8 + len).unwrap_or_default();
                    entry.insert(
                        String::from_utf8_lossy(line).into_owned(),
                        String::from_utf8_lossy(value).into_owned(),
                    );
                    data = &rest[(8 + len + 1).min(rest.len())..];
                }
            }
            if !entry.is_empty() {
                out.lock().unwrap().push(entry);
            }
        }
    });
    entries
}

/// Under systemd (stderr is the journal, as `JOURNAL_STREAM` says) the
/// daemon and its guard log to journald natively: a priority per level and
/// the fields as journal fields (JOB, FENCE, OUTCOME, EXIT_CODE, NODE).
/// Without a reachable journald socket: text without our own timestamp.
/// Each daemon runs in a mount namespace of its own (root only) where the
/// test's directory is /run/systemd/journal.
#[test]
fn under_journald_the_daemon_and_its_guard_log_natively_with_priorities_and_fields() {
    use std::os::unix::fs::MetadataExt;
    let jobs = "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = [\"/bin/sh\", \"-c\", \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N)\\\" >> '{out}'\"]\n[[job]]\nname = \"fails\"\nschedule = \"* * * * * *\"\ncommand = \"exit 3\"\n";
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED under_journald_...: a mount namespace of the daemon's own needs root");
        return;
    }
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    let journal = tempfile::tempdir().unwrap();
    let received = journal_reader(UnixDatagram::bind(journal.path().join("socket")).unwrap());
    let empty = tempfile::tempdir().unwrap();
    let start = |c: &mut Cluster, node: &str, dir: &std::path::Path| {
        let log = c.dir.path().join(format!("{node}.log"));
        std::fs::write(&log, "").unwrap();
        let meta = std::fs::metadata(&log).unwrap();
        let stream = format!("{}:{}", meta.dev(), meta.ino());
        // A /run of the namespace's own: nothing is made on the host.
        let script = format!(
            "mount -t tmpfs cronlease-test /run && mkdir -p /run/systemd/journal && mount --bind '{}' /run/systemd/journal && exec \"$@\"",
            dir.display()
        );
        c.start_under(
            node,
            &[
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                &script,
                "sh",
            ],
            &[("JOURNAL_STREAM", stream.as_str())],
        );
    };
    start(&mut c, "n1", journal.path());
    c.wait_for("three runs", Duration::from_secs(15), |l| l.len() >= 3);
    c.signal("n1", Signal::SIGKILL);
    c.wait_exit("n1", Duration::from_secs(5));
    let guard = wait_until(
        "the guard's entry",
        Duration::from_secs(10),
        || c.report(),
        || {
            received
                .lock()
                .unwrap()
                .iter()
                .find(|e| {
                    e.get("MESSAGE")
                        .is_some_and(|m| m.starts_with("the daemon died"))
                })
                .cloned()
        },
    );
    let entries = received.lock().unwrap().clone();
    let field = |e: &JournalEntry, k: &str| e.get(k).cloned().unwrap_or_default();
    assert_eq!(field(&guard, "PROCESS"), "guard", "{guard:?}");
    assert_eq!(field(&guard, "PRIORITY"), "4", "{guard:?}");
    assert_eq!(field(&guard, "NODE"), "n1", "{guard:?}");
    let failed = entries
        .iter()
        .find(|e| field(e, "MESSAGE") == "run finished: failed")
        .unwrap_or_else(|| panic!("no failed run in the journal: {entries:?}"));
    assert_eq!(field(failed, "PRIORITY"), "4", "WARN: {failed:?}");
    assert_eq!(field(failed, "JOB"), "fails", "{failed:?}");
    assert_eq!(field(failed, "OUTCOME"), "failed", "{failed:?}");
    assert_eq!(field(failed, "EXIT_CODE"), "3", "{failed:?}");
    assert_eq!(field(failed, "NODE"), "n1", "{failed:?}");
    assert_eq!(
        field(failed, "SYSLOG_IDENTIFIER"),
        "cronlease",
        "{failed:?}"
    );
    assert!(field(failed, "FENCE").parse::<u64>().is_ok(), "{failed:?}");
    let ok = entries
        .iter()
        .find(|e| field(e, "MESSAGE") == "run finished: ok")
        .unwrap_or_else(|| panic!("no ok run in the journal: {entries:?}"));
    assert_eq!(field(ok, "PRIORITY"), "6", "INFO: {ok:?}");
    assert_eq!(field(ok, "OUTCOME"), "ok", "{ok:?}");
    assert!(
        !c.log("n1").contains("run finished"),
        "nothing of the log on stderr:\n{}",
        c.log("n1")
    );

    // No journald socket: text, without our timestamp, saying why.
    start(&mut c, "n2", empty.path());
    let n2 = wait_until(
        "n2's text lines",
        Duration::from_secs(15),
        || c.report(),
        || {
            let log = c.log("n2");
            log.contains("cronlease node starting").then_some(log)
        },
    );
    c.stop_all();
    assert!(n2.contains("journald's socket cannot be reached"), "{n2}");
    assert!(
        n2.lines()
            .filter(|l| !l.trim().is_empty())
            .all(|l| !l.starts_with(char::is_numeric)),
        "no timestamp of ours when the journal stamps lines:\n{n2}"
    );
}

/// Runs two nodes on `url` with `store_extra` (TLS settings); n2 is given the
/// unrelated CA. Only n1 claims (within `wait`), n2 stays up and names the
/// certificate. Returns the stopped cluster for store-specific checks.
fn only_the_trusting_node_claims(
    backend: Backend,
    url: &str,
    store_extra: &str,
    wait: Duration,
) -> Cluster {
    let mut c = Cluster::build(backend, Some(url), None, "", store_extra);
    let n2 = std::fs::read_to_string(c.config("n2"))
        .unwrap()
        .replace("ca.pem", "other.pem");
    std::fs::write(c.config("n2"), n2).unwrap();
    c.start("n1");
    c.start("n2");
    c.wait_for("runs through TLS", wait, |l| l.len() >= 3);
    std::thread::sleep(Duration::from_secs(1));
    let running = c.is_running("n2");
    c.stop_all();
    let report = c.report();
    assert!(
        c.lines().iter().all(|l| l.node == "n1"),
        "only the node trusting the right CA claims\n{report}"
    );
    assert!(running, "an untrusted server is not fatal");
    let n2_log = c.log("n2").to_lowercase();
    assert!(
        n2_log.contains("certificate")
            || n2_log.contains("unknownissuer")
            || n2_log.contains("tls"),
        "the reason is named\n{report}"
    );
    c
}

#[test]
fn mariadb_over_tls_trusts_only_its_ca() {
    Backend::Mysql.require();
    let certs = tempfile::tempdir().unwrap();
    let d = certs.path();
    crate::support::make_certs(d);
    let mut server = crate::support::MariaDbServer::new();
    server.extra_args = vec![
        format!("--ssl-ca={}", d.join("ca.pem").display()),
        format!("--ssl-cert={}", d.join("server.pem").display()),
        format!("--ssl-key={}", d.join("server.key").display()),
        "--require-secure-transport=ON".to_string(),
    ];
    server.start();
    let store_extra = format!("tls_ca_file = \"{}\"", d.join("ca.pem").display());
    only_the_trusting_node_claims(
        Backend::Mysql,
        &server.url(),
        &store_extra,
        Duration::from_secs(20),
    );
}

#[test]
fn postgres_over_tls_trusts_only_its_ca() {
    Backend::Postgres.require();
    let certs = tempfile::tempdir().unwrap();
    let d = certs.path();
    crate::support::make_certs(d);
    let mut server = crate::support::PgServer::new();
    let cert = server.install(&d.join("server.pem"), "server.pem");
    let key = server.install(&d.join("server.key"), "server.key");
    let hba = server.install(&{
        let p = d.join("hba.conf");
        std::fs::write(&p, "local all all trust\nhostnossl all all 0.0.0.0/0 reject\nhostssl all all 127.0.0.1/32 trust\n").unwrap();
        p
    }, "hba.conf");
    server.settings = vec![
        "ssl=on".into(),
        format!("ssl_cert_file={}", cert.display()),
        format!("ssl_key_file={}", key.display()),
        format!("hba_file={}", hba.display()),
    ];
    server.start();
    let store_extra = format!("tls_ca_file = \"{}\"", d.join("ca.pem").display());
    only_the_trusting_node_claims(
        Backend::Postgres,
        &server.url(),
        &store_extra,
        Duration::from_secs(20),
    );
}

/// 64 idle connections (browser tabs, a scanner) hold every general slot
/// of the listener: `/healthz` and `/metrics` still answer from the slots
/// kept for probes, other paths are busy (503), and once the idle ones are
/// gone everything answers again (issue 29).
#[test]
fn healthz_and_metrics_answer_with_every_connection_taken() {
    let (mut c, port) = Cluster::listening(Backend::Sqlite, "");
    c.start("n1");
    wait_until(
        "/healthz to answer",
        Duration::from_secs(15),
        || c.report(),
        || {
            let listening = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
            (listening && http_get(port, "/healthz").0 == 200).then_some(())
        },
    );
    let idle: Vec<std::net::TcpStream> = (0..64)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    // Once the listener accepted them all (300 ms was not always enough
    // on a loaded machine), other paths are busy...
    wait_until(
        "/api/status to be busy (503) with every general slot taken",
        Duration::from_secs(10),
        || c.report(),
        || (http_get(port, "/api/status").0 == 503).then_some(()),
    );
    // ...and the probes still answer.
    let (code, text) = http_get(port, "/healthz");
    assert_eq!(code, 200, "{text}");
    let (code, text) = http_get(port, "/metrics");
    assert_eq!(code, 200, "{text}");
    assert!(text.contains("cronlease_store_up"), "{text}");
    let (code, text) = http_get(port, "/api/status");
    assert_eq!(code, 503, "{text}");
    drop(idle);
    wait_until(
        "/api/status to answer again",
        Duration::from_secs(10),
        || c.report(),
        || (http_get(port, "/api/status").0 == 200).then_some(()),
    );
    c.stop_all();
}
