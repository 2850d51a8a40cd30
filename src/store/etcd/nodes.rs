//! The node registry (`nodes/`): each node's record under a lease of its own,
//! written by its heartbeat (alone, or in a claim batch's first transaction).

use super::*;

/// The live records among a range read of the registry, by this host's
/// clock (etcd has none): a record is live while its key exists (its etcd
/// lease did not run out) and its recorded end is ahead of `now`.
/// The owner a registry key under `prefix` names.
pub(super) fn owner_of<'a>(kv: &'a KeyValue, prefix: &str) -> Option<&'a str> {
    std::str::from_utf8(kv.key().strip_prefix(prefix.as_bytes())?).ok()
}

pub(super) fn live_records(kvs: &[KeyValue], prefix: &str, now: i64) -> Vec<NodeRecord> {
    registry::sorted(
        kvs.iter()
            .filter_map(|kv| {
                let owner = owner_of(kv, prefix)?;
                let data = BeatData::parse(kv.value())?;
                let seen = data.last_seen?;
                let ends = seen.saturating_add(data.ttl_ms);
                (ends > now).then(|| data.record(owner, seen, ends, now))
            })
            .collect(),
    )
}

#[async_trait]
impl Registry for EtcdStore {
    /// The record is put with a new etcd lease of its time to live plus
    /// [`BEAT_LEASE_SPARE`] (whole seconds), so a dead node's key goes away
    /// by itself; the heartbeats inside claims reuse that lease for the
    /// spare's length. The read of every record rides in the same
    /// transaction.
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        self.beat_txn(beat, false).await.map(|(nodes, _)| nodes)
    }

    /// The look rides in the heartbeat's transaction too: one request and
    /// one answer (there were two, side by side). A user refused it (etcd
    /// checks every operation of a transaction: it may not read the
    /// requests' keys) beats without it, and looks beside the beat from
    /// then on, where only the look fails.
    async fn heartbeat_looking(&self, beat: &Heartbeat) -> Result<registry::Looked, StoreError> {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.look_apart.load(Relaxed) {
            match self.beat_txn(beat, true).await {
                Err(StoreError::Refused { reason, .. }) => {
                    tracing::debug!(
                        "a heartbeat with the look for manual runs was refused ({reason}): looking beside the beats from now on"
                    );
                    self.look_apart.store(true, Relaxed);
                }
                sent => return sent,
            }
        }
        registry::beat_beside_look(self, beat).await
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let client = self.client().await?;
        let prefix = self.keys.of(Kind::Node, "");
        let mut kv = client.kv_client();
        let read = self
            .timed(kv.get(prefix.as_str(), Some(GetOptions::new().with_prefix())))
            .await?;
        Ok(live_records(read.kvs(), &prefix, now_ms()))
    }

    async fn leave(&self, owner: &Owner) -> Result<(), StoreError> {
        let client = self.client().await?;
        let mut kv = client.kv_client();
        self.timed(kv.delete(self.keys.of(Kind::Node, owner.as_str()), None))
            .await
            .map(|_| ())
    }

    /// The heartbeat's put and the registry's read ride in the claim's
    /// first transaction, with the etcd lease of an earlier heartbeat. With
    /// none usable (the node's first beat, then once a
    /// [`BEAT_LEASE_SPARE`]), the heartbeat goes alongside the claim
    /// ([`registry::claim_alongside`]) and grants a new one. A claim that
    /// fails with the beat in it drops the lease, in case etcd no longer
    /// has it; one that failed because etcd has not got it (revoked, or a
    /// restore) was refused whole in its first transaction, before any
    /// write, and is sent again with the beat beside it.
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        let usable = self.usable_beat_lease().filter(|_| !requests.is_empty());
        let Some(lease) = usable else {
            return registry::claim_alongside(self, requests, beat).await;
        };
        let claimed = self.claim_with(requests, Some((beat, lease))).await;
        match &claimed {
            Err(e) if e.to_string().contains("lease not found") => {
                *lock(&self.beat_lease) = None;
                registry::claim_alongside(self, requests, beat).await
            }
            Err(_) => {
                *lock(&self.beat_lease) = None;
                claimed
            }
            Ok(_) => claimed,
        }
    }
}

