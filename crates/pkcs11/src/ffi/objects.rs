//! Objects: create, copy, destroy, attributes, search.

use cryptoki_sys::*;

use super::*;

/// `C_CreateObject`: imports an AES key (its bytes go from the caller's
/// template straight to the vault's socket), a private key (its components
/// copied once into memory wiped after the import) or a certificate into
/// the vault.
///
/// # Safety
/// `t` holds `n` attributes; `ph` is NULL or a writable handle.
#[no_mangle]
pub unsafe extern "C" fn C_CreateObject(
    h: CK_SESSION_HANDLE,
    t: *mut CK_ATTRIBUTE,
    n: CK_ULONG,
    ph: *mut CK_OBJECT_HANDLE,
) -> CK_RV {
    guard(|| {
        let (m, _) = session(h)?;
        // SAFETY: the caller's template of `n` attributes (contract).
        let attrs = unsafe { template(t, n) }?;
        let class = attrs
            .iter()
            .find(|(ty, _)| *ty == CKA_CLASS)
            .and_then(|(_, v)| <[u8; std::mem::size_of::<CK_ULONG>()]>::try_from(*v).ok())
            .map(CK_ULONG::from_ne_bytes);
        match class {
            Some(c @ (CKO_PRIVATE_KEY | CKO_CERTIFICATE)) => {
                // SAFETY: checked by `out`.
                let p = unsafe { out(ph) }?;
                let i = crate::asym::check_import(c, &attrs)?;
                *p = m.import(h, &i)?;
                Ok(())
            }
            Some(CKO_DATA) => {
                // SAFETY: checked by `out`.
                let p = unsafe { out(ph) }?;
                let (token, d) = crate::data::check_data(&attrs)?;
                *p = m.create_data(h, token, &d)?;
                Ok(())
            }
            // A public key alone: a session object held here.
            Some(CKO_PUBLIC_KEY) => {
                // SAFETY: checked by `out`.
                let p = unsafe { out(ph) }?;
                let i = crate::public::check_public_import(&attrs)?;
                *p = m.add_public(h, i)?;
                Ok(())
            }
            // SAFETY: passed on from the caller's contract.
            _ => unsafe { create(&m, h, t, n, ph, true) },
        }
    })
}

/// The shared body of `C_CreateObject` (`import`) and `C_GenerateKey`.
///
/// # Safety
/// `t` holds `n` attributes; `ph` is NULL or a writable handle.
pub(crate) unsafe fn create(
    m: &Module,
    h: CK_SESSION_HANDLE,
    t: *const CK_ATTRIBUTE,
    n: CK_ULONG,
    ph: *mut CK_OBJECT_HANDLE,
    import: bool,
) -> Result<(), Rv> {
    // SAFETY: the caller's template of `n` attributes (contract).
    let attrs = unsafe { template(t, n) }?;
    // SAFETY: checked by `out`.
    let p = unsafe { out(ph) }?;
    let (tpl, value) = check_template(&attrs, import, false)?;
    *p = m.create(h, &tpl, value)?;
    Ok(())
}

/// `C_CopyObject`: not supported (keys are not copyable).
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_CopyObject(
    h: CK_SESSION_HANDLE,
    _o: CK_OBJECT_HANDLE,
    _t: *mut CK_ATTRIBUTE,
    _n: CK_ULONG,
    _ph: *mut CK_OBJECT_HANDLE,
) -> CK_RV {
    guard(|| {
        session(h)?;
        Err(CKR_FUNCTION_NOT_SUPPORTED)
    })
}

/// `C_DestroyObject`: destroys the key in the vault.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_DestroyObject(h: CK_SESSION_HANDLE, o: CK_OBJECT_HANDLE) -> CK_RV {
    guard(|| {
        let (m, _) = session(h)?;
        m.destroy(h, o)
    })
}

/// `C_GetObjectSize`: unavailable.
///
/// # Safety
/// `size` is NULL or a writable `CK_ULONG`.
#[no_mangle]
pub unsafe extern "C" fn C_GetObjectSize(
    h: CK_SESSION_HANDLE,
    o: CK_OBJECT_HANDLE,
    size: *mut CK_ULONG,
) -> CK_RV {
    guard(|| {
        let (m, _) = session(h)?;
        m.object(o)?;
        // SAFETY: checked by `out`.
        *unsafe { out(size) }? = CK_UNAVAILABLE_INFORMATION;
        Ok(())
    })
}

