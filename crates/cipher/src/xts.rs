//! XTS-AES (IEEE 1619-2007, SP 800-38E): the kernels' fused XTS on the
//! AES-NI and VAES paths, RustCrypto's batched block API on the portable one.

use crate::block::{Aes, Block, BATCH};
use crate::kernel::{prefetch, wipe16};
use crate::path::{path, Path};
use crate::CipherError;

/// An XTS-AES-128 or XTS-AES-256 key: a data key and a tweak key of the same
/// size, which must differ. Plain inline data, so it can live in secret
/// memory; wiped on drop.
pub struct Xts {
    data: Aes,
    tweak: Aes,
}

/// Multiplies a tweak by α in GF(2^128) (IEEE 1619 little-endian convention).
#[inline]
fn mul_alpha(t: u128) -> u128 {
    let carry = t >> 127;
    (t << 1) ^ (carry * 0x87)
}

impl Xts {
    /// Builds an XTS key from its two halves (16 or 32 bytes each).
    ///
    /// # Errors
    /// [`CipherError::BadKeyLength`] for halves of another or unequal length;
    /// [`CipherError::EqualXtsHalves`] when the halves are equal.
    pub fn new(data_key: &[u8], tweak_key: &[u8]) -> Result<Self, CipherError> {
        Self::build(data_key, tweak_key, path())
    }

    /// [`Xts::new`] on the path named (for tests and benchmarks that run
    /// every path in turn).
    ///
    /// # Errors
    /// As [`Xts::new`]; [`CipherError::PathUnavailable`] when this CPU cannot
    /// run `p`.
    pub fn with_path(data_key: &[u8], tweak_key: &[u8], p: Path) -> Result<Self, CipherError> {
        Self::build(data_key, tweak_key, p.require()?)
    }

    fn build(data_key: &[u8], tweak_key: &[u8], p: Path) -> Result<Self, CipherError> {
        if data_key.len() != tweak_key.len() || !(data_key.len() == 16 || data_key.len() == 32) {
            return Err(CipherError::BadKeyLength {
                algorithm: "XTS",
                got: data_key.len() + tweak_key.len(),
                expected: "two halves of 16 (XTS-AES-128) or 32 (XTS-AES-256) bytes",
            });
        }
        if constant_time_eq(data_key, tweak_key) {
            return Err(CipherError::EqualXtsHalves);
        }
        Ok(Self {
            data: Aes::with_path(data_key, p)?,
            tweak: Aes::with_path(tweak_key, p)?,
        })
    }

    /// The path this key runs on.
    #[must_use]
    pub fn path(&self) -> Path {
        self.data.path()
    }

    /// Builds an XTS key from the combined key (32 or 64 bytes: data key then
    /// tweak key), as NIST and OpenSSL write it.
    ///
    /// # Errors
    /// As [`Xts::new`].
    pub fn from_combined(key: &[u8]) -> Result<Self, CipherError> {
        if !(key.len() == 32 || key.len() == 64) {
            return Err(CipherError::BadKeyLength {
                algorithm: "XTS",
                got: key.len(),
                expected: "32 (XTS-AES-128) or 64 (XTS-AES-256) bytes",
            });
        }
        let (a, b) = key.split_at(key.len() / 2);
        Self::new(a, b)
    }

    /// 128 or 256 (the size of each half).
    #[must_use]
    pub fn key_bits(&self) -> usize {
        self.data.key_bits()
    }

    /// Encrypts one data unit in place under the 16-byte tweak `i`.
    ///
    /// # Errors
    /// [`CipherError::BadLength`] for units shorter than 16 bytes.
    pub fn encrypt(&self, i: &[u8; 16], data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(i, data, true)
    }

    /// Decrypts one data unit in place under the 16-byte tweak `i`.
    ///
    /// # Errors
    /// [`CipherError::BadLength`] for units shorter than 16 bytes.
    pub fn decrypt(&self, i: &[u8; 16], data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(i, data, false)
    }

