// test.sh: alone (the shield under test: scripts/test.sh runs this file with nothing beside it)
//! Behaviour of protected ranges: contents survive eviction, system calls on
//! protected buffers work, threads never see torn or stale pages, evicted
//! pages hold no plaintext.

#![allow(clippy::unwrap_used, clippy::cast_possible_truncation)]
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use memveil_shield::{Config, Shield, PAGE};
use memveil_sys::uffd;

mod common;
use common::{pages, protect};
use memveil_testkit::{skip, Need};

fn shield(window: usize, force_wp: bool) -> Option<Shield> {
    common::shield(&Config {
        window,
        force_write_protect: force_wp,
        accept_unwiped_free: force_wp,
        ..Config::default()
    })
}

fn fill(buf: &mut [u8], seed: u64) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        c.copy_from_slice(&(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
    }
}

fn check(buf: &[u8], seed: u64) {
    for (i, c) in buf.chunks(8).enumerate() {
        let want = seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        assert_eq!(u64::from_le_bytes(c.try_into().unwrap()), want, "word {i}");
    }
}

fn round_trip(force_wp: bool) {
    let Some(s) = shield(8, force_wp) else { return };
    let buf = pages(64);
    fill(&mut buf[..PAGE * 4], 7); // present before protection: kept
    protect(&s, buf, 1);
    fill(&mut buf[PAGE * 4..], 11);
    check(&buf[..PAGE * 4], 7);
    check(&buf[PAGE * 4..], 11);
    let st = s.stats();
    assert!(st.evictions >= 56, "{st:?}");
    assert!(st.faults_in >= 4, "{st:?}");
    // Room is made before a page comes in: the window is never exceeded.
    assert!(st.max_resident <= 8, "{st:?}");
    assert!(st.evicted_pages >= 56, "{st:?}");
    if force_wp {
        assert!(st.wp_evictions > 0, "{st:?}");
    } else {
        assert_eq!(st.wp_evictions, 0, "{st:?}");
    }
    // Evicted pages are not in the page tables at all.
    let mut v = vec![0u8; 64];
    uffd::resident_pages(buf.as_ptr() as usize, buf.len(), &mut v).unwrap();
    assert!(v.iter().filter(|b| **b & 1 == 1).count() <= 8);
    s.unprotect(buf.as_mut_ptr(), buf.len()).unwrap();
    check(&buf[..PAGE * 4], 7);
    check(&buf[PAGE * 4..], 11);
}

#[test]
fn contents_survive_eviction_move() {
    round_trip(false);
}

#[test]
fn contents_survive_eviction_write_protect() {
    round_trip(true);
}

#[test]
fn system_calls_on_evicted_buffers() {
    let Some(s) = shield(4, false) else { return };
    let buf = pages(32);
    protect(&s, buf, 2);
    fill(buf, 3);
    // Page 0 is long evicted: write(2) reads it in the kernel.
    let (mut r, mut w) = std::io::pipe().unwrap();
    let t = std::thread::spawn(move || {
        let mut got = vec![0u8; 2 * PAGE];
        r.read_exact(&mut got).unwrap();
        got
    });
    w.write_all(&buf[..2 * PAGE]).unwrap();
    let got = t.join().unwrap();
    assert_eq!(&got[..], &buf[..2 * PAGE]);
    // read(2) into an evicted page: the kernel writes it.
    fill(&mut buf[8 * PAGE..], 5); // evicts pages 0..
    let src = vec![0x5Au8; 3 * PAGE];
    let (mut r, mut w) = std::io::pipe().unwrap();
    w.write_all(&src).unwrap();
    r.read_exact(&mut buf[PAGE / 2..PAGE / 2 + 3 * PAGE])
        .unwrap();
    assert!(buf[PAGE / 2..PAGE / 2 + 3 * PAGE]
        .iter()
        .all(|b| *b == 0x5A));
    assert!(s.stats().faults_in > 0);
}

