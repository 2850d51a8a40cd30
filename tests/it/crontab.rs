//! `import-crontab` on real crontabs: Debian 12's stock /etc/crontab and a
//! user's crontab using every feature (tests/fixtures/crontab/). Each
//! translates into a job file that `cronlease check` accepts (loaded with
//! `config::load`, the code behind `check`), and every translated job fires
//! at exactly the instants an independent reading of its crontab line
//! gives. That reference, below, parses the five fields into sets itself
//! and walks the calendar day by day, minute by minute, applying
//! crontab(5)'s day rule (OR when neither day field starts with `*`); it
//! never calls croner or `cronlease::schedule`.

use std::path::Path;

use chrono::{DateTime, Datelike, LocalResult, TimeZone, Utc};
use chrono_tz::Tz;

use cronlease::config::{self, Command, Overrides};
use cronlease::crontab::{self, Import, Options};

/// Where the comparisons start: an ordinary day, a leap February's end, a
/// year's last minute.
const STARTS: [&str; 3] = [
    "2026-11-26T00:00:00Z",
    "2028-02-27T00:00:00Z",
    "2026-12-31T23:59:00Z",
];
/// Occurrences compared per job and start.
const N: usize = 20;

const MONTHS: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];
const DAYS: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
}

fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/crontab")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One job line as the reference reads it.
struct RefJob {
    line: usize,
    reboot: bool,
    zone: Tz,
    minutes: Vec<bool>,
    hours: Vec<bool>,
    doms: Vec<bool>,
    months: Vec<bool>,
    /// Sunday = 0; a 7 in the field is folded into 0.
    dows: Vec<bool>,
    dom_star: bool,
    dow_star: bool,
}

/// A value: a number, or a name (`names[0]` is `first`). Sunday closing a
/// range is 7, so `sat-sun` is the weekend.
fn number(s: &str, names: &[&str], first: u32, range_end: bool) -> u32 {
    if let Ok(n) = s.parse() {
        return n;
    }
    let i = names
        .iter()
        .position(|n| n.eq_ignore_ascii_case(s))
        .unwrap_or_else(|| panic!("reference: unknown name {s:?}"));
    if range_end && names.len() == 7 && i == 0 {
        7
    } else {
        first + i as u32
    }
}

/// The values a field matches, indexed by value.
fn set(field: &str, lo: u32, hi: u32, names: &[&str], first: u32) -> Vec<bool> {
    let mut set = vec![false; hi as usize + 1];
    for item in field.split(',') {
        let (range, step) = match item.split_once('/') {
            Some((r, s)) => (r, s.parse::<usize>().unwrap()),
            None => (item, 1),
        };
        let (a, b) = if range == "*" {
            (lo, hi)
        } else if let Some((a, b)) = range.split_once('-') {
            (
                number(a, names, first, false),
                number(b, names, first, true),
            )
        } else {
            let v = number(range, names, first, false);
            (v, v)
        };
        assert!(lo <= a && a <= b && b <= hi, "reference: bad range {item}");
        for v in (a..=b).step_by(step) {
            set[v as usize] = true;
        }
    }
    set
}

/// Every job line of `text`, with the CRON_TZ in force for it.
fn reference(text: &str) -> Vec<RefJob> {
    let mut zone = Tz::UTC;
    let mut jobs = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let t = raw.trim_start();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let lead = t.chars().next().unwrap();
        if !(lead.is_ascii_digit() || lead == '*' || lead == '@') {
            // NAME=value: only CRON_TZ changes when jobs fire.
            let (name, value) = t.split_once('=').expect("an environment line");
            if name.trim() == "CRON_TZ" {
                let v = value.trim().trim_matches(|c: char| c == '"' || c == '\'');
                zone = if v.is_empty() {
                    Tz::UTC
                } else {
                    v.parse().unwrap()
                };
            }
            continue;
        }
        let words: Vec<&str> = t.split_whitespace().collect();
        let fields: Vec<&str> = match words[0].to_ascii_lowercase().as_str() {
            "@reboot" => Vec::new(),
            "@yearly" | "@annually" => vec!["0", "0", "1", "1", "*"],
            "@monthly" => vec!["0", "0", "1", "*", "*"],
            "@weekly" => vec!["0", "0", "*", "*", "0"],
            "@daily" | "@midnight" => vec!["0", "0", "*", "*", "*"],
            "@hourly" => vec!["0", "*", "*", "*", "*"],
            _ => words[..5].to_vec(),
        };
        if fields.is_empty() {
            jobs.push(RefJob {
                line: i + 1,
                reboot: true,
                zone,
                minutes: Vec::new(),
                hours: Vec::new(),
                doms: Vec::new(),
                months: Vec::new(),
                dows: Vec::new(),
                dom_star: false,
                dow_star: false,
            });
            continue;
        }
        let dow = set(fields[4], 0, 7, &DAYS, 0);
        jobs.push(RefJob {
            line: i + 1,
            reboot: false,
            zone,
            minutes: set(fields[0], 0, 59, &[], 0),
            hours: set(fields[1], 0, 23, &[], 0),
            doms: set(fields[2], 1, 31, &[], 0),
            months: set(fields[3], 1, 12, &MONTHS, 1),
            dows: (0..7).map(|d| dow[d] || (d == 0 && dow[7])).collect(),
            dom_star: fields[2].starts_with('*'),
            dow_star: fields[4].starts_with('*'),
        });
    }
    jobs
}

