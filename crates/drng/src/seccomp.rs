//! The seccomp allowlist of `memveil rng serve` once it serves (installed by the
//! `memveil` binary through `memveil_sys::seccomp::lock_down`; docs:
//! SECURITY.md, "Seccomp and mseal"). Measured on its test suites with
//! `MEMVEIL_SECCOMP=measure` and `scripts/seccomp_measure.py`.

use memveil_sys::seccomp::Syscall;
use memveil_sys::syscalls;

/// What `memveil rng serve` calls after start-up, besides
/// `memveil_sys::seccomp::BASE`: consumers accepted (`accept4`, timeouts by
/// `setsockopt`), EGD over `recvfrom`/`sendto`; at shutdown its own
/// listeners woken by a connection to each (`socket`, `connect`) and the
/// socket files removed (`unlink`). No file opened, no `execve`.
pub const RNG_SERVE: &[Syscall] = syscalls![
    SYS_accept4,
    SYS_setsockopt,
    SYS_recvfrom,
    SYS_sendto,
    SYS_socket,
    SYS_connect,
    SYS_unlink,
];
