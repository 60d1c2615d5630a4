//! Unmounting, for servers that must take down what they mounted (the disk
//! server's filesystem on its loop device, its FUSE mount) in order.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;

/// `umount2(path, flags)`: with `detach`, `MNT_DETACH` (the mount leaves the
/// namespace now and goes away when no longer busy).
///
/// # Errors
/// The error of `umount2(2)`: `EBUSY` while files on it are open (without
/// `detach`), `EINVAL` when `path` is not a mount point, `EPERM` without
/// `CAP_SYS_ADMIN`.
pub fn unmount(path: &Path, detach: bool) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let flags = if detach { libc::MNT_DETACH } else { 0 };
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call;
    // umount2 reads it and touches no other memory of ours.
    if unsafe { libc::umount2(c.as_ptr(), flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Detaches a loop device from its backing file (`ioctl(LOOP_CLR_FD)`, as
/// `losetup -d` does): with the device still open elsewhere the kernel
/// detaches it at the last close. Without running a program, so a server
/// under a seccomp filter that allows no `execve` can take its device down.
///
/// # Errors
/// Opening `dev`; the ioctl's error (`ENXIO` when nothing is attached).
pub fn loop_detach(dev: &Path) -> io::Result<()> {
    use std::os::fd::AsRawFd as _;
    /// `include/uapi/linux/loop.h`.
    const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
    let f = std::fs::OpenOptions::new().read(true).open(dev)?;
    // SAFETY: LOOP_CLR_FD takes no argument and touches no memory of ours;
    // `f` is an open descriptor for the duration of the call.
    if unsafe { libc::ioctl(f.as_raw_fd(), LOOP_CLR_FD, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmounting_a_plain_directory_fails() {
        let e = unmount(&std::env::temp_dir(), false).expect_err("not a mount point");
        assert!(
            matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EPERM)),
            "{e}"
        );
        assert!(unmount(Path::new("/no/such/dir/here"), true).is_err());
    }
}
