//! The asymmetric side of the token, as safe state: the mechanisms' parameters
//! (already copied out of C memory by the entry points), signatures and
//! decryptions in progress, and the templates of `C_GenerateKeyPair`,
//! `C_CreateObject` (private keys, certificates) and `C_DeriveKey`.
//!
//! Each signature or decryption is one vault request; what the module
//! holds in between is the caller's message (hashed here for the
//! `CKM_SHA*_RSA_PKCS`, `_PSS` and `CKM_ECDSA_SHA*` mechanisms), never key
//! material.
#![forbid(unsafe_code)]

use cryptoki_sys::*;
use memveil_asym::hash::digest;
use memveil_asym::Hash;
use memveil_vault::proto::{KeyKind, Mode};
use memveil_vault::ring::{status, AsymParams, Op};
use zeroize::Zeroizing;

use crate::core::{as_bool, as_ulong};
use crate::mech::{Failure, Rv};
use crate::object::{ec_params, ED25519_PARAMS};

/// Longest message a signature in progress keeps (multi-part).
pub const MAX_MESSAGE: usize = 1 << 20;

/// What runs one asymmetric request.
pub trait AsymBackend {
    /// Runs `mode` with vault key `key` over `input`; returns the result.
    ///
    /// # Errors
    /// The vault's status or a connection failure.
    fn run_asym(
        &self,
        op: Op,
        key: u32,
        mode: Mode,
        params: AsymParams,
        input: &[u8],
    ) -> Result<Zeroizing<Vec<u8>>, Failure>;
}

/// The hash of a `CKM_SHA*` mechanism code or a `CKG_MGF1_SHA*` code.
pub(crate) fn hash_of_mech(m: CK_MECHANISM_TYPE) -> Option<Hash> {
    Some(match m {
        CKM_SHA_1 => Hash::Sha1,
        CKM_SHA224 => Hash::Sha224,
        CKM_SHA256 => Hash::Sha256,
        CKM_SHA384 => Hash::Sha384,
        CKM_SHA512 => Hash::Sha512,
        _ => return None,
    })
}

pub(crate) fn hash_of_mgf(g: CK_RSA_PKCS_MGF_TYPE) -> Option<Hash> {
    Some(match g {
        CKG_MGF1_SHA1 => Hash::Sha1,
        CKG_MGF1_SHA224 => Hash::Sha224,
        CKG_MGF1_SHA256 => Hash::Sha256,
        CKG_MGF1_SHA384 => Hash::Sha384,
        CKG_MGF1_SHA512 => Hash::Sha512,
        _ => return None,
    })
}

/// `CK_RSA_PKCS_PSS_PARAMS` checked (its hash the mechanism's, when the
/// mechanism names one): the hash, MGF1's hash and the salt length.
///
/// # Errors
/// `CKR_MECHANISM_PARAM_INVALID`.
pub(crate) fn pss_of(
    mech_hash: Option<Hash>,
    hash: CK_MECHANISM_TYPE,
    mgf: CK_RSA_PKCS_MGF_TYPE,
    salt: CK_ULONG,
) -> Result<(Hash, Hash, u32), Rv> {
    let h = hash_of_mech(hash).ok_or(CKR_MECHANISM_PARAM_INVALID)?;
    if mech_hash.is_some_and(|x| x != h) {
        return Err(CKR_MECHANISM_PARAM_INVALID);
    }
    Ok((
        h,
        hash_of_mgf(mgf).ok_or(CKR_MECHANISM_PARAM_INVALID)?,
        u32::try_from(salt).map_err(|_| CKR_MECHANISM_PARAM_INVALID)?,
    ))
}

/// The parameters of a signature mechanism, copied out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignParams {
    /// None.
    None,
    /// `CK_RSA_PKCS_PSS_PARAMS`: hash mechanism, MGF, salt length.
    Pss {
        /// `hashAlg`.
        hash: CK_MECHANISM_TYPE,
        /// `mgf`.
        mgf: CK_RSA_PKCS_MGF_TYPE,
        /// `sLen`.
        salt: CK_ULONG,
    },
}

/// Whether `m` is a signature mechanism of an asymmetric key.
#[must_use]
pub fn is_sign_mech(m: CK_MECHANISM_TYPE) -> bool {
    sign_shape(m).is_some()
}

