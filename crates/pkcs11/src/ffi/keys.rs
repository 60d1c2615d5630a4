//! Key generation, random numbers, and the functions not offered.

use std::ffi::c_void;

use cryptoki_sys::*;

use super::*;

/// `C_GenerateKey` (`CKM_AES_KEY_GEN`, `CKM_GENERIC_SECRET_KEY_GEN`): the
/// key is generated inside the vault.
///
/// # Safety
/// `mech`, `t` (n attributes) and `ph` as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_GenerateKey(
    h: CK_SESSION_HANDLE,
    mech: *mut CK_MECHANISM,
    t: *mut CK_ATTRIBUTE,
    n: CK_ULONG,
    ph: *mut CK_OBJECT_HANDLE,
) -> CK_RV {
    guard(|| {
        let (m, _) = session(h)?;
        // SAFETY: the caller's CK_MECHANISM.
        let mm = unsafe { read(mech.cast_const()) }?;
        let generic = match mm.mechanism {
            CKM_AES_KEY_GEN => false,
            CKM_GENERIC_SECRET_KEY_GEN => true,
            _ => return Err(CKR_MECHANISM_INVALID),
        };
        if mm.ulParameterLen != 0 {
            return Err(CKR_MECHANISM_PARAM_INVALID);
        }
        // SAFETY: the caller's template of `n` attributes (contract).
        let attrs = unsafe { template(t, n) }?;
        // SAFETY: checked by `out`.
        let p = unsafe { out(ph) }?;
        let (tpl, _) = check_template(&attrs, false, generic)?;
        if tpl.generic != generic {
            return Err(CKR_TEMPLATE_INCONSISTENT);
        }
        *p = m.create(h, &tpl, None)?;
        Ok(())
    })
}

/// `C_GenerateKeyPair` (`CKM_RSA_PKCS_KEY_PAIR_GEN` for 2048, 3072 and
/// 4096 bits, `CKM_EC_KEY_PAIR_GEN` for P-256 and P-384,
/// `CKM_EC_EDWARDS_KEY_PAIR_GEN` for Ed25519): generated inside the vault;
/// the private key is sensitive and never extractable.
///
/// # Safety
/// `mech`, the templates (`pn` and `sn` attributes) and the two handle
/// pointers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_GenerateKeyPair(
    h: CK_SESSION_HANDLE,
    mech: *mut CK_MECHANISM,
    pt: *mut CK_ATTRIBUTE,
    pn: CK_ULONG,
    st: *mut CK_ATTRIBUTE,
    sn: CK_ULONG,
    ph: *mut CK_OBJECT_HANDLE,
    sh: *mut CK_OBJECT_HANDLE,
) -> CK_RV {
    guard(|| {
        let (m, _) = session(h)?;
        // SAFETY: the caller's CK_MECHANISM.
        let mm = unsafe { read(mech.cast_const()) }?;
        if mm.ulParameterLen != 0 {
            return Err(CKR_MECHANISM_PARAM_INVALID);
        }
        // SAFETY: the caller's templates (contract).
        let public = unsafe { template(pt, pn) }?;
        // SAFETY: as above.
        let private = unsafe { template(st, sn) }?;
        if ph.is_null() || sh.is_null() || !ph.is_aligned() || !sh.is_aligned() {
            return Err(CKR_ARGUMENTS_BAD);
        }
        let t = crate::asym::check_pair(mm.mechanism, &public, &private)?;
        let (pubh, privh) = m.generate_pair(h, &t)?;
        // SAFETY: checked non-NULL and aligned; the caller's handle slots.
        unsafe {
            *ph = pubh;
            *sh = privh;
        }
        Ok(())
    })
}

/// `C_DeriveKey` (`CKM_ECDH1_DERIVE` with a P-256 or P-384 key, KDF
/// `CKD_NULL` or `CKD_SHA*_KDF`): the new AES key is made in the vault from
/// the shared secret, which never leaves it.
///
/// # Safety
/// `mech` (with its `CK_ECDH1_DERIVE_PARAMS` and the data it points to),
/// the template (`n` attributes) and `ph` as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_DeriveKey(
    h: CK_SESSION_HANDLE,
    mech: *mut CK_MECHANISM,
    base: CK_OBJECT_HANDLE,
    t: *mut CK_ATTRIBUTE,
    n: CK_ULONG,
    ph: *mut CK_OBJECT_HANDLE,
) -> CK_RV {
    guard(|| {
        let (m, _) = session(h)?;
        // SAFETY: the caller's CK_MECHANISM.
        let mm = unsafe { read(mech.cast_const()) }?;
        if mm.mechanism != CKM_ECDH1_DERIVE {
            return Err(CKR_MECHANISM_INVALID);
        }
        // SAFETY: the parameter's bytes (contract).
        let p = unsafe { bytes(mm.pParameter.cast_const().cast::<u8>(), mm.ulParameterLen) }?;
        if p.len() != std::mem::size_of::<CK_ECDH1_DERIVE_PARAMS>() {
            return Err(CKR_MECHANISM_PARAM_INVALID);
        }
        // SAFETY: `p` holds a whole CK_ECDH1_DERIVE_PARAMS (length checked).
        let e = unsafe { read(p.as_ptr().cast::<CK_ECDH1_DERIVE_PARAMS>()) }?;
        // SAFETY: the shared data and public data the parameters point to.
        let shared = unsafe { bytes(e.pSharedData.cast_const(), e.ulSharedDataLen) }?;
        // SAFETY: as above.
        let public = unsafe { bytes(e.pPublicData.cast_const(), e.ulPublicDataLen) }?;
        let ecdh = crate::asym::Ecdh::new(e.kdf, shared, public)?;
        // SAFETY: the caller's template (contract).
        let attrs = unsafe { template(t, n) }?;
        // SAFETY: checked by `out`.
        let out_h = unsafe { out(ph) }?;
        let (tpl, _) = check_template(&attrs, false, false)?;
        if tpl.generic {
            return Err(CKR_TEMPLATE_INCONSISTENT);
        }
        *out_h = m.derive(h, base, &ecdh, &tpl)?;
        Ok(())
    })
}

