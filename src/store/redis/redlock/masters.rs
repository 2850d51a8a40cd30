//! The masters: each one's connection and life (answering, failing,
//! restarted empty and quarantined), and calls sent to all of them at once
//! with the answers of a majority kept.

use super::*;

/// One independent master and what this node knows of its life.
pub(super) struct Master {
    pub(super) url: StoreUrl,
    pub(super) conn: Connection,
    pub(super) life: std::sync::Mutex<Life>,
}

#[derive(Default)]
pub(super) struct Life {
    pub(super) run_id: Option<String>,
    /// When the master started, by its `uptime_in_seconds` (rounded down, so
    /// never earlier than it did): whoever started after it knows too.
    pub(super) started_at: Option<Instant>,
    /// Since when calls to it fail (logged once when it starts and ends).
    pub(super) failing_since: Option<Instant>,
}

impl Master {
    pub(super) fn life(&self) -> std::sync::MutexGuard<'_, Life> {
        crate::store::lock(&self.life)
    }

    pub(super) async fn connection(
        &self,
        op_timeout: Duration,
    ) -> Result<ConnectionManager, StoreError> {
        self.conn
            .get(manager_config(op_timeout))
            .await
            .map_err(|e| store_error(&self.url, &e))
    }

    /// Reads `run_id` and `uptime_in_seconds` from `INFO server`: when the
    /// master started, and whether it restarted since last seen.
    pub(super) fn observe(&self, info: &str) {
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.trim().strip_prefix(name).map(str::to_string))
        };
        let run_id = field("run_id:");
        let uptime = field("uptime_in_seconds:").and_then(|u| u.parse::<u64>().ok());
        let mut life = self.life();
        if let Some(up) = uptime {
            let now = Instant::now();
            life.started_at = Some(now.checked_sub(Duration::from_secs(up)).unwrap_or(now));
        }
        let Some(run_id) = run_id else {
            return;
        };
        if life.run_id.as_deref().is_some_and(|known| known != run_id) {
            tracing::warn!(
                master = %self.url,
                "Redis master restarted (its run_id changed): it may have lost leases and fences, so it counts in no quorum until it has been up for one lease length of each job"
            );
        }
        life.run_id = Some(run_id);
    }

    pub(super) fn answered(&self) {
        if let Some(since) = self.life().failing_since.take() {
            tracing::info!(master = %self.url, "Redis master answers again after {:?}", since.elapsed());
        }
    }

    pub(super) fn failed(&self, e: &StoreError) {
        let mut life = self.life();
        if life.failing_since.is_none() {
            life.failing_since = Some(Instant::now());
            tracing::warn!(master = %self.url, "Redis master does not answer ({e}): claims go on while a majority does");
        }
    }
}

/// The masters a call waits for. When the call ends, or its caller gives up
/// on it (the node gives a call `op_timeout`), without a majority having
/// answered and after at least half of `op_timeout`, each master that did
/// not answer is failing, and its connection is made anew on the next call
/// (see [`Connection`]: after a partition it would wait for TCP's backoff).
/// A master left behind once a majority answered is slow, not failing.
struct Waiting<'a> {
    store: &'a RedlockStore,
    started: Instant,
    answered: Vec<bool>,
    majority: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let waited = self.started.elapsed();
        if self.majority || waited < self.store.op_timeout / 2 {
            return;
        }
        for (master, answered) in self.store.masters.iter().zip(&self.answered) {
            if !answered {
                master.failed(&StoreError::Timeout(waited));
                master.conn.forget();
            }
        }
    }
}

/// [`eval_loading`] on `master`, once more if the connection broke (the
/// master restarted: the manager connects again, and every script of the
/// pipeline may run twice). Not after a timeout: sent again on the same
/// connection, it would wait behind the first.
pub(super) async fn send_loading(
    master: &Master,
    conn: &mut ConnectionManager,
    scripts: &[&Script],
    lead: usize,
    count: usize,
    build: impl Fn(&[usize]) -> redis::Pipeline,
) -> Result<Vec<redis::Value>, StoreError> {
    match eval_loading(conn, scripts, lead, count, &build).await {
        Err(e) if (e.is_connection_dropped() || e.is_io_error()) && !e.is_timeout() => {
            eval_loading(conn, scripts, lead, count, &build).await
        }
        other => other,
    }
    .map_err(|e| store_error(&master.url, &e))
}

