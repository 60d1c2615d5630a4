//! The one place memveil names its AES backend.
//!
//! Everything else in the workspace encrypts through the types here:
//! [`Aes`] (ECB, CBC, CTR and single blocks, 128/256-bit keys), [`Xts`]
//! (IEEE 1619 XTS-AES-128/256, the memory-encryption cipher) and [`Gcm`]
//! (AES-GCM, 96-bit nonces, 128-bit tags).
//!
//! The backend is RustCrypto's `aes` 0.9 (runtime-detected AES-NI, VAES when
//! the CPU has it, constant-time fixslice software otherwise) and RustCrypto's
//! `aes-gcm`, plus one fused AES-NI XTS kernel of our own (module `ni`, the only
//! `unsafe` here) for the page-encryption hot path; without AES-NI, XTS runs
//! over RustCrypto's batched block API. The choice was
//! made by measurement; see `BENCHMARKS.md` ("Cipher backend").
//!
//! What this crate refuses to do: return key bytes (key objects have no
//! accessor, no `Clone` and no `Debug` that prints them), accept XTS keys whose
//! two halves are equal (IEEE 1619 / FIPS 140 IG A.9), or accept lengths a mode
//! cannot process. Key objects wipe their schedules on drop (`zeroize`) and are
//! plain data, so callers can place them in secret memory.
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

mod block;
mod gcm;
mod ni;
mod xts;

pub use block::Aes;
pub use gcm::Gcm;
pub use xts::Xts;

/// Errors of the cipher layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CipherError {
    /// A key of a length the algorithm does not take.
    #[error("{algorithm} key of {got} bytes: expected {expected}")]
    BadKeyLength {
        /// The algorithm.
        algorithm: &'static str,
        /// Bytes received.
        got: usize,
        /// What it takes, in words.
        expected: &'static str,
    },
    /// The two halves of an XTS key are equal.
    #[error(
        "XTS data key and tweak key are equal: IEEE 1619 and FIPS 140 require two independent keys"
    )]
    EqualXtsHalves,
    /// A data length the mode cannot process.
    #[error("{mode}: data of {got} bytes: {expected}")]
    BadLength {
        /// The mode.
        mode: &'static str,
        /// Bytes received.
        got: usize,
        /// What it takes, in words.
        expected: &'static str,
    },
    /// A GCM tag did not verify: the ciphertext, AAD, nonce or key is wrong.
    #[error(
        "GCM authentication failed: ciphertext, associated data, nonce or key do not match the tag"
    )]
    TagMismatch,
}

/// Names the AES implementation in use on this CPU, for reports.
#[must_use]
pub fn backend() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("aes") {
            return "memveil AES-NI XTS kernel + RustCrypto aes 0.9 / aes-gcm 0.11 (AES-NI)";
        }
    }
    "RustCrypto aes 0.9 / aes-gcm 0.11 (software fixslice, constant time); XTS over its batch API"
}
