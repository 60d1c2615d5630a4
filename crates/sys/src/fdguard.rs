//! The shield's own descriptors inside a protected program, kept out of the
//! program's way: its userfaultfd, the page-key file, the host's ledger, the
//! loader's seccomp listener.
//!
//! A program that closes every descriptor it did not open (`closefrom(3)`,
//! `close_range(3, ~0U, 0)`: daemons and sandboxes do) or `dup2`s onto a
//! number it believes free closed the shield's userfaultfd with them: its
//! ranges were unregistered, evicted pages then read back as zeros, and the
//! program went on with corrupted data. So the shield's descriptors live
//! high ([`move_high`]: the top [`RESERVE`] numbers below
//! `min(RLIMIT_NOFILE, 1024)`, where the lowest-free rule of `open` does
//! not reach until a program holds about a thousand descriptors), they are
//! [`hold`]en in a process-wide set, and the calls that close or replace
//! descriptors by number skip them: the preload library wraps `close`,
//! `close_range`, `closefrom`, `dup2` and `dup3`, the loader's seccomp
//! filter hands those calls on held numbers to its agent. To the program a
//! held number looks closed, as it would be plainly: `close` and `dup2`
//! onto it fail with `EBADF`.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd as _, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// Numbers kept for the shield below the placement limit.
pub const RESERVE: RawFd = 64;
/// The placement limit when `RLIMIT_NOFILE` allows more: the kernel grows
/// a process's descriptor table up to the highest number in use, so the
/// numbers stay within a table a program of a thousand descriptors has.
const CEILING: RawFd = 1024;
/// Held descriptors at most (a program holds a handful: userfaultfd, key
/// file, ledger, listener).
const SLOTS: usize = 32;

static HELD: [AtomicI32; SLOTS] = [const { AtomicI32::new(-1) }; SLOTS];
/// The lowest number ever held: below it nothing is (one load on the
/// program's every `close`).
static LOWEST: AtomicI32 = AtomicI32::new(RawFd::MAX);
/// Whether a full set has been reported.
static SAID_FULL: AtomicBool = AtomicBool::new(false);

/// The lowest number [`move_high`] places descriptors at:
/// `min(soft RLIMIT_NOFILE, 1024) - 64` (half the limit when it is below
/// 128).
#[must_use]
pub fn base() -> RawFd {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct this frame owns.
    let limit = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 {
        RawFd::try_from(r.rlim_cur).unwrap_or(RawFd::MAX)
    } else {
        CEILING
    }
    .min(CEILING);
    if limit >= 2 * RESERVE {
        limit - RESERVE
    } else {
        limit / 2
    }
}

/// Adds `fd` to the held set; false when the set is full: the descriptor
/// is then not guarded, and stderr says so once (a program that closes it
/// loses the shield's hold on it; for the userfaultfd that ends the program
/// with exit 125, docs/shield.md "Limits").
pub fn hold(fd: RawFd) -> bool {
    if fd < 0 {
        return false;
    }
    if is_held(fd) {
        return true;
    }
    for s in &HELD {
        if s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            LOWEST.fetch_min(fd, Ordering::AcqRel);
            return true;
        }
    }
    if !SAID_FULL.swap(true, Ordering::AcqRel) {
        eprintln!(
            "memveil shield: more than {SLOTS} descriptors held; descriptor {fd} is not guarded \
             against the program closing it (further ones are not either)"
        );
    }
    false
}

