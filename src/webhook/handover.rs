//! Deliveries handed over (docs/protocol.md, "Webhook deliveries handed
//! over"): what a node could not deliver before it stopped goes to the
//! store's outbox ([`crate::store::outbox`]), and a node with webhooks
//! takes it from there and sends it, with the same `X-Cronlease-Delivery`
//! id, its tries and its age, so each event is still sent by one node of
//! the cluster.
//!
//! - A daemon that stops hands over what is left in its queue once its
//!   sender stopped ([`Webhooks::hand_over_left`]); a store that cannot
//!   take them leaves them in the spool for this node's next daemon.
//! - A dead daemon's guard hands over its spool ([`hand_over_spool`]),
//!   holding the spool's lock, which a daemon holds while it sends: a
//!   next daemon started meanwhile waits for it ([`lock_spool`]).
//! - Every node with webhooks takes, every [`TAKE_EVERY`], the parcels
//!   of the webhooks it has (a parcel's id starts with its webhook's name)
//!   ([`Webhooks::collect`]), spools each before sending it, and gives up
//!   one older than [`super::MAX_AGE`].

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::spool::Pending;
use super::{MAX_AGE, MAX_PENDING, Webhooks, now_ms};
use crate::spool::{Spool, SpoolLock, Spooled as _};
use crate::store::outbox::TAKE_AT_MOST;
use crate::store::{Owner, Parcel, Store, bounded};

/// How often a node with webhooks looks for deliveries handed over.
pub const TAKE_EVERY: Duration = Duration::from_secs(5);

/// Calls taking one webhook's deliveries in a row, at most (then the next
/// look, [`TAKE_EVERY`] later).
const TAKES_AT_ONCE: usize = 20;

/// How long a starting daemon waits for a guard handing over its spool.
const LOCK_WAIT: Duration = Duration::from_secs(30);

/// Why a delivery could not go through the outbox, or the guard could not
/// hand a spool over.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("cannot write it as JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("its id {0:?} does not match what it holds")]
    Mismatch(String),
    #[error("cannot lock {dir}: {source}")]
    Lock {
        dir: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{handed} handed over, then the store failed: {source}")]
    Store {
        handed: usize,
        source: crate::store::StoreError,
    },
}

impl Pending {
    /// As the outbox keeps it: `WEBHOOK~` (the prefix its takers ask
    /// for), when it was spooled and its delivery id (`JOB-FENCE-EVENT`):
    /// at most 64 + 1 + 13 + 1 + 161 bytes; and its JSON.
    pub fn parcel(&self) -> Result<Parcel, HandoverError> {
        let id = format!(
            "{}{:013}-{}",
            prefix_of(&self.target),
            self.created_ms.max(0),
            self.event.delivery
        );
        let body = serde_json::to_string(self)?;
        Ok(Parcel { id, body })
    }

    /// A delivery taken from the outbox.
    pub fn of_parcel(parcel: &Parcel) -> Result<Pending, HandoverError> {
        let p: Pending = serde_json::from_str(&parcel.body)?;
        if p.parcel()?.id != parcel.id {
            return Err(HandoverError::Mismatch(parcel.id.clone()));
        }
        Ok(p)
    }
}

/// The id prefix of `webhook`'s deliveries (`~` is in no webhook name).
fn prefix_of(webhook: &str) -> String {
    format!("{webhook}~")
}

/// `pending` as parcels, and the deliveries they are; one that cannot go
/// through the outbox (said in a WARN) stays where it is.
fn parcels_of(pending: &[Pending]) -> (Vec<Parcel>, Vec<&Pending>) {
    let mut parcels = Vec::with_capacity(pending.len());
    let mut of = Vec::with_capacity(pending.len());
    for p in pending {
        match p.parcel() {
            Ok(parcel) if Parcel::id_is_valid(&parcel.id) => {
                parcels.push(parcel);
                of.push(p);
            }
            Ok(parcel) => {
                tracing::warn!(webhook = %p.target, delivery = %p.event.delivery, "webhook delivery not handed over: its id ({} bytes) is not one the store keeps", parcel.id.len());
            }
            Err(e) => {
                tracing::warn!(webhook = %p.target, delivery = %p.event.delivery, "webhook delivery not handed over: {e}");
            }
        }
    }
    (parcels, of)
}

