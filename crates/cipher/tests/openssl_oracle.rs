//! Property tests against an independent implementation (OpenSSL's EVP), on
//! every path this CPU runs (each case checks them all; the paths this CPU
//! cannot run are named in the output).

#[path = "common/mod.rs"]
mod common;

use std::sync::OnceLock;

use memveil_cipher::{Aes, Gcm, Path, Xts};
use openssl::symm::{self, Cipher, Crypter, Mode};
use proptest::prelude::*;

fn ossl(c: Cipher, key: &[u8], iv: Option<&[u8]>, data: &[u8], enc: bool) -> Vec<u8> {
    let mut cr =
        Crypter::new(c, if enc { Mode::Encrypt } else { Mode::Decrypt }, key, iv).expect("crypter");
    cr.pad(false);
    let mut out = vec![0u8; data.len() + 32];
    let mut n = cr.update(data, &mut out).expect("update");
    n += cr.finalize(&mut out[n..]).expect("finalize");
    out.truncate(n);
    out
}

/// The paths to check, computed (and reported) once.
fn paths() -> &'static [Path] {
    static P: OnceLock<Vec<Path>> = OnceLock::new();
    P.get_or_init(|| common::paths("openssl_oracle"))
}

fn distinct_halves(k: &[u8]) -> bool {
    let (a, b) = k.split_at(k.len() / 2);
    a != b
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn xts_matches_openssl(
        wide in any::<bool>(),
        key in prop::collection::vec(any::<u8>(), 64),
        tweak in any::<[u8; 16]>(),
        data in prop::collection::vec(any::<u8>(), 16..5000),
    ) {
        let key = if wide { &key[..] } else { &key[..32] };
        prop_assume!(distinct_halves(key));
        let c = if wide { Cipher::aes_256_xts() } else { Cipher::aes_128_xts() };
        let want = ossl(c, key, Some(&tweak), &data, true);
        let (k1, k2) = key.split_at(key.len() / 2);
        for &p in paths() {
            let x = Xts::with_path(k1, k2, p).expect("key");
            let mut d = data.clone();
            x.encrypt(&tweak, &mut d).expect("enc");
            prop_assert_eq!(&d, &want, "{}", p);
            x.decrypt(&tweak, &mut d).expect("dec");
            prop_assert_eq!(&d, &data, "{}", p);
        }
    }

    #[test]
    fn ctr_and_cbc_match_openssl(
        wide in any::<bool>(),
        key in prop::collection::vec(any::<u8>(), 32),
        iv in any::<[u8; 16]>(),
        blocks in 0usize..300,
        extra in 0usize..16,
        seed in any::<u8>(),
    ) {
        let key = if wide { &key[..] } else { &key[..16] };
        let data: Vec<u8> = (0..blocks * 16 + extra).map(|i| (i % 256).to_le_bytes()[0].wrapping_mul(31) ^ seed).collect();
        let (ctr_c, cbc_c) = if wide {
            (Cipher::aes_256_ctr(), Cipher::aes_256_cbc())
        } else {
            (Cipher::aes_128_ctr(), Cipher::aes_128_cbc())
        };
        let want_ctr = ossl(ctr_c, key, Some(&iv), &data, true);
        let whole = &data[..blocks * 16];
        let want_cbc = ossl(cbc_c, key, Some(&iv), whole, true);
        let want_ecb = ossl(if wide { Cipher::aes_256_ecb() } else { Cipher::aes_128_ecb() }, key, None, whole, true);
        for &p in paths() {
            let a = Aes::with_path(key, p).expect("key");
            let mut d = data.clone();
            a.ctr_apply(&iv, &mut d);
            prop_assert_eq!(&d, &want_ctr, "{}", p);
            let mut d = whole.to_vec();
            a.cbc_encrypt(&iv, &mut d).expect("cbc");
            prop_assert_eq!(&d, &want_cbc, "{}", p);
            a.cbc_decrypt(&iv, &mut d).expect("cbc");
            prop_assert_eq!(&d[..], whole, "{}", p);
            a.ecb_encrypt(&mut d).expect("ecb");
            prop_assert_eq!(&d, &want_ecb, "{}", p);
            a.ecb_decrypt(&mut d).expect("ecb");
            prop_assert_eq!(&d[..], whole, "{}", p);
        }
    }

    #[test]
    fn gcm_matches_openssl(
        wide in any::<bool>(),
        key in prop::collection::vec(any::<u8>(), 32),
        nonce in any::<[u8; 12]>(),
        aad in prop::collection::vec(any::<u8>(), 0..64),
        data in prop::collection::vec(any::<u8>(), 0..3000),
    ) {
        let key = if wide { &key[..] } else { &key[..16] };
        let c = if wide { Cipher::aes_256_gcm() } else { Cipher::aes_128_gcm() };
        let mut otag = [0u8; 16];
        let oct = symm::encrypt_aead(c, key, Some(&nonce), &aad, &data, &mut otag).expect("ossl");
        for &p in paths() {
            let g = Gcm::with_path(key, p).expect("key");
            let mut d = data.clone();
            let tag = g.seal(&nonce, &aad, &mut d);
            prop_assert_eq!(&d, &oct, "{}", p);
            prop_assert_eq!(tag, otag, "{}", p);
            let mut bad = tag;
            bad[0] ^= 1;
            let mut e = d.clone();
            prop_assert!(g.open(&nonce, &aad, &mut e, &bad).is_err());
            prop_assert_eq!(&e, &d, "failed open must leave ciphertext ({})", p);
            g.open(&nonce, &aad, &mut d, &tag).expect("open");
            prop_assert_eq!(&d, &data, "{}", p);
        }
    }
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    assert!(Aes::new(&[0; 24]).is_err(), "AES-192 is not offered");
    assert!(Aes::new(&[]).is_err());
    let a = Aes::new(&[1; 16]).expect("key");
    assert!(a.ecb_encrypt(&mut [0u8; 17]).is_err());
    assert!(a.cbc_decrypt(&[0; 16], &mut [0u8; 31]).is_err());
    let g = Gcm::new(&[1; 32]).expect("key");
    assert!(g.open(&[0; 12], &[], &mut [], &[0; 15]).is_err());
    let msg = Xts::new(&[3; 16], &[3; 16])
        .err()
        .expect("equal halves")
        .to_string();
    assert!(msg.contains("equal"), "{msg}");
}
