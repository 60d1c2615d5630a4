//! Proof of protection for asymmetric keys (issue 27): with signatures,
//! decryptions and derivations in flight, neither RSA prime nor the private
//! exponent, nor the EC scalar, nor the Ed25519 seed or its expanded scalar
//! is found in the vault's readable memory (`/proc/PID/mem`) or in a `gcore`
//! dump of it. The vault routes aws-lc's allocations into a `memfd_secret`
//! heap and runs every operation on a secret stack.
//!
//! Positive control, same run: the same keys built by the same library
//! (memveil-asym over aws-lc) in this test process, on the ordinary heap,
//! are found by the same scan in `/proc/self/mem` and in a `gcore` of this
//! process. The test holds the secrets it looks for only masked
//! (`memveil_keyfind::Secrets`) and wipes its plain copies before any scan.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::{gcore, Vault};
use memveil_asym::components::{encode_into, encoded_len, secret_parts};
use memveil_asym::{Algorithm, PrivateKey, SignScheme};
use memveil_keyfind::{read_process, Secrets};
use memveil_testkit::{skip, Need};
use memveil_vault::proto::{KeyKind, Mode};
use memveil_vault::ring::{AsymParams, Op};
use zeroize::Zeroizing;

fn components(fields: &[Vec<u8>]) -> Zeroizing<Vec<u8>> {
    let refs: Vec<&[u8]> = fields.iter().map(Vec::as_slice).collect();
    let mut v = Zeroizing::new(vec![0u8; encoded_len(&refs)]);
    let n = encode_into(&refs, &mut v).expect("encode");
    v.truncate(n);
    v
}

fn add(s: &mut Secrets, alg: Algorithm, c: &[u8]) {
    for p in secret_parts(alg, c).expect("parts") {
        if p.number {
            s.add_number(p.what, &p.value);
        } else {
            s.add(p.what, &p.value);
        }
    }
}

