//! The C entry points. Each one runs inside `guard` (a panic becomes
//! `CKR_GENERAL_ERROR`, never an unwind into C), checks that the module is
//! initialised, the session and object handles, and every pointer and
//! length before reading or writing through it, and answers with the
//! PKCS#11 code the standard names. The unsafe code here is only the
//! reading and writing of caller memory, in the small helpers below.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use cryptoki_sys::*;
use memveil_vault::ring::Op;

use crate::core::{check_template, Attr, Module, Sess, SLOT};
use crate::mech::{CryptOp, MacOp, Params, Rv};

static MODULE: RwLock<Option<Arc<Module>>> = RwLock::new(None);

/// Runs an entry point's body; a panic is caught and answered with
/// `CKR_GENERAL_ERROR` (where the build unwinds; see docs/pkcs11.md).
fn guard(f: impl FnOnce() -> Result<(), Rv>) -> CK_RV {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => CKR_OK,
        Ok(Err(rv)) => rv,
        Err(_) => CKR_GENERAL_ERROR,
    }
}

/// The module, if `C_Initialize` was called in this process: a child
/// forked after it must call `C_Initialize` itself (PKCS#11 section 6.7.7),
/// so it never shares the parent's vault connection and lanes.
fn module() -> Result<Arc<Module>, Rv> {
    MODULE
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
        .filter(|m| m.pid() == std::process::id())
        .ok_or(CKR_CRYPTOKI_NOT_INITIALIZED)
}

fn lock(s: &Mutex<Sess>) -> std::sync::MutexGuard<'_, Sess> {
    s.lock().unwrap_or_else(PoisonError::into_inner)
}

fn session(h: CK_SESSION_HANDLE) -> Result<(Arc<Module>, Arc<Mutex<Sess>>), Rv> {
    let m = module()?;
    let s = m.session(h)?;
    Ok((m, s))
}

// ---- reading and writing caller memory ----

/// `len` bytes at `p` (empty when `len` is 0, whatever `p` is).
///
/// # Safety
/// When `len > 0` and `p` is not NULL, `p` must point to `len` readable
/// bytes that stay valid and unmodified for `'a` (the caller's promise, as
/// PKCS#11 states it for every buffer argument).
unsafe fn bytes<'a>(p: *const u8, len: CK_ULONG) -> Result<&'a [u8], Rv> {
    let n = usize::try_from(len).map_err(|_| CKR_ARGUMENTS_BAD)?;
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() || isize::try_from(n).is_err() {
        return Err(CKR_ARGUMENTS_BAD);
    }
    // SAFETY: non-NULL, `n` fits an isize, and the caller promises `n`
    // readable bytes for `'a` (this function's contract).
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// A mutable reference to the caller's `T` at `p`.
///
/// # Safety
/// When `p` is not NULL and aligned it must point to a writable `T` not
/// otherwise referenced during `'a`.
unsafe fn out<'a, T>(p: *mut T) -> Result<&'a mut T, Rv> {
    if p.is_null() || !p.is_aligned() {
        return Err(CKR_ARGUMENTS_BAD);
    }
    // SAFETY: non-NULL and aligned; the caller promises a writable `T`.
    Ok(unsafe { &mut *p })
}

/// Reads the caller's `T` at `p` (no alignment needed).
///
/// # Safety
/// When `p` is not NULL it must point to a readable `T`.
unsafe fn read<T: Copy>(p: *const T) -> Result<T, Rv> {
    if p.is_null() {
        return Err(CKR_ARGUMENTS_BAD);
    }
    // SAFETY: non-NULL; the caller promises a readable `T`; unaligned read.
    Ok(unsafe { p.read_unaligned() })
}

/// Copies `data` to the caller's array `p` of `*len` elements with the
/// PKCS#11 length convention: NULL `p` asks for the length, a short array
/// gets `CKR_BUFFER_TOO_SMALL` and the length.
///
/// # Safety
/// `len` as for [`out`]; when `p` is not NULL it must point to `*len`
/// writable elements.
unsafe fn give<T: Copy>(p: *mut T, len: *mut CK_ULONG, data: &[T]) -> Result<(), Rv> {
    // SAFETY: passed on from this function's contract.
    let len = unsafe { out(len) }?;
    let need = data.len() as CK_ULONG;
    if p.is_null() {
        *len = need;
        return Ok(());
    }
    if *len < need {
        *len = need;
        return Err(CKR_BUFFER_TOO_SMALL);
    }
    if !p.is_aligned() {
        return Err(CKR_ARGUMENTS_BAD);
    }
    // SAFETY: `p` is aligned and holds at least `*len >= data.len()`
    // writable elements (contract).
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
    *len = need;
    Ok(())
}

/// A template: (type, value) pairs borrowing the caller's values.
///
/// # Safety
/// When `n > 0` and `p` is not NULL, `p` must point to `n` `CK_ATTRIBUTE`s
/// whose values are readable for `'a`.
unsafe fn template<'a>(
    p: *const CK_ATTRIBUTE,
    n: CK_ULONG,
) -> Result<Vec<(CK_ATTRIBUTE_TYPE, &'a [u8])>, Rv> {
    let n = usize::try_from(n).map_err(|_| CKR_ARGUMENTS_BAD)?;
    if n == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() || n > 4096 {
        return Err(CKR_ARGUMENTS_BAD);
    }
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: `i < n` attributes the caller promised.
        let a = unsafe { read(p.add(i)) }?;
        // SAFETY: the attribute's value, as the caller promised.
        let val = unsafe { bytes(a.pValue.cast_const().cast::<u8>(), a.ulValueLen) }?;
        v.push((a.type_, val));
    }
    Ok(v)
}

