//! Inter-process plumbing for the key vault: peer credentials of a Unix
//! socket (`SO_PEERCRED`), passing file descriptors (`SCM_RIGHTS`), sealed
//! memfds, shared mappings of another process's memfd, and futexes on shared
//! memory.
//!
//! The shared mapping ([`SharedMap`]) is written by a process we do not trust:
//! every access here is bounds-checked against the mapping, and interpreting
//! the bytes (reading each index once, checking it) is the caller's job.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Credentials of the process at the other end of a Unix socket, as the
/// kernel recorded them at `connect(2)` time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id.
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

/// `getsockopt(SO_PEERCRED)` on a connected Unix stream socket.
///
/// # Errors
/// The error of `getsockopt(2)`.
pub fn peer_cred(sock: &UnixStream) -> io::Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::ucred>())
        .map_err(|_| io::Error::other("ucred size"))?;
    // SAFETY: `cred` and `len` are valid out pointers of the size we pass.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::from_mut(&mut cred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

const CMSG_SPACE_ONE_FD: usize = 24; // CMSG_SPACE(sizeof(int)) on 64-bit Linux

/// Sends `bufs` (gathered, like `writev`) with `fd` attached as `SCM_RIGHTS`.
/// Returns the bytes sent (the fd goes with the first byte).
///
/// # Errors
/// The error of `sendmsg(2)`.
pub fn send_with_fd(
    sock: &UnixStream,
    bufs: &[IoSlice<'_>],
    fd: BorrowedFd<'_>,
) -> io::Result<usize> {
    #[repr(C, align(8))]
    struct Cbuf([u8; CMSG_SPACE_ONE_FD]);
    let mut cbuf = Cbuf([0; CMSG_SPACE_ONE_FD]);
    // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = bufs.as_ptr().cast_mut().cast();
    msg.msg_iovlen = bufs.len();
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    msg.msg_controllen = CMSG_SPACE_ONE_FD;
    // SAFETY: msg_control points at CMSG_SPACE(4) bytes, so the first header
    // fits; CMSG_FIRSTHDR returns a pointer inside `cbuf`.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null() {
            return Err(io::Error::other("no room for SCM_RIGHTS"));
        }
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd.as_raw_fd());
    }
    // SAFETY: `msg` points at live iovecs (IoSlice is ABI-compatible with
    // iovec) and the control buffer above for the duration of the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Receives into `buf`, collecting at most one `SCM_RIGHTS` descriptor (any
/// further descriptors are closed). Returns the bytes read and the fd.
///
/// # Errors
/// The error of `recvmsg(2)`.
pub fn recv_with_fd(sock: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    #[repr(C, align(8))]
    struct Cbuf([u8; 128]);
    let mut cbuf = Cbuf([0; 128]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: all-zero msghdr is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    msg.msg_controllen = cbuf.0.len();
    // SAFETY: `msg` points at `buf` (through `iov`) and `cbuf`, both live and
    // writable for the call. MSG_CMSG_CLOEXEC keeps received fds from leaking
    // into children.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    let mut got: Option<OwnedFd> = None;
    // SAFETY: the kernel filled `msg_controllen` bytes of `cbuf` with
    // well-formed cmsg headers; CMSG_FIRSTHDR/NXTHDR stay inside it.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let hdr = libc::CMSG_LEN(0) as usize;
                let count = ((*c).cmsg_len.saturating_sub(hdr)) / 4;
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.add(i));
                    // Each received fd is new and ours; wrap so it is closed
                    // unless kept.
                    let owned = OwnedFd::from_raw_fd(fd);
                    if got.is_none() {
                        got = Some(owned);
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n, got))
}

