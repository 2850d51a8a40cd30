//! The man pages the .deb and the tarball ship, generated from the clap
//! definitions: `cronlease(1)`, with the exit codes, the daemon's signals
//! and its files, and one `cronlease-COMMAND(1)` per command, each page
//! clap_mangen's sections plus those written here. examples/gen_assets.rs
//! writes them and tests/it/cli.rs checks them; both include this file
//! (`#[path]`), which is why it lives in a directory cargo does not build
//! as an example of its own.

use std::io;

use clap::{Command, CommandFactory};
use clap_mangen::Man;
use clap_mangen::roff::{Inline, Roff, bold, italic, roman};
use cronlease::app::{
    EXIT_CONFIG, EXIT_INTERNAL, EXIT_NO_SUCH_JOB, EXIT_REFUSED, EXIT_UNAVAILABLE,
};
use cronlease::config::{DEFAULT_CONFIG_PATH, DEFAULT_PID_FILE, DEFAULT_STORE_URL};

/// Every command's exit codes. 0 and 1 are `ExitCode::SUCCESS` and
/// `FAILURE`; 2 is clap's usage error (and src/app/mod.rs's for a bad
/// `token` name or `import-crontab --timezone`); the rest are the
/// constants of src/app/mod.rs. docs/cli.md ("Exit codes") lists the same
/// codes, and a test (tests/it/cli.rs) holds the two lists equal.
pub const EXIT_CODES: &[(u8, &str)] = &[
    (0, "Done; for run, a graceful stop."),
    (
        1,
        "The operation failed: a stale pid file for step-down, reload or drill, a drill that found a job not taken over, a trigger refused or, with --wait, a run that did not end ok, a migrate on an incompatible newer schema, a store that answers with an error, the [http] port taken.",
    ),
    (
        2,
        "Usage: an unknown command or option, a bad option value, a malformed job name.",
    ),
    (
        EXIT_NO_SUCH_JOB,
        "No such job: neither configured nor in the store's history (for trigger, pause and resume: not configured).",
    ),
    (
        EXIT_UNAVAILABLE,
        "The store is unreachable (connection refused, timeout). run never exits for it: it waits for the store.",
    ),
    (
        EXIT_INTERNAL,
        "An internal error the daemon cannot go on from (a panic, the system bus gone under the systemd runner): its guard kills the running jobs and releases their leases, and systemd restarts it.",
    ),
    (
        EXIT_REFUSED,
        "The store refused this node: credentials rejected, no such database, a failed TLS handshake. The unit does not restart on it.",
    ),
    (
        EXIT_CONFIG,
        "An invalid configuration (every error is printed), or a store type not built into this binary; for check --strict, any warning; for import-crontab, a malformed crontab line.",
    ),
];

/// What `cronlease run` does on each signal: the signals it installs
/// (`Signals::new` in src/app/daemon.rs) and what `handle_signals` there
/// does with each. docs/cli.md ("Signals") names the same signals, and a
/// test (tests/it/cli.rs) holds the code, the docs and this list equal.
pub const SIGNALS: &[(&[&str], &str)] = &[
    (
        &["SIGTERM", "SIGINT"],
        "Graceful stop: claim nothing more, release the leases of the jobs not running, let the running jobs finish for up to shutdown_grace, then stop those still running (SIGTERM to the job's process group, SIGKILL after its kill_grace; recorded killed), release this node's remaining leases and exit 0. A second SIGTERM or SIGINT during the stop stops the running jobs at once.",
    ),
    (
        &["SIGHUP"],
        "Reload (what cronlease reload and systemctl reload cronlease send): read the main file and the job files again. If anything is invalid, every error is logged and the old configuration stays in force. Otherwise new jobs start, removed jobs are no longer claimed (a running run finishes first) and changed jobs take their new definition from their next occurrence; settings that apply only after a restart are named in a warning.",
    ),
    (
        &["SIGUSR1"],
        "Step down (what cronlease step-down sends): release every lease (a running job's when its run ends), claim nothing for one lease margin, then claim each job given up only after the head start until another node holds it, so that another node takes over and keeps it. The daemon keeps running.",
    ),
];

