//! Sub-page allocation of secrets out of one pre-faulted secret region.

use std::alloc::Layout;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use zeroize::Zeroize as _;

use crate::region::SecretRegion;
use crate::{scrub_stack, Level, Policy, SecmemError};

/// Allocation granule: one cache line.
const GRANULE: usize = 64;

/// Bytes of a [`SecretPool`] that an allocation of `bytes` takes (whole
/// granules; at least one), for callers that budget a pool among users.
#[must_use]
pub fn pool_footprint(bytes: usize) -> usize {
    bytes.max(1).div_ceil(GRANULE) * GRANULE
}

struct Inner {
    region: SecretRegion,
    /// One bit per granule; set = in use.
    used: Mutex<Vec<u64>>,
    granules: usize,
}

// SAFETY: the region's bytes are only reached through `SecretBox`es, each of
// which owns a disjoint run of granules handed out under the `used` mutex;
// the bitmap itself is behind that mutex.
unsafe impl Sync for Inner {}
// SAFETY: as above; nothing in `Inner` is tied to a thread.
unsafe impl Send for Inner {}

/// Runs `ctor` and moves its value to `p`, in a frame of its own: the value's
/// temporaries then live below the caller's frame, where `scrub_stack` reaches
/// them. (Were this inlined into the caller, they could sit in the caller's own
/// frame, or its caller's, above anything a scrub can safely overwrite.)
///
/// # Safety
/// `p` must be valid for writes of a `T` and suitably aligned.
#[inline(never)]
unsafe fn build_into<T>(p: *mut T, ctor: impl FnOnce() -> T) {
    // SAFETY: the caller promises `p` is valid and aligned for a T.
    unsafe { p.write(ctor()) };
}

/// A pool of secret memory for many small secrets (keys, key schedules, IVs).
/// Cloning the handle shares the pool.
#[derive(Clone)]
pub struct SecretPool {
    inner: Arc<Inner>,
}

impl SecretPool {
    /// Creates a pool of at least `len` bytes at the strongest level `policy`
    /// accepts (see [`SecretRegion::new`]).
    ///
    /// # Errors
    /// As [`SecretRegion::new`].
    pub fn new(len: usize, policy: Policy) -> Result<Self, SecmemError> {
        let region = SecretRegion::new(len, policy)?;
        let granules = region.len() / GRANULE;
        Ok(Self {
            inner: Arc::new(Inner {
                region,
                used: Mutex::new(vec![0; granules.div_ceil(64)]),
                granules,
            }),
        })
    }

    /// Seals the pool's region for the rest of the process's life
    /// ([`SecretRegion::seal`]).
    ///
    /// # Errors
    /// `mseal(2)`'s: `ENOSYS` before Linux 6.10.
    pub fn seal(&self) -> std::io::Result<()> {
        self.inner.region.seal()
    }

    /// The protection level of every allocation from this pool.
    #[must_use]
    pub fn level(&self) -> Level {
        self.inner.region.level()
    }

    /// Bytes in the pool.
    #[must_use]
    pub fn size(&self) -> usize {
        self.inner.region.len()
    }

    /// Bytes currently free.
    #[must_use]
    pub fn free(&self) -> usize {
        let used = self
            .inner
            .used
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let n: u32 = used.iter().map(|w| w.count_ones()).sum();
        self.inner.granules * GRANULE - n as usize * GRANULE
    }

    fn reserve(&self, layout: Layout) -> Result<(usize, usize), SecmemError> {
        if layout.align() > GRANULE {
            return Err(SecmemError::Alignment(layout.align()));
        }
        let need = pool_footprint(layout.size()) / GRANULE;
        let mut used = self
            .inner
            .used
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let bit = |used: &[u64], i: usize| used[i / 64] >> (i % 64) & 1 == 1;
        let mut run = 0;
        for i in 0..self.inner.granules {
            if bit(&used, i) {
                run = 0;
                continue;
            }
            run += 1;
            if run == need {
                let first = i + 1 - need;
                for j in first..=i {
                    used[j / 64] |= 1 << (j % 64);
                }
                return Ok((first, need));
            }
        }
        drop(used);
        Err(SecmemError::PoolExhausted {
            requested: layout.size(),
            free: self.free(),
            size: self.size(),
        })
    }

