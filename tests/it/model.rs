//! The claim protocol, model-checked with stateright: a plain `Model` with
//! explicit real time (stateright's actor timers ignore durations), nodes
//! whose wall clocks are off and whose monotonic clocks run slow, requests
//! and replies that are delayed, reordered, lost and retried, nodes that
//! freeze (SIGSTOP, GC), are cut off from the store, or crash, and a ghost
//! record of every run. The store decides with the library's own batch
//! step ([`claim_rows`], the memory store's, around the shared rule
//! `decide`), and the node's watchdog counts with the library's own
//! [`lease`] arithmetic, so design and code are checked together; the
//! node's reactions (claim at the instant, wait out a lease, retry after a
//! lost reply, renew, stop at the local deadline, check before start) are
//! written here after `src/node`, in the form docs/protocol.md gives them.
//!
//! Properties: at most one run per occurrence; never two nodes running the
//! job at the same real time; fences strictly increase; every occurrence
//! runs unless a documented rule excuses it (its winner crashed, froze or
//! never heard of its win between claim and start, or its holder was still
//! running the one before). Each rule is shown load-bearing: with it off
//! (a [`Rules`] flag) the checker finds the counterexample. Time moves from
//! event to event (the next instant, deadline, renewal, expiry, process
//! exit, thaw), so boundaries are hit exactly, to the millisecond. Faults
//! strike at any event; a freeze also right at the next one, before its
//! node acts: a daemon stopped just before its watchdog's deadline, the
//! worst moment, which is how the checker finds the edge of the margin
//! condition (docs/protocol.md, "The margin condition").
//!
//! A state keeps only what the future and the properties depend on, in one
//! canonical form ([`Protocol::canonical`]): the live runs, and of the
//! ended ones the occurrences they ran and the properties they broke;
//! request ids renumbered, the wire sorted, the nodes in order. Paths that
//! differ only in their past meet in one state: the reachable states are
//! those of a model that kept the whole history, merged (checked state by
//! state on eleven configurations, before the freeze at the next event was
//! added; without faults on skewed clocks, 2,257,580 states there, 407,393
//! here). A check that something holds explores every
//! state up to the horizon; a check that something breaks stops at its
//! first counterexample.
//!
//! `cargo test --all-features --test it -- model::` runs the bounded checks
//! (about 40 s on 2 cores); `-- --ignored model::` the longer ones (about 4
//! minutes, 3 GB). docs/protocol.md lists each check's states and time.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use cronlease::config::{JobName, Misfire};
use cronlease::node::lease;
use cronlease::store::{ClaimOutcome, ClaimRequest, LockRow, Owner, claim_rows, from_ms};
use stateright::{Checker, HasDiscoveries, Model, Property};

/// The rules of the protocol a check may switch off, to show each one is
/// needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rules {
    /// The store decides and writes a claim in one atomic step.
    pub atomic_claim: bool,
    /// A claim sets the running mark, so an idle holder's head start does
    /// not apply to a busy one.
    pub running_mark: bool,
    /// The watchdog stops a run at the local deadline without a renewal.
    pub local_deadline: bool,
    /// A node starts a run only while its local deadline is ahead.
    pub check_before_start: bool,
    /// Deadlines leave 0.1 % of the lease for a slow monotonic clock.
    pub rate_allowance: bool,
    /// A claim retried after a lost reply gets its own win back.
    pub retry_finds_its_win: bool,
}

impl Rules {
    pub const ALL: Rules = Rules {
        atomic_claim: true,
        running_mark: true,
        local_deadline: true,
        check_before_start: true,
        rate_allowance: true,
        retry_finds_its_win: true,
    };
}

/// What may go wrong, and how much of it, in one run of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    /// A request or a reply is lost.
    Lose,
    /// A node freezes for `ms` (SIGSTOP, GC): it does nothing (its watchdog
    /// neither stops nor kills), its job's process runs on.
    Freeze(i64),
    /// A node is cut off from the store for `ms`: what it sends and what it
    /// is sent is lost.
    CutOff(i64),
    /// A node's host dies (its job with it).
    Crash,
}

/// The checked system: one job every `period` ms, claimed by `nodes`
/// daemons on one store.
#[derive(Clone, Debug)]
pub struct Protocol {
    pub nodes: usize,
    /// Instants at `period`, 2 × `period`, …, `occurrences` × `period`.
    pub occurrences: i64,
    pub period: i64,
    pub margin: i64,
    pub head_start: i64,
    /// `cluster.max_clock_offset`.
    pub max_offset: i64,
    /// Node 0's wall clock is right; node 1's is off by one of these (ms,
    /// node − real).
    pub offsets: Vec<i64>,
    /// A node's monotonic clock may run this much slower than real time
    /// (parts per million): both cases are checked per node, or, with
    /// `all_slow`, every clock runs slow.
    pub slow_ppm: i64,
    pub all_slow: bool,
    /// A run takes one of these (ms), chosen when it starts.
    pub durations: Vec<i64>,
    /// A run ends this long after SIGTERM (a job that ignores it is killed
    /// at the lease's expiry, as its node counts it).
    pub stop_grace: i64,
    pub op_timeout: i64,
    /// The faults that may happen, each at most once, at any event (a
    /// freeze also right at the next event, before its node acts).
    pub faults: Vec<Fault>,
    /// How many of them one run may see.
    pub fault_budget: u8,
    pub rules: Rules,
}

/// The store's lock row.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Row {
    owner: Option<usize>,
    fence: i64,
    expires_at: i64,
    last: Option<i64>,
    running: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    Claim { occ: i64, after_unanswered: bool },
    Renew,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Answer {
    Won {
        fence: i64,
        occ: i64,
    },
    /// Refused: `retry_in` when a holder's lease (or head start) may end
    /// within the occurrence's window; `claimed` when the occurrence is
    /// taken.
    Lost {
        retry_in: Option<i64>,
        claimed: bool,
        fence: i64,
    },
    Renewed(bool),
}

/// A message on the wire: to the store (`answer` none) or back.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Wire {
    node: usize,
    id: u8,
    msg: Msg,
    answer: Option<Answer>,
    /// It arrives by then (or is lost): its request's send time plus the
    /// node's `op_timeout`. An answer may still come after the node gave
    /// up on it, at that very moment; a frozen node reads it when it thaws.
    due: i64,
}

