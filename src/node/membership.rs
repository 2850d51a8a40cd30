//! The node's record in the store's node registry (docs/protocol.md, "Node
//! registry"): a heartbeat every 3/8 of the lease margin, at most once a
//! second ([`beat_timing`]), with the node's name, version, start, clock
//! offset and leases held, carried by the claim batches the node sends
//! anyway and sent on its own (with the look for manual runs) only when
//! none carried one for a period, or at once when asked (an instant's
//! claims decided, a lease given up: [`super::progress`]). The record
//! lives two periods and a third
//! of the margin on the store's clock, so a killed node drops out of
//! `cronlease nodes` within that time; a node shutting down deletes its
//! record. Each heartbeat answers with the
//! live nodes, kept for `cronlease_nodes_alive` and for placement: with
//! `cluster.placement = "spread"` each job's preferred node is the
//! rendezvous hash's pick among the live node names ([`preferred_node`]),
//! of the nodes that have every tag of the job's `run_on`. The beat carries
//! the node's `[node] tags`; each answer is checked for `run_on` sets no
//! live node satisfies ([`Eligibility`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::{JobName, Placement, Tags};
use crate::store::{Heartbeat, NodeRecord, RunningRun, registry::RUNNING_IN_A_BEAT};

use super::Node;
use super::cancel::CancelSlot;
use super::definitions::JobDigests;

/// The shortest heartbeat period, whatever the margin.
pub(super) const MIN_BEAT: Duration = Duration::from_secs(1);

/// How often a node with lease margin `margin` beats, and how long each
/// beat keeps its record alive: 3/8 of the margin, at least [`MIN_BEAT`]
/// (a second: what an idle node costs the store is one call a period,
/// since the look for manual runs rides in the beat) but never longer than
/// the margin (the contract's "at least every margin"; never shorter than
/// 50 ms either); and the longer of
/// the margin and two periods, plus a third of the margin (at least
/// 50 ms), so two beats may be lost or late before the record ends. Not a
/// third of the margin: batches come at whole seconds, and three periods
/// of 333 ms put a beat on its own 1 ms before each batch, which then
/// carried none.
///
/// Nothing waits for a record to end but the listing itself (`nodes`, the
/// live count, `spread`'s view): takeover goes by the locks' running marks
/// and head start, and a crashed daemon's guard deletes its record at
/// once; so the period is what the registry's readers need, a second.
pub(super) fn beat_timing(margin: Duration) -> (Duration, Duration) {
    let every = (margin * 3 / 8)
        .max(MIN_BEAT.min(margin))
        .max(Duration::from_millis(50));
    (
        every,
        margin.max(every * 2) + (margin / 3).max(Duration::from_millis(50)),
    )
}

/// A run noted going ([`Node::run_going`]); dropped when its process is
/// over.
pub(super) struct RunningNow<'a> {
    node: &'a Node,
    key: (String, u64),
    /// Thrown by a cancel request ([`super::cancel`]).
    pub(super) slot: Arc<CancelSlot>,
}

impl Drop for RunningNow<'_> {
    fn drop(&mut self) {
        if let Ok(mut running) = self.node.members.running.lock() {
            running.remove(&self.key);
        }
    }
}

impl Node {
    /// Keeps this node's record fresh until claiming stops: beats once a
    /// period has passed since the last beat that went through, whether it
    /// went on its own or in a claim batch ([`Node::beat_for_batch`]), so a
    /// node whose batches come often enough never beats on its own. The
    /// first beat goes once the store is prepared (it may create the
    /// registry); a failed one is tried again a period later. A beat asked
    /// for ([`super::progress`]) goes at once.
    pub(super) async fn keep_registered(self: Arc<Self>) {
        let (every, _) = beat_timing(self.settings.margin);
        let mut tried: Option<Instant> = None;
        loop {
            let last = self.beaten_at().max(tried);
            let next = last.map_or_else(Instant::now, |at| at + every);
            // Asked for at once: the claims of an instant at which this node
            // held many jobs are answered ([`super::progress`]).
            let asked = tokio::select! {
                () = self.life.claims.cancelled() => return,
                () = tokio::time::sleep_until(next) => false,
                () = self.progress.beat_now.notified() => true,
            };
            if !asked && self.beaten_at().is_some_and(|at| at.elapsed() < every) {
                // A claim batch carried one meanwhile.
                continue;
            }
            tried = Some(Instant::now());
            if self.ensure_prepared().await.is_err() {
                continue;
            }
            self.beat_once().await;
        }
    }

