//! The seccomp filter that hands the program's memory calls to the agent:
//! `mmap`, `munmap`, `mremap`, `brk`, `madvise`, `mprotect`, `execve`,
//! `execveat` and `clone` without `CLONE_VM` (a fork) become user
//! notifications; `clone3`, whose
//! flags a filter cannot read, fails with ENOSYS so the C library falls back
//! to `clone`; `close`, `close_range`, `dup2` and `dup3` on a number from
//! the shield's held descriptors' base up (`memveil_sys::fdguard`) go to
//! the agent too, which keeps those descriptors open; everything else is
//! allowed.

use std::io;
use std::os::fd::{FromRawFd as _, OwnedFd};

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const X32_BIT: u32 = 0x4000_0000;
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
const OFF_ARG0: u32 = 16;

/// The calls the agent sees when their argument (index) names a
/// descriptor from the held descriptors' base up.
pub const GUARDED: [(libc::c_long, u32); 4] = [
    (libc::SYS_close, 0),
    (libc::SYS_close_range, 1),
    (libc::SYS_dup2, 1),
    (libc::SYS_dup3, 1),
];

/// The calls the agent serves.
pub const NOTIFIED: [libc::c_long; 8] = [
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_brk,
    libc::SYS_madvise,
    libc::SYS_mprotect,
    libc::SYS_execve,
    libc::SYS_execveat,
];

fn stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: u16::try_from(code).unwrap_or(0),
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u32, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter {
        code: u16::try_from(code).unwrap_or(0),
        jt,
        jf,
        k,
    }
}

fn nr(n: libc::c_long) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The filter program; `fd_base` is where the held descriptors start.
pub fn program(fd_base: u32) -> Vec<libc::sock_filter> {
    use libc::{BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_RET, BPF_W};
    let ld = BPF_LD | BPF_W | BPF_ABS;
    let ret = BPF_RET | BPF_K;
    let allow = stmt(ret, libc::SECCOMP_RET_ALLOW);
    let notify = stmt(ret, libc::SECCOMP_RET_USER_NOTIF);
    let enosys = stmt(ret, libc::SECCOMP_RET_ERRNO | nr(libc::ENOSYS.into()));
    let mut p = vec![
        stmt(ld, OFF_ARCH),
        // Another ABI (i386 int 0x80): allowed as it is.
        jump(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        allow,
        stmt(ld, OFF_NR),
        jump(BPF_JMP | BPF_JGE | BPF_K, X32_BIT, 0, 1),
        allow,
    ];
    // After the comparisons of the notified calls: a block per guarded
    // call, then clone3 and clone; the notify comes last.
    let mut tail = Vec::new();
    let mut to_notify = Vec::new();
    for &(c, arg) in &GUARDED {
        tail.push(jump(BPF_JMP | BPF_JEQ | BPF_K, nr(c), 0, 3));
        // The argument's low 32 bits (an int; little-endian).
        tail.push(stmt(ld, OFF_ARG0 + 8 * arg));
        to_notify.push(tail.len());
        tail.push(jump(BPF_JMP | BPF_JGE | BPF_K, fd_base, 0, 0));
        tail.push(allow);
    }
    tail.extend([
        jump(BPF_JMP | BPF_JEQ | BPF_K, nr(libc::SYS_clone3), 0, 1),
        enosys,
        jump(BPF_JMP | BPF_JEQ | BPF_K, nr(libc::SYS_clone), 0, 3),
        stmt(ld, OFF_ARG0),
        jump(BPF_JMP | BPF_JSET | BPF_K, nr(libc::CLONE_VM.into()), 0, 2),
        allow,
        allow,
    ]);
    for at in to_notify {
        tail[at].jt = u8::try_from(tail.len() - at - 1).unwrap_or(0);
    }
    // Each notified call: equal -> the notify after the tail.
    let n = NOTIFIED.len();
    for (i, &c) in NOTIFIED.iter().enumerate() {
        let skip = u8::try_from(n - 1 - i + tail.len()).unwrap_or(0);
        p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, nr(c), skip, 0));
    }
    p.extend(tail);
    p.push(notify);
    p
}

