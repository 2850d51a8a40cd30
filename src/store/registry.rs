//! The node registry: which nodes of the cluster are alive, and what they
//! say of themselves (docs/protocol.md, "Node registry").
//!
//! Every node keeps one record per owner (process incarnation) in the store
//! and refreshes it with a [`Heartbeat`] at least every lease margin. A
//! record lives for the heartbeat's `ttl` **on the store's clock** (etcd,
//! which has no clock, on the recorded end as the lease keys do), so a
//! killed node disappears from `cronlease nodes` within that time without
//! anyone deleting it; a node shutting down deletes its own record at once.
//! A heartbeat answers with the live records, so a node learns the
//! membership in the same round trip.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{ClaimRequest, Claimed, Owner, StoreError};
#[cfg(any(
    test,
    feature = "redis",
    feature = "etcd",
    feature = "zookeeper",
    feature = "memory"
))]
use super::{from_ms, to_ms};

/// A record expired this long ago is deleted by the next heartbeat of any
/// node; until then it is kept, but never listed.
pub const FORGET_AFTER: Duration = Duration::from_secs(60);

/// What a node says of itself, refreshed at least every lease margin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    pub owner: Owner,
    /// The node's name (`node` in the config).
    pub node: String,
    /// Its `[node] tags`, sorted (docs/configuration.md, "Node tags").
    pub tags: Vec<String>,
    /// The cronlease version it runs.
    pub version: String,
    /// When this incarnation started (its own clock).
    pub started_at: DateTime<Utc>,
    /// Its clock's offset from the store's (store − local), when measured.
    pub clock_offset_ms: Option<i64>,
    /// Leases it holds now.
    pub jobs_held: u32,
    /// The record lives this long on the store's clock unless refreshed.
    pub ttl: Duration,
    /// What it says of its job definitions (`None`: nothing, as a version
    /// before 0.x said nothing).
    pub definitions: Option<DefinitionsBeat>,
    /// The runs going on it now, the longest-running first, at most
    /// [`RUNNING_IN_A_BEAT`].
    pub running: Vec<RunningRun>,
    /// How far its claims have gone (`None`: nothing, as a node of schema 14
    /// or earlier said nothing).
    pub progress: Option<ClaimProgress>,
}

/// What a beat says of the node's claims, for followers that leave a live
/// holder's jobs to it (docs/protocol.md, "Followers leave held jobs to
/// their holder").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimProgress {
    /// Every scheduled occurrence at or before this instant (ms since the
    /// epoch, the occurrences' own time) that this node claimed has its
    /// answer: a follower that left such an occurrence to it knows it was
    /// claimed.
    pub through: i64,
    /// Bumped before each lease the node gives up while it lives (step-down,
    /// a job removed or no longer its to run): a follower that saw another
    /// count claims what it left.
    pub released: u64,
}

/// The most running runs a beat carries (the longest-running ones): a beat
/// stays a few tens of KiB, within what every store takes in one write.
pub const RUNNING_IN_A_BEAT: usize = 256;

/// A run going on a node, as its beats say (docs/protocol.md, "Running
/// now"): `status`, `/api/status` and the dashboard read it from the
/// registry, so it is as fresh as the node's last beat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningRun {
    pub job: String,
    pub fence: u64,
    /// The occurrence it runs (a manual run's: the job's last one).
    #[serde(with = "chrono::serde::ts_milliseconds")]
    pub occurrence: DateTime<Utc>,
    #[serde(with = "chrono::serde::ts_milliseconds")]
    pub started_at: DateTime<Utc>,
    /// A manual run's, a retry's or a redelivery's request; `None` for a
    /// scheduled occurrence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<super::TriggerId>,
    /// Which try of its occurrence it is (1 but for a retry).
    pub attempt: u32,
    /// How long it had run at the beat, by the node's monotonic clock (no
    /// two hosts' clocks compared).
    #[serde(default)]
    pub elapsed_ms: u64,
}

