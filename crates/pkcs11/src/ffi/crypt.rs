//! Encryption and decryption, single- and multi-part.

use cryptoki_sys::*;
use memveil_vault::ring::Op;

use super::*;

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
