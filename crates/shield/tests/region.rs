// test.sh: alone (the shield under test: scripts/test.sh runs this file with nothing beside it)
//! The region's page part as a static or Go program's system calls see it
//! (issue 34): `PROT_NONE` reservations, hints, `MAP_FIXED` in place,
//! partial `munmap`, `MADV_DONTNEED` reading zeros, `brk(2)`. Each test runs
//! a [`Region`] attached to a real [`Shield`] whose window is small enough
//! that pages are evicted under it.

#![allow(clippy::unwrap_used, clippy::cast_possible_truncation)]

use memveil_shield::region::{MapOpts, Region};
use memveil_shield::{Config, Shield, PAGE};
use memveil_sys::uffd;

mod common;

const RW: i32 = libc::PROT_READ | libc::PROT_WRITE;
const ANON: i32 = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
/// 2 GiB (of address space only).
const REGION: usize = 2 << 30;
const HEAP: usize = 16 << 20;
const GO: MapOpts = MapOpts {
    any_prot: true,
    honor_hint: true,
};

/// A region protected by a shield of `window` pages (both for good), or
/// `None` where userfaultfd is not permitted (said by `common::shield`).
fn region(window: usize) -> Option<(&'static Shield, Region)> {
    region_of(REGION, window)
}

/// [`region`] of `len` bytes.
fn region_of(len: usize, window: usize) -> Option<(&'static Shield, Region)> {
    let s: &'static Shield = Box::leak(Box::new(common::shield(&Config {
        window,
        ..Config::default()
    })?));
    let r = Region::reserve(len, HEAP, None).expect("reserve");
    let (base, end) = r.bounds();
    // SAFETY: the region's fresh mapping, reached only through `r` here.
    unsafe { s.encrypt_mprotect(base as *mut u8, end - base, RW, 1) }.expect("protect");
    r.attach(s);
    Some((s, r))
}

fn map(r: &Region, addr: usize, pages: usize, prot: i32, flags: i32, opts: MapOpts) -> usize {
    r.mmap(addr, pages * PAGE, prot, flags, -1, opts)
        .expect("the region serves it")
        .expect("mapped")
}

fn bytes(a: usize, pages: usize) -> &'static mut [u8] {
    // SAFETY: readable pages of the region the test mapped and owns.
    unsafe { std::slice::from_raw_parts_mut(a as *mut u8, pages * PAGE) }
}

fn fill(a: usize, pages: usize, seed: u8) {
    for (i, p) in bytes(a, pages).chunks_mut(PAGE).enumerate() {
        p.fill(seed.wrapping_add(i as u8) | 1);
    }
}

/// Reads every byte (through the shield's faults), as the program would.
fn zeros(a: usize, pages: usize) -> bool {
    bytes(a, pages)
        .iter()
        // SAFETY: a reference to a live byte of the mapping.
        .all(|b| unsafe { std::ptr::read_volatile(b) } == 0)
}

fn filled(a: usize, pages: usize, seed: u8) -> bool {
    bytes(a, pages)
        .chunks(PAGE)
        .enumerate()
        .all(|(i, p)| p.iter().all(|b| *b == seed.wrapping_add(i as u8) | 1))
}

fn resident(a: usize, pages: usize) -> usize {
    let mut v = vec![0u8; pages];
    uffd::resident_pages(a, pages * PAGE, &mut v).unwrap();
    v.iter().filter(|b| **b & 1 != 0).count()
}

/// The protection and `VmFlags` of the mapping holding `a`, from
/// `/proc/self/smaps`.
fn vma(a: usize) -> (String, String) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut found: Option<String> = None;
    for line in smaps.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(perms) = found.take() {
                return (perms, flags.trim().to_string());
            }
            continue;
        }
        let mut f = line.split_whitespace();
        let (Some(span), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let Some((lo, hi)) = span.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            continue;
        };
        if lo <= a && a < hi {
            found = Some(perms.to_string());
        }
    }
    panic!("{a:#x} not mapped");
}

/// Runs `f` on a thread of its own and fails if it has not finished
/// within `limit` (the thread is left behind, stuck: the test has failed).
fn within(limit: std::time::Duration, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    rx.recv_timeout(limit)
        .expect("did not finish in time (or panicked)");
}

