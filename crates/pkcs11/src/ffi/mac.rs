//! Signatures and their verification (`C_Sign*`, `C_Verify*`,
//! `C_VerifyRecover*`).

use cryptoki_sys::*;

use super::*;
use crate::asym::{AsymSign, SignParams};
use crate::core::{SignOp, VerifyOp};
use crate::hmac::{hmac_hash, HmacOp};
use crate::object::cap;
use crate::public::AsymVerify;

/// The parameters of an asymmetric signature mechanism, copied out.
///
/// # Safety
/// `mm`'s parameter holds `ulParameterLen` bytes.
unsafe fn sign_params(mm: &CK_MECHANISM) -> Result<SignParams, Rv> {
    // SAFETY: the parameter's bytes (contract).
    let p = unsafe { bytes(mm.pParameter.cast_const().cast::<u8>(), mm.ulParameterLen) }?;
    Ok(if p.is_empty() {
        SignParams::None
    } else if p.len() == std::mem::size_of::<CK_RSA_PKCS_PSS_PARAMS>() {
        // SAFETY: `p` holds a whole CK_RSA_PKCS_PSS_PARAMS (length checked).
        let pss = unsafe { read(p.as_ptr().cast::<CK_RSA_PKCS_PSS_PARAMS>()) }?;
        SignParams::Pss {
            hash: pss.hashAlg,
            mgf: pss.mgf,
            salt: pss.sLen,
        }
    } else if mm.mechanism == CKM_EDDSA && p.len() == std::mem::size_of::<CK_EDDSA_PARAMS>() {
        // SAFETY: `p` holds a whole CK_EDDSA_PARAMS (length checked).
        let e = unsafe { read(p.as_ptr().cast::<CK_EDDSA_PARAMS>()) }?;
        // Pure Ed25519 only: no prehash, no context.
        if e.phFlag != 0 || e.ulContextDataLen != 0 {
            return Err(CKR_MECHANISM_PARAM_INVALID);
        }
        SignParams::None
    } else {
        return Err(CKR_MECHANISM_PARAM_INVALID);
    })
}

/// # Safety
/// `mech` as PKCS#11 states.
unsafe fn mac_init(
    h: CK_SESSION_HANDLE,
    mech: *const CK_MECHANISM,
    key: CK_OBJECT_HANDLE,
    sign: bool,
) -> Rv {
    guard(|| {
        let (m, s) = session(h)?;
        // SAFETY: the caller's CK_MECHANISM.
        let mm = unsafe { read(mech) }?;
        let want = if sign { cap::SIGN } else { cap::VERIFY };
        if crate::asym::is_sign_mech(mm.mechanism) {
            // SAFETY: the caller's parameter (contract).
            let params = unsafe { sign_params(&mm) }?;
            let mut g;
            if sign {
                let k = m.key(key, want)?;
                let op = AsymSign::new(mm.mechanism, params, k.vault_id, k.kind)?;
                g = lock(&s);
                if g.sign.is_some() {
                    return Err(CKR_OPERATION_ACTIVE);
                }
                g.sign = Some(SignOp::Asym(op));
            } else {
                // Verification runs here, with the public key object's key.
                let (k, pk) = m.public_key(key, want)?;
                let op = AsymVerify::new(mm.mechanism, params, pk, k.kind)?;
                g = lock(&s);
                if g.verify.is_some() {
                    return Err(CKR_OPERATION_ACTIVE);
                }
                g.verify = Some(VerifyOp::Asym(op));
            }
            return Ok(());
        }
        if let Some(hash) = hmac_hash(mm.mechanism) {
            if mm.ulParameterLen != 0 {
                return Err(CKR_MECHANISM_PARAM_INVALID);
            }
            let k = m.key(key, want)?;
            if k.kind != memveil_vault::proto::KeyKind::Secret {
                return Err(CKR_KEY_TYPE_INCONSISTENT);
            }
            let op = HmacOp::new(k.vault_id, hash);
            let mut g = lock(&s);
            if sign {
                if g.sign.is_some() {
                    return Err(CKR_OPERATION_ACTIVE);
                }
                g.sign = Some(SignOp::Hmac(op));
            } else {
                if g.verify.is_some() {
                    return Err(CKR_OPERATION_ACTIVE);
                }
                g.verify = Some(VerifyOp::Hmac(op));
            }
            return Ok(());
        }
        if mm.mechanism != CKM_AES_CMAC {
            return Err(CKR_MECHANISM_INVALID);
        }
        if mm.ulParameterLen != 0 {
            return Err(CKR_MECHANISM_PARAM_INVALID);
        }
        let k = m.key(key, want)?;
        if k.class != CKO_SECRET_KEY || k.kind == memveil_vault::proto::KeyKind::Secret {
            return Err(CKR_KEY_TYPE_INCONSISTENT);
        }
        let mut g = lock(&s);
        if sign {
            if g.sign.is_some() {
                return Err(CKR_OPERATION_ACTIVE);
            }
            g.sign = Some(SignOp::Cmac(MacOp::new(k.vault_id)));
        } else {
            if g.verify.is_some() {
                return Err(CKR_OPERATION_ACTIVE);
            }
            g.verify = Some(VerifyOp::Cmac(MacOp::new(k.vault_id)));
        }
        Ok(())
    })
}

