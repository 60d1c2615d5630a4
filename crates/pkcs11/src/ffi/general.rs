//! General entry points: `C_Initialize`, `C_Finalize`, `C_GetInfo`,
//! `C_GetFunctionList` and the function list.

use std::ffi::c_void;

use cryptoki_sys::*;

use super::*;

/// `C_Initialize`.
///
/// # Safety
/// `args` is NULL or points to a `CK_C_INITIALIZE_ARGS`.
#[no_mangle]
pub unsafe extern "C" fn C_Initialize(args: *mut c_void) -> CK_RV {
    guard(|| {
        if !args.is_null() {
            // SAFETY: non-NULL: the caller's CK_C_INITIALIZE_ARGS.
            let a = unsafe { read(args.cast_const().cast::<CK_C_INITIALIZE_ARGS>()) }?;
            if !a.pReserved.is_null() {
                return Err(CKR_ARGUMENTS_BAD);
            }
            let fns = [
                a.CreateMutex.is_some(),
                a.DestroyMutex.is_some(),
                a.LockMutex.is_some(),
                a.UnlockMutex.is_some(),
            ];
            if fns.iter().any(|f| *f) && !fns.iter().all(|f| *f) {
                return Err(CKR_ARGUMENTS_BAD);
            }
            if fns[0] && a.flags & CKF_OS_LOCKING_OK == 0 {
                // Only the caller's own mutexes would do: we use the OS's.
                return Err(CKR_CANT_LOCK);
            }
        }
        let mut g = MODULE.write().unwrap_or_else(PoisonError::into_inner);
        match g.take() {
            Some(m) if m.pid() == std::process::id() => {
                *g = Some(m);
                return Err(CKR_CRYPTOKI_ALREADY_INITIALIZED);
            }
            // The parent's state, inherited through fork: never dropped
            // here, since dropping would close the parent's sessions and
            // destroy its session keys in the vault.
            Some(parent) => std::mem::forget(parent),
            None => {}
        }
        *g = Some(Arc::new(Module::new()));
        if std::env::var_os("MEMVEIL_PKCS11_PANIC_TEST").is_some_and(|v| v == "1") {
            PANIC_TEST.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    })
}

/// `C_Finalize`: closes every session (session objects are destroyed).
///
/// # Safety
/// None beyond PKCS#11's: `reserved` must be NULL.
#[no_mangle]
pub unsafe extern "C" fn C_Finalize(reserved: *mut c_void) -> CK_RV {
    PANIC_TEST.store(false, std::sync::atomic::Ordering::Relaxed);
    guard(|| {
        if !reserved.is_null() {
            return Err(CKR_ARGUMENTS_BAD);
        }
        let m = module()?;
        MODULE
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        m.close_all();
        Ok(())
    })
}

/// `C_GetInfo`.
///
/// # Safety
/// `info` is NULL or points to a writable `CK_INFO`.
#[no_mangle]
pub unsafe extern "C" fn C_GetInfo(info: *mut CK_INFO) -> CK_RV {
    guard(|| {
        module()?;
        // SAFETY: checked by `out`; the caller's CK_INFO.
        let i = unsafe { out(info) }?;
        *i = CK_INFO {
            cryptokiVersion: CK_VERSION {
                major: 2,
                minor: 40,
            },
            manufacturerID: pad("memveil"),
            flags: 0,
            libraryDescription: pad("memveil vault PKCS#11 module"),
            libraryVersion: version(),
        };
        Ok(())
    })
}

static FUNCTIONS: CK_FUNCTION_LIST = CK_FUNCTION_LIST {
    version: CK_VERSION {
        major: 2,
        minor: 40,
    },
    C_Initialize: Some(C_Initialize),
    C_Finalize: Some(C_Finalize),
    C_GetInfo: Some(C_GetInfo),
    C_GetFunctionList: Some(C_GetFunctionList),
    C_GetSlotList: Some(C_GetSlotList),
    C_GetSlotInfo: Some(C_GetSlotInfo),
    C_GetTokenInfo: Some(C_GetTokenInfo),
    C_GetMechanismList: Some(C_GetMechanismList),
    C_GetMechanismInfo: Some(C_GetMechanismInfo),
    C_InitToken: Some(C_InitToken),
    C_InitPIN: Some(C_InitPIN),
    C_SetPIN: Some(C_SetPIN),
    C_OpenSession: Some(C_OpenSession),
    C_CloseSession: Some(C_CloseSession),
    C_CloseAllSessions: Some(C_CloseAllSessions),
    C_GetSessionInfo: Some(C_GetSessionInfo),
    C_GetOperationState: Some(C_GetOperationState),
    C_SetOperationState: Some(C_SetOperationState),
    C_Login: Some(C_Login),
    C_Logout: Some(C_Logout),
    C_CreateObject: Some(C_CreateObject),
    C_CopyObject: Some(C_CopyObject),
    C_DestroyObject: Some(C_DestroyObject),
    C_GetObjectSize: Some(C_GetObjectSize),
    C_GetAttributeValue: Some(C_GetAttributeValue),
    C_SetAttributeValue: Some(C_SetAttributeValue),
    C_FindObjectsInit: Some(C_FindObjectsInit),
    C_FindObjects: Some(C_FindObjects),
    C_FindObjectsFinal: Some(C_FindObjectsFinal),
    C_EncryptInit: Some(C_EncryptInit),
    C_Encrypt: Some(C_Encrypt),
    C_EncryptUpdate: Some(C_EncryptUpdate),
    C_EncryptFinal: Some(C_EncryptFinal),
    C_DecryptInit: Some(C_DecryptInit),
    C_Decrypt: Some(C_Decrypt),
    C_DecryptUpdate: Some(C_DecryptUpdate),
    C_DecryptFinal: Some(C_DecryptFinal),
    C_DigestInit: Some(C_DigestInit),
    C_Digest: Some(C_Digest),
    C_DigestUpdate: Some(C_DigestUpdate),
    C_DigestKey: Some(C_DigestKey),
    C_DigestFinal: Some(C_DigestFinal),
    C_SignInit: Some(C_SignInit),
    C_Sign: Some(C_Sign),
    C_SignUpdate: Some(C_SignUpdate),
    C_SignFinal: Some(C_SignFinal),
    C_SignRecoverInit: Some(C_SignRecoverInit),
    C_SignRecover: Some(C_SignRecover),
    C_VerifyInit: Some(C_VerifyInit),
    C_Verify: Some(C_Verify),
    C_VerifyUpdate: Some(C_VerifyUpdate),
    C_VerifyFinal: Some(C_VerifyFinal),
    C_VerifyRecoverInit: Some(C_VerifyRecoverInit),
    C_VerifyRecover: Some(C_VerifyRecover),
    C_DigestEncryptUpdate: Some(C_DigestEncryptUpdate),
    C_DecryptDigestUpdate: Some(C_DecryptDigestUpdate),
    C_SignEncryptUpdate: Some(C_SignEncryptUpdate),
    C_DecryptVerifyUpdate: Some(C_DecryptVerifyUpdate),
    C_GenerateKey: Some(C_GenerateKey),
    C_GenerateKeyPair: Some(C_GenerateKeyPair),
    C_WrapKey: Some(C_WrapKey),
    C_UnwrapKey: Some(C_UnwrapKey),
    C_DeriveKey: Some(C_DeriveKey),
    C_SeedRandom: Some(C_SeedRandom),
    C_GenerateRandom: Some(C_GenerateRandom),
    C_GetFunctionStatus: Some(C_GetFunctionStatus),
    C_CancelFunction: Some(C_CancelFunction),
    C_WaitForSlotEvent: Some(C_WaitForSlotEvent),
};

/// `C_GetFunctionList`: works before `C_Initialize`.
///
/// # Safety
/// `list` is NULL or points to a writable pointer.
#[no_mangle]
pub unsafe extern "C" fn C_GetFunctionList(list: *mut *mut CK_FUNCTION_LIST) -> CK_RV {
    guard(|| {
        // SAFETY: checked by `out`; the caller's pointer slot.
        let l = unsafe { out(list) }?;
        // The list is never written through: PKCS#11 callers only read it.
        *l = std::ptr::addr_of!(FUNCTIONS).cast_mut();
        Ok(())
    })
}