    fn ptr_of(&self, first: usize) -> *mut u8 {
        // SAFETY: `first` indexes a granule inside the region (reserve only
        // returns runs below `granules`), so the offset is in bounds.
        unsafe { self.inner.region.as_ptr().add(first * GRANULE) }
    }

    /// Builds a `T` directly in secret memory: `ctor` runs and its result is
    /// moved into the pool, then the stack below the caller is scrubbed so no
    /// transient copy of the value outlives this call.
    ///
    /// # Errors
    /// [`SecmemError::PoolExhausted`] or [`SecmemError::Alignment`].
    pub fn alloc<T>(&self, ctor: impl FnOnce() -> T) -> Result<SecretBox<T>, SecmemError> {
        let (first, n) = self.reserve(Layout::new::<T>())?;
        let p = self.ptr_of(first).cast::<T>();
        // SAFETY: `p` points at `n` granules reserved for us alone, aligned to
        // 64 bytes (≥ align_of::<T>(), checked in reserve) and large enough for T.
        unsafe { build_into(p, ctor) };
        // `build_into` ran (and returned) below this frame, so every transient
        // copy the constructor left lies in the stack this scrub overwrites.
        scrub_stack(16 * 1024);
        Ok(SecretBox {
            // SAFETY: `p` is derived from the region's non-null base pointer.
            ptr: unsafe { NonNull::new_unchecked(p) },
            pool: self.clone(),
            first,
            granules: n,
        })
    }

    /// Allocates `n` zeroed bytes.
    ///
    /// # Errors
    /// [`SecmemError::PoolExhausted`].
    pub fn alloc_bytes(&self, n: usize) -> Result<SecretBox<[u8]>, SecmemError> {
        let layout = Layout::array::<u8>(n).map_err(|_| SecmemError::PoolExhausted {
            requested: n,
            free: self.free(),
            size: self.size(),
        })?;
        let (first, g) = self.reserve(layout)?;
        let p = self.ptr_of(first);
        // SAFETY: the reserved run holds at least `n` bytes owned by us alone.
        unsafe { p.write_bytes(0, n) };
        let slice = std::ptr::slice_from_raw_parts_mut(p, n);
        Ok(SecretBox {
            // SAFETY: derived from the region's non-null base pointer.
            ptr: unsafe { NonNull::new_unchecked(slice) },
            pool: self.clone(),
            first,
            granules: g,
        })
    }
}

/// One secret in a [`SecretPool`]. Dereferences to the value; on drop the
/// value's own destructor runs and then its bytes are wiped. No `Clone`, and
/// `Debug` prints no contents.
pub struct SecretBox<T: ?Sized> {
    ptr: NonNull<T>,
    pool: SecretPool,
    first: usize,
    granules: usize,
}

// SAFETY: a SecretBox owns its T exclusively (like Box<T>); sending it is
// sound when T is Send.
unsafe impl<T: ?Sized + Send> Send for SecretBox<T> {}
// SAFETY: shared access hands out &T only; sound when T is Sync.
unsafe impl<T: ?Sized + Sync> Sync for SecretBox<T> {}

impl<T: ?Sized> SecretBox<T> {
    /// The protection level of the memory holding this secret.
    #[must_use]
    pub fn level(&self) -> Level {
        self.pool.level()
    }
}

impl<T: ?Sized> Deref for SecretBox<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: `ptr` points at an initialised T owned by this box for its
        // whole life.
        unsafe { self.ptr.as_ref() }
    }
}

