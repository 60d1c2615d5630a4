//! Regression: Argon2id's working memory (64 MiB by default; the KEK is one
//! hash away from its last blocks) went back to the allocator unwiped, since
//! `argon2::Argon2::hash_password_into` frees its blocks as they are. The
//! keystore's KDF owns that memory and zeroes it first. Shown with a global
//! allocator that looks at every free of exactly the working memory's size.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use memveil_vault::keystore::{argon2id, KdfParams};

/// Size of the frees to look at (0: none).
static WATCH: AtomicUsize = AtomicUsize::new(0);
/// Frees of that size, and how many of them still held a non-zero byte.
static FREED: AtomicUsize = AtomicUsize::new(0);
static DIRTY: AtomicUsize = AtomicUsize::new(0);

struct Inspecting;

// SAFETY: every call is passed on to the system allocator unchanged; the
// only addition reads a block that is being freed, before it is freed.
unsafe impl GlobalAlloc for Inspecting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's promise for `layout` is passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let watch = WATCH.load(Relaxed);
        if watch != 0 && layout.size() == watch {
            // SAFETY: `ptr` is a live allocation of `layout.size()` bytes
            // (the caller's promise), initialised (a Vec of Blocks), not
            // yet freed and no longer used by its owner.
            let bytes = unsafe { std::slice::from_raw_parts(ptr, layout.size()) };
            FREED.fetch_add(1, Relaxed);
            if bytes.iter().any(|&b| b != 0) {
                DIRTY.fetch_add(1, Relaxed);
            }
        }
        // SAFETY: as the caller promised for `ptr` and `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Inspecting = Inspecting;

#[test]
fn argon2id_working_memory_is_zero_when_freed() {
    // 1048 KiB: 1048 blocks of 1 KiB, a size nothing else here frees.
    let params = KdfParams {
        m_kib: 1048,
        t: 1,
        p: 1,
    };
    let (pass, salt) = (b"correct horse battery", [7u8; 16]);
    WATCH.store(1048 * 1024, Relaxed);

    // Positive control: the crate's own allocation goes back dirty.
    let prm = argon2::Params::new(params.m_kib, params.t, params.p, Some(32)).expect("params");
    let mut want = [0u8; 32];
    argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, prm)
        .hash_password_into(pass, &salt, &mut want)
        .expect("argon2");
    assert_eq!(
        (FREED.load(Relaxed), DIRTY.load(Relaxed)),
        (1, 1),
        "positive control: hash_password_into's blocks were not seen freed holding state"
    );

    // The keystore's KDF: the same output, its memory zero when freed.
    let mut got = [0u8; 32];
    argon2id(pass, &salt, params, &mut got).expect("argon2id");
    assert_eq!(got, want, "the keystore's KDF must not change the KEK");
    assert_eq!(
        (FREED.load(Relaxed), DIRTY.load(Relaxed)),
        (2, 1),
        "the keystore's Argon2id working memory was freed holding state"
    );
    WATCH.store(0, Relaxed);
}
