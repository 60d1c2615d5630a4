//! The fenced `unsafe` of this crate: memveil's own AES kernels.
//!
//! - [`ni`]: 128-bit AES-NI kernels (eight blocks in flight) for ECB, CBC,
//!   CTR and XTS, single blocks, and key expansion.
//! - [`vaes`]: VAES kernels on 256-bit registers (two blocks per
//!   instruction, sixteen in flight) for ECB, CTR and XTS.
//! - [`clmul`]: GHASH (through POLYVAL, RFC 8452 appendix A) with PCLMULQDQ
//!   and VPCLMULQDQ, eight blocks per reduction.
//!
//! [`Schedule`] and [`GhashKey`] are the key material the kernels read. The
//! only way to build one is [`Schedule::new`]/[`GhashKey::new`], which check
//! the CPU for the features of the path asked for and refuse otherwise; that
//! check is the invariant every `unsafe` call of a `#[target_feature]`
//! function here relies on.
//!
//! Key hygiene (issue 14). What the compiler spills to the stack stays
//! there, unwiped, after the kernel returns; and not only round keys give a
//! key away: a block's state between rounds beside its known plaintext or
//! ciphertext gives the round key that joins them. So:
//!
//! - the kernels never copy a schedule into locals. Each group of blocks
//!   reads its round keys through a pointer that passed through
//!   [`std::hint::black_box`] ([`View`]), so the compiler cannot hoist them
//!   into registers held across the loop (sixteen vector registers cannot
//!   hold a schedule, the blocks and the tweaks; what does not fit is
//!   spilled). A round key lives in a register from its load to its last use
//!   in the same round;
//! - groups of blocks are arrays indexed only by constants ([`unroll!`]) and
//!   rounds are macros, never outlined functions, so blocks mid-cipher stay
//!   in registers;
//! - XTS tweaks wait for the last round in their blocks' own output slots
//!   rather than in registers beside the blocks (see the XTS kernels);
//! - the few locals that hold key-derived bytes (a partial CTR keystream
//!   block, the GHASH key while its powers are computed) are wiped
//!   ([`wipe`]).
//!
//! Checked twice: the compiled kernels store no vector register to the
//! stack except those wiped locals (inspected with `objdump`, see
//! `docs/benchmarks-history.md`), and the stack-scan tests (`tests/stack_hygiene.rs`)
//! find no round key, tweak or intermediate block state on a thread's stack
//! after the kernels ran, on every path.

/// Repeats `$body` with `$j` a constant 0, 1, …, N-1: unrolled by
/// construction, so arrays of vector registers indexed by `$j` are
/// registers, never memory (a loop the optimiser declines to unroll would
/// keep them in a stack array: blocks mid-cipher, from which a key can be
/// recovered).
macro_rules! unroll {
    (4, $j:ident => $body:expr) => {{
        { const $j: usize = 0; $body; }
        { const $j: usize = 1; $body; }
        { const $j: usize = 2; $body; }
        { const $j: usize = 3; $body; }
    }};
    (8, $j:ident => $body:expr) => {{
        unroll!(4, $j => $body);
        { const $j: usize = 4; $body; }
        { const $j: usize = 5; $body; }
        { const $j: usize = 6; $body; }
        { const $j: usize = 7; $body; }
    }};
}

mod clmul;
mod ni;
mod vaes;

use std::arch::x86_64::{
    __m128i, __m256i, _mm256_broadcastsi128_si256, _mm256_loadu_si256, _mm_load_si128,
};
use std::marker::PhantomData;

use zeroize::Zeroize;

use crate::path::Path;

/// `N` 16-byte values (round keys, powers of H), aligned so that the
/// legacy-SSE kernels can fold them into memory operands and pairs of them
/// load as one 256-bit value.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub(crate) struct Aligned<const N: usize>(pub(crate) [[u8; 16]; N]);

/// Round keys 0..=14.
pub(crate) type RoundKeys = Aligned<15>;

