//! Issue 36: what a conformance suite asks of a token, against OpenSSL's
//! answers, run through the PKCS#11 function list of this module and of
//! SoftHSM2 (loaded with `dlopen`, its own token; the positive control:
//! every case passes there too, where SoftHSM2 has the feature).
//!
//! - digests (SHA-1, SHA-224, SHA-256, SHA-384, SHA-512), single- and
//!   multi-part, equal to OpenSSL's;
//! - HMAC with RFC 4231's keys and messages (and OpenSSL's MACs of them),
//!   sign and verify, single- and multi-part, a changed MAC refused;
//!   generic secret keys generated and imported, never readable;
//! - signatures both ways: made by the token and verified by OpenSSL, made
//!   by OpenSSL and verified by the token (RSA PKCS#1 v1.5, PSS, ECDSA,
//!   Ed25519), recovery, RSA encryption decrypted by OpenSSL;
//! - `CKO_DATA` objects; the return codes the standard orders.
#![allow(
    clippy::unwrap_used,
    clippy::cast_possible_truncation,
    clippy::too_many_lines
)]

mod common;

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cryptoki_sys::*;
use openssl::hash::MessageDigest;
use openssl::pkey::PKey;
use openssl::sign::{RsaPssSaltlen, Signer, Verifier};

/// One token: a function list with a logged-in read/write session.
struct Token {
    name: &'static str,
    f: &'static CK_FUNCTION_LIST,
    slot: CK_SLOT_ID,
}

macro_rules! call {
    ($t:expr, $f:ident $(, $a:expr)*) => {{
        let f = $t.f.$f.expect(stringify!($f));
        // SAFETY: a PKCS#11 entry point called with pointers to live locals
        // of the types the standard names (or NULL where it allows).
        unsafe { f($($a),*) }
    }};
}

fn ok(what: &str, rv: CK_RV) {
    assert_eq!(rv, CKR_OK, "{what}: {rv:#x}");
}

/// `dlopen`s `path` (never closed) and returns its function list.
fn load(path: &Path) -> &'static CK_FUNCTION_LIST {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; the handle is kept for the process's life.
    let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!lib.is_null(), "dlopen {}", path.display());
    // SAFETY: a live handle and a NUL-terminated name.
    let sym = unsafe { libc::dlsym(lib, c"C_GetFunctionList".as_ptr()) };
    assert!(!sym.is_null(), "no C_GetFunctionList");
    // SAFETY: PKCS#11 defines the symbol with exactly this signature.
    let get: unsafe extern "C" fn(*mut *mut CK_FUNCTION_LIST) -> CK_RV =
        unsafe { std::mem::transmute(sym) };
    let mut list = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    ok("C_GetFunctionList", unsafe { get(&mut list) });
    // SAFETY: the list lives as long as the library (forever here).
    unsafe { list.as_ref() }.unwrap()
}

fn memveil() -> &'static Token {
    static T: OnceLock<Token> = OnceLock::new();
    T.get_or_init(|| {
        common::init();
        let mut list = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        ok("C_GetFunctionList", unsafe {
            memveil_pkcs11::ffi::C_GetFunctionList(&mut list)
        });
        Token {
            name: "memveil",
            // SAFETY: the module's static list.
            f: unsafe { list.as_ref() }.unwrap(),
            slot: 0,
        }
    })
}

/// SoftHSM2 with a fresh token (PIN 1234) in a scratch directory; `None`
/// after a skip line when it is not installed.
fn softhsm() -> Option<&'static Token> {
    static T: OnceLock<Option<(Token, PathBuf)>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("memveil-p11-conf-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (lib, conf) = common::softhsm_token(&dir, "conf")?;
        // Read by SoftHSM2's C_Initialize, once, before any test thread
        // loads it.
        std::env::set_var("SOFTHSM2_CONF", &conf);
        let f = load(&lib);
        let t = Token {
            name: "softhsm2",
            f,
            slot: 0,
        };
        // The tests run on several threads: with NULL arguments SoftHSM2
        // takes the caller at its word that it is single-threaded and
        // turns its own locks off (a session's objects then race, seen as
        // CKR_GENERAL_ERROR now and then); CKF_OS_LOCKING_OK keeps them.
        let mut args = CK_C_INITIALIZE_ARGS {
            CreateMutex: None,
            DestroyMutex: None,
            LockMutex: None,
            UnlockMutex: None,
            flags: CKF_OS_LOCKING_OK,
            pReserved: std::ptr::null_mut(),
        };
        ok(
            "C_Initialize",
            call!(t, C_Initialize, std::ptr::addr_of_mut!(args).cast()),
        );
        let mut slots = [0 as CK_SLOT_ID; 8];
        let mut n = 8;
        ok(
            "C_GetSlotList",
            call!(t, C_GetSlotList, CK_TRUE, slots.as_mut_ptr(), &mut n),
        );
        let t = Token {
            slot: slots[0],
            ..t
        };
        let s = t.open();
        let pin = b"1234";
        ok(
            "C_Login",
            call!(t, C_Login, s, CKU_USER, pin.as_ptr().cast_mut(), 4),
        );
        Some((t, dir))
    })
    .as_ref()
    .map(|(t, _)| t)
}

fn tokens() -> Vec<&'static Token> {
    let mut v = vec![memveil()];
    v.extend(softhsm());
    v
}

fn attr<T>(t: CK_ATTRIBUTE_TYPE, v: &T) -> CK_ATTRIBUTE {
    common::attr(t, v)
}

