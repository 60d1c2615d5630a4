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
//! Only on a calm host (issue 33): when the back-off is over, the watchdog
//! reads the host's CPU pressure (`/proc/pressure/cpu`, the time some
//! runnable task waited for a CPU) since the handler became normal, and
//! while that is [`CONTENDED_PERCENT`] or more of the time it keeps the
//! handler normal and looks again a second later (`idle_held`): on a
//! contended host there is no idle CPU for `SCHED_IDLE` to win, only busy
//! threads to wait behind. A rescue from a contended spell does not grow
//! the back-off. Before, beside two busy loops the handler went back to
//! `SCHED_IDLE` 1, 2, 4... s after each rescue and waited there until the
//! next one (single waits of 0.3-1.2 s, 0.9-1.7 s of handler wait in a 16 s
//! run of the 100 ms canary, booked as the shield's cost, so the budget's
//! sweep stood still); with the check the handler stayed normal from the
//! start (0 rescues, 16 holds) and its wait was 0.11-0.45 s, the faults'
//! real wait behind the busy threads. Without pressure information the
//! back-off alone decides, as before.
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
    let mut placement = Placement::new(Instant::now(), host_pressure_us());
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
            let is_idle = placement.is_idle;
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
            // For a whole period the handler neither finished the batch in
            // hand nor read a fault that waits, or, with work waiting for
            // it, spent more than half the time since the last look
            // runnable but off the CPU (a SCHED_IDLE thread behind busy
            // ones still gets a sliver, enough to finish a batch now and
            // then: "no progress" alone missed it, and every fault then
            // waited for the busy threads): starved.
            let stuck = progress == last && waiting || queued == Some(true);
            match placement.look(now, stuck, &mut host_pressure_us) {
                Move::Stay => {}
                Move::Held => {
                    c.idle_held.fetch_add(1, Ordering::Relaxed);
                }
                Move::Rescue(p) => {
                    if set_handler_policy(inner, SchedPolicy::Normal).is_ok() {
                        c.handler_idle.store(0, Ordering::Relaxed);
                        c.idle_rescues.fetch_add(1, Ordering::Relaxed);
                        placement.rescued(now, p);
                    }
                }
                Move::ToIdle => {
                    if set_handler_policy(inner, SchedPolicy::Idle).is_ok() {
                        c.handler_idle.store(1, Ordering::Relaxed);
                        placement.idled();
                    }
                }
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

/// Share of the time (percent) during which some runnable task waited for a
/// CPU on the host (`/proc/pressure/cpu`, "some") at or above which the
/// CPUs count as contended: there is then no idle CPU for `SCHED_IDLE` to
/// win (the woken thread's placement), only busy threads for the handler
/// to wait behind. Beside two busy loops on this 2-vCPU VM the share read
/// 85-96%; quiet, 0-5%.
const CONTENDED_PERCENT: u64 = 20;
/// The shortest span the contention is measured over.
const PRESSURE_SPAN: Duration = Duration::from_millis(50);
/// How soon the watchdog looks again at a contended host before it tries
/// `SCHED_IDLE`.
const HELD_LOOK: Duration = Duration::from_secs(1);

/// What the watchdog does with the handler's policy at a look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Move {
    /// Nothing.
    Stay,
    /// Its back-off over, the handler stays normal: the host's CPUs were
    /// contended over the last span.
    Held,
    /// Starved at `SCHED_IDLE`: normal again (with the host's CPU pressure
    /// total now, when the kernel has one).
    Rescue(Option<u64>),
    /// Back to `SCHED_IDLE`.
    ToIdle,
}

/// The watchdog's choice of the handler's policy: readings in, a [`Move`]
/// out (the caller applies it, then says so: [`Placement::rescued`],
/// [`Placement::idled`]).
///
/// Issue 33: beside two busy loops the back-off alone returned the handler
/// to `SCHED_IDLE` after 1, 2, 4... s, and each time it waited behind the
/// busy threads until the next rescue (single waits of 0.3-1.2 s, 0.9-1.7 s
/// in a 16 s run of the 100 ms canary), which the budget books as the
/// shield's cost: the sweep then stood still and the canary's secret stayed
/// plaintext. Now the handler returns to `SCHED_IDLE` only after a span in
/// which the host's CPUs were not contended ([`CONTENDED_PERCENT`]), and a
/// rescue from a contended spell does not grow the back-off.
#[derive(Debug)]
struct Placement {
    /// The handler runs at `SCHED_IDLE`.
    is_idle: bool,
    backoff: Duration,
    /// The soonest the handler may return to `SCHED_IDLE`.
    idle_from: Instant,
    /// When the handler last became normal (a long calm after it resets the
    /// back-off).
    calm_since: Instant,
    /// The host's CPU pressure total (µs) and when it was read: the
    /// contention is measured since.
    mark: Option<(u64, Instant)>,
}

