//! A pool of zeroed frames, filled ahead by a thread of its own, from which
//! the handler moves a run of frames into never-written pages instead of
//! having the kernel allocate and zero them in the fault's path.
//!
//! Why: on this VM `UFFDIO_COPY` of a run of zeros costs 1.8-1.9 µs a page
//! (the kernel allocates, zeroes and maps each frame while the program
//! waits), while `UFFDIO_MOVE` of a run of frames that already exist costs
//! 0.15 µs a page (measured by hand, 64-page runs). The frames still cost
//! the kernel the same work (`MADV_POPULATE_WRITE`, 2.2 µs a page), but the
//! filler does it on a CPU the program leaves idle: it runs at `SCHED_IDLE`,
//! so it takes no time from the program or from anything else on the
//! machine. When it cannot keep up (no idle CPU), the pool runs dry and the
//! handler falls back to `UFFDIO_COPY`, as before.
//!
//! The pool is a ring of [`POOL_PAGES`] pages of private anonymous memory,
//! not registered with the userfaultfd. It is filled only once the handler
//! has copied [`START_AFTER`] never-written pages in (a short-lived process
//! never pays for it), and refilled when [`REFILL`] slots are free; the
//! filler is at `SCHED_IDLE` only while it populates, and sleeps at the
//! normal policy, so a process exiting never waits for a starved filler.
//! The filler populates it in chunks of [`CHUNK`] pages behind the handler,
//! which takes runs from the front (one consumer: the handler, under the
//! shield's lock). Frames the kernel
//! zeroed hold nothing of the program's, so the pool is neither locked nor
//! dumped, and it is not inherited by a forked child (`MADV_DONTFORK`: a
//! child's copy would make the parent's frames shared, which `UFFDIO_MOVE`
//! refuses).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::Duration;

use memveil_sys::process::SchedPolicy;
use memveil_sys::uffd;

use crate::{PAGE, START_HOOK};

/// Pages in the ring (4 MiB).
pub(crate) const POOL_PAGES: usize = 1024;
/// Pages the filler populates at once (and the ring's alignment of them).
pub(crate) const CHUNK: usize = 64;

/// How long the filler sleeps at most before it looks again (a missed
/// wake-up costs this much, nothing more).
const NAP: Duration = Duration::from_millis(50);
/// Free slots that wake the filler (it then fills the ring up again).
const REFILL: usize = 256;
/// Never-written pages copied in before the pool is filled at all.
pub(crate) const START_AFTER: usize = 512;

/// The ring of zeroed frames.
pub(crate) struct ZeroPool {
    ring: uffd::DirectMap,
    /// Pages populated so far (counts up; the ring slot is `% POOL_PAGES`).
    filled: AtomicUsize,
    /// Pages taken so far (counts up; never more than `filled`).
    taken: AtomicUsize,
    /// Set by the handler once it has copied [`START_AFTER`] never-written
    /// pages in: a process that never takes fresh memory in bulk never
    /// fills the ring (no 4 MiB of frames, no filler at work).
    wanted: AtomicBool,
    /// Never-written pages the handler copied in while the pool was not
    /// wanted yet.
    copied: AtomicUsize,
    /// The filler waits for work on `room`, with `sleeping` set.
    sleeping: AtomicBool,
    lock: Mutex<()>,
    room: Condvar,
    stop: AtomicBool,
    /// Set when populating failed (a kernel without `MADV_POPULATE_WRITE`,
    /// or no memory): the handler copies zeros from then on.
    off: AtomicBool,
}

// SAFETY: the ring is only reached through system calls on its address: its
// pages are populated by the filler (ahead of `filled`) and moved away by the
// one consumer (behind it), the counters keeping the two apart.
unsafe impl Sync for ZeroPool {}

impl ZeroPool {
    /// Maps the ring (empty: the filler populates it).
    pub(crate) fn new() -> io::Result<Self> {
        let ring = uffd::DirectMap::new(POOL_PAGES * PAGE)?;
        for advice in [
            libc::MADV_DONTFORK,
            libc::MADV_DONTDUMP,
            libc::MADV_NOHUGEPAGE,
        ] {
            // SAFETY: advice on a mapping just made; none of these changes
            // its contents.
            unsafe { uffd::madvise_direct(ring.as_ptr(), ring.len(), advice) }?;
        }
        Ok(Self {
            ring,
            filled: AtomicUsize::new(0),
            taken: AtomicUsize::new(0),
            wanted: AtomicBool::new(false),
            copied: AtomicUsize::new(0),
            sleeping: AtomicBool::new(false),
            lock: Mutex::new(()),
            room: Condvar::new(),
            stop: AtomicBool::new(false),
            off: AtomicBool::new(false),
        })
    }

    /// A run of up to `want` zeroed frames at the front of the ring: its
    /// address and length in pages (0 when the ring is empty or off). The
    /// caller moves some of them away and reports how many with
    /// [`ZeroPool::took`].
    pub(crate) fn front(&self, want: usize) -> (u64, usize) {
        if self.off.load(Ordering::Relaxed) {
            return (0, 0);
        }
        let taken = self.taken.load(Ordering::Relaxed);
        let ready = self.filled.load(Ordering::Acquire) - taken;
        let slot = taken % POOL_PAGES;
        let n = want.min(ready).min(POOL_PAGES - slot);
        ((self.ring.as_ptr() as usize + slot * PAGE) as u64, n)
    }

    /// `n` frames from the front were moved away: their slots may be
    /// populated again. Wakes the filler when it waits for room.
    pub(crate) fn took(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.taken.fetch_add(n, Ordering::SeqCst);
        self.nudge();
    }

