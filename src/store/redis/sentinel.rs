//! Redis through Sentinel: the master's address is asked of the sentinels,
//! and asked again after a failover.
//!
//! redis-rs's `SentinelClient` finds the master (and checks that it says
//! `ROLE` master) each time a client is built, but a connection made from it
//! stays with that address for good. [`Master`] keeps the current master's
//! connection and drops it when a call shows the master gone or demoted
//! (connection lost or refused, `READONLY`, a write its replicas did not
//! acknowledge) or when a sentinel announces a failover (`+switch-master`),
//! so the next call asks the sentinels again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    Client, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo, RedisResult,
};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::config::SentinelTarget;

/// The current master's connection, if one is made.
type Slot = Arc<Mutex<Option<ConnectionManager>>>;

/// The master a `redis+sentinel://` URL names, found through its sentinels.
pub(super) struct Master {
    sentinels: tokio::sync::Mutex<SentinelClient>,
    current: Slot,
    /// For the `+switch-master` listener, started on first use.
    addrs: Vec<ConnectionInfo>,
    name: String,
    listening: AtomicBool,
    /// Ends the listener with the store.
    stop: CancellationToken,
    _stop_on_drop: DropGuard,
}

impl Master {
    /// The sentinels are asked on first use. `password` (and the target's
    /// user) are for the master; the sentinels are asked without them.
    pub(super) fn new(target: &SentinelTarget, password: Option<&str>) -> RedisResult<Self> {
        let sentinels = target
            .sentinels
            .iter()
            .map(|(host, port)| ConnectionAddr::Tcp(host.clone(), *port).into_connection_info())
            .collect::<RedisResult<Vec<_>>>()?;
        let mut redis = RedisConnectionInfo::default();
        if let Some(user) = &target.username {
            redis = redis.set_username(user);
        }
        if let Some(password) = password {
            redis = redis.set_password(password);
        }
        let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(redis);
        let client = SentinelClient::build(
            sentinels.clone(),
            target.master.as_str(),
            Some(node),
            SentinelServerType::Master,
        )?;
        let stop = CancellationToken::new();
        Ok(Master {
            sentinels: tokio::sync::Mutex::new(client),
            current: Arc::new(Mutex::new(None)),
            addrs: sentinels,
            name: target.master.clone(),
            listening: AtomicBool::new(false),
            _stop_on_drop: stop.clone().drop_guard(),
            stop,
        })
    }

    fn cached(&self) -> Option<ConnectionManager> {
        lock(&self.current).clone()
    }

    /// The connection to the current master, asking the sentinels for it
    /// when there is none (first use, or after [`Master::forget`]).
    pub(super) async fn connection(
        &self,
        config: ConnectionManagerConfig,
    ) -> RedisResult<ConnectionManager> {
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        if !self.listening.swap(true, Ordering::Relaxed) {
            tokio::spawn(listen(
                self.addrs.clone(),
                self.name.clone(),
                self.current.clone(),
                self.stop.clone(),
            ));
        }
        let mut sentinels = self.sentinels.lock().await;
        // Another call may have found it while this one waited.
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let client = sentinels.async_get_client().await?;
        let c = ConnectionManager::new_with_config(client, config).await?;
        *lock(&self.current) = Some(c.clone());
        Ok(c)
    }

    /// A client of the master the sentinels name now (for a subscription
    /// of its own).
    pub(super) async fn client(&self) -> RedisResult<redis::Client> {
        self.sentinels.lock().await.async_get_client().await
    }

    /// Drops the master's connection: the next call asks the sentinels.
    pub(super) fn forget(&self) {
        *lock(&self.current) = None;
    }
}

fn lock(slot: &Slot) -> std::sync::MutexGuard<'_, Option<ConnectionManager>> {
    crate::store::lock(slot)
}

/// Listens to the sentinels (one at a time, the next when one fails) for
/// `+switch-master` of `name`, and drops the master's connection when it
/// comes: the next call asks the sentinels instead of writing to the old
/// master first. Until `stop`.
async fn listen(
    sentinels: Vec<ConnectionInfo>,
    name: String,
    current: Slot,
    stop: CancellationToken,
) {
    for info in sentinels.iter().cycle() {
        let heard = async {
            let client = Client::open(info.clone())?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe("+switch-master").await?;
            let mut messages = pubsub.on_message();
            while let Some(msg) = messages.next().await {
                // "<master name> <old ip> <old port> <new ip> <new port>"
                let payload: String = msg.get_payload().unwrap_or_default();
                if payload.split(' ').next() == Some(name.as_str()) {
                    *lock(&current) = None;
                    tracing::info!(
                        master = %name,
                        "Sentinel announced a failover (+switch-master {payload}): the next store call goes to the new master"
                    );
                }
            }
            RedisResult::Ok(())
        };
        tokio::select! {
            () = stop.cancelled() => return,
            _ = heard => {}
        }
        // That sentinel is gone or never answered: try the next one soon.
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}
