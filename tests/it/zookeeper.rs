//! ZooKeeper of the test's own (standalone, tickTime 200 ms, data on disk),
//! which it kills and starts again: a restart during a cluster's run loses
//! nothing the store acknowledged. No occurrence runs twice and fences keep
//! rising across the restart; occurrences due while it was down are caught
//! up once.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use chrono::Utc;

use crate::cluster::{Cluster, Line, check_once_in_order};
use crate::support::{Backend, free_port, wait_until};

/// The jars Debian's zookeeper package installs (log4j for its logging).
const CLASSPATH: &str =
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

    fn answers(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let mut out = String::new();
        s.write_all(b"srvr").is_ok() && s.read_to_string(&mut out).is_ok() && out.contains("Mode:")
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
