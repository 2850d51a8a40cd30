//! Starts the jobs and makes sure none outlives its daemon, even one killed
//! by SIGKILL.
//!
//! The daemon starts one small helper, `cronlease __guard`, joined to it by
//! a Unix socket pair (`SOCK_SEQPACKET`, one message per request). The guard
//! starts every job process for the daemon: the daemon sends the command,
//! its environment and the write ends of the job's stdout and stderr pipes
//! (`SCM_RIGHTS`); the guard spawns it in a new process group, answers with
//! its pid, reaps it when it ends and reports how it ended. The guard holds
//! a handful of file descriptors, so a spawn copies and closes a handful;
//! the daemon holds two pipes per running job and would make every new
//! child copy and close all of them (with a thousand jobs starting at one
//! instant that was a fifth of their start time).
//!
//! When the daemon dies, however it dies, the kernel closes the socket; the
//! guard reads end-of-file and SIGKILLs every job group still running, then
//! exits. This covers a job's whole process tree (its process group), which
//! a parent-death signal on the direct child would not, and needs no
//! `unsafe` `pre_exec` hook. Processes that left the job's group or session
//! are found by walking parent links from the group's members (see
//! [`serve`]). The guard is the jobs' child subreaper
//! (`PR_SET_CHILD_SUBREAPER`): a process whose parent exits (a double fork,
//! `setsid -f`) is adopted by the guard instead of by init, so it stays in
//! sight, and the guard reaps it. Under systemd the unit's control group is
//! the second line of defence. If the guard is gone the daemon starts jobs
//! itself (and says once that they would now outlive it).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::WaitStatus;
use nix::unistd::Pid;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use serde::{Deserialize, Serialize};
use tokio::io::Interest;
use tokio::sync::oneshot;

use crate::config::JobName;
use crate::exec::Launch;
use crate::store::{Outcome, Owner, RunRecord, StoreError, bounded};

/// Largest message either side sends or reads: a job's command and
/// environment, or an answer.
const MAX_MESSAGE: usize = 256 * 1024;

/// Job names per [`Request::Handover`] message: 500 names of at most 128
/// bytes stay far below [`MAX_MESSAGE`].
const HANDOVER_CHUNK: usize = 500;

/// How long the guard waits for a dead daemon's jobs to be gone before it
/// gives up handing over (a process stuck in the kernel): their leases then
/// expire as they would without a guard.
const GONE_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// What the daemon asks of the guard.
#[derive(Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    /// Start `launch` with the two file descriptors sent along as its
    /// stdout and stderr; answered by [`Answer::Started`] or
    /// [`Answer::Failed`], and later [`Answer::Exited`]. `run`: what
    /// history records if the daemon dies during it.
    Start {
        id: u64,
        launch: Launch,
        run: Option<RunNote>,
    },
    /// A job the daemon started itself: kill its group if the daemon dies.
    Watch { pgid: i32, run: Option<RunNote> },
    /// That job ended.
    Forget { pgid: i32 },
    /// What the guard needs to hand over for a daemon that dies (the store,
    /// the owner, job names to release); sent when the node starts and
    /// whenever its jobs or settings change. Names add up.
    Handover(Box<Handover>),
    /// The daemon is stopping cleanly: it recorded its runs and released
    /// its leases itself, nothing is to be handed over.
    Bye,
}

/// What the guard needs to hand a dead daemon's work over: where the store
/// is, whose leases to release, and how much history to keep.
#[derive(Serialize, Deserialize)]
pub struct Handover {
    pub store: crate::config::StoreHandover,
    pub owner: String,
    pub node: String,
    /// `store.history_limit`.
    pub keep: u32,
    /// Names of jobs whose leases the owner may hold (released
    /// owner-checked: another owner's lease is left alone).
    pub jobs: Vec<String>,
}

/// A run, as history records it if the daemon dies while it goes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunNote {
    pub job: String,
    pub fence: u64,
    pub occurrence: chrono::DateTime<chrono::Utc>,
    pub takeover: bool,
    pub decision_ms: u64,
    /// When it started (the guard knows for the jobs it starts itself).
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// A manual run's request id.
    #[serde(default)]
    pub trigger: Option<i64>,
}

