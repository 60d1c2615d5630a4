//! Every mode against the NIST CAVP (and RFC 3686) vectors, THROUGH a
//! running vault: each key is imported over the control socket, each
//! operation goes through a shared-memory lane, and the key is destroyed
//! afterwards.
// Test data: small counters cast to bytes on purpose; expected errors unwrapped.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::err_expect,
    clippy::manual_is_multiple_of
)]

mod common;
#[path = "../../cipher/tests/common/mod.rs"]
mod nist;

use memveil_vault::client::{ClientError, Crypt};
use memveil_vault::proto::{KeyKind, Mode};
use memveil_vault::ring::status;
use memveil_vault::Client;

fn file(name: &str) -> Vec<nist::Case> {
    nist::parse(&format!("../../../cipher/tests/vectors/{name}"))
}

fn aes_kind(key: &[u8]) -> KeyKind {
    if key.len() == 16 {
        KeyKind::Aes128
    } else {
        KeyKind::Aes256
    }
}

fn with_key<R>(
    c: &mut Client,
    kind: KeyKind,
    key: &[u8],
    f: impl FnOnce(&mut Client, u32) -> R,
) -> R {
    let k = c.import_key("kat", kind, false, key).expect("import");
    let r = f(c, k.id);
    c.destroy_key("kat").expect("destroy");
    r
}

fn block_mode(c: &mut Client, prefix: &str, mode: Mode) -> usize {
    let mut n = 0;
    for kind in ["GFSbox", "KeySbox", "VarKey", "VarTxt", "MMT"] {
        for bits in [128, 256] {
            for case in file(&format!("{prefix}{kind}{bits}.rsp")) {
                let key = case.hex("KEY");
                let (pt, ct) = (case.hex("PLAINTEXT"), case.hex("CIPHERTEXT"));
                let iv = if mode == Mode::Cbc {
                    case.hex("IV")
                } else {
                    vec![0; 16]
                };
                with_key(c, aes_kind(&key), &key, |c, id| {
                    let p = Crypt::new(id, mode).iv(&iv);
                    if case.direction == "ENCRYPT" {
                        let mut d = pt.clone();
                        c.encrypt(&p, &mut d).expect("encrypt");
                        assert_eq!(d, ct, "{prefix}{kind}{bits} enc {:?}", case.get("COUNT"));
                    } else {
                        let mut d = ct.clone();
                        c.decrypt(&p, &mut d).expect("decrypt");
                        assert_eq!(d, pt, "{prefix}{kind}{bits} dec {:?}", case.get("COUNT"));
                    }
                });
                n += 1;
            }
        }
    }
    n
}

#[test]
fn every_mode_matches_the_vectors_through_the_vault() {
    let v = common::Vault::start();
    let mut c = v.client();

    let ecb = block_mode(&mut c, "ECB", Mode::Ecb);
    let cbc = block_mode(&mut c, "CBC", Mode::Cbc);
    assert!(ecb > 1000 && cbc > 1000, "ecb {ecb} cbc {cbc}");

    let mut ctr = 0;
    for f in ["aes-128-ctr.txt", "aes-256-ctr.txt"] {
        for case in file(f) {
            let key = case.hex("KEY");
            with_key(&mut c, aes_kind(&key), &key, |c, id| {
                let p = Crypt::new(id, Mode::Ctr).iv(&case.hex("IV"));
                let mut d = case.hex("PLAINTEXT");
                c.encrypt(&p, &mut d).expect("ctr");
                assert_eq!(d, case.hex("CIPHERTEXT"), "{f} {:?}", case.get("COUNT"));
                c.decrypt(&p, &mut d).expect("ctr");
                assert_eq!(d, case.hex("PLAINTEXT"));
            });
            ctr += 1;
        }
    }
    assert!(ctr >= 6, "{ctr}");

    let (mut xts, mut skipped) = (0, 0);
    for bits in [128, 256] {
        for form in ["hexstr", "seqno"] {
            for case in file(&format!("XTSGenAES{bits}-{form}.rsp")) {
                let len_bits: usize = case
                    .get("DATAUNITLEN")
                    .and_then(|v| v.parse().ok())
                    .expect("len");
                if len_bits % 8 != 0 {
                    skipped += 1;
                    continue;
                }
                let tweak: [u8; 16] = match case.get("I") {
                    Some(_) => case.hex("I").try_into().expect("i"),
                    None => case
                        .get("DATAUNITSEQNUMBER")
                        .and_then(|v| v.parse::<u128>().ok())
                        .expect("seq")
                        .to_le_bytes(),
                };
                let kind = if bits == 128 {
                    KeyKind::Xts128
                } else {
                    KeyKind::Xts256
                };
                with_key(&mut c, kind, &case.hex("KEY"), |c, id| {
                    let p = Crypt::new(id, Mode::Xts).iv(&tweak);
                    if case.direction == "ENCRYPT" {
                        let mut d = case.hex("PT");
                        c.encrypt(&p, &mut d).expect("xts enc");
                        assert_eq!(
                            d,
                            case.hex("CT"),
                            "XTS{bits} {form} {:?}",
                            case.get("COUNT")
                        );
                    } else {
                        let mut d = case.hex("CT");
                        c.decrypt(&p, &mut d).expect("xts dec");
                        assert_eq!(
                            d,
                            case.hex("PT"),
                            "XTS{bits} {form} {:?}",
                            case.get("COUNT")
                        );
                    }
                });
                xts += 1;
            }
        }
    }
    assert!(xts > 1000, "{xts}");

    let (mut gcm, mut rejected) = (0, 0);
    for bits in [128, 256] {
        for case in file(&format!("gcmEncryptExtIV{bits}.rsp")) {
            let key = case.hex("KEY");
            with_key(&mut c, aes_kind(&key), &key, |c, id| {
                let aad = case.hex("AAD");
                let p = Crypt::new(id, Mode::Gcm).iv(&case.hex("IV")).aad(&aad);
                let mut d = case.hex("PT");
                let tag = c.encrypt(&p, &mut d).expect("gcm seal");
                assert_eq!(d, case.hex("CT"), "gcm{bits} {:?}", case.get("COUNT"));
                let want = case.hex("TAG");
                assert_eq!(
                    &tag[..want.len()],
                    &want[..],
                    "gcm{bits} tag {:?}",
                    case.get("COUNT")
                );
            });
            gcm += 1;
        }
        for case in file(&format!("gcmDecrypt{bits}.rsp")) {
            let tag = case.hex("TAG");
            if tag.len() != 16 {
                continue;
            }
            let key = case.hex("KEY");
            with_key(&mut c, aes_kind(&key), &key, |c, id| {
                let aad = case.hex("AAD");
                let p = Crypt::new(id, Mode::Gcm)
                    .iv(&case.hex("IV"))
                    .aad(&aad)
                    .tag(&tag);
                let mut d = case.hex("CT");
                let r = c.decrypt(&p, &mut d);
                if case.fail {
                    assert!(
                        matches!(
                            r,
                            Err(ClientError::Request {
                                code: status::AUTH_FAILED,
                                ..
                            })
                        ),
                        "FAIL case accepted: {:?} {r:?}",
                        case.get("COUNT")
                    );
                    rejected += 1;
                } else {
                    r.expect("valid tag");
                    assert_eq!(d, case.hex("PT"));
                }
            });
            gcm += 1;
        }
    }
    assert!(gcm > 500 && rejected > 50, "{gcm} {rejected}");
    eprintln!(
        "through the vault: ECB {ecb}, CBC {cbc}, CTR {ctr}, XTS {xts} ({skipped} partial-byte units skipped), GCM {gcm} ({rejected} FAIL cases rejected)"
    );
    // Nothing left behind.
    assert!(c.list_keys().expect("list").is_empty());
}