/// What a beat says of the node's job definitions (docs/protocol.md, "Job
/// definitions across nodes"; built and read by `node::definitions`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DefinitionsBeat {
    /// The digest's encoding version.
    pub encoding: u32,
    /// The digest of the whole job set (16 hex digits).
    pub digest: String,
    /// Jobs in the set.
    pub jobs: u32,
    /// Which page of per-job digests `entries` is, of `pages`.
    pub page: u32,
    pub pages: u32,
    /// The page's jobs, 32 hex digits each: the name's hash, then the
    /// definition's digest. Sent only while a live peer's set differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entries: Option<String>,
    /// Jobs this node found defined otherwise on a live peer (the first few
    /// by name), and how many in all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub differ: Vec<String>,
    #[serde(default)]
    pub differ_count: u32,
}

/// A live node as the registry lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeRecord {
    pub node: String,
    pub owner: String,
    /// Its `[node] tags` as its last beat said (none from a version before
    /// tags).
    pub tags: Vec<String>,
    pub version: String,
    pub started_at: DateTime<Utc>,
    /// The store's clock at its last heartbeat (etcd: the node's own).
    pub last_seen: DateTime<Utc>,
    /// Time its record has left without another heartbeat.
    pub expires_in_ms: u64,
    pub clock_offset_ms: Option<i64>,
    pub jobs_held: u32,
    /// What its last beat said of its job definitions; `nodes --json`
    /// shows the set's digest and the jobs it found differing, not the
    /// page of per-job digests.
    #[serde(serialize_with = "definitions_summary")]
    pub definitions: Option<DefinitionsBeat>,
    /// The runs going on it as its last beat said (`status` shows them by
    /// job; `nodes` does not).
    #[serde(skip)]
    pub running: Vec<RunningRun>,
    /// How far its claims have gone, as its last beat said.
    #[serde(skip)]
    pub progress: Option<ClaimProgress>,
}

/// A record's definitions as `nodes --json` and `/api/nodes` show them.
fn definitions_summary<S: serde::Serializer>(
    beat: &Option<DefinitionsBeat>,
    s: S,
) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Summary<'a> {
        digest: &'a str,
        jobs: u32,
        differ: &'a [String],
        differ_count: u32,
    }
    beat.as_ref()
        .map(|b| Summary {
            digest: &b.digest,
            jobs: b.jobs,
            differ: &b.differ,
            differ_count: b.differ_count,
        })
        .serialize(s)
}

#[cfg(test)]
impl NodeRecord {
    /// A live record of `owner` on `node`, for unit tests.
    pub(crate) fn test_record(owner: &str, node: &str) -> NodeRecord {
        NodeRecord {
            node: node.into(),
            owner: owner.into(),
            tags: Vec::new(),
            version: "test".into(),
            started_at: from_ms(0),
            last_seen: from_ms(0),
            expires_in_ms: 1_000,
            clock_offset_ms: None,
            jobs_held: 0,
            definitions: None,
            running: Vec::new(),
            progress: None,
        }
    }
}

/// The registry half of a store. Every backend keeps it next to its locks.
#[async_trait]
pub trait Registry: Send + Sync + 'static {
    /// Writes (or refreshes) `beat`'s record, then answers with every live
    /// record, this one included, sorted by node and owner.
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError>;

    /// [`Registry::heartbeat`], and in the same call the pending manual
    /// runs' requests ([`super::Locks::pending_triggers`]): what an idle
    /// node asks once a beat period, so a beat on its own and the look for
    /// requests are one call (docs/protocol.md, "Node registry", says how
    /// each store sends them). The requests are `None` when the beat went
    /// through but their read did not (the node then asks on its own).
    async fn heartbeat_looking(&self, beat: &Heartbeat) -> Result<Looked, StoreError>;

    /// Every live record, sorted by node and owner.
    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError>;

    /// Deletes `owner`'s record (a node shutting down).
    async fn leave(&self, owner: &Owner) -> Result<(), StoreError>;

    /// Claims `requests` as [`super::Locks::claim`] does and writes `beat`
    /// with them, so the batches a node sends anyway keep its record fresh
    /// (docs/protocol.md, "Node registry", says how each store carries it).
    /// The live records come back with the claims; `None` when the claims
    /// were decided but the beat did not go through (the claims stand, the
    /// node beats again on its own). An error means the claims were not
    /// answered, as for `claim`.
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError>;
}

