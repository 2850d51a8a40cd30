//! Tests of the crontab import: environment lines, user and system formats, macros, names, the day rule, `%` as standard input, quoting, and errors with their line and column.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use chrono::{DateTime, Utc};

fn user(text: &str) -> Import {
    import(text, "t", &Options::default()).unwrap()
}

fn tables(imp: &Import) -> Vec<toml::Table> {
    let doc: toml::Table =
        toml::from_str(&imp.toml).unwrap_or_else(|e| panic!("invalid TOML: {e}\n{}", imp.toml));
    doc.get("job")
        .and_then(|j| j.as_array())
        .map(|a| a.iter().map(|v| v.as_table().unwrap().clone()).collect())
        .unwrap_or_default()
}

fn only(text: &str) -> toml::Table {
    let t = tables(&user(text));
    assert_eq!(t.len(), 1, "{t:?}");
    t.into_iter().next().unwrap()
}

fn s<'a>(t: &'a toml::Table, key: &str) -> &'a str {
    t.get(key)
        .and_then(|v| v.as_str())
        .unwrap_or_else(|| panic!("{key} in {t:?}"))
}

fn env(t: &toml::Table) -> Vec<(String, String)> {
    t.get("env")
        .and_then(|e| e.as_table())
        .map(|e| {
            e.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                .collect()
        })
        .unwrap_or_default()
}

fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = p
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    v.sort();
    v
}

fn line_err(text: &str, system: bool) -> (usize, usize, String) {
    let options = Options {
        system,
        timezone: None,
    };
    match import(text, "t", &options).unwrap_err() {
        ImportError::Line {
            line,
            column,
            message,
            ..
        } => (line, column, message),
        other => panic!("{other:?}"),
    }
}

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
}

fn next(schedule: &str, from: &str) -> String {
    Schedule::parse(schedule, "UTC")
        .unwrap()
        .next_after(utc(from))
        .unwrap()
        .to_rfc3339()
}

#[test]
fn env_lines_apply_to_the_jobs_after_them() {
    let t = tables(&user(
        "A=1\n* * * * * one\nB=2\n* * * * * two\nA=3\n0 * * * * three\n",
    ));
    assert_eq!(env(&t[0]), pairs(&[("A", "1")]));
    assert_eq!(env(&t[1]), pairs(&[("A", "1"), ("B", "2")]));
    assert_eq!(env(&t[2]), pairs(&[("A", "3"), ("B", "2")]));
}

#[test]
fn quoted_and_spaced_env_values() {
    let t = only(concat!(
        "X = \"  spaced  \"\n",
        "Y='a \"b\"'\n",
        "Z=plain value  \n",
        "W = it's\n",
        "E=\n",
        "Q=\"\"\n",
        "PATH=/usr/local/bin:/usr/bin:/bin\n",
        "TZ=Europe/Paris\n",
        "* * * * * x\n",
    ));
    assert_eq!(
        env(&t),
        pairs(&[
            ("X", "  spaced  "),
            ("Y", "a \"b\""),
            ("Z", "plain value"),
            ("W", "it's"),
            ("E", ""),
            ("Q", ""),
            ("PATH", "/usr/local/bin:/usr/bin:/bin"),
            // TZ is the job's environment, not its schedule's zone.
            ("TZ", "Europe/Paris"),
        ])
    );
    assert!(t.get("timezone").is_none());
    assert_eq!(
        parse_env("\"A B\" = 'x'"),
        Some(EnvLine {
            name: "A B".into(),
            value: "x".into(),
            value_at: 9
        })
    );
    // Not environment lines: a job line, junk after a quoted value.
    assert_eq!(parse_env("*/5 * * * * a=b"), None);
    assert_eq!(parse_env("X=\"a\" b"), None);
    assert_eq!(parse_env("X=\"a"), None);
}

/// Found by fuzz/ (target crontab): a name holding both kinds of quote
/// was written as a multi-line string, which TOML allows for no key.
#[test]
fn env_names_with_quotes_stay_valid_keys() {
    let t = tables(&user("GREETINGt'\"=x\n* * * * * true\n"));
    assert_eq!(env(&t[0]), pairs(&[("GREETINGt'\"", "x")]));
}