/// # Safety
/// `d` holds `dl` bytes.
unsafe fn mac_update(h: CK_SESSION_HANDLE, d: *const u8, dl: CK_ULONG, sign: bool) -> Rv {
    guard(|| {
        let (_, s) = session(h)?;
        let mut g = lock(&s);
        // SAFETY: the caller's part (contract).
        let part = unsafe { bytes(d, dl) };
        if !sign {
            let op = g.verify.as_mut().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
            let r = part.and_then(|p| match op {
                VerifyOp::Cmac(c) => {
                    c.update(p);
                    Ok(())
                }
                VerifyOp::Hmac(c) => c.update(p),
                VerifyOp::Asym(a) => a.update(p),
            });
            if r.is_err() {
                g.verify = None;
            }
            return r;
        }
        let op = g.sign.as_mut().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
        let r = part.and_then(|p| match op {
            SignOp::Cmac(c) => {
                c.update(p);
                Ok(())
            }
            SignOp::Hmac(c) => c.update(p),
            SignOp::Asym(a) => a.update(p),
        });
        if r.is_err() {
            g.sign = None;
        }
        r
    })
}

/// # Safety
/// `d` holds `dl` bytes; `sig`/`sl` as for [`give`].
unsafe fn sign(
    h: CK_SESSION_HANDLE,
    d: *const u8,
    dl: CK_ULONG,
    sig: *mut u8,
    sl: *mut CK_ULONG,
) -> Rv {
    guard(|| {
        let (m, s) = session(h)?;
        let mut g = lock(&s);
        let op = g.sign.as_ref().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
        if sl.is_null() || !sl.is_aligned() {
            g.sign = None;
            return Err(CKR_ARGUMENTS_BAD);
        }
        if sig.is_null() {
            let n = match op {
                SignOp::Cmac(_) => 16,
                SignOp::Hmac(c) => c.mac_len(),
                SignOp::Asym(a) => a.sig_len(),
            };
            // SAFETY: checked non-NULL and aligned.
            unsafe { *sl = n as CK_ULONG };
            return Ok(());
        }
        // SAFETY: the caller's data (contract).
        let r = unsafe { bytes(d, dl) }.and_then(|data| match op {
            SignOp::Cmac(c) => c
                .sign(&*m, data)
                .map(|t| zeroize::Zeroizing::new(t.to_vec())),
            SignOp::Hmac(c) => c.sign(&*m, data),
            SignOp::Asym(a) => a.sign(&*m, data),
        });
        let tag = match r {
            Ok(t) => t,
            Err(e) => {
                g.sign = None;
                return Err(e);
            }
        };
        // SAFETY: `sig` holds `*sl` writable bytes (contract).
        unsafe { give(sig, sl, &tag) }?;
        g.sign = None;
        Ok(())
    })
}

/// # Safety
/// `d` holds `dl` bytes, `sig` holds `sl` bytes.
unsafe fn verify(
    h: CK_SESSION_HANDLE,
    d: *const u8,
    dl: CK_ULONG,
    sig: *const u8,
    sl: CK_ULONG,
) -> Rv {
    guard(|| {
        let (m, s) = session(h)?;
        let mut g = lock(&s);
        let op = g.verify.take().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
        // SAFETY: the caller's data and signature (contract).
        let data = unsafe { bytes(d, dl) }?;
        // SAFETY: as above.
        let sig = unsafe { bytes(sig, sl) }?;
        if sig.is_empty() && sl == 0 {
            return Err(CKR_SIGNATURE_LEN_RANGE);
        }
        match op {
            VerifyOp::Cmac(c) => c.verify(&*m, data, sig),
            VerifyOp::Hmac(c) => c.verify(&*m, data, sig),
            VerifyOp::Asym(a) => a.verify(data, sig),
        }
    })
}

