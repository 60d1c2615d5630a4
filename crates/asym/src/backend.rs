//! Keys and operations over aws-lc. Every `unsafe` block here calls aws-lc
//! on objects this module owns (created here, freed in `Drop`) with buffers
//! whose lengths were checked first.

use std::ffi::{c_int, c_uint};
use std::ptr::{self, NonNull};

use aws_lc_sys as sys;
use zeroize::{Zeroize as _, Zeroizing};

use crate::components::{self, RSA_FIELDS};
use crate::{Algorithm, AsymError, Curve, Hash, Public};

/// How to sign.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignScheme {
    /// RSA PKCS#1 v1.5 (block type 1) over the input as given: a
    /// `DigestInfo` for a signature, at most `k - 11` bytes.
    Pkcs1,
    /// RSA-PSS over a digest of `hash`, MGF1 with `mgf1`, `salt` bytes of salt.
    Pss {
        /// The digest's hash.
        hash: Hash,
        /// MGF1's hash.
        mgf1: Hash,
        /// Salt length.
        salt: u32,
    },
    /// Raw RSA (`CKM_RSA_X_509`): the input, `k` bytes below the modulus,
    /// raised to the private exponent (TLS's PSS path through an engine).
    Raw,
    /// ECDSA over a digest; the signature is `r‖s`, each the field's bytes.
    Ecdsa,
    /// Ed25519 over the whole message.
    Ed25519,
}

/// How to decrypt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecryptScheme<'a> {
    /// PKCS#1 v1.5 with implicit rejection: a bad padding gives a synthetic
    /// message, never an error.
    Pkcs1,
    /// OAEP with `hash`, MGF1 with `mgf1`, and a label.
    Oaep {
        /// OAEP's hash.
        hash: Hash,
        /// MGF1's hash.
        mgf1: Hash,
        /// The label (usually empty).
        label: &'a [u8],
    },
    /// Raw RSA (`CKM_RSA_X_509`).
    Raw,
}

pub(crate) fn backend_error(what: &str) -> AsymError {
    let mut buf = [0u8; 256];
    // SAFETY: ERR_get_error reads this thread's error queue;
    // ERR_error_string_n writes at most `buf.len()` bytes, NUL-terminated.
    let code = unsafe { sys::ERR_get_error() };
    let text = if code == 0 {
        String::from("no detail")
    } else {
        // SAFETY: as above.
        unsafe { sys::ERR_error_string_n(code, buf.as_mut_ptr().cast(), buf.len()) };
        let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    };
    // SAFETY: clears this thread's queue; no pointers involved.
    unsafe { sys::ERR_clear_error() };
    AsymError::Backend(format!("{what}: {text}"))
}

