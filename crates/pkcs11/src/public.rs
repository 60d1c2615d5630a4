//! Public-key operations, run in the module's own process from the public
//! half it already holds (a public key object's modulus and exponent, or
//! curve and point): signature verification (`C_Verify*`), verification
//! with recovery (`C_VerifyRecover`, RSA PKCS#1 v1.5 and raw) and RSA
//! encryption (`C_Encrypt*`, PKCS#1 v1.5, OAEP, raw). Nothing here is
//! secret, so no vault request is made.
#![forbid(unsafe_code)]

use std::sync::Arc;

use cryptoki_sys::*;
use memveil_asym::{AsymError, EncryptScheme, Hash, Public, PublicKey, VerifyScheme};
use memveil_vault::proto::{KeyKind, Mode};
use zeroize::Zeroizing;

use crate::asym::{
    hash_of_mech, hash_of_mgf, kind_of_params, pss_of, DecryptParams, SigShape, SignParams,
};
use crate::core::{as_bool, as_ulong};
use crate::mech::Rv;

/// A verification with a public key in progress.
#[derive(Clone)]
pub struct AsymVerify {
    key: Arc<PublicKey>,
    scheme: VerifyScheme,
    shape: SigShape,
    pending: Vec<u8>,
}

impl AsymVerify {
    /// Starts a verification of `mech` with `key`, the public half of a
    /// key of `kind`.
    ///
    /// # Errors
    /// `CKR_MECHANISM_INVALID`, `CKR_KEY_TYPE_INCONSISTENT`,
    /// `CKR_MECHANISM_PARAM_INVALID`.
    pub fn new(
        mech: CK_MECHANISM_TYPE,
        params: SignParams,
        key: Arc<PublicKey>,
        kind: KeyKind,
    ) -> Result<Self, Rv> {
        let shape = SigShape::of(mech, kind)?;
        let scheme = match (shape.mode, params) {
            (Mode::RsaPss, SignParams::Pss { hash: h, mgf, salt }) => {
                let (hash, mgf1, salt) = pss_of(shape.hash, h, mgf, salt)?;
                VerifyScheme::Pss { hash, mgf1, salt }
            }
            (Mode::RsaPkcs1, SignParams::None) => VerifyScheme::Pkcs1,
            (Mode::RsaRaw, SignParams::None) => VerifyScheme::Raw,
            (Mode::Ecdsa, SignParams::None) => VerifyScheme::Ecdsa,
            (Mode::EdDsa, SignParams::None) => VerifyScheme::Ed25519,
            _ => return Err(CKR_MECHANISM_PARAM_INVALID),
        };
        Ok(Self {
            key,
            scheme,
            shape,
            pending: Vec::new(),
        })
    }

    /// Adds a part (`C_VerifyUpdate`).
    ///
    /// # Errors
    /// `CKR_FUNCTION_NOT_SUPPORTED` for a single-part mechanism;
    /// `CKR_DATA_LEN_RANGE` past [`crate::asym::MAX_MESSAGE`] (the mechanisms that keep
    /// the message: Ed25519).
    pub fn update(&mut self, part: &[u8]) -> Result<(), Rv> {
        self.shape.gather(&mut self.pending, part)
    }

    /// Checks `sig` over the parts so far followed by `last`.
    ///
    /// # Errors
    /// `CKR_SIGNATURE_LEN_RANGE`, `CKR_SIGNATURE_INVALID`,
    /// `CKR_DATA_LEN_RANGE`.
    pub fn verify(&self, last: &[u8], sig: &[u8]) -> Result<(), Rv> {
        if sig.len() != self.shape.sig_len {
            return Err(CKR_SIGNATURE_LEN_RANGE);
        }
        let mut msg = Zeroizing::new(self.pending.clone());
        msg.extend_from_slice(last);
        let input = self.shape.input(msg)?;
        self.key
            .verify(self.scheme, &input, sig)
            .map_err(|e| match e {
                AsymError::Rejected(_) => CKR_SIGNATURE_INVALID,
                AsymError::BadInput(_) => CKR_DATA_LEN_RANGE,
                _ => CKR_DEVICE_ERROR,
            })
    }

