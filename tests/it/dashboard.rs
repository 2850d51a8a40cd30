//! The dashboard in a real browser: headless Chromium (Debian `chromium`,
//! `.ci/services` installs it) loads `/` of a 3-node cluster's daemon with
//! every host name but loopback unresolvable, runs the page's script, and
//! the DOM it leaves shows every job with its holder; after a SIGKILL of
//! the holder a peer's dashboard shows the takeover. `/api/status` is what
//! `status --json` prints. The listener's bounds: 405 for other methods, a
//! request head over 16 KiB refused, an idle connection closed.
//!
//! The screenshot in the README is this test's: `CRONLEASE_SCREENSHOT=docs/dashboard.png
//! cargo test --all-features --test it dashboard::` writes it there.

use std::io::Read;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::cluster::Cluster;
use crate::service::{http_get, http_request};
use crate::support::{Backend, free_port};

const NODES: [&str; 3] = ["n1", "n2", "n3"];

fn chromium() -> &'static str {
    let found = Command::new("chromium")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "chromium is not installed: `apt-get install chromium` (or run .ci/services)"
    );
    "chromium"
}

/// Chromium's flags: headless, and no host but loopback resolves, so a
/// request leaving the host would fail (and the page would show it).
fn browser(extra: &[&str], url: &str) -> std::process::Output {
    let profile = tempfile::tempdir().unwrap();
    Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--virtual-time-budget=4000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .output()
        .unwrap()
}

