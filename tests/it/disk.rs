//! The disk under a SQLite store fills up and empties again: claims fail
//! while it is full and work again once there is room, without a restart
//! (a connection left inside a failed transaction must never go back to the
//! pool). Needs root to mount a small tmpfs; without it the test says so and
//! passes nothing off as checked.

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use chrono::{TimeDelta, Utc};
use cronlease::config::{JobName, Misfire, StoreConfig, StoreUrl};
use cronlease::store::{self, ClaimOutcome, ClaimRequest, Owner};

struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path, size: &str) -> Option<Tmpfs> {
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn request(job: &str, occurrence_s: i64) -> ClaimRequest {
    let t = cronlease::store::from_ms(Utc::now().timestamp_millis() / 1000 * 1000)
        - TimeDelta::seconds(600)
        + TimeDelta::seconds(occurrence_s);
    ClaimRequest {
        job: JobName::parse(job).unwrap(),
        occurrence: t,
        previous: None,
        misfire: Misfire::Skip,
        owner: Owner::from_raw("disk#1"),
        lease: Duration::from_secs(5),
        fence_floor: 0,
        max_offset: Duration::from_millis(500),
        head_start: None,
        after_unanswered: false,
        recheck_only: false,
        window_end: None,
        manual: None,
        redeliver: false,
        before_previous: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_recovers_from_a_full_disk() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mnt) = Tmpfs::mount(dir.path(), "1m") else {
        assert!(
            !nix::unistd::geteuid().is_root(),
            "running as root but could not mount a tmpfs"
        );
        eprintln!("SKIPPED sqlite_recovers_from_a_full_disk: mounting a tmpfs needs root");
        return;
    };
    let db = mnt.0.join("locks.db");
    let mut config = StoreConfig::new(
        StoreUrl::parse(&format!("sqlite://{}", db.display()), dir.path()).unwrap(),
    );
    config.op_timeout = Duration::from_millis(500);
    let s = store::connect(&config).await.unwrap();
    s.prepare().await.unwrap();
    let mut occurrence = 1;
    let jobs: Vec<String> = (0..10).map(|i| format!("j{i}")).collect();
    let batch = |occurrence: i64| -> Vec<ClaimRequest> {
        jobs.iter().map(|j| request(j, occurrence)).collect()
    };
    let c = s.claim(&batch(occurrence)).await.unwrap();
    assert!(c.outcomes.iter().all(|o| matches!(o, ClaimOutcome::Won(_))));

    // Fill the disk to the last byte.
    let filler = mnt.0.join("filler");
    {
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = vec![7u8; 4096];
        while f.write_all(&block).is_ok() {}
        let _ = f.sync_all();
    }
    let mut failures = 0;
    for i in 0..200 {
        occurrence += 1;
        // Existing rows only, so the transaction gets as far as COMMIT,
        // where WAL mode writes the pages.
        let r = s.claim(&batch(occurrence)).await;
        if r.is_err() {
            failures += 1;
        }
        if i % 10 == 0
            && s.record_run(&run("j0", occurrence as u64), 100)
                .await
                .is_err()
        {
            failures += 1;
        }
    }
    assert!(
        failures > 0,
        "a full disk made no store call fail: the test did not fill it"
    );

    // Room again: claims work within a few seconds, on the same store object.
    std::fs::remove_file(&filler).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let last_error = loop {
        occurrence += 1;
        match s.claim(&[request("j0", occurrence)]).await {
            Ok(c) if matches!(c.outcomes[0], ClaimOutcome::Won(_)) => break None,
            Ok(c) => panic!("unexpected answer {c:?}"),
            Err(e) if Instant::now() > deadline => break Some(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    assert!(
        last_error.is_none(),
        "claims still fail after the disk has room: {last_error:?}"
    );
    // And keep working.
    for _ in 0..20 {
        occurrence += 1;
        let c = s.claim(&[request("j0", occurrence)]).await.unwrap();
        assert!(matches!(c.outcomes[0], ClaimOutcome::Won(_)), "{c:?}");
    }
    drop(s);
}

fn run(job: &str, fence: u64) -> cronlease::store::RunRecord {
    let now = Utc::now();
    cronlease::store::RunRecord {
        job: job.into(),
        fence,
        owner: "disk#1".into(),
        node: "disk".into(),
        occurrence: now,
        started_at: now,
        finished_at: now,
        outcome: cronlease::store::Outcome::Ok,
        exit_code: Some(0),
        takeover: false,
        delay_ms: 0,
        decision_ms: 0,
        output: String::new(),
        trigger: None,
        cpu_ms: None,
        memory_peak: None,
    }
}