/// [`Registry::claim_beating`] with the beat as a call of its own, sent at
/// the same moment as the claim over the same connections (each store
/// multiplexes its requests): every store's answer to a batch with no
/// claims (the beat alone), and etcd's while it has no etcd lease for the
/// record to reuse.
#[cfg(any(
    feature = "sqlite",
    feature = "mysql",
    feature = "postgres",
    feature = "redis",
    feature = "zookeeper",
    feature = "etcd"
))]
pub(crate) async fn claim_alongside<S: super::Locks + Registry + ?Sized>(
    store: &S,
    requests: &[ClaimRequest],
    beat: &Heartbeat,
) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
    let (claimed, nodes) = tokio::join!(store.claim(requests), store.heartbeat(beat));
    if let Err(e) = &nodes {
        tracing::debug!("the heartbeat sent with a claim batch failed: {e}");
    }
    Ok((claimed?, nodes.ok()))
}

/// What a [`Registry::heartbeat_looking`] answers: the live records, and
/// the pending requests (job, id) sorted by job, if they were read.
pub type Looked = (Vec<NodeRecord>, Option<Vec<(String, super::TriggerId)>>);

/// [`Registry::heartbeat_looking`] for a store whose connection carries
/// requests side by side (a multiplexed Redis connection, a ZooKeeper
/// session; etcd's gRPC channel for a user refused the look inside the
/// beat's transaction): both requests sent at once, so one round trip;
/// the beat's failure is the call's.
#[cfg(any(feature = "redis", feature = "zookeeper", feature = "etcd"))]
pub(crate) async fn beat_beside_look<S: super::Locks + Registry + ?Sized>(
    store: &S,
    beat: &Heartbeat,
) -> Result<Looked, StoreError> {
    let (nodes, pending) = tokio::join!(store.heartbeat(beat), store.pending_triggers());
    if let Err(e) = &pending {
        tracing::debug!("the look for manual runs sent with a heartbeat failed: {e}");
    }
    Ok((nodes?, pending.ok()))
}

/// A record's fields as key-value stores keep them (JSON); the instants
/// that decide liveness are kept apart, where the store's clock sets them.
#[cfg(any(
    feature = "redis",
    feature = "etcd",
    feature = "zookeeper",
    feature = "memory"
))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct BeatData {
    pub node: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    pub version: String,
    pub started_at: i64,
    #[serde(default)]
    pub clock_offset_ms: Option<i64>,
    #[serde(default)]
    pub jobs_held: u32,
    /// How long the record lives after `last_seen` (ZooKeeper reads liveness
    /// from the node's mtime and this).
    #[serde(default)]
    pub ttl_ms: i64,
    /// Set only where no store clock sets it (etcd): the writer's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub definitions: Option<DefinitionsBeat>,
    /// Read leniently: a list this version cannot read shows no run, and
    /// never hides the node.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "lenient_runs"
    )]
    pub running: Vec<RunningRun>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<ClaimProgress>,
}

/// A record's running runs, or none when they are not ones this version
/// reads (a newer shape, a hand edit): the record itself is still listed.
#[cfg(any(
    feature = "redis",
    feature = "etcd",
    feature = "zookeeper",
    feature = "memory"
))]
fn lenient_runs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<RunningRun>, D::Error> {
    let value = serde_json::Value::deserialize(d)?;
    Ok(serde_json::from_value(value).unwrap_or_default())
}

#[cfg(any(
    feature = "redis",
    feature = "etcd",
    feature = "zookeeper",
    feature = "memory"
))]
impl From<&Heartbeat> for BeatData {
    fn from(beat: &Heartbeat) -> Self {
        BeatData {
            node: beat.node.clone(),
            tags: beat.tags.clone(),
            version: beat.version.clone(),
            started_at: to_ms(beat.started_at),
            clock_offset_ms: beat.clock_offset_ms,
            jobs_held: beat.jobs_held,
            ttl_ms: super::duration_ms(beat.ttl),
            last_seen: None,
            definitions: beat.definitions.clone(),
            running: beat.running.clone(),
            progress: beat.progress,
        }
    }
}