fn attr_bytes(t: CK_ATTRIBUTE_TYPE, v: &[u8]) -> CK_ATTRIBUTE {
    common::attr_bytes(t, v)
}

fn mech(m: CK_MECHANISM_TYPE) -> CK_MECHANISM {
    CK_MECHANISM {
        mechanism: m,
        pParameter: std::ptr::null_mut(),
        ulParameterLen: 0,
    }
}

const TRUE: CK_BBOOL = CK_TRUE;
const FALSE: CK_BBOOL = CK_FALSE;

impl Token {
    fn open(&self) -> CK_SESSION_HANDLE {
        let mut h = 0;
        ok(
            "C_OpenSession",
            call!(
                self,
                C_OpenSession,
                self.slot,
                CKF_SERIAL_SESSION | CKF_RW_SESSION,
                std::ptr::null_mut(),
                None,
                &mut h
            ),
        );
        h
    }

    fn has(&self, m: CK_MECHANISM_TYPE) -> bool {
        let mut info = CK_MECHANISM_INFO {
            ulMinKeySize: 0,
            ulMaxKeySize: 0,
            flags: 0,
        };
        call!(self, C_GetMechanismInfo, self.slot, m, &mut info) == CKR_OK
    }

    fn create(
        &self,
        h: CK_SESSION_HANDLE,
        t: &mut [CK_ATTRIBUTE],
    ) -> Result<CK_OBJECT_HANDLE, CK_RV> {
        let mut o = 0;
        match call!(
            self,
            C_CreateObject,
            h,
            t.as_mut_ptr(),
            t.len() as CK_ULONG,
            &mut o
        ) {
            CKR_OK => Ok(o),
            rv => Err(rv),
        }
    }

    fn get(
        &self,
        h: CK_SESSION_HANDLE,
        o: CK_OBJECT_HANDLE,
        ty: CK_ATTRIBUTE_TYPE,
    ) -> Result<Vec<u8>, CK_RV> {
        let mut a = CK_ATTRIBUTE {
            type_: ty,
            pValue: std::ptr::null_mut(),
            ulValueLen: 0,
        };
        let rv = call!(self, C_GetAttributeValue, h, o, &mut a, 1);
        if rv != CKR_OK {
            return Err(rv);
        }
        let mut v = vec![0u8; a.ulValueLen as usize];
        a.pValue = v.as_mut_ptr().cast();
        match call!(self, C_GetAttributeValue, h, o, &mut a, 1) {
            CKR_OK => Ok(v),
            rv => Err(rv),
        }
    }

    fn digest(&self, h: CK_SESSION_HANDLE, m: CK_MECHANISM_TYPE, parts: &[&[u8]]) -> Vec<u8> {
        let mut mm = mech(m);
        ok("C_DigestInit", call!(self, C_DigestInit, h, &mut mm));
        let mut out = [0u8; 64];
        let mut n: CK_ULONG = 64;
        if let [one] = parts {
            ok(
                "C_Digest",
                call!(
                    self,
                    C_Digest,
                    h,
                    one.as_ptr().cast_mut(),
                    one.len() as CK_ULONG,
                    out.as_mut_ptr(),
                    &mut n
                ),
            );
        } else {
            for p in parts {
                ok(
                    "C_DigestUpdate",
                    call!(
                        self,
                        C_DigestUpdate,
                        h,
                        p.as_ptr().cast_mut(),
                        p.len() as CK_ULONG
                    ),
                );
            }
            ok(
                "C_DigestFinal",
                call!(self, C_DigestFinal, h, out.as_mut_ptr(), &mut n),
            );
        }
        out[..n as usize].to_vec()
    }

    /// Signs the parts (one part: `C_Sign`, else updates and the final).
    fn sign(
        &self,
        h: CK_SESSION_HANDLE,
        mm: &mut CK_MECHANISM,
        k: CK_OBJECT_HANDLE,
        parts: &[&[u8]],
    ) -> Result<Vec<u8>, CK_RV> {
        let rv = call!(self, C_SignInit, h, mm, k);
        if rv != CKR_OK {
            return Err(rv);
        }
        let mut out = vec![0u8; 1024];
        let mut n = out.len() as CK_ULONG;
        let rv = if let [one] = parts {
            call!(
                self,
                C_Sign,
                h,
                one.as_ptr().cast_mut(),
                one.len() as CK_ULONG,
                out.as_mut_ptr(),
                &mut n
            )
        } else {
            for p in parts {
                let rv = call!(
                    self,
                    C_SignUpdate,
                    h,
                    p.as_ptr().cast_mut(),
                    p.len() as CK_ULONG
                );
                if rv != CKR_OK {
                    return Err(rv);
                }
            }
            call!(self, C_SignFinal, h, out.as_mut_ptr(), &mut n)
        };
        if rv != CKR_OK {
            return Err(rv);
        }
        out.truncate(n as usize);
        Ok(out)
    }

    fn verify(
        &self,
        h: CK_SESSION_HANDLE,
        mm: &mut CK_MECHANISM,
        k: CK_OBJECT_HANDLE,
        parts: &[&[u8]],
        sig: &[u8],
    ) -> CK_RV {
        let rv = call!(self, C_VerifyInit, h, mm, k);
        if rv != CKR_OK {
            return rv;
        }
        if let [one] = parts {
            return call!(
                self,
                C_Verify,
                h,
                one.as_ptr().cast_mut(),
                one.len() as CK_ULONG,
                sig.as_ptr().cast_mut(),
                sig.len() as CK_ULONG
            );
        }
        for p in parts {
            let rv = call!(
                self,
                C_VerifyUpdate,
                h,
                p.as_ptr().cast_mut(),
                p.len() as CK_ULONG
            );
            if rv != CKR_OK {
                return rv;
            }
        }
        call!(
            self,
            C_VerifyFinal,
            h,
            sig.as_ptr().cast_mut(),
            sig.len() as CK_ULONG
        )
    }