    /// One heartbeat on its own, now, reading the pending manual runs'
    /// requests in the same call for the trigger watcher.
    pub(super) async fn beat_once(&self) {
        let beat = self.heartbeat();
        let sent = Instant::now();
        if let Ok((nodes, pending)) = self
            .call(
                "heartbeat",
                self.settings.op_timeout,
                self.store.heartbeat_looking(&beat),
            )
            .await
        {
            self.beaten(nodes, sent);
            if let Some(pending) = pending {
                self.looks.deliver(sent, pending);
            }
        }
    }

    /// The heartbeat a claim batch sent now should carry: one once half a
    /// period has passed since the last beat (so the beat on its own, due a
    /// whole period after it, is not needed while batches come at least
    /// that often), and only once the store is prepared.
    pub(super) fn beat_for_batch(&self) -> Option<Heartbeat> {
        let (every, _) = beat_timing(self.settings.margin);
        let due = self.beaten_at().is_none_or(|at| at.elapsed() >= every / 2);
        (due && self.prepare.done.load(Ordering::SeqCst)).then(|| self.heartbeat())
    }

    /// A beat sent at `sent` went through and answered with `nodes`.
    pub(super) fn beaten(&self, nodes: Vec<NodeRecord>, sent: Instant) {
        self.metrics.nodes_alive.set(nodes.len() as i64);
        self.note_name_twins(&nodes);
        self.compare_definitions(&nodes);
        self.check_eligibility(&nodes);
        if let Ok(mut live) = self.members.live_nodes.lock() {
            *live = nodes;
        }
        if let Ok(mut at) = self.members.beaten_at.lock() {
            *at = (*at).max(Some(sent));
        }
    }

    /// Warns once about each other live daemon that uses this node's name
    /// (a copied config): the two split the jobs between them unevenly, and
    /// `status`, `drill` and `spread` cannot tell them apart. Counted in
    /// `cronlease_node_name_twins` for as long as both are live.
    fn note_name_twins(&self, nodes: &[NodeRecord]) {
        let twins: Vec<&NodeRecord> = nodes
            .iter()
            .filter(|n| n.node == self.name.as_str() && n.owner != self.owner.as_str())
            .collect();
        self.metrics.node_name_twins.set(twins.len() as i64);
        let Ok(mut warned) = self.members.name_twins.lock() else {
            return;
        };
        for twin in &twins {
            if warned.insert(twin.owner.clone()) {
                tracing::warn!(
                    node = %self.name,
                    other_owner = %twin.owner,
                    other_started = %twin.started_at.to_rfc3339(),
                    "another live daemon uses this node's name: two daemons with one name split the jobs unevenly and cannot be told apart; give each host its own `node`"
                );
            }
        }
        warned.retain(|owner| twins.iter().any(|t| &t.owner == owner));
    }

    /// Digests the job set now applied, off the runtime (20,000 jobs are
    /// milliseconds of hashing), for the next beats to carry.
    pub(super) fn digest_definitions(self: &Arc<Self>) {
        let generation = self.members.definitions_of.fetch_add(1, Ordering::SeqCst) + 1;
        let jobs: Vec<Arc<crate::config::Job>> = match self.jobs.lock() {
            Ok(jobs) => jobs.values().map(|e| e.state.job()).collect(),
            Err(_) => return,
        };
        let node = self.clone();
        tokio::task::spawn_blocking(move || {
            let digests = JobDigests::of(jobs.iter().map(|j| &**j));
            if node.members.definitions_of.load(Ordering::SeqCst) != generation {
                return;
            }
            if let Ok(mut comparison) = node.members.definitions.lock() {
                comparison.set_mine(digests);
            }
        });
    }

