//! The client's session: confirmed every quarter of its timeout, named in
//! each lease it takes, and each owner's live node (`live/<owner>~<session>`),
//! whose end ends the leases taken in that session.

use super::*;

/// A session of this store, for [`Locks::run_bound`].
pub(super) struct Session {
    pub(super) id: zk::SessionId,
    /// The negotiated session timeout.
    pub(super) timeout: Duration,
    /// The last confirmation of the session it replaced, if any. A lease
    /// taken in that session was sent no later (the claim's own reads
    /// confirmed it), so a lease sent by then may be that session's, whose
    /// live node is gone; one sent after is this session's.
    pub(super) earlier: Option<Instant>,
    /// Send time of the newest request the session got an answer to: the
    /// server heard from it no earlier, so it cannot end the session before
    /// this plus the timeout.
    pub(super) confirmed: Instant,
    /// Owners whose live node this session made.
    pub(super) live: HashSet<String>,
}

impl Session {
    pub(super) fn confirm(&mut self, id: zk::SessionId, sent: Instant) {
        if self.id == id && sent > self.confirmed {
            self.confirmed = sent;
        }
    }
}

/// The live node's name of `owner` in session `id`.
pub(super) fn live_name(owner: &str, id: zk::SessionId) -> String {
    format!("{owner}~{:016x}", id.0 as u64)
}

/// The session a lock node names is alive: its live node is in `live`
/// (the children of `live/`). A node naming no session counts by its lease
/// alone.
pub(super) fn session_alive(d: &LockData, live: Option<&HashSet<String>>) -> bool {
    match (&d.session, &d.owner, live) {
        (Some(session), Some(owner), Some(live)) => live.contains(&format!("{owner}~{session}")),
        _ => true,
    }
}

/// Confirms the client's session every quarter of its timeout, for as long
/// as the store and the session last. A quarter in which another request
/// was answered (a heartbeat, a claim) confirmed it already: then nothing
/// is sent.
pub(super) async fn keep_confirming(session: Weak<Mutex<Option<Session>>>, client: zk::Client) {
    let id = client.session_id();
    let every = (client.session_timeout() / 4).max(Duration::from_millis(10));
    let mut next = Instant::now() + every;
    loop {
        tokio::time::sleep_until(next).await;
        if client.state().is_terminated() {
            return;
        }
        let Some(confirmed) = confirmed_at(&session, id) else {
            return;
        };
        if confirmed + every > Instant::now() {
            next = confirmed + every;
            continue;
        }
        let sent = Instant::now();
        let answered = matches!(
            tokio::time::timeout(every, client.check_stat("/")).await,
            Ok(Ok(_))
        );
        let Some(slot) = session.upgrade() else {
            return;
        };
        let mut guard = lock(&slot);
        match guard.as_mut() {
            Some(s) if s.id == id => {
                if answered {
                    s.confirm(id, sent);
                }
            }
            // The store moved on to another session.
            _ => return,
        }
        next = Instant::now() + every;
    }
}

/// When session `id` was last confirmed; `None` once the store is gone or
/// in another session.
fn confirmed_at(session: &Weak<Mutex<Option<Session>>>, id: zk::SessionId) -> Option<Instant> {
    let slot = session.upgrade()?;
    let guard = lock(&slot);
    guard.as_ref().filter(|s| s.id == id).map(|s| s.confirmed)
}

impl ZkStore {
    /// The negotiated session timeout (the one asked for before a session).
    pub(super) fn session_timeout(&self) -> Duration {
        lock(&self.session)
            .as_ref()
            .map_or(self.target.session_timeout, |s| s.timeout)
    }

    /// Makes the live node of each of `owners` in the client's session, once
    /// per session, before any lock node names that session.
    pub(super) async fn ensure_live(
        &self,
        client: &zk::Client,
        owners: &[&str],
    ) -> Result<(), StoreError> {
        let id = client.session_id();
        let missing: Vec<&str> = {
            let guard = lock(&self.session);
            owners
                .iter()
                .copied()
                .filter(|o| {
                    guard
                        .as_ref()
                        .is_none_or(|s| s.id != id || !s.live.contains(*o))
                })
                .collect()
        };
        if missing.is_empty() {
            return Ok(());
        }
        let ephemeral = zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all());
        for owner in missing {
            let path = self.paths.under(&format!("live/{}", live_name(owner, id)));
            self.idempotent(client.create(&path, b"", &ephemeral), zk::Error::NodeExists)
                .await?;
            if let Some(s) = lock(&self.session).as_mut().filter(|s| s.id == id) {
                s.live.insert(owner.to_string());
            }
        }
        Ok(())
    }

    /// A request sent at `sent` in the client's session was answered.
    pub(super) fn confirmed(&self, client: &zk::Client, sent: Instant) {
        if let Some(s) = lock(&self.session).as_mut() {
            s.confirm(client.session_id(), sent);
        }
    }

    /// The session the client is in, as a lock node names it.
    pub(super) fn session_tag(client: &zk::Client) -> String {
        format!("{:016x}", client.session_id().0 as u64)
    }
}
