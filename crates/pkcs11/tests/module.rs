//! The module called in-process through its C entry points, over a real
//! vault: every mechanism against OpenSSL (single- and multi-part, both key
//! sizes), the key value refused, objects found and destroyed, the error
//! codes the standard names, and eight threads at once.
#![allow(clippy::cast_possible_truncation, clippy::unwrap_used)]

mod common;

use common::{attr, attr_bytes, import, init, label, open};
use cryptoki_sys::*;
use memveil_pkcs11::ffi;
use openssl::symm::{Cipher, Crypter, Mode as Dir};

/// A small deterministic generator (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum M {
    Ecb,
    Cbc,
    CbcPad,
    Ctr,
    Gcm,
}

struct Mech {
    m: CK_MECHANISM,
    // Owned parameter storage the mechanism points into.
    _iv: Box<[u8; 16]>,
    _ctr: Box<CK_AES_CTR_PARAMS>,
    _gcm: Box<CK_GCM_PARAMS>,
    _aad: Vec<u8>,
}

fn mech(m: M, iv: [u8; 16], aad: &[u8]) -> Mech {
    let mut ivb = Box::new(iv);
    let mut ctr = Box::new(CK_AES_CTR_PARAMS {
        ulCounterBits: 128,
        cb: iv,
    });
    let mut aadv = aad.to_vec();
    let mut gcm = Box::new(CK_GCM_PARAMS {
        pIv: ivb.as_mut_ptr(),
        ulIvLen: 12,
        ulIvBits: 96,
        pAAD: aadv.as_mut_ptr(),
        ulAADLen: aadv.len() as CK_ULONG,
        ulTagBits: 128,
    });
    let (mechanism, p, l): (_, *mut std::ffi::c_void, usize) = match m {
        M::Ecb => (CKM_AES_ECB, std::ptr::null_mut(), 0),
        M::Cbc => (CKM_AES_CBC, ivb.as_mut_ptr().cast(), 16),
        M::CbcPad => (CKM_AES_CBC_PAD, ivb.as_mut_ptr().cast(), 16),
        M::Ctr => (
            CKM_AES_CTR,
            std::ptr::from_mut(&mut *ctr).cast(),
            std::mem::size_of::<CK_AES_CTR_PARAMS>(),
        ),
        M::Gcm => (
            CKM_AES_GCM,
            std::ptr::from_mut(&mut *gcm).cast(),
            std::mem::size_of::<CK_GCM_PARAMS>(),
        ),
    };
    Mech {
        m: CK_MECHANISM {
            mechanism,
            pParameter: p,
            ulParameterLen: l as CK_ULONG,
        },
        _iv: ivb,
        _ctr: ctr,
        _gcm: gcm,
        _aad: aadv,
    }
}

fn reference(m: M, key: &[u8], iv: &[u8; 16], aad: &[u8], pt: &[u8]) -> Vec<u8> {
    let k256 = key.len() == 32;
    let c = match (m, k256) {
        (M::Ecb, false) => Cipher::aes_128_ecb(),
        (M::Ecb, true) => Cipher::aes_256_ecb(),
        (M::Cbc | M::CbcPad, false) => Cipher::aes_128_cbc(),
        (M::Cbc | M::CbcPad, true) => Cipher::aes_256_cbc(),
        (M::Ctr, false) => Cipher::aes_128_ctr(),
        (M::Ctr, true) => Cipher::aes_256_ctr(),
        (M::Gcm, false) => Cipher::aes_128_gcm(),
        (M::Gcm, true) => Cipher::aes_256_gcm(),
    };
    if m == M::Gcm {
        let mut tag = [0u8; 16];
        let mut ct =
            openssl::symm::encrypt_aead(c, key, Some(&iv[..12]), aad, pt, &mut tag).unwrap();
        ct.extend_from_slice(&tag);
        return ct;
    }
    let ivo = if m == M::Ecb { None } else { Some(&iv[..]) };
    let mut cr = Crypter::new(c, Dir::Encrypt, key, ivo).unwrap();
    cr.pad(m == M::CbcPad);
    let mut out = vec![0u8; pt.len() + 32];
    let mut n = cr.update(pt, &mut out).unwrap();
    n += cr.finalize(&mut out[n..]).unwrap();
    out.truncate(n);
    out
}

