//! What the shield costs, as the budgets draw it (`host_cost_ns`, CPU time
//! of the host: the CPU of its own threads, their thread clocks, a hand-off
//! per fault, and its work on the program's threads, discards wiping freed
//! pages) and as the summary reports it (`cost_ns`: what the program lost,
//! never more). Counters only, no timing thresholds: each part must be in
//! its total.

mod common;

use common::{pages, protect, shield};
use memveil_shield::{Budget, Config, PAGE, UNBOUNDED};

/// A shield under a cost budget alone, as `memveil run` starts it.
fn budget_config() -> Config {
    Config {
        window: UNBOUNDED,
        budget: Some(Budget::percent(1, 8_000)),
        ..Config::default()
    }
}

#[test]
fn the_cost_counts_the_wipes_of_freed_memory_on_the_programs_thread() {
    let Some(s) = shield(&budget_config()) else {
        return;
    };
    let n = 8192;
    let buf = pages(n);
    protect(&s, buf, 1);
    // Data in every page: the discard below must wipe each before its frame
    // goes back to the kernel, on this thread.
    for p in buf.chunks_mut(PAGE) {
        p[0] = 0x5a;
        p[PAGE - 1] = 0xa5;
    }
    let t = std::time::Instant::now();
    // SAFETY: nothing lives in the buffer; its pages may become zero.
    unsafe { s.discard(buf.as_ptr() as usize, n * PAGE) };
    let took = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
    s.flush_stats();
    let st = s.stats();
    assert!(
        st.program_ns > 0 && st.program_ns <= took,
        "the discard's {took} ns on this thread were counted as {} ns",
        st.program_ns
    );
    assert!(
        st.host_cost_ns >= st.program_ns + st.shield_cpu_ns,
        "the host's cost ({} ns) leaves out the wipes ({} ns) or the shield's threads ({} ns)",
        st.host_cost_ns,
        st.program_ns,
        st.shield_cpu_ns
    );
    assert!(
        st.cost_ns >= st.program_ns && st.cost_ns <= st.host_cost_ns,
        "the program's loss ({} ns) leaves out the wipes on its thread ({} ns) or exceeds the host's cost: {st:?}",
        st.cost_ns,
        st.program_ns
    );
    assert!(buf.iter().step_by(PAGE / 2).all(|b| *b == 0), "wiped");
}

#[test]
fn the_cost_counts_the_shield_threads_cpu_and_a_hand_off_per_fault() {
    // A small fixed window under a budget: every touch past it is a fault
    // the handler resolves (decrypting, evicting).
    let cfg = Config {
        window: 16,
        budget: Some(Budget::percent(100, 8_000)),
        ..Config::default()
    };
    let Some(s) = shield(&cfg) else {
        return;
    };
    let n = 256;
    let buf = pages(n);
    protect(&s, buf, 1);
    for round in 0..8u8 {
        for p in buf.chunks_mut(PAGE).step_by(3) {
            p[7] = p[7].wrapping_add(round);
        }
    }
    s.flush_stats();
    let st = s.stats();
    assert!(st.handoffs > 100, "the window forced faults: {st:?}");
    assert!(
        st.shield_cpu_ns > 0,
        "the shield's threads' CPU was not read: {st:?}"
    );
    assert!(
        st.host_cost_ns >= st.handoffs * st.fault_floor_ns + st.shield_cpu_ns,
        "the host's cost ({} ns) leaves out the hand-offs ({} x {} ns) or the threads' CPU ({} ns)",
        st.host_cost_ns,
        st.handoffs,
        st.fault_floor_ns,
        st.shield_cpu_ns
    );
    assert!(
        st.cost_ns > st.handoffs * st.fault_floor_ns && st.cost_ns <= st.host_cost_ns,
        "the program's loss ({} ns) leaves out the hand-offs and the handler's CPU, or exceeds the \
         host's cost: {st:?}",
        st.cost_ns
    );
}

