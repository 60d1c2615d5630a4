//! 128-bit AES-NI kernels: key expansion, single blocks, ECB, CBC, CTR and
//! XTS with eight blocks in flight. Also the tails (fewer than sixteen
//! blocks) of the VAES path.

use std::arch::x86_64::{
    __m128i, _mm_aesdec_si128, _mm_aesdeclast_si128, _mm_aesenc_si128, _mm_aesenclast_si128,
    _mm_aesimc_si128, _mm_aeskeygenassist_si128, _mm_and_si128, _mm_loadu_si128, _mm_set_epi32,
    _mm_set_epi64x, _mm_shuffle_epi32, _mm_slli_epi32, _mm_slli_si128, _mm_srai_epi32,
    _mm_storeu_si128, _mm_xor_si128,
};

use super::{opaque, wipe16, Rk, Schedule};

#[inline]
#[target_feature(enable = "sse2")]
pub(super) fn load(b: &[u8; 16]) -> __m128i {
    // SAFETY: `b` is 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "sse2")]
pub(super) fn store(b: &mut [u8; 16], v: __m128i) {
    // SAFETY: `b` is 16 writable bytes; storeu has no alignment requirement.
    unsafe { _mm_storeu_si128(b.as_mut_ptr().cast(), v) }
}

#[inline]
#[target_feature(enable = "sse2")]
fn prefix_xor(mut a: __m128i) -> __m128i {
    a = _mm_xor_si128(a, _mm_slli_si128::<4>(a));
    a = _mm_xor_si128(a, _mm_slli_si128::<4>(a));
    _mm_xor_si128(a, _mm_slli_si128::<4>(a))
}

/// Expands a 16- or 32-byte key straight into `enc` (FIPS-197 order) and
/// `dec` (equivalent inverse cipher); returns the number of rounds (0 for
/// another length). Only the last one or two round keys are ever held in
/// registers; nothing is copied to locals.
#[target_feature(enable = "aes,sse2")]
pub(super) fn expand(key: &[u8], enc: &mut [[u8; 16]; 15], dec: &mut [[u8; 16]; 15]) -> usize {
    let rounds = match (key.first_chunk::<16>(), key.len()) {
        (Some(k0), 16) => {
            let mut k = load(k0);
            store(&mut enc[0], k);
            macro_rules! r128 {
                ($i:expr, $rcon:expr) => {{
                    let t = _mm_shuffle_epi32::<0xff>(_mm_aeskeygenassist_si128::<$rcon>(k));
                    k = _mm_xor_si128(prefix_xor(k), t);
                    store(&mut enc[$i], k);
                }};
            }
            r128!(1, 0x01);
            r128!(2, 0x02);
            r128!(3, 0x04);
            r128!(4, 0x08);
            r128!(5, 0x10);
            r128!(6, 0x20);
            r128!(7, 0x40);
            r128!(8, 0x80);
            r128!(9, 0x1b);
            r128!(10, 0x36);
            10
        }
        (Some(k0), 32) => {
            let Some(k1) = key[16..].first_chunk::<16>() else {
                return 0;
            };
            let (mut a, mut b) = (load(k0), load(k1));
            store(&mut enc[0], a);
            store(&mut enc[1], b);
            // Round key i from i-2 and i-1, then i+1 from i-1 and i
            // (FIPS-197 §5.2, Nk = 8).
            macro_rules! even {
                ($i:expr, $rcon:expr) => {{
                    let t = _mm_shuffle_epi32::<0xff>(_mm_aeskeygenassist_si128::<$rcon>(b));
                    a = _mm_xor_si128(prefix_xor(a), t);
                    store(&mut enc[$i], a);
                }};
            }
            macro_rules! pair {
                ($i:expr, $rcon:expr) => {{
                    even!($i, $rcon);
                    let t = _mm_shuffle_epi32::<0xaa>(_mm_aeskeygenassist_si128::<0>(a));
                    b = _mm_xor_si128(prefix_xor(b), t);
                    store(&mut enc[$i + 1], b);
                }};
            }
            pair!(2, 0x01);
            pair!(4, 0x02);
            pair!(6, 0x04);
            pair!(8, 0x08);
            pair!(10, 0x10);
            pair!(12, 0x20);
            even!(14, 0x40);
            14
        }
        _ => return 0,
    };
    dec[0] = enc[rounds];
    for i in 1..rounds {
        store(&mut dec[i], _mm_aesimc_si128(load(&enc[rounds - i])));
    }
    dec[rounds] = enc[0];
    rounds
}

/// One block through every round (`R` rounds).
#[inline]
#[target_feature(enable = "aes,sse2")]
pub(super) fn one<const R: usize>(k: Rk<'_>, enc: bool, v: __m128i) -> __m128i {
    let mut v = _mm_xor_si128(v, k.x(0));
    for r in 1..R {
        v = if enc {
            _mm_aesenc_si128(v, k.x(r))
        } else {
            _mm_aesdec_si128(v, k.x(r))
        };
    }
    fin(enc, v, k.x(R))
}

/// The last round with round key `kl` (which may carry a tweak XORed in:
/// the last round ends by adding its round key).
#[inline]
#[target_feature(enable = "aes,sse2")]
fn fin(enc: bool, v: __m128i, kl: __m128i) -> __m128i {
    if enc {
        _mm_aesenclast_si128(v, kl)
    } else {
        _mm_aesdeclast_si128(v, kl)
    }
}

/// Rounds 1..R-1 over the eight blocks in `$x` (round 0 already added);
/// each round key is loaded once, used eight times, and dropped. A macro,
/// not a function: an outlined call would pass the blocks through the stack.
macro_rules! middle {
    ($r:expr, $k:expr, $enc:expr, $x:expr) => {{
        let k: Rk<'_> = $k;
        if $enc {
            for r in 1..$r {
                let kr = k.x(r);
                unroll!(8, J => $x[J] = _mm_aesenc_si128($x[J], kr));
            }
        } else {
            for r in 1..$r {
                let kr = k.x(r);
                unroll!(8, J => $x[J] = _mm_aesdec_si128($x[J], kr));
            }
        }
    }};
}

/// Encrypts or decrypts one block in place.
#[target_feature(enable = "aes,sse2")]
pub(super) fn block<const R: usize>(k: Rk<'_>, enc: bool, b: &mut [u8; 16]) {
    let v = one::<R>(k, enc, load(b));
    store(b, v);
}

/// ECB over whole blocks, eight in flight.
#[target_feature(enable = "aes,sse2")]
pub(super) fn ecb<const R: usize>(s: &Schedule, enc: bool, data: &mut [u8]) {
    let (chunks, rest) = data.as_chunks_mut::<128>();
    for chunk in chunks {
        let k = s.rk(enc);
        let Some(b) = chunk.as_chunks_mut::<16>().0.first_chunk_mut::<8>() else {
            continue;
        };
        let k0 = k.x(0);
        let mut x = [k0; 8];
        unroll!(8, J => x[J] = _mm_xor_si128(load(&b[J]), k0));
        middle!(R, k, enc, x);
        let kl = k.x(R);
        unroll!(8, J => store(&mut b[J], fin(enc, x[J], kl)));
    }
    let (blocks, _) = rest.as_chunks_mut::<16>();
    for b in blocks {
        block::<R>(s.rk(enc), enc, b);
    }
}

/// CBC encryption (serial by nature).
#[target_feature(enable = "aes,sse2")]
pub(super) fn cbc_encrypt<const R: usize>(s: &Schedule, iv: &[u8; 16], data: &mut [u8]) {
    let mut v = load(iv);
    let (blocks, _) = data.as_chunks_mut::<16>();
    for b in blocks {
        v = one::<R>(s.rk(true), true, _mm_xor_si128(v, load(b)));
        store(b, v);
    }
}

/// CBC decryption, eight blocks in flight. The previous ciphertext blocks
/// are read again from the buffer after the rounds (through a pointer the
/// optimiser cannot see through) and before any of the group is
/// overwritten: kept in registers from the first read they crowded the
/// rounds, and the last round key XORed with one of them (a key, given the
/// public ciphertext) was spilled to the stack.
#[target_feature(enable = "aes,sse2")]
pub(super) fn cbc_decrypt<const R: usize>(s: &Schedule, iv: &[u8; 16], data: &mut [u8]) {
    let mut prev = load(iv);
    let (chunks, rest) = data.as_chunks_mut::<128>();
    for chunk in chunks {
        let k = s.rk(false);
        let Some(b) = chunk.as_chunks_mut::<16>().0.first_chunk_mut::<8>() else {
            continue;
        };
        let k0 = k.x(0);
        let mut x = [k0; 8];
        unroll!(8, J => x[J] = _mm_xor_si128(load(&b[J]), k0));
        middle!(R, k, false, x);
        let b = opaque(b);
        let kl = k.x(R);
        unroll!(8, J => {
            let c = if J == 0 { prev } else { load(&b[J.saturating_sub(1)]) };
            x[J] = fin(false, x[J], _mm_xor_si128(kl, c));
        });
        prev = load(&b[7]);
        unroll!(8, J => store(&mut b[J], x[J]));
    }
    let (blocks, _) = rest.as_chunks_mut::<16>();
    for b in blocks {
        let c = load(b);
        let v = one::<R>(s.rk(false), false, c);
        store(b, _mm_xor_si128(v, prev));
        prev = c;
    }
}

/// The counter block (big-endian bytes of `c`) built in a register, without
/// a round trip through memory (a 16-byte load of two 8-byte stores stalls
/// store forwarding).
#[inline]
#[target_feature(enable = "sse2")]
pub(super) fn ctr_block(c: u128) -> __m128i {
    // Intended truncations: the two 64-bit halves of the counter.
    #[allow(clippy::cast_possible_truncation)]
    let (hi, lo) = ((c >> 64) as u64, c as u64);
    // Bytes 0..8 of the block are `hi` big-endian: the low lane holds them
    // byte-swapped; likewise `lo` in the high lane.
    _mm_set_epi64x(lo.swap_bytes().cast_signed(), hi.swap_bytes().cast_signed())
}

/// CTR keystream from the big-endian 128-bit counter `c`, XORed into `data`
/// (`xor`) or written over it; `c` is advanced past the blocks used.
#[target_feature(enable = "aes,sse2")]
pub(super) fn ctr<const R: usize>(s: &Schedule, c: &mut u128, data: &mut [u8], xor: bool) {
    let (chunks, rest) = data.as_chunks_mut::<128>();
    for chunk in chunks {
        let k = s.rk(true);
        let Some(b) = chunk.as_chunks_mut::<16>().0.first_chunk_mut::<8>() else {
            continue;
        };
        let k0 = k.x(0);
        let mut x = [k0; 8];
        // Intended truncation: the low 64 bits, advanced without carries
        // while they cannot overflow within these eight blocks.
        #[allow(clippy::cast_possible_truncation)]
        let lo = *c as u64;
        if lo <= u64::MAX - 8 {
            #[allow(clippy::cast_possible_truncation)]
            let hi = ((*c >> 64) as u64).swap_bytes().cast_signed();
            unroll!(8, J => {
                let n = (lo + J as u64).swap_bytes().cast_signed();
                x[J] = _mm_xor_si128(_mm_set_epi64x(n, hi), k0);
            });
        } else {
            unroll!(8, J => x[J] = _mm_xor_si128(ctr_block(c.wrapping_add(J as u128)), k0));
        }
        *c = c.wrapping_add(8);
        middle!(R, k, true, x);
        let kl = k.x(R);
        unroll!(8, J => {
            let ks = fin(true, x[J], kl);
            let v = if xor { _mm_xor_si128(ks, load(&b[J])) } else { ks };
            store(&mut b[J], v);
        });
    }
    ctr_tail::<R>(s, c, rest, xor);
}

/// CTR over fewer than eight blocks, the last one possibly partial (its
/// keystream block passes through a local that is wiped).
#[target_feature(enable = "aes,sse2")]
pub(super) fn ctr_tail<const R: usize>(s: &Schedule, c: &mut u128, data: &mut [u8], xor: bool) {
    let (blocks, partial) = data.as_chunks_mut::<16>();
    for b in blocks {
        let ks = one::<R>(s.rk(true), true, ctr_block(*c));
        *c = c.wrapping_add(1);
        store(b, if xor { _mm_xor_si128(ks, load(b)) } else { ks });
    }
    if !partial.is_empty() {
        let mut ks = [0u8; 16];
        store(&mut ks, one::<R>(s.rk(true), true, ctr_block(*c)));
        *c = c.wrapping_add(1);
        for (d, k) in partial.iter_mut().zip(ks.iter()) {
            *d = if xor { *d ^ k } else { *k };
        }
        wipe16(&mut ks);
    }
}

/// Multiplies the tweak by α (IEEE 1619): shift the 128-bit value left by one
/// and fold the carry out of bit 127 back in as 0x87.
#[inline]
#[target_feature(enable = "sse2")]
pub(super) fn mul_alpha(t: __m128i) -> __m128i {
    let carries = _mm_shuffle_epi32::<0x93>(_mm_srai_epi32::<31>(t));
    let mask = _mm_set_epi32(1, 1, 1, 0x87);
    _mm_xor_si128(_mm_slli_epi32::<1>(t), _mm_and_si128(carries, mask))
}

/// XTS over whole blocks from the tweak in `tw` (advanced past them), eight
/// blocks in flight. Eight blocks, eight tweaks and a round key do not fit
/// sixteen registers, and what does not fit would be spilled to the stack;
/// so each tweak waits in its block's own slot of `data` (read already,
/// overwritten by the ciphertext at the end of the same group), reloaded
/// through a pointer the optimiser cannot see through.
#[target_feature(enable = "aes,sse2")]
pub(super) fn xts<const R: usize>(s: &Schedule, enc: bool, tw: &mut [u8; 16], data: &mut [u8]) {
    let mut t = load(tw);
    let (chunks, rest) = data.as_chunks_mut::<128>();
    for chunk in chunks.iter_mut() {
        let k = s.rk(enc);
        let Some(b) = chunk.as_chunks_mut::<16>().0.first_chunk_mut::<8>() else {
            continue;
        };
        let k0 = k.x(0);
        let mut x = [k0; 8];
        unroll!(8, J => {
            x[J] = _mm_xor_si128(_mm_xor_si128(load(&b[J]), t), k0);
            store(&mut b[J], t);
            t = mul_alpha(t);
        });
        middle!(R, k, enc, x);
        let kl = k.x(R);
        let b = opaque(b);
        unroll!(8, J => {
            let v = fin(enc, x[J], _mm_xor_si128(kl, load(&b[J])));
            store(&mut b[J], v);
        });
    }
    let (blocks, _) = rest.as_chunks_mut::<16>();
    for b in blocks {
        let k = s.rk(enc);
        let mut v = _mm_xor_si128(_mm_xor_si128(load(b), t), k.x(0));
        for r in 1..R {
            v = if enc {
                _mm_aesenc_si128(v, k.x(r))
            } else {
                _mm_aesdec_si128(v, k.x(r))
            };
        }
        store(b, fin(enc, v, _mm_xor_si128(k.x(R), t)));
        t = mul_alpha(t);
    }
    store(tw, t);
}
