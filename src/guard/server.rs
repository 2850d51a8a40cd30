//! The guard process's side (`cronlease __guard`): it starts the runs,
//! reaps them, and when the daemon's socket closes without a goodbye kills
//! the runs' process trees, records them and hands the leases over.

use super::handover::{Left, hand_over, hands_back};
use super::*;

/// What the guard's threads tell its main loop.
pub(super) enum Event {
    /// A job's process group to kill if the daemon dies, and its run.
    Watch(i32, Option<Box<RunNote>>),
    Forget(i32),
    /// A run's systemd unit to kill if the daemon dies, and its run.
    WatchUnit(String, Option<Box<RunNote>>),
    ForgetUnit(String),
    Handover(Box<Handover>),
    /// Claims won, to hand back if no run of theirs starts.
    Claimed(Vec<RunNote>),
    /// Claims started or settled without a run: (job, fence).
    Settled(Vec<(String, u64)>),
    Bye,
    /// The daemon is gone.
    End,
}

/// What the guard hands over if the daemon dies without a [`Request::Bye`].
#[derive(Default, Serialize, Deserialize)]
pub(super) struct Succession {
    pub(super) handover: Option<Handover>,
    /// Every job name told, for the owner-checked release.
    pub(super) jobs: BTreeSet<String>,
    /// The runs going, by process group.
    pub(super) runs: BTreeMap<i32, RunNote>,
    /// The runs going as systemd units, by unit.
    pub(super) unit_runs: BTreeMap<String, RunNote>,
    /// Per job, its newest claim won ([`Request::Claimed`]).
    pub(super) claims: HashMap<String, RunNote>,
    /// Per job, the highest fence whose run started or whose claim was
    /// settled without one: a claim at or below it is not handed back.
    pub(super) settled: HashMap<String, u64>,
    pub(super) bye: bool,
}

impl Succession {
    /// The claim `fence` of `job` started a run or was settled.
    fn settle(&mut self, job: &str, fence: u64) {
        match self.settled.get_mut(job) {
            Some(highest) => *highest = (*highest).max(fence),
            None => {
                self.settled.insert(job.to_string(), fence);
            }
        }
    }

    /// A claim won.
    fn claimed(&mut self, claim: RunNote) {
        if self
            .claims
            .get(&claim.job)
            .is_none_or(|known| known.fence < claim.fence)
        {
            self.claims.insert(claim.job.clone(), claim);
        }
    }

    /// Per job, the highest fence the daemon told of.
    pub(super) fn known(&self) -> HashMap<String, u64> {
        let mut known = self.settled.clone();
        for (job, claim) in &self.claims {
            let fence = known.entry(job.clone()).or_default();
            *fence = (*fence).max(claim.fence);
        }
        known
    }

    /// The claims won whose run never started and that were not settled
    /// otherwise: what to hand back. Whichever order the reading threads
    /// passed the claim and its start on in, the fences tell.
    pub(super) fn unstarted(&mut self) -> Vec<RunNote> {
        let settled = &self.settled;
        let mut unstarted: Vec<RunNote> = std::mem::take(&mut self.claims)
            .into_values()
            .filter(|c| settled.get(&c.job).is_none_or(|&f| f < c.fence))
            .collect();
        unstarted.sort_by(|a, b| a.job.cmp(&b.job));
        unstarted
    }
}