#[test]
fn the_cost_counts_the_time_faults_waited_for_the_handler_to_get_a_cpu() {
    // This thread, and the shield's threads it starts, on one CPU, with a
    // thread of the program spinning there: every fault's handler must wait
    // for a CPU behind it, time the faulting thread loses that neither the
    // handler's CPU clock nor the hand-off counts.
    let Some(st) = faults_on_one_busy_cpu(std::time::Duration::ZERO) else {
        return;
    };
    assert!(
        st.handler_wait_ns > 0,
        "the handler never waited for a CPU behind a spinning thread on its one CPU: {st:?}"
    );
    assert!(
        st.host_cost_ns >= st.handoffs * st.fault_floor_ns + st.shield_cpu_ns + st.handler_wait_ns,
        "the host's cost ({} ns) leaves out the handler's wait for a CPU ({} ns): {st:?}",
        st.host_cost_ns,
        st.handler_wait_ns
    );
    assert!(
        st.cost_ns >= st.handoffs * st.fault_floor_ns + st.handler_wait_ns,
        "the program's loss ({} ns) leaves out the handler's wait for a CPU ({} ns): {st:?}",
        st.cost_ns,
        st.handler_wait_ns
    );
}

/// Pins the calling thread (and the threads it starts from now on) to the
/// first CPU it may run on.
fn pin_to_one_cpu() {
    // SAFETY: a zeroed cpu_set_t is valid; the calls only read and write it.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0
            && (0..libc::CPU_SETSIZE as usize)
                .find(|&c| libc::CPU_ISSET(c, &set))
                .is_some_and(|c| {
                    libc::CPU_ZERO(&mut set);
                    libc::CPU_SET(c, &mut set);
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
                })
    };
    assert!(
        ok,
        "pinning the test thread: {}",
        std::io::Error::last_os_error()
    );
}

/// This thread and a shield it starts (a 16-page window, its handler
/// spinning `spin` between faults) pinned to one CPU, faulting with a
/// thread spinning beside them; the shield's counters after (`None` after a
/// skip line).
fn faults_on_one_busy_cpu(spin: std::time::Duration) -> Option<memveil_shield::Snapshot> {
    pin_to_one_cpu();
    let cfg = Config {
        window: 16,
        budget: Some(Budget::percent(100, 8_000)),
        spin,
        ..Config::default()
    };
    let s = shield(&cfg)?;
    faults_beside_a_spinning_thread(&s);
    s.flush_stats();
    let st = s.stats();
    assert!(st.handoffs > 100, "the window forced faults: {st:?}");
    Some(st)
}

/// Faults through `s`'s 16-page window with a thread spinning beside the
/// shield's threads (all on one CPU when pinned).
fn faults_beside_a_spinning_thread(s: &memveil_shield::Shield) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spinner = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut x = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        })
    };
    let n = 256;
    let buf = pages(n);
    protect(s, buf, 1);
    for round in 0..4u8 {
        for p in buf.chunks_mut(PAGE).step_by(3) {
            p[7] = p[7].wrapping_add(round);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    spinner.join().expect("spinner");
}

#[test]
fn a_spinning_handlers_wait_for_a_cpu_is_not_counted_as_the_faults() {
    // A handler that spins between faults is runnable all along: behind a
    // busy thread on its CPU its run delay grows with no fault waiting.
    let Some(st) = faults_on_one_busy_cpu(std::time::Duration::from_micros(200)) else {
        return;
    };
    assert_eq!(
        st.handler_wait_ns, 0,
        "a spinning handler's run delay was counted as faults waiting: {st:?}"
    );
}

#[test]
fn a_handler_that_took_no_fault_counts_no_wait_for_a_cpu() {
    // The shield's threads start behind a thread spinning on their one CPU:
    // the handler waits for the CPU before it first runs, while no fault
    // can wait for it (nothing touched the shield's memory). Counted as
    // faults waiting, it made a protected `sort` that took no fault at all
    // report 13 ms, and each process of a shell pipeline 4-35 ms.
    pin_to_one_cpu();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spinners: Vec<_> = (0..2)
        .map(|_| {
            let stop = std::sync::Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            })
        })
        .collect();
    let s = shield(&budget_config());
    std::thread::sleep(std::time::Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in spinners {
        t.join().expect("spinner");
    }
    let Some(s) = s else {
        return;
    };
    let buf = pages(64);
    protect(&s, buf, 1);
    s.flush_stats();
    let st = s.stats();
    assert_eq!(st.handoffs, 0, "nothing was touched: {st:?}");
    assert!(
        st.handler_wait_ns < 1_000_000,
        "{} ns of the handler's wait for its first run were counted as faults waiting: {st:?}",
        st.handler_wait_ns
    );
}