/// Evicts what `a` holds by touching `pages` other pages of the region.
fn evict(r: &Region, a: usize, pages: usize) {
    let other = map(r, 0, 64, RW, ANON, MapOpts::default());
    fill(other, 64, 3);
    assert_eq!(resident(a, pages), 0, "the pages left the window");
    r.munmap(other, 64 * PAGE).unwrap().unwrap();
}

#[test]
fn a_prot_none_reservation_comes_from_the_region_is_never_brought_in_and_is_made_usable_in_place() {
    let Some((s, r)) = region(1024) else { return };
    let data = map(&r, 0, 64, RW, ANON, GO);
    let res = map(&r, 0, 64, libc::PROT_NONE, ANON, GO);
    assert!(
        r.contains(res) && res == data + 64 * PAGE,
        "{data:#x} {res:#x}"
    );
    assert_eq!(vma(res).0, "---p", "the kernel holds it PROT_NONE");
    // A sequential scan up to the reservation: the shield's readahead runs
    // stop short of it (unreadable pages are never brought in; when they
    // are not, the scan's faults never end: bounded here).
    within(std::time::Duration::from_secs(20), move || {
        fill(data, 64, 5);
        assert!(filled(data, 64, 5));
    });
    assert_eq!(resident(res, 64), 0, "{:?}", s.stats());
    // Without `any_prot` (the preload) a reservation is not the region's.
    assert_eq!(
        r.mmap(0, PAGE, libc::PROT_NONE, ANON, -1, MapOpts::default()),
        None
    );
    // Go's sysMap: MAP_FIXED read-write over part of it, in place.
    let fixed = libc::MAP_FIXED | ANON;
    assert_eq!(map(&r, res, 8, RW, fixed, GO), res);
    let (perms, flags) = vma(res);
    assert_eq!(perms, "rw-p");
    assert!(
        flags.contains("um"),
        "still the registered mapping: {flags}"
    );
    assert!(zeros(res, 8));
    fill(res, 8, 9);
    assert!(filled(res, 8, 9));
    // Or mprotect in place.
    r.mprotect(res + 8 * PAGE, 8 * PAGE, RW).unwrap().unwrap();
    assert!(zeros(res + 8 * PAGE, 8));
    fill(res + 8 * PAGE, 8, 11);
    assert!(filled(res + 8 * PAGE, 8, 11));
    assert_eq!(vma(res + 16 * PAGE).0, "---p", "the rest stays reserved");
}

#[test]
fn only_pages_made_accessible_are_scanned_for_data_under_a_budget() {
    // A budget alone: ranges are registered lazily and the watchdog scans
    // the chunks noted in use for data (`mincore`, every 50 ms). Go's
    // PROT_NONE reservations (gigabytes under etcd) hold none: walking
    // them was 40% of the watchdog's CPU under etcd's get load.
    let Some(s) = common::shield(&Config {
        window: memveil_shield::UNBOUNDED,
        budget: Some(memveil_shield::Budget::percent(10, 8_000)),
        ..Config::default()
    }) else {
        return;
    };
    let s: &'static Shield = Box::leak(Box::new(s));
    let r = Region::reserve(REGION, HEAP, None).expect("reserve");
    let (base, end) = r.bounds();
    // SAFETY: the region's fresh mapping, reached only through `r` here.
    unsafe { s.encrypt_mprotect(base as *mut u8, end - base, RW, 1) }.expect("protect");
    r.attach(s);
    let chunk = 512;
    let before = s.chunks_in_use();
    // 64 chunks reserved PROT_NONE: none to scan.
    let res = map(&r, 0, 64 * chunk, libc::PROT_NONE, ANON, GO);
    assert_eq!(
        s.chunks_in_use(),
        before,
        "a PROT_NONE reservation is scanned"
    );
    // Go's sysMap over one page of it, and an mprotect of another chunk's
    // page: those two chunks.
    let fixed = libc::MAP_FIXED | ANON;
    assert_eq!(
        map(&r, res + 3 * chunk * PAGE, 1, RW, fixed, GO),
        res + 3 * chunk * PAGE
    );
    r.mprotect(res + 9 * chunk * PAGE, PAGE, RW)
        .unwrap()
        .unwrap();
    let noted = s.chunks_in_use() - before;
    assert_eq!(noted, 2, "chunks noted");
    // A read-write mapping is noted as soon as it is handed out.
    let rw = map(&r, 0, 2 * chunk, RW, ANON, GO);
    assert!(s.chunks_in_use() - before >= noted + 2);
    fill(rw, 1, 7);
    assert!(filled(rw, 1, 7));
}