#[test]
fn mailto_becomes_a_comment_not_env() {
    let imp = user("MAILTO=ops@example.com\nMAILFROM=cron@example.com\n* * * * * true\n");
    let t = tables(&imp);
    assert!(env(&t[0]).is_empty(), "{:?}", env(&t[0]));
    assert!(
        imp.toml.contains("# MAILTO=ops@example.com\n"),
        "{}",
        imp.toml
    );
    assert!(imp.toml.contains("cronlease sends no mail"), "{}", imp.toml);
    assert_eq!(imp.warnings.len(), 2);
    assert_eq!(imp.warnings[0].line, 1);
    assert!(imp.warnings[0].to_string().starts_with("t:1: MAILTO"));
    // MAILTO="" (no mail) has nothing to translate.
    assert!(user("MAILTO=\"\"\n* * * * * true\n").warnings.is_empty());
}

#[test]
fn shell_other_than_sh_runs_the_command_as_argv() {
    let t = tables(&user(
        "SHELL=/bin/bash\n0 1 * * * echo $BASH_VERSION\nSHELL=/bin/sh\n0 2 * * * echo sh\n",
    ));
    let argv: Vec<&str> = t[0]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(argv, ["/bin/bash", "-c", "echo $BASH_VERSION"]);
    assert_eq!(env(&t[0]), pairs(&[("SHELL", "/bin/bash")]));
    assert_eq!(s(&t[1], "command"), "echo sh");
    assert_eq!(env(&t[1]), pairs(&[("SHELL", "/bin/sh")]));
}

#[test]
fn cron_tz_sets_the_timezone_of_later_jobs() {
    let options = Options {
        system: false,
        timezone: Some("America/New_York".into()),
    };
    let imp = import(
        "0 9 * * * a\nCRON_TZ=Europe/Berlin\n0 9 * * * b\nCRON_TZ=\n0 9 * * * c\n",
        "t",
        &options,
    )
    .unwrap();
    let t = tables(&imp);
    assert_eq!(s(&t[0], "timezone"), "America/New_York");
    assert_eq!(s(&t[1], "timezone"), "Europe/Berlin");
    assert_eq!(s(&t[2], "timezone"), "America/New_York");
    assert!(env(&t[1]).is_empty());
    assert_eq!(imp.jobs[1].timezone.as_deref(), Some("Europe/Berlin"));
    // Without a default: no key (UTC).
    assert!(only("0 9 * * * a\n").get("timezone").is_none());
    let (line, col, msg) = line_err("CRON_TZ=Mars/Base\n* * * * * x\n", false);
    assert_eq!((line, col), (1, 9));
    assert!(msg.contains("unknown time zone"), "{msg}");
    assert!(matches!(
        import(
            "",
            "t",
            &Options {
                system: false,
                timezone: Some("Nowhere".into())
            }
        ),
        Err(ImportError::Zone(_))
    ));
}

#[test]
fn system_format_takes_the_user_field() {
    let options = Options {
        system: true,
        timezone: None,
    };
    let imp = import(
        "SHELL=/bin/sh\n17 *\t* * *\troot    cd / && run-parts --report /etc/cron.hourly\n@daily www-data /usr/bin/php /srv/cron.php\n",
        "/etc/crontab",
        &options,
    )
    .unwrap();
    let t = tables(&imp);
    assert_eq!(s(&t[0], "user"), "root");
    assert_eq!(s(&t[0], "schedule"), "17 * * * *");
    assert_eq!(
        s(&t[0], "command"),
        "cd / && run-parts --report /etc/cron.hourly"
    );
    assert_eq!(s(&t[0], "name"), "run-parts");
    assert_eq!(s(&t[1], "user"), "www-data");
    assert_eq!(s(&t[1], "name"), "cron");
    assert_eq!(s(&t[1], "schedule"), "@daily");
    assert_eq!(s(&t[1], "command"), "/usr/bin/php /srv/cron.php");
    let (line, _, msg) = line_err("0 0 * * * root\n", true);
    assert_eq!(line, 1);
    assert!(msg.contains("after the user name"), "{msg}");
    let (_, _, msg) = line_err("0 0 * * *\n", true);
    assert!(msg.contains("expected a user name"), "{msg}");
    // A user crontab has no user field.
    assert!(only("0 0 * * * root echo\n").get("user").is_none());
    assert!(is_system_path(Path::new("/etc/crontab")));
    assert!(is_system_path(Path::new("/etc/cron.d/certbot")));
    assert!(!is_system_path(Path::new("/etc/cron.d")));
    assert!(!is_system_path(Path::new("/var/spool/cron/crontabs/alice")));
    assert!(!is_system_path(Path::new("-")));
}