type Init = unsafe extern "C" fn(CK_SESSION_HANDLE, *mut CK_MECHANISM, CK_OBJECT_HANDLE) -> CK_RV;
type One =
    unsafe extern "C" fn(CK_SESSION_HANDLE, *mut u8, CK_ULONG, *mut u8, *mut CK_ULONG) -> CK_RV;
type Fin = unsafe extern "C" fn(CK_SESSION_HANDLE, *mut u8, *mut CK_ULONG) -> CK_RV;

fn fns(enc: bool) -> (Init, One, One, Fin) {
    if enc {
        (
            ffi::C_EncryptInit,
            ffi::C_Encrypt,
            ffi::C_EncryptUpdate,
            ffi::C_EncryptFinal,
        )
    } else {
        (
            ffi::C_DecryptInit,
            ffi::C_Decrypt,
            ffi::C_DecryptUpdate,
            ffi::C_DecryptFinal,
        )
    }
}

/// Single-part, with the length query first.
fn single(
    h: CK_SESSION_HANDLE,
    enc: bool,
    mut me: Mech,
    key: CK_OBJECT_HANDLE,
    input: &[u8],
) -> Result<Vec<u8>, CK_RV> {
    let (init, one, _, _) = fns(enc);
    // SAFETY: all pointers are to live local buffers of the stated lengths.
    unsafe {
        let rv = init(h, &mut me.m, key);
        if rv != CKR_OK {
            return Err(rv);
        }
        let mut inp = input.to_vec();
        let mut n: CK_ULONG = 0;
        let rv = one(
            h,
            inp.as_mut_ptr(),
            inp.len() as CK_ULONG,
            std::ptr::null_mut(),
            &mut n,
        );
        if rv != CKR_OK {
            return Err(rv);
        }
        let mut out = vec![0u8; n as usize];
        let rv = one(
            h,
            inp.as_mut_ptr(),
            inp.len() as CK_ULONG,
            out.as_mut_ptr(),
            &mut n,
        );
        if rv != CKR_OK {
            return Err(rv);
        }
        out.truncate(n as usize);
        Ok(out)
    }
}

/// Multi-part over random splits.
fn multi(
    h: CK_SESSION_HANDLE,
    enc: bool,
    mut me: Mech,
    key: CK_OBJECT_HANDLE,
    input: &[u8],
    rng: &mut Rng,
) -> Result<Vec<u8>, CK_RV> {
    let (init, _, upd, fin) = fns(enc);
    let mut all = Vec::new();
    // SAFETY: as in `single`.
    unsafe {
        let rv = init(h, &mut me.m, key);
        if rv != CKR_OK {
            return Err(rv);
        }
        let mut rest = input;
        while !rest.is_empty() {
            let k = (1 + rng.below(40)).min(rest.len());
            let mut part = rest[..k].to_vec();
            rest = &rest[k..];
            let mut out = vec![0u8; part.len() + 32];
            let mut n = out.len() as CK_ULONG;
            let rv = upd(
                h,
                part.as_mut_ptr(),
                part.len() as CK_ULONG,
                out.as_mut_ptr(),
                &mut n,
            );
            if rv != CKR_OK {
                return Err(rv);
            }
            all.extend_from_slice(&out[..n as usize]);
        }
        let mut n: CK_ULONG = 0;
        let rv = fin(h, std::ptr::null_mut(), &mut n);
        if rv != CKR_OK {
            return Err(rv);
        }
        let mut out = vec![0u8; n as usize];
        let rv = fin(h, out.as_mut_ptr(), &mut n);
        if rv != CKR_OK {
            return Err(rv);
        }
        all.extend_from_slice(&out[..n as usize]);
    }
    Ok(all)
}

