//! The node registry, written to every master; a node's freshest record
//! among the masters that answer counts.

use super::*;

#[async_trait]
impl Registry for RedlockStore {
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        self.registry_call(crate::store::redis::registry_args(
            "beat",
            beat.owner.as_str(),
            Some(beat),
        ))
        .await
    }

    /// Both requests at once: one round trip.
    async fn heartbeat_looking(&self, beat: &Heartbeat) -> Result<registry::Looked, StoreError> {
        registry::beat_beside_look(self, beat).await
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.registry_call(crate::store::redis::registry_args("list", "", None))
            .await
    }

    async fn leave(&self, owner: &Owner) -> Result<(), StoreError> {
        self.registry_call(crate::store::redis::registry_args(
            "leave",
            owner.as_str(),
            None,
        ))
        .await
        .map(|_| ())
    }

    /// The heartbeat's script goes first in each master's first-phase
    /// pipeline (with `INFO` and the lease script: one round trip); a beat
    /// that fails leaves the claims standing, and the node beats again on
    /// its own.
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        if requests.is_empty() {
            return registry::claim_alongside(self, requests, beat).await;
        }
        let args = crate::store::redis::registry_args("beat", beat.owner.as_str(), Some(beat));
        self.claim_with(requests, Some(&args)).await
    }
}

/// The union of the masters' `registry.lua` replies, per owner the
/// freshest copy (a heartbeat that counted reached a majority, and a dead
/// node's record ends on every master by its own clock).
pub(super) fn freshest_records(replies: impl IntoIterator<Item = Vec<String>>) -> Vec<NodeRecord> {
    let mut freshest: BTreeMap<String, NodeRecord> = BTreeMap::new();
    for reply in replies {
        for record in crate::store::redis::nodes_from_reply(&reply) {
            match freshest.get(&record.owner) {
                Some(kept) if kept.expires_in_ms >= record.expires_in_ms => {}
                _ => {
                    freshest.insert(record.owner.clone(), record);
                }
            }
        }
    }
    registry::sorted(freshest.into_values().collect())
}

impl RedlockStore {
    /// `registry.lua` on every master; the union of a majority's live
    /// records (a heartbeat that counted reached a majority, and a dead
    /// node's record ends on every master by its own clock), per owner the
    /// freshest copy.
    pub(super) async fn registry_call(
        &self,
        args: Vec<String>,
    ) -> Result<Vec<NodeRecord>, StoreError> {
        let keys = [self.registry_key()];
        let (k, a) = (&keys, &args);
        let answers = self
            .each(|m| self.eval_on::<Vec<String>>(m, &self.registry, k, a))
            .await;
        let replies = self.quorum(answers)?.into_iter().map(|(_, reply)| reply);
        Ok(freshest_records(replies))
    }

    /// The key of the node registry's hash.
    pub(super) fn registry_key(&self) -> String {
        format!("{}nodes", self.prefix)
    }
}