/// Said after the signals: what `handle_signals` ignores, and how to reach
/// the daemon alone through systemd (the unit's processes include the
/// running jobs).
const SIGNALS_NOTE: &str = "SIGHUP and SIGUSR1 are ignored once a graceful stop has begun. Through systemd, signal the daemon alone: systemctl kill --kill-whom=main -s SIGUSR1 cronlease; without --kill-whom=main the running jobs get the signal too.";

/// The main page's SEE ALSO, after the command pages.
const MAIN_SEE_ALSO: &[&str] = &[
    "The documentation: /usr/share/doc/cronlease/README.md and /usr/share/doc/cronlease/docs/ (cli.md: the commands; configuration.md: the configuration and the job files; operations.md: installing, the systemd unit cronlease.service, running a cluster); in the release tarball, README.md and docs/.",
];

/// A command page's SEE ALSO, after the related pages.
const COMMAND_SEE_ALSO: &[&str] = &[
    "cronlease(1) lists the exit codes, the daemon's signals and its files.",
    "/usr/share/doc/cronlease/docs/cli.md describes every command in full (docs/cli.md in the release tarball).",
];

/// Every page, the main one first: `(file name, roff)`, such as
/// `("cronlease.1", ...)` and `("cronlease-run.1", ...)`.
pub fn pages() -> io::Result<Vec<(String, Vec<u8>)>> {
    // No `help` command: clap_mangen would list it as `cronlease-help(1)`,
    // a page of its own.
    let mut root = cronlease::cli::Cli::command().disable_help_subcommand(true);
    // Building names each subcommand as clap_mangen titles its page
    // (display name `cronlease-run`) and as it is typed in the synopsis
    // (bin name `cronlease run`).
    root.build();
    let source = format!(
        "{} {}",
        root.get_name(),
        root.get_version().unwrap_or_default()
    );
    let commands: Vec<&str> = visible_subcommands(&root).map(page_name).collect();
    let mut pages = vec![page(
        &root,
        &source,
        &daemon_sections(),
        &see_also(&commands, MAIN_SEE_ALSO),
    )?];
    for command in visible_subcommands(&root) {
        command_pages(command, &root, &source, &mut pages)?;
    }
    Ok(pages)
}

/// `cmd`'s page, then those of its own subcommands (none today; one would
/// be `cronlease-COMMAND-SUB(1)`, as clap_mangen names it in the
/// SUBCOMMANDS section of `cmd`'s page).
fn command_pages(
    cmd: &Command,
    parent: &Command,
    source: &str,
    pages: &mut Vec<(String, Vec<u8>)>,
) -> io::Result<()> {
    let mut related = vec![page_name(parent)];
    related.extend(visible_subcommands(cmd).map(page_name));
    pages.push(page(
        cmd,
        source,
        &Roff::new(),
        &see_also(&related, COMMAND_SEE_ALSO),
    )?);
    for sub in visible_subcommands(cmd) {
        command_pages(sub, cmd, source, pages)?;
    }
    Ok(())
}

/// The subcommands that get a page: clap_mangen lists those not hidden.
fn visible_subcommands(cmd: &Command) -> impl Iterator<Item = &Command> {
    cmd.get_subcommands().filter(|c| !c.is_hide_set())
}

/// The name of `cmd`'s page, as clap_mangen titles it and refers to it.
fn page_name(cmd: &Command) -> &str {
    cmd.get_display_name().unwrap_or_else(|| cmd.get_name())
}

/// One page: clap_mangen's sections for `cmd` in the order `Man::render`
/// writes them, with `middle` before VERSION and `see_also` last.
fn page(
    cmd: &Command,
    source: &str,
    middle: &Roff,
    see_also: &Roff,
) -> io::Result<(String, Vec<u8>)> {
    let man = Man::new(cmd.clone()).source(source);
    let mut page = Vec::new();
    man.render_title(&mut page)?;
    append(&mut page, |w| man.render_name_section(w))?;
    append(&mut page, |w| man.render_synopsis_section(w))?;
    append(&mut page, |w| man.render_description_section(w))?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        append(&mut page, |w| man.render_options_section(w))?;
    }
    if visible_subcommands(cmd).next().is_some() {
        append(&mut page, |w| man.render_subcommands_section(w))?;
    }
    if cmd.get_after_long_help().is_some() || cmd.get_after_help().is_some() {
        append(&mut page, |w| man.render_extra_section(w))?;
    }
    append(&mut page, |w| middle.to_writer(w))?;
    if cmd
        .get_version()
        .or_else(|| cmd.get_long_version())
        .is_some()
    {
        append(&mut page, |w| man.render_version_section(w))?;
    }
    if cmd.get_author().is_some() {
        append(&mut page, |w| man.render_authors_section(w))?;
    }
    append(&mut page, |w| see_also.to_writer(w))?;
    Ok((man.get_filename(), page))
}

