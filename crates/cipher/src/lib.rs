//! The one place memveil names its AES backend.
//!
//! Everything else in the workspace encrypts through the types here:
//! [`Aes`] (ECB, CBC, CTR and single blocks, 128/256-bit keys), [`Xts`]
//! (IEEE 1619 XTS-AES-128/256, the memory-encryption cipher) and [`Gcm`]
//! (AES-GCM, 96-bit nonces, 128-bit tags).
//!
//! Three implementations ("paths", [`Path`]), chosen once per process from
//! CPUID ([`path`], the one dispatch point; `MEMVEIL_CIPHER_PATH` caps it):
//!
//! - **vaes256**: memveil's VAES kernels on 256-bit registers (two blocks per
//!   instruction, sixteen in flight) for XTS, CTR, ECB and GCM, GHASH with
//!   VPCLMULQDQ;
//! - **aesni**: memveil's 128-bit AES-NI kernels (eight blocks in flight),
//!   GHASH with PCLMULQDQ;
//! - **portable**: memveil's modes over RustCrypto's `aes` 0.9 block API and
//!   RustCrypto's `aes-gcm` (constant-time fixslice software on CPUs without
//!   AES-NI).
//!
//! The kernels are the crate's only `unsafe` (module `kernel`), each entered
//! only through a key object built after CPUID showed the path's features.
//! They never copy a key schedule to the stack (see `kernel`). The choice of
//! paths was made by measurement; see `docs/benchmarks-history.md` ("Cipher paths and the
//! engine on a VAES machine").
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
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod kernel;
#[cfg(not(target_arch = "x86_64"))]
mod kernel_none;
#[cfg(not(target_arch = "x86_64"))]
use kernel_none as kernel;
mod path;
mod xts;

pub use block::Aes;
pub use gcm::Gcm;
pub use path::{path, path_note, Path, PATH_ENV};
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
    /// A path was asked for that this CPU cannot run.
    #[error("cipher path {path} needs CPU features this CPU lacks: {missing}")]
    PathUnavailable {
        /// The path asked for.
        path: Path,
        /// The features missing, in words.
        missing: String,
    },
}

impl CipherError {
    pub(crate) fn unavailable(p: Path) -> Self {
        CipherError::PathUnavailable {
            path: p,
            missing: p.missing().join(", "),
        }
    }
}

/// Bytes of stack [`scrub_stack`] overwrites.
const SCRUB_BYTES: usize = 8192;

/// Overwrites the stack just below the caller's frame, where the functions
/// it called have returned from. The portable path calls it after every
/// operation: RustCrypto's AES-NI and VAES backends leave round keys there
/// (found by `tests/stack_hygiene.rs`; the kernels leave nothing, so their
/// paths skip it).
#[inline(never)]
pub(crate) fn scrub_stack() {
    let mut pad = [0u128; SCRUB_BYTES / 16];
    zeroize::Zeroize::zeroize(&mut pad);
    std::hint::black_box(&pad);
}

/// Names the AES implementation in use in this process, for reports.
#[must_use]
pub fn backend() -> &'static str {
    path().describe()
}