/// An expanded AES-128 or AES-256 key for the kernels: encryption round keys
/// and the equivalent-inverse-cipher decryption round keys. Plain inline
/// data (callers place it in secret memory); wiped on drop.
pub(crate) struct Schedule {
    enc: RoundKeys,
    dec: RoundKeys,
    rounds: usize,
    /// Built for [`Path::Vaes256`] (the CPU was checked); otherwise AES-NI.
    wide: bool,
}

impl Drop for Schedule {
    fn drop(&mut self) {
        self.enc.0.zeroize();
        self.dec.0.zeroize();
    }
}

/// A read-only view of a table of key material whose pointer the optimiser
/// cannot see through (see the module documentation): every `View` made
/// reloads what it reads.
#[derive(Clone, Copy)]
pub(crate) struct View<'a, const N: usize> {
    p: *const Aligned<N>,
    _table: PhantomData<&'a Aligned<N>>,
}

impl<'a, const N: usize> View<'a, N> {
    #[inline(always)]
    fn new(table: &'a Aligned<N>) -> Self {
        View {
            p: std::hint::black_box(std::ptr::from_ref(table)),
            _table: PhantomData,
        }
    }

    /// Entry `i` (clamped to the table).
    #[inline(always)]
    fn x(self, i: usize) -> __m128i {
        // SAFETY: `p` came from a `&'a Aligned<N>` (black_box returns its
        // argument unchanged), which outlives `self`; `i.min(N - 1)` indexes
        // one of its N entries; `Aligned` is 32-byte aligned, so each 16-byte
        // entry is 16-byte aligned as `_mm_load_si128` requires. SSE2 is
        // part of the x86_64 baseline.
        unsafe { _mm_load_si128((&raw const (*self.p).0[i.min(N - 1)]).cast()) }
    }

    /// Entry `i` in both halves of a 256-bit register.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn y(self, i: usize) -> __m256i {
        _mm256_broadcastsi128_si256(self.x(i))
    }

    /// Entries `i` (low half) and `i + 1` (high half), clamped to the table.
    #[inline]
    #[target_feature(enable = "avx")]
    fn pair(self, i: usize) -> __m256i {
        let i = i.min(N.saturating_sub(2));
        // SAFETY: as in `x`; entries i and i+1 are both inside the table
        // (N >= 2 for every table this is used on, and i <= N - 2);
        // loadu has no alignment requirement.
        unsafe { _mm256_loadu_si256((&raw const (*self.p).0[i]).cast()) }
    }
}

/// One direction's round keys (the kernels take the round count as a
/// constant).
#[derive(Clone, Copy)]
pub(crate) struct Rk<'a> {
    t: View<'a, 15>,
}

impl Rk<'_> {
    /// Round key `i`.
    #[inline(always)]
    fn x(self, i: usize) -> __m128i {
        self.t.x(i)
    }

    /// Round key `i` in both halves of a 256-bit register.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn y(self, i: usize) -> __m256i {
        self.t.y(i)
    }
}

/// `r` itself, through a pointer the optimiser cannot relate to earlier
/// accesses: what was stored through `r` before must be loaded again, not
/// kept in a register (see the XTS kernels).
#[inline(always)]
fn opaque<T: ?Sized>(r: &mut T) -> &mut T {
    let p = std::hint::black_box(std::ptr::from_mut(r));
    // SAFETY: black_box returns its argument unchanged, so `p` is the
    // pointer of `r`, whose exclusive borrow this function consumed and
    // hands back with the same lifetime.
    unsafe { &mut *p }
}

/// Asks the processor to bring `bytes` into its caches ahead of use (no
/// effect on any result). The processor's own prefetchers stop at page
/// boundaries; a caller working through many pages in a row fetches the
/// next while it works on this one.
pub(crate) fn prefetch(bytes: &[u8]) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch reads nothing into the program and never
        // faults; the pointer is in bounds anyway. SSE is baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
    }
}

