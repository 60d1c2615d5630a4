//! aws-lc's allocator, routed into a `memfd_secret` heap.
//!
//! `CRYPTO_set_mem_functions` replaces `OPENSSL_malloc`, `OPENSSL_realloc`
//! and `OPENSSL_free` for the whole process, once. Every block aws-lc
//! allocates afterwards comes from a [`SecretHeap`], which wipes blocks when
//! they are freed. A block aws-lc allocated before the switch (none in the
//! vault, which switches first) still has aws-lc's default layout — its
//! size in the 8 bytes before it, from `malloc` — and is wiped and freed
//! that way.
//!
//! A full heap must be an error, never an abort: aws-lc `abort()`s when it
//! cannot allocate a thread's DRBG state (its first random bytes on a new
//! thread: RSA blinding, key generation, ECDSA nonces). So the last
//! [`heap_reserve`] bytes of the heap are kept for that: ordinary allocations
//! stop short of them, and [`ready`] (which every key operation calls
//! first) creates the calling thread's DRBG state inside the reserve, one
//! thread at a time, after checking there is room; when there is none it
//! returns [`AsymError::Heap`] instead of letting aws-lc abort.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use memveil_secmem::{Level, Policy, SecretHeap};

use crate::AsymError;

static HEAP: OnceLock<&'static SecretHeap> = OnceLock::new();

/// aws-lc's default block prefix (its size), for blocks allocated before
/// the switch.
const DEFAULT_PREFIX: usize = 8;

/// The heap's per-block header (`memveil_secmem::SecretHeap`'s).
const BLOCK_HEADER: usize = 16;

/// Room a thread's first random bytes need in the heap: aws-lc's per-thread
/// DRBG state, its tree-DRBG entropy source and a Jitter collector (about
/// 3 KiB measured with aws-lc 0.47), with margin.
const THREAD_STATE: usize = 16 << 10;

/// Allocations refused to keep the reserve (not counted by the heap).
static RESERVE_REFUSED: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's aws-lc DRBG state exists (made by [`ready`]).
    static READY: Cell<bool> = const { Cell::new(false) };
    /// This thread is inside [`ready`]: it may allocate from the reserve.
    static IN_RESERVE: Cell<bool> = const { Cell::new(false) };
}

/// Bytes at the end of a heap of `size` that only a thread making its
/// aws-lc generator state may take (before any key operation): a
/// sixteenth of it, at least 64 KiB (room for the DRBG states of some
/// threads at once), at most half.
#[must_use]
pub fn heap_reserve(size: usize) -> usize {
    (size / 16).max(64 << 10).min(size / 2)
}

/// Makes sure this thread's aws-lc DRBG state exists, so that aws-lc will
/// not abort for want of memory to make it later. A no-op without the
/// secret heap, and after the first call on a thread.
///
/// # Errors
/// [`AsymError::Heap`] when the heap has no room left for it (the request
/// is refused; nothing of the process is lost).
pub(crate) fn ready() -> Result<(), AsymError> {
    let Some(h) = heap() else {
        return Ok(());
    };
    if READY.get() {
        return Ok(());
    }
    // One thread at a time: the room checked is the room used.
    static ONE: Mutex<()> = Mutex::new(());
    let _g = ONE.lock().unwrap_or_else(PoisonError::into_inner);
    let full = || {
        AsymError::Heap(format!(
            "the secret heap for asymmetric keys is full ({} of {} KiB in use): no room for a new thread's random generator; destroy keys or raise the vault's --asym-heap-kib",
            h.in_use() / 1024,
            h.size() / 1024
        ))
    };
    IN_RESERVE.set(true);
    let probe = h.alloc(THREAD_STATE);
    let r = match probe {
        None => Err(full()),
        Some(p) => {
            // SAFETY: a live block of this heap, just allocated.
            unsafe { h.free(p) };
            let mut b = [0u8; 1];
            // SAFETY: one writable byte. The state is made in the room just
            // checked (no other thread can enter the reserve meanwhile).
            unsafe { aws_lc_sys::RAND_bytes(b.as_mut_ptr(), 1) };
            READY.set(true);
            Ok(())
        }
    };
    IN_RESERVE.set(false);
    r
}

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
        failures: h.failures() + RESERVE_REFUSED.load(Ordering::Relaxed),
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
        // aws-lc's process-wide generator state (its entropy source, about
        // 130 KiB) is made at the first random bytes: here, while the heap
        // is empty, rather than at a first request that may find it full.
        ready()?;
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

/// Whether an ordinary allocation of `size` would reach into the reserve.
fn into_reserve(h: &SecretHeap, size: usize) -> bool {
    if IN_RESERVE.get() {
        return false;
    }
    let after = h.in_use().saturating_add(size).saturating_add(BLOCK_HEADER);
    if after.saturating_add(heap_reserve(h.size())) > h.size() {
        RESERVE_REFUSED.fetch_add(1, Ordering::Relaxed);
        return true;
    }
    false
}

unsafe extern "C" fn hook_malloc(size: usize, _file: *const c_char, _line: c_int) -> *mut c_void {
    heap()
        .filter(|h| !into_reserve(h, size))
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
    if into_reserve(h, size) {
        return std::ptr::null_mut();
    }
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