/// An aws-lc object owned here, freed by its destructor: every early
/// return (a refused key, a failed call) frees what was built before it,
/// so a refused request leaves the secret heap as it found it.
macro_rules! owned {
    ($(#[$doc:meta])* $name:ident, $ty:ty, $free:path) => {
        $(#[$doc])*
        pub(crate) struct $name(NonNull<$ty>);

        impl $name {
            /// Takes ownership of `p`, or reports the aws-lc error of `what`
            /// when it is NULL.
            pub(crate) fn own(p: *mut $ty, what: &str) -> Result<Self, AsymError> {
                NonNull::new(p).map(Self).ok_or_else(|| backend_error(what))
            }

            pub(crate) fn ptr(&self) -> *mut $ty {
                self.0.as_ptr()
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: the object is owned by this value (taken from the
                // constructor that made it) and freed once, here.
                unsafe { $free(self.0.as_ptr()) }
            }
        }
    };
}

owned!(
    /// A BIGNUM (freed, and so wiped, on drop: aws-lc's free wipes, and the
    /// secret heap wipes again).
    Bn,
    sys::BIGNUM,
    sys::BN_free
);
owned!(
    /// An RSA key.
    RsaKey,
    sys::RSA,
    sys::RSA_free
);
owned!(
    /// An EVP_PKEY.
    Pkey,
    sys::EVP_PKEY,
    sys::EVP_PKEY_free
);
owned!(
    /// An EVP_PKEY_CTX.
    PkeyCtx,
    sys::EVP_PKEY_CTX,
    sys::EVP_PKEY_CTX_free
);
owned!(
    /// An EC key.
    EcKey,
    sys::EC_KEY,
    sys::EC_KEY_free
);
owned!(
    /// An EC point.
    EcPoint,
    sys::EC_POINT,
    sys::EC_POINT_free
);
owned!(
    /// A BN_CTX.
    BnCtx,
    sys::BN_CTX,
    sys::BN_CTX_free
);
owned!(
    /// An ECDSA signature.
    EcdsaSig,
    sys::ECDSA_SIG,
    sys::ECDSA_SIG_free
);

impl Bn {
    pub(crate) fn from_be(b: &[u8]) -> Result<Bn, AsymError> {
        // SAFETY: `b` is readable for its length; a NULL `ret` asks for a
        // new BIGNUM.
        let p = unsafe { sys::BN_bin2bn(b.as_ptr(), b.len(), ptr::null_mut()) };
        Bn::own(p, "BN_bin2bn")
    }
    fn new() -> Result<Bn, AsymError> {
        // SAFETY: no preconditions.
        Bn::own(unsafe { sys::BN_new() }, "BN_new")
    }
    /// Gives the BIGNUM up (to a function that takes ownership).
    pub(crate) fn into_raw(self) -> *mut sys::BIGNUM {
        let p = self.0.as_ptr();
        std::mem::forget(self);
        p
    }
}

/// Big-endian bytes of `bn`, exactly `len` long (left-padded), into `out`.
fn bn_padded(bn: *const sys::BIGNUM, out: &mut [u8]) -> Result<(), AsymError> {
    // SAFETY: `bn` is a live BIGNUM of a key we own; `out` is writable.
    let ok = unsafe { sys::BN_bn2bin_padded(out.as_mut_ptr(), out.len(), bn) };
    if ok == 1 {
        Ok(())
    } else {
        Err(AsymError::BadInput("a number longer than its field"))
    }
}

/// Minimal big-endian bytes of a public number.
fn bn_public(bn: *const sys::BIGNUM) -> Vec<u8> {
    // SAFETY: `bn` is a live BIGNUM; BN_bn2bin writes BN_num_bytes bytes.
    unsafe {
        let n = sys::BN_num_bytes(bn) as usize;
        let mut v = vec![0u8; n];
        sys::BN_bn2bin(bn, v.as_mut_ptr());
        v
    }
}

struct Rsa {
    /// The same key as an EVP_PKEY (its own reference), for OAEP.
    pkey: Pkey,
    rsa: RsaKey,
    /// SHA-256 of the private exponent, `k` bytes big-endian: the key of
    /// implicit rejection's derivation.
    d_hash: [u8; 32],
    k: usize,
}

impl Drop for Rsa {
    fn drop(&mut self) {
        // The aws-lc objects free themselves (fields drop after this).
        self.d_hash.zeroize();
    }
}

struct Ec {
    key: EcKey,
    curve: Curve,
}

enum Inner {
    Rsa(Rsa),
    Ec(Ec),
    /// RFC 8032 seed ‖ public key, as `ED25519_sign` takes it.
    Ed25519([u8; 64]),
}

/// A private key. No `Clone`, no `Debug` of key bytes; freed and wiped on
/// drop. Its aws-lc objects live wherever aws-lc allocates: the secret heap
/// once [`crate::use_secret_heap`] ran.
pub struct PrivateKey {
    alg: Algorithm,
    inner: Inner,
}

// SAFETY: aws-lc's RSA and EC_KEY objects may be used from several threads
// at once for private-key operations (their lazily built caches are behind
// aws-lc's own locks); the Ed25519 bytes are only read after construction.
unsafe impl Send for PrivateKey {}
// SAFETY: as above: every operation takes `&self` and aws-lc synchronises
// its internal state.
unsafe impl Sync for PrivateKey {}

impl std::fmt::Debug for PrivateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PrivateKey({:?})", self.alg)
    }
}

impl Drop for PrivateKey {
    fn drop(&mut self) {
        // RSA and EC keys free (and wipe) themselves.
        if let Inner::Ed25519(sk) = &mut self.inner {
            sk.zeroize();
        }
    }
}

pub(crate) fn nid(c: Curve) -> c_int {
    match c {
        Curve::P256 => sys::NID_X9_62_prime256v1,
        Curve::P384 => sys::NID_secp384r1,
    }
}

impl Rsa {
    fn wrap(rsa: RsaKey) -> Result<Rsa, AsymError> {
        // SAFETY: no preconditions.
        let pkey = Pkey::own(unsafe { sys::EVP_PKEY_new() }, "EVP_PKEY_new")?;
        // SAFETY: both live; set1 takes its own reference to the RSA key.
        if unsafe { sys::EVP_PKEY_set1_RSA(pkey.ptr(), rsa.ptr()) } != 1 {
            return Err(backend_error("EVP_PKEY_set1_RSA"));
        }
        // SAFETY: live key.
        let k = unsafe { sys::RSA_size(rsa.ptr()) } as usize;
        // SAFETY: live key; RSA_get0_d returns its exponent (non-NULL for a
        // private key, checked).
        let dp = unsafe { sys::RSA_get0_d(rsa.ptr()) };
        if dp.is_null() {
            return Err(AsymError::Backend(
                "RSA key without a private exponent".into(),
            ));
        }
        let mut r = Rsa {
            pkey,
            rsa,
            d_hash: [0; 32],
            k,
        };
        let mut d = Zeroizing::new(vec![0u8; k]);
        bn_padded(dp, &mut d)?;
        // SAFETY: `d` is readable, `d_hash` holds 32 bytes.
        unsafe { sys::SHA256(d.as_ptr(), d.len(), r.d_hash.as_mut_ptr()) };
        Ok(r)
    }

    fn generate(bits: u32) -> Result<Rsa, AsymError> {
        // SAFETY: no preconditions.
        let rsa = RsaKey::own(unsafe { sys::RSA_new() }, "RSA_new")?;
        // SAFETY: a live, empty key that generation fills.
        if unsafe { sys::RSA_generate_key_fips(rsa.ptr(), bits as c_int, ptr::null_mut()) } != 1 {
            return Err(backend_error("RSA_generate_key_fips"));
        }
        Rsa::wrap(rsa)
    }

    fn from_fields(alg: Algorithm, f: &[&[u8]]) -> Result<Rsa, AsymError> {
        let bad = |why: &str| AsymError::BadKey {
            alg,
            why: why.into(),
        };
        if f.len() != RSA_FIELDS {
            return Err(bad("RSA components are n, e, d, p, q, dp, dq, qinv"));
        }
        let n: Vec<Bn> = f[..5]
            .iter()
            .map(|b| Bn::from_be(b))
            .collect::<Result<_, _>>()?;
        // The size before anything else is built (the modulus' bits).
        // SAFETY: a live BIGNUM.
        let bits = unsafe { sys::BN_num_bits(n[0].ptr()) };
        if Some(bits) != alg.rsa_bits() {
            return Err(bad(&format!("the modulus has {bits} bits")));
        }
        let (dp, dq, qinv) = if f[5].is_empty() || f[6].is_empty() || f[7].is_empty() {
            crt_params(&n[2], &n[3], &n[4])?
        } else {
            (Bn::from_be(f[5])?, Bn::from_be(f[6])?, Bn::from_be(f[7])?)
        };
        // SAFETY: every argument is a live BIGNUM; the function copies them
        // and checks the key's consistency (RSA_check_key).
        let rsa = unsafe {
            sys::RSA_new_private_key(
                n[0].ptr(),
                n[1].ptr(),
                n[2].ptr(),
                n[3].ptr(),
                n[4].ptr(),
                dp.ptr(),
                dq.ptr(),
                qinv.ptr(),
            )
        };
        let rsa = RsaKey::own(rsa, "RSA_new_private_key")
            .map_err(|e| bad(&format!("inconsistent components ({e})")))?;
        let r = Rsa::wrap(rsa)?;
        // SAFETY: live key.
        let bits = unsafe { sys::RSA_bits(r.rsa.ptr()) };
        if Some(bits) != alg.rsa_bits() {
            return Err(bad(&format!("the modulus has {bits} bits")));
        }
        Ok(r)
    }

    fn fields(&self, out: &mut [u8]) -> Result<usize, AsymError> {
        let (mut n, mut e, mut d) = (ptr::null(), ptr::null(), ptr::null());
        let (mut p, mut q) = (ptr::null(), ptr::null());
        let (mut dp, mut dq, mut qi) = (ptr::null(), ptr::null(), ptr::null());
        // SAFETY: live key; the getters store borrowed pointers.
        unsafe {
            sys::RSA_get0_key(self.rsa.ptr(), &mut n, &mut e, &mut d);
            sys::RSA_get0_factors(self.rsa.ptr(), &mut p, &mut q);
            sys::RSA_get0_crt_params(self.rsa.ptr(), &mut dp, &mut dq, &mut qi);
        }
        let all = [n, e, d, p, q, dp, dq, qi];
        if all.iter().any(|x| x.is_null()) {
            return Err(AsymError::Backend("RSA key without CRT parameters".into()));
        }
        // SAFETY: every pointer is a live BIGNUM of this key (checked above).
        let lens = all.map(|bn| unsafe { sys::BN_num_bytes(bn) } as usize);
        let mut bufs = Zeroizing::new(vec![0u8; lens.iter().sum()]);
        let mut at = 0;
        let mut spans = Vec::new();
        for (bn, l) in all.iter().zip(lens) {
            bn_padded(*bn, &mut bufs[at..at + l])?;
            spans.push((at, l));
            at += l;
        }
        let fields: Vec<&[u8]> = spans.iter().map(|(a, l)| &bufs[*a..a + l]).collect();
        components::encode_into(&fields, out).ok_or(AsymError::ShortOutput {
            got: out.len(),
            need: components::encoded_len(&fields),
        })
    }

    fn public(&self) -> Public {
        // SAFETY: live key; n and e are always present.
        unsafe {
            Public::Rsa {
                n: bn_public(sys::RSA_get0_n(self.rsa.ptr())),
                e: bn_public(sys::RSA_get0_e(self.rsa.ptr())),
            }
        }
    }

    /// The private operation over `input` with aws-lc's `padding`
    /// (`RSA_NO_PADDING`: raw; `RSA_PKCS1_PADDING`: block type 1); `out`
    /// holds k bytes (checked by the caller). aws-lc checks the input is
    /// below the modulus and runs the blinded, constant-time operation.
    fn private(&self, input: &[u8], out: &mut [u8], padding: c_int) -> Option<usize> {
        let mut n = 0usize;
        // SAFETY: live key; `out` holds k writable bytes; `input` is readable.
        let ok = unsafe {
            sys::RSA_sign_raw(
                self.rsa.ptr(),
                &mut n,
                out.as_mut_ptr(),
                out.len(),
                input.as_ptr(),
                input.len(),
                padding,
            )
        };
        (ok == 1).then_some(n)
    }

    fn raw(&self, input: &[u8], out: &mut [u8]) -> Result<usize, AsymError> {
        if input.len() != self.k {
            return Err(AsymError::BadInput(
                "raw RSA takes exactly the modulus' bytes",
            ));
        }
        self.private(input, out, sys::RSA_NO_PADDING)
            .ok_or_else(|| {
                AsymError::Rejected(
                    backend_error("raw RSA (input not below the modulus?)").to_string(),
                )
            })
    }

    fn sign_pkcs1(&self, input: &[u8], out: &mut [u8]) -> Result<usize, AsymError> {
        if input.len() + 11 > self.k {
            return Err(AsymError::BadInput(
                "PKCS#1 v1.5 input longer than k - 11 bytes",
            ));
        }
        self.private(input, out, sys::RSA_PKCS1_PADDING)
            .ok_or_else(|| backend_error("RSA PKCS#1 v1.5 signature"))
    }

    fn sign_pss(
        &self,
        hash: Hash,
        mgf1: Hash,
        salt: u32,
        digest: &[u8],
        out: &mut [u8],
    ) -> Result<usize, AsymError> {
        if digest.len() != hash.len() {
            return Err(AsymError::BadInput(
                "PSS digest of the wrong length for its hash",
            ));
        }
        let salt = c_int::try_from(salt).map_err(|_| AsymError::BadInput("PSS salt too long"))?;
        let mut n = 0usize;
        // SAFETY: live key; `out` holds k bytes; the digest is readable; the
        // hashes are static method tables. aws-lc checks the salt fits.
        let ok = unsafe {
            sys::RSA_sign_pss_mgf1(
                self.rsa.ptr(),
                &mut n,
                out.as_mut_ptr(),
                out.len(),
                digest.as_ptr(),
                digest.len(),
                hash.md(),
                mgf1.md(),
                salt,
            )
        };
        if ok == 1 {
            Ok(n)
        } else {
            Err(backend_error(
                "RSA-PSS signature (salt too long for the key?)",
            ))
        }
    }

    fn decrypt_oaep(
        &self,
        hash: Hash,
        mgf1: Hash,
        label: &[u8],
        input: &[u8],
        out: &mut [u8],
    ) -> Result<usize, AsymError> {
        if input.len() != self.k {
            return Err(AsymError::BadInput("OAEP ciphertext of the wrong length"));
        }
        // SAFETY: a live EVP_PKEY; the context takes its own reference.
        let ctx = PkeyCtx::own(
            unsafe { sys::EVP_PKEY_CTX_new(self.pkey.ptr(), ptr::null_mut()) },
            "EVP_PKEY_CTX_new",
        )?;
        let ctx = ctx.ptr();
        // SAFETY: a live context (freed by its owner); each call checks it;
        // `oaep_setup` copies the label into a buffer the context takes over;
        // `out` holds k bytes and `n` says so on entry.
        let ok = unsafe {
            let ok = sys::EVP_PKEY_decrypt_init(ctx) == 1 && oaep_setup(ctx, hash, mgf1, label);
            let mut n = out.len();
            (ok && sys::EVP_PKEY_decrypt(
                ctx,
                out.as_mut_ptr(),
                &mut n,
                input.as_ptr(),
                input.len(),
            ) == 1)
                .then_some(n)
        };
        ok.ok_or_else(|| AsymError::Rejected(backend_error("OAEP").to_string()))
    }

    fn decrypt_pkcs1(&self, input: &[u8], out: &mut [u8]) -> Result<usize, AsymError> {
        let mut em = Zeroizing::new(vec![0u8; self.k]);
        let n = self.raw(input, &mut em)?;
        if n != self.k {
            return Err(AsymError::Backend(
                "raw RSA output of the wrong length".into(),
            ));
        }
        let kdk = Zeroizing::new(hmac_sha256(&self.d_hash, input));
        crate::implicit::decode(&em, &kdk, &hmac_sha256, out).ok_or(AsymError::ShortOutput {
            got: out.len(),
            need: self.k,
        })
    }
}

/// Sets OAEP padding, its hash, MGF1's hash and the label on `ctx`;
/// whether all took.
///
/// # Safety
/// `ctx` is a live context of an RSA key, initialised for encryption or
/// decryption.
pub(crate) unsafe fn oaep_setup(
    ctx: *mut sys::EVP_PKEY_CTX,
    hash: Hash,
    mgf1: Hash,
    label: &[u8],
) -> bool {
    // SAFETY: `ctx` is live (this function's contract); the hashes are
    // static tables; the label is copied into an OPENSSL_malloc'd buffer
    // the context takes over (set0), freed here if it does not.
    unsafe {
        let mut ok = sys::EVP_PKEY_CTX_set_rsa_padding(ctx, sys::RSA_PKCS1_OAEP_PADDING) == 1
            && sys::EVP_PKEY_CTX_set_rsa_oaep_md(ctx, hash.md()) == 1
            && sys::EVP_PKEY_CTX_set_rsa_mgf1_md(ctx, mgf1.md()) == 1;
        if ok && !label.is_empty() {
            let l = sys::OPENSSL_malloc(label.len()).cast::<u8>();
            ok = !l.is_null();
            if ok {
                ptr::copy_nonoverlapping(label.as_ptr(), l, label.len());
                ok = sys::EVP_PKEY_CTX_set0_rsa_oaep_label(ctx, l, label.len()) == 1;
                if !ok {
                    sys::OPENSSL_free(l.cast());
                }
            }
        }
        ok
    }
}

/// dp, dq and qinv from d, p and q (an ssh-agent key carries no dp, dq).
/// Variable-time arithmetic, once, at import (docs/vault.md says so).
fn crt_params(d: &Bn, p: &Bn, q: &Bn) -> Result<(Bn, Bn, Bn), AsymError> {
    let (dp, dq, qinv, pm1, qm1) = (Bn::new()?, Bn::new()?, Bn::new()?, Bn::new()?, Bn::new()?);
    // SAFETY: no preconditions.
    let ctx = BnCtx::own(unsafe { sys::BN_CTX_new() }, "BN_CTX_new")?;
    let ctx = ctx.ptr();
    // SAFETY: all live BIGNUMs and a live context.
    let ok = unsafe {
        sys::BN_sub(pm1.ptr(), p.ptr(), sys::BN_value_one()) == 1
            && sys::BN_sub(qm1.ptr(), q.ptr(), sys::BN_value_one()) == 1
            && sys::BN_div(ptr::null_mut(), dp.ptr(), d.ptr(), pm1.ptr(), ctx) == 1
            && sys::BN_div(ptr::null_mut(), dq.ptr(), d.ptr(), qm1.ptr(), ctx) == 1
            && !sys::BN_mod_inverse(qinv.ptr(), q.ptr(), p.ptr(), ctx).is_null()
    };
    if ok {
        Ok((dp, dq, qinv))
    } else {
        Err(backend_error("computing the CRT parameters"))
    }
}

fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    let mut n: c_uint = 0;
    // SAFETY: key and message readable; `out` holds SHA-256's 32 bytes.
    unsafe {
        sys::HMAC(
            sys::EVP_sha256(),
            key.as_ptr().cast(),
            key.len(),
            msg.as_ptr(),
            msg.len(),
            out.as_mut_ptr(),
            &mut n,
        );
    }
    out
}

