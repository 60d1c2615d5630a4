//! Digests (`C_Digest*`), in this process; `C_DigestKey` through the vault.

use cryptoki_sys::*;

use super::*;
use crate::digest::DigestOp;

/// `C_DigestInit` (`CKM_SHA_1`, `CKM_SHA224`, `CKM_SHA256`, `CKM_SHA384`,
/// `CKM_SHA512`).
///
/// # Safety
/// `mech` as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_DigestInit(h: CK_SESSION_HANDLE, mech: *mut CK_MECHANISM) -> CK_RV {
    guard(|| {
        let (_, s) = session(h)?;
        // SAFETY: the caller's CK_MECHANISM.
        let mm = unsafe { read(mech.cast_const()) }?;
        let mut g = lock(&s);
        if g.digest.is_some() {
            return Err(CKR_OPERATION_ACTIVE);
        }
        if mm.ulParameterLen != 0 {
            return Err(CKR_MECHANISM_PARAM_INVALID);
        }
        g.digest = Some(DigestOp::new(mm.mechanism)?);
        Ok(())
    })
}

/// The shared end of `C_Digest` and `C_DigestFinal`: a NULL output asks
/// for the length and a short one gets `CKR_BUFFER_TOO_SMALL` (the
/// operation stays); anything else ends it.
///
/// # Safety
/// `d` holds `dl` bytes (single-part), `o` is NULL or holds `*ol`
/// writable bytes, `ol` is a writable `CK_ULONG`.
unsafe fn digest_end(
    h: CK_SESSION_HANDLE,
    single: Option<(*const u8, CK_ULONG)>,
    o: *mut u8,
    ol: *mut CK_ULONG,
) -> Rv {
    guard(|| {
        let (m, s) = session(h)?;
        let mut g = lock(&s);
        let op = g.digest.as_ref().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
        if ol.is_null() || !ol.is_aligned() {
            g.digest = None;
            return Err(CKR_ARGUMENTS_BAD);
        }
        let need = op.len() as CK_ULONG;
        // SAFETY: checked non-NULL and aligned.
        let have = unsafe { *ol };
        if o.is_null() || have < need {
            // SAFETY: as above.
            unsafe { *ol = need };
            return if o.is_null() {
                Ok(())
            } else {
                Err(CKR_BUFFER_TOO_SMALL)
            };
        }
        let mut op = g.digest.take().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
        if let Some((d, dl)) = single {
            if op.updated {
                return Err(CKR_OPERATION_ACTIVE);
            }
            // SAFETY: the caller's data (contract).
            op.update(unsafe { bytes(d, dl) }?)?;
        }
        let out = op.finish(&*m)?;
        // SAFETY: `o` holds `*ol >= need` writable bytes (contract).
        unsafe { give(o, ol, &out) }
    })
}

/// `C_Digest`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_Digest(
    h: CK_SESSION_HANDLE,
    d: *mut CK_BYTE,
    dl: CK_ULONG,
    o: *mut CK_BYTE,
    ol: *mut CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { digest_end(h, Some((d.cast_const(), dl)), o, ol) }
}

/// `C_DigestUpdate`.
///
/// # Safety
/// `d` holds `dl` bytes.
#[no_mangle]
pub unsafe extern "C" fn C_DigestUpdate(
    h: CK_SESSION_HANDLE,
    d: *mut CK_BYTE,
    dl: CK_ULONG,
) -> CK_RV {
    guard(|| {
        let (_, s) = session(h)?;
        let mut g = lock(&s);
        let op = g.digest.as_mut().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
        // SAFETY: the caller's part (contract).
        let r = unsafe { bytes(d, dl) }.and_then(|p| op.update(p));
        if r.is_err() {
            g.digest = None;
        }
        r
    })
}

/// `C_DigestKey`: a generic secret key's bytes, digested in the vault
/// (with the data before and after them, at `C_DigestFinal`).
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_DigestKey(h: CK_SESSION_HANDLE, key: CK_OBJECT_HANDLE) -> CK_RV {
    guard(|| {
        let (m, s) = session(h)?;
        let k = m.object(key).map_err(|_| CKR_KEY_HANDLE_INVALID)?;
        let mut g = lock(&s);
        let op = g.digest.as_mut().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
        // AES keys: the vault keeps their schedules, not their bytes. A
        // secret longer than a hash block: HMAC uses its digest as the key,
        // so the vault refuses to give that digest out.
        let long = matches!(
            k.public.as_deref(),
            Some(memveil_vault::proto::PublicParts::SecretLen(n)) if *n > 64
        );
        let r = if k.kind == memveil_vault::proto::KeyKind::Secret && !long {
            op.add_key(k.vault_id)
        } else {
            Err(CKR_KEY_INDIGESTIBLE)
        };
        if r.is_err() {
            g.digest = None;
        }
        r
    })
}

/// `C_DigestFinal`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_DigestFinal(
    h: CK_SESSION_HANDLE,
    o: *mut CK_BYTE,
    ol: *mut CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { digest_end(h, None, o, ol) }
}
