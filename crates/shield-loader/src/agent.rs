//! The agent: a thread of the loaded program's process, every signal
//! blocked, outside the seccomp filter, that serves the program's memory
//! calls from the filter's listener (see `filter.rs`). It performs each call
//! itself on the protected region ([`Region`]) and answers with the
//! result, or lets the kernel perform it (`SECCOMP_USER_NOTIF_FLAG_CONTINUE`)
//! when the call is not the region's to serve. The caller is stopped in the
//! system call meanwhile, so a mapping is registered with the shield before
//! the program can touch it.

use std::ffi::c_int;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use memveil_shield::region::{Errno, MapOpts, Region};
use memveil_sys::fdguard;

use crate::keeper::Seen;

/// Whether a refused dup2/dup3 was reported (once per run).
static SAID: AtomicBool = AtomicBool::new(false);

/// How the region serves the program's mappings: Go reserves `PROT_NONE`
/// and maps over it, and asks for its arenas at hints it then checks.
const OPTS: MapOpts = MapOpts {
    any_prot: true,
    honor_hint: true,
};

fn addr(a: u64) -> usize {
    usize::try_from(a).unwrap_or(usize::MAX)
}

/// The low 32 bits, as the kernel reads an `int` argument.
fn int(a: u64) -> c_int {
    c_int::from_ne_bytes(u32::try_from(a & 0xffff_ffff).unwrap_or(0).to_ne_bytes())
}

/// How a notification is answered.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Continue,
    Value(i64),
    Error(Errno),
}

fn value(v: usize) -> Answer {
    Answer::Value(i64::try_from(v).unwrap_or(i64::MAX))
}

fn unit(r: Option<Result<(), Errno>>) -> Answer {
    match r {
        None => Answer::Continue,
        Some(Ok(())) => Answer::Value(0),
        Some(Err(e)) => Answer::Error(e),
    }
}

fn addr_result(r: Option<Result<usize, Errno>>) -> Answer {
    match r {
        None => Answer::Continue,
        Some(Ok(v)) => value(v),
        Some(Err(e)) => Answer::Error(e),
    }
}

/// Whether `tid` is a thread of this process (a child the program forked
/// and that then executed another program inherits the filter: its calls
/// are the kernel's to perform). Asked with `tgkill(pid, tid, 0)`, which
/// fails with `ESRCH` for a thread of another process, and looks nothing up
/// under `/proc`: an `access` of `/proc/self/task/TID` per memory call left
/// dentries under `/proc/PID/task` that the program's exit then tore down
/// inside its parent's `wait4` (issue 33's tenants measured 18% of their CPU
/// there from such reads).
fn own_thread(tid: u32) -> bool {
    let Ok(tid) = libc::pid_t::try_from(tid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the thread exists in our thread
    // group; nothing is sent and no memory is passed.
    unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, 0) == 0 }
}

fn answer(region: &Region, program: &str, n: &libc::seccomp_notif) -> Answer {
    let a = n.data.args;
    if !own_thread(n.pid) {
        return Answer::Continue;
    }
    match libc::c_long::from(n.data.nr) {
        libc::SYS_mmap => addr_result(region.mmap(
            addr(a[0]),
            addr(a[1]),
            int(a[2]),
            int(a[3]),
            int(a[4]),
            OPTS,
        )),
        libc::SYS_munmap => unit(region.munmap(addr(a[0]), addr(a[1]))),
        libc::SYS_madvise => unit(region.madvise(addr(a[0]), addr(a[1]), int(a[2]))),
        libc::SYS_mprotect => unit(region.mprotect(addr(a[0]), addr(a[1]), int(a[2]))),
        libc::SYS_mremap => {
            addr_result(region.mremap(addr(a[0]), addr(a[1]), addr(a[2]), int(a[3]), addr(a[4])))
        }
        libc::SYS_brk => value(region.brk(addr(a[0]))),
        libc::SYS_close => {
            if fdguard::is_held(int(a[0])) {
                Answer::Error(libc::EBADF)
            } else {
                Answer::Continue
            }
        }
        // Served here, on the table the agent shares with the program's
        // threads, around the held descriptors. With CLOSE_RANGE_UNSHARE
        // the caller's own copy of the table is closed and the shield's
        // stays whole: the kernel may do it.
        libc::SYS_close_range => {
            if a[2] & u64::from(libc::CLOSE_RANGE_UNSHARE) != 0 {
                return Answer::Continue;
            }
            let word = |v: u64| u32::try_from(v & 0xffff_ffff).unwrap_or(u32::MAX);
            match fdguard::close_range(word(a[0]), word(a[1]), word(a[2])) {
                Ok(()) => Answer::Value(0),
                Err(e) => Answer::Error(e.raw_os_error().unwrap_or(libc::EIO)),
            }
        }
        libc::SYS_dup2 | libc::SYS_dup3 => {
            let (old, new) = (int(a[0]), int(a[1]));
            if old == new || !fdguard::is_held(new) {
                return Answer::Continue;
            }
            if !SAID.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "memveil-shield-loader: refused a dup2/dup3 by {program} onto descriptor \
                     {new}, which the shield holds (its userfaultfd, key file or this filter's \
                     listener); it fails with EBADF, as for a number out of range (said once)"
                );
            }
            Answer::Error(libc::EBADF)
        }
        libc::SYS_execve | libc::SYS_execveat => {
            eprintln!(
                "memveil-shield-loader: refused an execve by {program} itself (pid {}): the \
                 program it would become keeps the loader's seccomp filter but not its agent, so \
                 its every mmap would fail (ENOSYS); execve fails with EPERM. Run that program \
                 under memveil run itself; a child's execve (posix_spawn, os/exec) works",
                n.pid
            );
            Answer::Error(libc::EPERM)
        }
        libc::SYS_clone => {
            eprintln!(
                "memveil-shield-loader: refused a fork of {program} (pid {}): a forked child \
                 of a program the loader runs would read zeros where its pages are evicted \
                 (it inherits neither the userfaultfd nor the keys); fork fails with EAGAIN. \
                 posix_spawn, vfork and Go's os/exec (clone with CLONE_VM) work",
                n.pid
            );
            Answer::Error(libc::EAGAIN)
        }
        _ => Answer::Continue,
    }
}