    /// `n` never-written pages were copied in (the ring was dry or not
    /// filled yet): after [`START_AFTER`] of them the pool is wanted.
    pub(crate) fn copied(&self, n: usize) {
        if !self.wanted.load(Ordering::Relaxed)
            && self.copied.fetch_add(n, Ordering::Relaxed) + n >= START_AFTER
        {
            self.wanted.store(true, Ordering::SeqCst);
            self.nudge();
        }
    }

    /// Wakes the filler when it waits and has work.
    fn nudge(&self) {
        if self.sleeping.load(Ordering::SeqCst) && self.has_work() {
            let _g = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.room.notify_one();
        }
    }

    /// Gives up the pool: [`ZeroPool::front`] hands out nothing from now on
    /// (the filler stops at its next chunk).
    pub(crate) fn turn_off(&self) {
        self.off.store(true, Ordering::Relaxed);
    }

    /// Stops the filler (it returns within [`NAP`]).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _g = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        self.room.notify_one();
    }

    /// The filler's loop, until [`ZeroPool::stop`]: populates the next chunk
    /// whenever the ring has room for one, else waits for the handler to
    /// take some.
    pub(crate) fn fill(&self) {
        if let Some(hook) = START_HOOK.get() {
            hook();
        }
        let _ = memveil_sys::process::set_thread_name("memveil-zeros");
        let tid = memveil_sys::process::gettid();
        loop {
            // Asleep at the normal policy: a process that exits (or is
            // killed) waits for every thread to die, and a SCHED_IDLE thread
            // on a busy machine may wait long for the CPU it needs for that.
            if !self.wait_for_work() {
                return;
            }
            // Populating: only time nobody else wants, the program's and
            // every other process's.
            let _ = memveil_sys::process::set_sched_policy(tid, SchedPolicy::Idle);
            let ok = self.populate_until_full();
            let _ = memveil_sys::process::set_sched_policy(tid, SchedPolicy::Normal);
            if !ok {
                self.off.store(true, Ordering::Relaxed);
                return;
            }
        }
    }

    /// Free slots in the ring.
    fn room(&self) -> usize {
        self.taken.load(Ordering::SeqCst) + POOL_PAGES - self.filled.load(Ordering::SeqCst)
    }

    /// Whether the filler has work: the handler wants the pool and at least
    /// [`REFILL`] slots are free.
    fn has_work(&self) -> bool {
        self.wanted.load(Ordering::SeqCst) && self.room() >= REFILL
    }

    /// Waits until there is work (true) or the pool stops (false).
    fn wait_for_work(&self) -> bool {
        loop {
            if self.stop.load(Ordering::SeqCst) || self.off.load(Ordering::Relaxed) {
                return false;
            }
            if self.has_work() {
                return true;
            }
            let g = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.sleeping.store(true, Ordering::SeqCst);
            // Looked at again with `sleeping` set: a take after this point
            // sees it and notifies under the lock, which this thread holds
            // until it waits.
            if !self.has_work() && !self.stop.load(Ordering::SeqCst) {
                drop(self.room.wait_timeout(g, NAP));
            }
            self.sleeping.store(false, Ordering::SeqCst);
        }
    }

    /// Populates chunks until the ring has no room for one; false when
    /// populating failed.
    fn populate_until_full(&self) -> bool {
        while !self.stop.load(Ordering::SeqCst) && self.room() >= CHUNK {
            let filled = self.filled.load(Ordering::Relaxed);
            let at = (self.ring.as_ptr() as usize + (filled % POOL_PAGES) * PAGE) as *mut u8;
            // SAFETY: the chunk lies inside the ring (CHUNK divides
            // POOL_PAGES); its slots are empty (taken, or never filled), so
            // populating changes no contents anyone reads.
            if unsafe { uffd::madvise_direct(at, CHUNK * PAGE, libc::MADV_POPULATE_WRITE) }.is_err()
            {
                return false;
            }
            self.filled.store(filled + CHUNK, Ordering::Release);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_hands_out_only_what_was_filled_and_never_past_its_end() {
        let p = ZeroPool::new().expect("map the ring");
        assert_eq!(p.front(8).1, 0, "nothing filled yet");
        p.filled.store(POOL_PAGES, Ordering::Release);
        let (a, n) = p.front(100);
        assert_eq!((a, n), (p.ring.as_ptr() as u64, 100));
        p.took(POOL_PAGES - 10);
        // Ten left before the end of the ring: a run does not wrap.
        assert_eq!(p.front(64).1, 10);
        p.took(10);
        assert_eq!(p.front(64).1, 0, "all taken");
        p.filled.store(POOL_PAGES + CHUNK, Ordering::Release);
        let (a, n) = p.front(100);
        assert_eq!(
            (a, n),
            (p.ring.as_ptr() as u64, CHUNK),
            "wrapped to the start"
        );
        p.off.store(true, Ordering::Relaxed);
        assert_eq!(p.front(8).1, 0, "off");
    }

    #[test]
    fn the_pool_is_wanted_only_after_bulk_fresh_memory_and_refills_by_the_quarter() {
        let p = ZeroPool::new().expect("map the ring");
        // An empty ring, but nobody asked for it yet: no work.
        assert!(!p.has_work());
        p.copied(START_AFTER - 1);
        assert!(!p.has_work(), "wanted too early");
        p.copied(1);
        assert!(p.has_work(), "not wanted after {START_AFTER} pages");
        // Full: no work until a quarter... REFILL slots are free again.
        p.filled.store(POOL_PAGES, Ordering::Release);
        assert!(!p.has_work());
        p.took(REFILL - 1);
        assert!(!p.has_work(), "woken for less than REFILL slots");
        p.took(1);
        assert!(p.has_work());
    }
}