/// Non-atomic stores only: a claim decided, not yet written.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Unwritten {
    node: usize,
    id: u8,
    row: Row,
    answer: Answer,
    due: i64,
}

/// A node's run as it happens, in real time (the ghost), with the
/// watchdog's lease clock.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Run {
    fence: i64,
    start: i64,
    /// When it exits or exited (its own end, or stopped, or killed).
    end: i64,
    /// Send time of the last successful claim or renewal.
    ok_sent: i64,
    /// SIGTERM went.
    termed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeState {
    up: bool,
    offset: i64,
    slow: bool,
    /// Frozen until then (0 once over).
    frozen_until: i64,
    /// Cut off until then (0 once over).
    cut_off_until: i64,
    /// The occurrence (index) it claims next.
    next: i64,
    /// A refusal said to ask again then (none once due).
    retry_at: Option<i64>,
    /// It had an answer to a claim of `next`.
    answered: bool,
    /// A claim of `next` got no answer: its retry asks for that win.
    unanswered: bool,
    /// The request it waits on: id, send time, what.
    waiting: Option<(u8, i64, Msg)>,
    next_id: u8,
    floor: i64,
    run: Option<Run>,
    /// The period (index) in which its last run ended, while it is the
    /// current one (a peer refused then still waits the lease out).
    ended_in: Option<i64>,
}

/// The checked system's state. Only what the future and the properties
/// depend on is kept, in one form per meaning (see [`Protocol::canonical`]),
/// so that paths that differ only in their past meet in one state: the
/// runs are the nodes' live ones plus what the properties need of the
/// ended ones.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    now: i64,
    row: Row,
    /// Sorted.
    wire: Vec<Wire>,
    /// Sorted.
    unwritten: Vec<Unwritten>,
    nodes: Vec<NodeState>,
    /// The occurrence of every run started so far, sorted.
    ran: Vec<i64>,
    /// The highest fence a run started with.
    run_fence: i64,
    /// The last fence the store handed out.
    fence: i64,
    /// Occurrences that may go unrun by a documented rule, sorted.
    excused: Vec<i64>,
    /// Sorted.
    faults_used: Vec<Fault>,
    /// Properties broken on the way here (`OVERLAP`, `FENCES`,
    /// `FENCE_ORDER`): checked when it happened, since what shows it (an
    /// ended run, an older fence) is not kept.
    broken: u8,
}

const OVERLAP: u8 = 1;
const FENCES: u8 = 2;
const FENCE_ORDER: u8 = 4;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Real time moves to the next event.
    Advance,
    /// A request reaches the store, which decides it.
    Deliver(usize),
    /// A non-atomic store writes what it decided and answers.
    Write(usize),
    /// A reply reaches its node; a run it starts takes `durations[d]`.
    Receive(usize, usize),
    Lose(usize),
    Freeze(usize, i64),
    /// Real time moves to the next event, where the node freezes before it
    /// acts: right before a deadline of its watchdog, say.
    FreezeAtNext(usize, i64),
    CutOff(usize, i64),
    Crash(usize),
}

impl Protocol {
    fn instant(&self, k: i64) -> i64 {
        k * self.period
    }

    /// The lease a claim asks for: the gap to the next occurrence plus the
    /// margin (biased ownership).
    fn lease(&self) -> i64 {
        self.period + self.margin
    }

    fn ms(d: Duration) -> i64 {
        i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
    }

    fn dur(ms: i64) -> Duration {
        Duration::from_millis(ms.max(0) as u64)
    }

    /// Real time at which a node's monotonic clock shows `local` ms passed
    /// since `from` (a slow clock shows less).
    fn real_after(&self, n: &NodeState, from: i64, local: i64) -> i64 {
        let ppm = if n.slow { self.slow_ppm } else { 0 };
        from + (local * (1_000_000 + ppm) + 999_999) / 1_000_000
    }

    fn allowance_back(&self) -> i64 {
        if self.rules.rate_allowance {
            0
        } else {
            Self::ms(lease::rate_allowance(Self::dur(self.lease())))
        }
    }

    /// The local deadline of a lease clock sent at `sent`, in real time.
    fn stop_at(&self, n: &NodeState, sent: i64) -> i64 {
        let local = Self::ms(lease::stop_after(
            Self::dur(self.lease()),
            Self::dur(self.margin),
        )) + self.allowance_back();
        self.real_after(n, sent, local)
    }

    fn kill_at(&self, n: &NodeState, sent: i64) -> i64 {
        let local = Self::ms(lease::kill_after(Self::dur(self.lease()))) + self.allowance_back();
        self.real_after(n, sent, local)
    }

    fn renew_at(&self, n: &NodeState, sent: i64) -> i64 {
        let local = Self::ms(lease::renew_after(
            Self::dur(self.lease()),
            Self::dur(self.margin),
        ));
        self.real_after(n, sent, local)
    }

    /// Real time at which a node's wall clock shows `wall`.
    fn when_wall(n: &NodeState, wall: i64) -> i64 {
        wall - n.offset
    }

    fn horizon(&self) -> i64 {
        self.instant(self.occurrences + 1) + self.lease()
    }

    fn awake(n: &NodeState, now: i64) -> bool {
        n.up && n.frozen_until <= now
    }

