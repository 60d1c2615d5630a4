//! The protected region: one reservation of address space whose pages a
//! program's memory-management calls are served from, so that everything
//! it maps lives in memory a [`Shield`] protects.
//!
//! The first `heap_len` bytes belong to the caller (the preload's
//! allocator); the rest, the page part, is handed out page-wise by
//! [`Region::mmap`], given back by [`Region::munmap`], and holds a slice for
//! the program's break ([`Region::brk`], [`Region::sbrk`]). Callers are the
//! preload's interposed `mmap`/`munmap`/`madvise`/`mprotect`/`mremap`/`sbrk`
//! (a dynamic program's calls) and the loader's seccomp agent (a static or
//! Go program's system calls): each method returns `None` when the call is
//! not the region's to serve, and the caller then makes the real system call.
//!
//! Freed and replaced pages are discarded through the attached shield
//! (plaintext wiped, ciphertext dropped), so they read back as zeros, as the
//! kernel's would: a program may rely on it (Go trusts `MADV_DONTNEED`ed
//! memory to be zero).

use std::cell::UnsafeCell;
use std::collections::BTreeMap;
use std::ffi::c_int;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

use memveil_sys::uffd;

use crate::{Shield, PAGE};

/// An `errno` value, as the system call would fail with.
pub type Errno = c_int;

const RW: c_int = libc::PROT_READ | libc::PROT_WRITE;

/// The program's break lives in a slice of at most this many bytes of the
/// page part, and at most [`BRK_SHARE`]th of it: a 1 GiB region
/// (`memveil run --region-gib 1`) whose break took all of it refused every
/// `mmap` (a static glibc program's malloc then fell back to the break).
const BRK_SLICE: usize = 1 << 30;
/// The break's slice is at most this fraction (1/n) of the page part.
const BRK_SHARE: usize = 8;

/// How [`Region::mmap`] serves a mapping request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapOpts {
    /// Serve anonymous private mappings of any protection (Go reserves
    /// `PROT_NONE` address space and later maps `MAP_FIXED` read-write over
    /// it); without it only read-write ones are served (the preload).
    pub any_prot: bool,
    /// Try the caller's hint address first when its pages are free in the
    /// page part (Go asks for its arenas at fixed hints and checks where
    /// they landed); `MAP_FIXED_NOREPLACE` is served there too.
    pub honor_hint: bool,
}

/// A test-and-set lock that can be held across `fork` (taken in a prepare
/// handler, released in both parent and child), which a `std` mutex cannot.
pub struct SpinLock(AtomicBool);

impl SpinLock {
    /// An unlocked lock.
    #[must_use]
    pub const fn new() -> Self {
        Self(AtomicBool::new(false))
    }