fn cmac_ref(key: &[u8], msg: &[u8]) -> Vec<u8> {
    let c = if key.len() == 16 {
        Cipher::aes_128_cbc()
    } else {
        Cipher::aes_256_cbc()
    };
    let k = openssl::pkey::PKey::cmac(&c, key).unwrap();
    let mut s = openssl::sign::Signer::new_without_digest(&k).unwrap();
    s.update(msg).unwrap();
    s.sign_to_vec().unwrap()
}

fn cmac_mech() -> CK_MECHANISM {
    CK_MECHANISM {
        mechanism: CKM_AES_CMAC,
        pParameter: std::ptr::null_mut(),
        ulParameterLen: 0,
    }
}

fn sign(
    h: CK_SESSION_HANDLE,
    key: CK_OBJECT_HANDLE,
    msg: &[u8],
    parts: Option<&mut Rng>,
) -> Vec<u8> {
    let mut m = cmac_mech();
    let mut msg = msg.to_vec();
    let mut sig = [0u8; 16];
    let mut n = 16 as CK_ULONG;
    // SAFETY: live local buffers.
    unsafe {
        assert_eq!(ffi::C_SignInit(h, &mut m, key), CKR_OK);
        match parts {
            None => assert_eq!(
                ffi::C_Sign(
                    h,
                    msg.as_mut_ptr(),
                    msg.len() as CK_ULONG,
                    sig.as_mut_ptr(),
                    &mut n
                ),
                CKR_OK
            ),
            Some(rng) => {
                let mut at = 0;
                while at < msg.len() {
                    let k = (1 + rng.below(40)).min(msg.len() - at);
                    assert_eq!(
                        ffi::C_SignUpdate(h, msg[at..].as_mut_ptr(), k as CK_ULONG),
                        CKR_OK
                    );
                    at += k;
                }
                assert_eq!(ffi::C_SignFinal(h, sig.as_mut_ptr(), &mut n), CKR_OK);
            }
        }
    }
    sig[..n as usize].to_vec()
}

fn verify(h: CK_SESSION_HANDLE, key: CK_OBJECT_HANDLE, msg: &[u8], sig: &[u8]) -> CK_RV {
    let mut m = cmac_mech();
    let mut msg = msg.to_vec();
    let mut sig = sig.to_vec();
    // SAFETY: live local buffers.
    unsafe {
        assert_eq!(ffi::C_VerifyInit(h, &mut m, key), CKR_OK);
        ffi::C_Verify(
            h,
            msg.as_mut_ptr(),
            msg.len() as CK_ULONG,
            sig.as_mut_ptr(),
            sig.len() as CK_ULONG,
        )
    }
}

fn close(h: CK_SESSION_HANDLE) {
    // SAFETY: no pointers.
    assert_eq!(unsafe { ffi::C_CloseSession(h) }, CKR_OK);
}