/// Takes `spool`'s lock, waiting up to [`LOCK_WAIT`] for a guard that
/// hands over what a dead daemon left in it. `None` (said in a WARN) when
/// it could not: the spool is used all the same.
pub async fn lock_spool(spool: &Spool) -> Option<SpoolLock> {
    let until = tokio::time::Instant::now() + LOCK_WAIT;
    let mut said = false;
    loop {
        let s = spool.clone();
        let tried = tokio::task::spawn_blocking(move || s.try_lock())
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        match tried {
            Ok(Some(lock)) => return Some(lock),
            Ok(None) if tokio::time::Instant::now() < until => {
                if !said {
                    tracing::info!(dir = %spool.dir().display(), "webhook spool: waiting for the previous daemon's guard to hand over its deliveries");
                    said = true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(None) => {
                tracing::warn!(dir = %spool.dir().display(), "webhook spool: still locked after {}; using it anyway", humantime::format_duration(LOCK_WAIT));
                return None;
            }
            Err(e) => {
                tracing::warn!(dir = %spool.dir().display(), "webhook spool: cannot lock it ({e}); using it anyway");
                return None;
            }
        }
    }
}

/// The guard's part: hands over every delivery in the spool at `dir` and
/// removes each handed over. Answers how many; `Ok(0)` also when a daemon
/// holds the spool (it sends them itself).
pub async fn hand_over_spool(
    store: &dyn Store,
    dir: &Path,
    within: Duration,
) -> Result<usize, HandoverError> {
    let spool = Spool::at(dir);
    if !dir.exists() {
        return Ok(0);
    }
    let locked = spool.try_lock().map_err(|source| HandoverError::Lock {
        dir: dir.to_path_buf(),
        source,
    })?;
    let Some(_lock) = locked else {
        return Ok(0);
    };
    let (pending, _problems) = spool.load::<Pending>();
    let (handed, failed) = hand_over_all(store, &pending, within).await;
    for p in &handed {
        let _ = spool.remove(*p);
    }
    match failed {
        Some(source) => Err(HandoverError::Store {
            handed: handed.len(),
            source,
        }),
        None => Ok(handed.len()),
    }
}

/// Hands `pending` over, [`TAKE_AT_MOST`] a call, until a call fails: the
/// deliveries the store took, and the failure if one came.
async fn hand_over_all<'a>(
    store: &dyn Store,
    pending: &'a [Pending],
    within: Duration,
) -> (Vec<&'a Pending>, Option<crate::store::StoreError>) {
    let mut handed = Vec::with_capacity(pending.len());
    for chunk in pending.chunks(TAKE_AT_MOST) {
        let (parcels, of) = parcels_of(chunk);
        if let Err(e) = bounded(within, store.hand_over(&parcels)).await {
            return (handed, Some(e));
        }
        handed.extend(of);
    }
    (handed, None)
}

impl Webhooks {
    /// Hands over every delivery still queued (the sender has stopped),
    /// and takes each handed over out of the queue and the spool. What the
    /// store did not take stays spooled for this node's next daemon.
    pub async fn hand_over_left(&self, store: &dyn Store, within: Duration) {
        let left: Vec<Pending> = self.with_queue(|q| q.pending.clone());
        if left.is_empty() {
            return;
        }
        let (handed, failed) = hand_over_all(store, &left, within).await;
        if let Some(e) = failed {
            tracing::warn!(
                pending = left.len() - handed.len(),
                "webhook deliveries not handed over ({e}): kept in the spool for the next start"
            );
        }
        for p in &handed {
            self.count(&p.target, "handed_over");
            self.unspool((*p).clone()).await;
        }
        let names: std::collections::HashSet<String> =
            handed.iter().map(|p| p.file_name()).collect();
        self.with_queue(|q| q.pending.retain(|p| !names.contains(&p.file_name())));
        self.set_pending_gauge();
        if !handed.is_empty() {
            tracing::info!(
                handed_over = handed.len(),
                "webhook deliveries handed over: a node with webhooks sends them"
            );
        }
    }

    /// Takes the deliveries handed over for this node's webhooks, every
    /// [`TAKE_EVERY`] until `stop`; none while the queue is nearly full.
    pub async fn collect(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        taker: Owner,
        within: Duration,
        stop: CancellationToken,
    ) {
        let prefixes: Vec<String> = self.hooks.iter().map(|h| prefix_of(&h.name)).collect();
        loop {
            for prefix in &prefixes {
                self.take_all(store.as_ref(), &taker, prefix, within, &stop)
                    .await;
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(TAKE_EVERY) => {}
            }
        }
    }

    /// Takes `prefix`'s parcels, [`TAKE_AT_MOST`] a call, while calls
    /// bring some (at most [`TAKES_AT_ONCE`] calls) and the queue has room.
    async fn take_all(
        &self,
        store: &dyn Store,
        taker: &Owner,
        prefix: &str,
        within: Duration,
        stop: &CancellationToken,
    ) {
        for _ in 0..TAKES_AT_ONCE {
            let room = MAX_PENDING.saturating_sub(self.with_queue(|q| q.pending.len()));
            if room < TAKE_AT_MOST || stop.is_cancelled() {
                return;
            }
            // Each store bounds its calls (a take stops starting deletes
            // after half of `op_timeout`): this bounds one that hangs, and
            // what it took is then lost.
            let bound = within * 5;
            match bounded(bound, store.take_handed_over(taker, prefix, TAKE_AT_MOST)).await {
                Ok(parcels) if parcels.is_empty() => return,
                Ok(parcels) => self.took(parcels).await,
                Err(crate::store::StoreError::Timeout(_)) => {
                    tracing::warn!(
                        "taking webhook deliveries handed over did not end within {}: those it took are lost",
                        humantime::format_duration(bound)
                    );
                    return;
                }
                Err(e) => {
                    tracing::debug!("looking for webhook deliveries handed over: {e}");
                    return;
                }
            }
        }
    }

    /// Queues what was taken, spooled first; gives up what is too old.
    async fn took(&self, parcels: Vec<Parcel>) {
        let now = now_ms();
        let mut mine = Vec::new();
        for parcel in parcels {
            match Pending::of_parcel(&parcel) {
                Err(why) => {
                    tracing::error!(parcel = %parcel.id, "webhook delivery handed over dropped: unreadable ({why})");
                }
                Ok(p) if p.age(now) >= MAX_AGE => {
                    tracing::error!(webhook = %p.target, delivery = %p.event.delivery, "webhook delivery handed over given up: older than {}", humantime::format_duration(MAX_AGE));
                    self.count(&p.target, "failed");
                }
                Ok(mut p) => {
                    p.next_ms = now;
                    mine.push(p);
                }
            }
        }
        if !mine.is_empty() {
            tracing::info!(
                taken = mine.len(),
                "webhook deliveries handed over by a node that stopped: sending them"
            );
            self.enqueue(mine).await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_goes_through_the_outbox_as_it_was() {
        let p = super::super::spool::tests::pending(1_000, 7);
        let parcel = p.parcel().unwrap();
        assert!(Parcel::id_is_valid(&parcel.id), "{}", parcel.id);
        assert_eq!(parcel.id, "ops~0000000001000-backup-7-failed");
        assert_eq!(Pending::of_parcel(&parcel).unwrap(), p);
        let renamed = Parcel {
            id: "ops~0000000001000-backup-8-failed".into(),
            ..parcel
        };
        assert!(Pending::of_parcel(&renamed).is_err());
    }

    #[test]
    fn the_guard_hands_over_only_a_spool_no_daemon_holds() {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool::open(dir.path()).unwrap();
        let held = spool.try_lock().unwrap();
        assert!(held.is_some());
        assert!(spool.try_lock().unwrap().is_none());
        drop(held);
        assert!(spool.try_lock().unwrap().is_some());
    }

    /// A node with webhook "ops" takes only "ops" deliveries, gives up one
    /// older than a day, spools what it takes, and hands it over again
    /// when it stops.
    #[cfg(all(feature = "memory", feature = "webhooks"))]
    #[tokio::test]
    async fn a_node_takes_its_webhooks_deliveries_and_hands_them_over_again() {
        use crate::store::Outbox as _;
        use crate::store::memory::MemoryStore;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cronlease.toml");
        std::fs::write(
            &path,
            format!(
                "node = \"n1\"\nstate_dir = \"{}\"\n[store]\nurl = \"sqlite://{}/x.db\"\n[[notify]]\nname = \"ops\"\nurl = \"http://127.0.0.1:9/ops\"\nevents = [\"failed\"]\n",
                dir.path().display(),
                dir.path().display()
            ),
        )
        .unwrap();
        let config = crate::config::load(&path, &crate::config::Overrides::default()).unwrap();
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let hooks = Webhooks::start(&config, metrics).await.unwrap().unwrap();
        let store = MemoryStore::new();
        let now = now_ms();
        let pending = |target: &str, fence: u64, created_ms: i64| Pending {
            target: target.into(),
            created_ms,
            next_ms: created_ms + 60_000,
            attempts: 4,
            ..super::super::spool::tests::pending(created_ms, fence)
        };
        let fresh = pending("ops", 1, now - 1_000);
        let stale = pending("ops", 2, now - 25 * 3600 * 1000);
        let theirs = pending("chat", 3, now - 1_000);
        let parcels: Vec<Parcel> = [&fresh, &stale, &theirs]
            .iter()
            .map(|p| p.parcel().unwrap())
            .collect();
        store.hand_over(&parcels).await.unwrap();
        let taker = Owner::from_raw("n1#1");
        let within = Duration::from_secs(2);
        hooks
            .take_all(&store, &taker, "ops~", within, &CancellationToken::new())
            .await;
        // Taken: due now, tries and age kept; the stale one given up.
        let queued = hooks.with_queue(|q| q.pending.clone());
        assert_eq!(queued.len(), 1, "{queued:?}");
        assert_eq!(
            (
                queued[0].event.fence,
                queued[0].attempts,
                queued[0].created_ms
            ),
            (1, 4, fresh.created_ms)
        );
        assert!(queued[0].next_ms <= now_ms());
        let spool = Spool::at(hooks.spool_dir().unwrap());
        assert_eq!(spool.load::<Pending>().0, queued);
        // The other webhook's is left for a node that has it.
        let left = store.take_handed_over(&taker, "chat~", 10).await.unwrap();
        assert_eq!(left, vec![theirs.parcel().unwrap()]);
        assert!(
            store
                .take_handed_over(&taker, "ops~", 10)
                .await
                .unwrap()
                .is_empty()
        );
        // Stopping: handed over again, out of the queue and the spool.
        hooks.hand_over_left(&store, within).await;
        assert!(hooks.with_queue(|q| q.pending.is_empty()));
        assert!(spool.load::<Pending>().0.is_empty());
        let back = store.take_handed_over(&taker, "ops~", 10).await.unwrap();
        assert_eq!(back, vec![queued[0].parcel().unwrap()]);
    }
}
