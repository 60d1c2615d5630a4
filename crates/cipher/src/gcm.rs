//! AES-GCM with 96-bit nonces and 128-bit tags: the kernels' CTR and GHASH
//! (PCLMULQDQ or VPCLMULQDQ) on the AES-NI and VAES paths, RustCrypto's
//! `aes-gcm` on the portable one.

use aes_gcm::aead::{AeadInOut, KeyInit};
use aes_gcm::{Aes128Gcm, Aes256Gcm, Nonce, Tag};

use crate::kernel::{wipe16, GhashKey, Schedule};
use crate::path::{path, Path};
use crate::CipherError;

/// Longest GCM plaintext: 2^32 − 2 blocks (SP 800-38D), so the counter,
/// which starts at 2, never carries out of its low 32 bits and a 128-bit
/// increment equals GCM's inc32.
const MAX_LEN: u64 = ((1u64 << 32) - 2) * 16;

// Inline, never boxed: a `Gcm` placed in secret memory must carry its key
// schedule and hash key with it (a Box would leave them on the ordinary heap).
#[allow(clippy::large_enum_variant)]
enum Inner {
    G128(Aes128Gcm),
    G256(Aes256Gcm),
    Kernel { aes: Schedule, h: GhashKey },
}

/// An AES-GCM key (128 or 256 bits). Wiped on drop; never printed or cloned.
/// Plain data (no heap allocation), so it can live in secret memory.
pub struct Gcm {
    inner: Inner,
}

impl Gcm {
    /// Expands a 16- or 32-byte key.
    ///
    /// # Errors
    /// [`CipherError::BadKeyLength`] for other lengths.
    pub fn new(key: &[u8]) -> Result<Self, CipherError> {
        Self::build(key, path())
    }

    /// [`Gcm::new`] on the path named (for tests and benchmarks that run
    /// every path in turn).
    ///
    /// # Errors
    /// As [`Gcm::new`]; [`CipherError::PathUnavailable`] when this CPU cannot
    /// run `p`.
    pub fn with_path(key: &[u8], p: Path) -> Result<Self, CipherError> {
        Self::build(key, p.require()?)
    }

    fn build(key: &[u8], p: Path) -> Result<Self, CipherError> {
        let bad = || CipherError::BadKeyLength {
            algorithm: "AES-GCM",
            got: key.len(),
            expected: "16 (AES-128-GCM) or 32 (AES-256-GCM) bytes",
        };
        if !(key.len() == 16 || key.len() == 32) {
            return Err(bad());
        }
        if let Some(aes) = Schedule::new(key, p) {
            let h = GhashKey::new(&aes);
            return Ok(Self {
                inner: Inner::Kernel { aes, h },
            });
        }
        let inner = match key.len() {
            16 => Inner::G128(Aes128Gcm::new_from_slice(key).map_err(|_| bad())?),
            32 => Inner::G256(Aes256Gcm::new_from_slice(key).map_err(|_| bad())?),
            _ => return Err(bad()),
        };
        Ok(Self { inner })
    }

    /// 128 or 256.
    #[must_use]
    pub fn key_bits(&self) -> usize {
        match &self.inner {
            Inner::G128(_) => 128,
            Inner::G256(_) => 256,
            Inner::Kernel { aes, .. } => aes.key_bits(),
        }
    }

    /// The path this key runs on.
    #[must_use]
    pub fn path(&self) -> Path {
        match &self.inner {
            Inner::G128(_) | Inner::G256(_) => Path::Portable,
            Inner::Kernel { aes, .. } => aes.path(),
        }
    }

    /// Encrypts `data` in place and returns the 16-byte tag over `aad` and
    /// the ciphertext.
    #[must_use]
    pub fn seal(&self, nonce: &[u8; 12], aad: &[u8], data: &mut [u8]) -> [u8; 16] {
        let n = Nonce::from(*nonce);
        let r = match &self.inner {
            Inner::G128(c) => c.encrypt_inout_detached(&n, aad, data.into()),
            Inner::G256(c) => c.encrypt_inout_detached(&n, aad, data.into()),
            Inner::Kernel { aes, h } => {
                if data.len() as u64 > MAX_LEN {
                    return [0; 16];
                }
                aes.ctr(counter(nonce, 2), data, true);
                return tag(aes, h, nonce, aad, data);
            }
        };
        crate::scrub_stack();
        // aes-gcm only fails for messages over 2^36 - 32 bytes, which no
        // slice on a 64-bit host we accept reaches in practice; map it to a
        // zero tag that can never verify rather than panic.
        r.map(|t| t.0).unwrap_or([0; 16])
    }

