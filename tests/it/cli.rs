//! The command line's contract (docs/cli.md): exit codes and output.

use std::process::Command;
use std::time::Duration;

use crate::support::{Backend, binary, unique};

// The pages the packages ship (examples/gen_assets.rs writes them).
#[path = "../../examples/assets/man_pages.rs"]
mod man_pages;

fn cronlease(args: &[&str], config: &std::path::Path) -> std::process::Output {
    Command::new(binary())
        .args(args)
        .arg("-c")
        .arg(config)
        .env_remove("CRONLEASE_STORE_URL")
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

fn write_config(dir: &std::path::Path, store: &str) -> std::path::PathBuf {
    let path = dir.join("cronlease.toml");
    let text = format!(
        "node = \"cli\"\n[store]\nurl = \"{store}\"\ntable_prefix = \"{p}\"\nkey_prefix = \"cl:{p}\"\nop_timeout = \"1s\"\n[[job]]\nname = \"tick\"\nschedule = \"*/5 * * * * *\"\ncommand = \"true\"\n",
        p = unique("cli")
    );
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn version_help_and_usage_errors() {
    let out = Command::new(binary()).arg("--version").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(version.starts_with("cronlease "));
    // The tests build every store (--all-features).
    assert!(
        version.contains(
            "\nstores: sqlite, mysql, postgres, redis, sentinel, redlock, zookeeper, etcd"
        ),
        "{version}"
    );
    let out = Command::new(binary()).arg("-V").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
    let out = Command::new(binary()).arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let out = Command::new(binary()).arg("frobnicate").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(binary())
        .args(["check", "--next", "many"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn check_prints_next_fire_times_without_a_store() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "redis://127.0.0.1:1/");
    let out = cronlease(&["check", "--next", "3"], &config);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("  20")).count(),
        3,
        "{stdout}"
    );
}

/// `check --next` shows each time as jitter moved it, and where from;
/// `jobs.default_jitter` applies where a job does not say, `jitter = "0s"`
/// opts out; a jitter that is not whole seconds is refused at its place.
#[test]
fn check_shows_jittered_times_and_refuses_a_bad_jitter() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cronlease.toml");
    let text = "node = \"cli\"\n[store]\nurl = \"sqlite://x.db\"\n[jobs]\ndefault_jitter = \"1h\"\n\
        [[job]]\nname = \"spread-a\"\nschedule = \"0 * * * *\"\ncommand = \"true\"\n\
        [[job]]\nname = \"spread-b\"\nschedule = \"0 * * * *\"\njitter = \"10m\"\ncommand = \"true\"\n\
        [[job]]\nname = \"plain\"\nschedule = \"0 * * * *\"\njitter = \"0s\"\ncommand = \"true\"\n";
    std::fs::write(&config, text).unwrap();
    let out = cronlease(&["check", "--next", "3"], &config);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let section = |job: &str| -> Vec<String> {
        stdout
            .lines()
            .skip_while(|l| !l.starts_with(&format!("{job}  ")))
            .take(4)
            .map(str::to_string)
            .collect()
    };
    // python3: p = int(hashlib.sha256(b"cronlease jitter v1\0" + name).hexdigest()[:16], 16)
    // delay = p * bound >> 64: spread-a 712 s of 3600, spread-b 132 s of 600.
    for (job, jitter, at, moved) in [
        ("spread-a", "  jitter 1h  ", ":11:52Z", "+11m 52s"),
        ("spread-b", "  jitter 10m  ", ":02:12Z", "+2m 12s"),
    ] {
        let lines = section(job);
        assert_eq!(lines.len(), 4, "{stdout}");
        assert!(lines[0].contains(jitter), "{stdout}");
        for l in &lines[1..] {
            assert!(l.starts_with("  20") && l.contains(at), "{job}: {l}");
            assert!(l.contains(":00:00 ") && l.ends_with(moved), "{job}: {l}");
        }
    }
    let plain = section("plain");
    assert!(!plain[0].contains("jitter"), "{stdout}");
    assert!(
        plain[1..]
            .iter()
            .all(|l| l.contains(":00:00Z") && !l.contains("scheduled")),
        "{stdout}"
    );

    std::fs::write(
        &config,
        text.replace("\"10m\"", "\"1500ms\"")
            .replace("\"1h\"", "\"soon\""),
    )
    .unwrap();
    let out = cronlease(&["check"], &config);
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let path = config.display().to_string();
    assert!(
        stderr.contains(&format!(
            "{path}:5:18: invalid duration \"soon\" for jobs.default_jitter"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "{path}:13:10: jitter \"1500ms\" is not a whole number of seconds"
        )),
        "{stderr}"
    );
}