/// AES-CMAC through a lane: the NIST SP 800-38B appendix D examples (AES-128
/// and AES-256, messages of 0, 16, 40 and 64 bytes); encrypt returns the tag
/// and leaves the data as it was, decrypt verifies a tag and refuses a wrong
/// one with `AUTH_FAILED`.
#[test]
fn cmac_matches_sp800_38b_through_the_vault() {
    let v = common::Vault::start();
    let mut c = v.client();
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/vectors/cmac-sp800-38b.txt"
    ))
    .expect("vector file");
    let cases: Vec<Vec<Vec<u8>>> = text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.split(':').map(|f| hex::decode(f).expect("hex")).collect())
        .collect();
    assert_eq!(cases.len(), 8);
    for case in &cases {
        let (key, msg, want) = (&case[0], &case[1], hex::encode(&case[2]));
        let len = msg.len();
        with_key(&mut c, aes_kind(key), key, |c, id| {
            let mut d = msg.clone();
            let tag = c
                .encrypt(&Crypt::new(id, Mode::Cmac), &mut d)
                .expect("cmac");
            assert_eq!(
                hex::encode(tag),
                want,
                "{} bytes of key, {len} of message",
                key.len()
            );
            assert_eq!(&d, msg, "CMAC changed the data");
            c.decrypt(&Crypt::new(id, Mode::Cmac).tag(&tag), &mut d)
                .expect("the right tag verifies");
            let mut bad = tag;
            bad[0] ^= 0x80;
            let r = c.decrypt(&Crypt::new(id, Mode::Cmac).tag(&bad), &mut d);
            assert!(
                matches!(
                    r,
                    Err(ClientError::Request {
                        code: status::AUTH_FAILED,
                        ..
                    })
                ),
                "a wrong CMAC tag verified: {r:?}"
            );
        });
    }
    // An XTS key does not serve CMAC.
    let xts = c
        .import_key(
            "xts",
            KeyKind::Xts128,
            false,
            &[7u8; 32]
                .iter()
                .enumerate()
                .map(|(i, b)| b ^ i as u8)
                .collect::<Vec<_>>(),
        )
        .expect("xts");
    let r = c.encrypt(&Crypt::new(xts.id, Mode::Cmac), &mut [0u8; 16]);
    assert!(
        matches!(
            r,
            Err(ClientError::Request {
                code: status::WRONG_MODE,
                ..
            })
        ),
        "{r:?}"
    );
}

/// Regression: the client library's first request on a connection, when it
/// carried no bytes (GCM over an empty message), failed with "no session"
/// because a scratch area of 0 bytes looked big enough.
#[test]
fn an_empty_first_request_opens_the_scratch_session() {
    let v = common::Vault::start();
    let mut c = v.client();
    let k = c.create_key("empty", KeyKind::Aes128, false).expect("key");
    let tag = c
        .encrypt(&Crypt::new(k.id, Mode::Gcm).iv(&[1; 12]), &mut [])
        .expect("GCM of the empty message as the first request");
    c.decrypt(&Crypt::new(k.id, Mode::Gcm).iv(&[1; 12]).tag(&tag), &mut [])
        .expect("and its tag verifies");
}
