//! Asymmetric keys through the module (issue 27), checked with OpenSSL:
//! `C_GenerateKeyPair` for every type, the public attributes read back, the
//! private ones sensitive; every signature mechanism, RSA decryption, ECDH
//! into an AES key; private keys and certificates imported with
//! `C_CreateObject` and found again.

mod common;

use common::{attr, attr_bytes, label, open};
use cryptoki_sys::*;
use memveil_pkcs11::ffi;
use openssl::bn::BigNum;
use openssl::hash::MessageDigest;
use openssl::pkey::PKey;
use openssl::rsa::{Padding, Rsa};
use openssl::sign::{RsaPssSaltlen, Verifier};

fn get(h: CK_SESSION_HANDLE, o: CK_OBJECT_HANDLE, t: CK_ATTRIBUTE_TYPE) -> Result<Vec<u8>, CK_RV> {
    let mut a = CK_ATTRIBUTE {
        type_: t,
        pValue: std::ptr::null_mut(),
        ulValueLen: 0,
    };
    // SAFETY: a length query into a valid attribute.
    let rv = unsafe { ffi::C_GetAttributeValue(h, o, &mut a, 1) };
    if rv != CKR_OK {
        return Err(rv);
    }
    let mut v = vec![0u8; usize::try_from(a.ulValueLen).expect("len")];
    a.pValue = v.as_mut_ptr().cast();
    // SAFETY: `v` holds the length just reported.
    let rv = unsafe { ffi::C_GetAttributeValue(h, o, &mut a, 1) };
    assert_eq!(rv, CKR_OK);
    Ok(v)
}

fn gen_pair(
    h: CK_SESSION_HANDLE,
    mech: CK_MECHANISM_TYPE,
    public: &mut [CK_ATTRIBUTE],
    lbl: &str,
) -> (CK_OBJECT_HANDLE, CK_OBJECT_HANDLE) {
    let id = [0x27u8];
    let mut private = [
        attr_bytes(CKA_LABEL, lbl.as_bytes()),
        attr_bytes(CKA_ID, &id),
    ];
    let mut m = CK_MECHANISM {
        mechanism: mech,
        pParameter: std::ptr::null_mut(),
        ulParameterLen: 0,
    };
    let (mut pubh, mut privh) = (0, 0);
    // SAFETY: templates and handles outlive the call.
    let rv = unsafe {
        ffi::C_GenerateKeyPair(
            h,
            &mut m,
            public.as_mut_ptr(),
            public.len() as CK_ULONG,
            private.as_mut_ptr(),
            private.len() as CK_ULONG,
            &mut pubh,
            &mut privh,
        )
    };
    assert_eq!(rv, CKR_OK, "C_GenerateKeyPair {mech:#x}");
    (pubh, privh)
}

/// `mech` with its parameter bytes (none: a null pointer); the caller keeps
/// `param` alive while the mechanism is in use.
fn mechanism(mech: CK_MECHANISM_TYPE, param: Option<&mut [u8]>) -> CK_MECHANISM {
    let (p, pl) = match param {
        Some(p) => (p.as_mut_ptr().cast(), p.len() as CK_ULONG),
        None => (std::ptr::null_mut(), 0),
    };
    CK_MECHANISM {
        mechanism: mech,
        pParameter: p,
        ulParameterLen: pl,
    }
}

fn sign(
    h: CK_SESSION_HANDLE,
    key: CK_OBJECT_HANDLE,
    mech: CK_MECHANISM_TYPE,
    param: Option<&mut [u8]>,
    parts: &[&[u8]],
) -> Result<Vec<u8>, CK_RV> {
    let mut m = mechanism(mech, param);
    // SAFETY: the mechanism and its parameter outlive the call.
    let rv = unsafe { ffi::C_SignInit(h, &mut m, key) };
    if rv != CKR_OK {
        return Err(rv);
    }
    let mut sig = vec![0u8; 1024];
    let mut n = sig.len() as CK_ULONG;
    // SAFETY: buffers with their lengths.
    let rv = unsafe {
        if parts.len() == 1 {
            ffi::C_Sign(
                h,
                parts[0].as_ptr().cast_mut(),
                parts[0].len() as CK_ULONG,
                sig.as_mut_ptr(),
                &mut n,
            )
        } else {
            for part in parts {
                let rv = ffi::C_SignUpdate(h, part.as_ptr().cast_mut(), part.len() as CK_ULONG);
                if rv != CKR_OK {
                    return Err(rv);
                }
            }
            ffi::C_SignFinal(h, sig.as_mut_ptr(), &mut n)
        }
    };
    if rv != CKR_OK {
        return Err(rv);
    }
    sig.truncate(usize::try_from(n).expect("n"));
    Ok(sig)
}

