//! A general-purpose heap (malloc/free/realloc by pointer) in one secret
//! region, for C libraries that allocate key material themselves: the vault
//! routes aws-lc's `OPENSSL_malloc` here (memveil-asym), so the BIGNUMs of
//! an RSA key, its Montgomery contexts, blinding values and every temporary
//! of an operation live in `memfd_secret` pages.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use talc::{ErrOnOom, Span, Talc};
use zeroize::Zeroize as _;

use crate::region::SecretRegion;
use crate::{Level, Policy, SecmemError};

/// Alignment of every block (what `malloc` promises on x86-64).
const ALIGN: usize = 16;
/// The header before each block: its size (one word, padded to `ALIGN`).
const HEADER: usize = 16;

/// A heap in secret memory. Blocks are 16-byte aligned, carry their size in
/// a 16-byte header, and are wiped when freed.
pub struct SecretHeap {
    region: SecretRegion,
    talc: Mutex<Talc<ErrOnOom>>,
    in_use: AtomicUsize,
    peak: AtomicUsize,
    failed: AtomicUsize,
}

// SAFETY: the region's bytes are reached only through blocks handed out under
// the `talc` mutex, each owned by one caller until it is freed; the allocator
// state is behind that mutex.
unsafe impl Sync for SecretHeap {}
// SAFETY: as above; nothing in the heap is tied to a thread.
unsafe impl Send for SecretHeap {}

fn layout(size: usize) -> Option<Layout> {
    let total = size.checked_add(HEADER)?;
    Layout::from_size_align(total, ALIGN).ok()
}

impl SecretHeap {
    /// A heap of at least `len` bytes at the strongest level `policy` accepts.
    ///
    /// # Errors
    /// As [`SecretRegion::new`]; [`SecmemError::Os`] if the allocator cannot
    /// take the region.
    pub fn new(len: usize, policy: Policy) -> Result<Self, SecmemError> {
        let region = SecretRegion::new(len, policy)?;
        let mut talc = Talc::new(ErrOnOom);
        let base = region.as_ptr();
        // SAFETY: the region is mapped read-write for `region.len()` bytes and
        // lives as long as the heap (it is a field of the same struct and is
        // never remapped); nothing else uses these bytes.
        unsafe { talc.claim(Span::from_base_size(base, region.len())) }.map_err(|()| {
            SecmemError::Os {
                op: "claiming the secret region for the heap",
                source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
            }
        })?;
        Ok(Self {
            region,
            talc: Mutex::new(talc),
            in_use: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
        })
    }

    /// The protection level of every block.
    #[must_use]
    pub fn level(&self) -> Level {
        self.region.level()
    }

    /// Seals the heap's region for the rest of the process's life
    /// ([`SecretRegion::seal`]).
    ///
    /// # Errors
    /// `mseal(2)`'s: `ENOSYS` before Linux 6.10.
    pub fn seal(&self) -> std::io::Result<()> {
        self.region.seal()
    }

    /// Bytes of the region.
    #[must_use]
    pub fn size(&self) -> usize {
        self.region.len()
    }