/// `C_SeedRandom`: the DRBG takes no caller seed. The arguments are
/// checked first (a NULL seed with a length is `CKR_ARGUMENTS_BAD`), as for
/// every entry point.
///
/// # Safety
/// `s` holds `l` bytes (only checked, never read).
#[no_mangle]
pub unsafe extern "C" fn C_SeedRandom(h: CK_SESSION_HANDLE, s: *mut CK_BYTE, l: CK_ULONG) -> CK_RV {
    guard(|| {
        session(h)?;
        // SAFETY: the caller's seed (contract); checked, not used.
        unsafe { bytes(s.cast_const(), l) }?;
        Err(CKR_RANDOM_SEED_NOT_SUPPORTED)
    })
}

/// `C_GenerateRandom`: memveil's CTR_DRBG.
///
/// # Safety
/// `p` holds `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn C_GenerateRandom(
    h: CK_SESSION_HANDLE,
    p: *mut CK_BYTE,
    len: CK_ULONG,
) -> CK_RV {
    guard(|| {
        let (m, _) = session(h)?;
        let n = usize::try_from(len).map_err(|_| CKR_ARGUMENTS_BAD)?;
        if n == 0 {
            return Ok(());
        }
        if p.is_null() || isize::try_from(n).is_err() {
            return Err(CKR_ARGUMENTS_BAD);
        }
        // SAFETY: `p` holds `n` writable bytes (contract), non-NULL.
        let buf = unsafe { std::slice::from_raw_parts_mut(p, n) };
        m.random(buf)
    })
}

/// `C_GetFunctionStatus`: legacy, as the standard says.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_GetFunctionStatus(h: CK_SESSION_HANDLE) -> CK_RV {
    guard(|| {
        session(h)?;
        Err(CKR_FUNCTION_NOT_PARALLEL)
    })
}

/// `C_CancelFunction`: legacy, as the standard says.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_CancelFunction(h: CK_SESSION_HANDLE) -> CK_RV {
    guard(|| {
        session(h)?;
        Err(CKR_FUNCTION_NOT_PARALLEL)
    })
}

/// `C_WaitForSlotEvent`: not supported.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_WaitForSlotEvent(
    _f: CK_FLAGS,
    _s: *mut CK_SLOT_ID,
    _r: *mut c_void,
) -> CK_RV {
    guard(|| {
        module()?;
        Err(CKR_FUNCTION_NOT_SUPPORTED)
    })
}

/// Entry points this module does not offer: after the usual
/// initialisation and session checks, `CKR_FUNCTION_NOT_SUPPORTED`.
macro_rules! unsupported {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        #[doc = concat!("`", stringify!($name), "`: not supported.")]
        ///
        /// # Safety
        /// None: no pointer is read.
        #[no_mangle]
        pub unsafe extern "C" fn $name(h: CK_SESSION_HANDLE, $($arg: $ty),*) -> CK_RV {
            $(let _ = $arg;)*
            guard(|| {
                session(h)?;
                Err(CKR_FUNCTION_NOT_SUPPORTED)
            })
        }
    )*};
}

unsupported! {
    C_SignRecoverInit(m: *mut CK_MECHANISM, k: CK_OBJECT_HANDLE);
    C_SignRecover(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_DigestEncryptUpdate(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_DecryptDigestUpdate(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_SignEncryptUpdate(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_DecryptVerifyUpdate(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_WrapKey(m: *mut CK_MECHANISM, w: CK_OBJECT_HANDLE, k: CK_OBJECT_HANDLE, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_UnwrapKey(m: *mut CK_MECHANISM, w: CK_OBJECT_HANDLE, d: *mut CK_BYTE, dl: CK_ULONG, t: *mut CK_ATTRIBUTE, n: CK_ULONG, ph: *mut CK_OBJECT_HANDLE);
}
