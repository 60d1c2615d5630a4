// test.sh: alone (the shield under test: scripts/test.sh runs this file with nothing beside it)
//! The fault path's economies, each against a control that shows the
//! counters could fail: sequential scans brought in as runs (never-written
//! and evicted pages alike), neighbouring victims evicted in one move, the
//! window and an adaptive window's bound never exceeded, an adaptive window
//! that grows on near misses and gives back when the program is quiet.

#![allow(clippy::unwrap_used, clippy::cast_possible_truncation)]
use std::time::{Duration, Instant};

use memveil_shield::{Bound, Config, Shield, Snapshot, PAGE};

mod common;
use common::pages;

fn shield(cfg: Config) -> Option<Shield> {
    common::shield(&cfg)
}

fn protect(s: &Shield, buf: &mut [u8]) {
    common::protect(s, buf, 1);
}

/// Writes a word derived from the page number into every page, in order.
fn sweep_write(buf: &mut [u8], seed: u64) {
    for (i, p) in buf.chunks_mut(PAGE).enumerate() {
        p[8..16].copy_from_slice(&(seed ^ i as u64).to_le_bytes());
    }
}

/// Checks every page's word, in order.
fn sweep_check(buf: &[u8], seed: u64) {
    for (i, p) in buf.chunks(PAGE).enumerate() {
        let got = u64::from_le_bytes(p[8..16].try_into().unwrap());
        assert_eq!(got, seed ^ i as u64, "page {i}");
    }
}

fn diff(a: &Snapshot, b: &Snapshot) -> (u64, u64, u64, u64) {
    (
        b.zero_fills - a.zero_fills,
        b.faults_in - a.faults_in,
        b.evictions - a.evictions,
        b.evict_moves - a.evict_moves,
    )
}

/// Runs the two sweeps of `sequential_runs` with or without readahead;
/// returns (zero fills, faults in, evictions, eviction moves) of the first
/// and the second sweep.
fn two_sweeps(readahead: bool) -> Option<[(u64, u64, u64, u64); 2]> {
    const N: usize = 4096;
    let s = shield(Config {
        window: 512,
        readahead,
        ..Config::default()
    })?;
    let buf = pages(N);
    protect(&s, buf);
    let s0 = s.stats();
    sweep_write(buf, 1);
    let s1 = s.stats();
    sweep_check(buf, 1);
    let s2 = s.stats();
    assert!(s2.max_resident <= 512, "{s2:?}");
    Some([diff(&s0, &s1), diff(&s1, &s2)])
}

#[test]
fn sequential_scans_bring_in_runs_and_evict_runs() {
    let Some([(zf, fi, ev, mv), (zf2, fi2, ev2, mv2)]) = two_sweeps(true) else {
        return;
    };
    let Some([(czf, _, cev, cmv), (_, cfi2, _, _)]) = two_sweeps(false) else {
        return;
    };
    println!("runs: zero {zf}, in {fi2}, moves {mv}/{ev} {mv2}/{ev2}; single pages: zero {czf}, in {cfi2}, moves {cmv}/{cev}");
    // Control: without readahead each page is a fault of its own.
    assert_eq!(czf, 4096);
    assert_eq!(cfi2, 4096);
    // Never-written pages in sequence: runs of up to 64 (window/8) pages.
    assert!(zf <= 4096 / 16, "zero-fill faults {zf}");
    assert_eq!(fi, 0);
    // Evicted pages in sequence: the same.
    assert!(fi2 <= 4096 / 16, "decrypting faults {fi2}");
    assert_eq!(zf2, 0);
    // Victims that are neighbours leave together (FIFO order of a scan).
    assert!(ev >= 3500 && mv * 8 <= ev, "{mv} moves for {ev} evictions");
    assert!(
        ev2 >= 4000 && mv2 * 8 <= ev2,
        "{mv2} moves for {ev2} evictions"
    );
}

/// xorshift: a cheap generator for access patterns.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

#[test]
fn an_adaptive_window_grows_to_its_bound_never_past_it_and_gives_back() {
    // A working set of 200 pages touched at random in a 2048-page buffer:
    // with a window of 64 nearly every touch misses, but each miss is on a
    // page evicted so recently that a larger window would have kept it.
    let Some(s) = shield(Config {
        window: 64,
        max_plaintext: Some(Bound::Pages(256)),
        ..Config::default()
    }) else {
        return;
    };
    let buf = pages(2048);
    protect(&s, buf);
    sweep_write(buf, 9);
    let after_fill = s.stats();
    assert_eq!(after_fill.adaptive, 1);
    let mut rng = Rng(0x1234_5678);
    for _ in 0..20_000 {
        let i = rng.below(200);
        buf[i * PAGE] = buf[i * PAGE].wrapping_add(1);
    }
    let grown = s.stats();
    println!("{grown:?}");
    assert!(grown.near_misses > 100, "{grown:?}");
    assert!(
        grown.max_window > 200,
        "the window grew to the working set: {grown:?}"
    );
    assert!(
        grown.max_window <= 256 && grown.max_resident <= 256,
        "past the bound: {grown:?}"
    );
    // Touches within the grown window no longer fault.
    let before = s.stats().faults();
    for _ in 0..5000 {
        let i = rng.below(200);
        buf[i * PAGE] = buf[i * PAGE].wrapping_add(1);
    }
    let refaults = s.stats().faults() - before;
    assert!(
        refaults < 500,
        "{refaults} faults in a window that holds the working set"
    );
    // Quiet seconds: the window gives pages back, plaintext goes with them.
    let t = Instant::now();
    while s.stats().window >= grown.window && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let quiet = s.stats();
    assert!(quiet.window < grown.window, "{quiet:?}");
    assert!(quiet.resident_pages <= quiet.window, "{quiet:?}");
    // The contents survived all of it.
    for (i, p) in buf.chunks(PAGE).enumerate().skip(200) {
        let got = u64::from_le_bytes(p[8..16].try_into().unwrap());
        assert_eq!(got, 9 ^ i as u64, "page {i}");
    }
}

