//! The randomized failover drill: three nodes, and every 1–3 s a random
//! SIGKILL+restart, SIGSTOP…SIGCONT of a node's whole tree, SIGTERM+restart or
//! step-down (SIGUSR1 or `cronlease step-down`), never leaving fewer than one
//! undisturbed node. At the end the jobs' own output is judged:
//! occurrences run twice, overlapping runs, fences out of order, occurrences
//! missed while a node was up. The seed is printed; `CRONLEASE_DRILL_SEED`
//! replays one. Beside the judged job the nodes carry a load of
//! `CRONLEASE_DRILL_JOBS` jobs (default 200) due every 5 s together, whose
//! runs are judged for doubles and fence order.
//!
//! The same drill runs other [`Plan`]s: kill anywhere kills only, the holder,
//! at random points around the instants, with load jobs every second.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use nix::sys::signal::Signal;

use crate::cluster::Cluster;
use crate::support::Backend;

const MARGIN: f64 = 1.0;
/// How long a node restarted beside a frozen peer may claim nothing on etcd:
/// its start up to its first beat (up to 1.5 s with both cores busy) plus
/// one heartbeat TTL at this margin (1.33 s, `beat_timing`), rounded up. Seen
/// in the long tier: a restart at +0, its first claim at +2.48 s.
const ETCD_SETTLING: f64 = 3.0;
/// A run that starts within this long after a node froze (seconds) had its
/// claim answered before the freeze: it says nothing of the store after it.
const CLAIMED_BEFORE_FREEZE: f64 = 0.05;
/// How long the judged job sleeps between its start and end lines.
const JOB_SECONDS: f64 = 0.2;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn between(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (self.next() % 10_000) as f64 / 10_000.0 * (hi - lo)
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[(self.next() % v.len() as u64) as usize]
    }
}

fn now() -> f64 {
    Utc::now().timestamp_micros() as f64 / 1e6
}

/// A span of time during which a node could not claim.
#[derive(Debug, Clone)]
struct Disturbance {
    node: String,
    kind: &'static str,
    from: f64,
    to: f64,
    /// When the node was restarted or thawed (SIGCONT sent just after).
    healed: f64,
}

enum Heal {
    Restart,
    Thaw(Vec<i32>),
}

#[derive(Debug, Default)]
pub struct Counts {
    pub events: BTreeMap<&'static str, usize>,
    pub occurrences: usize,
    pub ran_twice: usize,
    pub overlapping: usize,
    /// Claimed and skipped because the previous run still went.
    pub skipped_overlap: usize,
    pub stale_fenced: usize,
    pub fence_out_of_order: usize,
    pub missed_while_up: usize,
    pub lost_between_claim_and_start: usize,
    /// SQLite: missed while a frozen node held the database file's write
    /// lock (nothing started anywhere from its freeze to its thaw).
    pub sqlite_locked_by_frozen_writer: usize,
    /// etcd: missed while every node up had just restarted beside a frozen
    /// peer, its clock median not yet settled.
    pub etcd_clocks_settling: usize,
    /// Runs of the load jobs, and how many of their occurrences ran twice or
    /// got a fence lower than an earlier occurrence of the same job.
    pub load_runs: usize,
    pub load_ran_twice: usize,
    pub load_fence_out_of_order: usize,
    /// What each overlap and miss was, for the failure message's tail
    /// (where a truncated CI log still shows it).
    pub findings: Vec<String>,
}

/// Seconds since the Unix epoch.
fn secs(t: DateTime<Utc>) -> f64 {
    t.timestamp_millis() as f64 / 1000.0
}

/// What a drill does between its start and its judgement.
pub struct Plan {
    /// The disturbances drawn from.
    pub kinds: &'static [&'static str],
    /// The load jobs' schedule.
    pub load_schedule: &'static str,
    /// How many load jobs, unless `CRONLEASE_DRILL_JOBS` says.
    pub load: usize,
    /// Seconds between two disturbances.
    pub gap: (f64, f64),
    /// Seconds a killed or stopped node stays down.
    pub down: (f64, f64),
    /// Disturb the holder (the node of the judged job's last run) at this
    /// offset from an instant, in seconds, rather than any node at any time.
    pub near_instant: Option<(f64, f64)>,
}

