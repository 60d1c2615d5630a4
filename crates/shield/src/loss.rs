//! What the shield's background threads cost the program in wall time, as
//! opposed to CPU time of the host (issue 33, item 4: the summary's cost is
//! what the program loses against a plain run).
//!
//! The watchdog (sweeps, scans, the budget's bookkeeping) and the zero
//! pool's filler never hold up a fault: they cost the program wall time
//! only when they take a CPU one of its threads was waiting for. Beside a
//! single-threaded program on an idle second CPU they cost it nothing
//! (measured: GNU sort reported 21.5% and lost -3.8% of plain while their
//! CPU was counted in full); when every CPU is busy, up to all of their
//! CPU. So between two looks the loss counted is the least of what the
//! program's threads waited for a CPU (the growth of their `schedstat` run
//! delay) and what those threads used meanwhile (their thread clocks): the
//! rest of the wait was behind other threads, the rest of the CPU was spare.
//!
//! The program's threads are the ones the preload registered
//! ([`crate::threads`]); their `/proc/TID/schedstat` is read at most every
//! [`LOOK_EVERY`] and once more as the process exits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Least time between two looks (a file read per program thread).
const LOOK_EVERY: Duration = Duration::from_millis(20);

/// The program's threads' wait for a CPU behind the shield's background
/// threads, summed.
#[derive(Default)]
pub(crate) struct Contention {
    /// What was counted so far (ns).
    total: AtomicU64,
    look: Mutex<Look>,
}

/// What the last look read.
#[derive(Default)]
struct Look {
    /// When (None before the first look).
    at: Option<Instant>,
    /// Run delay of each program thread, `(tid, ns)`.
    waits: Vec<(u32, u64)>,
    /// CPU time of the watchdog and the zero filler (ns).
    others: u64,
}

impl Contention {
    /// The program's loss to the background threads so far, in ns.
    pub(crate) fn ns(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Looks again (at most every [`LOOK_EVERY`] unless `now`; a look under
    /// way elsewhere is not waited for): `others_ns` is the background
    /// threads' CPU time so far.
    pub(crate) fn look(&self, others_ns: u64, now: bool) {
        let Ok(mut look) = self.look.try_lock() else {
            return;
        };
        if !now && look.at.is_some_and(|t| t.elapsed() < LOOK_EVERY) {
            return;
        }
        let mut waits = Vec::with_capacity(look.waits.len().max(1));
        crate::threads::each_registered(|tid| {
            if let Some(ns) = memveil_sys::process::run_delay_ns(tid) {
                waits.push((tid, ns));
            }
        });
        if look.at.is_some() {
            let lost = charge(&look.waits, &waits, others_ns.saturating_sub(look.others));
            self.total.fetch_add(lost, Ordering::Relaxed);
        }
        *look = Look {
            at: Some(Instant::now()),
            waits,
            others: others_ns.max(look.others),
        };
    }
}

/// What the program lost to the background threads between two looks: the
/// least of its threads' added wait for a CPU (threads seen at both looks;
/// one that started or ended between them is left out) and the CPU time
/// `ran` the background threads used meanwhile.
pub(crate) fn charge(before: &[(u32, u64)], after: &[(u32, u64)], ran: u64) -> u64 {
    let waited = after
        .iter()
        .filter_map(|&(tid, ns)| {
            before
                .iter()
                .find(|&&(t, _)| t == tid)
                .map(|&(_, was)| ns.saturating_sub(was))
        })
        .fold(0u64, u64::saturating_add);
    waited.min(ran)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweeper_beside_a_program_that_never_waited_costs_it_nothing() {
        // A single-threaded program on one CPU, an expensive sweep (80 ms
        // of CPU) on the other: its thread never waited for a CPU, so it
        // lost nothing to the sweep. The cost counted before charged all
        // 80 ms (the threads' CPU in full).
        let before = [(100, 5_000_000)];
        let after = [(100, 5_000_000)];
        assert_eq!(charge(&before, &after, 80_000_000), 0);
    }

    #[test]
    fn the_loss_is_the_least_of_the_wait_and_the_background_cpu() {
        // Waited 30 ms while the sweep ran 80 ms: at most the 30 ms.
        assert_eq!(
            charge(
                &[(1, 0), (2, 10)],
                &[(1, 20_000_000), (2, 10_000_010)],
                80_000_000
            ),
            30_000_000
        );
        // Waited 30 ms while the sweep ran 5 ms: the rest was behind
        // others.
        assert_eq!(charge(&[(1, 0)], &[(1, 30_000_000)], 5_000_000), 5_000_000);
        // A thread seen once (started or ended between the looks) adds
        // nothing; a run delay never shrinks, but a reused id might.
        assert_eq!(charge(&[(1, 0)], &[(3, 9_000_000)], 80_000_000), 0);
        assert_eq!(charge(&[(1, 50)], &[(1, 10)], 80_000_000), 0);
    }

    #[test]
    fn a_look_reads_the_registered_threads_and_counts_only_after_the_first() {
        let c = Contention::default();
        std::thread::spawn(move || {
            if !crate::threads::register_thread() {
                println!("no rseq area here (C library without rseq): no thread to look at");
                return;
            }
            if memveil_sys::process::run_delay_ns(memveil_sys::process::gettid()).is_none() {
                println!("no schedstat here (CONFIG_SCHED_INFO off): nothing to read");
                crate::threads::unregister_thread();
                return;
            }
            c.look(0, true);
            assert_eq!(c.ns(), 0, "the first look only reads");
            let tid = memveil_sys::process::gettid();
            assert!(
                c.look
                    .lock()
                    .expect("look")
                    .waits
                    .iter()
                    .any(|w| w.0 == tid),
                "this thread was looked at"
            );
            // No background CPU since: nothing counted, whatever the wait.
            c.look(0, true);
            assert_eq!(c.ns(), 0);
            crate::threads::unregister_thread();
        })
        .join()
        .expect("thread");
    }
}
