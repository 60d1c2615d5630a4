//! `libmemveil_pkcs11.so`: a PKCS#11 (2.40) module over the memveil vault.
//!
//! Programs that reach keys through PKCS#11 (OpenSC's `pkcs11-tool`,
//! GnuTLS's `p11tool`, `p11-kit`, `python-pkcs11`, Java's SunPKCS11) load
//! this module; it is a client of the vault's control socket and
//! shared-memory lanes, not a key store of its own. AES keys are generated
//! or imported into the vault and every encryption, decryption and CMAC is
//! one lane request: no key, round key or MAC subkey ever enters the
//! calling process (imported key bytes go from the caller's template
//! straight to the socket).
//!
//! - One slot (id 0); its token is present while the vault answers at
//!   `$MEMVEIL_VAULT_SOCKET` (default `/run/memveil/vault.sock`), and holds
//!   the AES keys the vault lets this uid see (`SO_PEERCRED`).
//! - Objects: AES-128/256 secret keys, always sensitive and never
//!   extractable; token objects are vault keys named after their label and
//!   id, session objects vault keys destroyed with their session.
//! - Mechanisms: `CKM_AES_KEY_GEN`, `CKM_AES_ECB`, `CKM_AES_CBC`,
//!   `CKM_AES_CBC_PAD`, `CKM_AES_CTR`, `CKM_AES_GCM`, `CKM_AES_CMAC`,
//!   single- and multi-part; RSA, ECDSA, EdDSA and ECDH with key pairs in
//!   the vault; HMAC (SHA-1/2) with generic secrets in the vault;
//!   `C_GenerateRandom` from memveil's CTR_DRBG.
//! - In the calling process, since no secret is involved: digests,
//!   verification and RSA encryption with public key objects, data objects
//!   of session scope ([`public`], [`digest`], [`data`]).
//!
//! What it refuses: to return `CKA_VALUE` (`CKR_ATTRIBUTE_SENSITIVE`), to
//! create a key that is not sensitive or is extractable, wrapping, weak
//! algorithms and sizes (DES, RSA under 2048 bits, HMAC keys under 112
//! bits, MD5), and any other mechanism (`CKR_MECHANISM_INVALID`) or
//! function (`CKR_FUNCTION_NOT_SUPPORTED`); docs/pkcs11.md lists them.
//!
//! Layout: [`mech`] and [`core`] are safe Rust (`#![forbid(unsafe_code)]`);
//! `ffi` holds the C entry points, whose only `unsafe` is reading and
//! writing the caller's memory after checking every pointer and length.
#![deny(unsafe_op_in_unsafe_fn)]
#![allow(non_snake_case)]

pub mod asym;
pub mod core;
pub mod data;
pub mod digest;
pub mod ffi;
pub mod hmac;
pub mod mech;
pub mod object;
pub mod public;