    /// Takes in what the live nodes say of their job definitions: warns
    /// once about each job another live node defines otherwise (until
    /// they agree, or again after either changes), and counts this node's
    /// jobs that differ in `cronlease_jobs_defined_otherwise`.
    fn compare_definitions(&self, nodes: &[NodeRecord]) {
        let Ok(mut comparison) = self.members.definitions.lock() else {
            return;
        };
        if !comparison.mine().is_digested() {
            return;
        }
        let new = comparison.observe(self.owner.as_str(), nodes);
        let differing = comparison.differing().len();
        drop(comparison);
        self.metrics.jobs_defined_otherwise.set(differing as i64);
        for d in new {
            tracing::warn!(
                job = %d.job,
                other_node = %d.node,
                other_owner = %d.owner,
                "job defined otherwise on another live node (schedule, zone, command or policy): until the definitions agree each node claims the instants of its own schedule and runs its own definition of the job, so it runs at the instants of both; deploy one definition to every node"
            );
        }
    }

    /// Takes in the live nodes' tags: warns once about each `run_on` no
    /// live node satisfies (naming its jobs), says when one does again, and
    /// counts those jobs in `cronlease_jobs_without_eligible_node`.
    fn check_eligibility(&self, nodes: &[NodeRecord]) {
        let Ok(mut eligibility) = self.members.eligibility.lock() else {
            return;
        };
        let (stranded, back) = eligibility.observe(nodes);
        self.metrics
            .jobs_without_eligible_node
            .set(eligibility.stranded_jobs() as i64);
        for (run_on, jobs) in stranded {
            tracing::warn!(
                run_on = %run_on,
                jobs = jobs.len(),
                first = %first_names(&jobs),
                "no live node has every tag these jobs' run_on asks for: they are not run until one does (`cronlease nodes` lists each node's tags)"
            );
        }
        for (run_on, jobs) in back {
            tracing::info!(
                run_on = %run_on,
                jobs = jobs.len(),
                first = %first_names(&jobs),
                "a live node has every tag of this run_on again: its jobs run"
            );
        }
    }

    /// What this node's beat says of its job definitions now: `None` until
    /// the job set is digested.
    fn definitions_beat(&self) -> Option<crate::store::DefinitionsBeat> {
        let comparison = self.members.definitions.lock().ok()?;
        if !comparison.mine().is_digested() {
            return None;
        }
        let (every, _) = beat_timing(self.settings.margin);
        let now_ms = self.wall.now().timestamp_millis();
        Some(comparison.mine().beat(
            now_ms,
            page_slice(every),
            comparison.peers_differ(),
            &comparison.differing(),
        ))
    }

    /// When the last beat that went through was sent.
    pub(super) fn beaten_at(&self) -> Option<Instant> {
        self.members.beaten_at.lock().ok().and_then(|at| *at)
    }

