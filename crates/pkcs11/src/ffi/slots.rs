//! Slots, the token, mechanisms and PINs.

use cryptoki_sys::*;

use super::*;

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

pub(crate) fn check_slot(slot: CK_SLOT_ID) -> Result<Arc<Module>, Rv> {
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
        // Key sizes: bytes for AES, bits for RSA and EC (PKCS#11's units).
        let ec = CKF_EC_F_P | CKF_EC_NAMEDCURVE | CKF_EC_UNCOMPRESS;
        let (min_secret, max_secret) = (
            memveil_vault::proto::MIN_SECRET as CK_ULONG,
            memveil_vault::proto::MAX_SECRET as CK_ULONG,
        );
        let (flags, min, max) = match ty {
            CKM_AES_KEY_GEN => (CKF_GENERATE, 16, 32),
            CKM_AES_ECB | CKM_AES_CBC | CKM_AES_CBC_PAD | CKM_AES_CTR | CKM_AES_GCM => {
                (CKF_ENCRYPT | CKF_DECRYPT, 16, 32)
            }
            CKM_AES_CMAC => (CKF_SIGN | CKF_VERIFY, 16, 32),
            CKM_SHA_1 | CKM_SHA224 | CKM_SHA256 | CKM_SHA384 | CKM_SHA512 => (CKF_DIGEST, 0, 0),
            CKM_GENERIC_SECRET_KEY_GEN => (CKF_GENERATE, min_secret, max_secret),
            CKM_SHA_1_HMAC | CKM_SHA224_HMAC | CKM_SHA256_HMAC | CKM_SHA384_HMAC
            | CKM_SHA512_HMAC => (CKF_SIGN | CKF_VERIFY, min_secret, max_secret),
            CKM_RSA_PKCS_KEY_PAIR_GEN => (CKF_GENERATE_KEY_PAIR, 2048, 4096),
            CKM_RSA_PKCS | CKM_RSA_X_509 => (
                CKF_SIGN | CKF_VERIFY | CKF_VERIFY_RECOVER | CKF_DECRYPT | CKF_ENCRYPT,
                2048,
                4096,
            ),
            CKM_RSA_PKCS_OAEP => (CKF_DECRYPT | CKF_ENCRYPT, 2048, 4096),
            CKM_EC_KEY_PAIR_GEN => (CKF_GENERATE_KEY_PAIR | ec, 256, 384),
            CKM_ECDH1_DERIVE => (CKF_DERIVE | ec, 256, 384),
            CKM_EC_EDWARDS_KEY_PAIR_GEN => (CKF_GENERATE_KEY_PAIR, 255, 255),
            CKM_EDDSA => (CKF_SIGN | CKF_VERIFY, 255, 255),
            m if crate::asym::is_sign_mech(m) && MECHS.contains(&m) => {
                if matches!(
                    m,
                    CKM_ECDSA
                        | CKM_ECDSA_SHA1
                        | CKM_ECDSA_SHA224
                        | CKM_ECDSA_SHA256
                        | CKM_ECDSA_SHA384
                        | CKM_ECDSA_SHA512
                ) {
                    (CKF_SIGN | CKF_VERIFY | ec, 256, 384)
                } else {
                    (CKF_SIGN | CKF_VERIFY, 2048, 4096)
                }
            }
            _ => return Err(CKR_MECHANISM_INVALID),
        };
        // CKF_HW: the vault, a process of its own that the caller cannot
        // read, is the token's device and runs every operation with a
        // secret or private key; digests run in the caller's process.
        let flags = if flags == CKF_DIGEST {
            flags
        } else {
            flags | CKF_HW
        };
        // SAFETY: checked by `out`.
        let i = unsafe { out(info) }?;
        *i = CK_MECHANISM_INFO {
            ulMinKeySize: min,
            ulMaxKeySize: max,
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
