//! Secret memory for key material.
//!
//! [`SecretRegion`] is a run of whole pages backed by `memfd_secret(2)`: the
//! pages are removed from the kernel's direct map, so neither other processes
//! (`/proc/PID/mem`, ptrace) nor the kernel on their behalf, nor core dumps,
//! can read them; they are never swapped. Each region has a guard page on each
//! side, is pre-faulted at creation (first touch of secret memory costs about
//! 20 µs a page, so it is paid once) and is wiped before it is unmapped.
//! [`SecretPool`] carves many small secrets out of one region, and
//! [`SecretBox`] owns one of them, wiping it on drop. [`SecretHeap`] is a
//! malloc-style heap in one region, for C libraries that allocate key
//! material themselves (aws-lc in the vault, through memveil-asym).
//!
//! Every allocation reports its protection [`Level`]. Where `memfd_secret` is
//! unavailable this crate refuses, unless the caller's [`Policy`] explicitly
//! accepts the weaker `locked` level (mlock + `MADV_DONTDUMP`: no swap, no core
//! dump, but readable through `/proc/PID/mem` by root and the kernel). It never
//! falls back silently.
//!
//! Exhausting `RLIMIT_MEMLOCK` (secret memory counts against it) is an error
//! naming the limit and how to raise it, never a panic.
//!
//! Testing hook: with `MEMVEIL_SECRETMEM=off` in the environment this crate
//! behaves as on a kernel without `memfd_secret`. That can only make it refuse
//! or use a level the policy already accepts; it cannot weaken a policy.
#![deny(unsafe_op_in_unsafe_fn)]

mod heap;
mod pool;
mod region;

pub use heap::SecretHeap;
pub use pool::{pool_footprint, SecretBox, SecretPool};
pub use region::SecretRegion;

use std::fmt;
use std::str::FromStr;

/// A new `memfd_secret(2)` file (close-on-exec), or ENOSYS under the testing
/// hook `MEMVEIL_SECRETMEM=off`.
///
/// # Errors
/// The system call's error (ENOSYS: no secret memory on this kernel).
pub fn secret_file() -> std::io::Result<std::os::fd::OwnedFd> {
    if std::env::var_os("MEMVEIL_SECRETMEM").is_some_and(|v| v == "off") {
        return Err(std::io::Error::from_raw_os_error(libc::ENOSYS));
    }
    memveil_sys::memfd_secret()
}

/// How well a piece of memory is protected, strongest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// `memfd_secret`: out of the kernel direct map, unreadable by other
    /// processes and the kernel, never swapped or dumped.
    Secret,
    /// `mlock` + `MADV_DONTDUMP`: never swapped or dumped, but readable by
    /// root and the kernel (`/proc/PID/mem`, ptrace).
    Locked,
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Level::Secret => "secret",
            Level::Locked => "locked",
        })
    }
}

impl FromStr for Level {
    type Err = SecmemError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "secret" => Ok(Level::Secret),
            "locked" => Ok(Level::Locked),
            other => Err(SecmemError::UnknownLevel(other.to_owned())),
        }
    }
}

/// Which protection levels a caller accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    weakest: Level,
}

impl Policy {
    /// Only `memfd_secret` memory; refuse otherwise. The default.
    #[must_use]
    pub fn secret_only() -> Self {
        Self {
            weakest: Level::Secret,
        }
    }

    /// Accept `weakest` when stronger levels are unavailable (e.g. from an
    /// operator's `--allow-level=locked`).
    #[must_use]
    pub fn allow(weakest: Level) -> Self {
        Self { weakest }
    }

    /// The weakest level accepted.
    #[must_use]
    pub fn weakest(&self) -> Level {
        self.weakest
    }
}

impl Default for Policy {
    fn default() -> Self {
        Self::secret_only()
    }
}

/// Errors of secret memory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecmemError {
    /// `memfd_secret` is unavailable and the policy does not accept a weaker level.
    #[error(
        "memfd_secret unavailable ({cause}): kernel older than 5.14, built without \
         CONFIG_SECRETMEM, or booted with secretmem.enable=0; pass --allow-level=locked \
         to accept mlock-only protection (readable by root and the kernel)"
    )]
    Unavailable {
        /// Why `memfd_secret` failed.
        cause: String,
    },
    /// `RLIMIT_MEMLOCK` does not leave room for the allocation.
    #[error(
        "RLIMIT_MEMLOCK exhausted: {requested} bytes of locked/secret memory requested, \
         limit is {limit}; raise it with `ulimit -l <KiB>`, LimitMEMLOCK= in the systemd \
         unit, or a memlock line in /etc/security/limits.conf (or grant CAP_IPC_LOCK)"
    )]
    MemlockExhausted {
        /// Bytes requested.
        requested: usize,
        /// The soft limit, as text ("65536 bytes" or "unlimited").
        limit: String,
    },
    /// The pool has no free run large enough.
    #[error("secret pool exhausted: {requested} bytes requested, {free} of {size} bytes free; create a larger pool")]
    PoolExhausted {
        /// Bytes requested.
        requested: usize,
        /// Free bytes.
        free: usize,
        /// Pool size.
        size: usize,
    },
    /// A type whose alignment the pool does not provide.
    #[error("alignment {0} exceeds the pool's 64-byte granule")]
    Alignment(usize),
    /// An unknown level name.
    #[error("unknown protection level {0:?}: expected \"secret\" or \"locked\"")]
    UnknownLevel(String),
    /// Another system call failed.
    #[error("{op}: {source}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Overwrites at least `bytes` of the stack below the caller with zeros, to
/// remove transient copies of key material that the compiler placed there
/// (e.g. a key schedule returned by value before it was moved into secret
/// memory). The writes go through `zeroize`, which the optimiser cannot drop.
#[inline(never)]
pub fn scrub_stack(bytes: usize) {
    use zeroize::Zeroize as _;
    let mut frame = [0xA5u8; 4096];
    frame.zeroize();
    std::hint::black_box(&frame);
    if bytes > 4096 {
        scrub_stack(bytes - 4096);
    }
}
