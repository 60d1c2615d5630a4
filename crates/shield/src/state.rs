//! The shield's bookkeeping, all under one mutex: the protected ranges with
//! a state byte and an eviction stamp per page, the 2Q queues of resident
//! pages, the window and the readahead streams.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use memveil_cipher::Xts;
use memveil_secmem::SecretBox;
use memveil_sys::uffd;

use crate::policy::{Streams, Window};
use crate::{StatsFile, PAGE};

pub(crate) const ZERO: u8 = 0;
pub(crate) const RESIDENT: u8 = 1;
pub(crate) const EVICTED: u8 = 2;
pub(crate) const STATE_MASK: u8 = 3;
/// Page may not be read by the handler (the program made it unreadable):
/// it is never evicted while the flag is set.
pub(crate) const PINNED: u8 = 0x80;
/// Page was evicted recently (it is in the ghost queue): if it faults back
/// soon, it is hot and joins the main queue.
pub(crate) const GHOST: u8 = 0x40;
/// Page must stay resident (a thread's control block, which the kernel
/// writes as the thread exits): never evicted, but wiped when discarded.
pub(crate) const KEEP: u8 = 0x20;
/// Page the program made read-only (`mprotect` without `PROT_WRITE`): a
/// discard cannot write it, so its wipe is skipped (the preload makes a
/// range writable again before it unmaps it, so only `madvise` on a
/// read-only page drops a frame unwiped).
pub(crate) const RDONLY: u8 = 0x08;
/// Page was taken as a victim by the [`State::victims`] call under way
/// (a page may sit in the queues twice); cleared before it returns.
const CHOSEN: u8 = 0x10;

/// A protected range and its ciphertext store.
pub(crate) struct Range {
    pub(crate) base: usize,
    pub(crate) pages: usize,
    pub(crate) keyid: u16,
    /// One state byte per page (direct mapping, not the program's heap).
    states: *mut u8,
    /// One eviction stamp per page (the shield's eviction count when the
    /// page last left the window): how long ago an evicted page left.
    stamps: *mut u32,
    /// Ciphertext, page `i` at `store + i * PAGE`. With the Move mechanism
    /// the store is registered with the userfaultfd (a move's destination
    /// must be) and slot `i` holds a frame exactly while page `i` is
    /// evicted; the handler touches a slot only then, so it never faults on
    /// one.
    pub(crate) store: *mut u8,
}

/// Bytes of the state and stamp mappings of a range of `pages` pages.
fn side_lens(pages: usize) -> (usize, usize) {
    (
        pages.next_multiple_of(PAGE),
        (pages * std::mem::size_of::<u32>()).next_multiple_of(PAGE),
    )
}

impl Range {
    /// Maps the state, stamp and store mappings of a range of `pages`
    /// pages at `base` (the range owns them and unmaps them on drop).
    pub(crate) fn map(base: usize, pages: usize, keyid: u16) -> std::io::Result<Self> {
        let (sl, tl) = side_lens(pages);
        let mut r = Range {
            base,
            pages,
            keyid,
            states: std::ptr::null_mut(),
            stamps: std::ptr::null_mut(),
            store: std::ptr::null_mut(),
        };
        r.states = uffd::map_anonymous_direct(sl)?;
        r.stamps = uffd::map_anonymous_direct(tl)?.cast();
        r.store = uffd::map_anonymous_direct(pages * PAGE)?;
        // Ciphertext and bookkeeping: nothing a core dump needs (a dump
        // would otherwise hold a copy the size of the range, all but the
        // evicted pages zeros). Best effort: a dump with them is no less safe.
        for (p, len) in [
            (r.store, pages * PAGE),
            (r.states, sl),
            (r.stamps.cast(), tl),
        ] {
            // SAFETY: advice on mappings just made for this range; it does
            // not change their contents.
            let _ = unsafe { uffd::madvise_direct(p, len, libc::MADV_DONTDUMP) };
        }
        Ok(r)
    }

    pub(crate) fn state(&self, i: usize) -> u8 {
        assert!(i < self.pages);
        // SAFETY: `states` holds `pages` bytes owned by this range; i < pages.
        unsafe { self.states.add(i).read() }
    }

    pub(crate) fn set_state(&mut self, i: usize, s: u8) {
        assert!(i < self.pages);
        // SAFETY: as in `state`; `&mut self` gives exclusive access.
        unsafe { self.states.add(i).write(s) }
    }