#[test]
fn hints_are_honored_when_free_and_never_handed_out_twice() {
    let Some((_, r)) = region(1024) else { return };
    let (base, _) = r.bounds();
    let hint = base + HEAP + (32 << 20);
    assert_eq!(map(&r, hint, 16, libc::PROT_NONE, ANON, GO), hint);
    // Taken: elsewhere, as the kernel would (Go checks and tries another).
    let other = map(&r, hint, 16, libc::PROT_NONE, ANON, GO);
    assert_ne!(other, hint);
    r.munmap(other, 16 * PAGE).unwrap().unwrap();
    // MAP_FIXED_NOREPLACE: there, or EEXIST.
    let noreplace = ANON | libc::MAP_FIXED_NOREPLACE;
    assert_eq!(
        r.mmap(hint, PAGE, RW, noreplace, -1, GO),
        Some(Err(libc::EEXIST))
    );
    assert_eq!(
        map(&r, hint + 16 * PAGE, 4, RW, noreplace, GO),
        hint + 16 * PAGE
    );
    // Without honor_hint the hint is ignored (the preload).
    let plain = map(&r, hint + 64 * PAGE, 1, RW, ANON, MapOpts::default());
    assert_ne!(plain, hint + 64 * PAGE);
    r.munmap(plain, PAGE).unwrap().unwrap();
    // Everything first fit hands out below and above stays clear of the
    // hinted pages (the hole below them is used).
    let mut got = Vec::new();
    while let Some(Ok(a)) = r.mmap(0, 256 * PAGE, RW, ANON, -1, GO) {
        assert!(
            a + 256 * PAGE <= hint || a >= hint + 20 * PAGE,
            "{a:#x} overlaps the hinted pages at {hint:#x}"
        );
        got.push(a);
        if got.len() > 4096 {
            break;
        }
    }
    assert!(got.iter().any(|a| *a < hint), "the hole below was used");
    assert!(got.iter().any(|a| *a > hint), "and the space above");
}

#[test]
fn map_fixed_over_region_pages_is_in_place_with_its_protection_and_reads_zeros() {
    let Some((_, r)) = region(8) else { return };
    let a = map(&r, 0, 16, RW, ANON, GO);
    fill(a, 16, 7);
    evict(&r, a, 16);
    let fixed = libc::MAP_FIXED | ANON;
    assert_eq!(map(&r, a, 8, RW, fixed, GO), a);
    assert!(
        zeros(a, 8),
        "evicted pages replaced: zeros, not the old data"
    );
    assert!(filled(a + 8 * PAGE, 8, 15), "the pages after it are kept");
    assert_eq!(
        map(&r, a + 8 * PAGE, 8, libc::PROT_NONE, fixed, GO),
        a + 8 * PAGE
    );
    assert_eq!(vma(a + 8 * PAGE).0, "---p");
    assert!(vma(a + 8 * PAGE).1.contains("um"));
    // MAP_FIXED over free pages of the page part takes them: first fit never
    // hands them out again.
    let free = a + 1024 * PAGE;
    assert_eq!(map(&r, free, 4, RW, fixed, GO), free);
    fill(free, 4, 21);
    for _ in 0..300 {
        let b = map(&r, 0, 4, RW, ANON, GO);
        assert!(
            b + 4 * PAGE <= free || b >= free + 4 * PAGE,
            "{b:#x} reuses {free:#x}"
        );
    }
    assert!(filled(free, 4, 21));
}

#[test]
fn munmap_of_part_of_a_mapping_frees_only_those_pages() {
    let Some((_, r)) = region(8) else { return };
    let a = map(&r, 0, 8, RW, ANON, GO);
    fill(a, 8, 31);
    r.munmap(a + 2 * PAGE, 3 * PAGE).unwrap().unwrap();
    evict(&r, a, 8);
    assert!(filled(a, 2, 31));
    assert!(filled(a + 5 * PAGE, 3, 36));
    // The hole is free again, and reads as zeros.
    let b = map(&r, 0, 3, RW, ANON, GO);
    assert_eq!(b, a + 2 * PAGE);
    assert!(zeros(b, 3));
}