fn pad<const N: usize>(s: &str) -> [u8; N] {
    let mut a = [b' '; N];
    let b = s.as_bytes();
    let n = b.len().min(N);
    a[..n].copy_from_slice(&b[..n]);
    a
}

const MECHS: [CK_MECHANISM_TYPE; 7] = [
    CKM_AES_KEY_GEN,
    CKM_AES_ECB,
    CKM_AES_CBC,
    CKM_AES_CBC_PAD,
    CKM_AES_CTR,
    CKM_AES_GCM,
    CKM_AES_CMAC,
];

fn version() -> CK_VERSION {
    CK_VERSION { major: 0, minor: 1 }
}

// ---- general ----

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
        Ok(())
    })
}

/// `C_Finalize`: closes every session (session objects are destroyed).
///
/// # Safety
/// None beyond PKCS#11's: `reserved` must be NULL.
#[no_mangle]
pub unsafe extern "C" fn C_Finalize(reserved: *mut c_void) -> CK_RV {
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

// ---- slots and tokens ----

/// `C_GetSlotList`: one slot, whose token is present while the vault answers.
///
/// # Safety
/// `list` is NULL or holds `*count` slot ids; `count` is a writable `CK_ULONG`.
#[no_mangle]
pub unsafe extern "C" fn C_GetSlotList(
    token_present: CK_BBOOL,
    list: *mut CK_SLOT_ID,
    count: *mut CK_ULONG,
) -> CK_RV {
    guard(|| {
        let m = module()?;
        let slots: &[CK_SLOT_ID] = if token_present != 0 && !m.present() {
            &[]
        } else {
            &[SLOT]
        };
        // SAFETY: `list` holds `*count` slot ids (contract).
        unsafe { give(list, count, slots) }
    })
}

fn check_slot(slot: CK_SLOT_ID) -> Result<Arc<Module>, Rv> {
    let m = module()?;
    if slot == SLOT {
        Ok(m)
    } else {
        Err(CKR_SLOT_ID_INVALID)
    }
}

/// `C_GetSlotInfo`.
///
/// # Safety
/// `info` is NULL or points to a writable `CK_SLOT_INFO`.
#[no_mangle]
pub unsafe extern "C" fn C_GetSlotInfo(slot: CK_SLOT_ID, info: *mut CK_SLOT_INFO) -> CK_RV {
    guard(|| {
        let m = check_slot(slot)?;
        // SAFETY: checked by `out`.
        let i = unsafe { out(info) }?;
        let desc = format!("memveil vault at {}", m.socket().display());
        *i = CK_SLOT_INFO {
            slotDescription: pad(&desc),
            manufacturerID: pad("memveil"),
            flags: if m.present() { CKF_TOKEN_PRESENT } else { 0 },
            hardwareVersion: version(),
            firmwareVersion: version(),
        };
        Ok(())
    })
}

/// `C_GetTokenInfo`.
///
/// # Safety
/// `info` is NULL or points to a writable `CK_TOKEN_INFO`.
#[no_mangle]
pub unsafe extern "C" fn C_GetTokenInfo(slot: CK_SLOT_ID, info: *mut CK_TOKEN_INFO) -> CK_RV {
    guard(|| {
        let m = check_slot(slot)?;
        // SAFETY: checked by `out`.
        let i = unsafe { out(info) }?;
        if !m.present() {
            return Err(CKR_TOKEN_NOT_PRESENT);
        }
        let level = m.level().unwrap_or_default();
        let (all, rw) = m.session_count();
        *i = CK_TOKEN_INFO {
            label: pad("memveil vault"),
            manufacturerID: pad("memveil"),
            model: pad(&format!("vault {level}")),
            serialNumber: pad(&format!("uid {}", unsafe_free_uid())),
            flags: CKF_RNG | CKF_TOKEN_INITIALIZED | CKF_USER_PIN_INITIALIZED,
            ulMaxSessionCount: CK_EFFECTIVELY_INFINITE,
            ulSessionCount: all as CK_ULONG,
            ulMaxRwSessionCount: CK_EFFECTIVELY_INFINITE,
            ulRwSessionCount: rw as CK_ULONG,
            ulMaxPinLen: 255,
            ulMinPinLen: 0,
            ulTotalPublicMemory: CK_UNAVAILABLE_INFORMATION,
            ulFreePublicMemory: CK_UNAVAILABLE_INFORMATION,
            ulTotalPrivateMemory: CK_UNAVAILABLE_INFORMATION,
            ulFreePrivateMemory: CK_UNAVAILABLE_INFORMATION,
            hardwareVersion: version(),
            firmwareVersion: version(),
            utcTime: [b' '; 16],
        };
        Ok(())
    })
}

/// This process's real uid (what `SO_PEERCRED` gives the vault).
fn unsafe_free_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().nth(1).and_then(|u| u.parse().ok()))
        })
        .unwrap_or(u32::MAX)
}