    fn destroy(&self, h: CK_SESSION_HANDLE, o: CK_OBJECT_HANDLE) {
        ok("C_DestroyObject", call!(self, C_DestroyObject, h, o));
    }

    fn close(&self, h: CK_SESSION_HANDLE) {
        ok("C_CloseSession", call!(self, C_CloseSession, h));
    }
}

fn thirds(d: &[u8]) -> [&[u8]; 3] {
    let a = d.len() / 3;
    [&d[..a], &d[a..2 * a], &d[2 * a..]]
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 31 + 7) as u8).collect()
}

#[test]
fn digests_are_openssls_single_and_multi_part() {
    let algs = [
        (CKM_SHA_1, MessageDigest::sha1()),
        (CKM_SHA224, MessageDigest::sha224()),
        (CKM_SHA256, MessageDigest::sha256()),
        (CKM_SHA384, MessageDigest::sha384()),
        (CKM_SHA512, MessageDigest::sha512()),
    ];
    for t in tokens() {
        let h = t.open();
        for (m, md) in &algs {
            for len in [0, 1, 55, 64, 1000, 70_000] {
                let data = pattern(len);
                let want = openssl::hash::hash(*md, &data).unwrap().to_vec();
                assert_eq!(t.digest(h, *m, &[&data]), want, "{} {m:#x} {len}", t.name);
                assert_eq!(
                    t.digest(h, *m, &thirds(&data)),
                    want,
                    "{} {m:#x} {len} parts",
                    t.name
                );
            }
        }
        // MD5 is not offered here (SoftHSM2 has it).
        if t.name == "memveil" {
            let mut md5 = mech(CKM_MD5);
            assert_eq!(call!(t, C_DigestInit, h, &mut md5), CKR_MECHANISM_INVALID);
        }
        t.close(h);
    }
}

/// A generic secret imported with `value`, for HMAC.
fn secret(t: &Token, h: CK_SESSION_HANDLE, value: &[u8]) -> Result<CK_OBJECT_HANDLE, CK_RV> {
    let (class, kt) = (CKO_SECRET_KEY, CKK_GENERIC_SECRET);
    let mut tpl = [
        attr(CKA_CLASS, &class),
        attr(CKA_KEY_TYPE, &kt),
        attr(CKA_TOKEN, &FALSE),
        attr(CKA_SENSITIVE, &TRUE),
        attr(CKA_SIGN, &TRUE),
        attr(CKA_VERIFY, &TRUE),
        attr_bytes(CKA_VALUE, value),
    ];
    t.create(h, &mut tpl)
}

fn hmac_openssl(md: MessageDigest, key: &[u8], data: &[u8]) -> Vec<u8> {
    let k = PKey::hmac(key).unwrap();
    let mut s = Signer::new(md, &k).unwrap();
    s.sign_oneshot_to_vec(data).unwrap()
}

