// test.sh: alone (the shield under test: scripts/test.sh runs this file with nothing beside it)
//! The fault handler runs at `SCHED_IDLE` (so the scheduler keeps a woken
//! thread on the handler's CPU), and the watchdog makes it normal again
//! when busy threads on its CPU starve it. A test binary of its own: it
//! keeps both CPUs busy for a while.

#![allow(clippy::unwrap_used, clippy::cast_possible_truncation)]
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memveil_shield::{Config, Shield, PAGE};
use memveil_testkit::{skip, Need};

mod common;

/// Sweeps `pages` pages of `buf` (4x the window: every touch faults).
fn sweep(buf: *mut u8, pages: usize, v: u8) {
    for i in 0..pages {
        // SAFETY: inside the protected buffer of `pages` pages.
        unsafe { buf.add(i * PAGE).write_volatile(v) };
    }
}

fn setup(idle: bool) -> Option<(Shield, usize)> {
    if memveil_sys::process::allowed_cpus(std::process::id()).is_none_or(|n| n < 2) {
        skip(
            Need::SecondCpu,
            "there is no other CPU for the woken thread to be placed on",
        );
        return None;
    }
    let cfg = Config {
        window: 64,
        readahead: false,
        idle_handler: idle,
        ..Config::default()
    };
    let s = common::shield(&cfg)?;
    let buf = common::pages(256);
    common::protect(&s, buf, 1);
    Some((s, buf.as_mut_ptr() as usize))
}

#[test]
fn handler_runs_idle_and_is_made_normal_when_starved() {
    // SAFETY: geteuid takes no arguments.
    if unsafe { libc::geteuid() } != 0 {
        println!(
            "SKIP: leaving SCHED_IDLE needs CAP_SYS_NICE (root); the handler then stays normal"
        );
        return;
    }
    // Control first (one test, so the two never run at once): the same
    // shield with `idle_handler: false` never goes idle.
    {
        let Some((s, buf)) = setup(false) else { return };
        let buf = buf as *mut u8;
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(300) {
            sweep(buf, 256, 1);
        }
        let st = s.stats();
        assert!(st.faults() > 256, "{st:?}");
        assert_eq!(st.handler_idle, 0, "{st:?}");
    }
    let Some((s, buf)) = setup(true) else { return };
    let buf = buf as *mut u8;
    // The watchdog makes the handler idle within a period (later if the
    // machine is busy: each rescue backs off 1, 2, 4 s...).
    // On a busy machine (other programs on every CPU) the watchdog may
    // rescue the handler again moments after it went idle: a rescue counts
    // as having been idle, and the snapshot that saw either is the one
    // compared with below.
    sweep(buf, 256, 1);
    let t = Instant::now();
    let mut before = s.stats();
    while before.handler_idle == 0
        && before.idle_rescues == 0
        && t.elapsed() < Duration::from_secs(30)
    {
        sweep(buf, 256, 2);
        before = s.stats();
    }
    assert!(
        before.handler_idle == 1 || before.idle_rescues > 0,
        "the handler never went idle: {before:?}"
    );
    // Contended: a busy thread of normal priority on every CPU, and this
    // thread faulting on CPU 0, where the handler follows it. The idle
    // handler would wait behind the busy thread there; the watchdog sees it
    // make no progress and makes it normal.
    let stop = Arc::new(AtomicBool::new(false));
    let cpus = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
    let hogs: Vec<_> = (0..cpus)
        .map(|c| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let _ = memveil_sys::process::pin_to_cpu(c);
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    memveil_sys::process::pin_to_cpu(0).unwrap();
    let t = Instant::now();
    let mut sweeps = 0;
    while s.stats().idle_rescues == before.idle_rescues && t.elapsed() < Duration::from_secs(20) {
        sweep(buf, 256, 3);
        sweeps += 1;
    }
    let contended = t.elapsed();
    let st = s.stats();
    stop.store(true, Ordering::Relaxed);
    for h in hogs {
        h.join().unwrap();
    }
    println!("{sweeps} sweeps in {contended:?} until the rescue: {st:?}");
    assert!(
        st.idle_rescues > before.idle_rescues,
        "a starved handler was never rescued: {st:?}"
    );
    assert_eq!(st.handler_idle, 0, "{st:?}");
}
