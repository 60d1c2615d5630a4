//! Every mode against the NIST CAVP files in `tests/vectors` (see its README),
//! on every path this CPU runs (each test names the paths it could not run).

#[path = "common/mod.rs"]
mod common;

use common::{parse, paths};
use memveil_cipher::{Aes, CipherError, Gcm, Path, Xts};

fn block_mode(prefix: &str, cbc: bool) {
    for p in paths(prefix) {
        block_mode_on(prefix, cbc, p);
    }
}

fn block_mode_on(prefix: &str, cbc: bool, path: Path) {
    let mut n = 0;
    for kind in ["GFSbox", "KeySbox", "VarKey", "VarTxt", "MMT"] {
        for bits in [128, 256] {
            for c in parse(&format!("{prefix}{kind}{bits}.rsp")) {
                let key = Aes::with_path(&c.hex("KEY"), path).expect("key");
                let (pt, ct) = (c.hex("PLAINTEXT"), c.hex("CIPHERTEXT"));
                let iv: [u8; 16] = if cbc {
                    c.hex("IV").try_into().expect("iv")
                } else {
                    [0; 16]
                };
                if c.direction == "ENCRYPT" {
                    let mut d = pt.clone();
                    if cbc {
                        key.cbc_encrypt(&iv, &mut d).expect("len");
                    } else {
                        key.ecb_encrypt(&mut d).expect("len");
                    }
                    assert_eq!(
                        d,
                        ct,
                        "{path} {prefix}{kind}{bits} encrypt {:?}",
                        c.get("COUNT")
                    );
                } else {
                    let mut d = ct.clone();
                    if cbc {
                        key.cbc_decrypt(&iv, &mut d).expect("len");
                    } else {
                        key.ecb_decrypt(&mut d).expect("len");
                    }
                    assert_eq!(
                        d,
                        pt,
                        "{path} {prefix}{kind}{bits} decrypt {:?}",
                        c.get("COUNT")
                    );
                }
                n += 1;
            }
        }
    }
    assert!(n > 1000, "only {n} {prefix} cases read");
    eprintln!("{prefix} on {path}: {n} cases passed");
}

#[test]
fn ecb_kat_and_mmt() {
    block_mode("ECB", false);
}

#[test]
fn cbc_kat_and_mmt() {
    block_mode("CBC", true);
}

#[test]
fn ctr_rfc3686() {
    for path in paths("CTR") {
        ctr_on(path);
    }
}

fn ctr_on(path: Path) {
    let mut n = 0;
    for f in ["aes-128-ctr.txt", "aes-256-ctr.txt"] {
        for c in parse(f) {
            let key = Aes::with_path(&c.hex("KEY"), path).expect("key");
            let ctr: [u8; 16] = c.hex("IV").try_into().expect("iv");
            let mut d = c.hex("PLAINTEXT");
            key.ctr_apply(&ctr, &mut d);
            assert_eq!(d, c.hex("CIPHERTEXT"), "{path} {f} {:?}", c.get("COUNT"));
            key.ctr_apply(&ctr, &mut d);
            assert_eq!(d, c.hex("PLAINTEXT"));
            n += 1;
        }
    }
    assert!(n >= 6, "{n}");
    eprintln!("CTR on {path}: {n} cases passed");
}

#[test]
fn xts_genaes() {
    for path in paths("XTS") {
        xts_on(path);
    }
}

fn xts_on(path: Path) {
    let (mut n, mut skipped) = (0, 0);
    for bits in [128, 256] {
        for form in ["hexstr", "seqno"] {
            for c in parse(&format!("XTSGenAES{bits}-{form}.rsp")) {
                let len_bits: usize = c
                    .get("DATAUNITLEN")
                    .and_then(|v| v.parse().ok())
                    .expect("len");
                if !len_bits.is_multiple_of(8) {
                    skipped += 1;
                    continue;
                }
                let k = c.hex("KEY");
                let (k1, k2) = k.split_at(k.len() / 2);
                let key = Xts::with_path(k1, k2, path).expect("key");
                let tweak: [u8; 16] = match c.get("I") {
                    Some(_) => c.hex("I").try_into().expect("i"),
                    None => {
                        let s: u128 = c
                            .get("DATAUNITSEQNUMBER")
                            .and_then(|v| v.parse().ok())
                            .expect("seq");
                        s.to_le_bytes()
                    }
                };
                let (pt, ct) = (c.hex("PT"), c.hex("CT"));
                if c.direction == "ENCRYPT" {
                    let mut d = pt.clone();
                    key.encrypt(&tweak, &mut d).expect("enc");
                    assert_eq!(d, ct, "{path} XTS{bits} {form} enc {:?}", c.get("COUNT"));
                } else {
                    let mut d = ct.clone();
                    key.decrypt(&tweak, &mut d).expect("dec");
                    assert_eq!(d, pt, "{path} XTS{bits} {form} dec {:?}", c.get("COUNT"));
                }
                n += 1;
            }
        }
    }
    eprintln!("XTS on {path}: {n} cases passed, {skipped} skipped (DataUnitLen not a whole number of bytes)");
    assert!(n > 1000, "{n}");
}

#[test]
fn gcm_encrypt_and_decrypt() {
    for path in paths("GCM") {
        gcm_on(path);
    }
}

fn gcm_on(path: Path) {
    let (mut n, mut fails, mut skipped) = (0, 0, 0);
    for bits in [128, 256] {
        for c in parse(&format!("gcmEncryptExtIV{bits}.rsp")) {
            let key = Gcm::with_path(&c.hex("KEY"), path).expect("key");
            let iv: [u8; 12] = c.hex("IV").try_into().expect("96-bit iv");
            let mut d = c.hex("PT");
            let tag = key.seal(&iv, &c.hex("AAD"), &mut d);
            assert_eq!(d, c.hex("CT"), "{path} gcm{bits} {:?}", c.get("COUNT"));
            let want = c.hex("TAG");
            assert_eq!(
                &tag[..want.len()],
                &want[..],
                "{path} gcm{bits} tag {:?}",
                c.get("COUNT")
            );
            n += 1;
        }
        for c in parse(&format!("gcmDecrypt{bits}.rsp")) {
            let want = c.hex("TAG");
            if want.len() != 16 {
                skipped += 1;
                continue;
            }
            let key = Gcm::with_path(&c.hex("KEY"), path).expect("key");
            let iv: [u8; 12] = c.hex("IV").try_into().expect("96-bit iv");
            let mut d = c.hex("CT");
            let r = key.open(&iv, &c.hex("AAD"), &mut d, &want);
            if c.fail {
                assert_eq!(
                    r,
                    Err(CipherError::TagMismatch),
                    "{path} must reject {:?}",
                    c.get("COUNT")
                );
                fails += 1;
            } else {
                r.expect("valid tag");
                assert_eq!(d, c.hex("PT"));
            }
            n += 1;
        }
    }
    eprintln!("GCM on {path}: {n} cases passed ({fails} FAIL cases rejected), {skipped} decrypt cases with 96-bit tags skipped");
    assert!(n > 500 && fails > 50, "{n} {fails}");
}
