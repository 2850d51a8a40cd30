//! The id of a request in a job's lock (docs/protocol.md, "Manual runs"):
//! an operator's manual run (`cronlease trigger`), a retry's attempt, a
//! redelivery of a claim a dead daemon never started, and a resume's
//! catch-up, told apart by marks in the id's low bits, so every store keeps
//! them all in one field with no schema of their own.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::from_ms;

/// The id of a manual run's request (`cronlease trigger`): positive, kept as
/// a 64-bit integer, shown as 16 hex digits. It names the request in the
/// job's lock (pending), in the claim that takes it and in the run's history
/// record. Its high bits are when it was made (milliseconds since the Unix
/// epoch, by the store's clock as `trigger` read it), its low [`TRIGGER_RANDOM_BITS`]
/// random: every store knows a pending request's age without a field of
/// its own ([`TriggerId::requested_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TriggerId(i64);

impl TriggerId {
    /// A fresh id made now (never 0).
    pub fn new() -> Self {
        Self::made_at(Utc::now())
    }

    /// A fresh id made at `at`.
    pub fn made_at(at: DateTime<Utc>) -> Self {
        let mut bytes = [0u8; 8];
        if getrandom::fill(&mut bytes).is_err() {
            let now = Utc::now().timestamp_nanos_opt().unwrap_or_default() as u64;
            bytes = (now ^ u64::from(std::process::id()).rotate_left(32)).to_le_bytes();
        }
        let random = (u64::from_le_bytes(bytes) & ((1 << TRIGGER_RANDOM_BITS) - 1)) as i64;
        Self::manual(at, random)
    }

    /// A manual run's id made at `at` for a client's request id `key` (the
    /// write API's `request_id`): its low bits come from the key, so a
    /// request asked again finds its first asking by them
    /// ([`TriggerId::of_request`]), whenever that was made.
    pub fn for_request(at: DateTime<Utc>, key: &str) -> Self {
        Self::manual(at, Self::request_bits(key))
    }

    /// A manual run's low bits for request id `key`.
    fn request_bits(key: &str) -> i64 {
        Self::low_bits(Self::key_hash(key))
    }

    /// The bits of `key` a manual run's id takes its low bits from.
    fn key_hash(key: &str) -> i64 {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(key.as_bytes());
        let mut low = [0u8; 8];
        low.copy_from_slice(&digest[..8]);
        i64::from_le_bytes(low)
    }

    /// Whether this id was made for the client's request id `key`
    /// ([`TriggerId::for_request`]): an operator's manual run whose low
    /// bits are the key's (1 in 2^20 of other ids match by chance).
    pub fn of_request(self, key: &str) -> bool {
        let mask = (1 << TRIGGER_RANDOM_BITS) - 1;
        // Also as a build before shards made it (only marks changed): a
        // request asked again across an upgrade is found.
        let before_shards = {
            let mut low = Self::key_hash(key) & mask;
            if Self::marked(low >> RETRY_ATTEMPT_BITS) {
                low ^= 1 << (TRIGGER_RANDOM_BITS - 1);
            }
            low
        };
        self.resumed_at().is_none()
            && self.daemons_attempt().is_none()
            && [Self::request_bits(key), before_shards].contains(&(self.0 & mask))
    }

    /// A manual run's id of time `at` and low bits `random`; bits that
    /// would read as a retry's, a redelivery's or a resume's mark
    /// ([`TriggerId::retry`], [`TriggerId::redelivery`],
    /// [`TriggerId::resumed`]) are changed.
    fn manual(at: DateTime<Utc>, random: i64) -> Self {
        TriggerId(((time_bits(at) << TRIGGER_RANDOM_BITS) | Self::low_bits(random)).max(1))
    }

    /// `random`'s low bits as a manual run's id has them: never a mark
    /// nor a shard's tag.
    fn low_bits(mut random: i64) -> i64 {
        random &= (1 << TRIGGER_RANDOM_BITS) - 1;
        if Self::marked(random >> RETRY_ATTEMPT_BITS) || random >> SHARD_PAYLOAD_BITS == SHARD_TAG {
            random ^= 1 << (TRIGGER_RANDOM_BITS - 1);
        }
        random
    }

