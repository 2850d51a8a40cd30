//! Writes the man page and shell completions, generated from the clap
//! definitions, into a directory (for the .deb):
//! `cargo run --example gen_assets -- target/assets`.

use std::path::PathBuf;

use clap::CommandFactory;
use clap_complete::Shell;

fn main() -> std::io::Result<()> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "target/assets".into()),
    );
    std::fs::create_dir_all(dir.join("completions"))?;
    let mut cmd = cronlease::cli::Cli::command();
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd.clone()).render(&mut page)?;
    std::fs::write(dir.join("cronlease.1"), page)?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        clap_complete::generate_to(shell, &mut cmd, "cronlease", dir.join("completions"))?;
    }
    println!("wrote {}", dir.display());
    Ok(())
}
