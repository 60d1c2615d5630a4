//! Public-key operations: signature verification, RSA encryption and
//! verification with recovery, from a key's public half ([`Public`]). No
//! secret is involved: a PKCS#11 module runs these in its caller's process
//! with the public key it already holds.

use std::ffi::c_int;
use std::ptr;

use aws_lc_sys as sys;

use crate::backend::{
    backend_error, nid, oaep_setup, Bn, EcKey, EcPoint, EcdsaSig, Pkey, PkeyCtx, RsaKey,
};
use crate::{AsymError, Curve, Hash, Public};

/// How to verify a signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyScheme {
    /// RSA PKCS#1 v1.5: the signature's block type 1 content must equal
    /// the input (a `DigestInfo` for a signature).
    Pkcs1,
    /// Raw RSA (`CKM_RSA_X_509`): the signature raised to the public
    /// exponent must equal the input, left-padded to the modulus' bytes.
    Raw,
    /// RSA-PSS over a digest of `hash`, MGF1 with `mgf1`, `salt` bytes.
    Pss {
        /// The digest's hash.
        hash: Hash,
        /// MGF1's hash.
        mgf1: Hash,
        /// Salt length.
        salt: u32,
    },
    /// ECDSA over a digest; the signature is `r‖s`.
    Ecdsa,
    /// Ed25519 over the whole message.
    Ed25519,
}

/// How to encrypt with an RSA public key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncryptScheme<'a> {
    /// PKCS#1 v1.5 (block type 2, random padding).
    Pkcs1,
    /// OAEP with `hash`, MGF1 with `mgf1`, and a label.
    Oaep {
        /// OAEP's hash.
        hash: Hash,
        /// MGF1's hash.
        mgf1: Hash,
        /// The label.
        label: &'a [u8],
    },
    /// Raw RSA: the input, exactly the modulus' bytes.
    Raw,
}

enum Inner {
    Rsa(RsaKey),
    Ec(EcKey, Curve),
    Ed25519([u8; 32]),
}

/// A public key (aws-lc object), built from [`Public`].
pub struct PublicKey {
    inner: Inner,
}

// SAFETY: the aws-lc objects are owned by this value and only read by the
// public operations (aws-lc locks its lazily built Montgomery caches).
unsafe impl Send for PublicKey {}
// SAFETY: as above: every operation takes `&self`.
unsafe impl Sync for PublicKey {}

fn rejected(what: &str) -> AsymError {
    AsymError::Rejected(backend_error(what).to_string())
}

impl PublicKey {
    /// The key of `p`.
    ///
    /// # Errors
    /// [`AsymError::BadInput`] for a modulus, exponent or point aws-lc
    /// refuses (a point off the curve among them).
    pub fn new(p: &Public) -> Result<PublicKey, AsymError> {
        let inner = match p {
            Public::Rsa { n, e } => {
                let (n, e) = (Bn::from_be(n)?, Bn::from_be(e)?);
                // SAFETY: both live BIGNUMs, copied by the function, which
                // checks the key's form.
                let rsa = unsafe { sys::RSA_new_public_key(n.ptr(), e.ptr()) };
                Inner::Rsa(RsaKey::own(rsa, "RSA_new_public_key").map_err(|_| {
                    AsymError::BadInput("not an RSA public key (modulus or exponent refused)")
                })?)
            }
            Public::Ec { curve, point } => {
                // SAFETY: no preconditions; a NID aws-lc knows.
                let key = EcKey::own(
                    // SAFETY: no preconditions; a NID aws-lc knows.
                    unsafe { sys::EC_KEY_new_by_curve_name(nid(*curve)) },
                    "EC_KEY_new",
                )?;
                // SAFETY: a live key; its group lives as long as it does.
                let g = unsafe { sys::EC_KEY_get0_group(key.ptr()) };
                // SAFETY: a live group.
                let pt = EcPoint::own(unsafe { sys::EC_POINT_new(g) }, "EC_POINT_new")?;
                // SAFETY: live key, group and point; the point is decoded
                // (checked on the curve) and copied into the key.
                let ok = unsafe {
                    sys::EC_POINT_oct2point(
                        g,
                        pt.ptr(),
                        point.as_ptr(),
                        point.len(),
                        ptr::null_mut(),
                    ) == 1
                        && sys::EC_KEY_set_public_key(key.ptr(), pt.ptr()) == 1
                };
                if !ok {
                    return Err(AsymError::BadInput("not a point of the key's curve"));
                }
                Inner::Ec(key, *curve)
            }
            Public::Ed25519(pk) => Inner::Ed25519(*pk),
        };
        Ok(PublicKey { inner })
    }

