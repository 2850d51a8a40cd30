//! `cronlease-guard`: the job guard the daemon starts (`cronlease-guard
//! __guard VERSION`, the daemon's version) when this executable is beside
//! it, as a small one of its own
//! ([`cronlease::guard::serve_small`]): it starts and reaps the runs and
//! kills them when the daemon dies, then executes `cronlease __guard
//! --gone` in its place to hand the daemon's work over. The guard of an
//! idle daemon only waits, and a small executable maps a fraction of the
//! pages the `cronlease` binary would (docs/benchmarks.md).

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    match (args.next(), args.next(), args.next()) {
        (Some(a), Some(version), None) if a == "__guard" => {
            cronlease::app::guard_small(&version.to_string_lossy())
        }
        _ => {
            eprintln!(
                "cronlease-guard: the daemon starts it (cronlease-guard __guard VERSION, its socket on standard input); it takes nothing else"
            );
            ExitCode::from(64)
        }
    }
}