    /// The store decides a claim at `now` with the library's rule.
    fn decide_claim(
        &self,
        s: &State,
        node: usize,
        occ: i64,
        after_unanswered: bool,
    ) -> (Option<Row>, Answer) {
        let owner = |i: usize| format!("n{i}#1");
        let row = LockRow {
            owner: s.row.owner.map(owner),
            fence: s.row.fence,
            expires_at: s.row.expires_at,
            last_occurrence: s.row.last,
            running: s.row.running,
            paused: false,
            trigger: None,
            last_trigger: None,
            now: s.now,
        };
        let req = ClaimRequest {
            job: JobName::parse("job").unwrap(),
            occurrence: from_ms(occ),
            previous: None,
            misfire: Misfire::Skip,
            owner: Owner::from_raw(owner(node)),
            lease: Self::dur(self.lease()),
            fence_floor: s.nodes[node].floor.max(0) as u64,
            max_offset: Self::dur(self.max_offset),
            head_start: Some(Self::dur(self.head_start)),
            after_unanswered: after_unanswered && self.rules.retry_finds_its_win,
            recheck_only: false,
            window_end: None,
            manual: None,
            redeliver: false,
            before_previous: None,
        };
        // The store's batch step (a batch of one: the model has one job),
        // which decides with `decide` and writes the winner's row.
        let mut rows = BTreeMap::from([(req.job.as_str().to_string(), row)]);
        let outcome = claim_rows(&mut rows, std::slice::from_ref(&req), s.now);
        let written = &rows[req.job.as_str()];
        match outcome.into_iter().next() {
            Some(ClaimOutcome::Won(won)) => (
                Some(Row {
                    owner: Some(node),
                    fence: written.fence,
                    expires_at: written.expires_at,
                    last: written.last_occurrence,
                    // The rule switched off: as if no claim set the mark.
                    running: written.running && self.rules.running_mark,
                }),
                Answer::Won {
                    fence: written.fence,
                    occ: cronlease::store::to_ms(won.occurrence),
                },
            ),
            Some(ClaimOutcome::Lost(lost)) => {
                let claimed = lost
                    .last_occurrence
                    .is_some_and(|l| cronlease::store::to_ms(l) >= occ);
                let wait = lost.idle_wait.unwrap_or(lost.remaining);
                let retry_in = (lost.holder.is_some() && !claimed).then(|| Self::ms(wait).max(1));
                (
                    None,
                    Answer::Lost {
                        retry_in,
                        claimed,
                        fence: lost.fence as i64,
                    },
                )
            }
            // An exhausted fence (never reached within the model's bounds).
            Some(ClaimOutcome::Failed(_)) | None => (
                None,
                Answer::Lost {
                    retry_in: None,
                    claimed: true,
                    fence: 0,
                },
            ),
        }
    }

    /// Sends `msg` from node `i` now (lost if it is cut off).
    fn send(&self, s: &mut State, i: usize, msg: Msg) {
        let now = s.now;
        let n = &mut s.nodes[i];
        let id = n.next_id;
        n.next_id = n.next_id.wrapping_add(1);
        n.waiting = Some((id, now, msg.clone()));
        let due = now + self.op_timeout;
        if n.cut_off_until <= now {
            s.wire.push(Wire {
                node: i,
                id,
                msg,
                answer: None,
                due,
            });
        }
    }

    /// Ends node `i`'s run at the latest at `at` (SIGTERM + grace, SIGKILL).
    fn cut_run(s: &mut State, i: usize, at: i64) {
        if let Some(r) = &mut s.nodes[i].run {
            r.end = r.end.min(at.max(r.start));
        }
    }

    /// Records that occurrence `occ` is excused (once).
    fn excuse(s: &mut State, occ: i64) {
        if let Err(at) = s.excused.binary_search(&occ) {
            s.excused.insert(at, occ);
        }
    }

    /// Everything node `i` does by itself at `now`, awake.
    fn settle(&self, s: &mut State, i: usize) {
        let now = s.now;
        if !Self::awake(&s.nodes[i], now) {
            return;
        }
        // The watchdog, then the process's exit.
        if let Some(w) = s.nodes[i].run.clone() {
            let n = &s.nodes[i];
            let ended = w.end <= now;
            if !ended && self.rules.local_deadline {
                if now >= self.kill_at(n, w.ok_sent) {
                    Self::cut_run(s, i, now);
                } else if !w.termed && now >= self.stop_at(n, w.ok_sent) {
                    Self::cut_run(s, i, now + self.stop_grace);
                    if let Some(run) = &mut s.nodes[i].run {
                        run.termed = true;
                    }
                }
            }
            let end = s.nodes[i].run.as_ref().map_or(now, |r| r.end);
            if end <= now {
                // Recorded: the run of the lock's last claim is over.
                if s.row.fence == w.fence {
                    s.row.running = false;
                }
                s.nodes[i].run = None;
                s.nodes[i].ended_in = Some(end.div_euclid(self.period));
                if matches!(s.nodes[i].waiting, Some((_, _, Msg::Renew))) {
                    s.nodes[i].waiting = None;
                }
            }
        }
        // An answer that arrived is read before anything else (the job's
        // loop waits on it).
        if let Some((id, _, _)) = &s.nodes[i].waiting
            && s.wire
                .iter()
                .any(|m| m.node == i && m.id == *id && m.answer.is_some())
        {
            return;
        }
        // A request that got no answer in time.
        if let Some((_, sent, msg)) = s.nodes[i].waiting.clone()
            && now >= sent + self.op_timeout
        {
            s.nodes[i].waiting = None;
            if matches!(msg, Msg::Claim { .. }) {
                s.nodes[i].unanswered = true;
            }
        }
        // The occurrence's window closes at the next instant.
        let n = &s.nodes[i];
        if n.next <= self.occurrences && now >= Self::when_wall(n, self.instant(n.next + 1)) {
            let k = n.next;
            // It never learnt whether it won: no answer at all, or none to
            // its last claim (lost or late).
            let unheard =
                !n.answered || n.unanswered || matches!(n.waiting, Some((_, _, Msg::Claim { .. })));
            let n = &mut s.nodes[i];
            n.next += 1;
            n.retry_at = None;
            n.answered = false;
            n.unanswered = false;
            if matches!(n.waiting, Some((_, _, Msg::Claim { .. }))) {
                n.waiting = None;
            }
            if unheard {
                Self::excuse(s, self.instant(k));
            }
        }
        let n = &s.nodes[i];
        if n.waiting.is_some() {
            return;
        }
        // Renew a running job's lease.
        if let Some(w) = &n.run
            && !w.termed
            && now >= self.renew_at(n, w.ok_sent)
            && w.end > now
        {
            self.send(s, i, Msg::Renew);
            return;
        }
        // Claim the next occurrence at its instant (its wall clock), or
        // when a refusal said to ask again.
        let n = &s.nodes[i];
        if n.next <= self.occurrences
            && now >= Self::when_wall(n, self.instant(n.next))
            && n.retry_at.is_none_or(|r| now >= r)
        {
            let occ = self.instant(n.next);
            let after_unanswered = n.unanswered;
            s.nodes[i].retry_at = None;
            self.send(
                s,
                i,
                Msg::Claim {
                    occ,
                    after_unanswered,
                },
            );
        }
    }

