//! The seccomp allowlist of `memveil disk serve` once it serves (installed by the
//! `memveil` binary through `memveil_sys::seccomp::lock_down`; docs:
//! SECURITY.md, "Seccomp and mseal"). Measured on its test suites with
//! `MEMVEIL_SECCOMP=measure` and `scripts/seccomp_measure.py`.

use memveil_sys::seccomp::Syscall;
use memveil_sys::syscalls;

/// What `memveil disk serve` calls after start-up, besides
/// `memveil_sys::seccomp::BASE`: the FUSE workers on `/dev/fuse`
/// (`read`/`writev` in the base, `poll`) and the image (`pread64`,
/// `pwrite64`, `fsync`, `fdatasync`); the way down: /proc/self/mountinfo
/// and /sys/block read (`openat`, `newfstatat`, `statx`), the filesystems
/// on the loop device and the FUSE mount unmounted (`umount2`), the loop
/// device detached (`ioctl(LOOP_CLR_FD)`, not `losetup -d`: no `execve`);
/// the vault client's liveness probe of the vault, `kill(pid, 0)`, while
/// a lane waits (signal 0 only).
pub const DISK_SERVE: &[Syscall] = syscalls![
    SYS_openat,
    SYS_newfstatat,
    SYS_statx,
    SYS_pread64,
    SYS_pwrite64,
    SYS_fsync,
    SYS_fdatasync,
    SYS_ioctl,
    SYS_poll,
    SYS_umount2,
    SYS_kill[1 = 0],
];
