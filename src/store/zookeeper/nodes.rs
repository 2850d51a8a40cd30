//! The node registry: a persistent record per owner under `nodes/`,
//! written by its heartbeat, live while its beats go on.

use super::*;

#[async_trait]
impl Registry for ZkStore {
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        let client = self.client().await?;
        let path = self.node_path(beat.owner.as_str());
        let data = BeatData::from(beat).to_json();
        let sent = Instant::now();
        let written = tokio::time::timeout(
            self.op_timeout,
            client.set_data(&path, data.as_bytes(), None),
        )
        .await;
        let stat = match written {
            Ok(Ok(stat)) => stat,
            Ok(Err(zk::Error::NoNode)) => {
                let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                match tokio::time::timeout(
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
                }
            }
            Ok(Err(e)) => return Err(self.err(e)),
            Err(_) => return Err(StoreError::Timeout(self.op_timeout)),
        };
        self.confirmed(&client, sent);
        self.live_nodes(&client, stat.mtime, true).await
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
        let forget_before = now.saturating_sub(duration_ms(FORGET_AFTER));
        let mut nodes = Vec::new();
        let mut dead = Vec::new();
        for chunk in owners.chunks(MULTI_OPS) {
            let mut reader = client.new_multi_reader();
            for owner in chunk {
                reader
                    .add_get_data(&format!("{dir}/{owner}"))
                    .map_err(|e| self.err(e))?;
            }
            let results = self.timed(reader.commit()).await?;
            for (owner, r) in chunk.iter().zip(results) {
                // Gone since the list (a node left): not listed.
                let zk::MultiReadResult::Data { data, stat } = r else {
                    continue;
                };
                let Some(d) = BeatData::parse(&data) else {
                    continue;
                };
                let ends = stat.mtime.saturating_add(d.ttl_ms);
                if ends > now {
                    nodes.push(d.record(owner, stat.mtime, ends, now));
                } else if ends < forget_before {
                    dead.push((owner.clone(), stat.version));
                }
            }
        }
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
