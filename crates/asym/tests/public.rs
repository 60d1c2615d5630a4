//! Public-key operations against OpenSSL: signatures made by OpenSSL verify
//! here (and a changed byte does not), ciphertexts made here decrypt there,
//! raw and PKCS#1 recovery give back what OpenSSL signed.
#![allow(clippy::unwrap_used)]

use memveil_asym::hash::digest;
use memveil_asym::{Curve, EncryptScheme, Hash, Public, PublicKey, VerifyScheme};
use openssl::ec::{EcGroup, EcKey, PointConversionForm};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::PKey;
use openssl::rsa::{Padding, Rsa};
use openssl::sign::{RsaPssSaltlen, Signer};

fn flip(v: &[u8]) -> Vec<u8> {
    let mut v = v.to_vec();
    let last = v.len() - 1;
    v[last] ^= 1;
    v
}

#[test]
fn openssl_rsa_signatures_verify_and_ciphertexts_decrypt_there() {
    let r = Rsa::generate(2048).unwrap();
    let k = PublicKey::new(&Public::Rsa {
        n: r.n().to_vec(),
        e: r.e().to_vec(),
    })
    .unwrap();
    assert_eq!(k.block_len(), 256);
    let pkey = PKey::from_rsa(r.clone()).unwrap();
    let msg = b"memveil verifies what openssl signed";
    // PKCS#1 v1.5 over SHA-256.
    let mut s = Signer::new(MessageDigest::sha256(), &pkey).unwrap();
    let sig = s.sign_oneshot_to_vec(msg).unwrap();
    let mut di = Hash::Sha256.digest_info_prefix().to_vec();
    di.extend(digest(Hash::Sha256, msg));
    k.verify(VerifyScheme::Pkcs1, &di, &sig).unwrap();
    assert!(k.verify(VerifyScheme::Pkcs1, &di, &flip(&sig)).is_err());
    assert_eq!(k.recover(VerifyScheme::Pkcs1, &sig).unwrap(), di);
    // PSS, salt of 32.
    let mut s = Signer::new(MessageDigest::sha256(), &pkey).unwrap();
    s.set_rsa_padding(Padding::PKCS1_PSS).unwrap();
    s.set_rsa_pss_saltlen(RsaPssSaltlen::custom(32)).unwrap();
    let sig = s.sign_oneshot_to_vec(msg).unwrap();
    let pss = VerifyScheme::Pss {
        hash: Hash::Sha256,
        mgf1: Hash::Sha256,
        salt: 32,
    };
    let d = digest(Hash::Sha256, msg);
    k.verify(pss, &d, &sig).unwrap();
    assert!(k.verify(pss, &flip(&d), &sig).is_err());
    // Raw: OpenSSL's private operation without padding.
    let mut block = vec![0u8; 256];
    block[200..].fill(7);
    let mut sig = vec![0u8; 256];
    r.private_encrypt(&block, &mut sig, Padding::NONE).unwrap();
    k.verify(VerifyScheme::Raw, &block[200..], &sig).unwrap();
    assert!(k.verify(VerifyScheme::Raw, &flip(&block), &sig).is_err());
    // Encryption here, decryption there.
    for (scheme, pad) in [
        (EncryptScheme::Pkcs1, Padding::PKCS1),
        (
            EncryptScheme::Oaep {
                hash: Hash::Sha1,
                mgf1: Hash::Sha1,
                label: b"",
            },
            Padding::PKCS1_OAEP,
        ),
    ] {
        let c = k.encrypt(scheme, b"secret message").unwrap();
        let mut back = vec![0u8; 256];
        let n = r.private_decrypt(&c, &mut back, pad).unwrap();
        assert_eq!(&back[..n], b"secret message");
    }
    assert!(k.encrypt(EncryptScheme::Pkcs1, &[0u8; 246]).is_err());
}

#[test]
fn openssl_ecdsa_and_ed25519_signatures_verify() {
    let g = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    let ec = EcKey::generate(&g).unwrap();
    let mut ctx = openssl::bn::BigNumContext::new().unwrap();
    let point = ec
        .public_key()
        .to_bytes(&g, PointConversionForm::UNCOMPRESSED, &mut ctx)
        .unwrap();
    let k = PublicKey::new(&Public::Ec {
        curve: Curve::P256,
        point,
    })
    .unwrap();
    let d = digest(Hash::Sha256, b"ecdsa");
    let sig = openssl::ecdsa::EcdsaSig::sign(&d, &ec).unwrap();
    let mut rs = sig.r().to_vec_padded(32).unwrap();
    rs.extend(sig.s().to_vec_padded(32).unwrap());
    k.verify(VerifyScheme::Ecdsa, &d, &rs).unwrap();
    assert!(k.verify(VerifyScheme::Ecdsa, &d, &flip(&rs)).is_err());
    assert!(k.verify(VerifyScheme::Pkcs1, &d, &rs).is_err());
    assert!(PublicKey::new(&Public::Ec {
        curve: Curve::P256,
        point: vec![4; 65],
    })
    .is_err());

    let ed = PKey::generate_ed25519().unwrap();
    let pk: [u8; 32] = ed.raw_public_key().unwrap().try_into().unwrap();
    let k = PublicKey::new(&Public::Ed25519(pk)).unwrap();
    let mut s = Signer::new_without_digest(&ed).unwrap();
    let sig = s.sign_oneshot_to_vec(b"eddsa").unwrap();
    k.verify(VerifyScheme::Ed25519, b"eddsa", &sig).unwrap();
    assert!(k.verify(VerifyScheme::Ed25519, b"eddsA", &sig).is_err());
}