    /// Takes the lock, spinning then yielding while another holds it.
    pub fn lock(&self) {
        let mut n = 0u32;
        while self
            .0
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            n += 1;
            if n < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Releases the lock (also in a forked child, where its holder is gone).
    pub fn unlock(&self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Default for SpinLock {
    fn default() -> Self {
        Self::new()
    }
}

/// First-fit allocator of whole pages in the page part of the region.
struct PageAlloc {
    /// The page part: `[start, end)`.
    start: usize,
    /// Everything from here to `end` has never been handed out (or was
    /// given back at the top).
    next: usize,
    end: usize,
    /// Free ranges below `next`: start -> length.
    free: BTreeMap<usize, usize>,
    /// The break's slice: (start, break, end).
    brk: Option<(usize, usize, usize)>,
}

impl PageAlloc {
    fn alloc(&mut self, len: usize) -> Option<usize> {
        let len = len.next_multiple_of(PAGE);
        let hit = self
            .free
            .iter()
            .find(|(_, l)| **l >= len)
            .map(|(a, l)| (*a, *l));
        if let Some((a, l)) = hit {
            self.free.remove(&a);
            if l > len {
                self.free.insert(a + len, l - len);
            }
            return Some(a);
        }
        if self.next + len > self.end {
            return None;
        }
        let a = self.next;
        self.next += len;
        Some(a)
    }

    /// Extends the block `[a, a+len)` in place to `new_len` bytes (page
    /// multiples) when the pages after it are free: at the top of what was
    /// handed out, or a free range that starts where the block ends. Every
    /// free page was discarded when it was released (wiped, its frame given
    /// back) or never used, so it reads as zeros.
    fn grow(&mut self, a: usize, len: usize, new_len: usize) -> bool {
        let (end, want) = (a + len, new_len - len);
        if end == self.next {
            if self.next + want > self.end {
                return false;
            }
            self.next += want;
            return true;
        }
        match self.free.get(&end).copied() {
            Some(l) if l >= want => {
                self.free.remove(&end);
                if l > want {
                    self.free.insert(end + want, l - want);
                }
                true
            }
            _ => false,
        }
    }

    /// Whether every page of `[a, a+len)` is free (never handed out, or
    /// given back). No free range ends at `next` (a release reaching it
    /// lowers `next` instead), so below `next` one free range must hold
    /// the whole span.
    fn is_free(&self, a: usize, len: usize) -> bool {
        let Some(end) = a.checked_add(len) else {
            return false;
        };
        if a < self.start || end > self.end {
            return false;
        }
        a >= self.next
            || self
                .free
                .range(..=a)
                .next_back()
                .is_some_and(|(s, l)| s + l >= end)
    }

    /// Marks `[a, a+len)` (page multiples, inside the page part) handed out,
    /// whatever parts of it were free: a mapping placed there by address.
    fn take(&mut self, a: usize, len: usize) {
        let end = a + len;
        let overl: Vec<(usize, usize)> = self
            .free
            .range(..end)
            .filter(|(s, l)| **s + **l > a)
            .map(|(s, l)| (*s, *l))
            .collect();
        for (s, l) in overl {
            self.free.remove(&s);
            if s < a {
                self.free.insert(s, a - s);
            }
            if s + l > end {
                self.free.insert(end, s + l - end);
            }
        }
        if end > self.next {
            if a > self.next {
                self.free.insert(self.next, a - self.next);
            }
            self.next = end;
        }
    }

    /// Returns `[a, a+len)`; parts already free are ignored.
    fn release(&mut self, a: usize, len: usize) {
        let (mut a, mut len) = (a, len.next_multiple_of(PAGE));
        // Drop any overlap with free ranges (double free or partial frees).
        let overl: Vec<(usize, usize)> = self
            .free
            .range(..a + len)
            .filter(|(s, l)| **s + **l > a)
            .map(|(s, l)| (*s, *l))
            .collect();
        for (s, l) in overl {
            self.free.remove(&s);
            let lo = s.min(a);
            let hi = (s + l).max(a + len);
            a = lo;
            len = hi - lo;
        }
        // Coalesce with neighbours.
        if let Some((&s, &l)) = self.free.range(..a).next_back() {
            if s + l == a {
                self.free.remove(&s);
                len += l;
                a = s;
            }
        }
        if let Some(&l) = self.free.get(&(a + len)) {
            self.free.remove(&(a + len));
            len += l;
        }
        if a + len >= self.next {
            self.next = a.min(self.next);
        } else {
            self.free.insert(a, len);
        }
    }
}

/// The region: see the module's documentation.
pub struct Region {
    base: usize,
    len: usize,
    heap_len: usize,
    lock: SpinLock,
    pages: UnsafeCell<PageAlloc>,
    shield: AtomicPtr<Shield>,
    /// How far the page part has been handed out (`PageAlloc::next`, as
    /// of the last release of the lock).
    top: AtomicUsize,
    /// Set once the program gives pages a protection other than read-write:
    /// from then on pages are made writable again before they are wiped
    /// (and before they are handed out again).
    prot_changed: AtomicBool,
    /// Whether the "region full" refusal was printed (once per region).
    full_said: AtomicBool,
}

// SAFETY: `pages` is only reached under `lock` (`with_pages`); every other
// field is immutable or atomic; the shield is `Sync` and lives for the
// process.
unsafe impl Sync for Region {}
// SAFETY: as above; nothing in it is tied to the creating thread.
unsafe impl Send for Region {}

impl Region {
    /// Reserves `len` bytes of address space (`MADV_NOHUGEPAGE`: eviction
    /// works page by page), at `at` when that is page-aligned and free
    /// there, else where the kernel chooses. The first `heap_len` bytes are
    /// the caller's; the rest is the page part.
    ///
    /// # Errors
    /// `InvalidInput` for sizes that are not page multiples or a `heap_len`
    /// beyond `len`; the kernel's refusal to map.
    pub fn reserve(len: usize, heap_len: usize, at: Option<usize>) -> std::io::Result<Region> {
        if len == 0 || !len.is_multiple_of(PAGE) || !heap_len.is_multiple_of(PAGE) || heap_len > len
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("region of {len} bytes with a heap of {heap_len}: not page multiples"),
            ));
        }
        let base = match at.filter(|a| *a != 0 && a.is_multiple_of(PAGE)) {
            Some(a) => match map_at(a, len) {
                Some(b) => b,
                None => uffd::map_anonymous_direct(len)? as usize,
            },
            None => uffd::map_anonymous_direct(len)? as usize,
        };
        // Base pages only: UFFDIO_MOVE and per-page eviction need them.
        // SAFETY: advice on our own fresh mapping; not destructive.
        let _ = unsafe { uffd::madvise_direct(base as *mut u8, len, libc::MADV_NOHUGEPAGE) };
        Ok(Region {
            base,
            len,
            heap_len,
            lock: SpinLock::new(),
            pages: UnsafeCell::new(PageAlloc {
                start: base + heap_len,
                next: base + heap_len,
                end: base + len,
                free: BTreeMap::new(),
                brk: None,
            }),
            shield: AtomicPtr::new(null_mut()),
            top: AtomicUsize::new(base + heap_len),
            prot_changed: AtomicBool::new(false),
            full_said: AtomicBool::new(false),
        })
    }

