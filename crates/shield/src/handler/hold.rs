//! A reference to the userfaultfd that the program cannot close: a thread
//! of the shield with a descriptor table of its own (`close_range` with
//! `CLOSE_RANGE_UNSHARE` gives the calling thread a private copy of the
//! table), holding the userfaultfd only.
//!
//! The preload's wrappers keep the userfaultfd's number open, but a raw
//! `close_range` system call in a dynamic program passes them by. Without
//! this hold the number's close could drop the file's last reference (the
//! handler's `read(2)` holds one while it waits, and lets it go as the
//! next fault comes in): the kernel then unregistered every range and woke
//! the faulting threads, which retried and got zero pages in place of
//! evicted ones before the handler, at its next use of the number
//! (`EBADF`), ended the program. With the file held here the ranges stay
//! registered and a faulting thread stays blocked until the handler sees
//! `EBADF` and ends the program ([`super::lost_uffd`]), however late the
//! handler runs. docs/shield.md, Limits.

use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use memveil_sys::stack_thread::{self, StackThread};

use super::HandlerStack;
use crate::START_HOOK;

/// The hold's states.
const STARTING: u8 = 0;
const HOLDING: u8 = 1;
const FAILED: u8 = 2;
const STOP: u8 = 3;

struct Gate {
    state: Mutex<(u8, i32)>,
    wake: Condvar,
}

impl Gate {
    fn set(&self, state: u8, err: i32) {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner) = (state, err);
        self.wake.notify_all();
    }

    /// Waits while the state is `from`; returns the state and its error.
    fn wait_past(&self, from: u8) -> (u8, i32) {
        let mut g = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while g.0 == from {
            g = self.wake.wait(g).unwrap_or_else(PoisonError::into_inner);
        }
        *g
    }
}

/// The holding thread, stopped (its table, and with it its reference, let
/// go) by [`Hold::stop`].
pub(crate) struct Hold {
    thread: StackThread<HandlerStack>,
    gate: Arc<Gate>,
}

impl Hold {
    /// Starts the holding thread on `fd` and returns once it holds it.
    ///
    /// # Errors
    /// Why it could not (the thread's stack or creation, or
    /// `close_range`), as a sentence.
    pub(crate) fn start(fd: RawFd) -> Result<Self, String> {
        let gate = Arc::new(Gate {
            state: Mutex::new((STARTING, 0)),
            wake: Condvar::new(),
        });
        let g = Arc::clone(&gate);
        let stack = HandlerStack::new().map_err(|e| e.to_string())?;
        let thread = stack_thread::spawn(stack, move || {
            if let Some(hook) = START_HOOK.get() {
                hook();
            }
            let _ = memveil_sys::process::set_thread_name("memveil-hold");
            match private_table(fd) {
                Ok(()) => {
                    g.set(HOLDING, 0);
                    g.wait_past(HOLDING);
                }
                Err(e) => g.set(FAILED, e),
            }
        })
        .map_err(|e| format!("cannot start its thread: {e}"))?;
        match gate.wait_past(STARTING) {
            (HOLDING, _) => Ok(Hold { thread, gate }),
            (_, e) => {
                drop(thread.join());
                Err(format!(
                    "close_range(CLOSE_RANGE_UNSHARE) failed: {}",
                    std::io::Error::from_raw_os_error(e)
                ))
            }
        }
    }

    /// Lets the reference go and joins the thread.
    pub(crate) fn stop(self) {
        self.gate.set(STOP, 0);
        drop(self.thread.join());
    }
}

/// Gives the calling thread a descriptor table of its own that holds `fd`
/// only: the numbers above it are left out of the copy, those below closed
/// in it (the program's descriptors the copy took along). Raw system
/// calls: the preload's `close_range` wrapper would keep the shield's
/// other descriptors, and this table needs none of them.
fn private_table(fd: RawFd) -> Result<(), i32> {
    let fd = u32::try_from(fd).map_err(|_| libc::EBADF)?;
    // SAFETY: close_range takes three integer arguments; with
    // CLOSE_RANGE_UNSHARE it closes in the calling thread's private copy of
    // the table, so the program's descriptors stay open in its own.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            fd.saturating_add(1),
            u32::MAX,
            libc::CLOSE_RANGE_UNSHARE,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO));
    }
    if fd > 0 {
        // SAFETY: as above, in the table that is this thread's alone now.
        let _ = unsafe { libc::syscall(libc::SYS_close_range, 0u32, fd - 1, 0u32) };
    }
    Ok(())
}
