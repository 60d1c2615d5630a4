//! The watchdog thread: keeps the fault handler at `SCHED_IDLE` while that
//! is safe, and ages an adaptive window.
//!
//! Why `SCHED_IDLE`: when the handler wakes a faulting thread, the scheduler
//! places that thread on an idle CPU if the one it faulted on is busy — and
//! it is, with the handler on it. The next fault then crosses CPUs, whose
//! wake-up costs tens of microseconds on a VM, and the handler following
//! the thread only chases it (measured with the faultcost example on this
//! 2-vCPU VM: 83-115 µs per fault unpinned with a normal handler, 19.6 µs
//! at `SCHED_IDLE`: a CPU running only `SCHED_IDLE` threads counts as idle,
//! so the woken thread stays where it was).
//!
//! Why a watchdog: a `SCHED_IDLE` thread gets the CPU only when nothing else
//! wants it. With other busy threads on the handler's CPU the faulting
//! thread would wait for them (measured: 370-460 µs per fault with two CPU
//! hogs, against 23-42 µs for a normal handler; a test saw a handler
//! preempted in the middle of a batch wait 21 s). Every [`BUSY_PERIOD`] the
//! watchdog checks whether the handler, since the last look, neither
//! finished the batch in hand nor read a fault that waits, or, with work
//! waiting for it, spent more than half of that time runnable but off the
//! CPU (its `run_delay` in schedstat: behind busy threads a `SCHED_IDLE`
//! thread still gets a sliver, enough to finish a batch now and then); if
//! so it returns the handler to the normal policy and tries `SCHED_IDLE`
//! again only after a back-off that doubles each time (1 s to 64 s). It never waits for the
//! shield's lock, which a starved handler may hold.
//!
//! Once a second it also ages an adaptive window (`policy::Window::tick`)
//! and evicts what the window gave back.
//!
//! Under a cost budget it is also the sweep (`crate::sweep`): it wakes when
//! the next queued page is due, evicts the pages whose period has ended as
//! far as the budget allows, and, for lazily registered ranges, scans every
//! [`SCAN_PERIOD`] for chunks that hold data and registers them. Each tick
//! it integrates the plaintext and data pages over time (the time-weighted
//! plaintext fraction).

use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use memveil_sys::process::SchedPolicy;

use super::{set_handler_policy, Inner};
use crate::{nanos, START_HOOK};

/// Between two scans for chunks to register (lazily registered ranges).
const SCAN_PERIOD: Duration = Duration::from_millis(50);
/// Sweep batches taken in one wake-up before the watchdog looks again.
const MAX_BATCHES: usize = 8;
/// The soonest the sweep wakes again for a due page.
const SWEEP_MIN: Duration = Duration::from_millis(1);
/// How soon it looks again while due pages wait for the budget.
const SWEEP_WAIT: Duration = Duration::from_millis(10);

/// Between two looks while the program faults.
const BUSY_PERIOD: Duration = Duration::from_millis(10);
/// Between two looks while it does not.
const QUIET_PERIOD: Duration = Duration::from_millis(100);
/// First back-off after a rescue, and the longest.
const BACKOFF_MIN: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(64);
/// An adaptive window's aging period.
const TICK: Duration = Duration::from_secs(1);