    /// The modulus' bytes of an RSA key, the signature's bytes otherwise.
    #[must_use]
    pub fn block_len(&self) -> usize {
        match &self.inner {
            // SAFETY: live key.
            Inner::Rsa(r) => (unsafe { sys::RSA_size(r.ptr()) }) as usize,
            Inner::Ec(_, c) => 2 * c.field_bytes(),
            Inner::Ed25519(_) => 64,
        }
    }

    fn rsa(&self) -> Result<&RsaKey, AsymError> {
        match &self.inner {
            Inner::Rsa(r) => Ok(r),
            _ => Err(AsymError::BadInput("an RSA operation needs an RSA key")),
        }
    }

    /// The public operation on `sig` with aws-lc's `padding`; the
    /// recovered bytes into `out` (the modulus' bytes).
    fn open(&self, sig: &[u8], out: &mut [u8], padding: c_int) -> Result<usize, AsymError> {
        let r = self.rsa()?;
        let mut n = 0usize;
        // SAFETY: live key; `out` writable for its length; `sig` readable.
        let ok = unsafe {
            sys::RSA_verify_raw(
                r.ptr(),
                &mut n,
                out.as_mut_ptr(),
                out.len(),
                sig.as_ptr(),
                sig.len(),
                padding,
            )
        };
        if ok == 1 {
            Ok(n)
        } else {
            Err(rejected("RSA public operation"))
        }
    }

    /// What a signature recovers (`C_VerifyRecover`): the content of a
    /// PKCS#1 v1.5 block ([`VerifyScheme::Pkcs1`]) or the whole number
    /// ([`VerifyScheme::Raw`]).
    ///
    /// # Errors
    /// [`AsymError::Rejected`] for a signature that is not one;
    /// [`AsymError::BadInput`] for another scheme or key.
    pub fn recover(&self, scheme: VerifyScheme, sig: &[u8]) -> Result<Vec<u8>, AsymError> {
        let padding = match scheme {
            VerifyScheme::Pkcs1 => sys::RSA_PKCS1_PADDING,
            VerifyScheme::Raw => sys::RSA_NO_PADDING,
            _ => return Err(AsymError::BadInput("recovery needs RSA PKCS#1 or raw")),
        };
        let mut out = vec![0u8; self.block_len()];
        let n = self.open(sig, &mut out, padding)?;
        out.truncate(n);
        Ok(out)
    }

    /// Checks `sig` over `input` (the digest, the `DigestInfo`, or the
    /// message for Ed25519).
    ///
    /// # Errors
    /// [`AsymError::Rejected`] for a signature that does not verify;
    /// [`AsymError::BadInput`] for a scheme of another key type.
    pub fn verify(&self, scheme: VerifyScheme, input: &[u8], sig: &[u8]) -> Result<(), AsymError> {
        let bad = || AsymError::Rejected("signature does not verify".into());
        match (&self.inner, scheme) {
            (Inner::Rsa(_), VerifyScheme::Pkcs1) => {
                let got = self.recover(scheme, sig)?;
                if got == input {
                    Ok(())
                } else {
                    Err(bad())
                }
            }
            (Inner::Rsa(_), VerifyScheme::Raw) => {
                let k = self.block_len();
                if input.len() > k || sig.len() != k {
                    return Err(bad());
                }
                let got = self.recover(scheme, sig)?;
                let pad = k - input.len();
                if got.len() == k && got[..pad].iter().all(|b| *b == 0) && got[pad..] == *input {
                    Ok(())
                } else {
                    Err(bad())
                }
            }
            (Inner::Rsa(r), VerifyScheme::Pss { hash, mgf1, salt }) => {
                if input.len() != hash.len() {
                    return Err(AsymError::BadInput(
                        "PSS digest of the wrong length for its hash",
                    ));
                }
                let salt =
                    c_int::try_from(salt).map_err(|_| AsymError::BadInput("PSS salt too long"))?;
                // SAFETY: live key; digest and signature readable; the
                // hashes are static tables.
                let ok = unsafe {
                    sys::RSA_verify_pss_mgf1(
                        r.ptr(),
                        input.as_ptr(),
                        input.len(),
                        hash.md(),
                        mgf1.md(),
                        salt,
                        sig.as_ptr(),
                        sig.len(),
                    )
                };
                // SAFETY: clears this thread's error queue.
                unsafe { sys::ERR_clear_error() };
                if ok == 1 {
                    Ok(())
                } else {
                    Err(bad())
                }
            }
            (Inner::Ec(key, curve), VerifyScheme::Ecdsa) => {
                let f = curve.field_bytes();
                if sig.len() != 2 * f {
                    return Err(bad());
                }
                if input.is_empty() || input.len() > 64 {
                    return Err(AsymError::BadInput("an ECDSA digest is 1 to 64 bytes"));
                }
                let (r, s) = (Bn::from_be(&sig[..f])?, Bn::from_be(&sig[f..])?);
                // SAFETY: no preconditions.
                let es = EcdsaSig::own(unsafe { sys::ECDSA_SIG_new() }, "ECDSA_SIG_new")?;
                // SAFETY: a live signature object; set0 takes r and s over
                // on success only, so they are given up after it.
                if unsafe { sys::ECDSA_SIG_set0(es.ptr(), r.ptr(), s.ptr()) } != 1 {
                    return Err(backend_error("ECDSA_SIG_set0"));
                }
                let _ = (r.into_raw(), s.into_raw());
                // SAFETY: live signature and key; the digest is readable.
                let ok = unsafe {
                    let ok = sys::ECDSA_do_verify(input.as_ptr(), input.len(), es.ptr(), key.ptr());
                    sys::ERR_clear_error();
                    ok
                };
                if ok == 1 {
                    Ok(())
                } else {
                    Err(bad())
                }
            }
            (Inner::Ed25519(pk), VerifyScheme::Ed25519) => {
                let Ok(sig) = <&[u8; 64]>::try_from(sig) else {
                    return Err(bad());
                };
                // SAFETY: message readable, 64-byte signature, 32-byte key.
                let ok = unsafe {
                    sys::ED25519_verify(input.as_ptr(), input.len(), sig.as_ptr(), pk.as_ptr())
                };
                if ok == 1 {
                    Ok(())
                } else {
                    Err(bad())
                }
            }
            _ => Err(AsymError::BadInput(
                "this signature scheme is not one of the key's type",
            )),
        }
    }

