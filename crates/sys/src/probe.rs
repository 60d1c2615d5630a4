//! One-shot attempts for `memveil probe`: try a kernel facility once, report
//! whether it worked, release everything at once. Nothing here is kept open.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use crate::mem::{memfd_secret, page_size, Mapping, Protection};

/// `userfaultfd` system call number on x86_64.
const SYS_USERFAULTFD: libc::c_long = 323;
/// `UFFD_USER_MODE_ONLY` (Linux 5.11): handle only faults from user mode,
/// which unprivileged users may ask for when `vm.unprivileged_userfaultfd=0`.
pub const UFFD_USER_MODE_ONLY: libc::c_int = 1;
/// `UFFD_API` version number.
const UFFD_API: u64 = 0xAA;
/// `UFFDIO_API` = `_IOWR(0xAA, 0x3F, struct uffdio_api)` (24 bytes).
const UFFDIO_API: libc::c_ulong = 0xC018_AA3F;
/// `USERFAULTFD_IOC_NEW` = `_IO(0xAA, 0x00)` on `/dev/userfaultfd` (Linux 6.1).
const USERFAULTFD_IOC_NEW: libc::c_ulong = 0xAA00;
/// `KVM_GET_API_VERSION` = `_IO(0xAE, 0x00)`.
const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// Creates a `memfd_secret` file, sizes it to one page, maps it, writes a
/// byte through the mapping and reads it back, then unmaps and closes it.
///
/// # Errors
/// The first step that failed: `memfd_secret(2)` (ENOSYS: no secretmem),
/// `ftruncate(2)`, `mmap(2)` (EAGAIN/ENOMEM: `RLIMIT_MEMLOCK` exhausted) or a
/// read-back mismatch (`Other`).
pub fn try_memfd_secret() -> io::Result<()> {
    let fd = memfd_secret()?;
    let ps = page_size();
    let file = std::fs::File::from(fd);
    file.set_len(u64::try_from(ps).map_err(io::Error::other)?)?;
    let mut map = Mapping::anonymous(ps, Protection::None)?;
    map.map_fd_at(0, ps, file.as_fd())?;
    let p = map.as_ptr();
    // SAFETY: `map` owns one page at `p`, just mapped read-write from the
    // secret file by `map_fd_at`; it stays mapped until `map` drops below.
    let back = unsafe {
        p.write_volatile(0xA5);
        p.read_volatile()
    };
    // SAFETY: as above; the page is still mapped read-write.
    unsafe { p.write_volatile(0) };
    drop(map);
    if back == 0xA5 {
        Ok(())
    } else {
        Err(io::Error::other("memfd_secret page did not read back"))
    }
}

fn uffd_handshake(fd: &OwnedFd) -> io::Result<u64> {
    let mut api = UffdioApi {
        api: UFFD_API,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes exactly one `struct uffdio_api`,
    // which `api` is (repr(C), three u64) and outlives the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(api.features)
}

fn owned(fd: libc::c_long) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("fd out of range"))?;
    // SAFETY: `fd` was just returned by the kernel and is owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Calls `userfaultfd(2)` with `flags` (plus `O_CLOEXEC|O_NONBLOCK`) and
/// completes the `UFFDIO_API` handshake; returns the kernel's feature mask.
///
/// # Errors
/// ENOSYS (kernel without userfaultfd), EPERM (unprivileged userfaultfd
/// disabled by `vm.unprivileged_userfaultfd=0`), EINVAL (flag unknown to this
/// kernel), or the error of the handshake.
pub fn try_userfaultfd(flags: libc::c_int) -> io::Result<u64> {
    // SAFETY: userfaultfd takes one flags argument, returns a new descriptor
    // or -1, and touches no memory of ours.
    let fd = unsafe { libc::syscall(SYS_USERFAULTFD, flags | libc::O_CLOEXEC | libc::O_NONBLOCK) };
    let fd = owned(fd)?;
    uffd_handshake(&fd)
}

