//! Malformed configurations: each gives one precise line naming file, line
//! and column, and `check`/`run` exit 78.

use std::path::Path;
use std::process::Command;

use cronlease::config::{self, ConfigError, Overrides};

const GOOD_MAIN: &str = "node = \"n1\"\n[store]\nurl = \"sqlite://locks.db\"\n";
const GOOD_JOB: &str = "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\n";

/// Writes `main` as cronlease.toml and each `jobs` entry into jobs.d, then loads.
fn load(dir: &Path, main: &str, jobs: &[(&str, &str)]) -> Result<config::Config, Vec<ConfigError>> {
    std::fs::write(dir.join("cronlease.toml"), main).unwrap();
    std::fs::create_dir_all(dir.join("jobs.d")).unwrap();
    for (name, text) in jobs {
        std::fs::write(dir.join("jobs.d").join(name), text).unwrap();
    }
    config::load(&dir.join("cronlease.toml"), &Overrides::default()).map_err(|e| e.0)
}

/// (case, main file, job file, file the error is in, line, message fragment)
const CASES: &[(&str, &str, &str, &str, usize, &str)] = &[
    (
        "unknown top-level key",
        "node = \"n1\"\nnodes = 3\n",
        GOOD_JOB,
        "cronlease.toml",
        2,
        "unknown field `nodes`",
    ),
    (
        "store.max_connections out of range",
        "[store]\nurl = \"sqlite://x.db\"\nmax_connections = 0\n",
        GOOD_JOB,
        "cronlease.toml",
        3,
        "store.max_connections must be between 1 and 1000",
    ),
    (
        "Redlock with two masters",
        "[store]\nurls = [\"redis://a:6379\", \"redis://b:6379\"]\n",
        GOOD_JOB,
        "cronlease.toml",
        2,
        "Redlock needs 3 or 5 independent masters",
    ),
    (
        "Redlock master that is not Redis",
        "[store]\nurls = [\"redis://a:6379\", \"redis://b:6379\",\n  \"mysql://root:hunter2@c/x\"]\n",
        GOOD_JOB,
        "cronlease.toml",
        3,
        "mysql://root:***@c/x is not a redis:// or rediss:// URL",
    ),
    (
        "Redlock master named twice",
        "[store]\nurls = [\"redis://a:6379\", \"redis://b\", \"redis://B:6379/1\"]\n",
        GOOD_JOB,
        "cronlease.toml",
        2,
        "names redis://B:6379/1 twice",
    ),
    (
        "store url and urls together",
        "[store]\nurl = \"redis://a\"\nurls = [\"redis://a:6379\", \"redis://b:6379\", \"redis://c:6379\"]\n",
        GOOD_JOB,
        "cronlease.toml",
        3,
        "store.url and store.urls are both set",
    ),
    (
        "unknown store key",
        "[store]\nurl = \"sqlite://x.db\"\npasword = \"x\"\n",
        GOOD_JOB,
        "cronlease.toml",
        3,
        "unknown field `pasword`",
    ),
    (
        "unknown job key",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = \"true\"\ncomand = \"x\"\n",
        "a.toml",
        5,
        "unknown field `comand`",
    ),
    (
        "missing schedule",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\ncommand = \"true\"\n",
        "a.toml",
        1,
        "missing field `schedule`",
    ),
    (
        "empty shell command",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = \"  \"\n",
        "a.toml",
        4,
        "empty command",
    ),
    (
        "empty argv",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = []\n",
        "a.toml",
        4,
        "empty command",
    ),
    (
        "command of the wrong type",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = 42\n",
        "a.toml",
        4,
        "expected a string or an array of strings",
    ),
    (
        "cron with too few fields",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * *\"\ncommand = \"true\"\n",
        "a.toml",
        3,
        "expected 5 fields",
    ),
    (
        "cron value out of range",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"61 * * * *\"\ncommand = \"true\"\n",
        "a.toml",
        3,
        "invalid schedule \"61 * * * *\"",
    ),
    (
        "cron that never fires",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"0 0 0 30 2 *\"\ncommand = \"true\"\n",
        "a.toml",
        3,
        "never fires",
    ),
    (
        "@reboot",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"@reboot\"\ncommand = \"true\"\n",
        "a.toml",
        3,
        "@reboot is not supported",
    ),
    (
        "unknown time zone",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ntimezone = \"Europe/Atlantis\"\ncommand = \"true\"\n",
        "a.toml",
        4,
        "unknown time zone \"Europe/Atlantis\"",
    ),
    (
        "bad job name",
        GOOD_MAIN,
        "[[job]]\nname = \"has space\"\nschedule = \"* * * * *\"\ncommand = \"true\"\n",
        "a.toml",
        2,
        "invalid job name",
    ),
    (
        "bad misfire policy",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nmisfire = \"sometimes\"\n",
        "a.toml",
        5,
        "unknown variant `sometimes`",
    ),
    (
        "bad duration",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = \"true\"\ntimeout = \"2 parsecs\"\n",
        "a.toml",
        5,
        "invalid duration \"2 parsecs\" for timeout",
    ),
    (
        "zero lease margin",
        "[store]\nurl = \"sqlite://x.db\"\n[lease]\nmargin = \"0s\"\n",
        GOOD_JOB,
        "cronlease.toml",
        4,
        "lease.margin must be longer than zero",
    ),
    (
        "unsupported URL scheme",
        "[store]\nurl = \"ftp://host/x\"\n",
        GOOD_JOB,
        "cronlease.toml",
        2,
        "unsupported store URL scheme \"ftp\": expected sqlite://, mysql://, mariadb://, postgres://, postgresql://, redis://, rediss://, redis+sentinel://, zk://, etcd:// or etcds://",
    ),
    (
        "URL without host",
        "[store]\nurl = \"mysql://\"\n",
        GOOD_JOB,
        "cronlease.toml",
        2,
        "expected a host",
    ),
    (
        "in-memory sqlite",
        "[store]\nurl = \"sqlite://:memory:\"\n",
        GOOD_JOB,
        "cronlease.toml",
        2,
        "in-memory database cannot be shared",
    ),
    (
        "bad table prefix",
        "[store]\nurl = \"sqlite://x.db\"\ntable_prefix = \"a-b;\"\n",
        GOOD_JOB,
        "cronlease.toml",
        3,
        "invalid store.table_prefix",
    ),
    (
        "reserved env var",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nenv = { CRONLEASE_FENCE = \"1\" }\n",
        "a.toml",
        5,
        "is reserved",
    ),
    (
        "TOML syntax error",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \n",
        "a.toml",
        3,
        "string values must be quoted",
    ),
    (
        "duplicate key",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nname = \"b\"\n",
        "a.toml",
        3,
        "duplicate key",
    ),
    (
        "bad metrics address",
        "[store]\nurl = \"sqlite://x.db\"\n[metrics]\nlisten = \"everywhere\"\n",
        GOOD_JOB,
        "cronlease.toml",
        4,
        "invalid metrics.listen",
    ),
    (
        "bad http address",
        "[store]\nurl = \"sqlite://x.db\"\n[http]\nlisten = \"0.0.0.0\"\n",
        GOOD_JOB,
        "cronlease.toml",
        4,
        "invalid http.listen",
    ),
    (
        "http and its old name metrics both",
        "[store]\nurl = \"sqlite://x.db\"\n[http]\nlisten = \"127.0.0.1:1\"\n[metrics]\nlisten = \"127.0.0.1:2\"\n",
        GOOD_JOB,
        "cronlease.toml",
        4,
        "both [http] and [metrics]",
    ),
    (
        "NUL in a shell command",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = \"true\\u0000\"\n",
        "a.toml",
        4,
        "command contains a NUL byte",
    ),
    (
        "NUL in an argv element",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = [\"/bin/echo\", \"a\\u0000b\"]\n",
        "a.toml",
        4,
        "argument contains a NUL byte",
    ),
    (
        "NUL in an env value",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nenv = { X = \"a\\u0000\" }\n",
        "a.toml",
        5,
        "cannot contain NUL",
    ),
    (
        "NUL in working_dir",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nworking_dir = \"/tmp\\u0000\"\n",
        "a.toml",
        5,
        "working_dir contains a NUL byte",
    ),
    (
        "NUL in pid_file",
        "pid_file = \"/run/x\\u0000.pid\"\n[store]\nurl = \"sqlite://x.db\"\n",
        GOOD_JOB,
        "cronlease.toml",
        1,
        "pid_file contains a NUL byte",
    ),
    (
        "NUL in the SQLite path",
        "[store]\nurl = \"sqlite://x\\u0000.db\"\n",
        GOOD_JOB,
        "cronlease.toml",
        2,
        "store.url contains a NUL byte",
    ),
    (
        "absurd lease margin",
        "[store]\nurl = \"sqlite://x.db\"\n[lease]\nmargin = \"18446744073709551615s\"\n",
        GOOD_JOB,
        "cronlease.toml",
        4,
        "lease.margin",
    ),
    (
        "absurd op_timeout",
        "[store]\nurl = \"sqlite://x.db\"\nop_timeout = \"100000000h\"\n",
        GOOD_JOB,
        "cronlease.toml",
        3,
        "store.op_timeout",
    ),
    (
        "absurd job timeout",
        GOOD_MAIN,
        "[[job]]\nname = \"a\"\nschedule = \"* * * * *\"\ncommand = \"true\"\ntimeout = \"500y\"\n",
        "a.toml",
        5,
        "timeout",
    ),
    (
        "clock offset beyond a minute",
        "[store]\nurl = \"sqlite://x.db\"\n[cluster]\nmax_clock_offset = \"2m\"\n",
        GOOD_JOB,
        "cronlease.toml",
        4,
        "cluster.max_clock_offset",
    ),
    (
        "head start beyond half the margin",
        "[store]\nurl = \"sqlite://x.db\"\n[lease]\nmargin = \"1s\"\n[cluster]\nhead_start = \"600ms\"\n",
        GOOD_JOB,
        "cronlease.toml",
        6,
        "cluster.head_start",
    ),
    (
        "missing password file",
        "[store]\nurl = \"mysql://app@db/x\"\npassword_file = \"nope.pass\"\n",
        GOOD_JOB,
        "cronlease.toml",
        3,
        "cannot read password_file",
    ),
    (
        "unknown jobs.runner",
        "[jobs]\nrunner = \"docker\"\n",
        GOOD_JOB,
        "cronlease.toml",
        2,
        "unknown variant `docker`",
    ),
    (
        "limits.memory_max without a unit it knows",
        GOOD_MAIN,
        "[[job]]\nname = \"m\"\nschedule = \"* * * * *\"\ncommand = \"true\"\n[job.limits]\nmemory_max = \"64 elephants\"\n",
        "jobs.d/a.toml",
        6,
        "invalid limits.memory_max \"64 elephants\"",
    ),
    (
        "limits.nice out of range",
        GOOD_MAIN,
        "[[job]]\nname = \"m\"\nschedule = \"* * * * *\"\ncommand = \"true\"\n[job.limits]\nnice = 40\n",
        "jobs.d/a.toml",
        6,
        "limits.nice 40 is out of range: -20 to 19",
    ),
    (
        "unknown limit",
        GOOD_MAIN,
        "[[job]]\nname = \"m\"\nschedule = \"* * * * *\"\ncommand = \"true\"\n[job.limits]\nswap = \"1G\"\n",
        "jobs.d/a.toml",
        6,
        "unknown field `swap`",
    ),
    (
        "sandbox property not on the allow-list",
        GOOD_MAIN,
        "[[job]]\nname = \"m\"\nschedule = \"* * * * *\"\ncommand = \"true\"\n[job.sandbox]\nPrivateTmp = false\nUser = \"root\"\n",
        "jobs.d/a.toml",
        7,
        "unknown sandbox property \"User\": the allowed ones are ProtectSystem",
    ),
    (
        "sandbox property of the wrong type",
        GOOD_MAIN,
        "[[job]]\nname = \"m\"\nschedule = \"* * * * *\"\ncommand = \"true\"\n[job.sandbox]\nReadWritePaths = [\"srv/x\"]\n",
        "jobs.d/a.toml",
        6,
        "invalid sandbox.ReadWritePaths: expected an array of absolute paths",
    ),
    (
        "credential name with a slash",
        GOOD_MAIN,
        "[[job]]\nname = \"m\"\nschedule = \"* * * * *\"\ncommand = \"true\"\ncredentials = { \"a/b\" = \"/etc/x\" }\n",
        "jobs.d/a.toml",
        5,
        "invalid credential name \"a/b\"",
    ),
    (
        "webhook with an unknown event",
        "node = \"n1\"\n[store]\nurl = \"sqlite://x.db\"\n[[notify]]\nurl = \"https://h.example/x\"\nevents = [\"failed\",\n  \"exploded\"]\n",
        GOOD_JOB,
        "cronlease.toml",
        7,
        "unknown notify event \"exploded\": expected one of succeeded, failed",
    ),
    (
        "webhook URL that is not http(s), its token not repeated",
        "node = \"n1\"\n[store]\nurl = \"sqlite://x.db\"\n[[notify]]\nurl = \"ftp://h.example/T0KEN\"\n",
        GOOD_JOB,
        "cronlease.toml",
        5,
        "notify url must be an http:// or https:// URL with a host",
    ),
    (
        "webhook secret file missing",
        "node = \"n1\"\n[store]\nurl = \"sqlite://x.db\"\n[[notify]]\nurl = \"https://h.example/\"\nsecret_file = \"/nonexistent/cronlease-secret\"\n",
        GOOD_JOB,
        "cronlease.toml",
        6,
        "cannot read secret_file /nonexistent/cronlease-secret",
    ),
    (
        "two webhooks of one name",
        "node = \"n1\"\n[store]\nurl = \"sqlite://x.db\"\n[[notify]]\nname = \"ops\"\nurl = \"https://a.example/\"\n[[notify]]\nname = \"ops\"\nurl = \"https://b.example/\"\n",
        GOOD_JOB,
        "cronlease.toml",
        8,
        "a second notify table named \"ops\"",
    ),
    (
        "a starting_deadline under a second",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nstarting_deadline = \"10ms\"\n",
        "a.toml",
        5,
        "starting_deadline \"10ms\" is too short: at least 1s",
    ),
    (
        "a job key misspelt as on_sucess",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\non_sucess = \"true\"\n",
        "a.toml",
        5,
        "unknown field `on_sucess`",
    ),
    (
        "retry.attempts of 1 (it counts the first run)",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nretry = { attempts = 1 }\n",
        "a.toml",
        5,
        "retry.attempts 1 is out of range: 2 to 10 (it counts the first run: 2 is one retry)",
    ),
    (
        "retry.max_backoff shorter than its backoff",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nretry = { attempts = 3, backoff = \"1m\", max_backoff = \"30s\" }\n",
        "a.toml",
        5,
        "retry.max_backoff \"30s\" is shorter than retry.backoff (1m)",
    ),
    (
        "retry.on naming an outcome that is not retried",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nretry = { attempts = 3, on = [\"failed\", \"skipped\"] }\n",
        "a.toml",
        5,
        "retry.on: unknown outcome \"skipped\": expected one of failed, timeout, not_started, lease_lost",
    ),
    (
        "retry.backoff under a second",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nretry = { attempts = 3, backoff = \"100ms\" }\n",
        "a.toml",
        5,
        "retry.backoff \"100ms\" is too short: at least 1s",
    ),
    (
        "retry.on empty",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nretry = { attempts = 3, on = [] }\n",
        "a.toml",
        5,
        "retry.on is empty",
    ),
    (
        "a retry key misspelt",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nretry = { attempts = 3, backof = \"1s\" }\n",
        "a.toml",
        5,
        "unknown field `backof`",
    ),
    (
        "a node tag with a space",
        "[node]\nname = \"n1\"\ntags = [\"db\",\n  \"eu west\"]\n[store]\nurl = \"sqlite://x.db\"\n",
        GOOD_JOB,
        "cronlease.toml",
        4,
        "node.tags: invalid tag \"eu west\"",
    ),
    (
        "a node tag named twice",
        "[node]\ntags = [\"db\", \"db\"]\n[store]\nurl = \"sqlite://x.db\"\n",
        GOOD_JOB,
        "cronlease.toml",
        2,
        "node.tags names tag \"db\" twice",
    ),
    (
        "a [node] key misspelt",
        "[node]\nname = \"n1\"\ntag = [\"db\"]\n[store]\nurl = \"sqlite://x.db\"\n",
        GOOD_JOB,
        "cronlease.toml",
        3,
        "unknown field `tag`",
    ),
    (
        "node neither a name nor a table",
        "node = 3\n[store]\nurl = \"sqlite://x.db\"\n",
        GOOD_JOB,
        "cronlease.toml",
        1,
        "a node name, or a [node] table",
    ),
    (
        "every_node with retry",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nretry = { attempts = 2 }\nplacement = \"every_node\"\n",
        "a.toml",
        6,
        "placement = \"every_node\" cannot be combined with retry",
    ),
    (
        "every_node with at_least_once",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\ndelivery = \"at_least_once\"\nplacement = \"every_node\"\n",
        "a.toml",
        6,
        "cannot be combined with delivery = \"at_least_once\"",
    ),
    (
        "a job's placement other than every_node",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nplacement = \"spread\"\n",
        "a.toml",
        5,
        "unknown variant `spread`, expected `every_node`",
    ),
    (
        "a job name with the shard separator",
        GOOD_MAIN,
        "[[job]]\nname = \"ok~n1\"\nschedule = \"* * * * *\"\ncommand = \"true\"\n",
        "a.toml",
        2,
        "'~' is kept for the locks of broadcast jobs' shards",
    ),
    (
        "an empty run_on tag",
        GOOD_MAIN,
        "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nrun_on = [\"db\", \"\"]\n",
        "a.toml",
        5,
        "run_on: a tag cannot be empty",
    ),
];

#[test]
fn node_tags_and_run_on_are_read_sorted_and_the_name_form_still_works() {
    let dir = tempfile::tempdir().unwrap();
    let job = "[[job]]\nname = \"ok\"\nschedule = \"* * * * *\"\ncommand = \"true\"\nrun_on = [\"eu\", \"db\"]\n";
    let c = load(
        dir.path(),
        "[node]\nname = \"n1\"\ntags = [\"ssd\", \"db\", \"eu\"]\n[store]\nurl = \"sqlite://x.db\"\n",
        &[("a.toml", job)],
    )
    .unwrap();
    assert_eq!(c.node.as_str(), "n1");
    assert_eq!(c.tags.as_slice(), ["db", "eu", "ssd"]);
    assert_eq!(c.jobs[0].run_on.as_slice(), ["db", "eu"]);
    let c = load(dir.path(), GOOD_MAIN, &[("a.toml", GOOD_JOB)]).unwrap();
    assert_eq!(c.node.as_str(), "n1");
    assert!(c.tags.is_empty() && c.jobs[0].run_on.is_empty());
    // A reload that changes the tags changes them live.
    let tagged = load(
        dir.path(),
        "[node]\nname = \"n1\"\ntags = [\"db\"]\n[store]\nurl = \"sqlite://locks.db\"\n",
        &[("a.toml", GOOD_JOB)],
    )
    .unwrap();
    assert_eq!(c.changes(&tagged).live, ["node.tags"]);
}

#[test]
fn malformed_configs_name_file_line_and_column() {
    assert!(CASES.len() >= 15);
    for (case, main, job, file, line, fragment) in CASES {
        let dir = tempfile::tempdir().unwrap();
        let errors = match load(dir.path(), main, &[("a.toml", job)]) {
            Ok(_) => panic!("{case}: accepted"),
            Err(e) => e,
        };
        let hit = errors.iter().find(|e| e.message.contains(fragment));
        let Some(e) = hit else {
            panic!("{case}: no error contains {fragment:?}: {errors:#?}");
        };
        assert!(
            e.origin.ends_with(file),
            "{case}: error in {} not {file}",
            e.origin
        );
        let (l, c) = e
            .position
            .unwrap_or_else(|| panic!("{case}: no position in {e}"));
        assert_eq!(l, *line, "{case}: {e}");
        assert!(c >= 1, "{case}: {e}");
        let shown = e.to_string();
        assert!(!shown.contains('\n'), "{case}: one line: {shown}");
        assert!(
            shown.starts_with(&format!("{}:{l}:{c}: ", e.origin)),
            "{case}: {shown}"
        );
    }
}

#[test]
fn duplicate_names_across_files_point_at_both() {
    let dir = tempfile::tempdir().unwrap();
    let errors = load(
        dir.path(),
        GOOD_MAIN,
        &[("a.toml", GOOD_JOB), ("b.toml", &format!("\n\n{GOOD_JOB}"))],
    )
    .unwrap_err();
    assert_eq!(errors.len(), 1, "{errors:#?}");
    let e = &errors[0];
    assert!(
        e.origin.ends_with("b.toml") && e.position == Some((4, 8)),
        "{e}"
    );
    assert!(
        e.message.contains("duplicate job name \"ok\"") && e.message.contains("a.toml:2:8"),
        "{e}"
    );
    // Names that differ only in case would share one lock on MySQL.
    let other = GOOD_JOB.replace("\"ok\"", "\"OK\"");
    let errors = load(
        dir.path(),
        GOOD_MAIN,
        &[("a.toml", GOOD_JOB), ("b.toml", other.as_str())],
    )
    .unwrap_err();
    assert!(
        errors.len() == 1 && errors[0].message.contains("more than upper/lower case"),
        "{errors:#?}"
    );
}

#[test]
fn every_error_is_listed_and_check_exits_78() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cronlease.toml"), GOOD_MAIN).unwrap();
    std::fs::create_dir_all(dir.path().join("jobs.d")).unwrap();
    let bad = "[[job]]\nname = \"a\"\nschedule = \"* *\"\ncommand = \"\"\n\n[[job]]\nname = \"b\"\nschedule = \"* * * * *\"\ntimezone = \"Nowhere\"\ncommand = \"true\"\n";
    std::fs::write(dir.path().join("jobs.d/bad.toml"), bad).unwrap();
    std::fs::write(dir.path().join("jobs.d/broken.toml"), "[[job]\n").unwrap();
    for cmd in ["check", "run"] {
        let out = Command::new(crate::support::binary())
            .args([cmd, "-c"])
            .arg(dir.path().join("cronlease.toml"))
            .env_remove("CRONLEASE_STORE_URL")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(78), "{cmd}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 4, "{cmd}: {stderr}");
        assert!(
            lines[0].contains("bad.toml:3:12: invalid schedule"),
            "{stderr}"
        );
        assert!(
            lines[1].contains("bad.toml:4:11: empty command"),
            "{stderr}"
        );
        assert!(
            lines[2].contains("bad.toml:9:12: unknown time zone"),
            "{stderr}"
        );
        assert!(lines[3].contains("broken.toml:1:"), "{stderr}");
    }
}

#[test]
fn store_url_from_the_environment_is_checked_and_redacted() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cronlease.toml"), GOOD_MAIN).unwrap();
    let out = Command::new(crate::support::binary())
        .args(["check", "-c"])
        .arg(dir.path().join("cronlease.toml"))
        .env("CRONLEASE_STORE_URL", "nosql://user:hunter2@db/x")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("$CRONLEASE_STORE_URL: unsupported store URL scheme"),
        "{stderr}"
    );
    let out = Command::new(crate::support::binary())
        .args(["check", "-c"])
        .arg(dir.path().join("cronlease.toml"))
        .env("CRONLEASE_STORE_URL", "redis://:hunter2@127.0.0.1:6379/")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("store redis://:***@127.0.0.1:6379/") && !stdout.contains("hunter2"),
        "{stdout}"
    );
}

/// A `*.toml` symlink in jobs.d that leads nowhere (or in a circle) is an
/// error naming the file, never a job file skipped in silence.
#[test]
fn dangling_and_looping_job_symlinks_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("jobs.d")).unwrap();
    let jobs = dir.path().join("jobs.d");
    std::os::unix::fs::symlink(jobs.join("gone.toml.orig"), jobs.join("dangling.toml")).unwrap();
    std::os::unix::fs::symlink(jobs.join("loop-b.toml"), jobs.join("loop-a.toml")).unwrap();
    std::os::unix::fs::symlink(jobs.join("loop-a.toml"), jobs.join("loop-b.toml")).unwrap();
    let errors = load(dir.path(), GOOD_MAIN, &[("ok.toml", GOOD_JOB)]).unwrap_err();
    for name in ["dangling.toml", "loop-a.toml", "loop-b.toml"] {
        assert!(
            errors
                .iter()
                .any(|e| e.origin.ends_with(name) && e.message.contains("symlink")),
            "{name}: {errors:#?}"
        );
    }
    let out = Command::new(env!("CARGO_BIN_EXE_cronlease"))
        .args(["check", "-c"])
        .arg(dir.path().join("cronlease.toml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
}

/// A file with mistakes of every kind is reported whole by one `check`
/// (issue 36: 9 mistakes took 5 rounds: serde's first, then a type error,
/// then the meaning; a schedule error hid behind its job's time zone). Each
/// at its file, line and column, a misspelt key with the key it resembles.
#[test]
fn every_mistake_of_every_job_is_reported_in_one_check() {
    let dir = tempfile::tempdir().unwrap();
    let main = "node = \"n1\"\n[store]\nurl = \"sqlite://x.db\"\nhistory_limt = 5\n";
    let jobs = "[[job]]
name = \"a\"
schedule = \"0 61 * * *\"
timezone = \"Mars/Base\"
command = \"true\"
timout = \"5s\"

[[job]]
name = \"b\"
schedule = \"* * * * *\"
command = \"true\"
kill_grace = 5
overlap = \"queue\"
env = { CRONLEASE_X = \"1\" }

[[job]]
name = \"c d\"
schedule = \"* * * * *\"
command = \"\"
timeout = \"2 parsecs\"
";
    std::fs::write(dir.path().join("cronlease.toml"), main).unwrap();
    std::fs::create_dir_all(dir.path().join("jobs.d")).unwrap();
    std::fs::write(dir.path().join("jobs.d/all.toml"), jobs).unwrap();
    let out = Command::new(crate::support::binary())
        .args(["check", "-c"])
        .arg(dir.path().join("cronlease.toml"))
        .env_remove("CRONLEASE_STORE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let want = [
        (
            "cronlease.toml:4:1:",
            "unknown field `history_limt`",
            Some("did you mean `history_limit`?"),
        ),
        (
            "all.toml:3:12:",
            "hour 61 is out of range: expected a number from 0 to 23",
            None,
        ),
        ("all.toml:4:12:", "unknown time zone \"Mars/Base\"", None),
        (
            "all.toml:6:1:",
            "unknown field `timout`",
            Some("did you mean `timeout`?"),
        ),
        ("all.toml:12:14:", "invalid type", None),
        ("all.toml:13:11:", "unknown variant `queue`", None),
        ("all.toml:14:9:", "is reserved", None),
        ("all.toml:17:8:", "invalid job name", None),
        ("all.toml:19:11:", "empty command", None),
        ("all.toml:20:11:", "invalid duration \"2 parsecs\"", None),
    ];
    for (at, what, hint) in want {
        let line = stderr
            .lines()
            .find(|l| l.contains(at) && l.contains(what))
            .unwrap_or_else(|| panic!("no {at} {what}:\n{stderr}"));
        if let Some(hint) = hint {
            assert!(line.contains(hint), "{line}");
        }
    }
    assert_eq!(stderr.lines().count(), want.len(), "{stderr}");
}

/// Structural mistakes in different places of the main file are all
/// reported in one pass, each at its own line.
#[test]
fn every_structural_error_of_the_main_file_is_listed() {
    let dir = tempfile::tempdir().unwrap();
    let main = "node = \"n1\"\nnodes = 3\n[store]\nurl = \"sqlite://x.db\"\npasword = \"x\"\n[lease]\nmargin = 5\n[[job]]\nname = \"a\"\ncommand = \"true\"\n[[job]]\nname = \"b\"\nschedule = \"* * * * *\"\ncommand = \"true\"\ncomand = \"x\"\n";
    let errors = load(dir.path(), main, &[]).unwrap_err();
    let at = |line: usize, fragment: &str| {
        errors
            .iter()
            .any(|e| e.position.is_some_and(|(l, _)| l == line) && e.message.contains(fragment))
    };
    assert!(at(2, "unknown field `nodes`"), "{errors:#?}");
    assert!(at(5, "unknown field `pasword`"), "{errors:#?}");
    assert!(at(7, "invalid type"), "{errors:#?}");
    assert!(
        errors
            .iter()
            .any(|e| e.message.contains("missing field `schedule`")),
        "{errors:#?}"
    );
    assert!(at(15, "unknown field `comand`"), "{errors:#?}");
    // And syntax errors: every one the parser can recover from.
    let errors = load(dir.path(), "a = \nb = = 1\n[store]\nurl = \"x\n", &[]).unwrap_err();
    assert!(errors.len() >= 2, "{errors:#?}");
}

/// A value quoted in an error message never shows a password: a store URL
/// written where a table belongs.
#[test]
fn quoted_values_in_errors_are_redacted() {
    let dir = tempfile::tempdir().unwrap();
    let errors = load(dir.path(), "store = \"mysql://root:s3cretpw@db/x\"\n", &[]).unwrap_err();
    let shown: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert!(!shown.is_empty());
    assert!(shown.iter().all(|e| !e.contains("s3cretpw")), "{shown:#?}");
}

/// A job the OS could never start is refused at load, naming the limit and
/// pointing at the value (issue 29: such a job passed `check`, then every
/// run was `not_started`): one `NAME=value` over MAX_ARG_STRLEN, a shell
/// command over it, and an env over ARG_MAX in all. An env of 1 MB passes.
#[test]
fn a_job_over_the_os_argument_limits_is_refused_with_the_limit_named() {
    let job = |command: &str, env: &[(String, usize)]| {
        let vars: Vec<String> = env
            .iter()
            .map(|(k, n)| format!("{k} = \"{}\"", "v".repeat(*n)))
            .collect();
        format!(
            "[[job]]\nname = \"big\"\nschedule = \"* * * * *\"\ncommand = \"{command}\"\nenv = {{ {} }}\n",
            vars.join(", ")
        )
    };
    let one_too_long = job("true", &[("ONE".into(), 200_000)]);
    let command_too_long = format!(
        "[[job]]\nname = \"big\"\nschedule = \"* * * * *\"\ncommand = \"echo {}\"\n",
        "c".repeat(140_000)
    );
    let many: Vec<(String, usize)> = (0..20).map(|i| (format!("V{i}"), 120_000)).collect();
    let all_too_long = job("true", &many);
    for (case, text, line, fragment) in [
        (
            "one env value",
            one_too_long,
            5,
            "over the OS limit of 131072 bytes for one (MAX_ARG_STRLEN)",
        ),
        (
            "the command",
            command_too_long,
            4,
            "over the OS limit of 131072 bytes for one (MAX_ARG_STRLEN)",
        ),
        (
            "the env in all",
            all_too_long,
            5,
            "over the OS argument limit of",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let errors = match load(dir.path(), GOOD_MAIN, &[("a.toml", &text)]) {
            Ok(_) => panic!("{case}: accepted"),
            Err(e) => e,
        };
        let e = errors
            .iter()
            .find(|e| e.message.contains(fragment))
            .unwrap_or_else(|| panic!("{case}: no error contains {fragment:?}: {errors:?}"));
        assert_eq!(e.position.map(|p| p.0), Some(line), "{case}: {e}");
        assert!(e.origin.ends_with("a.toml"), "{case}: {e}");
        assert!(!e.to_string().contains('\n'), "{case}: one line");
    }
    let ten: Vec<(String, usize)> = (0..10).map(|i| (format!("V{i}"), 100_000)).collect();
    let dir = tempfile::tempdir().unwrap();
    let loaded = load(dir.path(), GOOD_MAIN, &[("a.toml", &job("true", &ten))]);
    assert!(loaded.is_ok(), "1 MB of env: {:?}", loaded.err());
}

/// A program or working directory that is not there passes `check` with a
/// warning each, naming file, line and column (it may be installed later);
/// `--strict` makes them errors, exit 78.
#[test]
fn a_missing_program_or_working_directory_is_a_warning_and_strict_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cronlease.toml"), GOOD_MAIN).unwrap();
    std::fs::create_dir_all(dir.path().join("jobs.d")).unwrap();
    let jobs = "[[job]]
name = \"argv\"
schedule = \"* * * * *\"
command = [\"/opt/nowhere/backup\", \"--full\"]

[[job]]
name = \"dir\"
schedule = \"* * * * *\"
command = \"true\"
working_dir = \"/srv/not-mounted\"

[[job]]
name = \"shell\"
schedule = \"* * * * *\"
command = \"no-such-tool-x --flag && echo done\"

[[job]]
name = \"fine\"
schedule = \"* * * * *\"
command = \"cd /tmp && ls\"
";
    std::fs::write(dir.path().join("jobs.d/a.toml"), jobs).unwrap();
    let check = |strict: bool| {
        let mut cmd = Command::new(crate::support::binary());
        cmd.args(["check", "-c"])
            .arg(dir.path().join("cronlease.toml"))
            .env_remove("CRONLEASE_STORE_URL");
        if strict {
            cmd.arg("--strict");
        }
        cmd.output().unwrap()
    };
    let out = check(false);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(
        lines[0].starts_with("warning: ")
            && lines[0].contains("a.toml:4:11: job \"argv\": /opt/nowhere/backup: no such file")
            && lines[0].contains("not_started"),
        "{stderr}"
    );
    assert!(
        lines[1].contains("a.toml:10:15: job \"dir\": working_dir /srv/not-mounted does not exist"),
        "{stderr}"
    );
    assert!(
        lines[2].contains("a.toml:15:11: job \"shell\": no-such-tool-x: not found in PATH")
            && lines[2].contains("exit 127"),
        "{stderr}"
    );
    let out = check(true);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert_eq!(stderr.lines().count(), 3, "{stderr}");
    assert!(
        stderr
            .lines()
            .all(|l| !l.starts_with("warning: ") && l.contains("a.toml:")),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}