    /// What this node says of itself now.
    fn heartbeat(&self) -> Heartbeat {
        let (_, ttl) = beat_timing(self.settings.margin);
        let (jobs, held) = self.job_and_lease_counts();
        // The gauges as the beat says them (the service's tick sets them
        // too, every few seconds).
        self.metrics.jobs.set(jobs as i64);
        self.metrics.leases_held.set(held as i64);
        Heartbeat {
            owner: self.owner.clone(),
            node: self.name.to_string(),
            tags: self.tags().as_slice().to_vec(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            started_at: self.members.started_at,
            clock_offset_ms: self.clock.last_offset_ms(),
            jobs_held: u32::try_from(held).unwrap_or(u32::MAX),
            ttl,
            definitions: self.definitions_beat(),
            running: self.running_now(),
            progress: self
                .progress
                .claim_progress(self.beat.next_due_ms.load(Ordering::Relaxed)),
        }
    }

    /// The runs going on this node, the longest-running first, at most
    /// [`RUNNING_IN_A_BEAT`].
    fn running_now(&self) -> Vec<RunningRun> {
        let Ok(running) = self.members.running.lock() else {
            return Vec::new();
        };
        let mut now: Vec<RunningRun> = running
            .values()
            .map(|(run, started, _)| RunningRun {
                elapsed_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                ..run.clone()
            })
            .collect();
        now.sort_by(|a, b| (a.started_at, &a.job).cmp(&(b.started_at, &b.job)));
        now.truncate(RUNNING_IN_A_BEAT);
        now
    }

    /// Notes `run` going on this node until the answer is dropped (its
    /// process is over), for the beats: `status` shows it from the
    /// registry.
    pub(super) fn run_going(&self, run: RunningRun) -> RunningNow<'_> {
        let key = (run.job.clone(), run.fence);
        let slot = Arc::new(CancelSlot::default());
        if let Ok(mut running) = self.members.running.lock() {
            running.insert(key.clone(), (run, Instant::now(), slot.clone()));
        }
        self.members.run_started.notify_one();
        RunningNow {
            node: self,
            key,
            slot,
        }
    }

    /// Whether a run is going on this node.
    pub(super) fn has_runs_going(&self) -> bool {
        self.members
            .running
            .lock()
            .is_ok_and(|running| !running.is_empty())
    }

    /// Stops every run of `job` going here for the occurrence `said` names
    /// (`overlap = "replace"`).
    pub(super) fn replace_runs_of(&self, job: &str, said: &str) {
        let Ok(running) = self.members.running.lock() else {
            return;
        };
        for ((of, _), (_, _, slot)) in running.iter() {
            if of == job {
                slot.replace(said);
            }
        }
    }

    /// The stop switch of `job`'s run at `fence`, if it is going here.
    pub(super) fn cancel_slot(&self, job: &str, fence: u64) -> Option<Arc<CancelSlot>> {
        let running = self.members.running.lock().ok()?;
        running
            .get(&(job.to_string(), fence))
            .map(|(_, _, slot)| slot.clone())
    }

    /// The live nodes as of this node's last heartbeat.
    pub fn live_nodes(&self) -> Vec<NodeRecord> {
        self.members
            .live_nodes
            .lock()
            .map(|l| l.clone())
            .unwrap_or_default()
    }

    /// Deletes this node's record (shutdown), so it leaves the registry at
    /// once instead of when its record ends; a failure only leaves it there
    /// until then.
    pub(super) async fn leave_registry(&self) {
        if let Err(e) = self
            .call(
                "leave",
                self.settings.op_timeout,
                self.store.leave(&self.owner),
            )
            .await
        {
            tracing::debug!(
                "could not delete this node's registry record ({e}); it ends by itself"
            );
        }
    }
}

/// How long each page of per-job digests is what the beats carry
/// ([`definitions::page_at`]): four beat periods, at least a second, so a
/// reader beating at that period sees every page.
fn page_slice(every: Duration) -> Duration {
    (every * 4).max(Duration::from_secs(1))
}

/// The first few of `jobs`, for a log line.
pub(super) fn first_names(jobs: &[JobName]) -> String {
    let mut names: Vec<&str> = jobs.iter().take(5).map(JobName::as_str).collect();
    if jobs.len() > names.len() {
        names.push("...");
    }
    names.join(", ")
}

/// A `run_on` set and the jobs that ask for it.
pub(super) type TaggedJobs = (Tags, Vec<JobName>);

