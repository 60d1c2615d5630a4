//! `memveil agent`: an SSH agent over vault keys (memveil-agent).

use std::path::PathBuf;

use anyhow::Context as _;
use memveil_secmem::{Level, Policy};

/// `memveil agent --help`, after the options.
const AFTER_LONG_HELP: &str = "\
Prints `SSH_AUTH_SOCK=PATH; export SSH_AUTH_SOCK;` once the socket listens, then
serves in the foreground (run it in the background or as a service, and export
SSH_AUTH_SOCK=PATH in your shell).

Keys: the vault's RSA, ECDSA and Ed25519 keys of this uid named PREFIX*; ssh-add
puts keys into the vault (named PREFIX + comment) and they never stay in the
agent; ssh-add -d/-D destroy them in the vault. Only the agent's uid and root may
connect.

Examples:
  memveil agent --socket ~/.ssh/memveil-agent.sock &
  export SSH_AUTH_SOCK=~/.ssh/memveil-agent.sock
  ssh-add ~/.ssh/id_ed25519                  # into the vault, wiped from the agent
  ssh-add -l                                 # the vault's ssh.* keys of this uid
  memveil vault create ssh.work --kind p256  # a key made in the vault is listed too
  ssh-keygen -Y sign -f key.pub -n file data # signs through the agent
  memveil agent --socket a.sock --persistent # added keys sealed to the vault's --state

See docs/agent.md.";

/// Flags of `memveil agent`.
#[derive(clap::Args)]
#[command(after_long_help = AFTER_LONG_HELP)]
pub struct Args {
    /// The agent's socket (mode 0600; only a stale socket there is replaced)
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// The vault's socket
    ///
    /// The vault's socket (default: $MEMVEIL_VAULT_SOCKET, else
    /// /run/memveil/vault.sock).
    #[arg(long, value_name = "SOCKET", verbatim_doc_comment)]
    vault: Option<PathBuf>,
    /// Name prefix of the agent's keys in the vault
    #[arg(long, default_value = "ssh.")]
    prefix: String,
    /// Seal keys added with ssh-add into the vault's keystore
    ///
    /// Seal keys added with ssh-add into the vault's keystore, so they come
    /// back when the vault restarts (the vault needs --state).
    #[arg(long, verbatim_doc_comment)]
    persistent: bool,
    /// Accept weaker memory for added keys' receive buffer (locked)
    ///
    /// Accept "locked" memory (mlock only) for the receive buffer of keys
    /// added with ssh-add when memfd_secret is unavailable.
    #[arg(long, value_name = "LEVEL", verbatim_doc_comment)]
    allow_level: Option<String>,
    /// Install no seccomp allowlist (debugging only; logged loudly)
    #[arg(long)]
    no_seccomp: bool,
    /// Also offer keys other users granted to this one
    ///
    /// Also offer the PREFIX* keys other users granted to this uid (by
    /// default only its own keys: a grant needs no consent, so another user
    /// could fill ssh-add -l or have you log in with a key it controls).
    #[arg(long, verbatim_doc_comment)]
    offer_granted: bool,
    /// Connections served at once
    #[arg(long, value_name = "N", default_value_t = 16,
          value_parser = clap::value_parser!(u16).range(1..))]
    max_connections: u16,
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
    let mut cfg = memveil_agent::Config::new(
        a.socket.clone(),
        a.vault.unwrap_or_else(memveil_vault::cli::default_socket),
    );
    cfg.prefix = a.prefix;
    cfg.persistent = a.persistent;
    cfg.policy = policy;
    cfg.offer_granted = a.offer_granted;
    cfg.max_connections = usize::from(a.max_connections);
    let agent = memveil_agent::Agent::bind(cfg).context("starting the agent")?;
    super::lock_down("memveil-agent", memveil_agent::seccomp::AGENT, a.no_seccomp)?;
    println!(
        "SSH_AUTH_SOCK={}; export SSH_AUTH_SOCK;",
        agent.socket().display()
    );
    use std::io::Write as _;
    std::io::stdout().flush()?;
    agent.run();
    Ok(0)
}
