//! VAES kernels on 256-bit registers: two blocks per instruction, eight
//! registers (sixteen blocks, 256 bytes) in flight, which is what it takes
//! to keep both AES units of a core busy (`vaesenc` has a latency of about
//! four cycles and issues twice a cycle). Each kernel handles whole 256-byte
//! groups and returns the rest for the AES-NI kernels.
//!
//! Registers: eight of blocks and one or two round keys at a time
//! (broadcast from the schedule as they are used); XTS tweaks come from
//! memory (see [`xts`]). That is what sixteen ymm registers hold without
//! spilling.

use std::arch::x86_64::{
    __m256i, _mm256_add_epi64, _mm256_aesdec_epi128, _mm256_aesdeclast_epi128,
    _mm256_aesenc_epi128, _mm256_aesenclast_epi128, _mm256_bslli_epi128, _mm256_bsrli_epi128,
    _mm256_castsi256_si128, _mm256_clmulepi64_epi128, _mm256_loadu_si256, _mm256_set_epi64x,
    _mm256_set_epi8, _mm256_set_m128i, _mm256_shuffle_epi8, _mm256_slli_epi64, _mm256_srli_epi64,
    _mm256_storeu_si256, _mm256_xor_si256,
};

use super::ni::{ctr_block, load, mul_alpha, store};
use super::{opaque, Rk, Schedule};

#[inline]
#[target_feature(enable = "avx")]
fn ld(b: &[u8; 32]) -> __m256i {
    // SAFETY: `b` is 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx")]
fn st(b: &mut [u8; 32], v: __m256i) {
    // SAFETY: `b` is 32 writable bytes; storeu has no alignment requirement.
    unsafe { _mm256_storeu_si256(b.as_mut_ptr().cast(), v) }
}

/// Rounds 1..R-1 over the eight registers in `$x` (round 0 already
/// added); each round key is broadcast once, used eight times, and dropped.
/// A macro, not a function: an outlined call would pass the blocks through
/// the stack.
macro_rules! middle {
    ($r:expr, $k:expr, $enc:expr, $x:expr) => {{
        let (k, x): (Rk<'_>, &mut [__m256i; 8]) = ($k, &mut $x);
        for r in 1..$r {
            let kr = k.y(r);
            for v in x.iter_mut() {
                *v = if $enc {
                    _mm256_aesenc_epi128(*v, kr)
                } else {
                    _mm256_aesdec_epi128(*v, kr)
                };
            }
        }
    }};
}

#[inline]
#[target_feature(enable = "vaes,avx2")]
fn fin(enc: bool, v: __m256i, kl: __m256i) -> __m256i {
    if enc {
        _mm256_aesenclast_epi128(v, kl)
    } else {
        _mm256_aesdeclast_epi128(v, kl)
    }
}

/// ECB over whole 256-byte groups; returns the rest.
#[target_feature(enable = "vaes,vpclmulqdq,avx2,avx,aes,pclmulqdq,sse2,ssse3")]
pub(super) fn ecb<'d, const R: usize>(s: &Schedule, enc: bool, data: &'d mut [u8]) -> &'d mut [u8] {
    let (chunks, rest) = data.as_chunks_mut::<256>();
    for chunk in chunks {
        let k = s.rk(enc);
        let Some(p) = chunk.as_chunks_mut::<32>().0.first_chunk_mut::<8>() else {
            continue;
        };
        let k0 = k.y(0);
        let mut x = [k0; 8];
        unroll!(8, J => x[J] = _mm256_xor_si256(ld(&p[J]), k0));
        middle!(R, k, enc, x);
        let kl = k.y(R);
        unroll!(8, J => st(&mut p[J], fin(enc, x[J], kl)));
    }
    rest
}

/// CTR over whole 256-byte groups from the big-endian counter `c` (advanced
/// past them); XORs the keystream in or writes it. Returns the rest.
#[target_feature(enable = "vaes,vpclmulqdq,avx2,avx,aes,pclmulqdq,sse2,ssse3")]
pub(super) fn ctr<'d, const R: usize>(
    s: &Schedule,
    c: &mut u128,
    data: &'d mut [u8],
    xor: bool,
) -> &'d mut [u8] {
    // Reverses the bytes of each 128-bit half: counters are kept as
    // little-endian integers and stored big-endian.
    let bswap = _mm256_set_epi8(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
        12, 13, 14, 15,
    );
    let (chunks, rest) = data.as_chunks_mut::<256>();
    for chunk in chunks {
        let k = s.rk(true);
        let Some(p) = chunk.as_chunks_mut::<32>().0.first_chunk_mut::<8>() else {
            continue;
        };
        let k0 = k.y(0);
        let mut x = [k0; 8];
        // Intended truncations: the two 64-bit halves of the counter.
        #[allow(clippy::cast_possible_truncation)]
        let (hi, lo) = ((*c >> 64) as u64, *c as u64);
        if lo <= u64::MAX - 15 {
            // No carry into the high half within these sixteen blocks.
            let (h, l) = (hi.cast_signed(), lo.cast_signed());
            let base = _mm256_set_epi64x(h, l.wrapping_add(1), h, l);
            unroll!(8, J => {
                let d = 2 * J as i64;
                let n = _mm256_add_epi64(base, _mm256_set_epi64x(0, d, 0, d));
                x[J] = _mm256_xor_si256(_mm256_shuffle_epi8(n, bswap), k0);
            });
        } else {
            unroll!(8, J => {
                let a = ctr_block(c.wrapping_add(2 * J as u128));
                let b = ctr_block(c.wrapping_add(2 * J as u128 + 1));
                x[J] = _mm256_xor_si256(_mm256_set_m128i(b, a), k0);
            });
        }
        *c = c.wrapping_add(16);
        middle!(R, k, true, x);
        let kl = k.y(R);
        unroll!(8, J => {
            let ks = fin(true, x[J], kl);
            let v = if xor { _mm256_xor_si256(ks, ld(&p[J])) } else { ks };
            st(&mut p[J], v);
        });
    }
    rest
}