    /// The eviction count when page `i` last left the window.
    pub(crate) fn stamp(&self, i: usize) -> u32 {
        assert!(i < self.pages);
        // SAFETY: `stamps` holds `pages` u32s owned by this range; i < pages.
        unsafe { self.stamps.add(i).read() }
    }

    fn set_stamp(&mut self, i: usize, v: u32) {
        assert!(i < self.pages);
        // SAFETY: as in `stamp`; `&mut self` gives exclusive access.
        unsafe { self.stamps.add(i).write(v) }
    }

    /// Marks the pages that already hold data RESIDENT and queues their
    /// addresses on `queue`; returns how many. `mincore` writes into a small
    /// scratch mapping, 64 MiB of the range per call, so the state bytes
    /// (fresh zero memory: ZERO) are written only for resident pages: a
    /// 16 GiB range would otherwise fault in 4 MiB of state bytes at every
    /// start (about 6 ms on this VM, where a page fault costs 2.2-3 µs).
    pub(crate) fn mark_resident_now(
        &mut self,
        queue: &mut VecDeque<usize>,
    ) -> std::io::Result<usize> {
        const STEP: usize = 16 * 1024;
        let mut scratch = uffd::DirectMap::new(STEP)?;
        let mut found = 0;
        let mut i = 0;
        while i < self.pages {
            let n = (self.pages - i).min(STEP);
            let v = &mut scratch.as_mut_slice()[..n];
            uffd::resident_pages(self.addr(i), n * PAGE, v)?;
            for (k, b) in v.iter().enumerate() {
                if b & 1 != 0 {
                    self.set_state(i + k, RESIDENT);
                    queue.push_back(self.addr(i + k));
                    found += 1;
                }
            }
            i += n;
        }
        Ok(found)
    }

    /// Address of store slot `i`.
    pub(crate) fn slot_ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.pages);
        // SAFETY: the store holds `pages * PAGE` bytes and i < pages, so the
        // offset stays inside it.
        unsafe { self.store.add(i * PAGE) }
    }

    /// Store slot `i`. Under the Move mechanism only while page `i` is
    /// evicted (the slot holds a frame then); otherwise always.
    pub(crate) fn store_page(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: the slot lies inside the store owned by this range (see
        // `slot_ptr`), and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(i), PAGE) }
    }

    pub(crate) fn addr(&self, i: usize) -> usize {
        self.base + i * PAGE
    }

    pub(crate) fn end(&self) -> usize {
        self.base + self.pages * PAGE
    }
}

impl Range {
    /// Unmaps the ciphertext store (in a forked child abandoning its
    /// parent's shield: see `Shield::abandon_in_forked_child`).
    pub(crate) fn drop_store(&mut self) {
        if !self.store.is_null() {
            // SAFETY: the store was mapped by `Range::map` for this range
            // alone; it is nulled so nothing uses or unmaps it again.
            let _ = unsafe { uffd::unmap_direct(self.store, self.pages * PAGE) };
            self.store = std::ptr::null_mut();
        }
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        let (sl, tl) = side_lens(self.pages);
        // SAFETY: the mappings were made by `Range::map` for this range
        // alone (null when that failed part-way) and nothing refers to them
        // after drop.
        unsafe {
            if !self.states.is_null() {
                let _ = uffd::unmap_direct(self.states, sl);
            }
            if !self.stamps.is_null() {
                let _ = uffd::unmap_direct(self.stamps.cast(), tl);
            }
        }
        self.drop_store();
    }
}

/// Resident pages in two FIFO queues (2Q): pages enter `probation`; a page
/// that faults back while its address is still in `ghosts` (evicted
/// recently) is hot and enters `main`. Eviction takes from `probation`
/// while it holds more than a [`PROBATION_SHARE`]th of the window, else from
/// `main`, so a hot set (hash tables, allocator metadata) survives a stream
/// of cold pages. Entries may be stale (page discarded or evicted): the page
/// state is checked when an entry is popped.
#[derive(Default)]
pub(crate) struct Queues {
    pub(crate) probation: VecDeque<usize>,
    pub(crate) main: VecDeque<usize>,
    ghosts: VecDeque<usize>,
}

/// The window is divided by this for the pages probation may hold before
/// victims come from it (and for the ghosts remembered, see
/// [`ghost_capacity`]). The 2Q paper's 1/4 and a ghost list as long as the
/// window let a large set touched uniformly at random (redis's values)
/// return to `main` as often as the hot set does, and push the hot set out:
/// redis-benchmark `-r 100000 -d 512` took 1.12 faults per GET and 0.72 per
/// SET. With 1/8 for both it takes 0.92 and 0.60; values alone would need
/// 0.87 a GET (BENCHMARKS.md, "Shield").
const PROBATION_SHARE: usize = 8;

