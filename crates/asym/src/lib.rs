//! Asymmetric keys for the memveil vault: RSA 2048/3072/4096, ECDSA over
//! P-256 and P-384, Ed25519, and ECDH, on aws-lc — the one place that names
//! the asymmetric backend, as `memveil-cipher` is for AES.
//!
//! - [`PrivateKey`]: generated inside the process or built from private
//!   components ([`components`], the vault's import format); signs (RSA
//!   PKCS#1 v1.5, PSS over a digest, raw RSA, ECDSA over a digest, Ed25519),
//!   decrypts (RSA OAEP, PKCS#1 v1.5 with implicit rejection, raw RSA) and
//!   derives ECDH shared secrets. Public parts come out through
//!   [`PrivateKey::public`]; private parts only as components, for the
//!   vault's sealed keystore.
//! - [`use_secret_heap`]: routes every allocation aws-lc makes in this
//!   process (the key's BIGNUMs, Montgomery contexts, blinding values, the
//!   temporaries of each operation, its per-thread DRBG state) into a
//!   `memfd_secret` heap. The vault calls it at start; a process that does
//!   not leaves aws-lc on the ordinary heap (what the proofs' positive
//!   control relies on).
//! - [`hash`]: SHA-1/SHA-2 digests and the DigestInfo prefixes of PKCS#1,
//!   for clients that hash before they sign; HMAC with a constant-time
//!   check, for the vault's generic secret keys.
//! - [`PublicKey`]: verification, RSA encryption and recovery from a public
//!   half ([`Public`]), for clients that hold only that.
//!
//! What aws-lc keeps on the stack of the thread that runs an operation is
//! not all wiped by it (an ECDSA signature leaves its nonce and the private
//! scalar there, ECDH the shared secret): callers on ordinary stacks scrub afterwards
//! (`memveil_secmem::scrub_stack`); the vault runs every operation on
//! threads whose stacks are in secret memory (`tests/stack_hygiene.rs`
//! shows both).
//!
//! What it refuses: the Rust `rsa` crate (RUSTSEC-2023-0071, the Marvin
//! timing attack) is not used; PKCS#1 v1.5 decryption never reports a
//! padding failure (implicit rejection, [`implicit`]); keys of other sizes
//! or curves; exporting a private key in any form but components.
#![deny(unsafe_op_in_unsafe_fn)]

mod backend;
pub mod components;
pub mod hash;
mod heap;
pub mod implicit;
pub mod public;

pub use backend::{DecryptScheme, PrivateKey, SignScheme};
pub use hash::Hash;
pub use heap::{heap_reserve, heap_stats, seal_heap, use_secret_heap, HeapStats};
pub use public::{EncryptScheme, PublicKey, VerifyScheme};

/// The key types the vault holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// RSA with a 2048-bit modulus (e = 65537 when generated).
    Rsa2048,
    /// RSA, 3072 bits.
    Rsa3072,
    /// RSA, 4096 bits.
    Rsa4096,
    /// ECDSA/ECDH over NIST P-256 (secp256r1).
    P256,
    /// ECDSA/ECDH over NIST P-384 (secp384r1).
    P384,
    /// Ed25519 (RFC 8032, pure).
    Ed25519,
}

impl Algorithm {
    /// RSA modulus bits, or `None`.
    #[must_use]
    pub fn rsa_bits(self) -> Option<u32> {
        match self {
            Algorithm::Rsa2048 => Some(2048),
            Algorithm::Rsa3072 => Some(3072),
            Algorithm::Rsa4096 => Some(4096),
            _ => None,
        }
    }

    /// The curve of an EC key, or `None`.
    #[must_use]
    pub fn curve(self) -> Option<Curve> {
        match self {
            Algorithm::P256 => Some(Curve::P256),
            Algorithm::P384 => Some(Curve::P384),
            _ => None,
        }
    }

    /// Bytes of the longest output of any operation (an RSA signature or
    /// block, an ECDSA `r‖s`, an Ed25519 signature).
    #[must_use]
    pub fn max_output(self) -> usize {
        match self {
            Algorithm::Rsa2048 => 256,
            Algorithm::Rsa3072 => 384,
            Algorithm::Rsa4096 => 512,
            Algorithm::P256 => 64,
            Algorithm::P384 => 96,
            Algorithm::Ed25519 => 64,
        }
    }
}

/// NIST curves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Curve {
    /// P-256.
    P256,
    /// P-384.
    P384,
}

impl Curve {
    /// Bytes of a field element and of a scalar.
    #[must_use]
    pub fn field_bytes(self) -> usize {
        match self {
            Curve::P256 => 32,
            Curve::P384 => 48,
        }
    }

    /// The DER of the curve's OID (what PKCS#11 calls `CKA_EC_PARAMS`).
    #[must_use]
    pub fn oid_der(self) -> &'static [u8] {
        match self {
            // 1.2.840.10045.3.1.7
            Curve::P256 => &[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07],
            // 1.3.132.0.34
            Curve::P384 => &[0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22],
        }
    }

    /// The SSH name (`nistp256`, `nistp384`).
    #[must_use]
    pub fn ssh_name(self) -> &'static str {
        match self {
            Curve::P256 => "nistp256",
            Curve::P384 => "nistp384",
        }
    }
}

/// The public half of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Public {
    /// RSA: modulus and public exponent, big-endian without leading zeros.
    Rsa {
        /// Modulus.
        n: Vec<u8>,
        /// Public exponent.
        e: Vec<u8>,
    },
    /// EC: the curve and the point, uncompressed (`04‖x‖y`).
    Ec {
        /// Curve.
        curve: Curve,
        /// Uncompressed point.
        point: Vec<u8>,
    },
    /// Ed25519: the 32-byte public key.
    Ed25519([u8; 32]),
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AsymError {
    /// Private components that do not make a key of the declared type.
    #[error("not a valid {alg:?} private key: {why}")]
    BadKey {
        /// The declared type.
        alg: Algorithm,
        /// What is wrong.
        why: String,
    },
    /// Input the operation cannot take (length, range, parameters).
    #[error("bad input: {0}")]
    BadInput(&'static str),
    /// An operation this key type does not do.
    #[error("{op} is not an operation of a {alg:?} key")]
    WrongKey {
        /// The operation.
        op: &'static str,
        /// The key type.
        alg: Algorithm,
    },
    /// A ciphertext that did not decrypt (OAEP), or a peer point off the curve.
    #[error("the input did not decrypt or is not a valid point: {0}")]
    Rejected(String),
    /// The output buffer is too small.
    #[error("output buffer of {got} bytes; {need} needed")]
    ShortOutput {
        /// Bytes given.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// aws-lc failed (out of memory in the secret heap, among others).
    #[error("aws-lc: {0}")]
    Backend(String),
    /// The secret heap could not be set up, or is too full for the
    /// calling thread's random generator (the request is refused).
    #[error("secret heap for aws-lc: {0}")]
    Heap(String),
}
