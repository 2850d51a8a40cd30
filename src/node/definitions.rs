//! One job name, two definitions: each node tells the registry a digest of
//! its job set, and the two sides of a difference find the jobs that differ
//! (docs/protocol.md, "Job definitions across nodes").
//!
//! - Each job's definition (what changes when it runs: schedule, zone,
//!   jitter, command, timeout, kill grace, misfire, overlap, `run_on`,
//!   starting deadline, delivery, env, working directory, user, output tail, hooks, retry)
//!   has a 64-bit digest, SHA-256 over a tagged encoding of those fields:
//!   the same on every host and version that writes the same encoding
//!   ([`ENCODING`]).
//! - Every beat carries the digest of the whole set (so agreeing nodes
//!   exchange 16 hex digits), and, while a live peer's set digest differs
//!   from this node's, one page of its per-job digests ([`PAGE_JOBS`] jobs,
//!   chosen by the time so every reader sees each page: [`page_at`]).
//! - A node collects a differing peer's pages until it has them all, then
//!   compares job by job (by the hash of the name) and names the jobs whose
//!   definitions differ. Both sides publish pages, so both name them.
//!
//! The pure part lives here (tested without a store); `membership` feeds
//! it each beat's answer.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::config::{Command, Hook, Job, JobName, hex};
use crate::store::{DefinitionsBeat, NodeRecord};

/// The version of the digest's encoding: a node writing another one says
/// so, and its sets are not compared job by job (they would all differ).
pub const ENCODING: u32 = 1;

/// Jobs per page of per-job digests (32 hex digits each: 4 KiB a page).
pub const PAGE_JOBS: usize = 128;

/// Job names a beat lists as differing, at most; `differ_count` has them all.
pub const DIFFER_LISTED: usize = 32;

/// One job's digest: the hash of its name and of its definition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobDigest {
    pub name: u64,
    pub definition: u64,
}

/// The digest of `job`'s definition (see the module's list of fields).
pub fn job_digest(job: &Job) -> JobDigest {
    let mut h = Sha256::new();
    let mut put = |tag: &str, value: &[u8]| {
        h.update(tag.as_bytes());
        h.update((value.len() as u64).to_le_bytes());
        h.update(value);
    };
    put("encoding", &ENCODING.to_le_bytes());
    // Fields as written, blanks folded: `0  * * * *` is `0 * * * *`.
    let expr: Vec<&str> = job.schedule.expr().split_whitespace().collect();
    put("schedule", expr.join(" ").to_ascii_lowercase().as_bytes());
    put("zone", job.schedule.zone().name().as_bytes());
    // Only when set: the digests of jobs without it are as before.
    put_duration(&mut put, "jitter", job.schedule.jitter());
    put_command(&mut put, "command", Some(&job.command));
    put_duration(&mut put, "timeout", job.timeout);
    put_duration(&mut put, "kill_grace", Some(job.kill_grace));
    put("misfire", format!("{:?}", job.misfire).as_bytes());
    put("overlap", format!("{:?}", job.overlap).as_bytes());
    // Only when set, like jitter; sorted, so the order written is no
    // difference.
    for tag in job.run_on.as_slice() {
        put("run_on", tag.as_bytes());
    }
    if job.every_node {
        // Only when set, as above.
        put("placement", b"every_node");
    }
    put_duration(&mut put, "starting_deadline", job.starting_deadline);
    if job.delivery == crate::config::Delivery::AtLeastOnce {
        // Only when set: the digests of jobs without it are as before.
        put("delivery", b"at_least_once");
    }
    for (name, value) in &job.env {
        put("env", name.as_bytes());
        put("=", value.as_bytes());
    }
    if let Some(dir) = &job.working_dir {
        put("working_dir", dir.as_os_str().as_encoded_bytes());
    }
    if let Some(id) = &job.identity {
        // A user by name: its uid may differ from host to host.
        match &id.user {
            Some((user, _)) => put("user", user.as_bytes()),
            None => put("uid", &id.uid.to_le_bytes()),
        }
        put("gid", &id.gid.to_le_bytes());
    }
    put("output_tail", &(job.output_tail as u64).to_le_bytes());
    for hook in [Hook::Failure, Hook::Success, Hook::Recovery] {
        put_command(&mut put, hook.key(), job.hook(hook));
    }
    if let Some(r) = &job.retry {
        put("retry.attempts", &r.attempts.to_le_bytes());
        put_duration(&mut put, "retry.backoff", Some(r.backoff));
        put_duration(&mut put, "retry.max_backoff", Some(r.max_backoff));
        for o in &r.on {
            put("retry.on", o.as_str().as_bytes());
        }
    }
    let sum = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&sum[..8]);
    JobDigest {
        name: name_hash(job.name.as_str()),
        definition: u64::from_be_bytes(first),
    }
}

