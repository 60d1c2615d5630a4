//! Seed-grade output from RDRAND by the method of the Intel DRNG Software
//! Implementation Guide (its section on guaranteeing DRBG reseeding): RDRAND's
//! on-chip DRBG reseeds at least every 511 128-bit outputs, so reducing 512
//! consecutive 128-bit samples to one 128-bit value through a cryptographic
//! extractor yields output that depends on at least one fresh hardware seed.
//!
//! The extractor is AES-128-CBC-MAC (zero IV, no length prefix: the input
//! length is fixed at 8192 bytes) under an *ephemeral* key: 16 fresh bytes from
//! `getrandom(2)` for every seed, so the key is independent of the samples it
//! compresses and never reused. The 8 KiB sample buffer, the key and its
//! schedule are wiped (`zeroize`) after each seed.
//!
//! Current rng-tools no longer does this reduction; memveil does.

use memveil_cipher::Aes;
use zeroize::{Zeroize, Zeroizing};

use crate::source::RawSource;
use crate::DrngError;

/// 128-bit samples reduced to one seed.
pub const SAMPLES_PER_SEED: usize = 512;

/// Bytes in one seed.
pub const SEED_BYTES: usize = 16;

/// 64-bit raw words consumed per seed.
const WORDS_PER_SEED: usize = SAMPLES_PER_SEED * 2;

/// Reduces a (health-tested) raw source 512:1 into 128-bit seeds.
pub struct Conditioner<S: RawSource = Box<dyn RawSource>> {
    input: S,
    words: Box<[u64; WORDS_PER_SEED]>,
    bytes: Box<[u8; WORDS_PER_SEED * 8]>,
    seeds: u64,
}

impl<S: RawSource> Conditioner<S> {
    /// Conditions `input` (wrap it in [`crate::HealthChecked`] first so that
    /// no failing sample reaches the extractor).
    pub fn new(input: S) -> Self {
        Self {
            input,
            words: Box::new([0; WORDS_PER_SEED]),
            bytes: Box::new([0; WORDS_PER_SEED * 8]),
            seeds: 0,
        }
    }

    /// The name reported for this stream, e.g. `seed(rdrand 512:1 AES-CBC-MAC)`.
    pub fn name(&self) -> String {
        format!("seed({} 512:1 AES-CBC-MAC)", self.input.name())
    }

    /// Seeds produced so far.
    #[must_use]
    pub fn seeds(&self) -> u64 {
        self.seeds
    }

    /// The raw input.
    pub fn input(&self) -> &S {
        &self.input
    }

    /// The raw input, mutably (to inspect quarantine state).
    pub fn input_mut(&mut self) -> &mut S {
        &mut self.input
    }

    /// Produces one 128-bit seed from 512 fresh 128-bit samples.
    ///
    /// # Errors
    /// The input's failure (unavailable, exhausted, quarantined) or a failing
    /// `getrandom(2)` for the ephemeral key.
    pub fn seed(&mut self) -> Result<Zeroizing<[u8; SEED_BYTES]>, DrngError> {
        let mut key = Zeroizing::new([0u8; 16]);
        memveil_sys::getrandom(&mut key[..]).map_err(DrngError::Getrandom)?;
        let mac = Aes::new(&key[..])?;
        let r = self.reduce(&mac);
        self.words.zeroize();
        self.bytes.zeroize();
        r
    }

    fn reduce(&mut self, mac: &Aes) -> Result<Zeroizing<[u8; SEED_BYTES]>, DrngError> {
        self.input.fill(&mut self.words[..])?;
        for (c, w) in self.bytes.chunks_exact_mut(8).zip(self.words.iter()) {
            c.copy_from_slice(&w.to_le_bytes());
        }
        mac.cbc_encrypt(&[0u8; 16], &mut self.bytes[..])?;
        let mut out = Zeroizing::new([0u8; SEED_BYTES]);
        out.copy_from_slice(&self.bytes[WORDS_PER_SEED * 8 - SEED_BYTES..]);
        self.seeds += 1;
        Ok(out)
    }

    /// Fills `out` with seeds (the last one truncated).
    ///
    /// # Errors
    /// As [`Conditioner::seed`]; `out` is wiped on error.
    pub fn fill(&mut self, out: &mut [u8]) -> Result<(), DrngError> {
        for chunk in out.chunks_mut(SEED_BYTES) {
            match self.seed() {
                Ok(s) => chunk.copy_from_slice(&s[..chunk.len()]),
                Err(e) => {
                    out.zeroize();
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

/// AES-128-CBC-MAC with zero IV of `data` (a multiple of 16 bytes), computed
/// block by block; the reference the tests hold [`Conditioner`] against.
#[must_use]
pub fn cbc_mac_reference(key: &[u8; 16], data: &[u8]) -> [u8; 16] {
    let Ok(aes) = Aes::new(key) else {
        return [0; 16];
    };
    let mut x = [0u8; 16];
    for blk in data.chunks_exact(16) {
        for (a, b) in x.iter_mut().zip(blk) {
            *a ^= b;
        }
        aes.encrypt_block(&mut x);
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::{HealthChecked, HealthConfig};
    use crate::source::{Fault, FaultControl, FaultySource, TestPattern};

    #[test]
    fn seed_is_cbc_mac_of_512_samples() {
        let key = [7u8; 16];
        let mac = Aes::new(&key).expect("key");
        let mut c = Conditioner::new(TestPattern::new(11));
        let s = c.reduce(&mac).expect("seed");
        // Same 1024 words from a fresh pattern, MACed block by block.
        let mut p = TestPattern::new(11);
        let mut w = vec![0u64; 1024];
        p.fill(&mut w).expect("pattern");
        let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(*s, cbc_mac_reference(&key, &bytes));
        assert_eq!(c.seeds(), 1);
    }

    #[test]
    fn ephemeral_keys_differ_per_seed() {
        // The same input words under two seeds give different outputs,
        // because each seed uses a fresh key.
        let mut a = Conditioner::new(TestPattern::new(1));
        let mut b = Conditioner::new(TestPattern::new(1));
        assert_ne!(*a.seed().expect("a"), *b.seed().expect("b"));
    }

    #[test]
    fn failing_input_yields_no_seed_and_wipes() {
        let ctl = FaultControl::new();
        let src = HealthChecked::new(
            FaultySource::new(TestPattern::new(2), ctl.clone()),
            HealthConfig::default(),
        );
        let mut c = Conditioner::new(src);
        let mut out = [0xaau8; 40];
        c.fill(&mut out).expect("healthy");
        ctl.set(Fault::Stuck(1));
        let mut out = [0xaau8; 40];
        assert!(c.fill(&mut out).is_err());
        assert_eq!(out, [0u8; 40]);
        assert!(c.input().quarantined().is_some());
        assert!(c.words.iter().all(|&w| w == 0));
    }

    #[test]
    fn live_rdrand_seed_or_skip() {
        match crate::source::SourceKind::Rdrand.open() {
            Ok(src) => {
                let mut c = Conditioner::new(HealthChecked::new(src, HealthConfig::default()));
                let s1 = c.seed().expect("seed");
                let s2 = c.seed().expect("seed");
                assert_ne!(*s1, *s2);
                assert!(c.name().starts_with("seed(rdrand"));
            }
            Err(e) => memveil_testkit::skip(memveil_testkit::Need::Cpu("RDRAND"), e),
        }
    }
}