impl Plan {
    /// The randomized drill: kills, stops, SIGTERMs and step-downs of any
    /// node at any time, 200 load jobs every 5 s.
    pub const RANDOMIZED: Plan = Plan {
        kinds: &["kill", "stop", "term", "step-down"],
        load_schedule: "*/5 * * * * *",
        load: 200,
        gap: (1.0, 3.0),
        down: (1.0, 3.0),
        near_instant: None,
    };

    /// Kill anywhere: SIGKILL of the holder from 100 ms before an instant
    /// to 600 ms after it (two in five drawn from 10 ms before it to 60 ms
    /// after) (before its claim, with its claim batch in flight
    /// or inside the store's transaction, between the claim and the spawn,
    /// in the first moments of the runs), 50 load jobs every second.
    pub const KILL_ANYWHERE: Plan = Plan {
        kinds: &["kill"],
        load_schedule: "* * * * * *",
        load: 50,
        gap: (0.8, 1.6),
        down: (0.3, 1.5),
        near_instant: Some((-0.1, 0.6)),
    };
}

/// Where a kill landed, from its offset to the nearest instant.
fn kill_point(offset: f64) -> &'static str {
    match offset {
        o if o < 0.0 => "kill: before the instant",
        o if o < 0.05 => "kill: claim in flight (+0-50 ms)",
        o if o < 0.2 => "kill: claim to spawn (+50-200 ms)",
        _ => "kill: runs started (+200-600 ms)",
    }
}

pub fn run(backend: Backend, seconds: u64) -> Counts {
    run_plan(backend, seconds, &Plan::RANDOMIZED)
}