#[test]
fn config_from_the_environment_variable() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "sqlite://x.db");
    let out = Command::new(binary())
        .arg("check")
        .env("CRONLEASE_CONFIG", &config)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn status_and_migrate_exit_69_when_the_store_is_unreachable() {
    // Each command waits out its connection attempts (about a second):
    // the 40 of them run at once, a thread each, each in its own directory.
    let urls = [
        "redis://:s3cretpw@127.0.0.1:1/",
        "mysql://root:s3cretpw@127.0.0.1:1/test",
        "postgres://u:s3cretpw@127.0.0.1:1/test",
        "postgres://u@127.0.0.1:1/test?password=s3cretpw",
        "mysql://root:83/s3cretpw@127.0.0.1:1/test",
    ];
    let cmds: [&[&str]; 8] = [
        &["status"],
        &["migrate"],
        &["history"],
        &["nodes"],
        &["pause", "tick"],
        &["resume", "--all"],
        &["trigger", "tick"],
        &["trigger", "tick", "--wait"],
    ];
    std::thread::scope(|scope| {
        let mut running = Vec::new();
        for url in urls {
            for cmd in cmds {
                running.push(scope.spawn(move || {
                    let dir = tempfile::tempdir().unwrap();
                    let config = write_config(dir.path(), url);
                    (url, cmd, cronlease(cmd, &config))
                }));
            }
        }
        for done in running {
            let (url, cmd, out) = done.join().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(69), "{cmd:?} {url}: {stderr}");
            assert!(
                !stderr.contains("s3cretpw")
                    && !String::from_utf8_lossy(&out.stdout).contains("s3cretpw"),
                "{stderr}"
            );
            assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
        }
    });
}

#[test]
fn migrate_then_status_on_each_store() {
    for backend in [
        Backend::Sqlite,
        Backend::Mysql,
        Backend::Postgres,
        Backend::Redis,
    ] {
        backend.require();
        let dir = tempfile::tempdir().unwrap();
        let config = write_config(dir.path(), &backend.url(dir.path()));
        let out = cronlease(&["migrate"], &config);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{backend:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = cronlease(&["migrate"], &config);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{backend:?}: migrate is idempotent"
        );
        let out = cronlease(&["status"], &config);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{backend:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.starts_with("JOB") && stdout.contains("tick"),
            "{stdout}"
        );
        assert!(
            stdout.contains("clock offset of this host"),
            "status shows this host's clock against the store's: {stdout}"
        );
        let out = cronlease(&["history", "nosuchjob"], &config);
        assert_eq!(out.status.code(), Some(64), "{backend:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("no such job") && err.lines().count() == 1,
            "{err}"
        );
        let out = cronlease(&["history", "tick"], &config);
        assert_eq!(
            out.status.code(),
            Some(0),
            "a configured job with no runs yet"
        );
        let out = cronlease(&["status", "--json"], &config);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v[0]["job"], "tick");
        assert_eq!(v[0]["fence"], 0);
        assert_eq!(v[0]["holder_alive"], serde_json::Value::Null, "no holder");
        assert_eq!(v[0]["paused"], false);
        // pause / resume: names checked first, the mark shown by status.
        let out = cronlease(&["pause", "tick", "nosuchjob"], &config);
        assert_eq!(out.status.code(), Some(64), "{backend:?}: {out:?}");
        let out = cronlease(&["pause"], &config);
        assert_eq!(out.status.code(), Some(2), "pause names no job: {out:?}");
        let paused = |config: &std::path::Path| {
            let out = cronlease(&["status", "--json"], config);
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            v[0]["paused"].clone()
        };
        assert_eq!(paused(&config), false, "an unknown name pauses nothing");
        let out = cronlease(&["pause", "tick", "--reason", "disk\nfull"], &config);
        assert_eq!(out.status.code(), Some(0), "{backend:?}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("paused tick"));
        assert_eq!(paused(&config), true, "{backend:?}");
        // Who paused it and why: in status (JSON and text), from the audit.
        let out = cronlease(&["status", "--json"], &config);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let by = &v[0]["paused_by"];
        assert_eq!(
            (by["action"].as_str(), by["reason"].as_str()),
            (Some("pause"), Some("disk full")),
            "{backend:?}: {v}"
        );
        let who = by["by"].as_str().unwrap().to_string();
        assert!(who.contains('@'), "user@host: {who}");
        assert_eq!(v[0]["last_action"], *by, "{v}");
        let out = cronlease(&["status"], &config);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.lines().any(
                |l| l.starts_with(&format!("PAUSED: tick pause by {who} at "))
                    && l.ends_with(": disk full")
            ),
            "{backend:?}: {text}"
        );
        let out = cronlease(&["status"], &config);
        let table = String::from_utf8_lossy(&out.stdout);
        let header: Vec<&str> = table
            .lines()
            .next()
            .unwrap()
            .split("  ")
            .filter(|c| !c.is_empty())
            .map(str::trim)
            .collect();
        assert!(header.contains(&"PAUSED"), "{table}");
        let row = table.lines().find(|l| l.starts_with("tick")).unwrap();
        assert!(row.split_whitespace().any(|c| c == "yes"), "{table}");
        let out = cronlease(&["resume", "--all", "--reason", "disk freed"], &config);
        assert_eq!(out.status.code(), Some(0), "{backend:?}: {out:?}");
        assert_eq!(paused(&config), false, "{backend:?}");
        // Both in history's audit, newest first; below the runs' table too.
        let out = cronlease(&["history", "tick", "--actions", "--json"], &config);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let said: Vec<(&str, &str, &str)> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["action"].as_str().unwrap(),
                    a["by"].as_str().unwrap(),
                    a["reason"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            said,
            [
                ("resume", who.as_str(), "disk freed"),
                ("pause", who.as_str(), "disk full")
            ],
            "{backend:?}: {v}"
        );
        let out = cronlease(&["history", "tick"], &config);
        let text = String::from_utf8_lossy(&out.stdout);
        let below = text.split("ACTIONS").nth(1).unwrap_or_default();
        assert!(
            below.contains("resume") && below.contains("disk freed"),
            "{backend:?}: {text}"
        );
        let out = cronlease(&["status", "--json"], &config);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v[0]["paused_by"], serde_json::Value::Null, "{v}");
        assert_eq!(v[0]["last_action"]["action"], "resume", "{v}");
        // No daemon ran: the registry is empty, and says so.
        let out = cronlease(&["nodes"], &config);
        assert_eq!(out.status.code(), Some(0), "{backend:?}: {out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.starts_with("NODE") && stdout.contains("0 live nodes"),
            "{stdout}"
        );
        let out = cronlease(&["nodes", "--json"], &config);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v, serde_json::json!([]), "{backend:?}");
    }
}

