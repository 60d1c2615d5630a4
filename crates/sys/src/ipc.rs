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

/// Why an access to a [`SharedMap`] was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShmError {
    /// The range does not lie inside the mapping.
    OutOfBounds,
    /// The range overlaps one this process is using right now (an exclusive
    /// claim, or a control range overlapping anything).
    Busy,
    /// A control access that is not on 4-byte boundaries.
    Misaligned,
}

impl std::fmt::Display for ShmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShmError::OutOfBounds => "range outside the shared mapping",
            ShmError::Busy => {
                "range in use by another access of this process (overlapping accesses are refused)"
            }
            ShmError::Misaligned => "control access not on 4-byte boundaries",
        })
    }
}

impl std::error::Error for ShmError {}

/// How a range of a [`SharedMap`] is in use inside this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    /// A [`Control`] range: only 32-bit atomic accesses, for as long as the
    /// handle lives.
    Control,
    /// A copy out of the mapping (plain reads; several may overlap).
    Shared,
    /// A [`Claim`]: copies in and `&mut [u8]`, nobody else in the process.
    Exclusive,
}

/// A live use of `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Live {
    start: usize,
    end: usize,
    kind: Use,
}

/// A read-write `MAP_SHARED` mapping of a memfd, unmapped on drop.
///
/// The other process may write any byte at any time; every accessor is
/// bounds-checked, and no two accesses of this process that could conflict
/// run on overlapping bytes at once: the map keeps a table of the ranges in
/// use and refuses an overlapping access with [`ShmError::Busy`] instead of
/// letting it alias. Three kinds of use:
///
/// - [`SharedMap::control`]: a range (a request ring's page) reached only
///   through 32-bit atomics, held for as long as the [`Control`] lives.
///   Overlaps nothing else.
/// - [`SharedMap::read`]: a copy out through a raw pointer (one read of each
///   byte). Overlaps other reads, nothing else.
/// - [`SharedMap::claim`] (and [`SharedMap::write`], [`SharedMap::with_mut`]):
///   exclusive; copies in and out through raw pointers, and the one place a
///   `&mut [u8]` over the mapping exists. Overlaps nothing.
///
/// So no safe call can produce two references, or a reference and a copy,
/// over the same bytes in this process.
pub struct SharedMap {
    ptr: NonNull<u8>,
    len: usize,
    live: std::sync::Mutex<Vec<Live>>,
}

