//! A cluster of real `cronlease run` processes sharing one store, driven with
//! real signals, and judged only from what their jobs wrote.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::support::{Backend, binary, unique};

/// One line a job wrote: `occurrence fence node started_unix_seconds`.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub occurrence: DateTime<Utc>,
    pub fence: u64,
    pub node: String,
    pub started: f64,
}

impl Line {
    /// Seconds from the scheduled instant to the job's start.
    pub fn lateness(&self) -> f64 {
        self.started - self.occurrence.timestamp_millis() as f64 / 1000.0
    }
}

/// A run as its job wrote it, in `OCCURRENCE FENCE NODE PHASE UNIX_TIME`
/// lines (`start`, then `end` unless it was cut short).
#[derive(Debug, Clone)]
pub struct Run {
    pub occurrence: DateTime<Utc>,
    pub fence: u64,
    pub node: String,
    pub start: f64,
    pub end: Option<f64>,
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    #[allow(dead_code)]
    pub backend: Backend,
    pub out: PathBuf,
    nodes: BTreeMap<String, Child>,
    /// The daemon binary nodes start from (the partition drills use a copy
    /// any uid can run).
    pub bin: PathBuf,
    /// The nodes' working directory, if not the test's.
    pub cwd: Option<PathBuf>,
}

/// Whether a node's log line is its guard's word on a dead daemon (`the
/// daemon died: … leases released …`, or why it could not hand over).
pub fn guard_on_death(line: &str) -> bool {
    line.contains("the daemon died") && line.contains("process=\"guard\"")
}

/// The job every cluster test runs unless it brings its own: each second,
/// append what it is to the shared output file.
pub fn tick_job(out: &Path) -> String {
    format!(
        "[[job]]\nname = \"tick\"\nschedule = \"* * * * * *\"\ncommand = [\"/bin/sh\", \"-c\", \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $(date +%s.%N)\\\" >> '{}'\"]\n",
        out.display()
    )
}

impl Cluster {
    /// A cluster on `backend`; `jobs` is the shared job file (it may use
    /// `{out}` for the output file's path). `extra` goes into each node's
    /// main config.
    pub fn new(backend: Backend, jobs: Option<&str>, extra: &str) -> Cluster {
        backend.require();
        Cluster::with_url(backend, None, jobs, extra)
    }

    /// As [`Cluster::new`] with the default job, each node's `[http]`
    /// listener on a free port (`http_extra`: more `[http]` keys); the port.
    pub fn listening(backend: Backend, http_extra: &str) -> (Cluster, u16) {
        let port = crate::support::free_port();
        let c = Cluster::new(
            backend,
            None,
            &format!("[http]\nlisten = \"127.0.0.1:{port}\"\n{http_extra}"),
        );
        (c, port)
    }

    /// As [`Cluster::new`], with a store URL of the test's own (a server it
    /// starts and stops itself).
    pub fn with_url(
        backend: Backend,
        url: Option<&str>,
        jobs: Option<&str>,
        extra: &str,
    ) -> Cluster {
        Cluster::build(backend, url, jobs, extra, "")
    }