/// (vault mode, hash the module applies first, DigestInfo prefix, the key
/// type it needs, multi-part allowed).
pub(crate) fn sign_shape(
    m: CK_MECHANISM_TYPE,
) -> Option<(Mode, Option<Hash>, bool, CK_KEY_TYPE, bool)> {
    Some(match m {
        CKM_RSA_PKCS => (Mode::RsaPkcs1, None, false, CKK_RSA, false),
        CKM_RSA_X_509 => (Mode::RsaRaw, None, false, CKK_RSA, false),
        CKM_RSA_PKCS_PSS => (Mode::RsaPss, None, false, CKK_RSA, false),
        CKM_SHA1_RSA_PKCS => (Mode::RsaPkcs1, Some(Hash::Sha1), true, CKK_RSA, true),
        CKM_SHA224_RSA_PKCS => (Mode::RsaPkcs1, Some(Hash::Sha224), true, CKK_RSA, true),
        CKM_SHA256_RSA_PKCS => (Mode::RsaPkcs1, Some(Hash::Sha256), true, CKK_RSA, true),
        CKM_SHA384_RSA_PKCS => (Mode::RsaPkcs1, Some(Hash::Sha384), true, CKK_RSA, true),
        CKM_SHA512_RSA_PKCS => (Mode::RsaPkcs1, Some(Hash::Sha512), true, CKK_RSA, true),
        CKM_SHA1_RSA_PKCS_PSS => (Mode::RsaPss, Some(Hash::Sha1), false, CKK_RSA, true),
        CKM_SHA224_RSA_PKCS_PSS => (Mode::RsaPss, Some(Hash::Sha224), false, CKK_RSA, true),
        CKM_SHA256_RSA_PKCS_PSS => (Mode::RsaPss, Some(Hash::Sha256), false, CKK_RSA, true),
        CKM_SHA384_RSA_PKCS_PSS => (Mode::RsaPss, Some(Hash::Sha384), false, CKK_RSA, true),
        CKM_SHA512_RSA_PKCS_PSS => (Mode::RsaPss, Some(Hash::Sha512), false, CKK_RSA, true),
        CKM_ECDSA => (Mode::Ecdsa, None, false, CKK_EC, false),
        CKM_ECDSA_SHA1 => (Mode::Ecdsa, Some(Hash::Sha1), false, CKK_EC, true),
        CKM_ECDSA_SHA224 => (Mode::Ecdsa, Some(Hash::Sha224), false, CKK_EC, true),
        CKM_ECDSA_SHA256 => (Mode::Ecdsa, Some(Hash::Sha256), false, CKK_EC, true),
        CKM_ECDSA_SHA384 => (Mode::Ecdsa, Some(Hash::Sha384), false, CKK_EC, true),
        CKM_ECDSA_SHA512 => (Mode::Ecdsa, Some(Hash::Sha512), false, CKK_EC, true),
        CKM_EDDSA => (Mode::EdDsa, None, false, CKK_EC_EDWARDS, true),
        _ => return None,
    })
}

fn map(f: Failure, len_rv: Rv, bad_rv: Rv) -> Rv {
    match f {
        Failure::Rv(rv) => rv,
        Failure::Status(s) => match s {
            status::BAD_LENGTH => len_rv,
            status::BAD_CIPHERTEXT => bad_rv,
            status::BAD_PARAMS => CKR_MECHANISM_PARAM_INVALID,
            status::NO_KEY => CKR_KEY_HANDLE_INVALID,
            status::DENIED => CKR_KEY_FUNCTION_NOT_PERMITTED,
            status::WRONG_MODE => CKR_KEY_TYPE_INCONSISTENT,
            status::NO_MEMORY => CKR_DEVICE_MEMORY,
            _ => CKR_DEVICE_ERROR,
        },
    }
}

/// A signature with an asymmetric key in progress.
#[derive(Clone)]
pub struct AsymSign {
    key: u32,
    shape: SigShape,
    params: AsymParams,
    pending: Zeroizing<Vec<u8>>,
    updated: bool,
}

impl AsymSign {
    /// The signature's length (modulus bytes, `2·field`, 64).
    #[must_use]
    pub fn sig_len(&self) -> usize {
        self.shape.sig_len
    }

    /// Starts a signature with vault key `key` of `kind`.
    ///
    /// # Errors
    /// `CKR_MECHANISM_INVALID`, `CKR_KEY_TYPE_INCONSISTENT`,
    /// `CKR_MECHANISM_PARAM_INVALID`.
    pub fn new(
        mech: CK_MECHANISM_TYPE,
        params: SignParams,
        key: u32,
        kind: KeyKind,
    ) -> Result<Self, Rv> {
        let shape = SigShape::of(mech, kind)?;
        let p = match (shape.mode, params) {
            (Mode::RsaPss, SignParams::Pss { hash: h, mgf, salt }) => {
                let (hh, mgf1, salt) = pss_of(shape.hash, h, mgf, salt)?;
                AsymParams {
                    hash: hh.code(),
                    mgf1: mgf1.code(),
                    len: salt,
                }
            }
            (Mode::RsaPss, SignParams::None) => return Err(CKR_MECHANISM_PARAM_INVALID),
            (_, SignParams::None) => AsymParams::default(),
            _ => return Err(CKR_MECHANISM_PARAM_INVALID),
        };
        Ok(Self {
            key,
            shape,
            params: p,
            pending: Zeroizing::new(Vec::new()),
            updated: false,
        })
    }

