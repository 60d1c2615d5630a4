//! Sessions and login.

use std::ffi::c_void;

use cryptoki_sys::*;

use super::*;

/// `C_OpenSession` (notification callbacks are never called).
///
/// # Safety
/// `ph` is NULL or points to a writable handle.
#[no_mangle]
pub unsafe extern "C" fn C_OpenSession(
    slot: CK_SLOT_ID,
    flags: CK_FLAGS,
    _app: *mut c_void,
    _notify: CK_NOTIFY,
    ph: *mut CK_SESSION_HANDLE,
) -> CK_RV {
    guard(|| {
        let m = check_slot(slot)?;
        // SAFETY: checked by `out`.
        let p = unsafe { out(ph) }?;
        if flags & CKF_SERIAL_SESSION == 0 {
            return Err(CKR_SESSION_PARALLEL_NOT_SUPPORTED);
        }
        *p = m.open_session(flags & CKF_RW_SESSION != 0)?;
        Ok(())
    })
}

/// `C_CloseSession`: its session objects are destroyed in the vault.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_CloseSession(h: CK_SESSION_HANDLE) -> CK_RV {
    guard(|| module()?.close_session(h))
}

/// `C_CloseAllSessions`.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_CloseAllSessions(slot: CK_SLOT_ID) -> CK_RV {
    guard(|| {
        check_slot(slot)?.close_all();
        Ok(())
    })
}

/// `C_GetSessionInfo`.
///
/// # Safety
/// `info` is NULL or points to a writable `CK_SESSION_INFO`.
#[no_mangle]
pub unsafe extern "C" fn C_GetSessionInfo(
    h: CK_SESSION_HANDLE,
    info: *mut CK_SESSION_INFO,
) -> CK_RV {
    guard(|| {
        let (m, s) = session(h)?;
        // SAFETY: checked by `out`.
        let i = unsafe { out(info) }?;
        let rw = lock(&s).rw;
        let state = match (rw, m.logged_in()) {
            (false, false) => CKS_RO_PUBLIC_SESSION,
            (true, false) => CKS_RW_PUBLIC_SESSION,
            (false, true) => CKS_RO_USER_FUNCTIONS,
            (true, true) => CKS_RW_USER_FUNCTIONS,
        };
        *i = CK_SESSION_INFO {
            slotID: SLOT,
            state,
            flags: CKF_SERIAL_SESSION | if rw { CKF_RW_SESSION } else { 0 },
            ulDeviceError: 0,
        };
        Ok(())
    })
}

/// `C_GetOperationState`: not supported.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_GetOperationState(
    h: CK_SESSION_HANDLE,
    _p: *mut CK_BYTE,
    _l: *mut CK_ULONG,
) -> CK_RV {
    guard(|| {
        session(h)?;
        Err(CKR_FUNCTION_NOT_SUPPORTED)
    })
}

/// `C_SetOperationState`: not supported.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_SetOperationState(
    h: CK_SESSION_HANDLE,
    _p: *mut CK_BYTE,
    _l: CK_ULONG,
    _k1: CK_OBJECT_HANDLE,
    _k2: CK_OBJECT_HANDLE,
) -> CK_RV {
    guard(|| {
        session(h)?;
        Err(CKR_FUNCTION_NOT_SUPPORTED)
    })
}

/// `C_Login`: the PIN is optional and not checked (docs/pkcs11.md).
///
/// # Safety
/// `pin` is NULL or holds `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn C_Login(
    h: CK_SESSION_HANDLE,
    user: CK_USER_TYPE,
    pin: *mut CK_UTF8CHAR,
    len: CK_ULONG,
) -> CK_RV {
    guard(|| {
        let (m, _) = session(h)?;
        // SAFETY: `pin` holds `len` bytes (contract); only checked, not kept.
        unsafe { bytes(pin.cast_const(), len) }?;
        if !matches!(user, CKU_USER | CKU_SO | CKU_CONTEXT_SPECIFIC) {
            return Err(CKR_USER_TYPE_INVALID);
        }
        if user == CKU_CONTEXT_SPECIFIC {
            return Ok(());
        }
        m.login()
    })
}

/// `C_Logout`.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_Logout(h: CK_SESSION_HANDLE) -> CK_RV {
    guard(|| session(h)?.0.logout())
}