impl Placement {
    /// As the watchdog starts (the handler normal), with the host's CPU
    /// pressure total now.
    fn new(now: Instant, pressure: Option<u64>) -> Self {
        Placement {
            is_idle: false,
            backoff: BACKOFF_MIN,
            idle_from: now,
            calm_since: now,
            mark: pressure.map(|p| (p, now)),
        }
    }

    /// The move at a look at `now`: `stuck` says whether the handler looks
    /// starved, `pressure` reads the host's CPU pressure total (read only
    /// when it decides; `None`: no such file, and the back-off alone
    /// decides, as before).
    fn look(
        &mut self,
        now: Instant,
        stuck: bool,
        pressure: &mut dyn FnMut() -> Option<u64>,
    ) -> Move {
        if self.is_idle {
            if stuck {
                return Move::Rescue(pressure());
            }
            if now.duration_since(self.calm_since) > BACKOFF_MAX {
                // A long calm: the next rescue starts the back-off afresh.
                self.backoff = BACKOFF_MIN;
            }
            return Move::Stay;
        }
        if now < self.idle_from {
            return Move::Stay;
        }
        let Some(p) = pressure() else {
            return Move::ToIdle;
        };
        let Some((m, at)) = self.mark.filter(|&(m, _)| m <= p) else {
            self.mark = Some((p, now));
            return Move::Stay;
        };
        let span = now.duration_since(at);
        if span < PRESSURE_SPAN {
            return Move::Stay;
        }
        self.mark = Some((p, now));
        if contended(p - m, span) {
            self.idle_from = now + HELD_LOOK;
            Move::Held
        } else {
            Move::ToIdle
        }
    }

    /// The handler was made normal at `now` (`pressure`: the total read
    /// then). A handler starved while the host was contended since it went
    /// idle was starved by that, which the return's own check answers: the
    /// back-off grows only for a rescue on a calm host.
    fn rescued(&mut self, now: Instant, pressure: Option<u64>) {
        let busy = match (pressure, self.mark) {
            (Some(p), Some((m, at))) if m <= p => contended(p - m, now.duration_since(at)),
            _ => false,
        };
        self.is_idle = false;
        self.idle_from = now + self.backoff;
        if !busy {
            self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        }
        self.calm_since = now;
        self.mark = pressure.map(|p| (p, now));
    }

    /// The handler was made idle.
    fn idled(&mut self) {
        self.is_idle = true;
    }
}

/// Whether `stalled_us` of "some" CPU pressure over `span` is contention.
fn contended(stalled_us: u64, span: Duration) -> bool {
    let span_us = u64::try_from(span.as_micros()).unwrap_or(u64::MAX);
    stalled_us.saturating_mul(100) >= span_us.saturating_mul(CONTENDED_PERCENT)
}

/// The host's CPU pressure so far: the total time, in µs, during which some
/// runnable task waited for a CPU (`/proc/pressure/cpu`; `None` on a kernel
/// without pressure stall information, or booted with `psi=0`).
fn host_pressure_us() -> Option<u64> {
    parse_pressure_total(&std::fs::read_to_string("/proc/pressure/cpu").ok()?)
}