    /// Adds a part (`C_SignUpdate`).
    ///
    /// # Errors
    /// `CKR_FUNCTION_NOT_SUPPORTED` for a single-part mechanism;
    /// `CKR_DATA_LEN_RANGE` past [`MAX_MESSAGE`].
    pub fn update(&mut self, part: &[u8]) -> Result<(), Rv> {
        self.shape.gather(&mut self.pending, part)?;
        self.updated = true;
        Ok(())
    }

    /// Signs the parts so far followed by `last`.
    ///
    /// # Errors
    /// A PKCS#11 code.
    pub fn sign(&self, be: &dyn AsymBackend, last: &[u8]) -> Result<Zeroizing<Vec<u8>>, Rv> {
        let mut msg = Zeroizing::new(self.pending.to_vec());
        msg.extend_from_slice(last);
        let input = self.shape.input(msg)?;
        be.run_asym(Op::Encrypt, self.key, self.shape.mode, self.params, &input)
            .map_err(|f| map(f, CKR_DATA_LEN_RANGE, CKR_DATA_INVALID))
    }
}

/// What a signature mechanism makes of the message for a key of a kind:
/// shared by signing (in the vault, [`AsymSign`]) and verifying (in the
/// module, `public::AsymVerify`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SigShape {
    /// The vault's mode.
    pub(crate) mode: Mode,
    /// The hash the module applies first.
    pub(crate) hash: Option<Hash>,
    /// Whether the digest goes in a `DigestInfo`.
    prefix: bool,
    /// Whether multi-part is allowed.
    multi: bool,
    /// The signature's length (modulus bytes, `2·field`, 64).
    pub(crate) sig_len: usize,
    /// The modulus' bytes of an RSA key, 0 otherwise.
    pub(crate) modulus_len: usize,
}

impl SigShape {
    /// The shape of `mech` with a key of `kind`.
    ///
    /// # Errors
    /// `CKR_MECHANISM_INVALID`, `CKR_KEY_TYPE_INCONSISTENT`.
    pub(crate) fn of(mech: CK_MECHANISM_TYPE, kind: KeyKind) -> Result<Self, Rv> {
        let (mode, hash, prefix, ktype, multi) = sign_shape(mech).ok_or(CKR_MECHANISM_INVALID)?;
        if crate::object::key_type(kind) != ktype {
            return Err(CKR_KEY_TYPE_INCONSISTENT);
        }
        let alg = kind.asym().ok_or(CKR_KEY_TYPE_INCONSISTENT)?;
        Ok(Self {
            mode,
            hash,
            prefix,
            multi,
            sig_len: alg.max_output(),
            modulus_len: alg.rsa_bits().map_or(0, |b| b as usize / 8),
        })
    }

    /// Adds a part to `pending` (`C_SignUpdate`, `C_VerifyUpdate`).
    ///
    /// # Errors
    /// `CKR_FUNCTION_NOT_SUPPORTED` for a single-part mechanism;
    /// `CKR_DATA_LEN_RANGE` past [`MAX_MESSAGE`].
    pub(crate) fn gather(&self, pending: &mut Vec<u8>, part: &[u8]) -> Result<(), Rv> {
        if !self.multi {
            return Err(CKR_FUNCTION_NOT_SUPPORTED);
        }
        if pending.len() + part.len() > MAX_MESSAGE {
            return Err(CKR_DATA_LEN_RANGE);
        }
        pending.extend_from_slice(part);
        Ok(())
    }

    /// What a signature mechanism signs (and its verification checks): the
    /// message's digest (in a `DigestInfo` for PKCS#1 v1.5) for the `SHA*`
    /// mechanisms, the message left-padded to the modulus for `CKM_RSA_X_509`,
    /// the message itself otherwise.
    ///
    /// # Errors
    /// `CKR_DATA_LEN_RANGE` for an empty input (but Ed25519's) or a raw one
    /// longer than the modulus.
    pub(crate) fn input(&self, msg: Zeroizing<Vec<u8>>) -> Result<Zeroizing<Vec<u8>>, Rv> {
        let (hash, prefix, mode, modulus_len) =
            (self.hash, self.prefix, self.mode, self.modulus_len);
        let input = match hash {
            Some(h) => {
                let mut v = if prefix {
                    h.digest_info_prefix().to_vec()
                } else {
                    Vec::new()
                };
                v.extend(digest(h, &msg));
                Zeroizing::new(v)
            }
            None if mode == Mode::RsaRaw => {
                // CKM_RSA_X_509: shorter input is a number below the modulus,
                // left-padded with zeros.
                if msg.len() > modulus_len {
                    return Err(CKR_DATA_LEN_RANGE);
                }
                let mut v = Zeroizing::new(vec![0u8; modulus_len - msg.len()]);
                v.extend_from_slice(&msg);
                v
            }
            None => msg,
        };
        if input.is_empty() && mode != Mode::EdDsa {
            return Err(CKR_DATA_LEN_RANGE);
        }
        Ok(input)
    }
}

