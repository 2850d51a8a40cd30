//! The output tail in history (`output_tail`, docs/configuration.md) and
//! `cronlease logs`, through a real daemon: a job writing 1 MiB keeps only
//! its last bytes, invalid UTF-8 arrives as U+FFFD, and the store's
//! password from `password_file` never reaches history, also when the job
//! prints it; nor the daemon's log, in any piece, and a job's control bytes
//! reach the log escaped.

use std::process::{Command, Output};
use std::time::Duration;

use crate::cluster::Cluster;
use crate::support::{Backend, binary, wait_until};

const SECRET: &str = "s3cret-Pa55w0rd-xyzzy";

fn cli(c: &Cluster, args: &[&str]) -> Output {
    Command::new(binary())
        .args(args)
        .arg("-c")
        .arg(c.config("n1"))
        .env_remove("CRONLEASE_STORE_URL")
        .output()
        .unwrap()
}

/// One node on PostgreSQL (trust authentication here: it takes the password
/// without needing it) whose password comes from `secret_file`, started.
fn started_with_password(jobs: &str, secret_file: &std::path::Path) -> Cluster {
    let mut c = Cluster::build(
        Backend::Postgres,
        None,
        Some(jobs),
        "",
        &format!("password_file = \"{}\"", secret_file.display()),
    );
    c.start("n1");
    c
}

#[test]
fn a_run_keeps_only_its_output_tail_without_secrets_and_logs_prints_it() {
    // PostgreSQL (trust authentication here) takes the password without
    // needing it: the daemon has a real secret to keep out of history.
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("store.pass");
    std::fs::write(&secret_file, format!("{SECRET}\n")).unwrap();
    // 1 MiB of x, a line with invalid UTF-8, the secret (on stderr), then
    // a last line; the next second's run only writes "second run" (and
    // fails).
    let script = dir.path().join("loud.sh");
    let done = dir.path().join("loud.done");
    std::fs::write(
        &script,
        format!(
            r#"if [ -e '{done}' ]; then echo second run; exit 3; fi
touch '{done}'
head -c 1048576 /dev/zero | tr '\0' x
printf '\nbad: \377\376 end\n'
sleep 0.1
echo "the password is $(cat '{secret}')" >&2
sleep 0.1
echo last line
"#,
            done = done.display(),
            secret = secret_file.display()
        ),
    )
    .unwrap();
    let jobs = format!(
        "[[job]]\nname = \"loud\"\nschedule = \"* * * * * *\"\noutput_tail = \"2KiB\"\ncommand = [\"/bin/sh\", \"{}\"]\n\n[[job]]\nname = \"quiet\"\nschedule = \"0 0 0 1 1 *\"\ncommand = \"true\"\n",
        script.display()
    );
    let mut c = started_with_password(&jobs, &secret_file);
    // The loud run and, newest, a failed one after it. Under load the loud
    // run can outlast its second, whose occurrence is then recorded
    // `skipped` (overlap) before it: a CI run saw that.
    let history = wait_until(
        "the loud run, then a failed one",
        Duration::from_secs(30),
        || c.report(),
        || {
            let out = cli(&c, &["history", "loud", "--json"]);
            let runs: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            let runs = runs.as_array()?.clone();
            let newest_failed = runs.first()?["outcome"] == "failed";
            let loud = runs
                .iter()
                .any(|r| r["outcome"] != "skipped" && r["outcome"] != "failed");
            (newest_failed && loud).then_some(runs)
        },
    );
    c.stop_all();
    let first = history
        .iter()
        .rev()
        .find(|r| r["outcome"] != "skipped")
        .unwrap();
    assert_eq!(first["outcome"], "ok", "{first}");
    let fence = first["fence"].as_u64().unwrap().to_string();
    // `logs --fence` prints that run's tail exactly.
    let logs = cli(&c, &["logs", "loud", "--fence", &fence]);
    assert!(logs.status.success(), "{logs:?}");
    let tail = String::from_utf8(logs.stdout).unwrap();
    assert_eq!(tail, first["output"].as_str().unwrap());
    assert!(tail.len() <= 2048, "{} bytes kept", tail.len());
    assert!(tail.len() > 1900, "only {} bytes kept", tail.len());
    assert!(tail.starts_with("xxxx"), "{tail:?}");
    assert!(
        tail.ends_with("\nbad: \u{fffd}\u{fffd} end\nthe password is ***\nlast line\n"),
        "{:?}",
        &tail[tail.len().saturating_sub(120)..]
    );
    // No part of the secret is in history, in any form it is read.
    let pieces: Vec<&str> = (0..=SECRET.len() - 8).map(|i| &SECRET[i..i + 8]).collect();
    for args in [
        vec!["history", "--json", "--limit", "100"],
        vec!["history", "--limit", "100"],
        vec!["logs", "loud", "--fence", &fence],
        vec!["status", "--json"],
    ] {
        let out = cli(&c, &args);
        let text = String::from_utf8_lossy(&out.stdout);
        for piece in &pieces {
            assert!(
                !text.contains(piece),
                "{args:?} shows {piece:?} of the secret"
            );
        }
    }
    // Without --fence: the newest run; the table shows its last line.
    let newest = cli(&c, &["logs", "loud"]);
    assert_eq!(String::from_utf8_lossy(&newest.stdout), "second run\n");
    let table = String::from_utf8(cli(&c, &["history", "loud", "--limit", "1"]).stdout).unwrap();
    let row = table.lines().nth(1).unwrap();
    assert!(
        row.contains("failed (3)") && row.ends_with("second run"),
        "{table}"
    );
    // Exit codes: a fence not in history 1, a job with no run yet 1 (no
    // output at all), an unknown job 64, a malformed name 2.
    let code = |args: &[&str]| cli(&c, args).status.code();
    assert_eq!(code(&["logs", "loud", "--fence", "999999"]), Some(1));
    assert_eq!(code(&["logs", "quiet"]), Some(1));
    assert_eq!(code(&["logs", "no-such-job"]), Some(64));
    assert_eq!(code(&["logs", "bad name!"]), Some(2));
}

