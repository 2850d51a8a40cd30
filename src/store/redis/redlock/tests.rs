//! Unit tests of Redlock's pure parts: validity, votes, tallies, the clock.
#![allow(clippy::unwrap_used)]
use super::*;

#[test]
fn validity_leaves_one_percent_and_two_ms() {
    let lease = Duration::from_millis(2_000);
    assert_eq!(
        validity(lease, Duration::from_millis(1_000)),
        Some(Duration::from_millis(978))
    );
    assert_eq!(
        validity(lease, Duration::from_millis(1_977)),
        Some(Duration::from_millis(1))
    );
    // Used up exactly is gone.
    assert_eq!(validity(lease, Duration::from_millis(1_978)), None);
    assert_eq!(validity(lease, Duration::from_millis(1_979)), None);
}

#[test]
fn a_majority_holds_until_all_but_majority_minus_one_leases_end() {
    assert_eq!(majority_left(vec![900, 300, 600], 2), Some(600));
    assert_eq!(majority_left(vec![900, 300], 2), Some(300));
    assert_eq!(majority_left(vec![900], 2), None);
    assert_eq!(majority_left(vec![5, 1, 4, 2, 3], 3), Some(3));
    let leases = [
        ("b".to_string(), 100),
        ("a".to_string(), 400),
        ("b".to_string(), 200),
    ];
    assert_eq!(top_holder(&leases), Some(("b", vec![100, 200])));
    assert_eq!(top_holder(&[]), None);
}

fn store() -> RedlockStore {
    let url = StoreUrl::redlock(&["redis://h1:1", "redis://h2:1", "redis://h3:1"]).unwrap();
    RedlockStore::open(&StoreConfig::new(url)).unwrap()
}

fn request(recheck_only: bool) -> ClaimRequest {
    ClaimRequest {
        job: JobName::parse("j").unwrap(),
        occurrence: from_ms(1_000),
        previous: None,
        misfire: crate::config::Misfire::RunOnce,
        owner: Owner::from_raw("me#1"),
        lease: Duration::from_secs(2),
        fence_floor: 0,
        max_offset: Duration::from_millis(500),
        head_start: None,
        after_unanswered: recheck_only,
        recheck_only,
        window_end: None,
        manual: None,
        redeliver: false,
        before_previous: None,
    }
}

fn tally(ours: usize, others: &[(&str, i64)], counted: usize) -> Tally {
    Tally {
        ours,
        counted,
        others: others.iter().map(|(o, p)| (o.to_string(), *p)).collect(),
        ..Tally::default()
    }
}

#[test]
fn an_idle_lease_is_over_when_a_majority_of_its_head_starts_are() {
    let ms = Duration::from_millis;
    assert_eq!(majority_past(vec![30, 10, 20, 50, 40], 3), Some(ms(30)));
    assert_eq!(majority_past(vec![-5, 10, 20], 3), Some(ms(20)));
    assert_eq!(majority_past(vec![-5, -1, 0], 3), Some(ms(0)));
    // Idle on two masters of five: the lease is not idle.
    assert_eq!(majority_past(vec![10, 20], 3), None);
    let mut idle = tally(1, &[("b", 900), ("b", 400)], 3);
    idle.idle_waits = vec![25, 15];
    assert!(matches!(
        store().vote(&idle, &request(false)),
        Vote::Held { idle_wait: Some(w), .. } if w == ms(25)
    ));
}

#[test]
fn votes_need_a_majority_for_one_owner() {
    let s = store();
    let claim = request(false);
    assert!(matches!(
        s.vote(&tally(2, &[("b", 900)], 3), &claim),
        Vote::Ours
    ));
    assert!(matches!(
        s.vote(&tally(1, &[("b", 900), ("b", 400)], 3), &claim),
        Vote::Held { ref holder, remaining, idle_wait: None } if holder == "b" && remaining == Duration::from_millis(400)
    ));
    // One each: nobody may give up, nobody has won.
    assert!(matches!(
        s.vote(&tally(1, &[("b", 900), ("c", 900)], 3), &claim),
        Vote::Split { .. }
    ));
    // Two masters counted of three: not enough to tell.
    assert!(matches!(
        s.vote(&tally(1, &[("b", 900)], 2), &claim),
        Vote::Split { .. }
    ));
    assert!(matches!(s.vote(&tally(1, &[], 1), &claim), Vote::Undecided));
    // A recheck takes nothing and reads a majority, unless another
    // holds the lease.
    let recheck = request(true);
    assert!(matches!(
        s.vote(&tally(0, &[("b", 900)], 3), &recheck),
        Vote::Ours
    ));
    assert!(matches!(
        s.vote(&tally(0, &[("b", 900), ("b", 900)], 3), &recheck),
        Vote::Held { .. }
    ));
}

