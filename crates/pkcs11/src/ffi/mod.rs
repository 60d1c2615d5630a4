//! The C entry points. Each one runs inside `guard` (a panic becomes
//! `CKR_GENERAL_ERROR`, never an unwind into C), checks that the module is
//! initialised, the session and object handles, and every pointer and
//! length before reading or writing through it, and answers with the
//! PKCS#11 code the standard names. The unsafe code here is only the
//! reading and writing of caller memory, in the small helpers below.
//!
//! Layout: this module holds the state lookup and the caller-memory
//! helpers; the entry points sit by area, as the PKCS#11 specification
//! groups them: [`general`] (initialise, finalise, info, function list),
//! [`slots`] (slots, tokens, mechanisms, PINs), [`sessions`], [`objects`],
//! [`crypt`] (encryption and decryption), [`digest`], [`mac`] (signatures
//! and verification), [`keys`] (key generation, random numbers and the
//! functions not offered).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use cryptoki_sys::*;

pub(crate) use crate::core::{check_template, Attr, Module, Sess, SLOT};
pub(crate) use crate::mech::{CryptOp, MacOp, Params, Rv};

pub mod crypt;
pub mod digest;
pub mod general;
pub mod keys;
pub mod mac;
pub mod objects;
pub mod sessions;
pub mod slots;

pub use crypt::*;
pub use digest::*;
pub use general::*;
pub use keys::*;
pub use mac::*;
pub use objects::*;
pub use sessions::*;
pub use slots::*;

static MODULE: RwLock<Option<Arc<Module>>> = RwLock::new(None);

/// Set by `C_Initialize` when `MEMVEIL_PKCS11_PANIC_TEST=1` is in the
/// environment: every entry point then panics inside its guard (the test
/// that a panic becomes `CKR_GENERAL_ERROR` and the host lives on);
/// `C_Finalize` clears it.
pub(crate) static PANIC_TEST: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Runs an entry point's body; a panic is caught and answered with
/// `CKR_GENERAL_ERROR`: the library is built to unwind (the workspace's
/// release profile), so no panic aborts the host.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Rv>) -> CK_RV {
    let body = || {
        assert!(
            !PANIC_TEST.load(std::sync::atomic::Ordering::Relaxed),
            "memveil-pkcs11: a panic forced by MEMVEIL_PKCS11_PANIC_TEST"
        );
        f()
    };
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CKR_OK,
        Ok(Err(rv)) => rv,
        Err(_) => CKR_GENERAL_ERROR,
    }
}

/// The module, if `C_Initialize` was called in this process: a child
/// forked after it must call `C_Initialize` itself (PKCS#11 section 6.7.7),
/// so it never shares the parent's vault connection and lanes.
pub(crate) fn module() -> Result<Arc<Module>, Rv> {
    MODULE
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
        .filter(|m| m.pid() == std::process::id())
        .ok_or(CKR_CRYPTOKI_NOT_INITIALIZED)
}

pub(crate) fn lock(s: &Mutex<Sess>) -> std::sync::MutexGuard<'_, Sess> {
    s.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn session(h: CK_SESSION_HANDLE) -> Result<(Arc<Module>, Arc<Mutex<Sess>>), Rv> {
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
pub(crate) unsafe fn bytes<'a>(p: *const u8, len: CK_ULONG) -> Result<&'a [u8], Rv> {
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
pub(crate) unsafe fn out<'a, T>(p: *mut T) -> Result<&'a mut T, Rv> {
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
pub(crate) unsafe fn read<T: Copy>(p: *const T) -> Result<T, Rv> {
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
pub(crate) unsafe fn give<T: Copy>(p: *mut T, len: *mut CK_ULONG, data: &[T]) -> Result<(), Rv> {
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
pub(crate) unsafe fn template<'a>(
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

pub(crate) fn pad<const N: usize>(s: &str) -> [u8; N] {
    let mut a = [b' '; N];
    let b = s.as_bytes();
    let n = b.len().min(N);
    a[..n].copy_from_slice(&b[..n]);
    a
}

pub(crate) const MECHS: [CK_MECHANISM_TYPE; 43] = [
    CKM_AES_KEY_GEN,
    CKM_AES_ECB,
    CKM_AES_CBC,
    CKM_AES_CBC_PAD,
    CKM_AES_CTR,
    CKM_AES_GCM,
    CKM_AES_CMAC,
    CKM_RSA_PKCS_KEY_PAIR_GEN,
    CKM_EC_KEY_PAIR_GEN,
    CKM_EC_EDWARDS_KEY_PAIR_GEN,
    CKM_RSA_PKCS,
    CKM_RSA_X_509,
    CKM_RSA_PKCS_PSS,
    CKM_RSA_PKCS_OAEP,
    CKM_SHA1_RSA_PKCS,
    CKM_SHA224_RSA_PKCS,
    CKM_SHA256_RSA_PKCS,
    CKM_SHA384_RSA_PKCS,
    CKM_SHA512_RSA_PKCS,
    CKM_SHA1_RSA_PKCS_PSS,
    CKM_SHA224_RSA_PKCS_PSS,
    CKM_SHA256_RSA_PKCS_PSS,
    CKM_SHA384_RSA_PKCS_PSS,
    CKM_SHA512_RSA_PKCS_PSS,
    CKM_ECDSA,
    CKM_ECDSA_SHA1,
    CKM_ECDSA_SHA224,
    CKM_ECDSA_SHA256,
    CKM_ECDSA_SHA384,
    CKM_ECDSA_SHA512,
    CKM_EDDSA,
    CKM_ECDH1_DERIVE,
    CKM_SHA_1,
    CKM_SHA224,
    CKM_SHA256,
    CKM_SHA384,
    CKM_SHA512,
    CKM_GENERIC_SECRET_KEY_GEN,
    CKM_SHA_1_HMAC,
    CKM_SHA224_HMAC,
    CKM_SHA256_HMAC,
    CKM_SHA384_HMAC,
    CKM_SHA512_HMAC,
];

pub(crate) fn version() -> CK_VERSION {
    CK_VERSION { major: 0, minor: 1 }
}