/// The `total=` of the "some" line of a pressure file.
fn parse_pressure_total(text: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.starts_with("some "))?
        .split_ascii_whitespace()
        .find_map(|f| f.strip_prefix("total="))?
        .parse()
        .ok()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A host whose pressure total grows by `percent` of the time.
    struct Host {
        t0: Instant,
        percent: u64,
        total: u64,
        at: Instant,
    }

    impl Host {
        fn new(t0: Instant, percent: u64) -> Self {
            Host {
                t0,
                percent,
                total: 1_000_000,
                at: t0,
            }
        }

        /// The total at `now` (time only moves forward).
        fn at(&mut self, now: Instant) -> Option<u64> {
            let us = u64::try_from(now.duration_since(self.at).as_micros()).unwrap_or(0);
            self.total += us * self.percent / 100;
            self.at = now;
            Some(self.total)
        }
    }

    /// Runs the watchdog's looks every 10 ms for `secs` seconds over
    /// `host`, the handler starved whenever it is idle when `starve` (a
    /// busy loop on its CPU); returns the rescues and the looks that held
    /// it normal.
    fn run(
        p: &mut Placement,
        host: &mut Host,
        from_ms: u64,
        secs: u64,
        starve: bool,
    ) -> (u32, u32) {
        let (mut rescues, mut held) = (0, 0);
        for ms in (from_ms..from_ms + secs * 1000).step_by(10) {
            let now = host.t0 + Duration::from_millis(ms);
            let stuck = starve && p.is_idle;
            match p.look(now, stuck, &mut || host.at(now)) {
                Move::Stay => {}
                Move::Held => held += 1,
                Move::Rescue(pr) => {
                    rescues += 1;
                    p.rescued(now, pr);
                }
                Move::ToIdle => p.idled(),
            }
        }
        (rescues, held)
    }

    #[test]
    fn a_contended_host_keeps_the_handler_normal_after_its_first_rescue() {
        // Two busy loops beside the program: 90% of the time some task
        // waits for a CPU. Before, the back-off alone returned the handler
        // to SCHED_IDLE after 1, 2, 4, 8, 16 s: five more starved spells
        // (each as long as a look, here; up to 1.2 s measured) in 40 s.
        let t0 = Instant::now();
        let mut host = Host::new(t0, 90);
        let mut p = Placement::new(t0, host.at(t0));
        let (rescues, held) = run(&mut p, &mut host, 10, 40, true);
        assert_eq!(rescues, 0, "never made idle on a contended host");
        assert!(held >= 30, "held {held} times in 40 s");
        assert!(!p.is_idle);
    }

    #[test]
    fn contention_that_starts_later_costs_one_rescue_and_no_back_off_growth() {
        let t0 = Instant::now();
        let mut host = Host::new(t0, 2);
        let mut p = Placement::new(t0, host.at(t0));
        // Quiet: idle after the first span, and stays so.
        assert_eq!(run(&mut p, &mut host, 10, 2, false), (0, 0));
        assert!(p.is_idle);
        // Contended from 2 s on: one rescue, then held normal.
        host.percent = 90;
        let (rescues, held) = run(&mut p, &mut host, 2000, 20, true);
        assert_eq!(rescues, 1);
        assert!(held >= 15, "held {held}");
        assert_eq!(
            p.backoff, BACKOFF_MIN,
            "a rescue by contention grows no back-off"
        );
        // Calm again: back to SCHED_IDLE within a back-off and a held look.
        host.percent = 0;
        run(&mut p, &mut host, 22_000, 3, false);
        assert!(p.is_idle, "a calm host has the handler idle again");
    }

    #[test]
    fn a_rescue_on_a_calm_host_still_backs_off() {
        // Starved with no contention seen (the program's own threads, say):
        // the back-off doubles as before.
        let t0 = Instant::now();
        let mut host = Host::new(t0, 0);
        let mut p = Placement::new(t0, host.at(t0));
        let (rescues, held) = run(&mut p, &mut host, 10, 8, true);
        assert_eq!(held, 0);
        // Idle at 50 ms, rescued at once; back 1 s, 2 s and 4 s after each
        // rescue (at 1.07, 3.08 and 7.09 s), rescued again each time.
        assert_eq!(rescues, 4, "{p:?}");
        assert_eq!(p.backoff, BACKOFF_MIN * 16);
    }

    #[test]
    fn without_pressure_information_the_back_off_alone_decides() {
        let t0 = Instant::now();
        let mut p = Placement::new(t0, None);
        let now = t0 + Duration::from_millis(10);
        assert_eq!(p.look(now, false, &mut || None), Move::ToIdle);
    }

    #[test]
    fn the_pressure_total_is_read_from_the_some_line() {
        let text = "some avg10=85.79 avg60=68.43 avg300=53.52 total=26159470206\n\
                    full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(parse_pressure_total(text), Some(26_159_470_206));
        assert_eq!(parse_pressure_total("full total=5\n"), None);
        assert_eq!(parse_pressure_total("some total=x\n"), None);
    }
}