#[test]
fn dontneed_free_and_remove_on_evicted_and_resident_pages_read_zeros() {
    let Some((s, r)) = region(8) else { return };
    let a = map(&r, 0, 24, RW, ANON, GO);
    fill(a, 24, 41);
    evict(&r, a, 24);
    assert!(s.stats().evicted_pages >= 24, "{:?}", s.stats());
    for (k, advice) in [libc::MADV_DONTNEED, libc::MADV_FREE, libc::MADV_REMOVE]
        .into_iter()
        .enumerate()
    {
        r.madvise(a + k * 8 * PAGE, 6 * PAGE, advice)
            .unwrap()
            .unwrap();
    }
    for k in 0..3 {
        let at = a + k * 8 * PAGE;
        assert!(zeros(at, 6), "advice {k}: ciphertext restored");
        assert!(filled(at + 6 * PAGE, 2, 41u8.wrapping_add(k as u8 * 8 + 6)));
    }
    // Resident pages too, and a part page counts whole, as in the kernel.
    fill(a, 2, 51);
    r.madvise(a, PAGE + 1, libc::MADV_DONTNEED)
        .unwrap()
        .unwrap();
    within(std::time::Duration::from_secs(20), move || {
        assert!(zeros(a, 2))
    });
}

#[test]
fn a_shield_discard_ending_in_a_part_page_leaves_that_page_alone() {
    let Some((s, r)) = region(8) else { return };
    let a = map(&r, 0, 2, RW, ANON, GO);
    fill(a, 2, 71);
    // SAFETY: the first page is the test's and holds nothing it needs.
    unsafe { s.discard(a, PAGE + 1) };
    // The page the range ends in keeps its data (it was zapped behind the
    // shield's back once, and its next touch faulted for ever).
    within(std::time::Duration::from_secs(20), move || {
        assert!(zeros(a, 1));
        assert!(filled(a + PAGE, 1, 72));
    });
}

#[test]
fn brk_moves_the_break_within_its_slice_as_the_kernel_does() {
    let Some((_, r)) = region(8) else { return };
    let lo = r.brk(0);
    assert!(r.contains(lo), "{lo:#x}");
    assert_eq!(r.brk(lo + 3 * PAGE + 100), lo + 3 * PAGE + 100);
    fill(lo, 4, 61);
    // Shrunk: the pages above the new break are dropped, and read as zeros
    // when it grows again.
    assert_eq!(r.brk(lo + PAGE), lo + PAGE);
    evict(&r, lo, 1);
    assert_eq!(r.brk(lo + 4 * PAGE), lo + 4 * PAGE);
    assert!(filled(lo, 1, 61));
    assert!(zeros(lo + PAGE, 3));
    // Out of the slice: refused, the break in force returned.
    assert_eq!(r.brk(lo - PAGE), lo + 4 * PAGE);
    assert_eq!(r.brk(lo + (2 << 30)), lo + 4 * PAGE);
    assert_eq!(r.sbrk(0), Ok(lo + 4 * PAGE));
    assert_eq!(r.sbrk(-(PAGE as isize)), Ok(lo + 4 * PAGE));
    assert_eq!(r.brk(0), lo + 3 * PAGE);
    assert_eq!(r.sbrk(isize::MAX), Err(libc::ENOMEM));
    // The slice is the break's: mmap never hands it out (the break may not
    // move into what mmap gave).
    let m = map(&r, 0, 16, RW, ANON, GO);
    assert_eq!(
        r.brk(m + PAGE),
        lo + 3 * PAGE,
        "{m:#x} in the break's slice"
    );
}

#[test]
fn a_small_regions_break_leaves_room_for_mmap() {
    // 1 GiB, as `memveil run --region-gib 1` gives: the break's slice once
    // took all of it, and every mmap after the first brk was refused.
    let Some((_, r)) = region_of(1 << 30, 8) else {
        return;
    };
    let lo = r.brk(0);
    assert_eq!(r.brk(lo + 64 * PAGE), lo + 64 * PAGE);
    let m = map(&r, 0, 8 << 8, RW, ANON, MapOpts::default());
    fill(m, 8, 5);
    assert!(filled(m, 8, 5));
    assert_eq!(
        r.brk(m + PAGE),
        lo + 64 * PAGE,
        "{m:#x} in the break's slice"
    );
}