pub fn run_plan(backend: Backend, seconds: u64, plan: &Plan) -> Counts {
    let seed = std::env::var("CRONLEASE_DRILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| Utc::now().timestamp_nanos_opt().unwrap_or(1) as u64 | 1);
    let mut rng = Rng(seed);
    let job = format!(
        "[[job]]\nname = \"drill\"\nschedule = \"* * * * * *\"\ncommand = \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE start $(date +%s.%N)\\\" >> '{{out}}'; sleep {JOB_SECONDS}; echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE end $(date +%s.%N)\\\" >> '{{out}}'\"\n"
    );
    let load: usize = std::env::var("CRONLEASE_DRILL_JOBS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(plan.load);
    let mut jobs = job.to_string();
    for i in 0..load {
        jobs.push_str(&format!(
            "[[job]]\nname = \"load{i:03}\"\nschedule = \"{}\"\ncommand = \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE $CRONLEASE_JOB\\\" >> '{{out}}.load'\"\n",
            plan.load_schedule
        ));
    }
    let mut c = Cluster::new(backend, Some(&jobs), "");
    let nodes = ["n1", "n2", "n3"];
    for n in nodes {
        c.start(n);
    }
    c.wait_for("steady state", Duration::from_secs(20), |l| {
        !l.is_empty() || std::fs::read_to_string(&c.out).is_ok_and(|t| t.lines().count() >= 2)
    });
    let begin = now();
    let mut disturbances: Vec<Disturbance> = Vec::new();
    let mut pending: Vec<(f64, String, Heal)> = Vec::new();
    let mut busy_until: BTreeMap<String, f64> = BTreeMap::new();
    let mut counts = Counts::default();
    let mut step_down_by_command = false;
    let until = begin + seconds as f64;
    while now() < until {
        std::thread::sleep(Duration::from_secs_f64(rng.between(plan.gap.0, plan.gap.1)));
        // Heal what is due.
        let t = now();
        let (due, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut pending)
            .into_iter()
            .partition(|(at, _, _)| *at <= t);
        pending = rest;
        for (_, node, heal) in due {
            let healed = now();
            match heal {
                Heal::Restart => c.start(&node),
                Heal::Thaw(tree) => c.thaw(&tree),
            }
            let mut end = now();
            if let Some(d) = disturbances.iter_mut().rev().find(|d| d.node == node) {
                end += if d.kind == "stop" { 0.1 } else { 0.5 };
                d.to = end;
                d.healed = healed;
            }
            busy_until.insert(node, end);
        }
        let t = now();
        let healthy: Vec<&str> = nodes
            .iter()
            .copied()
            .filter(|n| {
                !pending.iter().any(|(_, p, _)| p == n) && busy_until.get(*n).is_none_or(|b| *b < t)
            })
            .collect();
        if healthy.len() < 2 {
            continue;
        }
        let mut node = rng.pick(&healthy).to_string();
        let kind = *rng.pick(plan.kinds);
        *counts.events.entry(kind).or_default() += 1;
        if let Some((lo, hi)) = plan.near_instant {
            if let Some(holder) = c.runs().last().map(|r| r.node.clone())
                && healthy.contains(&holder.as_str())
            {
                node = holder;
            }
            // Two kills in five land in the claim's first 60 ms, where a
            // window of the whole range would rarely put one.
            let offset = if rng.next() % 5 < 2 {
                rng.between(-0.01, 0.06)
            } else {
                rng.between(lo, hi)
            };
            let t = now();
            let mut at = t.floor() + 1.0 + offset;
            if at - 1.0 > t {
                at -= 1.0;
            }
            std::thread::sleep(Duration::from_secs_f64((at - now()).max(0.0)));
            // Where it landed: the signal goes now, whatever the sleep's
            // overshoot.
            *counts
                .events
                .entry(kill_point(now() - (at - offset)))
                .or_default() += 1;
        }
        let from = now();
        match kind {
            "kill" => {
                c.signal(&node, Signal::SIGKILL);
                c.wait_exit(&node, Duration::from_secs(5));
                pending.push((
                    from + rng.between(plan.down.0, plan.down.1),
                    node.clone(),
                    Heal::Restart,
                ));
            }
            "stop" => {
                let tree = c.freeze(&node);
                pending.push((from + rng.between(0.5, 4.0), node.clone(), Heal::Thaw(tree)));
            }
            "term" => {
                c.signal(&node, Signal::SIGTERM);
                let status = c.wait_exit(&node, Duration::from_secs(10));
                assert!(
                    status.is_some_and(|s| s.success()),
                    "{node} did not stop cleanly on SIGTERM\n{}",
                    c.report()
                );
                pending.push((now() + rng.between(0.5, 2.0), node.clone(), Heal::Restart));
            }
            _ => {
                if step_down_by_command {
                    let out = c.cli(&node, &["step-down"]);
                    assert!(
                        out.status.success(),
                        "{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                } else {
                    c.signal(&node, Signal::SIGUSR1);
                }
                step_down_by_command = !step_down_by_command;
                busy_until.insert(node.clone(), from + MARGIN + 0.1);
            }
        }
        let to = if kind == "step-down" {
            from + MARGIN + 0.1
        } else {
            f64::INFINITY
        };
        disturbances.push(Disturbance {
            node,
            kind,
            from,
            to,
            healed: f64::INFINITY,
        });
    }
    let judged_until = now() - 2.0;
    for (_, node, heal) in std::mem::take(&mut pending) {
        let healed = now();
        if let Some(d) = disturbances.iter_mut().rev().find(|d| d.node == node) {
            d.healed = healed;
            d.to = healed + 0.5;
        }
        match heal {
            Heal::Restart => c.start(&node),
            Heal::Thaw(tree) => c.thaw(&tree),
        }
    }
    std::thread::sleep(Duration::from_secs(3));
    c.stop_all();
    let report = c.report();
    judge(&c, &disturbances, begin, judged_until, &mut counts);
    judge_load(&c, &mut counts);
    let summary = format!(
        "drill {backend:?} {seconds}s seed {seed} with {load} load jobs ({} runs, ran twice {}, fences out of order {}): events {:?}; {} occurrences; ran twice {}; overlapping runs {}; stale writes fenced off {}; fences out of order {}; missed while a node was up {}; lost between claim and start {}; skipped by overlap {}; SQLite file locked by a frozen writer {}; etcd clocks settling {}",
        counts.load_runs,
        counts.load_ran_twice,
        counts.load_fence_out_of_order,
        counts.events,
        counts.occurrences,
        counts.ran_twice,
        counts.overlapping,
        counts.stale_fenced,
        counts.fence_out_of_order,
        counts.missed_while_up,
        counts.lost_between_claim_and_start,
        counts.skipped_overlap,
        counts.sqlite_locked_by_frozen_writer,
        counts.etcd_clocks_settling
    );
    eprintln!("{summary}");
    // The verdict last: a CI log cut to its tail still shows why.
    let verdict = format!(
        "seed {seed}\n{report}\n{summary}\n{}",
        counts.findings.join("\n")
    );
    assert_eq!(counts.ran_twice, 0, "{verdict}");
    assert_eq!(counts.overlapping, 0, "{verdict}");
    assert_eq!(counts.fence_out_of_order, 0, "{verdict}");
    assert_eq!(counts.missed_while_up, 0, "{verdict}");
    assert_eq!(counts.load_ran_twice, 0, "{verdict}");
    assert_eq!(counts.load_fence_out_of_order, 0, "{verdict}");
    counts
}

/// The load jobs' lines (`OCCURRENCE FENCE NODE JOB`): no occurrence of a
/// job twice, fences increasing with the occurrence per job.
fn judge_load(c: &Cluster, counts: &mut Counts) {
    let path = format!("{}.load", c.out.display());
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut by_job: BTreeMap<String, Vec<(String, u64)>> = BTreeMap::new();
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        let [occ, fence, _node, job] = f[..] else {
            continue;
        };
        let Ok(fence) = fence.parse::<u64>() else {
            continue;
        };
        by_job
            .entry(job.to_string())
            .or_default()
            .push((occ.to_string(), fence));
    }
    for runs in by_job.values_mut() {
        counts.load_runs += runs.len();
        runs.sort();
        for w in runs.windows(2) {
            if w[0].0 == w[1].0 {
                counts.load_ran_twice += 1;
            } else if w[0].1 >= w[1].1 {
                counts.load_fence_out_of_order += 1;
            }
        }
    }
}

/// Occurrences (unix seconds) the judged job's history records with
/// `outcome`, for each of `outcomes`, read once: `lease_lost` (claimed,
/// then given up because the holder could not prove its lease) or
/// `skipped` (claimed while the previous run still went).
fn recorded_as<const N: usize>(
    c: &Cluster,
    outcomes: [&str; N],
) -> [std::collections::BTreeSet<i64>; N] {
    let runs = c.all_history("n1", Some("drill"));
    outcomes.map(|outcome| {
        runs.as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["job"] == "drill" && r["outcome"] == outcome)
            .filter_map(|r| DateTime::parse_from_rfc3339(r["occurrence"].as_str()?).ok())
            .map(|t| t.timestamp())
            .collect()
    })
}

fn judge(c: &Cluster, disturbances: &[Disturbance], begin: f64, until: f64, counts: &mut Counts) {
    let [lease_lost, skipped] = recorded_as(c, ["lease_lost", "skipped"]);
    // What history says of an occurrence that never ran (a claim handed
    // back and then ended, or not found), printed with it.
    let history = c.all_history("n1", Some("drill"));
    let records_of = |t: i64| -> Vec<String> {
        history
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| {
                r["job"] == "drill"
                    && r["occurrence"]
                        .as_str()
                        .and_then(|o| DateTime::parse_from_rfc3339(o).ok())
                        .is_some_and(|o| o.timestamp() == t)
            })
            .map(|r| {
                format!(
                    "{} fence {} {}: {}",
                    r["node"], r["fence"], r["outcome"], r["output"]
                )
            })
            .collect()
    };
    let mut runs = c.runs();

    // Each occurrence once; fences increasing in occurrence order.
    runs.sort_by(|a, b| a.occurrence.cmp(&b.occurrence).then(a.fence.cmp(&b.fence)));
    counts.occurrences = runs.len();
    for w in runs.windows(2) {
        if w[0].occurrence == w[1].occurrence {
            counts.ran_twice += 1;
            counts
                .findings
                .push(format!("ran twice: {:?} and {:?}", w[0], w[1]));
        } else if w[0].fence >= w[1].fence {
            counts.fence_out_of_order += 1;
            counts
                .findings
                .push(format!("fences out of order: {:?} then {:?}", w[0], w[1]));
        }
    }

    // Overlap in time. A run whose node was frozen may write after a peer
    // started (it resumes before its daemon can kill it): those writes carry
    // the lower fence and a fencing sink refuses them, so they are counted
    // apart. Anything else overlapping is a violation.
    let disturbed = |node: &str, kind: &str, from: f64, to: f64| {
        disturbances
            .iter()
            .any(|d| d.node == node && d.kind == kind && d.from < to && d.to > from)
    };
    runs.sort_by(|a, b| a.start.total_cmp(&b.start));
    for (i, a) in runs.iter().enumerate() {
        // A run with no end line was cut short by its node's next
        // disturbance: SIGKILL (the guard kills the job at once) or SIGSTOP
        // (the watchdog kills the stale job at the thaw), or, with neither,
        // by its daemon (a lease it could not prove).
        // Not frozen while its sleep ran, it was killed within it: a node
        // frozen between the claim and the job's first line writes that
        // line at the thaw, and its daemon kills the stale job there.
        let frozen_while_running = disturbances.iter().any(|d| {
            d.node == a.node
                && d.kind == "stop"
                && d.from >= a.start - 0.01
                && d.from <= a.start + JOB_SECONDS + 0.05
        });
        let own_length = if frozen_while_running {
            f64::INFINITY
        } else {
            a.start + JOB_SECONDS + 0.05
        };
        let cut = disturbances
            .iter()
            .filter(|d| d.node == a.node && d.from >= a.start - 0.01)
            .filter_map(|d| match d.kind {
                "kill" => Some(d.from),
                "stop" => Some(d.healed),
                _ => None,
            })
            .fold(own_length, f64::min);
        let end = a.end.unwrap_or(if cut.is_finite() { cut } else { a.start });
        for b in runs[i + 1..].iter().take_while(|b| b.start < end) {
            // The stale one of the two is the lower fence: frozen after its
            // claim (while it ran, or before its first line, written at the
            // thaw), it resumed on a lease a peer had taken over since.
            let stale = if a.fence < b.fence { a } else { b };
            if b.node != a.node
                && disturbed(&stale.node, "stop", secs(stale.occurrence) - 0.01, b.start)
            {
                counts.stale_fenced += 1;
            } else {
                counts.overlapping += 1;
                let around: Vec<&Disturbance> = disturbances
                    .iter()
                    .filter(|d| {
                        (d.node == a.node || d.node == b.node)
                            && d.from > a.start - 3.0
                            && d.from < b.start + 1.0
                    })
                    .collect();
                let finding = format!(
                    "overlap: {a:?} (end used {end:.3}) with {b:?}; disturbances: {around:?}"
                );
                eprintln!("{finding}");
                counts.findings.push(finding);
            }
        }
    }

    // Missed: an instant with no run although some node was up throughout its
    // claim window (the instant to the takeover and catch-up one margin on).
    let ran: std::collections::BTreeSet<i64> =
        runs.iter().map(|r| secs(r.occurrence) as i64).collect();
    let up = |node: &str, from: f64, to: f64| {
        !disturbances
            .iter()
            .any(|d| d.node == node && d.from < to && d.to > from)
    };
    // etcd judges whether an occurrence is due on the median of the live
    // nodes' clocks, and a node (re)started while a peer with a live record
    // is frozen waits for that peer's reading until one heartbeat TTL after
    // its first beat (src/store/etcd/clocks.rs, `unsettled`): until then it
    // claims nothing (docs/protocol.md, "Clock offset").
    let settling = |node: &str, from: f64, to: f64| {
        c.backend == Backend::Etcd
            && disturbances.iter().any(|d| {
                d.node == node
                    && matches!(d.kind, "kill" | "term")
                    && d.healed < to
                    && d.healed + ETCD_SETTLING > from
                    && disturbances.iter().any(|f| {
                        // Frozen by the time the restarted node first
                        // beats (its start, up to half a second).
                        f.node != node
                            && f.kind == "stop"
                            && f.from < d.healed + 0.5
                            && f.healed > d.healed
                    })
            })
    };
    let mut t = begin.ceil() as i64 + 2;
    while (t as f64) < until {
        let instant = t as f64;
        if !ran.contains(&t)
            && ["n1", "n2", "n3"]
                .iter()
                .any(|n| up(n, instant - 0.3, instant + MARGIN + 0.6))
        {
            // A holder frozen or killed between its claim and the start of the
            // run loses that occurrence by design (it never runs on a lease it
            // cannot prove): at most once beats at least once.
            // A frozen holder records the occurrence as lease_lost (it never
            // runs a job on a lease it cannot prove); a killed one records
            // nothing, so a kill right after the claim (at the instant, or at
            // the takeover one margin later) stands for it.
            // Likewise a node frozen right after the instant, its claim in
            // flight: the store answered, the node learns of its win only
            // at the thaw, long past the lease (seen in CI on Sentinel).
            let cut_off_after_claim = disturbances.iter().any(|d| {
                matches!(d.kind, "kill" | "stop")
                    && [instant, instant + MARGIN]
                        .iter()
                        .any(|at| d.from >= at - 0.05 && d.from <= at + 0.3)
            });
            // A holder that claimed the instant before as a catch-up (run in
            // this instant's window, on the lease of this one) and was then
            // frozen or killed mid-run: peers wait out that lease, so this
            // instant goes with it, like a claim lost before its start.
            let frozen_catch_up = runs.iter().any(|r| {
                secs(r.occurrence) as i64 == t - 1
                    && r.start >= instant
                    && disturbances.iter().any(|d| {
                        d.node == r.node
                            && matches!(d.kind, "stop" | "kill")
                            && d.from >= r.start - 0.05
                            && d.from <= r.end.unwrap_or(f64::INFINITY)
                    })
            });
            let in_window = lease_lost.contains(&t) || cut_off_after_claim || frozen_catch_up;
            // SQLite is one file whose write lock belongs to whichever
            // process writes: a node frozen inside a write transaction (a
            // claim, a heartbeat, a history write) holds it, and every
            // node's calls wait until its thaw. Its mark: no run started
            // anywhere from the freeze to the thaw, which covers the instant.
            // A run that started just after the freeze was claimed before
            // it (its claim committed, then the frozen node took the lock):
            // seen in the long tier, a run 1.6 ms after a freeze at an
            // instant, then 10 s of nothing while the frozen node held the
            // file.
            let file_locked = c.backend == Backend::Sqlite
                && disturbances.iter().any(|d| {
                    d.kind == "stop"
                        && d.from < instant
                        && d.healed > instant + MARGIN
                        && !runs.iter().any(|r| {
                            r.start > d.from + CLAIMED_BEFORE_FREEZE && r.start < d.healed - 0.01
                        })
                });
            let clocks_settling = !["n1", "n2", "n3"].iter().any(|n| {
                up(n, instant - 0.3, instant + MARGIN + 0.6)
                    && !settling(n, instant - 0.3, instant + MARGIN + 0.6)
            });
            if skipped.contains(&t) {
                // overlap = "skip": a late run (a thawed holder) was still
                // going at this instant; claimed and skipped, as configured.
                counts.skipped_overlap += 1;
            } else if in_window {
                counts.lost_between_claim_and_start += 1;
                eprintln!(
                    "lost between claim and start: unix {t}; its records: {:?}",
                    records_of(t)
                );
            } else if file_locked {
                counts.sqlite_locked_by_frozen_writer += 1;
            } else if clocks_settling {
                counts.etcd_clocks_settling += 1;
                eprintln!(
                    "etcd clocks settling: unix {t}; every node up had just restarted beside a frozen peer"
                );
            } else {
                counts.missed_while_up += 1;
                let around: Vec<&Disturbance> = disturbances
                    .iter()
                    .filter(|d| d.from > instant - 4.0 && d.from < instant + 3.0)
                    .collect();
                let finding = format!(
                    "missed occurrence {} (unix {instant}); its records: {:?}; disturbances around it: {around:?}",
                    DateTime::from_timestamp(t, 0).unwrap_or_default(),
                    records_of(t)
                );
                eprintln!("{finding}");
                counts.findings.push(finding);
            }
        }
        t += 1;
    }
}
