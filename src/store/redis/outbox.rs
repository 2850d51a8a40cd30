//! The outbox on one Redis master ([`crate::store::outbox`]): a hash of
//! parcels, written and taken by `outbox.lua`, so a take reads and
//! deletes in one atomic step. Redlock's take is in `redlock/outbox.rs`.

use super::*;
use crate::store::{Outbox, Parcel, outbox};

/// The outbox's hash and Redlock's marks beside it (one hash tag).
pub(crate) fn outbox_keys(prefix: &str) -> [String; 2] {
    [
        format!("{prefix}{{outbox}}"),
        format!("{prefix}{{outbox}}:marks"),
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

    async fn take_handed_over(
        &self,
        _taker: &Owner,
        max: usize,
    ) -> Result<Vec<Parcel>, StoreError> {
        let args = ["take".to_string(), max.to_string()];
        let reply: Vec<String> = self
            .eval(&self.outbox, &outbox_keys(&self.prefix), &args)
            .await?;
        Ok(parcels_from_reply(reply))
    }
}
