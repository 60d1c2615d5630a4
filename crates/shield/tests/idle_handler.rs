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
    // Which rescue this test sees. Idle here (a quiet host): the busy
    // threads below must starve it and the watchdog make it normal, a
    // rescue after this snapshot. Already normal after a rescue (a host
    // with no CPU idle, its busy programs starved the idle handler before
    // the snapshot; or the program's own start on a quiet one): that rescue
    // is the one, and the handler must stay normal from there. Waiting for
    // another rescue then waited in vain: a rescued handler returns to
    // SCHED_IDLE only once the host leaves CPU time idle (issue 33), which
    // the busy threads below deny, so beside two busy loops it failed in 5
    // of 6 runs with `idle_rescues: 1, handler_idle: 0` after 20 s.
    let was_idle = before.handler_idle == 1;
    // Without /proc/stat no look holds the handler normal: the back-off
    // alone returns it to SCHED_IDLE, where the busy threads starve it again.
    let readable = std::fs::read_to_string("/proc/stat").is_ok();
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
    let at_hogs = s.stats();
    // Rescued (the one this test sees), normal, and, with /proc/stat, held
    // normal by a look since the busy threads started: from that look on
    // the idle CPU time is measured over a contended span only (a look
    // whose span began on a quiet host, the program's own start's rescue,
    // may still return the handler to SCHED_IDLE once; the busy threads
    // then starve it and it is rescued again before the hold).
    let settled = |st: &memveil_shield::Snapshot| {
        (!was_idle || st.idle_rescues > before.idle_rescues)
            && st.handler_idle == 0
            && (!readable || st.idle_held > at_hogs.idle_held)
    };
    let t = Instant::now();
    let mut sweeps = 0;
    let mut st = s.stats();
    while !settled(&st) && t.elapsed() < Duration::from_secs(20) {
        sweep(buf, 256, 3);
        sweeps += 1;
        st = s.stats();
    }
    let contended = t.elapsed();
    // Still no CPU idle: the handler stays normal (issue 33). Before, its
    // back-off returned it to SCHED_IDLE 1 s after the rescue, where it
    // waited behind the busy threads until the next rescue (and then 2 s,
    // 4 s... later again).
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(3500) {
        sweep(buf, 256, 4);
    }
    let later = s.stats();
    stop.store(true, Ordering::Relaxed);
    for h in hogs {
        h.join().unwrap();
    }
    println!(
        "idle before the busy threads: {was_idle}; {sweeps} sweeps in {contended:?} until \
         rescued and held: {st:?}"
    );
    // Fails if rescue is broken: the handler, never rescued, is idle at
    // `before` (no rescue to have counted), and stays so.
    assert!(
        st.idle_rescues > if was_idle { before.idle_rescues } else { 0 },
        "a starved handler was never rescued (idle before the busy threads: {was_idle}, \
         {before:?}): {st:?}"
    );
    assert_eq!(st.handler_idle, 0, "{st:?}");
    if !readable {
        skip(
            Need::HostSetting("/proc/stat"),
            "no idle CPU time to read: the back-off alone decides when the handler goes idle again",
        );
        return;
    }
    assert!(
        st.idle_held > at_hogs.idle_held,
        "never held normal beside the busy threads: {st:?}"
    );
    println!("3.5 s more beside the busy threads: {later:?}");
    assert_eq!(
        later.idle_rescues, st.idle_rescues,
        "the handler went back to SCHED_IDLE on a contended host and starved again"
    );
    assert!(later.idle_held > st.idle_held, "{later:?}");
    assert_eq!(later.handler_idle, 0, "{later:?}");
}