/// The parameters of a decryption mechanism, copied out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecryptParams {
    /// None.
    None,
    /// `CK_RSA_PKCS_OAEP_PARAMS`, the label (`pSourceData`) copied.
    Oaep {
        /// `hashAlg`.
        hash: CK_MECHANISM_TYPE,
        /// `mgf`.
        mgf: CK_RSA_PKCS_MGF_TYPE,
        /// The label.
        label: Vec<u8>,
    },
}

/// Whether `m` decrypts with an RSA key.
#[must_use]
pub fn is_decrypt_mech(m: CK_MECHANISM_TYPE) -> bool {
    matches!(m, CKM_RSA_PKCS | CKM_RSA_PKCS_OAEP | CKM_RSA_X_509)
}

/// An RSA decryption in progress (the ciphertext gathered until the last
/// part: one block of the modulus' length).
#[derive(Clone)]
pub struct AsymDecrypt {
    key: u32,
    mode: Mode,
    params: AsymParams,
    label: Vec<u8>,
    /// The modulus' bytes (the ciphertext's length, the output's bound).
    pub k: usize,
    pending: Vec<u8>,
}

impl AsymDecrypt {
    /// Starts a decryption with vault key `key` of `kind`.
    ///
    /// # Errors
    /// `CKR_MECHANISM_INVALID`, `CKR_KEY_TYPE_INCONSISTENT`,
    /// `CKR_MECHANISM_PARAM_INVALID`.
    pub fn new(
        mech: CK_MECHANISM_TYPE,
        params: DecryptParams,
        key: u32,
        kind: KeyKind,
    ) -> Result<Self, Rv> {
        let bits = kind
            .asym()
            .and_then(memveil_asym::Algorithm::rsa_bits)
            .ok_or(CKR_KEY_TYPE_INCONSISTENT)?;
        let (mode, p, label) = match (mech, params) {
            (CKM_RSA_PKCS, DecryptParams::None) => {
                (Mode::RsaPkcs1, AsymParams::default(), Vec::new())
            }
            (CKM_RSA_X_509, DecryptParams::None) => {
                (Mode::RsaRaw, AsymParams::default(), Vec::new())
            }
            (CKM_RSA_PKCS_OAEP, DecryptParams::Oaep { hash, mgf, label }) => {
                let h = hash_of_mech(hash).ok_or(CKR_MECHANISM_PARAM_INVALID)?;
                let g = hash_of_mgf(mgf).ok_or(CKR_MECHANISM_PARAM_INVALID)?;
                let p = AsymParams {
                    hash: h.code(),
                    mgf1: g.code(),
                    len: u32::try_from(label.len()).map_err(|_| CKR_MECHANISM_PARAM_INVALID)?,
                };
                (Mode::RsaOaep, p, label)
            }
            (CKM_RSA_PKCS | CKM_RSA_PKCS_OAEP | CKM_RSA_X_509, _) => {
                return Err(CKR_MECHANISM_PARAM_INVALID)
            }
            _ => return Err(CKR_MECHANISM_INVALID),
        };
        Ok(Self {
            key,
            mode,
            params: p,
            label,
            k: bits as usize / 8,
            pending: Vec::new(),
        })
    }

    /// Adds ciphertext (`C_DecryptUpdate`); nothing comes out before the
    /// last part.
    ///
    /// # Errors
    /// `CKR_ENCRYPTED_DATA_LEN_RANGE` past one block.
    pub fn update(&mut self, part: &[u8]) -> Result<(), Rv> {
        if self.pending.len() + part.len() > self.k {
            return Err(CKR_ENCRYPTED_DATA_LEN_RANGE);
        }
        self.pending.extend_from_slice(part);
        Ok(())
    }

    /// Decrypts the ciphertext so far followed by `last`.
    ///
    /// # Errors
    /// `CKR_ENCRYPTED_DATA_LEN_RANGE`, `CKR_ENCRYPTED_DATA_INVALID` (OAEP),
    /// or another code. PKCS#1 v1.5 never reports a bad padding (implicit
    /// rejection: a synthetic message comes back).
    pub fn decrypt(&self, be: &dyn AsymBackend, last: &[u8]) -> Result<Zeroizing<Vec<u8>>, Rv> {
        let mut input = self.label.clone();
        input.extend_from_slice(&self.pending);
        input.extend_from_slice(last);
        if input.len() != self.label.len() + self.k {
            return Err(CKR_ENCRYPTED_DATA_LEN_RANGE);
        }
        be.run_asym(Op::Decrypt, self.key, self.mode, self.params, &input)
            .map_err(|f| map(f, CKR_ENCRYPTED_DATA_LEN_RANGE, CKR_ENCRYPTED_DATA_INVALID))
    }
}