fn decrypt(
    h: CK_SESSION_HANDLE,
    key: CK_OBJECT_HANDLE,
    mech: CK_MECHANISM_TYPE,
    param: Option<&mut [u8]>,
    ct: &[u8],
) -> Result<Vec<u8>, CK_RV> {
    let mut m = mechanism(mech, param);
    // SAFETY: the mechanism outlives the call.
    let rv = unsafe { ffi::C_DecryptInit(h, &mut m, key) };
    if rv != CKR_OK {
        return Err(rv);
    }
    let mut out = vec![0u8; 1024];
    let mut n = out.len() as CK_ULONG;
    // SAFETY: buffers with their lengths.
    let rv = unsafe {
        ffi::C_Decrypt(
            h,
            ct.as_ptr().cast_mut(),
            ct.len() as CK_ULONG,
            out.as_mut_ptr(),
            &mut n,
        )
    };
    if rv != CKR_OK {
        return Err(rv);
    }
    out.truncate(usize::try_from(n).expect("n"));
    Ok(out)
}

fn as_bytes<T>(v: &mut T) -> &mut [u8] {
    // SAFETY: a plain C struct viewed as its bytes, for a mechanism parameter.
    unsafe {
        std::slice::from_raw_parts_mut(std::ptr::from_mut(v).cast(), std::mem::size_of::<T>())
    }
}