impl Ec {
    fn group(&self) -> *const sys::EC_GROUP {
        // SAFETY: live key with a group.
        unsafe { sys::EC_KEY_get0_group(self.key.ptr()) }
    }

    fn new_key(curve: Curve) -> Result<EcKey, AsymError> {
        // SAFETY: no preconditions; the NID is one aws-lc knows.
        let k = unsafe { sys::EC_KEY_new_by_curve_name(nid(curve)) };
        EcKey::own(k, "EC_KEY_new_by_curve_name")
    }

    fn generate(curve: Curve) -> Result<Ec, AsymError> {
        let key = Ec::new_key(curve)?;
        // SAFETY: live key with its group.
        if unsafe { sys::EC_KEY_generate_key_fips(key.ptr()) } != 1 {
            return Err(backend_error("EC_KEY_generate_key_fips"));
        }
        Ok(Ec { key, curve })
    }

    fn from_scalar(alg: Algorithm, curve: Curve, s: &[u8]) -> Result<Ec, AsymError> {
        let bad = |why: String| AsymError::BadKey { alg, why };
        if s.is_empty() || s.len() > curve.field_bytes() {
            return Err(bad(format!(
                "an EC private key is a scalar of at most {} bytes",
                curve.field_bytes()
            )));
        }
        let d = Bn::from_be(s)?;
        let ec = Ec {
            key: Ec::new_key(curve)?,
            curve,
        };
        let g = ec.group();
        // SAFETY: a live group.
        let pt = EcPoint::own(unsafe { sys::EC_POINT_new(g) }, "EC_POINT_new")?;
        // SAFETY: live key, group, point and BIGNUM; the point is set as the
        // public key (copied). EC_POINT_mul with a secret scalar and no other
        // inputs is aws-lc's constant-time base point multiplication.
        let ok = unsafe {
            sys::EC_KEY_set_private_key(ec.key.ptr(), d.ptr()) == 1
                && sys::EC_POINT_mul(
                    g,
                    pt.ptr(),
                    d.ptr(),
                    ptr::null(),
                    ptr::null(),
                    ptr::null_mut(),
                ) == 1
                && sys::EC_KEY_set_public_key(ec.key.ptr(), pt.ptr()) == 1
                && sys::EC_KEY_check_key(ec.key.ptr()) == 1
        };
        if ok {
            Ok(ec)
        } else {
            Err(bad(format!(
                "the scalar is not a private key of {curve:?} ({})",
                backend_error("EC_KEY_check_key")
            )))
        }
    }