impl<T: ?Sized> DerefMut for SecretBox<T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` guarantees exclusivity.
        unsafe { self.ptr.as_mut() }
    }
}

impl<T: ?Sized> std::fmt::Debug for SecretBox<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SecretBox({} bytes, {})",
            self.granules * GRANULE,
            self.level()
        )
    }
}

impl<T: ?Sized> Drop for SecretBox<T> {
    fn drop(&mut self) {
        let bytes = self.granules * GRANULE;
        // SAFETY: the value is initialised and dropped exactly once, here;
        // afterwards its granules are wiped and returned to the pool, and the
        // pool (kept alive by `self.pool`) still maps them.
        unsafe {
            std::ptr::drop_in_place(self.ptr.as_ptr());
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<u8>(), bytes).zeroize();
        }
        let mut used = self
            .pool
            .inner
            .used
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for j in self.first..self.first + self.granules {
            used[j / 64] &= !(1 << (j % 64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> SecretPool {
        SecretPool::new(16 * 1024, Policy::allow(Level::Locked)).expect("pool")
    }

    #[test]
    fn boxes_are_disjoint_and_freed() {
        let p = pool();
        let free0 = p.free();
        let mut a = p.alloc(|| [1u8; 100]).expect("a");
        let b = p.alloc(|| [2u8; 100]).expect("b");
        a[0] = 9;
        assert_eq!(b[0], 2);
        assert_eq!(p.free(), free0 - 4 * GRANULE);
        drop(a);
        drop(b);
        assert_eq!(p.free(), free0);
    }

    #[test]
    fn footprint_is_what_an_allocation_takes() {
        let p = pool();
        let free0 = p.free();
        let a = p.alloc_bytes(100).expect("a");
        assert_eq!(free0 - p.free(), pool_footprint(100));
        let b = p.alloc(|| [0u64; 9]).expect("b");
        assert_eq!(free0 - p.free(), pool_footprint(100) + pool_footprint(72));
        assert_eq!(pool_footprint(0), GRANULE);
        drop((a, b));
        assert_eq!(p.free(), free0);
    }

    #[test]
    fn exhaustion_is_an_error() {
        let p = pool();
        let e = p.alloc_bytes(p.size() + 1).expect_err("too big");
        assert!(e.to_string().contains("exhausted"), "{e}");
        let big = p.alloc_bytes(p.size()).expect("whole pool");
        assert!(p.alloc_bytes(1).is_err());
        drop(big);
        assert!(p.alloc_bytes(1).is_ok());
    }

    #[test]
    fn over_aligned_types_are_refused() {
        #[repr(align(128))]
        struct Big(#[allow(dead_code)] u8);
        assert!(matches!(
            pool().alloc(|| Big(1)),
            Err(SecmemError::Alignment(128))
        ));
    }

    #[test]
    fn drop_wipes_bytes() {
        let p = pool();
        let b = p.alloc(|| [0x5Au8; 64]).expect("b");
        let addr = std::ptr::from_ref::<[u8; 64]>(&b).cast::<u8>();
        drop(b);
        // SAFETY: the pool is alive, so the granule is still mapped; we only
        // read it to observe the wipe.
        let after = unsafe { std::slice::from_raw_parts(addr, 64) };
        assert!(after.iter().all(|&x| x == 0), "not wiped: {after:?}");
    }

    proptest::proptest! {
        #[test]
        fn random_alloc_free_never_overlaps(sizes in proptest::collection::vec(1usize..700, 1..40)) {
            let p = pool();
            let mut live = Vec::new();
            for (i, s) in sizes.iter().enumerate() {
                if let Ok(mut b) = p.alloc_bytes(*s) {
                    let tag = u8::try_from(i % 251).unwrap_or(0) + 1;
                    b.fill(tag);
                    live.push((tag, b));
                }
                if i % 3 == 2 && !live.is_empty() {
                    live.remove(0);
                }
            }
            for (tag, b) in &live {
                proptest::prop_assert!(b.iter().all(|x| x == tag));
            }
        }
    }
}
