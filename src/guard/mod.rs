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
//! sight, and the guard reaps it. Where systemd delegated the daemon's
//! cgroup, each run also has a cgroup of its own ([`crate::cgroup`]), and
//! the guard kills those too. Under systemd the unit's control group is
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
use crate::launch::Launch;
use crate::store::{MAX_REDELIVERIES, Outcome, Owner, RunRecord, StoreError, TriggerId, bounded};

mod client;
mod handover;
pub mod owed;
mod procs;
mod relay;
mod server;
pub use client::*;
use procs::*;
pub use relay::{resume, serve_small};
pub use server::*;

/// Largest message either side sends or reads: a job's command and
/// environment, or an answer.
const MAX_MESSAGE: usize = 256 * 1024;

/// Job names per [`Request::Handover`] message, and claims per
/// [`Request::Claimed`] or [`Request::Settled`]: 500 names of at most 128
/// bytes, with a claim's few fields each, stay far below [`MAX_MESSAGE`].
const HANDOVER_CHUNK: usize = 500;

/// How long the daemon waits for room on the socket for a note about its
/// claims ([`Guard::claimed`], [`Guard::settled`]) before it goes on
/// without it.
const NOTE_WITHIN: std::time::Duration = std::time::Duration::from_millis(100);

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
    /// A run the daemon started as a systemd unit: kill the unit if the
    /// daemon dies.
    WatchUnit { unit: String, run: Option<RunNote> },
    /// That unit ended.
    ForgetUnit { unit: String },
    /// What the guard needs to hand over for a daemon that dies (the store,
    /// the owner, job names to release); sent when the node starts and
    /// whenever its jobs or settings change. Names add up.
    Handover(Box<Handover>),
    /// Claims the daemon won, sent as their answers arrive, before any of
    /// them starts: one the daemon dies without starting (or settling) is
    /// handed back ([`handover::hand_over`]).
    Claimed { claims: Vec<RunNote> },
    /// Claims the daemon settled without starting a run (skipped, missed,
    /// not started, expired: their records are written): (job, fence).
    Settled { claims: Vec<(String, u64)> },
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
    /// Where the runs it records are owed their `on_failure` and events
    /// for the node's next daemon ([`owed`]); `None`: nowhere.
    #[serde(default)]
    pub owed_dir: Option<std::path::PathBuf>,
    /// The daemon's webhook spool, handed over to the store's outbox
    /// ([`crate::webhook::hand_over_spool`]); `None`: no webhooks.
    #[serde(default)]
    pub notify_dir: Option<std::path::PathBuf>,
}

/// A run, as history records it if the daemon dies while it goes; or a won
/// claim, as the guard hands it back if the daemon dies before starting it
/// (`started_at`: when its answer came).
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

/// Where a start request's pid (and start time), then its exit, go.
type StartWaiter = (
    oneshot::Sender<Result<(u32, i64), String>>,
    oneshot::Sender<ExitStatus>,
);
