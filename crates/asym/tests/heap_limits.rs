//! Issue 32: the secret heap under refused and exhausting requests.
//!
//! - Refused keys leave the heap as they found it: bytes in use before and
//!   after hundreds of refused imports (an RSA-3072 key declared RSA-2048,
//!   inconsistent RSA components, EC scalars that are no private key) are
//!   the same. Before the fix each refused RSA import kept its whole key and
//!   each refused EC scalar its EC_KEY.
//! - A full heap is an error, never an abort: with the heap filled by keys,
//!   threads that make their first random bytes (aws-lc's per-thread DRBG
//!   state, which aws-lc aborts without) get errors or answers; once the
//!   keys are gone, keys are made again. Before the fix the first new thread
//!   aborted the process.
//!
//! `CRYPTO_set_mem_functions` is once per process, so each case runs in a
//! child process of this test binary (`MEMVEIL_ASYM_LIMITS_CHILD=...`); an
//! abort shows as the child's signal.

use std::process::Command;
use std::sync::mpsc;

use memveil_asym::components::{encode_into, encoded_len};
use memveil_asym::{heap_stats, use_secret_heap, Algorithm, AsymError, PrivateKey, SignScheme};
use memveil_secmem::{Level, Policy};
use openssl::pkey::Private;
use openssl::rsa::Rsa;

fn enc(fields: &[&[u8]]) -> Vec<u8> {
    let mut v = vec![0u8; encoded_len(fields)];
    let n = encode_into(fields, &mut v).expect("encode");
    v.truncate(n);
    v
}

fn rsa_components(r: &Rsa<Private>, d: &[u8]) -> Vec<u8> {
    let f = |b: Option<&openssl::bn::BigNumRef>| b.map(|b| b.to_vec()).unwrap_or_default();
    let v = [
        r.n().to_vec(),
        r.e().to_vec(),
        d.to_vec(),
        f(r.p()),
        f(r.q()),
        f(r.dmp1()),
        f(r.dmq1()),
        f(r.iqmp()),
    ];
    let refs: Vec<&[u8]> = v.iter().map(Vec::as_slice).collect();
    enc(&refs)
}

fn in_use() -> usize {
    heap_stats().expect("heap").in_use
}

fn refusals() {
    use_secret_heap(512 << 10, Policy::allow(Level::Locked)).expect("heap");
    let r3072 = Rsa::generate(3072).expect("rsa");
    let r2048 = Rsa::generate(2048).expect("rsa");
    let big = rsa_components(&r3072, &r3072.d().to_vec());
    let mut bad_d = r2048.d().to_vec();
    let last = bad_d.len() - 1;
    bad_d[last] ^= 2;
    let inconsistent = rsa_components(&r2048, &bad_d);
    let good = rsa_components(&r2048, &r2048.d().to_vec());
    let cases: Vec<(Algorithm, Vec<u8>, &str)> = vec![
        (Algorithm::Rsa2048, big, "an RSA-3072 key declared rsa2048"),
        (
            Algorithm::Rsa2048,
            inconsistent,
            "inconsistent RSA components",
        ),
        (
            Algorithm::P256,
            enc(&[&[0xff; 32]]),
            "a P-256 scalar above the order",
        ),
        (Algorithm::P256, enc(&[&[0; 32]]), "a zero P-256 scalar"),
        (
            Algorithm::P384,
            enc(&[&[0xff; 48]]),
            "a P-384 scalar above the order",
        ),
    ];
    // Warm up what aws-lc makes once per thread or process (its DRBG
    // state, error queue): one good key and one refusal of each kind.
    drop(PrivateKey::from_components(Algorithm::Rsa2048, &good).expect("good key"));
    for (alg, bytes, _) in &cases {
        assert!(PrivateKey::from_components(*alg, bytes).is_err());
    }
    let before = in_use();
    for (alg, bytes, what) in &cases {
        for _ in 0..200 {
            match PrivateKey::from_components(*alg, bytes) {
                Err(AsymError::BadKey { .. }) => {}
                other => panic!("{what}: {other:?}"),
            }
        }
        println!("after 200 refusals of {what}: {} bytes in use", in_use());
    }
    println!("in use before {before} after {}", in_use());
}

fn full() {
    let st = use_secret_heap(256 << 10, Policy::allow(Level::Locked)).expect("heap");
    println!("heap of {} KiB", st.size / 1024);
    let mut keys = Vec::new();
    let err = loop {
        match PrivateKey::generate(Algorithm::P256) {
            Ok(k) => keys.push(k),
            Err(e) => break e,
        }
        assert!(keys.len() < 100_000, "the heap never filled");
    };
    println!("filled with {} P-256 keys: {err}", keys.len());
    let keys = std::sync::Arc::new(keys);
    // New threads, each making its first random bytes, kept alive so their
    // DRBG states stay: some answer, then they are refused; none aborts.
    let (hold_tx, hold_rx) = mpsc::channel::<()>();
    let hold_rx = std::sync::Arc::new(std::sync::Mutex::new(hold_rx));
    let mut threads = Vec::new();
    let (mut ok, mut refused, mut heap_refused) = (0, 0, 0);
    for _ in 0..300 {
        let (k, hold) = (
            std::sync::Arc::clone(&keys),
            std::sync::Arc::clone(&hold_rx),
        );
        let (tx, rx) = mpsc::channel();
        threads.push(std::thread::spawn(move || {
            let mut sig = [0u8; 64];
            let _ = tx.send(k[0].sign(SignScheme::Ecdsa, &[7u8; 32], &mut sig));
            let _ = hold.lock().map(|h| h.recv());
        }));
        match rx.recv().expect("thread answered") {
            Ok(_) => ok += 1,
            Err(AsymError::Heap(m)) => {
                assert!(m.contains("--asym-heap-kib"), "{m}");
                heap_refused += 1;
            }
            Err(_) => refused += 1,
        }
        if heap_refused > 3 {
            break;
        }
    }
    println!("new threads: {ok} signed, {refused} refused, {heap_refused} refused for the heap");
    drop(hold_tx);
    for t in threads {
        t.join().expect("join");
    }
    assert!(heap_refused > 0, "the reserve never ran out");
    drop(keys);
    let k = std::thread::spawn(|| {
        let k = PrivateKey::generate(Algorithm::Rsa2048)?;
        let mut sig = [0u8; 256];
        k.sign(SignScheme::Pkcs1, b"after", &mut sig)
    })
    .join()
    .expect("join");
    println!("after the keys were freed: {k:?}");
}

fn run(mode: &str) -> String {
    let out = Command::new(std::env::current_exe().expect("exe"))
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env("MEMVEIL_ASYM_LIMITS_CHILD", mode)
        .output()
        .expect("run child");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{mode} child failed ({}): {text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn child() {
    match std::env::var("MEMVEIL_ASYM_LIMITS_CHILD").as_deref() {
        Ok("refusals") => refusals(),
        Ok("full") => full(),
        _ => {}
    }
}

#[test]
fn refused_keys_leave_the_secret_heap_as_they_found_it() {
    let out = run("refusals");
    print!("{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("in use before"))
        .expect("summary line");
    let n: Vec<usize> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(n.len(), 2, "{line}");
    assert_eq!(n[0], n[1], "refused imports kept heap bytes: {line}");
}

#[test]
fn a_full_secret_heap_is_an_error_never_an_abort() {
    let out = run("full");
    print!("{out}");
    assert!(
        out.contains("after the keys were freed: Ok(256)"),
        "no key after the heap was freed: {out}"
    );
}