    /// What `sig` recovers (`C_VerifyRecover`): `CKM_RSA_PKCS` gives the
    /// signed data, `CKM_RSA_X_509` the whole number.
    ///
    /// # Errors
    /// `CKR_SIGNATURE_LEN_RANGE`, `CKR_SIGNATURE_INVALID`,
    /// `CKR_MECHANISM_INVALID` (a mechanism without recovery).
    pub fn recover(&self, sig: &[u8]) -> Result<Vec<u8>, Rv> {
        if self.shape.hash.is_some()
            || !matches!(self.scheme, VerifyScheme::Pkcs1 | VerifyScheme::Raw)
        {
            return Err(CKR_MECHANISM_INVALID);
        }
        if sig.len() != self.shape.sig_len {
            return Err(CKR_SIGNATURE_LEN_RANGE);
        }
        self.key
            .recover(self.scheme, sig)
            .map_err(|_| CKR_SIGNATURE_INVALID)
    }

    /// The longest output of [`AsymVerify::recover`].
    #[must_use]
    pub fn recover_bound(&self) -> usize {
        self.shape.modulus_len
    }
}

/// Whether `m` has a verification with recovery here.
#[must_use]
pub fn is_recover_mech(m: CK_MECHANISM_TYPE) -> bool {
    matches!(m, CKM_RSA_PKCS | CKM_RSA_X_509)
}

/// An RSA encryption in progress (the message gathered until the last
/// part: one block at most).
#[derive(Clone)]
pub struct AsymEncrypt {
    key: Arc<PublicKey>,
    mech: CK_MECHANISM_TYPE,
    oaep: Option<(Hash, Hash, Vec<u8>)>,
    /// The modulus' bytes (the ciphertext's length).
    pub k: usize,
    pending: Zeroizing<Vec<u8>>,
}

impl AsymEncrypt {
    /// Starts an encryption with `key`, the public half of a key of `kind`.
    ///
    /// # Errors
    /// `CKR_MECHANISM_INVALID`, `CKR_KEY_TYPE_INCONSISTENT`,
    /// `CKR_MECHANISM_PARAM_INVALID`.
    pub fn new(
        mech: CK_MECHANISM_TYPE,
        params: DecryptParams,
        key: Arc<PublicKey>,
        kind: KeyKind,
    ) -> Result<Self, Rv> {
        let bits = kind
            .asym()
            .and_then(memveil_asym::Algorithm::rsa_bits)
            .ok_or(CKR_KEY_TYPE_INCONSISTENT)?;
        let oaep = match (mech, params) {
            (CKM_RSA_PKCS | CKM_RSA_X_509, DecryptParams::None) => None,
            (CKM_RSA_PKCS_OAEP, DecryptParams::Oaep { hash, mgf, label }) => Some((
                hash_of_mech(hash).ok_or(CKR_MECHANISM_PARAM_INVALID)?,
                hash_of_mgf(mgf).ok_or(CKR_MECHANISM_PARAM_INVALID)?,
                label,
            )),
            (CKM_RSA_PKCS | CKM_RSA_PKCS_OAEP | CKM_RSA_X_509, _) => {
                return Err(CKR_MECHANISM_PARAM_INVALID)
            }
            _ => return Err(CKR_MECHANISM_INVALID),
        };
        Ok(Self {
            key,
            mech,
            oaep,
            k: bits as usize / 8,
            pending: Zeroizing::new(Vec::new()),
        })
    }

    /// Adds plaintext (`C_EncryptUpdate`); nothing comes out before the
    /// last part.
    ///
    /// # Errors
    /// `CKR_DATA_LEN_RANGE` past one block.
    pub fn update(&mut self, part: &[u8]) -> Result<(), Rv> {
        if self.pending.len() + part.len() > self.k {
            return Err(CKR_DATA_LEN_RANGE);
        }
        self.pending.extend_from_slice(part);
        Ok(())
    }