    fn public(&self) -> Public {
        let mut point = vec![0u8; 1 + 2 * self.curve.field_bytes()];
        // SAFETY: live key and group; the buffer holds an uncompressed point.
        let n = unsafe {
            sys::EC_POINT_point2oct(
                self.group(),
                sys::EC_KEY_get0_public_key(self.key.ptr()),
                sys::point_conversion_form_t::POINT_CONVERSION_UNCOMPRESSED,
                point.as_mut_ptr(),
                point.len(),
                ptr::null_mut(),
            )
        };
        point.truncate(n);
        Public::Ec {
            curve: self.curve,
            point,
        }
    }

    fn scalar(&self, out: &mut [u8]) -> Result<(), AsymError> {
        // SAFETY: live key with a private scalar.
        let d = unsafe { sys::EC_KEY_get0_private_key(self.key.ptr()) };
        if d.is_null() {
            return Err(AsymError::Backend("EC key without a private scalar".into()));
        }
        bn_padded(d, out)
    }

    fn sign(&self, digest: &[u8], out: &mut [u8]) -> Result<usize, AsymError> {
        let f = self.curve.field_bytes();
        if digest.is_empty() || digest.len() > 64 {
            return Err(AsymError::BadInput("an ECDSA digest is 1 to 64 bytes"));
        }
        if out.len() < 2 * f {
            return Err(AsymError::ShortOutput {
                got: out.len(),
                need: 2 * f,
            });
        }
        // SAFETY: live key; the digest is readable.
        let sig = unsafe { sys::ECDSA_do_sign(digest.as_ptr(), digest.len(), self.key.ptr()) };
        let sig = EcdsaSig::own(sig, "ECDSA_do_sign")?;
        let (mut r, mut s) = (ptr::null(), ptr::null());
        // SAFETY: a live signature; the getter stores borrowed pointers.
        unsafe { sys::ECDSA_SIG_get0(sig.ptr(), &mut r, &mut s) };
        bn_padded(r, &mut out[..f])?;
        bn_padded(s, &mut out[f..2 * f])?;
        Ok(2 * f)
    }

