//! userfaultfd(2): page faults on registered ranges delivered to a handler
//! thread, which resolves them with `UFFDIO_COPY`, moves pages out with
//! `UFFDIO_MOVE` (Linux 6.8+) or write-protects them (`UFFDIO_WRITEPROTECT`,
//! Linux 5.7+ for anonymous memory).
//!
//! Also the direct (system-call, not PLT) forms of `mmap`, `munmap`,
//! `madvise` and `mincore`: a preload library that interposes those symbols
//! must still reach the kernel for its own bookkeeping memory.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

const UFFD_API: u64 = 0xAA;

/// Register mode: faults on pages with no page table entry.
pub const MODE_MISSING: u64 = 1;
/// Register mode: write faults on write-protected pages.
pub const MODE_WP: u64 = 2;

/// API feature: write-protect faults are reported (anonymous memory).
pub const FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
/// API feature: a `fork` of a process whose ranges are registered keeps
/// them registered in the child, with a new descriptor handed to the
/// reader of this one ([`Message::Fork`]). Needs `CAP_SYS_PTRACE`.
pub const FEATURE_EVENT_FORK: u64 = 1 << 1;
/// API feature: missing faults on shared memory (shmem, 4.11+).
pub const FEATURE_MISSING_SHMEM: u64 = 1 << 5;
/// API feature: write-protection of shared memory (shmem, 5.19+).
pub const FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
/// API feature: fault messages carry the faulting thread's id (4.14+).
pub const FEATURE_THREAD_ID: u64 = 1 << 8;
/// API feature: `UFFDIO_MOVE` (Linux 6.8+).
pub const FEATURE_MOVE: u64 = 1 << 16;

/// Fault flag: the access was a write.
pub const PAGEFAULT_FLAG_WRITE: u64 = 1;
/// Fault flag: the fault is a write-protect fault.
pub const PAGEFAULT_FLAG_WP: u64 = 2;

const EVENT_PAGEFAULT: u8 = 0x12;
const EVENT_FORK: u8 = 0x13;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;

const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (UFFD_API << 8) | nr
}
const IOC_RW: u64 = 3;
const IOC_R: u64 = 2;

#[repr(C)]
#[derive(Default)]
struct Api {
    api: u64,
    features: u64,
    ioctls: u64,
}
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Range {
    start: u64,
    len: u64,
}
#[repr(C)]
#[derive(Default)]
struct Register {
    range: Range,
    mode: u64,
    ioctls: u64,
}
#[repr(C)]
#[derive(Default)]
struct Copy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}
#[repr(C)]
#[derive(Default)]
struct WriteProtect {
    range: Range,
    mode: u64,
}
#[repr(C)]
#[derive(Default)]
struct Move {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    moved: i64,
}

const UFFDIO_API: u64 = ioc(IOC_RW, 0x3F, std::mem::size_of::<Api>());
const UFFDIO_REGISTER: u64 = ioc(IOC_RW, 0x00, std::mem::size_of::<Register>());
const UFFDIO_UNREGISTER: u64 = ioc(IOC_R, 0x01, std::mem::size_of::<Range>());
const UFFDIO_WAKE: u64 = ioc(IOC_R, 0x02, std::mem::size_of::<Range>());
const UFFDIO_COPY: u64 = ioc(IOC_RW, 0x03, std::mem::size_of::<Copy>());
const UFFDIO_MOVE: u64 = ioc(IOC_RW, 0x05, std::mem::size_of::<Move>());
const UFFDIO_WRITEPROTECT: u64 = ioc(IOC_RW, 0x06, std::mem::size_of::<WriteProtect>());
/// `USERFAULTFD_IOC_NEW` on `/dev/userfaultfd` (`_IO(0xAA, 0x00)`).
const USERFAULTFD_IOC_NEW: u64 = UFFD_API << 8;

/// One fault reported by the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// Faulting address (page-aligned unless the kernel reports exact addresses).
    pub address: u64,
    /// `PAGEFAULT_FLAG_*` bits.
    pub flags: u64,
    /// The faulting thread's id, with [`FEATURE_THREAD_ID`]; 0 without.
    pub tid: u32,
}