/// Overwrites `b` with zeros, 16 bytes per store, in a way the optimiser
/// cannot drop (`zeroize` on byte arrays stores a byte at a time: 256
/// stores for a 256-byte buffer, a tenth of a page's encryption).
pub(crate) fn wipe<const N: usize>(b: &mut [[u8; 16]; N]) {
    for e in b.iter_mut() {
        // SAFETY: `e` is a valid, writable `[u8; 16]` (alignment 1).
        unsafe { std::ptr::write_volatile(std::ptr::from_mut(e), [0u8; 16]) };
    }
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
}

/// [`wipe`] of one 16-byte block.
pub(crate) fn wipe16(b: &mut [u8; 16]) {
    wipe(std::array::from_mut(b));
}

/// Calls the kernel `$f` instantiated for the schedule's round count.
macro_rules! by_rounds {
    ($s:expr, $($f:ident)::+ ( $($a:expr),* $(,)? )) => {
        if $s.rounds == 14 {
            $($f)::+::<14>($($a),*)
        } else {
            $($f)::+::<10>($($a),*)
        }
    };
}

fn feature_ok(path: Path) -> bool {
    path != Path::Portable && path.supported()
}

impl Schedule {
    /// Expands `key` (16 or 32 bytes) for `path`; `None` for the portable
    /// path, another key length, or a CPU that lacks the path's features.
    pub(crate) fn new(key: &[u8], path: Path) -> Option<Self> {
        if !(key.len() == 16 || key.len() == 32) || !feature_ok(path) {
            return None;
        }
        let mut s = Schedule {
            enc: Aligned([[0; 16]; 15]),
            dec: Aligned([[0; 16]; 15]),
            rounds: 0,
            wide: path == Path::Vaes256,
        };
        // SAFETY: `feature_ok` saw AES-NI, PCLMULQDQ and SSSE3 on this CPU.
        s.rounds = unsafe { ni::expand(key, &mut s.enc.0, &mut s.dec.0) };
        (s.rounds != 0).then_some(s)
    }

    /// The path these round keys were built for.
    pub(crate) fn path(&self) -> Path {
        if self.wide {
            Path::Vaes256
        } else {
            Path::AesNi
        }
    }

    pub(crate) fn key_bits(&self) -> usize {
        if self.rounds == 14 {
            256
        } else {
            128
        }
    }