    fn ecdh(&self, peer: &[u8], out: &mut [u8]) -> Result<usize, AsymError> {
        let f = self.curve.field_bytes();
        if out.len() < f {
            return Err(AsymError::ShortOutput {
                got: out.len(),
                need: f,
            });
        }
        let g = self.group();
        // SAFETY: a live group.
        let pt = EcPoint::own(unsafe { sys::EC_POINT_new(g) }, "EC_POINT_new")?;
        // SAFETY: live key, group and point; decoding checks the point is on
        // the curve; `out` holds f bytes.
        let n = unsafe {
            if sys::EC_POINT_oct2point(g, pt.ptr(), peer.as_ptr(), peer.len(), ptr::null_mut()) == 1
            {
                sys::ECDH_compute_key(out.as_mut_ptr().cast(), f, pt.ptr(), self.key.ptr(), None)
            } else {
                -1
            }
        };
        if n == c_int::try_from(f).unwrap_or(-1) {
            Ok(f)
        } else {
            Err(AsymError::Rejected(
                backend_error("the peer's public point").to_string(),
            ))
        }
    }
}

impl PrivateKey {
    /// A new key, generated with aws-lc's DRBG (RSA: e = 65537, FIPS 186-4
    /// generation with its pairwise check).
    ///
    /// # Errors
    /// [`AsymError::Backend`] (the secret heap full, among others).
    pub fn generate(alg: Algorithm) -> Result<PrivateKey, AsymError> {
        crate::heap::ready()?;
        let inner = match (alg.rsa_bits(), alg.curve()) {
            (Some(bits), _) => Inner::Rsa(Rsa::generate(bits)?),
            (_, Some(c)) => Inner::Ec(Ec::generate(c)?),
            _ => {
                let mut sk = [0u8; 64];
                let mut pk = [0u8; 32];
                // SAFETY: both buffers have the sizes the function writes.
                unsafe { sys::ED25519_keypair(pk.as_mut_ptr(), sk.as_mut_ptr()) };
                Inner::Ed25519(sk)
            }
        };
        Ok(PrivateKey { alg, inner })
    }