/// The kind named by `CKA_EC_PARAMS` (an OID, or Ed25519's printable name).
pub(crate) fn kind_of_params(p: &[u8]) -> Result<KeyKind, Rv> {
    if p == ec_params(memveil_asym::Curve::P256) {
        Ok(KeyKind::P256)
    } else if p == ec_params(memveil_asym::Curve::P384) {
        Ok(KeyKind::P384)
    } else if p == ED25519_PARAMS || p == b"\x13\x0cedwards25519" {
        Ok(KeyKind::Ed25519)
    } else {
        Err(CKR_CURVE_NOT_SUPPORTED)
    }
}

/// What a key pair's templates asked for, checked.
#[derive(Debug, Default)]
pub struct PairTemplate<'a> {
    /// The kind to generate.
    pub kind: Option<KeyKind>,
    /// `CKA_TOKEN` (the private template's, else the public one's).
    pub token: bool,
    /// `CKA_LABEL`.
    pub label: &'a [u8],
    /// `CKA_ID`.
    pub id: &'a [u8],
    /// `CKA_SIGN`, `CKA_DECRYPT`, `CKA_DERIVE` (default true).
    pub sign: bool,
    /// As above.
    pub decrypt: bool,
    /// As above.
    pub derive: bool,
}

/// Attributes every key template may carry: boolean usage flags a private
/// key cannot have set (wrap, unwrap, extractable…) are refused when true.
fn common_key_attr<'a>(
    t: &mut PairTemplate<'a>,
    ty: CK_ATTRIBUTE_TYPE,
    v: &'a [u8],
    private: bool,
) -> Result<bool, Rv> {
    match ty {
        CKA_TOKEN => t.token = as_bool(v)?,
        CKA_LABEL => t.label = v,
        CKA_ID => t.id = v,
        CKA_CLASS | CKA_KEY_TYPE => {
            as_ulong(v)?;
        }
        CKA_SENSITIVE
        | CKA_PRIVATE
        | CKA_DESTROYABLE
        | CKA_VERIFY
        | CKA_ENCRYPT
        | CKA_VERIFY_RECOVER
        | CKA_ALWAYS_AUTHENTICATE => {
            as_bool(v)?;
        }
        CKA_SUBJECT
        | CKA_START_DATE
        | CKA_END_DATE
        | CKA_ALLOWED_MECHANISMS
        | CKA_PUBLIC_KEY_INFO
        | CKA_WRAP_TEMPLATE
        | CKA_UNWRAP_TEMPLATE
        | CKA_DERIVE_TEMPLATE => {}
        CKA_SIGN if private => t.sign = as_bool(v)?,
        CKA_DECRYPT if private => t.decrypt = as_bool(v)?,
        CKA_DERIVE => t.derive = as_bool(v)?,
        CKA_EXTRACTABLE
        | CKA_WRAP
        | CKA_UNWRAP
        | CKA_SIGN_RECOVER
        | CKA_MODIFIABLE
        | CKA_COPYABLE
        | CKA_TRUSTED
        | CKA_WRAP_WITH_TRUSTED => {
            if as_bool(v)? {
                return Err(CKR_ATTRIBUTE_VALUE_INVALID);
            }
        }
        _ => return Ok(false),
    }
    Ok(true)
}

