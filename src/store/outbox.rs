//! The outbox: what a node hands over for a peer to finish, kept in the
//! store (docs/protocol.md, "Webhook deliveries handed over"). Today that
//! is webhook deliveries a stopping daemon (or a dead daemon's guard) did
//! not make: each is a [`Parcel`], an id and an opaque body, and each is
//! taken by exactly one caller of [`Outbox::take_handed_over`].
//!
//! How each store takes a parcel once:
//! - SQL: a row per parcel, taken by the `DELETE` of its id that removed
//!   a row (of two takers, one deletes it, the other deletes nothing);
//! - Redis, Sentinel: a hash, read and emptied by one Lua script;
//! - Redlock: a hash per master; a taker marks the parcels on every
//!   master and takes those a majority marked for it
//!   (`redis/outbox.lua`), then deletes them everywhere;
//! - ZooKeeper: a znode per parcel, taken by its delete at the version
//!   read;
//! - etcd: a key per parcel, taken by a transaction deleting it at the
//!   revision read;
//! - memory: a map under the store's one lock.

use async_trait::async_trait;

use super::{Owner, StoreError};

/// One thing handed over: a unique id (`[A-Za-z0-9_.-]`, at most
/// [`MAX_ID`] bytes; oldest first in id order) and its body (JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parcel {
    pub id: String,
    pub body: String,
}

/// The longest parcel id, as every store keeps it (a znode name, a SQL
/// key column).
pub const MAX_ID: usize = 200;

/// Parcels taken at most per call.
pub const TAKE_AT_MOST: usize = 100;

impl Parcel {
    /// Whether the id is one every store keeps as it is.
    pub fn id_is_valid(id: &str) -> bool {
        !id.is_empty()
            && id.len() <= MAX_ID
            && !id.starts_with('.')
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    }
}

/// The outbox half of a store.
#[async_trait]
pub trait Outbox: Send + Sync + 'static {
    /// Leaves `parcels` in the store for a peer. Idempotent: a parcel
    /// handed over again (same id) replaces the one there. An error means
    /// some may not be there: the caller keeps them all.
    async fn hand_over(&self, parcels: &[Parcel]) -> Result<(), StoreError>;

    /// Takes at most `max` parcels, oldest first, out of the store: each
    /// parcel is answered to one caller only, however many take at once
    /// (`taker` names this one where the store needs it, Redlock). An
    /// error means none was taken by this call.
    async fn take_handed_over(&self, taker: &Owner, max: usize) -> Result<Vec<Parcel>, StoreError>;
}

/// `parcels` with an invalid id refused, as every store does before
/// writing.
pub(crate) fn checked(store: &str, parcels: &[Parcel]) -> Result<(), StoreError> {
    match parcels.iter().find(|p| !Parcel::id_is_valid(&p.id)) {
        None => Ok(()),
        Some(p) => Err(StoreError::Backend {
            store: store.to_string(),
            reason: format!(
                "a handed-over parcel's id {:?} is not [A-Za-z0-9_.-]{{1,{MAX_ID}}}",
                crate::config::one_line(&p.id)
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_what_every_store_keeps_as_it_is() {
        assert!(Parcel::id_is_valid("0001764000000000-ops-backup-7-failed"));
        for bad in ["", ".x", "a/b", "a b", "é", &"x".repeat(MAX_ID + 1)] {
            assert!(!Parcel::id_is_valid(bad), "{bad:?}");
        }
        assert!(
            checked(
                "s",
                &[Parcel {
                    id: "a/b".into(),
                    body: String::new()
                }]
            )
            .is_err()
        );
    }
}
