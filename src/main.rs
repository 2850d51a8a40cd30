//! The `cronlease` binary: parse the command line, hand over to the library.

use std::process::ExitCode;

use clap::Parser;

/// mimalloc, not glibc's malloc: it hands freed memory back, so a daemon of
/// 20,000 jobs keeps its size across reloads (`benches/reload.rs`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = cronlease::cli::Cli::parse();
    cronlease::app::main(cli)
}
