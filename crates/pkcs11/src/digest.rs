//! Digests (`C_Digest*`), SHA-1 and SHA-2, in the module's own process:
//! the data is the caller's, so no vault round trip. `C_DigestKey` is the
//! exception: a generic secret key's bytes never leave the vault, so from
//! that call on the digest is finished there, in one request over the data
//! before the key, the key, and the data after it (the module keeps the
//! data, up to [`MAX_MESSAGE`] bytes).
#![forbid(unsafe_code)]

use cryptoki_sys::*;
use memveil_asym::hash::Hasher;
use memveil_asym::Hash;
use memveil_vault::proto::Mode;
use memveil_vault::ring::{AsymParams, Op};
use zeroize::Zeroizing;

use crate::asym::{hash_of_mech, AsymBackend, MAX_MESSAGE};
use crate::mech::{Failure, Rv};

/// A digest in progress.
pub struct DigestOp {
    hash: Hash,
    hasher: Hasher,
    /// The data so far, while it fits [`MAX_MESSAGE`] (what a later
    /// `C_DigestKey` sends the vault as the data before the key).
    seen: Option<Zeroizing<Vec<u8>>>,
    /// After `C_DigestKey`: the key and the data that came after it.
    keyed: Option<(u32, Zeroizing<Vec<u8>>)>,
    /// An update was made (`C_Digest` then is out of order).
    pub updated: bool,
}

impl DigestOp {
    /// Starts a digest of `mech` (`CKM_SHA_1`, `CKM_SHA224`, `CKM_SHA256`,
    /// `CKM_SHA384`, `CKM_SHA512`).
    ///
    /// # Errors
    /// `CKR_MECHANISM_INVALID` (MD5 among others), `CKR_HOST_MEMORY`.
    pub fn new(mech: CK_MECHANISM_TYPE) -> Result<Self, Rv> {
        let hash = match mech {
            CKM_SHA_1 | CKM_SHA224 | CKM_SHA256 | CKM_SHA384 | CKM_SHA512 => {
                hash_of_mech(mech).ok_or(CKR_MECHANISM_INVALID)?
            }
            _ => return Err(CKR_MECHANISM_INVALID),
        };
        Ok(Self {
            hash,
            hasher: Hasher::new(hash).ok_or(CKR_HOST_MEMORY)?,
            seen: Some(Zeroizing::new(Vec::new())),
            keyed: None,
            updated: false,
        })
    }

    /// The digest's length.
    #[must_use]
    pub fn len(&self) -> usize {
        self.hash.len()
    }

    /// Never true (for clippy's `len` convention).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Adds data.
    ///
    /// # Errors
    /// `CKR_DATA_LEN_RANGE` past [`MAX_MESSAGE`] after `C_DigestKey`.
    pub fn update(&mut self, part: &[u8]) -> Result<(), Rv> {
        self.updated = true;
        if let Some((_, after)) = self.keyed.as_mut() {
            if after.len() + part.len() > MAX_MESSAGE {
                return Err(CKR_DATA_LEN_RANGE);
            }
            after.extend_from_slice(part);
            return Ok(());
        }
        self.hasher.update(part);
        if self
            .seen
            .as_ref()
            .is_some_and(|s| s.len() + part.len() > MAX_MESSAGE)
        {
            self.seen = None;
        } else if let Some(s) = self.seen.as_mut() {
            s.extend_from_slice(part);
        }
        Ok(())
    }

    /// Adds the bytes of vault key `key` (a generic secret).
    ///
    /// # Errors
    /// `CKR_KEY_INDIGESTIBLE` for a second key, `CKR_DATA_LEN_RANGE` when
    /// more than [`MAX_MESSAGE`] bytes came before.
    pub fn add_key(&mut self, key: u32) -> Result<(), Rv> {
        self.updated = true;
        if self.keyed.is_some() {
            return Err(CKR_KEY_INDIGESTIBLE);
        }
        if self.seen.is_none() {
            return Err(CKR_DATA_LEN_RANGE);
        }
        self.keyed = Some((key, Zeroizing::new(Vec::new())));
        Ok(())
    }

    /// The digest.
    ///
    /// # Errors
    /// The vault's refusal of a digest with a key.
    pub fn finish(self, be: &dyn AsymBackend) -> Result<Vec<u8>, Rv> {
        let Some((key, after)) = self.keyed else {
            return Ok(self.hasher.finish());
        };
        let before = self.seen.unwrap_or_default();
        let mut input = Zeroizing::new(before.to_vec());
        input.extend_from_slice(&after);
        let p = AsymParams {
            hash: self.hash.code(),
            mgf1: 0,
            len: u32::try_from(before.len()).map_err(|_| CKR_DATA_LEN_RANGE)?,
        };
        be.run_asym(Op::Encrypt, key, Mode::KeyDigest, p, &input)
            .map(|d| d.to_vec())
            .map_err(|f| match f {
                Failure::Rv(rv) => rv,
                Failure::Status(memveil_vault::ring::status::WRONG_MODE) => CKR_KEY_INDIGESTIBLE,
                Failure::Status(memveil_vault::ring::status::DENIED) => {
                    CKR_KEY_FUNCTION_NOT_PERMITTED
                }
                Failure::Status(_) => CKR_DEVICE_ERROR,
            })
    }
}