    /// Encrypts `input` with an RSA key; returns the ciphertext (the
    /// modulus' bytes).
    ///
    /// # Errors
    /// [`AsymError::BadInput`] for a message too long for the scheme or a
    /// key that is not RSA.
    pub fn encrypt(&self, scheme: EncryptScheme<'_>, input: &[u8]) -> Result<Vec<u8>, AsymError> {
        let r = self.rsa()?;
        let k = self.block_len();
        let mut out = vec![0u8; k];
        let too_long = || AsymError::BadInput("message too long for the key and padding");
        let mut n = 0usize;
        let padding = match scheme {
            EncryptScheme::Pkcs1 => {
                if input.len() + 11 > k {
                    return Err(too_long());
                }
                sys::RSA_PKCS1_PADDING
            }
            EncryptScheme::Raw => {
                if input.len() != k {
                    return Err(AsymError::BadInput(
                        "raw RSA takes exactly the modulus' bytes",
                    ));
                }
                sys::RSA_NO_PADDING
            }
            EncryptScheme::Oaep { hash, mgf1, label } => {
                if input.len() + 2 * hash.len() + 2 > k {
                    return Err(too_long());
                }
                return oaep(r, hash, mgf1, label, input, out);
            }
        };
        // SAFETY: live key; `out` holds k bytes; `input` readable.
        let ok = unsafe {
            sys::RSA_encrypt(
                r.ptr(),
                &mut n,
                out.as_mut_ptr(),
                out.len(),
                input.as_ptr(),
                input.len(),
                padding,
            )
        };
        if ok != 1 {
            return Err(rejected("RSA encryption (input not below the modulus?)"));
        }
        out.truncate(n);
        Ok(out)
    }
}

fn oaep(
    r: &RsaKey,
    hash: Hash,
    mgf1: Hash,
    label: &[u8],
    input: &[u8],
    mut out: Vec<u8>,
) -> Result<Vec<u8>, AsymError> {
    // SAFETY: no preconditions.
    let pkey = Pkey::own(unsafe { sys::EVP_PKEY_new() }, "EVP_PKEY_new")?;
    // SAFETY: live EVP_PKEY and RSA key; set1 takes its own reference.
    if unsafe { sys::EVP_PKEY_set1_RSA(pkey.ptr(), r.ptr()) } != 1 {
        return Err(backend_error("EVP_PKEY_set1_RSA"));
    }
    let ctx = PkeyCtx::own(
        // SAFETY: a live EVP_PKEY; the context takes its own reference.
        unsafe { sys::EVP_PKEY_CTX_new(pkey.ptr(), ptr::null_mut()) },
        "EVP_PKEY_CTX_new",
    )?;
    let mut n = out.len();
    // SAFETY: a live context (`oaep_setup`'s contract), initialised for
    // encryption first; `out` holds the modulus' bytes and `n` says so on
    // entry; `input` is readable.
    let ok = unsafe {
        sys::EVP_PKEY_encrypt_init(ctx.ptr()) == 1
            && oaep_setup(ctx.ptr(), hash, mgf1, label)
            && sys::EVP_PKEY_encrypt(
                ctx.ptr(),
                out.as_mut_ptr(),
                &mut n,
                input.as_ptr(),
                input.len(),
            ) == 1
    };
    if ok {
        out.truncate(n);
        Ok(out)
    } else {
        Err(backend_error("OAEP encryption"))
    }
}