/// Undoes what a call the program never saw the answer of did (it was
/// killed meanwhile): a fresh mapping goes.
fn undo(region: &Region, n: &libc::seccomp_notif, a: &Answer) {
    if let (libc::SYS_mmap, Answer::Value(v)) = (libc::c_long::from(n.data.nr), a) {
        if let Ok(at) = usize::try_from(*v) {
            let _ = region.munmap(at, addr(n.data.args[1]));
        }
    }
}

/// Serves the listener until it fails (it never does while the process
/// lives: the program's end ends this thread with it). The id of each
/// notification received goes to `seen` first (for the keeper: see
/// `keeper.rs`).
pub fn serve(listener: &impl AsRawFd, region: &Region, program: &str, seen: &Seen) -> io::Error {
    let fd = listener.as_raw_fd();
    // The agent's CPU is the shield's cost: every caller waits for it.
    let shield = region.shield();
    if let Some(s) = shield {
        s.enter_agent();
    }
    loop {
        // SAFETY: all-zero is a valid seccomp_notif (plain integers); the
        // kernel requires it zeroed before RECV.
        let mut n: libc::seccomp_notif = unsafe { std::mem::zeroed() };
        // SAFETY: RECV fills `n`, which lives across the call.
        if unsafe { libc::ioctl(fd, libc::SECCOMP_IOCTL_NOTIF_RECV, &mut n) } != 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // Interrupted, or the caller died before it was received.
                Some(libc::EINTR | libc::ENOENT) => continue,
                _ => return e,
            }
        }
        seen.record(n.id);
        if let Some(s) = shield {
            s.count_served(1);
        }
        let a = answer(region, program, &n);
        // SAFETY: all-zero is a valid seccomp_notif_resp.
        let mut r: libc::seccomp_notif_resp = unsafe { std::mem::zeroed() };
        r.id = n.id;
        match a {
            Answer::Continue => {
                r.flags = u32::try_from(libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE).unwrap_or(1)
            }
            Answer::Value(v) => r.val = v,
            Answer::Error(e) => r.error = -e,
        }
        // SAFETY: SEND reads `r`, which lives across the call.
        if unsafe { libc::ioctl(fd, libc::SECCOMP_IOCTL_NOTIF_SEND, &r) } != 0 {
            // The caller was killed while the call was served.
            undo(region, &n, &a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int_arguments_are_their_low_32_bits() {
        assert_eq!(int(0xffff_ffff), -1);
        assert_eq!(int(0x1_0000_0022), 0x22);
        assert_eq!(addr(0x7fff_0000_1000), 0x7fff_0000_1000);
    }

    #[test]
    fn own_threads_are_told_from_other_processes() {
        assert!(own_thread(std::process::id()));
        // SAFETY: gettid(2) takes nothing and cannot fail.
        let tid = std::thread::spawn(|| unsafe { libc::gettid() })
            .join()
            .expect("thread");
        let other = std::thread::spawn(|| {
            // SAFETY: as above.
            let t = unsafe { libc::gettid() };
            (own_thread(u32::try_from(t).expect("tid")), t)
        });
        let (seen, live) = other.join().expect("thread");
        assert!(seen, "a live thread {live} of this process");
        // A thread that ended is no longer one; pid 1 and a child process
        // never were.
        assert!(!own_thread(u32::try_from(tid).expect("tid")));
        assert!(!own_thread(1));
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .expect("sleep");
        assert!(!own_thread(child.id()));
        let _ = child.kill();
        let _ = child.wait();
    }
}