    /// Encrypts the parts so far followed by `last`.
    ///
    /// # Errors
    /// `CKR_DATA_LEN_RANGE` (too long for the padding), `CKR_DATA_INVALID`
    /// (a raw block not below the modulus).
    pub fn encrypt(&self, last: &[u8]) -> Result<Zeroizing<Vec<u8>>, Rv> {
        let mut msg = Zeroizing::new(self.pending.to_vec());
        msg.extend_from_slice(last);
        let scheme = match (&self.oaep, self.mech) {
            (Some((hash, mgf1, label)), _) => EncryptScheme::Oaep {
                hash: *hash,
                mgf1: *mgf1,
                label,
            },
            (None, CKM_RSA_X_509) => {
                // A shorter block is a number below the modulus.
                if msg.len() > self.k {
                    return Err(CKR_DATA_LEN_RANGE);
                }
                let mut v = Zeroizing::new(vec![0u8; self.k - msg.len()]);
                v.extend_from_slice(&msg);
                msg = v;
                EncryptScheme::Raw
            }
            _ => EncryptScheme::Pkcs1,
        };
        self.key
            .encrypt(scheme, &msg)
            .map(Zeroizing::new)
            .map_err(|e| match e {
                AsymError::BadInput(_) => CKR_DATA_LEN_RANGE,
                AsymError::Rejected(_) => CKR_DATA_INVALID,
                _ => CKR_DEVICE_ERROR,
            })
    }
}

/// A public key template of `C_CreateObject`, checked.
#[derive(Debug)]
pub struct PublicImport {
    /// The kind whose public half this is.
    pub kind: KeyKind,
    /// The key.
    pub key: Public,
    /// `CKA_LABEL`.
    pub label: Vec<u8>,
    /// `CKA_ID`.
    pub id: Vec<u8>,
    /// `CKA_VERIFY` (default true).
    pub verify: bool,
    /// `CKA_ENCRYPT` (default true; RSA only).
    pub encrypt: bool,
}

/// A point given as `CKA_EC_POINT`: a DER OCTET STRING, or raw.
fn unwrap_point(p: &[u8]) -> &[u8] {
    match p {
        [0x04, n, rest @ ..] if usize::from(*n) == rest.len() && *n < 0x80 => rest,
        [0x04, 0x81, n, rest @ ..] if usize::from(*n) == rest.len() => rest,
        _ => p,
    }
}