/// `C_GetMechanismList`.
///
/// # Safety
/// `list` is NULL or holds `*count` entries; `count` is a writable `CK_ULONG`.
#[no_mangle]
pub unsafe extern "C" fn C_GetMechanismList(
    slot: CK_SLOT_ID,
    list: *mut CK_MECHANISM_TYPE,
    count: *mut CK_ULONG,
) -> CK_RV {
    guard(|| {
        check_slot(slot)?;
        // SAFETY: `list` holds `*count` entries (contract).
        unsafe { give(list, count, &MECHS) }
    })
}

/// `C_GetMechanismInfo`.
///
/// # Safety
/// `info` is NULL or points to a writable `CK_MECHANISM_INFO`.
#[no_mangle]
pub unsafe extern "C" fn C_GetMechanismInfo(
    slot: CK_SLOT_ID,
    ty: CK_MECHANISM_TYPE,
    info: *mut CK_MECHANISM_INFO,
) -> CK_RV {
    guard(|| {
        check_slot(slot)?;
        let flags = match ty {
            CKM_AES_KEY_GEN => CKF_GENERATE,
            CKM_AES_ECB | CKM_AES_CBC | CKM_AES_CBC_PAD | CKM_AES_CTR | CKM_AES_GCM => {
                CKF_ENCRYPT | CKF_DECRYPT
            }
            CKM_AES_CMAC => CKF_SIGN | CKF_VERIFY,
            _ => return Err(CKR_MECHANISM_INVALID),
        };
        // SAFETY: checked by `out`.
        let i = unsafe { out(info) }?;
        *i = CK_MECHANISM_INFO {
            ulMinKeySize: 16,
            ulMaxKeySize: 32,
            flags,
        };
        Ok(())
    })
}

