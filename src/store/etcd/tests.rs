//! Unit tests of the etcd store's pure parts.
#![allow(clippy::unwrap_used)]
use super::*;

fn store(url: &str, prefix: &str) -> EtcdStore {
    let mut config = StoreConfig::new(StoreUrl::parse(url, Path::new("/")).unwrap());
    config.key_prefix = prefix.into();
    EtcdStore::open(&config).unwrap()
}

#[test]
fn lease_ttls_are_whole_seconds_rounded_up_and_at_least_two() {
    let ttl = |ms| lease_ttl_secs(Duration::from_millis(ms));
    assert_eq!(ttl(0), 2);
    assert_eq!(ttl(1), 2);
    assert_eq!(ttl(1500), 2);
    assert_eq!(ttl(2000), 2);
    assert_eq!(ttl(2001), 3);
    assert_eq!(ttl(61_000), 61);
    assert_eq!(lease_ttl_secs(Duration::from_secs(61)), 61);
    assert_eq!(lease_ttl_secs(Duration::MAX), MAX_TTL_SECS);
}

#[test]
fn keys_sit_under_the_prefix_and_runs_sort_by_fence() {
    let s = store("etcd://h", "cronlease:");
    assert_eq!(s.keys.of(Kind::Lock, "backup"), "cronlease:lock/backup");
    assert_eq!(s.keys.of(Kind::Lease, "backup"), "cronlease:lease/backup");
    assert_eq!(s.keys.runs_prefix("backup"), "cronlease:runs/backup/");
    assert_eq!(
        s.keys.run("backup", 42),
        "cronlease:runs/backup/00000000000000000042"
    );
    assert!(s.keys.run("j", 9) < s.keys.run("j", 10));
    assert_eq!(
        s.keys.run("j", u64::MAX),
        format!("cronlease:runs/j/{}", u64::MAX)
    );
    let bare = store("etcd://h", "");
    assert_eq!(bare.keys.of(Kind::Lock, "j"), "lock/j");
}

#[test]
fn transactions_keep_within_etcds_operation_limit() {
    let items: Vec<u32> = (0..300).collect();
    let chunks = chunked(items.clone(), MAX_TXN_OPS);
    assert_eq!(
        chunks.iter().map(Vec::len).collect::<Vec<_>>(),
        [128, 128, 44]
    );
    assert_eq!(chunks.concat(), items);
    assert!(chunked(Vec::<u8>::new(), MAX_TXN_OPS).is_empty());
    assert_eq!(chunked(vec![1, 2, 3], 0), vec![vec![1], vec![2], vec![3]]);
    // A claim's nested transaction: two compares, two puts; the parent
    // holds 126 of them, 126 + 2 = 128.
    assert_eq!(nested_per_txn(2), 126);
    assert_eq!(nested_per_txn(1), 127);
    assert_eq!(nested_per_txn(500), 1);
    let claim = Plan {
        when: vec![
            unchanged("l", None),
            unchanged(
                "k",
                Some(&Entry {
                    value: Vec::new(),
                    mod_revision: 7,
                    lease: 1,
                }),
            ),
        ],
        ops: vec![
            PlanOp::Put("l".into(), Vec::new()),
            PlanOp::PutLeased("k".into(), Vec::new(), 3),
        ],
    };
    assert_eq!((claim.width(), claim.ident()), (2, "l"));
    assert_eq!(claim.ttls().collect::<Vec<_>>(), [3]);
    assert!(claim.into_txn(&HashMap::new()).is_err());
}

#[test]
fn prefix_ends_are_the_next_key() {
    assert_eq!(prefix_end(b"cronlease:runs/"), b"cronlease:runs0");
    assert_eq!(prefix_end(b"a\xff"), b"b");
    assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
}

#[test]
fn endpoints_follow_the_scheme() {
    let plain = store("etcd://a,b:2380", "");
    assert_eq!(endpoints(&plain.target), ["http://a:2379", "http://b:2380"]);
    let tls = store("etcds://a:2379,[::1]:2379", "");
    assert_eq!(
        endpoints(&tls.target),
        ["https://a:2379", "https://[::1]:2379"]
    );
}

#[test]
fn versions_before_3_4_are_refused() {
    assert!(is_supported_version("3.5.17"));
    assert!(is_supported_version("3.4.0"));
    assert!(is_supported_version("4.0.0"));
    assert!(!is_supported_version("3.3.27"));
    assert!(is_supported_version("unknown"));
}

