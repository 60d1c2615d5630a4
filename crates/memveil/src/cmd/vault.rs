//! `memveil vault`.

/// Flags of `memveil vault`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `memveil vault`.
pub fn run(_args: Args) -> anyhow::Result<u8> {
    anyhow::bail!("memveil vault is not built yet")
}
