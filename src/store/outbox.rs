//! The outbox: what a node hands over for a peer to finish, kept in the
//! store (docs/protocol.md, "Webhook deliveries handed over"). Today that
//! is webhook deliveries a stopping daemon (or a dead daemon's guard) did
//! not make: each is a [`Parcel`], an id and an opaque body, and each is
//! taken by one caller of [`Outbox::take_handed_over`], which takes only
//! the parcels whose id starts with a prefix (a webhook's name), so a node
//! takes what it can deliver and leaves the rest.
//!
//! How each store takes a parcel once:
//! - SQL: a row per parcel, taken by the `DELETE` of its id that removed
//!   a row (of two takers, one deletes it, the other deletes nothing);
//! - Redis, Sentinel: a hash, read and emptied by one Lua script;
//! - Redlock: a hash per master; a taker marks the parcels on every
//!   master and takes those a majority marked for it and then dropped for
//!   it (`redis/outbox.lua`);
//! - ZooKeeper: a znode per parcel, taken by its delete at the version
//!   read;
//! - etcd: a key per parcel, taken by the delete that answers its
//!   previous value;
//! - memory: a map under the store's one lock.
//!
//! Where a take goes one parcel at a time (SQL, ZooKeeper, etcd), it
//! starts no new one once half its store's `op_timeout` has passed since
//! the call began ([`one_by_one`]), so a large outbox is taken in several
//! calls rather than cut off mid-way with parcels deleted and not
//! answered.

use async_trait::async_trait;

use super::{Owner, StoreError};

/// One thing handed over: a unique id (`[A-Za-z0-9_.~-]`, at most
/// [`MAX_ID`] bytes; oldest first in id order after its prefix) and its
/// body (JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parcel {
    pub id: String,
    pub body: String,
}

/// The longest parcel id, as every store keeps it (a znode name, a SQL
/// key column of 255).
pub const MAX_ID: usize = 255;

/// Parcels taken at most per call.
pub const TAKE_AT_MOST: usize = 100;

impl Parcel {
    /// Whether the id (or a prefix of one) is one every store keeps as
    /// it is.
    pub fn id_is_valid(id: &str) -> bool {
        !id.is_empty()
            && id.len() <= MAX_ID
            && id != "."
            && id != ".."
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-' | b'~'))
    }
}

/// The outbox half of a store.
#[async_trait]
pub trait Outbox: Send + Sync + 'static {
    /// Leaves `parcels` in the store for a peer. Idempotent: a parcel
    /// handed over again (same id) replaces the one there. An error means
    /// some may be there and some not: the caller keeps them all (and a
    /// peer may take one it also keeps).
    async fn hand_over(&self, parcels: &[Parcel]) -> Result<(), StoreError>;

    /// Takes at most `max` parcels whose id starts with `prefix`, oldest
    /// first, out of the store: each parcel is answered to one caller only,
    /// however many take at once (`taker` names this one where the store
    /// needs it, Redlock). An error means this call answers none; a parcel
    /// whose delete was sent and not answered may be gone all the same.
    async fn take_handed_over(
        &self,
        taker: &Owner,
        prefix: &str,
        max: usize,
    ) -> Result<Vec<Parcel>, StoreError>;
}

/// `parcels` with an invalid id refused, as every store does before
/// writing.
pub(crate) fn checked(store: &str, parcels: &[Parcel]) -> Result<(), StoreError> {
    match parcels.iter().find(|p| !Parcel::id_is_valid(&p.id)) {
        None => Ok(()),
        Some(p) => Err(StoreError::Backend {
            store: store.to_string(),
            reason: format!(
                "a handed-over parcel's id {:?} is not [A-Za-z0-9_.~-]{{1,{MAX_ID}}}",
                crate::config::one_line(&p.id)
            ),
        }),
    }
}

/// Takes `candidates` one at a time with `take_one` (`Some`: this call
/// took it), starting no new one once `until` has passed: what was taken,
/// or the first error when nothing was.
#[cfg(any(
    feature = "sqlite",
    feature = "mysql",
    feature = "postgres",
    feature = "zookeeper",
    feature = "etcd"
))]
pub(crate) async fn one_by_one<T, F, Fut>(
    candidates: impl IntoIterator<Item = T>,
    until: tokio::time::Instant,
    mut take_one: F,
) -> Result<Vec<Parcel>, StoreError>
where
    F: FnMut(T) -> Fut,
    Fut: std::future::Future<Output = Result<Option<Parcel>, StoreError>>,
{
    let mut taken = Vec::new();
    for candidate in candidates {
        if tokio::time::Instant::now() >= until {
            break;
        }
        match take_one(candidate).await {
            Ok(Some(p)) => taken.push(p),
            Ok(None) => {}
            Err(e) if taken.is_empty() => return Err(e),
            Err(_) => break,
        }
    }
    Ok(taken)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_what_every_store_keeps_as_it_is() {
        assert!(Parcel::id_is_valid("ops~0001764000000000-backup-7-failed"));
        assert!(Parcel::id_is_valid(".ops~1"));
        for bad in ["", ".", "..", "a/b", "a b", "é", &"x".repeat(MAX_ID + 1)] {
            assert!(!Parcel::id_is_valid(bad), "{bad:?}");
        }
        let bad = Parcel {
            id: "a/b".into(),
            body: String::new(),
        };
        assert!(checked("s", &[bad]).is_err());
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test(start_paused = true)]
    async fn one_by_one_stops_starting_takes_once_its_budget_is_spent() {
        use std::time::Duration;
        let take = |i: u32| async move {
            tokio::time::sleep(Duration::from_millis(400)).await;
            match i {
                3 => Err(StoreError::Timeout(Duration::from_secs(1))),
                _ => Ok(i.is_multiple_of(2).then(|| Parcel {
                    id: format!("p{i}"),
                    body: String::new(),
                })),
            }
        };
        let until = |d| tokio::time::Instant::now() + d;
        // 0 taken, 1 someone else's, 2 taken, then the budget (1 s) is spent.
        let got = one_by_one(0..10, until(Duration::from_secs(1)), take)
            .await
            .unwrap();
        let ids: Vec<&str> = got.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["p0", "p2"]);
        // An error after a take answers what was taken; before, the error.
        let got = one_by_one(2..10, until(Duration::from_secs(5)), take)
            .await
            .unwrap();
        assert_eq!(got.len(), 1);
        assert!(
            one_by_one(3..10, until(Duration::from_secs(5)), take)
                .await
                .is_err()
        );
    }
}