#[test]
fn reboot_becomes_a_comment() {
    let imp = user("@reboot /usr/local/bin/agent --start\n@daily true\n");
    assert_eq!(tables(&imp).len(), 1);
    assert_eq!(imp.jobs.len(), 1);
    assert!(
        imp.toml
            .contains("# line 1: @reboot /usr/local/bin/agent --start\n")
    );
    assert!(imp.toml.contains("not boots"), "{}", imp.toml);
    assert_eq!(imp.warnings.len(), 1);
    assert!(imp.warnings[0].message.contains("systemd unit"));
}

#[test]
fn macros_map_to_the_same_macro() {
    let t = only("@daily /usr/sbin/logrotate /etc/logrotate.conf\n");
    assert_eq!(s(&t, "schedule"), "@daily");
    assert_eq!(s(&t, "name"), "logrotate");
    for (m, want) in [
        ("@hourly", "@hourly"),
        ("@WEEKLY", "@weekly"),
        ("@monthly", "@monthly"),
        ("@yearly", "@yearly"),
        ("@annually", "@annually"),
        ("@midnight", "@midnight"),
    ] {
        assert_eq!(s(&only(&format!("{m} x\n")), "schedule"), want);
    }
}

#[test]
fn names_become_numbers() {
    assert_eq!(s(&only("0 9 * jan mon-fri x\n"), "schedule"), "0 9 * 1 1-5");
    assert_eq!(
        s(&only("0 9 * JAN-Mar,oct Sun,sat x\n"), "schedule"),
        "0 9 * 1-3,10 0,6"
    );
    // Sunday ending a range is the 7: the weekend.
    assert_eq!(s(&only("0 9 * * sat-sun x\n"), "schedule"), "0 9 * * 6-7");
    assert_eq!(
        s(&only("05 */6 1-31/2 * * x\n"), "schedule"),
        "5 */6 1-31/2 * *"
    );
    let (_, col, msg) = line_err("0 9 * * monday x\n", false);
    assert_eq!(col, 9);
    assert!(msg.contains("unknown day of week name \"monday\""), "{msg}");
    let (_, col, msg) = line_err("0 9 * * 1-fri,sep x\n", false);
    assert_eq!(col, 15);
    assert!(msg.contains("unknown day of week name \"sep\""), "{msg}");
    // Names only where cron takes them.
    let (_, _, msg) = line_err("0 mon * * * x\n", false);
    assert!(msg.contains("expected a number from 0 to 23"), "{msg}");
}

#[test]
fn seven_is_sunday() {
    let t = only("0 0 * * 7 x\n");
    assert_eq!(s(&t, "schedule"), "0 0 * * 7");
    // 2026-11-26 is a Thursday.
    assert_eq!(
        next("0 0 * * 7", "2026-11-26T00:00:00Z"),
        "2026-11-29T00:00:00+00:00"
    );
    assert_eq!(
        next("0 0 * * 5-7", "2026-11-28T12:00:00Z"),
        "2026-11-29T00:00:00+00:00"
    );
}

#[test]
fn day_rule_follows_cron() {
    // Both restricted: either matches (Tuesday 2026-12-01 is the 1st, the
    // next Monday is the 7th, then the 15th).
    let t = only("0 12 1,15 * mon x\n");
    assert_eq!(s(&t, "schedule"), "0 12 1,15 * 1");
    assert_eq!(
        next("0 12 1,15 * 1", "2026-12-01T12:00:00Z"),
        "2026-12-07T12:00:00+00:00"
    );
    assert_eq!(
        next("0 12 1,15 * 1", "2026-12-07T12:00:00Z"),
        "2026-12-14T12:00:00+00:00"
    );
    // A `*`-led day field: both must match, in cron and so in the
    // translation. Odd days that are weekdays: Tue 1st, Thu 3rd, ...
    let imp = user("15 3 */2 * 1-5 x\n");
    assert_eq!(imp.jobs[0].schedule, "15 3 */2 * +1-5");
    assert_eq!(imp.warnings.len(), 1);
    assert!(imp.toml.contains("the + before the day of week"));
    assert_eq!(
        next("15 3 */2 * +1-5", "2026-12-01T03:15:00Z"),
        "2026-12-03T03:15:00+00:00"
    );
    // Sat 5th is odd but a weekend; Mon 7th is the next odd weekday.
    assert_eq!(
        next("15 3 */2 * +1-5", "2026-12-03T03:15:00Z"),
        "2026-12-07T03:15:00+00:00"
    );
    // A `*`-led field that matches every day is plain `*`.
    assert_eq!(s(&only("0 0 *,5 * mon x\n"), "schedule"), "0 0 * * 1");
    assert_eq!(s(&only("0 0 1 * */1 x\n"), "schedule"), "0 0 1 * *");
    assert_eq!(s(&only("0 0 */2 * * x\n"), "schedule"), "0 0 */2 * *");
    // `*` inside a list of an unrestricted-looking field stays a range.
    assert_eq!(s(&only("0 0 1,* * mon x\n"), "schedule"), "0 0 1,1-31 * 1");
}

