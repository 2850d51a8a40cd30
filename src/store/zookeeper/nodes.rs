//! The node registry: a persistent record per owner under `nodes/`,
//! written by its heartbeat, live while its beats go on.

use std::collections::HashMap;
use std::future::Future;

use super::*;

#[async_trait]
impl Registry for ZkStore {
    /// The write and the read of the registry go out together, in that
    /// order (ZooKeeper answers a session's requests in the order sent, so
    /// the read sees this beat): one round trip while the nodes stay the
    /// same.
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        let client = self.client().await?;
        let path = self.node_path(beat.owner.as_str());
        let data = BeatData::from(beat).to_json();
        let sent = Instant::now();
        let written = client.set_data(&path, data.as_bytes(), None);
        let read = self.read_registry(&client);
        let (written, read) =
            match tokio::time::timeout(self.op_timeout, futures_util::future::join(written, read))
                .await
            {
                Ok(both) => both,
                Err(_) => return Err(StoreError::Timeout(self.op_timeout)),
            };
        let stat = match written {
            Ok(stat) => stat,
            // The first beat of this owner: its record is made, and the
            // registry read again (the read sent with the write missed it).
            Err(zk::Error::NoNode) => {
                let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                let stat = match tokio::time::timeout(
                    self.op_timeout,
                    client.create(&path, data.as_bytes(), &persistent),
                )
                .await
                {
                    Ok(Ok((stat, _))) => stat,
                    // Made meanwhile by a retry of this very beat.
                    Ok(Err(zk::Error::NodeExists)) => {
                        self.timed(client.set_data(&path, data.as_bytes(), None))
                            .await?
                    }
                    Ok(Err(e)) => return Err(self.err(e)),
                    Err(_) => return Err(StoreError::Timeout(self.op_timeout)),
                };
                self.confirmed(&client, sent);
                return self.live_nodes(&client, stat.mtime, true).await;
            }
            Err(e) => return Err(self.err(e)),
        };
        self.confirmed(&client, sent);
        let read = read.map_err(|e| self.err(e))?;
        self.live_from(&client, read, stat.mtime, true).await
    }

    /// Both requests at once: one round trip.
    async fn heartbeat_looking(&self, beat: &Heartbeat) -> Result<registry::Looked, StoreError> {
        registry::beat_beside_look(self, beat).await
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let client = self.client().await?;
        let now = self.tick(&client).await?;
        self.live_nodes(&client, now, false).await
    }

    async fn leave(&self, owner: &Owner) -> Result<(), StoreError> {
        let client = self.client().await?;
        let path = self.paths.of(Kind::Node, owner.as_str());
        self.idempotent(client.delete(&path, None), zk::Error::NoNode)
            .await
    }

    /// The heartbeat is written in the claim's clock multi (the write to
    /// `/clock` every claim makes), and the live nodes are read while the
    /// claims are decided and written; a beat that fails leaves the claims
    /// standing, and the node beats again on its own.
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        if requests.is_empty() {
            return registry::claim_alongside(self, requests, beat).await;
        }
        self.claim_with(requests, Some(beat)).await
    }
}

impl ZkStore {
    /// A node's record in the registry.
    pub(super) fn node_path(&self, owner: &str) -> String {
        self.paths.of(Kind::Node, owner)
    }

    /// The registry's records live at the store's `now` (ms), read in
    /// multis of [`MULTI_OPS`]; with `forget`, records dead for
    /// [`FORGET_AFTER`] are deleted (each only at the version read).
    pub(super) async fn live_nodes(
        &self,
        client: &zk::Client,
        now: i64,
        forget: bool,
    ) -> Result<Vec<NodeRecord>, StoreError> {
        let dir = self.paths.dir(Kind::Node);
        let owners = match tokio::time::timeout(self.op_timeout, client.list_children(&dir)).await {
            Ok(Ok(owners)) => owners,
            // Never prepared by a version with a registry: nobody in it.
            Ok(Err(zk::Error::NoNode)) => return Ok(Vec::new()),
            Ok(Err(e)) => return Err(self.err(e)),
            Err(_) => return Err(StoreError::Timeout(self.op_timeout)),
        };
        let read = RegistryRead {
            owners,
            records: HashMap::new(),
        };
        self.live_from(client, read, now, forget).await
    }