/// A message from a descriptor handshaken with [`FEATURE_EVENT_FORK`].
#[derive(Debug)]
pub enum Message {
    /// A page fault.
    Fault(Fault),
    /// A registered process forked: the descriptor of the child's ranges.
    Fork(Uffd),
}

/// Raw `struct uffd_msg` (32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Msg {
    event: u8,
    _r1: u8,
    _r2: u16,
    _r3: u32,
    arg0: u64,
    arg1: u64,
    arg2: u64,
}

impl Msg {
    /// The page fault this message reports, if it is one.
    fn fault(&self) -> Option<Fault> {
        (self.event == EVENT_PAGEFAULT).then(|| Fault {
            flags: self.arg0,
            address: self.arg1,
            // `feat.ptid`, the first 32 bits of the union.
            tid: u32::try_from(self.arg2 & 0xffff_ffff).unwrap_or(0),
        })
    }
}

/// How a userfaultfd was obtained, for reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The `userfaultfd(2)` system call.
    Syscall,
    /// `/dev/userfaultfd` (Linux 6.1+), for users granted access to the node.
    DevNode,
}

/// Why no userfaultfd handling kernel faults could be created.
#[derive(Debug)]
pub struct OpenError {
    /// Error of the `userfaultfd(2)` system call.
    pub syscall: io::Error,
    /// Error opening `/dev/userfaultfd`.
    pub dev: io::Error,
    /// Whether a user-mode-only descriptor would have been allowed (it cannot
    /// serve faults taken inside system calls, so it is not used).
    pub user_mode_only_allowed: bool,
}

/// An owned userfaultfd (non-blocking, close-on-exec).
#[derive(Debug)]
pub struct Uffd {
    /// Held high, out of the way of a program closing or replacing
    /// descriptors by number (`crate::fdguard`).
    fd: crate::fdguard::Held,
    origin: Origin,
}

