//! memveil's KMIP client: the subset of the OASIS Key Management
//! Interoperability Protocol (1.2) that fleet key management needs — Create,
//! Register, Get, Locate and Destroy of AES keys — over TLS with a client
//! certificate.
//!
//! - [`ttlv`]: the encoding, sans-IO, tested against the specification's
//!   examples and fuzzed (`fuzz/fuzz_targets/kmip_ttlv.rs`).
//! - [`msg`]: requests and responses of the operations above.
//! - [`Client`]: one TLS connection per operation; every response is read
//!   into secret memory (`memveil-secmem`), and key bytes leave it only as a
//!   [`memveil_secmem::SecretBox`], wiped on drop. Nothing here logs or
//!   prints key bytes (no `Debug` shows them).
//! - [`Config`]: the server's address and the certificate files, from flags
//!   or a small `key = "value"` file (`/etc/memveil/kmip.toml`).
//!
//! What it refuses to do: KMIP 2.0, asymmetric keys, server-side crypto
//! (Encrypt/Decrypt), batches, asynchronous operations; TLS without a
//! server certificate verified against the configured CA alone (never the
//! system's CAs); an OpenSSL older than 3.0, which cannot wipe the
//! plaintext in its record buffers (`SSL_OP_CLEANSE_PLAINTEXT`).
//!
//! What it cannot do: OpenSSL's record buffers hold each decrypted TLS
//! record in ordinary heap memory from its decryption until it is copied
//! into the secret buffer (then OpenSSL wipes it).
#![forbid(unsafe_code)]

pub mod client;
pub mod config;
pub mod msg;
pub mod testserver;
pub mod ttlv;

pub use client::{Client, KmipError};
pub use config::Config;