#[cfg(any(
    feature = "redis",
    feature = "etcd",
    feature = "zookeeper",
    feature = "memory"
))]
impl BeatData {
    /// The JSON kept in the store.
    #[cfg_attr(
        not(any(feature = "redis", feature = "etcd", feature = "zookeeper")),
        allow(dead_code)
    )]
    pub fn to_json(&self) -> String {
        // A struct of strings and numbers always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A stored record read back; `None` when it is not one of ours (a hand
    /// edit, a newer version's shape): such a record is not listed.
    #[cfg_attr(
        not(any(feature = "redis", feature = "etcd", feature = "zookeeper")),
        allow(dead_code)
    )]
    pub fn parse(data: &[u8]) -> Option<BeatData> {
        serde_json::from_slice(data).ok()
    }

    /// The listed record, seen at `last_seen` and living until
    /// `expires_at`, read at `now` (all on one clock, ms).
    pub fn record(self, owner: &str, last_seen: i64, expires_at: i64, now: i64) -> NodeRecord {
        NodeRecord {
            node: self.node,
            owner: owner.to_string(),
            tags: self.tags,
            version: self.version,
            started_at: from_ms(self.started_at),
            last_seen: from_ms(last_seen),
            expires_in_ms: expires_at.saturating_sub(now).max(0) as u64,
            clock_offset_ms: self.clock_offset_ms,
            jobs_held: self.jobs_held,
            definitions: self.definitions,
            running: self.running,
            progress: self.progress,
        }
    }
}

/// Sorts records the way [`Registry::nodes`] lists them.
pub(crate) fn sorted(mut nodes: Vec<NodeRecord>) -> Vec<NodeRecord> {
    nodes.sort_by(|a, b| (&a.node, &a.owner).cmp(&(&b.node, &b.owner)));
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_through_its_stored_form() {
        let beat = Heartbeat {
            owner: Owner::from_raw("a#1"),
            node: "a".into(),
            tags: vec!["db".into(), "eu-west".into()],
            version: "1.2.3".into(),
            started_at: from_ms(1_000),
            clock_offset_ms: Some(-7),
            jobs_held: 3,
            ttl: Duration::from_millis(1500),
            definitions: Some(DefinitionsBeat {
                encoding: 1,
                digest: "00112233aabbccdd".into(),
                jobs: 2,
                page: 0,
                pages: 1,
                entries: Some("0".repeat(64)),
                differ: vec!["x".into()],
                differ_count: 1,
            }),
            running: vec![RunningRun {
                job: "backup".into(),
                fence: 9,
                occurrence: from_ms(60_000),
                started_at: from_ms(60_012),
                trigger: super::super::TriggerId::parse("0000019a2b3c4d5e"),
                attempt: 2,
                elapsed_ms: 1_234,
            }],
            progress: Some(ClaimProgress {
                through: 59_999,
                released: 2,
            }),
        };
        let stored = BeatData::from(&beat).to_json();
        let read = BeatData::parse(stored.as_bytes()).map(|d| d.record("a#1", 5_000, 6_500, 6_000));
        assert_eq!(
            read,
            Some(NodeRecord {
                node: "a".into(),
                owner: "a#1".into(),
                tags: beat.tags.clone(),
                version: "1.2.3".into(),
                started_at: from_ms(1_000),
                last_seen: from_ms(5_000),
                expires_in_ms: 500,
                clock_offset_ms: Some(-7),
                jobs_held: 3,
                definitions: beat.definitions.clone(),
                running: beat.running.clone(),
                progress: beat.progress,
            })
        );
        assert!(BeatData::parse(b"{\"node\": 3}").is_none());
        // An older version's record: no definitions, still listed.
        let old = br#"{"node":"a","version":"0.9","started_at":1,"ttl_ms":1500}"#;
        let read = BeatData::parse(old).map(|d| d.record("a#1", 5_000, 6_500, 6_000));
        assert!(
            read.is_some_and(|r| r.definitions.is_none()
                && r.tags.is_empty()
                && r.progress.is_none())
        );
        // A list of runs this version cannot read: the node is still
        // listed, with none.
        let odd =
            br#"{"node":"a","version":"9","started_at":1,"ttl_ms":1500,"running":[{"job":3}]}"#;
        let read = BeatData::parse(odd).map(|d| d.record("a#1", 5_000, 6_500, 6_000));
        assert!(read.is_some_and(|r| r.running.is_empty()));
    }
}
