//! The outbox on every master ([`crate::store::outbox`]): a parcel is
//! handed over once a majority of masters keep it. A taker marks the
//! oldest parcels of its prefix for itself on every master (`outbox.lua`
//! `mark`: a mark of another taker holds for [`MARK_HOLDS`]), then drops
//! those a majority marked for it, each only where the mark is still its
//! own (`drop`), and answers a parcel only when a majority dropped it: any
//! two majorities share a master, where the first drop deleted the parcel,
//! so of two takers at most one can, as long as no master loses a delete
//! it acknowledged. A parcel marked for it on fewer masters is unmarked
//! again (beside the drop), so takers that split a parcel try again at
//! once. A copy left on a minority of masters (a drop or a hand-over that
//! missed one) is never won again, and is deleted there by the first take
//! of its prefix once older than [`LEFT_FOR`].

use super::*;
use crate::store::redis::{outbox_keys, parcels_from_reply, put_args};
use crate::store::{Outbox, Parcel, outbox};

/// How long a taker's mark keeps another taker off a parcel: longer than
/// a take's mark, tally and drop.
const MARK_HOLDS: Duration = Duration::from_secs(30);

/// A parcel older than this on a master is a copy nobody can take any
/// more: past the 24 hours a webhook delivery is tried, with a margin.
const LEFT_FOR: Duration = Duration::from_secs(25 * 3600);

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

    async fn take_handed_over(
        &self,
        taker: &Owner,
        prefix: &str,
        max: usize,
    ) -> Result<Vec<Parcel>, StoreError> {
        let keys = outbox_keys(&self.prefix);
        let args = [
            "mark".to_string(),
            max.to_string(),
            prefix.to_string(),
            taker.as_str().to_string(),
            MARK_HOLDS.as_millis().to_string(),
            LEFT_FOR.as_millis().to_string(),
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
            max,
        );
        let taker_arg = taker.as_str().to_string();
        // Best effort, beside the drop: a mark left lapses after MARK_HOLDS.
        let mut unmark = vec!["unmark".to_string(), taker_arg.clone()];
        unmark.extend(split);
        let u = &unmark;
        let unmarking = async {
            if u.len() > 2 {
                let _ = self
                    .each(|m| self.eval_on::<i64>(m, &self.outbox, k, u))
                    .await;
            }
        };
        let mut drop = vec!["drop".to_string(), taker_arg];
        drop.extend(won.iter().map(|p| p.id.clone()));
        let d = &drop;
        let dropping = async {
            if won.is_empty() {
                return Ok(Vec::new());
            }
            let answers = self
                .each(|m| self.eval_on::<Vec<String>>(m, &self.outbox, k, d))
                .await;
            self.quorum(answers)
        };
        let ((), dropped) = tokio::join!(unmarking, dropping);
        let mut count: BTreeMap<String, usize> = BTreeMap::new();
        for (_, ids) in dropped? {
            for id in ids {
                *count.entry(id).or_default() += 1;
            }
        }
        Ok(won
            .into_iter()
            .filter(|p| count.get(&p.id).is_some_and(|n| *n >= self.majority()))
            .collect())
    }
}

/// The oldest `max` parcels at least `majority` masters marked for this
/// taker, and the ids of the others marked for it (fewer masters, or past
/// `max`: each master answers its own oldest).
fn won_parcels(
    replies: impl IntoIterator<Item = Vec<Parcel>>,
    majority: usize,
    max: usize,
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
        if n >= majority && won.len() < max {
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
    fn a_parcel_is_won_where_a_majority_marked_it_and_no_more_than_asked() {
        let (won, split) = won_parcels(
            [vec![p("b"), p("a")], vec![p("a")], vec![p("b"), p("c")]],
            2,
            10,
        );
        assert_eq!(won, vec![p("a"), p("b")]);
        assert_eq!(split, vec!["c".to_string()]);
        let (won, split) = won_parcels([vec![p("a")], vec![], vec![]], 2, 10);
        assert!(won.is_empty());
        assert_eq!(split, vec!["a".to_string()]);
        // Each master's own oldest two: three won by a majority, two kept.
        let (won, split) = won_parcels(
            [
                vec![p("x"), p("y")],
                vec![p("y"), p("z")],
                vec![p("x"), p("z")],
            ],
            2,
            2,
        );
        assert_eq!(won, vec![p("x"), p("y")]);
        assert_eq!(split, vec!["z".to_string()]);
    }
}