    /// The next moment anything happens by itself.
    fn next_event(&self, s: &State) -> Option<i64> {
        let now = s.now;
        let mut times = vec![self.horizon()];
        for n in s.nodes.iter().filter(|n| n.up) {
            if n.frozen_until > now {
                times.push(n.frozen_until);
                continue;
            }
            if n.next <= self.occurrences {
                times.push(Self::when_wall(n, self.instant(n.next)));
                times.push(Self::when_wall(n, self.instant(n.next + 1)));
            }
            times.extend(n.retry_at);
            if let Some((_, sent, _)) = &n.waiting {
                times.push(sent + self.op_timeout);
            }
            if let Some(w) = &n.run {
                times.push(self.renew_at(n, w.ok_sent));
                times.push(self.stop_at(n, w.ok_sent));
                times.push(self.kill_at(n, w.ok_sent));
            }
        }
        // A run's exit, also while its node is frozen.
        for n in &s.nodes {
            times.extend(n.run.as_ref().map(|r| r.end));
        }
        times.extend(s.wire.iter().map(|m| m.due));
        times.extend(s.unwritten.iter().map(|u| u.due));
        times.into_iter().filter(|t| *t > now).min()
    }

    /// Node `i` stops answering for itself (frozen, cut off, crashed) while
    /// it holds a lease marked running: a peer must wait that lease out
    /// (a holder running a job keeps the full lease), so the occurrences
    /// whose window closes before it ends may go unrun.
    /// A peer refused while the holder ran a job waits its lease out even
    /// once that run ended, so a run that ended in the current window
    /// counts as busy too.
    fn excuse_held(&self, s: &mut State, i: usize) {
        let window_start = s.now - s.now.rem_euclid(self.period);
        let n = &s.nodes[i];
        let busy_lately = n.run.as_ref().is_some_and(|r| r.end >= window_start)
            || n.ended_in
                .is_some_and(|k| k >= s.now.div_euclid(self.period));
        if s.row.owner != Some(i) || s.row.expires_at <= s.now || !(s.row.running || busy_lately) {
            return;
        }
        for k in 1..=self.occurrences {
            let occ = self.instant(k);
            if occ + self.period <= s.row.expires_at {
                Self::excuse(s, occ);
            }
        }
    }

