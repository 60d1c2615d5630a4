//! `memveil-shield-loader PROGRAM ARGS...`: see the library's documentation
//! (`memveil_shield_loader`).

// The test harness (`cargo test --bins`, which selects this binary despite
// `test = false`) brings its own `main`; the binary is only ever the C one.
#![cfg_attr(not(test), no_main)]

#[cfg(not(test))]
use std::ffi::{c_char, c_int};

/// The C entry point (no Rust runtime start-up: it would install signal
/// handlers of its own, which the program would inherit).
///
/// # Safety
/// Called by the C library's start-up only.
#[cfg(not(test))]
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