    fn rk(&self, enc: bool) -> Rk<'_> {
        Rk {
            t: View::new(if enc { &self.enc } else { &self.dec }),
        }
    }

    /// Encrypts (`enc`) or decrypts one block in place.
    pub(crate) fn block(&self, b: &mut [u8; 16], enc: bool) {
        // SAFETY: a Schedule exists only where `new` saw AES-NI.
        unsafe { by_rounds!(self, ni::block(self.rk(enc), enc, b)) }
    }

    /// ECB over whole blocks of `data` (a multiple of 16 bytes).
    pub(crate) fn ecb(&self, data: &mut [u8], enc: bool) {
        if self.wide && data.len() >= 256 {
            // SAFETY: `wide` is set only where `new` saw the VAES path's
            // features.
            let rest = unsafe { by_rounds!(self, vaes::ecb(self, enc, data)) };
            // SAFETY: as above (AES-NI).
            unsafe { by_rounds!(self, ni::ecb(self, enc, rest)) }
        } else {
            // SAFETY: a Schedule exists only where `new` saw AES-NI.
            unsafe { by_rounds!(self, ni::ecb(self, enc, data)) }
        }
    }

    /// CBC encryption over whole blocks from `iv`.
    pub(crate) fn cbc_encrypt(&self, iv: &[u8; 16], data: &mut [u8]) {
        // SAFETY: a Schedule exists only where `new` saw AES-NI.
        unsafe { by_rounds!(self, ni::cbc_encrypt(self, iv, data)) }
    }

    /// CBC decryption over whole blocks from `iv`.
    pub(crate) fn cbc_decrypt(&self, iv: &[u8; 16], data: &mut [u8]) {
        // SAFETY: a Schedule exists only where `new` saw AES-NI.
        unsafe { by_rounds!(self, ni::cbc_decrypt(self, iv, data)) }
    }

    /// CTR over `data` of any length from the big-endian counter `ctr`
    /// (the whole 128-bit block incremented); XORs the keystream in, or
    /// writes it over `data` when `xor` is false.
    pub(crate) fn ctr(&self, ctr: u128, data: &mut [u8], xor: bool) {
        let mut c = ctr;
        let rest = if self.wide && data.len() >= 256 {
            // SAFETY: `wide` is set only where `new` saw the VAES path's
            // features.
            unsafe { by_rounds!(self, vaes::ctr(self, &mut c, data, xor)) }
        } else {
            data
        };
        // SAFETY: a Schedule exists only where `new` saw AES-NI.
        unsafe { by_rounds!(self, ni::ctr(self, &mut c, rest, xor)) }
    }

    /// XTS over whole blocks of `data` (a multiple of 16 bytes) from the
    /// encrypted tweak `tw` (little-endian), which is advanced to the tweak
    /// of the block after.
    pub(crate) fn xts(&self, tw: &mut [u8; 16], data: &mut [u8], enc: bool) {
        let rest = if self.wide && data.len() >= 256 {
            // SAFETY: `wide` is set only where `new` saw the VAES path's
            // features.
            unsafe { by_rounds!(self, vaes::xts(self, enc, tw, data)) }
        } else {
            data
        };
        if !rest.is_empty() {
            // SAFETY: a Schedule exists only where `new` saw AES-NI.
            unsafe { by_rounds!(self, ni::xts(self, enc, tw, rest)) };
        }
    }
}

/// The hash key of GHASH for the kernels: H, H^2, ..., H^8 in POLYVAL form
/// (RFC 8452 appendix A: byte-reversed and multiplied by x), highest power
/// first. Plain inline data; wiped on drop.
pub(crate) struct GhashKey {
    h: Aligned<8>,
    wide: bool,
}

impl Drop for GhashKey {
    fn drop(&mut self) {
        self.h.0.zeroize();
    }
}

impl GhashKey {
    /// The hash key of `aes` (H = E_K(0)), for the same path as `aes`.
    pub(crate) fn new(aes: &Schedule) -> Self {
        let mut k = GhashKey {
            h: Aligned([[0; 16]; 8]),
            wide: aes.wide,
        };
        let mut h = [0u8; 16];
        aes.block(&mut h, true);
        // SAFETY: a Schedule exists only where `new` saw AES-NI, PCLMULQDQ
        // and SSSE3.
        unsafe { clmul::powers(&h, &mut k.h.0) };
        wipe16(&mut h);
        k
    }

    /// Folds whole 16-byte blocks of `data` (the last one zero-padded) into
    /// the GHASH state `s` (GCM byte order).
    pub(crate) fn update(&self, s: &mut [u8; 16], data: &[u8]) {
        let (blocks, tail) = data.as_chunks::<16>();
        let rest = if self.wide && blocks.len() >= 8 {
            // SAFETY: `wide` is copied from a Schedule built where `new`
            // saw the VAES path's features (VPCLMULQDQ, AVX2 among them).
            unsafe { clmul::update_wide(&self.h, s, blocks) }
        } else {
            blocks
        };
        // SAFETY: GhashKey is built only from a Schedule, which exists only
        // where PCLMULQDQ and SSSE3 were seen.
        unsafe { clmul::update(&self.h, s, rest) };
        if !tail.is_empty() {
            let mut last = [0u8; 16];
            last[..tail.len()].copy_from_slice(tail);
            // SAFETY: as above.
            unsafe { clmul::update(&self.h, s, &[last]) };
        }
    }
}
