//! Quick look at the cost of a fault: sweeps a protected buffer 4x the
//! window and prints microseconds per page, handler and eviction time.
#![allow(
    clippy::unwrap_used,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]
use memveil_shield::{Config, Shield, StatsFile, PAGE};
use std::time::Instant;

fn main() {
    let window: usize = std::env::args().nth(1).map_or(16, |a| a.parse().unwrap());
    let wp = std::env::args().nth(2).is_some_and(|a| a == "wp");
    let spin = std::env::var("SPIN_US").map_or(0, |v| v.parse().unwrap());
    let cfg = Config {
        window,
        idle_handler: std::env::var("IDLE").map_or(true, |v| v != "0"),
        handler_cpu: if std::env::var("FOLLOW").is_ok_and(|v| v == "0") {
            memveil_shield::HandlerCpu::Current
        } else {
            memveil_shield::HandlerCpu::Follow
        },
        force_write_protect: wp,
        accept_unwiped_free: wp,
        spin: std::time::Duration::from_micros(spin),
        ..Config::default()
    };
    let s = Shield::new(&cfg, StatsFile::private()).unwrap();
    if std::env::var("RSEQ").map_or(true, |v| v != "0") {
        memveil_shield::register_thread();
    }
    let pages = (window * 4).max(1024);
    let p = memveil_sys::uffd::map_anonymous_direct(pages * PAGE).unwrap();
    // SAFETY: fresh mapping used only through the shield.
    unsafe { s.encrypt_mprotect(p, pages * PAGE, 3, 1) }.unwrap();
    if std::env::var("RAND_FAULTS").is_ok_and(|v| v == "1") {
        // Random single pages: every touch outside the window faults.
        for i in 0..pages {
            // SAFETY: inside the protected range.
            unsafe { p.add(i * PAGE).write_volatile(1) };
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..4 {
            let before = s.stats();
            let t = Instant::now();
            let n = pages * 2;
            for _ in 0..n {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = (x % pages as u64) as usize;
                // SAFETY: inside the protected range.
                unsafe { p.add(i * PAGE).write_volatile(round) };
            }
            let dt = t.elapsed();
            let st = s.stats();
            let faults = st.faults() - before.faults();
            println!(
                "random {round}: {:.2} us/fault, {faults} faults of {n} touches, handler {:.2} us/fault, evict {:.2} us/page, idle {} rescues {} held {} moves {}",
                dt.as_secs_f64() * 1e6 / faults.max(1) as f64,
                (st.handler_ns - before.handler_ns) as f64 / 1e3 / faults.max(1) as f64,
                (st.evict_ns - before.evict_ns) as f64 / 1e3 / (st.evictions - before.evictions).max(1) as f64,
                st.handler_idle, st.idle_rescues, st.idle_held, st.handler_moves
            );
        }
        std::process::exit(0);
    }
    let threads: usize = std::env::var("THREADS").map_or(1, |v| v.parse().unwrap());
    if threads > 1 {
        let base = p as usize;
        for pass in 0..4 {
            let t = Instant::now();
            std::thread::scope(|sc| {
                for k in 0..threads {
                    sc.spawn(move || {
                        let per = pages / threads;
                        for i in k * per..(k + 1) * per {
                            // SAFETY: inside the protected range.
                            unsafe { ((base + i * PAGE) as *mut u8).write_volatile(pass as u8) };
                        }
                    });
                }
            });
            println!(
                "threads {threads} pass {pass}: {:.2} us/page (wall)",
                t.elapsed().as_secs_f64() * 1e6 / pages as f64
            );
        }
        std::process::exit(0);
    }
    for pass in 0..4 {
        let before = s.stats();
        let t = Instant::now();
        for i in 0..pages {
            // SAFETY: inside the protected range.
            unsafe { p.add(i * PAGE).write_volatile(pass as u8) };
        }
        let dt = t.elapsed();
        let st = s.stats();
        let faults = st.faults() - before.faults();
        let ev = st.evictions - before.evictions;
        println!(
            "pass {pass}: {:.2} us/page, {faults} faults, {ev} evictions, handler {:.2} us/fault, evict {:.2} us/page, copy {:.2} us",
            dt.as_secs_f64() * 1e6 / pages as f64,
            (st.handler_ns - before.handler_ns) as f64 / 1e3 / faults.max(1) as f64,
            (st.evict_ns - before.evict_ns) as f64 / 1e3 / ev.max(1) as f64,
            (st.copy_ns - before.copy_ns) as f64 / 1e3 / faults.max(1) as f64
        );
    }
}
