//! `memveil probe`.

/// Flags of `memveil probe`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `memveil probe`.
pub fn run(_args: Args) -> anyhow::Result<u8> {
    anyhow::bail!("memveil probe is not built yet")
}