#[test]
fn threads_never_see_torn_or_stale_pages() {
    let Some(s) = shield(6, false) else { return };
    let buf = pages(48);
    protect(&s, buf, 3);
    let base = buf.as_mut_ptr() as usize;
    let counters: Arc<Vec<AtomicU64>> = Arc::new((0..48).map(|_| AtomicU64::new(0)).collect());
    let mut hs = Vec::new();
    for t in 0..4usize {
        let counters = Arc::clone(&counters);
        hs.push(std::thread::spawn(move || {
            let mut x = t as u64 + 1;
            for _ in 0..20_000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Each thread owns every 4th page; it increments a word there
                // and checks the whole page agrees with its own count.
                let page = (x as usize % 12) * 4 + t;
                let p = (base + page * PAGE) as *mut u64;
                let n = counters[page].load(Ordering::Relaxed);
                // SAFETY: the page belongs to this thread alone and lies in
                // the protected range, which stays mapped.
                unsafe {
                    for w in 0..PAGE / 8 {
                        assert_eq!(p.add(w).read_volatile(), n, "page {page} word {w}");
                    }
                    for w in 0..PAGE / 8 {
                        p.add(w).write_volatile(n + 1);
                    }
                }
                counters[page].store(n + 1, Ordering::Relaxed);
            }
        }));
    }
    for h in hs {
        h.join().unwrap();
    }
    let st = s.stats();
    assert!(st.evictions > 1000, "{st:?}");
}

#[test]
fn store_holds_no_plaintext() {
    // Positive control and test in one: the marker is found in the process
    // image while resident, and nowhere once evicted.
    let Some(s) = shield(4, false) else { return };
    let buf = pages(32);
    protect(&s, buf, 4);
    let marker = b"memveil-shield-marker-3f9a1c27d84e";
    buf[100..100 + marker.len()].copy_from_slice(marker);
    let found = || {
        let mut mem = std::fs::File::open("/proc/self/mem").unwrap();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let mut hits = 0;
        for line in maps.lines() {
            let mut f = line.split_whitespace();
            let range = f.next().unwrap();
            let perms = f.next().unwrap();
            if !perms.starts_with('r') || line.contains("[vvar]") || line.contains("[vsyscall]") {
                continue;
            }
            let (a, b) = range.split_once('-').unwrap();
            let (a, b) = (
                u64::from_str_radix(a, 16).unwrap(),
                u64::from_str_radix(b, 16).unwrap(),
            );
            let mut chunk = vec![0u8; 1 << 20];
            let mut off = a;
            while off < b {
                let n = ((b - off) as usize).min(chunk.len());
                use std::os::unix::fs::FileExt;
                // Missing protected pages read as errors: skip them.
                if let Ok(k) = mem.read_at(&mut chunk[..n], off) {
                    hits += chunk[..k]
                        .windows(marker.len())
                        .filter(|w| *w == marker)
                        .count();
                }
                off += n as u64;
                let _ = &mut mem;
            }
        }
        hits
    };
    // The literal in this binary's rodata is one hit; the page is another.
    let baseline = found();
    assert!(
        baseline >= 2,
        "positive control: marker not found in the page"
    );
    fill(&mut buf[PAGE..], 9); // pushes page 0 out
    std::thread::sleep(Duration::from_millis(10));
    let after = found();
    assert_eq!(after, baseline - 1, "plaintext left behind after eviction");
}

#[test]
fn refuses_bad_ranges_and_keyids() {
    let Some(s) = shield(4, false) else { return };
    let buf = pages(4);
    // SAFETY: refused before anything is registered.
    let e = unsafe { s.encrypt_mprotect(buf.as_mut_ptr().add(1), PAGE, 3, 1) }.unwrap_err();
    assert!(e.to_string().contains("page-aligned"), "{e}");
    // SAFETY: as above.
    let e = unsafe { s.encrypt_mprotect(buf.as_mut_ptr(), PAGE, 3, 64) }.unwrap_err();
    assert!(e.to_string().contains("KeyID 64"), "{e}");
    protect(&s, buf, 0);
    // SAFETY: as above (overlap refused).
    let e = unsafe { s.encrypt_mprotect(buf.as_mut_ptr(), PAGE, 3, 1) }.unwrap_err();
    assert!(e.to_string().contains("overlaps"), "{e}");
}