/// A store URL with a typo (`scheme:/`, `scheme:`) never has its password
/// echoed, by any command, from the file or from the environment.
#[test]
fn malformed_store_urls_are_redacted_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    for url in [
        "mysql:/root:s3cretpw@127.0.0.1:3306/test",
        "mysql:root:s3cretpw@127.0.0.1:3306/test",
        "postgres:/u:s3cretpw@127.0.0.1/test",
        "redis::s3cretpw@127.0.0.1:6379/",
        "mysql://root:s3cretpw",
    ] {
        let config = write_config(dir.path(), url);
        for cmd in [
            "run",
            "check",
            "status",
            "migrate",
            "history",
            "step-down",
            "nodes",
        ] {
            let out = cronlease(&[cmd], &config);
            let all = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(out.status.code(), Some(78), "{cmd} {url}: {all}");
            assert!(!all.contains("s3cretpw"), "{cmd} {url}: {all}");
            assert_eq!(all.lines().count(), 1, "{cmd} {url}: one line: {all}");
        }
        let out = Command::new(binary())
            .args(["check", "-c"])
            .arg(dir.path().join("nonexistent.toml"))
            .env("CRONLEASE_STORE_URL", url)
            .output()
            .unwrap();
        assert!(!String::from_utf8_lossy(&out.stderr).contains("s3cretpw"));
        let ok = write_config(dir.path(), "sqlite://x.db");
        let out = Command::new(binary())
            .args(["check", "-c"])
            .arg(&ok)
            .env("CRONLEASE_STORE_URL", url)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{err}");
        assert!(!err.contains("s3cretpw"), "{err}");
    }
}

/// The guard process does not carry the store URL in its environment.
#[test]
fn the_guard_has_no_store_url_in_its_environment() {
    let mut c = crate::cluster::Cluster::new(Backend::Sqlite, None, "");
    let url = format!("sqlite://{}", c.dir.path().join("locks.db").display());
    c.start_with_env("n1", &[("CRONLEASE_STORE_URL", url.as_str())]);
    let guard = c.guard_pid("n1");
    let environ = std::fs::read(format!("/proc/{guard}/environ")).unwrap();
    assert!(
        !String::from_utf8_lossy(&environ).contains("CRONLEASE_STORE_URL"),
        "the guard inherited the store URL"
    );
    let daemon = std::fs::read(format!("/proc/{}/environ", c.pid("n1"))).unwrap();
    assert!(
        String::from_utf8_lossy(&daemon).contains("CRONLEASE_STORE_URL"),
        "test premise"
    );
    c.stop_all();
}

/// This process's hard limit on open files.
fn own_hard_open_files_limit() -> String {
    open_files_limit(std::process::id()).1
}

