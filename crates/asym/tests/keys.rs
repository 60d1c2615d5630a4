//! Every key type and operation against OpenSSL (an independent
//! implementation): keys generated here verify there, keys made there sign
//! here, ciphertexts made there decrypt here, ECDH agrees both ways.

use memveil_asym::components::{self, encode_into, encoded_len};
use memveil_asym::hash::digest;
use memveil_asym::{
    Algorithm, AsymError, Curve, DecryptScheme, Hash, PrivateKey, Public, SignScheme,
};
use openssl::bn::{BigNum, BigNumContext};
use openssl::ec::{EcGroup, EcKey, EcPoint, PointConversionForm};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use openssl::rsa::{Padding, Rsa};
use openssl::sign::{RsaPssSaltlen, Signer, Verifier};

fn enc(fields: &[&[u8]]) -> Vec<u8> {
    let mut v = vec![0u8; encoded_len(fields)];
    let n = encode_into(fields, &mut v).expect("encode");
    v.truncate(n);
    v
}

fn rsa_components(r: &Rsa<Private>, with_crt: bool) -> Vec<u8> {
    let f = |b: Option<&openssl::bn::BigNumRef>| b.map(|b| b.to_vec()).unwrap_or_default();
    let mut v = vec![
        r.n().to_vec(),
        r.e().to_vec(),
        r.d().to_vec(),
        f(r.p()),
        f(r.q()),
    ];
    if with_crt {
        v.extend([f(r.dmp1()), f(r.dmq1()), f(r.iqmp())]);
    } else {
        v.extend([Vec::new(), Vec::new(), f(r.iqmp())]);
    }
    let refs: Vec<&[u8]> = v.iter().map(Vec::as_slice).collect();
    enc(&refs)
}

fn ossl_rsa_public(p: &Public) -> PKey<openssl::pkey::Public> {
    let Public::Rsa { n, e } = p else {
        panic!("not RSA")
    };
    let r = Rsa::from_public_components(
        BigNum::from_slice(n).expect("n"),
        BigNum::from_slice(e).expect("e"),
    )
    .expect("rsa");
    PKey::from_rsa(r).expect("pkey")
}

fn ossl_ec_public(p: &Public) -> PKey<openssl::pkey::Public> {
    let Public::Ec { curve, point } = p else {
        panic!("not EC")
    };
    let g = group(*curve);
    let mut ctx = BigNumContext::new().expect("ctx");
    let pt = EcPoint::from_bytes(&g, point, &mut ctx).expect("point");
    PKey::from_ec_key(EcKey::from_public_key(&g, &pt).expect("key")).expect("pkey")
}

fn group(c: Curve) -> EcGroup {
    EcGroup::from_curve_name(match c {
        Curve::P256 => Nid::X9_62_PRIME256V1,
        Curve::P384 => Nid::SECP384R1,
    })
    .expect("group")
}

fn md(h: Hash) -> MessageDigest {
    match h {
        Hash::Sha1 => MessageDigest::sha1(),
        Hash::Sha224 => MessageDigest::sha224(),
        Hash::Sha256 => MessageDigest::sha256(),
        Hash::Sha384 => MessageDigest::sha384(),
        Hash::Sha512 => MessageDigest::sha512(),
    }
}