/// `C_InitToken`: not supported (the vault is set up with `memveil vault`).
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_InitToken(
    slot: CK_SLOT_ID,
    _pin: *mut CK_UTF8CHAR,
    _len: CK_ULONG,
    _label: *mut CK_UTF8CHAR,
) -> CK_RV {
    guard(|| {
        check_slot(slot)?;
        Err(CKR_FUNCTION_NOT_SUPPORTED)
    })
}

/// `C_InitPIN`: not supported (no PIN is kept).
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_InitPIN(
    h: CK_SESSION_HANDLE,
    _pin: *mut CK_UTF8CHAR,
    _len: CK_ULONG,
) -> CK_RV {
    guard(|| {
        session(h)?;
        Err(CKR_FUNCTION_NOT_SUPPORTED)
    })
}

/// `C_SetPIN`: not supported.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_SetPIN(
    h: CK_SESSION_HANDLE,
    _old: *mut CK_UTF8CHAR,
    _old_len: CK_ULONG,
    _new: *mut CK_UTF8CHAR,
    _new_len: CK_ULONG,
) -> CK_RV {
    guard(|| {
        session(h)?;
        Err(CKR_FUNCTION_NOT_SUPPORTED)
    })
}

// ---- sessions ----

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

// ---- objects ----

/// `C_CreateObject`: imports an AES key into the vault. The key bytes go
/// from the caller's template straight to the vault's socket.
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
        // SAFETY: passed on from the caller's contract.
        unsafe { create(&m, h, t, n, ph, true) }
    })
}

