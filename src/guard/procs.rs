//! The process table as /proc shows it: each run's process group and
//! every descendant, orphans re-parented away included, and their killing.

use super::*;

/// One process as `/proc/PID/stat` tells it.
#[derive(Debug, Clone, Copy)]
pub(super) struct ProcInfo {
    pub(super) ppid: i32,
    pub(super) pgrp: i32,
    /// Start time (clock ticks since boot): tells a reused pid apart.
    pub(super) start: u64,
}

pub(super) fn process_table() -> BTreeMap<i32, ProcInfo> {
    let mut table = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return table;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if let Some(info) = proc_info(pid) {
            table.insert(pid, info);
        }
    }
    table
}

/// `/proc/PID/stat` read; `None` for a process gone or a zombie.
pub(super) fn proc_info(pid: i32) -> Option<ProcInfo> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may itself hold spaces.
    let (_, rest) = stat.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    if f.first() == Some(&"Z") {
        return None;
    }
    Some(ProcInfo {
        ppid: f.get(1)?.parse().ok()?,
        pgrp: f.get(2)?.parse().ok()?,
        start: f.get(19)?.parse().ok()?,
    })
}

/// The guard's children (jobs it started and orphans it adopted), from
/// `/proc/self/task/*/children`: a few small reads, not a scan of the host.
/// A kernel without those files (`CONFIG_PROC_CHILDREN`) gets the scan.
pub(super) fn own_children() -> BTreeSet<i32> {
    let mut children = BTreeSet::new();
    let mut read_any = false;
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for task in tasks.flatten() {
            if let Ok(list) = std::fs::read_to_string(task.path().join("children")) {
                read_any = true;
                children.extend(
                    list.split_whitespace()
                        .filter_map(|p| p.parse::<i32>().ok()),
                );
            }
        }
    }
    if !read_any {
        let me = std::process::id() as i32;
        children.extend(
            process_table()
                .into_iter()
                .filter(|(_, p)| p.ppid == me)
                .map(|(pid, _)| pid),
        );
    }
    children
}

/// Processes the guard adopted as the jobs' subreaper: a job's process
/// whose parent exited. Each counts for the running jobs it may belong to:
/// the job it was noted under, else every job running when it was first
/// seen (its parent links are gone). One that counts for no running job
/// (adopted while none ran, or whose jobs all ended: `ssh -fN`, `tmux new
/// -d`) was left behind on purpose and is never killed.
#[derive(Default)]
pub(super) struct Orphans {
    /// pid → its start time and the job groups it counts for.
    pub(super) counted: BTreeMap<i32, (u64, BTreeSet<i32>)>,
    /// pid → start time: left behind, never killed.
    pub(super) released: BTreeMap<i32, u64>,
}

impl Orphans {
    /// Looks at the guard's children: notes the orphans adopted since the
    /// last look, forgets those gone. `groups`: the running jobs (whose
    /// leaders are children too); `known`: what was noted under each.
    pub(super) fn note(
        &mut self,
        groups: &BTreeSet<i32>,
        known: &BTreeMap<i32, BTreeMap<i32, u64>>,
    ) {
        let children = own_children();
        self.counted.retain(|pid, _| children.contains(pid));
        self.released.retain(|pid, _| children.contains(pid));
        for pid in children {
            if groups.contains(&pid) {
                continue;
            }
            let Some(info) = proc_info(pid) else {
                continue;
            };
            let seen = self.counted.get(&pid).map(|(start, _)| *start);
            if seen == Some(info.start) || self.released.get(&pid) == Some(&info.start) {
                continue;
            }
            let noted_under: BTreeSet<i32> = known
                .iter()
                .filter(|(_, noted)| noted.get(&pid) == Some(&info.start))
                .map(|(pgid, _)| *pgid)
                .collect();
            let counts_for = match noted_under.is_empty() {
                true => groups.clone(),
                false => noted_under,
            };
            if counts_for.is_empty() {
                self.released.insert(pid, info.start);
            } else {
                self.counted.insert(pid, (info.start, counts_for));
            }
        }
    }

    /// The job of group `pgid` ended: orphans that counted only for it
    /// were left behind by it.
    pub(super) fn forget(&mut self, pgid: i32) {
        let mut released = Vec::new();
        for (pid, (start, groups)) in &mut self.counted {
            if groups.remove(&pgid) && groups.is_empty() {
                released.push((*pid, *start));
            }
        }
        for (pid, start) in released {
            self.counted.remove(&pid);
            self.released.insert(pid, start);
        }
    }

    pub(super) fn counts_any(&self) -> bool {
        !self.counted.is_empty()
    }

    /// The orphans that die with the running jobs, with their start times.
    pub(super) fn counted(&self) -> impl Iterator<Item = (i32, u64)> + '_ {
        self.counted.iter().map(|(pid, (start, _))| (*pid, *start))
    }
}

