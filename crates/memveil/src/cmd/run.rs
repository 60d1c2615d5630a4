//! `memveil run`.

/// Flags of `memveil run`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `memveil run`.
pub fn run(_args: Args) -> anyhow::Result<u8> {
    anyhow::bail!("memveil run is not built yet")
}