    /// Encrypts a data unit whose tweak is the sequence number `unit`
    /// (little-endian, as IEEE 1619 and the engine's physical addresses use).
    ///
    /// # Errors
    /// As [`Xts::encrypt`].
    pub fn encrypt_unit(&self, unit: u128, data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(&unit.to_le_bytes(), data, true)
    }

    /// Decrypts a data unit whose tweak is the sequence number `unit`.
    ///
    /// # Errors
    /// As [`Xts::encrypt`].
    pub fn decrypt_unit(&self, unit: u128, data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(&unit.to_le_bytes(), data, false)
    }

    /// Encrypts consecutive data units of `unit` bytes in place: the first
    /// under sequence number `first`, each next one `step` higher (an
    /// engine's pages: the tweak is the physical address, the step a page).
    /// While one unit is encrypted the next is fetched into the caches, which
    /// the processor does not do across pages by itself.
    ///
    /// # Errors
    /// [`CipherError::BadLength`] for units shorter than 16 bytes or data
    /// that is not a whole number of units.
    pub fn encrypt_units(
        &self,
        first: u128,
        step: u128,
        unit: usize,
        data: &mut [u8],
    ) -> Result<(), CipherError> {
        self.units(first, step, unit, data, true)
    }

    /// The inverse of [`Xts::encrypt_units`].
    ///
    /// # Errors
    /// As [`Xts::encrypt_units`].
    pub fn decrypt_units(
        &self,
        first: u128,
        step: u128,
        unit: usize,
        data: &mut [u8],
    ) -> Result<(), CipherError> {
        self.units(first, step, unit, data, false)
    }

    fn units(
        &self,
        first: u128,
        step: u128,
        unit: usize,
        data: &mut [u8],
        enc: bool,
    ) -> Result<(), CipherError> {
        if unit < 16 || !data.len().is_multiple_of(unit) {
            return Err(CipherError::BadLength {
                mode: "XTS units",
                got: data.len(),
                expected: "whole units of at least 16 bytes",
            });
        }
        let mut rest = data;
        let mut seq = first;
        while !rest.is_empty() {
            let (cur, tail) = std::mem::take(&mut rest).split_at_mut(unit);
            if let Some(next) = tail.get(..unit) {
                prefetch(next);
            }
            self.crypt(&seq.to_le_bytes(), cur, enc)?;
            seq = seq.wrapping_add(step);
            rest = tail;
        }
        Ok(())
    }

    fn crypt(&self, i: &[u8; 16], data: &mut [u8], enc: bool) -> Result<(), CipherError> {
        let n = data.len();
        if n < 16 {
            return Err(CipherError::BadLength {
                mode: "XTS",
                got: n,
                expected: "at least 16 bytes per data unit",
            });
        }
        let mut t0 = *i;
        self.tweak.block(&mut t0, true);
        let rem = n % 16;
        // With ciphertext stealing the last full block is handled apart.
        let bulk_blocks = if rem == 0 { n / 16 } else { n / 16 - 1 };
        let (bulk, tail) = data.split_at_mut(bulk_blocks * 16);
        let t = match self.data.kernel() {
            Some(k) => {
                k.xts(&mut t0, bulk, enc);
                u128::from_le_bytes(t0)
            }
            None => self.bulk(u128::from_le_bytes(t0), bulk, enc),
        };
        wipe16(&mut t0);
        if rem != 0 {
            self.steal(t, tail, enc);
        }
        self.data.after();
        Ok(())
    }

    /// Portable path: whole blocks over RustCrypto's batch API; returns the
    /// tweak for the next block.
    fn bulk(&self, mut t: u128, data: &mut [u8], enc: bool) -> u128 {
        let (blocks, _) = Block::slice_as_chunks_mut(data);
        let mut tw = [0u128; BATCH];
        for chunk in blocks.chunks_mut(BATCH) {
            for (b, slot) in chunk.iter_mut().zip(tw.iter_mut()) {
                *slot = t;
                b.0 = (u128::from_le_bytes(b.0) ^ t).to_le_bytes();
                t = mul_alpha(t);
            }
            if enc {
                self.data.encrypt_blocks(chunk);
            } else {
                self.data.decrypt_blocks(chunk);
            }
            for (b, tv) in chunk.iter_mut().zip(tw.iter()) {
                b.0 = (u128::from_le_bytes(b.0) ^ tv).to_le_bytes();
            }
        }
        zeroize::Zeroize::zeroize(&mut tw);
        t
    }