/// Opens `/dev/userfaultfd` (Linux 6.1+), asks it for a descriptor with
/// `USERFAULTFD_IOC_NEW` and completes the handshake; returns the feature mask.
///
/// # Errors
/// `NotFound` (no device: older kernel), `PermissionDenied` (device mode), or
/// the error of the ioctl or handshake.
pub fn try_dev_userfaultfd() -> io::Result<u64> {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")?;
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: USERFAULTFD_IOC_NEW takes the flags as an integer argument and
    // returns a new descriptor or -1; no memory of ours is touched.
    let fd = unsafe { libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW, flags) };
    let fd = owned(libc::c_long::from(fd))?;
    uffd_handshake(&fd)
}

/// Opens `/dev/kvm` and returns `KVM_GET_API_VERSION` (12 on every kernel
/// since 2.6.22).
///
/// # Errors
/// `NotFound` (no KVM module), `PermissionDenied` (not in group `kvm`), or
/// the error of the ioctl.
pub fn kvm_api_version() -> io::Result<i32> {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")?;
    // SAFETY: KVM_GET_API_VERSION takes no argument and returns an integer.
    let v = unsafe { libc::ioctl(dev.as_raw_fd(), KVM_GET_API_VERSION, 0) };
    if v < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}

/// The effective user id of this process.
#[must_use]
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_encoding() {
        // _IOWR(type, nr, size) = 3<<30 | size<<16 | type<<8 | nr.
        let iowr: libc::c_ulong = (3 << 30) | (24 << 16) | (0xAA << 8) | 0x3F;
        assert_eq!(UFFDIO_API, iowr);
        assert_eq!(std::mem::size_of::<UffdioApi>(), 24);
    }

    #[test]
    fn memfd_secret_try_matches_the_plain_call() {
        match (memfd_secret(), try_memfd_secret()) {
            (Ok(_), r) => r.expect("memfd_secret works, so one page must map"),
            (Err(e), r) => {
                assert!(r.is_err());
                memveil_testkit::skip(memveil_testkit::Need::MemfdSecret, e);
            }
        }
    }

    /// Whether this process holds CAP_SYS_PTRACE (bit 19 of CapEff), which
    /// lets userfaultfd(2) ignore `vm.unprivileged_userfaultfd=0`.
    fn cap_sys_ptrace() -> bool {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                let hex = s.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
                u64::from_str_radix(hex.trim(), 16).ok()
            })
            .is_some_and(|caps| caps >> 19 & 1 == 1)
    }

    /// `try_userfaultfd` agrees with the kernel's configuration: a kernel
    /// built with userfaultfd has the `vm.unprivileged_userfaultfd` sysctl
    /// and, from 5.11 on, grants a user-mode-only descriptor to anyone; one
    /// built without answers ENOSYS. Kernel-mode descriptors work exactly
    /// when the sysctl is 1 or the process holds CAP_SYS_PTRACE.
    #[test]
    fn userfaultfd_answers_agree_with_the_kernel_configuration() {
        let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").ok();
        let built_in = sysctl.is_some();
        match try_userfaultfd(UFFD_USER_MODE_ONLY) {
            Ok(_) => assert!(
                built_in,
                "userfaultfd works, yet /proc/sys/vm/unprivileged_userfaultfd is missing"
            ),
            Err(e) => {
                match e.raw_os_error() {
                    Some(libc::ENOSYS) => assert!(
                        !built_in,
                        "ENOSYS from a kernel that has vm.unprivileged_userfaultfd"
                    ),
                    // Older than 5.11 (flag unknown), or a security module's refusal.
                    Some(libc::EINVAL | libc::EPERM) => {}
                    _ => panic!("try_userfaultfd: an error its documentation does not name: {e}"),
                }
                memveil_testkit::skip(memveil_testkit::Need::Userfaultfd, e);
                return;
            }
        }
        let allowed = cap_sys_ptrace() || sysctl.is_some_and(|s| s.trim() == "1");
        match try_userfaultfd(0) {
            Ok(_) => assert!(
                allowed,
                "a kernel-mode userfaultfd was granted without CAP_SYS_PTRACE while vm.unprivileged_userfaultfd=0"
            ),
            Err(e) => assert!(
                !allowed && e.raw_os_error() == Some(libc::EPERM),
                "kernel-mode userfaultfd refused ({e}) although CAP_SYS_PTRACE or the sysctl allows it"
            ),
        }
    }
}
