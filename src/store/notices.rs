//! Notices of written requests, pushed by the store
//! ([`super::Locks::notices`]): one task per subscription keeps it up, made
//! again after a backoff when it fails or ends, and forwards each notice to
//! the node, coalesced (one waiting at most).

use std::future::Future;
use std::time::Duration;

use tokio::sync::mpsc::{Receiver, Sender, channel};
use tokio_util::sync::CancellationToken;

/// The first wait before a subscription is made again.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// The longest wait before a subscription is made again.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Keeps `subscribe` going until `stop` (or the receiver is dropped): each
/// call subscribes, sends one notice once subscribed (what was written
/// while it was down), forwards a notice per message, and returns when
/// the subscription ends (`Ok`) or cannot be made (`Err`, its reason, no
/// secret in it). The first failure is logged at INFO for `store`, later
/// ones at DEBUG: the heartbeats find the requests anyway.
pub(crate) fn follow<F, Fut>(
    store: String,
    stop: CancellationToken,
    mut subscribe: F,
) -> Receiver<()>
where
    F: FnMut(Sender<()>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), String>> + Send,
{
    let (tx, rx) = channel(1);
    tokio::spawn(async move {
        let mut backoff = FIRST_BACKOFF;
        let mut told = false;
        loop {
            let began = tokio::time::Instant::now();
            let ended = tokio::select! {
                () = stop.cancelled() => return,
                ended = subscribe(tx.clone()) => ended,
            };
            if tx.is_closed() {
                return;
            }
            // Only a subscription that lasted starts the backoff over: one
            // the server drops at once (a proxy, a buffer limit) must not
            // be made again five times a second, each time with a look.
            if began.elapsed() >= MAX_BACKOFF {
                backoff = FIRST_BACKOFF;
            }
            match ended {
                Ok(()) => {
                    tracing::debug!(store = %store, "the store's notices of requests ended: subscribing again");
                }
                Err(why) if !told => {
                    told = true;
                    tracing::info!(
                        store = %store,
                        "the store's notices of manual runs are not available ({why}): each heartbeat looks for them instead (within a second); trying again"
                    );
                }
                Err(why) => {
                    tracing::debug!(store = %store, "the store's notices of requests: {why}");
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    });
    rx
}

/// Sends a notice unless one is waiting already; false once the node
/// stopped listening.
pub(crate) fn notify(tx: &Sender<()>) -> bool {
    !matches!(
        tx.try_send(()),
        Err(tokio::sync::mpsc::error::TrySendError::Closed(()))
    )
}
