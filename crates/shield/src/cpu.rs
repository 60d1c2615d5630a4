//! What the shield's own threads cost: the CPU time of the fault handler,
//! the watchdog (sweeps, scans, the budget's bookkeeping), the filler of
//! the zero pool and, for a program the loader runs, the agent that serves
//! its memory calls ([`crate::Shield::enter_agent`]), read from their
//! thread CPU clocks. A timed section misses
//! a thread's wake-ups, its reads of the userfaultfd, its `mincore` scans
//! outside the lock; the thread's clock does not.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

/// The shield's threads.
#[derive(Clone, Copy)]
pub(crate) enum Worker {
    Handler = 0,
    Guard = 1,
    Zeros = 2,
    /// The loader's agent (not started by the shield: it says so itself).
    Agent = 3,
}

thread_local! {
    /// Whether this thread is the agent: its thread clock counts its work,
    /// so its time in the shield's calls is not counted again as work on
    /// the program's threads ([`crate::Counters::program_ns`]).
    static IS_AGENT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is the agent ([`ShieldCpu::enter_agent`]).
pub(crate) fn on_agent() -> bool {
    IS_AGENT.with(std::cell::Cell::get)
}

/// Thread ids of the shield's threads and the CPU time last read of each.
#[derive(Default)]
pub(crate) struct ShieldCpu {
    tids: [AtomicU32; 4],
    seen: [AtomicU64; 4],
    /// The handler's run delay faults waited for ([`WaitSplit`]).
    handler_wait: AtomicU64,
    /// The faulting threads' wait for a CPU once woken ([`post_wake_wait`]).
    woken_wait: AtomicU64,
    /// The descriptors of the handler's [`SchedFile`]s (its own, the
    /// faulting thread's), plus one (0: none), for a forked child to close: the
    /// handler that owns them does not exist there.
    files: [AtomicI32; 2],
}

/// Which of the handler's [`SchedFile`]s ([`ShieldCpu::note_file`]).
#[derive(Clone, Copy)]
pub(crate) enum FileSlot {
    Own = 0,
    Faulter = 1,
}

impl ShieldCpu {
    /// Called by a shield thread as it starts: its clock counts from now on.
    pub(crate) fn enter(&self, w: Worker) {
        self.tids[w as usize].store(memveil_sys::process::gettid(), Ordering::Release);
    }

    /// Called by the agent as it starts: its clock counts from now on, and
    /// its work in the shield's calls is not timed again.
    pub(crate) fn enter_agent(&self) {
        IS_AGENT.with(|a| a.set(true));
        self.enter(Worker::Agent);
    }

    /// The agent's CPU time so far, in ns (0 without one).
    pub(crate) fn agent_ns(&self) -> u64 {
        self.read(Worker::Agent as usize)
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

    /// Notes `f` as the handler's file in `slot` (before the file it
    /// replaces is closed: a fork meanwhile leaves the child one more
    /// descriptor, never one closed and reused).
    pub(crate) fn note_file(&self, slot: FileSlot, f: Option<&SchedFile>) {
        let fd = f.map_or(0, |f| f.fd.as_raw_fd().saturating_add(1));
        self.files[slot as usize].store(fd, Ordering::Release);
    }

    /// Closes the handler's files in a forked child.
    ///
    /// # Safety
    /// Only in a forked child, where the handler that owns the files does
    /// not exist, once: the numbers are closed here and may be reused.
    pub(crate) unsafe fn close_files_in_forked_child(&self) {
        for f in &self.files {
            let fd: RawFd = f.swap(0, Ordering::AcqRel) - 1;
            if fd >= 0 {
                // SAFETY: the caller promises nothing in the child uses it.
                let _ = unsafe { memveil_sys::fdguard::close_held(fd) };
            }
        }
    }

    /// Adds `ns` of the handler's run delay that faults waited for
    /// ([`WaitSplit`] decides which part that is).
    pub(crate) fn add_handler_wait(&self, ns: u64) {
        if ns > 0 {
            self.handler_wait.fetch_add(ns, Ordering::Relaxed);
        }
    }

    /// Adds `ns` of a woken thread's wait for a CPU ([`post_wake_wait`]).
    pub(crate) fn add_woken_wait(&self, ns: u64) {
        if ns > 0 {
            self.woken_wait.fetch_add(ns, Ordering::Relaxed);
        }
    }

    /// How long the program's threads waited so far for a CPU once woken
    /// from a fault, in ns ([`post_wake_wait`]).
    pub(crate) fn woken_wait_ns(&self) -> u64 {
        self.woken_wait.load(Ordering::Relaxed)
    }

    /// How long faults waited so far for the handler to get a CPU, in ns:
    /// its run delay (`schedstat`) while a fault was in hand or waiting
    /// for it, split off by [`WaitSplit`]. Neither its CPU clock nor the
    /// hand-off measured at start counts it. 4096 faults back to back took
    /// 26.6 us each here (taken around each touch): 8.4 us the handler's
    /// CPU, 4.6 us the hand-off, 13 us this wait.
    pub(crate) fn handler_wait_ns(&self) -> u64 {
        self.handler_wait.load(Ordering::Relaxed)
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

/// A thread's `schedstat`: its CPU time and its run delay (time runnable
/// but off a CPU), ns, and how many times it was put on a CPU.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sched {
    pub(crate) cpu: u64,
    pub(crate) delay: u64,
    pub(crate) runs: u64,
}

/// What a thread waited for a CPU after its last fault's wake, read at its
/// next fault (`then`: its `schedstat` in the last fault, `now`: in this
/// one), in ns: its run delay since, over the times it was put on a CPU
/// since (the wait after the wake is one of those; the others are
/// preemptions while it ran). Beside busy loops a thread woken from a fault
/// waits for a CPU before it runs again: wait the sweep's time away must
/// not count as the program's (`sweep::HeldLog`); a pass over the 100 ms
/// canary's hot quarter with tens of faults in it took over 50 ms so.
pub(crate) fn post_wake_wait(then: Sched, now: Sched) -> u64 {
    let waited = now.delay.saturating_sub(then.delay);
    waited / now.runs.saturating_sub(then.runs).max(1)
}

/// A thread's `schedstat` file, kept open: one `pread` a reading (about
/// 1 us here), not an open, a read and a close. Opened as `/proc/TID`,
/// outside `/proc/TGID` (entries looked up under `/proc/TGID/task` made
/// the parent's `wait4` spin at the program's end; docs/shield.md), and
/// held high like the shield's other descriptors, out of the program's way.
pub(crate) struct SchedFile {
    fd: memveil_sys::fdguard::Held,
    pub(crate) tid: u32,
}

impl SchedFile {
    /// The calling thread's.
    pub(crate) fn own() -> Option<Self> {
        Self::of(memveil_sys::process::gettid())
    }

    /// Thread `tid`'s.
    pub(crate) fn of(tid: u32) -> Option<Self> {
        let file = std::fs::File::open(format!("/proc/{tid}/schedstat")).ok()?;
        Some(SchedFile {
            fd: memveil_sys::fdguard::move_high(file.into()),
            tid,
        })
    }

    /// The reading now (`None`: the thread is gone).
    pub(crate) fn read(&self) -> Option<Sched> {
        let mut buf = [0u8; 96];
        // SAFETY: `buf` is writable for its length; the descriptor is ours
        // (held: the program cannot close it).
        let n = unsafe { libc::pread(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        let text = std::str::from_utf8(buf.get(..usize::try_from(n).ok()?)?).ok()?;
        let (cpu, delay) = memveil_sys::process::parse_schedstat(text)?;
        let runs = text
            .split_ascii_whitespace()
            .nth(2)
            .and_then(|r| r.parse().ok())
            .unwrap_or(0);
        Some(Sched { cpu, delay, runs })
    }
}

/// What the handler knew as it woke the faulting threads of a batch.
#[derive(Debug, Clone, Copy)]
struct Woke {
    /// Its run delay then.
    delay: u64,
    /// When (ns on a monotonic clock).
    at_ns: u64,
    /// The one thread woken, and its `schedstat` while it still waited in
    /// its fault (`None`: several threads, or not known).
    thread: Option<(u32, Sched)>,
}

/// Splits the handler's run delay into what faults waited for and what
/// they did not. A thread woken on the handler's CPU preempts the handler
/// (at `SCHED_IDLE` always), which then stays runnable, off the CPU, while
/// the program runs: run delay that no fault waits for (a third of the
/// cold server's counted cost, where the server keeps its CPU busy until
/// its next fault, and that fault lets the handler on at once). Felt:
/// the run delay from when the handler comes to read faults until it wakes
/// their threads; after a wake, only when a fault was waiting as the handler
/// got back to read, and then no more than the faulting thread spent
/// neither on a CPU nor waiting for one since it was woken (when it is the
/// one thread that was woken; all of it otherwise). Fed with readings, so
/// the accounting is tested apart from the scheduler.
#[derive(Debug)]
pub(crate) struct WaitSplit {
    /// The last wake, until the handler next comes to read faults.
    woke: Option<Woke>,
    /// A post-wake run delay during which a fault came, and that wake.
    gap: Option<(u64, Woke)>,
    /// The handler's run delay as it came to read faults.
    reading: u64,
}

impl Default for WaitSplit {
    /// As the handler starts: its run delay since the thread began counts
    /// only if a fault waits for it as it first comes to read (a new
    /// thread's wait for its first run, 4-35 ms for each process of a
    /// protected shell pipeline on a loaded host, kept no fault waiting
    /// otherwise).
    fn default() -> Self {
        WaitSplit {
            woke: Some(Woke {
                delay: 0,
                at_ns: 0,
                thread: None,
            }),
            gap: None,
            reading: 0,
        }
    }
}

impl WaitSplit {
    /// Whether [`WaitSplit::before_read`] looks at `pending` (after a wake).
    #[cfg(test)]
    fn wants_pending(&self) -> bool {
        self.woke.is_some()
    }

    /// The handler comes to read faults (and may sleep): `delay` its run
    /// delay now, `pending` whether a fault waited already (the read that
    /// follows found one; looked at only after a wake).
    pub(crate) fn before_read(&mut self, delay: u64, pending: bool) {
        if let Some(w) = self.woke.take() {
            if pending {
                self.gap = Some((delay.saturating_sub(w.delay), w));
            }
        }
        self.reading = delay;
    }

    /// A read returned faults, all of thread `tid` (`None`: several or not
    /// known) whose `schedstat` is `now` at `at_ns`: the run delay after
    /// the last wake they waited for, in ns.
    pub(crate) fn after_read(&mut self, tid: Option<u32>, now: Option<Sched>, at_ns: u64) -> u64 {
        let Some((gap, w)) = self.gap.take() else {
            return 0;
        };
        match (tid, w.thread, now) {
            (Some(t), Some((woken, then)), Some(now)) if t == woken => {
                // Since it was woken, the thread was on a CPU, waited for
                // one, or was blocked: its fault waited within the last.
                let wall = at_ns.saturating_sub(w.at_ns);
                let ran = now.cpu.saturating_sub(then.cpu);
                let queued = now.delay.saturating_sub(then.delay);
                gap.min(wall.saturating_sub(ran).saturating_sub(queued))
            }
            _ => gap,
        }
    }

    /// The handler is about to wake the threads of the batch in hand:
    /// `delay` its run delay now, at `at_ns`; `thread` the one thread it
    /// wakes and its `schedstat` as it waits in its fault. Returns the run
    /// delay since the handler came to read the batch (all felt: a fault
    /// was waiting or in hand), in ns.
    pub(crate) fn before_wake(
        &mut self,
        delay: u64,
        at_ns: u64,
        thread: Option<(u32, Sched)>,
    ) -> u64 {
        self.woke = Some(Woke {
            delay,
            at_ns,
            thread,
        });
        delay.saturating_sub(self.reading)
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

    /// A wake of one thread at run delay 1 ms (its `schedstat` then).
    fn woke_one(split: &mut WaitSplit, at_read: u64) -> u64 {
        split.before_read(at_read, false);
        split.before_wake(
            1_000_000,
            10_000_000,
            Some((
                7,
                Sched {
                    cpu: 50_000_000,
                    delay: 2_000_000,
                    runs: 0,
                },
            )),
        )
    }

    #[test]
    fn a_wakes_post_wake_run_delay_is_not_charged_when_no_fault_waited() {
        let mut split = WaitSplit::default();
        // In hand from 0.9 ms to 1 ms of run delay: felt.
        assert_eq!(woke_one(&mut split, 900_000), 100_000);
        // Preempted by the woken thread for 8 ms, and back to read with no
        // fault waiting: no fault waited for any of it.
        assert!(split.wants_pending());
        split.before_read(9_000_000, false);
        assert_eq!(split.after_read(Some(7), None, 20_000_000), 0);
        assert_eq!(split.before_wake(9_050_000, 21_000_000, None), 50_000);
    }

    #[test]
    fn a_fault_of_the_woken_thread_is_charged_only_the_time_it_was_blocked() {
        let mut split = WaitSplit::default();
        woke_one(&mut split, 900_000);
        // 8 ms of post-wake run delay, and a fault waiting as the handler
        // got back: the thread ran 7.5 ms and waited 0.2 ms for a CPU of
        // the 8 ms since its wake, so its fault waited 0.3 ms at most.
        split.before_read(9_000_000, true);
        let now = Sched {
            cpu: 57_500_000,
            delay: 2_200_000,
            runs: 0,
        };
        assert_eq!(split.after_read(Some(7), Some(now), 18_000_000), 300_000);
        // A thread blocked the whole time: all of the gap (never more).
        let mut split = WaitSplit::default();
        woke_one(&mut split, 900_000);
        split.before_read(9_000_000, true);
        let idle = Sched {
            cpu: 50_000_000,
            delay: 2_000_000,
            runs: 0,
        };
        assert_eq!(split.after_read(Some(7), Some(idle), 30_000_000), 8_000_000);
    }

    #[test]
    fn a_fault_of_another_thread_after_a_wake_is_charged_the_whole_delay() {
        let mut split = WaitSplit::default();
        woke_one(&mut split, 900_000);
        split.before_read(9_000_000, true);
        assert_eq!(split.after_read(Some(8), None, 18_000_000), 8_000_000);
        let mut split = WaitSplit::default();
        woke_one(&mut split, 900_000);
        split.before_read(9_000_000, true);
        assert_eq!(split.after_read(None, None, 18_000_000), 8_000_000);
    }

    #[test]
    fn the_handlers_wait_for_its_first_run_counts_only_with_a_fault_waiting() {
        let mut quiet = WaitSplit::default();
        quiet.before_read(13_000_000, false);
        assert_eq!(quiet.after_read(None, None, 1), 0);
        let mut waited = WaitSplit::default();
        waited.before_read(13_000_000, true);
        assert_eq!(waited.after_read(Some(7), None, 1), 13_000_000);
    }

    #[test]
    fn a_woken_threads_wait_is_its_run_delay_over_its_runs() {
        let then = Sched {
            cpu: 10_000_000,
            delay: 4_000_000,
            runs: 100,
        };
        // Woken, it waited 2.5 ms for a CPU, ran until its next fault.
        let now = Sched {
            cpu: 10_300_000,
            delay: 6_500_000,
            runs: 101,
        };
        assert_eq!(post_wake_wait(then, now), 2_500_000);
        // Preempted three times meanwhile (12 ms of run delay over four
        // runs): a quarter is counted as the wake's.
        let now = Sched {
            cpu: 30_000_000,
            delay: 16_000_000,
            runs: 104,
        };
        assert_eq!(post_wake_wait(then, now), 3_000_000);
        // A reading without runs (or going back) counts nothing odd.
        assert_eq!(post_wake_wait(now, then), 0);
    }

    #[test]
    fn a_threads_schedstat_is_read_from_its_open_file() {
        let Some(own) = SchedFile::own() else {
            memveil_testkit::skip(
                memveil_testkit::Need::HostSetting("CONFIG_SCHED_INFO"),
                "no /proc/thread-self/schedstat",
            );
            return;
        };
        let a = own.read().expect("a reading");
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(5) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let b = own.read().expect("a second reading");
        assert!(b.cpu > a.cpu && b.delay >= a.delay, "{a:?} then {b:?}");
        assert!(b.runs >= a.runs && a.runs > 0, "{a:?} then {b:?}");
        let tid = memveil_sys::process::gettid();
        let by_tid = SchedFile::of(tid).and_then(|f| f.read()).expect("by tid");
        assert!(by_tid.cpu >= b.cpu, "{by_tid:?} before {b:?}");
    }

    #[test]
    fn a_forked_child_closes_the_handlers_files_and_only_those() {
        let cpu = ShieldCpu::default();
        // Nothing noted: nothing closed (descriptor 0 stays as it was).
        // SAFETY: F_GETFD only reads descriptor flags.
        let stdin = unsafe { libc::fcntl(0, libc::F_GETFD) };
        // SAFETY: no file is noted.
        unsafe { cpu.close_files_in_forked_child() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::fcntl(0, libc::F_GETFD) }, stdin);
        let Some(f) = SchedFile::own() else {
            memveil_testkit::skip(
                memveil_testkit::Need::HostSetting("CONFIG_SCHED_INFO"),
                "no /proc/TID/schedstat",
            );
            return;
        };
        let fd = f.fd.as_raw_fd();
        cpu.note_file(FileSlot::Faulter, Some(&f));
        assert!(memveil_sys::fdguard::is_held(fd), "held high");
        // As in a child, where the handler owning `f` does not exist: in a
        // real forked child, whose only thread is this one. Checked in this
        // process, the number was free again once closed, and another test
        // thread's own held file took it before the check (the test failed
        // now and then in the parallel run, "still open").
        std::mem::forget(f);
        let code = in_a_forked_child(|| {
            // SAFETY: `f` is forgotten: nothing in the child uses its
            // descriptor.
            unsafe { cpu.close_files_in_forked_child() };
            // SAFETY: F_GETFD only reads descriptor flags.
            if unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1 {
                1
            } else if memveil_sys::fdguard::is_held(fd) {
                2
            } else {
                0
            }
        });
        assert_eq!(
            code, 0,
            "descriptor {fd} in the child: 1 still open, 2 still held"
        );
        // SAFETY: `f` was forgotten; this process closes its copy once.
        let _ = unsafe { memveil_sys::fdguard::close_held(fd) };
    }

    /// Runs `check` in a forked child and returns its exit status (`check`
    /// may use only what is safe after `fork` in a threaded process:
    /// system calls and atomics).
    fn in_a_forked_child(check: impl FnOnce() -> i32) -> i32 {
        // SAFETY: the child runs only `check` (system calls and atomics, as
        // its caller promises) and leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let code = check();
            // SAFETY: leaves the child without running the parent's
            // destructors or atexit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is writable.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(r, pid, "waitpid: {}", std::io::Error::last_os_error());
        assert!(libc::WIFEXITED(status), "child status {status:#x}");
        libc::WEXITSTATUS(status)
    }
}
