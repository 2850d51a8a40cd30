//! Whether what a job runs is there when the configuration is read: its
//! program and its working directory. Missing, each is a warning, not an
//! error (the program may be installed after the configuration, the
//! directory mounted later); `cronlease check --strict` refuses them. The
//! run itself, if they are still missing, is `not_started` with an output
//! naming which one ([`crate::launch::Launch::command`]).

use super::*;

/// Words the shell runs itself: never looked for in `PATH`.
const SHELL_WORDS: &[&str] = &[
    ".", ":", "[", "alias", "bg", "break", "case", "cd", "command", "continue", "do", "done",
    "echo", "elif", "else", "esac", "eval", "exec", "exit", "export", "false", "fc", "fg", "fi",
    "for", "getopts", "hash", "if", "jobs", "kill", "local", "printf", "pwd", "read", "readonly",
    "return", "set", "shift", "test", "then", "times", "trap", "true", "type", "ulimit", "umask",
    "unalias", "unset", "until", "wait", "while", "{", "}", "!",
];

/// Warnings for `rj`'s program and working directory, if either is not
/// there; `command` and `working_dir` as loaded.
pub(super) fn check_present(
    src: &Source,
    rj: &RawJob,
    command: &Command,
    working_dir: Option<&Path>,
    env: &BTreeMap<String, String>,
    warnings: &mut Vec<String>,
) {
    let job = rj.name.get_ref();
    let at = |span: Range<usize>| {
        let (line, col) = src.line_col(span.start);
        format!("{}:{line}:{col}", src.origin)
    };
    if let (Some(dir), Some(raw)) = (working_dir, &rj.working_dir)
        && std::fs::metadata(dir).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
    {
        warnings.push(format!(
            "{}: job {job:?}: working_dir {} does not exist: every run will be not_started until it does",
            at(raw.span()),
            dir.display()
        ));
        // The program is looked for from there: nothing more to say.
        return;
    }
    let program = match command {
        Command::Argv(argv) => argv.first().cloned(),
        // The shell's first word, when it is a plain program name or path.
        Command::Shell(line) => line
            .split_whitespace()
            .next()
            .filter(|w| {
                !w.contains('=')
                    && !SHELL_WORDS.contains(w)
                    && w.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "/._-+".contains(c))
            })
            .map(str::to_string),
    };
    let Some(program) = program else {
        return;
    };
    let launch = crate::launch::Launch {
        program,
        args: Vec::new(),
        env: env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        cwd: working_dir.map(Path::to_path_buf),
    };
    if let Err(why) = launch.program_path() {
        let outcome = match command {
            Command::Argv(_) => "not_started",
            // The shell starts and says "not found": exit 127.
            Command::Shell(_) => "failed (exit 127)",
        };
        warnings.push(format!(
            "{}: job {job:?}: {why}: every run will be {outcome} until it is installed",
            at(rj.command.span())
        ));
    }
}