/// Takes `fd` out of the held set (before the shield closes it itself).
pub fn release(fd: RawFd) {
    for s in &HELD {
        let _ = s.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// Whether the shield holds `fd`.
#[must_use]
pub fn is_held(fd: RawFd) -> bool {
    fd >= LOWEST.load(Ordering::Acquire) && HELD.iter().any(|s| s.load(Ordering::Acquire) == fd)
}

/// The held numbers in `lo..=hi`, sorted.
fn held_within(lo: RawFd, hi: RawFd) -> Vec<RawFd> {
    let mut v: Vec<RawFd> = HELD
        .iter()
        .map(|s| s.load(Ordering::Acquire))
        .filter(|&fd| fd >= 0 && fd >= lo && fd <= hi)
        .collect();
    v.sort_unstable();
    v
}

/// A descriptor the shield holds: in the held set while it lives, taken
/// out of it before it is closed.
#[derive(Debug)]
pub struct Held(OwnedFd);

impl Held {
    /// Holds `fd` where it is (inherited at a number the environment
    /// names).
    #[must_use]
    pub fn at(fd: OwnedFd) -> Self {
        hold(fd.as_raw_fd());
        Self(fd)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        release(self.0.as_raw_fd());
    }
}

impl AsRawFd for Held {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl AsFd for Held {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// A duplicate of `fd` at the lowest free number from [`base`] on, made
/// by `fcntl(cmd)` (`F_DUPFD` or `F_DUPFD_CLOEXEC`).
fn dup_from_base(fd: BorrowedFd<'_>, cmd: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: fcntl(F_DUPFD*) on a borrowed descriptor returns a new one.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), cmd, base()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

/// `fd` moved to the lowest free number from [`base`] on (close-on-exec)
/// and held; where no such number is free it stays where it is, held all
/// the same.
#[must_use]
pub fn move_high(fd: OwnedFd) -> Held {
    match dup_from_base(fd.as_fd(), libc::F_DUPFD_CLOEXEC) {
        Ok(high) => Held::at(high),
        Err(_) => Held::at(fd),
    }
}

/// Closes a held descriptor the shield is done with (taken out of the set
/// first, so the preload's `close` lets it go).
///
/// # Safety
/// Nothing may use `fd` afterwards (its number may be reused at once).
pub unsafe fn close_held(fd: RawFd) -> io::Result<()> {
    release(fd);
    // SAFETY: the caller gives up `fd`.
    if unsafe { libc::syscall(libc::SYS_close, fd) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A duplicate of `fd` at the lowest free number from [`base`] on, left
/// open across `execve` (not held: for `memveil run`, which passes the
/// page-key file and the host's ledger to the program at numbers the
/// program's own descriptors do not reach).
///
/// # Errors
/// The error of `fcntl(F_DUPFD)`.
pub fn dup_high_inheritable(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    dup_from_base(fd, libc::F_DUPFD)
}

/// `close_range(lo, hi, flags)` that leaves the held descriptors open: the
/// stretches between them are closed. With `CLOSE_RANGE_UNSHARE` the
/// caller's table is first made its own, so the held descriptors of the
/// table the shield's threads use stay open whatever it closes: passed on
/// as it is.
///
/// # Errors
/// The error of `close_range(2)`.
pub fn close_range(lo: u32, hi: u32, flags: u32) -> io::Result<()> {
    let unshare = libc::CLOSE_RANGE_UNSHARE;
    let mut from = lo;
    if flags & unshare == 0 {
        let top = RawFd::try_from(hi).unwrap_or(RawFd::MAX);
        for fd in held_within(RawFd::try_from(lo).unwrap_or(RawFd::MAX), top) {
            let fd = u32::try_from(fd).unwrap_or(0);
            if fd > from {
                raw_close_range(from, fd - 1, flags)?;
            }
            from = fd.saturating_add(1);
            if fd == u32::MAX {
                return Ok(());
            }
        }
    }
    if from <= hi {
        raw_close_range(from, hi, flags)?;
    }
    Ok(())
}

fn raw_close_range(lo: u32, hi: u32, flags: u32) -> io::Result<()> {
    // SAFETY: close_range takes integers; it closes descriptors of this
    // process, none of which the shield holds in lo..=hi.
    if unsafe { libc::syscall(libc::SYS_close_range, lo, hi, flags) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::IntoRawFd as _;

    fn open_null() -> OwnedFd {
        std::fs::File::open("/dev/null").expect("/dev/null").into()
    }

    fn is_open(fd: RawFd) -> bool {
        // SAFETY: F_GETFD reads only the descriptor's flags.
        unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
    }

    /// Runs `f` in a forked child (closing ranges of descriptors must not
    /// touch the other tests' in this process) and returns its exit code:
    /// 0 when every check held, else the number of the first that failed.
    fn in_child(f: fn() -> i32) -> i32 {
        // SAFETY: the child runs `f` (system calls and small allocations
        // on a copy of this process) and leaves with _exit.
        match unsafe { libc::fork() } {
            0 => {
                let code = f();
                // SAFETY: ends the child without running the parent's handlers.
                unsafe { libc::_exit(code) }
            }
            pid if pid > 0 => {
                let mut st = 0;
                // SAFETY: waits for our own child with a status word we own.
                unsafe { libc::waitpid(pid, &mut st, 0) };
                if libc::WIFEXITED(st) {
                    libc::WEXITSTATUS(st)
                } else {
                    -1
                }
            }
            _ => panic!("fork: {}", io::Error::last_os_error()),
        }
    }

    #[test]
    fn held_descriptors_live_high_and_survive_a_close_range_of_everything_else() {
        assert_eq!(
            in_child(|| {
                let held = move_high(open_null());
                let fd = held.as_raw_fd();
                if fd < base() || !is_held(fd) {
                    return 1;
                }
                let o = open_null().into_raw_fd();
                // Everything from `o` up, as closefrom(o) would.
                if close_range(u32::try_from(o).unwrap_or(0), u32::MAX, 0).is_err() {
                    return 2;
                }
                if is_open(o) {
                    return 3;
                }
                if !is_open(fd) {
                    return 4;
                }
                drop(held);
                if is_held(fd) || is_open(fd) {
                    return 5;
                }
                0
            }),
            0
        );
    }

    #[test]
    fn a_range_that_ends_at_a_held_number_closes_up_to_it() {
        assert_eq!(
            in_child(|| {
                let held = move_high(open_null());
                let fd = held.as_raw_fd();
                let b = open_null().into_raw_fd();
                let (Ok(lo), Ok(hi)) = (u32::try_from(b), u32::try_from(fd)) else {
                    return 1;
                };
                if close_range(lo, hi, 0).is_err() {
                    return 2;
                }
                i32::from(is_open(b)) * 3 + i32::from(!is_open(fd)) * 4
            }),
            0
        );
    }

    #[test]
    fn a_full_set_refuses_one_more_and_says_so_through_its_answer() {
        assert_eq!(
            in_child(|| {
                let mut held: Vec<Held> = (0..SLOTS).map(|_| move_high(open_null())).collect();
                if held.iter().any(|h| !is_held(h.as_raw_fd())) {
                    return 1;
                }
                let extra = open_null().into_raw_fd();
                if hold(extra) || is_held(extra) || !SAID_FULL.load(Ordering::Acquire) {
                    return 2;
                }
                // A slot freed is taken again; the others stay held.
                let first = held.remove(0);
                let n = first.as_raw_fd();
                drop(first);
                let others = held.iter().all(|h| is_held(h.as_raw_fd()));
                i32::from(!hold(extra) || is_held(n) || !others) * 3
            }),
            0
        );
    }

    #[test]
    fn without_the_guard_a_close_range_takes_the_descriptor() {
        // Positive control: the same range closed by the kernel directly.
        assert_eq!(
            in_child(|| {
                let held = move_high(open_null());
                let fd = held.as_raw_fd();
                if raw_close_range(3, u32::MAX, 0).is_err() {
                    return 2;
                }
                i32::from(is_open(fd)) * 3
            }),
            0
        );
    }
}