fn check_rsa(key: &PrivateKey, k: usize) {
    let pubk = ossl_rsa_public(&key.public());
    let msg = b"memveil signs this";
    let mut sig = vec![0u8; k];
    for h in [Hash::Sha256, Hash::Sha384, Hash::Sha512, Hash::Sha1] {
        // PKCS#1 v1.5 over a DigestInfo.
        let mut di = h.digest_info_prefix().to_vec();
        di.extend(digest(h, msg));
        let n = key.sign(SignScheme::Pkcs1, &di, &mut sig).expect("sign");
        assert_eq!(n, k);
        let mut v = Verifier::new(md(h), &pubk).expect("verifier");
        v.update(msg).expect("update");
        assert!(v.verify(&sig[..n]).expect("verify"), "PKCS#1 {h:?}");
        // PSS, salt = digest length.
        let s = SignScheme::Pss {
            hash: h,
            mgf1: h,
            salt: u32::try_from(h.len()).expect("len"),
        };
        let n = key.sign(s, &digest(h, msg), &mut sig).expect("pss");
        let mut v = Verifier::new(md(h), &pubk).expect("verifier");
        v.set_rsa_padding(Padding::PKCS1_PSS).expect("pad");
        v.set_rsa_pss_saltlen(RsaPssSaltlen::DIGEST_LENGTH)
            .expect("salt");
        v.update(msg).expect("update");
        assert!(v.verify(&sig[..n]).expect("verify"), "PSS {h:?}");
    }
    // Raw: x^d; OpenSSL's public raw operation gives x back.
    let rsa_pub = pubk.rsa().expect("rsa");
    let mut x = vec![0x42u8; k];
    x[0] = 0;
    let n = key.sign(SignScheme::Raw, &x, &mut sig).expect("raw");
    let mut back = vec![0u8; k];
    rsa_pub
        .public_decrypt(&sig[..n], &mut back, Padding::NONE)
        .expect("public");
    assert_eq!(back, x);
    assert!(matches!(
        key.sign(SignScheme::Raw, &vec![0xff; k], &mut sig),
        Err(AsymError::Rejected(_))
    ));
    // OAEP (SHA-1 and SHA-256, with and without a label is OpenSSL's default: none).
    let mut ct = vec![0u8; k];
    let secret = b"premaster secret, 48 bytes long for TLS 1.2....";
    rsa_pub
        .public_encrypt(secret, &mut ct, Padding::PKCS1_OAEP)
        .expect("oaep");
    let mut out = vec![0u8; k];
    let s = DecryptScheme::Oaep {
        hash: Hash::Sha1,
        mgf1: Hash::Sha1,
        label: &[],
    };
    let n = key.decrypt(s, &ct, &mut out).expect("oaep decrypt");
    assert_eq!(&out[..n], secret);
    ct[5] ^= 1;
    assert!(matches!(
        key.decrypt(s, &ct, &mut out),
        Err(AsymError::Rejected(_))
    ));
    let mut ctx = openssl::pkey_ctx::PkeyCtx::new(&pubk).expect("ctx");
    ctx.encrypt_init().expect("init");
    ctx.set_rsa_padding(Padding::PKCS1_OAEP).expect("pad");
    ctx.set_rsa_oaep_md(openssl::md::Md::sha256()).expect("md");
    ctx.set_rsa_mgf1_md(openssl::md::Md::sha256()).expect("mgf");
    ctx.set_rsa_oaep_label(b"a label").expect("label");
    let mut ct2 = Vec::new();
    ctx.encrypt_to_vec(secret, &mut ct2).expect("encrypt");
    let s = DecryptScheme::Oaep {
        hash: Hash::Sha256,
        mgf1: Hash::Sha256,
        label: b"a label",
    };
    let n = key.decrypt(s, &ct2, &mut out).expect("oaep-256 decrypt");
    assert_eq!(&out[..n], secret);
    // PKCS#1 v1.5 decryption: the message back; a tampered ciphertext gives a
    // synthetic message, the same each time, never an error.
    rsa_pub
        .public_encrypt(secret, &mut ct, Padding::PKCS1)
        .expect("pkcs1");
    let n = key
        .decrypt(DecryptScheme::Pkcs1, &ct, &mut out)
        .expect("pkcs1");
    assert_eq!(&out[..n], secret);
    let mut bad = ct.clone();
    bad[k - 1] ^= 0x80;
    let n1 = key
        .decrypt(DecryptScheme::Pkcs1, &bad, &mut out)
        .expect("ir");
    let first = out[..n1].to_vec();
    let n2 = key
        .decrypt(DecryptScheme::Pkcs1, &bad, &mut out)
        .expect("ir");
    assert_eq!(first, out[..n2].to_vec());
    assert_ne!(first, secret.to_vec());
    assert!(n1 <= k - 11);
    // Raw decryption is the same operation as a raw signature.
    let n = key
        .decrypt(DecryptScheme::Raw, &x, &mut out)
        .expect("raw decrypt");
    assert_eq!(&out[..n], &sig[..n]);
    // Wrong lengths are refused, not padded.
    assert!(matches!(
        key.decrypt(DecryptScheme::Pkcs1, &ct[1..], &mut out),
        Err(AsymError::BadInput(_))
    ));
    assert!(matches!(
        key.sign(SignScheme::Pkcs1, &vec![1; k - 10], &mut sig),
        Err(AsymError::BadInput(_))
    ));
    assert!(matches!(
        key.sign(SignScheme::Ecdsa, b"x", &mut sig),
        Err(AsymError::WrongKey { .. })
    ));
    assert!(matches!(
        key.ecdh(b"x", &mut sig),
        Err(AsymError::WrongKey { .. })
    ));
    assert!(matches!(
        key.sign(SignScheme::Pkcs1, b"x", &mut sig[..10]),
        Err(AsymError::ShortOutput { .. })
    ));
}