/// How many evicted pages' addresses the ghost queue remembers: a page is
/// hot when it faults back within this many evictions.
fn ghost_capacity(window: usize) -> usize {
    (window / PROBATION_SHARE).max(4)
}

pub(crate) struct State {
    pub(crate) ranges: Vec<Range>,
    pub(crate) queues: Queues,
    pub(crate) resident: usize,
    pub(crate) evicted: usize,
    pub(crate) window: Window,
    pub(crate) streams: Streams,
    /// Pages evicted so far (wrapping): stamps are read against it.
    pub(crate) evictions: u32,
    pub(crate) keys: Vec<Option<SecretBox<Xts>>>,
    pub(crate) bounce: SecretBox<[u8]>,
    /// Eviction is suspended (around fork).
    pub(crate) frozen: bool,
}

// SAFETY: the raw pointers in `Range` refer to mappings owned by the State
// and are only dereferenced under the State's mutex.
unsafe impl Send for State {}

impl State {
    /// Pages holding data (plaintext or ciphertext).
    pub(crate) fn data_pages(&self) -> usize {
        self.resident + self.evicted
    }

    /// The plaintext window now.
    pub(crate) fn window_size(&self) -> usize {
        self.window.size(self.data_pages())
    }

    /// Books page `i` of range `pos` as evicted (its ciphertext is in its
    /// store slot) and remembers it in the ghost queue.
    pub(crate) fn mark_evicted(&mut self, pos: usize, i: usize) {
        let stamp = self.evictions;
        self.evictions = self.evictions.wrapping_add(1);
        let r = &mut self.ranges[pos];
        let addr = r.addr(i);
        let s = r.state(i);
        r.set_state(i, EVICTED | GHOST | (s & (PINNED | KEEP | RDONLY)));
        r.set_stamp(i, stamp);
        self.resident -= 1;
        self.evicted += 1;
        self.queues.ghosts.push_back(addr);
        if self.queues.ghosts.len() > ghost_capacity(self.window_size()) {
            if let Some(old) = self.queues.ghosts.pop_front() {
                if let Some((p, k)) = self.find(old) {
                    let r = &mut self.ranges[p];
                    let s = r.state(k);
                    r.set_state(k, s & !GHOST);
                }
            }
        }
    }

    /// Books page `i` of range `pos`, which was in state `s` (ZERO or
    /// EVICTED), as resident; a ghost enters the main queue, anything else
    /// probation.
    pub(crate) fn mark_resident(&mut self, pos: usize, i: usize, s: u8) {
        let r = &mut self.ranges[pos];
        let addr = r.addr(i);
        r.set_state(i, RESIDENT | (s & (PINNED | KEEP | RDONLY)));
        if s & GHOST != 0 {
            self.queues.main.push_back(addr);
        } else {
            self.queues.probation.push_back(addr);
        }
        if s & STATE_MASK == EVICTED {
            self.evicted -= 1;
        }
        self.resident += 1;
    }

    /// How many evictions ago page `i` of range `pos` (evicted) left.
    pub(crate) fn age(&self, pos: usize, i: usize) -> u32 {
        self.evictions
            .wrapping_sub(self.ranges[pos].stamp(i))
            .wrapping_sub(1)
    }

    /// The range holding `addr` and the page's index in it.
    pub(crate) fn find(&self, addr: usize) -> Option<(usize, usize)> {
        let pos = self.ranges.partition_point(|r| r.base <= addr);
        let r = self.ranges.get(pos.checked_sub(1)?)?;
        (addr < r.end()).then(|| (pos - 1, (addr - r.base) / PAGE))
    }

    pub(crate) fn set_flags(&mut self, addr: usize, len: usize, flag: u8, on: bool) {
        let end = addr.saturating_add(len);
        for r in &mut self.ranges {
            let lo = addr.max(r.base);
            let hi = end.min(r.end());
            if lo >= hi {
                continue;
            }
            for i in (lo - r.base) / PAGE..(hi - r.base).div_ceil(PAGE) {
                let s = r.state(i);
                r.set_state(i, if on { s | flag } else { s & !flag });
            }
        }
    }

