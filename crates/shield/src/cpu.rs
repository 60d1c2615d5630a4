//! What the shield's own threads cost: the CPU time of the fault handler,
//! the watchdog (sweeps, scans, the budget's bookkeeping) and the filler of
//! the zero pool, read from their thread CPU clocks. A timed section misses
//! a thread's wake-ups, its reads of the userfaultfd, its `mincore` scans
//! outside the lock; the thread's clock does not.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The shield's threads.
#[derive(Clone, Copy)]
pub(crate) enum Worker {
    Handler = 0,
    Guard = 1,
    Zeros = 2,
}

/// Thread ids of the shield's threads and the CPU time last read of each.
#[derive(Default)]
pub(crate) struct ShieldCpu {
    tids: [AtomicU32; 3],
    seen: [AtomicU64; 3],
    /// The handler's run delay at the last [`ShieldCpu::refresh_handler_wait`].
    handler_wait: AtomicU64,
    /// The handler's run delay when it first came to wait for faults
    /// ([`ShieldCpu::handler_ready`]), which [`ShieldCpu::handler_wait_ns`]
    /// leaves out.
    handler_wait_base: AtomicU64,
}

impl ShieldCpu {
    /// Called by a shield thread as it starts: its clock counts from now on.
    pub(crate) fn enter(&self, w: Worker) {
        self.tids[w as usize].store(memveil_sys::process::gettid(), Ordering::Release);
    }

    /// CPU time of the shield's threads so far, in ns. A thread whose clock
    /// cannot be read (it exited) keeps its last reading.
    pub(crate) fn total_ns(&self) -> u64 {
        (0..self.tids.len())
            .map(|k| self.read(k))
            .fold(0, u64::saturating_add)
    }

    /// The handler's CPU time so far, in ns (0 before it started): its
    /// clock alone.
    pub(crate) fn handler_ns(&self) -> u64 {
        self.read(Worker::Handler as usize)
    }

    /// Called by the handler as it first comes to wait for faults: the run
    /// delay it took to get there (a new thread waiting for its first run,
    /// behind the program's threads and other programs: 4-35 ms for each
    /// process of a protected shell pipeline on a loaded host, 13 ms for a
    /// `sort` that took no fault) kept no fault waiting, unless one is
    /// waiting already (`fault_waiting`: then it is all counted).
    pub(crate) fn handler_ready(&self, fault_waiting: bool) {
        let tid = self.tids[Worker::Handler as usize].load(Ordering::Acquire);
        if fault_waiting || tid == 0 {
            return;
        }
        if let Some(ns) = memveil_sys::process::run_delay_ns(tid) {
            self.handler_wait_base.store(ns, Ordering::Relaxed);
        }
    }

    /// Reads how long the handler has waited for a CPU so far, runnable
    /// but off it (its `schedstat` run delay), for
    /// [`ShieldCpu::handler_wait_ns`]: a file read, so the watchdog does
    /// it once a tick, not every sweep step.
    pub(crate) fn refresh_handler_wait(&self) {
        let tid = self.tids[Worker::Handler as usize].load(Ordering::Acquire);
        if tid != 0 {
            if let Some(ns) = memveil_sys::process::run_delay_ns(tid) {
                self.handler_wait.fetch_max(ns, Ordering::Relaxed);
            }
        }
    }

    /// The handler's run delay at the last refresh, in ns, since it was
    /// ready ([`ShieldCpu::handler_ready`]): the handler wakes for faults
    /// alone, so this is time a faulting thread waited
    /// for it to get a CPU (behind the watchdog, the program's other
    /// threads, other programs), which neither its CPU clock nor the
    /// hand-off measured at start counts. 4096 faults back to back took
    /// 26.6 us each here (taken around each touch): 8.4 us the handler's
    /// CPU, 4.6 us the hand-off, 13 us this wait.
    pub(crate) fn handler_wait_ns(&self) -> u64 {
        self.handler_wait
            .load(Ordering::Relaxed)
            .saturating_sub(self.handler_wait_base.load(Ordering::Relaxed))
    }

    /// Thread `k`'s CPU time so far (its last reading if its clock cannot
    /// be read now).
    fn read(&self, k: usize) -> u64 {
        let tid = self.tids[k].load(Ordering::Acquire);
        if tid != 0 {
            if let Ok(ns) = memveil_sys::process::thread_cpu_ns(tid) {
                self.seen[k].fetch_max(ns, Ordering::Relaxed);
            }
        }
        self.seen[k].load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threads_cpu_is_counted_and_kept_after_they_exit() {
        let cpu = std::sync::Arc::new(ShieldCpu::default());
        assert_eq!(cpu.total_ns(), 0, "no thread entered yet");
        let c = std::sync::Arc::clone(&cpu);
        std::thread::spawn(move || {
            c.enter(Worker::Guard);
            // Spins until its own clock (read apart from `ShieldCpu`) says
            // 30 ms: 30 ms of wall time was less than 10 ms of CPU on a
            // loaded 2-vCPU host.
            let me = memveil_sys::process::gettid();
            let t = std::time::Instant::now();
            let mut x = 0u64;
            while memveil_sys::process::thread_cpu_ns(me).unwrap_or(u64::MAX) < 30_000_000
                && t.elapsed() < std::time::Duration::from_secs(20)
            {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            // Read while the thread lives: what it used so far.
            assert!(c.total_ns() >= 10_000_000, "{}", c.total_ns());
        })
        .join()
        .expect("join");
        // The thread is gone: its last reading stays.
        assert!(cpu.total_ns() >= 10_000_000, "{}", cpu.total_ns());
        assert_eq!(cpu.handler_ns(), 0, "the handler never entered");
    }
}