/// `Max open files` (soft, hard) in /proc/PID/limits.
fn open_files_limit(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let f: Vec<&str> = line.split_whitespace().collect();
    (f[3].to_string(), f[4].to_string())
}

/// A thousand jobs at once hold two thousand pipes: the daemon lifts its
/// soft limit on open files to the hard one; the guard, which starts the
/// jobs, keeps the limit the daemon was given, and so do the jobs.
#[test]
fn the_daemon_lifts_its_open_files_limit_and_the_jobs_keep_theirs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("limit");
    let mut c = crate::cluster::Cluster::new(
        Backend::Sqlite,
        None,
        &format!(
            "[[job]]\nname = \"limit\"\nschedule = \"* * * * * *\"\ncommand = \"ulimit -Sn > {}\"\n",
            out.display()
        ),
    );
    let hard = own_hard_open_files_limit();
    c.start_under(
        "n1",
        &["prlimit", &format!("--nofile=512:{hard}"), "--"],
        &[],
    );
    let guard = c.guard_pid("n1");
    let job = crate::support::wait_until(
        "a run of the job",
        std::time::Duration::from_secs(10),
        || c.report(),
        || std::fs::read_to_string(&out).ok().filter(|s| !s.is_empty()),
    );
    let (daemon_soft, daemon_hard) = open_files_limit(c.pid("n1") as u32);
    let (guard_soft, _) = open_files_limit(guard as u32);
    c.stop_all();
    assert_eq!(daemon_soft, daemon_hard, "the daemon's soft limit");
    assert_eq!(guard_soft, "512", "the guard's soft limit");
    assert_eq!(job.trim(), "512", "the job's soft limit");
}

/// Something that is not Redis on the Redis URL's port (here MariaDB's, and
/// a plain TCP listener that answers HTTP) is an unreachable store: one
/// line, exit 69.
#[test]
fn a_non_redis_server_on_the_redis_port_is_unreachable() {
    Backend::Mysql.require();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 512];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n<html>\n</html>\n",
            );
        }
    });
    let dir = tempfile::tempdir().unwrap();
    for url in [
        "redis://127.0.0.1:3306/".to_string(),
        format!("redis://127.0.0.1:{port}/"),
    ] {
        let config = write_config(dir.path(), &url);
        for cmd in ["status", "migrate"] {
            unreachable_line(cmd, &url, &config);
        }
    }
}

/// `cmd` on `config` (naming the store at `url`) fails as unreachable:
/// exit 69, one line, which it returns.
fn unreachable_line(cmd: &str, url: &str, config: &std::path::Path) -> String {
    let out = cronlease(&[cmd], config);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(69), "{cmd} {url}: {err}");
    assert_eq!(err.lines().count(), 1, "{cmd} {url}: one line: {err}");
    err
}

/// The man pages and the shell completions the .deb ships are generated
/// from the clap definitions (examples/gen_assets.rs), and docs/cli.md is
/// written by hand: every command must be in all of them, so a new command
/// cannot ship undocumented or uncompleted.
#[test]
fn every_command_is_in_the_man_page_the_completions_and_docs() {
    use clap::CommandFactory;
    let mut cmd = cronlease::cli::Cli::command();
    // Hidden ones (the guard's internal entry point) are nobody's to type.
    let names: Vec<String> = cmd
        .get_subcommands()
        .filter(|c| !c.is_hide_set())
        .map(|c| c.get_name().to_string())
        .filter(|n| n != "help")
        .collect();
    assert!(names.iter().any(|n| n == "pause"), "{names:?}");
    let pages = man_pages::pages().unwrap();
    let main_page = man_text(&man_page(&pages, "cronlease.1"));
    let docs = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/cli.md"),
    )
    .unwrap();
    for shell in [
        clap_complete::Shell::Bash,
        clap_complete::Shell::Zsh,
        clap_complete::Shell::Fish,
    ] {
        let mut out = Vec::new();
        clap_complete::generate(shell, &mut cmd, "cronlease", &mut out);
        let out = String::from_utf8(out).unwrap();
        for name in &names {
            assert!(
                out.contains(name.as_str()),
                "{shell:?} completion lacks {name}"
            );
        }
    }
    for name in &names {
        let page = man_text(&man_page(&pages, &format!("cronlease-{name}.1")));
        assert!(
            page.contains(&format!("cronlease-{name} - ")),
            "cronlease-{name}(1) lacks its NAME line: {page}"
        );
        assert!(
            main_page.contains(&format!("cronlease-{name}(1)")),
            "cronlease(1) does not refer to cronlease-{name}(1)"
        );
        let heading = format!("`{name}");
        assert!(
            docs.lines()
                .any(|l| l.starts_with("### ") && l.contains(&heading)),
            "docs/cli.md has no section for {name}"
        );
    }
    assert_eq!(
        pages.len(),
        names.len() + 1,
        "one page per command and cronlease(1): {:?}",
        pages.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
}

