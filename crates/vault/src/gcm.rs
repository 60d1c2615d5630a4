//! AES-GCM for the vault, built from `memveil-cipher`'s [`Aes`] (CTR) and
//! RustCrypto's `ghash`. The key object — AES schedule and the hash key H —
//! is plain inline data, placed in secret memory by the vault.
//!
//! Why the vault has its own GCM beside `memveil_cipher::Gcm` (which is
//! inline too since 94241f1; it once boxed its state): three reasons, checked
//! when that box went away.
//! - Speed: CTR runs on `memveil-cipher`'s fused AES-NI kernel, about 10%
//!   faster than `aes-gcm` on this machine (4 MiB seal 1.86 vs 1.55 GB/s,
//!   open 13% less time; 16 KiB 11%, 1 KiB 3–7%), and it follows any faster
//!   kernel `memveil-cipher` gains.
//! - One fetch: [`VaultGcm::open_fetched`] hashes and decrypts each chunk of
//!   a message as it is copied out of client-shared memory, which a one-shot
//!   AEAD API cannot do.
//! - One schedule per key: the vault's ECB/CBC/CTR use [`VaultGcm::aes`], so
//!   a key version holds one AES schedule, not two.
//!
//! The vault uses no other GCM (the keystore seals with this one too).
//! Checked against every NIST GCM vector through the vault
//! (`tests/nist_through_vault.rs`) and against `memveil_cipher::Gcm` in the
//! unit tests below.
#![forbid(unsafe_code)]

use ghash::universal_hash::UniversalHash as _;
use ghash::GHash;
use memveil_cipher::{Aes, CipherError};

/// Largest GCM plaintext: 2^32 − 2 blocks (so the 128-bit counter used by
/// `Aes::ctr_apply` never carries out of the low 32 bits, i.e. equals inc32).
const MAX_LEN: u64 = ((1u64 << 32) - 2) * 16;

/// An AES-GCM key: the AES schedule and H = E_K(0¹²⁸), inline.
pub struct VaultGcm {
    aes: Aes,
    h: [u8; 16],
}

impl Drop for VaultGcm {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.h);
    }
}

impl VaultGcm {
    /// Expands a 16- or 32-byte key.
    ///
    /// # Errors
    /// [`CipherError::BadKeyLength`].
    pub fn new(key: &[u8]) -> Result<Self, CipherError> {
        let aes = Aes::new(key)?;
        let mut h = [0u8; 16];
        aes.encrypt_block(&mut h);
        Ok(Self { aes, h })
    }

    /// The AES key under the GCM (for the vault's ECB, CBC and CTR).
    #[must_use]
    pub fn aes(&self) -> &Aes {
        &self.aes
    }

    fn tag(&self, nonce: &[u8; 12], aad: &[u8], ct: &[u8]) -> [u8; 16] {
        let mut g = GHash::new(&self.h.into());
        g.update_padded(aad);
        g.update_padded(ct);
        self.finish(g, nonce, aad.len(), ct.len())
    }

    /// Hashes the lengths block into `g` and masks the result with E_K(J0).
    fn finish(&self, mut g: GHash, nonce: &[u8; 12], aad_len: usize, ct_len: usize) -> [u8; 16] {
        let mut lens = [0u8; 16];
        lens[..8].copy_from_slice(&(aad_len as u64 * 8).to_be_bytes());
        lens[8..].copy_from_slice(&(ct_len as u64 * 8).to_be_bytes());
        g.update(&[lens.into()]);
        let s: [u8; 16] = g.finalize().into();
        let mut j0 = [0u8; 16];
        j0[..12].copy_from_slice(nonce);
        j0[15] = 1;
        self.aes.encrypt_block(&mut j0);
        let mut t = [0u8; 16];
        for i in 0..16 {
            t[i] = s[i] ^ j0[i];
        }
        t
    }

    fn ctr(&self, nonce: &[u8; 12], data: &mut [u8]) {
        self.ctr_at(nonce, 0, data);
    }

    /// CTR over `data`, which starts `block` 16-byte blocks into the message.
    fn ctr_at(&self, nonce: &[u8; 12], block: u128, data: &mut [u8]) {
        let mut c = [0u8; 16];
        c[..12].copy_from_slice(nonce);
        c[15] = 2;
        // Below MAX_LEN the low 32 bits never carry, so this is GCM's inc32.
        let c = (u128::from_be_bytes(c) + block).to_be_bytes();
        self.aes.ctr_apply(&c, data);
    }

    /// Encrypts in place; returns the 16-byte tag.
    ///
    /// # Errors
    /// [`CipherError::BadLength`] beyond GCM's limit.
    pub fn seal(
        &self,
        nonce: &[u8; 12],
        aad: &[u8],
        data: &mut [u8],
    ) -> Result<[u8; 16], CipherError> {
        if data.len() as u64 > MAX_LEN {
            return Err(CipherError::BadLength {
                mode: "GCM",
                got: data.len(),
                expected: "at most 2^32-2 blocks",
            });
        }
        self.ctr(nonce, data);
        Ok(self.tag(nonce, aad, data))
    }

    /// Verifies `tag` (constant-time compare) and only then decrypts in place.
    ///
    /// # Errors
    /// [`CipherError::TagMismatch`]; the data is left as it was.
    pub fn open(
        &self,
        nonce: &[u8; 12],
        aad: &[u8],
        data: &mut [u8],
        tag: &[u8],
    ) -> Result<(), CipherError> {
        if tag.len() != 16 || data.len() as u64 > MAX_LEN {
            return Err(CipherError::TagMismatch);
        }
        let want = self.tag(nonce, aad, data);
        let diff = want.iter().zip(tag).fold(0u8, |a, (x, y)| a | (x ^ y));
        if std::hint::black_box(diff) != 0 {
            return Err(CipherError::TagMismatch);
        }
        self.ctr(nonce, data);
        Ok(())
    }
}

