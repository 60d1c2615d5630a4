//! Where a faulting thread runs, without a system call: the CPU number the
//! kernel keeps in each thread's rseq area (glibc 2.35+ registers one per
//! thread, `__rseq_offset` bytes from the thread pointer), so the handler
//! can follow the faulting thread on every fault instead of reading
//! `/proc/PID/task/TID/stat` (a `pread`, about 3 µs) every
//! [`crate::FOLLOW_EVERY`] faults.
//!
//! Threads register themselves ([`register_thread`]; the preload library
//! does it for every thread of the program) and unregister before they exit.
//! The handler reads a thread's area only while that thread is blocked in a
//! fault the handler is resolving (so the thread, and its area, exist), and
//! never when the area lies in a protected range (the read could fault on
//! the handler itself).

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

/// Threads tracked at once; more are followed by the slower look-up.
const SLOTS: usize = 1024;

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_TID: AtomicU32 = AtomicU32::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_ADDR: AtomicUsize = AtomicUsize::new(0);
static TIDS: [AtomicU32; SLOTS] = [EMPTY_TID; SLOTS];
static ADDRS: [AtomicUsize; SLOTS] = [EMPTY_ADDR; SLOTS];

/// Offset of `cpu_id` in the kernel's `struct rseq` (after `cpu_id_start`).
const CPU_ID: usize = 4;

/// The calling thread's rseq area, when the C library registered one.
fn own_rseq() -> Option<usize> {
    // SAFETY: dlsym with NUL-terminated names; the results are read only if
    // non-null, as the objects glibc documents (`ptrdiff_t __rseq_offset`,
    // `unsigned int __rseq_size`), which never change after start-up.
    let (off, size) = unsafe {
        let off = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_offset".as_ptr());
        let size = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_size".as_ptr());
        if off.is_null() || size.is_null() {
            return None;
        }
        (off.cast::<isize>().read(), size.cast::<u32>().read())
    };
    // Registration failed or was turned off (glibc.pthread.rseq=0).
    if (size as usize) < CPU_ID + 4 {
        return None;
    }
    // SAFETY: pthread_self takes no arguments; on glibc it is the thread
    // pointer, from which `__rseq_offset` locates the thread's area.
    let tp = usize::try_from(unsafe { libc::pthread_self() }).ok()?;
    Some(tp.wrapping_add_signed(off))
}

fn slot_of(tid: u32) -> usize {
    (tid as usize).wrapping_mul(0x9E37_79B9) % SLOTS
}

/// Registers the calling thread so the fault handler can see where it runs;
/// returns whether it could (an rseq area exists and a slot was free).
pub fn register_thread() -> bool {
    let Some(area) = own_rseq() else {
        return false;
    };
    let tid = memveil_sys::process::gettid();
    if tid == 0 {
        return false;
    }
    let start = slot_of(tid);
    for k in 0..SLOTS {
        let i = (start + k) % SLOTS;
        let t = TIDS[i].load(Ordering::Acquire);
        if t == tid
            || (t == 0
                && TIDS[i]
                    .compare_exchange(0, tid, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok())
        {
            ADDRS[i].store(area + CPU_ID, Ordering::Release);
            return true;
        }
    }
    false
}

/// Forgets every thread and registers the calling one: in a child after
/// `fork`, where only the forking thread exists.
pub fn reset_after_fork() {
    for i in 0..SLOTS {
        ADDRS[i].store(0, Ordering::Release);
        TIDS[i].store(0, Ordering::Release);
    }
    register_thread();
}

/// Unregisters the calling thread (before it exits).
pub fn unregister_thread() {
    let tid = memveil_sys::process::gettid();
    if let Some(i) = find(tid) {
        ADDRS[i].store(0, Ordering::Release);
        TIDS[i].store(0, Ordering::Release);
    }
}

/// Calls `f` with the id of every registered thread of the program.
pub(crate) fn each_registered(mut f: impl FnMut(u32)) {
    for t in &TIDS {
        match t.load(Ordering::Acquire) {
            0 => {}
            tid => f(tid),
        }
    }
}

fn find(tid: u32) -> Option<usize> {
    if tid == 0 {
        return None;
    }
    let start = slot_of(tid);
    (0..SLOTS)
        .map(|k| (start + k) % SLOTS)
        .find(|&i| TIDS[i].load(Ordering::Acquire) == tid)
}

/// The CPU thread `tid` runs on, from its rseq area, unless it is not
/// registered or its area is in memory `protected` says the handler must not
/// touch.
///
/// Call it only for a thread blocked in a fault being resolved: such a
/// thread cannot exit meanwhile, so its registered area is mapped.
pub(crate) fn cpu_of(tid: u32, protected: impl Fn(usize) -> bool) -> Option<usize> {
    let addr = ADDRS[find(tid)?].load(Ordering::Acquire);
    if addr == 0 || !addr.is_multiple_of(4) || protected(addr) {
        return None;
    }
    // SAFETY: `addr` is the `cpu_id` field of the rseq area of thread `tid`,
    // registered by that thread and removed before it exits; the caller
    // promises the thread is blocked in a fault (alive), and the area is not
    // in protected memory (reading it cannot fault on the handler). The
    // kernel writes the field; a volatile read of an aligned u32 sees a
    // whole value.
    let cpu = unsafe { (addr as *const u32).read_volatile() };
    // The kernel's "not registered" markers are u32::MAX and u32::MAX - 1.
    (cpu < u32::MAX - 1).then_some(cpu as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registered_thread_is_found_where_it_runs() {
        std::thread::spawn(|| {
            let _ = memveil_sys::process::pin_to_cpu(0);
            if !register_thread() {
                println!("no rseq area here (C library without rseq): nothing to read");
                return;
            }
            let tid = memveil_sys::process::gettid();
            assert_eq!(cpu_of(tid, |_| false), Some(0));
            // An area in protected memory is never read.
            assert_eq!(cpu_of(tid, |_| true), None);
            unregister_thread();
            assert_eq!(cpu_of(tid, |_| false), None);
        })
        .join()
        .expect("thread");
        assert_eq!(cpu_of(u32::MAX, |_| false), None);
        assert_eq!(cpu_of(0, |_| false), None);
    }
}