/// Members of `groups` and every process below them, the guard excluded.
pub(super) fn tree_of(groups: &BTreeSet<i32>, table: &BTreeMap<i32, ProcInfo>) -> BTreeSet<i32> {
    let members = table
        .iter()
        .filter(|(_, p)| groups.contains(&p.pgrp))
        .map(|(pid, _)| *pid)
        .collect();
    with_descendants(members, table)
}

/// `roots` and every process below them by parent links, the guard excluded.
pub(super) fn with_descendants(
    mut tree: BTreeSet<i32>,
    table: &BTreeMap<i32, ProcInfo>,
) -> BTreeSet<i32> {
    let me = std::process::id() as i32;
    tree.remove(&me);
    loop {
        let below: Vec<i32> = table
            .iter()
            .filter(|(pid, p)| tree.contains(&p.ppid) && !tree.contains(pid) && **pid != me)
            .map(|(pid, _)| *pid)
            .collect();
        if below.is_empty() {
            return tree;
        }
        tree.extend(below);
    }
}

/// Stops every process of the job trees (so none can fork away while the
/// trees are walked), then kills them all. Returns them, with their start
/// times.
pub(super) fn kill_trees(groups: &BTreeSet<i32>, known: &BTreeMap<i32, u64>) -> BTreeMap<i32, u64> {
    let signal = |pid: i32, sig: Signal| {
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), sig);
    };
    let mut doomed: BTreeMap<i32, u64> = BTreeMap::new();
    for _ in 0..20 {
        let table = process_table();
        let mut roots = tree_of(groups, &table);
        // Noted earlier, still the same process (not a reused pid), and
        // anything those have forked since.
        roots.extend(
            known
                .iter()
                .filter(|(pid, start)| table.get(pid).is_some_and(|p| p.start == **start))
                .map(|(pid, _)| *pid),
        );
        let tree = with_descendants(roots, &table);
        let new: Vec<i32> = tree
            .into_iter()
            .filter(|pid| !doomed.contains_key(pid))
            .collect();
        if new.is_empty() {
            break;
        }
        for pid in new {
            signal(pid, Signal::SIGSTOP);
            doomed.insert(pid, table.get(&pid).map_or(0, |p| p.start));
        }
    }
    for pgid in groups {
        let _ = killpg(Pid::from_raw(*pgid), Signal::SIGKILL);
    }
    for pid in doomed.keys() {
        signal(*pid, Signal::SIGKILL);
    }
    doomed
}

#[cfg(test)]
mod tests {
    //! The process-tree walk on tables made by hand: what a run's kill
    //! reaches, and what it must never reach.
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// (pid, ppid, pgrp) → a table; start times are the pids.
    fn table(rows: &[(i32, i32, i32)]) -> BTreeMap<i32, ProcInfo> {
        rows.iter()
            .map(|&(pid, ppid, pgrp)| {
                (
                    pid,
                    ProcInfo {
                        ppid,
                        pgrp,
                        start: pid as u64,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn a_group_takes_its_members_and_everything_below_them() {
        // Run group 100: its leader 100, a member 101 and 101's child 102,
        // which moved to a group of its own (setsid), and 102's child 103;
        // an orphan 104 of the run, re-parented to init, stays in group 100.
        // 200 is another run's group, 1 is init, 300 an unrelated process.
        let t = table(&[
            (1, 0, 1),
            (100, 50, 100),
            (101, 100, 100),
            (102, 101, 102),
            (103, 102, 102),
            (104, 1, 100),
            (200, 50, 200),
            (201, 200, 200),
            (300, 1, 300),
        ]);
        let tree = tree_of(&BTreeSet::from([100]), &t);
        assert_eq!(tree, BTreeSet::from([100, 101, 102, 103, 104]));
        let both = tree_of(&BTreeSet::from([100, 200]), &t);
        assert_eq!(both, BTreeSet::from([100, 101, 102, 103, 104, 200, 201]));
        // A group with no process left reaches nothing.
        assert!(tree_of(&BTreeSet::from([999]), &t).is_empty());
    }

    #[test]
    fn the_walk_never_reaches_the_guard_or_what_is_above_the_roots() {
        let me = std::process::id() as i32;
        // The guard is the parent of the run's leader and sits in its group
        // (as it would were it asked to kill its own group by mistake).
        let t = table(&[(me, 1, 100), (100, me, 100), (101, 100, 100), (7, me, 7)]);
        let tree = tree_of(&BTreeSet::from([100]), &t);
        assert_eq!(tree, BTreeSet::from([100, 101]));
        // From the guard as a root: still not the guard, and not its other
        // children either (they are not below a root once it is removed).
        let from_me = with_descendants(BTreeSet::from([me]), &t);
        assert!(from_me.is_empty(), "{from_me:?}");
    }

    #[test]
    fn a_cycle_in_the_table_ends_the_walk() {
        // A table read while pids were reused can hold a loop.
        let t = table(&[(10, 11, 10), (11, 10, 11)]);
        assert_eq!(
            with_descendants(BTreeSet::from([10]), &t),
            BTreeSet::from([10, 11])
        );
    }
}