/// A password whose every 4 characters are unlike anything else a log holds.
const LOG_SECRET: &str = "Q7zkS3cr3tPa55w0rdJ9";

/// The daemon's own log (issue 29): a line of 16,380 bytes and then the
/// password, longer than one log event, logs no piece of the password; NUL
/// bytes and a bare CR from a job arrive escaped, not raw.
#[test]
fn the_daemon_log_holds_no_split_password_and_no_raw_control_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("store.pass");
    std::fs::write(&secret_file, format!("{LOG_SECRET}\n")).unwrap();
    let script = dir.path().join("print.sh");
    std::fs::write(
        &script,
        format!(
            "head -c 16380 /dev/zero | tr '\\0' y\necho \"$(cat '{}')XYZ\"\nprintf 'nul:\\000:cr:\\r:end\\n'\n",
            secret_file.display()
        ),
    )
    .unwrap();
    let jobs = format!(
        "[[job]]\nname = \"print\"\nschedule = \"* * * * * *\"\ncommand = [\"/bin/sh\", \"{}\"]\n",
        script.display()
    );
    let mut c = started_with_password(&jobs, &secret_file);
    wait_until(
        "the job's last line in the log",
        Duration::from_secs(30),
        || c.report(),
        || c.log("n1").contains(":end").then_some(()),
    );
    c.stop_all();
    let log = c.log("n1");
    for piece in (0..=LOG_SECRET.len() - 4).map(|i| &LOG_SECRET[i..i + 4]) {
        assert!(
            !log.contains(piece),
            "the log holds {piece:?} of the password"
        );
    }
    assert!(log.contains("***XYZ"), "the password's line, scrubbed");
    assert!(
        !log.contains('\0') && !log.contains(":\r:"),
        "raw control bytes"
    );
    assert!(log.contains(r"nul:\u{0}:cr:\r:end"), "escaped");
}