fn cvt(r: libc::c_long) -> io::Result<libc::c_long> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn ioctl<T>(fd: RawFd, req: u64, arg: &mut T) -> io::Result<()> {
    // SAFETY: every `req` used in this module is a userfaultfd ioctl whose
    // argument is exactly the `#[repr(C)]` struct `T` passed here by
    // exclusive reference; the kernel reads and writes only that struct.
    let r = unsafe { libc::ioctl(fd, req as libc::c_ulong, std::ptr::from_mut(arg)) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Bytes a run-ioctl (`UFFDIO_COPY`, `UFFDIO_MOVE`) handled: the whole
/// `len` on success, else the count the kernel wrote back (negative when
/// it handled nothing: the error itself).
fn done_bytes(r: &io::Result<()>, reported: i64, len: u64) -> u64 {
    match r {
        Ok(()) => len,
        Err(_) => u64::try_from(reported).unwrap_or(0).min(len),
    }
}

impl Uffd {
    /// Opens a userfaultfd that also receives faults taken by the kernel on
    /// behalf of this process (inside `read(2)`, `write(2)`, ...): the system
    /// call first, then `/dev/userfaultfd`.
    ///
    /// # Errors
    /// Both ways refused: with `vm.unprivileged_userfaultfd=0` the system call
    /// needs `CAP_SYS_PTRACE`, and `/dev/userfaultfd` needs access to the node.
    pub fn open() -> Result<Self, OpenError> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: userfaultfd takes one flags argument and returns a new fd.
        let r = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
        let syscall = match cvt(r) {
            Ok(fd) => return Ok(Self::own(fd, Origin::Syscall)),
            Err(e) => e,
        };
        let dev = match Self::open_dev(flags) {
            Ok(fd) => return Ok(Self::own(fd, Origin::DevNode)),
            Err(e) => e,
        };
        // SAFETY: as above; the probe descriptor is closed at once.
        let r = unsafe { libc::syscall(libc::SYS_userfaultfd, flags | UFFD_USER_MODE_ONLY) };
        let user_mode_only_allowed = match cvt(r) {
            Ok(fd) => {
                drop(Self::own(fd, Origin::Syscall));
                true
            }
            Err(_) => false,
        };
        Err(OpenError {
            syscall,
            dev,
            user_mode_only_allowed,
        })
    }

    /// Features the running kernel offers, from a throw-away descriptor
    /// (the handshake can be done once per descriptor, and asking for an
    /// unknown feature fails it).
    ///
    /// # Errors
    /// As [`Uffd::open`] (the syscall error) and [`Uffd::handshake`].
    pub fn offered_features() -> io::Result<u64> {
        let probe = Self::open().map_err(|e| e.syscall)?;
        probe.handshake(0)
    }

    fn open_dev(flags: libc::c_int) -> io::Result<libc::c_long> {
        let node = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/userfaultfd")?;
        // SAFETY: USERFAULTFD_IOC_NEW takes the flags as its integer argument
        // and returns a new descriptor.
        let r = unsafe {
            libc::ioctl(
                node.as_raw_fd(),
                USERFAULTFD_IOC_NEW as libc::c_ulong,
                libc::c_long::from(flags),
            )
        };
        cvt(libc::c_long::from(r))
    }

    fn own(fd: libc::c_long, origin: Origin) -> Self {
        let fd = RawFd::try_from(fd).unwrap_or(-1);
        // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Self {
            fd: crate::fdguard::move_high(fd),
            origin,
        }
    }

    /// How the descriptor was obtained.
    #[must_use]
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// The `UFFDIO_API` handshake: asks for `features` and returns the
    /// features the kernel offers (asked or not).
    ///
    /// # Errors
    /// EINVAL when a requested feature is unknown to the kernel.
    pub fn handshake(&self, features: u64) -> io::Result<u64> {
        let mut api = Api {
            api: UFFD_API,
            features,
            ioctls: 0,
        };
        ioctl(self.fd.as_raw_fd(), UFFDIO_API, &mut api)?;
        Ok(api.features)
    }

    /// Registers `[start, start+len)` for the `MODE_*` bits in `mode`.
    ///
    /// # Errors
    /// EINVAL for ranges that are not page-aligned anonymous private memory;
    /// EBUSY when another userfaultfd already holds the range.
    pub fn register(&self, start: u64, len: u64, mode: u64) -> io::Result<()> {
        let mut r = Register {
            range: Range { start, len },
            mode,
            ioctls: 0,
        };
        ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER, &mut r)
    }

    /// Unregisters a range.
    ///
    /// # Errors
    /// EINVAL for a range not covered by mappings.
    pub fn unregister(&self, start: u64, len: u64) -> io::Result<()> {
        let mut r = Range { start, len };
        ioctl(self.fd.as_raw_fd(), UFFDIO_UNREGISTER, &mut r)
    }

    /// Wakes the threads waiting on faults in a range.
    ///
    /// # Errors
    /// EINVAL for a bad range.
    pub fn wake(&self, start: u64, len: u64) -> io::Result<()> {
        let mut r = Range { start, len };
        ioctl(self.fd.as_raw_fd(), UFFDIO_WAKE, &mut r)
    }

    /// Atomically fills the missing pages at `dst` with `src.len()` bytes
    /// and wakes the threads waiting on them.
    ///
    /// # Errors
    /// EEXIST when a page is already present (the fault was resolved
    /// meanwhile); EAGAIN when the mappings changed under the call.
    pub fn copy(&self, dst: u64, src: &[u8]) -> io::Result<()> {
        self.copy_run(dst, src, true).1
    }

    /// [`Uffd::copy`] of a run of pages, waking the waiters only with
    /// `wake`. Returns the bytes copied (all of `src` on success; on an
    /// error, the pages before the one that failed) and the outcome.
    pub fn copy_run(&self, dst: u64, src: &[u8], wake: bool) -> (u64, io::Result<()>) {
        let len = src.len() as u64;
        let mut c = Copy {
            dst,
            src: src.as_ptr() as u64,
            len,
            mode: u64::from(!wake), // UFFDIO_COPY_MODE_DONTWAKE
            copy: 0,
        };
        let r = ioctl(self.fd.as_raw_fd(), UFFDIO_COPY, &mut c);
        (done_bytes(&r, c.copy, len), r)
    }

    /// Moves the pages at `src` to the missing pages at `dst` (both in this
    /// address space, `dst` registered here): afterwards `src` is missing.
    /// With `wake`, the threads waiting on `dst` are woken.
    ///
    /// # Errors
    /// EBUSY when a page is shared (after fork) or pinned; EEXIST when `dst`
    /// is present; ENOTTY/EINVAL on kernels older than 6.8.
    pub fn move_pages(&self, dst: u64, src: u64, len: u64, wake: bool) -> io::Result<()> {
        self.move_run(dst, src, len, wake).1
    }

    /// [`Uffd::move_pages`] returning also the bytes moved: all of `len` on
    /// success; on an error, the pages moved before the one that failed
    /// (one call moves a whole run, so a caller must know where it stopped).
    pub fn move_run(&self, dst: u64, src: u64, len: u64, wake: bool) -> (u64, io::Result<()>) {
        let mut m = Move {
            dst,
            src,
            len,
            mode: u64::from(!wake), // UFFDIO_MOVE_MODE_DONTWAKE
            moved: 0,
        };
        let r = ioctl(self.fd.as_raw_fd(), UFFDIO_MOVE, &mut m);
        (done_bytes(&r, m.moved, len), r)
    }

    /// Sets (`wp`) or clears write protection on a range; clearing wakes the
    /// waiting writers.
    ///
    /// # Errors
    /// EINVAL when the range was not registered with `MODE_WP`.
    pub fn write_protect(&self, start: u64, len: u64, wp: bool) -> io::Result<()> {
        let mut w = WriteProtect {
            range: Range { start, len },
            mode: u64::from(wp),
        };
        ioctl(self.fd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut w)
    }

    /// Reads pending fault messages into `out`; returns how many were read,
    /// 0 at once when none is pending (the descriptor is non-blocking).
    /// Events other than page faults are not requested, so none are
    /// returned.
    ///
    /// # Errors
    /// The error of `read(2)` other than EAGAIN and EINTR.
    pub fn read_faults(&self, out: &mut [Fault]) -> io::Result<usize> {
        let mut msgs = [Msg::default(); 64];
        let want = out.len().min(msgs.len());
        let n = self.read_raw(&mut msgs[..want])?;
        let mut k = 0;
        for m in &msgs[..n] {
            if let Some(f) = m.fault() {
                out[k] = f;
                k += 1;
            }
        }
        Ok(k)
    }

    /// Reads pending raw messages into `msgs`; 0 when none is pending.
    fn read_raw(&self, msgs: &mut [Msg]) -> io::Result<usize> {
        let bytes = std::mem::size_of_val(msgs);
        // SAFETY: `msgs` is a writable buffer of `bytes` bytes of
        // plain-old-data structs for which every bit pattern is valid.
        let r = unsafe { libc::read(self.fd.as_raw_fd(), msgs.as_mut_ptr().cast(), bytes) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) {
                Ok(0)
            } else {
                Err(e)
            };
        }
        Ok(usize::try_from(r).unwrap_or(0) / std::mem::size_of::<Msg>())
    }

    /// Reads pending messages, fork events included (see
    /// [`FEATURE_EVENT_FORK`]), and hands each to `f`; returns how many.
    /// Returns 0 at once when none is pending (non-blocking descriptor).
    /// Allocates nothing: a handler may run this while another thread of
    /// its process is inside `fork`, holding the C library's allocator.
    ///
    /// # Errors
    /// The error of `read(2)` other than EAGAIN and EINTR.
    pub fn read_messages(&self, mut f: impl FnMut(Message)) -> io::Result<usize> {
        let mut msgs = [Msg::default(); 16];
        let n = self.read_raw(&mut msgs)?;
        for m in &msgs[..n] {
            match m.event {
                EVENT_PAGEFAULT => f(Message::Fault(m.fault().unwrap_or(Fault {
                    address: 0,
                    flags: 0,
                    tid: 0,
                }))),
                // `arg.fork.ufd` (a u32 in the union): a descriptor the
                // kernel has just installed in this process for the reader.
                EVENT_FORK => {
                    let fd = m.arg0 & 0xffff_ffff;
                    if let Ok(fd) = libc::c_long::try_from(fd) {
                        f(Message::Fork(Self::own(fd, self.origin)));
                    }
                }
                _ => {}
            }
        }
        Ok(n)
    }

    /// The descriptor number (for a child that must close an inherited
    /// descriptor it can never drop).
    #[must_use]
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Whether a fault message is waiting to be read (`poll(2)` with no
    /// wait): a watchdog's view of a handler that has fallen behind. The
    /// descriptor is non-blocking, so `poll` answers it (the kernel answers
    /// every `poll` of a blocking userfaultfd with `POLLERR`; the handler
    /// once made its descriptor blocking and had to read the count from the
    /// descriptor's `fdinfo` instead, 3.5-4.3 us a time here against 0.6).
    #[must_use]
    pub fn pending(&self) -> bool {
        let mut fd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `fd` is one valid pollfd struct.
        let r = unsafe { libc::poll(&mut fd, 1, 0) };
        r > 0 && fd.revents & libc::POLLIN != 0
    }

    /// Waits up to `timeout_ms` (-1: forever) until a message is pending or
    /// `extra` (another descriptor, e.g. an eventfd) is readable.
    ///
    /// # Errors
    /// The error of `poll(2)` other than EINTR.
    pub fn wait(&self, extra: Option<RawFd>, timeout_ms: i32) -> io::Result<()> {
        let mut fds = [
            libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: extra.unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfd structs.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        Ok(())
    }
}

/// Maps `len` bytes of anonymous private read-write memory with the
/// `mmap` system call itself (bypassing any interposed `mmap`), with
/// `MAP_NORESERVE`. Returns the base address.
///
/// # Errors
/// The error of `mmap(2)`.
pub fn map_anonymous_direct(len: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh anonymous mapping at an address of the kernel's
    // choosing overlaps no existing object.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mmap,
            0usize,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    let r = cvt(r)?;
    Ok(usize::try_from(r).unwrap_or(0) as *mut u8)
}

/// An anonymous private read-write mapping made with the `mmap` system call
/// itself ([`map_anonymous_direct`]: no interposed `mmap` sees it), unmapped
/// when dropped.
pub struct DirectMap {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by the value, with no thread affinity.
unsafe impl Send for DirectMap {}

impl DirectMap {
    /// Maps `len` bytes (see [`map_anonymous_direct`]).
    ///
    /// # Errors
    /// The error of `mmap(2)`.
    pub fn new(len: usize) -> io::Result<Self> {
        Ok(Self {
            ptr: map_anonymous_direct(len)?,
            len,
        })
    }

    /// Base address of the mapping.
    #[must_use]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping has no bytes (never: `mmap` refuses a length of 0).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The mapping's bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a mapping of `len` bytes owned by this value, and
        // `&mut self` makes this slice the only access to it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for DirectMap {
    fn drop(&mut self) {
        // SAFETY: the mapping is owned by this value, and no slice of it
        // outlives the borrow of the value that made it.
        let _ = unsafe { unmap_direct(self.ptr, self.len) };
    }
}

/// `munmap(2)` by system call.
///
/// # Safety
/// No live Rust object may be in `[addr, addr+len)`, and nothing may use the
/// range afterwards.
pub unsafe fn unmap_direct(addr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: the caller promises the range is no longer used.
    cvt(unsafe { libc::syscall(libc::SYS_munmap, addr, len) }).map(drop)
}

/// `madvise(2)` by system call.
///
/// # Safety
/// For destructive advice (`MADV_DONTNEED`, `MADV_FREE`, `MADV_REMOVE`), the
/// caller owns the range and accepts that its contents become zero.
pub unsafe fn madvise_direct(addr: *mut u8, len: usize, advice: libc::c_int) -> io::Result<()> {
    // SAFETY: the caller promises the advice is acceptable for the range.
    cvt(unsafe { libc::syscall(libc::SYS_madvise, addr, len, advice) }).map(drop)
}

/// `mprotect(2)` by system call.
///
/// # Safety
/// The caller owns the range and no code relies on the old protection.
pub unsafe fn mprotect_direct(addr: *mut u8, len: usize, prot: libc::c_int) -> io::Result<()> {
    // SAFETY: the caller promises the range is theirs to protect.
    cvt(unsafe { libc::syscall(libc::SYS_mprotect, addr, len, prot) }).map(drop)
}

/// `mmap(2)` by system call with all its arguments, returning the raw result
/// (an address, or a negated errno as the kernel returns it through libc's
/// `syscall`: -1 with errno set).
///
/// # Safety
/// As `mmap(2)`: with `MAP_FIXED` the caller owns the replaced range.
pub unsafe fn mmap_direct(
    addr: *mut libc::c_void,
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: libc::c_int,
    off: libc::off_t,
) -> *mut libc::c_void {
    // SAFETY: the caller promises what mmap(2) requires.
    let r = unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off) };
    if r < 0 {
        libc::MAP_FAILED
    } else {
        usize::try_from(r).unwrap_or(0) as *mut libc::c_void
    }
}

