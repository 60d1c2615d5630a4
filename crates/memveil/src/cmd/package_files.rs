//! `memveil package-files DIR` (hidden): the man pages (one per command,
//! `memveil-vault-serve.1`) and shell completions (bash, zsh, fish) made
//! from the command line's own definition, for `scripts/package.sh`.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap_complete::Shell;

/// Flags of `memveil package-files`.
#[derive(clap::Args)]
pub struct Args {
    /// Directory to write `man1/` and `completions/{bash,zsh,fish}/` into
    dir: PathBuf,
}

/// Writes the man pages and completions of `root` under `a.dir`.
///
/// # Errors
/// A file cannot be written.
pub fn run(a: &Args, mut root: clap::Command) -> anyhow::Result<u8> {
    root.build();
    let man = a.dir.join("man1");
    std::fs::create_dir_all(&man).with_context(|| format!("creating {}", man.display()))?;
    let mut pages = 0;
    write_pages(&root, "memveil", &man, &mut pages)?;
    for (shell, file) in [
        (Shell::Bash, "bash/memveil"),
        (Shell::Zsh, "zsh/_memveil"),
        (Shell::Fish, "fish/memveil.fish"),
    ] {
        let path = a.dir.join("completions").join(file);
        let mut buf = Vec::new();
        clap_complete::generate(shell, &mut root.clone(), "memveil", &mut buf);
        write(&path, &buf)?;
    }
    eprintln!(
        "memveil package-files: {pages} man pages and 3 completions in {}",
        a.dir.display()
    );
    Ok(0)
}

/// The page of `cmd` (named `name`: `memveil-vault-serve`) and its
/// subcommands' pages, depth first; hidden commands and `help` have none.
fn write_pages(cmd: &clap::Command, name: &str, dir: &Path, n: &mut usize) -> anyhow::Result<()> {
    let mut buf = Vec::new();
    clap_mangen::Man::new(cmd.clone().name(name.to_owned()))
        .render(&mut buf)
        .with_context(|| format!("rendering the man page of {name}"))?;
    write(&dir.join(format!("{name}.1")), &buf)?;
    *n += 1;
    for sub in cmd
        .get_subcommands()
        .filter(|s| s.get_name() != "help" && !s.is_hide_set())
    {
        write_pages(sub, &format!("{name}-{}", sub.get_name()), dir, n)?;
    }
    Ok(())
}

fn write(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}
