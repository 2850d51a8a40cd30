//! The daemon's side: the guard process spawned at start ([`Guard`]),
//! asked to start runs, watch process groups and hand leases over, its
//! answers read on one task.

use super::*;

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
    pub(super) shared: Arc<Shared>,
    pub(super) child: Mutex<Child>,
}

pub(super) struct Shared {
    /// The daemon's end of the `SOCK_SEQPACKET` pair. tokio has no type
    /// for that kind of socket; its `UnixStream` serves here only to make
    /// the descriptor's readiness known to the runtime (every read and write
    /// is a `recv` or `sendmsg` of our own, whole messages).
    pub(super) sock: tokio::net::UnixStream,
    pub(super) next_id: AtomicU64,
    pub(super) waiting: Mutex<Waiting>,
    pub(super) gone: AtomicBool,
    /// The daemon is letting the guard go (it is stopping): its end is
    /// expected, not an error.
    pub(super) closing: AtomicBool,
}

/// Answers the daemon is waiting for.
#[derive(Default)]
pub(super) struct Waiting {
    /// Start requests by id: where to send the pid, then the exit.
    pub(super) starts: HashMap<u64, StartWaiter>,
    /// Started jobs by pid.
    pub(super) exits: HashMap<u32, oneshot::Sender<ExitStatus>>,
}

impl Guard {
    /// Starts the guard: `cronlease-guard` beside this executable, the
    /// small one ([`super::serve_small`]), else this executable in
    /// `__guard` mode. Must be called on a tokio runtime (it reads the
    /// guard's answers there).
    pub fn spawn() -> std::io::Result<Guard> {
        let (ours, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        rustix::io::ioctl_fionbio(&ours, true)?;
        let (program, args): (_, &[&str]) = match crate::launch::beside_this("cronlease-guard") {
            Some(small) => (small, &["__guard", env!("CARGO_PKG_VERSION")]),
            None => (
                std::env::current_exe().unwrap_or_else(|_| "/proc/self/exe".into()),
                &["__guard"],
            ),
        };
        let child = Command::new(program)
            .args(args)
            // The guard needs nothing from the daemon's environment, least of
            // all its secrets; the jobs it starts get the daemon's
            // environment less these, as `exec` says.
            .env_remove("CRONLEASE_STORE_URL")
            // It logs as the daemon does (text, JSON or the journal).
            .envs(crate::telemetry::guard_env())
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

    /// Lists a run started as a systemd unit, for killing (and recording)
    /// if the daemon dies.
    pub async fn watch_unit(&self, unit: &str, run: Option<&RunNote>) {
        self.note(Request::WatchUnit {
            unit: unit.to_string(),
            run: run.cloned(),
        })
        .await;
    }

    /// Takes such a unit off the list.
    pub async fn forget_unit(&self, unit: &str) {
        self.note(Request::ForgetUnit {
            unit: unit.to_string(),
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
            owed_dir,
            notify_dir,
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
                owed_dir: owed_dir.clone(),
                notify_dir: notify_dir.clone(),
            }));
            if self.shared.gone.load(Ordering::Relaxed)
                || self.shared.send(&message, &[]).await.is_err()
            {
                return false;
            }
        }
        true
    }

    /// Tells the guard of claims won (before any of them starts): those the
    /// daemon dies without starting or settling are handed back. Each
    /// message waits at most [`NOTE_WITHIN`] for room on the socket: a
    /// stuck guard must not hold the claims up (an untold claim is only
    /// lost if the daemon dies, as without a guard).
    pub async fn claimed(&self, claims: Vec<RunNote>) {
        for chunk in claims.chunks(HANDOVER_CHUNK) {
            self.note_within(Request::Claimed {
                claims: chunk.to_vec(),
            })
            .await;
        }
    }

    /// Tells the guard of claims settled without a run (their records
    /// about to be written, or a process the daemon starts itself): nothing
    /// to hand back for them. Bounded as [`Guard::claimed`].
    pub async fn settled(&self, claims: Vec<(String, u64)>) {
        for chunk in claims.chunks(HANDOVER_CHUNK) {
            self.note_within(Request::Settled {
                claims: chunk.to_vec(),
            })
            .await;
        }
    }

    /// [`Guard::note`], waiting at most [`NOTE_WITHIN`] for room on the
    /// socket.
    async fn note_within(&self, request: Request) {
        let _ = tokio::time::timeout(NOTE_WITHIN, self.note(request)).await;
    }

    /// Says the daemon starts `run` itself (the guard could not take the
    /// request): its claim is settled, never handed back. Not bounded: a
    /// claim handed back while its process runs would run twice.
    pub async fn starts_itself(&self, run: &RunNote) {
        self.note(Request::Settled {
            claims: vec![(run.job.clone(), run.fence)],
        })
        .await;
    }

    /// Says the daemon is stopping cleanly: nothing to hand over.
    pub async fn bye(&self) {
        self.note(Request::Bye).await;
    }

    /// Takes such a job off the list.
    pub async fn forget(&self, pgid: u32) {
        self.note(Request::Forget { pgid: pgid as i32 }).await;
    }

    pub(super) async fn note(&self, request: Request) {
        if !self.shared.gone.load(Ordering::Relaxed) {
            let _ = self.shared.send(&request, &[]).await;
        }
    }
}

impl Shared {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) async fn send(
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
pub(super) async fn read_answers(shared: Arc<Shared>) {
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