#[test]
fn rsa_pairs_sign_and_decrypt_with_every_mechanism() {
    let h = open();
    let bits: CK_ULONG = 2048;
    let e = [1u8, 0, 1];
    let lbl = label("rsa");
    let mut public = [
        attr(CKA_MODULUS_BITS, &bits),
        attr_bytes(CKA_PUBLIC_EXPONENT, &e),
    ];
    let (pubh, privh) = gen_pair(h, CKM_RSA_PKCS_KEY_PAIR_GEN, &mut public, &lbl);
    let n = get(h, pubh, CKA_MODULUS).expect("modulus");
    assert_eq!(n.len(), 256);
    assert_eq!(
        get(h, privh, CKA_MODULUS).expect("modulus on the private key"),
        n
    );
    for t in [
        CKA_PRIVATE_EXPONENT,
        CKA_PRIME_1,
        CKA_PRIME_2,
        CKA_COEFFICIENT,
    ] {
        assert_eq!(get(h, privh, t), Err(CKR_ATTRIBUTE_SENSITIVE), "{t:#x}");
    }
    assert_eq!(get(h, privh, CKA_EXTRACTABLE).expect("x"), vec![CK_FALSE]);
    assert_eq!(
        get(h, privh, CKA_ALWAYS_SENSITIVE).expect("x"),
        vec![CK_TRUE]
    );
    let spki = get(h, pubh, CKA_PUBLIC_KEY_INFO).expect("spki");
    let pk = PKey::public_key_from_der(&spki).expect("openssl reads the SPKI");
    let rsa = Rsa::from_public_components(
        BigNum::from_slice(&n).expect("n"),
        BigNum::from_slice(&get(h, pubh, CKA_PUBLIC_EXPONENT).expect("e")).expect("e"),
    )
    .expect("rsa");
    assert_eq!(pk.rsa().expect("rsa").n().to_vec(), rsa.n().to_vec());
    let msg = b"through the memveil module";
    let verify = |md: MessageDigest, sig: &[u8], pss: bool| {
        let mut v = Verifier::new(md, &pk).expect("verifier");
        if pss {
            v.set_rsa_padding(Padding::PKCS1_PSS).expect("pad");
            v.set_rsa_pss_saltlen(RsaPssSaltlen::DIGEST_LENGTH)
                .expect("salt");
        }
        v.update(msg).expect("update");
        v.verify(sig).expect("verify")
    };
    for (mech, md) in [
        (CKM_SHA256_RSA_PKCS, MessageDigest::sha256()),
        (CKM_SHA384_RSA_PKCS, MessageDigest::sha384()),
        (CKM_SHA512_RSA_PKCS, MessageDigest::sha512()),
        (CKM_SHA1_RSA_PKCS, MessageDigest::sha1()),
    ] {
        let s = sign(h, privh, mech, None, &[&msg[..5], &msg[5..]]).expect("multi-part sign");
        assert!(verify(md, &s, false), "{mech:#x}");
    }
    // CKM_RSA_PKCS over a DigestInfo.
    let mut di = memveil_asym::Hash::Sha256.digest_info_prefix().to_vec();
    di.extend(openssl::sha::sha256(msg));
    assert!(verify(
        MessageDigest::sha256(),
        &sign(h, privh, CKM_RSA_PKCS, None, &[&di]).expect("sign"),
        false
    ));
    // PSS with parameters, over a digest and hashing here.
    let mut pss = CK_RSA_PKCS_PSS_PARAMS {
        hashAlg: CKM_SHA256,
        mgf: CKG_MGF1_SHA256,
        sLen: 32,
    };
    let s = sign(
        h,
        privh,
        CKM_RSA_PKCS_PSS,
        Some(as_bytes(&mut pss)),
        &[&openssl::sha::sha256(msg)],
    )
    .expect("pss");
    assert!(verify(MessageDigest::sha256(), &s, true));
    let s = sign(
        h,
        privh,
        CKM_SHA256_RSA_PKCS_PSS,
        Some(as_bytes(&mut pss)),
        &[msg],
    )
    .expect("pss");
    assert!(verify(MessageDigest::sha256(), &s, true));
    // PSS without its parameters, or with another hash than the mechanism's.
    assert_eq!(
        sign(h, privh, CKM_RSA_PKCS_PSS, None, &[&[0; 32]]),
        Err(CKR_MECHANISM_PARAM_INVALID)
    );
    pss.hashAlg = CKM_SHA384;
    assert_eq!(
        sign(
            h,
            privh,
            CKM_SHA256_RSA_PKCS_PSS,
            Some(as_bytes(&mut pss)),
            &[msg]
        ),
        Err(CKR_MECHANISM_PARAM_INVALID)
    );
    // Raw RSA (TLS's PSS through libp11): the public operation undoes it.
    let x = [0x11u8; 200];
    let y = sign(h, privh, CKM_RSA_X_509, None, &[&x]).expect("raw");
    let mut back = vec![0u8; 256];
    rsa.public_decrypt(&y, &mut back, Padding::NONE)
        .expect("public op");
    assert_eq!(&back[56..], &x[..]);
    // Decryption: PKCS#1 v1.5 and OAEP (SHA-256, with a label).
    let mut ct = vec![0u8; 256];
    rsa.public_encrypt(b"premaster", &mut ct, Padding::PKCS1)
        .expect("encrypt");
    assert_eq!(
        decrypt(h, privh, CKM_RSA_PKCS, None, &ct).expect("decrypt"),
        b"premaster"
    );
    let mut ctx = openssl::pkey_ctx::PkeyCtx::new(&pk).expect("ctx");
    ctx.encrypt_init().expect("init");
    ctx.set_rsa_padding(Padding::PKCS1_OAEP).expect("pad");
    ctx.set_rsa_oaep_md(openssl::md::Md::sha256()).expect("md");
    ctx.set_rsa_mgf1_md(openssl::md::Md::sha256()).expect("mgf");
    ctx.set_rsa_oaep_label(b"label").expect("label");
    let mut ct2 = Vec::new();
    ctx.encrypt_to_vec(b"oaep", &mut ct2).expect("encrypt");
    let mut lab = *b"label";
    let mut oaep = CK_RSA_PKCS_OAEP_PARAMS {
        hashAlg: CKM_SHA256,
        mgf: CKG_MGF1_SHA256,
        source: CKZ_DATA_SPECIFIED,
        pSourceData: lab.as_mut_ptr().cast(),
        ulSourceDataLen: 5,
    };
    assert_eq!(
        decrypt(h, privh, CKM_RSA_PKCS_OAEP, Some(as_bytes(&mut oaep)), &ct2).expect("oaep"),
        b"oaep"
    );
    ct2[9] ^= 1;
    assert_eq!(
        decrypt(h, privh, CKM_RSA_PKCS_OAEP, Some(as_bytes(&mut oaep)), &ct2),
        Err(CKR_ENCRYPTED_DATA_INVALID)
    );
    // The public key object does not sign; ECDSA is not an RSA mechanism.
    assert_eq!(
        sign(h, pubh, CKM_SHA256_RSA_PKCS, None, &[msg]),
        Err(CKR_KEY_FUNCTION_NOT_PERMITTED)
    );
    assert_eq!(
        sign(h, privh, CKM_ECDSA, None, &[&[0; 32]]),
        Err(CKR_KEY_TYPE_INCONSISTENT)
    );
    // Issue 36: the public half is destroyed alone (clients clean a pair up
    // public half first); the private key stays and still signs.
    // SAFETY: plain calls with valid handles.
    unsafe {
        assert_eq!(ffi::C_DestroyObject(h, pubh), CKR_OK);
        assert_eq!(ffi::C_DestroyObject(h, pubh), CKR_OBJECT_HANDLE_INVALID);
    }
    assert!(sign(h, privh, CKM_SHA256_RSA_PKCS, None, &[msg]).is_ok());
    // SAFETY: as above.
    unsafe {
        assert_eq!(ffi::C_DestroyObject(h, privh), CKR_OK);
        assert_eq!(ffi::C_DestroyObject(h, privh), CKR_OBJECT_HANDLE_INVALID);
    }
}