/// The man pages refer only to pages the packages ship (clap_mangen names
/// `cronlease-COMMAND(1)` whether or not it exists), and cronlease(1) lists
/// the files, the exit codes and the signals, the latter two as the code
/// has them and as docs/cli.md documents them.
#[test]
fn man_pages_reference_only_pages_that_exist_and_list_files_exit_codes_signals() {
    let pages = man_pages::pages().unwrap();
    let names: Vec<&str> = pages.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"cronlease.1"), "{names:?}");
    for (name, page) in &pages {
        let text = man_text(page);
        for reference in page_references(&text) {
            assert!(
                names.contains(&format!("{reference}.1").as_str()),
                "{name} refers to {reference}(1), which is not generated: {names:?}"
            );
        }
        assert!(text.contains("SEE ALSO"), "{name} has no SEE ALSO: {text}");
    }
    let main_page = String::from_utf8(man_page(&pages, "cronlease.1")).unwrap();
    let headings: Vec<&str> = main_page
        .lines()
        .filter_map(|l| l.strip_prefix(".SH "))
        .map(|h| h.trim_matches('"'))
        .collect();
    for heading in ["EXIT STATUS", "SIGNALS", "FILES", "SEE ALSO"] {
        assert!(headings.contains(&heading), "no {heading}: {headings:?}");
    }
    let exit_status = man_section(&main_page, "EXIT STATUS");
    for (code, _) in man_pages::EXIT_CODES {
        assert!(
            exit_status.contains(&format!("\\fB{code}\\fR")),
            "EXIT STATUS lacks {code}: {exit_status}"
        );
    }
    let signals = man_section(&main_page, "SIGNALS");
    let page_signals: Vec<&str> = man_pages::SIGNALS
        .iter()
        .flat_map(|(names, _)| names.iter().copied())
        .collect();
    for signal in &page_signals {
        assert!(
            signals.contains(&format!("\\fB{signal}\\fR")),
            "SIGNALS lacks {signal}: {signals}"
        );
    }
    let files = man_text(man_section(&main_page, "FILES").as_bytes());
    for path in [
        cronlease::config::DEFAULT_CONFIG_PATH,
        cronlease::config::DEFAULT_PID_FILE,
    ] {
        assert!(files.contains(path), "FILES lacks {path}: {files}");
    }

    // The exit codes docs/cli.md's table lists are the page's.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let docs = std::fs::read_to_string(root.join("docs/cli.md")).unwrap();
    let mut documented: Vec<u8> = markdown_section(&docs, "## Exit codes")
        .lines()
        .filter_map(|l| l.strip_prefix("| ")?.split(" |").next()?.parse().ok())
        .collect();
    documented.sort_unstable();
    let mut listed: Vec<u8> = man_pages::EXIT_CODES.iter().map(|(c, _)| *c).collect();
    listed.sort_unstable();
    assert_eq!(
        listed, documented,
        "exit codes: the man page's, then docs/cli.md's"
    );

    // The signals: those the daemon installs handlers for, those
    // docs/cli.md's table lists, and the page's.
    let mut page_signals: Vec<String> = page_signals.iter().map(|s| s.to_string()).collect();
    page_signals.sort_unstable();
    let documented = signal_names(
        &markdown_section(&docs, "## Signals")
            .lines()
            .filter(|l| l.starts_with("| "))
            .filter_map(|l| l.split(" |").next())
            .collect::<Vec<_>>()
            .join(" "),
    );
    assert_eq!(
        page_signals, documented,
        "signals: the man page's, then docs/cli.md's"
    );
    let daemon = std::fs::read_to_string(root.join("src/app/daemon.rs")).unwrap();
    let installed = daemon
        .split_once("Signals::new([")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| signal_names(list))
        .expect("src/app/daemon.rs installs its handlers with Signals::new([...])");
    assert_eq!(
        page_signals, installed,
        "signals: the man page's, then those src/app/daemon.rs handles"
    );
}

/// The page named `name` (`cronlease.1`, `cronlease-run.1`, ...).
fn man_page(pages: &[(String, Vec<u8>)], name: &str) -> Vec<u8> {
    pages
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, page)| page.clone())
        .unwrap_or_else(|| panic!("no man page {name}"))
}

/// A page's roff as the reader sees its words: no font changes, `\-` a
/// plain `-`, `\*(Aq` an apostrophe.
fn man_text(roff: &[u8]) -> String {
    String::from_utf8_lossy(roff)
        .replace("\\fB", "")
        .replace("\\fI", "")
        .replace("\\fR", "")
        .replace("\\&", "")
        .replace("\\-", "-")
        .replace("\\*(Aq", "'")
}

