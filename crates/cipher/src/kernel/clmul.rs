//! GHASH with carry-less multiplication, computed as POLYVAL (RFC 8452,
//! appendix A): GHASH_H(X) = rev(POLYVAL_{mulX(rev H)}(rev X₁, …)), where
//! `rev` reverses the bytes of a block. POLYVAL's field elements are
//! little-endian, so a byte-reversed GCM block is a plain 128-bit register,
//! and its product needs no bit reflection: a 256-bit carry-less product
//! and a Montgomery reduction by x¹²⁸ (two multiplications by
//! 0xc200000000000000).
//!
//! Eight blocks are folded per reduction: S' = (S+X₁)·H⁸ + X₂·H⁷ + … + X₈·H,
//! the products summed unreduced. The powers live in the key object and are
//! read through a [`View`] like round keys.

use std::arch::x86_64::{
    __m128i, _mm256_castsi256_si128, _mm256_clmulepi64_epi128, _mm256_extracti128_si256,
    _mm256_loadu_si256, _mm256_set_epi8, _mm256_set_m128i, _mm256_setzero_si256,
    _mm256_shuffle_epi8, _mm256_xor_si256, _mm_clmulepi64_si128, _mm_set_epi64x, _mm_set_epi8,
    _mm_setzero_si128, _mm_shuffle_epi32, _mm_shuffle_epi8, _mm_slli_si128, _mm_srli_si128,
    _mm_xor_si128,
};

use zeroize::Zeroize;

use super::ni::{load, store};
use super::{wipe16, Aligned, View};

/// Reverses the bytes of a 128-bit register.
#[inline]
#[target_feature(enable = "ssse3")]
fn rev(v: __m128i) -> __m128i {
    _mm_shuffle_epi8(
        v,
        _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
    )
}

/// Montgomery reduction of the 256-bit product `hi:lo` to 128 bits
/// (multiplication by x⁻¹²⁸ modulo x¹²⁸ + x¹²⁷ + x¹²⁶ + x¹²¹ + 1): twice,
/// the low 64 bits times the polynomial's upper part are added in and the
/// value shifts down by 64 bits.
#[inline]
#[target_feature(enable = "pclmulqdq,sse2")]
fn reduce(lo: __m128i, hi: __m128i) -> __m128i {
    let poly = _mm_set_epi64x((0xc2u64 << 56).cast_signed(), 0);
    let t = _mm_clmulepi64_si128::<0x10>(lo, poly);
    let lo = _mm_xor_si128(_mm_shuffle_epi32::<0x4e>(lo), t);
    let t = _mm_clmulepi64_si128::<0x10>(lo, poly);
    _mm_xor_si128(_mm_xor_si128(hi, _mm_shuffle_epi32::<0x4e>(lo)), t)
}

/// The unreduced product of `a` and `b` as (low, middle, high) parts.
#[inline]
#[target_feature(enable = "pclmulqdq,sse2")]
fn mul(a: __m128i, b: __m128i) -> [__m128i; 3] {
    [
        _mm_clmulepi64_si128::<0x00>(a, b),
        _mm_xor_si128(
            _mm_clmulepi64_si128::<0x01>(a, b),
            _mm_clmulepi64_si128::<0x10>(a, b),
        ),
        _mm_clmulepi64_si128::<0x11>(a, b),
    ]
}

#[inline]
#[target_feature(enable = "sse2")]
fn add3(acc: &mut [__m128i; 3], p: [__m128i; 3]) {
    for (a, b) in acc.iter_mut().zip(p) {
        *a = _mm_xor_si128(*a, b);
    }
}

/// Reduces (low, middle, high) to one field element.
#[inline]
#[target_feature(enable = "pclmulqdq,sse2")]
fn fold(p: [__m128i; 3]) -> __m128i {
    reduce(
        _mm_xor_si128(p[0], _mm_slli_si128::<8>(p[1])),
        _mm_xor_si128(p[2], _mm_srli_si128::<8>(p[1])),
    )
}

