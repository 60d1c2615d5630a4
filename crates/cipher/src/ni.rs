//! AES-NI XTS kernel: the memory-encryption hot path.
//!
//! RustCrypto's batched API makes XTS three passes over a page (tweak XOR,
//! encrypt, tweak XOR), which on a CPU without VAES left it about 25% behind
//! OpenSSL's fused `aesni_xts_encrypt` (BENCHMARKS.md, "Cipher backend"). This
//! kernel fuses them: eight blocks in flight, tweaks advanced in SSE registers,
//! one load and one store per block.
//!
//! Only built and used when CPUID reports AES-NI; [`NiKeys::new`] returns
//! `None` otherwise, which is the invariant every `unsafe` call here relies on.
#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m128i, _mm_aesdec_si128, _mm_aesdeclast_si128, _mm_aesenc_si128, _mm_aesenclast_si128,
    _mm_aesimc_si128, _mm_aeskeygenassist_si128, _mm_and_si128, _mm_loadu_si128, _mm_set_epi32,
    _mm_set_epi64x, _mm_shuffle_epi32, _mm_slli_epi32, _mm_slli_si128, _mm_srai_epi32,
    _mm_storeu_si128, _mm_xor_si128,
};

use zeroize::Zeroize;

/// Expanded encryption and decryption round keys for AES-128 (10 rounds) or
/// AES-256 (14 rounds). Wiped on drop.
pub(crate) struct NiKeys {
    enc: [[u8; 16]; 15],
    dec: [[u8; 16]; 15],
    rounds: usize,
}