/// The page's DOM after its script ran (a completed refresh marks the body
/// `data-loaded="yes"`).
fn dom(port: u16) -> String {
    let out = browser(&["--dump-dom"], &format!("http://127.0.0.1:{port}/"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The text of the `td` with `class` in the jobs table's row of `job`.
fn cell(dom: &str, job: &str, class: &str) -> Option<String> {
    let row_start = dom.find(&format!("<tr data-job=\"{job}\">"))?;
    let row = &dom[row_start..];
    let row = &row[..row.find("</tr>")?];
    let at = row.find(&format!("<td class=\"{class}\">"))?;
    let rest = &row[at..];
    let text = &rest[rest.find('>')? + 1..rest.find("</td>")?];
    Some(text.to_string())
}

/// The nodes of `job`'s runs in its timeline lane (one lane per job, each
/// run marked with its node).
fn lanes(dom: &str, job: &str) -> Vec<String> {
    let Some(at) = dom.find(&format!("<div class=\"lane\" data-job=\"{job}\">")) else {
        return Vec::new();
    };
    let lane = &dom[at..];
    // Up to the next lane, or the legends after the last one.
    let end = ["<div class=\"lane\"", "<div class=\"legend"]
        .iter()
        .filter_map(|m| lane[1..].find(m).map(|e| e + 1))
        .min()
        .unwrap_or(lane.len());
    let lane = &lane[..end];
    let mut nodes: Vec<String> = lane
        .match_indices(" data-node=\"")
        .filter_map(|(i, m)| {
            let rest = &lane[i + m.len()..];
            Some(rest[..rest.find('"')?].to_string())
        })
        .collect();
    nodes.sort();
    nodes.dedup();
    nodes
}

fn cluster() -> (Cluster, Vec<u16>) {
    let jobs = "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = \"echo tick\"\n[[job]]\nname = \"report\"\nschedule = \"*/2 * * * * *\"\ncommand = \"sleep 0.3\"\n";
    let mut c = Cluster::new(Backend::Sqlite, Some(jobs), "");
    let mut ports = Vec::new();
    for n in NODES {
        let port = free_port();
        let path = c.config(n);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str(&format!("\n[http]\nlisten = \"127.0.0.1:{port}\"\n"));
        std::fs::write(&path, text).unwrap();
        ports.push(port);
        c.start(n);
    }
    (c, ports)
}

fn holder_of(c: &Cluster, job: &str) -> Option<String> {
    let rows = c.cli_json("n1", &["status"]).ok()?;
    let row = rows.as_array()?.iter().find(|r| r["job"] == job)?;
    row["holder_node"].as_str().map(str::to_string)
}

/// Rows without what changes from one moment to the next, and without the
/// output tail (`status --json` prints it, the listener never serves it).
fn steady(mut rows: serde_json::Value) -> serde_json::Value {
    for row in rows.as_array_mut().into_iter().flatten() {
        if let Some(o) = row.as_object_mut() {
            o.remove("lease_remaining_ms");
            o.remove("holder_clock_offset_ms");
            // Runs start and end between two reads, and their elapsed time
            // grows.
            o.remove("running");
            if let Some(run) = o.get_mut("last_run").and_then(|r| r.as_object_mut()) {
                run.remove("output");
            }
        }
    }
    rows
}

fn cli(c: &Cluster, args: &[&str]) {
    let out = c.cli("n1", args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn api_status(port: u16) -> serde_json::Value {
    let (code, text) = http_get(port, "/api/status");
    assert_eq!(code, 200, "{text}");
    let body = &text[text.find("\r\n\r\n").unwrap() + 4..];
    serde_json::from_str(body).unwrap()
}

#[test]
fn the_dashboard_shows_jobs_holders_and_a_takeover_in_a_real_browser() {
    let (mut c, ports) = cluster();
    let port_of = |n: &str| ports[NODES.iter().position(|x| *x == n).unwrap()];
    crate::support::wait_until(
        "a holder of tick with a few runs",
        Duration::from_secs(30),
        || c.report(),
        || {
            let runs = c.all_history("n1", Some("tick"));
            (runs.as_array()?.len() >= 3).then_some(())?;
            holder_of(&c, "tick").map(drop)
        },
    );

    // /api/status is `status --json`, asked with the jobs paused (no fence
    // or last run moves) and bracketed by two fresh answers of listeners
    // (the next fire time moves each second): equal to one of them. A
    // listener answers from a snapshot up to 1 s old, so the two come from
    // n2 and n3 (same jobs, same store), each last asked over a second ago,
    // the first early in a second. Its rows carry no output tail, though
    // the runs have one (`echo tick`).
    cli(&c, &["pause", "--all"]);
    std::thread::sleep(Duration::from_millis(1500));
    crate::support::wait_until(
        "/api/status equal to status --json",
        Duration::from_secs(30),
        || c.report(),
        || {
            std::thread::sleep(Duration::from_millis(1100));
            crate::cluster::at_fraction_of_second(0.05);
            let before = api_status(port_of("n2"));
            let cli = c.cli_json("n1", &["status"]).ok()?;
            let after = api_status(port_of("n3"));
            let served = [&before, &after].map(|rows| rows.to_string());
            assert!(
                served.iter().all(|r| !r.contains("\"output\":\"tick")),
                "the listener served a run's output: {before}"
            );
            assert!(
                cli.to_string().contains("\"output\":\"tick"),
                "status --json shows no output tail to compare with: {cli}"
            );
            let cli = steady(cli);
            (cli == steady(before) || cli == steady(after)).then_some(())
        },
    );
    cli(&c, &["resume", "--all"]);

    // The page: every job, its holder, a timeline lane for the holder. The
    // holder is asked again: the leases lapsed during the pause, so any
    // node may have won tick's first occurrence after the resume.
    let (holder, page) = crate::support::wait_until(
        "the dashboard to show tick's holder",
        Duration::from_secs(30),
        || c.report(),
        || {
            let holder = holder_of(&c, "tick")?;
            let d = dom(port_of("n1"));
            (d.contains("data-loaded=\"yes\"")
                && cell(&d, "tick", "holder").as_deref() == Some(holder.as_str()))
            .then_some((holder, d))
        },
    );
    assert!(cell(&page, "report", "holder").is_some(), "{page}");
    assert!(lanes(&page, "tick").contains(&holder), "{page}");
    assert!(
        page.contains("<tr data-node=\"n2\" class=\"\">"),
        "live nodes lack n2: {page}"
    );

    // A takeover appears after a kill, on a peer's dashboard.
    let fence_before: u64 = cell(&page, "tick", "fence").unwrap().parse().unwrap();
    c.signal(&holder, Signal::SIGKILL);
    c.wait_exit(&holder, Duration::from_secs(10));
    let peer = NODES.iter().copied().find(|n| *n != holder).unwrap();
    let after = crate::support::wait_until(
        "the peer's dashboard to show the takeover",
        Duration::from_secs(30),
        || c.report(),
        || {
            let d = dom(port_of(peer));
            let new = cell(&d, "tick", "holder")?;
            let fence: u64 = cell(&d, "tick", "fence")?.parse().ok()?;
            let lanes = lanes(&d, "tick");
            (new != holder
                && new != "-"
                && fence > fence_before
                && lanes.contains(&holder)
                && lanes.contains(&new))
            .then_some(d)
        },
    );
    assert!(
        after.contains("<span id=\"error\" class=\"error\" hidden=\"\"></span>"),
        "the page shows an error: {after}"
    );

    // The README's picture, from the same page.
    let shot = std::env::var("CRONLEASE_SCREENSHOT").unwrap_or_else(|_| {
        std::env::temp_dir()
            .join(format!("cronlease-dashboard-{}.png", std::process::id()))
            .display()
            .to_string()
    });
    let out = browser(
        &["--window-size=1600,720", &format!("--screenshot={shot}")],
        &format!("http://127.0.0.1:{}/", port_of(peer)),
    );
    assert!(
        Path::new(&shot).metadata().is_ok_and(|m| m.len() > 10_000),
        "no screenshot: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.stop_all();
}

/// Every asset is served from the binary and names no other host; the page
/// carries a policy that lets it talk to this listener only.
#[test]
fn the_page_loads_nothing_from_elsewhere_and_the_listener_is_bounded() {
    let (mut c, ports) = cluster();
    let port = ports[0];
    crate::support::wait_until(
        "the listener",
        Duration::from_secs(20),
        || c.report(),
        || std::net::TcpStream::connect(("127.0.0.1", port)).ok(),
    );
    let (code, page) = http_get(port, "/");
    assert_eq!(code, 200, "{page}");
    assert!(
        page.to_lowercase()
            .contains("content-security-policy: default-src 'none'; script-src 'self'"),
        "{page}"
    );
    for asset in ["/", "/assets/dashboard.js", "/assets/dashboard.css"] {
        let (code, text) = http_get(port, asset);
        assert_eq!(code, 200, "{asset}");
        let body = &text[text.find("\r\n\r\n").unwrap() + 4..];
        assert!(!body.contains("://"), "{asset} names another host: {body}");
        assert!(
            !body.contains("src=\"//") && !body.contains("href=\"//"),
            "{asset}"
        );
    }
    // Writes, oversized heads, idle connections.
    let text = http_request(
        port,
        "POST /api/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
    );
    // Without tokens_file a write is refused as such (docs/api.md).
    assert!(
        text.starts_with("HTTP/1.1 403") && text.contains("this API is read-only"),
        "{text}"
    );
    let big = "a".repeat(20 * 1024);
    let text = http_request(
        port,
        &format!("GET /api/status HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n"),
    );
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 431"),
        "an oversized head was served: {}",
        &text[..text.len().min(200)]
    );

    // An idle connection (nothing sent) is closed by the server: read
    // returns EOF (0) rather than timing out on our side after 20 s.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf);
    assert!(n.is_ok(), "an idle connection was kept open: {n:?}");

    // The history route: bad query 400; the output tail `logs` shows is
    // never served.
    let (code, _) = http_get(port, "/api/history?limit=many");
    assert_eq!(code, 400);
    crate::support::wait_until(
        "a tick run with its output in history",
        Duration::from_secs(20),
        || c.report(),
        || {
            let out = c.cli("n1", &["logs", "tick"]);
            String::from_utf8_lossy(&out.stdout)
                .contains("tick")
                .then_some(())
        },
    );
    let (code, text) = http_get(port, "/api/history?job=tick&limit=5");
    assert_eq!(code, 200, "{text}");
    assert!(text.contains("\"job\":\"tick\""), "{text}");
    assert!(!text.contains("\"output\":\"tick"), "{text}");
    c.stop_all();
}

/// The dashboard's actions, clicked in headless Chromium through
/// chromedriver: without a token a click is refused (and nothing runs);
/// with an `operate` token entered once, "Run now" starts the job (its
/// row shows it running on the node), and "Cancel" with a reason stops it,
/// recorded `cancelled` by the token's name with that reason; the job's
/// page shows its runs, their durations and the output tail; a node that
/// dies while the page is open stays listed, greyed, with when it was last
/// seen.
#[test]
fn dashboard_actions_trigger_and_cancel_a_run_by_clicks_in_a_real_browser() {
    let (secret, table) = crate::api::token("clicker", "operate");
    let port = free_port();
    let jobs = "[[job]]\nname = \"long\"\nschedule = \"0 0 0 1 1 *\"\nkill_grace = \"2s\"\ncommand = \"echo started; sleep 60\"\n";
    let mut c = Cluster::new(
        Backend::Sqlite,
        Some(jobs),
        &format!("[http]\nlisten = \"127.0.0.1:{port}\"\ntokens_file = \"tokens.toml\"\n"),
    );
    crate::api::tokens_file(&c, &table);
    // n2 on a port of its own.
    let cfg = std::fs::read_to_string(c.config("n2")).unwrap();
    let other = free_port();
    std::fs::write(
        c.config("n2"),
        cfg.replace(&format!(":{port}\""), &format!(":{other}\"")),
    )
    .unwrap();
    assert!(c.cli("n1", &["migrate"]).status.success());
    c.start("n1");
    c.start("n2");
    crate::support::wait_until(
        "the listener, healthy",
        Duration::from_secs(15),
        || c.report(),
        || (http_get(port, "/healthz").0 == 200).then_some(()),
    );
    let browser = crate::webdriver::Driver::start();
    browser.goto(&format!("http://127.0.0.1:{port}/"));
    let long = "button[data-job=\"long\"]";
    browser.wait_for(
        "the page with long's buttons",
        Duration::from_secs(15),
        |b| {
            (b.script("return document.body.dataset.loaded") == "yes")
                .then(|| b.find(&format!("{long}[data-action=\"trigger\"]")))
                .flatten()
        },
    );

    // No token: refused, said, nothing run.
    browser.click(&format!("{long}[data-action=\"trigger\"]"));
    let refused = browser.wait_for("the refusal", Duration::from_secs(10), |b| {
        Some(b.text("#notice")).filter(|t| t.contains("refused"))
    });
    assert!(refused.contains("(401)"), "{refused}");
    assert!(crate::cluster::history(&c, "long").is_empty());

    // The token, once; then Run now.
    browser.type_into("#token", &secret);
    browser.click("#use-token");
    browser.wait_for("the token in use", Duration::from_secs(10), |b| {
        b.text("#who")
            .contains("token clicker (operate)")
            .then_some(())
    });
    browser.click(&format!("{long}[data-action=\"trigger\"]"));
    let said = browser.wait_for("the request said", Duration::from_secs(10), |b| {
        Some(b.text("#notice")).filter(|t| t.contains("requested (trigger"))
    });
    assert!(said.starts_with("trigger long:"), "{said}");
    browser.wait_for("long shown running", Duration::from_secs(15), |b| {
        b.text("tr[data-job=\"long\"] td.running")
            .contains("on n")
            .then_some(())
    });

    // Cancel, with a reason.
    browser.type_into("#reason", "from the browser");
    let cancel = format!("{long}[data-action=\"cancel\"]");
    browser.wait_for("the cancel button", Duration::from_secs(10), |b| {
        b.find(&cancel)
    });
    browser.click(&cancel);
    let asked = browser.wait_for("the cancel said", Duration::from_secs(10), |b| {
        Some(b.text("#notice")).filter(|t| t.starts_with("cancel long:"))
    });
    assert!(
        asked.contains("to stop its run") && asked.contains("(fence"),
        "{asked}"
    );
    browser.wait_for(
        "the cancelled run on the page",
        Duration::from_secs(15),
        |b| {
            b.text("tr[data-job=\"long\"]")
                .contains("cancelled")
                .then_some(())
        },
    );
    let runs = crate::cluster::history(&c, "long");
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0]["outcome"], "cancelled", "{runs:?}");
    let output = runs[0]["output"].as_str().unwrap_or_default();
    assert!(
        output.ends_with("cancelled by token clicker: from the browser\n"),
        "{output:?}"
    );

    // The job page: its runs, the duration chart, the output tail (the
    // token has scope operate).
    browser.click("tr[data-job=\"long\"] a.job-link");
    let tail = browser.wait_for("the job page's output tail", Duration::from_secs(10), |b| {
        Some(b.text("#job-output")).filter(|t| t.contains("cancelled by token clicker"))
    });
    assert!(tail.contains("started"), "{tail}");
    assert_eq!(browser.text("#job-title"), "long");
    assert!(browser.find("#job-chart .bar.o-cancelled").is_some());
    assert!(browser.text("#job-runs tbody").contains("cancelled"));
    // Its audit: who triggered and who cancelled it, with the reason.
    let acted = browser.wait_for("the job page's actions", Duration::from_secs(10), |b| {
        Some(b.text("#job-actions tbody")).filter(|t| t.contains("cancel"))
    });
    assert!(
        acted.contains("token clicker")
            && acted.contains("from the browser")
            && acted.contains("trigger"),
        "{acted}"
    );
    browser.click("a[href=\"#\"]");
    browser.wait_for("the overview again", Duration::from_secs(10), |b| {
        (b.script("return document.getElementById('overview').hidden") == false).then_some(())
    });

    // A node that dies stays listed, greyed, with when it was last seen.
    browser.wait_for("n2 listed live", Duration::from_secs(10), |b| {
        b.find("#nodes tr[data-node=\"n2\"]:not(.gone)")
    });
    c.signal("n2", nix::sys::signal::Signal::SIGKILL);
    let gone = browser.wait_for("n2 greyed", Duration::from_secs(15), |b| {
        Some(b.text("#nodes tr.gone[data-node=\"n2\"]")).filter(|t| !t.is_empty())
    });
    assert!(
        gone.contains("n2 (gone)") && gone.contains("no heartbeat since"),
        "{gone}"
    );
    drop(browser);
    c.stop_all();
}