#[test]
fn percent_is_standard_input() {
    let t = only("0 3 * * * tar czf /b/$(date +\\%F).tgz /home\n");
    assert_eq!(s(&t, "command"), "tar czf /b/$(date +%F).tgz /home");

    let imp = user("* * * * * cat%it's 100\\% \"q\"%tab\\there\n");
    assert_eq!(imp.warnings.len(), 1);
    assert!(imp.toml.contains("standard input"), "{}", imp.toml);
    let t = tables(&imp);
    let cmd = s(&t[0], "command");
    assert_eq!(
        cmd,
        "printf '%s' 'it'\\''s 100% \"q\"\ntab\\there' | (\ncat\n)"
    );
    assert_eq!(s(&t[0], "name"), "cat");
    let out = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(cmd)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "it's 100% \"q\"\ntab\\there"
    );

    assert_eq!(
        split_percent("mail -s x root%Hi,%%done.%"),
        (
            "mail -s x root".to_string(),
            Some("Hi,\n\ndone.\n".to_string())
        )
    );
    assert_eq!(
        split_percent("a \\\\%b"),
        ("a \\\\".to_string(), Some("b".to_string()))
    );
    assert_eq!(split_percent("echo \\x"), ("echo \\x".to_string(), None));
    assert_eq!(
        split_percent("cat%end\\"),
        ("cat".to_string(), Some("end\\".to_string()))
    );

    // Another shell: /bin/sh feeds the text, that shell runs the command.
    if Path::new("/bin/bash").exists() {
        let t = only("SHELL=/bin/bash\n* * * * * cat %x%y\n");
        let argv: Vec<String> = t["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        assert_eq!(argv[0], "/bin/sh");
        assert_eq!(
            argv[3..].to_vec(),
            vec!["/bin/bash".to_string(), "cat ".to_string()]
        );
        let out = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8(out.stdout).unwrap(), "x\ny");
    }
    let (_, col, msg) = line_err("* * * * * %only input\n", false);
    assert_eq!(col, 11);
    assert!(msg.contains("before the %"), "{msg}");
}

#[test]
fn quotes_backslashes_and_control_characters_survive() {
    let line = "* * * * * printf \"a\\tb\\\\n\" | grep -F '\"x\"' # \u{1} é\n";
    let t = only(line);
    assert_eq!(
        s(&t, "command"),
        "printf \"a\\tb\\\\n\" | grep -F '\"x\"' # \u{1} é"
    );
    // crontab(5) has no escapes in values: the backslash is kept and the
    // first matching quote ends the value, so this K is `va\`.
    let t = only("K=\"va\\\"\nQ=a\\b\n* * * * * x\n");
    assert_eq!(env(&t), pairs(&[("K", "va\\"), ("Q", "a\\b")]));
    // Text after the closing quote: not an environment line, so not a
    // job line either.
    let (line, col, _) = line_err("K=\"va\\\"l\"\n", false);
    assert_eq!((line, col), (1, 1));
    let t = only("'A.B'=1\n* * * * * x\n");
    assert_eq!(env(&t), pairs(&[("A.B", "1")]));
}

fn names(text: &str) -> Vec<String> {
    let imp = user(text);
    // The record and the table agree.
    let written: Vec<String> = tables(&imp)
        .iter()
        .map(|t| s(t, "name").to_string())
        .collect();
    let recorded: Vec<String> = imp.jobs.iter().map(|j| j.name.clone()).collect();
    assert_eq!(written, recorded, "{}", imp.toml);
    recorded
}

