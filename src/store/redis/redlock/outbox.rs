//! The outbox on every master ([`crate::store::outbox`]): a parcel is
//! handed over once a majority of masters keep it. A taker marks the
//! oldest parcels for itself on every master (`outbox.lua` `mark`: a mark
//! of another taker holds for [`MARK_HOLDS`]); a parcel a majority marked
//! for it is its, as a lock would be, and is dropped everywhere before it
//! is answered; one marked for it on fewer is unmarked again, so takers
//! that split a parcel between them try again at once. A drop that
//! reached fewer than a majority answers nothing (the marks lapse and a
//! taker tries again); what it left on a minority of masters is never
//! taken again (a majority can no longer mark it).

use super::*;
use crate::store::redis::{outbox_keys, parcels_from_reply, put_args};
use crate::store::{Outbox, Parcel, outbox};

/// How long a taker's mark keeps another taker off a parcel: longer than
/// a take's mark, tally and drop.
const MARK_HOLDS: Duration = Duration::from_secs(30);

#[async_trait]
impl Outbox for RedlockStore {
    async fn hand_over(&self, parcels: &[Parcel]) -> Result<(), StoreError> {
        outbox::checked(self.url.redacted(), parcels)?;
        if parcels.is_empty() {
            return Ok(());
        }
        let (keys, args) = (outbox_keys(&self.prefix), put_args(parcels));
        let (k, a) = (&keys, &args);
        let answers = self
            .each(|m| self.eval_on::<i64>(m, &self.outbox, k, a))
            .await;
        self.quorum(answers).map(|_| ())
    }

    async fn take_handed_over(&self, taker: &Owner, max: usize) -> Result<Vec<Parcel>, StoreError> {
        let keys = outbox_keys(&self.prefix);
        let args = [
            "mark".to_string(),
            max.to_string(),
            taker.as_str().to_string(),
            MARK_HOLDS.as_millis().to_string(),
        ];
        let (k, a) = (&keys, &args);
        let answers = self
            .each(|m| self.eval_on::<Vec<String>>(m, &self.outbox, k, a))
            .await;
        let marked = self.quorum(answers)?;
        let (won, split) = won_parcels(
            marked
                .into_iter()
                .map(|(_, reply)| parcels_from_reply(reply)),
            self.majority(),
        );
        if !split.is_empty() {
            // Marked for this taker on too few masters: unmarked, so that
            // takers who split a parcel try again now instead of waiting
            // the marks out (best effort: a mark left lapses).
            let mut unmark = vec!["unmark".to_string(), taker.as_str().to_string()];
            unmark.extend(split);
            let u = &unmark;
            let _ = self
                .each(|m| self.eval_on::<i64>(m, &self.outbox, k, u))
                .await;
        }
        if won.is_empty() {
            return Ok(won);
        }
        let mut drop = vec!["drop".to_string()];
        drop.extend(won.iter().map(|p| p.id.clone()));
        let d = &drop;
        let answers = self
            .each(|m| self.eval_on::<i64>(m, &self.outbox, k, d))
            .await;
        self.quorum(answers)?;
        Ok(won)
    }
}

/// The parcels at least `majority` masters marked for this taker, oldest
/// first, and the ids fewer marked for it.
fn won_parcels(
    replies: impl IntoIterator<Item = Vec<Parcel>>,
    majority: usize,
) -> (Vec<Parcel>, Vec<String>) {
    let mut seen: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for reply in replies {
        for p in reply {
            seen.entry(p.id).or_insert((0, p.body)).0 += 1;
        }
    }
    let mut won = Vec::new();
    let mut split = Vec::new();
    for (id, (n, body)) in seen {
        if n >= majority {
            won.push(Parcel { id, body });
        } else {
            split.push(id);
        }
    }
    (won, split)
}

#[cfg(test)]
mod outbox_tests {
    use super::*;

    fn p(id: &str) -> Parcel {
        Parcel {
            id: id.into(),
            body: format!("body of {id}"),
        }
    }

    #[test]
    fn a_parcel_is_won_where_a_majority_marked_it() {
        let (won, split) = won_parcels(
            [vec![p("b"), p("a")], vec![p("a")], vec![p("b"), p("c")]],
            2,
        );
        assert_eq!(won, vec![p("a"), p("b")]);
        assert_eq!(split, vec!["c".to_string()]);
        let (won, split) = won_parcels([vec![p("a")], vec![], vec![]], 2);
        assert!(won.is_empty());
        assert_eq!(split, vec!["a".to_string()]);
    }
}