    /// The request for shard `index` of `count` of a broadcast job's
    /// occurrence `at` (`placement = "every_node"`, docs/protocol.md
    /// "Broadcast"), left by the node that dispatched the occurrence in the
    /// shard's own lock: its time is the occurrence, its low bits
    /// [`SHARD_TAG`], the index and the count. `None` for a count of 0 or
    /// above [`MAX_SHARDS`], or an index not below the count.
    pub fn shard(at: DateTime<Utc>, index: u32, count: u32) -> Option<Self> {
        if count == 0 || count > MAX_SHARDS || index >= count {
            return None;
        }
        Some(TriggerId(
            (time_bits(at) << TRIGGER_RANDOM_BITS)
                | (SHARD_TAG << SHARD_PAYLOAD_BITS)
                | (i64::from(index) << 8)
                | i64::from(count),
        ))
    }

    /// For a shard's request ([`TriggerId::shard`]): the occurrence, the
    /// shard's index and the count. `None` for any other.
    pub fn shard_of(self) -> Option<(DateTime<Utc>, u32, u32)> {
        let low = self.0 & ((1 << TRIGGER_RANDOM_BITS) - 1);
        if low >> SHARD_PAYLOAD_BITS != SHARD_TAG {
            return None;
        }
        let (index, count) = (((low >> 8) & 0xff) as u32, (low & 0xff) as u32);
        let at = self.requested_at()?;
        (count > 0 && index < count).then_some((at, index, count))
    }

    /// Whether `mark` (the 16 bits above an id's low 4) is one a retry's,
    /// a redelivery's or a resume's id carries.
    fn marked(mark: i64) -> bool {
        mark == RETRY_MARK || mark == RESUME_MARK || REDELIVERY_MARKS.contains(&mark)
    }

    /// The request `cronlease resume` leaves for a job it resumed at `at`
    /// whose latest occurrence was missed while it was paused
    /// (docs/protocol.md, "Catch-up on resume"): no node runs it as a
    /// manual run; a node that has the job claims that occurrence at once,
    /// by the occurrence's own claim rule, and withdraws the request. Its
    /// time is when the job was resumed.
    pub fn resumed(at: DateTime<Utc>) -> Self {
        TriggerId((time_bits(at) << TRIGGER_RANDOM_BITS) | (RESUME_MARK << RETRY_ATTEMPT_BITS) | 1)
    }

    /// For a resume's request ([`TriggerId::resumed`]): when the job was
    /// resumed. `None` for any other.
    pub fn resumed_at(self) -> Option<DateTime<Utc>> {
        self.unpacked()
            .filter(|&(mark, ..)| mark == RESUME_MARK)
            .map(|(.., at)| at)
    }

    /// The request of a job's retry (`retry`, docs/protocol.md "Retries"):
    /// attempt `attempt` (2 to [`MAX_RETRY_ATTEMPTS`]) of an occurrence,
    /// due at `due`. Its time is when it is due, not when it was made; its
    /// low bits are [`RETRY_MARK`] and the attempt instead of random ones
    /// (a job has one pending request at a time, so the time names it).
    pub fn retry(due: DateTime<Utc>, attempt: u32) -> Self {
        let attempt = i64::from(attempt.clamp(2, MAX_RETRY_ATTEMPTS));
        TriggerId(
            (time_bits(due) << TRIGGER_RANDOM_BITS) | (RETRY_MARK << RETRY_ATTEMPT_BITS) | attempt,
        )
    }