/// Checks `C_GenerateKeyPair`'s templates for `mech`.
///
/// # Errors
/// `CKR_MECHANISM_INVALID`, `CKR_TEMPLATE_INCOMPLETE` (no modulus size or
/// curve), `CKR_ATTRIBUTE_VALUE_INVALID` (a size or exponent the vault does
/// not generate, a usage it cannot give), `CKR_CURVE_NOT_SUPPORTED`,
/// `CKR_ATTRIBUTE_TYPE_INVALID`.
pub fn check_pair<'a>(
    mech: CK_MECHANISM_TYPE,
    public: &[(CK_ATTRIBUTE_TYPE, &'a [u8])],
    private: &[(CK_ATTRIBUTE_TYPE, &'a [u8])],
) -> Result<PairTemplate<'a>, Rv> {
    let mut t = PairTemplate {
        sign: true,
        decrypt: true,
        derive: true,
        ..PairTemplate::default()
    };
    let mut bits = None;
    let mut params = None;
    let mut pub_token = None;
    for (ty, v) in public {
        let v: &'a [u8] = v;
        match *ty {
            CKA_MODULUS_BITS => bits = Some(as_ulong(v)?),
            CKA_PUBLIC_EXPONENT => {
                if v.iter()
                    .skip_while(|b| **b == 0)
                    .copied()
                    .collect::<Vec<u8>>()
                    != [1, 0, 1]
                {
                    return Err(CKR_ATTRIBUTE_VALUE_INVALID);
                }
            }
            CKA_EC_PARAMS => params = Some(v),
            CKA_TOKEN => pub_token = Some(as_bool(v)?),
            _ => {
                if !common_key_attr(&mut t, *ty, v, false)? {
                    return Err(CKR_ATTRIBUTE_TYPE_INVALID);
                }
            }
        }
    }
    let (pub_label, pub_id) = (t.label, t.id);
    t.label = &[];
    t.id = &[];
    let mut priv_token = None;
    for (ty, v) in private {
        let v: &'a [u8] = v;
        match *ty {
            CKA_TOKEN => priv_token = Some(as_bool(v)?),
            _ => {
                if !common_key_attr(&mut t, *ty, v, true)? {
                    return Err(CKR_ATTRIBUTE_TYPE_INVALID);
                }
            }
        }
    }
    if t.label.is_empty() {
        t.label = pub_label;
    }
    if t.id.is_empty() {
        t.id = pub_id;
    }
    t.token = priv_token.or(pub_token).unwrap_or(false);
    t.kind = Some(match mech {
        CKM_RSA_PKCS_KEY_PAIR_GEN => match bits.ok_or(CKR_TEMPLATE_INCOMPLETE)? {
            2048 => KeyKind::Rsa2048,
            3072 => KeyKind::Rsa3072,
            4096 => KeyKind::Rsa4096,
            _ => return Err(CKR_ATTRIBUTE_VALUE_INVALID),
        },
        CKM_EC_KEY_PAIR_GEN => match kind_of_params(params.ok_or(CKR_TEMPLATE_INCOMPLETE)?)? {
            k @ (KeyKind::P256 | KeyKind::P384) => k,
            _ => return Err(CKR_CURVE_NOT_SUPPORTED),
        },
        CKM_EC_EDWARDS_KEY_PAIR_GEN => match params.map(kind_of_params).transpose()? {
            None | Some(KeyKind::Ed25519) => KeyKind::Ed25519,
            Some(_) => return Err(CKR_CURVE_NOT_SUPPORTED),
        },
        _ => return Err(CKR_MECHANISM_INVALID),
    });
    Ok(t)
}

/// What `C_CreateObject` makes of a private key or certificate template:
/// the vault kind and the bytes to import (components, built here in
/// memory that is wiped; or the certificate's DER).
pub struct Import<'a> {
    /// The template's label, id, token flag and usages.
    pub t: PairTemplate<'a>,
    /// The vault kind.
    pub kind: KeyKind,
    /// The import bytes.
    pub bytes: Zeroizing<Vec<u8>>,
}

/// Checks a `C_CreateObject` template of class `CKO_PRIVATE_KEY` (RSA with
/// every component, EC with `CKA_EC_PARAMS` and `CKA_VALUE`, Ed25519 with
/// its 32-byte seed as `CKA_VALUE`) or `CKO_CERTIFICATE` (X.509, its DER
/// as `CKA_VALUE`).
///
/// # Errors
/// `CKR_TEMPLATE_INCOMPLETE`, `CKR_ATTRIBUTE_VALUE_INVALID`,
/// `CKR_ATTRIBUTE_TYPE_INVALID`.
pub fn check_import<'a>(
    class: CK_OBJECT_CLASS,
    attrs: &[(CK_ATTRIBUTE_TYPE, &'a [u8])],
) -> Result<Import<'a>, Rv> {
    let mut t = PairTemplate {
        sign: true,
        decrypt: true,
        derive: true,
        token: class == CKO_CERTIFICATE,
        ..PairTemplate::default()
    };
    let mut key_type = None;
    let mut f: [&[u8]; 8] = [&[]; 8];
    let (mut value, mut params) = (None, None);
    for (ty, v) in attrs {
        let v: &'a [u8] = v;
        let slot = match *ty {
            CKA_MODULUS => Some(0),
            CKA_PUBLIC_EXPONENT => Some(1),
            CKA_PRIVATE_EXPONENT => Some(2),
            CKA_PRIME_1 => Some(3),
            CKA_PRIME_2 => Some(4),
            CKA_EXPONENT_1 => Some(5),
            CKA_EXPONENT_2 => Some(6),
            CKA_COEFFICIENT => Some(7),
            _ => None,
        };
        match (*ty, slot) {
            (_, Some(i)) => f[i] = v,
            (CKA_KEY_TYPE, _) => key_type = Some(as_ulong(v)?),
            (CKA_VALUE, _) => value = Some(v),
            (CKA_EC_PARAMS, _) => params = Some(v),
            (CKA_CERTIFICATE_TYPE, _) if class == CKO_CERTIFICATE => {
                if as_ulong(v)? != CKC_X_509 {
                    return Err(CKR_ATTRIBUTE_VALUE_INVALID);
                }
            }
            (
                CKA_ISSUER
                | CKA_SERIAL_NUMBER
                | CKA_CERTIFICATE_CATEGORY
                | CKA_CHECK_VALUE
                | CKA_URL
                | CKA_HASH_OF_SUBJECT_PUBLIC_KEY
                | CKA_HASH_OF_ISSUER_PUBLIC_KEY,
                _,
            ) if class == CKO_CERTIFICATE => {}
            (ty, _) => {
                if !common_key_attr(&mut t, ty, v, true)? {
                    return Err(CKR_ATTRIBUTE_TYPE_INVALID);
                }
            }
        }
    }
    let value = value.ok_or(CKR_TEMPLATE_INCOMPLETE);
    let enc = |fields: &[&[u8]]| -> Result<Zeroizing<Vec<u8>>, Rv> {
        let mut v = Zeroizing::new(vec![0u8; memveil_asym::components::encoded_len(fields)]);
        let n = memveil_asym::components::encode_into(fields, &mut v)
            .ok_or(CKR_ATTRIBUTE_VALUE_INVALID)?;
        v.truncate(n);
        Ok(v)
    };
    let (kind, bytes) = if class == CKO_CERTIFICATE {
        let der = value?;
        memveil_vault::keyfile::cert_fields(der).map_err(|_| CKR_ATTRIBUTE_VALUE_INVALID)?;
        (KeyKind::Cert, Zeroizing::new(der.to_vec()))
    } else {
        match key_type.ok_or(CKR_TEMPLATE_INCOMPLETE)? {
            CKK_RSA => {
                if f[..5].iter().any(|x| x.is_empty()) {
                    return Err(CKR_TEMPLATE_INCOMPLETE);
                }
                let kind = match memveil_vault::keyfile::rsa_bits(f[0]) {
                    2048 => KeyKind::Rsa2048,
                    3072 => KeyKind::Rsa3072,
                    4096 => KeyKind::Rsa4096,
                    _ => return Err(CKR_ATTRIBUTE_VALUE_INVALID),
                };
                (kind, enc(&f)?)
            }
            CKK_EC => {
                let kind = kind_of_params(params.ok_or(CKR_TEMPLATE_INCOMPLETE)?)?;
                if kind == KeyKind::Ed25519 {
                    return Err(CKR_ATTRIBUTE_VALUE_INVALID);
                }
                (kind, enc(&[value?])?)
            }
            CKK_EC_EDWARDS => {
                if params.is_some_and(|p| kind_of_params(p) != Ok(KeyKind::Ed25519)) {
                    return Err(CKR_CURVE_NOT_SUPPORTED);
                }
                let seed = value?;
                if seed.len() != 32 {
                    return Err(CKR_ATTRIBUTE_VALUE_INVALID);
                }
                (KeyKind::Ed25519, enc(&[seed])?)
            }
            _ => return Err(CKR_ATTRIBUTE_VALUE_INVALID),
        }
    };
    Ok(Import { t, kind, bytes })
}

/// `CK_ECDH1_DERIVE_PARAMS`, copied out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ecdh {
    /// The vault's KDF code (0 = `CKD_NULL`, else the hash's code).
    pub kdf: u8,
    /// `pSharedData`.
    pub shared: Vec<u8>,
    /// `pPublicData`: the peer's point (raw, or a DER OCTET STRING).
    pub peer: Vec<u8>,
}

