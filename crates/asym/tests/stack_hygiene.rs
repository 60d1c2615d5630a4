//! Issue 27: what an asymmetric operation leaves on the stack of the thread
//! that ran it. aws-lc does not wipe all its stack temporaries: measured
//! here (aws-lc-sys 0.47, x86-64), an ECDSA P-256 signature leaves its
//! nonce `k` and the private scalar there (either gives the key away), ECDH
//! the shared secret; the RSA operations and Ed25519 left none of the
//! values searched for. On an ordinary stack a memory
//! dump reads them; the vault runs every operation on a thread whose stack
//! is secret memory, and a caller on an ordinary stack scrubs
//! (`memveil_secmem::scrub_stack`) after each operation.
//!
//! Each operation runs on a fresh thread 64 KiB deep in its stack
//! (`memveil_testkit::stack_after`); the test then reads the whole stack
//! and looks, at every byte offset, for any 16 bytes of a secret in either
//! byte order (aws-lc keeps numbers as little-endian words): RSA's `p`, `q`,
//! `d`, `dp`, `dq`, `qinv`; an EC key's scalar and every signature's nonce
//! `k` and `k⁻¹` (computed from the signature); Ed25519's seed, expanded
//! scalar, prefix and nonce (before and after reduction); ECDH's shared
//! secret. It reports what each operation leaves (the positive control:
//! the finder finds real leftovers), and asserts that after a scrub of
//! 64 KiB nothing is left. A planted copy of `p` in a local array is the
//! control that does not depend on aws-lc's behaviour.

use std::collections::HashMap;
use std::hint::black_box;

use memveil_asym::components::{encode_into, encoded_len};
use memveil_asym::hash::digest;
use memveil_asym::{Algorithm, DecryptScheme, Hash, PrivateKey, SignScheme};
use memveil_testkit::stack_after;
use openssl::bn::{BigNum, BigNumContext};
use openssl::ec::{EcGroup, EcKey, PointConversionForm};
use openssl::nid::Nid;
use openssl::rsa::{Padding, Rsa};

type B16 = [u8; 16];
type Op<'a> = Box<dyn Fn() + Sync + 'a>;

#[derive(Default)]
struct Secrets(HashMap<B16, String>);

impl Secrets {
    /// Every 16-byte window of `v`, big-endian and reversed.
    fn add(&mut self, v: &[u8], what: &str) {
        let rev: Vec<u8> = v.iter().rev().copied().collect();
        for (bytes, order) in [(v, "BE"), (&rev[..], "LE")] {
            for w in bytes.windows(16) {
                let b: B16 = w.try_into().expect("16");
                if b.iter().filter(|x| **x == 0).count() < 8 {
                    self.0
                        .entry(b)
                        .or_insert_with(|| format!("{what} ({order})"));
                }
            }
        }
    }