/// The watchdog's loop, until [`crate::handler::Threads::stop`].
pub(crate) fn run(inner: &Inner, idle: bool) {
    if let Some(hook) = START_HOOK.get() {
        hook();
    }
    let _ = memveil_sys::process::set_thread_name("memveil-guard");
    inner.cpu.enter(crate::cpu::Worker::Guard);
    let c = inner.stats.counters();
    // SCHED_IDLE only when the handler can be brought back from it.
    let idle = idle && may_leave_idle();
    let mut is_idle = false;
    let mut backoff = BACKOFF_MIN;
    let mut idle_from = Instant::now();
    let mut calm_since = Instant::now();
    let mut next_tick = Instant::now() + TICK;
    let mut last = inner.progress.load(Ordering::Relaxed);
    let mut period = BUSY_PERIOD;
    // The handler's run delay at the last look that read it, and when.
    let mut last_delay: Option<(u64, Instant)> = None;
    let mut scratch = if inner.lazy {
        memveil_sys::uffd::DirectMap::new(16 * 1024).ok()
    } else {
        None
    };
    let mut next_scan = Instant::now();
    loop {
        // When this thread wakes next, for the handler to poke it sooner
        // when a page comes in due before that (see `Inner::poke_guard`).
        let wake = inner
            .lock_free_now_ms()
            .saturating_add(u64::try_from(period.as_millis()).unwrap_or(u64::MAX));
        inner.guard_at.store(wake, Ordering::Release);
        if wait(inner, period) {
            break;
        }
        let now = Instant::now();
        inner.integrate(false);
        let progress = inner.progress.load(Ordering::Acquire);
        if idle {
            let waiting = progress % 2 == 1 || inner.uffd.pending();
            // How long the handler waited for a CPU since the last look,
            // read only while work waits for it (its schedstat).
            let delay = (is_idle && waiting)
                .then(|| {
                    memveil_sys::process::run_delay_ns(inner.handler_tid.load(Ordering::Acquire))
                })
                .flatten();
            let queued = match (delay, last_delay) {
                (Some(d), Some((l, at))) => {
                    Some(d.saturating_sub(l) * 2 > nanos(now.duration_since(at)))
                }
                _ => None,
            };
            last_delay = delay.map(|d| (d, now));
            let stuck = progress == last && waiting || queued == Some(true);
            if is_idle && stuck {
                // For a whole period the handler neither finished the batch
                // in hand nor read a fault that waits, or, with work waiting
                // for it, spent more than half the time since the last look
                // runnable but off the CPU (a SCHED_IDLE thread behind busy
                // ones still gets a sliver, enough to finish a batch now and
                // then: "no progress" alone missed it, and every fault then
                // waited for the busy threads): starved.
                if set_handler_policy(inner, SchedPolicy::Normal).is_ok() {
                    is_idle = false;
                    c.handler_idle.store(0, Ordering::Relaxed);
                    c.idle_rescues.fetch_add(1, Ordering::Relaxed);
                    idle_from = now + backoff;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    calm_since = now;
                }
            } else if !is_idle && now >= idle_from {
                if set_handler_policy(inner, SchedPolicy::Idle).is_ok() {
                    is_idle = true;
                    c.handler_idle.store(1, Ordering::Relaxed);
                }
            } else if is_idle && now.duration_since(calm_since) > BACKOFF_MAX {
                // A long calm: the next rescue starts the back-off afresh.
                backoff = BACKOFF_MIN;
            }
        }
        period = if progress == last {
            QUIET_PERIOD
        } else {
            BUSY_PERIOD
        };
        last = progress;
        if inner.budget.is_some() {
            if let Some(scratch) = scratch.as_mut().filter(|_| now >= next_scan) {
                inner.scan_chunks(scratch);
                next_scan = Instant::now() + SCAN_PERIOD;
            }
            period = period.min(sweep(inner));
            if scratch.is_some() {
                period = period.min(next_scan.saturating_duration_since(Instant::now()));
            }
            period = period.max(SWEEP_MIN);
        }
        if now >= next_tick {
            next_tick = now + TICK;
            // Never wait for the lock: a starved handler may hold it, and
            // this thread is what rescues it. The tick comes again.
            let Some(mut st) = inner.try_lock() else {
                continue;
            };
            if st.window.adaptive() {
                let data = st.data_pages();
                st.window.tick(data);
                if !st.frozen {
                    inner.shrink_to_window(&mut st);
                }
            }
        }
    }
}

/// Sweeps the pages that are due (never waiting for the lock: a starved
/// handler may hold it); returns how soon to look again.
fn sweep(inner: &Inner) -> Duration {
    for _ in 0..MAX_BATCHES {
        // The handler first: a fault waiting (or a batch in hand) waits on
        // this thread's lock and, on a shared CPU, on this thread itself
        // (the handler runs at SCHED_IDLE): a sweep under way made hot pages
        // come back hundreds of ms late, and so look idle.
        if inner.uffd.pending() || inner.progress.load(Ordering::Acquire) % 2 == 1 {
            return SWEEP_MIN;
        }
        let Some(mut st) = inner.try_lock() else {
            return SWEEP_MIN;
        };
        let step = inner.sweep_step(&mut st);
        drop(st);
        if let Some(ms) = step.host_wait_ms {
            return Duration::from_millis(ms);
        }
        if step.waiting {
            return SWEEP_WAIT;
        }
        if !step.more {
            return step.next_due_ms.map_or(QUIET_PERIOD, Duration::from_millis);
        }
    }
    SWEEP_MIN
}

/// Sleeps up to `d`; returns whether the shield is stopping.
fn wait(inner: &Inner, d: Duration) -> bool {
    let stop = inner
        .guard_stop
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if *stop {
        return true;
    }
    if inner.poked.swap(false, Ordering::AcqRel) {
        return false;
    }
    let (stop, _) = inner
        .guard_wake
        .wait_timeout(stop, d)
        .unwrap_or_else(PoisonError::into_inner);
    inner.poked.store(false, Ordering::Release);
    *stop
}

/// Whether a thread of ours may return from `SCHED_IDLE` to the normal
/// policy (root, or `RLIMIT_NICE` room): tried on this thread itself. When
/// it may not, the watchdog stays at `SCHED_IDLE` (it then only ages the
/// window, late under load) and the handler is never made idle.
fn may_leave_idle() -> bool {
    memveil_sys::process::set_sched_policy(0, SchedPolicy::Idle).is_ok()
        && memveil_sys::process::set_sched_policy(0, SchedPolicy::Normal).is_ok()
}
