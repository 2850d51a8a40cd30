//! The `cronlease` binary: parse the command line, hand over to the library.

use std::process::ExitCode;

use clap::Parser;

/// mimalloc, not glibc's malloc: it hands freed memory back, so a daemon of
/// 20,000 jobs keeps its size across reloads (`benches/reload.rs`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc 3's number for its purge delay option (the order of
/// `mi_option_e` in its `mimalloc.h`; the bindings name only older options).
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// mimalloc 3 keeps pages freed for 1 s by default and hands them back only
/// when the thread that freed them allocates again. Measured with 20,000
/// jobs (`benches/reload.rs`, release build): 106 MiB running and 160–216
/// MiB after each of ten reloads, swinging by −42 to +26 % from one reload
/// to the next; purging at once gives 60–62 MiB running and 67–80 MiB after
/// every reload (−8 to +6 % of the first), with no measurable CPU cost
/// (`benches/scale.rs`, 1,000 jobs). `MIMALLOC_PURGE_DELAY` in the
/// environment still wins.
#[allow(unsafe_code)]
fn tune_allocator() {
    // SAFETY: `mi_option_set_default` stores a number in mimalloc's option
    // table, for an option index it checks. It is not thread safe: it is
    // called first thing in `main`, before any other thread exists.
    unsafe {
        libmimalloc_sys::mi_option_set_default(PURGE_DELAY, 0);
    }
}

fn main() -> ExitCode {
    tune_allocator();
    // The job guard the daemon starts (`cronlease __guard`, nothing after
    // it) goes straight to its loop: the command line parser and its
    // tables would stay paged into a process that never needs them again.
    // `__guard --gone`: `cronlease-guard` handing a dead daemon's work on.
    let mut args = std::env::args_os().skip(1);
    if args.next().is_some_and(|a| a == "__guard") {
        match (args.next(), args.next()) {
            (None, _) => return cronlease::app::guard(),
            (Some(a), None) if a == "--gone" => return cronlease::app::guard_gone(),
            _ => {}
        }
    }
    let cli = cronlease::cli::Cli::parse();
    cronlease::app::main(cli)
}

#[cfg(test)]
mod tests {
    /// The option number is mimalloc 3's purge delay: read before any
    /// change, it holds that option's default (1,000 ms). A mimalloc whose
    /// table differs fails here.
    #[test]
    #[allow(unsafe_code)]
    fn the_option_number_names_mimalloc_3s_purge_delay() {
        if std::env::vars().any(|(k, _)| k.to_ascii_uppercase().starts_with("MIMALLOC_")) {
            return;
        }
        // SAFETY: reads mimalloc's option table.
        let purge = unsafe { libmimalloc_sys::mi_option_get(super::PURGE_DELAY) };
        assert_eq!(purge, 1000);
    }
}