    /// Sends, at once, one multi read of the registry's list and of the
    /// records of the owners it listed last time (at most [`MULTI_OPS`] in
    /// all); the future gives what it read.
    fn read_registry<'c>(
        &self,
        client: &'c zk::Client,
    ) -> impl Future<Output = Result<RegistryRead, zk::Error>> + Send + use<'c> {
        let dir = self.paths.dir(Kind::Node);
        let known: Vec<String> = lock(&self.listed)
            .iter()
            .take(MULTI_OPS - 1)
            .cloned()
            .collect();
        let mut reader = client.new_multi_reader();
        let added = reader.add_get_children(&dir).and_then(|()| {
            known
                .iter()
                .try_for_each(|owner| reader.add_get_data(&format!("{dir}/{owner}")))
        });
        let answer = added.map(|()| reader.commit());
        async move {
            let results = answer?.await?;
            let mut results = results.into_iter();
            let owners = match results.next() {
                Some(zk::MultiReadResult::Children { children }) => children,
                // Never prepared by a version with a registry: nobody in it.
                Some(zk::MultiReadResult::Error {
                    err: zk::Error::NoNode,
                }) => Vec::new(),
                Some(zk::MultiReadResult::Error { err }) => return Err(err),
                _ => {
                    return Err(zk::Error::UnexpectedError(
                        "a multi read of the registry answered no list".into(),
                    ));
                }
            };
            let mut records = HashMap::new();
            for (owner, r) in known.into_iter().zip(results) {
                if let zk::MultiReadResult::Data { data, stat } = r {
                    records.insert(owner, (data, stat));
                }
            }
            Ok(RegistryRead { owners, records })
        }
    }

    /// The live records of `read`, at the store's `now` (ms): the records
    /// of listed owners it has not read yet are read in multis of
    /// [`MULTI_OPS`]; with `forget`, records dead for [`FORGET_AFTER`] are
    /// deleted (each only at the version read). The list is kept for the
    /// next [`ZkStore::read_registry`].
    async fn live_from(
        &self,
        client: &zk::Client,
        read: RegistryRead,
        now: i64,
        forget: bool,
    ) -> Result<Vec<NodeRecord>, StoreError> {
        let dir = self.paths.dir(Kind::Node);
        let RegistryRead {
            owners,
            mut records,
        } = read;
        let unread: Vec<&String> = owners
            .iter()
            .filter(|o| !records.contains_key(*o))
            .collect();
        for chunk in unread.chunks(MULTI_OPS) {
            let mut reader = client.new_multi_reader();
            for owner in chunk {
                reader
                    .add_get_data(&format!("{dir}/{owner}"))
                    .map_err(|e| self.err(e))?;
            }
            let results = self.timed(reader.commit()).await?;
            for (owner, r) in chunk.iter().zip(results) {
                if let zk::MultiReadResult::Data { data, stat } = r {
                    records.insert((*owner).clone(), (data, stat));
                }
            }
        }
        let forget_before = now.saturating_sub(duration_ms(FORGET_AFTER));
        let mut nodes = Vec::new();
        let mut dead = Vec::new();
        for owner in &owners {
            // Gone since the list (a node left): not listed.
            let Some((data, stat)) = records.get(owner) else {
                continue;
            };
            let Some(d) = BeatData::parse(data) else {
                continue;
            };
            let ends = stat.mtime.saturating_add(d.ttl_ms);
            if ends > now {
                nodes.push(d.record(owner, stat.mtime, ends, now));
            } else if ends < forget_before {
                dead.push((owner.clone(), stat.version));
            }
        }
        *lock(&self.listed) = owners;
        if forget {
            for (owner, version) in dead {
                // Best effort: a node that beat again since keeps its record.
                let _ = tokio::time::timeout(
                    self.op_timeout,
                    client.delete(&format!("{dir}/{owner}"), Some(version)),
                )
                .await;
            }
        }
        Ok(registry::sorted(nodes))
    }
}

/// A read of the registry: the owners listed under `nodes/`, and the
/// records (data and stat) read with the list.
struct RegistryRead {
    owners: Vec<String>,
    records: HashMap<String, (Vec<u8>, zk::Stat)>,
}
