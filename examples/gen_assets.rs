//! Writes the man pages and shell completions, generated from the clap
//! definitions, into a directory (for the .deb and the tarball):
//! `cargo run --example gen_assets -- target/assets` writes
//! `target/assets/man/*.1` (examples/assets/man_pages.rs) and
//! `target/assets/completions/`.

use std::path::PathBuf;

use clap::CommandFactory;
use clap_complete::Shell;

#[path = "assets/man_pages.rs"]
mod man_pages;

fn main() -> std::io::Result<()> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "target/assets".into()),
    );
    // The packages take every page in man/: none may be left from a
    // command since removed or renamed.
    let man = dir.join("man");
    if man.exists() {
        std::fs::remove_dir_all(&man)?;
    }
    std::fs::create_dir_all(&man)?;
    std::fs::create_dir_all(dir.join("completions"))?;
    for (name, page) in man_pages::pages()? {
        std::fs::write(man.join(name), page)?;
    }
    let mut cmd = cronlease::cli::Cli::command();
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        clap_complete::generate_to(shell, &mut cmd, "cronlease", dir.join("completions"))?;
    }
    println!("wrote {}", dir.display());
    Ok(())
}