    /// The request that hands a claim back for another run
    /// (docs/protocol.md, "Redelivery"): attempt `attempt` (1 to
    /// [`MAX_RETRY_ATTEMPTS`]) of an occurrence, due at `due` (the
    /// occurrence itself for attempt 1, the retry's due time for a later
    /// one), redelivered for the `generation`th time (1 to
    /// [`MAX_REDELIVERIES`]: each generation has a mark of its own, so a
    /// redelivery of a redelivery has an id of its own). `None` past the
    /// last generation.
    pub fn redelivery(due: DateTime<Utc>, attempt: u32, generation: u32) -> Option<Self> {
        let mark = REDELIVERY_MARKS.start + i64::from(generation) - 1;
        if generation == 0 || !REDELIVERY_MARKS.contains(&mark) {
            return None;
        }
        let attempt = i64::from(attempt.clamp(1, MAX_RETRY_ATTEMPTS));
        Some(TriggerId(
            (time_bits(due) << TRIGGER_RANDOM_BITS) | (mark << RETRY_ATTEMPT_BITS) | attempt,
        ))
    }

    /// The mark, attempt and due time of a retry's or a redelivery's id,
    /// if its time is plausible (an earlier build's wholly random ids are
    /// not).
    fn unpacked(self) -> Option<(i64, u32, DateTime<Utc>)> {
        let low = self.0 & ((1 << TRIGGER_RANDOM_BITS) - 1);
        let mark = low >> RETRY_ATTEMPT_BITS;
        if !Self::marked(mark) {
            return None;
        }
        let attempt = u32::try_from(low & ((1 << RETRY_ATTEMPT_BITS) - 1)).ok()?;
        let ms = self.0 >> TRIGGER_RANDOM_BITS;
        let plausible = TRIGGER_TIMES_FROM..=Utc::now().timestamp_millis() + 2 * 86_400_000;
        (plausible.contains(&ms) && (1..=MAX_RETRY_ATTEMPTS).contains(&attempt))
            .then(|| (mark, attempt, from_ms(ms)))
    }

    /// For a retry's request ([`TriggerId::retry`]): its attempt and when
    /// it is due. `None` for a manual run's and a redelivery's.
    pub fn retry_of(self) -> Option<(u32, DateTime<Utc>)> {
        self.unpacked()
            .filter(|&(mark, attempt, _)| mark == RETRY_MARK && attempt >= 2)
            .map(|(_, attempt, due)| (attempt, due))
    }

    /// For a redelivery's request ([`TriggerId::redelivery`]): its attempt,
    /// due time and generation. `None` for any other.
    pub fn redelivery_of(self) -> Option<Redelivery> {
        self.unpacked()
            .filter(|(mark, ..)| REDELIVERY_MARKS.contains(mark))
            .map(|(mark, attempt, due)| Redelivery {
                attempt,
                due,
                generation: (mark - REDELIVERY_MARKS.start + 1) as u32,
            })
    }

    /// An operator's request (`cronlease trigger`), not one the daemons
    /// make for themselves (a retry, a redelivery) nor a resume's.
    pub fn is_operators(self) -> bool {
        self.daemons_attempt().is_none() && self.resumed_at().is_none() && self.shard_of().is_none()
    }

    /// A request the daemons made for themselves: the attempt it runs and
    /// when that was due (a retry's or a redelivery's). Its time is not
    /// when it was made.
    pub fn daemons_attempt(self) -> Option<(u32, DateTime<Utc>)> {
        self.retry_of()
            .or_else(|| self.redelivery_of().map(|r| (r.attempt, r.due)))
    }

    /// The attempt a run of this request is: its retry's or redelivery's,
    /// else 1.
    pub fn attempt(id: Option<Self>) -> u32 {
        let Some(id) = id else { return 1 };
        match (id.retry_of(), id.redelivery_of()) {
            (Some((k, _)), _) => k,
            (_, Some(r)) => r.attempt,
            _ => 1,
        }
    }

    /// When the request was made, by the store's clock `trigger` read; `None`
    /// for an id that carries no plausible time (made by an earlier build,
    /// whose ids were wholly random: about one in 70 of those reads as a
    /// time after 2025 anyway).
    pub fn requested_at(self) -> Option<DateTime<Utc>> {
        let ms = self.0 >> TRIGGER_RANDOM_BITS;
        let plausible = TRIGGER_TIMES_FROM..=Utc::now().timestamp_millis() + 86_400_000;
        plausible.contains(&ms).then(|| from_ms(ms))
    }

