//! Encryption and decryption, single- and multi-part.

use cryptoki_sys::*;
use memveil_vault::ring::Op;

use super::*;
use crate::asym::{AsymDecrypt, DecryptParams};
use crate::core::{DecOp, EncOp};
use crate::object::cap;
use crate::public::AsymEncrypt;

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

/// An RSA decryption mechanism's parameters (`CK_RSA_PKCS_OAEP_PARAMS`
/// and its label), copied out of the caller's memory.
///
/// # Safety
/// As [`params`]; an OAEP label pointer holds its length.
unsafe fn rsa_params(mech: *const CK_MECHANISM) -> Result<(CK_MECHANISM_TYPE, DecryptParams), Rv> {
    // SAFETY: the caller's CK_MECHANISM (contract).
    let m = unsafe { read(mech) }?;
    // SAFETY: the parameter's bytes (contract).
    let p = unsafe { bytes(m.pParameter.cast_const().cast::<u8>(), m.ulParameterLen) }?;
    let dp = match m.mechanism {
        CKM_RSA_PKCS_OAEP => {
            if p.len() != std::mem::size_of::<CK_RSA_PKCS_OAEP_PARAMS>() {
                return Err(CKR_MECHANISM_PARAM_INVALID);
            }
            // SAFETY: `p` holds a whole CK_RSA_PKCS_OAEP_PARAMS (length checked).
            let o = unsafe { read(p.as_ptr().cast::<CK_RSA_PKCS_OAEP_PARAMS>()) }?;
            if o.source != CKZ_DATA_SPECIFIED && o.ulSourceDataLen != 0 {
                return Err(CKR_MECHANISM_PARAM_INVALID);
            }
            // SAFETY: the label the parameters point to (contract).
            let label =
                unsafe { bytes(o.pSourceData.cast_const().cast::<u8>(), o.ulSourceDataLen) }?;
            DecryptParams::Oaep {
                hash: o.hashAlg,
                mgf: o.mgf,
                label: label.to_vec(),
            }
        }
        _ if p.is_empty() => DecryptParams::None,
        _ => return Err(CKR_MECHANISM_PARAM_INVALID),
    };
    Ok((m.mechanism, dp))
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
        // SAFETY: the caller's CK_MECHANISM (contract).
        let which = unsafe { read(mech) }?.mechanism;
        let new = if op == Op::Decrypt && crate::asym::is_decrypt_mech(which) {
            // SAFETY: passed on from the caller's contract.
            let (mt, p) = unsafe { rsa_params(mech) }?;
            let k = m.key(key, cap::DECRYPT)?;
            Some(DecOp::Rsa(AsymDecrypt::new(mt, p, k.vault_id, k.kind)?))
        } else {
            None
        };
        let new_enc = if op == Op::Encrypt && crate::asym::is_decrypt_mech(which) {
            // SAFETY: passed on from the caller's contract.
            let (mt, p) = unsafe { rsa_params(mech) }?;
            // Encryption with a public key runs here.
            let (k, pk) = m.public_key(key, cap::ENCRYPT)?;
            Some(EncOp::Rsa(AsymEncrypt::new(mt, p, pk, k.kind)?))
        } else {
            None
        };
        let mut g = lock(&s);
        if op == Op::Decrypt {
            if g.dec.is_some() {
                return Err(CKR_OPERATION_ACTIVE);
            }
            if let Some(d) = new {
                g.dec = Some(d);
                return Ok(());
            }
        } else {
            if g.enc.is_some() {
                return Err(CKR_OPERATION_ACTIVE);
            }
            if let Some(e) = new_enc {
                g.enc = Some(e);
                return Ok(());
            }
        }
        drop(g);
        // SAFETY: passed on from the caller's contract.
        let p = unsafe { params(mech, op) }?;
        let k = m.key(
            key,
            if op == Op::Encrypt {
                cap::ENCRYPT
            } else {
                cap::DECRYPT
            },
        )?;
        if k.class != CKO_SECRET_KEY {
            return Err(CKR_KEY_TYPE_INCONSISTENT);
        }
        let c = CryptOp::new(op, k.vault_id, p);
        let mut g = lock(&s);
        let slot_busy = if op == Op::Encrypt {
            g.enc.is_some()
        } else {
            g.dec.is_some()
        };
        if slot_busy {
            return Err(CKR_OPERATION_ACTIVE);
        }
        if op == Op::Encrypt {
            g.enc = Some(EncOp::Aes(c));
        } else {
            g.dec = Some(DecOp::Aes(c));
        }
        Ok(())
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Single,
    Update,
    Final,
}

/// An operation that turns input into output by parts.
trait Parts: Clone {
    fn bound(&self, part: Part, n: usize) -> usize;
    fn step(
        &mut self,
        m: &Module,
        part: Part,
        data: &[u8],
    ) -> Result<zeroize::Zeroizing<Vec<u8>>, Rv>;
}

impl Parts for CryptOp {
    fn bound(&self, part: Part, n: usize) -> usize {
        match part {
            Part::Single => self.single_bound(n),
            Part::Update => self.update_bound(n),
            Part::Final => self.final_bound(),
        }
    }
    fn step(
        &mut self,
        m: &Module,
        part: Part,
        data: &[u8],
    ) -> Result<zeroize::Zeroizing<Vec<u8>>, Rv> {
        let r = match part {
            Part::Single => self.single(m, data),
            Part::Update => self.update(m, data),
            Part::Final => self.finish(m),
        };
        r.map(zeroize::Zeroizing::new)
    }
}

