//! The node registry: one hash of records, written by `registry.lua`.

use super::*;

/// The arguments of `registry.lua` for `op` (`beat`, `list`, `leave`).
pub(crate) fn registry_args(op: &str, owner: &str, beat: Option<&Heartbeat>) -> Vec<String> {
    let (ttl, data) = beat.map_or((0, String::new()), |b| {
        (duration_ms(b.ttl), BeatData::from(b).to_json())
    });
    vec![
        op.to_string(),
        owner.to_string(),
        ttl.to_string(),
        data,
        duration_ms(registry::FORGET_AFTER).to_string(),
    ]
}

/// The live records in a reply of `registry.lua`; a record that does not
/// parse (a hand edit) is left out.
pub(crate) fn nodes_from_reply(reply: &[String]) -> Vec<NodeRecord> {
    let Some((now, records)) = reply.split_first() else {
        return Vec::new();
    };
    let now: i64 = now.parse().unwrap_or(0);
    registry::sorted(
        records
            .chunks_exact(4)
            .filter_map(|r| {
                let seen = r[1].parse().ok()?;
                let ends = r[2].parse().ok()?;
                BeatData::parse(r[3].as_bytes()).map(|d| d.record(&r[0], seen, ends, now))
            })
            .collect(),
    )
}

#[async_trait]
impl Registry for RedisStore {
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        let args = registry_args("beat", beat.owner.as_str(), Some(beat));
        let reply: Vec<String> = self
            .eval(&self.registry, &[self.registry_key()], &args)
            .await?;
        Ok(nodes_from_reply(&reply))
    }

    /// Both requests at once: one round trip.
    async fn heartbeat_looking(&self, beat: &Heartbeat) -> Result<registry::Looked, StoreError> {
        registry::beat_beside_look(self, beat).await
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let args = registry_args("list", "", None);
        let reply: Vec<String> = self
            .eval(&self.registry, &[self.registry_key()], &args)
            .await?;
        Ok(nodes_from_reply(&reply))
    }

    async fn leave(&self, owner: &Owner) -> Result<(), StoreError> {
        let args = registry_args("leave", owner.as_str(), None);
        let _: Vec<String> = self
            .eval(&self.registry, &[self.registry_key()], &args)
            .await?;
        Ok(())
    }

    /// The heartbeat's script goes first in the claim's pipeline (one round
    /// trip, one `WAIT`): after a script flush only the calls refused are
    /// sent again, and a beat that fails leaves the claims standing.
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        if requests.is_empty() {
            return registry::claim_alongside(self, requests, beat).await;
        }
        let (keys, args) = claim_args(&self.prefix, requests);
        let beat_keys = [self.registry_key()];
        let beat_args = registry_args("beat", beat.owner.as_str(), Some(beat));
        let mut replies = self
            .eval_all(&[
                (&self.registry, &beat_keys, &beat_args),
                (&self.claim, &keys, &args),
            ])
            .await?
            .into_iter();
        let (Some(beaten), Some(claimed)) = (replies.next(), replies.next()) else {
            return Err(self.malformed("a claim with a heartbeat lost a reply".into()));
        };
        let claimed = self.claimed(requests, self.decode(claimed)?)?;
        let nodes = match self.decode::<Vec<String>>(beaten) {
            Ok(reply) => Some(nodes_from_reply(&reply)),
            Err(e) => {
                tracing::debug!("the heartbeat in a claim batch failed: {e}");
                None
            }
        };
        Ok((claimed, nodes))
    }
}

impl RedisStore {
    /// The node registry's hash.
    pub(super) fn registry_key(&self) -> String {
        format!("{}nodes", self.prefix)
    }
}