/// The guard process itself: starts the jobs the daemon asks for, reaps
/// them, and when the daemon's end of the socket closes kills what is
/// left; if the daemon died (it did not say [`Request::Bye`]), it then
/// hands over ([`super::handover::hand_over`]). Signals that would stop a daemon (INT from a terminal, TERM from
/// `pkill`) are ignored: the guard must outlive the daemon by a moment, and
/// ends exactly when the daemon's end closes the socket.
///
/// "What is left" is each running job's group and every process below its
/// members, also those that left the group or the session (`setsid cmd &`):
/// they still hang below the job's process by their parent links. While jobs
/// run, the guard also notes their descendants every second. A process
/// whose parent exits is adopted by the guard (its subreaper) and counts
/// for the job it was noted under, or, adopted before any note, for every
/// job running when it is first seen, or ended since the last look
/// ([`Orphans`], [`Watched::look`]); one adopted while no job ran, or whose
/// jobs have all ended, was left behind on purpose and is never killed.
///
/// This is `cronlease __guard`, which does it all in one process: the
/// daemon's fallback when `cronlease-guard` is not beside it
/// ([`serve_small`]).
pub fn serve() -> std::process::ExitCode {
    // Executed from a descriptor by a `cronlease-guard` of another version
    // ([`serve_small`]), the process would be named by its number before
    // Linux 6.14.
    let _ = nix::sys::prctl::set_name(c"cronlease");
    serve_then(|remains, died| {
        remains.finish(died);
        std::process::ExitCode::SUCCESS
    })
}

/// The signals that would stop a daemon, which the guard ignores.
pub(super) const STOP_SIGNALS: [Signal; 5] = [
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGUSR1,
    Signal::SIGQUIT,
];

/// Ignores [`STOP_SIGNALS`] by a handler that only sets a flag: an ignored
/// disposition (`SIG_IGN`) would be inherited by every job it starts.
pub(super) fn ignore_stop_signals() {
    let ignored = Arc::new(AtomicBool::new(false));
    for sig in STOP_SIGNALS {
        let _ = signal_hook::flag::register(sig as i32, ignored.clone());
    }
}

/// The loop of [`serve`] and [`serve_small`]; once the daemon is gone and
/// the runs' trees are killed, `then` does what is left.
pub(super) fn serve_then(
    then: impl FnOnce(Remains, std::time::Instant) -> std::process::ExitCode,
) -> std::process::ExitCode {
    ignore_stop_signals();
    let sock = match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(sock) => Arc::new(sock),
        Err(e) => {
            tracing::error!(process = "guard", "no socket on stdin: {e}");
            return std::process::ExitCode::from(70);
        }
    };
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        tracing::error!(
            process = "guard",
            "cannot become the jobs' subreaper ({e}): a process whose parent exits is found only if it was noted before"
        );
    }
    let (incoming, threads) = start_threads(&sock);
    let mut watched = Watched::default();
    let mut ended = 0;
    // The process table is read once a second while jobs run, never once
    // per message: a thousand jobs starting at one instant are two thousand
    // messages, and a scan reads every /proc/PID/stat of the host.
    let every = std::time::Duration::from_secs(1);
    let mut last_scan = std::time::Instant::now();
    loop {
        // With no job running and none ended since the last look there is
        // nothing to scan: an idle guard sleeps until a message comes, not
        // once a second.
        let event = if watched.idle() {
            let event = incoming
                .recv()
                .map_err(|_| mpsc::RecvTimeoutError::Disconnected);
            // The first scan a second after the first job, as before.
            last_scan = std::time::Instant::now();
            event
        } else {
            incoming.recv_timeout(every.saturating_sub(last_scan.elapsed()))
        };
        match event {
            // Every reading thread says so once it read the end: a start
            // it was still making (its `Watch` comes first) is killed too.
            Ok(Event::End) => {
                ended += 1;
                if ended == threads {
                    break;
                }
            }
            Ok(event) => watched.apply(event),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if last_scan.elapsed() >= every {
            last_scan = std::time::Instant::now();
            watched.scan();
        }
    }
    let died = std::time::Instant::now();
    then(watched.daemon_gone(), died)
}