    fn settle_all(&self, s: &mut State) {
        for i in 0..s.nodes.len() {
            self.settle(s, i);
        }
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let mut states = Vec::new();
        for &offset in &self.offsets {
            for slow in 0..(1u8 << self.nodes) {
                if self.all_slow && slow != (1u8 << self.nodes) - 1 {
                    continue;
                }
                let nodes = (0..self.nodes)
                    .map(|i| NodeState {
                        up: true,
                        offset: if i == 1 { offset } else { 0 },
                        slow: slow & (1 << i) != 0 && self.slow_ppm > 0,
                        frozen_until: 0,
                        cut_off_until: 0,
                        next: 1,
                        retry_at: None,
                        answered: false,
                        unanswered: false,
                        waiting: None,
                        next_id: 0,
                        floor: 0,
                        run: None,
                        ended_in: None,
                    })
                    .collect();
                let s = State {
                    now: 0,
                    row: Row {
                        owner: None,
                        fence: 0,
                        expires_at: 0,
                        last: None,
                        running: false,
                    },
                    wire: Vec::new(),
                    unwritten: Vec::new(),
                    nodes,
                    ran: Vec::new(),
                    run_fence: 0,
                    fence: 0,
                    excused: Vec::new(),
                    faults_used: Vec::new(),
                    broken: 0,
                };
                let s = self.canonical(s);
                if !states.contains(&s) {
                    states.push(s);
                }
            }
        }
        states
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.now >= self.horizon() {
            return;
        }
        // Time stops until what is due arrives (or is lost); an answer to
        // a frozen node waits for its thaw.
        let overdue = s.wire.iter().any(|m| {
            m.due <= s.now && (m.answer.is_none() || Self::awake(&s.nodes[m.node], s.now))
        }) || s.unwritten.iter().any(|u| u.due <= s.now);
        if !overdue {
            actions.push(Action::Advance);
        }
        for (w, m) in s.wire.iter().enumerate() {
            match m.answer {
                None => actions.push(Action::Deliver(w)),
                Some(_) if Self::awake(&s.nodes[m.node], s.now) => {
                    let starts = matches!(m.answer, Some(Answer::Won { .. }));
                    let choices = if starts { self.durations.len() } else { 1 };
                    actions.extend((0..choices).map(|d| Action::Receive(w, d)));
                }
                Some(_) => {}
            }
            if self.faults_left(s) > 0
                && self.faults.contains(&Fault::Lose)
                && !s.faults_used.contains(&Fault::Lose)
            {
                actions.push(Action::Lose(w));
            }
        }
        for w in 0..s.unwritten.len() {
            actions.push(Action::Write(w));
        }
        if self.faults_left(s) == 0 {
            return;
        }
        for f in &self.faults {
            if s.faults_used.contains(f) {
                continue;
            }
            for (i, n) in s.nodes.iter().enumerate() {
                if !Self::awake(n, s.now) {
                    continue;
                }
                match *f {
                    Fault::Freeze(ms) => {
                        actions.push(Action::Freeze(i, ms));
                        if !overdue {
                            actions.push(Action::FreezeAtNext(i, ms));
                        }
                    }
                    Fault::CutOff(ms) => actions.push(Action::CutOff(i, ms)),
                    Fault::Crash => actions.push(Action::Crash(i)),
                    Fault::Lose => {}
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        self.step(last, action).map(|s| self.canonical(s))
    }

    fn within_boundary(&self, s: &State) -> bool {
        s.now <= self.horizon()
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("at most one run per occurrence", |_, s: &State| {
                s.ran.windows(2).all(|p| p[0] != p[1])
            }),
            Property::always("no two nodes run the job at once", |_, s: &State| {
                s.broken & OVERLAP == 0
            }),
            Property::always("fences strictly increase", |_, s: &State| {
                s.broken & FENCES == 0
            }),
            Property::always("runs start in fence order", |_, s: &State| {
                s.broken & FENCE_ORDER == 0
            }),
            Property::always(
                "every occurrence runs unless excused",
                |m: &Protocol, s: &State| {
                    s.now < m.horizon()
                        || (1..=m.occurrences).all(|k| {
                            let occ = m.instant(k);
                            s.ran.contains(&occ) || s.excused.contains(&occ)
                        })
                },
            ),
        ]
    }
}

impl Protocol {
    /// What `action` does to `last`, and what the nodes then do by
    /// themselves (not in canonical form).
    fn step(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        let now = s.now;
        match action {
            Action::Advance => {
                s.now = self.next_event(&s)?;
            }
            Action::Deliver(w) => {
                let m = s.wire[w].clone();
                let answer = match m.msg {
                    Msg::Claim {
                        occ,
                        after_unanswered,
                    } => {
                        let (row, answer) = self.decide_claim(&s, m.node, occ, after_unanswered);
                        match row {
                            Some(row) if self.rules.atomic_claim => {
                                if let Answer::Won { fence, .. } = answer
                                    && fence != s.row.fence
                                {
                                    Self::hand_out(&mut s, fence);
                                }
                                s.row = row;
                                Some(answer)
                            }
                            Some(row) => {
                                s.unwritten.push(Unwritten {
                                    node: m.node,
                                    id: m.id,
                                    row,
                                    answer,
                                    due: m.due,
                                });
                                None
                            }
                            None => Some(answer),
                        }
                    }
                    Msg::Renew => {
                        let ok = s.row.owner == Some(m.node) && s.row.expires_at > now;
                        if ok {
                            s.row.expires_at = now + self.lease();
                        }
                        Some(Answer::Renewed(ok))
                    }
                };
                match answer {
                    Some(a) if s.nodes[m.node].cut_off_until <= now => {
                        s.wire[w].answer = Some(a);
                    }
                    _ => {
                        s.wire.remove(w);
                    }
                }
            }
            Action::Write(w) => {
                let Unwritten {
                    node,
                    id,
                    row,
                    answer,
                    due,
                } = s.unwritten.remove(w);
                if let Answer::Won { fence, .. } = answer {
                    Self::hand_out(&mut s, fence);
                }
                s.row = row;
                if s.nodes[node].cut_off_until <= now {
                    s.wire.push(Wire {
                        node,
                        id,
                        msg: Msg::Claim {
                            occ: 0,
                            after_unanswered: false,
                        },
                        answer: Some(answer),
                        due,
                    });
                }
            }
            Action::Receive(w, d) => {
                let m = s.wire.remove(w);
                let n = &s.nodes[m.node];
                let Some((id, sent, _)) = n.waiting.clone() else {
                    return Some(self.settled(s));
                };
                if id != m.id {
                    // An answer to a request given up on.
                    return Some(self.settled(s));
                }
                let i = m.node;
                s.nodes[i].waiting = None;
                match m.answer? {
                    Answer::Won { fence, occ } => {
                        let n = &mut s.nodes[i];
                        n.floor = n.floor.max(fence);
                        n.answered = true;
                        n.unanswered = false;
                        n.next = n.next.max(occ / self.period + 1);
                        n.retry_at = None;
                        let n = &s.nodes[i];
                        let busy = n.run.is_some();
                        let stale = now >= self.stop_at(n, sent);
                        if busy || (stale && self.rules.check_before_start) {
                            // Skipped (its last run still goes) or lost
                            // between claim and start: documented.
                            Self::excuse(&mut s, occ);
                        } else {
                            if fence <= s.run_fence {
                                s.broken |= FENCE_ORDER;
                            }
                            s.run_fence = s.run_fence.max(fence);
                            let at = s.ran.partition_point(|o| *o <= occ);
                            s.ran.insert(at, occ);
                            s.nodes[i].run = Some(Run {
                                fence,
                                start: now,
                                end: now + self.durations[d],
                                ok_sent: sent,
                                termed: false,
                            });
                        }
                    }
                    Answer::Lost {
                        retry_in,
                        claimed,
                        fence,
                    } => {
                        let n = &mut s.nodes[i];
                        n.floor = n.floor.max(fence);
                        n.answered = true;
                        n.unanswered = false;
                        let retry_at = now + retry_in.unwrap_or(1);
                        if claimed {
                            n.next += 1;
                            n.answered = false;
                        } else if retry_at >= Self::when_wall(n, self.instant(n.next + 1)) {
                            // The lease outlasts the window (counted from
                            // the reply's arrival, as the node does): the
                            // occurrence is left to the holder, and goes
                            // unrun if the holder cannot run it.
                            let occ = self.instant(n.next);
                            n.next += 1;
                            n.answered = false;
                            Self::excuse(&mut s, occ);
                        } else {
                            n.retry_at = Some(retry_at);
                        }
                    }
                    Answer::Renewed(ok) => {
                        if ok {
                            if let Some(r) = &mut s.nodes[i].run {
                                r.ok_sent = sent;
                            }
                        } else {
                            // Refused: the lease is gone; killed at once.
                            Self::cut_run(&mut s, i, now);
                        }
                    }
                }
            }
            Action::Lose(w) => {
                s.wire.remove(w);
                Self::use_fault(&mut s, Fault::Lose);
            }
            Action::Freeze(i, ms) => {
                self.excuse_held(&mut s, i);
                s.nodes[i].frozen_until = now + ms;
                Self::use_fault(&mut s, Fault::Freeze(ms));
            }
            Action::FreezeAtNext(i, ms) => {
                s.now = self.next_event(&s)?;
                self.excuse_held(&mut s, i);
                s.nodes[i].frozen_until = s.now + ms;
                Self::use_fault(&mut s, Fault::Freeze(ms));
            }
            Action::CutOff(i, ms) => {
                self.excuse_held(&mut s, i);
                s.nodes[i].cut_off_until = now + ms;
                s.wire.retain(|m| m.node != i);
                Self::use_fault(&mut s, Fault::CutOff(ms));
            }
            Action::Crash(i) => {
                self.excuse_held(&mut s, i);
                s.nodes[i].up = false;
                if let Some(r) = s.nodes[i].run.take() {
                    // Killed with its host: over now.
                    s.nodes[i].ended_in = Some(now.max(r.start).div_euclid(self.period));
                }
                s.wire.retain(|m| m.node != i);
                // Whatever it won and had not started is lost with it.
                if let Some(last) = s.row.last
                    && s.row.owner == Some(i)
                    && !s.ran.contains(&last)
                {
                    Self::excuse(&mut s, last);
                }
                Self::use_fault(&mut s, Fault::Crash);
            }
        }
        Some(self.settled(s))
    }

    /// `a` in words, nodes named by `names`.
    fn describe_action(&self, s: &State, a: &Action, names: &[usize]) -> String {
        let wire = |w: usize| {
            let m = &s.wire[w];
            let n = names[m.node];
            match &m.answer {
                None => format!("n{n}'s {:?} to the store", m.msg),
                Some(answer)
                    if s.nodes[m.node]
                        .waiting
                        .as_ref()
                        .is_some_and(|w| w.0 == m.id) =>
                {
                    format!("the store's {answer:?} to n{n}")
                }
                Some(answer) => format!("the store's {answer:?} to n{n} (given up on)"),
            }
        };
        match *a {
            Action::Advance => "time moves on".into(),
            Action::Deliver(w) => format!("deliver {}", wire(w)),
            Action::Write(w) => {
                let u = &s.unwritten[w];
                format!(
                    "the store writes n{}'s claim: {:?}",
                    names[u.node], u.answer
                )
            }
            Action::Receive(w, d) => match s.wire[w].answer {
                Some(Answer::Won { .. }) => {
                    format!(
                        "receive {} (a run would take {} ms)",
                        wire(w),
                        self.durations[d]
                    )
                }
                _ => format!("receive {}", wire(w)),
            },
            Action::Lose(w) => format!("lose {}", wire(w)),
            Action::Freeze(i, ms) => format!("n{} freezes for {ms} ms", names[i]),
            Action::FreezeAtNext(i, ms) => format!(
                "time moves on, and n{} freezes for {ms} ms before it acts",
                names[i]
            ),
            Action::CutOff(i, ms) => format!("n{} is cut off for {ms} ms", names[i]),
            Action::Crash(i) => format!("n{} crashes", names[i]),
        }
    }

    /// The state after an action: what the nodes do by themselves at
    /// `now`.
    fn settled(&self, mut s: State) -> State {
        Self::note_overlap(&mut s);
        self.settle_all(&mut s);
        s
    }

    /// Two runs on two nodes that both went on at some moment up to `now`.
    /// Checked after every action, before a node lets its ended run go:
    /// time moves only forward and a run is only cut at `now` or later, so
    /// every overlap is seen while both runs are still kept.
    fn note_overlap(s: &mut State) {
        let runs: Vec<&Run> = s.nodes.iter().filter_map(|n| n.run.as_ref()).collect();
        for (k, a) in runs.iter().enumerate() {
            for b in &runs[k + 1..] {
                if a.start.max(b.start) < a.end.min(b.end).min(s.now) {
                    s.broken |= OVERLAP;
                }
            }
        }
    }

    fn faults_left(&self, s: &State) -> usize {
        usize::from(self.fault_budget).saturating_sub(s.faults_used.len())
    }

    fn use_fault(s: &mut State, f: Fault) {
        let at = s.faults_used.partition_point(|u| *u <= f);
        s.faults_used.insert(at, f);
    }

    /// The store hands out `fence` (a claim written).
    fn hand_out(s: &mut State, fence: i64) {
        if fence <= s.fence {
            s.broken |= FENCES;
        }
        s.fence = fence;
    }

    /// One state per meaning, so that paths that differ only in what no
    /// longer matters meet:
    /// - a freeze, a cut-off or a retry time that is past reads as none,
    ///   and so does the period of a run's end once it is over;
    /// - a crashed node keeps only what can still matter (whether what the
    ///   store writes for it is sent, non-atomic stores);
    /// - request ids are renumbered per node (the one it waits on first):
    ///   only their equality matters; an answer carries no copy of its
    ///   request;
    /// - the wire and the unwritten claims are sorted (delivery picks any);
    /// - nodes are ordered, every reference to them renamed: the model
    ///   treats node indices as names only (the initial states alone give
    ///   node 1 the offset, and a node's offset and clock rate go with it).
    fn canonical(&self, s: State) -> State {
        self.canonical_named(s).0
    }

    /// [`Self::canonical`], and which node of `s` each node of the result
    /// is.
    fn canonical_named(&self, mut s: State) -> (State, Vec<usize>) {
        let now = s.now;
        for n in &mut s.nodes {
            if n.frozen_until <= now {
                n.frozen_until = 0;
            }
            if n.cut_off_until <= now {
                n.cut_off_until = 0;
            }
            if n.retry_at.is_some_and(|r| r <= now) {
                n.retry_at = None;
            }
            if n.ended_in.is_some_and(|k| k < now.div_euclid(self.period)) {
                n.ended_in = None;
            }
            if !n.up {
                *n = NodeState {
                    up: false,
                    offset: 0,
                    slow: false,
                    frozen_until: 0,
                    cut_off_until: n.cut_off_until,
                    next: 0,
                    retry_at: None,
                    answered: false,
                    unanswered: false,
                    waiting: None,
                    next_id: 0,
                    floor: 0,
                    run: None,
                    ended_in: None,
                };
            }
        }
        for m in &mut s.wire {
            if m.answer.is_some() {
                m.msg = Msg::Renew;
            }
        }
        // Ids: the awaited request's first, then in the order of what they
        // carry.
        s.wire.sort_by(|a, b| {
            (a.node, &a.msg, &a.answer, a.due).cmp(&(b.node, &b.msg, &b.answer, b.due))
        });
        s.unwritten.sort_by(|a, b| {
            (a.node, &a.row, &a.answer, a.due).cmp(&(b.node, &b.row, &b.answer, b.due))
        });
        for i in 0..s.nodes.len() {
            let mut ids: Vec<u8> = Vec::new();
            ids.extend(s.nodes[i].waiting.as_ref().map(|w| w.0));
            for id in s
                .wire
                .iter()
                .filter(|m| m.node == i)
                .map(|m| m.id)
                .chain(s.unwritten.iter().filter(|u| u.node == i).map(|u| u.id))
            {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
            let renamed = |id: u8| ids.iter().position(|x| *x == id).unwrap_or(0) as u8;
            if let Some(w) = &mut s.nodes[i].waiting {
                w.0 = renamed(w.0);
            }
            for m in s.wire.iter_mut().filter(|m| m.node == i) {
                m.id = renamed(m.id);
            }
            for u in s.unwritten.iter_mut().filter(|u| u.node == i) {
                u.id = renamed(u.id);
            }
            s.nodes[i].next_id = ids.len() as u8;
        }
        // Nodes in order; among equal nodes, the naming that orders the
        // rest first.
        let mut best: Option<(State, Vec<usize>)> = None;
        for perm in permutations(s.nodes.len()) {
            if !perm.windows(2).all(|p| s.nodes[p[0]] <= s.nodes[p[1]]) {
                continue;
            }
            let c = Self::renamed(&s, &perm);
            if best.as_ref().is_none_or(|(b, _)| {
                (&c.row, &c.wire, &c.unwritten) < (&b.row, &b.wire, &b.unwritten)
            }) {
                best = Some((c, perm));
            }
        }
        best.unwrap_or_else(|| (s.clone(), (0..s.nodes.len()).collect()))
    }

    /// `s` with its node `perm[k]` as node `k`.
    fn renamed(s: &State, perm: &[usize]) -> State {
        let mut to = vec![0; perm.len()];
        for (k, &old) in perm.iter().enumerate() {
            to[old] = k;
        }
        let mut c = s.clone();
        c.nodes = perm.iter().map(|&old| s.nodes[old].clone()).collect();
        c.row.owner = c.row.owner.map(|o| to[o]);
        for m in &mut c.wire {
            m.node = to[m.node];
        }
        for u in &mut c.unwritten {
            u.node = to[u.node];
            u.row.owner = u.row.owner.map(|o| to[o]);
        }
        c.wire.sort();
        c.unwritten.sort();
        c
    }

    /// Two nodes, two occurrences 2 s apart, the default 1 s margin and
    /// 50 ms head start (a 3 s lease), clocks right (see [`Self::skewed`]),
    /// runs of 100 ms or 3.5 s
    /// (renewed, longer than a lease), jobs that stop at SIGTERM, every
    /// rule on, at most two of `faults`.
    pub fn small(faults: Vec<Fault>) -> Protocol {
        Protocol {
            nodes: 2,
            occurrences: 2,
            period: 2_000,
            margin: 1_000,
            head_start: 50,
            max_offset: 500,
            offsets: vec![0],
            slow_ppm: 0,
            all_slow: false,
            durations: vec![100, 3_500],
            stop_grace: 0,
            op_timeout: 1_000,
            fault_budget: faults.len().min(2) as u8,
            faults,
            rules: Rules::ALL,
        }
    }

    /// Node 1's wall clock 30 ms ahead or right, each monotonic clock
    /// right or 0.1 % slow.
    fn skewed(self) -> Protocol {
        self.with(|p| {
            p.offsets = vec![0, 30];
            p.slow_ppm = 1_000;
        })
    }

    fn with(mut self, f: impl FnOnce(&mut Protocol)) -> Protocol {
        f(&mut self);
        self
    }
}

/// Every order of `0..n`.
fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![Vec::new()];
    }
    let mut all = Vec::new();
    for p in permutations(n - 1) {
        for at in 0..=p.len() {
            let mut q = p.clone();
            q.insert(at, n - 1);
            all.push(q);
        }
    }
    all
}

/// Explores every state of `p` up to its horizon; returns the checker for
/// its counts and discoveries.
fn check(p: Protocol) -> impl Checker<Protocol> {
    let t = Instant::now();
    let c = p.checker().threads(2).spawn_bfs().join();
    println!(
        "states: {} in {:.1} s",
        c.unique_state_count(),
        t.elapsed().as_secs_f64()
    );
    c
}

/// Explores `p` until property `name` is broken: the path that breaks it,
/// if one does.
fn counterexample(p: Protocol, name: &'static str) -> Option<String> {
    let t = Instant::now();
    let c = p
        .checker()
        .threads(2)
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name])))
        .spawn_bfs()
        .join();
    println!(
        "states: {} in {:.1} s to break {name:?}",
        c.unique_state_count(),
        t.elapsed().as_secs_f64()
    );
    found(&c, name)
}