fn put_command(put: &mut impl FnMut(&str, &[u8]), tag: &str, command: Option<&Command>) {
    match command {
        None => {}
        Some(Command::Shell(line)) => put(tag, line.as_bytes()),
        Some(Command::Argv(argv)) => {
            put(tag, &(argv.len() as u64).to_le_bytes());
            for arg in argv {
                put("arg", arg.as_bytes());
            }
        }
    }
}

fn put_duration(put: &mut impl FnMut(&str, &[u8]), tag: &str, d: Option<Duration>) {
    if let Some(d) = d {
        put(tag, &(d.as_millis() as u64).to_le_bytes());
    }
}

/// FNV-1a over the name: a job's key in the pages (not secret).
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A node's job set as digests: sorted by name hash, with the digest of the
/// whole set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobDigests {
    /// `(digest, name)` sorted by the name's hash.
    jobs: Vec<(JobDigest, JobName)>,
    /// SHA-256 of every `(name hash, definition)` in that order, 16 hex digits.
    all: String,
}

impl JobDigests {
    /// The digests of `jobs` (in any order).
    pub fn of<'a>(jobs: impl IntoIterator<Item = &'a Job>) -> Self {
        let mut digests: Vec<(JobDigest, JobName)> = jobs
            .into_iter()
            .map(|j| (job_digest(j), j.name.clone()))
            .collect();
        digests.sort_by_key(|(d, _)| (d.name, d.definition));
        let mut h = Sha256::new();
        h.update(ENCODING.to_le_bytes());
        for (d, _) in &digests {
            h.update(d.name.to_le_bytes());
            h.update(d.definition.to_le_bytes());
        }
        let all = hex(&h.finalize()[..8]);
        JobDigests { jobs: digests, all }
    }

    /// The whole set's digest.
    pub fn all(&self) -> &str {
        &self.all
    }

    /// Whether a job set was digested (`default()` is none).
    pub fn is_digested(&self) -> bool {
        !self.all.is_empty()
    }

    fn pages(&self) -> usize {
        self.jobs.len().div_ceil(PAGE_JOBS).max(1)
    }

    /// What a beat sent at `now_ms` says: the set's digest, the jobs this
    /// node found differing, and, when `with_page` (a live peer's set
    /// differs), the page of per-job digests due at `now_ms` every `slice`.
    pub fn beat(
        &self,
        now_ms: i64,
        slice: Duration,
        with_page: bool,
        differ: &BTreeMap<JobName, BTreeSet<String>>,
    ) -> DefinitionsBeat {
        let pages = self.pages();
        let page = page_at(now_ms, slice, pages);
        let entries = if with_page {
            let mut s = String::with_capacity(PAGE_JOBS * 32);
            for (d, _) in self.jobs.iter().skip(page * PAGE_JOBS).take(PAGE_JOBS) {
                let _ = write!(s, "{:016x}{:016x}", d.name, d.definition);
            }
            Some(s)
        } else {
            None
        };
        DefinitionsBeat {
            encoding: ENCODING,
            digest: self.all.clone(),
            jobs: u32::try_from(self.jobs.len()).unwrap_or(u32::MAX),
            page: u32::try_from(page).unwrap_or(u32::MAX),
            pages: u32::try_from(pages).unwrap_or(u32::MAX),
            entries,
            differ: differ
                .keys()
                .take(DIFFER_LISTED)
                .map(|j| j.to_string())
                .collect(),
            differ_count: u32::try_from(differ.len()).unwrap_or(u32::MAX),
        }
    }
}

/// The page a beat at `now_ms` carries: pages turn every `slice`, which is
/// longer than any reader's beat period, so each reader sees every page.
pub fn page_at(now_ms: i64, slice: Duration, pages: usize) -> usize {
    let slice = i64::try_from(slice.as_millis()).unwrap_or(i64::MAX).max(1);
    let turn = u64::try_from(now_ms.max(0) / slice).unwrap_or(0);
    (turn % pages.max(1) as u64) as usize
}

/// What is known of one peer's set: its digest, and the pages seen so far.
#[derive(Debug, Clone)]
struct PeerSet {
    node: String,
    digest: String,
    pages: Vec<Option<String>>,
}

