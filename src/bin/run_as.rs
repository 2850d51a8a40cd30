//! `cronlease-run-as`: what `cronlease __run-as` does (enter a run's
//! cgroup, set its priority and open files limit, become its user, execute
//! its command; [`cronlease::launch::run_as`]), as a small executable of
//! its own. Every run of the process runner with a cgroup of its own, a
//! `user` or those limits starts through it: the `cronlease` binary costs
//! about 4 ms of kernel time to execute (its 57,000 relocations, 1.4 MB of
//! pages written at load), this one a fraction, and 100 runs due at one
//! instant started 440 ms later through the big one (docs/benchmarks.md).
//!
//! Arguments: `[--cgroup=DIR] [--user=UID:GID:NAME] [--nice=N]
//! [--open-files=N] -- PROGRAM ARGS...`, each option in its `--key=value`
//! form; anything else exits 127 saying what, as a shell does for a
//! command it cannot run.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::process::ExitCode;

fn main() -> ExitCode {
    match parse(std::env::args_os().skip(1)) {
        Ok(a) => cronlease::launch::run_as(
            a.cgroup.as_deref(),
            a.user.as_deref(),
            a.nice,
            a.open_files,
            &a.command,
        ),
        Err(e) => {
            eprintln!("cronlease-run-as: {e}");
            ExitCode::from(127)
        }
    }
}

#[derive(Debug, Default, PartialEq)]
struct Args {
    cgroup: Option<std::path::PathBuf>,
    user: Option<String>,
    nice: Option<i32>,
    open_files: Option<u64>,
    command: Vec<OsString>,
}

fn parse(mut args: impl Iterator<Item = OsString>) -> Result<Args, String> {
    let mut a = Args::default();
    for arg in args.by_ref() {
        if arg == "--" {
            a.command = args.collect();
            if a.command.is_empty() {
                return Err("no command after --".into());
            }
            return Ok(a);
        }
        let text = std::str::from_utf8(arg.as_bytes())
            .map_err(|_| format!("an option that is not UTF-8: {arg:?}"))?;
        let (key, value) = text
            .split_once('=')
            .ok_or_else(|| format!("expected --key=value or --, got {text:?}"))?;
        let number = |what: &str| format!("{key}: not {what}: {value:?}");
        match key {
            "--cgroup" => a.cgroup = Some(value.into()),
            "--user" => a.user = Some(value.into()),
            "--nice" => a.nice = Some(value.parse().map_err(|_| number("a priority"))?),
            "--open-files" => a.open_files = Some(value.parse().map_err(|_| number("a count"))?),
            _ => return Err(format!("unknown option {key}")),
        }
    }
    Err("no -- before the command".into())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn args(v: &[&str]) -> impl Iterator<Item = OsString> {
        v.iter().map(OsString::from).collect::<Vec<_>>().into_iter()
    }

    #[test]
    fn options_then_the_command() {
        let a = parse(args(&[
            "--cgroup=/sys/fs/cgroup/x/run-a-1",
            "--user=1000:1000:ops",
            "--nice=-5",
            "--open-files=64",
            "--",
            "sh",
            "-c",
            "--nice=1",
        ]))
        .unwrap();
        assert_eq!(
            a,
            Args {
                cgroup: Some("/sys/fs/cgroup/x/run-a-1".into()),
                user: Some("1000:1000:ops".into()),
                nice: Some(-5),
                open_files: Some(64),
                command: vec!["sh".into(), "-c".into(), "--nice=1".into()],
            }
        );
    }

    #[test]
    fn what_it_refuses() {
        for (bad, says) in [
            (&["sh"][..], "expected --key=value"),
            (&["--nice=x", "--", "sh"][..], "--nice: not a priority"),
            (
                &["--open-files=-1", "--", "sh"][..],
                "--open-files: not a count",
            ),
            (&["--color=1", "--", "sh"][..], "unknown option --color"),
            (&["--nice=1"][..], "no -- before"),
            (&["--"][..], "no command"),
        ] {
            let e = parse(args(bad)).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