/// The first `n` instants after `start` at which cron runs `job`: each day
/// from the day before `start` (in the job's zone), when its month and day
/// match, every matching hour and minute of it, in order.
fn fires(job: &RefJob, start: DateTime<Utc>, n: usize) -> Vec<DateTime<Utc>> {
    let mut out = Vec::new();
    let mut date = start
        .with_timezone(&job.zone)
        .date_naive()
        .pred_opt()
        .unwrap();
    // A century of days: enough for 20 leap days.
    for _ in 0..366 * 100 {
        let dom_ok = job.doms[date.day() as usize];
        let dow_ok = job.dows[date.weekday().num_days_from_sunday() as usize];
        let day_ok = if job.dom_star || job.dow_star {
            dom_ok && dow_ok
        } else {
            dom_ok || dow_ok
        };
        if job.months[date.month() as usize] && day_ok {
            for h in (0..24u32).filter(|h| job.hours[*h as usize]) {
                for m in (0..60u32).filter(|m| job.minutes[*m as usize]) {
                    let local = date.and_hms_opt(h, m, 0).unwrap();
                    let t = match job.zone.from_local_datetime(&local) {
                        LocalResult::Single(t) => t.with_timezone(&Utc),
                        other => panic!(
                            "line {}: {local} in {} is {other:?}: the fixtures' zoned jobs keep clear of DST changes",
                            job.line, job.zone
                        ),
                    };
                    if t > start {
                        out.push(t);
                        if out.len() == n {
                            return out;
                        }
                    }
                }
            }
        }
        date = date.succ_opt().unwrap();
    }
    out
}

/// Loads `jobs` as a job file beside a minimal main file, as `check` does.
fn check(jobs: &str) -> config::Config {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("cronlease.toml"),
        "node = \"n1\"\n[store]\nurl = \"sqlite://locks.db\"\n",
    )
    .unwrap();
    std::fs::create_dir(dir.path().join("jobs.d")).unwrap();
    // `user` is accepted only when the checking process is root (as for
    // `cronlease check`); elsewhere the loaded copy goes without it.
    let text: String = if nix::unistd::geteuid().is_root() {
        jobs.to_string()
    } else {
        jobs.lines()
            .filter(|l| !l.starts_with("user = "))
            .map(|l| format!("{l}\n"))
            .collect()
    };
    std::fs::write(dir.path().join("jobs.d/imported.toml"), text).unwrap();
    config::load(&dir.path().join("cronlease.toml"), &Overrides::default())
        .unwrap_or_else(|e| panic!("{e}\n--- imported:\n{jobs}"))
}

/// Translates a fixture, loads it, and compares every job's next fire
/// times with the reference's.
fn translate_and_compare(name: &str, system: bool) -> (Import, config::Config) {
    let text = fixture(name);
    let options = Options {
        system,
        timezone: None,
    };
    let imp = crontab::import(&text, name, &options).unwrap_or_else(|e| panic!("{e}"));
    let cfg = check(&imp.toml);
    let reference = reference(&text);
    let lines: Vec<usize> = reference
        .iter()
        .filter(|r| !r.reboot)
        .map(|r| r.line)
        .collect();
    assert_eq!(
        imp.jobs.iter().map(|j| j.line).collect::<Vec<_>>(),
        lines,
        "one job per job line (no @reboot)"
    );
    assert_eq!(cfg.jobs.len(), lines.len());
    for r in reference.iter().filter(|r| !r.reboot) {
        let imported = imp.jobs.iter().find(|j| j.line == r.line).unwrap();
        let job = cfg
            .jobs
            .iter()
            .find(|j| j.name.as_str() == imported.name)
            .unwrap_or_else(|| panic!("job {} not loaded", imported.name));
        assert_eq!(job.schedule.zone(), r.zone, "{name}:{}", r.line);
        for start in STARTS {
            let start = utc(start);
            let got = job.schedule.upcoming(start, N);
            let want = fires(r, start, N);
            assert_eq!(want.len(), N, "{name}:{}: reference ran out", r.line);
            assert_eq!(
                got, want,
                "{name}:{}: schedule {:?} from {start}",
                r.line, imported.schedule
            );
        }
    }
    (imp, cfg)
}