#[test]
fn hmac_gives_rfc4231_and_openssl_macs_and_refuses_a_changed_one() {
    // RFC 4231 test cases 1, 3, 4, 6 and 7 (case 5 is truncated output).
    let c4: Vec<u8> = (1..=25).collect();
    let cases: [(Vec<u8>, Vec<u8>); 5] = [
        (vec![0x0b; 20], b"Hi There".to_vec()),
        (vec![0xaa; 20], vec![0xdd; 50]),
        (c4, vec![0xcd; 50]),
        (vec![0xaa; 131], b"Test Using Larger Than Block-Size Key - Hash Key First".to_vec()),
        (
            vec![0xaa; 131],
            b"This is a test using a larger than block-size key and a larger than block-size data. The key needs to be hashed before being used by the HMAC algorithm.".to_vec(),
        ),
    ];
    let mechs = [
        (CKM_SHA_1_HMAC, MessageDigest::sha1()),
        (CKM_SHA224_HMAC, MessageDigest::sha224()),
        (CKM_SHA256_HMAC, MessageDigest::sha256()),
        (CKM_SHA384_HMAC, MessageDigest::sha384()),
        (CKM_SHA512_HMAC, MessageDigest::sha512()),
    ];
    // RFC 4231's own values for case 1 (OpenSSL's agree, checked below).
    assert_eq!(
        hex::encode(hmac_openssl(
            MessageDigest::sha256(),
            &cases[0].0,
            &cases[0].1
        )),
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
    );
    assert_eq!(
        hex::encode(hmac_openssl(MessageDigest::sha512(), &cases[0].0, &cases[0].1)),
        "87aa7cdea5ef619d4ff0b4241a1d6cb02379f4e2ce4ec2787ad0b30545e17cdedaa833b7d6b8a702038b274eaea3f4e4be9d914eeb61f1702e696c203a126854"
    );
    for t in tokens() {
        let h = t.open();
        for (key, data) in &cases {
            let k = secret(t, h, key).unwrap();
            for (m, md) in &mechs {
                let want = hmac_openssl(*md, key, data);
                let mut mm = mech(*m);
                if t.name == "softhsm2" && key.len() < md.size() {
                    // SoftHSM2 wants a key at least as long as the MAC.
                    assert_eq!(t.sign(h, &mut mm, k, &[data]), Err(CKR_KEY_SIZE_RANGE));
                    continue;
                }
                assert_eq!(
                    t.sign(h, &mut mm, k, &[data]).unwrap(),
                    want,
                    "{} {m:#x}",
                    t.name
                );
                assert_eq!(
                    t.sign(h, &mut mm, k, &thirds(data)).unwrap(),
                    want,
                    "{} {m:#x} parts",
                    t.name
                );
                assert_eq!(
                    t.verify(h, &mut mm, k, &[data], &want),
                    CKR_OK,
                    "{}",
                    t.name
                );
                assert_eq!(
                    t.verify(h, &mut mm, k, &thirds(data), &want),
                    CKR_OK,
                    "{}",
                    t.name
                );
                let mut bad = want.clone();
                bad[0] ^= 1;
                assert_eq!(
                    t.verify(h, &mut mm, k, &[data], &bad),
                    CKR_SIGNATURE_INVALID,
                    "{}",
                    t.name
                );
                assert_eq!(
                    t.verify(h, &mut mm, k, &[data], &want[..want.len() - 1]),
                    CKR_SIGNATURE_LEN_RANGE,
                    "{}",
                    t.name
                );
            }
            // The key is never given out.
            assert_eq!(
                t.get(h, k, CKA_VALUE),
                Err(CKR_ATTRIBUTE_SENSITIVE),
                "{}",
                t.name
            );
            t.destroy(h, k);
        }
        // RFC 4231 case 2's 4-byte key ("Jefe"): below 112 bits, refused at
        // import here; SoftHSM2 imports it and refuses to MAC with it.
        let jefe = secret(t, h, b"Jefe");
        if t.name == "memveil" {
            assert_eq!(jefe, Err(CKR_ATTRIBUTE_VALUE_INVALID));
        } else {
            let mut mm = mech(CKM_SHA256_HMAC);
            let msg: &[u8] = b"what do ya want for nothing?";
            assert_eq!(
                t.sign(h, &mut mm, jefe.unwrap(), &[msg]),
                Err(CKR_KEY_SIZE_RANGE)
            );
        }
        // Generated: CKM_GENERIC_SECRET_KEY_GEN, 48 bytes; signs and verifies.
        let len: CK_ULONG = 48;
        let mut tpl = [
            attr(CKA_VALUE_LEN, &len),
            attr(CKA_TOKEN, &FALSE),
            attr(CKA_SENSITIVE, &TRUE),
            attr(CKA_SIGN, &TRUE),
            attr(CKA_VERIFY, &TRUE),
        ];
        let mut gen = mech(CKM_GENERIC_SECRET_KEY_GEN);
        let mut k = 0;
        ok(
            "C_GenerateKey",
            call!(
                t,
                C_GenerateKey,
                h,
                &mut gen,
                tpl.as_mut_ptr(),
                tpl.len() as CK_ULONG,
                &mut k
            ),
        );
        assert_eq!(t.get(h, k, CKA_VALUE_LEN).unwrap(), len.to_ne_bytes());
        assert_eq!(
            t.get(h, k, CKA_KEY_TYPE).unwrap(),
            CKK_GENERIC_SECRET.to_ne_bytes()
        );
        assert_eq!(
            t.get(h, k, CKA_VALUE),
            Err(CKR_ATTRIBUTE_SENSITIVE),
            "{}",
            t.name
        );
        assert_eq!(t.get(h, k, CKA_SIGN).unwrap(), [CK_TRUE], "{}", t.name);
        assert_eq!(t.get(h, k, CKA_VERIFY).unwrap(), [CK_TRUE], "{}", t.name);
        let mut mm = mech(CKM_SHA384_HMAC);
        let mac = t.sign(h, &mut mm, k, &[b"generated"]).unwrap();
        assert_eq!(mac.len(), 48);
        assert_eq!(
            t.verify(h, &mut mm, k, &[b"gene", b"rated"], &mac),
            CKR_OK,
            "{}",
            t.name
        );
        t.close(h);
    }
}

/// `C_DigestKey`: the digest of data, a generic secret's bytes, data — the
/// vault hashes the key; the answer is OpenSSL's over the same bytes.
#[test]
fn digest_key_hashes_the_secret_inside_the_vault() {
    let t = memveil();
    let h = t.open();
    let key = pattern(32);
    let k = secret(t, h, &key).unwrap();
    let mut mm = mech(CKM_SHA256);
    ok("C_DigestInit", call!(t, C_DigestInit, h, &mut mm));
    let (a, b) = (b"before".to_vec(), b"after".to_vec());
    ok(
        "C_DigestUpdate",
        call!(t, C_DigestUpdate, h, a.as_ptr().cast_mut(), 6),
    );
    ok("C_DigestKey", call!(t, C_DigestKey, h, k));
    ok(
        "C_DigestUpdate",
        call!(t, C_DigestUpdate, h, b.as_ptr().cast_mut(), 5),
    );
    let mut out = [0u8; 32];
    let mut n: CK_ULONG = 32;
    ok(
        "C_DigestFinal",
        call!(t, C_DigestFinal, h, out.as_mut_ptr(), &mut n),
    );
    let mut all = a.clone();
    all.extend(&key);
    all.extend(&b);
    assert_eq!(
        out.to_vec(),
        openssl::hash::hash(MessageDigest::sha256(), &all)
            .unwrap()
            .to_vec()
    );
    // A key longer than a hash block: HMAC keys with its digest, so the
    // digest is refused (else C_DigestKey would hand out the HMAC key).
    let long = secret(t, h, &pattern(100)).unwrap();
    ok("C_DigestInit", call!(t, C_DigestInit, h, &mut mm));
    assert_eq!(call!(t, C_DigestKey, h, long), CKR_KEY_INDIGESTIBLE);
    // An AES key: the vault keeps no bytes of it apart from its schedule.
    let aes = common::import(h, &[7; 32], &common::label("dk"), false);
    ok("C_DigestInit", call!(t, C_DigestInit, h, &mut mm));
    assert_eq!(call!(t, C_DigestKey, h, aes), CKR_KEY_INDIGESTIBLE);
    t.close(h);
}