/// The shared body of `C_CreateObject` (`import`) and `C_GenerateKey`.
///
/// # Safety
/// `t` holds `n` attributes; `ph` is NULL or a writable handle.
unsafe fn create(
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
    let (tpl, value) = check_template(&attrs, import)?;
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

/// `C_SetAttributeValue`: keys are not modifiable.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_SetAttributeValue(
    h: CK_SESSION_HANDLE,
    o: CK_OBJECT_HANDLE,
    _t: *mut CK_ATTRIBUTE,
    _n: CK_ULONG,
) -> CK_RV {
    guard(|| {
        let (m, _) = session(h)?;
        m.object(o)?;
        Err(CKR_ATTRIBUTE_READ_ONLY)
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

// ---- encryption and decryption ----

/// `CK_GCM_PARAMS` as PKCS#11 2.40 first published it, without `ulIvBits`
/// (some callers still pass it).
#[repr(C)]
#[derive(Clone, Copy)]
struct GcmParamsNoIvBits {
    pIv: *mut CK_BYTE,
    ulIvLen: CK_ULONG,
    pAAD: *mut CK_BYTE,
    ulAADLen: CK_ULONG,
    ulTagBits: CK_ULONG,
}

/// The mechanism's parameters, copied out of the caller's memory.
///
/// # Safety
/// `mech` is NULL or points to a `CK_MECHANISM` whose parameter holds
/// `ulParameterLen` bytes (and, for GCM, whose IV and AAD pointers hold
/// their lengths).
unsafe fn params(mech: *const CK_MECHANISM, op: Op) -> Result<Params, Rv> {
    // SAFETY: the caller's CK_MECHANISM (contract).
    let m = unsafe { read(mech) }?;
    // SAFETY: the parameter's bytes (contract).
    let p = unsafe { bytes(m.pParameter.cast_const().cast::<u8>(), m.ulParameterLen) }?;
    let iv = || <[u8; 16]>::try_from(p).map_err(|_| CKR_MECHANISM_PARAM_INVALID);
    Ok(match m.mechanism {
        CKM_AES_ECB if p.is_empty() => Params::Ecb,
        CKM_AES_CBC => Params::Cbc(iv()?),
        CKM_AES_CBC_PAD => Params::CbcPad(iv()?),
        CKM_AES_CTR => {
            if p.len() != std::mem::size_of::<CK_AES_CTR_PARAMS>() {
                return Err(CKR_MECHANISM_PARAM_INVALID);
            }
            // SAFETY: `p` holds a whole CK_AES_CTR_PARAMS (length checked).
            let c = unsafe { read(p.as_ptr().cast::<CK_AES_CTR_PARAMS>()) }?;
            let bits = u32::try_from(c.ulCounterBits).map_err(|_| CKR_MECHANISM_PARAM_INVALID)?;
            if !(1..=128).contains(&bits) {
                return Err(CKR_MECHANISM_PARAM_INVALID);
            }
            Params::Ctr { cb: c.cb, bits }
        }
        CKM_AES_GCM => {
            // PKCS#11 2.40 errata and 3.0: with ulIvBits (48 bytes); the
            // 2.40 header as first published lacked it (40 bytes).
            let full = std::mem::size_of::<CK_GCM_PARAMS>();
            let (iv_p, iv_len, aad_p, aad_len, tag_bits) = if p.len() == full {
                // SAFETY: `p` holds a whole CK_GCM_PARAMS (length checked).
                let g = unsafe { read(p.as_ptr().cast::<CK_GCM_PARAMS>()) }?;
                (g.pIv, g.ulIvLen, g.pAAD, g.ulAADLen, g.ulTagBits)
            } else if p.len() == std::mem::size_of::<GcmParamsNoIvBits>() {
                // SAFETY: `p` holds a whole GcmParamsNoIvBits (length checked).
                let g = unsafe { read(p.as_ptr().cast::<GcmParamsNoIvBits>()) }?;
                (g.pIv, g.ulIvLen, g.pAAD, g.ulAADLen, g.ulTagBits)
            } else {
                return Err(CKR_MECHANISM_PARAM_INVALID);
            };
            // SAFETY: the IV and AAD the parameters point to (contract).
            let nonce = unsafe { bytes(iv_p.cast_const(), iv_len) }?;
            // SAFETY: as above.
            let aad = unsafe { bytes(aad_p.cast_const(), aad_len) }?;
            let nonce: [u8; 12] = nonce.try_into().map_err(|_| CKR_MECHANISM_PARAM_INVALID)?;
            let ok_tag = match op {
                Op::Encrypt => (96..=128).contains(&tag_bits) && tag_bits % 8 == 0,
                Op::Decrypt => tag_bits == 128,
            };
            if !ok_tag {
                return Err(CKR_MECHANISM_PARAM_INVALID);
            }
            Params::Gcm {
                nonce,
                aad: aad.to_vec(),
                tag_len: usize::try_from(tag_bits / 8).map_err(|_| CKR_MECHANISM_PARAM_INVALID)?,
            }
        }
        CKM_AES_ECB => return Err(CKR_MECHANISM_PARAM_INVALID),
        _ => return Err(CKR_MECHANISM_INVALID),
    })
}

/// # Safety
/// As [`params`].
unsafe fn crypt_init(
    h: CK_SESSION_HANDLE,
    mech: *const CK_MECHANISM,
    key: CK_OBJECT_HANDLE,
    op: Op,
) -> Rv {
    guard(|| {
        let (m, s) = session(h)?;
        // SAFETY: passed on from the caller's contract.
        let p = unsafe { params(mech, op) }?;
        let cap = if op == Op::Encrypt { 0 } else { 1 };
        let k = m.key(key, cap)?;
        let mut g = lock(&s);
        let slot = if op == Op::Encrypt {
            &mut g.enc
        } else {
            &mut g.dec
        };
        if slot.is_some() {
            return Err(CKR_OPERATION_ACTIVE);
        }
        *slot = Some(CryptOp::new(op, k.vault_id, p));
        Ok(())
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Single,
    Update,
    Final,
}

/// The shared body of `C_Encrypt*` and `C_Decrypt*`.
///
/// # Safety
/// `input` holds `in_len` bytes; `outp` is NULL or holds `*out_len`
/// writable bytes; `out_len` is a writable `CK_ULONG`.
unsafe fn crypt(
    h: CK_SESSION_HANDLE,
    op: Op,
    part: Part,
    input: *const u8,
    in_len: CK_ULONG,
    outp: *mut u8,
    out_len: *mut CK_ULONG,
) -> Rv {
    guard(|| {
        let (m, s) = session(h)?;
        let mut g = lock(&s);
        let slot = if op == Op::Encrypt {
            &mut g.enc
        } else {
            &mut g.dec
        };
        let cur = slot.as_ref().ok_or(CKR_OPERATION_NOT_INITIALIZED)?;
        if out_len.is_null() || !out_len.is_aligned() {
            *slot = None;
            return Err(CKR_ARGUMENTS_BAD);
        }
        // SAFETY: the input the caller passed (contract); it is no longer
        // used once the output is written (the two may be the same buffer).
        let data = match unsafe { bytes(input, in_len) } {
            Ok(d) => d,
            Err(e) => {
                *slot = None;
                return Err(e);
            }
        };
        if outp.is_null() {
            let bound = match part {
                Part::Single => cur.single_bound(data.len()),
                Part::Update => cur.update_bound(data.len()),
                Part::Final => cur.final_bound(),
            };
            // SAFETY: checked non-NULL and aligned above.
            unsafe { *out_len = bound as CK_ULONG };
            return Ok(());
        }
        let mut next = cur.clone();
        let r = match part {
            Part::Single => next.single(&*m, data),
            Part::Update => next.update(&*m, data),
            Part::Final => next.finish(&*m),
        };
        let produced = match r {
            Ok(v) => zeroize::Zeroizing::new(v),
            Err(e) => {
                *slot = None;
                return Err(e);
            }
        };
        // SAFETY: `outp` holds `*out_len` writable bytes (contract).
        unsafe { give(outp, out_len, &produced) }?;
        *slot = if part == Part::Update {
            Some(next)
        } else {
            None
        };
        Ok(())
    })
}

/// `C_EncryptInit`.
///
/// # Safety
/// `mech` as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_EncryptInit(
    h: CK_SESSION_HANDLE,
    mech: *mut CK_MECHANISM,
    key: CK_OBJECT_HANDLE,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { crypt_init(h, mech, key, Op::Encrypt) }
}

/// `C_Encrypt`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_Encrypt(
    h: CK_SESSION_HANDLE,
    d: *mut CK_BYTE,
    dl: CK_ULONG,
    o: *mut CK_BYTE,
    ol: *mut CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { crypt(h, Op::Encrypt, Part::Single, d, dl, o, ol) }
}

/// `C_EncryptUpdate`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_EncryptUpdate(
    h: CK_SESSION_HANDLE,
    d: *mut CK_BYTE,
    dl: CK_ULONG,
    o: *mut CK_BYTE,
    ol: *mut CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { crypt(h, Op::Encrypt, Part::Update, d, dl, o, ol) }
}

/// `C_EncryptFinal`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_EncryptFinal(
    h: CK_SESSION_HANDLE,
    o: *mut CK_BYTE,
    ol: *mut CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { crypt(h, Op::Encrypt, Part::Final, std::ptr::null(), 0, o, ol) }
}

/// `C_DecryptInit`.
///
/// # Safety
/// `mech` as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_DecryptInit(
    h: CK_SESSION_HANDLE,
    mech: *mut CK_MECHANISM,
    key: CK_OBJECT_HANDLE,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { crypt_init(h, mech, key, Op::Decrypt) }
}

