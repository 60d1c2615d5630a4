//! Memory mappings: anonymous, `memfd_secret(2)`, protection, locking.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// `memfd_secret` system call number on x86_64 (Linux 5.14+).
const SYS_MEMFD_SECRET: libc::c_long = 447;

/// The system page size (asked of the C library once: every
/// `SecretRegion::bytes` needs it, and the engine's zero-copy path calls that
/// per page touched).
#[must_use]
pub fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no memory-safety preconditions.
        let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(v).unwrap_or(4096)
    })
}

/// Creates a `memfd_secret(2)` file descriptor: memory that is removed from
/// the kernel's direct map and cannot be read by other processes, by the
/// kernel on their behalf (`/proc/PID/mem`, ptrace) or through core dumps.
///
/// # Errors
/// ENOSYS when the kernel lacks the call (older than 5.14, or built without
/// `CONFIG_SECRETMEM`); EINVAL/ENOSYS when booted with `secretmem.enable=0`.
pub fn memfd_secret() -> io::Result<OwnedFd> {
    // SAFETY: memfd_secret takes one flags argument and returns a new file
    // descriptor or -1; it touches no memory of ours.
    let fd = unsafe { libc::syscall(SYS_MEMFD_SECRET, libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("fd out of range"))?;
    // SAFETY: `fd` was just returned by the kernel and is owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Access rights of a range of pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protection {
    /// No access: a guard page or a protected (encrypted) page.
    None,
    /// Read only.
    Read,
    /// Read and write.
    ReadWrite,
}

impl Protection {
    fn bits(self) -> libc::c_int {
        match self {
            Protection::None => libc::PROT_NONE,
            Protection::Read => libc::PROT_READ,
            Protection::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
        }
    }
}

/// A private mapping of whole pages, unmapped on drop.
///
/// The mapping owns its address range exclusively; callers get raw pointers and
/// are responsible for accessing only pages they made accessible.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `Mapping` is an owned range of address space with no thread
// affinity; moving the owner between threads is sound. Access to the bytes
// goes through raw pointers whose synchronisation is the caller's duty.
unsafe impl Send for Mapping {}
// SAFETY: shared references only expose the base pointer and length (plain
// data); any access through the pointer is the caller's responsibility.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn map(
        addr: *mut libc::c_void,
        len: usize,
        prot: Protection,
        flags: libc::c_int,
        fd: libc::c_int,
    ) -> io::Result<NonNull<u8>> {
        if len == 0 || !len.is_multiple_of(page_size()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("mapping length {len} is not a positive multiple of the page size"),
            ));
        }
        // SAFETY: mmap with these arguments either creates a new mapping or,
        // with MAP_FIXED, replaces pages inside a range our caller owns
        // (checked by the callers of `map` below). No existing Rust object
        // lives in a range we replace.
        let p = unsafe { libc::mmap(addr, len, prot.bits(), flags, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned NULL"))
    }

    /// Maps `len` bytes of fresh, zeroed anonymous memory with `prot`.
    ///
    /// # Errors
    /// The error of `mmap(2)` (ENOMEM), or `InvalidInput` for a length that is
    /// not a positive multiple of the page size.
    pub fn anonymous(len: usize, prot: Protection) -> io::Result<Self> {
        let ptr = Self::map(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
        )?;
        Ok(Self { ptr, len })
    }

    /// Maps `len` bytes of the file `fd` shared (as `memfd_secret` requires),
    /// read-write, at offset 0 of the file, over the pages starting at `offset`
    /// inside this mapping (which must already own that range).
    ///
    /// # Errors
    /// `InvalidInput` when the range is outside this mapping or unaligned; the
    /// error of `mmap(2)` (EAGAIN/ENOMEM when `RLIMIT_MEMLOCK` is exhausted for
    /// secret memory).
    pub fn map_fd_at(&mut self, offset: usize, len: usize, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.check_range(offset, len)?;
        // SAFETY: `check_range` proved [offset, offset+len) lies inside the
        // range this mapping owns, so the add stays in bounds.
        let at = unsafe { self.ptr.as_ptr().add(offset) };
        Self::map(
            at.cast(),
            len,
            Protection::ReadWrite,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
        )?;
        Ok(())
    }

    fn check_range(&self, offset: usize, len: usize) -> io::Result<()> {
        let ps = page_size();
        let end = offset.checked_add(len);
        if !offset.is_multiple_of(ps) || !len.is_multiple_of(ps) || end.is_none_or(|e| e > self.len)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "range {offset:#x}+{len:#x} is unaligned or outside a mapping of {:#x} bytes",
                    self.len
                ),
            ));
        }
        Ok(())
    }

    /// Changes the protection of `len` bytes at `offset`.
    ///
    /// # Errors
    /// `InvalidInput` for a range outside the mapping; the error of `mprotect(2)`.
    pub fn protect(&self, offset: usize, len: usize, prot: Protection) -> io::Result<()> {
        self.check_range(offset, len)?;
        // SAFETY: the range is inside our mapping (checked); changing its
        // protection cannot invalidate Rust references because this type
        // hands out none.
        let r = unsafe { libc::mprotect(self.ptr.as_ptr().add(offset).cast(), len, prot.bits()) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Locks `len` bytes at `offset` into RAM (`mlock(2)`).
    ///
    /// # Errors
    /// ENOMEM/EAGAIN when `RLIMIT_MEMLOCK` would be exceeded.
    pub fn lock(&self, offset: usize, len: usize) -> io::Result<()> {
        self.check_range(offset, len)?;
        // SAFETY: the range is inside our mapping (checked); mlock reads no memory.
        let r = unsafe { libc::mlock(self.ptr.as_ptr().add(offset).cast(), len) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Applies `madvise(advice)` to `len` bytes at `offset`.
    ///
    /// # Errors
    /// The error of `madvise(2)`.
    pub fn advise(&self, offset: usize, len: usize, advice: libc::c_int) -> io::Result<()> {
        self.check_range(offset, len)?;
        // SAFETY: the range is inside our mapping (checked). The advice values
        // used by memveil (DONTDUMP, DONTFORK, WIPEONFORK, DONTNEED) do not
        // free memory that a live Rust reference points to: callers only
        // discard pages they own and no longer reference.
        let r = unsafe { libc::madvise(self.ptr.as_ptr().add(offset).cast(), len, advice) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Base address of the mapping.
    #[must_use]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: mappings are never empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we own [ptr, ptr+len) exclusively and nothing references it
        // after drop.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_rejects_unaligned() {
        let e = Mapping::anonymous(100, Protection::ReadWrite)
            .err()
            .expect("error");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn protect_checks_bounds() {
        let m = Mapping::anonymous(page_size(), Protection::ReadWrite).expect("map");
        assert!(m.protect(0, 2 * page_size(), Protection::None).is_err());
        assert!(m.protect(0, page_size(), Protection::Read).is_ok());
    }
}