    fn one(&self, t: u128, b: &mut [u8; 16], enc: bool) {
        *b = (u128::from_le_bytes(*b) ^ t).to_le_bytes();
        self.data.block(b, enc);
        *b = (u128::from_le_bytes(*b) ^ t).to_le_bytes();
    }

    /// Ciphertext stealing over the last full block and the partial block
    /// (`tail` is 17..=31 bytes), IEEE 1619 §5.3.2 / §5.4.2.
    fn steal(&self, t: u128, tail: &mut [u8], enc: bool) {
        let r = tail.len() - 16;
        let (t_first, t_second) = if enc {
            (t, mul_alpha(t))
        } else {
            (mul_alpha(t), t)
        };
        let mut last = [0u8; 16];
        last.copy_from_slice(&tail[..16]);
        self.one(t_first, &mut last, enc);
        let mut pp = [0u8; 16];
        pp[..r].copy_from_slice(&tail[16..]);
        pp[r..].copy_from_slice(&last[r..]);
        let partial_out = last;
        self.one(t_second, &mut pp, enc);
        tail[..16].copy_from_slice(&pp);
        tail[16..].copy_from_slice(&partial_out[..r]);
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_halves_are_refused() {
        let k = [7u8; 16];
        assert_eq!(Xts::new(&k, &k).err(), Some(CipherError::EqualXtsHalves));
        assert_eq!(
            Xts::from_combined(&[9u8; 64]).err(),
            Some(CipherError::EqualXtsHalves)
        );
    }

    #[test]
    fn wrong_key_lengths_are_refused() {
        assert!(matches!(
            Xts::new(&[1; 16], &[2; 32]),
            Err(CipherError::BadKeyLength { .. })
        ));
        assert!(matches!(
            Xts::from_combined(&[1; 48]),
            Err(CipherError::BadKeyLength { .. })
        ));
    }

    #[test]
    fn short_unit_is_refused() {
        let x = Xts::new(&[1; 16], &[2; 16]).expect("key");
        let mut d = [0u8; 15];
        assert!(matches!(
            x.encrypt_unit(0, &mut d),
            Err(CipherError::BadLength { .. })
        ));
    }

    #[test]
    fn units_are_pages_each_under_its_own_tweak() {
        let x = Xts::new(&[1; 16], &[2; 16]).expect("key");
        let src: Vec<u8> = (0..3 * 4096)
            .map(|i| u8::try_from(i % 249).unwrap_or(0))
            .collect();
        let mut a = src.clone();
        x.encrypt_units(0x7000, 4096, 4096, &mut a).expect("units");
        let mut b = src.clone();
        for (i, page) in b.chunks_mut(4096).enumerate() {
            x.encrypt_unit(0x7000 + 4096 * i as u128, page)
                .expect("unit");
        }
        assert_eq!(a, b);
        x.decrypt_units(0x7000, 4096, 4096, &mut a).expect("units");
        assert_eq!(a, src);
        assert!(matches!(
            x.encrypt_units(0, 1, 4096, &mut a[..5000]),
            Err(CipherError::BadLength { .. })
        ));
        assert!(matches!(
            x.encrypt_units(0, 1, 8, &mut a[..16]),
            Err(CipherError::BadLength { .. })
        ));
    }

    /// IEEE 1619-2007 annex B, on every path this CPU runs: vectors 1 and 2
    /// style 32-byte units, and vectors 4 (XTS-AES-128) and 10
    /// (XTS-AES-256) with 512-byte units, which the wide kernel processes
    /// whole (first and last 32 bytes of ciphertext checked; the last ones
    /// cross-checked with OpenSSL through python-cryptography).
    #[test]
    fn ieee1619_vectors() {
        for path in crate::path::runnable() {
            let p = [0x44u8; 32];
            let x = Xts::with_path(&[0x11; 16], &[0x22; 16], path).expect("key");
            let mut d = p;
            x.encrypt_unit(0x33_3333_3333, &mut d).expect("enc");
            assert_eq!(
                hex::encode(d),
                "c454185e6a16936e39334038acef838bfb186fff7480adc4289382ecd6d394f0",
                "{path}"
            );
            x.decrypt_unit(0x33_3333_3333, &mut d).expect("dec");
            assert_eq!(d, p);
            let k1: Vec<u8> = (0..16u8).map(|i| 0xff - i).collect();
            let x = Xts::with_path(&k1, &[0x22; 16], path).expect("key");
            let mut d = p;
            x.encrypt_unit(0x33_3333_3333, &mut d).expect("enc");
            assert_eq!(
                hex::encode(d),
                "af85336b597afc1a900b2eb21ec949d292df4c047e0b21532186a5971a227a89",
                "{path}"
            );
            let unit: Vec<u8> = (0..512)
                .map(|i| u8::try_from(i % 256).unwrap_or(0))
                .collect();
            let cases = [
                (
                    "2718281828459045235360287471352631415926535897932384626433832795",
                    0u128,
                    "27a7479befa1d476489f308cd4cfa6e2a96e4bbe3208ff25287dd3819616e89c",
                    "eb4a427d1923ce3ff262735779a418f20a282df920147beabe421ee5319d0568",
                ),
                (
                    "27182818284590452353602874713526624977572470936999595749669676273141592653589793238462643383279502884197169399375105820974944592",
                    0xff,
                    "1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b",
                    "773dad38014bd2092fa755c824bb5e54c4f36ffda9fcea70b9c6e693e148c151",
                ),
            ];
            for (key, seq, head, tail) in cases {
                let key = hex::decode(key).expect("hex");
                let (a, b) = key.split_at(key.len() / 2);
                let x = Xts::with_path(a, b, path).expect("key");
                let mut d = unit.clone();
                x.encrypt_unit(seq, &mut d).expect("enc");
                assert_eq!(hex::encode(&d[..32]), head, "{path} {}", a.len() * 8);
                assert_eq!(hex::encode(&d[480..]), tail, "{path} {}", a.len() * 8);
                x.decrypt_unit(seq, &mut d).expect("dec");
                assert_eq!(d, unit);
            }
        }
    }
}

#[cfg(test)]
mod backend_tests {
    use super::*;