impl Ecdh {
    /// From the parameter's fields.
    ///
    /// # Errors
    /// `CKR_MECHANISM_PARAM_INVALID` for a KDF the vault does not run.
    pub fn new(kdf: CK_EC_KDF_TYPE, shared: &[u8], public: &[u8]) -> Result<Self, Rv> {
        let kdf = match kdf {
            CKD_NULL => 0,
            CKD_SHA1_KDF => Hash::Sha1.code(),
            CKD_SHA224_KDF => Hash::Sha224.code(),
            CKD_SHA256_KDF => Hash::Sha256.code(),
            CKD_SHA384_KDF => Hash::Sha384.code(),
            CKD_SHA512_KDF => Hash::Sha512.code(),
            _ => return Err(CKR_MECHANISM_PARAM_INVALID),
        };
        if kdf == 0 && !shared.is_empty() {
            return Err(CKR_MECHANISM_PARAM_INVALID);
        }
        Ok(Self {
            kdf,
            shared: shared.to_vec(),
            peer: peer_point(public).to_vec(),
        })
    }
}

/// Whether `len` bytes are a whole encoded point of a curve the vault
/// holds (P-256, P-384): compressed `1 + f` or uncompressed `1 + 2f`.
fn is_point_len(len: usize) -> bool {
    matches!(len, 33 | 65 | 49 | 97)
}

