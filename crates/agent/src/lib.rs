//! `memveil agent`: an SSH agent whose keys live in the vault.
//!
//! It speaks the ssh-agent protocol (draft-ietf-sshm-ssh-agent / RFC 9987)
//! on a Unix socket (`SSH_AUTH_SOCK`): `ssh-add -l` lists the vault's
//! asymmetric keys of this uid named with its prefix (`ssh.`); a key added
//! with `ssh-add` is read into secret memory, imported into the vault and
//! wiped, so the agent never keeps it; signatures (`rsa-sha2-256`,
//! `rsa-sha2-512`, `ssh-rsa`, ECDSA P-256/P-384, Ed25519) are vault
//! requests; `ssh-add -d`/`-D` destroy the keys in the vault; `ssh-add
//! -x`/`-X` lock and unlock.
//!
//! - [`proto`]: the sans-IO message codec (fuzzed: `agent_proto`).
//! - [`server`]: the socket, its access rule (the agent's own uid and
//!   root, as ssh-agent), the vault connection of each client, a limit on
//!   connections served at once.
//! - [`lock`]: `ssh-add -x`/`-X`: the passphrase read into secret memory,
//!   stored as Argon2id (the keystore's KDF), a growing delay after each
//!   wrong guess (fuzzed: `agent_lock`).
//!
//! What it refuses: key constraints (lifetime, confirmation, destination:
//! the key would outlive them in the vault), smartcard and extension
//! requests, clients of other uids; keys other uids granted to this one
//! (unless `--offer-granted`); a socket path holding anything but a stale
//! socket. The crate has no `unsafe`.
#![forbid(unsafe_code)]

pub mod lock;
pub mod proto;
pub mod seccomp;
pub mod server;

pub use server::{Agent, Config};
