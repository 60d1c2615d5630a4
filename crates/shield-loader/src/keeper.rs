//! The keeper: a small process that answers the filter's notifications for
//! the program's children once the program has ended.
//!
//! A child the program starts with `posix_spawn` or Go's `os/exec` (a clone
//! with `CLONE_VM`, then `execve`) inherits the loader's seccomp filter:
//! its `mmap`, `brk`, `mprotect`, `execve`, forks... are notified. While the
//! program lives the agent lets them through (`CONTINUE`: they are not the
//! region's to serve). Once the loader's last thread has gone the listener
//! would close, and the kernel fails every notified call of the children
//! still running with ENOSYS (`seccomp_notify_detach`): a daemon the program
//! started and left behind could no longer allocate nor fork.
//!
//! So, before any thread exists, the loader opens a pidfd on itself and a
//! socket pair and double-forks the keeper (not a child of the program: a
//! program that waits for all its children would reap it or wait on it).
//! The keeper names itself `memveil-keeper` (`memveil run` leaves it out of
//! the processes "left running"), starts a session of its own (a Ctrl-C at
//! the terminal is meant for the program's children, which end and so end
//! it), closes every descriptor but its socket and the pidfd (the program's
//! stdout pipe must close when the program's users of it do), receives the
//! listener, and waits until the pidfd says the loader has ended. Only then
//! does it receive: a `CONTINUE` to the program's own `mmap` would place
//! the mapping outside the protected region. From then on it lets every
//! call through, and ends when poll reports `POLLHUP` with nothing to read:
//! no task uses the filter any more (`seccomp_notify_poll`: the filter's
//! `users` dropped to 0, when the last task that had it is released).
//!
//! One notification can be left between the two: the agent received it
//! (the kernel marks it sent) and was killed with the program before it
//! answered. Its caller would then wait for ever (received notifications
//! wait killable only). The agent writes the id of each notification it
//! receives into a page shared with the keeper ([`Seen`]); ids are handed
//! out in order and received in order (FIFO), so the one left is at or a
//! little after the last id written: once the loader is gone, while poll
//! says a received notification awaits its answer (`POLLOUT`), the keeper
//! answers ids from there on (`CONTINUE`; an id that is not a sent
//! notification fails harmlessly).

use std::os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};

/// The name the keeper gives itself (`/proc/PID/comm`).
const NAME: &std::ffi::CStr = c"memveil-keeper";

/// How far past the last id the agent wrote the keeper looks for a
/// notification left unanswered (ids between are those of calls whose
/// caller was interrupted before they were received).
const SCAN: u64 = 1 << 16;

/// The page the agent writes the ids it receives into, shared with the
/// keeper (`MAP_SHARED`: the keeper's copy is the same memory).
#[repr(C)]
pub struct Seen {
    /// The id of the last notification the agent received.
    id: AtomicU64,
    /// 1 once `id` holds one.
    set: AtomicU64,
}

impl Seen {
    /// Records that the agent received notification `id`.
    pub fn record(&self, id: u64) {
        self.id.store(id, Ordering::Release);
        self.set.store(1, Ordering::Release);
    }

    fn last(&self) -> Option<u64> {
        (self.set.load(Ordering::Acquire) == 1).then(|| self.id.load(Ordering::Acquire))
    }
}

/// Where the agent records ids when no keeper runs.
static NO_KEEPER: Seen = Seen {
    id: AtomicU64::new(0),
    set: AtomicU64::new(0),
};

/// The loader's side of a started keeper.
pub struct Keeper {
    sock: UnixStream,
    seen: &'static Seen,
    /// The child that forked the keeper and exited (0: the keeper was
    /// forked; 1: that fork failed).
    intermediate: libc::pid_t,
}