/// Checks every mechanism on `n_msgs` random messages with one key.
fn exercise(h: CK_SESSION_HANDLE, rng: &mut Rng, key_len: usize, lens: &[usize]) {
    let key = rng.bytes(key_len);
    let k = import(h, &key, &label("mech"), false);
    for &len in lens {
        let pt = rng.bytes(len);
        let iv: [u8; 16] = rng.bytes(16).try_into().unwrap();
        let aad_len = rng.below(40);
        let aad = rng.bytes(aad_len);
        for m in [M::Ecb, M::Cbc, M::CbcPad, M::Ctr, M::Gcm] {
            let whole = len % 16 == 0;
            let want = if whole || !matches!(m, M::Ecb | M::Cbc) {
                reference(m, &key, &iv, &aad, &pt)
            } else {
                Vec::new()
            };
            let got = single(h, true, mech(m, iv, &aad), k, &pt);
            if !whole && matches!(m, M::Ecb | M::Cbc) {
                assert_eq!(got, Err(CKR_DATA_LEN_RANGE), "{m:?} {len}");
                continue;
            }
            assert_eq!(
                got.as_ref(),
                Ok(&want),
                "{m:?} single, {key_len}-byte key, {len} bytes"
            );
            let got = multi(h, true, mech(m, iv, &aad), k, &pt, rng);
            assert_eq!(
                got.as_ref(),
                Ok(&want),
                "{m:?} multi, {key_len}-byte key, {len} bytes"
            );
            let back = single(h, false, mech(m, iv, &aad), k, &want);
            assert_eq!(back.as_ref(), Ok(&pt), "{m:?} decrypt single {len}");
            let back = multi(h, false, mech(m, iv, &aad), k, &want, rng);
            assert_eq!(back.as_ref(), Ok(&pt), "{m:?} decrypt multi {len}");
        }
        let want = cmac_ref(&key, &pt);
        assert_eq!(sign(h, k, &pt, None), want, "CMAC {len}");
        assert_eq!(sign(h, k, &pt, Some(rng)), want, "CMAC multi {len}");
        assert_eq!(verify(h, k, &pt, &want), CKR_OK);
        let mut bad = want.clone();
        bad[3] ^= 4;
        assert_eq!(verify(h, k, &pt, &bad), CKR_SIGNATURE_INVALID);
    }
}

#[test]
fn every_mechanism_matches_openssl_single_and_multi_part() {
    let h = open();
    let mut rng = Rng(17);
    let lens = [0, 1, 15, 16, 17, 31, 32, 48, 100, 1000, 4096 + 7];
    for key_len in [16, 32] {
        exercise(h, &mut rng, key_len, &lens);
    }
    close(h);
}

#[test]
fn eight_threads_at_once() {
    init();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                let h = open();
                let mut rng = Rng(1000 + t);
                for round in 0..3 {
                    exercise(
                        h,
                        &mut rng,
                        if (t + round) % 2 == 0 { 16 } else { 32 },
                        &[0, 33, 256, 1500],
                    );
                }
                close(h);
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a thread failed");
    }
}

fn get_attr(
    h: CK_SESSION_HANDLE,
    o: CK_OBJECT_HANDLE,
    t: CK_ATTRIBUTE_TYPE,
) -> (CK_RV, CK_ULONG, Vec<u8>) {
    let mut buf = vec![0u8; 64];
    let mut a = [CK_ATTRIBUTE {
        type_: t,
        pValue: buf.as_mut_ptr().cast(),
        ulValueLen: 64,
    }];
    // SAFETY: one attribute over a live 64-byte buffer.
    let rv = unsafe { ffi::C_GetAttributeValue(h, o, a.as_mut_ptr(), 1) };
    let n = a[0].ulValueLen;
    if n <= 64 {
        buf.truncate(n as usize);
    }
    (rv, n, buf)
}

fn find(h: CK_SESSION_HANDLE, t: &mut [CK_ATTRIBUTE]) -> Vec<CK_OBJECT_HANDLE> {
    let mut out = [0 as CK_OBJECT_HANDLE; 16];
    let mut n = 0;
    // SAFETY: live local buffers.
    unsafe {
        assert_eq!(
            ffi::C_FindObjectsInit(h, t.as_mut_ptr(), t.len() as CK_ULONG),
            CKR_OK
        );
        assert_eq!(ffi::C_FindObjects(h, out.as_mut_ptr(), 16, &mut n), CKR_OK);
        assert_eq!(ffi::C_FindObjectsFinal(h), CKR_OK);
    }
    out[..n as usize].to_vec()
}

