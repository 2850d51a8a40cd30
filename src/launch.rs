//! A job's process as it is to be started ([`Launch`]): program,
//! arguments, environment, working directory. The daemon builds it
//! ([`crate::exec`]); the job guard ([`crate::guard`]) or, without a guard,
//! the daemon starts it. Both depend on this room and not on each other.
//! `__run-as` ([`run_as`]) takes a job's user and groups and executes the
//! command in place.

use std::process::Stdio;

/// Environment variables of the daemon that a job must not inherit.
const WITHHELD_ENV: &[&str] = &[
    "CRONLEASE_STORE_URL",
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
    // How the guard logs (crate::telemetry::guard_env), not the job's.
    "CRONLEASE_LOG_FORMAT",
    "CRONLEASE_LOG_LEVEL",
    "CRONLEASE_LOG_NODE",
];

/// This process's environment less [`WITHHELD_ENV`], read once: a thousand
/// starts at one instant need not copy and sort it a thousand times.
fn inherited_env() -> &'static [(std::ffi::OsString, std::ffi::OsString)] {
    static ENV: std::sync::OnceLock<Vec<(std::ffi::OsString, std::ffi::OsString)>> =
        std::sync::OnceLock::new();
    ENV.get_or_init(|| {
        std::env::vars_os()
            .filter(|(k, _)| !WITHHELD_ENV.iter().any(|w| k == w))
            .collect()
    })
}

/// A job's process as it is to be started: program, arguments, the
/// variables set on top of the daemon's environment (less
/// [`WITHHELD_ENV`]), and the working directory. The daemon builds it; the
/// job guard ([`crate::guard`]) starts it, or the daemon itself when the
/// guard is gone.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Launch {
    pub program: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: Option<std::path::PathBuf>,
}

impl Launch {
    /// The process to start, stdin `/dev/null`, in a new process group;
    /// stdout and stderr are the caller's to set. Fails for a program
    /// found nowhere in `PATH` ([`Launch::program_path`]) and for a working
    /// directory that is not there.
    pub fn command(&self) -> Result<std::process::Command, String> {
        // Else the spawn's "No such file or directory" would not say which
        // of the program and the directory is missing.
        if let Some(dir) = &self.cwd
            && !dir.is_dir()
        {
            return Err(format!(
                "cannot change to the working directory {} (working_dir): no such directory",
                dir.display()
            ));
        }
        let mut cmd = std::process::Command::new(self.program_path()?);
        std::os::unix::process::CommandExt::arg0(&mut cmd, &self.program);
        cmd.args(&self.args)
            .env_clear()
            .envs(inherited_env().iter().map(|(k, v)| (k, v)))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        if let Some(dir) = &self.cwd {
            cmd.current_dir(dir);
        }
        Ok(cmd)
    }

    /// The program as a path: a name without `/` is looked up in the `PATH`
    /// the process gets (the job's `env`, else the daemon's), as `execvp`
    /// does. With a path std starts the process with `posix_spawn`, which
    /// reports a failed `exec` without waiting for the child itself; its
    /// fork-and-exec way (taken for a bare name once the environment is
    /// replaced) waits for it and panics when the guard's reaper, which
    /// waits for any child, took it first.
    pub(crate) fn program_path(&self) -> Result<std::path::PathBuf, String> {
        if self.program.contains('/') {
            // Else the spawn's "No such file or directory" would not say
            // that it is the program which is missing. A relative path is
            // looked for in the working directory too: which one the
            // spawn takes is not settled.
            let path = std::path::PathBuf::from(&self.program);
            let missing = |p: &std::path::Path| {
                std::fs::metadata(p).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
            };
            let in_cwd = self.cwd.as_ref().map(|cwd| cwd.join(&path));
            if missing(&path) && in_cwd.as_deref().is_none_or(missing) {
                return Err(format!(
                    "{}: no such file (the command's program)",
                    self.program
                ));
            }
            return Ok(path);
        }
        let path = match self.env.iter().rev().find(|(k, _)| k == "PATH") {
            Some((_, v)) => std::ffi::OsString::from(v),
            None => inherited_env()
                .iter()
                .find(|(k, _)| k == "PATH")
                .map_or_else(|| "/usr/local/bin:/usr/bin:/bin".into(), |(_, v)| v.clone()),
        };
        let executable = |p: &std::path::Path| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        };
        std::env::split_paths(&path)
            .map(|dir| match (&self.cwd, dir.is_relative()) {
                (Some(cwd), true) => cwd.join(dir),
                _ => dir,
            })
            .map(|dir| dir.join(&self.program))
            .find(|p| executable(p))
            .ok_or_else(|| format!("{}: not found in PATH", self.program))
    }
}