/// An RSA-2048 (or EC / Ed25519) pair generated in the token.
fn pair(
    t: &Token,
    h: CK_SESSION_HANDLE,
    m: CK_MECHANISM_TYPE,
    params: Option<&[u8]>,
) -> (CK_OBJECT_HANDLE, CK_OBJECT_HANDLE) {
    let bits: CK_ULONG = 2048;
    let e = [1u8, 0, 1];
    let mut pubt = vec![
        attr(CKA_TOKEN, &FALSE),
        attr(CKA_VERIFY, &TRUE),
        attr(CKA_ENCRYPT, &TRUE),
    ];
    match params {
        None => {
            pubt.push(attr(CKA_MODULUS_BITS, &bits));
            pubt.push(attr_bytes(CKA_PUBLIC_EXPONENT, &e));
        }
        Some(p) => pubt.push(attr_bytes(CKA_EC_PARAMS, p)),
    }
    if params.is_some() {
        pubt.remove(2);
    }
    let mut privt = [
        attr(CKA_TOKEN, &FALSE),
        attr(CKA_SIGN, &TRUE),
        attr(CKA_SENSITIVE, &TRUE),
    ];
    let mut mm = mech(m);
    let (mut pk, mut sk) = (0, 0);
    ok(
        "C_GenerateKeyPair",
        call!(
            t,
            C_GenerateKeyPair,
            h,
            &mut mm,
            pubt.as_mut_ptr(),
            pubt.len() as CK_ULONG,
            privt.as_mut_ptr(),
            privt.len() as CK_ULONG,
            &mut pk,
            &mut sk
        ),
    );
    (pk, sk)
}

fn pss_params(
    hash: CK_MECHANISM_TYPE,
    mgf: CK_RSA_PKCS_MGF_TYPE,
    salt: CK_ULONG,
) -> CK_RSA_PKCS_PSS_PARAMS {
    CK_RSA_PKCS_PSS_PARAMS {
        hashAlg: hash,
        mgf,
        sLen: salt,
    }
}

fn with_param<T>(m: CK_MECHANISM_TYPE, p: &mut T) -> CK_MECHANISM {
    CK_MECHANISM {
        mechanism: m,
        pParameter: std::ptr::from_mut(p).cast(),
        ulParameterLen: std::mem::size_of::<T>() as CK_ULONG,
    }
}

const ED25519_OID: [u8; 5] = [0x06, 0x03, 0x2b, 0x65, 0x70];