/// The jobs' `run_on` sets against the live nodes' tags: which sets no
/// live node satisfies. Kept by distinct set, so a beat's check costs the
/// number of sets times the live nodes, not the number of jobs.
#[derive(Debug, Default)]
pub(super) struct Eligibility {
    /// Each distinct non-empty `run_on` of the job set, with its jobs.
    jobs: BTreeMap<Tags, Vec<JobName>>,
    /// The sets no live node satisfied at the last look (warned about).
    stranded: BTreeSet<Tags>,
}

impl Eligibility {
    /// A job set applied: its `run_on` sets. Every stranded set is warned
    /// about again at the next look, so jobs the new set added to one are
    /// named.
    pub(super) fn set_jobs(&mut self, jobs: BTreeMap<Tags, Vec<JobName>>) {
        self.stranded.clear();
        self.jobs = jobs;
    }

    /// Compares the sets with `nodes`' tags: answers the sets newly
    /// stranded (no live node satisfies them) and those no longer, each
    /// with its jobs.
    pub(super) fn observe(&mut self, nodes: &[NodeRecord]) -> (Vec<TaggedJobs>, Vec<TaggedJobs>) {
        let (mut stranded, mut back) = (Vec::new(), Vec::new());
        for (run_on, jobs) in &self.jobs {
            let able = nodes.iter().any(|n| run_on.allow(&n.tags));
            if !able && self.stranded.insert(run_on.clone()) {
                stranded.push((run_on.clone(), jobs.clone()));
            } else if able && self.stranded.remove(run_on) {
                back.push((run_on.clone(), jobs.clone()));
            }
        }
        (stranded, back)
    }

    /// How many jobs no live node may run, as of the last look.
    pub(super) fn stranded_jobs(&self) -> usize {
        self.stranded
            .iter()
            .filter_map(|t| self.jobs.get(t))
            .map(Vec::len)
            .sum()
    }
}

/// A 64-bit score of (job, node), the same on every host and version:
/// FNV-1a over both names (a zero byte between), then the SplitMix64
/// finalizer, so names that differ in one character score far apart.
pub(super) fn rendezvous_score(job: &str, node: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in job.bytes().chain([0]).chain(node.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The preferred node of `job` among `nodes` (names, in any order, a name
/// listed twice counting once): the highest score, ties to the smaller
/// name. Adding or removing a node moves only the jobs it wins or won.
pub(super) fn preferred_node<'a, S: AsRef<str>>(job: &str, nodes: &'a [S]) -> Option<&'a S> {
    nodes.iter().max_by(|a, b| {
        let (a, b) = (a.as_ref(), b.as_ref());
        rendezvous_score(job, a)
            .cmp(&rendezvous_score(job, b))
            .then_with(|| b.cmp(a))
    })
}

/// A live node as placement sees it: its name, and its owner to tell the
/// holder a claim's answer names.
#[derive(Debug, Clone)]
pub(super) struct Member {
    pub(super) node: String,
    pub(super) owner: String,
    /// Its tags, as its last beat said.
    pub(super) tags: Vec<String>,
}

impl AsRef<str> for Member {
    fn as_ref(&self) -> &str {
        &self.node
    }
}

/// When a due claim is sent, with `spread`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Deferral {
    /// This node is the job's preferred node (or nothing is known): at once.
    AtOnce,
    /// Another node is preferred and held the job when this node last
    /// looked: sent like a `sticky` follower's claim, so the store's head
    /// start for an idle holder decides, and a dead preferred node's job is
    /// taken over exactly as fast as in `sticky`.
    BehindHolder,
    /// Another node is preferred and does not hold the job: sent after the
    /// head start and `DEFERRED_LAG`, so the preferred node, refused by an
    /// idle holder until its head start is over, wins its job back first.
    BehindHeadStart,
}

