//! Entering the loaded program: the initial stack a kernel `execve` would
//! have built for it (argc, argv, envp, auxv), on this thread's own stack
//! below the loader's frames, then a jump to its entry.

use std::ffi::{c_char, CStr};

use crate::load::Loaded;

const AT_NULL: usize = 0;
const AT_PHDR: usize = 3;
const AT_PHNUM: usize = 5;
const AT_BASE: usize = 7;
const AT_ENTRY: usize = 9;
const AT_EXECFN: usize = 31;
/// Environment variables only the loader reads; the program does not see them.
const LOADER_ONLY: &[u8] = b"MEMVEIL_LOADER_";

/// The words of the program's initial stack: `argc`, the program's
/// arguments (the loader's, less its own name), the environment (less the
/// loader's own variables) and the auxiliary vector the kernel gave the
/// loader, with the entries that describe the executable rewritten.
///
/// # Safety
/// `argv` and `envp` are the NULL-terminated vectors the kernel gave this
/// process (`envp` followed by the auxiliary vector), `argv` with at least
/// `skip` entries.
pub unsafe fn initial_stack(
    argv: *const *const c_char,
    skip: usize,
    envp: *const *const c_char,
    img: &Loaded,
    execfn: &'static CStr,
) -> Vec<usize> {
    let mut args = Vec::new();
    // SAFETY: the caller's promise: NULL-terminated vectors of C strings.
    unsafe {
        let mut i = skip;
        while !(*argv.add(i)).is_null() {
            args.push(*argv.add(i) as usize);
            i += 1;
        }
    }
    let mut words = vec![args.len()];
    words.extend(args);
    words.push(0);
    let mut i = 0;
    // SAFETY: as above; each entry is a NUL-terminated string.
    unsafe {
        while !(*envp.add(i)).is_null() {
            let e = *envp.add(i);
            if !CStr::from_ptr(e).to_bytes().starts_with(LOADER_ONLY) {
                words.push(e as usize);
            }
            i += 1;
        }
    }
    words.push(0);
    // SAFETY: the auxiliary vector follows envp's NULL, as pairs ending in AT_NULL.
    let mut av = unsafe { envp.add(i + 1).cast::<usize>() };
    loop {
        // SAFETY: as above; reading pair by pair up to AT_NULL.
        let (ty, val) = unsafe { (*av, *av.add(1)) };
        let val = match ty {
            AT_PHDR => img.phdr(),
            AT_PHNUM => img.image.phnum,
            AT_ENTRY => img.entry(),
            AT_BASE => img.interp_base(),
            AT_EXECFN => execfn.as_ptr() as usize,
            _ => val,
        };
        words.extend([ty, val]);
        if ty == AT_NULL {
            break;
        }
        // SAFETY: not AT_NULL, so another pair follows.
        av = unsafe { av.add(2) };
    }
    words
}

/// Unregisters the rseq area the loader's C library registered for this
/// thread: the program's C library registers its own (the kernel takes one
/// per thread).
pub fn unregister_rseq() {
    // SAFETY: dlsym with NUL-terminated names; the objects glibc documents
    // (`ptrdiff_t __rseq_offset`, `unsigned int __rseq_size`) are read only
    // if present.
    let (off, size) = unsafe {
        let off = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_offset".as_ptr());
        let size = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_size".as_ptr());
        if off.is_null() || size.is_null() {
            return;
        }
        (off.cast::<isize>().read(), size.cast::<u32>().read())
    };
    if size == 0 {
        return;
    }
    // SAFETY: pthread_self is glibc's thread pointer, from which
    // __rseq_offset locates this thread's area.
    let Ok(tp) = usize::try_from(unsafe { libc::pthread_self() }) else {
        return;
    };
    let area = tp.wrapping_add_signed(off);
    const RSEQ_FLAG_UNREGISTER: libc::c_int = 1;
    const RSEQ_SIG: u32 = 0x5305_3053;
    // glibc registers 32 bytes (the original area) or __rseq_size: the
    // kernel takes the unregistration only with the length registered.
    for len in [size, 32] {
        // SAFETY: rseq(2) unregistration of this thread's own area.
        let r = unsafe { libc::syscall(libc::SYS_rseq, area, len, RSEQ_FLAG_UNREGISTER, RSEQ_SIG) };
        if r == 0 {
            return;
        }
    }
}

/// Copies `words` to this thread's stack, well below the current frame,
/// restores the signal mask `mask` and jumps to `entry` with the stack
/// pointer at `argc` and rdx 0 (the ABI's "no function for atexit").
///
/// # Safety
/// `entry` is the entry point of a program mapped in this process and
/// `words` its initial stack; nothing of the caller runs again.
pub unsafe fn jump(words: &[usize], entry: usize, mask: &libc::sigset_t) -> ! {
    let here = std::ptr::addr_of!(words) as usize;
    // 128 KiB below this frame: far below anything the loader's frames use;
    // the stack grows down to it on the first touch.
    let top = (here - (128 << 10) - words.len() * 8) & !15;
    // SAFETY: the range is this thread's stack below every live frame
    // (unused), writable once touched.
    unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), top as *mut usize, words.len()) };
    // SAFETY: restoring the mask the loader started with; from here on the
    // loader's code only jumps.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, mask, std::ptr::null_mut()) };
    // SAFETY: the caller's promise; the registers are pinned (rdx must be 0,
    // so neither operand may live in it).
    unsafe {
        std::arch::asm!(
            "mov rsp, rcx",
            "xor edx, edx",
            "xor ebp, ebp",
            "jmp rax",
            in("rcx") top,
            in("rax") entry,
            options(noreturn)
        )
    }
}