#[test]
fn signatures_verify_both_ways_with_openssl() {
    use openssl::bn::BigNum;
    use openssl::ec::{EcGroup, EcKey, PointConversionForm};
    use openssl::nid::Nid;
    use openssl::rsa::{Padding, Rsa};
    let msg: &[u8] = b"signed on one side, verified on the other";
    for t in tokens() {
        let h = t.open();
        // --- RSA: the token signs, OpenSSL verifies.
        let (pk, sk) = pair(t, h, CKM_RSA_PKCS_KEY_PAIR_GEN, None);
        let n = t.get(h, pk, CKA_MODULUS).unwrap();
        let e = t.get(h, pk, CKA_PUBLIC_EXPONENT).unwrap();
        let rsa = Rsa::from_public_components(
            BigNum::from_slice(&n).unwrap(),
            BigNum::from_slice(&e).unwrap(),
        )
        .unwrap();
        let opk = PKey::from_rsa(rsa).unwrap();
        let mut m = mech(CKM_SHA256_RSA_PKCS);
        let sig = t.sign(h, &mut m, sk, &thirds(msg)).unwrap();
        let mut v = Verifier::new(MessageDigest::sha256(), &opk).unwrap();
        assert!(
            v.verify_oneshot(&sig, msg).unwrap(),
            "{}: SHA256-RSA-PKCS",
            t.name
        );
        assert_eq!(t.verify(h, &mut m, pk, &[msg], &sig), CKR_OK, "{}", t.name);
        let mut pp = pss_params(CKM_SHA256, CKG_MGF1_SHA256, 32);
        let mut m = with_param(CKM_SHA256_RSA_PKCS_PSS, &mut pp);
        let sig = t.sign(h, &mut m, sk, &[msg]).unwrap();
        let mut v = Verifier::new(MessageDigest::sha256(), &opk).unwrap();
        v.set_rsa_padding(Padding::PKCS1_PSS).unwrap();
        v.set_rsa_pss_saltlen(RsaPssSaltlen::custom(32)).unwrap();
        assert!(v.verify_oneshot(&sig, msg).unwrap(), "{}: PSS", t.name);
        assert_eq!(
            t.verify(h, &mut m, pk, &thirds(msg), &sig),
            CKR_OK,
            "{}",
            t.name
        );
        // --- RSA: OpenSSL signs, the token verifies with the public key
        // imported; recovery; encryption decrypted by OpenSSL.
        let r = Rsa::generate(2048).unwrap();
        let osk = PKey::from_rsa(r.clone()).unwrap();
        let (class, kt) = (CKO_PUBLIC_KEY, CKK_RSA);
        let (rn, re) = (r.n().to_vec(), r.e().to_vec());
        let mut tpl = [
            attr(CKA_CLASS, &class),
            attr(CKA_KEY_TYPE, &kt),
            attr(CKA_TOKEN, &FALSE),
            attr(CKA_VERIFY, &TRUE),
            attr(CKA_ENCRYPT, &TRUE),
            attr(CKA_VERIFY_RECOVER, &TRUE),
            attr_bytes(CKA_LABEL, b"openssl"),
            attr_bytes(CKA_MODULUS, &rn),
            attr_bytes(CKA_PUBLIC_EXPONENT, &re),
        ];
        let ipk = t.create(h, &mut tpl).unwrap();
        let mut s = Signer::new(MessageDigest::sha256(), &osk).unwrap();
        let sig = s.sign_oneshot_to_vec(msg).unwrap();
        let mut m = mech(CKM_SHA256_RSA_PKCS);
        assert_eq!(t.verify(h, &mut m, ipk, &[msg], &sig), CKR_OK, "{}", t.name);
        assert_eq!(
            t.verify(h, &mut m, ipk, &thirds(msg), &sig),
            CKR_OK,
            "{}",
            t.name
        );
        let mut bad = sig.clone();
        bad[100] ^= 1;
        assert_eq!(
            t.verify(h, &mut m, ipk, &[msg], &bad),
            CKR_SIGNATURE_INVALID,
            "{}",
            t.name
        );
        assert_eq!(
            t.verify(h, &mut m, ipk, &[msg], &sig[1..]),
            CKR_SIGNATURE_LEN_RANGE,
            "{}",
            t.name
        );
        let mut s = Signer::new(MessageDigest::sha384(), &osk).unwrap();
        s.set_rsa_padding(Padding::PKCS1_PSS).unwrap();
        s.set_rsa_pss_saltlen(RsaPssSaltlen::custom(48)).unwrap();
        let sig = s.sign_oneshot_to_vec(msg).unwrap();
        let mut pp = pss_params(CKM_SHA384, CKG_MGF1_SHA384, 48);
        let mut m = with_param(CKM_SHA384_RSA_PKCS_PSS, &mut pp);
        assert_eq!(
            t.verify(h, &mut m, ipk, &[msg], &sig),
            CKR_OK,
            "{}: PSS",
            t.name
        );
        // Recovery: what OpenSSL's PKCS#1 v1.5 private operation signed.
        let di = b"a DigestInfo, or anything up to k - 11 bytes";
        let mut raw = vec![0u8; 256];
        let nsig = r.private_encrypt(di, &mut raw, Padding::PKCS1).unwrap();
        let mut m = mech(CKM_RSA_PKCS);
        match call!(t, C_VerifyRecoverInit, h, &mut m, ipk) {
            CKR_FUNCTION_NOT_SUPPORTED if t.name == "softhsm2" => {
                eprintln!("softhsm2: no C_VerifyRecover, recovery not compared");
            }
            rv => {
                ok("C_VerifyRecoverInit", rv);
                let mut out = vec![0u8; 256];
                let mut ol: CK_ULONG = 256;
                ok(
                    "C_VerifyRecover",
                    call!(
                        t,
                        C_VerifyRecover,
                        h,
                        raw.as_mut_ptr(),
                        nsig as CK_ULONG,
                        out.as_mut_ptr(),
                        &mut ol
                    ),
                );
                assert_eq!(&out[..ol as usize], di, "{}", t.name);
            }
        }
        // Encryption with the public key; OpenSSL decrypts.
        for (mm, pad) in [
            (CKM_RSA_PKCS, Padding::PKCS1),
            (CKM_RSA_PKCS_OAEP, Padding::PKCS1_OAEP),
        ] {
            let mut oaep = CK_RSA_PKCS_OAEP_PARAMS {
                hashAlg: CKM_SHA_1,
                mgf: CKG_MGF1_SHA1,
                source: CKZ_DATA_SPECIFIED,
                pSourceData: std::ptr::null_mut(),
                ulSourceDataLen: 0,
            };
            let mut m = if mm == CKM_RSA_PKCS {
                mech(mm)
            } else {
                with_param(mm, &mut oaep)
            };
            ok("C_EncryptInit", call!(t, C_EncryptInit, h, &mut m, ipk));
            let plain = b"for openssl's eyes".to_vec();
            let mut ct = vec![0u8; 256];
            let mut cl: CK_ULONG = 256;
            ok(
                "C_Encrypt",
                call!(
                    t,
                    C_Encrypt,
                    h,
                    plain.as_ptr().cast_mut(),
                    plain.len() as CK_ULONG,
                    ct.as_mut_ptr(),
                    &mut cl
                ),
            );
            let mut back = vec![0u8; 256];
            let bn = r
                .private_decrypt(&ct[..cl as usize], &mut back, pad)
                .unwrap();
            assert_eq!(&back[..bn], &plain[..], "{} {mm:#x}", t.name);
        }
        // A public key object is destroyed alone; its private half stays.
        t.destroy(h, pk);
        let mut m = mech(CKM_SHA256_RSA_PKCS);
        assert!(t.sign(h, &mut m, sk, &[msg]).is_ok(), "{}", t.name);
        t.destroy(h, ipk);

        // --- ECDSA P-256, both ways.
        let g = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
        let p256 = g
            .curve_name()
            .map(|_| [0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07])
            .unwrap();
        let (epk, esk) = pair(t, h, CKM_EC_KEY_PAIR_GEN, Some(&p256));
        let point = t.get(h, epk, CKA_EC_POINT).unwrap();
        let mut ctx = openssl::bn::BigNumContext::new().unwrap();
        let pt = openssl::ec::EcPoint::from_bytes(&g, &point[2..], &mut ctx).unwrap();
        let oec = PKey::from_ec_key(EcKey::from_public_key(&g, &pt).unwrap()).unwrap();
        // CKM_ECDSA over OpenSSL's digest (SoftHSM2 2.6 has no
        // CKM_ECDSA_SHA256; this module's is in tests/asym.rs).
        let d = openssl::hash::hash(MessageDigest::sha256(), msg).unwrap();
        let mut m = mech(CKM_ECDSA);
        let rs = t.sign(h, &mut m, esk, &[&d]).unwrap();
        let der = openssl::ecdsa::EcdsaSig::from_private_components(
            BigNum::from_slice(&rs[..32]).unwrap(),
            BigNum::from_slice(&rs[32..]).unwrap(),
        )
        .unwrap()
        .to_der()
        .unwrap();
        let mut v = Verifier::new(MessageDigest::sha256(), &oec).unwrap();
        assert!(v.verify_oneshot(&der, msg).unwrap(), "{}: ECDSA", t.name);
        assert_eq!(t.verify(h, &mut m, epk, &[&d], &rs), CKR_OK, "{}", t.name);
        let oks = EcKey::generate(&g).unwrap();
        let os = openssl::ecdsa::EcdsaSig::sign(&d, &oks).unwrap();
        let mut ors = os.r().to_vec_padded(32).unwrap();
        ors.extend(os.s().to_vec_padded(32).unwrap());
        let opt = oks
            .public_key()
            .to_bytes(&g, PointConversionForm::UNCOMPRESSED, &mut ctx)
            .unwrap();
        let mut wrapped = vec![0x04, opt.len() as u8];
        wrapped.extend(&opt);
        let kt = CKK_EC;
        let mut tpl = [
            attr(CKA_CLASS, &class),
            attr(CKA_KEY_TYPE, &kt),
            attr(CKA_TOKEN, &FALSE),
            attr(CKA_VERIFY, &TRUE),
            attr_bytes(CKA_EC_PARAMS, &p256),
            attr_bytes(CKA_EC_POINT, &wrapped),
        ];
        let iec = t.create(h, &mut tpl).unwrap();
        let mut m = mech(CKM_ECDSA);
        assert_eq!(
            t.verify(h, &mut m, iec, &[&d], &ors),
            CKR_OK,
            "{}: ECDSA",
            t.name
        );
        ors[5] ^= 1;
        assert_eq!(
            t.verify(h, &mut m, iec, &[&d], &ors),
            CKR_SIGNATURE_INVALID,
            "{}",
            t.name
        );

        // --- Ed25519, both ways, where the token has it.
        if t.has(CKM_EDDSA) {
            let (dpk, dsk) = pair(t, h, CKM_EC_EDWARDS_KEY_PAIR_GEN, Some(&ED25519_OID));
            let point = t.get(h, dpk, CKA_EC_POINT).unwrap();
            let raw: &[u8] = if point.len() == 34 {
                &point[2..]
            } else {
                &point
            };
            let oed = PKey::public_key_from_raw_bytes(raw, openssl::pkey::Id::ED25519).unwrap();
            let mut m = mech(CKM_EDDSA);
            let sig = t.sign(h, &mut m, dsk, &[msg]).unwrap();
            let mut v = Verifier::new_without_digest(&oed).unwrap();
            assert!(v.verify_oneshot(&sig, msg).unwrap(), "{}: Ed25519", t.name);
            let osk = PKey::generate_ed25519().unwrap();
            let mut s = Signer::new_without_digest(&osk).unwrap();
            let osig = s.sign_oneshot_to_vec(msg).unwrap();
            let opub = osk.raw_public_key().unwrap();
            let mut wrapped = vec![0x04, 32];
            wrapped.extend(&opub);
            let kt = CKK_EC_EDWARDS;
            let mut tpl = [
                attr(CKA_CLASS, &class),
                attr(CKA_KEY_TYPE, &kt),
                attr(CKA_TOKEN, &FALSE),
                attr(CKA_VERIFY, &TRUE),
                attr_bytes(CKA_EC_PARAMS, &ED25519_OID),
                attr_bytes(CKA_EC_POINT, &wrapped),
            ];
            let ied = t.create(h, &mut tpl).unwrap();
            assert_eq!(
                t.verify(h, &mut m, ied, &[msg], &osig),
                CKR_OK,
                "{}: Ed25519",
                t.name
            );
            assert_eq!(
                t.verify(h, &mut m, ied, &[b"other"], &osig),
                CKR_SIGNATURE_INVALID,
                "{}",
                t.name
            );
        } else {
            eprintln!("{}: no CKM_EDDSA, Ed25519 not compared", t.name);
        }
        t.close(h);
    }
}