/// Bytes [`VaultGcm::open_fetched`] fetches, hashes and decrypts at a time
/// (the chunk stays in the L1 cache between the three steps).
const FETCH_CHUNK: usize = 16 * 1024;

impl VaultGcm {
    /// Opens a message of `out.len()` bytes that `fetch(offset, chunk)`
    /// copies, chunk by chunk, into `out` (from memory the caller does not
    /// trust to hold still). Each byte is fetched once; the tag is checked
    /// over exactly the bytes fetched, and they are what is decrypted. On a
    /// mismatch, or when `fetch` fails, `out` is wiped and nothing decrypted
    /// is left in it; the caller must not release `out` unless this returns
    /// `Ok`.
    ///
    /// # Errors
    /// [`CipherError::TagMismatch`], also for a failed fetch.
    pub fn open_fetched(
        &self,
        nonce: &[u8; 12],
        aad: &[u8],
        tag: &[u8],
        out: &mut [u8],
        mut fetch: impl FnMut(usize, &mut [u8]) -> bool,
    ) -> Result<(), CipherError> {
        if tag.len() != 16 || out.len() as u64 > MAX_LEN {
            return Err(CipherError::TagMismatch);
        }
        let mut g = GHash::new(&self.h.into());
        g.update_padded(aad);
        let mut fetched = true;
        for (i, chunk) in out.chunks_mut(FETCH_CHUNK).enumerate() {
            if !fetch(i * FETCH_CHUNK, chunk) {
                fetched = false;
                break;
            }
            // Whole chunks are whole blocks; only the last one is padded.
            g.update_padded(chunk);
            self.ctr_at(nonce, (i * (FETCH_CHUNK / 16)) as u128, chunk);
        }
        let want = self.finish(g, nonce, aad.len(), out.len());
        let diff = want.iter().zip(tag).fold(0u8, |a, (x, y)| a | (x ^ y));
        if !fetched || std::hint::black_box(diff) != 0 {
            zeroize::Zeroize::zeroize(out);
            return Err(CipherError::TagMismatch);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memveil_cipher::Gcm;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn matches_memveil_cipher_gcm(key in proptest::collection::vec(any::<u8>(), 32), k128: bool,
                                      nonce: [u8; 12], aad in proptest::collection::vec(any::<u8>(), 0..70),
                                      data in proptest::collection::vec(any::<u8>(), 0..300)) {
            let key = if k128 { &key[..16] } else { &key[..] };
            let ours = VaultGcm::new(key).expect("key");
            let theirs = Gcm::new(key).expect("key");
            let (mut a, mut b) = (data.clone(), data.clone());
            let ta = ours.seal(&nonce, &aad, &mut a).expect("seal");
            let tb = theirs.seal(&nonce, &aad, &mut b);
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(ta, tb);
            let mut bad = ta;
            bad[0] ^= 1;
            prop_assert!(ours.open(&nonce, &aad, &mut a.clone(), &bad).is_err());
            // The fetched open agrees, and refuses a bad tag with nothing left.
            let mut out = vec![0u8; a.len()];
            ours.open_fetched(&nonce, &aad, &ta, &mut out, |at, c| {
                c.copy_from_slice(&a[at..at + c.len()]);
                true
            }).expect("open_fetched");
            prop_assert_eq!(&out, &data);
            let mut out = vec![0u8; a.len()];
            let r = ours.open_fetched(&nonce, &aad, &bad, &mut out, |at, c| {
                c.copy_from_slice(&a[at..at + c.len()]);
                true
            });
            prop_assert!(r.is_err());
            prop_assert!(out.iter().all(|&b| b == 0));
            ours.open(&nonce, &aad, &mut a, &ta).expect("open");
            prop_assert_eq!(a, data);
        }
    }

    /// Messages spanning several fetch chunks (the chunk seams are where a
    /// counter or hash state carried wrong would show).
    #[test]
    fn open_fetched_across_chunks() {
        let g = VaultGcm::new(&[3; 16]).expect("key");
        let theirs = Gcm::new(&[3; 16]).expect("key");
        for len in [
            0,
            1,
            FETCH_CHUNK - 1,
            FETCH_CHUNK,
            FETCH_CHUNK + 17,
            3 * FETCH_CHUNK + 5,
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3).to_le_bytes()[0]).collect();
            let mut ct = data.clone();
            let tag = theirs.seal(&[9; 12], b"a", &mut ct);
            let mut out = vec![0u8; len];
            let mut calls = 0;
            g.open_fetched(&[9; 12], b"a", &tag, &mut out, |at, c| {
                calls += 1;
                c.copy_from_slice(&ct[at..at + c.len()]);
                true
            })
            .expect("open");
            assert_eq!(out, data, "len {len}");
            assert_eq!(calls, len.div_ceil(FETCH_CHUNK), "len {len}");
            // A failed fetch is a failed open, with nothing left behind.
            let mut out = vec![0u8; len];
            if len > 0 {
                let r = g.open_fetched(&[9; 12], b"a", &tag, &mut out, |at, c| {
                    c.copy_from_slice(&ct[at..at + c.len()]);
                    at + c.len() < len
                });
                assert!(r.is_err());
                assert!(out.iter().all(|&b| b == 0));
            }
        }
    }
}