// SAFETY: the mapping is an owned range of address space; all access goes
// through bounds-checked methods whose overlapping uses are refused by the
// `live` table (itself behind a mutex).
unsafe impl Send for SharedMap {}
// SAFETY: as above: concurrent accesses from several threads either touch
// disjoint bytes, or are copies out (reads only), or are 32-bit atomics in a
// `Control` range; the peer process's writes are treated as untrusted bytes.
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
        Ok(Self {
            ptr,
            len,
            live: std::sync::Mutex::new(Vec::new()),
        })
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

    /// `[off, off+len)` when it lies inside the mapping.
    fn range(&self, off: usize, len: usize) -> Result<(usize, usize), ShmError> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok((off, end)),
            _ => Err(ShmError::OutOfBounds),
        }
    }

    /// Records a use of `[start, end)` unless it conflicts with a live one.
    fn acquire(&self, start: usize, end: usize, kind: Use) -> Result<Live, ShmError> {
        let me = Live { start, end, kind };
        let mut live = self
            .live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let clash = live.iter().any(|l| {
            l.start < end && start < l.end && !(l.kind == Use::Shared && kind == Use::Shared)
        });
        if clash {
            return Err(ShmError::Busy);
        }
        live.push(me);
        Ok(me)
    }

    fn release(&self, me: Live) {
        let mut live = self
            .live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(i) = live.iter().position(|l| *l == me) {
            live.swap_remove(i);
        }
    }

    /// Copies `out.len()` bytes starting at `off` out of the mapping (one
    /// read of each byte, through a raw pointer).
    ///
    /// # Errors
    /// [`ShmError::OutOfBounds`]; [`ShmError::Busy`] while the range overlaps
    /// a claim or a control range.
    pub fn read(&self, off: usize, out: &mut [u8]) -> Result<(), ShmError> {
        let (start, end) = self.range(off, out.len())?;
        let me = self.acquire(start, end, Use::Shared)?;
        // SAFETY: source range checked in bounds; the `Shared` entry keeps
        // every write of this process off these bytes during the copy; `out`
        // is a distinct local buffer; bytes have no invalid values. A peer
        // writing meanwhile can only change which values we copy.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), out.as_mut_ptr(), out.len());
        }
        self.release(me);
        Ok(())
    }

    /// Copies `data` into the mapping at `off` (through a raw pointer).
    ///
    /// # Errors
    /// As [`SharedMap::claim`].
    pub fn write(&self, off: usize, data: &[u8]) -> Result<(), ShmError> {
        self.claim(off, data.len())?.write(0, data)
    }

    /// Runs `f` on the bytes `[off, off+len)` of the mapping in place (no
    /// copy), under an exclusive claim (see [`Claim::bytes`] for what `f`
    /// must assume about them).
    ///
    /// # Errors
    /// As [`SharedMap::claim`].
    pub fn with_mut<R>(
        &self,
        off: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, ShmError> {
        let mut c = self.claim(off, len)?;
        Ok(f(c.bytes()))
    }

    /// Claims `[off, off+len)` for this caller alone until the [`Claim`] is
    /// dropped.
    ///
    /// # Errors
    /// [`ShmError::OutOfBounds`]; [`ShmError::Busy`] when the range overlaps
    /// any live use (claim, read or control range).
    pub fn claim(&self, off: usize, len: usize) -> Result<Claim<'_>, ShmError> {
        let (start, end) = self.range(off, len)?;
        let me = self.acquire(start, end, Use::Exclusive)?;
        Ok(Claim {
            map: self,
            me,
            _not_send: std::marker::PhantomData,
        })
    }

    /// Reserves `[off, off+len)` for 32-bit atomic access (a request ring's
    /// control page) until the [`Control`] is dropped.
    ///
    /// # Errors
    /// [`ShmError::OutOfBounds`]; [`ShmError::Misaligned`] unless `off` and
    /// `len` are multiples of 4; [`ShmError::Busy`] when the range overlaps
    /// any live use.
    pub fn control(
        self: &std::sync::Arc<Self>,
        off: usize,
        len: usize,
    ) -> Result<Control, ShmError> {
        if !off.is_multiple_of(4) || !len.is_multiple_of(4) {
            return Err(ShmError::Misaligned);
        }
        let (start, end) = self.range(off, len)?;
        let me = self.acquire(start, end, Use::Control)?;
        Ok(Control {
            map: std::sync::Arc::clone(self),
            me,
        })
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: we own this mapping; no reference into it outlives `self`
        // (claims borrow it, control handles keep it alive through an Arc).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// An exclusive range of a [`SharedMap`]: no other access of this process
/// reaches these bytes while it lives. Released on drop.
pub struct Claim<'a> {
    map: &'a SharedMap,
    me: Live,
    // A claim is released by the thread that made it (it is cheap to make).
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Claim<'_> {
    /// Bytes claimed.
    #[must_use]
    pub fn len(&self) -> usize {
        self.me.end - self.me.start
    }

    /// True for an empty claim.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn at(&self, at: usize, len: usize) -> Result<*mut u8, ShmError> {
        match at.checked_add(len) {
            Some(end) if end <= self.len() => {}
            _ => return Err(ShmError::OutOfBounds),
        }
        // SAFETY: `start + at + len <= end <= map.len`, so the offset stays
        // inside the mapping.
        Ok(unsafe { self.map.ptr.as_ptr().add(self.me.start + at) })
    }

    /// Copies `out.len()` bytes from offset `at` of the claim out (one read
    /// of each byte, through a raw pointer).
    ///
    /// # Errors
    /// [`ShmError::OutOfBounds`] past the claim's end.
    pub fn read(&self, at: usize, out: &mut [u8]) -> Result<(), ShmError> {
        let p = self.at(at, out.len())?;
        // SAFETY: in bounds of the claim; the claim keeps every other access
        // of this process away; `out` is distinct memory; bytes have no
        // invalid values, and a peer writing meanwhile only changes which
        // values we copy.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` into the claim at offset `at` (through a raw pointer).
    ///
    /// # Errors
    /// [`ShmError::OutOfBounds`] past the claim's end.
    pub fn write(&mut self, at: usize, data: &[u8]) -> Result<(), ShmError> {
        let p = self.at(at, data.len())?;
        // SAFETY: in bounds of the claim, which no other access of this
        // process overlaps; `data` cannot point into it (the only reference
        // into the claim, `bytes`, needs `&mut self`).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }

    /// The claimed bytes in place.
    ///
    /// The claim makes this the only reference to them in this process. The
    /// peer process can still write them at any moment, which no Rust type
    /// can rule out: callers must treat the bytes as input that may change
    /// under them, and give them only to code that never lets a byte's value
    /// decide a memory access, a length or a loop bound (the vault passes
    /// its data-oblivious cipher transforms here, and copies bytes out with
    /// [`Claim::read`] when it must look at them). A racing peer can then
    /// only change the output it gets back.
    pub fn bytes(&mut self) -> &mut [u8] {
        let len = self.len();
        // SAFETY: `[start, end)` lies inside our live mapping; the exclusive
        // entry in the map's table keeps every other access of this process
        // (claims, reads, control ranges) off these bytes until the claim
        // is dropped, and the returned borrow cannot outlive `&mut self`;
        // u8 has no invalid values, so bytes a peer writes are still valid
        // `u8`s.
        unsafe { std::slice::from_raw_parts_mut(self.map.ptr.as_ptr().add(self.me.start), len) }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.map.release(self.me);
    }
}

/// A range of a [`SharedMap`] reached only through 32-bit atomics (the
/// control words and descriptors of a request ring). Since every access of
/// this process to it is a 4-byte atomic, threads may share it freely; no
/// claim or copy can overlap it while it lives. Released on drop.
pub struct Control {
    map: std::sync::Arc<SharedMap>,
    me: Live,
}

impl Control {
    /// Bytes in the range.
    #[must_use]
    pub fn len(&self) -> usize {
        self.me.end - self.me.start
    }

    /// True for an empty range.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The range as 32-bit atomic words.
    fn atomics(&self) -> &[AtomicU32] {
        // SAFETY: the range lies inside our live mapping and starts 4-byte
        // aligned (the mapping is page-aligned, the offset a multiple of 4),
        // its length a multiple of 4 (both checked in `SharedMap::control`);
        // AtomicU32 has no invalid bit patterns and tolerates a concurrent
        // writer in the other process; this process reaches the range only
        // through such atomics while `self` lives (the map refuses claims
        // and copies over it), and the borrow cannot outlive `self`.
        unsafe {
            std::slice::from_raw_parts(
                self.map.ptr.as_ptr().add(self.me.start).cast::<AtomicU32>(),
                self.len() / 4,
            )
        }
    }

    /// The atomic word at offset `at` of the range, or `None` when out of
    /// bounds or misaligned.
    #[must_use]
    pub fn word(&self, at: usize) -> Option<&AtomicU32> {
        if !at.is_multiple_of(4) {
            return None;
        }
        self.atomics().get(at / 4)
    }

    fn words(&self, at: usize, len: usize) -> Result<&[AtomicU32], ShmError> {
        if !at.is_multiple_of(4) || !len.is_multiple_of(4) {
            return Err(ShmError::Misaligned);
        }
        match at.checked_add(len) {
            Some(end) if end <= self.len() => Ok(&self.atomics()[at / 4..end / 4]),
            _ => Err(ShmError::OutOfBounds),
        }
    }

    /// Copies `out.len()` bytes from offset `at` out, one relaxed 32-bit
    /// atomic load per word (so one read of each byte).
    ///
    /// # Errors
    /// [`ShmError::Misaligned`] unless `at` and the length are multiples of
    /// 4; [`ShmError::OutOfBounds`].
    pub fn read(&self, at: usize, out: &mut [u8]) -> Result<(), ShmError> {
        let words = self.words(at, out.len())?;
        for (o, w) in out.chunks_exact_mut(4).zip(words) {
            o.copy_from_slice(&w.load(std::sync::atomic::Ordering::Relaxed).to_ne_bytes());
        }
        Ok(())
    }

    /// Copies `data` in at offset `at`, one relaxed 32-bit atomic store per
    /// word.
    ///
    /// # Errors
    /// As [`Control::read`].
    pub fn write(&self, at: usize, data: &[u8]) -> Result<(), ShmError> {
        let words = self.words(at, data.len())?;
        for (d, w) in data.chunks_exact(4).zip(words) {
            let v = u32::from_ne_bytes([d[0], d[1], d[2], d[3]]);
            w.store(v, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        self.map.release(self.me);
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

/// Takes `flock(2)`'s exclusive lock on `fd` without waiting: `Ok(true)`
/// when it is this open file's now, `Ok(false)` when another open file holds
/// it (another process, or another `open` in this one). The lock goes with
/// the open file: closing the last descriptor of it (or the process
/// ending, however) lets it go.
///
/// # Errors
/// The error of `flock(2)` other than `EWOULDBLOCK`.
pub fn try_lock_exclusive(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: flock on a descriptor the caller keeps open; no memory.
    if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// The lock of a path: `PATH.lock` beside it (mode 0600), `flock`ed by the
/// one process that may check what is at PATH and then replace or make it.
///
/// For a Unix socket ([`bind_socket`]), held from before the check for a
/// live listener for as long as it listens. Without it, two servers started
/// at once on a stale socket file each found it stale, and the second
/// removed the socket the first had just bound: both ran, the first where
/// no client could reach it. For a disk image's binding file, held by
/// `memveil disk create` from its check that no binding is there until the
/// binding is written.
#[derive(Debug)]
pub struct PathLock {
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl PathLock {
    /// Takes the lock of `path` without waiting; `Ok(None)` when another
    /// process (or another open in this one) holds it.
    ///
    /// # Errors
    /// Opening or creating `PATH.lock`, or `flock(2)`.
    pub fn try_take(path: &std::path::Path) -> io::Result<Option<Self>> {
        use std::os::fd::AsFd as _;
        use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
        let mut path = path.as_os_str().to_owned();
        path.push(".lock");
        let path = std::path::PathBuf::from(path);
        loop {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)?;
            if !try_lock_exclusive(file.as_fd())? {
                return Ok(None);
            }
            // A holder removes the file as it lets go ([`PathLock::release`]):
            // the lock of a file no longer at the path guards nothing.
            let held = file.metadata()?;
            match std::fs::symlink_metadata(&path) {
                Ok(m) if m.dev() == held.dev() && m.ino() == held.ino() => {
                    return Ok(Some(Self { file, path }));
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Lets the lock go and removes its file (once the socket is removed:
    /// removed under the lock, so a server starting meanwhile takes the
    /// lock of the file made after it, never of this one).
    pub fn release(self) {
        let _ = std::fs::remove_file(&self.path);
        drop(self.file);
    }
}

/// Why [`bind_socket`] bound nothing. Whatever was at the path is left as
/// it was, and no lock file is left beside it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BindError {
    /// Another process holds the path's lock: a server starting on it, or
    /// listening on it.
    #[error("another server is starting on it or listens on it")]
    Held,
    /// A program answers on the socket there (one that takes no lock).
    #[error("another program listens on it")]
    Listening,
    /// Something other than a socket is there: never removed, for a
    /// mistyped path must not delete a file someone keeps.
    #[error("{0} is there")]
    NotASocket(&'static str),
    /// A socket there that cannot be probed for a listener (`connect`
    /// failed other than with `ECONNREFUSED`): not known to be stale.
    #[error("a socket that cannot be probed is there ({0})")]
    Unprobed(io::Error),
    /// A system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The cause.
        source: io::Error,
    },
}

/// What sits at `path` when it is not a socket, in words; `None` for a
/// socket or nothing.
///
/// # Errors
/// `lstat(2)`'s error other than `ENOENT`.
fn not_a_socket(path: &std::path::Path) -> Result<Option<&'static str>, BindError> {
    use std::os::unix::fs::FileTypeExt as _;
    let ft = match std::fs::symlink_metadata(path) {
        Ok(m) => m.file_type(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(BindError::Io {
                what: "reading what is there",
                source,
            })
        }
    };
    Ok(if ft.is_socket() {
        None
    } else if ft.is_file() {
        Some("a regular file")
    } else if ft.is_dir() {
        Some("a directory")
    } else if ft.is_symlink() {
        Some("a symbolic link")
    } else {
        Some("a file that is not a socket")
    })
}

/// Binds a listening Unix socket at `path` with `mode`, under the path's
/// lock ([`PathLock`], returned to be held for as long as it listens).
///
/// Replaces only a stale socket (one that refuses connections) and refuses
/// anything else: a regular file, a directory, a link (`--socket
/// ~/.ssh/id_ed25519` must not delete the key), a live socket, a socket it
/// cannot probe, or a path another server holds the lock of. What is not a
/// socket is refused before the lock's file is made beside it.
///
/// # Errors
/// [`BindError`]: what is in the way, or the system call that failed.
pub fn bind_socket(
    path: &std::path::Path,
    mode: u32,
) -> Result<(std::os::unix::net::UnixListener, PathLock), BindError> {
    if let Some(what) = not_a_socket(path)? {
        return Err(BindError::NotASocket(what));
    }
    let held = PathLock::try_take(path)
        .map_err(|source| BindError::Io {
            what: "taking its lock (the file .lock beside it)",
            source,
        })?
        .ok_or(BindError::Held)?;
    match bind_held(path, mode) {
        Ok(l) => Ok((l, held)),
        Err(e) => {
            held.release();
            Err(e)
        }
    }
}

/// [`bind_socket`] under the path's lock: checks again what is there (it
/// may have changed), removes a stale socket, binds, sets the mode.
fn bind_held(
    path: &std::path::Path,
    mode: u32,
) -> Result<std::os::unix::net::UnixListener, BindError> {
    use std::os::unix::fs::PermissionsExt as _;
    let failed = |what| move |source| BindError::Io { what, source };
    if let Some(what) = not_a_socket(path)? {
        return Err(BindError::NotASocket(what));
    }
    match UnixStream::connect(path) {
        Ok(_) => return Err(BindError::Listening),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            std::fs::remove_file(path).map_err(failed("removing the stale socket"))?;
        }
        Err(e) => return Err(BindError::Unprobed(e)),
    }
    let l = std::os::unix::net::UnixListener::bind(path).map_err(failed("binding"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|source| {
        // Bound with another mode: nobody is to connect to it.
        let _ = std::fs::remove_file(path);
        failed("setting the socket's mode")(source)
    })?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_socket_paths_lock_is_one_holders_and_free_once_released() {
        let d = std::env::temp_dir().join(format!("memveil-sys-plock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("dir");
        let sock = d.join("s.sock");
        let a = PathLock::try_take(&sock).expect("take").expect("free");
        assert!(
            PathLock::try_take(&sock).expect("take").is_none(),
            "two holders"
        );
        // A taker that opened the file before the holder released it.
        let early = std::fs::File::open(d.join("s.sock.lock")).expect("open");
        a.release();
        assert!(
            !d.join("s.sock.lock").exists(),
            "the lock's file left behind"
        );
        let b = PathLock::try_take(&sock)
            .expect("take")
            .expect("free once released");
        // The released file's lock can be had, but guards nothing: the path
        // is b's file.
        assert!(try_lock_exclusive(early.as_fd()).expect("flock"));
        assert!(
            PathLock::try_take(&sock).expect("take").is_none(),
            "b's lock ignored"
        );
        drop(b);
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Regression: the vault removed whatever was at its socket path. Only
    /// a stale socket is replaced; anything else is refused, left as it
    /// was, with no lock file made beside it.
    #[test]
    fn bind_socket_replaces_only_a_stale_socket() {
        use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
        let d = std::env::temp_dir().join(format!("memveil-sys-bind-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("dir");
        let no_lock_beside = |p: &std::path::Path| {
            let mut l = p.as_os_str().to_owned();
            l.push(".lock");
            assert!(!std::path::Path::new(&l).exists(), "{l:?} left behind");
        };
        // A regular file, a directory, a link: refused by name, kept.
        let file = d.join("key");
        std::fs::write(&file, b"keep me").expect("write");
        let dir = d.join("dir");
        std::fs::create_dir(&dir).expect("mkdir");
        let link = d.join("link");
        std::os::unix::fs::symlink(&file, &link).expect("symlink");
        for (p, what) in [
            (&file, "a regular file"),
            (&dir, "a directory"),
            (&link, "a symbolic link"),
        ] {
            match bind_socket(p, 0o600) {
                Err(BindError::NotASocket(w)) => assert_eq!(w, what),
                other => panic!("{}: {other:?}", p.display()),
            }
            no_lock_beside(p);
        }
        assert_eq!(std::fs::read(&file).expect("kept"), b"keep me");
        assert!(dir.is_dir());
        assert!(std::fs::symlink_metadata(&link)
            .expect("kept")
            .file_type()
            .is_symlink());
        // A live socket (bound without the lock) is refused and still answers.
        let live = d.join("live.sock");
        let other = std::os::unix::net::UnixListener::bind(&live).expect("bind");
        assert!(matches!(
            bind_socket(&live, 0o600),
            Err(BindError::Listening)
        ));
        no_lock_beside(&live);
        UnixStream::connect(&live).expect("still answers");
        drop(other);
        // Positive control: a stale socket (nobody listens) is replaced,
        // with the mode asked for; a second bind meets the lock.
        let (l, held) = bind_socket(&live, 0o600).expect("stale socket replaced");
        let m = std::fs::symlink_metadata(&live).expect("socket");
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        UnixStream::connect(&live).expect("answers");
        assert!(matches!(bind_socket(&live, 0o600), Err(BindError::Held)));
        drop(l);
        held.release();
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn an_exclusive_lock_is_refused_to_a_second_open_until_the_first_closes() {
        let p = std::env::temp_dir().join(format!("memveil-sys-lock-{}", std::process::id()));
        let a = std::fs::File::create(&p).expect("create");
        let b = std::fs::File::open(&p).expect("open");
        assert!(try_lock_exclusive(a.as_fd()).expect("lock a"));
        assert!(
            !try_lock_exclusive(b.as_fd()).expect("lock b"),
            "two holders"
        );
        drop(a);
        assert!(
            try_lock_exclusive(b.as_fd()).expect("lock b"),
            "the lock outlived its file"
        );
        let _ = std::fs::remove_file(&p);
    }

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
        assert_eq!(m2.read(8190, &mut out), Err(ShmError::OutOfBounds));
        assert_eq!(
            m2.with_mut(usize::MAX, 2, |_| ()),
            Err(ShmError::OutOfBounds)
        );
        let cred = peer_cred(&a).expect("cred");
        assert_eq!(cred.pid, i32::try_from(std::process::id()).expect("pid"));
    }

    /// Regression (issue 14): `with_mut` handed out `&mut [u8]` over any
    /// range and left "no overlapping calls" to the caller, so two lane
    /// workers could hold aliased `&mut` over bytes a client chose. Now an
    /// overlapping access is refused while the first one lives.
    #[test]
    fn overlapping_accesses_are_refused_while_a_claim_lives() {
        let fd = memfd_sealed("t", 16384).expect("memfd");
        let m = std::sync::Arc::new(SharedMap::map(fd.as_fd(), 16384).expect("map"));
        let mut c = m.claim(4096, 4096).expect("claim");
        c.bytes().fill(7);
        assert_eq!(m.claim(8191, 2).err(), Some(ShmError::Busy));
        assert_eq!(m.with_mut(0, 4097, |_| ()), Err(ShmError::Busy));
        assert_eq!(m.read(5000, &mut [0u8; 4]), Err(ShmError::Busy));
        assert_eq!(m.write(4095, &[1, 2]), Err(ShmError::Busy));
        assert_eq!(m.control(4096, 4096).err(), Some(ShmError::Busy));
        // Positive control: the neighbours on both sides are free.
        m.with_mut(0, 4096, |b| b.fill(1)).expect("left");
        m.write(8192, &[2; 16]).expect("right");
        // A claim inside the same thread's closure is refused too.
        let nested = m.with_mut(0, 64, |_| m.with_mut(32, 64, |_| ()));
        assert_eq!(nested, Ok(Err(ShmError::Busy)));
        c.write(0, b"abc").expect("claim write");
        let mut got = [0u8; 4];
        c.read(0, &mut got).expect("claim read");
        assert_eq!(&got, b"abc\x07");
        assert_eq!(c.read(4094, &mut got), Err(ShmError::OutOfBounds));
        drop(c);
        // Released: the same range can be had again, and reads may overlap.
        let mut out = [0u8; 8];
        m.read(4096, &mut out).expect("read after release");
        assert_eq!(&out, b"abc\x07\x07\x07\x07\x07");
        let ctl = m.control(12288, 4096).expect("control");
        assert!(ctl.word(2).is_none() && ctl.word(4096).is_none());
        ctl.word(0)
            .expect("word")
            .store(9, std::sync::atomic::Ordering::SeqCst);
        ctl.write(8, &[1, 2, 3, 4]).expect("control write");
        assert_eq!(ctl.write(9, &[1, 2, 3, 4]), Err(ShmError::Misaligned));
        let mut w = [0u8; 12];
        ctl.read(0, &mut w).expect("control read");
        assert_eq!(w, [9, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]);
        assert_eq!(m.read(12280, &mut [0u8; 16]), Err(ShmError::Busy));
        assert_eq!(m.control(12288, 4).err(), Some(ShmError::Busy));
        drop(ctl);
        m.read(12280, &mut [0u8; 16]).expect("free again");
    }

    #[test]
    fn plain_files_have_no_seals() {
        let f = std::fs::File::open("/proc/self/status").expect("open");
        assert!(seals(f.as_fd()).is_err());
    }
}