/// The discovery of property `name`, if any, as its steps.
fn found(c: &impl Checker<Protocol>, name: &'static str) -> Option<String> {
    c.discovery(name)
        .map(|path| describe(c.model(), path.into_vec()))
}

/// A path, step by step, each node under one name throughout (the
/// canonical form may reorder the nodes from one state to the next); with
/// `MODEL_STATES` set, each state too.
fn describe(p: &Protocol, path: Vec<(State, Option<Action>)>) -> String {
    let show_states = std::env::var_os("MODEL_STATES").is_some();
    // The name of each node of the current state, by its index there.
    let mut names: Vec<usize> = (0..p.nodes).collect();
    let mut lines = Vec::new();
    for (s, a) in path {
        let mut at = vec![0; names.len()];
        for (k, &name) in names.iter().enumerate() {
            at[name] = k;
        }
        let shown = Protocol::renamed(&s, &at);
        let Some(a) = a else {
            lines.push(format!("ends at {}: {shown:?}", s.now));
            break;
        };
        lines.push(format!(
            "at {}: {}",
            s.now,
            p.describe_action(&s, &a, &names)
        ));
        if show_states {
            lines.push(format!("    {shown:?}"));
        }
        if let Some(raw) = p.step(&s, a) {
            let (_, perm) = p.canonical_named(raw);
            names = perm.iter().map(|&i| names[i]).collect();
        }
    }
    lines.join("\n")
}