/// The program (and its first arguments) that starts a run in its cgroup,
/// as its user, with its limits ([`run_as`]): `cronlease-run-as` beside
/// this executable (the package's /usr/bin), a small one, else this
/// binary's `__run-as` (`/proc/self/exe`: after a package upgrade
/// `current_exe()` names the new binary, or nothing). Looked for once.
/// Measured on a host: 100 starts through `cronlease __run-as` took 524 ms
/// of one CPU, 409 ms of it in the kernel loading the 21 MB binary.
pub fn starter() -> (String, Vec<String>) {
    static STARTER: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let found = STARTER.get_or_init(|| {
        beside_this("cronlease-run-as").map(|path| path.to_string_lossy().into_owned())
    });
    match found {
        Some(path) => (path.clone(), Vec::new()),
        None => ("/proc/self/exe".to_string(), vec!["__run-as".to_string()]),
    }
}

/// The executable file `name` in this executable's directory, if there is
/// one (the package's small helpers: `cronlease-run-as`, `cronlease-guard`).
pub fn beside_this(name: &str) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::current_exe().ok()?.parent()?.join(name);
    let runnable =
        std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    runnable.then_some(path)
}

/// `cronlease __run-as [--cgroup DIR] [--user UID:GID:USER] [--nice N]
/// [--open-files N] -- PROGRAM ARGS...`: enters the run's cgroup (while it
/// is still the daemon's user, whose the cgroup is), sets the priority and
/// the open files limit, then
/// takes the user's supplementary groups (`initgroups`, or only GID when
/// USER is empty), GID and UID, and executes PROGRAM in place. Exits 127
/// when any step fails, as a shell does for a command it cannot run.
pub fn run_as(
    cgroup: Option<&std::path::Path>,
    user: Option<&str>,
    nice: Option<i32>,
    open_files: Option<u64>,
    command: &[std::ffi::OsString],
) -> std::process::ExitCode {
    use nix::unistd::{Gid, Uid};
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        eprintln!("cronlease: cannot run the job: {what}: {e}");
        std::process::ExitCode::from(127)
    };
    if let Some(dir) = cgroup
        && let Err(e) = crate::cgroup::enter(dir)
    {
        return fail("entering its cgroup", &e);
    }
    if let Some(n) = nice
        && let Err(e) = rustix::process::setpriority_process(None, n)
    {
        return fail(&format!("setting limits.nice = {n}"), &e);
    }
    if let Some(n) = open_files {
        use nix::sys::resource::{Resource, setrlimit};
        if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, n, n) {
            return fail(&format!("setting limits.open_files = {n}"), &e);
        }
    }
    if let Some(user) = user {
        let mut parts = user.splitn(3, ':');
        let (uid, gid, name) = match (
            parts.next().and_then(|u| u.parse::<u32>().ok()),
            parts.next().and_then(|g| g.parse::<u32>().ok()),
            parts.next(),
        ) {
            (Some(u), Some(g), Some(n)) => (u, g, n),
            _ => return fail("--user", &"expected UID:GID:NAME"),
        };
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            eprintln!("cronlease: cannot run the job as uid {uid} gid {gid}: {what}: {e}");
            std::process::ExitCode::from(127)
        };
        let gid_ = Gid::from_raw(gid);
        let groups = if name.is_empty() {
            nix::unistd::setgroups(&[gid_])
        } else {
            match CString::new(name) {
                Ok(name) => nix::unistd::initgroups(&name, gid_),
                Err(e) => return fail("user name", &e),
            }
        };
        if let Err(e) = groups {
            return fail("setting the supplementary groups", &e);
        }
        if let Err(e) = nix::unistd::setgid(gid_) {
            return fail("setgid", &e);
        }
        if let Err(e) = nix::unistd::setuid(Uid::from_raw(uid)) {
            return fail("setuid", &e);
        }
    }
    let argv: Result<Vec<CString>, _> =
        command.iter().map(|a| CString::new(a.as_bytes())).collect();
    let argv = match argv {
        Ok(argv) if !argv.is_empty() => argv,
        Ok(_) => return fail("command", &"empty"),
        Err(e) => return fail("command", &e),
    };
    match nix::unistd::execvp(&argv[0], &argv) {
        Ok(never) => match never {},
        Err(e) => fail(&format!("executing {:?}", argv[0]), &e),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn launch(program: &str, cwd: Option<&str>) -> Launch {
        Launch {
            program: program.into(),
            args: Vec::new(),
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            cwd: cwd.map(Into::into),
        }
    }

    /// A run that cannot start says which of its program and its working
    /// directory is missing (before: "No such file or directory" for both).
    #[test]
    fn a_start_that_cannot_be_made_names_what_is_missing() {
        let err = |l: Launch| l.command().err().unwrap_or_default();
        assert!(
            err(launch("/no/such/program", None)).contains("/no/such/program: no such file"),
            "{}",
            err(launch("/no/such/program", None))
        );
        assert!(
            err(launch("no-such-program-x", None)).contains("no-such-program-x: not found in PATH")
        );
        let dir = err(launch("/bin/sh", Some("/no/such/dir")));
        assert!(
            dir.contains("working directory /no/such/dir (working_dir): no such directory"),
            "{dir}"
        );
        // A relative path is found in the working directory.
        assert!(launch("./sh", Some("/bin")).command().is_ok());
        assert!(launch("/bin/sh", Some("/")).command().is_ok());
        assert!(launch("sh", None).command().is_ok());
    }
}