fn job<'a>(cfg: &'a config::Config, name: &str) -> &'a config::Job {
    cfg.jobs
        .iter()
        .find(|j| j.name.as_str() == name)
        .unwrap_or_else(|| panic!("no job {name}"))
}

#[test]
fn debian_etc_crontab_translates_and_fires_as_cron() {
    assert!(crontab::is_system_path(Path::new("/etc/crontab")));
    let (imp, cfg) = translate_and_compare("debian-etc-crontab", true);
    let names: Vec<&str> = imp.jobs.iter().map(|j| j.name.as_str()).collect();
    assert_eq!(
        names,
        ["run-parts", "run-parts-2", "run-parts-3", "run-parts-4"]
    );
    assert_eq!(imp.toml.matches("\nuser = \"root\"\n").count(), 4);
    assert!(imp.warnings.is_empty(), "{:?}", imp.warnings);
    for j in &cfg.jobs {
        assert!(matches!(j.command, Command::Shell(_)), "{:?}", j.command);
        assert_eq!(j.env.len(), 1, "{:?}", j.env);
        assert_eq!(j.env["SHELL"], "/bin/sh");
    }
    assert_eq!(
        job(&cfg, "run-parts-2").command,
        Command::Shell(
            "test -x /usr/sbin/anacron || ( cd / && run-parts --report /etc/cron.daily )".into()
        )
    );
    assert_eq!(job(&cfg, "run-parts-3").schedule.expr(), "47 6 * * 7");
    // The header comments are carried over.
    assert!(imp.toml.contains("# /etc/crontab: system-wide crontab\n"));
}

#[test]
fn user_crontab_translates_and_fires_as_cron() {
    let (imp, cfg) = translate_and_compare("user-crontab", false);
    let names: Vec<&str> = imp.jobs.iter().map(|j| j.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "rotate-logs",
            "curl",
            "report",
            "tar",
            "echo",
            "weekly-sweep",
            "payroll",
            "odd-weekday",
            "true",
            "mid-month",
            "mail",
            "vnstat",
            "cleanup",
            "echo-2",
            "taxes",
            "for",
            "cat",
            "standup-reminder",
            "backup-notify",
            "echo-3",
        ]
    );
    // MAILTO (line 6), the AND day rule (26), % (31, 41), @reboot (33);
    // MAILTO="" (39) has nothing to say.
    assert_eq!(
        imp.warnings.iter().map(|w| w.line).collect::<Vec<_>>(),
        [6, 26, 31, 33, 41]
    );

    let curl = job(&cfg, "curl");
    assert!(!curl.env.contains_key("MAILTO"));
    assert_eq!(
        curl.env["PATH"],
        "/home/alice/bin:/usr/local/bin:/usr/bin:/bin"
    );
    assert_eq!(curl.env["BACKUP_DIR"], "/srv/backup/alice");
    assert_eq!(curl.env["GREETING"], "  hello, world  ");
    assert!(!curl.env.contains_key("SHELL"));

    assert_eq!(
        job(&cfg, "tar").command,
        Command::Shell("tar czf \"$BACKUP_DIR/home-$(date +%Y%m%d).tgz\" /home/alice".into())
    );
    assert_eq!(
        job(&cfg, "mail").command,
        Command::Shell(
            "printf '%s' 'Hello Alice,\n\nthe backup is 100% done.\n' | (\nmail -s \"nightly report\" alice\n)"
                .into()
        )
    );
    assert_eq!(
        job(&cfg, "echo-2").command,
        Command::Shell("echo \"month \\\"start\\\" \\\\ backslash\"".into())
    );
    assert_eq!(
        job(&cfg, "for").command,
        Command::Argv(vec![
            "/bin/bash".into(),
            "-c".into(),
            "for f in /tmp/*.log; do gzip -f \"$f\"; done".into()
        ])
    );
    assert_eq!(
        job(&cfg, "cat").command,
        Command::Argv(vec![
            "/bin/sh".into(),
            "-c".into(),
            "printf '%s' 'first line\nsecond '\\''quoted'\\'' line' | \"$0\" -c \"$1\"".into(),
            "/bin/bash".into(),
            "cat > /tmp/note.txt".into(),
        ])
    );
    assert_eq!(job(&cfg, "for").env["SHELL"], "/bin/bash");
    assert_eq!(job(&cfg, "odd-weekday").schedule.expr(), "15 3 */2 * +1-5");
    assert_eq!(
        job(&cfg, "mid-month").schedule.expr(),
        "10 5 10-20/5,28 2,8,11 *"
    );
    assert_eq!(
        job(&cfg, "standup-reminder").schedule.zone(),
        chrono_tz::Europe::Berlin
    );
    assert_eq!(job(&cfg, "echo-3").schedule.zone(), Tz::UTC);
    assert!(
        imp.toml
            .contains("# line 33: @reboot /home/alice/bin/start-agent\n")
    );
}