const PROPERTIES: [&str; 5] = [
    "at most one run per occurrence",
    "no two nodes run the job at once",
    "fences strictly increase",
    "runs start in fence order",
    "every occurrence runs unless excused",
];

fn assert_holds(c: &impl Checker<Protocol>) {
    for name in PROPERTIES {
        if let Some(path) = found(c, name) {
            panic!("{name}:\n{path}");
        }
    }
}

/// Asserts that `p` breaks property `name`, and prints how.
fn assert_breaks(p: Protocol, name: &'static str) {
    match counterexample(p, name) {
        Some(path) => println!("{name}:\n{path}"),
        None => panic!("{name} holds"),
    }
}

#[test]
fn the_protocol_holds_without_faults_on_skewed_clocks() {
    assert_holds(&check(Protocol::small(vec![]).skewed()));
}

#[test]
fn the_protocol_holds_under_lost_messages_and_a_crash() {
    assert_holds(&check(Protocol::small(vec![Fault::Lose, Fault::Crash])));
}

#[test]
fn the_protocol_holds_when_a_node_is_cut_off_or_frozen_briefly() {
    assert_holds(&check(Protocol::small(vec![
        Fault::CutOff(3_000),
        Fault::Freeze(490),
    ])));
}

/// The margin condition (docs/protocol.md, "The margin condition"): a
/// frozen daemon cannot stop its job, so a run whose renewal was lost is
/// stopped only when its node thaws, and must be gone by the earliest
/// moment the store may let a peer in, a lease after the send. The local
/// deadline comes margin/2 + the 3 ms allowance before that: a freeze from
/// the deadline on may last 503 ms on a right clock (504 overlaps), and
/// 500 ms on a clock 0.1 % slow, on which the 2,497 ms to the deadline
/// take 2,500 (501 overlaps).
#[test]
fn a_freeze_past_half_the_margin_lets_a_stale_run_overlap() {
    let lose_and_freeze = |ms| Protocol::small(vec![Fault::Lose, Fault::Freeze(ms)]);
    assert_holds(&check(lose_and_freeze(503)));
    assert_breaks(lose_and_freeze(504), "no two nodes run the job at once");
    let slow = |p: Protocol| {
        p.with(|p| {
            p.slow_ppm = 1_000;
            p.all_slow = true;
        })
    };
    assert_holds(&check(slow(lose_and_freeze(500))));
    assert_breaks(
        slow(lose_and_freeze(501)),
        "no two nodes run the job at once",
    );
}

