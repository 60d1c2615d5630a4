//! What the shield costs, as the budget and the summary count it: the CPU
//! of its own threads (their thread clocks), a hand-off per fault, and its
//! work on the program's threads (discards wiping freed pages). Counters
//! only, no timing thresholds: each part must be in the total.

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
        st.cost_ns >= st.program_ns + st.shield_cpu_ns,
        "the cost ({} ns) leaves out the wipes ({} ns) or the shield's threads ({} ns)",
        st.cost_ns,
        st.program_ns,
        st.shield_cpu_ns
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
        st.cost_ns >= st.handoffs * st.fault_floor_ns + st.shield_cpu_ns,
        "the cost ({} ns) leaves out the hand-offs ({} x {} ns) or the threads' CPU ({} ns)",
        st.cost_ns,
        st.handoffs,
        st.fault_floor_ns,
        st.shield_cpu_ns
    );
}