    fn hits(&self, stack: &[u8]) -> Vec<String> {
        let mut v: Vec<String> = stack
            .windows(16)
            .filter_map(|w| self.0.get(<&B16>::try_from(w).ok()?).cloned())
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

fn enc(fields: &[&[u8]]) -> Vec<u8> {
    let mut v = vec![0u8; encoded_len(fields)];
    let n = encode_into(fields, &mut v).expect("encode");
    v.truncate(n);
    v
}

fn bn(b: &[u8]) -> BigNum {
    BigNum::from_slice(b).expect("bn")
}

/// Runs `op` plainly and then with a scrub; returns what the plain run left.
fn check(name: &str, s: &Secrets, op: &(dyn Fn() + Sync)) -> Vec<String> {
    let plain = s.hits(&stack_after(op));
    let scrubbed = s.hits(&stack_after(|| {
        op();
        memveil_secmem::scrub_stack(64 * 1024);
    }));
    assert!(
        scrubbed.is_empty(),
        "{name}: left on the stack after a 64 KiB scrub: {scrubbed:?}"
    );
    eprintln!("{name}: left on an ordinary stack without a scrub: {plain:?}");
    plain
}

#[test]
fn operations_leave_secrets_that_a_scrub_removes() {
    let mut all_plain = Vec::new();

    // RSA-2048, imported so the test knows every secret number.
    let r = Rsa::generate(2048).expect("rsa");
    let v = |b: Option<&openssl::bn::BigNumRef>| b.expect("part").to_vec();
    let parts = [
        r.n().to_vec(),
        r.e().to_vec(),
        r.d().to_vec(),
        v(r.p()),
        v(r.q()),
        v(r.dmp1()),
        v(r.dmq1()),
        v(r.iqmp()),
    ];
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let rsa = PrivateKey::from_components(Algorithm::Rsa2048, &enc(&refs)).expect("import");
    let mut s = Secrets::default();
    for (i, what) in [
        (2, "d"),
        (3, "p"),
        (4, "q"),
        (5, "dp"),
        (6, "dq"),
        (7, "qinv"),
    ] {
        s.add(&parts[i], &format!("RSA {what}"));
    }
    let mut ct = vec![0u8; 256];
    r.public_encrypt(b"a secret message", &mut ct, Padding::PKCS1_OAEP)
        .expect("oaep");
    let mut ct1 = vec![0u8; 256];
    r.public_encrypt(b"a secret message", &mut ct1, Padding::PKCS1)
        .expect("pkcs1");
    let mut di = Hash::Sha256.digest_info_prefix().to_vec();
    di.extend(digest(Hash::Sha256, b"m"));
    let d256 = digest(Hash::Sha256, b"m");
    let ops: [(&str, Op<'_>); 5] = [
        (
            "RSA PKCS#1 v1.5 sign",
            Box::new(|| {
                let mut o = [0u8; 256];
                black_box(rsa.sign(SignScheme::Pkcs1, &di, &mut o).expect("sign"));
            }),
        ),
        (
            "RSA-PSS sign",
            Box::new(|| {
                let mut o = [0u8; 256];
                let sch = SignScheme::Pss {
                    hash: Hash::Sha256,
                    mgf1: Hash::Sha256,
                    salt: 32,
                };
                black_box(rsa.sign(sch, &d256, &mut o).expect("sign"));
            }),
        ),
        (
            "RSA raw",
            Box::new(|| {
                let mut o = [0u8; 256];
                black_box(rsa.sign(SignScheme::Raw, &ct, &mut o).expect("raw"));
            }),
        ),
        (
            "RSA OAEP decrypt",
            Box::new(|| {
                let mut o = [0u8; 256];
                let sch = DecryptScheme::Oaep {
                    hash: Hash::Sha1,
                    mgf1: Hash::Sha1,
                    label: &[],
                };
                black_box(rsa.decrypt(sch, &ct, &mut o).expect("oaep"));
            }),
        ),
        (
            "RSA PKCS#1 v1.5 decrypt (implicit rejection)",
            Box::new(|| {
                let mut o = [0u8; 256];
                black_box(
                    rsa.decrypt(DecryptScheme::Pkcs1, &ct1, &mut o)
                        .expect("pkcs1"),
                );
            }),
        ),
    ];
    for (name, op) in &ops {
        all_plain.extend(check(name, &s, op.as_ref()));
    }

    // P-256: the scalar, and the nonce of every signature made.
    let g = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).expect("group");
    let ek = EcKey::generate(&g).expect("ec");
    let scalar = ek.private_key().to_vec();
    let ec = PrivateKey::from_components(Algorithm::P256, &enc(&[&scalar])).expect("import");
    let mut order = BigNum::new().expect("bn");
    let mut ctx = BigNumContext::new().expect("ctx");
    g.order(&mut order, &mut ctx).expect("order");
    let sigs = std::sync::Mutex::new(Vec::new());
    let sign = || {
        let mut o = [0u8; 64];
        ec.sign(SignScheme::Ecdsa, &d256, &mut o).expect("ecdsa");
        sigs.lock().expect("lock").push(o);
    };
    let peer = EcKey::generate(&g).expect("peer");
    let their = peer
        .public_key()
        .to_bytes(&g, PointConversionForm::UNCOMPRESSED, &mut ctx)
        .expect("point");
    let mut z = [0u8; 32];
    ec.ecdh(&their, &mut z).expect("ecdh");
    let ecdh = || {
        let mut o = [0u8; 32];
        black_box(ec.ecdh(&their, &mut o).expect("ecdh"));
    };
    // The nonce is known only once the signature is: read the stack, then
    // derive k from the signature the run made (k = s⁻¹ (e + r·d) mod n).
    let secrets_of = |sig: &[u8; 64], ctx: &mut BigNumContext| {
        let mut s = Secrets::default();
        s.add(&scalar, "P-256 scalar");
        s.add(&z, "ECDH shared secret");
        let (rr, ss) = (bn(&sig[..32]), bn(&sig[32..]));
        let mut sinv = BigNum::new().expect("bn");
        sinv.mod_inverse(&ss, &order, ctx).expect("inv");
        let mut rd = BigNum::new().expect("bn");
        rd.mod_mul(&rr, &bn(&scalar), &order, ctx).expect("mul");
        let mut sum = BigNum::new().expect("bn");
        sum.mod_add(&rd, &bn(&d256), &order, ctx).expect("add");
        let mut k = BigNum::new().expect("bn");
        k.mod_mul(&sum, &sinv, &order, ctx).expect("k");
        let mut kinv = BigNum::new().expect("bn");
        kinv.mod_inverse(&k, &order, ctx).expect("kinv");
        s.add(&k.to_vec_padded(32).expect("k"), "ECDSA nonce k");
        s.add(&kinv.to_vec_padded(32).expect("kinv"), "ECDSA k⁻¹");
        s
    };
    let stack = stack_after(sign);
    let sig = *sigs.lock().expect("lock").last().expect("sig");
    let plain = secrets_of(&sig, &mut ctx).hits(&stack);
    let stack = stack_after(|| {
        sign();
        memveil_secmem::scrub_stack(64 * 1024);
    });
    let sig = *sigs.lock().expect("lock").last().expect("sig");
    let scrubbed = secrets_of(&sig, &mut ctx).hits(&stack);
    assert!(
        scrubbed.is_empty(),
        "ECDSA P-256 sign: left on the stack after a 64 KiB scrub: {scrubbed:?}"
    );
    eprintln!("ECDSA P-256 sign: left on an ordinary stack without a scrub: {plain:?}");
    all_plain.extend(plain);
    let mut s = Secrets::default();
    s.add(&scalar, "P-256 scalar");
    s.add(&z, "ECDH shared secret");
    all_plain.extend(check("ECDH P-256", &s, &ecdh));

    // Ed25519: seed, expanded scalar a, prefix, nonce.
    let seed: [u8; 32] = std::array::from_fn(|i| u8::try_from(i * 7 + 3).expect("u8") ^ 0x9c);
    let ed = PrivateKey::from_components(Algorithm::Ed25519, &enc(&[&seed])).expect("import");
    let h = digest(Hash::Sha512, &seed);
    let mut a = h[..32].to_vec();
    a[0] &= 248;
    a[31] &= 127;
    a[31] |= 64;
    let mut s = Secrets::default();
    s.add(&seed, "Ed25519 seed");
    s.add(&a, "Ed25519 scalar a");
    s.add(&h[32..], "Ed25519 prefix");
    let msg = b"ssh signature data";
    let mut pm = h[32..].to_vec();
    pm.extend_from_slice(msg);
    let rh = digest(Hash::Sha512, &pm);
    s.add(&rh, "Ed25519 nonce hash");
    let le: Vec<u8> = rh.iter().rev().copied().collect();
    let l = bn(
        &hex::decode("1000000000000000000000000000000014def9dea2f79cd65812631a5cf5d3ed")
            .expect("L"),
    );
    let mut r = BigNum::new().expect("bn");
    r.nnmod(&bn(&le), &l, &mut ctx).expect("mod");
    s.add(&r.to_vec_padded(32).expect("r"), "Ed25519 nonce r");
    all_plain.extend(check("Ed25519 sign", &s, &|| {
        let mut o = [0u8; 64];
        black_box(ed.sign(SignScheme::Ed25519, msg, &mut o).expect("sign"));
    }));

    // Control independent of aws-lc: a planted copy of p is found.
    let mut s = Secrets::default();
    s.add(&parts[3], "RSA p");
    let p = parts[3].clone();
    let hits = s.hits(&stack_after(move || {
        let mut local = [0u8; 128];
        local.copy_from_slice(&p);
        black_box(&mut local);
    }));
    assert!(
        hits.iter().any(|h| h.contains("RSA p")),
        "control: a copy of p on the stack was not found"
    );
    eprintln!(
        "summary: {} kinds of secret left by aws-lc on ordinary stacks (all removed by the scrub)",
        all_plain.len()
    );
}