/// The roff of one `.SH` section, up to the next.
fn man_section<'a>(roff: &'a str, heading: &str) -> &'a str {
    let quoted = if heading.contains(' ') {
        format!(".SH \"{heading}\"\n")
    } else {
        format!(".SH {heading}\n")
    };
    let (_, rest) = roff
        .split_once(&quoted)
        .unwrap_or_else(|| panic!("no section {heading}"));
    rest.split_once("\n.SH ")
        .map_or(rest, |(section, _)| section)
}

/// A markdown section: from its heading line to the next of its level.
fn markdown_section<'a>(text: &'a str, heading: &str) -> &'a str {
    let (_, rest) = text
        .split_once(&format!("\n{heading}"))
        .unwrap_or_else(|| panic!("no {heading}"));
    rest.split_once("\n## ")
        .map_or(rest, |(section, _)| section)
}

/// Every man page `text` refers to in section 1 whose name starts with
/// `cronlease` (`cronlease-run(1)` gives `cronlease-run`).
fn page_references(text: &str) -> Vec<String> {
    let mut references = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("(1)") {
        let before = &rest[..at];
        // The name: the ASCII run of name characters right before "(1)".
        let name_len = before
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || "-_.".contains(*c))
            .count();
        let name = &before[before.len() - name_len..];
        if name.starts_with("cronlease") {
            references.push(name.to_string());
        }
        rest = &rest[at + 3..];
    }
    references
}

/// The `SIG...` names in `text`, sorted, each once.
fn signal_names(text: &str) -> Vec<String> {
    let mut names: Vec<String> = text
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| w.starts_with("SIG") && w.len() > 3)
        .map(str::to_string)
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// `import-crontab` as a user runs it: a file or standard input in, TOML
/// out that `check` accepts; warnings on stderr; a malformed line is exit
/// 78 naming file, line and column with nothing printed; an unreadable file
/// exit 1; a bad `--timezone` exit 2.
#[test]
fn import_crontab_output_passes_check() {
    let import = |args: &[&str], stdin: Option<&str>| {
        use std::io::Write;
        let mut child = Command::new(binary())
            .arg("import-crontab")
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
        drop(input);
        child.wait_with_output().unwrap()
    };
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/crontab/user-crontab");
    let text = std::fs::read_to_string(&fixture).unwrap();
    let from_file = import(&[fixture.to_str().unwrap()], None);
    assert_eq!(from_file.status.code(), Some(0), "{from_file:?}");
    let from_stdin = import(&["-"], Some(&text));
    assert_eq!(from_stdin.status.code(), Some(0), "{from_stdin:?}");
    let toml = String::from_utf8(from_file.stdout).unwrap();
    // The header names the source; otherwise standard input gives the same.
    let body = |t: &str| {
        t.lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        body(&toml),
        body(&String::from_utf8(from_stdin.stdout).unwrap())
    );
    let warnings = String::from_utf8_lossy(&from_file.stderr);
    assert!(
        warnings
            .lines()
            .any(|l| l.starts_with("warning:") && l.contains("@reboot")),
        "{warnings}"
    );

    // What it printed is a job file `check` accepts.
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("jobs.d")).unwrap();
    std::fs::write(dir.path().join("jobs.d/alice.toml"), &toml).unwrap();
    let config = dir.path().join("cronlease.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nurl = \"sqlite://{}/locks.db\"\n[jobs]\ndir = \"jobs.d\"\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let out = cronlease(&["check"], &config);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let jobs = toml.matches("[[job]]").count();
    assert!(jobs >= 15, "{jobs} jobs:\n{toml}");
    // Named after their programs, not their lines (tests/it/crontab.rs has
    // every name).
    assert!(toml.contains("\nname = \"rotate-logs\"\n"), "{toml}");
    assert!(toml.contains("\nname = \"echo-2\"\n"), "{toml}");

    let bad = import(&["-"], Some("# ok\n61 * * * * true\n"));
    assert_eq!(bad.status.code(), Some(78), "{bad:?}");
    assert!(bad.stdout.is_empty(), "nothing printed for a bad crontab");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("-:2:1:") && err.lines().count() == 1, "{err}");
    let missing = import(&["/nonexistent/crontab"], None);
    assert_eq!(missing.status.code(), Some(1), "{missing:?}");
    let zone = import(
        &["--timezone", "Mars/Olympus", "-"],
        Some("* * * * * true\n"),
    );
    assert_eq!(zone.status.code(), Some(2), "{zone:?}");
}