impl Node {
    /// With `spread`, the live nodes jobs are placed among, as of the last
    /// heartbeat: read once per instant, not once per job. `None` with
    /// `sticky`, and while this node is not in the registry yet (nothing
    /// known: claim as with `sticky`).
    pub(super) fn placement_view(&self) -> Option<Vec<Member>> {
        if self.settings.placement != Placement::Spread {
            return None;
        }
        let live = self.members.live_nodes.lock().ok()?;
        let members: Vec<Member> = live
            .iter()
            .map(|n| Member {
                node: n.node.clone(),
                owner: n.owner.clone(),
                tags: n.tags.clone(),
            })
            .collect();
        members
            .iter()
            .any(|m| m.node == self.name.as_str())
            .then_some(members)
    }

    /// How this node claims `job`, last seen held by `holder` (an owner),
    /// in `view` (see [`Node::placement_view`]): the job's preferred node is
    /// picked among the members that have every tag of its `run_on`.
    pub(super) fn deferral_in(
        &self,
        job: &crate::config::Job,
        holder: Option<&str>,
        view: Option<&[Member]>,
    ) -> Deferral {
        let preferred = view.and_then(|members| {
            if job.run_on.is_empty() {
                preferred_node(job.name.as_str(), members).cloned()
            } else {
                let able: Vec<&Member> = members
                    .iter()
                    .filter(|m| job.run_on.allow(&m.tags))
                    .collect();
                preferred_node(job.name.as_str(), &able).map(|m| (*m).clone())
            }
        });
        match preferred {
            Some(p) if p.node == self.name.as_str() => Deferral::AtOnce,
            Some(p) if holder == Some(p.owner.as_str()) => Deferral::BehindHolder,
            Some(_) => Deferral::BehindHeadStart,
            None => Deferral::AtOnce,
        }
    }

    /// Whether this node should give `job` to a peer: the current view
    /// names another node as its preferred one.
    pub(super) fn defers(&self, job: &crate::config::Job) -> bool {
        let view = self.placement_view();
        self.deferral_in(job, None, view.as_deref()) != Deferral::AtOnce
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_spreads_evenly_and_moves_only_a_leavers_jobs() {
        let jobs: Vec<String> = (0..300).map(|i| format!("j{i:04}")).collect();
        let three = ["n1", "n2", "n3"];
        let pick = |nodes: &[&str]| -> Vec<String> {
            jobs.iter()
                .map(|j| preferred_node(j, nodes).map_or("", |n| *n).to_string())
                .collect()
        };
        let before = pick(&three);
        for n in three {
            let share = before.iter().filter(|p| **p == n).count();
            assert!((85..=115).contains(&share), "{n}: {share} of 300");
        }
        // n2 leaves: only its jobs move, and they split over the others.
        let after = pick(&["n1", "n3"]);
        for (b, a) in before.iter().zip(&after) {
            if *b != "n2" {
                assert_eq!(b, a);
            }
        }
        // The order of the list does not matter.
        assert_eq!(pick(&["n3", "n1", "n2"]), before);
        assert_eq!(preferred_node::<&str>("j", &[]), None);
    }

    #[test]
    fn a_record_outlives_two_lost_beats_and_an_idle_node_beats_once_a_second_at_most() {
        for margin_ms in [150u64, 300, 1_000, 5_000, 60_000] {
            let margin = Duration::from_millis(margin_ms);
            let (every, ttl) = beat_timing(margin);
            assert!(
                every >= MIN_BEAT.min(margin),
                "{margin:?}: beats every {every:?}"
            );
            assert!(every <= margin, "{margin:?}: beats every {every:?}");
            assert!(
                ttl >= every * 2 + Duration::from_millis(50),
                "{margin:?}: {ttl:?} vs {every:?}"
            );
            assert!(
                ttl <= (margin * 2).max(every * 2 + margin),
                "{margin:?}: lives {ttl:?}"
            );
        }
        let ms = |d: Duration| d.as_millis();
        let (every, ttl) = beat_timing(Duration::from_secs(1));
        assert_eq!((ms(every), ms(ttl)), (1_000, 2_333));
        let (every, ttl) = beat_timing(Duration::from_secs(5));
        assert_eq!((ms(every), ms(ttl)), (1_875, 6_666));
    }
}