/// `C_Decrypt`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_Decrypt(
    h: CK_SESSION_HANDLE,
    d: *mut CK_BYTE,
    dl: CK_ULONG,
    o: *mut CK_BYTE,
    ol: *mut CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { crypt(h, Op::Decrypt, Part::Single, d, dl, o, ol) }
}

/// `C_DecryptUpdate`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_DecryptUpdate(
    h: CK_SESSION_HANDLE,
    d: *mut CK_BYTE,
    dl: CK_ULONG,
    o: *mut CK_BYTE,
    ol: *mut CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { crypt(h, Op::Decrypt, Part::Update, d, dl, o, ol) }
}

/// `C_DecryptFinal`.
///
/// # Safety
/// Buffers as PKCS#11 states.
#[no_mangle]
pub unsafe extern "C" fn C_DecryptFinal(
    h: CK_SESSION_HANDLE,
    o: *mut CK_BYTE,
    ol: *mut CK_ULONG,
) -> CK_RV {
    // SAFETY: passed on.
    unsafe { crypt(h, Op::Decrypt, Part::Final, std::ptr::null(), 0, o, ol) }
}

// ---- CMAC ----

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

// ---- keys and random ----

/// `C_GenerateKey` (`CKM_AES_KEY_GEN`): the key is generated inside the vault.
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
        if mm.mechanism != CKM_AES_KEY_GEN {
            return Err(CKR_MECHANISM_INVALID);
        }
        if mm.ulParameterLen != 0 {
            return Err(CKR_MECHANISM_PARAM_INVALID);
        }
        // SAFETY: passed on from the caller's contract.
        unsafe { create(&m, h, t, n, ph, false) }
    })
}