/// Every TOML file the repository ships (config/, examples/, debian/) passes
/// `check`: the main configs as they are, and each job file by being loaded
/// through one of them (`check` names the file of each job it loaded). The
/// README's quickstart runs config/example.toml.
#[test]
fn every_shipped_config_and_job_file_passes_check() {
    fn tomls(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                tomls(&path, out);
            } else if path.extension().is_some_and(|e| e == "toml") {
                out.push(path);
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["config", "examples", "debian"] {
        tomls(&root.join(dir), &mut files);
    }
    files.sort();
    let is_main = |p: &std::path::Path| {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .any(|l| l.trim() == "[store]")
    };
    let (mains, job_files): (Vec<_>, Vec<_>) = files.iter().partition(|p| is_main(p));
    assert!(
        mains.iter().any(|p| p.ends_with("config/example.toml")),
        "config/example.toml is among them: {files:?}"
    );
    let mut loaded = String::new();
    for config in &mains {
        let out = Command::new(binary())
            .args(["check", "--next", "1", "-c"])
            .arg(config.strip_prefix(root).unwrap())
            .current_dir(root)
            .env_remove("CRONLEASE_STORE_URL")
            .env_remove("CRONLEASE_CONFIG")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}: {stdout}{}",
            config.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        loaded.push_str(&stdout);
    }
    for job_file in job_files {
        let shown = job_file.strip_prefix(root).unwrap().display().to_string();
        assert!(
            loaded.contains(&format!("{shown}:")),
            "{shown} is loaded by none of {mains:?}, so no check covers it:\n{loaded}"
        );
    }
}

