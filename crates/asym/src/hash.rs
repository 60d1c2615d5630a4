//! SHA-1 and SHA-2 digests (aws-lc), and PKCS#1's DigestInfo prefixes.

use std::ptr::NonNull;

/// Hash functions, with the codes the vault's ring entries carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Hash {
    /// SHA-1 (code 1).
    Sha1,
    /// SHA-224 (code 2).
    Sha224,
    /// SHA-256 (code 3).
    Sha256,
    /// SHA-384 (code 4).
    Sha384,
    /// SHA-512 (code 5).
    Sha512,
}

impl Hash {
    /// Every hash.
    pub const ALL: [Hash; 5] = [
        Hash::Sha1,
        Hash::Sha224,
        Hash::Sha256,
        Hash::Sha384,
        Hash::Sha512,
    ];

    /// Wire value.
    #[must_use]
    pub fn code(self) -> u8 {
        match self {
            Hash::Sha1 => 1,
            Hash::Sha224 => 2,
            Hash::Sha256 => 3,
            Hash::Sha384 => 4,
            Hash::Sha512 => 5,
        }
    }

    /// From a wire value.
    #[must_use]
    pub fn from_code(c: u8) -> Option<Hash> {
        Hash::ALL.into_iter().find(|h| h.code() == c)
    }

    /// Digest bytes.
    #[must_use]
    pub fn len(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha224 => 28,
            Hash::Sha256 => 32,
            Hash::Sha384 => 48,
            Hash::Sha512 => 64,
        }
    }

    /// Never true; digests have a length (for clippy's `len` convention).
    #[must_use]
    pub fn is_empty(self) -> bool {
        false
    }

    /// The DER prefix of a PKCS#1 v1.5 `DigestInfo` (RFC 8017, 9.2 note 1):
    /// the prefix followed by the digest is what `CKM_RSA_PKCS` signs.
    #[must_use]
    pub fn digest_info_prefix(self) -> &'static [u8] {
        match self {
            Hash::Sha1 => &[
                0x30, 0x21, 0x30, 0x09, 0x06, 0x05, 0x2b, 0x0e, 0x03, 0x02, 0x1a, 0x05, 0x00, 0x04,
                0x14,
            ],
            Hash::Sha224 => &[
                0x30, 0x2d, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02,
                0x04, 0x05, 0x00, 0x04, 0x1c,
            ],
            Hash::Sha256 => &[
                0x30, 0x31, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02,
                0x01, 0x05, 0x00, 0x04, 0x20,
            ],
            Hash::Sha384 => &[
                0x30, 0x41, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02,
                0x02, 0x05, 0x00, 0x04, 0x30,
            ],
            Hash::Sha512 => &[
                0x30, 0x51, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02,
                0x03, 0x05, 0x00, 0x04, 0x40,
            ],
        }
    }

    pub(crate) fn md(self) -> *const aws_lc_sys::EVP_MD {
        // SAFETY: these accessors return pointers to static method tables.
        unsafe {
            match self {
                Hash::Sha1 => aws_lc_sys::EVP_sha1(),
                Hash::Sha224 => aws_lc_sys::EVP_sha224(),
                Hash::Sha256 => aws_lc_sys::EVP_sha256(),
                Hash::Sha384 => aws_lc_sys::EVP_sha384(),
                Hash::Sha512 => aws_lc_sys::EVP_sha512(),
            }
        }
    }
}

/// The digest of `data` (one call, no allocation inside aws-lc).
#[must_use]
pub fn digest(h: Hash, data: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; h.len()];
    let (p, n, o) = (data.as_ptr(), data.len(), out.as_mut_ptr());
    // SAFETY: `data` is readable for `n` bytes and `out` holds the digest.
    unsafe {
        match h {
            Hash::Sha1 => aws_lc_sys::SHA1(p, n, o),
            Hash::Sha224 => aws_lc_sys::SHA224(p, n, o),
            Hash::Sha256 => aws_lc_sys::SHA256(p, n, o),
            Hash::Sha384 => aws_lc_sys::SHA384(p, n, o),
            Hash::Sha512 => aws_lc_sys::SHA512(p, n, o),
        };
    }
    out
}

/// HMAC of `data` under `key` with `h` into `out` (at least `h.len()`
/// bytes); returns the MAC's length, 0 when `out` is short. aws-lc keeps
/// the keyed state on the calling thread's stack (the vault's are in
/// secret memory).
#[must_use]
pub fn hmac(h: Hash, key: &[u8], data: &[u8], out: &mut [u8]) -> usize {
    let n = h.len();
    let Some(o) = out.get_mut(..n) else {
        return 0;
    };
    let mut len: std::ffi::c_uint = 0;
    // SAFETY: key and data readable for their lengths; `o` holds the
    // digest's length; the method table is static.
    let p = unsafe {
        aws_lc_sys::HMAC(
            h.md(),
            key.as_ptr().cast(),
            key.len(),
            data.as_ptr(),
            data.len(),
            o.as_mut_ptr(),
            &mut len,
        )
    };
    if p.is_null() {
        0
    } else {
        n
    }
}

