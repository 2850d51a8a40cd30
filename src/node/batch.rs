//! Batching store calls: one round trip for everything due together.
//!
//! A [`Batcher`] is a queue in front of one kind of store call (claims,
//! renewals, history writes). Callers queue requests, alone or several as
//! one group, and wait for their own answers; one task per batcher takes
//! whatever is queued, sends it to the store in **one** call, and hands each
//! caller its answer. While a call is in flight, new requests wait and go
//! together in the next one, so a node makes a handful of store round trips
//! per instant whatever the number of jobs.
//!
//! The scheduler queues all claims of an instant as one group, so they are
//! always one call. Requests that become due on their own (a takeover
//! retry, a renewal, a finished run) are gathered over a window first: the
//! batcher's `window` (zero: only what is queued already; 5 ms for
//! renewals, 250 ms for history writes, which nothing waits for).

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::store::StoreError;

/// One caller's request with where its answer goes.
type Slot<Q, R> = (Q, oneshot::Sender<Result<R, StoreError>>);

/// A group of requests queued together.
type Group<Q, R> = Vec<Slot<Q, R>>;

/// A queue of requests of type `Q` answered with `R`.
pub(super) struct Batcher<Q, R> {
    tx: mpsc::UnboundedSender<Group<Q, R>>,
    /// Taken by the one task that serves the queue.
    rx: Mutex<Option<mpsc::UnboundedReceiver<Group<Q, R>>>>,
    window: Duration,
}

/// The answer of a queued request.
pub(super) type Pending<R> = oneshot::Receiver<Result<R, StoreError>>;

impl<Q: Send + 'static, R: Send + 'static> Batcher<Q, R> {
    /// A batcher that gathers requests for `window` before each call.
    pub fn new(window: Duration) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Batcher {
            tx,
            rx: Mutex::new(Some(rx)),
            window,
        }
    }

    /// Queues `requests` as one group (they go in the same store call) and
    /// returns where each answer will come, in order.
    pub fn submit(&self, requests: Vec<Q>) -> Vec<Pending<R>> {
        let (group, pending) = group(requests);
        if !group.is_empty() {
            // A closed queue (the node is gone) drops the senders: every
            // caller sees its answer channel closed.
            let _ = self.tx.send(group);
        }
        pending
    }

    /// Like [`Batcher::submit`], but the group is queued only after
    /// `delay` (the answers' channels exist at once).
    pub fn submit_after(&self, requests: Vec<Q>, delay: Duration) -> Vec<Pending<R>> {
        let (group, pending) = group(requests);
        if !group.is_empty() {
            let queue = self.tx.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = queue.send(group);
            });
        }
        pending
    }

    /// Queues one request and waits for its answer.
    pub async fn call(&self, request: Q) -> Result<R, StoreError> {
        let pending = self.submit(vec![request]);
        match pending.into_iter().next() {
            Some(rx) => answer(rx).await,
            None => Err(closed()),
        }
    }

    /// Runs the queue until every sender is gone: each round, one call of
    /// `flush` with every request queued (in queue order), which must answer
    /// them in the same order. Starts only once; later calls return at once.
    pub async fn serve<F, Fut>(&self, flush: F)
    where
        F: Fn(Vec<Q>) -> Fut,
        Fut: Future<Output = Result<Vec<R>, StoreError>>,
    {
        let Some(mut rx) = self.rx.lock().ok().and_then(|mut rx| rx.take()) else {
            return;
        };
        while let Some(first) = rx.recv().await {
            if self.window.is_zero() {
                // Let callers woken at the same moment queue theirs too.
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(self.window).await;
            }
            // Each group moved straight into the call's two lists, sized
            // for at least what is queued (one request per group after the
            // first, as a lone `call` queues; more grow the lists): no
            // third list of every request beside them while a thousand
            // runs' records are in flight.
            let room = first.len() + rx.len();
            let (mut requests, mut replies) = (Vec::with_capacity(room), Vec::with_capacity(room));
            let mut take = |group: Group<Q, R>| {
                for (q, reply) in group {
                    requests.push(q);
                    replies.push(reply);
                }
            };
            take(first);
            while let Ok(more) = rx.try_recv() {
                take(more);
            }
            let asked = requests.len();
            match flush(requests).await {
                Ok(answers) if answers.len() == asked => {
                    for (reply, a) in replies.into_iter().zip(answers) {
                        let _ = reply.send(Ok(a));
                    }
                }
                Ok(answers) => {
                    let e = StoreError::Backend {
                        store: String::new(),
                        reason: format!("{} answers to {asked} requests", answers.len()),
                    };
                    for reply in replies {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
                Err(e) => {
                    for reply in replies {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
            }
        }
    }
}

/// Each request with the channel its answer goes through, and the receiving
/// ends, in order.
fn group<Q, R>(requests: Vec<Q>) -> (Group<Q, R>, Vec<Pending<R>>) {
    requests
        .into_iter()
        .map(|q| {
            let (tx, rx) = oneshot::channel();
            ((q, tx), rx)
        })
        .unzip()
}

/// Waits for a queued request's answer.
pub(super) async fn answer<R>(rx: Pending<R>) -> Result<R, StoreError> {
    rx.await.unwrap_or_else(|_| Err(closed()))
}

fn closed() -> StoreError {
    StoreError::Unavailable {
        store: String::new(),
        reason: "the node is shutting down".into(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(start_paused = true)]
    async fn everything_queued_together_is_one_call_answered_in_order() {
        let b = Arc::new(Batcher::<u32, u32>::new(Duration::from_millis(5)));
        let calls = Arc::new(AtomicUsize::new(0));
        let server = {
            let (b, calls) = (b.clone(), calls.clone());
            tokio::spawn(async move {
                b.serve(|qs: Vec<u32>| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    async move { Ok(qs.into_iter().map(|q| q * 10).collect()) }
                })
                .await
            })
        };
        let group = b.submit((0..1000).collect());
        let single = b.call(7);
        let (single, group) = tokio::join!(single, async {
            let mut out = Vec::new();
            for rx in group {
                out.push(answer(rx).await.unwrap());
            }
            out
        });
        assert_eq!(single.unwrap(), 70);
        assert_eq!(group, (0..1000).map(|q| q * 10).collect::<Vec<_>>());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        server.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_call_fails_every_request_in_it() {
        let b = Arc::new(Batcher::<u32, u32>::new(Duration::ZERO));
        let server = {
            let b = b.clone();
            tokio::spawn(async move {
                b.serve(|_| async { Err(StoreError::Timeout(Duration::from_secs(2))) })
                    .await
            })
        };
        let pending = b.submit(vec![1, 2]);
        for rx in pending {
            assert!(matches!(answer(rx).await, Err(StoreError::Timeout(_))));
        }
        server.abort();
    }
}
