//! A process-wide stop flag raised by SIGINT/SIGTERM, for tools that must
//! finish cleanly (print their statistics) when interrupted, as rngtest does.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn raise_stop(_sig: libc::c_int) {
    // An atomic store is async-signal-safe.
    STOP.store(true, Ordering::SeqCst);
}

/// Installs a handler for each of `signals` that only sets the returned
/// flag. The handler is installed without `SA_RESTART`, so a blocking
/// `read(2)` in progress returns `EINTR` and the caller can look at the flag.
///
/// # Errors
/// The error of `sigaction(2)` (e.g. `EINVAL` for SIGKILL).
pub fn install_stop_flag(signals: &[libc::c_int]) -> io::Result<&'static AtomicBool> {
    for &sig in signals {
        // SAFETY: `sigaction` is plain old data; all-zero is a valid value
        // (no flags, empty handler) that is filled in below.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = raise_stop as extern "C" fn(libc::c_int) as libc::sighandler_t;
        sa.sa_flags = 0;
        // SAFETY: `sa.sa_mask` is a valid, writable sigset_t owned by `sa`.
        unsafe { libc::sigemptyset(&mut sa.sa_mask) };
        // SAFETY: `sa` is fully initialised; the handler only performs an
        // atomic store, which is async-signal-safe; the old action is not
        // requested (null pointer is allowed).
        if unsafe { libc::sigaction(sig, &sa, std::ptr::null_mut()) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(&STOP)
}

/// [`install_stop_flag`] for SIGINT and SIGTERM.
///
/// # Errors
/// The error of `sigaction(2)`.
pub fn stop_on_interrupt() -> io::Result<&'static AtomicBool> {
    install_stop_flag(&[libc::SIGINT, libc::SIGTERM])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigkill_cannot_be_caught() {
        assert!(install_stop_flag(&[libc::SIGKILL]).is_err());
    }

    #[test]
    fn a_raised_signal_sets_the_flag() {
        let flag = install_stop_flag(&[libc::SIGUSR2]).expect("sigaction");
        // SAFETY: raising a signal whose handler was just installed.
        assert_eq!(unsafe { libc::raise(libc::SIGUSR2) }, 0);
        assert!(flag.load(Ordering::SeqCst));
    }
}