/// Whether `mac` is the HMAC of `data` under `key`: full length only,
/// compared in constant time (`CRYPTO_memcmp`).
#[must_use]
pub fn hmac_verify(h: Hash, key: &[u8], data: &[u8], mac: &[u8]) -> bool {
    let mut want = zeroize::Zeroizing::new([0u8; 64]);
    let n = hmac(h, key, data, &mut want[..]);
    if n == 0 || mac.len() != n {
        return false;
    }
    // SAFETY: both readable for `n` bytes.
    unsafe { aws_lc_sys::CRYPTO_memcmp(want.as_ptr().cast(), mac.as_ptr().cast(), n) == 0 }
}

/// A digest over several parts.
pub struct Hasher {
    hash: Hash,
    ctx: NonNull<aws_lc_sys::EVP_MD_CTX>,
}

// SAFETY: the context is owned by this value alone and aws-lc's digest
// contexts carry no thread affinity.
unsafe impl Send for Hasher {}

impl Hasher {
    /// A fresh digest; `None` when aws-lc cannot allocate its context.
    #[must_use]
    pub fn new(hash: Hash) -> Option<Hasher> {
        // SAFETY: EVP_MD_CTX_new has no preconditions; a non-NULL result is
        // initialised with a static method table.
        let ctx = unsafe {
            let c = aws_lc_sys::EVP_MD_CTX_new();
            if !c.is_null() {
                aws_lc_sys::EVP_DigestInit_ex(c, hash.md(), std::ptr::null_mut());
            }
            c
        };
        NonNull::new(ctx).map(|ctx| Hasher { hash, ctx })
    }

    /// The hash.
    #[must_use]
    pub fn hash(&self) -> Hash {
        self.hash
    }

    /// Adds bytes.
    pub fn update(&mut self, data: &[u8]) {
        // SAFETY: the context is live and initialised; `data` is readable.
        unsafe {
            aws_lc_sys::EVP_DigestUpdate(self.ctx.as_ptr(), data.as_ptr().cast(), data.len());
        }
    }

    /// Writes the digest into `out` (its first `hash.len()` bytes; `out`
    /// must hold them), for digests that are key material and must land in
    /// secret memory. Returns the digest's length, or 0 when `out` is short.
    pub fn finish_into(self, out: &mut [u8]) -> usize {
        let n = self.hash.len();
        let Some(o) = out.get_mut(..n) else {
            return 0;
        };
        let mut len = 0u32;
        // SAFETY: `o` holds the digest's length; the context is live.
        unsafe {
            aws_lc_sys::EVP_DigestFinal_ex(self.ctx.as_ptr(), o.as_mut_ptr(), &mut len);
        }
        n
    }

    /// The digest.
    #[must_use]
    pub fn finish(self) -> Vec<u8> {
        let mut out = vec![0u8; self.hash.len()];
        let mut n = 0u32;
        // SAFETY: `out` holds the digest's length; the context is live.
        unsafe {
            aws_lc_sys::EVP_DigestFinal_ex(self.ctx.as_ptr(), out.as_mut_ptr(), &mut n);
        }
        out
    }
}

impl Drop for Hasher {
    fn drop(&mut self) {
        // SAFETY: the context is ours and freed once.
        unsafe { aws_lc_sys::EVP_MD_CTX_free(self.ctx.as_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_match_openssl_and_prefixes_parse() {
        for h in Hash::ALL {
            let want = match h {
                Hash::Sha1 => openssl::hash::MessageDigest::sha1(),
                Hash::Sha224 => openssl::hash::MessageDigest::sha224(),
                Hash::Sha256 => openssl::hash::MessageDigest::sha256(),
                Hash::Sha384 => openssl::hash::MessageDigest::sha384(),
                Hash::Sha512 => openssl::hash::MessageDigest::sha512(),
            };
            let data = b"memveil asym";
            let w = openssl::hash::hash(want, data).expect("openssl");
            assert_eq!(digest(h, data), w.to_vec(), "{h:?}");
            let mut s = Hasher::new(h).expect("context");
            s.update(b"memveil");
            s.update(b" asym");
            assert_eq!(s.finish(), w.to_vec());
            let p = h.digest_info_prefix();
            assert_eq!(usize::from(p[1]) + 2, p.len() + h.len(), "{h:?}");
            assert_eq!(usize::from(p[p.len() - 1]), h.len());
            assert_eq!(Hash::from_code(h.code()), Some(h));
        }
        assert_eq!(Hash::from_code(0), None);
    }

    #[test]
    fn hmac_matches_rfc4231_case_1_and_refuses_a_changed_mac() {
        let key = [0x0b; 20];
        let want = "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7";
        let mut out = [0u8; 64];
        assert_eq!(hmac(Hash::Sha256, &key, b"Hi There", &mut out), 32);
        assert_eq!(hex::encode(&out[..32]), want);
        assert!(hmac_verify(Hash::Sha256, &key, b"Hi There", &out[..32]));
        out[31] ^= 1;
        assert!(!hmac_verify(Hash::Sha256, &key, b"Hi There", &out[..32]));
        assert!(!hmac_verify(Hash::Sha256, &key, b"Hi There", &out[..31]));
        assert_eq!(hmac(Hash::Sha512, &key, b"x", &mut [0u8; 63]), 0);
    }
}
