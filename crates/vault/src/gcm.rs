//! AES-GCM for the vault, built from `memveil-cipher`'s [`Aes`] (CTR) and
//! RustCrypto's `ghash`. The key object — AES schedule and the hash key H —
//! is plain inline data, placed in secret memory by the vault.
//!
//! Why the vault has its own GCM beside `memveil_cipher::Gcm` (which is
//! inline too since 94241f1; it once boxed its state): two reasons, checked
//! when that box went away.
//! - Speed: CTR runs on `memveil-cipher`'s fused AES-NI kernel, about 10%
//!   faster than `aes-gcm` on this machine (4 MiB seal 1.86 vs 1.55 GB/s,
//!   open 13% less time; 16 KiB 11%, 1 KiB 3–7%), and it follows any faster
//!   kernel `memveil-cipher` gains.
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
        let mut lens = [0u8; 16];
        lens[..8].copy_from_slice(&(aad.len() as u64 * 8).to_be_bytes());
        lens[8..].copy_from_slice(&(ct.len() as u64 * 8).to_be_bytes());
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
        let mut c = [0u8; 16];
        c[..12].copy_from_slice(nonce);
        c[15] = 2;
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
            // A bad tag decrypts nothing: the data is left as it was.
            let mut kept = a.clone();
            prop_assert!(ours.open(&nonce, &aad, &mut kept, &bad).is_err());
            prop_assert_eq!(&kept, &a);
            ours.open(&nonce, &aad, &mut a, &ta).expect("open");
            prop_assert_eq!(a, data);
        }
    }
}