    /// The general form: `store_extra` goes into each node's `[store]` table.
    pub fn build(
        backend: Backend,
        url: Option<&str>,
        jobs: Option<&str>,
        extra: &str,
        store_extra: &str,
    ) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.log");
        std::fs::write(&out, "").unwrap();
        let prefix = unique("e2e");
        std::fs::create_dir_all(dir.path().join("jobs.d")).unwrap();
        let jobs = jobs.map_or_else(
            || tick_job(&out),
            |j| j.replace("{out}", &out.display().to_string()),
        );
        std::fs::write(dir.path().join("jobs.d/jobs.toml"), jobs).unwrap();
        let url = url.map_or_else(|| backend.url(dir.path()), str::to_string);
        let grace = if extra.contains("shutdown_grace") {
            ""
        } else {
            "shutdown_grace = \"5s\"\n"
        };
        // Redlock names its masters in `urls`, one URL each.
        let store = if backend == Backend::Redlock {
            let list: Vec<String> = url.split(',').map(|u| format!("\"{u}\"")).collect();
            format!("urls = [{}]", list.join(", "))
        } else {
            format!("url = \"{url}\"")
        };
        for n in 1..=5 {
            let name = format!("n{n}");
            let config = format!(
                "node = \"{name}\"\npid_file = \"{name}.pid\"\n{grace}{extra}\n[store]\n{store}\n{store_extra}\ntable_prefix = \"{prefix}\"\nkey_prefix = \"cl:{prefix}\"\nop_timeout = \"1s\"\nhistory_limit = 100000\n[lease]\nmargin = \"1s\"\n[log]\nlevel = \"info\"\n"
            );
            std::fs::write(dir.path().join(format!("{name}.toml")), config).unwrap();
        }
        Cluster {
            dir,
            backend,
            out,
            nodes: BTreeMap::new(),
            bin: binary(),
            cwd: None,
        }
    }

    /// Replaces `from` by `to` in every node's main config (e.g. the
    /// lease margin, which [`Cluster::build`] sets).
    pub fn edit_configs(&self, from: &str, to: &str) {
        for n in 1..=5 {
            let path = self.dir.path().join(format!("n{n}.toml"));
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(text.contains(from), "{from:?} not in {}", path.display());
            std::fs::write(&path, text.replace(from, to)).unwrap();
        }
    }

    pub fn config(&self, node: &str) -> PathBuf {
        self.dir.path().join(format!("{node}.toml"))
    }

    /// `cronlease ARGS -c <node's config>` (whatever `CRONLEASE_CONFIG`
    /// says), run to its end.
    pub fn cli(&self, node: &str, args: &[&str]) -> std::process::Output {
        Command::new(binary())
            .args(args)
            .arg("-c")
            .arg(self.config(node))
            .env_remove("CRONLEASE_CONFIG")
            .output()
            .unwrap()
    }

    /// `cronlease ARGS --json -c <node's config>`, its stdout parsed.
    pub fn cli_json(&self, node: &str, args: &[&str]) -> serde_json::Result<serde_json::Value> {
        let mut args = args.to_vec();
        args.push("--json");
        serde_json::from_slice(&self.cli(node, &args).stdout)
    }

    /// Every run `cronlease history --json` lists (of `job`, or of every
    /// job), asked with `via`'s config until it answers: the CLI reads with
    /// the nodes' `op_timeout` (1 s here), and under the suite's load
    /// reading thousands of runs (from a majority of Redlock's masters, say)
    /// once took longer in CI.
    pub fn all_history(&self, via: &str, job: Option<&str>) -> serde_json::Value {
        let mut args = vec!["history", "--limit", "1000000"];
        args.extend(job);
        crate::support::wait_until(
            "`cronlease history` to answer",
            Duration::from_secs(30),
            || self.report(),
            || self.cli_json(via, &args).ok(),
        )
    }

    /// The node names `cronlease nodes --json` lists, asked with `via`'s
    /// config, sorted; panics when the command fails.
    pub fn registry(&self, via: &str) -> Vec<String> {
        let listed = self.cli_json(via, &["nodes"]).unwrap_or_else(|e| {
            panic!("`cronlease nodes` printed no JSON ({e})\n{}", self.report())
        });
        let mut names: Vec<String> = listed
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["node"].as_str().unwrap().to_string())
            .collect();
        names.sort();
        names
    }

    /// Polls [`Cluster::registry`] until it lists exactly `want`; returns
    /// when the first poll that saw it started (each poll is a `nodes`
    /// process, a few hundred ms under load: its end would add that to the
    /// registry's own latency), or panics after `limit`.
    pub fn wait_registry(&self, via: &str, want: &[&str], limit: Duration) -> Instant {
        let start = Instant::now();
        let mut last = Vec::new();
        while start.elapsed() < limit {
            let asked = Instant::now();
            last = self.registry(via);
            if last == want {
                return asked;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "the node registry listed {last:?}, not {want:?}, for {limit:?}\n{}",
            self.report()
        );
    }

    /// Starts (or restarts) a node; its output is appended to `{node}.log`.
    pub fn start(&mut self, node: &str) {
        self.start_with_env(node, &[]);
    }

    /// Starts a node with extra environment variables.
    pub fn start_with_env(&mut self, node: &str, env: &[(&str, &str)]) {
        self.start_under(node, &[], env);
    }

    /// Starts `node` as the command `prefix` runs in place (`prlimit …
    /// --`): the node's pid is the prefix's.
    pub fn start_under(&mut self, node: &str, prefix: &[&str], env: &[(&str, &str)]) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{node}.log")))
            .unwrap();
        let mut command = match prefix.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        if let Some(cwd) = &self.cwd {
            command.current_dir(cwd);
        }
        let child = command
            .args(["run", "-c"])
            .arg(self.config(node))
            .env_remove("CRONLEASE_STORE_URL")
            .env_remove("RUST_LOG")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.nodes.insert(node.to_string(), child);
    }

    pub fn pid(&self, node: &str) -> i32 {
        self.nodes[node].id() as i32
    }

    pub fn signal(&self, node: &str, sig: Signal) {
        kill(Pid::from_raw(self.pid(node)), sig).unwrap();
    }

    /// Waits up to `limit` for the node to exit.
    pub fn wait_exit(&mut self, node: &str, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        let child = self.nodes.get_mut(node)?;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// The node's daemon and every process below it (guard, jobs and theirs).
    pub fn tree(&self, node: &str) -> Vec<i32> {
        let root = self.pid(node);
        let parent_of: Vec<(i32, i32)> = crate::support::all_pids()
            .into_iter()
            .filter_map(|pid| Some((pid, crate::support::proc_stat(pid).get(1)?.parse().ok()?)))
            .collect();
        let mut tree = vec![root];
        let mut i = 0;
        while i < tree.len() {
            let p = tree[i];
            tree.extend(parent_of.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
            i += 1;
        }
        tree
    }

    /// The node's guard process (`cronlease __guard`), waiting up to 10 s
    /// for it to be up.
    pub fn guard_pid(&self, node: &str) -> i32 {
        crate::support::wait_until(
            "the guard process",
            Duration::from_secs(10),
            || self.report(),
            || {
                self.tree(node).into_iter().find(|pid| {
                    std::fs::read(format!("/proc/{pid}/cmdline"))
                        .is_ok_and(|cmd| String::from_utf8_lossy(&cmd).contains("__guard"))
                })
            },
        )
    }

    /// kill -9 of the daemon and its guard together, as a dead host would
    /// go (its jobs, left alone, end by themselves); both are stopped first,
    /// so neither sees the other go.
    pub fn kill_with_guard(&self, node: &str) {
        let both = [self.guard_pid(node), self.pid(node)];
        for sig in [Signal::SIGSTOP, Signal::SIGKILL] {
            for pid in both {
                kill(Pid::from_raw(pid), sig).unwrap();
            }
        }
    }

    /// SIGSTOP the whole tree, daemon first: a VM or GC pause. Returns it.
    pub fn freeze(&self, node: &str) -> Vec<i32> {
        let tree = self.tree(node);
        for pid in &tree {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGSTOP);
        }
        tree
    }

    /// SIGCONT a frozen tree, the daemon last (its jobs wake first, as they may).
    pub fn thaw(&self, tree: &[i32]) {
        for pid in tree.iter().rev() {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGCONT);
        }
    }

    pub fn is_running(&mut self, node: &str) -> bool {
        self.nodes
            .get_mut(node)
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The runs of a job writing phase lines, by fence, in start order.
    pub fn runs(&self) -> Vec<Run> {
        runs_in(&std::fs::read_to_string(&self.out).unwrap_or_default())
    }

    /// Everything the jobs wrote, in file order.
    pub fn lines(&self) -> Vec<Line> {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                Some(Line {
                    occurrence: DateTime::parse_from_rfc3339(f.next()?)
                        .ok()?
                        .with_timezone(&Utc),
                    fence: f.next()?.parse().ok()?,
                    node: f.next()?.to_string(),
                    started: f.next()?.parse().ok()?,
                })
            })
            .collect()
    }

    /// Waits until `pred` holds for the lines (or panics after `limit`).
    pub fn wait_for(
        &self,
        what: &str,
        limit: Duration,
        pred: impl Fn(&[Line]) -> bool,
    ) -> Vec<Line> {
        crate::support::wait_until(
            what,
            limit,
            || self.report(),
            || {
                let lines = self.lines();
                pred(&lines).then_some(lines)
            },
        )
    }

    /// A node's log so far.
    pub fn log(&self, node: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{node}.log"))).unwrap_or_default()
    }

    /// The output file and the tail of every node's log, for failure messages.
    pub fn report(&self) -> String {
        let mut s = format!(
            "--- {} ---\n{}",
            self.out.display(),
            std::fs::read_to_string(&self.out).unwrap_or_default()
        );
        for node in self.nodes.keys() {
            let log = std::fs::read_to_string(self.dir.path().join(format!("{node}.log")))
                .unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            s.push_str(&format!("--- {node}.log (last 40 lines) ---\n"));
            for l in tail.iter().rev() {
                s.push_str(l);
                s.push('\n');
            }
        }
        s
    }

    /// Stops every node with SIGTERM and checks each exits 0.
    pub fn stop_all(&mut self) {
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for n in &names {
            if self.is_running(n) {
                self.signal(n, Signal::SIGTERM);
            }
        }
        for n in &names {
            let status = self.wait_exit(n, Duration::from_secs(15));
            assert!(status.is_some(), "{n} did not stop\n{}", self.report());
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in self.nodes.values_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// How far into its second `t` is, in seconds.
pub fn fraction_of_second(t: DateTime<Utc>) -> f64 {
    f64::from(t.timestamp_subsec_millis()) / 1000.0
}

/// The runs in `text`, phase lines of a job (`timed_job`), by fence, in
/// start order.
pub fn runs_in(text: &str) -> Vec<Run> {
    let mut by_fence: BTreeMap<u64, Run> = BTreeMap::new();
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        let [occ, fence, node, phase, t] = f[..] else {
            continue;
        };
        let (Ok(occ), Ok(fence), Ok(t)) = (
            DateTime::parse_from_rfc3339(occ),
            fence.parse::<u64>(),
            t.parse::<f64>(),
        ) else {
            continue;
        };
        let run = by_fence.entry(fence).or_insert(Run {
            occurrence: occ.with_timezone(&Utc),
            fence,
            node: node.into(),
            start: t,
            end: None,
        });
        match phase {
            "start" => run.start = t,
            _ => run.end = Some(t),
        }
    }
    let mut v: Vec<Run> = by_fence.into_values().collect();
    v.sort_by(|a, b| a.start.total_cmp(&b.start));
    v
}

/// Sleeps until the wall clock is `frac` into a second (away from instants).
pub fn at_fraction_of_second(frac: f64) {
    let into = fraction_of_second(Utc::now());
    let wait = if into < frac {
        frac - into
    } else {
        1.0 - into + frac
    };
    std::thread::sleep(Duration::from_secs_f64(wait));
}

/// Checks the whole record: every occurrence exactly once with no gap, and
/// fences strictly increasing in occurrence order. Returns the lines sorted.
pub fn check_exactly_once(lines: &[Line], report: &str) -> Vec<Line> {
    let sorted = check_once_in_order(lines, report);
    for w in sorted.windows(2) {
        assert_eq!(
            (w[1].occurrence - w[0].occurrence).num_seconds(),
            1,
            "occurrence missed between {:?} and {:?}\n{report}",
            w[0],
            w[1]
        );
    }
    sorted
}

/// No occurrence twice and fences rising with the occurrences; gaps
/// allowed (the store was out of reach for some). Returns them in order.
pub fn check_once_in_order(lines: &[Line], report: &str) -> Vec<Line> {
    let mut sorted = lines.to_vec();
    sorted.sort_by_key(|l| l.occurrence);
    for w in sorted.windows(2) {
        assert_ne!(
            w[0].occurrence, w[1].occurrence,
            "occurrence ran twice: {:?} {:?}\n{report}",
            w[0], w[1]
        );
        assert!(
            w[0].fence < w[1].fence,
            "fence not increasing: {:?} then {:?}\n{report}",
            w[0],
            w[1]
        );
    }
    sorted
}

/// A job that writes `start`, sleeps `secs`, writes `end`.
pub fn timed_job(schedule: &str, secs: f64) -> String {
    let line = |phase: &str| {
        format!(
            "echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE {phase} $(date +%s.%N)\\\" >> '{{out}}'"
        )
    };
    format!(
        "[[job]]\nname = \"job\"\nschedule = \"{schedule}\"\ncommand = \"{}; sleep {secs}; {}\"\n",
        line("start"),
        line("end")
    )
}

/// No two runs overlap in time; fences increase with start order.
pub fn assert_no_overlap(runs: &[Run], report: &str) {
    for w in runs.windows(2) {
        let end = w[0].end.unwrap_or(w[0].start);
        assert!(
            w[1].start > end,
            "runs overlap: {:?} and {:?}\n{report}",
            w[0],
            w[1]
        );
        assert!(
            w[0].fence < w[1].fence && w[0].occurrence < w[1].occurrence,
            "{:?} {:?}\n{report}",
            w[0],
            w[1]
        );
    }
}

/// The job's history (newest first, at most 1,000 runs) as `history
/// --json` prints it, read through n1's configuration; nothing while the
/// daemon has not set the store up yet.
pub fn history(c: &Cluster, job: &str) -> Vec<serde_json::Value> {
    let out = Command::new(binary())
        .args(["history", job, "--json", "--limit", "1000", "-c"])
        .arg(c.config("n1"))
        .env_remove("CRONLEASE_STORE_URL")
        .output()
        .unwrap();
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("no cronlease tables yet"), "{stderr}");
        return Vec::new();
    }
    serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}
