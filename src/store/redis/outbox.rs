//! The outbox on one Redis master ([`crate::store::outbox`]): a hash of
//! parcels, written and taken by `outbox.lua`, so a take reads and
//! deletes in one atomic step. Redlock's take is in `redlock/outbox.rs`.

use super::*;
use crate::store::{Outbox, Parcel, outbox};

/// The outbox's hash, and beside it (one hash tag) Redlock's marks and
/// when each parcel was handed over.
pub(crate) fn outbox_keys(prefix: &str) -> [String; 3] {
    [
        format!("{prefix}{{outbox}}"),
        format!("{prefix}{{outbox}}:marks"),
        format!("{prefix}{{outbox}}:at"),
    ]
}

/// `outbox.lua`'s arguments writing `parcels`.
pub(crate) fn put_args(parcels: &[Parcel]) -> Vec<String> {
    let mut args = Vec::with_capacity(1 + 2 * parcels.len());
    args.push("put".to_string());
    for p in parcels {
        args.push(p.id.clone());
        args.push(p.body.clone());
    }
    args
}

/// The parcels of a `take` or `mark` reply (id, body, id, body ...).
pub(crate) fn parcels_from_reply(reply: Vec<String>) -> Vec<Parcel> {
    let mut parcels = Vec::with_capacity(reply.len() / 2);
    let mut items = reply.into_iter();
    while let (Some(id), Some(body)) = (items.next(), items.next()) {
        parcels.push(Parcel { id, body });
    }
    parcels
}

#[async_trait]
impl Outbox for RedisStore {
    /// Through Sentinel with `wait`, a write fewer replicas acknowledged
    /// fails (the caller keeps the parcels, which a peer may take too).
    async fn hand_over(&self, parcels: &[Parcel]) -> Result<(), StoreError> {
        outbox::checked(self.url.redacted(), parcels)?;
        if parcels.is_empty() {
            return Ok(());
        }
        let _: i64 = self
            .eval(&self.outbox, &outbox_keys(&self.prefix), &put_args(parcels))
            .await?;
        Ok(())
    }

    /// Not followed by `WAIT`: a take the master made is answered even
    /// when too few replicas acknowledged it (a failover that loses the
    /// delete brings the parcels back, for a peer to send again), rather
    /// than deleted and answered as failed.
    async fn take_handed_over(
        &self,
        _taker: &Owner,
        prefix: &str,
        max: usize,
    ) -> Result<Vec<Parcel>, StoreError> {
        let mut conn = self.conn().await?;
        let mut call = self.outbox.prepare_invoke();
        for key in outbox_keys(&self.prefix) {
            call.key(key);
        }
        call.arg("take").arg(max).arg(prefix);
        let reply: Vec<String> = call
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(parcels_from_reply(reply))
    }
}
