//! aws-lc's allocator, routed into a `memfd_secret` heap.
//!
//! `CRYPTO_set_mem_functions` replaces `OPENSSL_malloc`, `OPENSSL_realloc`
//! and `OPENSSL_free` for the whole process, once. Every block aws-lc
//! allocates afterwards comes from a [`SecretHeap`], which wipes blocks when
//! they are freed. A block aws-lc allocated before the switch (none in the
//! vault, which switches first) still has aws-lc's default layout — its
//! size in the 8 bytes before it, from `malloc` — and is wiped and freed
//! that way.

use std::ffi::{c_char, c_int, c_void};
use std::ptr::NonNull;
use std::sync::OnceLock;

use memveil_secmem::{Level, Policy, SecretHeap};

use crate::AsymError;

static HEAP: OnceLock<&'static SecretHeap> = OnceLock::new();

/// aws-lc's default block prefix (its size), for blocks allocated before
/// the switch.
const DEFAULT_PREFIX: usize = 8;

/// Counters of the secret heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeapStats {
    /// Protection level of the heap's pages.
    pub level: Level,
    /// Bytes of the heap.
    pub size: usize,
    /// Bytes in use now.
    pub in_use: usize,
    /// Most bytes in use at once.
    pub peak: usize,
    /// Allocations refused because the heap was full.
    pub failures: usize,
}

/// The secret heap's counters, once [`use_secret_heap`] ran in this process.
#[must_use]
pub fn heap_stats() -> Option<HeapStats> {
    HEAP.get().map(|h| HeapStats {
        level: h.level(),
        size: h.size(),
        in_use: h.in_use(),
        peak: h.peak(),
        failures: h.failures(),
    })
}

/// Makes every later aws-lc allocation in this process come from a secret
/// heap of `bytes` (at the strongest level `policy` accepts). Idempotent:
/// a second call returns the first heap's counters (its size stays).
///
/// # Errors
/// [`AsymError::Heap`] when the region cannot be had (no `memfd_secret`
/// and a policy that demands it, `RLIMIT_MEMLOCK`), or aws-lc refuses the
/// switch.
pub fn use_secret_heap(bytes: usize, policy: Policy) -> Result<HeapStats, AsymError> {
    static SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = SWITCH
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if HEAP.get().is_none() {
        let h = SecretHeap::new(bytes, policy).map_err(|e| AsymError::Heap(e.to_string()))?;
        let h: &'static SecretHeap = Box::leak(Box::new(h));
        // The heap must be in place before aws-lc can call the hooks.
        let _ = HEAP.set(h);
        // SAFETY: the three functions have the signatures aws-lc expects and
        // honour its contract (malloc/realloc/free semantics, callable from
        // any thread, no calls back into aws-lc).
        let ok = unsafe {
            aws_lc_sys::CRYPTO_set_mem_functions(
                Some(hook_malloc),
                Some(hook_realloc),
                Some(hook_free),
            )
        };
        if ok != 1 {
            return Err(AsymError::Heap(
                "aws-lc refused CRYPTO_set_mem_functions (set once per process already?)".into(),
            ));
        }
    }
    heap_stats().ok_or_else(|| AsymError::Heap("no heap".into()))
}

/// Seals the secret heap's region for the rest of the process's life
/// (`mseal(2)`, see `SecretRegion::seal`); `None` before
/// [`use_secret_heap`].
#[must_use]
pub fn seal_heap() -> Option<std::io::Result<()>> {
    heap().map(SecretHeap::seal)
}

fn heap() -> Option<&'static SecretHeap> {
    HEAP.get().copied()
}

unsafe extern "C" fn hook_malloc(size: usize, _file: *const c_char, _line: c_int) -> *mut c_void {
    heap()
        .and_then(|h| h.alloc(size))
        .map_or(std::ptr::null_mut(), |p| p.as_ptr().cast())
}

unsafe extern "C" fn hook_free(p: *mut c_void, _file: *const c_char, _line: c_int) {
    let Some(p) = NonNull::new(p.cast::<u8>()) else {
        return;
    };
    match heap() {
        // SAFETY: aws-lc frees only blocks it allocated; one inside the
        // region came from `alloc`.
        Some(h) if h.contains(p.as_ptr()) => unsafe { h.free(p) },
        // SAFETY: a block from before the switch: aws-lc's default layout,
        // `malloc`ed with its size in the word before it.
        _ => unsafe { free_default(p) },
    }
}

unsafe extern "C" fn hook_realloc(
    p: *mut c_void,
    size: usize,
    _file: *const c_char,
    _line: c_int,
) -> *mut c_void {
    let Some(old) = NonNull::new(p.cast::<u8>()) else {
        // SAFETY: realloc(NULL, n) is malloc(n).
        return unsafe { hook_malloc(size, std::ptr::null(), 0) };
    };
    let Some(h) = heap() else {
        return std::ptr::null_mut();
    };
    if h.contains(old.as_ptr()) {
        // SAFETY: a live block of this heap, as aws-lc passes only its own.
        return unsafe { h.realloc(old, size) }.map_or(std::ptr::null_mut(), |n| n.as_ptr().cast());
    }
    // A block from before the switch: move it into the heap.
    let Some(new) = h.alloc(size) else {
        return std::ptr::null_mut();
    };
    // SAFETY: the old block has aws-lc's default layout (size word before
    // it); both blocks hold at least the bytes copied; they do not overlap.
    unsafe {
        let old_size = old
            .as_ptr()
            .sub(DEFAULT_PREFIX)
            .cast::<usize>()
            .read_unaligned();
        std::ptr::copy_nonoverlapping(old.as_ptr(), new.as_ptr(), old_size.min(size));
        free_default(old);
    }
    new.as_ptr().cast()
}

/// Wipes and frees a block in aws-lc's default layout.
///
/// # Safety
/// `p` must be a live block `OPENSSL_malloc` returned before the switch.
unsafe fn free_default(p: NonNull<u8>) {
    // SAFETY: the caller's promise: the size word sits DEFAULT_PREFIX bytes
    // before `p`, at the start of the `malloc`ed block.
    unsafe {
        let base = p.as_ptr().sub(DEFAULT_PREFIX);
        let size = base.cast::<usize>().read_unaligned();
        zeroize::Zeroize::zeroize(std::slice::from_raw_parts_mut(base, size + DEFAULT_PREFIX));
        libc::free(base.cast());
    }
}