impl Token {
    fn find(&self, h: CK_SESSION_HANDLE, t: &mut [CK_ATTRIBUTE]) -> Vec<CK_OBJECT_HANDLE> {
        ok(
            "C_FindObjectsInit",
            call!(
                self,
                C_FindObjectsInit,
                h,
                t.as_mut_ptr(),
                t.len() as CK_ULONG
            ),
        );
        let mut found = [0 as CK_OBJECT_HANDLE; 16];
        let mut n = 0;
        ok(
            "C_FindObjects",
            call!(self, C_FindObjects, h, found.as_mut_ptr(), 16, &mut n),
        );
        ok("C_FindObjectsFinal", call!(self, C_FindObjectsFinal, h));
        found[..n as usize].to_vec()
    }
}

#[test]
fn data_objects_are_created_found_changed_and_destroyed() {
    let oid = [0x06u8, 0x03, 0x2a, 0x03, 0x04];
    for t in tokens() {
        for token in [FALSE, TRUE] {
            let h = t.open();
            let app = common::label(&format!("app{token}"));
            let class = CKO_DATA;
            let mut tpl = [
                attr(CKA_CLASS, &class),
                attr(CKA_TOKEN, &token),
                attr(CKA_PRIVATE, &FALSE),
                attr_bytes(CKA_LABEL, b"settings"),
                attr_bytes(CKA_APPLICATION, app.as_bytes()),
                attr_bytes(CKA_OBJECT_ID, &oid),
                attr_bytes(CKA_VALUE, b"first value"),
            ];
            let o = t.create(h, &mut tpl).unwrap();
            assert_eq!(
                t.get(h, o, CKA_VALUE).unwrap(),
                b"first value",
                "{}",
                t.name
            );
            assert_eq!(t.get(h, o, CKA_OBJECT_ID).unwrap(), oid);
            assert_eq!(t.get(h, o, CKA_LABEL).unwrap(), b"settings");
            // Found by class and application, from another session for a
            // token object.
            let h2 = if token == TRUE { t.open() } else { h };
            let mut q = [
                attr(CKA_CLASS, &class),
                attr_bytes(CKA_APPLICATION, app.as_bytes()),
            ];
            let found = t.find(h2, &mut q);
            assert_eq!(found.len(), 1, "{} token={token}", t.name);
            let f = found[0];
            // The label may change; the value may not (PKCS#11 2.40, 4.5).
            let mut set = [attr_bytes(CKA_LABEL, b"renamed")];
            assert_eq!(
                call!(t, C_SetAttributeValue, h2, f, set.as_mut_ptr(), 1),
                CKR_OK,
                "{} token={token}",
                t.name
            );
            assert_eq!(t.get(h2, f, CKA_LABEL).unwrap(), b"renamed", "{}", t.name);
            assert_eq!(
                t.get(h2, f, CKA_VALUE).unwrap(),
                b"first value",
                "{}",
                t.name
            );
            let mut set = [attr_bytes(CKA_VALUE, b"second value")];
            assert_eq!(
                call!(t, C_SetAttributeValue, h2, f, set.as_mut_ptr(), 1),
                CKR_ATTRIBUTE_READ_ONLY,
                "{}",
                t.name
            );
            t.destroy(h2, f);
            assert!(t.find(h2, &mut q).is_empty(), "{}", t.name);
            if h2 != h {
                t.close(h2);
            }
            t.close(h);
        }
    }
}