/// Derives an AES-128 key with `CKM_ECDH1_DERIVE` from vault key `privh`
/// (whose public half is `ours`) and `peer`'s raw uncompressed point, and
/// checks it encrypts as the leading bytes of OpenSSL's shared secret.
fn ecdh_matches_openssl(
    h: CK_SESSION_HANDLE,
    privh: CK_OBJECT_HANDLE,
    g: &openssl::ec::EcGroupRef,
    peer: openssl::ec::EcKey<openssl::pkey::Private>,
    ours: openssl::ec::EcKey<openssl::pkey::Public>,
    what: &str,
) {
    let mut ctx = openssl::bn::BigNumContext::new().expect("ctx");
    let their = peer
        .public_key()
        .to_bytes(g, openssl::ec::PointConversionForm::UNCOMPRESSED, &mut ctx)
        .expect("their point");
    let peer_pk = PKey::from_ec_key(peer).expect("pk");
    let our_pk = PKey::from_ec_key(ours).expect("pk");
    let mut der = openssl::derive::Deriver::new(&peer_pk).expect("deriver");
    der.set_peer(&our_pk).expect("peer");
    let z = der.derive_to_vec().expect("z");
    let mut p = CK_ECDH1_DERIVE_PARAMS {
        kdf: CKD_NULL,
        ulSharedDataLen: 0,
        pSharedData: std::ptr::null_mut(),
        ulPublicDataLen: their.len() as CK_ULONG,
        pPublicData: their.as_ptr().cast_mut(),
    };
    let mut m = CK_MECHANISM {
        mechanism: CKM_ECDH1_DERIVE,
        pParameter: std::ptr::from_mut(&mut p).cast(),
        ulParameterLen: std::mem::size_of::<CK_ECDH1_DERIVE_PARAMS>() as CK_ULONG,
    };
    let (class, kt, len) = (CKO_SECRET_KEY, CKK_AES, 16 as CK_ULONG);
    let mut t = [
        attr(CKA_CLASS, &class),
        attr(CKA_KEY_TYPE, &kt),
        attr(CKA_VALUE_LEN, &len),
    ];
    let mut aes = 0;
    // SAFETY: all pointers outlive the call.
    let rv = unsafe { ffi::C_DeriveKey(h, &mut m, privh, t.as_mut_ptr(), 3, &mut aes) };
    assert_eq!(rv, CKR_OK, "C_DeriveKey ({what})");
    assert_eq!(get(h, aes, CKA_VALUE), Err(CKR_ATTRIBUTE_SENSITIVE));
    let mut ecb = CK_MECHANISM {
        mechanism: CKM_AES_ECB,
        pParameter: std::ptr::null_mut(),
        ulParameterLen: 0,
    };
    let mut block = [9u8; 16];
    let mut out = [0u8; 16];
    let mut n = 16 as CK_ULONG;
    // SAFETY: buffers with their lengths.
    unsafe {
        assert_eq!(ffi::C_EncryptInit(h, &mut ecb, aes), CKR_OK);
        assert_eq!(
            ffi::C_Encrypt(h, block.as_mut_ptr(), 16, out.as_mut_ptr(), &mut n),
            CKR_OK
        );
    }
    let want = openssl::symm::encrypt(openssl::symm::Cipher::aes_128_ecb(), &z[..16], None, &block)
        .expect("openssl");
    assert_eq!(out.to_vec(), want[..16].to_vec(), "{what}");
}