/// A malformed job name is a usage error, exit 2 with one line naming the
/// rule, for every command that takes job names (one parser for all);
/// a well-formed name the configuration lacks stays exit 64.
#[test]
fn a_malformed_job_name_is_exit_2_for_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("locks.db");
    let config = write_config(dir.path(), &format!("sqlite://{}", db.display()));
    let bad = "no such/job!";
    let commands: [&[&str]; 6] = [
        &["history", bad],
        &["logs", bad],
        &["trigger", bad],
        &["pause", bad],
        &["resume", "tick", bad],
        &["drill", "--jobs", bad],
    ];
    for args in commands {
        let out = cronlease(args, &config);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("invalid job name"), "{args:?}: {stderr}");
    }
    for args in [&["trigger", "absent"][..], &["pause", "absent"]] {
        let out = cronlease(args, &config);
        assert_eq!(
            out.status.code(),
            Some(64),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A store that answers and refuses the node ends `run` at once: exit 77,
/// one line, no password (the unit does not restart on 77).
#[test]
fn run_exits_77_at_once_when_the_store_refuses_the_node() {
    let urls = [
        // PostgreSQL: no such database (3D000).
        "postgres://postgres:s3cretpw@127.0.0.1:5432/cronlease_no_such_database",
        // MariaDB: root has no password here, so a password is refused (1045).
        "mysql://root:s3cretpw@127.0.0.1:3306/test",
        // MariaDB: no such database (1049).
        "mysql://root@127.0.0.1:3306/cronlease_no_such_database",
        // Redis without a password configured, sent one.
        "redis://:s3cretpw@127.0.0.1:6379/",
    ];
    Backend::Postgres.require();
    Backend::Mysql.require();
    Backend::Redis.require();
    std::thread::scope(|scope| {
        let running: Vec<_> = urls
            .iter()
            .map(|url| {
                scope.spawn(move || {
                    let dir = tempfile::tempdir().unwrap();
                    let config = write_config(dir.path(), url);
                    let mut child = Command::new(binary())
                        .args(["run", "-c"])
                        .arg(&config)
                        .env_remove("CRONLEASE_STORE_URL")
                        .env_remove("RUST_LOG")
                        .stdout(std::process::Stdio::piped())
                        .stderr(std::process::Stdio::piped())
                        .spawn()
                        .unwrap();
                    let deadline = std::time::Instant::now() + Duration::from_secs(20);
                    let status = loop {
                        if let Some(s) = child.try_wait().unwrap() {
                            break Some(s);
                        }
                        if std::time::Instant::now() > deadline {
                            let _ = child.kill();
                            break None;
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    };
                    let out = child.wait_with_output().unwrap();
                    (url, status, out)
                })
            })
            .collect();
        for done in running {
            let (url, status, out) = done.join().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert_eq!(
                status.and_then(|s| s.code()),
                Some(77),
                "{url}: still running after 20 s or another exit\n{stdout}{stderr}"
            );
            let refused: Vec<&str> = stderr
                .lines()
                .chain(stdout.lines())
                .filter(|l| l.contains("refused this node"))
                .collect();
            assert_eq!(
                refused.len(),
                1,
                "{url}: one line saying why\n{stdout}{stderr}"
            );
            assert!(
                !stderr.contains("s3cretpw") && !stdout.contains("s3cretpw"),
                "{stdout}{stderr}"
            );
        }
    });
}

/// SQL stores' errors in an operator's words (issue 36): a refused port is
/// "connection refused by ADDR", not sqlx's "pool timed out while waiting
/// for an open connection"; PostgreSQL's messages come without the
/// server's source line ("at line 948"); a second migration logs no NOTICE
/// ("relation ... already exists, skipping").
#[test]
fn sql_store_errors_are_in_an_operators_words_and_server_notices_stay_quiet() {
    Backend::Postgres.require();
    let dir = tempfile::tempdir().unwrap();
    let port = crate::support::free_port();
    for url in [
        format!("mysql://root@127.0.0.1:{port}/test"),
        format!("postgres://postgres@127.0.0.1:{port}/test"),
    ] {
        let config = write_config(dir.path(), &url);
        for cmd in ["status", "migrate"] {
            let err = unreachable_line(cmd, &url, &config);
            assert!(
                err.contains(&format!("127.0.0.1:{port}")) && err.contains("refused"),
                "{cmd} {url}: {err}"
            );
            assert!(!err.contains("pool timed out"), "{cmd} {url}: {err}");
        }
    }
    let config = write_config(
        dir.path(),
        "postgres://postgres@127.0.0.1:5432/no_such_database_x",
    );
    let out = cronlease(&["status"], &config);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("database \"no_such_database_x\" does not exist")
            && !err.contains(" at line "),
        "{err}"
    );
    let config = write_config(dir.path(), &Backend::Postgres.url(dir.path()));
    for round in 0..2 {
        let out = cronlease(&["migrate"], &config);
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(0), "{all}");
        assert!(
            !all.contains("already exists") && !all.contains("NOTICE"),
            "round {round}: {all}"
        );
    }
}

/// The README's quickstart as written (issue 36: it stopped a node with
/// `kill %2`, which names the wrong node half the time): its shell blocks
/// run in a copy of config/, with this build's binary and free ports. The
/// holder is killed through its pid file, the survivor runs the next
/// occurrence, and the survivor stops through its own pid file, as the text
/// says. About 25 s: the quickstart's own two waits.
#[test]
fn readme_quickstart_runs_as_written_and_kills_through_pid_files() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let start = readme.find("## Two-minute quickstart").unwrap();
    let section = &readme[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    assert!(!section.contains("kill %"), "job-control kills: {section}");
    let blocks: Vec<&str> = section
        .split("```sh\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .collect();
    assert_eq!(blocks.len(), 2, "{section}");
    // The stop the text gives for the survivor, after the blocks.
    let stop = "kill \"$(cat config/$survivor.pid)\"";
    assert!(section.contains(stop), "{section}");
    let dir = tempfile::tempdir().unwrap();
    let copy = std::process::Command::new("cp")
        .arg("-r")
        .arg(root.join("config"))
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(copy.success());
    let (p1, p2) = (crate::support::free_port(), crate::support::free_port());
    let script = format!(
        "set -eu\n{}\n{}\n{stop}\nwhile kill -0 \"$(cat config/$survivor.pid 2>/dev/null)\" 2>/dev/null; do sleep 0.1; done\necho \"holder=$holder survivor=$survivor\"\n",
        blocks[0], blocks[1]
    )
    .replace("cargo build --release\n", "")
    .replace("./target/release/cronlease", &binary().display().to_string())
    .replace("9187", &p1.to_string())
    .replace("9188", &p2.to_string());
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(dir.path())
        .env_remove("CRONLEASE_STORE_URL")
        .env_remove("RUST_LOG")
        .stdout(std::fs::File::create(dir.path().join("out.txt")).unwrap())
        .stderr(std::fs::File::create(dir.path().join("err.txt")).unwrap())
        .status()
        .unwrap();
    let read = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap_or_default();
    let report = format!(
        "script:\n{script}\nstdout:\n{}\nstderr:\n{}\na.log:\n{}\nb.log:\n{}",
        read("out.txt"),
        read("err.txt"),
        read("a.log"),
        read("b.log")
    );
    assert!(out.success(), "{report}");
    let said = read("out.txt");
    let names = said
        .lines()
        .find_map(|l| l.strip_prefix("holder="))
        .unwrap_or_else(|| panic!("no names\n{report}"));
    let (holder, survivor) = names.split_once(" survivor=").unwrap();
    assert!(
        (holder, survivor) == ("a", "b") || (holder, survivor) == ("b", "a"),
        "{report}"
    );
    // The survivor ran an occurrence after the kill, and stopped cleanly.
    let survivor_log = read(&format!("{survivor}.log"));
    assert!(
        said.contains(&format!("hello from {survivor}")),
        "the survivor's run in the grep\n{report}"
    );
    assert!(
        survivor_log.contains("leases released; stopped"),
        "{report}"
    );
}