    /// A key from its private components ([`components`]); checked for
    /// consistency and for the declared size or curve.
    ///
    /// # Errors
    /// [`AsymError::BadKey`] naming what is wrong.
    pub fn from_components(alg: Algorithm, bytes: &[u8]) -> Result<PrivateKey, AsymError> {
        let bad = |why: &str| AsymError::BadKey {
            alg,
            why: why.into(),
        };
        let f = components::decode(bytes).map_err(|e| bad(&e.to_string()))?;
        crate::heap::ready()?;
        let inner = match (alg.rsa_bits(), alg.curve()) {
            (Some(_), _) => Inner::Rsa(Rsa::from_fields(alg, &f)?),
            (_, Some(c)) => match f.as_slice() {
                [s] => Inner::Ec(Ec::from_scalar(alg, c, s)?),
                _ => return Err(bad("an EC key is one field, the scalar")),
            },
            _ => match f.as_slice() {
                [seed] if seed.len() == 32 => {
                    let mut sk = [0u8; 64];
                    let mut pk = [0u8; 32];
                    // SAFETY: `seed` is 32 readable bytes; the outputs have
                    // the sizes the function writes.
                    unsafe {
                        sys::ED25519_keypair_from_seed(
                            pk.as_mut_ptr(),
                            sk.as_mut_ptr(),
                            seed.as_ptr(),
                        );
                    }
                    Inner::Ed25519(sk)
                }
                _ => return Err(bad("an Ed25519 key is one field, the 32-byte seed")),
            },
        };
        Ok(PrivateKey { alg, inner })
    }

