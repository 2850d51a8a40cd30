//! `cronlease cancel` against real daemons on every store: the run going on
//! whichever node is stopped (SIGTERM, then SIGKILL after `kill_grace`),
//! recorded `cancelled` with who asked and why, and gone from `status`;
//! nothing going is refused; a pending request is withdrawn instead.

use std::time::{Duration, Instant};

use crate::cluster::{Cluster, history};
use crate::support::{Backend, wait_until};
use crate::trigger::text;

/// `long` runs only when triggered and would take 30 s; it notes its start
/// and a SIGTERM it got.
const JOBS: &str = r#"
[[job]]
name = "long"
schedule = "0 0 0 1 1 *"
kill_grace = "3s"
command = "trap 'echo term >> \"{out}.term\"; exit 143' TERM; echo \"$CRONLEASE_FENCE $CRONLEASE_NODE\" > '{out}.long'; sleep 30 & wait"
"#;

/// `job`'s runs going as `status --json` on `node` shows them (`None`
/// while it cannot be read).
pub(crate) fn running(c: &Cluster, node: &str, job: &str) -> Option<Vec<serde_json::Value>> {
    let rows = c.cli_json(node, &["status"]).ok()?;
    let row = rows.as_array()?.iter().find(|r| r["job"] == job)?;
    row["running"].as_array().cloned()
}

fn a_running_run_is_cancelled_on_its_node_with_who_and_why(backend: Backend) {
    let mut c = Cluster::new(backend, Some(JOBS), "");
    assert!(c.cli("n1", &["migrate"]).status.success());
    c.start("n1");
    c.start("n2");
    let nothing = c.cli("n1", &["cancel", "long"]);
    assert_eq!(nothing.status.code(), Some(1), "{}", text(&nothing));
    assert!(
        text(&nothing).contains("nothing to cancel"),
        "{}",
        text(&nothing)
    );
    let asked = c.cli("n1", &["trigger", "long"]);
    assert!(asked.status.success(), "{}", text(&asked));
    let marker = format!("{}.long", c.out.display());
    let started: Vec<String> = wait_until(
        "the run to start",
        Duration::from_secs(15),
        || c.report(),
        || {
            let line = std::fs::read_to_string(&marker).ok()?;
            let f: Vec<String> = line.split_whitespace().map(str::to_string).collect();
            (f.len() == 2).then_some(f)
        },
    );
    // Cancelled from the host that does not run it, once status shows it.
    let other = if started[1] == "n1" { "n2" } else { "n1" };
    wait_until(
        "status to show the run",
        Duration::from_secs(5),
        || c.report(),
        || (!running(&c, other, "long")?.is_empty()).then_some(()),
    );
    let asked_at = Instant::now();
    let cancel = c.cli(other, &["cancel", "long", "--reason", "wrong input\nfile"]);
    let took = asked_at.elapsed();
    assert!(cancel.status.success(), "{}\n{}", text(&cancel), c.report());
    let said = text(&cancel);
    assert!(
        said.contains(&format!(
            "long: cancel of its run on {} (fence {}) asked by",
            started[1], started[0]
        )) && said.contains(&format!(
            "long: its run on {} (fence {}) cancelled (exit code 143)",
            started[1], started[0]
        )),
        "{said}"
    );
    let runs = history(&c, "long");
    let run = runs
        .iter()
        .find(|r| r["fence"].as_u64() == started[0].parse().ok())
        .unwrap_or_else(|| panic!("{runs:?}"));
    assert_eq!(run["outcome"], "cancelled", "{run}");
    assert_eq!(run["node"], started[1].as_str(), "{run}");
    let output = run["output"].as_str().unwrap_or_default();
    assert!(
        output.contains("cronlease: cancelled by ") && output.ends_with(": wrong input file\n"),
        "{output:?}"
    );
    // Stopped, not run to its end: SIGTERM reached the command.
    let ran = chrono::DateTime::parse_from_rfc3339(run["finished_at"].as_str().unwrap()).unwrap()
        - chrono::DateTime::parse_from_rfc3339(run["started_at"].as_str().unwrap()).unwrap();
    assert!(ran.num_seconds() < 20, "{run}");
    assert!(
        std::fs::read_to_string(format!("{}.term", c.out.display()))
            .unwrap_or_default()
            .contains("term")
    );
    assert!(
        c.log(&started[1])
            .contains("cancel asked: stopping the run"),
        "{}",
        c.log(&started[1])
    );
    wait_until(
        "status to show it no more",
        Duration::from_secs(5),
        || c.report(),
        || running(&c, other, "long")?.is_empty().then_some(()),
    );
    eprintln!(
        "{backend:?}: cancel asked to record read back in {} ms",
        took.as_millis()
    );
    c.stop_all();
}

crate::per_store!(all; a_running_run_is_cancelled_on_its_node_with_who_and_why);
