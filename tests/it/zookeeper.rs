//! ZooKeeper's sessions and restarts, with real processes:
//! - a holder killed with SIGKILL loses its jobs when the server ends its
//!   session, well before its lease would have run out;
//! - a holder that cannot confirm its session stops its run before the
//!   server could end the session (and a peer take the job over);
//! - a ZooKeeper of the test's own (standalone, tickTime 200 ms, data on
//!   disk), killed and started again: a restart during a cluster's run
//!   loses nothing the store acknowledged. No occurrence runs twice and
//!   fences keep rising across the restart; occurrences due while it was
//!   down are caught up once.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use chrono::Utc;

use nix::sys::signal::Signal;

use crate::cluster::{Cluster, Line, at_fraction_of_second, check_once_in_order};
use crate::support::{Backend, free_port, wait_until};

/// The jars Debian's zookeeper package installs (log4j for its logging).
pub(crate) const CLASSPATH: &str =
    "/usr/share/java/zookeeper.jar:/usr/share/java/slf4j-log4j12.jar:/usr/share/java/log4j-1.2.jar";

struct ZkServer {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl ZkServer {
    fn new() -> ZkServer {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        std::fs::create_dir_all(dir.path().join("data")).unwrap();
        std::fs::write(
            dir.path().join("zoo.cfg"),
            format!(
                "tickTime=200\nminSessionTimeout=400\nmaxSessionTimeout=20000\ninitLimit=10\nsyncLimit=5\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\nadmin.enableServer=false\n4lw.commands.whitelist=srvr\n",
                dir.path().join("data").display()
            ),
        )
        .unwrap();
        ZkServer {
            port,
            dir,
            child: None,
        }
    }

    fn url(&self) -> String {
        format!("zk://127.0.0.1:{}/restart", self.port)
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap()
    }

    fn answers(&self) -> bool {
        four_letter(self.port, "srvr", Duration::from_secs(1))
            .is_ok_and(|out| out.contains("Mode:"))
    }