/// What the guard tells the daemon.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Answer {
    /// `at_us`: the wall clock just before the spawn (µs since the epoch).
    Started {
        id: u64,
        pid: u32,
        at_us: i64,
    },
    Failed {
        id: u64,
        error: String,
    },
    /// A started job ended: its wait status, as `waitpid` gives it. What it
    /// left in its process group has been killed.
    Exited {
        pid: u32,
        status: i32,
    },
}

/// A job process started by the guard.
pub struct GuardedChild {
    pub pid: u32,
    /// The wall clock just before the guard spawned it.
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// How it ended; closed without a value if the guard died first.
    pub exit: oneshot::Receiver<ExitStatus>,
}

/// Why the guard did not start a job.
#[derive(Debug)]
pub enum StartError {
    /// The guard is gone (said once when it went): the daemon may start
    /// the job itself.
    Gone,
    /// The request never reached the guard (too large, say): the daemon
    /// may start the job itself.
    NotSent(String),
    /// The guard could not start the command, or ended before saying.
    Failed(String),
}

/// The daemon's handle on its guard process.
pub struct Guard {
    shared: Arc<Shared>,
    child: Mutex<Child>,
}

struct Shared {
    /// The daemon's end of the `SOCK_SEQPACKET` pair. tokio has no type
    /// for that kind of socket; its `UnixStream` serves here only to make
    /// the descriptor's readiness known to the runtime (every read and write
    /// is a `recv` or `sendmsg` of our own, whole messages).
    sock: tokio::net::UnixStream,
    next_id: AtomicU64,
    waiting: Mutex<Waiting>,
    gone: AtomicBool,
    /// The daemon is letting the guard go (it is stopping): its end is
    /// expected, not an error.
    closing: AtomicBool,
}

/// Where a start request's pid (and start time), then its exit, go.
type StartWaiter = (
    oneshot::Sender<Result<(u32, i64), String>>,
    oneshot::Sender<ExitStatus>,
);

/// Answers the daemon is waiting for.
#[derive(Default)]
struct Waiting {
    /// Start requests by id: where to send the pid, then the exit.
    starts: HashMap<u64, StartWaiter>,
    /// Started jobs by pid.
    exits: HashMap<u32, oneshot::Sender<ExitStatus>>,
}