/// Starts the threads that read the daemon's requests and the reaper;
/// answers their events and how many reading threads there are (each says
/// [`Event::End`] once).
fn start_threads(sock: &Arc<OwnedFd>) -> (mpsc::Receiver<Event>, usize) {
    let (events, incoming) = mpsc::channel::<Event>();
    let reports = Arc::new(Mutex::new(Reports::default()));
    let (spawned, reaper_wakes) = mpsc::channel::<()>();
    // Four threads per CPU take requests (four to sixteen in all): a spawn
    // waits for its child to reach `exec`, and on a busy machine that child
    // waits for a CPU. Measured at 1,000 jobs on 2 CPUs (start p99, two runs
    // each): 1 thread 681-698 ms, 2: 574-582, 4: 493-540, 8: 499-504, 16:
    // 496-513, with the spawn floor at 405-483.
    let threads = std::thread::available_parallelism().map_or(8, |n| (4 * n.get()).clamp(4, 16));
    for _ in 0..threads {
        let (sock, events, reports, spawned) = (
            sock.clone(),
            events.clone(),
            reports.clone(),
            spawned.clone(),
        );
        std::thread::spawn(move || serve_requests(&sock, &events, &reports, &spawned));
    }
    drop(spawned);
    {
        let (sock, events, reports) = (sock.clone(), events.clone(), reports.clone());
        std::thread::spawn(move || reap(&sock, &events, &reports, &reaper_wakes));
    }
    (incoming, threads)
}

/// What the guard watches: the running jobs' process groups, the processes
/// noted below each, the orphans it adopted, and what to hand over if the
/// daemon dies.
#[derive(Default)]
struct Watched {
    groups: BTreeSet<i32>,
    succession: Succession,
    /// Per running job (process group): the processes noted below it, with
    /// their start times. Forgotten with the job, so a daemon a finished job
    /// left behind on purpose (`ssh -fN`, `tmux new -d`) is never killed
    /// later.
    known: BTreeMap<i32, BTreeMap<i32, u64>>,
    orphans: Orphans,
    /// The runs' systemd units.
    units: BTreeSet<String>,
    /// Jobs ended since the orphans were last looked at, with what was
    /// noted below each: the orphans adopted meanwhile count for them too.
    /// Looking once per job end read the guard's children a thousand
    /// times when a thousand jobs ended at one instant (most of the
    /// guard's CPU then); it is done with the scan, once a second.
    ended: Vec<(i32, BTreeMap<i32, u64>)>,
}

impl Watched {
    /// One event of the daemon's requests or the reaper (not
    /// [`Event::End`]).
    fn apply(&mut self, event: Event) {
        match event {
            Event::Watch(pgid, run) if pgid > 1 => {
                self.groups.insert(pgid);
                if let Some(run) = run {
                    self.succession.settle(&run.job, run.fence);
                    self.succession.runs.insert(pgid, *run);
                }
            }
            Event::Forget(pgid) => {
                // Orphans adopted until the next look count for this job
                // too; it is forgotten for them then ([`Watched::look`]).
                self.groups.remove(&pgid);
                let noted = self.known.remove(&pgid).unwrap_or_default();
                self.ended.push((pgid, noted));
                self.succession.runs.remove(&pgid);
            }
            Event::WatchUnit(unit, run) => {
                if let Some(run) = run {
                    self.succession.settle(&run.job, run.fence);
                    self.succession.unit_runs.insert(unit.clone(), *run);
                }
                self.units.insert(unit);
            }
            Event::ForgetUnit(unit) => {
                self.units.remove(&unit);
                self.succession.unit_runs.remove(&unit);
            }
            Event::Handover(handover) => {
                let mut handover = *handover;
                self.succession
                    .jobs
                    .extend(std::mem::take(&mut handover.jobs));
                self.succession.handover = Some(handover);
            }
            Event::Claimed(claims) => {
                for claim in claims {
                    self.succession.claimed(claim);
                }
            }
            Event::Settled(claims) => {
                for (job, fence) in claims {
                    self.succession.settle(&job, fence);
                }
            }
            Event::Bye => self.succession.bye = true,
            Event::Watch(..) | Event::End => {}
        }
    }

    /// Notes the orphans adopted since the last look, counting them for
    /// the jobs running and those ended since, which are then forgotten:
    /// an orphan counted only for ended jobs was left behind on purpose.
    fn look(&mut self) {
        // A pid that ended and already leads a new job (its number used
        // again) is that job's.
        let ended: Vec<(i32, BTreeMap<i32, u64>)> = std::mem::take(&mut self.ended)
            .into_iter()
            .filter(|(pgid, _)| !self.groups.contains(pgid))
            .collect();
        if ended.is_empty() && self.groups.is_empty() && !self.orphans.counts_any() {
            return;
        }
        // Counted as running for this look only.
        let mut pgids = Vec::with_capacity(ended.len());
        for (pgid, noted) in ended {
            self.groups.insert(pgid);
            self.known.insert(pgid, noted);
            pgids.push(pgid);
        }
        self.orphans.note(&self.groups, &self.known);
        for pgid in pgids {
            self.groups.remove(&pgid);
            self.known.remove(&pgid);
            self.orphans.forget(pgid);
        }
    }