#[test]
fn a_fixed_window_stays_fixed_under_the_same_load() {
    // Control for the test above: the same near misses, no bound.
    let Some(s) = shield(Config {
        window: 64,
        ..Config::default()
    }) else {
        return;
    };
    let buf = pages(2048);
    protect(&s, buf);
    sweep_write(buf, 9);
    let mut rng = Rng(0x1234_5678);
    for _ in 0..20_000 {
        let i = rng.below(200);
        buf[i * PAGE] = buf[i * PAGE].wrapping_add(1);
    }
    let st = s.stats();
    assert_eq!(st.adaptive, 0);
    assert_eq!(st.max_window, 64, "{st:?}");
    assert!(st.max_resident <= 64, "{st:?}");
    assert!(
        st.faults_in > 10_000,
        "a 64-page window thrashes on 200 pages: {st:?}"
    );
}

#[test]
fn refault_ages_tell_how_much_larger_a_window_would_have_kept_a_page() {
    // Page-by-page sweeps (no readahead) over 1000 pages through a fixed
    // 64-page window: every page that comes back left the window about
    // 1000 - 64 evictions before (give or take an eviction batch), so the
    // refaults land in the [512, 1024) bucket and nowhere else; the same
    // sweeps over 200 pages land below 256. The two are each other's
    // control: a histogram that did not follow the ages fails one of them.
    for (n, want) in [(1000usize, 2usize), (200, 0)] {
        let Some(s) = shield(Config {
            window: 64,
            readahead: false,
            ..Config::default()
        }) else {
            return;
        };
        let buf = pages(n);
        protect(&s, buf);
        sweep_write(buf, 3);
        let a = s.stats();
        sweep_check(buf, 3);
        sweep_check(buf, 3);
        let b = s.stats();
        let ages: Vec<u64> = (0..memveil_shield::AGE_BUCKETS)
            .map(|k| b.refault_ages[k] - a.refault_ages[k])
            .collect();
        let total: u64 = ages.iter().sum();
        println!("{n} pages: refault ages {ages:?}");
        assert_eq!(
            total,
            b.faults_in - a.faults_in,
            "every refault counted once"
        );
        assert!(
            total as usize >= 2 * (n - 64) - 64,
            "{n} pages: {total} refaults"
        );
        assert!(
            ages[want] * 100 >= total * 95,
            "{n} pages: refaults not in bucket {want}: {ages:?}"
        );
        assert!(b.max_data >= n as u64, "{b:?}");
        assert_eq!(memveil_shield::age_bucket(255), 0);
        assert_eq!(memveil_shield::age_bucket(256), 1);
        assert_eq!(memveil_shield::age_bucket(1023), 2);
        assert_eq!(memveil_shield::age_bucket_end(2), Some(1024));
        assert_eq!(memveil_shield::age_bucket(u32::MAX), 15);
        assert_eq!(memveil_shield::age_bucket_end(15), None);
    }
}

#[test]
fn never_written_pages_come_from_the_pool_of_zeroed_frames_and_read_zero() {
    // Fresh pages written in sequence, 512 at a time with pauses, through
    // a 512-page window, with the pool and without. The pool is filled only
    // after the first 512 fresh pages (a process that never takes fresh
    // memory in bulk never fills it), by a thread that runs at SCHED_IDLE
    // while it fills: the pauses give it idle time. With the pool, later
    // runs of fresh pages are moved in from its frames; without it, none
    // are (the control). Either way every page reads zero until written,
    // then what was written.
    const N: usize = 16 * 1024;
    for pool in [true, false] {
        let Some(s) = shield(Config {
            window: 512,
            zero_pool: pool,
            ..Config::default()
        }) else {
            return;
        };
        let buf = pages(N);
        protect(&s, buf);
        let a = s.stats();
        let t = Instant::now();
        let mut written = 0;
        for (i, p) in buf.chunks_mut(PAGE).enumerate() {
            assert!(p.iter().all(|&b| b == 0), "fresh page {i} is not zero");
            p[8..16].copy_from_slice(&(5 ^ i as u64).to_le_bytes());
            written = i + 1;
            if (i + 1) % 512 == 0 {
                if (pool && s.stats().pool_fills - a.pool_fills >= 1024) || (!pool && i + 1 >= 4096)
                {
                    break;
                }
                if t.elapsed() > Duration::from_secs(30) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        sweep_check(&buf[..written * PAGE], 5);
        let b = s.stats();
        println!(
            "pool {pool}: {} of {written} fresh pages from the pool in {:?}",
            b.pool_fills - a.pool_fills,
            t.elapsed()
        );
        let fills = b.pool_fills - a.pool_fills;
        if !pool {
            assert_eq!(fills, 0, "no pool, yet pages came from it: {b:?}");
            assert_eq!(b.pool_pages, 0, "{b:?}");
        } else if b.pool_pages == 0 {
            println!("SKIP the pool half: no pool here (one CPU, or no UFFDIO_MOVE)");
        } else {
            assert!(
                fills >= 1024,
                "only {fills} of {written} pages came from the pool in 30 s: {b:?}"
            );
        }
        assert!(b.max_resident <= 512, "{b:?}");
    }
}