/// `C_SignInit` (`CKM_AES_CMAC`).
///
/// # Safety
/// `mech` as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_SignInit(
    h: CK_SESSION_HANDLE,
    mech: *mut CK_MECHANISM,
    key: CK_OBJECT_HANDLE,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { mac_init(h, mech, key, true) }
}

/// `C_Sign`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_Sign(
    h: CK_SESSION_HANDLE,
    d: *mut CK_BYTE,
    dl: CK_ULONG,
    sig: *mut CK_BYTE,
    sl: *mut CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { sign(h, d, dl, sig, sl) }
}

/// `C_SignUpdate`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_SignUpdate(
    h: CK_SESSION_HANDLE,
    d: *mut CK_BYTE,
    dl: CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { mac_update(h, d, dl, true) }
}

/// `C_SignFinal`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_SignFinal(
    h: CK_SESSION_HANDLE,
    sig: *mut CK_BYTE,
    sl: *mut CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { sign(h, std::ptr::null(), 0, sig, sl) }
}

/// `C_VerifyInit` (`CKM_AES_CMAC`).
///
/// # Safety
/// `mech` as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_VerifyInit(
    h: CK_SESSION_HANDLE,
    mech: *mut CK_MECHANISM,
    key: CK_OBJECT_HANDLE,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { mac_init(h, mech, key, false) }
}

/// `C_Verify`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_Verify(
    h: CK_SESSION_HANDLE,
    d: *mut CK_BYTE,
    dl: CK_ULONG,
    sig: *mut CK_BYTE,
    sl: CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { verify(h, d, dl, sig, sl) }
}

/// `C_VerifyUpdate`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_VerifyUpdate(
    h: CK_SESSION_HANDLE,
    d: *mut CK_BYTE,
    dl: CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { mac_update(h, d, dl, false) }
}

/// `C_VerifyFinal`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_VerifyFinal(
    h: CK_SESSION_HANDLE,
    sig: *mut CK_BYTE,
    sl: CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { verify(h, std::ptr::null(), 0, sig, sl) }
}

/// `C_VerifyRecoverInit` (`CKM_RSA_PKCS`, `CKM_RSA_X_509`, with an RSA
/// public key object).
///
/// # Safety
/// `mech` as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_VerifyRecoverInit(
    h: CK_SESSION_HANDLE,
    mech: *mut CK_MECHANISM,
    key: CK_OBJECT_HANDLE,
) -> CK_RV {
    guard(|| {
        let (m, s) = session(h)?;
        // SAFETY: the caller's CK_MECHANISM.
        let mm = unsafe { read(mech.cast_const()) }?;
        if !crate::public::is_recover_mech(mm.mechanism) {
            return Err(CKR_MECHANISM_INVALID);
        }
        if mm.ulParameterLen != 0 {
            return Err(CKR_MECHANISM_PARAM_INVALID);
        }
        let (k, pk) = m.public_key(key, cap::VERIFY)?;
        let op = AsymVerify::new(mm.mechanism, SignParams::None, pk, k.kind)?;
        let mut g = lock(&s);
        if g.recover.is_some() {
            return Err(CKR_OPERATION_ACTIVE);
        }
        g.recover = Some(op);
        Ok(())
    })
}

/// `C_VerifyRecover`: the data a signature carries.
///
/// # Safety
/// `sig` holds `sl` bytes; `o` is NULL or holds `*ol` writable bytes; `ol` is a writable `CK_ULONG`.
#[no_mangle]
pub unsafe extern "C" fn C_VerifyRecover(
    h: CK_SESSION_HANDLE,
    sig: *mut CK_BYTE,
    sl: CK_ULONG,
    o: *mut CK_BYTE,
    ol: *mut CK_ULONG,
) -> CK_RV {
    guard(|| {
        let (_, s) = session(h)?;
        let mut g = lock(&s);
        let op = g.recover.as_ref().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
        if ol.is_null() || !ol.is_aligned() {
            g.recover = None;
            return Err(CKR_ARGUMENTS_BAD);
        }
        if o.is_null() {
            // SAFETY: checked non-NULL and aligned.
            unsafe { *ol = op.recover_bound() as CK_ULONG };
            return Ok(());
        }
        // SAFETY: the caller's signature (contract).
        let r = unsafe { bytes(sig, sl) }.and_then(|sig| op.recover(sig));
        let data = match r {
            Ok(d) => d,
            Err(e) => {
                g.recover = None;
                return Err(e);
            }
        };
        // SAFETY: `o` holds `*ol` writable bytes (contract).
        unsafe { give(o, ol, &data) }?;
        g.recover = None;
        Ok(())
    })
}
