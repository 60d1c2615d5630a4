//! Asymmetric keys through a real vault (issue 27): generated and imported
//! keys of every kind sign, decrypt and derive through the lanes, checked
//! with OpenSSL; public halves come out, private parts never; permissions,
//! refusals and persistence.

mod common;

use common::{Opts, Vault};
use memveil_asym::components::{encode_into, encoded_len};
use memveil_asym::hash::digest;
use memveil_asym::{Hash, Public};
use memveil_vault::client::{ClientError, Crypt};
use memveil_vault::proto::{perm, ErrorCode, KeyKind, Mode, PublicParts};
use memveil_vault::ring::{status, AsymParams, Op};
use openssl::bn::{BigNum, BigNumContext};
use openssl::ec::{EcGroup, EcKey, EcPoint, PointConversionForm};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::PKey;
use openssl::rsa::{Padding, Rsa};
use openssl::sign::{RsaPssSaltlen, Verifier};

fn enc(fields: &[&[u8]]) -> Vec<u8> {
    let mut v = vec![0u8; encoded_len(fields)];
    let n = encode_into(fields, &mut v).expect("encode");
    v.truncate(n);
    v
}

fn public(c: &mut memveil_vault::Client, name: &str) -> Public {
    match c.public_key(name).expect("public key") {
        PublicParts::Key(p) => p,
        other => panic!("not a key: {other:?}"),
    }
}

fn rsa_pkey(p: &Public) -> PKey<openssl::pkey::Public> {
    let Public::Rsa { n, e } = p else {
        panic!("not RSA")
    };
    PKey::from_rsa(
        Rsa::from_public_components(
            BigNum::from_slice(n).expect("n"),
            BigNum::from_slice(e).expect("e"),
        )
        .expect("rsa"),
    )
    .expect("pkey")
}

fn none() -> AsymParams {
    AsymParams::default()
}