impl Drop for NiKeys {
    fn drop(&mut self) {
        self.enc.zeroize();
        self.dec.zeroize();
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse2")]
fn load(b: &[u8; 16]) -> __m128i {
    // SAFETY: `b` is 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse2")]
fn store(b: &mut [u8; 16], v: __m128i) {
    // SAFETY: `b` is 16 writable bytes; storeu has no alignment requirement.
    unsafe { _mm_storeu_si128(b.as_mut_ptr().cast(), v) }
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse2")]
fn prefix_xor(mut a: __m128i) -> __m128i {
    a = _mm_xor_si128(a, _mm_slli_si128::<4>(a));
    a = _mm_xor_si128(a, _mm_slli_si128::<4>(a));
    _mm_xor_si128(a, _mm_slli_si128::<4>(a))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "aes,sse2")]
fn expand(key: &[u8], enc: &mut [[u8; 16]; 15], dec: &mut [[u8; 16]; 15]) -> usize {
    let mut k = [[0u8; 16]; 15];
    let mut rk = [load(&k[0]); 15];
    let rounds = if key.len() == 16 {
        k[0].copy_from_slice(key);
        rk[0] = load(&k[0]);
        macro_rules! r128 {
            ($i:expr, $rcon:expr) => {{
                let t = _mm_shuffle_epi32::<0xff>(_mm_aeskeygenassist_si128::<$rcon>(rk[$i - 1]));
                rk[$i] = _mm_xor_si128(prefix_xor(rk[$i - 1]), t);
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
    } else {
        k[0].copy_from_slice(&key[..16]);
        k[1].copy_from_slice(&key[16..32]);
        rk[0] = load(&k[0]);
        rk[1] = load(&k[1]);
        macro_rules! r256_even {
            ($i:expr, $rcon:expr) => {{
                let t = _mm_shuffle_epi32::<0xff>(_mm_aeskeygenassist_si128::<$rcon>(rk[$i - 1]));
                rk[$i] = _mm_xor_si128(prefix_xor(rk[$i - 2]), t);
            }};
        }
        macro_rules! r256 {
            ($i:expr, $rcon:expr) => {{
                r256_even!($i, $rcon);
                let t = _mm_shuffle_epi32::<0xaa>(_mm_aeskeygenassist_si128::<0>(rk[$i]));
                rk[$i + 1] = _mm_xor_si128(prefix_xor(rk[$i - 1]), t);
            }};
        }
        r256!(2, 0x01);
        r256!(4, 0x02);
        r256!(6, 0x04);
        r256!(8, 0x08);
        r256!(10, 0x10);
        r256!(12, 0x20);
        r256_even!(14, 0x40);
        14
    };
    for i in 0..=rounds {
        store(&mut enc[i], rk[i]);
    }
    store(&mut dec[0], rk[rounds]);
    for i in 1..rounds {
        store(&mut dec[i], _mm_aesimc_si128(rk[rounds - i]));
    }
    store(&mut dec[rounds], rk[0]);
    k.zeroize();
    rounds
}

/// Multiplies the tweak by α (IEEE 1619): shift the 128-bit value left by one
/// and fold the carry out of bit 127 back in as 0x87.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse2")]
fn mul_alpha(t: __m128i) -> __m128i {
    let carries = _mm_shuffle_epi32::<0x93>(_mm_srai_epi32::<31>(t));
    let mask = _mm_set_epi32(1, 1, 1, 0x87);
    _mm_xor_si128(_mm_slli_epi32::<1>(t), _mm_and_si128(carries, mask))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "aes,sse2")]
fn xts_kernel(keys: &[[u8; 16]; 15], rounds: usize, enc: bool, t: &mut [u8; 16], data: &mut [u8]) {
    let rk = round_keys(keys, rounds);
    let mut tw = load(t);
    let (chunks, rest) = data.as_chunks_mut::<128>();
    for chunk in chunks {
        let (blocks, _) = chunk.as_chunks_mut::<16>();
        let mut ts = [tw; 8];
        let mut x = [tw; 8];
        for j in 0..8 {
            ts[j] = tw;
            tw = mul_alpha(tw);
            x[j] = _mm_xor_si128(_mm_xor_si128(load(&blocks[j]), ts[j]), rk[0]);
        }
        if enc {
            for r in &rk[1..rounds] {
                for v in &mut x {
                    *v = _mm_aesenc_si128(*v, *r);
                }
            }
            for v in &mut x {
                *v = _mm_aesenclast_si128(*v, rk[rounds]);
            }
        } else {
            for r in &rk[1..rounds] {
                for v in &mut x {
                    *v = _mm_aesdec_si128(*v, *r);
                }
            }
            for v in &mut x {
                *v = _mm_aesdeclast_si128(*v, rk[rounds]);
            }
        }
        for j in 0..8 {
            store(&mut blocks[j], _mm_xor_si128(x[j], ts[j]));
        }
    }
    let (blocks, _) = rest.as_chunks_mut::<16>();
    for b in blocks {
        let mut v = _mm_xor_si128(_mm_xor_si128(load(b), tw), rk[0]);
        for r in &rk[1..rounds] {
            v = if enc {
                _mm_aesenc_si128(v, *r)
            } else {
                _mm_aesdec_si128(v, *r)
            };
        }
        v = if enc {
            _mm_aesenclast_si128(v, rk[rounds])
        } else {
            _mm_aesdeclast_si128(v, rk[rounds])
        };
        store(b, _mm_xor_si128(v, tw));
        tw = mul_alpha(tw);
    }
    store(t, tw);
}

/// Loads round keys `0..=rounds` into registers.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse2")]
fn round_keys(keys: &[[u8; 16]; 15], rounds: usize) -> [__m128i; 15] {
    let mut rk = [load(&keys[0]); 15];
    for (r, k) in rk.iter_mut().zip(keys.iter()).take(rounds + 1) {
        *r = load(k);
    }
    rk
}

/// Encrypts (or decrypts) eight blocks held in registers with round keys `rk`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "aes,sse2")]
fn rounds8(rk: &[__m128i; 15], rounds: usize, enc: bool, x: &mut [__m128i; 8]) {
    for v in x.iter_mut() {
        *v = _mm_xor_si128(*v, rk[0]);
    }
    if enc {
        for r in &rk[1..rounds] {
            for v in x.iter_mut() {
                *v = _mm_aesenc_si128(*v, *r);
            }
        }
        for v in x.iter_mut() {
            *v = _mm_aesenclast_si128(*v, rk[rounds]);
        }
    } else {
        for r in &rk[1..rounds] {
            for v in x.iter_mut() {
                *v = _mm_aesdec_si128(*v, *r);
            }
        }
        for v in x.iter_mut() {
            *v = _mm_aesdeclast_si128(*v, rk[rounds]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "aes,sse2")]
fn round1(rk: &[__m128i; 15], rounds: usize, enc: bool, v: __m128i) -> __m128i {
    let mut b = _mm_xor_si128(v, rk[0]);
    for r in &rk[1..rounds] {
        b = if enc {
            _mm_aesenc_si128(b, *r)
        } else {
            _mm_aesdec_si128(b, *r)
        };
    }
    if enc {
        _mm_aesenclast_si128(b, rk[rounds])
    } else {
        _mm_aesdeclast_si128(b, rk[rounds])
    }
}

/// ECB over whole blocks, eight in flight.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "aes,sse2")]
fn ecb_kernel(keys: &[[u8; 16]; 15], rounds: usize, enc: bool, data: &mut [u8]) {
    let rk = round_keys(keys, rounds);
    let (chunks, rest) = data.as_chunks_mut::<128>();
    for chunk in chunks {
        let (blocks, _) = chunk.as_chunks_mut::<16>();
        let mut x = [rk[0]; 8];
        for (v, b) in x.iter_mut().zip(blocks.iter()) {
            *v = load(b);
        }
        rounds8(&rk, rounds, enc, &mut x);
        for (v, b) in x.iter().zip(blocks.iter_mut()) {
            store(b, *v);
        }
    }
    let (blocks, _) = rest.as_chunks_mut::<16>();
    for b in blocks {
        let v = round1(&rk, rounds, enc, load(b));
        store(b, v);
    }
}

/// The counter block (big-endian bytes of `c`) built in a register, without
/// a round trip through memory (a 16-byte load of two 8-byte stores stalls
/// store forwarding).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse2")]
fn ctr_block(c: u128) -> __m128i {
    // Intended truncations: the two 64-bit halves of the counter.
    #[allow(clippy::cast_possible_truncation)]
    let (hi, lo) = ((c >> 64) as u64, c as u64);
    // Bytes 0..8 of the block are `hi` big-endian: the low lane holds them
    // byte-swapped; likewise `lo` in the high lane.
    _mm_set_epi64x(lo.swap_bytes().cast_signed(), hi.swap_bytes().cast_signed())
}

/// CTR keystream from the big-endian 128-bit counter `ctr`, XORed into
/// `data` (`xor`) or written over it; `ctr` is advanced past the blocks used.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "aes,sse2")]
fn ctr_kernel(keys: &[[u8; 16]; 15], rounds: usize, ctr: &mut u128, data: &mut [u8], xor: bool) {
    let rk = round_keys(keys, rounds);
    let mut c = *ctr;
    let (chunks, rest) = data.as_chunks_mut::<128>();
    for chunk in chunks {
        let (blocks, _) = chunk.as_chunks_mut::<16>();
        let mut x = [rk[0]; 8];
        // Intended truncation: the low 64 bits, advanced without carries
        // while they cannot overflow within these eight blocks.
        #[allow(clippy::cast_possible_truncation)]
        let lo = c as u64;
        if lo <= u64::MAX - 8 {
            #[allow(clippy::cast_possible_truncation)]
            let hi = ((c >> 64) as u64).swap_bytes().cast_signed();
            for (j, v) in (0u64..).zip(x.iter_mut()) {
                *v = _mm_set_epi64x((lo + j).swap_bytes().cast_signed(), hi);
            }
            c = c.wrapping_add(8);
        } else {
            for v in &mut x {
                *v = ctr_block(c);
                c = c.wrapping_add(1);
            }
        }
        rounds8(&rk, rounds, true, &mut x);
        if xor {
            for (v, b) in x.iter().zip(blocks.iter_mut()) {
                store(b, _mm_xor_si128(*v, load(b)));
            }
        } else {
            for (v, b) in x.iter().zip(blocks.iter_mut()) {
                store(b, *v);
            }
        }
    }
    for piece in rest.chunks_mut(16) {
        let mut ks = [0u8; 16];
        store(&mut ks, round1(&rk, rounds, true, ctr_block(c)));
        c = c.wrapping_add(1);
        for (d, k) in piece.iter_mut().zip(ks.iter()) {
            *d = if xor { *d ^ k } else { *k };
        }
        ks.zeroize();
    }
    *ctr = c;
}

impl NiKeys {
    /// ECB over whole blocks of `data` (a multiple of 16 bytes).
    pub(crate) fn ecb(&self, data: &mut [u8], enc: bool) {
        let keys = if enc { &self.enc } else { &self.dec };
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a NiKeys exists only when `new` saw AES-NI on this CPU.
        unsafe {
            ecb_kernel(keys, self.rounds, enc, data);
        }
    }

    /// CTR over `data` of any length from counter `ctr` (big-endian); XORs
    /// the keystream in, or writes it over `data` when `xor` is false.
    pub(crate) fn ctr(&self, ctr: u128, data: &mut [u8], xor: bool) {
        let mut c = ctr;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a NiKeys exists only when `new` saw AES-NI on this CPU.
        unsafe {
            ctr_kernel(&self.enc, self.rounds, &mut c, data, xor);
        }
    }

    /// Expands `key` (16 or 32 bytes) when the CPU has AES-NI; `None` otherwise.
    pub(crate) fn new(key: &[u8]) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            if !(key.len() == 16 || key.len() == 32) || !std::is_x86_feature_detected!("aes") {
                return None;
            }
            let mut k = NiKeys {
                enc: [[0; 16]; 15],
                dec: [[0; 16]; 15],
                rounds: 0,
            };
            // SAFETY: AES-NI (and SSE2, baseline on x86_64) checked just above.
            k.rounds = unsafe { expand(key, &mut k.enc, &mut k.dec) };
            Some(k)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = key;
            None
        }
    }

    /// XTS over whole blocks of `data` (a multiple of 16 bytes) starting with
    /// the encrypted tweak `t`; returns the tweak for the block after.
    pub(crate) fn xts(&self, t: u128, data: &mut [u8], enc: bool) -> u128 {
        let mut tb = t.to_le_bytes();
        let keys = if enc { &self.enc } else { &self.dec };
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a NiKeys exists only when `new` saw AES-NI on this CPU.
        unsafe {
            xts_kernel(keys, self.rounds, enc, &mut tb, data);
        }
        u128::from_le_bytes(tb)
    }
}