/// Regression (issue 32): a raw peer point whose X starts with `3F 04`
/// (P-256) or `5F 04` (P-384) reads like a DER OCTET STRING of the rest of
/// the point; the module stripped two bytes and C_DeriveKey failed (about
/// one ECDHE handshake in 65,536). The peers' scalars were found by search
/// so that their X has that start (checked here).
#[test]
fn ecdh_takes_a_raw_peer_point_that_looks_like_an_octet_string() {
    let h = open();
    for (curve, nid, d, start) in [
        (
            memveil_asym::Curve::P256,
            openssl::nid::Nid::X9_62_PRIME256V1,
            "487229916f97828b32e480a4357a70024bb43397bbdd58ffe6d782628d72e72b",
            [0x04, 0x3f, 0x04],
        ),
        (
            memveil_asym::Curve::P384,
            openssl::nid::Nid::SECP384R1,
            "84c215938a9c9110deb62f483725efada827f8cb4ff05224ebac2e0f4746cbd0d106fb23f880615c45d3ccc3e1e16dbc",
            [0x04, 0x5f, 0x04],
        ),
    ] {
        let params = curve.oid_der();
        let mut public = [attr_bytes(CKA_EC_PARAMS, params)];
        let (pubh, privh) = gen_pair(h, CKM_EC_KEY_PAIR_GEN, &mut public, &label("ecdh3f"));
        let point = get(h, pubh, CKA_EC_POINT).expect("point");
        let g = openssl::ec::EcGroup::from_curve_name(nid).expect("group");
        let mut ctx = openssl::bn::BigNumContext::new().expect("ctx");
        let ours = openssl::ec::EcKey::from_public_key(
            &g,
            &openssl::ec::EcPoint::from_bytes(&g, &point[2..], &mut ctx).expect("point"),
        )
        .expect("key");
        let d = BigNum::from_hex_str(d).expect("d");
        let mut q = openssl::ec::EcPoint::new(&g).expect("q");
        q.mul_generator2(&g, &d, &mut ctx).expect("d·G");
        let raw = q
            .to_bytes(&g, openssl::ec::PointConversionForm::UNCOMPRESSED, &mut ctx)
            .expect("raw");
        assert_eq!(raw[..3], start, "the fixture's point starts like an OCTET STRING");
        assert_eq!(usize::from(raw[1]), raw.len() - 2);
        let peer = openssl::ec::EcKey::from_private_components(&g, &d, &q).expect("peer");
        ecdh_matches_openssl(h, privh, &g, peer, ours, &format!("{curve:?} raw 3F/5F 04 point"));
        // SAFETY: plain calls.
        unsafe {
            assert_eq!(ffi::C_DestroyObject(h, privh), CKR_OK);
        }
    }
}