/// One reply of a pipeline of scripts, decoded: the server's error, or
/// why it is not a `T`, or missing.
pub(super) fn reply_of<T: redis::FromRedisValue>(
    master: &Master,
    reply: Option<redis::Value>,
) -> Result<T, StoreError> {
    match reply {
        Some(redis::Value::ServerError(e)) => {
            Err(store_error(&master.url, &redis::RedisError::from(e)))
        }
        Some(reply) => decoded(master, reply),
        None => Err(StoreError::Backend {
            store: master.url.redacted().into(),
            reason: "a script's reply is missing".into(),
        }),
    }
}

/// One reply of a pipeline, decoded.
pub(super) fn decoded<T: redis::FromRedisValue>(
    master: &Master,
    v: redis::Value,
) -> Result<T, StoreError> {
    redis::from_redis_value(v).map_err(|e| StoreError::Backend {
        store: master.url.redacted().into(),
        reason: format!("unexpected reply: {e}"),
    })
}

impl RedlockStore {
    /// How many masters make a majority.
    pub(super) fn majority(&self) -> usize {
        self.masters.len() / 2 + 1
    }

    /// Whether `master` may count in a quorum for a lease of `lease`: not
    /// while it has been up for less than that (it may have restarted and
    /// lost leases and fences).
    pub(super) fn counts(&self, master: &Master, lease: Duration) -> bool {
        !self.quarantine
            || master
                .life()
                .started_at
                .is_none_or(|t| t.elapsed() >= lease)
    }

    /// How long answers of a majority that do not decide a call wait for
    /// the other masters: a quarter of `op_timeout`.
    pub(super) fn unsettled_wait(&self) -> Duration {
        self.op_timeout / 4
    }

    pub(super) fn unavailable(&self, reason: String) -> StoreError {
        StoreError::Unavailable {
            store: self.url.redacted().into(),
            reason,
        }
    }

