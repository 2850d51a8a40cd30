//! Redis through Sentinel: the master's address is asked of the sentinels,
//! and asked again after a failover.
//!
//! redis-rs's `SentinelClient` finds the master (and checks that it says
//! `ROLE` master) each time a client is built, but a connection made from it
//! stays with that address for good. [`Master`] keeps the current master's
//! connection and drops it when a call shows the master gone or demoted
//! (connection lost or refused, `READONLY`), so the next call asks the
//! sentinels again.

use std::sync::Mutex;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo, RedisResult};

use crate::config::SentinelTarget;

/// The master a `redis+sentinel://` URL names, found through its sentinels.
pub(super) struct Master {
    sentinels: tokio::sync::Mutex<SentinelClient>,
    current: Mutex<Option<ConnectionManager>>,
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
            sentinels,
            target.master.as_str(),
            Some(node),
            SentinelServerType::Master,
        )?;
        Ok(Master {
            sentinels: tokio::sync::Mutex::new(client),
            current: Mutex::new(None),
        })
    }

    fn cached(&self) -> Option<ConnectionManager> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
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
        let mut sentinels = self.sentinels.lock().await;
        // Another call may have found it while this one waited.
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let client = sentinels.async_get_client().await?;
        let c = ConnectionManager::new_with_config(client, config).await?;
        *self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(c.clone());
        Ok(c)
    }

    /// Drops the master's connection: the next call asks the sentinels.
    pub(super) fn forget(&self) {
        *self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}