/// Multiplies each 128-bit half by α⁸ (a byte shift; the byte shifted out
/// of bit 127 is folded back in by a carry-less multiply with 0x87).
#[inline]
#[target_feature(enable = "vpclmulqdq,avx2")]
fn mul_alpha8(t: __m256i) -> __m256i {
    let poly = _mm256_set_epi64x(0, 0x87, 0, 0x87);
    let carry = _mm256_clmulepi64_epi128::<0x00>(_mm256_bsrli_epi128::<15>(t), poly);
    _mm256_xor_si256(_mm256_bslli_epi128::<1>(t), carry)
}

/// Multiplies each 128-bit half by α^K (K < 64; `L` = 64 - K): both 64-bit
/// halves shift up K bits, the low half's top bits carry into the high
/// half, the high half's fold back in through a carry-less multiply.
#[inline]
#[target_feature(enable = "vpclmulqdq,avx2")]
fn mul_alpha_k<const K: i32, const L: i32>(t: __m256i) -> __m256i {
    let poly = _mm256_set_epi64x(0, 0x87, 0, 0x87);
    let top = _mm256_srli_epi64::<L>(t);
    let up = _mm256_bslli_epi128::<8>(top);
    let out = _mm256_clmulepi64_epi128::<0x00>(_mm256_bsrli_epi128::<8>(top), poly);
    _mm256_xor_si256(_mm256_xor_si256(_mm256_slli_epi64::<K>(t), up), out)
}

/// Multiplies each 128-bit half by α¹⁶ (as [`mul_alpha8`], two bytes).
#[inline]
#[target_feature(enable = "vpclmulqdq,avx2")]
fn mul_alpha16(t: __m256i) -> __m256i {
    let poly = _mm256_set_epi64x(0, 0x87, 0, 0x87);
    let carry = _mm256_clmulepi64_epi128::<0x00>(_mm256_bsrli_epi128::<14>(t), poly);
    _mm256_xor_si256(_mm256_bslli_epi128::<2>(t), carry)
}

/// XTS over whole 256-byte groups from the tweak in `tw` (advanced past
/// them); returns the rest.
///
/// Register `j` of a group holds blocks 2j and 2j+1. `r[j]` are the tweaks
/// of registers 0..4 and `r[j]·α⁸` those of registers 4..8; the next
/// group's are `r[j]·α¹⁶`. Sixteen blocks in flight is what it takes to keep
/// both AES units busy, and then blocks, tweaks and round keys do not fit
/// the sixteen registers: so every tweak waits for the last round in its
/// blocks' own slot of `data` (read already, overwritten by the ciphertext
/// at the end of the same group), reloaded through a pointer the optimiser
/// cannot see through. Only the blocks and a round key or two are live
/// across the rounds; nothing spills.
#[target_feature(enable = "vaes,vpclmulqdq,avx2,avx,aes,pclmulqdq,sse2,ssse3")]
pub(super) fn xts<'d, const R: usize>(
    s: &Schedule,
    enc: bool,
    tw: &mut [u8; 16],
    data: &'d mut [u8],
) -> &'d mut [u8] {
    let (chunks, rest) = data.as_chunks_mut::<256>();
    if chunks.is_empty() {
        return rest;
    }
    // The first group's tweaks: T and Tα in one register, then that
    // register times α², α⁴, α⁶, in parallel (a serial chain of seven
    // multiplications by α was a tenth of a page's time).
    let t0 = load(tw);
    let r0 = _mm256_set_m128i(mul_alpha(t0), t0);
    let mut r = [
        r0,
        mul_alpha_k::<2, 62>(r0),
        mul_alpha_k::<4, 60>(r0),
        mul_alpha_k::<6, 58>(r0),
    ];
    for chunk in chunks.iter_mut() {
        let k = s.rk(enc);
        let Some(p) = chunk.as_chunks_mut::<32>().0.first_chunk_mut::<8>() else {
            continue;
        };
        let k0 = k.y(0);
        let mut x = [k0; 8];
        unroll!(4, J => {
            let hi = mul_alpha8(r[J]);
            x[J] = _mm256_xor_si256(_mm256_xor_si256(ld(&p[J]), r[J]), k0);
            x[J + 4] = _mm256_xor_si256(_mm256_xor_si256(ld(&p[J + 4]), hi), k0);
            st(&mut p[J], r[J]);
            st(&mut p[J + 4], hi);
        });
        middle!(R, k, enc, x);
        let kl = k.y(R);
        let p = opaque(p);
        unroll!(4, J => {
            let lo = ld(&p[J]);
            let hi = ld(&p[J + 4]);
            st(&mut p[J], fin(enc, x[J], _mm256_xor_si256(kl, lo)));
            st(&mut p[J + 4], fin(enc, x[J + 4], _mm256_xor_si256(kl, hi)));
            r[J] = mul_alpha16(lo);
        });
    }
    store(tw, _mm256_castsi256_si128(r[0]));
    rest
}