    /// Bytes handed out now (headers included).
    #[must_use]
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Relaxed)
    }

    /// The most bytes ever handed out at once.
    #[must_use]
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Allocations refused because the heap was full.
    #[must_use]
    pub fn failures(&self) -> usize {
        self.failed.load(Ordering::Relaxed)
    }

    /// Whether `p` lies inside this heap's region.
    #[must_use]
    pub fn contains(&self, p: *const u8) -> bool {
        let base = self.region.as_ptr() as usize;
        let a = p as usize;
        a >= base && a < base + self.region.len()
    }

    /// A block of `size` bytes (16-byte aligned), or `None` when the heap is
    /// full. The block's contents are unspecified (freed blocks are wiped,
    /// so in practice zeros).
    #[must_use]
    pub fn alloc(&self, size: usize) -> Option<NonNull<u8>> {
        let l = layout(size)?;
        let raw = {
            let mut t = self.talc.lock().unwrap_or_else(PoisonError::into_inner);
            // SAFETY: `l` has a non-zero size (at least the header).
            unsafe { t.malloc(l) }
        };
        let Ok(raw) = raw else {
            self.failed.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        // SAFETY: the block holds `HEADER + size` bytes, 16-aligned; the
        // header is its first word, the caller's bytes start after it.
        unsafe {
            raw.as_ptr().cast::<usize>().write(size);
            let now = self.in_use.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            self.peak.fetch_max(now, Ordering::Relaxed);
            Some(NonNull::new_unchecked(raw.as_ptr().add(HEADER)))
        }
    }

    /// The size the caller asked for when `p` was allocated.
    ///
    /// # Safety
    /// `p` must be a live block of this heap.
    #[must_use]
    pub unsafe fn size_of(&self, p: NonNull<u8>) -> usize {
        // SAFETY: the caller promises `p` came from `alloc`, so its header
        // lies HEADER bytes before it, inside the same block.
        unsafe { p.as_ptr().sub(HEADER).cast::<usize>().read() }
    }

    /// Wipes and frees a block.
    ///
    /// # Safety
    /// `p` must be a live block of this heap, not used after this call.
    pub unsafe fn free(&self, p: NonNull<u8>) {
        // SAFETY: as promised, `p` is a live block: its header and its
        // `size` bytes are ours to wipe, and `raw`/`l` are what `alloc` used.
        unsafe {
            let size = self.size_of(p);
            let raw = p.as_ptr().sub(HEADER);
            std::slice::from_raw_parts_mut(raw, size + HEADER).zeroize();
            if let Some(l) = layout(size) {
                self.in_use.fetch_sub(l.size(), Ordering::Relaxed);
                let mut t = self.talc.lock().unwrap_or_else(PoisonError::into_inner);
                t.free(NonNull::new_unchecked(raw), l);
            }
        }
    }

    /// Moves a block to one of `size` bytes (the old one wiped and freed);
    /// `None` leaves the old block as it was.
    ///
    /// # Safety
    /// `p` must be a live block of this heap; on success it is freed.
    #[must_use]
    pub unsafe fn realloc(&self, p: NonNull<u8>, size: usize) -> Option<NonNull<u8>> {
        let new = self.alloc(size)?;
        // SAFETY: `p` is live (caller's promise) with `old` readable bytes;
        // `new` is a fresh block of `size` bytes; they do not overlap.
        unsafe {
            let old = self.size_of(p);
            std::ptr::copy_nonoverlapping(p.as_ptr(), new.as_ptr(), old.min(size));
            self.free(p);
        }
        Some(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_aligned_disjoint_wiped_and_counted() {
        let h = SecretHeap::new(64 << 10, Policy::allow(Level::Locked)).expect("heap");
        let a = h.alloc(100).expect("a");
        let b = h.alloc(1).expect("b");
        assert_eq!(a.as_ptr() as usize % ALIGN, 0);
        assert!(h.contains(a.as_ptr()) && h.contains(b.as_ptr()));
        assert!(!h.contains(std::ptr::null()));
        // SAFETY: both blocks are live and at least as large as written.
        unsafe {
            a.as_ptr().write_bytes(0xAB, 100);
            b.as_ptr().write(7);
            assert_eq!(h.size_of(a), 100);
            assert_eq!(b.as_ptr().read(), 7);
            let a2 = h.realloc(a, 300).expect("grow");
            assert_eq!(std::slice::from_raw_parts(a2.as_ptr(), 100), &[0xAB; 100]);
            assert_eq!(h.size_of(a2), 300);
            h.free(a2);
            h.free(b);
        }
        assert_eq!(h.in_use(), 0);
        assert!(h.peak() >= 316);
        // Full: refused and counted, never a panic.
        assert!(h.alloc(1 << 30).is_none());
        assert!(h.alloc(usize::MAX).is_none());
        assert_eq!(h.failures(), 1);
    }
}
