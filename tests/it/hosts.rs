//! Drills on real systemd hosts (docs/testing.md, "Real systemd hosts"):
//! three hosts booted by `.ci/hosts` (systemd as PID 1 in systemd-nspawn,
//! each with its own disk, hostname and machine-id), the package built by
//! `.ci/run` installed in each, one cluster config per store, and
//! `systemctl enable --now cronlease`. Each round disturbs the host that
//! ran the last occurrence, as an operator's drill does:
//!
//! - `crash`: `systemctl kill -s KILL --kill-whom=main cronlease`, the
//!   daemon only (its guard must hand over under systemd, and the unit
//!   restarts it); `crash-busy`: the same while its job runs;
//! - `host`: SIGKILL of the host's init, everything on it dies at once;
//!   `host-busy`: the same while its job runs (the lease is waited out);
//! - `stop`: `systemctl stop cronlease` (graceful handover), then start;
//! - `reboot`: `systemctl reboot` inside the host;
//! - `cut`: the host cut off from the network (`.ci/hosts cut`: nftables
//!   drops what its processes send) until a peer ran three occurrences,
//!   then healed; `cut-busy`: the same while its job runs.
//!
//! The disturbed host comes back (the unit restarts, the host boots again
//! with its disk) before the next round. Judged from what the job wrote in
//! the directory all hosts share: every occurrence at most once, fences
//! rising in occurrence order, no two runs overlapping, and none missed
//! but where a dead busy host's lease has to be waited out. Each mode
//! prints a table row: the first run on a peer after the disturbance, late
//! by p50/p99/max over the rounds.
//!
//! Also here: the jobs cron users run as systemd units, relaxed on the job
//! alone, their credentials, journal and the secrets they cannot see
//! (`units`); with the process runner, under the unit as shipped and with
//! the documented drop-ins (`hardening`), the package's life cycle
//! (`packaging`), the unit's reload, stop and start (`unit`) and the
//! rolling upgrade with a rollback (`upgrade`).
//!
//! Ignored in every tier (they need root and the `.deb`): `.ci/host-drills`
//! runs them one at a time, short (2 rounds of `crash` and `host` on Redis,
//! hardening, packaging, unit, upgrade) in `.ci/run`, long
//! (`.ci/host-drills long`: every mode, 10 rounds, Redis, PostgreSQL and
//! etcd) by hand.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use crate::cluster::{Run, assert_no_overlap, at_fraction_of_second, runs_in, timed_job};
use crate::support::Backend;

/// The repository's `.ci/hosts`.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/hosts")
}

/// The directory every host sees as /srv/drill.
fn shared() -> PathBuf {
    PathBuf::from(std::env::var("HOSTS_DIR").unwrap_or_else(|_| "/tmp/cronlease-hosts".into()))
        .join("shared")
}