/// Which of the pages of `[addr, addr+len)` are resident (`mincore(2)`), one
/// byte per page (bit 0 set when resident) written to `out`.
///
/// # Errors
/// ENOMEM when part of the range is not mapped; `InvalidInput` when `out`
/// is too short.
pub fn resident_pages(addr: usize, len: usize, out: &mut [u8]) -> io::Result<()> {
    if out.len() < len.div_ceil(crate::page_size()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "mincore vector too short",
        ));
    }
    // SAFETY: `out` has one writable byte per page of the range (checked).
    cvt(unsafe { libc::syscall(libc::SYS_mincore, addr, len, out.as_mut_ptr()) }).map(drop)
}

/// Maps `len` bytes for a thread stack with the `mmap` system call itself:
/// private (a forked child gets its own copy, as the C library expects of
/// every thread's control block), locked in RAM when `RLIMIT_MEMLOCK`
/// allows (best effort), and left out of core dumps.
///
/// Locked as its pages are first touched (`MLOCK_ONFAULT`), not populated
/// at once: a page the thread never reaches holds nothing to keep from
/// swap, and one it reaches is locked from its first fault on. `mlock`
/// populated every page of the shield's four 256 KiB stacks at each
/// start (1 MiB zeroed, about 1.5 ms of a `memveil run`'s start here,
/// `perf record` 2026-11-28), where the threads use a few pages each.
///
/// # Errors
/// The error of `mmap(2)`.
pub fn map_stack_direct(len: usize) -> io::Result<*mut u8> {
    let p = map_anonymous_direct(len)?;
    // SAFETY: advice and locking on the fresh mapping just made; neither
    // changes its contents.
    unsafe {
        if libc::syscall(libc::SYS_mlock2, p, len, libc::MLOCK_ONFAULT) != 0 {
            // A kernel before 4.4: lock it whole.
            let _ = libc::syscall(libc::SYS_mlock, p, len);
        }
        let _ = madvise_direct(p, len, libc::MADV_DONTDUMP);
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fault waiting on the descriptor shows (the watchdog's question;
    /// it did not when the handler made the descriptor blocking: `poll`
    /// says `POLLERR` on such a descriptor).
    #[test]
    fn a_userfaultfd_says_when_a_fault_waits() {
        let u = match Uffd::open() {
            Ok(u) => u,
            Err(e) => {
                memveil_testkit::skip(memveil_testkit::Need::Userfaultfd, e.syscall);
                return;
            }
        };
        u.handshake(0).expect("UFFDIO_API");
        let page = 4096usize;
        let mem = map_anonymous_direct(page).expect("mmap");
        let at = mem as u64;
        u.register(at, page as u64, MODE_MISSING).expect("register");
        assert!(!u.pending(), "nothing faulted yet");
        let addr = mem as usize;
        // SAFETY: a read of the page just mapped; it blocks in its fault
        // until the range is unregistered below, then reads a zero.
        let t = std::thread::spawn(move || unsafe { std::ptr::read_volatile(addr as *const u8) });
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut seen = false;
        while std::time::Instant::now() < end {
            if u.pending() {
                seen = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Unregistering wakes the faulting thread, whose read then finds a
        // zero page.
        u.unregister(at, page as u64).expect("unregister");
        assert_eq!(t.join().expect("reader"), 0);
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(mem.cast(), page) };
        assert!(
            seen,
            "a fault waited 10 s on the userfaultfd and pending() never said so"
        );
    }
}