#[test]
fn generated_keys_are_sensitive_found_by_label_and_id_and_destroyed() {
    let h = open();
    let lab = label("gen");
    let id = [0xc0u8, 0xde];
    let len: CK_ULONG = 32;
    let tru: CK_BBOOL = CK_TRUE;
    let fal: CK_BBOOL = CK_FALSE;
    let mut gen = CK_MECHANISM {
        mechanism: CKM_AES_KEY_GEN,
        pParameter: std::ptr::null_mut(),
        ulParameterLen: 0,
    };
    // Extractable: refused, nothing created.
    let mut t = [
        attr(CKA_VALUE_LEN, &len),
        attr(CKA_TOKEN, &tru),
        attr(CKA_EXTRACTABLE, &tru),
        attr_bytes(CKA_LABEL, lab.as_bytes()),
    ];
    let mut k = 0;
    // SAFETY: live template and out-pointer.
    let rv =
        unsafe { ffi::C_GenerateKey(h, &mut gen, t.as_mut_ptr(), t.len() as CK_ULONG, &mut k) };
    assert_eq!(rv, CKR_ATTRIBUTE_VALUE_INVALID);
    // pkcs11-tool's template (CKA_SENSITIVE=false): made, and sensitive.
    let mut t = [
        attr(CKA_VALUE_LEN, &len),
        attr(CKA_TOKEN, &tru),
        attr(CKA_SENSITIVE, &fal),
        attr(CKA_EXTRACTABLE, &fal),
        attr_bytes(CKA_LABEL, lab.as_bytes()),
        attr_bytes(CKA_ID, &id),
    ];
    // SAFETY: as above.
    let rv =
        unsafe { ffi::C_GenerateKey(h, &mut gen, t.as_mut_ptr(), t.len() as CK_ULONG, &mut k) };
    assert_eq!(rv, CKR_OK);
    let (rv, n, _) = get_attr(h, k, CKA_VALUE);
    assert_eq!(
        (rv, n),
        (CKR_ATTRIBUTE_SENSITIVE, CK_UNAVAILABLE_INFORMATION)
    );
    assert_eq!(get_attr(h, k, CKA_SENSITIVE).2, [CK_TRUE]);
    assert_eq!(get_attr(h, k, CKA_EXTRACTABLE).2, [CK_FALSE]);
    assert_eq!(get_attr(h, k, CKA_LABEL).2, lab.as_bytes());
    assert_eq!(get_attr(h, k, CKA_ID).2, id);
    assert_eq!(get_attr(h, k, CKA_VALUE_LEN).2, 32u64.to_ne_bytes());
    // Positive control of the lookup: the key is found by label, by id.
    assert_eq!(find(h, &mut [attr_bytes(CKA_LABEL, lab.as_bytes())]), [k]);
    assert_eq!(find(h, &mut [attr_bytes(CKA_ID, &id)]), [k]);
    // Another session (another process would do the same) sees the token object.
    let h2 = open();
    let seen = find(h2, &mut [attr_bytes(CKA_ID, &id)]);
    assert_eq!(seen.len(), 1);
    // It encrypts.
    let ct = single(h2, true, mech(M::Gcm, [7; 16], b"a"), seen[0], b"hello").unwrap();
    assert_eq!(
        single(h2, false, mech(M::Gcm, [7; 16], b"a"), seen[0], &ct).unwrap(),
        b"hello"
    );
    // SAFETY: no pointers.
    assert_eq!(unsafe { ffi::C_DestroyObject(h, k) }, CKR_OK);
    assert!(find(h, &mut [attr_bytes(CKA_LABEL, lab.as_bytes())]).is_empty());
    assert_eq!(get_attr(h, k, CKA_LABEL).0, CKR_OBJECT_HANDLE_INVALID);
    // SAFETY: no pointers.
    let again = unsafe { ffi::C_DestroyObject(h, k) };
    assert_eq!(again, CKR_OBJECT_HANDLE_INVALID);
    close(h2);
    close(h);
}

