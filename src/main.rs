//! The `cronlease` binary: parse the command line, hand over to the library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cronlease::cli::Cli::parse();
    cronlease::app::main(cli)
}