fn check_ec(key: &PrivateKey, curve: Curve) {
    let pubk = ossl_ec_public(&key.public());
    let f = curve.field_bytes();
    let mut sig = vec![0u8; 2 * f];
    for h in [Hash::Sha256, Hash::Sha384, Hash::Sha512, Hash::Sha1] {
        let d = digest(h, b"memveil");
        let n = key.sign(SignScheme::Ecdsa, &d, &mut sig).expect("sign");
        assert_eq!(n, 2 * f);
        let s = openssl::ecdsa::EcdsaSig::from_private_components(
            BigNum::from_slice(&sig[..f]).expect("r"),
            BigNum::from_slice(&sig[f..]).expect("s"),
        )
        .expect("sig");
        assert!(
            s.verify(&d, &pubk.ec_key().expect("ec")).expect("verify"),
            "{h:?}"
        );
    }
    // ECDH against an OpenSSL key, both directions.
    let g = group(curve);
    let other = PKey::from_ec_key(EcKey::generate(&g).expect("gen")).expect("pkey");
    let mut ctx = BigNumContext::new().expect("ctx");
    let their = other
        .ec_key()
        .expect("ec")
        .public_key()
        .to_bytes(&g, PointConversionForm::UNCOMPRESSED, &mut ctx)
        .expect("bytes");
    let mut z = vec![0u8; f];
    assert_eq!(key.ecdh(&their, &mut z).expect("ecdh"), f);
    let mut d = openssl::derive::Deriver::new(&other).expect("deriver");
    d.set_peer(&pubk).expect("peer");
    assert_eq!(d.derive_to_vec().expect("derive"), z);
    let mut off = their.clone();
    off[5] ^= 1;
    assert!(matches!(
        key.ecdh(&off, &mut z),
        Err(AsymError::Rejected(_))
    ));
    assert!(matches!(
        key.decrypt(DecryptScheme::Pkcs1, b"x", &mut vec![0; 512]),
        Err(AsymError::WrongKey { .. })
    ));
}

fn check_ed25519(key: &PrivateKey) {
    let Public::Ed25519(pk) = key.public() else {
        panic!("not Ed25519")
    };
    let pubk = PKey::public_key_from_raw_bytes(&pk, openssl::pkey::Id::ED25519).expect("pk");
    let mut sig = [0u8; 64];
    for msg in [&b""[..], b"memveil", &[7u8; 5000]] {
        assert_eq!(
            key.sign(SignScheme::Ed25519, msg, &mut sig).expect("sign"),
            64
        );
        let mut v = Verifier::new_without_digest(&pubk).expect("verifier");
        assert!(v.verify_oneshot(&sig, msg).expect("verify"));
    }
}

#[test]
fn generated_keys_work_with_openssl() {
    for (alg, k) in [
        (Algorithm::Rsa2048, 256),
        (Algorithm::Rsa3072, 384),
        (Algorithm::Rsa4096, 512),
    ] {
        let key = PrivateKey::generate(alg).expect("generate");
        assert_eq!(key.algorithm(), alg);
        check_rsa(&key, k);
        // Components round trip to the same key.
        let mut c = vec![0u8; key.components_len()];
        let n = key.components(&mut c).expect("components");
        let again = PrivateKey::from_components(alg, &c[..n]).expect("again");
        assert_eq!(again.public(), key.public());
    }
    for (alg, c) in [
        (Algorithm::P256, Curve::P256),
        (Algorithm::P384, Curve::P384),
    ] {
        let key = PrivateKey::generate(alg).expect("generate");
        check_ec(&key, c);
        let mut b = vec![0u8; key.components_len()];
        let n = key.components(&mut b).expect("components");
        assert_eq!(
            PrivateKey::from_components(alg, &b[..n])
                .expect("again")
                .public(),
            key.public()
        );
    }
    let key = PrivateKey::generate(Algorithm::Ed25519).expect("generate");
    check_ed25519(&key);
}