    /// Runs `call` on every master at once. Waits for all answers, but once
    /// a majority answered, no longer than [`STRAGGLER_WAIT`] for the rest,
    /// and never past `op_timeout`; `None` for a master that did not answer
    /// in time.
    pub(super) async fn each<'a, T, F, Fut>(&'a self, call: F) -> Vec<Option<Result<T, StoreError>>>
    where
        F: Fn(&'a Master) -> Fut,
        Fut: Future<Output = Result<T, StoreError>> + 'a,
    {
        self.each_until(call, |_| true).await
    }

    /// [`RedlockStore::each`], with the wait for stragglers starting only
    /// once a majority answered **and** `settled` says the answers so far
    /// decide everything the call asked. Answers of a majority that do not
    /// (a split vote) wait for the other masters, whose answers could still
    /// decide it, at most [`RedlockStore::unsettled_wait`] longer: the
    /// split is then cheaper to try again than a master whose replies are
    /// lost is to wait for (the node gives the whole call `op_timeout`).
    pub(super) async fn each_until<'a, T, F, Fut>(
        &'a self,
        call: F,
        settled: impl Fn(&[Option<Result<T, StoreError>>]) -> bool,
    ) -> Vec<Option<Result<T, StoreError>>>
    where
        F: Fn(&'a Master) -> Fut,
        Fut: Future<Output = Result<T, StoreError>> + 'a,
    {
        let mut pending: FuturesUnordered<_> = self
            .masters
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let fut = call(m);
                async move { (i, fut.await) }
            })
            .collect();
        let mut answers: Vec<Option<Result<T, StoreError>>> =
            self.masters.iter().map(|_| None).collect();
        let mut waiting = Waiting {
            store: self,
            started: Instant::now(),
            answered: vec![false; self.masters.len()],
            majority: false,
        };
        let mut deadline = waiting.started + self.op_timeout;
        let mut ok = 0;
        loop {
            tokio::select! {
                next = pending.next() => {
                    let Some((i, answer)) = next else { break };
                    let master = &self.masters[i];
                    // A timeout or a connection that failed is no answer.
                    waiting.answered[i] = match &answer {
                        Ok(_) => {
                            master.answered();
                            ok += 1;
                            true
                        }
                        Err(e) if e.is_unreachable() => {
                            master.failed(e);
                            false
                        }
                        Err(_) => true,
                    };
                    answers[i] = Some(answer);
                    if ok >= self.majority() {
                        // The unsettled wait starts once, with the majority.
                        let wait = if settled(&answers) {
                            Some(STRAGGLER_WAIT)
                        } else {
                            (!waiting.majority).then(|| self.unsettled_wait())
                        };
                        if let Some(wait) = wait {
                            deadline = deadline.min(Instant::now() + wait);
                        }
                        waiting.majority = true;
                    }
                }
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        answers
    }

    /// One script on one master, behind `INFO server` (to see a restart).
    pub(super) async fn eval_on<T: redis::FromRedisValue>(
        &self,
        master: &Master,
        script: &Script,
        keys: &[String],
        args: &[String],
    ) -> Result<T, StoreError> {
        let [reply] = self
            .evals_on::<1, T>(master, [(script, keys, args)])
            .await?;
        reply
    }

    /// `N` scripts on one master in one pipeline, behind `INFO server` (to
    /// see a restart): each script's reply, decoded, or why not. An error
    /// for the whole call when the master did not answer.
    pub(super) async fn evals_on<const N: usize, T: redis::FromRedisValue>(
        &self,
        master: &Master,
        calls: [(&Script, &[String], &[String]); N],
    ) -> Result<[Result<T, StoreError>; N], StoreError> {
        let mut conn = master.connection(self.op_timeout).await?;
        let build = |which: &[usize]| {
            let mut pipe = redis::pipe();
            pipe.cmd("INFO").arg("server");
            for &i in which {
                add_evalsha(&mut pipe, calls[i]);
            }
            pipe
        };
        let scripts = self.scripts();
        let replies = send_loading(master, &mut conn, &scripts, 1, N, build).await?;
        let malformed = |reason: String| StoreError::Backend {
            store: master.url.redacted().into(),
            reason,
        };
        if replies.len() != N + 1 {
            return Err(malformed(format!(
                "{} replies to INFO and {N} scripts",
                replies.len()
            )));
        }
        let mut replies = replies.into_iter();
        let info: String = replies
            .next()
            .map(redis::from_redis_value)
            .transpose()
            .map_err(|e| malformed(format!("unexpected reply to INFO: {e}")))?
            .unwrap_or_default();
        master.observe(&info);
        Ok(std::array::from_fn(|_| reply_of(master, replies.next())))
    }

    /// A command without arguments on one master.
    pub(super) async fn cmd_on<T: redis::FromRedisValue>(
        &self,
        master: &Master,
        name: &'static str,
    ) -> Result<T, StoreError> {
        let mut conn = master.connection(self.op_timeout).await?;
        redis::cmd(name)
            .query_async(&mut conn)
            .await
            .map_err(|e| store_error(&master.url, &e))
    }

    /// The answers of those that answered, or an error when fewer than a
    /// majority did.
    pub(super) fn quorum<T>(
        &self,
        answers: Vec<Option<Result<T, StoreError>>>,
    ) -> Result<Vec<(usize, T)>, StoreError> {
        let mut ok = Vec::new();
        let mut last_error = None;
        for (i, a) in answers.into_iter().enumerate() {
            match a {
                Some(Ok(v)) => ok.push((i, v)),
                Some(Err(e)) => last_error = Some(e),
                None => {}
            }
        }
        if ok.len() >= self.majority() {
            return Ok(ok);
        }
        let why = last_error.map_or_else(|| "no answer in time".to_string(), |e| e.to_string());
        Err(self.unavailable(format!(
            "{} of {} Redis masters answered; a majority ({}) must ({why})",
            ok.len(),
            self.masters.len(),
            self.majority()
        )))
    }
}
