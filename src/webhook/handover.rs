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
//! - Every node with webhooks takes parcels every [`TAKE_EVERY`]
//!   ([`Webhooks::collect`]), spools each before sending it, and gives
//!   back one for a webhook it has not got (dropped once older than
//!   [`super::MAX_AGE`]).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::spool::Pending;
use super::{MAX_AGE, Webhooks, now_ms};
use crate::spool::{Spool, SpoolLock, Spooled as _};
use crate::store::outbox::TAKE_AT_MOST;
use crate::store::{Owner, Parcel, Store, bounded};

/// How often a node with webhooks looks for deliveries handed over.
pub const TAKE_EVERY: Duration = Duration::from_secs(5);

/// How long a starting daemon waits for a guard handing over its spool.
const LOCK_WAIT: Duration = Duration::from_secs(30);

impl Pending {
    /// As the outbox keeps it: its spool file's name without `.json`, and
    /// its JSON.
    pub fn parcel(&self) -> Result<Parcel, String> {
        let name = self.file_name();
        let id = name.strip_suffix(".json").unwrap_or(&name).to_string();
        let body = serde_json::to_string(self).map_err(|e| e.to_string())?;
        Ok(Parcel { id, body })
    }

    /// A delivery taken from the outbox.
    pub fn of_parcel(parcel: &Parcel) -> Result<Pending, String> {
        let p: Pending = serde_json::from_str(&parcel.body).map_err(|e| e.to_string())?;
        if p.parcel()?.id != parcel.id {
            return Err("its id does not match what it holds".into());
        }
        Ok(p)
    }

    fn age(&self, now: i64) -> Duration {
        Duration::from_millis(u64::try_from(now.saturating_sub(self.created_ms)).unwrap_or(0))
    }
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
/// removes each handed over. Answers how many, or why none; `Ok(0)` also
/// when a daemon holds the spool (it sends them itself).
pub async fn hand_over_spool(
    store: &dyn Store,
    dir: &Path,
    within: Duration,
) -> Result<usize, String> {
    let spool = Spool::at(dir);
    if !dir.exists() {
        return Ok(0);
    }
    let Some(_lock) = spool
        .try_lock()
        .map_err(|e| format!("locking {}: {e}", dir.display()))?
    else {
        return Ok(0);
    };
    let (pending, _problems) = spool.load::<Pending>();
    let mut handed = 0;
    for chunk in pending.chunks(TAKE_AT_MOST) {
        let parcels: Vec<Parcel> = chunk.iter().filter_map(|p| p.parcel().ok()).collect();
        bounded(within, store.hand_over(&parcels))
            .await
            .map_err(|e| format!("{handed} handed over, then: {e}"))?;
        for p in chunk {
            let _ = spool.remove(p);
        }
        handed += chunk.len();
    }
    Ok(handed)
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
        let mut handed = 0;
        for chunk in left.chunks(TAKE_AT_MOST) {
            let parcels: Vec<Parcel> = chunk.iter().filter_map(|p| p.parcel().ok()).collect();
            if let Err(e) = bounded(within, store.hand_over(&parcels)).await {
                tracing::warn!(
                    pending = left.len() - handed,
                    "webhook deliveries not handed over ({e}): kept in the spool for the next start"
                );
                break;
            }
            for p in chunk {
                self.count(&p.target, "handed_over");
                self.unspool(p.clone()).await;
            }
            let names: std::collections::HashSet<String> =
                chunk.iter().map(Pending::file_name).collect();
            self.with_queue(|q| q.pending.retain(|p| !names.contains(&p.file_name())));
            handed += chunk.len();
        }
        self.set_pending_gauge();
        if handed > 0 {
            tracing::info!(
                handed_over = handed,
                "webhook deliveries handed over: a node with webhooks sends them"
            );
        }
    }

    /// Takes the deliveries handed over, every [`TAKE_EVERY`] until `stop`.
    pub async fn collect(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        taker: Owner,
        within: Duration,
        stop: CancellationToken,
    ) {
        loop {
            let mut more = true;
            while more && !stop.is_cancelled() {
                more = match bounded(within, store.take_handed_over(&taker, TAKE_AT_MOST)).await {
                    Ok(parcels) => {
                        let full = parcels.len() >= TAKE_AT_MOST;
                        self.took(store.as_ref(), parcels, within).await;
                        full
                    }
                    Err(e) => {
                        tracing::debug!("looking for webhook deliveries handed over: {e}");
                        false
                    }
                };
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(TAKE_EVERY) => {}
            }
        }
    }

    /// Queues what was taken; gives back what is for a webhook this node
    /// has not got.
    async fn took(&self, store: &dyn Store, parcels: Vec<Parcel>, within: Duration) {
        if parcels.is_empty() {
            return;
        }
        let now = now_ms();
        let mut mine = Vec::new();
        let mut back = Vec::new();
        for parcel in parcels {
            match Pending::of_parcel(&parcel) {
                Err(why) => {
                    tracing::error!(parcel = %parcel.id, "webhook delivery handed over dropped: unreadable ({why})");
                }
                Ok(p) if p.age(now) >= MAX_AGE => {
                    tracing::error!(webhook = %p.target, delivery = %p.event.delivery, "webhook delivery handed over given up: older than {}", humantime::format_duration(MAX_AGE));
                    self.count(&p.target, "failed");
                }
                Ok(p) if !self.hooks.iter().any(|h| h.name == p.target) => back.push(parcel),
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
        if !back.is_empty() {
            tracing::debug!(
                back = back.len(),
                "webhook deliveries handed over for webhooks this node has not got: given back"
            );
            if let Err(e) = bounded(within, store.hand_over(&back)).await {
                tracing::error!(
                    lost = back.len(),
                    "webhook deliveries for webhooks this node has not got could not be given back: {e}"
                );
            }
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
        assert_eq!(parcel.id, "0000000001000-ops-backup-7-failed");
        assert_eq!(Pending::of_parcel(&parcel).unwrap(), p);
        let renamed = Parcel {
            id: "0000000001000-ops-backup-8-failed".into(),
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
}