/// An RSA operation over one block: the parts are gathered, the block is
/// processed at the last one.
trait OneBlock: Clone {
    /// The output's bound (the modulus' bytes).
    fn block(&self) -> usize;
    /// Gathers a part.
    fn gather(&mut self, part: &[u8]) -> Result<(), Rv>;
    /// Processes the gathered parts followed by `last`.
    fn last(&self, m: &Module, last: &[u8]) -> Result<zeroize::Zeroizing<Vec<u8>>, Rv>;
}

impl OneBlock for AsymEncrypt {
    fn block(&self) -> usize {
        self.k
    }
    fn gather(&mut self, part: &[u8]) -> Result<(), Rv> {
        self.update(part)
    }
    fn last(&self, _m: &Module, last: &[u8]) -> Result<zeroize::Zeroizing<Vec<u8>>, Rv> {
        self.encrypt(last)
    }
}

impl OneBlock for AsymDecrypt {
    fn block(&self) -> usize {
        self.k
    }
    fn gather(&mut self, part: &[u8]) -> Result<(), Rv> {
        self.update(part)
    }
    fn last(&self, m: &Module, last: &[u8]) -> Result<zeroize::Zeroizing<Vec<u8>>, Rv> {
        self.decrypt(m, last)
    }
}

impl<T: OneBlock> Parts for T {
    fn bound(&self, part: Part, _n: usize) -> usize {
        if part == Part::Update {
            0
        } else {
            self.block()
        }
    }
    fn step(
        &mut self,
        m: &Module,
        part: Part,
        data: &[u8],
    ) -> Result<zeroize::Zeroizing<Vec<u8>>, Rv> {
        match part {
            Part::Update => {
                self.gather(data)?;
                Ok(zeroize::Zeroizing::new(Vec::new()))
            }
            Part::Single | Part::Final => self.last(m, data),
        }
    }
}

/// One part of an operation: returns the answer and, when the held state
/// changes, the new state (`Some(None)`: the operation ends). A length
/// query or a short output buffer leaves it as it was (PKCS#11); an update
/// keeps the advanced state; a finished operation or any other error ends it.
///
/// # Safety
/// `input` holds `in_len` bytes; `outp` is NULL or holds `*out_len`
/// writable bytes; `out_len` is a writable `CK_ULONG`.
#[allow(clippy::too_many_arguments)]
unsafe fn run_part<T: Parts>(
    m: &Module,
    cur: &T,
    part: Part,
    input: *const u8,
    in_len: CK_ULONG,
    outp: *mut u8,
    out_len: *mut CK_ULONG,
) -> (Result<(), Rv>, Option<Option<T>>) {
    if out_len.is_null() || !out_len.is_aligned() {
        return (Err(CKR_ARGUMENTS_BAD), Some(None));
    }
    // SAFETY: the input the caller passed (contract); it is no longer used
    // once the output is written (the two may be the same buffer).
    let data = match unsafe { bytes(input, in_len) } {
        Ok(d) => d,
        Err(e) => return (Err(e), Some(None)),
    };
    if outp.is_null() {
        // SAFETY: checked non-NULL and aligned above.
        unsafe { *out_len = cur.bound(part, data.len()) as CK_ULONG };
        return (Ok(()), None);
    }
    let mut next = cur.clone();
    let produced = match next.step(m, part, data) {
        Ok(v) => v,
        Err(e) => return (Err(e), Some(None)),
    };
    // SAFETY: `outp` holds `*out_len` writable bytes (contract).
    match unsafe { give(outp, out_len, &produced) } {
        // A short buffer (or a misaligned one): the operation stays as it was.
        Err(e) => (Err(e), None),
        Ok(()) => (
            Ok(()),
            Some(if part == Part::Update {
                Some(next)
            } else {
                None
            }),
        ),
    }
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
        if op == Op::Encrypt {
            let (r, next) = match g.enc.as_ref().ok_or(CKR_OPERATION_NOT_INITIALIZED)? {
                EncOp::Aes(cur) => {
                    // SAFETY: passed on from the caller's contract.
                    let (r, n) = unsafe { run_part(&m, cur, part, input, in_len, outp, out_len) };
                    (r, n.map(|o| o.map(EncOp::Aes)))
                }
                EncOp::Rsa(cur) => {
                    // SAFETY: passed on from the caller's contract.
                    let (r, n) = unsafe { run_part(&m, cur, part, input, in_len, outp, out_len) };
                    (r, n.map(|o| o.map(EncOp::Rsa)))
                }
            };
            if let Some(n) = next {
                g.enc = n;
            }
            return r;
        }
        let (r, next) = match g.dec.as_ref().ok_or(CKR_OPERATION_NOT_INITIALIZED)? {
            DecOp::Aes(cur) => {
                // SAFETY: passed on from the caller's contract.
                let (r, n) = unsafe { run_part(&m, cur, part, input, in_len, outp, out_len) };
                (r, n.map(|o| o.map(DecOp::Aes)))
            }
            DecOp::Rsa(cur) => {
                // SAFETY: passed on from the caller's contract.
                let (r, n) = unsafe { run_part(&m, cur, part, input, in_len, outp, out_len) };
                (r, n.map(|o| o.map(DecOp::Rsa)))
            }
        };
        if let Some(n) = next {
            g.dec = n;
        }
        r
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