/// A difference found, to be warned about once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub job: JobName,
    pub node: String,
    pub owner: String,
}

/// This node's view of the other live nodes' definitions.
#[derive(Debug, Default)]
pub struct Comparison {
    mine: JobDigests,
    peers: HashMap<String, PeerSet>,
    /// Per owner whose set differs, the jobs found differing (complete only
    /// once every page was seen).
    found: HashMap<String, BTreeSet<JobName>>,
    /// `(job, owner)` pairs warned about, with the two set digests then: a
    /// change of either warns again.
    warned: HashMap<(JobName, String), (String, String)>,
}

impl Comparison {
    /// This node's set changed (start, reload).
    pub fn set_mine(&mut self, mine: JobDigests) {
        if mine != self.mine {
            self.mine = mine;
            self.found.clear();
        }
    }

    pub fn mine(&self) -> &JobDigests {
        &self.mine
    }

    /// Whether some live peer's set differs from this node's (so this node's
    /// beats carry pages).
    pub fn peers_differ(&self) -> bool {
        self.peers.values().any(|p| p.digest != self.mine.all)
    }

    /// This node's jobs whose definition differs on a live peer, with the
    /// peers' node names.
    pub fn differing(&self) -> BTreeMap<JobName, BTreeSet<String>> {
        let mut out: BTreeMap<JobName, BTreeSet<String>> = BTreeMap::new();
        for (owner, jobs) in &self.found {
            let Some(peer) = self.peers.get(owner) else {
                continue;
            };
            for job in jobs {
                out.entry(job.clone())
                    .or_default()
                    .insert(peer.node.clone());
            }
        }
        out
    }

    /// Takes in a beat's answer (`own`: this node's owner), and answers the
    /// differences not warned about yet.
    pub fn observe(&mut self, own: &str, nodes: &[NodeRecord]) -> Vec<Difference> {
        self.peers
            .retain(|owner, _| nodes.iter().any(|n| &n.owner == owner));
        self.found.retain(|owner, _| self.peers.contains_key(owner));
        for n in nodes.iter().filter(|n| n.owner != own) {
            let Some(beat) = &n.definitions else {
                // An older version: it says nothing of its jobs.
                self.peers.remove(&n.owner);
                self.found.remove(&n.owner);
                continue;
            };
            if beat.encoding != ENCODING {
                self.peers.remove(&n.owner);
                self.found.remove(&n.owner);
                continue;
            }
            let pages = (beat.pages as usize).clamp(1, 1 << 16);
            let peer = self
                .peers
                .entry(n.owner.clone())
                .or_insert_with(|| PeerSet {
                    node: n.node.clone(),
                    digest: beat.digest.clone(),
                    pages: vec![None; pages],
                });
            if peer.digest != beat.digest || peer.pages.len() != pages {
                *peer = PeerSet {
                    node: n.node.clone(),
                    digest: beat.digest.clone(),
                    pages: vec![None; pages],
                };
                self.found.remove(&n.owner);
            }
            if beat.digest == self.mine.all {
                self.found.remove(&n.owner);
                continue;
            }
            if let (Some(entries), Some(slot)) =
                (&beat.entries, peer.pages.get_mut(beat.page as usize))
            {
                *slot = Some(entries.clone());
            }
            if peer.pages.iter().all(Option::is_some) && !self.found.contains_key(&n.owner) {
                let theirs = parse_pages(&peer.pages);
                let differ: BTreeSet<JobName> = self
                    .mine
                    .jobs
                    .iter()
                    .filter(|(d, _)| theirs.get(&d.name).is_some_and(|t| *t != d.definition))
                    .map(|(_, name)| name.clone())
                    .collect();
                self.found.insert(n.owner.clone(), differ);
            }
        }
        let mut new = Vec::new();
        let mut still = HashMap::new();
        for (owner, jobs) in &self.found {
            let Some(peer) = self.peers.get(owner) else {
                continue;
            };
            for job in jobs {
                let key = (job.clone(), owner.clone());
                let now = (self.mine.all.clone(), peer.digest.clone());
                if self.warned.get(&key) != Some(&now) {
                    new.push(Difference {
                        job: job.clone(),
                        node: peer.node.clone(),
                        owner: owner.clone(),
                    });
                }
                still.insert(key, now);
            }
        }
        // Forgotten once they agree (or the peer is gone): a new difference
        // later warns again.
        self.warned = still;
        new
    }
}