/// A shared anonymous page holding a [`Seen`]; never unmapped.
fn shared_page() -> std::io::Result<&'static Seen> {
    // SAFETY: a fresh anonymous shared mapping of one page, at an address
    // the kernel picks; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the page is zero-filled, page-aligned and larger than `Seen`
    // (two atomics, for which all-zero is a valid value); it stays mapped
    // for the rest of the process's life, so `'static` holds.
    Ok(unsafe { &*p.cast::<Seen>() })
}

impl Keeper {
    /// Starts the keeper (see the module's documentation).
    ///
    /// # Safety
    /// Called while the process has a single thread (it forks, and the
    /// forked processes run on without `exec`).
    ///
    /// # Errors
    /// What could not be had: a pidfd (Linux 5.3+), a socket pair, a
    /// shared page, a fork.
    pub unsafe fn start() -> Result<Keeper, String> {
        let pidfd = memveil_sys::process::PidFd::open(std::process::id())
            .map_err(|e| format!("no pidfd on this process: {e}"))?
            .ok_or("no pidfd on this process")?;
        let seen = shared_page().map_err(|e| format!("cannot map a shared page: {e}"))?;
        let (ours, theirs) =
            UnixStream::pair().map_err(|e| format!("cannot create a socket pair: {e}"))?;
        // SAFETY: a single thread (the caller's promise): the children run
        // on in a consistent copy of this process; they call only
        // async-signal-safe functions and `_exit`.
        let first = unsafe { libc::fork() };
        if first < 0 {
            return Err(format!("fork: {}", std::io::Error::last_os_error()));
        }
        if first == 0 {
            // SAFETY: as above; the keeper is a grandchild, reparented
            // once this intermediate child exits.
            unsafe {
                // Named before the second fork: the keeper bears the name
                // from its first instant (memveil run tells it by it, maybe
                // before it has run at all).
                libc::prctl(libc::PR_SET_NAME, NAME.as_ptr(), 0, 0, 0);
                match libc::fork() {
                    0 => serve(theirs.as_raw_fd(), pidfd.as_fd().as_raw_fd(), seen),
                    k if k < 0 => libc::_exit(1),
                    _ => libc::_exit(0),
                }
            }
        }
        drop(theirs);
        drop(pidfd);
        // The intermediate child is reaped in `hand`, by when it has long
        // ended: waiting for it here cost `memveil run` of a short static
        // program about 1 ms (14% of /bin/true's run).
        Ok(Keeper {
            sock: ours,
            seen,
            intermediate: first,
        })
    }

    /// Where the agent records the ids it receives.
    pub fn seen(&self) -> &'static Seen {
        self.seen
    }

    /// Reaps the intermediate child, then hands the keeper the filter's
    /// listener; the loader's end of the socket closes with `self`.
    ///
    /// # Errors
    /// The keeper could not be forked, or `sendmsg(2)` failed (it died).
    pub fn hand(self, listener: BorrowedFd<'_>) -> Result<(), String> {
        let mut status = 0;
        // SAFETY: waits for this process's own child, forked in `start`,
        // with a status word this frame owns.
        while unsafe { libc::waitpid(self.intermediate, &mut status, 0) } < 0 {
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                break;
            }
        }
        if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 1 {
            return Err("its fork failed".to_owned());
        }
        memveil_sys::ipc::send_with_fd(&self.sock, &[std::io::IoSlice::new(b"L")], listener)
            .map(|_| ())
            .map_err(|e| format!("it ended before it had the listener: {e}"))
    }
}

/// Where the agent records ids when [`Keeper::start`] failed.
pub fn no_keeper() -> &'static Seen {
    &NO_KEEPER
}

