//! `memveil-vault`: the same verbs as `memveil vault`, as a stand-alone
//! binary (tests start the daemon from it).
#![forbid(unsafe_code)]

use clap::Parser as _;

/// The memveil key vault.
#[derive(clap::Parser)]
#[command(name = "memveil-vault", version)]
struct Cli {
    #[command(flatten)]
    args: memveil_vault::cli::Args,
}

fn main() -> std::process::ExitCode {
    memveil_sys::process::abort_on_panic();
    let cli = Cli::parse();
    match memveil_vault::cli::run(cli.args) {
        Ok(code) => std::process::ExitCode::from(code),
        Err(e) => {
            eprintln!("memveil-vault: error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