#[test]
fn ec_and_ed25519_pairs_sign_and_derive() {
    let h = open();
    for (curve, nid, f) in [
        (
            memveil_asym::Curve::P256,
            openssl::nid::Nid::X9_62_PRIME256V1,
            32usize,
        ),
        (memveil_asym::Curve::P384, openssl::nid::Nid::SECP384R1, 48),
    ] {
        let params = curve.oid_der();
        let mut public = [attr_bytes(CKA_EC_PARAMS, params)];
        let (pubh, privh) = gen_pair(h, CKM_EC_KEY_PAIR_GEN, &mut public, &label("ec"));
        assert_eq!(get(h, pubh, CKA_EC_PARAMS).expect("params"), params);
        let point = get(h, pubh, CKA_EC_POINT).expect("point");
        assert_eq!(point[0], 0x04, "a DER OCTET STRING");
        let raw = &point[2..];
        assert_eq!(get(h, privh, CKA_VALUE), Err(CKR_ATTRIBUTE_SENSITIVE));
        let g = openssl::ec::EcGroup::from_curve_name(nid).expect("group");
        let mut ctx = openssl::bn::BigNumContext::new().expect("ctx");
        let pt = openssl::ec::EcPoint::from_bytes(&g, raw, &mut ctx).expect("point");
        let ek = openssl::ec::EcKey::from_public_key(&g, &pt).expect("key");
        let d = openssl::sha::sha256(b"m");
        for (mech, parts) in [
            (CKM_ECDSA, vec![&d[..]]),
            (CKM_ECDSA_SHA256, vec![&b"m"[..]]),
        ] {
            let s = sign(h, privh, mech, None, &parts).expect("ecdsa");
            assert_eq!(s.len(), 2 * f);
            let sig = openssl::ecdsa::EcdsaSig::from_private_components(
                BigNum::from_slice(&s[..f]).expect("r"),
                BigNum::from_slice(&s[f..]).expect("s"),
            )
            .expect("sig");
            assert!(sig.verify(&d, &ek).expect("verify"));
        }
        // ECDH: an AES key equal to OpenSSL's shared secret's leading bytes.
        let peer = openssl::ec::EcKey::generate(&g).expect("peer");
        ecdh_matches_openssl(h, privh, &g, peer, ek, &format!("{curve:?}"));
    }
    let (pubh, privh) = gen_pair(h, CKM_EC_EDWARDS_KEY_PAIR_GEN, &mut [], &label("ed"));
    let point = get(h, pubh, CKA_EC_POINT).expect("point");
    let pk = PKey::public_key_from_raw_bytes(&point[2..], openssl::pkey::Id::ED25519).expect("pk");
    let s = sign(h, privh, CKM_EDDSA, None, &[b"ssh", b" data"]).expect("eddsa");
    let mut v = Verifier::new_without_digest(&pk).expect("verifier");
    assert!(v.verify_oneshot(&s, b"ssh data").expect("verify"));
}