/// `C_SeedRandom`: the DRBG takes no caller seed.
///
/// # Safety
/// None: no pointer is read.
#[no_mangle]
pub unsafe extern "C" fn C_SeedRandom(
    h: CK_SESSION_HANDLE,
    _s: *mut CK_BYTE,
    _l: CK_ULONG,
) -> CK_RV {
    guard(|| {
        session(h)?;
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
    C_DigestInit(m: *mut CK_MECHANISM);
    C_Digest(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_DigestUpdate(d: *mut CK_BYTE, dl: CK_ULONG);
    C_DigestKey(k: CK_OBJECT_HANDLE);
    C_DigestFinal(o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_SignRecoverInit(m: *mut CK_MECHANISM, k: CK_OBJECT_HANDLE);
    C_SignRecover(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_VerifyRecoverInit(m: *mut CK_MECHANISM, k: CK_OBJECT_HANDLE);
    C_VerifyRecover(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_DigestEncryptUpdate(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_DecryptDigestUpdate(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_SignEncryptUpdate(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_DecryptVerifyUpdate(d: *mut CK_BYTE, dl: CK_ULONG, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_GenerateKeyPair(m: *mut CK_MECHANISM, pt: *mut CK_ATTRIBUTE, pn: CK_ULONG, st: *mut CK_ATTRIBUTE, sn: CK_ULONG, ph: *mut CK_OBJECT_HANDLE, sh: *mut CK_OBJECT_HANDLE);
    C_WrapKey(m: *mut CK_MECHANISM, w: CK_OBJECT_HANDLE, k: CK_OBJECT_HANDLE, o: *mut CK_BYTE, ol: *mut CK_ULONG);
    C_UnwrapKey(m: *mut CK_MECHANISM, w: CK_OBJECT_HANDLE, d: *mut CK_BYTE, dl: CK_ULONG, t: *mut CK_ATTRIBUTE, n: CK_ULONG, ph: *mut CK_OBJECT_HANDLE);
    C_DeriveKey(m: *mut CK_MECHANISM, k: CK_OBJECT_HANDLE, t: *mut CK_ATTRIBUTE, n: CK_ULONG, ph: *mut CK_OBJECT_HANDLE);
}