#[test]
fn a_job_is_held_while_its_lease_key_exists_until_its_recorded_end() {
    let state = LockState {
        owner: "a#1".into(),
        marks: JobMarks {
            fence: "7".into(),
            last_occurrence: Some(19_000),
            running: true,
            ..JobMarks::free(19_000)
        },
    };
    let lease = Entry {
        value: br##"{"owner":"b#2","expires_at":20300}"##.to_vec(),
        mod_revision: 9,
        lease: 42,
    };
    // Held until the end the key records, by the key's owner.
    let held = JobView {
        keys: JobKeys {
            lock: None,
            lease: Some(lease.clone()),
        },
        now: 20_000,
    };
    let row = row_of(Some(&(state.clone(), 7)), &held);
    assert_eq!(row.owner.as_deref(), Some("b#2"));
    assert_eq!(row.expires_at, 20_300);
    assert_eq!((row.fence, row.last_occurrence), (7, Some(19_000)));
    // A value written by hand: held for a second at a time.
    let hand = JobView {
        keys: JobKeys {
            lock: None,
            lease: Some(Entry {
                value: b"ghost".to_vec(),
                ..lease
            }),
        },
        now: 20_000,
    };
    let row = row_of(None, &hand);
    assert_eq!(
        (row.owner.as_deref(), row.expires_at),
        (Some("ghost"), 21_000)
    );
    let free = JobView {
        keys: JobKeys::default(),
        now: 20_000,
    };
    let row = row_of(Some(&(state, 7)), &free);
    assert_eq!((row.owner.as_deref(), row.expires_at), (Some("a#1"), 0));
    let fresh = row_of(None, &free);
    assert_eq!((fresh.owner, fresh.fence, fresh.expires_at), (None, 0, 0));
}

#[test]
fn a_node_is_measured_against_the_median_of_three_or_more_clocks() {
    assert_eq!(median(&mut [0, 5000, 10]), 10);
    assert_eq!(median(&mut [0, -3, 7, 9]), 3);
    let clocks = PeerClocks::default();
    *lock(&clocks.me) = Some("n1#1".into());
    // Our own heartbeat: sent at 1000, back through the watch at 1004.
    clocks.observe("n1#1", 1000, 1004, 1333);
    // Alone, and with one peer: no majority, our own clock.
    assert_eq!(clocks.median_ms(1004), 0);
    // A peer 5 s ahead (sent at its 6000, seen at our 1006).
    clocks.observe("n2#1", 6000, 1006, 1333);
    assert_eq!(clocks.median_ms(1006), 0);
    // A second peer, 20 ms ahead of us: the median is its clock, and
    // the one 5 s ahead is the one far from it.
    clocks.observe("n3#1", 1024, 1008, 1333);
    assert_eq!(clocks.median_ms(1008), 20);
    // Seen from the node 5 s ahead, the same clocks say about -5 s.
    let ahead = PeerClocks::default();
    *lock(&ahead.me) = Some("n2#1".into());
    ahead.observe("n2#1", 6000, 6004, 1333);
    ahead.observe("n1#1", 1000, 6003, 1333);
    ahead.observe("n3#1", 1024, 6002, 1333);
    assert_eq!(ahead.median_ms(6004), -4974);
    // Readings past their record's time to live, and leavers, drop out.
    assert_eq!(clocks.median_ms(1008 + 1334), 0);
    clocks.observe("n2#1", 6000, 1006, 1333);
    clocks.forget("n3#1");
    assert_eq!(clocks.median_ms(1008), 0);
}

#[test]
fn claims_wait_for_the_readings_of_the_nodes_a_first_heartbeat_saw() {
    let clocks = PeerClocks::default();
    assert!(
        !clocks.unsettled(0),
        "no heartbeat yet: nothing to wait for"
    );
    *lock(&clocks.me) = Some("n1#1".into());
    clocks.expect(HashSet::from(["n2#1".to_string()]), 1000, 1333);
    assert!(clocks.unsettled(1100));
    clocks.observe("n2#1", 1100, 1101, 1333);
    assert!(!clocks.unsettled(1102));
    // A record whose node beats no more is waited for one record's
    // life after the first heartbeat at most.
    clocks.expect(
        HashSet::from(["n2#1".to_string(), "gone#1".to_string()]),
        1200,
        1333,
    );
    assert!(clocks.unsettled(1300));
    assert!(!clocks.unsettled(2334));
}

#[test]
fn unreadable_state_is_named_not_guessed() {
    let entry = |value: &str| Entry {
        value: value.as_bytes().to_vec(),
        mod_revision: 1,
        lease: 0,
    };
    assert!(read_state(None).unwrap().is_none());
    let ok = entry(r#"{"owner":"a#1","fence":"3","last_occurrence":5,"modified_at":6}"#);
    assert_eq!(read_state(Some(&ok)).unwrap().unwrap().1, 3);
    assert!(read_state(Some(&entry("{"))).is_err());
    let bad_fence = entry(r#"{"owner":"a#1","fence":"x","modified_at":6}"#);
    assert!(read_state(Some(&bad_fence)).unwrap_err().contains("fence"));
}
