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

    /// The registry script and the read of the requests' hash in one
    /// pipeline per master, without the `INFO server` other calls carry:
    /// a master's restart matters to the claims, which read it in their
    /// own pipelines before they count its answer, not to the registry.
    /// One request and one reply per master (there were three: `INFO`
    /// and the script, then `HGETALL`).
    async fn heartbeat_looking(&self, beat: &Heartbeat) -> Result<registry::Looked, StoreError> {
        let keys = [self.registry_key()];
        let args = crate::store::redis::registry_args("beat", beat.owner.as_str(), Some(beat));
        let triggers = triggers_key(&self.prefix);
        let (k, a, t) = (&keys, &args, &triggers);
        let answers = self.each(|m| self.beat_and_look_on(m, k, a, t)).await;
        let mut records = Vec::new();
        let mut looks = Vec::new();
        let mut look_failed = None;
        for (_, (reply, look)) in self.quorum(answers)? {
            records.push(reply);
            match look {
                Ok(pairs) => looks.push(pairs),
                Err(e) => look_failed = Some(e),
            }
        }
        let pending = if looks.len() >= self.majority() {
            Some(self.pending_of(looks))
        } else {
            if let Some(e) = look_failed {
                tracing::debug!("the look for manual runs sent with a heartbeat failed: {e}");
            }
            None
        };
        Ok((freshest_records(records), pending))
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

    /// [`Registry::heartbeat_looking`] on one master: the registry script
    /// (loaded again if the master forgot it) and `HGETALL` of the
    /// requests' hash, one pipeline; the script's reply, and the hash's
    /// pairs or why not.
    async fn beat_and_look_on(
        &self,
        master: &Master,
        keys: &[String],
        args: &[String],
        triggers: &str,
    ) -> Result<(Vec<String>, Result<Vec<(String, String)>, StoreError>), StoreError> {
        let mut conn = master.connection(self.op_timeout).await?;
        let build = |which: &[usize]| {
            let mut pipe = redis::pipe();
            if !which.is_empty() {
                add_evalsha(&mut pipe, (&self.registry, keys, args));
            }
            pipe.cmd("HGETALL").arg(triggers);
            pipe
        };
        let replies = send_loading(master, &mut conn, &[&self.registry], 0, 1, build).await?;
        let mut replies = replies.into_iter();
        let records = reply_of(master, replies.next())?;
        let look = reply_of(master, replies.next());
        Ok((records, look))
    }

    /// The requests a majority of the masters hold, from the requests'
    /// hashes of those that answered (job → id), sorted by job.
    pub(super) fn pending_of(
        &self,
        hashes: impl IntoIterator<Item = Vec<(String, String)>>,
    ) -> Vec<(String, TriggerId)> {
        let mut seen: BTreeMap<(String, TriggerId), usize> = BTreeMap::new();
        for pairs in hashes {
            for (job, id) in pairs {
                if let Some(id) = TriggerId::parse_stored(&id) {
                    *seen.entry((job, id)).or_default() += 1;
                }
            }
        }
        seen.into_iter()
            .filter(|(_, n)| *n >= self.majority())
            .map(|(key, _)| key)
            .collect()
    }

    /// The key of the node registry's hash.
    pub(super) fn registry_key(&self) -> String {
        format!("{}nodes", self.prefix)
    }
}