#[test]
fn private_keys_and_certificates_import_and_are_found() {
    let h = open();
    let r = Rsa::generate(2048).expect("rsa");
    let pk = PKey::from_rsa(r.clone()).expect("pkey");
    let lbl = label("imp");
    let id = [0x42u8];
    let (class, kt, tok) = (CKO_PRIVATE_KEY, CKK_RSA, CK_TRUE);
    let parts: Vec<(CK_ATTRIBUTE_TYPE, Vec<u8>)> = vec![
        (CKA_MODULUS, r.n().to_vec()),
        (CKA_PUBLIC_EXPONENT, r.e().to_vec()),
        (CKA_PRIVATE_EXPONENT, r.d().to_vec()),
        (CKA_PRIME_1, r.p().expect("p").to_vec()),
        (CKA_PRIME_2, r.q().expect("q").to_vec()),
        (CKA_EXPONENT_1, r.dmp1().expect("dp").to_vec()),
        (CKA_EXPONENT_2, r.dmq1().expect("dq").to_vec()),
        (CKA_COEFFICIENT, r.iqmp().expect("qi").to_vec()),
    ];
    let mut t = vec![
        attr(CKA_CLASS, &class),
        attr(CKA_KEY_TYPE, &kt),
        attr(CKA_TOKEN, &tok),
        attr_bytes(CKA_LABEL, lbl.as_bytes()),
        attr_bytes(CKA_ID, &id),
    ];
    t.extend(parts.iter().map(|(a, v)| attr_bytes(*a, v)));
    let mut key = 0;
    // SAFETY: the template outlives the call.
    let rv = unsafe { ffi::C_CreateObject(h, t.as_mut_ptr(), t.len() as CK_ULONG, &mut key) };
    assert_eq!(rv, CKR_OK, "import a private key");
    let msg = b"imported";
    let s = sign(h, key, CKM_SHA256_RSA_PKCS, None, &[msg]).expect("sign");
    let mut signer = openssl::sign::Signer::new(MessageDigest::sha256(), &pk).expect("signer");
    signer.update(msg).expect("update");
    assert_eq!(s, signer.sign_to_vec().expect("sign"), "the same key");
    // The certificate of that key, with the same id.
    let mut b = openssl::x509::X509Builder::new().expect("x509");
    let mut name = openssl::x509::X509NameBuilder::new().expect("name");
    name.append_entry_by_text("CN", "memveil test").expect("cn");
    let name = name.build();
    b.set_subject_name(&name).expect("subject");
    b.set_issuer_name(&name).expect("issuer");
    b.set_pubkey(&pk).expect("pub");
    b.sign(&pk, MessageDigest::sha256()).expect("sign");
    let der = b.build().to_der().expect("der");
    let (cclass, ctype) = (CKO_CERTIFICATE, CKC_X_509);
    let mut ct = [
        attr(CKA_CLASS, &cclass),
        attr(CKA_CERTIFICATE_TYPE, &ctype),
        attr_bytes(CKA_LABEL, lbl.as_bytes()),
        attr_bytes(CKA_ID, &id),
        attr_bytes(CKA_VALUE, &der),
    ];
    let mut cert = 0;
    // SAFETY: the template outlives the call.
    let rv = unsafe { ffi::C_CreateObject(h, ct.as_mut_ptr(), ct.len() as CK_ULONG, &mut cert) };
    assert_eq!(rv, CKR_OK, "import a certificate");
    assert_eq!(get(h, cert, CKA_VALUE).expect("value"), der);
    assert_eq!(
        get(h, cert, CKA_SUBJECT).expect("subject"),
        name.to_der().expect("der")
    );
    // Another session finds the key, its public half and the certificate by id.
    let h2 = open();
    let mut found = Vec::new();
    // SAFETY: template and out buffers outlive the calls.
    unsafe {
        let mut ft = [
            attr_bytes(CKA_ID, &id),
            attr_bytes(CKA_LABEL, lbl.as_bytes()),
        ];
        assert_eq!(ffi::C_FindObjectsInit(h2, ft.as_mut_ptr(), 2), CKR_OK);
        let mut hs = [0 as CK_OBJECT_HANDLE; 8];
        let mut n = 0;
        assert_eq!(ffi::C_FindObjects(h2, hs.as_mut_ptr(), 8, &mut n), CKR_OK);
        assert_eq!(ffi::C_FindObjectsFinal(h2), CKR_OK);
        for o in &hs[..usize::try_from(n).expect("n")] {
            found.push(CK_ULONG::from_ne_bytes(
                get(h2, *o, CKA_CLASS)
                    .expect("class")
                    .try_into()
                    .expect("ulong"),
            ));
        }
    }
    found.sort_unstable();
    assert_eq!(
        found,
        vec![CKO_CERTIFICATE, CKO_PUBLIC_KEY, CKO_PRIVATE_KEY]
    );
    // A template that would let the key out is refused.
    let ext = CK_TRUE;
    t.push(attr(CKA_EXTRACTABLE, &ext));
    let mut k2 = 0;
    // SAFETY: the template outlives the call.
    let rv = unsafe { ffi::C_CreateObject(h, t.as_mut_ptr(), t.len() as CK_ULONG, &mut k2) };
    assert_eq!(rv, CKR_ATTRIBUTE_VALUE_INVALID);
    // SAFETY: plain calls.
    unsafe {
        assert_eq!(ffi::C_DestroyObject(h, key), CKR_OK);
        assert_eq!(ffi::C_DestroyObject(h, cert), CKR_OK);
    }
}