#[test]
fn session_objects_leave_the_vault_with_their_session() {
    let h = open();
    let k = import(h, &[9u8; 16], "scratch", false);
    let mut c = memveil_vault::Client::connect(&common::vault().socket).unwrap();
    let named = |c: &mut memveil_vault::Client| {
        c.list_keys()
            .unwrap()
            .into_iter()
            .filter(|k| k.name.starts_with(&format!("p11s.{}.", std::process::id())))
            .count()
    };
    let before = named(&mut c);
    assert!(before >= 1, "the session object is a vault key");
    assert_eq!(get_attr(h, k, CKA_TOKEN).2, [CK_FALSE]);
    close(h);
    assert_eq!(get_attr(open(), k, CKA_LABEL).0, CKR_OBJECT_HANDLE_INVALID);
    assert!(
        named(&mut c) < before,
        "closing the session destroyed its key"
    );
}

#[test]
fn errors_have_the_codes_the_standard_names() {
    let h = open();
    let k = import(h, &[1u8; 32], &label("err"), false);
    let mut out = [0u8; 64];
    let mut n: CK_ULONG = 64;
    // SAFETY: every pointer below is to a live local buffer, or NULL on purpose.
    unsafe {
        // An unknown mechanism; a bad IV length; a GCM nonce of 16 bytes.
        let mut bad = CK_MECHANISM {
            mechanism: CKM_SHA256,
            pParameter: std::ptr::null_mut(),
            ulParameterLen: 0,
        };
        assert_eq!(ffi::C_EncryptInit(h, &mut bad, k), CKR_MECHANISM_INVALID);
        assert_eq!(ffi::C_SignInit(h, &mut bad, k), CKR_MECHANISM_INVALID);
        let mut iv = [0u8; 8];
        let mut cbc8 = CK_MECHANISM {
            mechanism: CKM_AES_CBC,
            pParameter: iv.as_mut_ptr().cast(),
            ulParameterLen: 8,
        };
        assert_eq!(
            ffi::C_EncryptInit(h, &mut cbc8, k),
            CKR_MECHANISM_PARAM_INVALID
        );
        let mut g = mech(M::Gcm, [0; 16], b"");
        g._gcm.ulIvLen = 16;
        assert_eq!(
            ffi::C_EncryptInit(h, &mut g.m, k),
            CKR_MECHANISM_PARAM_INVALID
        );
        // No operation; then one already active.
        assert_eq!(
            ffi::C_Encrypt(h, out.as_mut_ptr(), 16, out.as_mut_ptr(), &mut n),
            CKR_OPERATION_NOT_INITIALIZED
        );
        let mut e = mech(M::Ecb, [0; 16], b"");
        assert_eq!(ffi::C_EncryptInit(h, &mut e.m, k), CKR_OK);
        assert_eq!(ffi::C_EncryptInit(h, &mut e.m, k), CKR_OPERATION_ACTIVE);
        // Too short an output buffer: the length, and the operation stays.
        let mut small: CK_ULONG = 8;
        assert_eq!(
            ffi::C_Encrypt(h, out.as_mut_ptr(), 32, out.as_mut_ptr(), &mut small),
            CKR_BUFFER_TOO_SMALL
        );
        assert_eq!(small, 32);
        n = 64;
        assert_eq!(
            ffi::C_Encrypt(h, out.as_mut_ptr(), 32, out.as_mut_ptr(), &mut n),
            CKR_OK
        );
        assert_eq!(n, 32);
        // ECB over 15 bytes; the operation ends.
        assert_eq!(ffi::C_EncryptInit(h, &mut e.m, k), CKR_OK);
        n = 64;
        assert_eq!(
            ffi::C_Encrypt(h, out.as_mut_ptr(), 15, out.as_mut_ptr(), &mut n),
            CKR_DATA_LEN_RANGE
        );
        assert_eq!(
            ffi::C_EncryptUpdate(h, out.as_mut_ptr(), 16, out.as_mut_ptr(), &mut n),
            CKR_OPERATION_NOT_INITIALIZED
        );
        // NULL length pointer.
        assert_eq!(ffi::C_EncryptInit(h, &mut e.m, k), CKR_OK);
        assert_eq!(
            ffi::C_Encrypt(
                h,
                out.as_mut_ptr(),
                16,
                out.as_mut_ptr(),
                std::ptr::null_mut()
            ),
            CKR_ARGUMENTS_BAD
        );
        // A wrong key handle; a NULL mechanism.
        assert_eq!(
            ffi::C_EncryptInit(h, &mut e.m, 0xdead_beef),
            CKR_KEY_HANDLE_INVALID
        );
        assert_eq!(
            ffi::C_EncryptInit(h, std::ptr::null_mut(), k),
            CKR_ARGUMENTS_BAD
        );
        // A tampered GCM message; bad CBC padding.
        let mut ct = single(h, true, mech(M::Gcm, [3; 16], b"x"), k, b"attack at dawn").unwrap();
        ct[0] ^= 1;
        assert_eq!(
            single(h, false, mech(M::Gcm, [3; 16], b"x"), k, &ct),
            Err(CKR_ENCRYPTED_DATA_INVALID)
        );
        let raw = single(h, true, mech(M::Cbc, [3; 16], b""), k, &[0u8; 16]).unwrap();
        assert_eq!(
            single(h, false, mech(M::CbcPad, [3; 16], b""), k, &raw),
            Err(CKR_ENCRYPTED_DATA_INVALID)
        );
        assert_eq!(
            single(h, false, mech(M::CbcPad, [3; 16], b""), k, &raw[..15]),
            Err(CKR_ENCRYPTED_DATA_LEN_RANGE)
        );
        // A digest is not a key mechanism.
        assert_eq!(ffi::C_DigestInit(h, &mut bad), CKR_OK);
        assert_eq!(ffi::C_DigestInit(h, &mut bad), CKR_OPERATION_ACTIVE);
        assert_eq!(
            ffi::C_SetAttributeValue(h, k, std::ptr::null_mut(), 0),
            CKR_ATTRIBUTE_READ_ONLY
        );
        // Random: from the DRBG, different each time; NULL with a length.
        let (mut a, mut b) = ([0u8; 32], [0u8; 32]);
        assert_eq!(ffi::C_GenerateRandom(h, a.as_mut_ptr(), 32), CKR_OK);
        assert_eq!(ffi::C_GenerateRandom(h, b.as_mut_ptr(), 32), CKR_OK);
        assert_ne!(a, b);
        assert_ne!(a, [0u8; 32]);
        assert_eq!(
            ffi::C_GenerateRandom(h, std::ptr::null_mut(), 32),
            CKR_ARGUMENTS_BAD
        );
        assert_eq!(
            ffi::C_SeedRandom(h, a.as_mut_ptr(), 32),
            CKR_RANDOM_SEED_NOT_SUPPORTED
        );
        // Issue 36: the arguments are checked before the feature.
        assert_eq!(
            ffi::C_SeedRandom(h, std::ptr::null_mut(), 1),
            CKR_ARGUMENTS_BAD
        );
    }
    close(h);
    // SAFETY: a closed session; the pointers are valid.
    unsafe {
        let mut e = mech(M::Ecb, [0; 16], b"");
        assert_eq!(
            ffi::C_EncryptInit(h, &mut e.m, k),
            CKR_SESSION_HANDLE_INVALID
        );
        assert_eq!(ffi::C_CloseSession(h), CKR_SESSION_HANDLE_INVALID);
        assert_eq!(
            ffi::C_GenerateRandom(h, out.as_mut_ptr(), 1),
            CKR_SESSION_HANDLE_INVALID
        );
    }
}