    /// Nothing for [`Watched::scan`] to do: no job running, none ended
    /// since the last look.
    fn idle(&self) -> bool {
        self.groups.is_empty() && self.ended.is_empty()
    }

    /// Notes the processes below each running job, then looks at the
    /// orphans.
    fn scan(&mut self) {
        if self.groups.is_empty() {
            if !self.ended.is_empty() {
                self.look();
            }
            return;
        }
        let table = process_table();
        for pgid in &self.groups {
            let noted = self.known.entry(*pgid).or_default();
            noted.retain(|pid, start| table.get(pid).is_some_and(|p| p.start == *start));
            for pid in tree_of(&BTreeSet::from([*pgid]), &table) {
                if let Some(p) = table.get(&pid) {
                    noted.insert(pid, p.start);
                }
            }
        }
        self.look();
    }

    /// The daemon's end of the socket closed: kills what is left of the
    /// runs' process trees at once, and says what else there is to do.
    fn daemon_gone(mut self) -> Remains {
        self.look();
        let mut known: BTreeMap<i32, u64> = self.known.into_values().flatten().collect();
        known.extend(self.orphans.counted());
        let doomed = kill_trees(&self.groups, &known);
        Remains {
            doomed,
            units: self.units,
            succession: self.succession,
            died_at_ns: None,
        }
    }
}

/// What is left to do for a dead daemon once its runs' process trees are
/// killed: its runs' systemd units and cgroups to kill, then (unless it
/// said goodbye) its work to hand over. Passed from `cronlease-guard` to
/// `cronlease __guard --gone` ([`super::relay`]) as JSON.
#[derive(Serialize, Deserialize)]
pub(super) struct Remains {
    /// The processes killed (pid and start time), to wait for.
    pub(super) doomed: BTreeMap<i32, u64>,
    pub(super) units: BTreeSet<String>,
    pub(super) succession: Succession,
    /// When the daemon died, on `CLOCK_MONOTONIC` (ns), when passed on.
    #[serde(default)]
    pub(super) died_at_ns: Option<u64>,
}

impl Remains {
    /// Whether what is left needs more than `cronlease-guard` holds: a
    /// systemd unit to stop (over D-Bus) or work to hand over (the store).
    pub(super) fn needs_more(&self) -> bool {
        !self.units.is_empty() || (!self.succession.bye && self.succession.handover.is_some())
    }

    /// Kills the units and cgroups of the runs and, unless the daemon
    /// said goodbye, hands over once they are gone (daemon died at `died`).
    pub(super) fn finish(mut self, died: std::time::Instant) {
        // Its units too, and they must be gone before anything is handed
        // over (a peer would run beside them).
        let units_gone =
            self.units.is_empty() || crate::units::kill_and_wait(&self.units, GONE_WITHIN);
        if !units_gone {
            tracing::warn!(
                process = "guard",
                "the daemon died and units of its runs are still there after {GONE_WITHIN:?}: its leases are left to expire"
            );
        }
        // And each run's cgroup, with whatever got away from its group.
        let units_gone = units_gone && kill_cgroups();
        if units_gone
            && !self.succession.bye
            && let Some(handover) = self.succession.handover.take()
        {
            let mut runs: Vec<RunNote> = std::mem::take(&mut self.succession.runs)
                .into_values()
                .collect();
            runs.extend(std::mem::take(&mut self.succession.unit_runs).into_values());
            let (known, unstarted) = match hands_back() {
                true => (Some(self.succession.known()), self.succession.unstarted()),
                false => (None, Vec::new()),
            };
            hand_over(
                handover,
                &self.succession.jobs,
                Left {
                    runs,
                    unstarted,
                    known,
                },
                &self.doomed,
                died,
            );
        }
    }
}

