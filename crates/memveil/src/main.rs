//! `memveil`: the command-line front end. It parses flags, calls a library
//! crate and prints; errors become exit codes here and nowhere else.

mod cmd;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// memveil protects data in use on Linux hosts: a software multi-key memory
/// encryption engine, a key vault in secret memory, an entropy service and a
/// probe of what the host offers.
#[derive(Parser)]
#[command(name = "memveil", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// What memory protection this host really offers, with evidence.
    Probe(cmd::probe::Args),
    /// Entropy: read streams, run the FIPS 140-2 battery, serve EGD, feed the kernel.
    Rng(cmd::rng::Args),
    /// Key vault: serve keys from secret memory, manage keys, encrypt and decrypt.
    Vault(cmd::vault::Args),
    /// Host key table (TME-MK's KeyIDs), held by the vault: program, clear, status.
    #[command(long_about = cmd::key::ABOUT)]
    Key(cmd::key::Args),
    /// SSH agent whose keys live in the vault (ssh-add, ssh, ssh-keygen -Y sign).
    Agent(cmd::agent::Args),
    /// Encrypted disk: an aes-xts-plain64 image whose key stays in the vault, as a FUSE file and loop device.
    Disk(cmd::disk::Args),
    /// Find AES key schedules (or a byte pattern) in a process, core file or memory image.
    Keyfind(cmd::keyfind::Args),
    /// Run an unmodified program with its heap kept as ciphertext outside a plaintext window.
    Run(cmd::run::Args),
    /// Run the benchmark suite and write a report.
    Bench(cmd::bench::Args),
}

fn main() -> ExitCode {
    // The release profile unwinds (for the PKCS#11 module); this binary's
    // daemons abort on a panic, as with panic = "abort".
    memveil_sys::process::abort_on_panic();
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Probe(a) => cmd::probe::run(a),
        Command::Rng(a) => cmd::rng::run(a),
        Command::Vault(a) => cmd::vault::run(a),
        Command::Key(a) => cmd::key::run(a),
        Command::Agent(a) => cmd::agent::run(a),
        Command::Disk(a) => cmd::disk::run(a),
        Command::Keyfind(a) => cmd::keyfind::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Bench(a) => cmd::bench::run(a),
    };
    match r {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("memveil: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
