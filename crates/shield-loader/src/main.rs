//! `memveil-shield-loader PROGRAM ARGS...`: see the library's documentation
//! (`memveil_shield_loader`).

#![no_main]

use std::ffi::{c_char, c_int};

/// The C entry point (no Rust runtime start-up: it would install signal
/// handlers of its own, which the program would inherit).
///
/// # Safety
/// Called by the C library's start-up only.
#[no_mangle]
pub unsafe extern "C" fn main(
    argc: c_int,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the C library calls `main` once, on the initial thread, with
    // the vectors the kernel gave the process.
    unsafe { memveil_shield_loader::run(argc, argv, envp) }
}
