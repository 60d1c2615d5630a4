//! The memveil key vault: AES keys that live only in `memfd_secret` memory,
//! served to local clients over a Unix control socket and shared-memory
//! request rings.
//!
//! - [`server`]: the daemon. Keys, their schedules, IVs/counters in flight
//!   and the stacks of every thread that touches them live in secret memory;
//!   the process is not dumpable and writes no core file. It refuses to
//!   start without `memfd_secret` unless the operator accepts the `locked`
//!   level explicitly.
//! - [`proto`]: the sans-IO control codec; [`ring`]: the lane layout and the
//!   bounds checks that keep every data request inside the buffers its client
//!   registered.
//! - [`client`]: the client library.
//! - [`keystore`]: persistent keys sealed with AES-256-GCM under a KEK from
//!   a passphrase (Argon2id) or a key file, written atomically.
//!
//! What the vault refuses to do: export a key (no verb or reply carries key
//! bytes; import is one-way; the one reply with key material is a host
//! KeyID's page key, derived from the KeyID's key and given only to a uid
//! that may program KeyIDs, for `memveil run --keyid`), read or write outside a client's registered
//! buffers, map a shared area that its client could shrink, or degrade its
//! protection level silently.
//!
//! The crate has no `unsafe`: the system calls it needs (peer credentials,
//! descriptor passing, shared mappings, futexes, threads on caller-provided
//! stacks) are in `memveil-sys`.
#![forbid(unsafe_code)]

pub mod backup;
#[cfg(feature = "cli")]
pub mod cli;
pub mod client;
pub mod cmac;
mod derive;
pub mod gcm;
pub mod keyfile;
mod keys;
pub mod keystore;
pub mod limits;
pub mod proto;
pub mod ring;
pub mod seccomp;
pub mod server;
mod tenants;

pub use client::Client;
pub use server::{Config, Server, VaultError};