    /// Every path this CPU runs gives the portable path's ciphertext, at
    /// lengths around the kernels' group sizes (8 and 16 blocks), with and
    /// without ciphertext stealing.
    #[test]
    fn every_path_agrees_with_portable() {
        for p in crate::path::runnable() {
            for klen in [16usize, 32] {
                let k1: Vec<u8> = (0..klen).map(|i| u8::try_from(i).unwrap_or(0)).collect();
                let k2: Vec<u8> = k1.iter().map(|b| b ^ 0x5c).collect();
                let fast = Xts::with_path(&k1, &k2, p).expect("key");
                assert_eq!(fast.path(), p);
                let portable = Xts::with_path(&k1, &k2, Path::Portable).expect("key");
                for len in [
                    16usize, 17, 31, 128, 143, 255, 256, 257, 272, 383, 512, 527, 4096, 4111,
                ] {
                    let src: Vec<u8> = (0..len)
                        .map(|i| u8::try_from(i % 251).unwrap_or(0))
                        .collect();
                    for unit in [0x1234_5000u128, u128::MAX - 3] {
                        let (mut a, mut b) = (src.clone(), src.clone());
                        fast.encrypt_unit(unit, &mut a).expect("enc");
                        portable.encrypt_unit(unit, &mut b).expect("enc");
                        assert_eq!(a, b, "{p} len {len} key {klen}");
                        fast.decrypt_unit(unit, &mut a).expect("dec");
                        portable.decrypt_unit(unit, &mut b).expect("dec");
                        assert_eq!(a, src);
                        assert_eq!(b, src);
                    }
                }
            }
        }
    }
}