    /// Picks up to `n` resident, evictable pages (2Q order, see [`Queues`]),
    /// sorted by address so that neighbours leave in one move.
    pub(crate) fn victims(&mut self, n: usize) -> Vec<(usize, usize)> {
        let mut victims: Vec<(usize, usize)> = Vec::with_capacity(n);
        let mut pinned = Vec::new();
        let probation_max = self.window_size() / PROBATION_SHARE;
        while victims.len() < n {
            let from_probation =
                self.queues.probation.len() > probation_max || self.queues.main.is_empty();
            let q = if from_probation {
                &mut self.queues.probation
            } else {
                &mut self.queues.main
            };
            let Some(a) = q.pop_front().or_else(|| self.queues.main.pop_front()) else {
                break;
            };
            let Some((pos, i)) = self.find(a) else {
                continue;
            };
            let s = self.ranges[pos].state(i);
            if s & STATE_MASK != RESIDENT || s & CHOSEN != 0 {
                continue;
            }
            if s & (PINNED | KEEP) != 0 {
                pinned.push(a);
                continue;
            }
            // A flag, not a search of `victims`: a shrink after a fork asks
            // for tens of thousands of pages at once.
            self.ranges[pos].set_state(i, s | CHOSEN);
            victims.push((pos, i));
        }
        for &(pos, i) in &victims {
            let s = self.ranges[pos].state(i);
            self.ranges[pos].set_state(i, s & !CHOSEN);
        }
        // Unreadable and kept pages stay resident; back to the main queue.
        self.queues.main.extend(pinned);
        victims.sort_unstable();
        victims
    }

    /// Drops the contents of `[addr, addr+len)`: resident pages are wiped
    /// before their frames go back to the kernel, ciphertext is dropped.
    pub(crate) fn discard(&mut self, addr: usize, len: usize, stats: &StatsFile) {
        let end = addr.saturating_add(len);
        let (mut dropped_res, mut dropped_ev) = (0, 0);
        for r in &mut self.ranges {
            let lo = addr.max(r.base).next_multiple_of(PAGE);
            let hi = end.min(r.end());
            if lo >= hi {
                continue;
            }
            let first = (lo - r.base) / PAGE;
            let last = (hi - r.base) / PAGE;
            for i in first..last {
                let s = r.state(i);
                match s & STATE_MASK {
                    RESIDENT => {
                        let p = r.addr(i) as *mut u8;
                        if s & (PINNED | RDONLY) == 0 {
                            // SAFETY: the page is resident (present, readable
                            // and writable: pinned and read-only pages are
                            // skipped) and the caller of `discard` owns its
                            // contents.
                            unsafe { zeroize_page(p) };
                        }
                        // SAFETY: as above; the contents are being dropped.
                        let _ = unsafe { uffd::madvise_direct(p, PAGE, libc::MADV_DONTNEED) };
                        dropped_res += 1;
                    }
                    EVICTED => {
                        // SAFETY: ciphertext store slot owned by the range.
                        let _ = unsafe {
                            uffd::madvise_direct(r.slot_ptr(i), PAGE, libc::MADV_DONTNEED)
                        };
                        dropped_ev += 1;
                    }
                    _ => {}
                }
                r.set_state(i, ZERO | (s & (PINNED | RDONLY)));
            }
        }
        self.resident -= dropped_res;
        self.evicted -= dropped_ev;
        let c = stats.counters();
        c.resident.store(self.resident as u64, Ordering::Relaxed);
        c.evicted.store(self.evicted as u64, Ordering::Relaxed);
        c.discards
            .fetch_add((dropped_res + dropped_ev) as u64, Ordering::Relaxed);
        let limit = 2 * self.window_size() + 1024;
        let ranges = &self.ranges;
        let live = |a: &usize| {
            let pos = ranges.partition_point(|r| r.base <= *a);
            pos > 0 && {
                let r = &ranges[pos - 1];
                *a < r.end() && r.state((*a - r.base) / PAGE) & STATE_MASK == RESIDENT
            }
        };
        for q in [&mut self.queues.probation, &mut self.queues.main] {
            if q.len() > limit {
                q.retain(live);
            }
        }
    }
}

/// Zeroes one page with writes the optimiser keeps.
///
/// # Safety
/// `p` must be a writable, present page no Rust object lives in.
pub(crate) unsafe fn zeroize_page(p: *mut u8) {
    use zeroize::Zeroize as _;
    // SAFETY: the caller promises the page is writable and owned.
    unsafe { std::slice::from_raw_parts_mut(p, PAGE) }.zeroize();
}