/// The refusals that are security (docs/pkcs11.md lists them), each with
/// its code; SoftHSM2 shows the same two `C_SetAttributeValue` answers and
/// takes what this module refuses (DES3, RSA-1024: the contrast).
#[test]
fn security_refusals_keep_their_codes() {
    for t in tokens() {
        let h = t.open();
        let mine = t.name == "memveil";
        // A sensitive, non-extractable key stays so.
        let k = secret(t, h, &[9; 32]).unwrap_or_else(|rv| panic!("{}: {rv:#x}", t.name));
        let mut unset = [attr(CKA_SENSITIVE, &FALSE)];
        assert_eq!(
            call!(t, C_SetAttributeValue, h, k, unset.as_mut_ptr(), 1),
            CKR_ATTRIBUTE_READ_ONLY,
            "{}",
            t.name
        );
        let mut ext = [attr(CKA_EXTRACTABLE, &TRUE)];
        let rv = call!(t, C_SetAttributeValue, h, k, ext.as_mut_ptr(), 1);
        assert_eq!(rv, CKR_ATTRIBUTE_READ_ONLY, "{}", t.name);
        assert_eq!(t.get(h, k, CKA_VALUE), Err(CKR_ATTRIBUTE_SENSITIVE));
        // DES3 and RSA-1024.
        let mut des = mech(CKM_DES3_KEY_GEN);
        let mut tpl = [attr(CKA_TOKEN, &FALSE)];
        let mut o = 0;
        let rv = call!(t, C_GenerateKey, h, &mut des, tpl.as_mut_ptr(), 1, &mut o);
        assert_eq!(
            rv == CKR_MECHANISM_INVALID,
            mine,
            "{}: DES3 {rv:#x}",
            t.name
        );
        let bits: CK_ULONG = 1024;
        let e = [1u8, 0, 1];
        let mut pubt = [
            attr(CKA_TOKEN, &FALSE),
            attr(CKA_MODULUS_BITS, &bits),
            attr_bytes(CKA_PUBLIC_EXPONENT, &e),
        ];
        let mut privt = [attr(CKA_TOKEN, &FALSE)];
        let mut gen = mech(CKM_RSA_PKCS_KEY_PAIR_GEN);
        let (mut p, mut s) = (0, 0);
        let rv = call!(
            t,
            C_GenerateKeyPair,
            h,
            &mut gen,
            pubt.as_mut_ptr(),
            3,
            privt.as_mut_ptr(),
            1,
            &mut p,
            &mut s
        );
        assert_eq!(
            rv == CKR_ATTRIBUTE_VALUE_INVALID,
            mine,
            "{}: RSA-1024 {rv:#x}",
            t.name
        );
        t.close(h);
    }
}