impl EtcdStore {
    /// [`Registry::heartbeat`] as one transaction: the record's put, the
    /// registry's read and, when `look`, the read of the requests' keys
    /// (one page of [`KEYS_PAGE`]; more are read apart, after it). A look
    /// that fails apart leaves the requests unread; the beat stands.
    async fn beat_txn(&self, beat: &Heartbeat, look: bool) -> Result<registry::Looked, StoreError> {
        let client = self.client().await?;
        let id = match self.usable_beat_lease() {
            Some(id) => id,
            None => {
                let ttl = lease_ttl_secs(beat.ttl + BEAT_LEASE_SPARE);
                let granted_at = tokio::time::Instant::now();
                let leases = self.grant(&client, vec![ttl]).await?;
                let id = leases
                    .get(&ttl)
                    .copied()
                    .ok_or_else(|| self.backend("etcd granted no lease for a heartbeat"))?;
                *lock(&self.beat_lease) = Some((id, granted_at + BEAT_LEASE_SPARE));
                id
            }
        };
        let (mut ops, sent) = self.beat_ops(&client, beat, id);
        let root = self.keys.of(Kind::Trigger, "");
        if look {
            let keys = GetOptions::new()
                .with_prefix()
                .with_keys_only()
                .with_limit(KEYS_PAGE);
            ops.push(TxnOp::get(root.as_str(), Some(keys)));
        }
        let answers = match self.batch(&client, ops).await {
            Ok(answers) => answers,
            Err(e) => {
                // Perhaps etcd no longer has the lease: the next beat
                // grants another.
                *lock(&self.beat_lease) = None;
                return Err(e);
            }
        };
        let (read, requests) = match answers.as_slice() {
            [_, TxnOpResponse::Get(read)] if !look => (read, None),
            [_, TxnOpResponse::Get(read), TxnOpResponse::Get(requests)] if look => {
                (read, Some(requests))
            }
            _ => {
                return Err(self.backend("a heartbeat answered with something other than its keys"));
            }
        };
        let nodes = self.beat_answered(beat, read, sent);
        let pending = match requests {
            None => None,
            Some(page) if !page.more() => {
                Some(pending_from_entries(page.kvs().iter().filter_map(|kv| {
                    std::str::from_utf8(kv.key()).ok()?.strip_prefix(&root)
                })))
            }
            Some(_) => match self.pending_triggers().await {
                Ok(pending) => Some(pending),
                Err(e) => {
                    tracing::debug!("the look for manual runs sent with a heartbeat failed: {e}");
                    None
                }
            },
        };
        Ok((nodes, pending))
    }

    /// A heartbeat's operations: its record put with `lease`, and the read
    /// of every record. Returns them with the time it says it was sent.
    pub(super) fn beat_ops(
        &self,
        client: &etcd::Client,
        beat: &Heartbeat,
        lease: i64,
    ) -> (Vec<TxnOp>, i64) {
        let mut data = BeatData::from(beat);
        let now = now_ms();
        data.last_seen = Some(now);
        let prefix = self.keys.of(Kind::Node, "");
        let ops = vec![
            TxnOp::put(
                self.keys.of(Kind::Node, beat.owner.as_str()),
                data.to_json(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::get(prefix.as_str(), Some(GetOptions::new().with_prefix())),
        ];
        *lock(&self.clocks.me) = Some(beat.owner.to_string());
        self.watch_clocks(client);
        (ops, now)
    }

    /// The live records a heartbeat sent at `sent` read back; the peers'
    /// clocks are expected from them.
    pub(super) fn beat_answered(
        &self,
        beat: &Heartbeat,
        read: &GetResponse,
        sent: i64,
    ) -> Vec<NodeRecord> {
        let prefix = self.keys.of(Kind::Node, "");
        let live = live_records(read.kvs(), &prefix, sent);
        // Every other record's clock is waited for, not only those live by
        // this node's clock: a node whose clock ran ahead saw its peers'
        // records as expired, waited for none and judged its first claim
        // on its own clock alone, running it early (a node 5 s ahead, in
        // about one run in five of
        // `clock::etcd_measures_each_node_against_the_median_of_the_live_clocks`).
        // A dead node's key stays until its etcd lease ends, a minute after
        // its last beat; its reading is waited for one record's life at most.
        let others: HashSet<String> = read
            .kvs()
            .iter()
            .filter_map(|kv| {
                let owner = owner_of(kv, &prefix)?;
                (owner != beat.owner.as_str()).then(|| owner.to_string())
            })
            .collect();
        self.clocks
            .expect(others, sent, BeatData::from(beat).ttl_ms);
        live
    }

    /// The heartbeat's etcd lease while a heartbeat may still use it.
    pub(super) fn usable_beat_lease(&self) -> Option<i64> {
        let lease = *lock(&self.beat_lease);
        lease
            .filter(|(_, until)| tokio::time::Instant::now() < *until)
            .map(|(id, _)| id)
    }
}