/// A job that ignores SIGTERM (or takes longer than margin/2 to exit) is
/// stopped only by the SIGKILL at lease − the allowance, 3 ms before the
/// earliest expiry: a daemon frozen right then for 4 ms lets it overlap a
/// peer's run (3 ms holds: the longer run below).
#[test]
fn a_job_deaf_to_sigterm_overlaps_when_its_daemon_freezes_at_the_kill() {
    assert_breaks(
        deaf_and_cut_off(Fault::Freeze(4)),
        "no two nodes run the job at once",
    );
}

/// Runs of 3.5 s that ignore SIGTERM, a node cut off for 3 s, and `fault`.
fn deaf_and_cut_off(fault: Fault) -> Protocol {
    Protocol::small(vec![Fault::CutOff(3_000), fault]).with(|p| {
        p.durations = vec![3_500];
        p.stop_grace = 10_000;
    })
}

/// Each rule, switched off, lets the checker find the counterexample it
/// guards against; the same system with the rule on holds (here, or in a
/// test above whose faults include these).
#[test]
fn each_rule_is_load_bearing() {
    let off = |p: Protocol, f: fn(&mut Rules)| p.with(|p| f(&mut p.rules));
    // A store that reads and writes a claim in two steps runs an
    // occurrence twice (holds: the first test).
    assert_breaks(
        off(Protocol::small(vec![]), |r| r.atomic_claim = false),
        "at most one run per occurrence",
    );
    // Holds: the second test.
    assert_breaks(
        off(Protocol::small(vec![Fault::Lose]), |r| {
            r.running_mark = false
        }),
        "no two nodes run the job at once",
    );
    // Holds: the third test.
    assert_breaks(
        off(Protocol::small(vec![Fault::CutOff(3_000)]), |r| {
            r.local_deadline = false
        }),
        "no two nodes run the job at once",
    );
    // A retry after a lost reply that does not get its own win back leaves
    // an occurrence unrun that nothing excuses (holds: the second test).
    assert_breaks(
        off(Protocol::small(vec![Fault::Lose]), |r| {
            r.retry_finds_its_win = false
        }),
        "every occurrence runs unless excused",
    );
    // A node frozen between its claim and the start: short runs, so only
    // the start can be stale. Without the check, the stale run starts after
    // a peer's newer one, with the older fence (its watchdog, past both
    // deadlines, kills it at once, and a kill takes no time in the model,
    // so it overlaps nothing).
    let short = || Protocol::small(vec![Fault::Freeze(3_050)]).with(|p| p.durations = vec![100]);
    assert_holds(&check(short()));
    assert_breaks(
        off(short(), |r| r.check_before_start = false),
        "runs start in fence order",
    );
    // A job that ignores SIGTERM is killed at the expiry its node counts on
    // a clock 0.1 % slow: without the allowance, 3 ms after a peer began.
    let deaf = || {
        Protocol::small(vec![Fault::CutOff(3_000)]).with(|p| {
            p.slow_ppm = 1_000;
            p.all_slow = true;
            p.durations = vec![3_500];
            p.stop_grace = 10_000;
        })
    };
    assert_holds(&check(deaf()));
    assert_breaks(
        off(deaf(), |r| r.rate_allowance = false),
        "no two nodes run the job at once",
    );
}

/// The longer run: three occurrences, skewed clocks, and the edges of the
/// margin condition that are too big for CI (about 1.5 minutes on 2 cores;
/// docs/protocol.md, "The margin condition", has the counts).
#[test]
#[ignore = "the longer run: about 1.5 minutes on 2 cores"]
fn the_protocol_holds_in_a_longer_run() {
    let lose_and_crash = || Protocol::small(vec![Fault::Lose, Fault::Crash]);
    assert_holds(&check(lose_and_crash().with(|p| p.occurrences = 3)));
    assert_holds(&check(lose_and_crash().skewed()));
    // A job deaf to SIGTERM: a 3 ms freeze at its SIGKILL is still in time
    // on a right clock (4 ms is not: above); on a clock 0.1 % slow the
    // SIGKILL falls on the expiry itself, and 1 ms is too late.
    assert_holds(&check(deaf_and_cut_off(Fault::Freeze(3))));
    assert_breaks(
        deaf_and_cut_off(Fault::Freeze(1)).with(|p| {
            p.slow_ppm = 1_000;
            p.all_slow = true;
        }),
        "no two nodes run the job at once",
    );
    // The rate allowance's check above, on every combination of clocks.
    assert_holds(&check(
        Protocol::small(vec![Fault::CutOff(3_000)])
            .skewed()
            .with(|p| {
                p.durations = vec![3_500];
                p.stop_grace = 10_000;
            }),
    ));
}

/// The margin condition's edge on every combination of clocks (node 1's
/// wall clock right or 30 ms ahead, each monotonic clock right or 0.1 %
/// slow): about 16 million states, 2 to 4 minutes and 3 GB.
#[test]
#[ignore = "the longer run: 2 to 4 minutes on 2 cores, 3 GB"]
fn the_margin_condition_holds_on_skewed_clocks() {
    let lose_and_freeze = |ms| Protocol::small(vec![Fault::Lose, Fault::Freeze(ms)]).skewed();
    assert_holds(&check(lose_and_freeze(500)));
    assert_breaks(lose_and_freeze(501), "no two nodes run the job at once");
}