    /// The key's type.
    #[must_use]
    pub fn algorithm(&self) -> Algorithm {
        self.alg
    }

    /// The public half.
    #[must_use]
    pub fn public(&self) -> Public {
        match &self.inner {
            Inner::Rsa(r) => r.public(),
            Inner::Ec(e) => e.public(),
            Inner::Ed25519(sk) => {
                let mut pk = [0u8; 32];
                pk.copy_from_slice(&sk[32..]);
                Public::Ed25519(pk)
            }
        }
    }

    /// Bytes [`PrivateKey::components`] writes (at most).
    #[must_use]
    pub fn components_len(&self) -> usize {
        match &self.inner {
            Inner::Rsa(r) => 2 * 8 + 7 * r.k + 8,
            Inner::Ec(e) => 2 + e.curve.field_bytes(),
            Inner::Ed25519(_) => 2 + 32,
        }
    }

    /// Writes the private components into `out` (secret memory: the vault
    /// seals them into its keystore); returns the bytes written.
    ///
    /// # Errors
    /// [`AsymError::ShortOutput`].
    pub fn components(&self, out: &mut [u8]) -> Result<usize, AsymError> {
        match &self.inner {
            Inner::Rsa(r) => r.fields(out),
            Inner::Ec(e) => {
                let mut s = Zeroizing::new(vec![0u8; e.curve.field_bytes()]);
                e.scalar(&mut s)?;
                components::encode_into(&[&s], out).ok_or(AsymError::ShortOutput {
                    got: out.len(),
                    need: 2 + s.len(),
                })
            }
            Inner::Ed25519(sk) => {
                components::encode_into(&[&sk[..32]], out).ok_or(AsymError::ShortOutput {
                    got: out.len(),
                    need: 34,
                })
            }
        }
    }

