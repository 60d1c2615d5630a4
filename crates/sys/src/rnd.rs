//! The kernel's random pool ioctls (`random(4)`): `RNDADDENTROPY` (what
//! `rngd` uses to mix bytes into the input pool and credit entropy) and
//! `RNDGETENTCNT` (the credited entropy count).
//!
//! `RNDADDENTROPY` needs `CAP_SYS_ADMIN`; without it the kernel answers
//! `EPERM`, which is returned as is.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// `_IOR('R', 0x00, int)`.
pub const RNDGETENTCNT: libc::c_ulong = 0x8004_5200;
/// `_IOW('R', 0x03, int[2])`.
pub const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;

/// Largest buffer one `RNDADDENTROPY` call takes here (the kernel accepts
/// any size; this bounds the copy).
pub const MAX_ADD: usize = 4096;

/// Mixes `data` into the kernel input pool of the device opened as `dev`
/// (`/dev/random`, opened for writing) and credits `entropy_bits` bits.
///
/// # Errors
/// `InvalidInput` when `data` is longer than [`MAX_ADD`] or the credit is
/// more than `8 * data.len()` bits; otherwise the error of `ioctl(2)`
/// (`EPERM` without `CAP_SYS_ADMIN`, `ENOTTY` when `dev` is not a random
/// device).
pub fn add_entropy(dev: &File, data: &[u8], entropy_bits: u32) -> io::Result<()> {
    if data.len() > MAX_ADD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} bytes for RNDADDENTROPY, at most {MAX_ADD}", data.len()),
        ));
    }
    let max_bits = data.len() * 8;
    if usize::try_from(entropy_bits).map_or(true, |b| b > max_bits) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("credit of {entropy_bits} bits for {} bytes", data.len()),
        ));
    }
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    // laid out as u32 words so the buffer is aligned for the header ints.
    let words = 2 + data.len().div_ceil(4);
    let mut info = vec![0u32; words];
    // Both are at most 8 * MAX_ADD, far below i32::MAX, so the kernel's
    // `int`s read the same values.
    info[0] = entropy_bits;
    info[1] = u32::try_from(data.len()).map_err(|_| io::ErrorKind::InvalidInput)?;
    for (w, chunk) in info[2..].iter_mut().zip(data.chunks(4)) {
        let mut b = [0u8; 4];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u32::from_ne_bytes(b);
    }
    // SAFETY: `info` is a live, 4-byte aligned buffer of `2 + ceil(len/4)`
    // u32 words: the two header ints the kernel reads first, then at least
    // `buf_size` bytes of payload. The kernel only reads it.
    let r = unsafe { libc::ioctl(dev.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) };
    let err = io::Error::last_os_error();
    info.fill(0);
    std::hint::black_box(&info);
    if r != 0 {
        return Err(err);
    }
    Ok(())
}

/// The entropy the kernel credits its input pool with, in bits.
///
/// # Errors
/// The error of `ioctl(2)`.
pub fn entropy_count(dev: &File) -> io::Result<i32> {
    let mut n: libc::c_int = 0;
    // SAFETY: RNDGETENTCNT writes one int through the pointer, which points
    // at a live local.
    let r = unsafe { libc::ioctl(dev.as_raw_fd(), RNDGETENTCNT, &mut n) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_encoding() {
        // _IOC(dir, type, nr, size) = dir<<30 | size<<16 | type<<8 | nr
        let ioc =
            |dir: u64, nr: u64, size: u64| (dir << 30) | (size << 16) | (u64::from(b'R') << 8) | nr;
        assert_eq!(RNDGETENTCNT, ioc(2, 0, 4));
        assert_eq!(RNDADDENTROPY, ioc(1, 3, 8));
    }

    #[test]
    fn entropy_count_reads() {
        let f = File::open("/dev/random").expect("/dev/random");
        let n = entropy_count(&f).expect("RNDGETENTCNT");
        assert!(n >= 0);
    }

    #[test]
    fn over_credit_refused_before_the_kernel() {
        let f = File::open("/dev/random").expect("/dev/random");
        let e = add_entropy(&f, &[1, 2], 17).expect_err("17 bits in 2 bytes");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn add_entropy_needs_cap_sys_admin() {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/random")
            .expect("/dev/random");
        match add_entropy(&f, &[0x5a; 16], 0) {
            Ok(()) => {}
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}"),
        }
    }
}