    /// From now on freed and replaced pages are discarded through `shield`
    /// (which the caller has made protect the region); the page part handed
    /// out so far is noted in use. Again in a forked child, with its new
    /// shield.
    pub fn attach(&self, shield: &'static Shield) {
        self.shield
            .store(std::ptr::from_ref(shield).cast_mut(), Ordering::Release);
        // Everything handed out so far (a forked child's new shield knows
        // none of it; which of it is PROT_NONE is not kept).
        let (from, top) = (self.base + self.heap_len, self.top.load(Ordering::Acquire));
        if top > from {
            shield.note_in_use(from, top - from);
        }
    }

    /// Forgets the shield (in a forked child, whose inherited shield is
    /// dead): pages are wiped and zapped directly until the next
    /// [`Region::attach`].
    pub fn detach(&self) {
        self.shield.store(null_mut(), Ordering::Release);
    }

    /// Whether `addr` lies in the region.
    #[must_use]
    pub fn contains(&self, addr: usize) -> bool {
        addr >= self.base && addr - self.base < self.len
    }

    /// `(base, end)` of the region.
    #[must_use]
    pub fn bounds(&self) -> (usize, usize) {
        (self.base, self.base + self.len)
    }

    /// Whether `[addr, addr+len)` lies in the page part.
    fn in_page_part(&self, addr: usize, len: usize) -> bool {
        addr >= self.base + self.heap_len
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.base + self.len)
    }

    /// Before `fork`: holds the region's lock across it, so the child finds
    /// no allocation half done.
    pub fn fork_prepare(&self) {
        self.lock.lock();
    }

    /// After `fork`, in the parent.
    pub fn fork_parent(&self) {
        self.lock.unlock();
    }

    /// After `fork`, in the child: the lock is released and the parent's
    /// shield forgotten (see [`Region::detach`]).
    pub fn fork_child(&self) {
        self.lock.unlock();
        self.detach();
    }

    /// The shield attached ([`Region::attach`]), if any.
    pub fn shield(&self) -> Option<&'static Shield> {
        let p = self.shield.load(Ordering::Acquire);
        // SAFETY: set only from a `&'static Shield` (`attach`).
        (!p.is_null()).then(|| unsafe { &*p })
    }

    /// Runs `f` on the page allocator under the lock, then tells the shield
    /// how far the page part is handed out (outside the lock: the shield
    /// takes its own).
    fn with_pages<R>(&self, f: impl FnOnce(&mut PageAlloc) -> R) -> R {
        self.lock.lock();
        // SAFETY: `pages` is only reached here, under `lock`.
        let pages = unsafe { &mut *self.pages.get() };
        let r = f(pages);
        self.top.store(pages.next, Ordering::Release);
        self.lock.unlock();
        r
    }

    /// Tells the shield that `[addr, addr+len)` may now hold data (a
    /// shield under a cost budget alone scans only such chunks for data to
    /// sweep). Called where pages become accessible: handed out with a
    /// protection other than `PROT_NONE`, given one, or grown into. Pages
    /// handed out `PROT_NONE` (a Go heap's reservations: gigabytes) are
    /// not, so the scan's `mincore` does not walk them every 50 ms (measured
    /// under etcd: 40% of the watchdog's CPU); a page can hold data only
    /// after one of those calls, and a chunk once noted stays noted.
    fn note_accessible(&self, addr: usize, len: usize, prot: c_int) {
        if prot == libc::PROT_NONE || len == 0 {
            return;
        }
        if let Some(s) = self.shield() {
            s.note_in_use(addr, len.next_multiple_of(PAGE));
        }
    }

    /// Drops the contents of `[a, a+len)`: through the shield (wipe, zap,
    /// forget ciphertext) or, with none attached, by wiping and zapping.
    fn discard(&self, a: usize, len: usize) {
        if let Some(s) = self.shield() {
            // SAFETY: the caller freed or replaces the range: no object
            // lives there.
            unsafe { s.discard(a, len) };
        } else {
            // SAFETY: as above; the memory is readable and writable (pages
            // of the region are, unless the program changed that, and then
            // they are made writable before this: `munmap`).
            unsafe {
                std::ptr::write_bytes(a as *mut u8, 0, len);
                let _ = uffd::madvise_direct(a as *mut u8, len, libc::MADV_DONTNEED);
            }
        }
    }

    /// Whole pages of the page part for the caller's own use (the preload's
    /// large blocks and thread stacks): `len` bytes rounded up to pages,
    /// reading as zeros, given back with [`Region::munmap`].
    pub fn alloc(&self, len: usize) -> Option<usize> {
        let a = self.with_pages(|p| p.alloc(len))?;
        self.note_accessible(a, len, RW);
        Some(a)
    }

    /// Gives back pages [`Region::alloc`] handed out (any part of them):
    /// discarded, then free. The caller knows their protection allows the
    /// wipe (else [`Region::munmap`], which restores it first).
    pub fn free(&self, addr: usize, len: usize) {
        let len = len.next_multiple_of(PAGE);
        self.discard(addr, len);
        self.with_pages(|p| p.release(addr, len));
    }

    /// Extends pages [`Region::alloc`] handed out, `[addr, addr+len)`, to
    /// `new_len` bytes in place when the pages after them are free (they
    /// read as zeros); false otherwise.
    pub fn grow(&self, addr: usize, len: usize, new_len: usize) -> bool {
        let grown = self.with_pages(|p| p.grow(addr, len, new_len));
        if grown && new_len > len {
            self.note_accessible(addr + len, new_len - len, RW);
        }
        grown
    }

    /// `mmap(2)` on the region: anonymous private read-write mappings (of
    /// any protection with `opts.any_prot`) come from the page part, at the
    /// hint when `opts.honor_hint` and its pages are free there (with
    /// `MAP_FIXED_NOREPLACE`: there or `EEXIST`); `MAP_FIXED` anonymous
    /// private ones over the page part are done in place, with the given
    /// protection, reading as zeros. Any other `MAP_FIXED` mapping over the
    /// region has the shield forget the pages it replaces, and is left to
    /// the kernel (`None`).
    pub fn mmap(
        &self,
        addr: usize,
        len: usize,
        prot: c_int,
        flags: c_int,
        fd: c_int,
        opts: MapOpts,
    ) -> Option<Result<usize, Errno>> {
        let ours = len > 0 && anonymous_private(flags, fd) && (prot == RW || opts.any_prot);
        if ours && flags & (libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE) == 0 {
            let hint = (opts.honor_hint && addr != 0).then_some(addr);
            return Some(self.map_new(hint, false, len, prot));
        }
        if ours && flags & libc::MAP_FIXED_NOREPLACE != 0 && opts.honor_hint {
            if !self.contains(addr) {
                return None;
            }
            if !addr.is_multiple_of(PAGE) {
                return Some(Err(libc::EINVAL));
            }
            // Over a mapping of the region unless its pages are free.
            return Some(self.map_new(Some(addr), true, len, prot));
        }
        if flags & libc::MAP_FIXED == 0 || !self.contains(addr) {
            return None;
        }
        if anonymous_private(flags, fd)
            && len > 0
            && addr.is_multiple_of(PAGE)
            && self.in_page_part(addr, len)
        {
            // Fresh anonymous memory over the page part (an allocator
            // resetting or decommitting what it mapped): done in place, so
            // the pages stay in the protected mapping. Handing it to the
            // kernel would make a new mapping outside userfaultfd, where the
            // pages would never be encrypted.
            let len = len.next_multiple_of(PAGE);
            if self.protect(addr, len, RW).is_ok() {
                self.discard(addr, len);
                // Pages that were free are the mapping's now.
                self.with_pages(|p| p.take(addr, len));
                if prot == RW || self.protect(addr, len, prot).is_ok() {
                    return Some(Ok(addr));
                }
            }
        }
        // Anything else replaces part of the region: forget what the shield
        // held there so it never evicts pages of the new mapping.
        self.discard(addr, len);
        None
    }

    /// A new mapping of `len` bytes from the page part, at `hint` when its
    /// pages are free, else (unless `exact`: then `EEXIST`) first fit; with
    /// protection `prot` (free pages are read-write and read as zeros).
    fn map_new(
        &self,
        hint: Option<usize>,
        exact: bool,
        len: usize,
        prot: c_int,
    ) -> Result<usize, Errno> {
        let len = len.next_multiple_of(PAGE);
        let got = self.with_pages(|p| {
            if let Some(h) = hint.filter(|h| h.is_multiple_of(PAGE) && p.is_free(*h, len)) {
                p.take(h, len);
                return Ok(Some(h));
            }
            if exact {
                return Err(libc::EEXIST);
            }
            Ok(p.alloc(len))
        })?;
        let Some(a) = got else {
            // The page part is full: refuse rather than hand out memory the
            // shield cannot protect.
            if !self.full_said.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "memveil-shield: the protected region has no room for an mmap of {len} bytes: \
                     refused (ENOMEM) rather than mapped unprotected; rerun with a larger \
                     memveil run --region-gib"
                );
            }
            return Err(libc::ENOMEM);
        };
        if prot == RW {
            self.note_accessible(a, len, RW);
        } else if let Err(e) = self.protect(a, len, prot) {
            self.munmap(a, len);
            return Err(e);
        }
        Ok(a)
    }

    /// `munmap(2)` on the region: pages of the page part are discarded and
    /// go back to it (any part of a mapping: the allocator keeps no
    /// mapping boundaries); the heap part is refused.
    pub fn munmap(&self, addr: usize, len: usize) -> Option<Result<(), Errno>> {
        if !self.contains(addr) {
            return None;
        }
        if !addr.is_multiple_of(PAGE) || len == 0 || !self.in_page_part(addr, len) {
            return Some(Err(libc::EINVAL));
        }
        let len = len.next_multiple_of(PAGE);
        if self.prot_changed.load(Ordering::Relaxed) {
            // A JIT's code pages (read-only, executable) come back here: the
            // wipe writes them, and the next mmap expects them writable.
            let _ = self.protect(addr, len, RW);
        }
        self.free(addr, len);
        Some(Ok(()))
    }

    /// `madvise(2)` on the region: `MADV_DONTNEED`, `MADV_FREE` and
    /// `MADV_REMOVE` discard (the pages read as zeros afterwards, their
    /// ciphertext dropped); huge pages (they would defeat per-page eviction)
    /// and paging out or in (plaintext would reach swap) are declined,
    /// silently, as the kernel may decline advice. Other advice goes to the
    /// kernel (`None`).
    pub fn madvise(&self, addr: usize, len: usize, advice: c_int) -> Option<Result<(), Errno>> {
        if !self.contains(addr) {
            return None;
        }
        match advice {
            libc::MADV_DONTNEED | libc::MADV_FREE | libc::MADV_REMOVE => {
                if !addr.is_multiple_of(PAGE) {
                    return Some(Err(libc::EINVAL));
                }
                // The kernel's rounding: a part page is a whole one.
                self.discard(addr, len.next_multiple_of(PAGE));
                Some(Ok(()))
            }
            libc::MADV_HUGEPAGE | libc::MADV_COLD | libc::MADV_PAGEOUT | libc::MADV_WILLNEED => {
                Some(Ok(()))
            }
            _ => None,
        }
    }

    /// `mprotect(2)` on the region: the shield learns the protection
    /// (unreadable pages are never evicted, read-only ones never wiped),
    /// then the kernel applies it.
    pub fn mprotect(&self, addr: usize, len: usize, prot: c_int) -> Option<Result<(), Errno>> {
        self.contains(addr).then(|| self.protect(addr, len, prot))
    }

    fn protect(&self, addr: usize, len: usize, prot: c_int) -> Result<(), Errno> {
        if let Some(s) = self.shield() {
            s.set_protection(addr, len, prot);
        }
        if prot != RW {
            self.prot_changed.store(true, Ordering::Relaxed);
        }
        // Noted before the pages become accessible.
        self.note_accessible(addr, len, prot);
        // SAFETY: pages of the region the caller owns (mprotect(2)'s
        // contract, passed on).
        unsafe { uffd::mprotect_direct(addr as *mut u8, len, prot) }
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EINVAL))
    }

    /// `mremap(2)` on the page part: shrinks in place, grows in place when
    /// the pages after the mapping are free, else (with `MREMAP_MAYMOVE`)
    /// moves by allocate-copy-discard within the page part.
    /// `MREMAP_FIXED` and the heap part are refused (EINVAL).
    pub fn mremap(
        &self,
        old: usize,
        old_len: usize,
        new_len: usize,
        flags: c_int,
        new_addr: usize,
    ) -> Option<Result<usize, Errno>> {
        let _ = new_addr;
        if !self.contains(old) {
            return None;
        }
        if flags & libc::MREMAP_FIXED != 0
            || !old.is_multiple_of(PAGE)
            || !self.in_page_part(old, old_len)
            || new_len == 0
        {
            return Some(Err(libc::EINVAL));
        }
        let (old_len, new_len) = (
            old_len.next_multiple_of(PAGE),
            new_len.next_multiple_of(PAGE),
        );
        if new_len <= old_len {
            if new_len < old_len {
                self.munmap(old + new_len, old_len - new_len);
            }
            return Some(Ok(old));
        }
        // In place when the pages after it are free (they read as zeros, as
        // the kernel's growth would give).
        if self.grow(old, old_len, new_len) {
            return Some(Ok(old));
        }
        if flags & libc::MREMAP_MAYMOVE == 0 {
            return Some(Err(libc::ENOMEM));
        }
        let Some(b) = self.alloc(new_len) else {
            return Some(Err(libc::ENOMEM));
        };
        // SAFETY: both ranges are the region's and distinct; the old one is
        // the caller's live mapping.
        unsafe { std::ptr::copy_nonoverlapping(old as *const u8, b as *mut u8, old_len) };
        self.munmap(old, old_len);
        Some(Ok(b))
    }

    /// Moves the break by `incr` within its slice (taken from the page part
    /// on first use), returning the old break; pages given up are
    /// discarded.
    fn move_break(&self, to: impl FnOnce(usize) -> Option<usize>) -> Option<(usize, usize)> {
        let r = self.with_pages(|p| {
            if p.brk.is_none() {
                let len = BRK_SLICE.min((p.end - p.start) / BRK_SHARE / PAGE * PAGE);
                let lo = p.alloc(len)?;
                p.brk = Some((lo, lo, lo + len));
            }
            let (lo, cur, hi) = p.brk?;
            match to(cur).filter(|n| *n >= lo && *n <= hi) {
                Some(new) => {
                    p.brk = Some((lo, new, hi));
                    Some((cur, new))
                }
                None => Some((cur, cur)),
            }
        })?;
        let (old, new) = r;
        if new > old {
            self.note_accessible(old, new - old, RW);
        }
        if new < old {
            let from = new.next_multiple_of(PAGE);
            if from < old {
                self.discard(from, old.next_multiple_of(PAGE) - from);
            }
        }
        Some(r)
    }

    /// `brk(2)` on the break's slice: `brk(0)` gives the current break,
    /// `brk(a)` moves it to `a` when `a` lies in the slice, and the break in
    /// force afterwards is returned (0 when the slice cannot be had).
    pub fn brk(&self, addr: usize) -> usize {
        self.move_break(|cur| if addr == 0 { Some(cur) } else { Some(addr) })
            .map_or(0, |(_, new)| new)
    }

    /// `sbrk(3)` on the same slice: the old break, or ENOMEM when the
    /// break would leave the slice.
    ///
    /// # Errors
    /// `ENOMEM`.
    pub fn sbrk(&self, incr: isize) -> Result<usize, Errno> {
        match self.move_break(|cur| cur.checked_add_signed(incr)) {
            Some((old, new)) if new == old.wrapping_add_signed(incr) => Ok(old),
            _ => Err(libc::ENOMEM),
        }
    }
}

