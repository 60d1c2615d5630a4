//! Signatures and their verification (`C_Sign*`, `C_Verify*`).

use cryptoki_sys::*;

use super::*;

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
        if mm.mechanism != CKM_AES_CMAC {
            return Err(CKR_MECHANISM_INVALID);
        }
        if mm.ulParameterLen != 0 {
            return Err(CKR_MECHANISM_PARAM_INVALID);
        }
        let k = m.key(key, if sign { 2 } else { 3 })?;
        let mut g = lock(&s);
        let slot = if sign { &mut g.sign } else { &mut g.verify };
        if slot.is_some() {
            return Err(CKR_OPERATION_ACTIVE);
        }
        *slot = Some(MacOp::new(k.vault_id));
        Ok(())
    })
}

/// # Safety
/// `d` holds `dl` bytes.
unsafe fn mac_update(h: CK_SESSION_HANDLE, d: *const u8, dl: CK_ULONG, sign: bool) -> Rv {
    guard(|| {
        let (_, s) = session(h)?;
        let mut g = lock(&s);
        let slot = if sign { &mut g.sign } else { &mut g.verify };
        let op = slot.as_mut().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
        // SAFETY: the caller's part (contract).
        match unsafe { bytes(d, dl) } {
            Ok(part) => {
                op.update(part);
                Ok(())
            }
            Err(e) => {
                *slot = None;
                Err(e)
            }
        }
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
            // SAFETY: checked non-NULL and aligned.
            unsafe { *sl = 16 };
            return Ok(());
        }
        // SAFETY: the caller's data (contract).
        let r = unsafe { bytes(d, dl) }.and_then(|data| op.sign(&*m, data));
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
        op.verify(&*m, data, sig)
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