/// The peer's point of `CK_ECDH1_DERIVE_PARAMS.pPublicData`: raw (what
/// PKCS#11 v2.40 says) or wrapped in a DER OCTET STRING (what some callers
/// pass). A raw point's first bytes can read like an OCTET STRING's header
/// (`04 3F 04…`: a P-256 point whose X starts with `3F 04`, one in 65,536),
/// so the bytes are unwrapped only when they are not a whole raw point
/// themselves, the tag is `04`, the DER length (short or long form,
/// minimal) covers exactly the rest, and the rest is a whole point. Any
/// other bytes are passed on as given: the vault checks the point is on the
/// key's curve.
#[must_use]
pub fn peer_point(public: &[u8]) -> &[u8] {
    if is_point_len(public.len()) {
        return public;
    }
    let inner = match public {
        [0x04, n @ 0..=0x7f, rest @ ..] if usize::from(*n) == rest.len() => rest,
        [0x04, 0x81, n @ 0x80..=0xff, rest @ ..] if usize::from(*n) == rest.len() => rest,
        _ => return public,
    };
    if is_point_len(inner.len()) && matches!(inner.first(), Some(2..=4)) {
        inner
    } else {
        public
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_templates() {
        let bits = (2048 as CK_ULONG).to_ne_bytes();
        let e = [1u8, 0, 1];
        let t = CK_TRUE;
        let pubt = [(CKA_MODULUS_BITS, &bits[..]), (CKA_PUBLIC_EXPONENT, &e[..])];
        let privt = [
            (CKA_TOKEN, std::slice::from_ref(&t)),
            (CKA_LABEL, &b"srv"[..]),
        ];
        let p = check_pair(CKM_RSA_PKCS_KEY_PAIR_GEN, &pubt, &privt).expect("rsa");
        assert_eq!(p.kind, Some(KeyKind::Rsa2048));
        assert!(p.token && p.label == b"srv");
        let bad = (1024 as CK_ULONG).to_ne_bytes();
        assert_eq!(
            check_pair(
                CKM_RSA_PKCS_KEY_PAIR_GEN,
                &[(CKA_MODULUS_BITS, &bad[..])],
                &[]
            )
            .err(),
            Some(CKR_ATTRIBUTE_VALUE_INVALID)
        );
        let ec = [(CKA_EC_PARAMS, ec_params(memveil_asym::Curve::P384))];
        assert_eq!(
            check_pair(CKM_EC_KEY_PAIR_GEN, &ec, &[]).expect("ec").kind,
            Some(KeyKind::P384)
        );
        assert_eq!(
            check_pair(CKM_EC_KEY_PAIR_GEN, &[(CKA_EC_PARAMS, &[6, 1, 1][..])], &[]).err(),
            Some(CKR_CURVE_NOT_SUPPORTED)
        );
        let ext = [(CKA_EXTRACTABLE, std::slice::from_ref(&t))];
        assert_eq!(
            check_pair(CKM_EC_EDWARDS_KEY_PAIR_GEN, &[], &ext).err(),
            Some(CKR_ATTRIBUTE_VALUE_INVALID)
        );
    }

    /// An uncompressed point of `f`-byte coordinates whose X starts with
    /// `x0`.
    fn point(f: usize, x0: &[u8]) -> Vec<u8> {
        let mut p = vec![4u8];
        p.extend_from_slice(x0);
        p.extend((p.len()..=2 * f).map(|i| u8::try_from(i % 251).unwrap_or(0)));
        p
    }

    fn wrap(p: &[u8]) -> Vec<u8> {
        let mut w = vec![4u8, u8::try_from(p.len()).expect("short form")];
        w.extend_from_slice(p);
        w
    }

    #[test]
    fn ecdh_points_unwrap_from_octet_strings() {
        for raw in [point(32, &[7]), point(48, &[7]), point(32, &[0x41, 4])] {
            assert_eq!(Ecdh::new(CKD_NULL, &[], &wrap(&raw)).expect("ok").peer, raw);
            assert_eq!(Ecdh::new(CKD_NULL, &[], &raw).expect("ok").peer, raw);
        }
        // A compressed point, wrapped.
        let mut c = vec![2u8];
        c.extend([9u8; 32]);
        assert_eq!(peer_point(&wrap(&c)), &c[..]);
        // Not a whole point inside, or a length that does not cover the
        // rest: passed on as given (the vault refuses it).
        for odd in [vec![4u8, 4, 4, 1, 2, 3], vec![4u8, 66, 4, 1], vec![4u8]] {
            assert_eq!(peer_point(&odd), &odd[..]);
        }
        let raw = point(32, &[7]);
        assert!(Ecdh::new(CKD_NULL, b"x", &raw).is_err());
        assert_eq!(Ecdh::new(CKD_SHA256_KDF, b"x", &raw).expect("ok").kdf, 3);
    }

    /// Regression (issue 32): a raw P-256 point whose X starts with `3F 04`
    /// (P-384: `5F 04`) reads like an OCTET STRING of the rest; it was
    /// stripped of two bytes and the derivation failed (one ECDHE handshake
    /// in 65,536).
    #[test]
    fn a_raw_point_that_looks_like_an_octet_string_is_taken_raw() {
        for (f, x0) in [(32, [0x3f, 4]), (48, [0x5f, 4])] {
            let raw = point(f, &x0);
            assert_eq!(usize::from(raw[1]), raw.len() - 2, "looks wrapped");
            assert_eq!(Ecdh::new(CKD_NULL, &[], &raw).expect("ok").peer, raw);
            assert_eq!(peer_point(&wrap(&raw)), &raw[..]);
        }
    }
}