    /// Verifies `tag` and decrypts `data` in place. On failure `data` is left
    /// as ciphertext.
    ///
    /// # Errors
    /// [`CipherError::TagMismatch`] when the tag does not verify;
    /// [`CipherError::BadLength`] for a tag that is not 16 bytes.
    pub fn open(
        &self,
        nonce: &[u8; 12],
        aad: &[u8],
        data: &mut [u8],
        tag: &[u8],
    ) -> Result<(), CipherError> {
        let tag: [u8; 16] = tag.try_into().map_err(|_| CipherError::BadLength {
            mode: "GCM tag",
            got: tag.len(),
            expected: "16 bytes",
        })?;
        let n = Nonce::from(*nonce);
        let t = Tag::from(tag);
        let r = match &self.inner {
            Inner::G128(c) => c.decrypt_inout_detached(&n, aad, data.into(), &t),
            Inner::G256(c) => c.decrypt_inout_detached(&n, aad, data.into(), &t),
            Inner::Kernel { aes, h } => {
                if data.len() as u64 > MAX_LEN {
                    return Err(CipherError::TagMismatch);
                }
                let want = self::tag(aes, h, nonce, aad, data);
                let diff = want.iter().zip(&tag).fold(0u8, |a, (x, y)| a | (x ^ y));
                if std::hint::black_box(diff) != 0 {
                    return Err(CipherError::TagMismatch);
                }
                aes.ctr(counter(nonce, 2), data, true);
                return Ok(());
            }
        };
        crate::scrub_stack();
        r.map_err(|_| CipherError::TagMismatch)
    }
}

/// The counter block `nonce || n` as a big-endian integer.
fn counter(nonce: &[u8; 12], n: u32) -> u128 {
    let mut c = [0u8; 16];
    c[..12].copy_from_slice(nonce);
    c[12..].copy_from_slice(&n.to_be_bytes());
    u128::from_be_bytes(c)
}

/// The tag over `aad` and the ciphertext `ct`: GHASH, then E(J0) added.
fn tag(aes: &Schedule, h: &GhashKey, nonce: &[u8; 12], aad: &[u8], ct: &[u8]) -> [u8; 16] {
    let mut s = [0u8; 16];
    h.update(&mut s, aad);
    h.update(&mut s, ct);
    let mut lens = [0u8; 16];
    lens[..8].copy_from_slice(&(aad.len() as u64).wrapping_mul(8).to_be_bytes());
    lens[8..].copy_from_slice(&(ct.len() as u64).wrapping_mul(8).to_be_bytes());
    h.update(&mut s, &lens);
    let mut j0 = counter(nonce, 1).to_be_bytes();
    aes.block(&mut j0, true);
    let mut t = [0u8; 16];
    for ((o, a), b) in t.iter_mut().zip(&s).zip(&j0) {
        *o = a ^ b;
    }
    wipe16(&mut s);
    wipe16(&mut j0);
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: `Gcm` once boxed its state, so a `Gcm` inside secret
    /// memory left the AES schedule on the ordinary heap (found by the vault's
    /// memory scan). Inline state makes the value at least a full AES-256
    /// schedule big; a boxed one would be pointer-sized.
    #[test]
    fn gcm_keeps_its_schedule_inline() {
        assert!(
            std::mem::size_of::<Gcm>() >= 15 * 16,
            "{}",
            std::mem::size_of::<Gcm>()
        );
        for p in Path::ALL.into_iter().filter(|p| p.supported()) {
            let g = Gcm::with_path(&[7; 32], p).expect("key");
            let mut d = *b"inline";
            let t = g.seal(&[0; 12], b"", &mut d);
            g.open(&[0; 12], b"", &mut d, &t).expect("open");
            assert_eq!(&d, b"inline");
        }
    }

    /// Every path this CPU runs agrees with the portable one (RustCrypto's
    /// aes-gcm) at lengths around the GHASH groups (8 blocks) and the VAES
    /// groups (16 blocks), with AAD of every shape.
    #[test]
    fn every_path_agrees_with_portable() {
        for p in crate::path::runnable() {
            for klen in [16usize, 32] {
                let key: Vec<u8> = (0..klen)
                    .map(|i| u8::try_from(i * 3).unwrap_or(0))
                    .collect();
                let fast = Gcm::with_path(&key, p).expect("key");
                let slow = Gcm::with_path(&key, Path::Portable).expect("key");
                for len in [
                    0usize, 1, 16, 17, 127, 128, 129, 255, 256, 257, 400, 4096, 4100,
                ] {
                    for alen in [0usize, 5, 16, 130, 300] {
                        let aad: Vec<u8> = (0..alen)
                            .map(|i| u8::try_from(i % 7).unwrap_or(0))
                            .collect();
                        let src: Vec<u8> = (0..len)
                            .map(|i| u8::try_from(i % 249).unwrap_or(0))
                            .collect();
                        let nonce = [0xa5u8; 12];
                        let (mut a, mut b) = (src.clone(), src.clone());
                        let ta = fast.seal(&nonce, &aad, &mut a);
                        let tb = slow.seal(&nonce, &aad, &mut b);
                        assert_eq!(a, b, "{p} len {len} aad {alen}");
                        assert_eq!(ta, tb, "{p} tag len {len} aad {alen}");
                        let mut bad = ta;
                        bad[15] ^= 0x80;
                        assert_eq!(
                            fast.open(&nonce, &aad, &mut a, &bad),
                            Err(CipherError::TagMismatch)
                        );
                        assert_eq!(a, b, "failed open leaves the ciphertext");
                        fast.open(&nonce, &aad, &mut a, &ta).expect("open");
                        assert_eq!(a, src);
                    }
                }
            }
        }
    }
}