/// Plain anonymous private memory, the kind the region holds: no file, not
/// shared, no huge pages, not a stack.
fn anonymous_private(flags: c_int, fd: c_int) -> bool {
    let excluded = libc::MAP_SHARED | libc::MAP_HUGETLB | libc::MAP_GROWSDOWN | libc::MAP_STACK;
    fd == -1
        && flags & libc::MAP_ANONYMOUS != 0
        && flags & libc::MAP_PRIVATE != 0
        && flags & excluded == 0
}

/// Maps `len` bytes of reservation at exactly `at`, or `None` when the
/// address range is taken (or the kernel cannot place it there).
fn map_at(at: usize, len: usize) -> Option<usize> {
    let flags =
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE;
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping.
    let p = unsafe { uffd::mmap_direct(at as *mut libc::c_void, len, RW, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        return None;
    }
    if p as usize != at {
        // A kernel older than 4.17 took the flag as a hint.
        // SAFETY: the mapping just made, unused.
        let _ = unsafe { uffd::unmap_direct(p.cast(), len) };
        return None;
    }
    Some(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pages(start: usize, n: usize) -> PageAlloc {
        PageAlloc {
            start,
            next: start,
            end: start + n * PAGE,
            free: BTreeMap::new(),
            brk: None,
        }
    }

    #[test]
    fn taken_pages_are_never_handed_out_and_the_hole_below_them_is() {
        let base = 1 << 30;
        let mut p = pages(base, 64);
        assert!(p.is_free(base + 8 * PAGE, 4 * PAGE));
        p.take(base + 8 * PAGE, 4 * PAGE);
        assert!(!p.is_free(base + 8 * PAGE, PAGE));
        assert!(
            !p.is_free(base + 6 * PAGE, 4 * PAGE),
            "straddles taken pages"
        );
        assert!(p.is_free(base, 8 * PAGE) && p.is_free(base + 12 * PAGE, 52 * PAGE));
        assert!(!p.is_free(base + 60 * PAGE, 8 * PAGE), "past the end");
        assert!(!p.is_free(base - PAGE, PAGE), "below the start");
        let got: Vec<usize> = (0..15).filter_map(|_| p.alloc(4 * PAGE)).collect();
        assert_eq!(got.len(), 15);
        for a in &got {
            assert!(
                a + 4 * PAGE <= base + 8 * PAGE || *a >= base + 12 * PAGE,
                "{a:#x}"
            );
        }
        assert_eq!(p.alloc(PAGE), None, "full");
        // Give it all back, in pieces and overlapping: one top again.
        p.release(base + 8 * PAGE, 4 * PAGE);
        for a in got {
            p.release(a, 4 * PAGE);
        }
        p.release(base, 64 * PAGE);
        assert_eq!((p.next, p.free.len()), (base, 0));
    }

    #[test]
    fn taking_pages_inside_a_free_range_splits_it() {
        let base = 1 << 30;
        let mut p = pages(base, 64);
        let a = p.alloc(32 * PAGE).expect("room");
        let _top = p.alloc(PAGE).expect("room");
        p.release(a, 32 * PAGE);
        p.take(a + 4 * PAGE, 2 * PAGE);
        assert_eq!(
            p.free.iter().map(|(a, l)| (*a, *l)).collect::<Vec<_>>(),
            vec![(a, 4 * PAGE), (a + 6 * PAGE, 26 * PAGE)]
        );
        // A release reaching past the top lowers the top, leaving no free
        // range above it.
        p.release(a + 6 * PAGE, 64 * PAGE);
        assert_eq!(p.next, a + 6 * PAGE);
        assert_eq!(p.free.len(), 1);
    }
}