#[test]
fn the_pause_mark_of_the_highest_generation_counts() {
    let s = store();
    let entry = |paused: i64, generation: i64| -> LeaseAnswer {
        Some(Ok((
            0,
            vec![(
                1,
                Some("me#1".into()),
                900,
                "3".into(),
                5,
                None,
                -1,
                paused,
                generation,
                None,
                None,
                1,
            )],
        )))
    };
    let pause = |answers: &[LeaseAnswer]| s.tally(answers, 0, &request(false)).pause;
    // A master that missed the resume (generation 2) keeps nothing paused.
    assert_eq!(
        pause(&[entry(1, 1), entry(0, 2), entry(0, 2)]),
        PauseMark(2, false)
    );
    // Paused on one master of a majority, by the newest generation.
    assert_eq!(pause(&[entry(0, 1), entry(1, 2), None]), PauseMark(2, true));
    // Two marks of one generation (two operators at once): paused.
    assert_eq!(pause(&[entry(0, 3), entry(1, 3)]), PauseMark(3, true));
    assert_eq!(pause(&[entry(1, 3), entry(0, 3)]), PauseMark(3, true));
}

#[test]
fn ties_at_the_highest_fence_leave_the_last_owner_unknown() {
    let s = store();
    let entry = |fence: &str, owner: &str| -> LeaseAnswer {
        Some(Ok((
            0,
            vec![(
                2,
                Some("me#1".into()),
                900,
                fence.into(),
                5,
                Some(owner.into()),
                -1,
                0,
                0,
                None,
                None,
                1,
            )],
        )))
    };
    let answers = [entry("7", "me#1"), entry("7", "b#1"), entry("6", "me#1")];
    let t = s.tally(&answers, 0, &request(false));
    assert_eq!((t.fence, t.fence_owner.as_deref()), (7, None));
    let answers = [entry("7", "me#1"), entry("7", "me#1"), entry("6", "b#1")];
    let t = s.tally(&answers, 0, &request(false));
    assert_eq!((t.fence, t.fence_owner.as_deref()), (7, Some("me#1")));
    assert_eq!((t.ours, t.ours_before, t.counted), (3, 3, 3));
}

#[test]
fn the_running_mark_counts_at_the_highest_fence_unless_a_master_there_saw_the_run_recorded() {
    let s = store();
    let entry = |fence: &str, running: i64, last_trigger: Option<&str>| -> LeaseAnswer {
        Some(Ok((
            0,
            vec![(
                1,
                Some("me#1".into()),
                900,
                fence.into(),
                5,
                Some("b#1".into()),
                -1,
                0,
                0,
                None,
                last_trigger.map(str::to_string),
                running,
            )],
        )))
    };
    let tally = |answers: &[LeaseAnswer]| s.tally(answers, 0, &request(false));
    // The claim's write reached one master of this majority; the others
    // are behind (a lower fence, recorded there long ago).
    let t = tally(&[
        entry("7", 1, None),
        entry("6", 0, None),
        entry("6", 0, None),
    ]);
    assert!(t.running());
    // Its record reached one of them: the run is recorded.
    let t = tally(&[
        entry("7", 1, None),
        entry("7", 0, None),
        entry("6", 0, None),
    ]);
    assert!(!t.running());
    // A recorded run at a lower fence says nothing about the last claim's.
    let t = tally(&[
        entry("6", 0, Some("9")),
        entry("7", 1, Some("5")),
        entry("7", 1, None),
    ]);
    assert!(t.running());
    // The last request taken, as the masters at the highest fence have it.
    assert_eq!(t.top_last_trigger, Some(5));
}

#[test]
fn the_clock_is_the_median_master() {
    assert_eq!(median(vec![5, 1, 9]), Some(5));
    assert_eq!(median(vec![7, 1, 9, 3, 100]), Some(7));
    assert_eq!(median(Vec::new()), None);
}

#[test]
fn a_split_claim_stands_back_only_behind_another_last_owner_holding_leases() {
    let req = request(false);
    let ms = Duration::from_millis;
    // Five masters, four answering: a holds two, b one, we one.
    let mut t = tally(1, &[("a#1", 900), ("b#1", 300), ("a#1", 400)], 4);
    t.fence_owner = Some("a#1".into());
    assert_eq!(behind(&t, &req, 3, 1, ms(250)), Some(("a#1", ms(250))));
    assert_eq!(behind(&t, &req, 3, 1, ms(1_000)), Some(("a#1", ms(400))));
    // With every master heard, a's two leases cannot make a majority: a
    // may be gone, and the others race for the rest.
    assert_eq!(behind(&t, &req, 3, 0, ms(250)), None);
    // Our own last claim: we go on trying.
    t.fence_owner = Some("me#1".into());
    assert_eq!(behind(&t, &req, 3, 1, ms(250)), None);
    // A last owner with no lease among the answers (it died): a race.
    t.fence_owner = Some("c#1".into());
    assert_eq!(behind(&t, &req, 3, 1, ms(250)), None);
    t.fence_owner = None;
    assert_eq!(behind(&t, &req, 3, 1, ms(250)), None);
    for _ in 0..100 {
        let d = spread(ms(200));
        assert!(d >= ms(100) && d <= ms(200), "{d:?}");
    }
}