#[test]
fn names_come_from_the_programs_base_name() {
    assert_eq!(
        names(concat!(
            "0 1 * * * cd /srv && ./backup.sh --full\n",
            "0 2 * * * /usr/local/bin/rotate-logs.sh\n",
            "0 3 * * * [ -x /usr/bin/vnstat ] && /usr/bin/vnstat -u\n",
            "0 4 * * * LANG=C TZ=UTC /opt/Report.PY x\n",
            "0 5 * * * ./weird@name!.sh\n",
            "0 6 * * * /usr/bin/python3 /srv/app/manage.py clearsessions\n",
            "0 7 * * * sh -c 'echo hi'\n",
            "0 8 * * * test -x /usr/sbin/anacron || ( cd / && run-parts /etc/cron.daily )\n",
            "0 9 * * * { cd /tmp; exec ./sweep; }\n",
            "0 10 * * * (cd /var/www && php artisan schedule:run)\n",
            "0 11 * * * cd /tmp\n",
            "0 12 * * * \"/opt/my tool/run\" x\n",
        )),
        [
            "backup",
            "rotate-logs",
            "vnstat",
            "report",
            "weird-name",
            "manage",
            "sh",
            "run-parts",
            // `exec` is a program word like any other.
            "exec",
            "artisan",
            "cd",
            "my",
        ]
    );
    let long = format!("/bin/{}.sh", "a".repeat(200));
    assert_eq!(name_stem(&long), "a".repeat(MAX_STEM));
    assert_eq!(name_stem("x--y..z-. arg"), "x-y..z");
    // Every name is one the configuration accepts.
    for n in names("* * * * * ./Ünïcode-ß.sh\n* * * * * .hidden\n") {
        assert!(crate::config::JobName::parse(&n).is_ok(), "{n}");
    }
}

#[test]
fn the_same_program_gets_a_counter_only_on_collision() {
    assert_eq!(
        names(concat!(
            "0 1 * * * /usr/local/bin/backup --full\n",
            "0 2 * * * /usr/local/bin/backup --incremental\n",
            "0 3 * * * /usr/bin/curl https://x/\n",
            "0 4 * * * BACKUP.sh\n",
        )),
        ["backup", "backup-2", "curl", "backup-3"]
    );
    // A program named like a numbered name keeps its plain name, wherever
    // it comes: the counter goes round it.
    assert_eq!(
        names("* * * * * backup\n* * * * * backup\n* * * * * backup-2\n"),
        ["backup", "backup-3", "backup-2"]
    );
    assert_eq!(
        distinct_names(&["x", "x-2", "x", "x"].map(String::from)),
        ["x", "x-2", "x-3", "x-4"]
    );
    // Names differ in more than case, as `check` requires.
    assert_eq!(names("* * * * * X\n* * * * * x\n"), ["x", "x-2"]);
    // A later program called `a-2` keeps its name: the second `a` skips it.
    let text = "* * * * * a\n* * * * * a\n* * * * * a-2\n* * * * * b\n";
    assert_eq!(names(text), ["a", "a-3", "a-2", "b"]);
}

#[test]
fn names_stay_when_lines_are_added_or_removed_above() {
    let below = "0 1 * * * cd /srv && ./backup.sh\n0 2 * * * /usr/bin/rotate-logs\n";
    let before = names(below);
    assert_eq!(before, ["backup", "rotate-logs"]);
    let added = names(&format!(
        "# new\nMAILTO=\"\"\n\n*/5 * * * * curl -fsS https://x/\n@daily /usr/bin/report\n{below}"
    ));
    assert_eq!(added, ["curl", "report", "backup", "rotate-logs"]);
    // No name carries a line number.
    let lines = user(&format!("\n\n\n{below}"));
    assert_eq!(lines.jobs[0].line, 4);
    assert_eq!(lines.jobs[0].name, "backup");
}

#[test]
fn a_command_of_symbols_only_is_named_job() {
    assert_eq!(
        names("* * * * * @@@ --x\n* * * * * !!!\n* * * * * ( ; )\n"),
        ["job", "job-2", "job-3"]
    );
    assert_eq!(name_stem(""), "job");
    assert_eq!(name_stem("'-.-'"), "job");
}