/// Installs [`program`] on the calling thread (only: threads started before
/// stay outside it, threads it starts inherit it) and returns the listener.
/// Without CAP_SYS_ADMIN this needs no_new_privs, which it then sets; the
/// bool says whether it did.
pub fn install() -> io::Result<(OwnedFd, bool)> {
    let prog = program(u32::try_from(memveil_sys::fdguard::base()).unwrap_or(u32::MAX));
    let fprog = libc::sock_fprog {
        len: u16::try_from(prog.len()).unwrap_or(0),
        filter: prog.as_ptr().cast_mut(),
    };
    let flags =
        libc::SECCOMP_FILTER_FLAG_NEW_LISTENER | libc::SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV;
    let attempt = || {
        // SAFETY: seccomp(2) with a filter program that outlives the call;
        // the kernel copies it.
        let r = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                flags,
                std::ptr::from_ref(&fprog),
            )
        };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            // SAFETY: the kernel returned a new descriptor that nothing else owns.
            Ok(unsafe { OwnedFd::from_raw_fd(i32::try_from(r).unwrap_or(-1)) })
        }
    };
    match attempt() {
        Ok(fd) => Ok((fd, false)),
        Err(e) if e.raw_os_error() == Some(libc::EACCES) => {
            // SAFETY: prctl with integer arguments.
            if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
                return Err(io::Error::last_os_error());
            }
            attempt().map(|fd| (fd, true))
        }
        Err(e) => Err(e),
    }
}

/// `SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP` (linux/seccomp.h; not in the libc
/// crate).
const SYNC_WAKE_UP: libc::c_ulong = 1;

/// Asks the kernel (Linux 6.6+) to hand each notification to the agent on
/// the caller's CPU, and the answer back on the agent's: the caller waits
/// for the answer anyway, so the agent runs where the caller stopped and no
/// wake-up crosses CPUs (waking an idle CPU costs an inter-processor
/// interrupt, and on a virtual machine an exit to the hypervisor). It
/// changes where the two threads run, not what the agent serves.
/// Measured on this project's 2-vCPU VM, quiet: `brk(0)` through the agent
/// 11-15 us a call without it, 3.6-4.7 us with it; an anonymous 64 KiB
/// `mmap` + `munmap` 30-40 us against 8.4-11 us.
///
/// # Errors
/// A kernel without the flag (`EINVAL`, older than 6.6): notifications
/// then use the ordinary wake-ups.
pub fn sync_wake_up(listener: &OwnedFd) -> io::Result<()> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: SECCOMP_IOCTL_NOTIF_SET_FLAGS takes its flags by value and
    // reads no memory; the descriptor is a seccomp listener we own.
    let r = unsafe {
        libc::ioctl(
            listener.as_raw_fd(),
            libc::SECCOMP_IOCTL_NOTIF_SET_FLAGS,
            SYNC_WAKE_UP,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The listener takes the synchronous wake-up on this kernel: installed
    /// in a forked child (a filter stays on its thread for good), which
    /// exits with 0 when both calls succeed.
    #[test]
    fn the_listener_hands_notifications_over_on_the_callers_cpu() {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut v = release
            .trim()
            .split(['.', '-'])
            .map(|x| x.parse::<u32>().unwrap_or(0));
        let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
        if (major, minor) < (6, 6) {
            memveil_testkit::skip(
                memveil_testkit::Need::HostSetting("Linux 6.6+"),
                format!(
                    "kernel {} has no SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP",
                    release.trim()
                ),
            );
            return;
        }
        // SAFETY: the child makes only the calls below (glibc's malloc is
        // usable after fork) and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
        if pid == 0 {
            let code = match install() {
                Ok((fd, _)) => match sync_wake_up(&fd) {
                    Ok(()) => 0,
                    Err(_) => 1,
                },
                Err(_) => 2,
            };
            // SAFETY: _exit is async-signal-safe and not a notified call.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waitpid on our own child with a status word we own.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(r, pid);
        assert!(libc::WIFEXITED(status), "child status {status:#x}");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "1: the kernel refused the flag; 2: the filter would not install"
        );
    }
}