/// `C_GetAttributeValue`: `CKA_VALUE` is `CKR_ATTRIBUTE_SENSITIVE`, always.
///
/// # Safety
/// `t` holds `n` writable attributes whose `pValue` (when not NULL) holds
/// `ulValueLen` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn C_GetAttributeValue(
    h: CK_SESSION_HANDLE,
    o: CK_OBJECT_HANDLE,
    t: *mut CK_ATTRIBUTE,
    n: CK_ULONG,
) -> CK_RV {
    guard(|| {
        let (m, _) = session(h)?;
        let obj = m.object(o)?;
        let n = usize::try_from(n).map_err(|_| CKR_ARGUMENTS_BAD)?;
        if n > 0 && t.is_null() {
            return Err(CKR_ARGUMENTS_BAD);
        }
        let mut rv = CKR_OK;
        for i in 0..n {
            // SAFETY: `i < n` attributes the caller promised, checked by `out`.
            let a = unsafe { out(t.add(i)) }?;
            match obj.attr(a.type_) {
                Attr::Sensitive => {
                    a.ulValueLen = CK_UNAVAILABLE_INFORMATION;
                    rv = CKR_ATTRIBUTE_SENSITIVE;
                }
                Attr::Invalid => {
                    a.ulValueLen = CK_UNAVAILABLE_INFORMATION;
                    rv = CKR_ATTRIBUTE_TYPE_INVALID;
                }
                Attr::Value(v) => {
                    let mut len = a.ulValueLen;
                    // SAFETY: `pValue` holds `ulValueLen` writable bytes (contract).
                    match unsafe { give(a.pValue.cast::<u8>(), &mut len, &v) } {
                        Ok(()) => a.ulValueLen = len,
                        Err(e) => {
                            a.ulValueLen = CK_UNAVAILABLE_INFORMATION;
                            rv = e;
                        }
                    }
                }
            }
        }
        if rv == CKR_OK {
            Ok(())
        } else {
            Err(rv)
        }
    })
}

/// `C_SetAttributeValue`: a data object's attributes change; keys,
/// certificates and the rest are not modifiable.
///
/// # Safety
/// `t` holds `n` attributes.
#[no_mangle]
pub unsafe extern "C" fn C_SetAttributeValue(
    h: CK_SESSION_HANDLE,
    o: CK_OBJECT_HANDLE,
    t: *mut CK_ATTRIBUTE,
    n: CK_ULONG,
) -> CK_RV {
    guard(|| {
        let (m, _) = session(h)?;
        // SAFETY: the caller's template of `n` attributes (contract).
        let attrs = unsafe { template(t.cast_const(), n) }?;
        m.object(o)?;
        m.set_attributes(h, o, &attrs)
    })
}

/// `C_FindObjectsInit`.
///
/// # Safety
/// `t` holds `n` attributes.
#[no_mangle]
pub unsafe extern "C" fn C_FindObjectsInit(
    h: CK_SESSION_HANDLE,
    t: *mut CK_ATTRIBUTE,
    n: CK_ULONG,
) -> CK_RV {
    guard(|| {
        let (m, s) = session(h)?;
        // SAFETY: the caller's template of `n` attributes.
        let attrs = unsafe { template(t.cast_const(), n) }?;
        if lock(&s).find.is_some() {
            return Err(CKR_OPERATION_ACTIVE);
        }
        let mut found = m.find(&attrs)?;
        found.reverse();
        lock(&s).find = Some(found);
        Ok(())
    })
}

/// `C_FindObjects`.
///
/// # Safety
/// `ph` holds `max` writable handles; `count` is a writable `CK_ULONG`.
#[no_mangle]
pub unsafe extern "C" fn C_FindObjects(
    h: CK_SESSION_HANDLE,
    ph: *mut CK_OBJECT_HANDLE,
    max: CK_ULONG,
    count: *mut CK_ULONG,
) -> CK_RV {
    guard(|| {
        let (_, s) = session(h)?;
        // SAFETY: checked by `out`.
        let c = unsafe { out(count) }?;
        if ph.is_null() || !ph.is_aligned() {
            return Err(CKR_ARGUMENTS_BAD);
        }
        let mut g = lock(&s);
        let f = g.find.as_mut().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
        let max = usize::try_from(max).unwrap_or(usize::MAX);
        let mut n = 0;
        while n < max {
            let Some(o) = f.pop() else { break };
            // SAFETY: `ph` holds `max > n` aligned handles (contract).
            unsafe { ph.add(n).write(o) };
            n += 1;
        }
        *c = n as CK_ULONG;
        Ok(())
    })
}

/// `C_FindObjectsFinal`.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_FindObjectsFinal(h: CK_SESSION_HANDLE) -> CK_RV {
    guard(|| {
        let (_, s) = session(h)?;
        let had = lock(&s).find.take();
        had.map(|_| ()).ok_or(CKR_OPERATION_NOT_INITIALIZED)
    })
}