/// Kills what is left in the runs' cgroups; true once they are empty.
pub(super) fn kill_cgroups() -> bool {
    let gone = crate::cgroup::kill_runs(GONE_WITHIN);
    if !gone {
        tracing::warn!(
            process = "guard",
            "the daemon died and processes of its runs' cgroups are still there after {GONE_WITHIN:?}: its leases are left to expire"
        );
    }
    gone
}

/// Waits until none of `doomed` (pid and start time) is alive any more,
/// at most `limit`; true if they all went.
pub(super) fn wait_gone(doomed: &BTreeMap<i32, u64>, limit: std::time::Duration) -> bool {
    let since = std::time::Instant::now();
    loop {
        let table = process_table();
        let alive = doomed
            .iter()
            .any(|(pid, start)| table.get(pid).is_some_and(|p| p.start == *start));
        if !alive {
            return true;
        }
        if since.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Sends one answer to the daemon (blocking: the guard's end of the socket
/// is in blocking mode). A daemon that is gone is noticed by the reader.
pub(super) fn answer(sock: &OwnedFd, answer: &Answer) {
    if let Ok(bytes) = serde_json::to_vec(answer) {
        let _ = rustix::net::send(sock, &bytes, SendFlags::NOSIGNAL);
    }
}

/// Which started jobs the daemon has heard of, and the exits of those it
/// has not yet: the daemon hears of a job's start before its exit.
#[derive(Default)]
pub(super) struct Reports {
    /// Jobs this guard started whose end is not reported yet; any other
    /// child it reaps is an adopted orphan, or a job whose spawn has not
    /// said its pid yet (while `spawning` is above 0).
    pub(super) ours: std::collections::HashSet<i32>,
    /// Spawns under way: begun, their child not in `ours` yet.
    pub(super) spawning: usize,
    pub(super) announced: std::collections::HashSet<i32>,
    /// Wait statuses of jobs reaped before their start was announced, and
    /// of children reaped while a spawn was under way (a job's, or an
    /// orphan's: dropped once no spawn is).
    pub(super) early: HashMap<i32, i32>,
}

impl Reports {
    /// A spawn is about to fork.
    pub(super) fn spawn_begins(&mut self) {
        self.spawning += 1;
    }

    /// A spawn that began is over, its child `pid` if it started one: an
    /// exit parked meanwhile for a pid not ours was an orphan's.
    pub(super) fn spawn_ends(&mut self, pid: Option<i32>) {
        if let Some(pid) = pid {
            self.ours.insert(pid);
        }
        self.spawning = self.spawning.saturating_sub(1);
        if self.spawning == 0 {
            let ours = &self.ours;
            self.early.retain(|pid, _| ours.contains(pid));
        }
    }
}

/// What follows a job's end: what it left in its process group is killed
/// (as the daemon does for a job it starts itself), the main loop forgets
/// the group, and the daemon hears the exit.
pub(super) fn report_exit(sock: &OwnedFd, events: &mpsc::Sender<Event>, pid: i32, status: i32) {
    let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    let _ = events.send(Event::Forget(pid));
    answer(
        sock,
        &Answer::Exited {
            pid: pid as u32,
            status,
        },
    );
}

/// A reading thread of the guard: starts jobs, notes the daemon's own.
pub(super) fn serve_requests(
    sock: &OwnedFd,
    events: &mpsc::Sender<Event>,
    reports: &Mutex<Reports>,
    spawned: &mpsc::Sender<()>,
) {
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let received = rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        let n = match received {
            Ok(msg) if msg.bytes > 0 => msg.bytes,
            Err(rustix::io::Errno::INTR) => continue,
            _ => break,
        };
        let mut fds: Vec<OwnedFd> = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        match serde_json::from_slice::<Request>(&buf[..n.min(buf.len())]) {
            Ok(Request::Start { id, launch, run }) => {
                // A start that fails is the daemon's to record
                // (`not_started`): its claim is settled either way.
                if let Some(r) = &run {
                    let _ = events.send(Event::Settled(vec![(r.job.clone(), r.fence)]));
                }
                let (Some(stderr), Some(stdout)) = (fds.pop(), fds.pop()) else {
                    answer(
                        sock,
                        &Answer::Failed {
                            id,
                            error: "the request came without the job's output pipes".into(),
                        },
                    );
                    continue;
                };
                let mut command = match launch.command() {
                    Ok(command) => command,
                    Err(error) => {
                        answer(sock, &Answer::Failed { id, error });
                        continue;
                    }
                };
                command
                    .stdout(Stdio::from(stdout))
                    .stderr(Stdio::from(stderr));
                let at_us = chrono::Utc::now().timestamp_micros();
                let lock = || reports.lock().unwrap_or_else(|e| e.into_inner());
                lock().spawn_begins();
                let spawn = command.spawn();
                lock().spawn_ends(spawn.as_ref().ok().map(|c| c.id() as i32));
                match spawn {
                    Ok(child) => {
                        let pid = child.id();
                        // Reaped by `reap`, not through this handle.
                        drop(child);
                        let run = run.map(|mut r| {
                            r.started_at = chrono::DateTime::from_timestamp_micros(at_us)
                                .unwrap_or(r.started_at);
                            Box::new(r)
                        });
                        let _ = events.send(Event::Watch(pid as i32, run));
                        let _ = spawned.send(());
                        let mut reports = reports.lock().unwrap_or_else(|e| e.into_inner());
                        answer(sock, &Answer::Started { id, pid, at_us });
                        match reports.early.remove(&(pid as i32)) {
                            Some(status) => {
                                reports.ours.remove(&(pid as i32));
                                report_exit(sock, events, pid as i32, status);
                            }
                            None => {
                                reports.announced.insert(pid as i32);
                            }
                        }
                    }
                    Err(e) => answer(
                        sock,
                        &Answer::Failed {
                            id,
                            error: e.to_string(),
                        },
                    ),
                }
            }
            Ok(Request::Watch { pgid, run }) => {
                let _ = events.send(Event::Watch(pgid, run.map(Box::new)));
            }
            Ok(Request::Handover(handover)) => {
                let _ = events.send(Event::Handover(handover));
            }
            Ok(Request::Bye) => {
                let _ = events.send(Event::Bye);
            }
            Ok(Request::Claimed { claims }) => {
                let _ = events.send(Event::Claimed(claims));
            }
            Ok(Request::Settled { claims }) => {
                let _ = events.send(Event::Settled(claims));
            }
            Ok(Request::Forget { pgid }) => {
                let _ = events.send(Event::Forget(pgid));
            }
            Ok(Request::WatchUnit { unit, run }) => {
                let _ = events.send(Event::WatchUnit(unit, run.map(Box::new)));
            }
            Ok(Request::ForgetUnit { unit }) => {
                let _ = events.send(Event::ForgetUnit(unit));
            }
            // Where, not what: a request holds the job's environment.
            Err(e) => tracing::error!(
                process = "guard",
                "a request it cannot read (line {}, column {})",
                e.line(),
                e.column()
            ),
        }
    }
    let _ = events.send(Event::End);
}

/// The guard's reaping thread: waits for every job it started and reports
/// its end ([`report_exit`]) once its start is announced; reaps the
/// orphans it adopted as their subreaper, and says nothing of them.
pub(super) fn reap(
    sock: &OwnedFd,
    events: &mpsc::Sender<Event>,
    reports: &Mutex<Reports>,
    wakes: &mpsc::Receiver<()>,
) {
    loop {
        let (pid, status) = match nix::sys::wait::wait() {
            Ok(WaitStatus::Exited(pid, code)) => (pid, code << 8),
            Ok(WaitStatus::Signaled(pid, signal, core)) => {
                (pid, signal as i32 | if core { 0x80 } else { 0 })
            }
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            // No child: sleep until the next start.
            Err(_) => {
                if wakes.recv().is_err() {
                    return;
                }
                while wakes.try_recv().is_ok() {}
                continue;
            }
        };
        let pid = pid.as_raw();
        let mut held = reports.lock().unwrap_or_else(|e| e.into_inner());
        if !held.ours.contains(&pid) {
            // A spawn under way may have forked this child and not said so
            // yet: kept until it does (or ends). With none under way, a
            // child not ours is an adopted orphan, reaped and forgotten.
            if held.spawning > 0 {
                held.early.insert(pid, status);
            }
            continue;
        }
        if held.announced.remove(&pid) {
            held.ours.remove(&pid);
            report_exit(sock, events, pid, status);
        } else {
            held.early.insert(pid, status);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::guard::handover::tests::claim;

    /// The ends of many jobs do not each look at the guard's children: the
    /// jobs ended wait for the next look (the scan), where an orphan found
    /// counts for them and for the jobs running, and is then counted for
    /// the running ones only; once they end too, it was left behind.
    #[test]
    fn jobs_ended_wait_for_the_next_look_and_their_orphans_count_for_the_jobs_still_running() {
        use std::io::BufRead;
        use std::os::unix::process::CommandExt;
        nix::sys::prctl::set_child_subreaper(true).unwrap();
        let mut watched = Watched::default();
        // B runs on; A leaves a process behind and exits.
        let mut b = Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        let b_pid = b.id() as i32;
        watched.apply(Event::Watch(b_pid, None));
        let mut a = Command::new("sh")
            .args(["-c", "sleep 30 >/dev/null & echo $!"])
            .process_group(0)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let a_pid = a.id() as i32;
        watched.apply(Event::Watch(a_pid, None));
        let mut line = String::new();
        std::io::BufReader::new(a.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let orphan: i32 = line.trim().parse().unwrap();
        assert!(a.wait().unwrap().success());
        // Adopted: its parent is this process now.
        let adopted = (0..500).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            proc_info(orphan).is_some_and(|p| p.ppid == std::process::id() as i32)
        });
        assert!(adopted, "the orphan was not adopted");
        // Many ends (A's among them): no look yet.
        watched.apply(Event::Forget(a_pid));
        for pgid in 1_000_000..1_000_500 {
            watched.apply(Event::Forget(pgid));
        }
        assert!(watched.orphans.counted.is_empty() && watched.orphans.released.is_empty());
        assert_eq!(watched.ended.len(), 501);
        // The scan looks: the orphan counts for B alone.
        watched.scan();
        assert!(watched.ended.is_empty());
        let counted: Vec<(i32, Vec<i32>)> = watched
            .orphans
            .counted
            .iter()
            .map(|(pid, (_, groups))| (*pid, groups.iter().copied().collect()))
            .collect();
        assert_eq!(counted, vec![(orphan, vec![b_pid])]);
        // B ends too: the orphan was left behind, never to be killed.
        b.kill().unwrap();
        b.wait().unwrap();
        watched.apply(Event::Forget(b_pid));
        watched.scan();
        assert!(watched.orphans.counted.is_empty());
        assert!(watched.orphans.released.contains_key(&orphan));
        let _ = nix::sys::signal::kill(Pid::from_raw(orphan), Signal::SIGKILL);
    }

    #[test]
    fn only_claims_neither_started_nor_settled_are_handed_back_whatever_the_order() {
        let mut s = Succession::default();
        // a: claimed, then started (its start came first: another thread).
        s.settle("a", 4);
        s.claimed(claim("a", 4, None));
        // b: claimed twice; the newer is not started, the older was.
        s.claimed(claim("b", 7, None));
        s.settle("b", 7);
        s.claimed(claim("b", 8, None));
        // c: settled without a run (skipped); d: claimed only.
        s.claimed(claim("c", 2, None));
        s.settle("c", 2);
        s.claimed(claim("d", 1, None));
        // An older claim told late does not hide the newer.
        s.claimed(claim("d", 0, None));
        let back: Vec<(String, u64)> = s
            .unstarted()
            .into_iter()
            .map(|c| (c.job, c.fence))
            .collect();
        assert_eq!(back, vec![("b".to_string(), 8), ("d".to_string(), 1)]);
    }
}