/// The per-job digests of a peer's pages, by name hash (an entry that is not
/// 32 hex digits is passed over).
fn parse_pages(pages: &[Option<String>]) -> HashMap<u64, u64> {
    let number = |hex: &[u8]| {
        std::str::from_utf8(hex)
            .ok()
            .and_then(|s| u64::from_str_radix(s, 16).ok())
    };
    let mut out = HashMap::new();
    for page in pages.iter().flatten() {
        for entry in page.as_bytes().chunks_exact(32) {
            if let (Some(name), Some(def)) = (number(&entry[..16]), number(&entry[16..])) {
                out.insert(name, def);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str, schedule: &str, command: &str) -> Job {
        crate::config::test_job(name, schedule, command)
    }

    fn record(owner: &str, node: &str, beat: DefinitionsBeat) -> NodeRecord {
        let mut r = NodeRecord::test_record(owner, node);
        r.definitions = Some(beat);
        r
    }

    /// Runs `a` and `b` against each other, each beating at `every` for
    /// `beats` beats, and answers what each found.
    fn exchange(
        a: &mut Comparison,
        b: &mut Comparison,
        every: Duration,
        beats: usize,
    ) -> (Vec<Difference>, Vec<Difference>) {
        let slice = every * 4;
        let (mut warned_a, mut warned_b) = (Vec::new(), Vec::new());
        for i in 0..beats {
            let now = 1_000_000 + (i as u128 * every.as_millis()) as i64;
            let beat_a = a.mine().beat(now, slice, a.peers_differ(), &a.differing());
            let beat_b = b.mine().beat(now, slice, b.peers_differ(), &b.differing());
            let nodes = vec![record("a#1", "a", beat_a), record("b#1", "b", beat_b)];
            warned_a.extend(a.observe("a#1", &nodes));
            warned_b.extend(b.observe("b#1", &nodes));
        }
        (warned_a, warned_b)
    }

    #[test]
    fn a_definition_is_what_changes_when_it_runs_not_where_it_is_written() {
        let x = job("x", "*/4 * * * * *", "true");
        let mut moved = x.clone();
        moved.defined_at = "other.toml:9".into();
        assert_eq!(job_digest(&x), job_digest(&moved));
        let spaced = job("x", "*/4  *  * * * *", "true");
        assert_eq!(job_digest(&x), job_digest(&spaced));
        for other in [
            job("x", "*/6 * * * * *", "true"),
            job("x", "*/4 * * * * *", "false"),
        ] {
            assert_eq!(job_digest(&x).name, job_digest(&other).name);
            assert_ne!(job_digest(&x).definition, job_digest(&other).definition);
        }
        let mut env = x.clone();
        env.env.insert("A".into(), "1".into());
        assert_ne!(job_digest(&x), job_digest(&env));
        let mut timeout = x.clone();
        timeout.timeout = Some(Duration::from_secs(3));
        assert_ne!(job_digest(&x), job_digest(&timeout));
        // Jitter moves the instants: two hosts must agree on it.
        let mut jittered = x.clone();
        jittered.schedule = jittered.schedule.with_jitter("x", Duration::from_secs(3));
        assert_ne!(job_digest(&x), job_digest(&jittered));
        let mut none = x.clone();
        none.schedule = none.schedule.with_jitter("x", Duration::ZERO);
        assert_eq!(job_digest(&x), job_digest(&none));
        // run_on decides who claims: two hosts must agree on it too.
        let mut tagged = x.clone();
        tagged.run_on = crate::config::Tags::from_checked(["db"]);
        assert_ne!(job_digest(&x), job_digest(&tagged));
    }

    #[test]
    fn agreeing_sets_exchange_no_pages_and_find_nothing() {
        let jobs = [job("x", "* * * * *", "true"), job("y", "@daily", "true")];
        let mut a = Comparison::default();
        let mut b = Comparison::default();
        a.set_mine(JobDigests::of(&jobs));
        b.set_mine(JobDigests::of(jobs.iter().rev()));
        let (wa, wb) = exchange(&mut a, &mut b, Duration::from_millis(375), 5);
        assert!(wa.is_empty() && wb.is_empty());
        assert!(!a.peers_differ());
        let beat = a
            .mine()
            .beat(0, Duration::from_secs(2), a.peers_differ(), &a.differing());
        assert!(beat.entries.is_none(), "agreeing nodes send no pages");
        assert!(a.differing().is_empty());
    }

    #[test]
    fn both_sides_name_the_one_differing_job_once_and_forget_it_when_they_agree() {
        let same = job("same", "@hourly", "true");
        let mut a = Comparison::default();
        let mut b = Comparison::default();
        a.set_mine(JobDigests::of(&[
            same.clone(),
            job("x", "*/4 * * * * *", "true"),
        ]));
        b.set_mine(JobDigests::of(&[
            same.clone(),
            job("x", "*/6 * * * * *", "true"),
        ]));
        let (wa, wb) = exchange(&mut a, &mut b, Duration::from_millis(375), 6);
        let names = |w: &[Difference]| -> Vec<(String, String)> {
            w.iter()
                .map(|d| (d.job.to_string(), d.node.clone()))
                .collect()
        };
        assert_eq!(names(&wa), vec![("x".to_string(), "b".to_string())]);
        assert_eq!(names(&wb), vec![("x".to_string(), "a".to_string())]);
        assert_eq!(a.differing().len(), 1);
        let beat = a
            .mine()
            .beat(0, Duration::from_secs(2), true, &a.differing());
        assert_eq!((beat.differ, beat.differ_count), (vec!["x".to_string()], 1));
        // b is reloaded with a's definition: the difference ends.
        b.set_mine(JobDigests::of(&[
            same.clone(),
            job("x", "*/4 * * * * *", "true"),
        ]));
        let (wa, wb) = exchange(&mut a, &mut b, Duration::from_millis(375), 3);
        assert!(wa.is_empty() && wb.is_empty());
        assert!(a.differing().is_empty() && b.differing().is_empty());
        // And a new difference warns again.
        b.set_mine(JobDigests::of(&[same, job("x", "*/5 * * * * *", "true")]));
        let (wa, _) = exchange(&mut a, &mut b, Duration::from_millis(375), 4);
        assert_eq!(names(&wa), vec![("x".to_string(), "b".to_string())]);
    }

    #[test]
    fn a_large_set_is_compared_over_its_pages() {
        let many: Vec<Job> = (0..1000)
            .map(|i| job(&format!("job-{i}"), "@yearly", "true"))
            .collect();
        let mut changed = many.clone();
        changed[700] = job("job-700", "@monthly", "true");
        changed[3] = job("job-3", "@yearly", "false");
        let mut a = Comparison::default();
        let mut b = Comparison::default();
        a.set_mine(JobDigests::of(&many));
        b.set_mine(JobDigests::of(&changed));
        let pages = 1000usize.div_ceil(PAGE_JOBS);
        // Too few beats to see every page: nothing is named yet.
        let (wa, _) = exchange(&mut a, &mut b, Duration::from_millis(375), 4 * (pages - 2));
        assert!(wa.is_empty(), "{wa:?}");
        let (wa, wb) = exchange(&mut a, &mut b, Duration::from_millis(375), 4 * pages + 8);
        let mut jobs: Vec<String> = wa.iter().map(|d| d.job.to_string()).collect();
        jobs.sort();
        assert_eq!(jobs, ["job-3", "job-700"]);
        assert_eq!(wb.len(), 2);
        let beat = a
            .mine()
            .beat(0, Duration::from_secs(2), true, &a.differing());
        assert!(beat.entries.is_some_and(|e| e.len() == PAGE_JOBS * 32));
    }

    #[test]
    fn every_page_turns_up_for_a_reader_beating_more_often_than_a_slice() {
        let slice = Duration::from_millis(1500);
        for pages in [1, 2, 7, 157] {
            let mut seen = vec![false; pages];
            // A reader at 375 ms, starting at an odd phase.
            let mut t = 123_457;
            while t < 123_457 + (pages as i64 + 1) * 1500 {
                seen[page_at(t, slice, pages)] = true;
                t += 375;
            }
            assert!(seen.iter().all(|s| *s), "{pages} pages");
        }
    }

    #[test]
    fn a_peer_of_another_encoding_or_version_is_not_compared() {
        let mut a = Comparison::default();
        a.set_mine(JobDigests::of(&[job("x", "* * * * *", "true")]));
        let other = JobDigests::of(&[job("x", "* * * * *", "false")]);
        let mut beat = other.beat(0, Duration::from_secs(2), true, &BTreeMap::new());
        beat.encoding = ENCODING + 1;
        let mut old = NodeRecord::test_record("c#1", "c");
        old.definitions = None;
        let nodes = vec![record("b#1", "b", beat), old];
        assert!(a.observe("a#1", &nodes).is_empty());
        assert!(!a.peers_differ());
    }
}