/// Creates a memfd of `len` bytes (not secret memory: for data shared with
/// another process), sealed against shrinking so the peer can map it without
/// fear of `SIGBUS`.
///
/// # Errors
/// The errors of `memfd_create(2)`, `ftruncate(2)`, `fcntl(F_ADD_SEALS)`.
pub fn memfd_sealed(name: &str, len: u64) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).map_err(|_| io::Error::other("memfd name has NUL"))?;
    // SAFETY: `cname` is a valid NUL-terminated string for the call.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is new and owned by no one else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let f = std::fs::File::from(fd);
    f.set_len(len)?;
    let fd = OwnedFd::from(f);
    // SAFETY: fcntl with F_ADD_SEALS takes an int argument.
    let r = unsafe {
        libc::fcntl(
            fd.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// The seals of a memfd (`F_GET_SEALS`); an error for files that cannot be
/// sealed (anything that is not shmem).
///
/// # Errors
/// EINVAL for a file that is not a memfd/shmem file.
pub fn seals(fd: BorrowedFd<'_>) -> io::Result<i32> {
    // SAFETY: F_GET_SEALS takes no argument and touches no memory.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// Whether a seal set forbids shrinking.
#[must_use]
pub fn seals_forbid_shrink(seals: i32) -> bool {
    seals & libc::F_SEAL_SHRINK != 0
}

/// A read-write `MAP_SHARED` mapping of a memfd, unmapped on drop. The other
/// side may write any byte at any time; every accessor is bounds-checked.
pub struct SharedMap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is an owned range of address space; all access goes
// through bounds-checked methods using atomics or byte copies.
unsafe impl Send for SharedMap {}
// SAFETY: as above; concurrent access is to shared memory whose contents are
// treated as untrusted bytes.
unsafe impl Sync for SharedMap {}

impl SharedMap {
    /// Maps the first `len` bytes of `fd` shared and read-write. The caller
    /// must have checked that the file cannot shrink below `len` (a sealed
    /// memfd), or a later access may raise `SIGBUS`.
    ///
    /// # Errors
    /// `InvalidInput` for a zero length; the error of `mmap(2)`.
    pub fn map(fd: BorrowedFd<'_>, len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero-length map",
            ));
        }
        // SAFETY: a fresh mapping chosen by the kernel; no Rust object lives there.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(Self { ptr, len })
    }

    /// Bytes mapped.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        false
    }

    fn range_ok(&self, off: usize, len: usize) -> bool {
        off.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// The 4-byte-aligned atomic word at `off`, or `None` when out of bounds
    /// or misaligned.
    #[must_use]
    pub fn atomic_u32(&self, off: usize) -> Option<&AtomicU32> {
        if !self.range_ok(off, 4) || !off.is_multiple_of(4) {
            return None;
        }
        // SAFETY: in bounds and 4-byte aligned (the mapping is page-aligned);
        // AtomicU32 has no invalid bit patterns and tolerates concurrent
        // writers in the other process; it lives as long as `&self`.
        Some(unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU32>() })
    }

    /// Copies `out.len()` bytes starting at `off` out of the mapping (one
    /// read of each byte), or returns `None` when out of bounds.
    pub fn read(&self, off: usize, out: &mut [u8]) -> Option<()> {
        if !self.range_ok(off, out.len()) {
            return None;
        }
        // SAFETY: source range checked in bounds; `out` is a distinct local
        // buffer; bytes have no invalid values. A racing writer can only
        // change which bytes we copy.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), out.as_mut_ptr(), out.len());
        }
        Some(())
    }

    /// Copies `data` into the mapping at `off`, or returns `None` when out of bounds.
    pub fn write(&self, off: usize, data: &[u8]) -> Option<()> {
        if !self.range_ok(off, data.len()) {
            return None;
        }
        // SAFETY: destination range checked in bounds; `data` cannot overlap
        // the mapping through a safe reference handed out by us except via
        // `with_mut`, which holds the only such borrow while it runs.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(off), data.len());
        }
        Some(())
    }

    /// Runs `f` on the bytes `[off, off+len)` of the mapping in place (no
    /// copy), or returns `None` when the range is out of bounds.
    ///
    /// The other process may write these bytes while `f` runs; `f` must treat
    /// them as untrusted data (a cipher transforming them in place does: a
    /// racing writer can only corrupt its own output). Callers must not run
    /// two `with_mut` on overlapping ranges at once.
    pub fn with_mut<R>(&self, off: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        if !self.range_ok(off, len) {
            return None;
        }
        // SAFETY: range checked in bounds of our live mapping. u8 has no
        // invalid values, so concurrent writes by the peer cannot create an
        // invalid value; no Rust invariant of ours depends on these bytes.
        // Exclusivity inside this process is the caller's documented duty.
        let s = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) };
        Some(f(s))
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: we own this mapping; no reference into it outlives `self`
        // (all accessors borrow `self`).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// `FUTEX_WAIT` (shared, so it works across processes on a `MAP_SHARED`
/// mapping): sleeps while `*word == expected`, at most `timeout`.
/// Spurious returns are possible; callers re-check.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(i32::try_from(timeout.subsec_nanos()).unwrap_or(0)),
    };
    // SAFETY: `word` is a live, aligned u32; `ts` lives for the call. The
    // kernel only reads the word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// `FUTEX_WAKE` (shared): wakes up to `n` waiters on `word`.
pub fn futex_wake(word: &AtomicU32, n: i32) {
    // SAFETY: `word` is a live, aligned u32; the kernel does not access it
    // beyond computing the futex key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            n,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Whether a process id exists (`kill(pid, 0)`; a process of another user
/// that we may not signal counts as alive).
#[must_use]
pub fn pid_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn fd_passing_and_peer_cred() {
        let (a, b) = UnixStream::pair().expect("pair");
        let fd = memfd_sealed("t", 8192).expect("memfd");
        let sent = send_with_fd(&a, &[IoSlice::new(b"hi")], fd.as_fd()).expect("send");
        assert_eq!(sent, 2);
        let mut buf = [0u8; 8];
        let (n, got) = recv_with_fd(&b, &mut buf).expect("recv");
        assert_eq!(&buf[..n], b"hi");
        let got = got.expect("an fd");
        assert!(seals_forbid_shrink(seals(got.as_fd()).expect("seals")));
        let m1 = SharedMap::map(fd.as_fd(), 8192).expect("map1");
        let m2 = SharedMap::map(got.as_fd(), 8192).expect("map2");
        m1.write(100, b"xyz").expect("write");
        let mut out = [0u8; 3];
        m2.read(100, &mut out).expect("read");
        assert_eq!(&out, b"xyz");
        assert!(m2.read(8190, &mut out).is_none());
        assert!(m2.atomic_u32(8190).is_none());
        assert!(m2.atomic_u32(usize::MAX - 1).is_none());
        assert!(m2.with_mut(usize::MAX, 2, |_| ()).is_none());
        let cred = peer_cred(&a).expect("cred");
        assert_eq!(cred.pid, i32::try_from(std::process::id()).expect("pid"));
    }

    #[test]
    fn plain_files_have_no_seals() {
        let f = std::fs::File::open("/proc/self/status").expect("open");
        assert!(seals(f.as_fd()).is_err());
    }
}