#[test]
fn asymmetric_keys_are_not_found_in_the_vault_but_the_baseline_is() {
    if common::euid() != 0 {
        skip(
            Need::Root,
            "reading the non-dumpable vault's /proc/PID/mem needs root",
        );
        return;
    }
    // The keys, made here so the test knows what to look for.
    let mut keys: Vec<(KeyKind, Algorithm, Zeroizing<Vec<u8>>)> = Vec::new();
    {
        let r = openssl::rsa::Rsa::generate(2048).expect("rsa");
        let v = |b: Option<&openssl::bn::BigNumRef>| b.expect("part").to_vec();
        let f = [
            r.n().to_vec(),
            r.e().to_vec(),
            r.d().to_vec(),
            v(r.p()),
            v(r.q()),
            v(r.dmp1()),
            v(r.dmq1()),
            v(r.iqmp()),
        ];
        keys.push((KeyKind::Rsa2048, Algorithm::Rsa2048, components(&f)));
        let g = openssl::ec::EcGroup::from_curve_name(openssl::nid::Nid::X9_62_PRIME256V1)
            .expect("group");
        let ec = openssl::ec::EcKey::generate(&g).expect("ec");
        keys.push((
            KeyKind::P256,
            Algorithm::P256,
            components(&[ec.private_key().to_vec()]),
        ));
        let mut seed = [0u8; 32];
        memveil_sys::getrandom(&mut seed).expect("random");
        keys.push((
            KeyKind::Ed25519,
            Algorithm::Ed25519,
            components(&[seed.to_vec()]),
        ));
        seed.iter_mut().for_each(|b| *b = 0);
        // OpenSSL's copies (its BIGNUMs) are cleared when these drop.
    }
    let mut secrets = Secrets::new();
    for (_, alg, c) in &keys {
        add(&mut secrets, *alg, c);
    }

    let v = Vault::start();
    let mut c = v.client();
    let mut ids = Vec::new();
    for (kind, _, comp) in &keys {
        ids.push((
            *kind,
            c.import_key(kind.name(), *kind, false, comp)
                .expect("import")
                .id,
        ));
    }
    // The baseline: the same keys in this process, on the ordinary heap.
    let baseline: Vec<PrivateKey> = keys
        .iter()
        .map(|(_, alg, comp)| PrivateKey::from_components(*alg, comp).expect("baseline"))
        .collect();
    drop(keys);

    // Requests in flight from another client for the whole scan.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let worker = {
        let (stop, done) = (stop.clone(), done.clone());
        let mut c = v.client();
        std::thread::spawn(move || {
            let digest = [0x42u8; 32];
            while !stop.load(Ordering::Relaxed) {
                for (kind, id) in &ids {
                    let (mode, input): (Mode, &[u8]) = match kind {
                        KeyKind::Rsa2048 => (Mode::RsaPss, &digest),
                        KeyKind::P256 => (Mode::Ecdsa, &digest),
                        _ => (Mode::EdDsa, b"ssh signature data"),
                    };
                    let p = AsymParams {
                        hash: 3,
                        mgf1: 3,
                        len: 32,
                    };
                    c.private_op(Op::Encrypt, *id, mode, p, input)
                        .expect("sign");
                    done.fetch_add(1, Ordering::Relaxed);
                }
                c.derive_key(
                    "session",
                    KeyKind::Aes256,
                    false,
                    "p256",
                    0,
                    &p256_peer(),
                    b"",
                )
                .expect("derive");
                c.destroy_key("session").expect("destroy");
            }
        })
    };
    while done.load(Ordering::Relaxed) < 30 {
        std::thread::yield_now();
    }

    let vault_mem = read_process(v.pid()).expect("read vault memory");
    assert!(
        vault_mem.bytes() > 1 << 20,
        "read only {} bytes",
        vault_mem.bytes()
    );
    let hits = secrets.find(&vault_mem);
    assert!(hits.is_empty(), "in the vault's readable memory: {hits:?}");
    eprintln!(
        "vault: {} secrets looked for in {} bytes read; unreadable (secret memory): {} bytes",
        secrets.len(),
        vault_mem.bytes(),
        vault_mem.skipped_bytes()
    );
    if let Some(core) = gcore(v.pid(), "vault-asym") {
        assert!(
            core.bytes() > 1 << 20,
            "vault core holds {} bytes",
            core.bytes()
        );
        let hits = secrets.find(&core);
        assert!(hits.is_empty(), "in the vault's core dump: {hits:?}");
    }
    let before = done.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    worker.join().expect("worker");
    assert!(done.load(Ordering::Relaxed) > before.saturating_sub(1));

    // Positive control: the baseline keys, used once, are found here.
    let mut sig = [0u8; 256];
    for k in &baseline {
        let s = match k.algorithm() {
            Algorithm::Rsa2048 => SignScheme::Pkcs1,
            Algorithm::P256 => SignScheme::Ecdsa,
            _ => SignScheme::Ed25519,
        };
        k.sign(s, &[1; 32], &mut sig).expect("baseline sign");
    }
    let mem = read_process(std::process::id()).expect("read own memory");
    let hits = secrets.find(&mem);
    let what: std::collections::BTreeSet<&str> = hits
        .iter()
        .map(|h| h.what.split(" (").next().unwrap_or(""))
        .collect();
    eprintln!("control: found in this process: {what:?}");
    for want in [
        "RSA prime p",
        "RSA prime q",
        "EC private scalar",
        "Ed25519 seed",
    ] {
        assert!(
            what.contains(want),
            "control: {want} not found in /proc/self/mem: {what:?}"
        );
    }
    if let Some(core) = gcore(std::process::id(), "asym-baseline") {
        let hits = secrets.find(&core);
        assert!(
            hits.iter().any(|h| h.what.starts_with("RSA prime p")),
            "control: the baseline's p not found in this process's core"
        );
    }
    drop(baseline);
}

/// A fixed valid P-256 point (the generator) for derivations in flight.
fn p256_peer() -> Vec<u8> {
    hex::decode(concat!(
        "04",
        "6b17d1f2e12c4247f8bce6e563a440f277037d812deb33a0f4a13945d898c296",
        "4fe342e2fe1a7f9b8ee7eb4a7c0f9e162bce33576b315ececbb6406837bf51f5"
    ))
    .expect("hex")
}