/// Checks a `C_CreateObject` template of class `CKO_PUBLIC_KEY`: RSA with
/// `CKA_MODULUS` (2048, 3072 or 4096 bits) and `CKA_PUBLIC_EXPONENT`; EC
/// (P-256, P-384) or Ed25519 with `CKA_EC_PARAMS` and `CKA_EC_POINT`. Every
/// attribute the standard gives a public key is taken: the usage flags this
/// module honours (`CKA_VERIFY`, `CKA_ENCRYPT`, `CKA_VERIFY_RECOVER`), the
/// descriptive ones (subject, dates, allowed mechanisms...) checked for
/// form and ignored.
///
/// # Errors
/// `CKR_TEMPLATE_INCOMPLETE`, `CKR_ATTRIBUTE_VALUE_INVALID` (a weak RSA
/// modulus among others: 1024 bits is refused), `CKR_CURVE_NOT_SUPPORTED`,
/// `CKR_ATTRIBUTE_TYPE_INVALID`, `CKR_ATTRIBUTE_READ_ONLY`.
pub fn check_public_import(attrs: &[(CK_ATTRIBUTE_TYPE, &[u8])]) -> Result<PublicImport, Rv> {
    let (mut key_type, mut n, mut e, mut params, mut point) = (None, None, None, None, None);
    let (mut label, mut id) = (Vec::new(), Vec::new());
    let (mut verify, mut encrypt) = (true, true);
    for (ty, v) in attrs {
        let v: &[u8] = v;
        match *ty {
            CKA_CLASS => {
                if as_ulong(v)? != CKO_PUBLIC_KEY {
                    return Err(CKR_TEMPLATE_INCONSISTENT);
                }
            }
            CKA_KEY_TYPE => key_type = Some(as_ulong(v)?),
            CKA_MODULUS => n = Some(v),
            CKA_PUBLIC_EXPONENT => e = Some(v),
            CKA_EC_PARAMS => params = Some(v),
            CKA_EC_POINT => point = Some(v),
            CKA_LABEL => label = v.to_vec(),
            CKA_ID => id = v.to_vec(),
            CKA_VERIFY => verify = as_bool(v)?,
            CKA_ENCRYPT => encrypt = as_bool(v)?,
            // A session object of this module: CKA_TOKEN true cannot be
            // kept (the vault stores key pairs, not lone public keys).
            CKA_TOKEN => {
                if as_bool(v)? {
                    return Err(CKR_ATTRIBUTE_VALUE_INVALID);
                }
            }
            CKA_VERIFY_RECOVER | CKA_DERIVE | CKA_PRIVATE | CKA_MODIFIABLE | CKA_COPYABLE
            | CKA_DESTROYABLE => {
                as_bool(v)?;
            }
            CKA_WRAP | CKA_TRUSTED => {
                if as_bool(v)? {
                    return Err(CKR_ATTRIBUTE_VALUE_INVALID);
                }
            }
            CKA_SUBJECT
            | CKA_START_DATE
            | CKA_END_DATE
            | CKA_ALLOWED_MECHANISMS
            | CKA_PUBLIC_KEY_INFO
            | CKA_WRAP_TEMPLATE => {}
            CKA_MODULUS_BITS | CKA_LOCAL | CKA_KEY_GEN_MECHANISM => {
                return Err(CKR_ATTRIBUTE_READ_ONLY)
            }
            _ => return Err(CKR_ATTRIBUTE_TYPE_INVALID),
        }
    }
    let (kind, key) = match key_type.ok_or(CKR_TEMPLATE_INCOMPLETE)? {
        CKK_RSA => {
            let (n, e) = (
                n.ok_or(CKR_TEMPLATE_INCOMPLETE)?,
                e.ok_or(CKR_TEMPLATE_INCOMPLETE)?,
            );
            let kind = match memveil_vault::keyfile::rsa_bits(n) {
                2048 => KeyKind::Rsa2048,
                3072 => KeyKind::Rsa3072,
                4096 => KeyKind::Rsa4096,
                _ => return Err(CKR_ATTRIBUTE_VALUE_INVALID),
            };
            let strip = |b: &[u8]| {
                b.iter()
                    .copied()
                    .skip_while(|x| *x == 0)
                    .collect::<Vec<u8>>()
            };
            (
                kind,
                Public::Rsa {
                    n: strip(n),
                    e: strip(e),
                },
            )
        }
        t @ (CKK_EC | CKK_EC_EDWARDS) => {
            let kind = kind_of_params(params.ok_or(CKR_TEMPLATE_INCOMPLETE)?)?;
            let pt = unwrap_point(point.ok_or(CKR_TEMPLATE_INCOMPLETE)?);
            match (t, kind) {
                (CKK_EC, KeyKind::P256) => (
                    kind,
                    Public::Ec {
                        curve: memveil_asym::Curve::P256,
                        point: pt.to_vec(),
                    },
                ),
                (CKK_EC, KeyKind::P384) => (
                    kind,
                    Public::Ec {
                        curve: memveil_asym::Curve::P384,
                        point: pt.to_vec(),
                    },
                ),
                (CKK_EC_EDWARDS, KeyKind::Ed25519) => (
                    kind,
                    Public::Ed25519(pt.try_into().map_err(|_| CKR_ATTRIBUTE_VALUE_INVALID)?),
                ),
                _ => return Err(CKR_CURVE_NOT_SUPPORTED),
            }
        }
        _ => return Err(CKR_ATTRIBUTE_VALUE_INVALID),
    };
    // The key must be one aws-lc takes (a point on its curve, among others).
    PublicKey::new(&key).map_err(|_| CKR_ATTRIBUTE_VALUE_INVALID)?;
    Ok(PublicImport {
        kind,
        key,
        label,
        id,
        verify,
        encrypt,
    })
}