#[test]
fn imported_openssl_keys_work() {
    for (alg, bits) in [(Algorithm::Rsa2048, 2048usize), (Algorithm::Rsa3072, 3072)] {
        let r = Rsa::generate(u32::try_from(bits).expect("bits")).expect("openssl rsa");
        for crt in [true, false] {
            let key = PrivateKey::from_components(alg, &rsa_components(&r, crt)).expect("import");
            assert_eq!(
                key.public(),
                Public::Rsa {
                    n: r.n().to_vec(),
                    e: r.e().to_vec()
                }
            );
            check_rsa(&key, bits / 8);
            // The same signature as OpenSSL's (PKCS#1 v1.5 is deterministic).
            let mut di = Hash::Sha256.digest_info_prefix().to_vec();
            di.extend(digest(Hash::Sha256, b"same"));
            let mut sig = vec![0u8; bits / 8];
            key.sign(SignScheme::Pkcs1, &di, &mut sig).expect("sign");
            let pk = PKey::from_rsa(r.clone()).expect("pkey");
            let mut s = Signer::new(MessageDigest::sha256(), &pk).expect("signer");
            s.update(b"same").expect("update");
            assert_eq!(s.sign_to_vec().expect("sign"), sig);
        }
        // A key of another size is refused, naming it.
        let other = if bits == 2048 {
            Algorithm::Rsa3072
        } else {
            Algorithm::Rsa2048
        };
        let e = PrivateKey::from_components(other, &rsa_components(&r, true)).expect_err("size");
        assert!(e.to_string().contains(&format!("{bits} bits")), "{e}");
        // Inconsistent components are refused.
        let mut c = rsa_components(&r, true);
        let last = c.len() - 1;
        c[last] ^= 1;
        assert!(matches!(
            PrivateKey::from_components(alg, &c),
            Err(AsymError::BadKey { .. })
        ));
    }
    for (alg, c) in [
        (Algorithm::P256, Curve::P256),
        (Algorithm::P384, Curve::P384),
    ] {
        let k = EcKey::generate(&group(c)).expect("gen");
        let key =
            PrivateKey::from_components(alg, &enc(&[&k.private_key().to_vec()])).expect("import");
        let mut ctx = BigNumContext::new().expect("ctx");
        let want = k
            .public_key()
            .to_bytes(&group(c), PointConversionForm::UNCOMPRESSED, &mut ctx)
            .expect("bytes");
        assert_eq!(
            key.public(),
            Public::Ec {
                curve: c,
                point: want
            }
        );
        check_ec(&key, c);
        // Zero and the group order are not private keys.
        let order = match c {
            Curve::P256 => hex::decode("ffffffff00000000ffffffffffffffffbce6faada7179e84f3b9cac2fc632551"),
            Curve::P384 => hex::decode("ffffffffffffffffffffffffffffffffffffffffffffffffc7634d81f4372ddf581a0db248b0a77aecec196accc52973"),
        }
        .expect("hex");
        for s in [
            vec![0u8; c.field_bytes()],
            order,
            vec![1u8; c.field_bytes() + 1],
        ] {
            assert!(matches!(
                PrivateKey::from_components(alg, &enc(&[&s])),
                Err(AsymError::BadKey { .. })
            ));
        }
    }
    let ed = PKey::generate_ed25519().expect("ed");
    let seed = ed.raw_private_key().expect("seed");
    let key = PrivateKey::from_components(Algorithm::Ed25519, &enc(&[&seed])).expect("import");
    assert_eq!(
        key.public(),
        Public::Ed25519(ed.raw_public_key().expect("pk").try_into().expect("32"))
    );
    check_ed25519(&key);
    // The same signature as OpenSSL's (Ed25519 is deterministic).
    let mut sig = [0u8; 64];
    key.sign(SignScheme::Ed25519, b"same", &mut sig)
        .expect("sign");
    let mut s = Signer::new_without_digest(&ed).expect("signer");
    assert_eq!(s.sign_oneshot_to_vec(b"same").expect("sign"), sig.to_vec());
    for bad in [enc(&[&[1u8; 31]]), enc(&[&[1u8; 32], &[2u8; 32]]), vec![5]] {
        assert!(PrivateKey::from_components(Algorithm::Ed25519, &bad).is_err());
    }
    assert!(components::decode(&[0xff, 0xff, 1]).is_err());
}
