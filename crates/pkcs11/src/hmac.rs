//! HMAC (`CKM_SHA_1_HMAC`, `CKM_SHA224_HMAC`, `CKM_SHA256_HMAC`,
//! `CKM_SHA384_HMAC`, `CKM_SHA512_HMAC`) with a generic secret key in the
//! vault: the module keeps the message until the final part, and one vault
//! request computes the MAC, or checks one in constant time; the key and
//! its hash state never enter this process.
#![forbid(unsafe_code)]

use cryptoki_sys::*;
use memveil_asym::Hash;
use memveil_vault::proto::Mode;
use memveil_vault::ring::{status, AsymParams, Op, MAX_ASYM_INPUT};
use zeroize::Zeroizing;

use crate::asym::AsymBackend;
use crate::mech::{Failure, Rv};

/// The hash of an HMAC mechanism.
#[must_use]
pub fn hmac_hash(m: CK_MECHANISM_TYPE) -> Option<Hash> {
    Some(match m {
        CKM_SHA_1_HMAC => Hash::Sha1,
        CKM_SHA224_HMAC => Hash::Sha224,
        CKM_SHA256_HMAC => Hash::Sha256,
        CKM_SHA384_HMAC => Hash::Sha384,
        CKM_SHA512_HMAC => Hash::Sha512,
        _ => return None,
    })
}

/// An HMAC signature or verification in progress.
#[derive(Clone)]
pub struct HmacOp {
    key: u32,
    hash: Hash,
    pending: Zeroizing<Vec<u8>>,
}

fn map(f: Failure) -> Rv {
    match f {
        Failure::Rv(rv) => rv,
        Failure::Status(s) => match s {
            status::AUTH_FAILED => CKR_SIGNATURE_INVALID,
            status::BAD_LENGTH | status::TOO_LONG => CKR_DATA_LEN_RANGE,
            status::NO_KEY => CKR_KEY_HANDLE_INVALID,
            status::DENIED => CKR_KEY_FUNCTION_NOT_PERMITTED,
            status::WRONG_MODE => CKR_KEY_TYPE_INCONSISTENT,
            status::NO_MEMORY => CKR_DEVICE_MEMORY,
            _ => CKR_DEVICE_ERROR,
        },
    }
}

impl HmacOp {
    /// Starts an HMAC with `hash` and vault key `key`.
    #[must_use]
    pub fn new(key: u32, hash: Hash) -> Self {
        Self {
            key,
            hash,
            pending: Zeroizing::new(Vec::new()),
        }
    }

    /// The MAC's length.
    #[must_use]
    pub fn mac_len(&self) -> usize {
        self.hash.len()
    }

    /// Adds a part.
    ///
    /// # Errors
    /// `CKR_DATA_LEN_RANGE` past the vault's largest request (1 MiB).
    pub fn update(&mut self, part: &[u8]) -> Result<(), Rv> {
        let cap = usize::try_from(MAX_ASYM_INPUT).unwrap_or(usize::MAX) - self.hash.len();
        if self.pending.len() + part.len() > cap {
            return Err(CKR_DATA_LEN_RANGE);
        }
        self.pending.extend_from_slice(part);
        Ok(())
    }

    fn params(&self) -> AsymParams {
        AsymParams {
            hash: self.hash.code(),
            mgf1: 0,
            len: 0,
        }
    }

    /// The MAC of the parts so far followed by `last`.
    ///
    /// # Errors
    /// A PKCS#11 code.
    pub fn sign(&self, be: &dyn AsymBackend, last: &[u8]) -> Result<Zeroizing<Vec<u8>>, Rv> {
        let mut msg = self.clone();
        msg.update(last)?;
        be.run_asym(
            Op::Encrypt,
            self.key,
            Mode::Hmac,
            self.params(),
            &msg.pending,
        )
        .map_err(map)
    }

    /// Checks `mac` over the parts so far followed by `last` (in the vault,
    /// in constant time).
    ///
    /// # Errors
    /// `CKR_SIGNATURE_LEN_RANGE`, `CKR_SIGNATURE_INVALID` or another code.
    pub fn verify(&self, be: &dyn AsymBackend, last: &[u8], mac: &[u8]) -> Result<(), Rv> {
        if mac.len() != self.hash.len() {
            return Err(CKR_SIGNATURE_LEN_RANGE);
        }
        let mut msg = self.clone();
        msg.update(last)?;
        msg.pending.extend_from_slice(mac);
        be.run_asym(
            Op::Decrypt,
            self.key,
            Mode::Hmac,
            self.params(),
            &msg.pending,
        )
        .map(|_| ())
        .map_err(map)
    }
}
