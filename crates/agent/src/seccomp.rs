//! The seccomp allowlist of `memveil agent` once it serves (installed by the
//! `memveil` binary through `memveil_sys::seccomp::lock_down`; docs:
//! SECURITY.md, "Seccomp and mseal"). Measured on its test suites with
//! `MEMVEIL_SECCOMP=measure` and `scripts/seccomp_measure.py`.

use memveil_sys::seccomp::Syscall;
use memveil_sys::syscalls;

/// What `memveil agent` calls after start-up, besides
/// `memveil_sys::seccomp::BASE`: its socket's `accept4` and `SO_PEERCRED`
/// (`getsockopt`); each client's own connection to the vault (`socket`,
/// `connect`, `recvfrom`, `sendto`); the shared buffer a key added with
/// `ssh-add` goes to the vault in (`memfd_create`, `ftruncate`, passed with
/// `sendmsg`); the vault client's liveness probe of the vault while a lane
/// waits, `kill(pid, 0)` (signal 0 only). No `execve`, no file opened.
pub const AGENT: &[Syscall] = syscalls![
    SYS_accept4,
    SYS_getsockopt,
    SYS_socket,
    SYS_connect,
    SYS_recvfrom,
    SYS_sendto,
    SYS_sendmsg,
    SYS_memfd_create,
    SYS_ftruncate,
    SYS_kill[1 = 0],
];