#[test]
fn handler_follows_the_faulting_thread_to_its_cpu() {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    if cpus < 2 {
        skip(Need::SecondCpu, "the handler has nowhere to follow to");
        return;
    }
    // The shield (and its handler) start on CPU 0; the faulting thread
    // runs on CPU 1 only.
    std::thread::spawn(move || {
        memveil_sys::process::pin_to_cpu(0).expect("pin to CPU 0");
        let Some(s) = shield(8, false) else { return };
        let buf = pages(64);
        protect(&s, buf, 1);
        let addr = buf.as_mut_ptr() as usize;
        std::thread::spawn(move || {
            memveil_sys::process::pin_to_cpu(1).expect("pin to CPU 1");
            // SAFETY: the 64 leaked pages above, used only through the shield.
            let buf = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, 64 * PAGE) };
            for round in 0..4u8 {
                for p in buf.chunks_mut(PAGE) {
                    p[0] = round;
                }
            }
        })
        .join()
        .unwrap();
        let st = s.stats();
        assert!(st.faults() > 4 * memveil_shield::FOLLOW_EVERY);
        assert!(
            st.handler_moves >= 1,
            "the handler never moved to CPU 1 after {} faults there",
            st.faults()
        );
    })
    .join()
    .unwrap();
}

#[test]
fn dropping_a_shield_stops_its_handler_at_any_moment() {
    // The handler sleeps in read(2) on the userfaultfd; dropping rings a
    // doorbell page to wake it. Shields dropped at once (handler maybe not
    // started yet), idle, or with pages evicted must all stop, never hang.
    if let Err(e) = memveil_shield::check() {
        skip(Need::Userfaultfd, format!("shield unavailable here: {e}"));
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for round in 0..60 {
            let s = shield(4, false).expect("shield");
            if round % 3 == 1 {
                std::thread::sleep(Duration::from_millis(2));
            }
            if round % 3 == 2 {
                let buf = pages(16);
                protect(&s, buf, 1);
                fill(buf, round);
                check(buf, round);
            }
            drop(s);
        }
        tx.send(()).expect("send");
    });
    assert!(
        rx.recv_timeout(Duration::from_secs(60)).is_ok(),
        "dropping a shield hung (handler never woke)"
    );
}

#[test]
fn read_only_pages_survive_eviction_and_return() {
    // A page the program made read-only lives in a mapping whose protection
    // differs from the store's: it cannot be moved out or home, so it goes
    // by write-protection and comes back by copy (the slot is then wiped
    // and dropped). Contents must survive both ways, and the page must be
    // writable again once the program says so.
    let Some(s) = shield(4, false) else { return };
    let buf = pages(32);
    protect(&s, buf, 1);
    fill(buf, 21);
    let ro = &mut buf[8 * PAGE..16 * PAGE];
    // SAFETY: pages of the protected range, which the test owns.
    unsafe { uffd::mprotect_direct(ro.as_mut_ptr(), ro.len(), libc::PROT_READ) }.expect("mprotect");
    let before = s.stats();
    for _ in 0..3 {
        check(buf, 21);
    }
    let st = s.stats();
    assert!(
        st.wp_evictions > before.wp_evictions && st.faults_in > before.faults_in + 16,
        "read-only pages were not evicted and brought back: {st:?}"
    );
    let ro = &mut buf[8 * PAGE..16 * PAGE];
    // SAFETY: as above.
    unsafe {
        uffd::mprotect_direct(
            ro.as_mut_ptr(),
            ro.len(),
            libc::PROT_READ | libc::PROT_WRITE,
        )
    }
    .expect("mprotect");
    fill(buf, 22);
    check(buf, 22);
    check(buf, 22);
}

#[test]
fn pages_present_before_protection_are_found_across_the_mincore_steps() {
    // The pages already holding data are found by mincore 16384 pages at a
    // time: pages on both sides of each step's edge, and the last page,
    // must all be counted as data (resident) and keep their contents.
    let Some(s) = shield(64, false) else { return };
    let n = 40_000;
    let buf = pages(n);
    let marked = [0usize, 16_383, 16_384, 32_767, 32_768, n - 1];
    for &i in &marked {
        buf[i * PAGE..(i + 1) * PAGE].fill(i as u8 ^ 0x5a);
    }
    protect(&s, buf, 1);
    let st = s.stats();
    assert_eq!(st.resident_pages, marked.len() as u64, "{st:?}");
    assert_eq!(st.evicted_pages, 0, "{st:?}");
    for &i in &marked {
        assert!(
            buf[i * PAGE..(i + 1) * PAGE]
                .iter()
                .all(|&b| b == i as u8 ^ 0x5a),
            "page {i} lost its contents"
        );
    }
    // A page never written is still a zero-fill.
    assert_eq!(buf[5 * PAGE], 0);
    assert_eq!(s.stats().zero_fills, 1);
}