    fn need_out(&self, out: &[u8]) -> Result<(), AsymError> {
        let need = self.alg.max_output();
        if out.len() < need {
            Err(AsymError::ShortOutput {
                got: out.len(),
                need,
            })
        } else {
            Ok(())
        }
    }

    /// Signs `input` into `out` (at least [`Algorithm::max_output`] bytes);
    /// returns the signature's length.
    ///
    /// # Errors
    /// [`AsymError::WrongKey`] for a scheme of another key type,
    /// [`AsymError::BadInput`] for input the scheme cannot take.
    pub fn sign(
        &self,
        scheme: SignScheme,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<usize, AsymError> {
        self.need_out(out)?;
        crate::heap::ready()?;
        let wrong = || AsymError::WrongKey {
            op: "this signature scheme",
            alg: self.alg,
        };
        match (&self.inner, scheme) {
            (Inner::Rsa(r), SignScheme::Pkcs1) => r.sign_pkcs1(input, out),
            (Inner::Rsa(r), SignScheme::Pss { hash, mgf1, salt }) => {
                r.sign_pss(hash, mgf1, salt, input, out)
            }
            (Inner::Rsa(r), SignScheme::Raw) => r.raw(input, out),
            (Inner::Ec(e), SignScheme::Ecdsa) => e.sign(input, out),
            (Inner::Ed25519(sk), SignScheme::Ed25519) => {
                // SAFETY: `out` holds at least 64 bytes (need_out); the
                // message is readable; `sk` is the 64-byte private key.
                let ok = unsafe {
                    sys::ED25519_sign(out.as_mut_ptr(), input.as_ptr(), input.len(), sk.as_ptr())
                };
                if ok == 1 {
                    Ok(64)
                } else {
                    Err(backend_error("ED25519_sign"))
                }
            }
            _ => Err(wrong()),
        }
    }

    /// Decrypts `input` into `out` (at least the modulus' bytes); returns
    /// the message's length. PKCS#1 v1.5 never fails on a bad padding (it
    /// returns a synthetic message: implicit rejection).
    ///
    /// # Errors
    /// [`AsymError::WrongKey`] for a key that is not RSA;
    /// [`AsymError::Rejected`] for an OAEP ciphertext that does not decrypt
    /// or a raw input not below the modulus; [`AsymError::BadInput`] for a
    /// ciphertext of the wrong length.
    pub fn decrypt(
        &self,
        scheme: DecryptScheme<'_>,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<usize, AsymError> {
        self.need_out(out)?;
        crate::heap::ready()?;
        let Inner::Rsa(r) = &self.inner else {
            return Err(AsymError::WrongKey {
                op: "decryption",
                alg: self.alg,
            });
        };
        if input.len() != r.k {
            return Err(AsymError::BadInput(
                "an RSA ciphertext is exactly the modulus' bytes",
            ));
        }
        match scheme {
            DecryptScheme::Pkcs1 => r.decrypt_pkcs1(input, out),
            DecryptScheme::Oaep { hash, mgf1, label } => {
                r.decrypt_oaep(hash, mgf1, label, input, out)
            }
            DecryptScheme::Raw => r.raw(input, out),
        }
    }

    /// ECDH: the x-coordinate of the shared point with `peer` (an
    /// uncompressed or compressed point, checked to be on the curve), the
    /// field's bytes, into `out`.
    ///
    /// # Errors
    /// [`AsymError::WrongKey`] for a key that is not EC;
    /// [`AsymError::Rejected`] for a point not on the curve.
    pub fn ecdh(&self, peer: &[u8], out: &mut [u8]) -> Result<usize, AsymError> {
        crate::heap::ready()?;
        match &self.inner {
            Inner::Ec(e) => e.ecdh(peer, out),
            _ => Err(AsymError::WrongKey {
                op: "ECDH",
                alg: self.alg,
            }),
        }
    }
}
