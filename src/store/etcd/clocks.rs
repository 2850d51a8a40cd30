//! etcd has no clock of its own: each node is measured against the median
//! of the live nodes' clocks, read from their heartbeats ([`PeerClocks`]).

use super::*;

/// The other live nodes' clocks against this host's, from their heartbeats
/// as a watch on the registry delivers them: etcd has no clock of its own,
/// so the clock a node is measured against is the median of the live
/// nodes' clocks (docs/protocol.md, "Clock offset").
///
/// A heartbeat carries its sender's clock when it was sent; the watch
/// event comes one path later (sender to etcd to this node). That path is
/// taken to be as long as this node's own heartbeat's (its send to its own
/// event), so a peer's clock − ours ≈ its sent − our received + our path.
#[derive(Default)]
pub(super) struct PeerClocks {
    /// This node's owner, from its heartbeats (none: a CLI, no median).
    pub(super) me: std::sync::Mutex<Option<String>>,
    /// This node's own heartbeat from its send to its watch event, in ms.
    pub(super) own_path_ms: std::sync::Mutex<Option<i64>>,
    /// Per peer owner: its clock − ours in ms, and until when (our clock)
    /// the reading counts: its record's time to live.
    pub(super) peers: std::sync::Mutex<HashMap<String, (i64, i64)>>,
    /// Owners with a record at this node's last heartbeat, and until when
    /// (our clock) their first readings are waited for: a record's life
    /// after the watch started, since a live node beats within it.
    pub(super) expected: std::sync::Mutex<(HashSet<String>, Option<i64>)>,
    pub(super) watch: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl PeerClocks {
    /// The median of the live nodes' clocks (this one's included) − this
    /// node's clock, in ms. 0 with fewer than [`MEDIAN_OF_AT_LEAST`]
    /// clocks: two clocks that disagree give no majority to tell which is
    /// off (the mean would put both out of bounds).
    pub(super) fn median_ms(&self, now: i64) -> i64 {
        let mut offsets = vec![0];
        offsets.extend(
            lock(&self.peers)
                .values()
                .filter(|(_, until)| *until > now)
                .map(|(offset, _)| *offset),
        );
        if offsets.len() < MEDIAN_OF_AT_LEAST {
            return 0;
        }
        median(&mut offsets)
    }

    /// A heartbeat of `owner` sent at `sent` (its clock) seen at
    /// `received` (ours), living `ttl_ms`.
    pub(super) fn observe(&self, owner: &str, sent: i64, received: i64, ttl_ms: i64) {
        if lock(&self.me).as_deref() == Some(owner) {
            *lock(&self.own_path_ms) = Some((received - sent).max(0));
            return;
        }
        let path = lock(&self.own_path_ms).unwrap_or(0);
        lock(&self.peers).insert(
            owner.to_string(),
            (sent - received + path, received.saturating_add(ttl_ms)),
        );
    }

    pub(super) fn forget(&self, owner: &str) {
        lock(&self.peers).remove(owner);
        lock(&self.expected).0.remove(owner);
    }

    /// Notes the owners whose records a heartbeat read (this node's own
    /// left out); the first heartbeat starts the wait for their readings.
    pub(super) fn expect(&self, owners: HashSet<String>, now: i64, ttl_ms: i64) {
        let mut expected = lock(&self.expected);
        expected.1.get_or_insert(now.saturating_add(ttl_ms));
        expected.0 = owners;
    }

    /// This node has heartbeats and not yet a reading of every node that
    /// had a record then: its median may still be its own clock alone.
    /// Never before its first heartbeat (a CLI, a test without a node).
    pub(super) fn unsettled(&self, now: i64) -> bool {
        let expected = lock(&self.expected);
        let Some(until) = expected.1 else {
            return false;
        };
        if now >= until {
            return false;
        }
        let peers = lock(&self.peers);
        expected.0.iter().any(|o| !peers.contains_key(o))
    }
}

/// Clocks (this node's included) needed for a median.
pub(super) const MEDIAN_OF_AT_LEAST: usize = 3;

/// The median of `values` (the mean of the middle two for an even count);
/// 0 for none.
pub(super) fn median(values: &mut [i64]) -> i64 {
    values.sort_unstable();
    let n = values.len();
    match n {
        0 => 0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]).div_euclid(2),
    }
}

/// Reads every heartbeat put under `prefix` as a reading of its sender's
/// clock, and drops a leaving node's; watches again when the watch breaks
/// (after 1 s, doubling to 30 s), for as long as the store lasts. Without
/// the watch a node is measured against its own clock, as before it had
/// peers.
pub(super) async fn read_clocks(
    clocks: Weak<PeerClocks>,
    client: etcd::Client,
    prefix: String,
    url: StoreUrl,
) {
    let options = WatchOptions::new().with_range(prefix_end(prefix.as_bytes()));
    let mut pause = Duration::from_secs(1);
    loop {
        let mut watch = client.watch_client();
        match watch.watch(prefix.as_str(), Some(options.clone())).await {
            Err(e) => {
                tracing::debug!(store = %url.redacted(), "cannot watch the node registry: {}", one_line(&url.scrub(&e.to_string())));
                pause = (pause * 2).min(Duration::from_secs(30));
            }
            Ok(mut stream) => {
                pause = Duration::from_secs(1);
                while let Ok(Some(answer)) = stream.message().await {
                    let received = now_ms();
                    let Some(clocks) = clocks.upgrade() else {
                        return;
                    };
                    if answer.canceled() {
                        break;
                    }
                    for event in answer.events() {
                        let Some(kv) = event.kv() else {
                            continue;
                        };
                        let Some(owner) = owner_of(kv, &prefix) else {
                            continue;
                        };
                        if matches!(event.event_type(), EventType::Delete) {
                            clocks.forget(owner);
                            continue;
                        }
                        if let Some(data) = BeatData::parse(kv.value())
                            && let Some(sent) = data.last_seen
                        {
                            clocks.observe(owner, sent, received, data.ttl_ms);
                        }
                    }
                }
            }
        }
        if clocks.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(pause).await;
    }
}

impl EtcdStore {
    /// Starts the watch on the registry unless it runs: every heartbeat
    /// it delivers is a reading of its sender's clock ([`PeerClocks`]).
    pub(super) fn watch_clocks(&self, client: &etcd::Client) {
        let mut slot = lock(&self.clocks.watch);
        if slot.as_ref().is_some_and(|w| !w.is_finished()) {
            return;
        }
        *slot = Some(tokio::spawn(read_clocks(
            Arc::downgrade(&self.clocks),
            client.clone(),
            self.keys.of(Kind::Node, ""),
            self.url.clone(),
        )));
    }

    /// The clock this node is measured against: the live nodes' median.
    pub(super) fn median_now_ms(&self) -> i64 {
        let now = now_ms();
        now.saturating_add(self.clocks.median_ms(now))
    }
}
