//! The seccomp allowlist of `memveil probe --serve` once it serves (installed by the
//! `memveil` binary through `memveil_sys::seccomp::lock_down`; docs:
//! SECURITY.md, "Seccomp and mseal"). Measured on its test suites with
//! `MEMVEIL_SECCOMP=measure` and `scripts/seccomp_measure.py`.

use memveil_sys::seccomp::Syscall;
use memveil_sys::syscalls;

/// What `memveil probe --serve` calls after start-up, besides
/// `memveil_sys::seccomp::BASE`: HTTP (`accept4`, `setsockopt` for the
/// deadlines, `recvfrom`/`sendto`, `shutdown`); each scrape's read of the
/// vault's and the entropy service's counters (`socket`, `connect`); the
/// refresh's probe of the host: /proc, /sys and /dev files (`openat`,
/// `newfstatat`, `statx`, `getdents64`, MSRs by `pread64`), the
/// `memfd_secret` and userfaultfd attempts (`memfd_secret`, `ftruncate`,
/// `userfaultfd`, `ioctl`), `RLIMIT_MEMLOCK` (`prlimit64`), `geteuid`. No
/// `execve`: under the filter the refresh runs no program
/// (`CollectOptions::run_commands`).
pub const PROBE_SERVE: &[Syscall] = syscalls![
    SYS_accept4,
    SYS_setsockopt,
    SYS_recvfrom,
    SYS_sendto,
    SYS_shutdown,
    SYS_socket,
    SYS_connect,
    SYS_openat,
    SYS_newfstatat,
    SYS_statx,
    SYS_getdents64,
    SYS_pread64,
    SYS_ioctl,
    SYS_memfd_secret,
    SYS_ftruncate,
    SYS_userfaultfd,
    SYS_prlimit64,
    SYS_geteuid,
    // `memveil shield status`'s files (the registry, the ledger): the
    // standard library's reads ask for the position.
    SYS_lseek,
];
