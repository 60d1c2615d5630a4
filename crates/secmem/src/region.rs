//! Whole-page secret regions with guard pages.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};

use memveil_sys::{page_size, Mapping, Protection};
use zeroize::Zeroize as _;

use crate::{Level, Policy, SecmemError};

/// A run of whole pages of secret memory with a guard page on each side.
/// Pre-faulted at creation, wiped and unmapped on drop.
pub struct SecretRegion {
    map: Mapping,
    len: usize,
    level: Level,
    _fd: Option<OwnedFd>,
}

fn memlock_error(requested: usize) -> SecmemError {
    let limit = match memveil_sys::process::memlock_limit() {
        Ok((cur, _)) if cur == libc::RLIM_INFINITY => "unlimited".to_owned(),
        Ok((cur, _)) => format!("{cur} bytes"),
        Err(e) => format!("unknown ({e})"),
    };
    SecmemError::MemlockExhausted { requested, limit }
}

fn is_memlock(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAGAIN | libc::ENOMEM | libc::EPERM)
    )
}

impl SecretRegion {
    /// Allocates at least `len` bytes (rounded up to whole pages) at the
    /// strongest level available that `policy` accepts.
    ///
    /// # Errors
    /// [`SecmemError::Unavailable`] when `memfd_secret` is missing and the
    /// policy demands it; [`SecmemError::MemlockExhausted`] when
    /// `RLIMIT_MEMLOCK` is too low; [`SecmemError::Os`] otherwise.
    pub fn new(len: usize, policy: Policy) -> Result<Self, SecmemError> {
        let ps = page_size();
        let len = len.max(1).div_ceil(ps) * ps;
        let total = len + 2 * ps;
        let mut map =
            Mapping::anonymous(total, Protection::None).map_err(|source| SecmemError::Os {
                op: "reserving address space",
                source,
            })?;
        let secret = crate::secret_file();
        let region = match secret {
            Ok(fd) => {
                let f = File::from(fd);
                f.set_len(len as u64).map_err(|source| SecmemError::Os {
                    op: "sizing the memfd_secret file",
                    source,
                })?;
                let fd = OwnedFd::from(f);
                map.map_fd_at(ps, len, fd.as_fd()).map_err(|e| {
                    if is_memlock(&e) {
                        memlock_error(len)
                    } else {
                        SecmemError::Os {
                            op: "mapping memfd_secret",
                            source: e,
                        }
                    }
                })?;
                SecretRegion {
                    map,
                    len,
                    level: Level::Secret,
                    _fd: Some(fd),
                }
            }
            Err(e) if policy.weakest() >= Level::Locked => {
                let _ = e;
                map.protect(ps, len, Protection::ReadWrite)
                    .map_err(|source| SecmemError::Os {
                        op: "mprotect",
                        source,
                    })?;
                map.lock(ps, len).map_err(|e| {
                    if is_memlock(&e) {
                        memlock_error(len)
                    } else {
                        SecmemError::Os {
                            op: "mlock",
                            source: e,
                        }
                    }
                })?;
                map.advise(ps, len, libc::MADV_DONTDUMP)
                    .map_err(|source| SecmemError::Os {
                        op: "madvise(MADV_DONTDUMP)",
                        source,
                    })?;
                SecretRegion {
                    map,
                    len,
                    level: Level::Locked,
                    _fd: None,
                }
            }
            Err(e) => {
                return Err(SecmemError::Unavailable {
                    cause: e.to_string(),
                })
            }
        };
        // Children never inherit secrets.
        let _ = region.map.advise(ps, len, libc::MADV_DONTFORK);
        region.prefault()?;
        Ok(region)
    }

    /// Touches every page once so that later accesses never fault (and a
    /// memory shortage shows here, not in the middle of a request).
    fn prefault(&self) -> Result<(), SecmemError> {
        let ps = page_size();
        for off in (0..self.len).step_by(ps) {
            // SAFETY: `off < len`, so the byte lies in the read-write middle
            // of our mapping, which we own; a volatile write keeps the touch.
            unsafe { self.as_ptr().add(off).write_volatile(0) };
        }
        Ok(())
    }

    /// Seals the region's mapping (guard pages too) with `mseal(2)` for the
    /// rest of the process's life: it can no longer be unmapped, remapped or
    /// reprotected, and dropping the region wipes it but leaves the pages
    /// mapped. Only for regions that live as long as the daemon.
    ///
    /// # Errors
    /// `mseal(2)`'s: `ENOSYS` before Linux 6.10.
    pub fn seal(&self) -> io::Result<()> {
        self.map.seal()
    }

    /// The protection level of this region.
    #[must_use]
    pub fn level(&self) -> Level {
        self.level
    }

    /// Usable length in bytes (a multiple of the page size).
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: regions have at least one page.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Start of the usable bytes (after the leading guard page).
    #[must_use]
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: the mapping is `len + 2 pages` long, so one page in is in bounds.
        unsafe { self.map.as_ptr().add(page_size()) }
    }

    /// The usable bytes.
    #[must_use]
    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: [as_ptr, as_ptr+len) is mapped read-write and owned by this
        // region; `&mut self` makes the returned slice the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len) }
    }

    /// The usable bytes, read-only.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as in `bytes`; shared access only while `&self` lives, and
        // mutation requires `&mut self`.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }
}

impl Drop for SecretRegion {
    fn drop(&mut self) {
        self.bytes().zeroize();
    }
}