    /// Starts it on its data directory and waits until it serves.
    fn start(&mut self) {
        assert!(
            std::path::Path::new("/usr/share/java/zookeeper.jar").exists(),
            "ZooKeeper is not installed: bash .ci/services installs it (Debian package zookeeper)"
        );
        let child = Command::new("java")
            .args(["-Xms32m", "-Xmx128m", "-cp", CLASSPATH])
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(self.dir.path().join("zoo.cfg"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("java must be installed (a dependency of Debian's zookeeper)");
        self.child = Some(child);
        wait_until(
            "ZooKeeper serving",
            Duration::from_secs(60),
            || format!("port {}", self.port),
            || self.answers().then_some(()),
        );
    }

    /// Kills it (SIGKILL: what it wrote to its log stays).
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for ZkServer {
    fn drop(&mut self) {
        self.stop();
    }
}

#[test]
fn a_zookeeper_restart_during_a_run_loses_nothing() {
    let mut server = ZkServer::new();
    server.start();
    let mut c = Cluster::with_url(Backend::ZooKeeper, Some(&server.url()), None, "");
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    c.wait_for("three runs", Duration::from_secs(30), |l| l.len() >= 3);
    server.stop();
    let down = Utc::now();
    std::thread::sleep(Duration::from_secs(2));
    server.start();
    let up = Utc::now();
    c.wait_for(
        "four runs after the restart",
        Duration::from_secs(30),
        |l| l.iter().filter(|x| x.occurrence > up).count() >= 4,
    );
    c.stop_all();
    let report = c.report();
    let lines: Vec<Line> = check_once_in_order(&c.lines(), &report);
    let before = lines.iter().filter(|l| l.occurrence < down).count();
    let after = lines.iter().filter(|l| l.occurrence > up).count();
    assert!(before >= 3 && after >= 4, "{report}");
    // What the store had acknowledged before the restart is still there:
    // the runs recorded before it are in its history, with their fences.
    let history = c.cli_json("n1", &["history", "--limit", "100000"]).unwrap();
    let recorded: Vec<u64> = history
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["fence"].as_u64())
        .collect();
    let settled = down - chrono::TimeDelta::seconds(2);
    for l in lines.iter().filter(|l| l.occurrence < settled) {
        assert!(
            recorded.contains(&l.fence),
            "the run of fence {} (before the restart) is gone from history: {recorded:?}\n{report}",
            l.fence
        );
    }
}

/// The shared ZooKeeper with a session timeout of 400 ms (its minimum with
/// tickTime 200) and a lease margin of 4 s.
fn short_session_cluster(jobs: Option<&str>) -> Cluster {
    let url = format!(
        "{}?session_timeout=400ms",
        Backend::ZooKeeper.url(std::path::Path::new("."))
    );
    Backend::ZooKeeper.require();
    let c = Cluster::with_url(Backend::ZooKeeper, Some(&url), jobs, "");
    c.edit_configs("margin = \"1s\"", "margin = \"4s\"");
    c
}

#[test]
fn a_killed_holders_jobs_move_when_its_session_ends_before_its_lease() {
    let mut c = short_session_cluster(None);
    for n in ["n1", "n2", "n3"] {
        c.start(n);
    }
    c.wait_for("three runs", Duration::from_secs(30), |l| l.len() >= 3);
    at_fraction_of_second(0.4);
    let holder = c.lines().last().unwrap().node.clone();
    let killed_at = Utc::now();
    c.signal(&holder, Signal::SIGKILL);
    c.wait_exit(&holder, Duration::from_secs(5))
        .expect("killed node exits");
    let after = |l: &[Line]| -> Vec<Line> {
        l.iter()
            .filter(|x| x.occurrence > killed_at)
            .cloned()
            .collect()
    };
    c.wait_for("five runs after kill -9", Duration::from_secs(30), |l| {
        after(l).len() >= 5
    });
    c.stop_all();
    let report = c.report();
    let lines = check_once_in_order(&c.lines(), &report);
    let post = after(&lines);
    assert!(post.iter().all(|l| l.node != holder), "{report}");
    // The killed holder's lease (1 s + 4 s margin) still had about 4.6 s
    // to go; its session ended 0.4 to 0.6 s after its last word, so the
    // first occurrence after the kill (0.6 s after it) moves at once or
    // after a recheck, and none is missed.
    let first = &post[0];
    let killed = killed_at.timestamp_micros() as f64 / 1e6;
    // Waited out, the lease would have let the next three occurrences go
    // by and a peer caught up only the last of them.
    let next_instant = killed_at.timestamp() + 1;
    assert_eq!(
        first.occurrence.timestamp(),
        next_instant,
        "the first occurrence after the kill was not run: the session's end did not free the job\n{report}"
    );
    assert!(
        first.started - killed >= 0.4,
        "taken over {:.3}s after the kill, before the session could end\n{report}",
        first.started - killed
    );
    assert!(
        first.lateness() < 1.5,
        "the first occurrence after the kill started {:.3}s late: the session's end did not free the job (the lease would have lasted {:.1}s more)\n{report}",
        first.lateness(),
        5.0 - 0.4
    );
    let every: Vec<i64> = post.iter().map(|l| l.occurrence.timestamp()).collect();
    assert!(
        every.windows(2).all(|w| w[1] == w[0] + 1),
        "an occurrence after the kill was missed: {every:?}\n{report}"
    );
    eprintln!(
        "ZooKeeper, session 400 ms, margin 4 s: first run after kill -9 started {:.3}s after the kill, {:.3}s late",
        first.started - killed,
        first.lateness()
    );
}

#[test]
fn a_run_stops_when_its_session_cannot_be_confirmed() {
    let mut server = ZkServer::new();
    server.start();
    let url = format!("{}?session_timeout=1s", server.url());
    let job = "[[job]]\nname = \"long\"\nschedule = \"*/30 * * * * *\"\ncommand = \"echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE start $(date +%s.%N)\\\" >> '{out}'; sleep 20; echo \\\"$CRONLEASE_OCCURRENCE $CRONLEASE_FENCE $CRONLEASE_NODE end $(date +%s.%N)\\\" >> '{out}'\"\n";
    let mut c = Cluster::with_url(Backend::ZooKeeper, Some(&url), Some(job), "");
    c.edit_configs("margin = \"1s\"", "margin = \"10s\"");
    c.start("n1");
    let runs = crate::support::wait_until(
        "a run going",
        Duration::from_secs(40),
        || c.report(),
        || Some(c.runs()).filter(|r| !r.is_empty()),
    );
    std::thread::sleep(Duration::from_millis(500));
    // The server freezes: no request of the holder is answered. Its lease
    // has 30 s + 10 s, but the session it names could end 1 s after the
    // holder's last answered request.
    let frozen_at = std::time::Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(server.pid()), Signal::SIGSTOP).unwrap();
    let killed = crate::support::wait_until(
        "the run stopped",
        Duration::from_secs(10),
        || c.report(),
        || {
            c.log("n1")
                .contains("session is no longer confirmed")
                .then_some(frozen_at.elapsed())
        },
    );
    std::thread::sleep(Duration::from_millis(1500));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(server.pid()), Signal::SIGCONT).unwrap();
    let report = c.report();
    let history = crate::support::wait_until(
        "the run recorded",
        Duration::from_secs(20),
        || c.report(),
        || {
            let h = c.cli_json("n1", &["history", "--limit", "10"]).ok()?;
            let outcome = h.as_array()?.first()?["outcome"].as_str()?.to_string();
            Some(outcome)
        },
    );
    c.stop_all();
    assert!(
        killed < Duration::from_secs(3),
        "stopped {killed:?} after the freeze\n{report}"
    );
    assert_eq!(history, "lease_lost", "{report}");
    let run = &runs[0];
    let after = c.runs();
    assert!(
        after
            .iter()
            .all(|r| r.fence != run.fence || r.end.is_none()),
        "the run went on to its end: {after:?}\n{report}"
    );
}

#[test]
fn zookeeper_claims_queued_behind_a_stall_catch_up_only_the_latest() {
    let mut server = ZkServer::new();
    server.start();
    crate::stall::stale_claims_do_not_run(
        Backend::ZooKeeper,
        &server.url(),
        server.pid(),
        "run_once",
    );
}

/// The answer of the ZooKeeper server on 127.0.0.1:`port` to the
/// four-letter word `command` (`srvr`, `cons`: whitelisted in its config),
/// read to its end within `timeout`.
pub fn four_letter(port: u16, command: &str, timeout: Duration) -> std::io::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(command.as_bytes())?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// Packets the shared ZooKeeper (127.0.0.1:2181) received on the
/// connection of session `sid` (`0x…`), from its `cons` command.
fn packets_received(sid: &str) -> u64 {
    let out = four_letter(2181, "cons", Duration::from_secs(5)).unwrap();
    let line = out
        .lines()
        .find(|l| l.contains(&format!("sid={sid},")))
        .unwrap_or_else(|| panic!("no connection of session {sid} in `cons`:\n{out}"));
    let from = line.find("recved=").unwrap() + "recved=".len();
    line[from..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The ZooKeeper client (vendor/zookeeper-client) pings only when nothing
/// was sent for five eighths of its connection timeout, on a timer set to
/// that deadline: a session sending a request every second (a node's beat)
/// at the shipped 2 s sends no ping between them (the published client
/// pinged after 750 ms, one between every two beats), and an idle session
/// is still pinged, so its connection stays up. Counted by the server
/// (`cons`: packets received per connection).
#[tokio::test]
async fn a_zookeeper_session_pings_only_when_nothing_else_was_sent() {
    Backend::ZooKeeper.require();
    let client = zookeeper_client::Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .with_connection_timeout(Duration::from_secs(2))
        .connect("127.0.0.1:2181")
        .await
        .unwrap();
    let sid = client.session_id().to_string();
    let requests = 6;
    let first = packets_received(&sid);
    for _ in 0..requests {
        client.check_stat("/").await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let beating = packets_received(&sid) - first;
    assert!(
        beating <= requests + 2,
        "{beating} packets for {requests} requests a second apart: pings went between them"
    );
    let quiet = packets_received(&sid);
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let pings = packets_received(&sid) - quiet;
    assert!(
        pings >= 2,
        "{pings} packets in 3.5 s without a request: the idle session was not pinged"
    );
    assert!(
        client.check_stat("/").await.is_ok(),
        "the session's connection is gone"
    );
}