/// POLYVAL's product a·b·x⁻¹²⁸.
#[inline]
#[target_feature(enable = "pclmulqdq,sse2")]
fn dot(a: __m128i, b: __m128i) -> __m128i {
    fold(mul(a, b))
}

/// Fills `out` with H'⁸, H'⁷, …, H' where H' = mulX(rev(`h`)) is the POLYVAL
/// key of the GHASH key `h`.
#[target_feature(enable = "pclmulqdq,sse2,ssse3")]
pub(super) fn powers(h: &[u8; 16], out: &mut [[u8; 16]; 8]) {
    // rev(H) as a little-endian integer is H read big-endian; mulX shifts
    // it up one bit and folds bit 128 back as x¹²⁷ + x¹²⁶ + x¹²¹ + 1.
    let mut v = u128::from_be_bytes(*h);
    let carry = v >> 127;
    v = (v << 1) ^ (carry * ((0xc2u128 << 120) | 1));
    let mut b = v.to_le_bytes();
    v.zeroize();
    let h1 = load(&b);
    wipe16(&mut b);
    store(&mut out[7], h1);
    let mut p = h1;
    for i in (0..7).rev() {
        p = dot(p, h1);
        store(&mut out[i], p);
    }
}

/// Folds whole blocks into the GHASH state `s` (GCM byte order), eight per
/// reduction.
#[target_feature(enable = "pclmulqdq,sse2,ssse3")]
pub(super) fn update(h: &Aligned<8>, s: &mut [u8; 16], blocks: &[[u8; 16]]) {
    let mut acc = rev(load(s));
    let (groups, rest) = blocks.as_chunks::<8>();
    for g in groups {
        let hp = View::new(h);
        let mut p = mul(_mm_xor_si128(rev(load(&g[0])), acc), hp.x(0));
        for (j, b) in g.iter().enumerate().skip(1) {
            add3(&mut p, mul(rev(load(b)), hp.x(j)));
        }
        acc = fold(p);
    }
    for b in rest {
        acc = dot(_mm_xor_si128(rev(load(b)), acc), View::new(h).x(7));
    }
    store(s, rev(acc));
}

/// [`update`] with VPCLMULQDQ, two blocks per instruction; returns the
/// blocks left over (fewer than eight).
#[target_feature(enable = "vaes,vpclmulqdq,avx2,avx,aes,pclmulqdq,sse2,ssse3")]
pub(super) fn update_wide<'d>(
    h: &Aligned<8>,
    s: &mut [u8; 16],
    blocks: &'d [[u8; 16]],
) -> &'d [[u8; 16]] {
    let bswap = _mm256_set_epi8(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
        12, 13, 14, 15,
    );
    let mut acc = rev(load(s));
    let (groups, rest) = blocks.as_chunks::<8>();
    for g in groups {
        let hp = View::new(h);
        let (pairs, _) = g.as_flattened().as_chunks::<32>();
        let mut p = [_mm256_setzero_si256(); 3];
        for (j, pair) in pairs.iter().enumerate() {
            // SAFETY: `pair` is 32 readable bytes; loadu has no alignment
            // requirement.
            let raw = unsafe { _mm256_loadu_si256(pair.as_ptr().cast()) };
            let mut x = _mm256_shuffle_epi8(raw, bswap);
            if j == 0 {
                x = _mm256_xor_si256(x, _mm256_set_m128i(_mm_setzero_si128(), acc));
            }
            let k = hp.pair(2 * j);
            p[0] = _mm256_xor_si256(p[0], _mm256_clmulepi64_epi128::<0x00>(x, k));
            p[1] = _mm256_xor_si256(
                p[1],
                _mm256_xor_si256(
                    _mm256_clmulepi64_epi128::<0x01>(x, k),
                    _mm256_clmulepi64_epi128::<0x10>(x, k),
                ),
            );
            p[2] = _mm256_xor_si256(p[2], _mm256_clmulepi64_epi128::<0x11>(x, k));
        }
        let halves =
            p.map(|v| _mm_xor_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v)));
        acc = fold(halves);
    }
    store(s, rev(acc));
    rest
}
