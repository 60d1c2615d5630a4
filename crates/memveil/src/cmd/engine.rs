//! `memveil engine`.

/// Flags of `memveil engine`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `memveil engine`.
pub fn run(_args: Args) -> anyhow::Result<u8> {
    anyhow::bail!("memveil engine is not built yet")
}