    /// How old the request is at `now` (`None` without a time, or made
    /// after `now`).
    pub fn age(self, now: DateTime<Utc>) -> Option<Duration> {
        (now - self.requested_at()?).to_std().ok()
    }

    /// An id as a store keeps it (a positive integer); anything else is none.
    pub fn from_stored(raw: i64) -> Option<Self> {
        (raw > 0).then_some(TriggerId(raw))
    }

    /// The stored form.
    pub fn get(self) -> i64 {
        self.0
    }

    /// An id as shown: 16 hex digits.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        if s.len() != 16 {
            return None;
        }
        i64::from_str_radix(s, 16).ok().and_then(Self::from_stored)
    }

    /// An id as a store keeps it in text: decimal.
    pub fn parse_stored(s: &str) -> Option<Self> {
        s.trim().parse().ok().and_then(Self::from_stored)
    }
}

/// The random low bits of a [`TriggerId`].
pub const TRIGGER_RANDOM_BITS: u32 = 20;
/// A retry's request ([`TriggerId::retry`]): these 16 bits above the
/// attempt's 4 in place of the random ones. A manual run's id never has
/// them (nor a redelivery's marks); an id made by a build before retries,
/// one in 65,536.
const RETRY_MARK: i64 = 0xa7e5;
const RETRY_ATTEMPT_BITS: u32 = 4;
/// The most attempts a `retry` makes, the first run included.
pub const MAX_RETRY_ATTEMPTS: u32 = 10;
/// A redelivery's request ([`TriggerId::redelivery`]): one of these marks
/// (its generation: the first for a claim handed back once, the next for
/// the redelivery of a redelivery) in place of [`RETRY_MARK`].
const REDELIVERY_MARKS: std::ops::Range<i64> = 0xa7e6..0xa7e6 + MAX_REDELIVERIES as i64;
/// A resume's request ([`TriggerId::resumed`]): this mark, and attempt 1,
/// in place of random bits.
const RESUME_MARK: i64 = 0xa7e4;
/// A shard's request ([`TriggerId::shard`]): these 4 bits at the top of
/// the low bits (never a mark's: theirs start 0xa), above the index's 8 and
/// the count's 8.
const SHARD_TAG: i64 = 0xf;
const SHARD_PAYLOAD_BITS: u32 = 16;
/// The most shards (nodes) a broadcast occurrence is split into.
pub const MAX_SHARDS: u32 = 255;
/// How often one attempt of an occurrence is handed back at most: a
/// claim whose daemon dies before each start, again and again, ends
/// recorded `not_started`.
pub const MAX_REDELIVERIES: u32 = 3;
/// Ids with a time before this (2025-01-01) carry none.
const TRIGGER_TIMES_FROM: i64 = 1_735_689_600_000;

/// An id's time bits: milliseconds since the epoch, within what fits.
fn time_bits(at: DateTime<Utc>) -> i64 {
    at.timestamp_millis()
        .clamp(0, i64::MAX >> TRIGGER_RANDOM_BITS)
}

/// What a redelivery's request ([`TriggerId::redelivery`]) carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Redelivery {
    /// The attempt handed back (1: the occurrence's first run).
    pub attempt: u32,
    /// When the attempt handed back was due: the occurrence for attempt 1.
    pub due: DateTime<Utc>,
    /// How often this attempt has been handed back, this time included.
    pub generation: u32,
}

impl Default for TriggerId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for TriggerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl Serialize for TriggerId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The serialized form read back (a node's running runs in its registry
/// record): what [`TriggerId::parse`] reads.
impl<'de> serde::Deserialize<'de> for TriggerId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        TriggerId::parse(&s).ok_or_else(|| serde::de::Error::custom("not a trigger id"))
    }
}

