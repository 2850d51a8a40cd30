//! The upgrade drill's "next release" (tests/it/hosts.rs `upgrade`): the
//! `cronlease` binary that knows one PostgreSQL migration more than this
//! release (a column added, `tests/upgrade/postgres_next.sql`). `.ci/deb
//! next` packages it as version VERSION+drill1, which dpkg orders after
//! VERSION. A test build (`failpoints`), never a release; it is the debug
//! build the tests already made, so the drill costs no build of its own.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    cronlease::store::sql::be_the_upgrade_drills_next_release();
    let cli = cronlease::cli::Cli::parse();
    cronlease::app::main(cli)
}