/// Closes every descriptor but `a` and `b`.
fn close_all_but(a: RawFd, b: RawFd) {
    let (lo, hi) = (a.min(b), a.max(b));
    let close = |from: RawFd, to: RawFd| {
        if let (Ok(from), Ok(to)) = (u32::try_from(from), u32::try_from(to)) {
            if from <= to {
                // SAFETY: close_range takes integers; the descriptors in
                // the range belong to this process and nothing here uses
                // them again.
                unsafe { libc::syscall(libc::SYS_close_range, from, to, 0) };
            }
        }
    };
    close(0, lo - 1);
    close(lo + 1, hi - 1);
    if let Ok(from) = u32::try_from(hi + 1) {
        // SAFETY: as above, up to the last possible descriptor.
        unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0) };
    }
}

/// `poll(2)` of one descriptor; the events seen (0 on timeout).
fn poll_one(fd: RawFd, events: libc::c_short, timeout_ms: libc::c_int) -> libc::c_short {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    loop {
        // SAFETY: one pollfd this frame owns.
        let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        if r >= 0 {
            return if r == 0 { 0 } else { p.revents };
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return libc::POLLERR;
        }
    }
}

/// Lets notification `id` go on (`SECCOMP_USER_NOTIF_FLAG_CONTINUE`);
/// whether the kernel took the answer.
fn let_through(listener: RawFd, id: u64) -> bool {
    // SAFETY: all-zero is a valid seccomp_notif_resp (plain integers).
    let mut r: libc::seccomp_notif_resp = unsafe { std::mem::zeroed() };
    r.id = id;
    r.flags = u32::try_from(libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE).unwrap_or(1);
    // SAFETY: SEND reads `r`, which lives across the call.
    unsafe { libc::ioctl(listener, libc::SECCOMP_IOCTL_NOTIF_SEND, &r) == 0 }
}

/// The keeper's life (see the module's documentation); never returns.
/// Only async-signal-safe calls, no allocation.
fn serve(sock: RawFd, pidfd: RawFd, seen: &'static Seen) -> ! {
    // SAFETY: setsid and chdir with a NUL-terminated path.
    unsafe {
        libc::setsid();
        libc::chdir(c"/".as_ptr());
    }
    close_all_but(sock, pidfd);
    // SAFETY: `sock` is this process's own open socket, owned from here
    // on by this frame.
    let stream =
        UnixStream::from(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(sock) });
    let mut byte = [0u8; 1];
    let listener = match memveil_sys::ipc::recv_with_fd(&stream, &mut byte) {
        Ok((_, Some(fd))) => fd,
        // The loader ended (or refused the program) before it had one.
        _ => exit(),
    };
    drop(stream);
    let fd = listener.as_raw_fd();
    // Until the loader's last thread has gone, the agent serves.
    while poll_one(pidfd, libc::POLLIN, -1) & (libc::POLLIN | libc::POLLERR | libc::POLLNVAL) == 0 {
    }
    // SAFETY: the pidfd is this process's own and not used again.
    unsafe { libc::close(pidfd) };
    if let Some(last) = seen.last() {
        let mut id = last;
        while id.wrapping_sub(last) < SCAN && poll_one(fd, libc::POLLOUT, 0) & libc::POLLOUT != 0 {
            for _ in 0..64 {
                let _ = let_through(fd, id);
                id = id.wrapping_add(1);
            }
        }
    }
    loop {
        let ev = poll_one(fd, libc::POLLIN, -1);
        if ev & libc::POLLIN != 0 {
            // SAFETY: all-zero is a valid seccomp_notif; RECV requires it
            // zeroed.
            let mut n: libc::seccomp_notif = unsafe { std::mem::zeroed() };
            // SAFETY: RECV fills `n`, which lives across the call.
            if unsafe { libc::ioctl(fd, libc::SECCOMP_IOCTL_NOTIF_RECV, &mut n) } == 0 {
                // ENOENT: the caller died meanwhile; nothing to do.
                let _ = let_through(fd, n.id);
            }
        } else if ev & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
            exit();
        }
    }
}

fn exit() -> ! {
    // SAFETY: _exit ends this process without the loader's destructors or
    // atexit handlers (they are the loader's).
    unsafe { libc::_exit(0) }
}