/// A pending request's name where a store lists them by name (ZooKeeper's
/// `triggers/` children, etcd's `trigger/` keys): `<job>~<id>`.
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
pub(crate) fn trigger_entry(job: &str, id: TriggerId) -> String {
    format!("{job}~{id}")
}

/// The pending requests a store listed by name ([`trigger_entry`]),
/// sorted; a name this version cannot read is left out.
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
pub(crate) fn pending_from_entries<'a>(
    names: impl Iterator<Item = &'a str>,
) -> Vec<(String, TriggerId)> {
    let mut pending: Vec<(String, TriggerId)> = names
        .filter_map(|name| {
            let (job, id) = name.rsplit_once('~')?;
            Some((job.to_string(), TriggerId::parse(id)?))
        })
        .collect();
    pending.sort();
    pending
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_request_id_names_its_trigger_whenever_it_was_made() {
        let first = TriggerId::for_request(from_ms(1_790_000_000_000), "deploy-42");
        let again = TriggerId::for_request(from_ms(1_790_000_060_000), "deploy-42");
        assert_ne!(first, again);
        assert!(first.of_request("deploy-42") && again.of_request("deploy-42"));
        assert!(!first.of_request("deploy-43"));
        assert!(first.is_operators());
        assert_eq!(first.requested_at(), Some(from_ms(1_790_000_000_000)));
        // Neither a random id nor a daemon's own request reads as one.
        let due = from_ms(1_790_000_000_000);
        assert!(!TriggerId::retry(due, 2).of_request("deploy-42"));
        assert!(!TriggerId::resumed(due).of_request("deploy-42"));
    }

    #[test]
    fn a_retry_request_carries_its_attempt_and_due_time_and_a_manual_one_never_reads_as_one() {
        let due = Utc::now() + chrono::Duration::seconds(90);
        let due = from_ms(due.timestamp_millis());
        for attempt in 2..=MAX_RETRY_ATTEMPTS {
            let id = TriggerId::retry(due, attempt);
            assert_eq!(id.retry_of(), Some((attempt, due)));
            assert_eq!(TriggerId::attempt(Some(id)), attempt);
            // Stored and shown forms keep it.
            assert_eq!(TriggerId::from_stored(id.get()), Some(id));
            assert_eq!(TriggerId::parse(&id.to_string()), Some(id));
            // Its age counts from when it is due.
            assert_eq!(id.age(Utc::now()), None);
            assert!(id.age(due + chrono::Duration::seconds(5)).is_some());
        }
        // A manual id whose random bits happen to be a retry's mark and
        // attempt is changed, so it never reads as one.
        for attempt in 2..=MAX_RETRY_ATTEMPTS {
            let random = (RETRY_MARK << RETRY_ATTEMPT_BITS) | i64::from(attempt);
            let id = TriggerId::manual(due, random);
            assert_eq!(id.retry_of(), None, "{id}");
            assert_eq!(TriggerId::attempt(Some(id)), 1);
            assert_eq!(id.requested_at(), Some(due));
        }
        assert_eq!(TriggerId::new().retry_of(), None);
        assert_eq!(TriggerId::attempt(None), 1);
        // An id far in the future (an earlier build's random one) is not.
        let far = TriggerId::retry(Utc::now() + chrono::Duration::days(30), 2);
        assert_eq!(far.retry_of(), None);
    }

    #[test]
    fn a_redelivery_request_carries_its_attempt_due_time_and_generation_and_reads_as_no_other_kind()
    {
        let due = from_ms(Utc::now().timestamp_millis() - 1_500);
        let mut seen = std::collections::BTreeSet::new();
        for attempt in 1..=MAX_RETRY_ATTEMPTS {
            for generation in 1..=MAX_REDELIVERIES {
                let id = TriggerId::redelivery(due, attempt, generation).unwrap();
                assert_eq!(
                    id.redelivery_of(),
                    Some(Redelivery {
                        attempt,
                        due,
                        generation
                    })
                );
                assert_eq!(id.retry_of(), None, "{id}");
                assert!(!id.is_operators());
                assert_eq!(TriggerId::attempt(Some(id)), attempt);
                assert_eq!(TriggerId::parse(&id.to_string()), Some(id));
                assert!(seen.insert(id), "{id} repeats");
            }
            assert_eq!(TriggerId::redelivery(due, attempt, 0), None);
            assert_eq!(
                TriggerId::redelivery(due, attempt, MAX_REDELIVERIES + 1),
                None
            );
            // A retry's id is no redelivery, and neither is an operator's.
            if attempt >= 2 {
                let retry = TriggerId::retry(due, attempt);
                assert_eq!(retry.redelivery_of(), None);
                assert!(!retry.is_operators());
            }
        }
        // A manual id whose random bits would read as a redelivery's is
        // changed.
        for generation in 1..=MAX_REDELIVERIES {
            let mark = REDELIVERY_MARKS.start + i64::from(generation) - 1;
            let id = TriggerId::manual(due, (mark << RETRY_ATTEMPT_BITS) | 1);
            assert_eq!(id.redelivery_of(), None, "{id}");
            assert!(id.is_operators());
        }
    }

    #[test]
    fn a_resume_request_carries_when_it_was_made_and_reads_as_no_other_kind() {
        let at = from_ms(Utc::now().timestamp_millis() - 300);
        let id = TriggerId::resumed(at);
        assert_eq!(id.resumed_at(), Some(at));
        assert_eq!(id.requested_at(), Some(at));
        assert_eq!((id.retry_of(), id.redelivery_of()), (None, None));
        assert_eq!(id.daemons_attempt(), None);
        assert!(!id.is_operators());
        assert_eq!(TriggerId::parse(&id.to_string()), Some(id));
        assert_eq!(TriggerId::from_stored(id.get()), Some(id));
        // A manual id whose random bits would read as a resume's is changed;
        // no retry or redelivery reads as one.
        let id = TriggerId::manual(at, (RESUME_MARK << RETRY_ATTEMPT_BITS) | 1);
        assert_eq!(id.resumed_at(), None, "{id}");
        assert!(id.is_operators());
        assert_eq!(TriggerId::retry(at, 2).resumed_at(), None);
        assert_eq!(
            TriggerId::redelivery(at, 1, 1).and_then(|r| r.resumed_at()),
            None
        );
    }

    #[test]
    fn a_shard_request_carries_its_occurrence_index_and_count_and_reads_as_no_other_kind() {
        let at = from_ms((Utc::now().timestamp_millis() / 1000 - 5) * 1000);
        for (index, count) in [(0, 1), (0, 3), (2, 3), (254, 255)] {
            let id = TriggerId::shard(at, index, count).unwrap();
            assert_eq!(id.shard_of(), Some((at, index, count)));
            assert_eq!(id.requested_at(), Some(at));
            assert!(!id.is_operators());
            assert_eq!(
                (id.retry_of(), id.redelivery_of(), id.resumed_at()),
                (None, None, None)
            );
            assert_eq!(TriggerId::attempt(Some(id)), 1);
            assert_eq!(TriggerId::parse(&id.to_string()), Some(id));
        }
        assert_eq!(TriggerId::shard(at, 3, 3), None);
        assert_eq!(TriggerId::shard(at, 0, 0), None);
        assert_eq!(TriggerId::shard(at, 0, MAX_SHARDS + 1), None);
        // A manual id whose random bits would read as a shard's is changed;
        // no other kind reads as one.
        let id = TriggerId::manual(at, (SHARD_TAG << SHARD_PAYLOAD_BITS) | (1 << 8) | 2);
        assert_eq!(id.shard_of(), None, "{id}");
        assert!(id.is_operators());
        for other in [
            Some(TriggerId::retry(at, 2)),
            TriggerId::redelivery(at, 1, 1),
            Some(TriggerId::resumed(at)),
            Some(TriggerId::made_at(at)),
        ] {
            assert_eq!(other.and_then(TriggerId::shard_of), None);
        }
    }
}