#[test]
fn the_header_says_how_to_rename_a_job() {
    let toml = user("* * * * * true\n").toml;
    let header: String = toml
        .lines()
        .take_while(|l| l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(header.contains("edit its name = \"...\" line"), "{header}");
    assert!(header.contains("a new\n#   lock"), "{header}");
    assert!(header.contains("under the old name"), "{header}");
}

#[test]
fn errors_name_line_and_column() {
    let (line, col, msg) = line_err("61 * * * * x\n", false);
    assert_eq!((line, col), (1, 1));
    assert_eq!(
        msg,
        "minute 61 is out of range: expected a number from 0 to 59"
    );
    let (line, col, msg) = line_err("# c\nA=1\n  */5 * 32 * * x\n", false);
    assert_eq!((line, col), (3, 9));
    assert!(msg.contains("day of month 32"), "{msg}");
    let (_, col, msg) = line_err("0 0 * foo * x\n", false);
    assert_eq!(col, 7);
    assert!(msg.contains("unknown month name \"foo\""), "{msg}");
    let (_, col, msg) = line_err("* * *\n", false);
    assert_eq!(col, 6);
    assert!(msg.contains("expected 5 time fields"), "{msg}");
    let (_, col, msg) = line_err("0 0 * * * \n", false);
    assert_eq!(col, 11);
    assert!(msg.contains("expected a command"), "{msg}");
    let (_, col, msg) = line_err("0 5/15 * * * x\n", false);
    assert_eq!(col, 3);
    assert!(msg.contains("a step needs a range"), "{msg}");
    // A control character in a field (the fuzzer's `\r`) is quoted as an
    // escape: the error stays on one line.
    let (_, col, msg) = line_err("00 0/*\r\r **x\n", false);
    assert_eq!(col, 4);
    assert!(msg.contains("0/*\\r\\r: a step needs a range"), "{msg}");
    assert!(!msg.contains(['\r', '\n']), "{msg:?}");
    let (_, col, msg) = line_err("*/0 * * * * x\n", false);
    assert_eq!(col, 3);
    assert!(msg.contains("expected a step from 1 to 60"), "{msg}");
    let (_, col, msg) = line_err("0 5-2 * * * x\n", false);
    assert_eq!(col, 3);
    assert!(msg.contains("runs backwards"), "{msg}");
    let (_, col, msg) = line_err("0 1,,2 * * * x\n", false);
    assert_eq!(col, 5);
    assert!(msg.contains("each side of every comma"), "{msg}");
    let (_, col, msg) = line_err("\t0 0 30 2 * x\n", false);
    assert_eq!(col, 2);
    assert!(msg.contains("never fires"), "{msg}");
    let (_, col, msg) = line_err("@often x\n", false);
    assert_eq!(col, 1);
    assert!(msg.contains("unknown schedule \"@often\""), "{msg}");
    let (_, _, msg) = line_err("hello world=1\n", false);
    assert!(
        msg.contains("nor is the line an environment setting"),
        "{msg}"
    );
    let (_, col, msg) = line_err("CRONLEASE_JOB=x\n", false);
    assert_eq!(col, 1);
    assert!(msg.contains("reserved"), "{msg}");
    let (_, _, msg) = line_err("1X=y\n", false);
    assert!(msg.contains("invalid environment variable name"), "{msg}");
    let e = import(
        "x\n0 0 * * * ok\n61 * * * * x\n",
        "/etc/cron.d/x",
        &Options::default(),
    )
    .unwrap_err();
    assert!(e.to_string().starts_with("/etc/cron.d/x:1:1: "), "{e}");
    let e = import("0 0 * * * ok\n61 * * * * x\n", "f", &Options::default()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "f:2:1: minute 61 is out of range: expected a number from 0 to 59"
    );
}

#[test]
fn output_is_valid_toml_with_a_header_and_comments() {
    let imp = user("# my jobs \u{7}\r\n\r\n*/15 * * * * curl -fsS https://x/ping\r\n");
    assert!(
        imp.toml
            .starts_with("# Jobs imported from t (user crontab)")
    );
    assert!(imp.toml.contains("# my jobs \u{FFFD}\n"), "{}", imp.toml);
    let t = tables(&imp);
    assert_eq!(s(&t[0], "command"), "curl -fsS https://x/ping");
    assert_eq!(s(&t[0], "name"), "curl");
    // Empty input: a header and no jobs, still TOML.
    assert!(tables(&user("")).is_empty());
    // A last line without its newline is imported, with a warning.
    let imp = user("0 0 * * * x");
    assert_eq!(imp.jobs.len(), 1);
    assert!(imp.warnings[0].message.contains("newline"));
}