/// Appends a section rendered on its own. Every rendering starts with the
/// same preamble (it defines the apostrophe string `\*(Aq`): the page
/// keeps the title's and drops the repeats.
fn append(
    page: &mut Vec<u8>,
    render: impl FnOnce(&mut Vec<u8>) -> io::Result<()>,
) -> io::Result<()> {
    let mut section = Vec::new();
    render(&mut section)?;
    let preamble = Roff::new().render();
    page.extend_from_slice(
        section
            .strip_prefix(preamble.as_bytes())
            .unwrap_or(&section[..]),
    );
    Ok(())
}

/// The main page's EXIT STATUS, SIGNALS and FILES.
fn daemon_sections() -> Roff {
    let mut roff = Roff::new();
    roff.control("SH", ["EXIT STATUS"]);
    roff.text([roman("Every command exits with one of:")]);
    for (code, meaning) in EXIT_CODES {
        roff.control("TP", []);
        roff.text([bold(code.to_string())]);
        roff.text([roman(*meaning)]);
    }
    roff.control("SH", ["SIGNALS"]);
    roff.text([roman("The daemon, cronlease run, acts on these signals:")]);
    for (names, effect) in SIGNALS {
        roff.control("TP", []);
        roff.text(list(names, ""));
        roff.text([roman(*effect)]);
    }
    roff.control("PP", []);
    roff.text([roman(SIGNALS_NOTE)]);
    roff.control("SH", ["FILES"]);
    for (path, what) in files() {
        roff.control("TP", []);
        roff.text([italic(path)]);
        roff.text([roman(what)]);
    }
    roff
}

/// The files the defaults name: the constants of src/config/mod.rs, and
/// the directory `load_jobs` (src/config/load.rs) reads the job files from
/// unless `jobs.dir` names another: `jobs.d` beside the main file.
fn files() -> [(String, &'static str); 4] {
    let config_dir = DEFAULT_CONFIG_PATH
        .rsplit_once('/')
        .map_or(".", |(dir, _)| dir);
    let sqlite = DEFAULT_STORE_URL
        .strip_prefix("sqlite://")
        .unwrap_or(DEFAULT_STORE_URL);
    [
        (
            DEFAULT_CONFIG_PATH.to_string(),
            "The main configuration, unless -c FILE or $CRONLEASE_CONFIG names another.",
        ),
        (
            format!("{config_dir}/jobs.d/*.toml"),
            "The job files ([[job]] tables), read with the main file; jobs.dir names another directory (relative to the main file's).",
        ),
        (
            DEFAULT_PID_FILE.to_string(),
            "The daemon's pid file unless pid_file names another: locked while the daemon runs; step-down, reload and drill find the daemon through it.",
        ),
        (
            sqlite.to_string(),
            "The SQLite store used when neither $CRONLEASE_STORE_URL nor store.url or store.urls names one.",
        ),
    ]
}

/// A SEE ALSO section: the pages in section 1, then a paragraph per note.
fn see_also(pages: &[&str], notes: &[&str]) -> Roff {
    let mut roff = Roff::new();
    roff.control("SH", ["SEE ALSO"]);
    roff.text(list(pages, "(1)"));
    for note in notes {
        roff.control("PP", []);
        roff.text([roman(*note)]);
    }
    roff
}

/// `names` in bold, each followed by `suffix`, separated by commas.
fn list(names: &[&str], suffix: &str) -> Vec<Inline> {
    let mut line = Vec::new();
    for name in names {
        if !line.is_empty() {
            line.push(roman(", "));
        }
        line.push(bold(*name));
        if !suffix.is_empty() {
            line.push(roman(suffix));
        }
    }
    line
}