impl Guard {
    /// Starts the guard: this same executable, in `__guard` mode. Must be
    /// called on a tokio runtime (it reads the guard's answers there).
    pub fn spawn() -> std::io::Result<Guard> {
        let (ours, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        rustix::io::ioctl_fionbio(&ours, true)?;
        let exe = std::env::current_exe().unwrap_or_else(|_| "/proc/self/exe".into());
        let child = Command::new(exe)
            .arg("__guard")
            // The guard needs nothing from the daemon's environment, least of
            // all its secrets; the jobs it starts get the daemon's
            // environment less these, as `exec` says.
            .env_remove("CRONLEASE_STORE_URL")
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()?;
        let shared = Arc::new(Shared {
            sock: tokio::net::UnixStream::from_std(std::os::unix::net::UnixStream::from(ours))?,
            next_id: AtomicU64::new(1),
            waiting: Mutex::new(Waiting::default()),
            gone: AtomicBool::new(false),
            closing: AtomicBool::new(false),
        });
        tokio::spawn(read_answers(shared.clone()));
        Ok(Guard {
            shared,
            child: Mutex::new(child),
        })
    }

    /// Has the guard start `launch` with `stdout` and `stderr` (the write
    /// ends of the job's pipes, closed here once sent).
    pub async fn start(
        &self,
        launch: &Launch,
        run: Option<&RunNote>,
        stdout: OwnedFd,
        stderr: OwnedFd,
    ) -> Result<GuardedChild, StartError> {
        if self.shared.gone.load(Ordering::Relaxed) {
            return Err(StartError::Gone);
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (started_tx, started) = oneshot::channel();
        let (exit_tx, exit) = oneshot::channel();
        self.shared.lock().starts.insert(id, (started_tx, exit_tx));
        let message = Request::Start {
            id,
            launch: launch.clone(),
            run: run.cloned(),
        };
        let sent = self
            .shared
            .send(&message, &[stdout.as_fd(), stderr.as_fd()])
            .await;
        drop((stdout, stderr));
        if let Err(e) = sent {
            self.shared.lock().starts.remove(&id);
            return Err(StartError::NotSent(e.to_string()));
        }
        match started.await {
            Ok(Ok((pid, at_us))) => Ok(GuardedChild {
                pid,
                started_at: chrono::DateTime::from_timestamp_micros(at_us).unwrap_or_default(),
                exit,
            }),
            Ok(Err(e)) => Err(StartError::Failed(e)),
            Err(_) => Err(StartError::Failed(
                "the job guard process ended before it said whether the command started".into(),
            )),
        }
    }

    /// Lists a job the daemon started itself, for killing (and recording)
    /// if the daemon dies.
    pub async fn watch(&self, pgid: u32, run: Option<&RunNote>) {
        self.note(Request::Watch {
            pgid: pgid as i32,
            run: run.cloned(),
        })
        .await;
    }

    /// Tells the guard what it needs to hand over if the daemon dies
    /// (several messages for many jobs). False if it did not get it.
    pub async fn hand_over(&self, handover: Handover) -> bool {
        let Handover {
            store,
            owner,
            node,
            keep,
            jobs,
        } = handover;
        let mut chunks: Vec<Vec<String>> = jobs
            .chunks(HANDOVER_CHUNK)
            .map(<[String]>::to_vec)
            .collect();
        if chunks.is_empty() {
            chunks.push(Vec::new());
        }
        for jobs in chunks {
            let message = Request::Handover(Box::new(Handover {
                store: store.clone(),
                owner: owner.clone(),
                node: node.clone(),
                keep,
                jobs,
            }));
            if self.shared.gone.load(Ordering::Relaxed)
                || self.shared.send(&message, &[]).await.is_err()
            {
                return false;
            }
        }
        true
    }

    /// Says the daemon is stopping cleanly: nothing to hand over.
    pub async fn bye(&self) {
        self.note(Request::Bye).await;
    }

    /// Takes such a job off the list.
    pub async fn forget(&self, pgid: u32) {
        self.note(Request::Forget { pgid: pgid as i32 }).await;
    }

    async fn note(&self, request: Request) {
        if !self.shared.gone.load(Ordering::Relaxed) {
            let _ = self.shared.send(&request, &[]).await;
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn send(
        &self,
        request: &Request,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(request).map_err(std::io::Error::other)?;
        if bytes.len() > MAX_MESSAGE {
            return Err(std::io::Error::other(format!(
                "the job's command and environment take {} bytes, more than the {MAX_MESSAGE} a request to the job guard may",
                bytes.len()
            )));
        }
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        self.sock
            .async_io(Interest::WRITABLE, || {
                let mut control = SendAncillaryBuffer::new(&mut space);
                if !fds.is_empty() {
                    control.push(SendAncillaryMessage::ScmRights(fds));
                }
                rustix::net::sendmsg(
                    &self.sock,
                    &[IoSlice::new(&bytes)],
                    &mut control,
                    SendFlags::NOSIGNAL,
                )
                .map_err(std::io::Error::from)
            })
            .await
            .map(|_| ())
    }
}

/// Reads the guard's answers until it goes away, then fails whatever was
/// waiting for one.
async fn read_answers(shared: Arc<Shared>) {
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let read = shared
            .sock
            .async_io(Interest::READABLE, || {
                rustix::net::recv(&shared.sock, &mut buf[..], RecvFlags::empty())
                    .map_err(std::io::Error::from)
            })
            .await;
        let n = match read {
            Ok((n, _)) if n > 0 => n,
            _ => break,
        };
        let Ok(answer) = serde_json::from_slice::<Answer>(&buf[..n]) else {
            tracing::error!("the job guard process sent a message this daemon cannot read");
            continue;
        };
        let mut waiting = shared.lock();
        match answer {
            Answer::Started { id, pid, at_us } => {
                if let Some((started, exit)) = waiting.starts.remove(&id) {
                    waiting.exits.insert(pid, exit);
                    let _ = started.send(Ok((pid, at_us)));
                }
            }
            Answer::Failed { id, error } => {
                if let Some((started, _)) = waiting.starts.remove(&id) {
                    let _ = started.send(Err(error));
                }
            }
            Answer::Exited { pid, status } => {
                if let Some(exit) = waiting.exits.remove(&pid) {
                    let _ = exit.send(ExitStatus::from_raw(status));
                }
            }
        }
    }
    shared.gone.store(true, Ordering::Relaxed);
    let mut waiting = shared.lock();
    waiting.starts.clear();
    waiting.exits.clear();
    drop(waiting);
    if !shared.closing.load(Ordering::Relaxed) {
        tracing::error!(
            "the job guard process is gone: jobs are now started by the daemon itself and would outlive it if it were killed by SIGKILL"
        );
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        // Shutting the socket down lets the guard exit; reap it so no zombie
        // is left.
        self.shared.closing.store(true, Ordering::Relaxed);
        let _ = rustix::net::shutdown(&self.shared.sock, rustix::net::Shutdown::Both);
        if let Ok(mut child) = self.child.lock() {
            let _ = child.wait();
        }
    }
}

/// What the guard's threads tell its main loop.
enum Event {
    /// A job's process group to kill if the daemon dies, and its run.
    Watch(i32, Option<Box<RunNote>>),
    Forget(i32),
    Handover(Box<Handover>),
    Bye,
    /// The daemon is gone.
    End,
}

/// What the guard hands over if the daemon dies without a [`Request::Bye`].
#[derive(Default)]
struct Succession {
    handover: Option<Handover>,
    /// Every job name told, for the owner-checked release.
    jobs: BTreeSet<String>,
    /// The runs going, by process group.
    runs: BTreeMap<i32, RunNote>,
    bye: bool,
}

/// The guard process itself: starts the jobs the daemon asks for, reaps
/// them, and when the daemon's end of the socket closes kills what is
/// left; if the daemon died (it did not say [`Request::Bye`]), it then
/// hands over ([`hand_over`]). Signals that would stop a daemon (INT from a terminal, TERM from
/// `pkill`) are ignored: the guard must outlive the daemon by a moment, and
/// ends exactly when the daemon's end closes the socket.
///
/// "What is left" is each running job's group and every process below its
/// members, also those that left the group or the session (`setsid cmd &`):
/// they still hang below the job's process by their parent links. While jobs
/// run, the guard also notes their descendants every second. A process
/// whose parent exits is adopted by the guard (its subreaper) and counts
/// for the job it was noted under, or, adopted before any note, for every
/// job running then ([`Orphans`]); one adopted while no job ran, or whose
/// jobs have all ended, was left behind on purpose and is never killed.
pub fn serve() -> std::process::ExitCode {
    let ignored = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
        signal_hook::consts::SIGUSR1,
        signal_hook::consts::SIGQUIT,
    ] {
        let _ = signal_hook::flag::register(sig, ignored.clone());
    }
    let sock = match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(sock) => Arc::new(sock),
        Err(e) => {
            eprintln!("cronlease __guard: no socket on stdin: {e}");
            return std::process::ExitCode::from(70);
        }
    };
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        eprintln!(
            "cronlease __guard: cannot become the jobs' subreaper ({e}): a process whose parent exits is found only if it was noted before"
        );
    }
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
    drop(events);
    let mut groups = BTreeSet::new();
    let mut succession = Succession::default();
    let mut ended = 0;
    // Per running job (process group): the processes noted below it, with
    // their start times. Forgotten with the job, so a daemon a finished job
    // left behind on purpose (`ssh -fN`, `tmux new -d`) is never killed later.
    let mut known: BTreeMap<i32, BTreeMap<i32, u64>> = BTreeMap::new();
    let mut orphans = Orphans::default();
    // The process table is read once a second while jobs run, never once
    // per message: a thousand jobs starting at one instant are two thousand
    // messages, and a scan reads every /proc/PID/stat of the host.
    let every = std::time::Duration::from_secs(1);
    let mut last_scan = std::time::Instant::now();
    loop {
        let wait = every.saturating_sub(last_scan.elapsed());
        match incoming.recv_timeout(wait) {
            Ok(Event::Watch(pgid, run)) if pgid > 1 => {
                groups.insert(pgid);
                if let Some(run) = run {
                    succession.runs.insert(pgid, *run);
                }
            }
            Ok(Event::Forget(pgid)) => {
                // Orphans adopted since the last look count for this job
                // too, until it is forgotten here.
                if orphans.counts_any() || !groups.is_empty() {
                    orphans.note(&groups, &known);
                }
                orphans.forget(pgid);
                groups.remove(&pgid);
                known.remove(&pgid);
                succession.runs.remove(&pgid);
            }
            Ok(Event::Handover(handover)) => {
                let mut handover = *handover;
                succession.jobs.extend(std::mem::take(&mut handover.jobs));
                succession.handover = Some(handover);
            }
            Ok(Event::Bye) => succession.bye = true,
            Ok(Event::Watch(..)) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            // Every reading thread says so once it read the end: a start
            // it was still making (its `Watch` comes first) is killed too.
            Ok(Event::End) => {
                ended += 1;
                if ended == threads {
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if last_scan.elapsed() < every {
            continue;
        }
        last_scan = std::time::Instant::now();
        if !groups.is_empty() {
            let table = process_table();
            for pgid in &groups {
                let noted = known.entry(*pgid).or_default();
                noted.retain(|pid, start| table.get(pid).is_some_and(|p| p.start == *start));
                for pid in tree_of(&BTreeSet::from([*pgid]), &table) {
                    if let Some(p) = table.get(&pid) {
                        noted.insert(pid, p.start);
                    }
                }
            }
            orphans.note(&groups, &known);
        }
    }
    let died = std::time::Instant::now();
    orphans.note(&groups, &known);
    let mut known: BTreeMap<i32, u64> = known.into_values().flatten().collect();
    known.extend(orphans.counted());
    let doomed = kill_trees(&groups, &known);
    if !succession.bye {
        if let Some(handover) = succession.handover.take() {
            let runs = std::mem::take(&mut succession.runs).into_values().collect();
            hand_over(handover, &succession.jobs, runs, &doomed, died);
        }
    }
    std::process::ExitCode::SUCCESS
}

/// The daemon died without releasing: once its jobs' processes are gone,
/// records the runs they were `killed`, releases the owner's leases
/// (owner-checked) and takes the owner out of the node registry, so peers
/// claim the next occurrences at once. A store that cannot be reached is
/// said once; the leases then expire as they would without a guard.
fn hand_over(
    handover: Handover,
    jobs: &BTreeSet<String>,
    runs: Vec<RunNote>,
    doomed: &BTreeMap<i32, u64>,
    died: std::time::Instant,
) {
    if !wait_gone(doomed, GONE_WITHIN) {
        eprintln!(
            "cronlease __guard: the daemon died and processes of its jobs are still there after {GONE_WITHIN:?}: its leases are left to expire"
        );
        return;
    }
    let finished_at = chrono::Utc::now();
    let Handover {
        store,
        owner,
        node,
        keep,
        ..
    } = handover;
    let records: Vec<RunRecord> = runs
        .into_iter()
        .map(|r| RunRecord {
            delay_ms: (r.started_at - r.occurrence).num_milliseconds().max(0) as u64,
            job: r.job,
            fence: r.fence,
            owner: owner.clone(),
            node: node.clone(),
            occurrence: r.occurrence,
            started_at: r.started_at,
            finished_at,
            outcome: Outcome::Killed,
            exit_code: Some(128 + Signal::SIGKILL as i32),
            takeover: r.takeover,
            decision_ms: r.decision_ms,
            output: String::new(),
            trigger: r.trigger.and_then(crate::store::TriggerId::from_stored),
        })
        .collect();
    let jobs: Vec<JobName> = jobs.iter().filter_map(|j| JobName::parse(j).ok()).collect();
    let owner = Owner::from_raw(owner);
    let config = store.into_config();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("cronlease __guard: the daemon died; cannot hand over: {e}");
            return;
        }
    };
    let handed = runtime.block_on(async {
        let within = config.op_timeout;
        // Bounded like every call: a store that accepts the connection and
        // never answers must not keep the guard (and the host's view of
        // the daemon) alive.
        let store = bounded(within, crate::store::connect(&config))
            .await
            .map_err(|e| format!("connecting: {e}"))?;
        let call = |what: &'static str| move |e: StoreError| format!("{what}: {e}");
        let recorded = match records.is_empty() {
            true => Ok(()),
            false => bounded(within, store.record_runs(&records, keep))
                .await
                .map_err(call("recording its runs")),
        };
        // Released whether or not the history write went through: the
        // jobs are gone, nothing runs on these leases any more.
        let released = bounded(within, store.release(&jobs, &owner))
            .await
            .map_err(call("releasing its leases"))?;
        let _ = bounded(within, store.leave(&owner)).await;
        recorded.map(|()| released)
    });
    let took = died.elapsed().as_millis();
    match handed {
        Ok(released) => eprintln!(
            "cronlease __guard: the daemon died: {} interrupted runs recorded killed, {released} leases released, {took} ms after its death",
            records.len()
        ),
        Err(e) => eprintln!(
            "cronlease __guard: the daemon died; handing over failed after {took} ms ({e}): its leases expire as they would without a guard"
        ),
    }
}

/// Waits until none of `doomed` (pid and start time) is alive any more,
/// at most `limit`; true if they all went.
fn wait_gone(doomed: &BTreeMap<i32, u64>, limit: std::time::Duration) -> bool {
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
fn answer(sock: &OwnedFd, answer: &Answer) {
    if let Ok(bytes) = serde_json::to_vec(answer) {
        let _ = rustix::net::send(sock, &bytes, SendFlags::NOSIGNAL);
    }
}

/// Which started jobs the daemon has heard of, and the exits of those it
/// has not yet: the daemon hears of a job's start before its exit.
#[derive(Default)]
struct Reports {
    /// Jobs this guard started whose end is not reported yet; any other
    /// child it reaps is an adopted orphan, or a job whose spawn has not
    /// said its pid yet (while `spawning` is above 0).
    ours: std::collections::HashSet<i32>,
    /// Spawns under way: begun, their child not in `ours` yet.
    spawning: usize,
    announced: std::collections::HashSet<i32>,
    /// Wait statuses of jobs reaped before their start was announced, and
    /// of children reaped while a spawn was under way (a job's, or an
    /// orphan's: dropped once no spawn is).
    early: HashMap<i32, i32>,
}

impl Reports {
    /// A spawn is about to fork.
    fn spawn_begins(&mut self) {
        self.spawning += 1;
    }

    /// A spawn that began is over, its child `pid` if it started one: an
    /// exit parked meanwhile for a pid not ours was an orphan's.
    fn spawn_ends(&mut self, pid: Option<i32>) {
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
fn report_exit(sock: &OwnedFd, events: &mpsc::Sender<Event>, pid: i32, status: i32) {
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
fn serve_requests(
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
            Ok(Request::Forget { pgid }) => {
                let _ = events.send(Event::Forget(pgid));
            }
            // Where, not what: a request holds the job's environment.
            Err(e) => eprintln!(
                "cronlease __guard: a request it cannot read (line {}, column {})",
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
fn reap(
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

/// One process as `/proc/PID/stat` tells it.
#[derive(Debug, Clone, Copy)]
struct ProcInfo {
    ppid: i32,
    pgrp: i32,
    /// Start time (clock ticks since boot): tells a reused pid apart.
    start: u64,
}

fn process_table() -> BTreeMap<i32, ProcInfo> {
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
fn proc_info(pid: i32) -> Option<ProcInfo> {
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
fn own_children() -> BTreeSet<i32> {
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
struct Orphans {
    /// pid → its start time and the job groups it counts for.
    counted: BTreeMap<i32, (u64, BTreeSet<i32>)>,
    /// pid → start time: left behind, never killed.
    released: BTreeMap<i32, u64>,
}

impl Orphans {
    /// Looks at the guard's children: notes the orphans adopted since the
    /// last look, forgets those gone. `groups`: the running jobs (whose
    /// leaders are children too); `known`: what was noted under each.
    fn note(&mut self, groups: &BTreeSet<i32>, known: &BTreeMap<i32, BTreeMap<i32, u64>>) {
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
    fn forget(&mut self, pgid: i32) {
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

    fn counts_any(&self) -> bool {
        !self.counted.is_empty()
    }

    /// The orphans that die with the running jobs, with their start times.
    fn counted(&self) -> impl Iterator<Item = (i32, u64)> + '_ {
        self.counted.iter().map(|(pid, (start, _))| (*pid, *start))
    }
}

/// Members of `groups` and every process below them, the guard excluded.
fn tree_of(groups: &BTreeSet<i32>, table: &BTreeMap<i32, ProcInfo>) -> BTreeSet<i32> {
    let members = table
        .iter()
        .filter(|(_, p)| groups.contains(&p.pgrp))
        .map(|(pid, _)| *pid)
        .collect();
    with_descendants(members, table)
}

/// `roots` and every process below them by parent links, the guard excluded.
fn with_descendants(mut tree: BTreeSet<i32>, table: &BTreeMap<i32, ProcInfo>) -> BTreeSet<i32> {
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
fn kill_trees(groups: &BTreeSet<i32>, known: &BTreeMap<i32, u64>) -> BTreeMap<i32, u64> {
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
