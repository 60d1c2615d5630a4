//! `memveil agent`: an SSH agent over vault keys (memveil-agent).

use std::path::PathBuf;

use anyhow::Context as _;
use memveil_secmem::{Level, Policy};

/// Flags of `memveil agent`.
#[derive(clap::Args)]
#[command(
    after_help = "Prints `SSH_AUTH_SOCK=PATH; export SSH_AUTH_SOCK;` once the socket listens, then serves in the foreground (run it in the background or as a service, and export SSH_AUTH_SOCK=PATH in your shell).\n\
Keys: the vault's RSA, ECDSA and Ed25519 keys of this uid named PREFIX*; ssh-add puts keys into the vault (named PREFIX + comment) and they never stay in the agent; ssh-add -d/-D destroy them in the vault. See docs/agent.md."
)]
pub struct Args {
    /// The agent's socket (created mode 0600; a stale one is replaced).
    #[arg(long)]
    socket: PathBuf,
    /// The vault's socket (default: $MEMVEIL_VAULT_SOCKET, else /run/memveil/vault.sock).
    #[arg(long)]
    vault: Option<PathBuf>,
    /// Which vault keys are the agent's: names starting with this.
    #[arg(long, default_value = "ssh.")]
    prefix: String,
    /// Seal keys added with ssh-add into the vault's keystore (the vault needs --state).
    #[arg(long)]
    persistent: bool,
    /// Accept "locked" memory (mlock only) for the receive buffer of added keys when memfd_secret is unavailable.
    #[arg(long, value_name = "LEVEL")]
    allow_level: Option<String>,
}

/// Runs `memveil agent`.
///
/// # Errors
/// The socket or the vault cannot be reached; the message says why.
pub fn run(a: Args) -> anyhow::Result<u8> {
    let policy = match a.allow_level.as_deref() {
        None => Policy::secret_only(),
        Some(l) => Policy::allow(l.parse::<Level>().map_err(|e| anyhow::anyhow!("{e}"))?),
    };
    anyhow::ensure!(
        memveil_vault::proto::valid_name(&format!("{}x", a.prefix)) && a.prefix.len() <= 32,
        "--prefix: up to 32 characters of [A-Za-z0-9._-]"
    );
    let cfg = memveil_agent::Config {
        socket: a.socket.clone(),
        vault: a.vault.unwrap_or_else(memveil_vault::cli::default_socket),
        prefix: a.prefix,
        persistent: a.persistent,
        policy,
    };
    let agent = memveil_agent::Agent::bind(cfg).context("starting the agent")?;
    println!(
        "SSH_AUTH_SOCK={}; export SSH_AUTH_SOCK;",
        agent.socket().display()
    );
    use std::io::Write as _;
    std::io::stdout().flush()?;
    agent.run();
    Ok(0)
}
