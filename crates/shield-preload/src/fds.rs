//! The calls that close or replace descriptors by number, wrapped so that
//! they leave the shield's own descriptors open (`memveil_sys::fdguard`: a
//! program that closes everything it did not open, as daemons and
//! sandboxes do, closed the shield's userfaultfd with it, and its evicted
//! pages then read back as zeros). A held number looks closed to the
//! program, as it would be plainly: `close` and `dup2`/`dup3` onto it fail
//! with `EBADF`. A raw `syscall(SYS_close_range, ...)` is not seen here;
//! the fault handler then ends the program loudly rather than let it run
//! on with lost pages.

use std::ffi::{c_int, c_uint, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use memveil_sys::fdguard;

use super::{next_definition, set_errno};

static REAL_CLOSE: AtomicUsize = AtomicUsize::new(0);
static REAL_DUP2: AtomicUsize = AtomicUsize::new(0);
static REAL_DUP3: AtomicUsize = AtomicUsize::new(0);
static SAID: AtomicBool = AtomicBool::new(false);

fn refuse_onto(call: &str, fd: c_int) -> c_int {
    if !SAID.swap(true, Ordering::Relaxed) {
        eprintln!(
            "memveil-shield: refused {call} onto descriptor {fd}, which the shield holds (its \
             userfaultfd or key file: closing it would lose the program's evicted pages); the \
             call fails with EBADF, as for a number out of range"
        );
    }
    set_errno(libc::EBADF);
    -1
}

/// The C library's `name` (cached), or None when it cannot be found.
fn real(name: &CStr, cache: &AtomicUsize) -> Option<usize> {
    Some(next_definition(name, cache)).filter(|&f| f != 0)
}

fn result(r: std::io::Result<()>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if fdguard::is_held(fd) {
        set_errno(libc::EBADF);
        return -1;
    }
    match real(c"close", &REAL_CLOSE) {
        // SAFETY: glibc's close has this type; the argument is the caller's.
        Some(f) => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(c_int) -> c_int>(f)(fd)
        },
        // SAFETY: close(2) of the caller's descriptor.
        None => unsafe { c_int::try_from(libc::syscall(libc::SYS_close, fd)).unwrap_or(-1) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn close_range(lo: c_uint, hi: c_uint, flags: c_int) -> c_int {
    result(fdguard::close_range(
        lo,
        hi,
        u32::try_from(flags).unwrap_or(u32::MAX),
    ))
}

#[no_mangle]
pub unsafe extern "C" fn closefrom(lo: c_int) {
    let lo = u32::try_from(lo).unwrap_or(0);
    if fdguard::close_range(lo, u32::MAX, 0).is_ok() {
        return;
    }
    // No close_range (before Linux 5.9): every open descriptor from `lo`
    // that the shield does not hold, as glibc's own fallback does.
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let open: Vec<c_int> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .filter(|&n: &c_int| u32::try_from(n).is_ok_and(|n| n >= lo))
        .collect();
    for fd in open {
        // SAFETY: close of the program's own descriptor (held ones refused).
        let _ = unsafe { close(fd) };
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    if old != new && fdguard::is_held(new) {
        return refuse_onto("dup2", new);
    }
    match real(c"dup2", &REAL_DUP2) {
        // SAFETY: glibc's dup2 has this type; the arguments are the caller's.
        Some(f) => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(c_int, c_int) -> c_int>(f)(old, new)
        },
        // SAFETY: dup2(2) on the caller's descriptors.
        None => unsafe { c_int::try_from(libc::syscall(libc::SYS_dup2, old, new)).unwrap_or(-1) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    if old != new && fdguard::is_held(new) {
        return refuse_onto("dup3", new);
    }
    match real(c"dup3", &REAL_DUP3) {
        // SAFETY: glibc's dup3 has this type; the arguments are the caller's.
        Some(f) => unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(c_int, c_int, c_int) -> c_int>(f)(
                old, new, flags,
            )
        },
        // SAFETY: dup3(2) on the caller's descriptors.
        None => unsafe {
            c_int::try_from(libc::syscall(libc::SYS_dup3, old, new, flags)).unwrap_or(-1)
        },
    }
}