#[test]
fn generated_keys_sign_decrypt_and_derive_through_the_lanes() {
    let v = Vault::start();
    let mut c = v.client();
    let msg = b"signed through the vault";
    for (kind, k) in [
        (KeyKind::Rsa2048, 256),
        (KeyKind::Rsa3072, 384),
        (KeyKind::Rsa4096, 512),
    ] {
        let name = kind.name();
        let info = c.create_key(name, kind, false).expect("create");
        assert_eq!(info.kind, kind);
        let p = public(&mut c, name);
        let pk = rsa_pkey(&p);
        // PKCS#1 v1.5 over a DigestInfo.
        let mut di = Hash::Sha256.digest_info_prefix().to_vec();
        di.extend(digest(Hash::Sha256, msg));
        let sig = c
            .private_op(Op::Encrypt, info.id, Mode::RsaPkcs1, none(), &di)
            .expect("sign");
        assert_eq!(sig.len(), k);
        let mut ver = Verifier::new(MessageDigest::sha256(), &pk).expect("verifier");
        ver.update(msg).expect("update");
        assert!(ver.verify(&sig).expect("verify"), "{kind}");
        // PSS.
        let pss = AsymParams {
            hash: Hash::Sha384.code(),
            mgf1: Hash::Sha384.code(),
            len: 48,
        };
        let sig = c
            .private_op(
                Op::Encrypt,
                info.id,
                Mode::RsaPss,
                pss,
                &digest(Hash::Sha384, msg),
            )
            .expect("pss");
        let mut ver = Verifier::new(MessageDigest::sha384(), &pk).expect("verifier");
        ver.set_rsa_padding(Padding::PKCS1_PSS).expect("pad");
        ver.set_rsa_pss_saltlen(RsaPssSaltlen::DIGEST_LENGTH)
            .expect("salt");
        ver.update(msg).expect("update");
        assert!(ver.verify(&sig).expect("verify"), "{kind} PSS");
        // OAEP with a label, and PKCS#1 v1.5 decryption.
        let rsa = pk.rsa().expect("rsa");
        let mut ct = vec![0u8; k];
        rsa.public_encrypt(b"session key", &mut ct, Padding::PKCS1)
            .expect("encrypt");
        let pt = c
            .private_op(Op::Decrypt, info.id, Mode::RsaPkcs1, none(), &ct)
            .expect("decrypt");
        assert_eq!(pt, b"session key");
        let mut ctx = openssl::pkey_ctx::PkeyCtx::new(&pk).expect("ctx");
        ctx.encrypt_init().expect("init");
        ctx.set_rsa_padding(Padding::PKCS1_OAEP).expect("pad");
        ctx.set_rsa_oaep_md(openssl::md::Md::sha256()).expect("md");
        ctx.set_rsa_mgf1_md(openssl::md::Md::sha256()).expect("mgf");
        ctx.set_rsa_oaep_label(b"lbl").expect("label");
        let mut ct = Vec::new();
        ctx.encrypt_to_vec(b"oaep secret", &mut ct)
            .expect("encrypt");
        let mut input = b"lbl".to_vec();
        input.extend(&ct);
        let oaep = AsymParams {
            hash: Hash::Sha256.code(),
            mgf1: Hash::Sha256.code(),
            len: 3,
        };
        let pt = c
            .private_op(Op::Decrypt, info.id, Mode::RsaOaep, oaep, &input)
            .expect("oaep");
        assert_eq!(pt, b"oaep secret");
        // A ciphertext that does not decrypt: a status, not a crash.
        input[10] ^= 1;
        let e = c
            .private_op(Op::Decrypt, info.id, Mode::RsaOaep, oaep, &input)
            .expect_err("tampered");
        assert!(
            matches!(
                e,
                ClientError::Request {
                    code: status::BAD_CIPHERTEXT,
                    ..
                }
            ),
            "{e}"
        );
        // Raw RSA: x^d, which the public operation undoes.
        let mut x = vec![0x5au8; k];
        x[0] = 0;
        let y = c
            .private_op(Op::Encrypt, info.id, Mode::RsaRaw, none(), &x)
            .expect("raw");
        let mut back = vec![0u8; k];
        rsa.public_decrypt(&y, &mut back, Padding::NONE)
            .expect("public op");
        assert_eq!(back, x);
        // Refused: PSS decryption, an unknown hash, a short output range.
        let e = c
            .private_op(Op::Decrypt, info.id, Mode::RsaPss, pss, &ct)
            .expect_err("pss decrypt");
        assert!(
            matches!(
                e,
                ClientError::Request {
                    code: status::WRONG_MODE,
                    ..
                }
            ),
            "{e}"
        );
        let bad = AsymParams { hash: 9, ..pss };
        let e = c
            .private_op(
                Op::Encrypt,
                info.id,
                Mode::RsaPss,
                bad,
                &digest(Hash::Sha384, msg),
            )
            .expect_err("hash 9");
        assert!(
            matches!(
                e,
                ClientError::Request {
                    code: status::BAD_PARAMS,
                    ..
                }
            ),
            "{e}"
        );
        // Not rotated.
        let e = c.rotate_key(name).expect_err("rotate");
        assert!(e.to_string().contains("not rotated"), "{e}");
    }

    for (kind, nid, f) in [
        (KeyKind::P256, Nid::X9_62_PRIME256V1, 32),
        (KeyKind::P384, Nid::SECP384R1, 48),
    ] {
        let name = kind.name();
        let info = c.create_key(name, kind, false).expect("create");
        let Public::Ec { point, .. } = public(&mut c, name) else {
            panic!("not EC")
        };
        let g = EcGroup::from_curve_name(nid).expect("group");
        let mut ctx = BigNumContext::new().expect("ctx");
        let pt = EcPoint::from_bytes(&g, &point, &mut ctx).expect("point");
        let ek = EcKey::from_public_key(&g, &pt).expect("key");
        let d = digest(Hash::Sha256, msg);
        let sig = c
            .private_op(Op::Encrypt, info.id, Mode::Ecdsa, none(), &d)
            .expect("ecdsa");
        assert_eq!(sig.len(), 2 * f);
        let s = openssl::ecdsa::EcdsaSig::from_private_components(
            BigNum::from_slice(&sig[..f]).expect("r"),
            BigNum::from_slice(&sig[f..]).expect("s"),
        )
        .expect("sig");
        assert!(s.verify(&d, &ek).expect("verify"), "{kind}");
        // ECDH into an AES key: the same key as OpenSSL's shared secret.
        let peer = EcKey::generate(&g).expect("peer");
        let their = peer
            .public_key()
            .to_bytes(&g, PointConversionForm::UNCOMPRESSED, &mut ctx)
            .expect("point");
        let (peer_pk, our_pk) = (
            PKey::from_ec_key(peer).expect("pk"),
            PKey::from_ec_key(ek).expect("pk"),
        );
        let mut der = openssl::derive::Deriver::new(&peer_pk).expect("deriver");
        der.set_peer(&our_pk).expect("peer");
        let z = der.derive_to_vec().expect("z");
        for (kdf, key) in [
            (0u8, z[..32].to_vec()),
            (3u8, {
                let mut input = z.clone();
                input.extend(1u32.to_be_bytes());
                input.extend(b"info");
                digest(Hash::Sha256, &input)
            }),
        ] {
            let dname = format!("{name}.derived{kdf}");
            let shared: &[u8] = if kdf == 0 { b"" } else { b"info" };
            let dk = c
                .derive_key(&dname, KeyKind::Aes256, false, name, kdf, &their, shared)
                .expect("derive");
            // The derived key is that key: ECB of a block equals OpenSSL's.
            let mut block = [7u8; 16];
            c.encrypt(&Crypt::new(dk.id, Mode::Ecb), &mut block)
                .expect("ecb");
            let want = openssl::symm::encrypt(
                openssl::symm::Cipher::aes_256_ecb(),
                &key,
                None,
                &[7u8; 16],
            )
            .expect("openssl");
            assert_eq!(block.to_vec(), want[..16].to_vec(), "{kind} kdf {kdf}");
        }
        let mut off = their.clone();
        off[3] ^= 1;
        let e = c
            .derive_key("bad", KeyKind::Aes256, false, name, 0, &off, b"")
            .expect_err("off the curve");
        assert!(
            matches!(
                e,
                ClientError::Refused {
                    code: ErrorCode::Invalid,
                    ..
                }
            ),
            "{e}"
        );
    }

    let info = c.create_key("ed", KeyKind::Ed25519, false).expect("create");
    let Public::Ed25519(pk) = public(&mut c, "ed") else {
        panic!("not Ed25519")
    };
    let pk = PKey::public_key_from_raw_bytes(&pk, openssl::pkey::Id::ED25519).expect("pk");
    for m in [&msg[..], &vec![3u8; 100_000]] {
        let sig = c
            .private_op(Op::Encrypt, info.id, Mode::EdDsa, none(), m)
            .expect("ed25519");
        let mut ver = Verifier::new_without_digest(&pk).expect("verifier");
        assert!(ver.verify_oneshot(&sig, m).expect("verify"));
    }
    // A symmetric key has no public half; an Ed25519 key does not derive.
    c.create_key("aes", KeyKind::Aes256, false).expect("aes");
    assert!(c.public_key("aes").is_err());
    let e = c
        .derive_key("x", KeyKind::Aes128, false, "ed", 0, &[4; 65], b"")
        .expect_err("ed25519 ecdh");
    assert!(e.to_string().contains("p256 or p384"), "{e}");
    // A wrong mode for the key is a status.
    let e = c
        .private_op(Op::Encrypt, info.id, Mode::Ecdsa, none(), &[1; 32])
        .expect_err("ecdsa on ed25519");
    assert!(
        matches!(
            e,
            ClientError::Request {
                code: status::WRONG_MODE,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn imported_keys_keep_their_identity_and_persist() {
    let dir = common::scratch_dir("asym-persist");
    let keyfile = dir.join("kek");
    std::fs::write(&keyfile, [9u8; 32]).expect("kek");
    let opts = || {
        Opts::default()
            .arg("--state")
            .arg(dir.join("state").to_str().expect("utf8"))
            .arg("--key-file")
            .arg(keyfile.to_str().expect("utf8"))
            .dir(&dir)
    };
    let rsa = Rsa::generate(2048).expect("rsa");
    let p = |b: Option<&openssl::bn::BigNumRef>| b.expect("part").to_vec();
    let parts = [
        rsa.n().to_vec(),
        rsa.e().to_vec(),
        rsa.d().to_vec(),
        p(rsa.p()),
        p(rsa.q()),
        Vec::new(),
        Vec::new(),
        p(rsa.iqmp()),
    ];
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let ed = PKey::generate_ed25519().expect("ed");
    let seed = ed.raw_private_key().expect("seed");
    let cert = {
        let mut b = openssl::x509::X509Builder::new().expect("x509");
        let pk = PKey::from_rsa(rsa.clone()).expect("pkey");
        b.set_pubkey(&pk).expect("pub");
        b.sign(&pk, MessageDigest::sha256()).expect("sign");
        b.build().to_der().expect("der")
    };
    let msg_di = {
        let mut di = Hash::Sha256.digest_info_prefix().to_vec();
        di.extend(digest(Hash::Sha256, b"m"));
        di
    };
    let want_sig = {
        let mut s = vec![0u8; 256];
        let n = rsa
            .private_encrypt(&msg_di, &mut s, Padding::PKCS1)
            .expect("sign");
        s.truncate(n);
        s
    };
    {
        let v = Vault::start_with(opts()).expect("vault");
        let mut c = v.client();
        // ssh-agent's RSA form: no dp, dq (the vault computes them).
        let k = c
            .import_key("rsa", KeyKind::Rsa2048, true, &enc(&refs))
            .expect("import rsa");
        assert_eq!(
            c.private_op(Op::Encrypt, k.id, Mode::RsaPkcs1, none(), &msg_di)
                .expect("sign"),
            want_sig
        );
        c.import_key("ed", KeyKind::Ed25519, true, &enc(&[&seed]))
            .expect("import ed");
        c.import_key("cert", KeyKind::Cert, true, &cert)
            .expect("cert");
        // The wrong size for its kind is refused, naming it.
        let e = c
            .import_key("rsa3k", KeyKind::Rsa3072, false, &enc(&refs))
            .expect_err("size");
        assert!(e.to_string().contains("2048 bits"), "{e}");
        // Nothing else can read the public half of a key it cannot see.
        assert!(c
            .list_keys()
            .expect("list")
            .iter()
            .any(|k| k.kind == KeyKind::Cert));
    }
    // After a restart, from the keystore.
    let v = Vault::start_with(opts()).expect("vault again");
    let mut c = v.client();
    let k = c.key_info("rsa").expect("rsa back");
    assert_eq!(
        c.private_op(Op::Encrypt, k.id, Mode::RsaPkcs1, none(), &msg_di)
            .expect("sign"),
        want_sig
    );
    assert_eq!(
        public(&mut c, "ed"),
        Public::Ed25519(ed.raw_public_key().expect("pk").try_into().expect("32"))
    );
    assert_eq!(c.public_key("cert").expect("cert"), PublicParts::Cert(cert));
    drop(v);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn other_uids_need_grants_for_private_operations() {
    if common::euid() != 0 {
        memveil_testkit::skip(
            memveil_testkit::Need::Root,
            "switches a thread to another uid",
        );
        return;
    }
    let v = Vault::start();
    let mut owner = v.client();
    let k = owner
        .create_key("p256", KeyKind::P256, false)
        .expect("create");
    let socket = v.socket.clone();
    let run = move || {
        common::become_uid(65534);
        let mut c = memveil_vault::Client::connect(&socket).expect("connect");
        let sign = c.private_op(Op::Encrypt, k.id, Mode::Ecdsa, none(), &[1; 32]);
        let public = c.public_key("p256").is_ok();
        (sign.err().map(|e| e.to_string()), public)
    };
    let (e, saw) = std::thread::spawn(run.clone()).join().expect("thread");
    assert!(e.is_some_and(|e| e.contains("permission denied")) && !saw);
    owner.grant("p256", 65534, perm::ENCRYPT).expect("grant");
    let (e, saw) = std::thread::spawn(run).join().expect("thread");
    assert!(e.is_none() && saw, "{e:?}");
    // Derivation needs d, which was not granted.
    let socket = v.socket.clone();
    let e = std::thread::spawn(move || {
        common::become_uid(65534);
        let mut c = memveil_vault::Client::connect(&socket).expect("connect");
        c.derive_key("n", KeyKind::Aes128, false, "p256", 0, &[4; 65], b"")
            .expect_err("no d")
    })
    .join()
    .expect("thread");
    assert!(
        matches!(
            e,
            ClientError::Refused {
                code: ErrorCode::Denied,
                ..
            }
        ),
        "{e}"
    );
}
