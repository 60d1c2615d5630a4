//! `memveil rng`.

/// Flags of `memveil rng`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `memveil rng`.
pub fn run(_args: Args) -> anyhow::Result<u8> {
    anyhow::bail!("memveil rng is not built yet")
}