/// `.ci/hosts ARGS`, its output; fails the test when it fails.
fn hosts(args: &[&str]) -> Output {
    let out = Command::new("bash")
        .arg(script())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        ".ci/hosts {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `sh -c CMD` as root inside `host`, with `input` on its stdin.
fn sh(host: &str, cmd: &str, input: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new("bash")
        .arg(script())
        .args(["exec", host, "sh", "-c", cmd])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// [`sh`] that must succeed.
fn must(host: &str, cmd: &str, input: &str) -> String {
    let out = sh(host, cmd, input);
    assert!(
        out.status.success(),
        "on {host}: {cmd}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The package to install: `$CRONLEASE_DEB`, else the newest
/// target/debian/cronlease_*.deb.
fn deb() -> PathBuf {
    newest_deb(
        "CRONLEASE_DEB",
        "target/debian",
        "build it as .ci/run's package phase does",
    )
}

/// `$var`, else the newest .deb in the repository's `dir`; a failure
/// saying how to `build` one when there is none.
fn newest_deb(var: &str, dir: &str, build: &str) -> PathBuf {
    if let Ok(p) = std::env::var(var) {
        return p.into();
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let newest = std::fs::read_dir(&dir).ok().and_then(|d| {
        d.filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "deb"))
            .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
    });
    newest.unwrap_or_else(|| {
        panic!(
            "no package in {}: {build}, or run these drills with .ci/host-drills (which builds it)",
            dir.display()
        )
    })
}

/// Three hosts with the package installed, taken down (disks wiped) when
/// dropped.
struct Fleet {
    names: Vec<String>,
    /// Where the job writes (this machine's path of /srv/drill/TAG/out).
    out: PathBuf,
    report: String,
}

impl Fleet {
    fn boot(prefix: &str, backend: Backend) -> Fleet {
        Fleet::boot_n(prefix, backend, 3, &timed_job("* * * * * *", 0.3))
    }

    /// `n` hosts with the package, the cluster config on `backend` and the
    /// jobs `jobs` (`{out}` the shared output file), the unit enabled and
    /// started.
    fn boot_n(prefix: &str, backend: Backend, n: usize, jobs: &str) -> Fleet {
        backend.require();
        let (names, deb) = Fleet::bare(prefix, n);
        let tag = format!("{prefix}{}", std::process::id());
        let dir = shared().join(&tag);
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("out");
        std::fs::write(&out, "").unwrap();
        // Every host's cronlease appends to it.
        std::process::Command::new("chmod")
            .args(["0777"])
            .arg(&dir)
            .status()
            .unwrap();
        std::process::Command::new("chmod")
            .args(["0666"])
            .arg(&out)
            .status()
            .unwrap();
        let job = jobs.replace("{out}", &format!("/srv/drill/{tag}/out"));
        let fleet = Fleet {
            names,
            out,
            report: String::new(),
        };
        for name in &fleet.names {
            hosts(&["install", name, deb.to_str().unwrap()]);
            let store = match backend {
                Backend::Redlock => {
                    let list: Vec<String> = backend
                        .url(Path::new("/"))
                        .split(',')
                        .map(|u| format!("\"{u}\""))
                        .collect();
                    format!("urls = [{}]", list.join(", "))
                }
                _ => format!("url = \"{}\"", backend.url(Path::new("/"))),
            };
            let config = format!(
                "node = \"{name}\"\n[store]\n{store}\ntable_prefix = \"{tag}\"\nkey_prefix = \"hd:{tag}:\"\nop_timeout = \"1s\"\nhistory_limit = 100000\n[lease]\nmargin = \"1s\"\n[jobs]\ndir = \"jobs.d\"\n[log]\nlevel = \"info\"\n"
            );
            must(name, "cat > /etc/cronlease/cronlease.toml", &config);
            must(name, "cat > /etc/cronlease/jobs.d/drill.toml", &job);
            must(
                name,
                "mkdir -p /etc/systemd/system/cronlease.service.d && cat > /etc/systemd/system/cronlease.service.d/drill.conf",
                "[Service]\nReadWritePaths=/srv/drill\n",
            );
        }
        for name in &fleet.names {
            must(
                name,
                "systemctl daemon-reload && systemctl enable --now cronlease",
                "",
            );
        }
        fleet
    }

    /// `n` fresh hosts booted (the names), and the package to install.
    fn bare(prefix: &str, n: usize) -> (Vec<String>, PathBuf) {
        assert!(
            nix::unistd::geteuid().is_root(),
            "the host drills boot systemd-nspawn hosts: run them as root (.ci/host-drills)"
        );
        let deb = deb();
        let names: Vec<String> = (1..=n).map(|i| format!("{prefix}{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        hosts(&[&["down"], &refs[..]].concat());
        hosts(&[&["boot"], &refs[..]].concat());
        (names, deb)
    }

    fn runs(&self) -> Vec<Run> {
        runs_in(&std::fs::read_to_string(&self.out).unwrap_or_default())
    }

    /// The journals of the unit on every host, for a failure's message.
    fn journals(&self) -> String {
        let mut s = self.report.clone();
        for name in &self.names {
            let out = sh(
                name,
                "systemctl status cronlease --no-pager | head -5; journalctl -u cronlease --no-pager -n 60",
                "",
            );
            s += &format!(
                "\n--- {name}\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        s
    }

    fn wait(&self, what: &str, limit: Duration, done: impl Fn(&[Run]) -> bool) -> Vec<Run> {
        let deadline = Instant::now() + limit;
        loop {
            let runs = self.runs();
            if done(&runs) {
                return runs;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {limit:?}\n{}",
                self.journals()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Until `host`'s unit is active again (after a restart or a boot).
    fn wait_active(&self, host: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while sh(host, "systemctl is-active --quiet cronlease", "")
            .status
            .code()
            != Some(0)
        {
            assert!(
                Instant::now() < deadline,
                "{host}: cronlease not active again within 60 s\n{}",
                self.journals()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // The hosts' journals outlive them, beside what the job wrote: a
        // round to explain later (text, microsecond timestamps).
        if let Some(dir) = self.out.parent().filter(|d| d.is_dir()) {
            for name in &self.names {
                let _ = sh(
                    name,
                    &format!(
                        "journalctl -u cronlease -o short-precise --no-pager > /srv/drill/{}/{name}.journal",
                        dir.file_name().and_then(|n| n.to_str()).unwrap_or_default()
                    ),
                    "",
                );
            }
        }
        let mut args = vec!["down".to_string()];
        args.extend(self.names.iter().cloned());
        let _ = Command::new("bash").arg(script()).args(&args).status();
    }
}

/// `jobs.runner = "process"` on `host` (runs inside the daemon's unit),
/// and the daemon restarted with it.
fn use_process_runner(host: &str) {
    must(
        host,
        "sed -i 's/^\\[jobs\\]$/[jobs]\\nrunner = \"process\"/' /etc/cronlease/cronlease.toml && systemctl restart cronlease",
        "",
    );
}

/// How often systemd restarted `host`'s unit (`NRestarts`).
fn restarts(host: &str) -> u64 {
    must(host, "systemctl show -p NRestarts --value cronlease", "")
        .trim()
        .parse()
        .unwrap_or(0)
}

/// The modes and rounds of this run: `$CRONLEASE_HOST_MODES` (comma
/// separated) and `$CRONLEASE_HOST_ROUNDS`, by default the short form.
fn plan() -> (Vec<String>, usize) {
    let modes = std::env::var("CRONLEASE_HOST_MODES").unwrap_or_else(|_| "crash,host".into());
    let rounds = std::env::var("CRONLEASE_HOST_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(2);
    (
        modes.split(',').map(|m| m.trim().to_string()).collect(),
        rounds,
    )
}

/// From a run's scheduled instant to its start, in ms.
fn late_ms(run: &Run) -> f64 {
    (run.start - run.occurrence.timestamp_micros() as f64 / 1e6) * 1000.0
}

fn drill(prefix: &str, backend: Backend) {
    let (modes, rounds) = plan();
    let mut fleet = Fleet::boot(prefix, backend);
    // `CRONLEASE_HOST_RUNNER=process`: the runs as the guard's processes,
    // each in a cgroup of its own (the unit's Delegate=yes), not as units.
    let runner = std::env::var("CRONLEASE_HOST_RUNNER").unwrap_or_else(|_| "auto".into());
    if runner == "process" {
        for name in fleet.names.clone() {
            use_process_runner(&name);
            fleet.wait_active(&name);
        }
    }
    fleet.wait("three runs", Duration::from_secs(30), |runs| {
        runs.len() >= 3
    });
    let mut rows = Vec::new();
    let mut windows: Vec<(String, DateTime<Utc>, DateTime<Utc>)> = Vec::new();
    for mode in &modes {
        let busy = mode.ends_with("-busy");
        let mut delays = Vec::new();
        let from = Utc::now();
        for round in 0..rounds {
            // Busy: while the 0.3 s job runs; idle: its run over and
            // recorded.
            // A cut takes effect some 100-250 ms after it is asked for (the
            // rule is added by nft in a mount namespace of its own): asked
            // at .6, it is in force before the next instant.
            let idle_at = if mode == "cut" { 0.6 } else { 0.8 };
            at_fraction_of_second(if busy { 0.1 } else { idle_at });
            let holder = fleet.runs().last().expect("a run").node.clone();
            let restarted = restarts(&holder);
            let mut at = Utc::now();
            match mode.as_str() {
                "crash" | "crash-busy" => {
                    must(
                        &holder,
                        "systemctl kill -s KILL --kill-whom=main cronlease",
                        "",
                    );
                }
                "host" | "host-busy" => {
                    hosts(&["kill", &holder]);
                }
                "stop" => {
                    must(&holder, "systemctl stop cronlease", "");
                }
                "reboot" => {
                    // The connection may drop as the host goes down.
                    let _ = sh(&holder, "systemctl reboot", "");
                }
                "cut" | "cut-busy" => {
                    hosts(&["cut", &holder]);
                    // In force from here (the rule takes some 100 ms to
                    // add): an occurrence the holder claimed before is its.
                    at = Utc::now();
                }
                other => panic!(
                    "unknown mode {other} (crash, crash-busy, host, host-busy, stop, reboot, cut, cut-busy)"
                ),
            }
            let runs = fleet.wait(
                "a run after the disturbance",
                Duration::from_secs(30),
                |r| r.iter().any(|x| x.occurrence > at),
            );
            let first = runs
                .iter()
                .filter(|x| x.occurrence > at)
                .min_by_key(|x| x.occurrence)
                .unwrap();
            assert_ne!(
                first.node,
                holder,
                "{mode}: a peer takes over from {holder}\n{}",
                fleet.journals()
            );
            delays.push(late_ms(first));
            let line = format!(
                "{backend:?} {mode} round {}: {holder} disturbed at {at}; first run after: {} fence {} on {}, {:.0} ms late",
                round + 1,
                first.occurrence,
                first.fence,
                first.node,
                late_ms(first)
            );
            eprintln!("{line}");
            fleet.report += &line;
            fleet.report += "\n";
            // Back: the unit restarted, the host booted again (its disk
            // kept, the unit enabled), the service started.
            match mode.as_str() {
                "host" | "host-busy" | "reboot" => {
                    hosts(&["boot", &holder]);
                }
                "stop" => {
                    must(&holder, "systemctl start cronlease", "");
                }
                "cut" | "cut-busy" => {
                    // Healed after a few of the peer's runs: the holder was
                    // up all along, and must not have run anything meanwhile
                    // (judged with the rest below).
                    fleet.wait("runs on a peer while cut", Duration::from_secs(30), |r| {
                        r.iter().filter(|x| x.occurrence > at).count() >= 3
                    });
                    hosts(&["heal", &holder]);
                }
                _ => {
                    // Not "active" as systemd saw it before the crash.
                    let deadline = Instant::now() + Duration::from_secs(30);
                    while restarts(&holder) <= restarted {
                        assert!(
                            Instant::now() < deadline,
                            "{holder}: the unit did not restart\n{}",
                            fleet.journals()
                        );
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
            fleet.wait_active(&holder);
            // Steady again: a run on time after the disturbance.
            fleet.wait(
                "a run on time after the takeover",
                Duration::from_secs(30),
                |r| {
                    r.iter().any(|x| {
                        x.occurrence > at + chrono::TimeDelta::seconds(2) && late_ms(x) < 500.0
                    })
                },
            );
        }
        windows.push((mode.clone(), from, Utc::now()));
        rows.push((mode.clone(), delays));
    }
    for name in fleet.names.clone() {
        must(&name, "systemctl stop cronlease", "");
    }
    let mut runs = fleet.runs();
    let report = fleet.journals();
    runs.sort_by_key(|r| r.occurrence);
    // No occurrence twice (occurrences rise), fences rise, no overlap.
    assert_no_overlap(&runs, &report);
    println!("runner: {runner}");
    println!("| store | event | rounds | first run on a peer, late p50 | p99 | max | missed |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    let mut failed = Vec::new();
    for ((mode, delays), (_, from, to)) in rows.into_iter().zip(&windows) {
        let missed: i64 = runs
            .windows(2)
            .filter(|w| w[0].occurrence >= *from && w[1].occurrence <= *to)
            .map(|w| ((w[1].occurrence - w[0].occurrence).num_seconds() - 1).max(0))
            .sum();
        let (p50, p99, max) = percentiles(delays);
        println!(
            "| {backend:?} | {mode} | {rounds} | {p50:.0} ms | {p99:.0} ms | {max:.0} ms | {missed} |"
        );
        // A dead or cut-off busy host's lease is waited out (its run is
        // never recorded): the occurrences inside it are missed by design
        // (docs/protocol.md). Nothing else misses.
        if missed > 0 && mode != "host-busy" && mode != "cut-busy" {
            failed.push(format!("{mode}: {missed} missed"));
        }
    }
    assert!(failed.is_empty(), "{failed:?}\n{report}");
}

/// (p50, p99, max) of `v`.
fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    (at(0.5), at(0.99), v[v.len() - 1])
}

#[test]
#[ignore = "real systemd hosts, as root, with the .deb: .ci/host-drills"]
fn redis() {
    drill("hr", Backend::Redis);
}

#[test]
#[ignore = "real systemd hosts, as root, with the .deb: .ci/host-drills"]
fn postgres() {
    drill("hp", Backend::Postgres);
}

#[test]
#[ignore = "real systemd hosts, as root, with the .deb: .ci/host-drills"]
fn etcd() {
    drill("he", Backend::Etcd);
}

/// What cron users' jobs do with the process runner (`jobs.runner =
/// "process"`: runs inside the daemon's unit), under the unit as shipped
/// and then with the documented drop-ins: `python3`, `tar` into the state directory,
/// `/proc/meminfo` and a binary in /usr/local/bin work as shipped; writing
/// /var/backups and reading a home directory fail, each run's output
/// ending with the hint that names the setting; with the drop-ins
/// (docs/operations.md) both work, the home read as the job's `user`.
#[test]
#[ignore = "real systemd hosts, as root, with the .deb: .ci/host-drills"]
fn hardening() {
    let yearly = |name: &str, command: &str, extra: &str| {
        format!(
            "[[job]]\nname = \"{name}\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"{command}\"\n{extra}"
        )
    };
    let jobs = [
        yearly("python", "python3 -c 'print(6 * 7)'", ""),
        yearly(
            "tar_state",
            "tar czf /var/lib/cronlease/etc.tgz /etc/cronlease",
            "",
        ),
        yearly("meminfo", "grep MemTotal /proc/meminfo", ""),
        yearly("local_bin", "drill-hello", ""),
        yearly("backups", "tar czf /var/backups/etc.tgz /etc/cronlease", ""),
        yearly("home", "cat /home/ops/note", ""),
    ]
    .concat();
    let fleet = Fleet::boot_n("hh", Backend::Redis, 1, &jobs);
    let host = fleet.names[0].clone();
    // The process runner: runs inside the daemon's unit, under its sandbox.
    use_process_runner(&host);
    fleet.wait_active(&host);
    must(
        &host,
        "useradd -m ops && echo secret-note > /home/ops/note && chown ops:ops /home/ops/note && chmod 0600 /home/ops/note && cp /bin/echo /usr/local/bin/drill-hello",
        "",
    );
    let run = |job: &str| -> (bool, String) {
        let ran = sh(&host, &format!("cronlease trigger {job} --wait"), "");
        let logs = must(&host, &format!("cronlease logs {job}"), "");
        (ran.status.success(), logs)
    };
    let mut table = Vec::new();
    for (job, works) in [
        ("python", true),
        ("tar_state", true),
        ("meminfo", true),
        ("local_bin", true),
        ("backups", false),
        ("home", false),
    ] {
        let (ok, logs) = run(job);
        table.push(format!(
            "| as shipped | {job} | {} |",
            if ok { "ok" } else { "failed" }
        ));
        assert_eq!(ok, works, "{job} as shipped:\n{logs}\n{}", fleet.journals());
        if !works {
            let setting = if job == "backups" {
                "ReadWritePaths="
            } else {
                "ProtectHome=read-only"
            };
            assert!(
                logs.contains("cronlease: hint: ") && logs.contains(setting),
                "{job}: its output names {setting}:\n{logs}"
            );
        }
    }
    // The drop-ins of docs/operations.md: the per-job user's, a readable
    // home, /var/backups writable; `home` now runs as ops.
    must(
        &host,
        "mkdir -p /etc/systemd/system/cronlease.service.d && cat > /etc/systemd/system/cronlease.service.d/relax.conf",
        "[Service]\nUser=root\nPrivateUsers=no\nCapabilityBoundingSet=CAP_SETUID CAP_SETGID CAP_KILL\nSystemCallFilter=@setuid\nProtectHome=read-only\nReadWritePaths=/var/backups\n",
    );
    let home_as_ops = jobs.replace(
        "command = \"cat /home/ops/note\"\n",
        "command = \"cat /home/ops/note\"\nuser = \"ops\"\n",
    );
    must(
        &host,
        "cat > /etc/cronlease/jobs.d/drill.toml",
        &home_as_ops,
    );
    must(
        &host,
        "systemctl daemon-reload && systemctl restart cronlease",
        "",
    );
    for job in ["backups", "home"] {
        let (ok, logs) = run(job);
        table.push(format!(
            "| with the drop-ins | {job} | {} |",
            if ok { "ok" } else { "failed" }
        ));
        assert!(ok, "{job} with the drop-ins:\n{logs}\n{}", fleet.journals());
        assert!(!logs.contains("cronlease: hint: "), "{logs}");
    }
    let (_, logs) = run("home");
    assert!(logs.contains("secret-note"), "{logs}");
    println!(
        "| unit | job | outcome |\n|---|---|---|\n{}",
        table.join("\n")
    );
}

/// Runs as systemd units, on the package as shipped (its polkit rule lets
/// the daemon's user start them; issue 32): the runner is chosen by
/// itself; relaxations go on the job (`user`, `[job.sandbox]`), never on
/// the daemon's unit; credentials reach their job only; the store's
/// password reaches no job, run as the daemon's user or as root; each
/// unit's lines are in the journal under its own unit and identifier at
/// their priority; a limit the host's cgroups cannot enforce is a WARN.
#[test]
#[ignore = "real systemd hosts, as root, with the .deb: .ci/host-drills"]
fn units() {
    const PASSWORD: &str = "Drill-Pa55-xyzzy";
    // Hosts share this machine's network: a port of this test's own.
    let port = 20_000 + std::process::id() % 10_000;
    let yearly = |name: &str, command: &str, extra: &str| {
        format!(
            "[[job]]\nname = \"{name}\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"{command}\"\n{extra}"
        )
    };
    let peek = "id -un; cat /etc/cronlease/cronlease.toml /etc/cronlease/store.pass; ls /run/credentials/cronlease.service; env; cat /run/credentials/*/tok; true";
    let jobs = [
        yearly("python", "python3 -c 'print(6 * 7)'", ""),
        yearly("meminfo", "grep MemTotal /proc/meminfo", ""),
        yearly("stderr", "echo to-stdout; echo to-stderr >&2", ""),
        yearly("backups", "tar czf /var/backups/hostname.tgz /etc/hostname", "user = \"root\"\n"),
        yearly("home", "cat /home/ops/note", "user = \"ops\"\n"),
        yearly(
            "srv_yes",
            "echo a > /srv/x/yes",
            "user = \"root\"\n[job.sandbox]\nProtectSystem = \"strict\"\nReadWritePaths = [\"/srv/x\"]\n",
        ),
        yearly(
            "srv_no",
            "echo b > /srv/x/no",
            "user = \"root\"\n[job.sandbox]\nProtectSystem = \"strict\"\n",
        ),
        yearly(
            "cred",
            "cat $CREDENTIALS_DIRECTORY/tok",
            "credentials = { tok = \"/etc/cronlease-secrets/tok\" }\n",
        ),
        yearly("peek", peek, ""),
        yearly("peek_root", peek, "user = \"root\"\n"),
        yearly(
            "limited",
            "systemctl show cronlease-$CRONLEASE_JOB-$CRONLEASE_FENCE.service -p MemoryMax -p TasksMax -p Nice -p LimitNOFILE -p CPUQuotaPerSecUSec; echo nice=$(nice)",
            "[job.limits]\nmemory_max = \"64M\"\ntasks_max = 16\nnice = 5\nopen_files = 333\ncpu_quota = \"50%\"\n",
        ),
    ]
    .concat();
    // Booted with one job; the rest once user ops exists.
    let fleet = Fleet::boot_n("hy", Backend::Postgres, 1, &yearly("python", "true", ""));
    let host = fleet.names[0].clone();
    // The store's password in a password_file, root:cronlease 0640 as an
    // operator would keep it (PostgreSQL's trust authentication here
    // accepts it without checking).
    must(
        &host,
        &format!(
            "useradd -m ops && echo secret-note > /home/ops/note && chown ops:ops /home/ops/note && chmod 0600 /home/ops/note \
             && mkdir -p /srv/x /etc/cronlease-secrets && echo cred-token-42 > /etc/cronlease-secrets/tok && chmod 0600 /etc/cronlease-secrets/tok \
             && printf %s {PASSWORD} > /etc/cronlease/store.pass && chown root:cronlease /etc/cronlease/store.pass && chmod 0640 /etc/cronlease/store.pass \
             && sed -i 's|^url = .*|&\\npassword_file = \"store.pass\"|' /etc/cronlease/cronlease.toml \
             && printf '[http]\\nlisten = \"127.0.0.1:{port}\"\\n' >> /etc/cronlease/cronlease.toml"
        ),
        "",
    );
    must(&host, "cat > /etc/cronlease/jobs.d/drill.toml", &jobs);
    must(&host, "systemctl restart cronlease", "");
    fleet.wait_active(&host);
    let journal = must(&host, "journalctl -u cronlease --no-pager", "");
    assert!(
        journal.contains("runs start as transient systemd units"),
        "the runner chosen by itself:\n{journal}"
    );
    assert!(
        journal.contains("not enforced for this job: limits.memory_max, limits.tasks_max")
            || !must(&host, "cat /sys/fs/cgroup/cgroup.controllers", "").contains("memory"),
        "a limit this host cannot enforce is said:\n{journal}"
    );
    let run = |job: &str| -> (bool, String) {
        let ran = sh(&host, &format!("cronlease trigger {job} --wait"), "");
        let logs = must(&host, &format!("cronlease logs {job}"), "");
        (ran.status.success(), logs)
    };
    let mut table = Vec::new();
    for (job, works, shows) in [
        ("python", true, "42"),
        ("meminfo", true, "MemTotal"),
        ("stderr", true, "to-stderr"),
        ("backups", true, ""),
        ("home", true, "secret-note"),
        ("srv_yes", true, ""),
        ("srv_no", false, "[job.sandbox] ReadWritePaths"),
        ("cred", true, "cred-token-42"),
        ("peek", true, "cronlease"),
        ("peek_root", true, "root"),
        ("limited", true, "MemoryMax=67108864"),
    ] {
        let (ok, logs) = run(job);
        table.push(format!("| {job} | {} |", if ok { "ok" } else { "failed" }));
        assert_eq!(ok, works, "{job}:\n{logs}\n{}", fleet.journals());
        assert!(logs.contains(shows), "{job} shows {shows:?}:\n{logs}");
        if job.starts_with("peek") {
            assert!(
                !logs.contains(PASSWORD),
                "{job} saw the store's password:\n{logs}"
            );
            assert!(
                !logs.contains("cred-token-42"),
                "{job} saw another job's credential:\n{logs}"
            );
            assert!(
                !logs.contains("[store]"),
                "{job} read the configuration:\n{logs}"
            );
        }
    }
    assert_eq!(must(&host, "cat /srv/x/yes", "").trim(), "a");
    // The limits are the unit's (systemd and the kernel enforce them where
    // the host's cgroups have the controllers; these hosts' do not).
    let limited = must(&host, "cronlease logs limited", "");
    for want in [
        "MemoryMax=67108864",
        "TasksMax=16",
        "Nice=5",
        "LimitNOFILE=333",
        "CPUQuotaPerSecUSec=500ms",
        "nice=5",
    ] {
        assert!(limited.contains(want), "{want}:\n{limited}");
    }
    // What the unit used, in history and in the metrics.
    let history = must(&host, "cronlease history python --json", "");
    let history: serde_json::Value = serde_json::from_str(&history).unwrap();
    let cpu = &history[0]["cpu_ms"];
    assert!(cpu.is_u64(), "a unit's CPU time in history: {history}");
    let metrics = must(
        &host,
        &format!(
            "python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:{port}/metrics\").read().decode())'"
        ),
        "",
    );
    assert!(
        metrics.contains("cronlease_run_cpu_seconds_count{cron_job=\"python\"} 1"),
        "{metrics}"
    );
    // The journal: the unit's own lines at their priority, by unit and by
    // identifier.
    let by_id = must(
        &host,
        "journalctl -t cronlease-stderr -o json --no-pager",
        "",
    );
    let priority_of = |text: &str| -> Option<String> {
        by_id
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|e| e["MESSAGE"] == text)
            .map(|e| {
                format!(
                    "{} {}",
                    e["PRIORITY"].as_str().unwrap_or(""),
                    e["_SYSTEMD_UNIT"].as_str().unwrap_or("")
                )
            })
    };
    let out = priority_of("to-stdout").unwrap_or_default();
    let err = priority_of("to-stderr").unwrap_or_default();
    assert!(
        out.starts_with("6 cronlease-stderr-"),
        "stdout at info, in its unit: {out}\n{by_id}"
    );
    assert!(
        err.starts_with("4 cronlease-stderr-"),
        "stderr at warning, in its unit: {err}\n{by_id}"
    );
    let unit = err.split(' ').nth(1).unwrap_or_default().to_string();
    let by_unit = must(&host, &format!("journalctl -u {unit} --no-pager"), "");
    assert!(
        by_unit.contains("to-stderr"),
        "journalctl -u {unit}:\n{by_unit}"
    );
    // No relaxation of the daemon's unit was needed (the drills' own
    // drop-in only opens /srv/drill, which these jobs do not use).
    let dropins = must(&host, "ls /etc/systemd/system/cronlease.service.d", "");
    assert_eq!(dropins.trim(), "drill.conf", "{dropins}");
    println!(
        "| job (systemd runner, as shipped) | outcome |\n|---|---|\n{}",
        table.join("\n")
    );
}

/// The conformance of runs (tests/it/jobs.rs on this machine's process
/// runner) for runs as systemd units: outcomes and exit codes, argv and
/// the environment, `working_dir`, a timeout's SIGTERM and `kill_grace`'s
/// SIGKILL, `overlap = "skip"`, the output tail's bound, and the store's
/// password scrubbed from it.
#[test]
#[ignore = "real systemd hosts, as root, with the .deb: .ci/host-drills"]
fn unit_runs() {
    conformance_of_runs("hz", false);
}

/// The system bus lost under the systemd runner (dbus-daemon killed while
/// a run's unit goes on): the daemon can no longer follow or stop the unit,
/// so it exits 70; its guard, with a connection of its own, kills the unit
/// and records the run `killed`, and systemd restarts the daemon, which
/// starts runs as units again. No unit is left running unfenced.
#[test]
#[ignore = "real systemd hosts, as root, with the .deb: .ci/host-drills"]
fn bus_lost() {
    let jobs = "[[job]]\nname = \"long\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"sleep 300\"\n";
    let fleet = Fleet::boot_n("hb", Backend::Redis, 1, jobs);
    let host = fleet.names[0].clone();
    fleet.wait_active(&host);
    must(&host, "cronlease trigger long", "");
    let running = || {
        must(
            &host,
            "systemctl list-units 'cronlease-long-*' --state=active --no-legend --plain | wc -l",
            "",
        )
        .trim()
        .to_string()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while running() != "1" {
        assert!(Instant::now() < deadline, "{}", fleet.journals());
        std::thread::sleep(Duration::from_millis(100));
    }
    must(&host, "pkill -KILL dbus-daemon", "");
    let deadline = Instant::now() + Duration::from_secs(30);
    let history = loop {
        let h = must(&host, "cronlease history long --json", "");
        if h.contains("\"killed\"") && restarts(&host) >= 1 {
            break h;
        }
        assert!(Instant::now() < deadline, "{h}\n{}", fleet.journals());
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(running(), "0", "the unit went with the daemon's bus");
    fleet.wait_active(&host);
    let journal = must(&host, "journalctl -u cronlease --no-pager", "");
    assert!(
        journal.contains("the system bus connection ended")
            && journal.contains("status=70")
            && journal.contains("1 interrupted runs recorded killed"),
        "{journal}"
    );
    // Natively in the journal (JOURNAL_STREAM): the guard's entry with its
    // priority (WARN: 4) and fields, the node's name on it.
    let guard = must(
        &host,
        "journalctl -u cronlease -o json --no-pager PROCESS=guard",
        "",
    );
    assert!(
        guard.contains("1 interrupted runs recorded killed")
            && guard.contains("\"PRIORITY\":\"4\"")
            && guard.contains("\"NODE\":\"")
            && guard.contains("\"SYSLOG_IDENTIFIER\":\"cronlease\""),
        "{guard}"
    );
    // The new daemon starts runs as units again.
    let after = journal
        .rsplit("the system bus connection ended")
        .next()
        .unwrap_or_default();
    assert!(
        after.contains("runs start as transient systemd units"),
        "{journal}"
    );
    println!(
        "| the system bus killed under a running unit | daemon exits 70, the guard kills the unit and records it killed, systemd restarts the daemon |\n{history}"
    );
}

/// The conformance of runs for the process runner on a host as shipped:
/// each run in a cgroup of its own below the daemon's (the unit's
/// `Delegate=yes`), so what a run leaves behind dies with it however it
/// got away from its group, its CPU time is accounted, and no run cgroup
/// is left.
#[test]
#[ignore = "real systemd hosts, as root, with the .deb: .ci/host-drills"]
fn process_runs() {
    conformance_of_runs("hp", true);
}

/// Outcomes, timeouts and kill grace, overlap, output tail and scrubbing,
/// a missing working directory: the same runs and verdicts for either
/// runner (`process`: the process runner, else the systemd runner the
/// host picks itself).
fn conformance_of_runs(prefix: &str, process: bool) {
    const PASSWORD: &str = "Drill-Pa55-runs-42";
    let job = |name: &str, schedule: &str, command: &str, extra: &str| {
        format!(
            "[[job]]\nname = \"{name}\"\nschedule = \"{schedule}\"\ncommand = {command}\n{extra}"
        )
    };
    let yearly = "0 0 0 1 1 *";
    let jobs = [
        job("ok", yearly, "\"echo fine\"", ""),
        job("fails", yearly, "\"echo bad >&2; exit 3\"", ""),
        job("argv", yearly, "[\"printf\", \"%s|\", \"a b\", \"c\"]", ""),
        job(
            "env",
            yearly,
            "\"echo $GREETING $CRONLEASE_JOB $CRONLEASE_FENCE $CRONLEASE_NODE $CRONLEASE_OCCURRENCE; pwd\"",
            "env = { GREETING = \"hi\" }\nworking_dir = \"/srv\"\n",
        ),
        job(
            "polite",
            yearly,
            "\"trap 'echo terminated; exit 0' TERM; sleep 20 & wait\"",
            "timeout = \"1s\"\n",
        ),
        job(
            "stubborn",
            yearly,
            "\"trap '' TERM; sleep 20\"",
            "timeout = \"1s\"\nkill_grace = \"1s\"\n",
        ),
        job("overlap", "* * * * * *", "\"sleep 2.5\"", ""),
        job(
            "tail",
            yearly,
            "\"seq 1 1000\"",
            "output_tail = \"64B\"\n",
        ),
        job("scrub", yearly, &format!("\"echo the password is {PASSWORD}.\""), ""),
        job("nodir", yearly, "\"true\"", "working_dir = \"/nonexistent\"\n"),
        // Gets away from its process group and session, and leaves a
        // process behind.
        job(
            "escape",
            yearly,
            "\"setsid sh -c 'sleep 300 & echo $! > /var/lib/cronlease/escaped.pid'; echo left\"",
            "",
        ),
        // Half its CPU time is in a child that left the session.
        job(
            "busy",
            yearly,
            "\"setsid sh -c 'i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done' & i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done; wait\"",
            "",
        ),
    ]
    .concat();
    let fleet = Fleet::boot_n(
        prefix,
        Backend::Postgres,
        1,
        &job("ok", yearly, "\"true\"", ""),
    );
    let host = fleet.names[0].clone();
    must(
        &host,
        &format!(
            "printf %s {PASSWORD} > /etc/cronlease/store.pass && chown root:cronlease /etc/cronlease/store.pass && chmod 0640 /etc/cronlease/store.pass \
             && sed -i 's|^url = .*|&\\npassword_file = \"store.pass\"|' /etc/cronlease/cronlease.toml"
        ),
        "",
    );
    must(&host, "cat > /etc/cronlease/jobs.d/drill.toml", &jobs);
    if process {
        use_process_runner(&host);
    } else {
        must(&host, "systemctl restart cronlease", "");
    }
    fleet.wait_active(&host);
    let history = |job: &str| -> Vec<serde_json::Value> {
        let out = must(
            &host,
            &format!("cronlease history {job} --json --limit 50"),
            "",
        );
        serde_json::from_str::<serde_json::Value>(&out)
            .unwrap()
            .as_array()
            .unwrap()
            .clone()
    };
    let took = |r: &serde_json::Value| {
        let t = |k: &str| DateTime::parse_from_rfc3339(r[k].as_str().unwrap()).unwrap();
        (t("finished_at") - t("started_at")).num_milliseconds()
    };
    let trigger = |job: &str| {
        let _ = sh(&host, &format!("cronlease trigger {job} --wait"), "");
        history(job).remove(0)
    };
    let mut table = Vec::new();
    let mut row = |what: &str, r: &serde_json::Value| {
        table.push(format!(
            "| {what} | {} | {} | {} ms |",
            r["outcome"],
            r["exit_code"],
            took(r)
        ));
    };
    let r = trigger("ok");
    row("ok", &r);
    assert_eq!(
        (r["outcome"].as_str(), r["exit_code"].as_i64()),
        (Some("ok"), Some(0)),
        "{r}"
    );
    assert!(r["output"].as_str().unwrap().contains("fine"), "{r}");
    let r = trigger("fails");
    row("exit 3", &r);
    assert_eq!(
        (r["outcome"].as_str(), r["exit_code"].as_i64()),
        (Some("failed"), Some(3)),
        "{r}"
    );
    assert!(r["output"].as_str().unwrap().contains("bad"), "{r}");
    let r = trigger("argv");
    row("argv", &r);
    assert_eq!(r["output"].as_str().unwrap().trim(), "a b|c|", "{r}");
    let r = trigger("env");
    row("env, working_dir", &r);
    let out = r["output"].as_str().unwrap();
    let fence = r["fence"].as_u64().unwrap();
    assert!(out.contains(&format!("hi env {fence} {host} 20")), "{r}");
    assert!(out.contains("\n/srv"), "{r}");
    let r = trigger("polite");
    row("timeout, SIGTERM obeyed", &r);
    assert_eq!(r["outcome"], "timeout", "{r}");
    assert!(r["output"].as_str().unwrap().contains("terminated"), "{r}");
    assert!((900..1900).contains(&took(&r)), "ended by SIGTERM: {r}");
    let r = trigger("stubborn");
    row("timeout, SIGTERM ignored", &r);
    assert_eq!(
        (r["outcome"].as_str(), r["exit_code"].as_i64()),
        (Some("timeout"), Some(137)),
        "{r}"
    );
    assert!(
        (1900..4000).contains(&took(&r)),
        "SIGKILL after kill_grace: {r}"
    );
    let r = trigger("tail");
    row("output_tail 64B", &r);
    let out = r["output"].as_str().unwrap();
    assert!(out.len() <= 64 && out.ends_with("1000\n"), "{out:?}");
    let r = trigger("scrub");
    row("the store's password printed", &r);
    let out = r["output"].as_str().unwrap();
    assert!(
        out.contains("the password is ***.") && !out.contains(PASSWORD),
        "{out:?}"
    );
    let journal = must(&host, "journalctl -u cronlease --no-pager", "");
    assert!(
        !journal.contains(PASSWORD),
        "the daemon's log has no password"
    );
    let r = trigger("nodir");
    row("working_dir missing", &r);
    assert_eq!(
        (r["outcome"].as_str(), r["exit_code"].as_i64()),
        (Some("not_started"), None),
        "{r}"
    );
    assert!(
        r["output"].as_str().unwrap().contains("working directory"),
        "{r}"
    );
    let r = trigger("escape");
    row("left a process behind (setsid, &)", &r);
    assert_eq!(r["outcome"], "ok", "{r}");
    let pid = must(&host, "cat /var/lib/cronlease/escaped.pid", "");
    let alive = |pid: &str| {
        sh(&host, &format!("kill -0 {}", pid.trim()), "")
            .status
            .success()
    };
    let r = trigger("busy");
    row("CPU in a child that left the session", &r);
    assert_eq!(r["outcome"], "ok", "{r}");
    let cgroup = "/sys/fs/cgroup/system.slice/cronlease.service";
    if process {
        // Its cgroup went with the run, and all in it.
        assert!(
            !alive(&pid),
            "the process a run left behind is killed with it"
        );
        assert!(
            r["cpu_ms"].as_u64().unwrap_or_default() >= 100,
            "the run's cgroup counts its child's CPU too: {r}"
        );
        let left = must(&host, &format!("ls {cgroup}"), "");
        // (`overlap` may be running.)
        assert!(
            left.lines().any(|l| l == "daemon")
                && !left.contains("run-escape-")
                && !left.contains("run-busy-"),
            "the daemon in its leaf, no cgroup of an ended run left: {left}"
        );
        let journal = must(&host, "journalctl -u cronlease --no-pager", "");
        assert!(
            journal.contains("each run gets a cgroup of its own"),
            "{journal}"
        );
    } else {
        // A unit's processes all end with its main one (systemd).
        assert!(
            !alive(&pid),
            "the process a run left behind is killed with it"
        );
        assert!(r["cpu_ms"].as_u64().is_some(), "{r}");
    }
    table.push(format!(
        "| busy: CPU accounted | | | {} ms CPU |",
        r["cpu_ms"]
    ));
    // Overlap: a run of 2.5 s every second; the occurrences due meanwhile
    // are skipped, and no two runs overlap.
    let deadline = Instant::now() + Duration::from_secs(30);
    let runs = loop {
        let h = history("overlap");
        let done = h.iter().filter(|r| r["outcome"] == "ok").count();
        if done >= 3 {
            break h;
        }
        assert!(Instant::now() < deadline, "3 runs of overlap: {h:?}");
        std::thread::sleep(Duration::from_millis(500));
    };
    let mut ran: Vec<(i64, i64)> = runs
        .iter()
        .filter(|r| r["outcome"] == "ok")
        .map(|r| {
            let t = |k: &str| {
                DateTime::parse_from_rfc3339(r[k].as_str().unwrap())
                    .unwrap()
                    .timestamp_millis()
            };
            (t("started_at"), t("finished_at"))
        })
        .collect();
    ran.sort_unstable();
    for w in ran.windows(2) {
        assert!(w[0].1 <= w[1].0, "two runs at once: {ran:?}");
    }
    let skipped = runs.iter().filter(|r| r["outcome"] == "skipped").count();
    assert!(
        skipped >= 2,
        "occurrences due during a run are skipped: {runs:?}"
    );
    table.push(format!(
        "| overlap = \"skip\" | {} runs, {skipped} skipped, none at once | | |",
        ran.len()
    ));
    println!(
        "| run ({} runner) | outcome | exit code | took |\n|---|---|---|---|\n{}",
        if process { "process" } else { "systemd" },
        table.join("\n")
    );
}

/// Start lateness of many jobs due at one instant (issue 32): runs as
/// systemd units, as the guard's processes each in a cgroup of its own,
/// and as the guard's processes without (the floor), on one
/// host as shipped, from what each job wrote when it started. Prints
/// p50/p99/max per runner and the ratio. `CRONLEASE_LATENESS_JOBS` (100)
/// and `CRONLEASE_LATENESS_INSTANTS` (4) size it. Measures, asserts
/// nothing about time: `.ci/host-drills long`, or alone with
/// `.ci/host-drills long -E 'test(=hosts::unit_start_lateness)'`.
#[test]
#[ignore = "real systemd hosts, as root, with the .deb: .ci/host-drills"]
fn unit_start_lateness() {
    let var = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let n = var("CRONLEASE_LATENESS_JOBS", 100);
    let instants = var("CRONLEASE_LATENESS_INSTANTS", 4);
    let jobs: String = (0..n)
        .map(|i| {
            format!(
                "[[job]]\nname = \"j{i:04}\"\nschedule = \"*/5 * * * * *\"\ncommand = \"echo $CRONLEASE_OCCURRENCE $(date +%s.%N) >> {{out}}\"\n"
            )
        })
        .collect();
    let fleet = Fleet::boot_n("hl", Backend::Redis, 1, &jobs);
    let host = fleet.names[0].clone();
    // Lateness of each start, by occurrence, from the lines written since
    // `from` (a line count), the first instant left out (the daemon's
    // start).
    let measure = |from: usize| -> Vec<f64> {
        let deadline = Instant::now() + Duration::from_secs(10 * instants as u64 + 30);
        loop {
            let text = std::fs::read_to_string(&fleet.out).unwrap_or_default();
            let mut by_occ: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
            for l in text.lines().skip(from) {
                let mut f = l.split_whitespace();
                let (Some(occ), Some(t)) = (f.next(), f.next().and_then(|t| t.parse::<f64>().ok()))
                else {
                    continue;
                };
                let Ok(at) = DateTime::parse_from_rfc3339(occ) else {
                    continue;
                };
                let at = at.timestamp_millis() as f64 / 1000.0;
                by_occ
                    .entry(occ.to_string())
                    .or_default()
                    .push((t - at) * 1000.0);
            }
            let complete: Vec<&Vec<f64>> =
                by_occ.values().skip(1).filter(|v| v.len() == n).collect();
            if complete.len() >= instants {
                return complete
                    .into_iter()
                    .take(instants)
                    .flatten()
                    .copied()
                    .collect();
            }
            assert!(
                Instant::now() < deadline,
                "{instants} complete instants of {n} jobs\n{}",
                fleet.journals()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let journal = must(&host, "journalctl -u cronlease --no-pager", "");
    assert!(
        journal.contains("runs start as transient systemd units"),
        "{journal}"
    );
    let units = measure(0);
    let lines = std::fs::read_to_string(&fleet.out)
        .unwrap_or_default()
        .lines()
        .count();
    use_process_runner(&host);
    let journal = must(&host, "journalctl -u cronlease --no-pager", "");
    assert!(
        journal.contains("each run gets a cgroup of its own"),
        "{journal}"
    );
    let in_cgroups = measure(lines);
    let lines = std::fs::read_to_string(&fleet.out)
        .unwrap_or_default()
        .lines()
        .count();
    // The floor: the guard's processes without a cgroup per run (no
    // `__run-as --cgroup` exec before the command).
    must(
        &host,
        "mkdir -p /etc/systemd/system/cronlease.service.d && printf '[Service]\\nDelegate=no\\n' > /etc/systemd/system/cronlease.service.d/floor.conf && systemctl daemon-reload && systemctl restart cronlease",
        "",
    );
    let processes = measure(lines);
    let (u50, u99, umax) = percentiles(units);
    let (c50, c99, cmax) = percentiles(in_cgroups);
    let (p50, p99, pmax) = percentiles(processes);
    println!(
        "| runner | jobs at one instant | instants | start late p50 | p99 | max | p50 / floor |\n|---|---|---|---|---|---|---|\n\
         | systemd (transient units) | {n} | {instants} | {u50:.1} ms | {u99:.1} ms | {umax:.1} ms | {:.1}x |\n\
         | process, a cgroup per run (Delegate=yes) | {n} | {instants} | {c50:.1} ms | {c99:.1} ms | {cmax:.1} ms | {:.1}x |\n\
         | process, no cgroup (Delegate=no: the floor) | {n} | {instants} | {p50:.1} ms | {p99:.1} ms | {pmax:.1} ms | 1.0x |",
        u50 / p50,
        c50 / p50,
    );
}

/// The package on a fresh host: installs with its dependencies, creates
/// the user, enables the unit (not started before it is configured), keeps
/// an operator's edit of the conffile through a reinstall, and leaves
/// nothing of its own after a purge.
#[test]
#[ignore = "real systemd hosts, as root, with the .deb: .ci/host-drills"]
fn packaging() {
    let (names, deb) = Fleet::bare("hk", 1);
    let fleet = Fleet {
        names,
        out: PathBuf::new(),
        report: String::new(),
    };
    let host = fleet.names[0].clone();
    hosts(&["install", &host, deb.to_str().unwrap()]);
    let state = must(
        &host,
        "dpkg-query -W -f '${Status} ${Version}\\n' cronlease; systemctl is-enabled cronlease; id -un cronlease; stat -c '%a %U:%G' /etc/cronlease/cronlease.toml; cronlease --version",
        "",
    );
    assert!(state.contains("install ok installed"), "{state}");
    assert!(state.contains("enabled"), "{state}");
    assert!(state.contains("640 root:cronlease"), "{state}");
    for store in [
        "sqlite",
        "mysql",
        "postgres",
        "redis",
        "sentinel",
        "redlock",
        "zookeeper",
        "etcd",
    ] {
        assert!(state.contains(store), "the package serves {store}: {state}");
    }
    must(
        &host,
        "echo '# an operator edit' >> /etc/cronlease/cronlease.toml && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --reinstall /root/cronlease.deb",
        "",
    );
    let kept = must(&host, "tail -1 /etc/cronlease/cronlease.toml", "");
    assert_eq!(
        kept.trim(),
        "# an operator edit",
        "the conffile edit survives"
    );
    must(
        &host,
        "DEBIAN_FRONTEND=noninteractive apt-get purge -y -q cronlease",
        "",
    );
    let left = must(
        &host,
        "for p in /usr/bin/cronlease /etc/cronlease/cronlease.toml /var/lib/cronlease /lib/systemd/system/cronlease.service; do [ -e $p ] && echo left: $p; done; id cronlease 2>/dev/null && echo left: the user; true",
        "",
    );
    assert_eq!(left.trim(), "", "purge leaves nothing: {left}");
}

/// The unit's own behaviour on a real host: `systemctl reload` with a
/// broken job file fails and the daemon keeps its jobs; a process a job
/// left behind does not outlive `systemctl stop`; a store that refuses the
/// node fails the start at once (exit 77, not restarted); a store that is
/// down lets the start end (active, "waiting for the store" in STATUS).
#[test]
#[ignore = "real systemd hosts, as root, with the .deb: .ci/host-drills"]
fn unit() {
    let jobs = "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = \"echo tick >> '{out}'\"\n\n[[job]]\nname = \"leaver\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"setsid sh -c 'echo up > {out}.leaver; exec sleep 1000' < /dev/null > /dev/null 2>&1 & until [ -s {out}.leaver ]; do sleep 0.05; done; echo left\"\n";
    // The leaver waits for its sleep to have left its process group
    // (`setsid` done): what is still in the group when a job ends is
    // killed with it, by design.
    let fleet = Fleet::boot_n("hu", Backend::Redis, 1, jobs);
    let host = fleet.names[0].clone();
    let ticks = || {
        std::fs::read_to_string(&fleet.out)
            .unwrap_or_default()
            .lines()
            .count()
    };
    let wait_ticks = |n: usize, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while ticks() < n {
            assert!(Instant::now() < deadline, "{what}\n{}", fleet.journals());
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_ticks(2, "tick runs");
    let mut table = Vec::new();

    // Reload: a broken job file fails it, visibly; the daemon keeps going.
    let good = must(&host, "cat /etc/cronlease/jobs.d/drill.toml", "");
    must(
        &host,
        "cat > /etc/cronlease/jobs.d/broken.toml",
        "[[job]]\nname = \"broken\"\nschedule = \"* * *\"\ncommand = \"true\"\n",
    );
    let reload = sh(&host, "systemctl reload cronlease", "");
    let why = must(&host, "journalctl -u cronlease --no-pager -n 20", "");
    assert!(
        !reload.status.success(),
        "reload of a broken config must fail\n{why}"
    );
    assert!(why.contains("reload refused"), "{why}");
    assert!(why.contains("broken.toml:3:12"), "{why}");
    // The unit keeps the package's mode of /etc/cronlease (no complaint at
    // each start and reload).
    assert!(!why.contains("the mode is different"), "{why}");
    let before = ticks();
    wait_ticks(before + 2, "tick still runs after a refused reload");
    must(&host, "rm /etc/cronlease/jobs.d/broken.toml", "");
    must(&host, "systemctl reload cronlease", "");
    table.push("| `systemctl reload`, a broken job file | fails (exit 1), the journal names file:line:column, the jobs go on |".to_string());
    assert_eq!(
        good,
        must(&host, "cat /etc/cronlease/jobs.d/drill.toml", "")
    );

    // What a job leaves behind goes with its run's unit (systemd runner),
    // or its run's cgroup (process runner, the unit's Delegate=yes).
    must(&host, "cronlease trigger leaver --wait", "");
    let sleepers = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '^sleep 1000' && echo $p; done | wc -l";
    let left = must(&host, sleepers, "");
    let units = must(&host, "journalctl -u cronlease --no-pager", "")
        .contains("runs start as transient systemd units");
    assert!(units, "the package's runner where polkitd is installed");
    assert_eq!(
        left.trim(),
        "0",
        "the run's unit ended with its command, and took the sleep"
    );
    table.push("| a job's `setsid sleep &` (systemd runner) | killed with the run's unit when its command ends |".to_string());
    // The process runner: runs inside the daemon's unit.
    use_process_runner(&host);
    // The leaver waits for its sleep's mark: a fresh one.
    let _ = std::fs::remove_file(format!("{}.leaver", fleet.out.display()));
    must(&host, "cronlease trigger leaver --wait", "");
    let left = must(&host, sleepers, "");
    assert_eq!(
        left.trim(),
        "0",
        "the run's cgroup ended with its command, and took the sleep"
    );
    table.push(
        "| the same on the process runner | killed with the run's cgroup when its command ends |"
            .to_string(),
    );
    // `__wait-guard` (in the delegated unit's .control cgroup) sweeps the
    // unit's cgroups below it: a process put in the daemon's by hand.
    must(
        &host,
        "setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > /sys/fs/cgroup/system.slice/cronlease.service/daemon/cgroup.procs",
        "",
    );
    let left = must(&host, sleepers, "");
    assert_eq!(left.trim(), "1", "a process in the daemon's cgroup");
    must(&host, "systemctl stop cronlease", "");
    let after = must(&host, sleepers, "");
    let journal = must(&host, "journalctl -u cronlease --no-pager -n 30", "");
    assert_eq!(after.trim(), "0", "left behind after the stop\n{journal}");
    assert!(
        journal.contains("left in the unit after its guard"),
        "{journal}"
    );
    table.push("| a process left in the daemon's cgroup, `systemctl stop` | killed by `__wait-guard`, said in the journal |".to_string());
    must(
        &host,
        "sed -i '/^runner = \"process\"$/d' /etc/cronlease/cronlease.toml",
        "",
    );

    // A store that refuses the node: the start fails at once, no restart.
    let config = must(&host, "cat /etc/cronlease/cronlease.toml", "");
    let refused = config.replace(
        "url = \"redis://127.0.0.1:6379/\"",
        "url = \"redis://:wrongpw@127.0.0.1:6379/\"",
    );
    assert_ne!(refused, config, "{config}");
    must(&host, "cat > /etc/cronlease/cronlease.toml", &refused);
    let started = Instant::now();
    let start = sh(&host, "systemctl start cronlease", "");
    let took = started.elapsed();
    std::thread::sleep(Duration::from_secs(3));
    let state = must(
        &host,
        "systemctl show -p ActiveState -p ExecMainStatus -p NRestarts cronlease; journalctl -u cronlease --no-pager -n 20",
        "",
    );
    assert!(!start.status.success(), "{state}");
    assert!(state.contains("ActiveState=failed"), "{state}");
    assert!(state.contains("ExecMainStatus=77"), "{state}");
    assert!(state.contains("NRestarts=0"), "{state}");
    assert!(
        state.contains("refused this node") && !state.contains("wrongpw"),
        "{state}"
    );
    table.push(format!("| a wrong password, `systemctl start` | fails after {:.1} s: exit 77, `failed`, not restarted, no password in the journal |", took.as_secs_f64()));

    // A store that is down: the start ends, the unit active and waiting.
    let down = config.replace(
        "url = \"redis://127.0.0.1:6379/\"",
        "url = \"redis://127.0.0.1:1/\"",
    );
    must(&host, "cat > /etc/cronlease/cronlease.toml", &down);
    must(&host, "systemctl reset-failed cronlease", "");
    let started = Instant::now();
    let start = sh(&host, "systemctl start cronlease", "");
    let took = started.elapsed();
    let state = must(
        &host,
        "systemctl show -p ActiveState -p StatusText cronlease",
        "",
    );
    assert!(start.status.success(), "{state}");
    assert!(state.contains("ActiveState=active"), "{state}");
    assert!(state.contains("waiting for the store"), "{state}");
    table.push(format!("| the store down, `systemctl start` | returns after {:.1} s: `active`, STATUS `waiting for the store: …` |", took.as_secs_f64()));
    println!(
        "| on a real host | what happened |\n|---|---|\n{}",
        table.join("\n")
    );
}

/// The upgrade drill's "next release": `$CRONLEASE_DEB_NEXT`, else
/// target/debian-next's package (`.ci/deb next`).
fn deb_next() -> PathBuf {
    newest_deb(
        "CRONLEASE_DEB_NEXT",
        "target/debian-next",
        "build it with `.ci/deb next`",
    )
}

/// One value from the drill's PostgreSQL database (psql on this machine).
fn psql(query: &str) -> String {
    let url = Backend::Postgres.url(Path::new("/"));
    let out = Command::new("psql")
        .args([url.as_str(), "-Atc", query])
        .output()
        .expect("psql (Debian package postgresql-client)");
    assert!(
        out.status.success(),
        "psql {query}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Rolling upgrade (docs/operations.md, "Upgrade"): three hosts on
/// PostgreSQL run the package N, a job every second. Each host in turn is
/// stopped, given N+1 (`.ci/deb next`: one migration more, adding a
/// column) and started, as the procedure says; then one host is rolled
/// back to N. N+1's migration is applied by the first upgraded host while
/// the others still run N; the rolled-back host claims on the newer schema
/// of its block and says so. Judged from what the job wrote: nothing
/// missed, nothing twice, fences rising, no overlap.
#[test]
#[ignore = "real systemd hosts, as root, with the .deb and the next one: .ci/host-drills"]
fn upgrade() {
    let next = deb_next();
    let fleet = Fleet::boot("hg", Backend::Postgres);
    let tag = fleet
        .out
        .parent()
        .and_then(|d| d.file_name())
        .and_then(|n| n.to_str())
        .unwrap()
        .to_string();
    fleet.wait("three runs", Duration::from_secs(30), |r| r.len() >= 3);
    let schema = || psql(&format!("SELECT MAX(version) FROM {tag}cronlease_schema"));
    let column = || {
        psql(&format!(
            "SELECT COUNT(*) FROM information_schema.columns WHERE table_name = '{tag}lock_info' AND column_name = 'upgrade_drill'"
        ))
    };
    let before: i64 = schema().parse().unwrap();
    assert_eq!(column(), "0", "N has no drill column");
    let from = Utc::now();
    let mut table = Vec::new();
    let installed = |host: &str| {
        must(host, "dpkg-query -W -f '${Version}' cronlease", "")
            .trim()
            .to_string()
    };
    let old_version = installed(&fleet.names[0]);
    // One host at a time: stop (its leases handed over), install, start;
    // the next host once this one runs again.
    let step = |host: &str, deb: &Path, what: &str| {
        at_fraction_of_second(0.8);
        let at = Utc::now();
        must(host, "systemctl stop cronlease", "");
        hosts(&["install", host, deb.to_str().unwrap()]);
        must(
            host,
            "cronlease check >/dev/null && systemctl start cronlease",
            "",
        );
        fleet.wait_active(host);
        let runs = fleet.wait("runs after the step", Duration::from_secs(30), |r| {
            r.iter().filter(|x| x.occurrence > at).count() >= 3
        });
        let first = runs
            .iter()
            .filter(|x| x.occurrence > at)
            .min_by_key(|x| x.occurrence)
            .unwrap();
        let line = format!(
            "| {host} | {what} ({}) | {} on {}, {:.0} ms late |",
            installed(host),
            first.occurrence.format("%H:%M:%S"),
            first.node,
            late_ms(first)
        );
        eprintln!("{line}");
        line
    };
    for host in fleet.names.clone() {
        table.push(step(&host, &next, "upgraded to N+1"));
    }
    let after: i64 = schema().parse().unwrap();
    assert_eq!(after, before + 1, "N+1 applied its migration");
    assert_eq!(column(), "1", "N+1's column is there");
    let newer = installed(&fleet.names[0]);
    assert_ne!(newer, old_version, "the hosts run the next package");
    // Rollback of one host to N: it claims on the newer schema of its
    // block, with the WARN; `migrate` says the same and applies nothing.
    let back = fleet.names[1].clone();
    table.push(step(&back, &deb(), "rolled back to N"));
    let said = must(&back, "cronlease migrate", "");
    assert!(
        said.contains(&format!(
            "schema version {after} is newer than this binary knows ({before})"
        )),
        "{said}"
    );
    let journal = must(&back, "journalctl -u cronlease --no-pager -b", "");
    assert!(journal.contains("it is compatible"), "{journal}");
    // The rolled-back host takes its turn again: it can claim.
    let at = Utc::now();
    must(&fleet.names[0], "systemctl stop cronlease", "");
    must(&fleet.names[2], "systemctl stop cronlease", "");
    let runs = fleet.wait(
        "a run on the rolled-back host",
        Duration::from_secs(30),
        |r| r.iter().any(|x| x.occurrence > at && x.node == back),
    );
    assert!(runs.iter().any(|x| x.node == back));
    must(&back, "systemctl stop cronlease", "");
    let mut runs = fleet.runs();
    runs.retain(|r| r.occurrence >= from);
    runs.sort_by_key(|r| r.occurrence);
    let report = fleet.journals();
    assert_no_overlap(&runs, &report);
    let missed: i64 = runs
        .windows(2)
        .map(|w| ((w[1].occurrence - w[0].occurrence).num_seconds() - 1).max(0))
        .sum();
    println!("| host | step (package) | first run after the step |");
    println!("|---|---|---|");
    for line in &table {
        println!("{line}");
    }
    println!(
        "upgrade drill: {} occurrences from {} to {}, {missed} missed, 0 twice; schema {before} -> {after}",
        runs.len(),
        from.format("%H:%M:%S"),
        runs.last()
            .map(|r| r.occurrence.format("%H:%M:%S").to_string())
            .unwrap_or_default()
    );
    assert_eq!(missed, 0, "occurrences missed during the upgrade\n{report}");
}
